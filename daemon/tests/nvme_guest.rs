//! keelfs's userspace NVMe driver in a real guest: a Linux 6.12 guest under
//! QEMU (TCG here, one vCPU: run-nvme.sh --help says why) with an emulated
//! NVMe controller behind a vIOMMU binds it to vfio-pci
//! (scripts/nvme-setup.sh) and runs qemu-scripts/guest-tests/nvme.sh through
//! qemu-scripts/run-nvme.sh:
//! keelfs-bench bdev-check, keelfsd mkfs/fsck, keelfsd serve over /dev/fuse
//! with fsx and a restart, and the bdev benches on nvme: and, after handing
//! the controller back to the kernel, on /dev/nvme0n1 with io_uring.
//!
//! scripts/setup.sh installs QEMU 10, the 6.12 kernel, busybox-static and
//! fsx. As in guest.rs nothing is skipped when they are missing: the test
//! fails and says what to install. keelfs-bench lives in another package:
//! `cargo test --workspace` builds it next to keelfsd (target/<profile>/);
//! KEELFS_BENCH=PATH overrides that.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// What guest-tests/nvme.sh prints as "PASS: NAME: ..." when all is well.
const CHECKS: &[&str] = &[
    "bind",
    "bdev-check",
    "mkfs",
    "fsck-new",
    "serve",
    "fsx-buffered",
    "fsx-odirect",
    "pattern-write",
    "serve-stop",
    "fsck-served",
    "serve-again",
    "pattern-survived",
    "serve-stop-again",
    "vhost-dma",
    "vhost-dma-zero-copy",
    "fsck-final",
    "error-no-namespace",
    "bench-nvme-randread",
    "bench-nvme-randwrite",
    "unbind",
    "error-not-bound",
    "bench-uring-randread",
    "bench-uring-randwrite",
];

fn keelfs_bench(keelfsd: &Path) -> PathBuf {
    match std::env::var_os("KEELFS_BENCH") {
        Some(p) => PathBuf::from(p),
        None => keelfsd.with_file_name("keelfs-bench"),
    }
}

#[test]
fn keelfs_drives_an_nvme_controller_through_vfio_in_a_linux_guest() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let script = repo.join("qemu-scripts/run-nvme.sh");
    assert!(
        Command::new("sh").arg("-c").arg("command -v qemu-system-x86_64").status().unwrap().success(),
        "qemu-system-x86_64 is missing: run scripts/setup.sh"
    );
    let keelfsd = Path::new(env!("CARGO_BIN_EXE_keelfsd"));
    let bench = keelfs_bench(keelfsd);
    // An old keelfs-bench (built before bdev-check) would fail in the guest
    // with a less helpful message.
    let fresh = Command::new(&bench).args(["bdev-check", "--help"]).output().is_ok_and(|o| o.status.success());
    assert!(
        fresh,
        "{} is missing or has no bdev-check: `cargo test --workspace` builds it; alone, run \
         `cargo build -p keelfs-bench` (same profile) first, or set KEELFS_BENCH=PATH",
        bench.display()
    );
    let bench_out = std::env::temp_dir().join(format!("keelfs-nvme-bench-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&bench_out);
    let started = Instant::now();
    let out = Command::new("bash")
        .arg(&script)
        .arg("--keelfsd")
        .arg(keelfsd)
        .arg("--bench")
        .arg(&bench)
        .arg("--bench-out")
        .arg(&bench_out)
        .arg("--quiet")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let bench_lines = std::fs::read_to_string(&bench_out).unwrap_or_default();
    let _ = std::fs::remove_file(&bench_out);
    let checks: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("PASS: ") || l.starts_with("FAIL: ") || l.starts_with("SKIP: "))
        .collect();
    eprintln!(
        "{}\n{}\nNVMe guest test wall time: {:.0} s",
        checks.join("\n"),
        bench_lines.trim_end(),
        started.elapsed().as_secs_f64()
    );
    assert!(out.status.success(), "the NVMe guest test failed ({}):\n{text}", out.status);
    let failed: Vec<&&str> = checks.iter().filter(|l| l.starts_with("FAIL: ")).collect();
    assert!(failed.is_empty(), "failed checks: {failed:?}\n{text}");
    let missing: Vec<&str> = CHECKS
        .iter()
        .copied()
        .filter(|name| !checks.iter().any(|l| l.starts_with(&format!("PASS: {name}:"))))
        .collect();
    assert!(missing.is_empty(), "checks that did not pass: {missing:?}\n{text}");
    let results: Vec<serde_json::Value> = bench_lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bench line {l:?} is not JSON: {e}")))
        .collect();
    assert!(results.len() >= 4, "want a JSON result from each of the 4 benches, got {}:\n{bench_lines}", results.len());
    assert!(results.iter().all(|r| r.is_object()), "bench results must be JSON objects:\n{bench_lines}");
}
