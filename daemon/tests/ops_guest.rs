//! Operations under a running Linux guest (QEMU, TCG here): while the
//! guest's fio verifies its writes, the host adds and removes another
//! export of the same sandboxed keelfsd over JSON-RPC (the supervisor opens
//! it); the guest's fstrim gives a deleted file's space back to the image
//! file; the guest's df shows its export's quota, and writes past it fail
//! with EDQUOT. qemu-scripts/ops.sh drives it; nothing is skipped when QEMU
//! is missing.

mod common;
use common::run_qemu_script;

#[test]
fn a_guest_keeps_running_while_exports_change_and_space_is_given_back() {
    assert!(
        std::process::Command::new("sh").arg("-c").arg("command -v qemu-system-x86_64").status().unwrap().success(),
        "qemu-system-x86_64 is missing: run scripts/setup.sh"
    );
    let (passed, text, _) = run_qemu_script("ops", "ops.sh", &["--keelfsd", env!("CARGO_BIN_EXE_keelfsd")]);
    assert!(passed, "qemu-scripts/ops.sh failed:\n{text}");
}
