//! Data checksums under a running Linux guest (QEMU, TCG here; issue 38):
//! a byte flipped in the image behind keelfs's back makes the guest's
//! direct read of that block fail with EIO while the rest of its file
//! reads as written, and a scrub then names that block. Driven by
//! qemu-scripts/checksums.sh; nothing is skipped when QEMU is missing.

mod common;
use common::run_qemu_script;

#[test]
fn a_block_damaged_on_the_host_reads_as_eio_in_the_guest_and_scrub_finds_it() {
    assert!(
        std::process::Command::new("sh").arg("-c").arg("command -v qemu-system-x86_64").status().unwrap().success(),
        "qemu-system-x86_64 is missing: run scripts/setup.sh"
    );
    let (passed, text, _) = run_qemu_script("checksums", "checksums.sh", &["--keelfsd", env!("CARGO_BIN_EXE_keelfsd")]);
    assert!(passed, "qemu-scripts/checksums.sh failed:\n{text}");
}
