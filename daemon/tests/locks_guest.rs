//! Locks that a Linux guest (QEMU, TCG here) and the host mount of one
//! export agree on (issue 36): the guest's kernel sends its fcntl and
//! flock locks over virtio-fs, the host's over /dev/fuse, and keelfsd,
//! holding them for the export, keeps each out of the other's; F_GETLK on
//! either side names the other's lock, and the host's blocking waits are
//! granted when the guest lets go. qemu-scripts/locks.sh drives it;
//! nothing is skipped when QEMU is missing.

mod common;
use common::run_qemu_script;

#[test]
fn a_guest_and_the_host_mount_keep_each_other_out() {
    assert!(
        std::process::Command::new("sh").arg("-c").arg("command -v qemu-system-x86_64").status().unwrap().success(),
        "qemu-system-x86_64 is missing: run scripts/setup.sh"
    );
    let (passed, text, _) = run_qemu_script("locks", "locks.sh", &["--keelfsd", env!("CARGO_BIN_EXE_keelfsd")]);
    assert!(passed, "qemu-scripts/locks.sh failed:\n{text}");
}
