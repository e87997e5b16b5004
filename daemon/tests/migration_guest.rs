//! Live migration and upgrade under a running Linux guest (TCG): two
//! QEMUs and two keelfsd on one image, driven by qemu-scripts/migrate.sh.
//! The guest holds a file open (and one unlinked while open), lists a
//! directory through an open descriptor in a loop, and runs fio with
//! crc32c verification; it is migrated to the second QEMU and keelfsd
//! (`--incoming`), and afterwards every check in
//! qemu-scripts/guest-tests/migrate.sh must pass, both daemons must stop
//! cleanly and fsck must find the image clean:
//! - with the migration in a quiet spell;
//! - with it started while fio's I/O is in flight;
//! - as an upgrade (qemu-scripts/upgrade.sh): the destination runs a
//!   different keelfsd binary (a copy here, standing in for a new build);
//! - between two "hosts" on a Ceph RBD image: each keelfsd in a network
//!   namespace of its own on the dev cluster's bridge (scripts/ceph-dev.sh),
//!   and afterwards the image's lock held by the destination's client
//!   alone.
//!
//! scripts/setup.sh installs QEMU 10, the guest kernel, fio, python3 (the
//! QMP client), a C compiler (the guest's directory lister) and Ceph.
//! Nothing is skipped when they are missing: the scripts fail and say what
//! is.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

mod common;
use common::run_qemu_script;

/// Two guests under TCG take both cores: one run at a time.
static ONE_RUN_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Run `script` (under qemu-scripts) with `args`; fails with its output
/// unless it exits 0 having printed its summary. Returns the summary.
fn run(name: &str, script: &str, args: &[&str]) -> Vec<String> {
    let _turn = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (passed, text, summary) = run_qemu_script(&format!("migrate-{name}"), script, args);
    assert!(passed, "{name} failed:\n{text}");
    assert!(!summary.iter().any(|l| l.contains("FAIL:")), "{name} printed a failure:\n{text}");
    for check in ["fd 6 reads the file unlinked before the migration", "fsck", "read-verify of every block"] {
        assert!(
            summary.iter().any(|l| l.contains("PASS") && l.contains(check)),
            "{name}: no PASS for {check}:\n{text}"
        );
    }
    summary
}

const KEELFSD: &str = env!("CARGO_BIN_EXE_keelfsd");

#[test]
fn a_guest_migrates_to_a_second_keelfsd_in_a_quiet_spell() {
    run("quiet", "migrate.sh", &["--keelfsd", KEELFSD]);
}

#[test]
fn a_guest_migrates_with_its_io_in_flight() {
    run("during-io", "migrate.sh", &["--keelfsd", KEELFSD, "--during-io"]);
}

#[test]
fn keelfsd_is_upgraded_under_a_running_guest() {
    // Another binary file: the destination really runs a different one.
    let new = std::env::temp_dir().join(format!("keelfsd-new-{}", std::process::id()));
    std::fs::copy(KEELFSD, &new).unwrap();
    let new_path = new.to_str().unwrap().to_owned();
    run("upgrade", "upgrade.sh", &["--keelfsd", KEELFSD, "--keelfsd-new", &new_path, "--during-io"]);
    let _ = std::fs::remove_file(&new);
}

/// A network namespace on the dev cluster's bridge (`ceph-dev.sh host
/// add`): another "host" for a keelfsd. Removed when dropped, also when
/// the test fails.
struct Host {
    name: String,
}

impl Host {
    fn add(name: String, addr: &str) -> Self {
        let out = Command::new(ceph_dev()).args(["host", "add", &name, addr]).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "ceph-dev.sh host add {name} {addr}: {said}");
        Host { name }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = Command::new(ceph_dev()).args(["host", "del", &self.name]).output();
    }
}

fn ceph_dev() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ceph-dev.sh")
}

/// The guest moves, during fio's I/O, between two keelfsd on one RBD
/// image, each in its own network namespace (two hosts reaching the
/// cluster from their own addresses; QEMU reaches both through their
/// unix sockets). The lock must end with the destination's client alone.
#[test]
fn a_guest_migrates_between_two_hosts_on_rbd() {
    keelfs_bdev::dev_cluster_up();
    let pid = std::process::id();
    let (src_addr, dst_addr) = ("10.87.0.41", "10.87.0.42");
    let src = Host::add(format!("kmsrc{pid}"), src_addr);
    let dst = Host::add(format!("kmdst{pid}"), dst_addr);
    let args = [
        "--keelfsd",
        KEELFSD,
        "--rbd-pool",
        "keelfs",
        "--src-netns",
        &src.name,
        "--dst-netns",
        &dst.name,
        "--during-io",
    ];
    let summary = run("rbd-hosts", "migrate.sh", &args);
    for (when, addr) in [("before", src_addr), ("after", dst_addr)] {
        let held = format!("PASS: RBD lock {when} the migration: one holder, client.");
        assert!(
            summary.iter().any(|l| l.starts_with(&held) && l.contains(&format!(" at {addr}:"))),
            "the lock {when} the migration is not held by {addr} alone:\n{}",
            summary.join("\n")
        );
    }
    // Both daemons serve the RBD image in their sandboxes (issue 36).
    for side in ["source", "destination"] {
        let sandboxed = format!("PASS: {side} keelfsd: sandboxed (sandboxed: namespaces");
        assert!(summary.iter().any(|l| l.starts_with(&sandboxed)), "{side}:\n{}", summary.join("\n"));
    }
}
