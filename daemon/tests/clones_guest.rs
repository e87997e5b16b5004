//! Clones and snapshots under a running Linux guest (QEMU, TCG here;
//! issue 37): the guest's GNU cp of a 128 MiB file takes no new blocks, fio
//! verifies both copies after writes to each, and a snapshot the host
//! takes while the guest works, served read-only beside the live export,
//! keeps the guest's files as they were (their md5 list). Driven by
//! qemu-scripts/clones.sh; nothing is skipped when QEMU is missing.

mod common;
use common::run_qemu_script;

#[test]
fn a_guest_clones_with_cp_and_a_snapshot_keeps_its_files() {
    assert!(
        std::process::Command::new("sh").arg("-c").arg("command -v qemu-system-x86_64").status().unwrap().success(),
        "qemu-system-x86_64 is missing: run scripts/setup.sh"
    );
    let (passed, text, _) = run_qemu_script("clones", "clones.sh", &["--keelfsd", env!("CARGO_BIN_EXE_keelfsd")]);
    assert!(passed, "qemu-scripts/clones.sh failed:\n{text}");
}
