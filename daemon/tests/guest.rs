//! End to end with a real guest: a Linux 6.12 guest under QEMU (TCG here)
//! mounts keelfs over vhost-user-fs and runs the guest suites of
//! qemu-scripts/run-e2e.sh: namespace operations, fio with verification on
//! the three seed data paths, fsx (buffered, O_DIRECT, mmap), a
//! multi-process stress, overlayfs with keelfs as its upper layer and
//! ACLs set in the guest, persistence across umount/mount and across a
//! daemon restart with fsck clean: with 2 request queues spread over 2
//! reactors (`--spread-queues`: the second queue's cached reads served on
//! the other reactor, the rest sent to the export's); once more with 1
//! queue in the `always` cache mode, where the guest kernel caches writes
//! (writeback); and once more with 1 queue on Ceph RBD images (the dev
//! cluster of scripts/ceph-dev.sh), where the crash test must fence the
//! killed daemon (`keelfsd break-lock --fence-live`) before serving it
//! again.
//!
//! Each guest suite takes 7-10 minutes under TCG, most of it in the
//! guest's own processes (fsx, and stress's busybox forks). So the three
//! runs cover the settings in pairs rather than every combination: file
//! image with the default cache (2 queues), 1 queue with guest writeback
//! (file), and 1 queue with the default cache (RBD). The second and third
//! runs check that their setting keeps every property, with a third of
//! the stress iterations and fsx operations of the first; the first runs
//! them in full. (1 queue, file image, default cache is also what
//! ops_guest.rs and migration_guest.rs serve.)
//!
//! scripts/setup.sh installs QEMU 10, the 6.12 kernel, busybox-static, fio,
//! fsx and Ceph. Nothing here is skipped when they are missing: the test
//! fails and says what to install.

use std::process::Command;
use std::sync::Mutex;

mod common;
use common::run_qemu_script;

/// Guests under TCG take both cores: the suites run one at a time.
static ONE_GUEST_SUITE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// run-e2e.sh with `args`; fails with its log when any check failed.
/// Returns the summary's lines.
fn run_suite(name: &str, args: &[&str]) -> Vec<String> {
    let _turn = ONE_GUEST_SUITE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    assert!(
        Command::new("sh").arg("-c").arg("command -v qemu-system-x86_64").status().unwrap().success(),
        "qemu-system-x86_64 is missing: run scripts/setup.sh"
    );
    let mut all = vec!["--keelfsd", env!("CARGO_BIN_EXE_keelfsd")];
    all.extend_from_slice(args);
    let (passed, text, summary) = run_qemu_script(&format!("e2e-{name}"), "run-e2e.sh", &all);
    assert!(passed, "the {name} guest suite failed:\n{text}");
    summary
}

#[test]
fn a_linux_guest_passes_the_end_to_end_suite() {
    run_suite("auto", &["--spread", "--queues-list", "2"]);
}

/// What the second and third runs pass: a third of the first's stress
/// iterations and fsx operations (qemu-scripts/guest-tests/stress.sh and
/// fsx.sh).
const LIGHTER: [&str; 4] = ["--stress-iters", "40", "--fsx-ops", "3000"];

/// The whole suite again with writeback caching in the guest kernel
/// (`--cache always`): fsx, the crash test and persistence included.
#[test]
fn a_linux_guest_passes_the_suite_with_writeback_caching() {
    run_suite("writeback", &[&["--cache", "always", "--queues-list", "1"][..], &LIGHTER].concat());
}

/// The whole default suite with every image on RBD (`rbd:keelfs/e2e-...`,
/// made by `keelfsd mkfs`, served with `--sandbox none`). After the crash
/// test's SIGKILL the dead daemon's lock outlives it: run-e2e.sh fences it
/// with `keelfsd break-lock --fence-live`, its own row, before the restart.
#[test]
fn a_linux_guest_passes_the_suite_on_rbd() {
    keelfs_bdev::dev_cluster_up();
    let summary = run_suite("rbd", &[&["--rbd-pool", "keelfs", "--queues-list", "1"][..], &LIGHTER].concat());
    let fenced = summary.iter().any(|l| l.starts_with("crash: break-lock") && l.contains(" PASS "));
    assert!(fenced, "no PASS row for crash: break-lock:\n{}", summary.join("\n"));
}
