//! `mount -t fuse.keelfs IMAGE DIR`, an fstab line, and `umount`: mount(8)
//! runs /sbin/mount.fuse.keelfs, which this test links to the keelfsd under
//! test (mount(8) looks for helpers in /sbin only). The server must exit
//! by itself once the mount is unmounted, leaving a clean image.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;
use common::{fsck, is_mounted, mkfs, Scratch};

/// Once per run: the tests run in parallel, and each needs the link.
fn install_helper() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let helper = Path::new("/sbin/mount.fuse.keelfs");
        let _ = std::fs::remove_file(helper);
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_keelfsd"), helper).expect("linking /sbin/mount.fuse.keelfs");
    });
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr))
}

/// Whether a `keelfsd serve` still holds `image` open.
fn served(image: &Path) -> bool {
    let image = std::fs::canonicalize(image).unwrap();
    std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
        std::fs::read_dir(p.path().join("fd"))
            .map(|fds| fds.flatten().any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == image)))
            .unwrap_or(false)
    })
}

/// Unmount `dir` and wait for its server to let go of `image`.
fn umount_and_wait(what: &Path, image: &Path) {
    let (ok, out) = run(Command::new("umount").arg(what));
    assert!(ok, "umount {}: {out}", what.display());
    let deadline = Instant::now() + Duration::from_secs(30);
    while served(image) {
        assert!(Instant::now() < deadline, "keelfsd still serves {} 30 s after umount", image.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn mount_fstab_and_umount_drive_the_daemon() {
    install_helper();
    let scratch = Scratch::new("mount-helper");
    let (image, mnt) = (scratch.path("img"), scratch.path("mnt"));
    mkfs(&image, "256M");
    std::fs::create_dir(&mnt).unwrap();

    let (ok, out) =
        run(Command::new("mount").args(["-t", "fuse.keelfs"]).arg(&image).arg(&mnt).args(["-o", "cache=none"]));
    assert!(ok, "mount -t fuse.keelfs: {out}");
    assert!(is_mounted(&mnt));
    let (_, listed) = run(Command::new("findmnt").args(["-rn", "-o", "SOURCE,FSTYPE"]).arg(&mnt));
    assert_eq!(listed.trim(), format!("{} fuse.keelfs", image.display()), "the mount's source is the image");
    let (_, options) = run(Command::new("findmnt").args(["-rn", "-o", "OPTIONS"]).arg(&mnt));
    assert!(!options.contains("nosuid") && !options.contains("nodev"), "mount(8)'s defaults are dev,suid: {options}");
    std::fs::write(mnt.join("kept"), b"through the helper").unwrap();
    // Unmounting by the image's name, as xfstests does.
    umount_and_wait(&image, &image);
    assert!(!is_mounted(&mnt));
    assert_eq!(fsck(&image).0, 0, "the image is clean after umount");

    // Unmounted and at once mounted again (as xfstests' cycle_mount does):
    // the first server, still shutting down, must leave the new mount be.
    for round in 0..3 {
        let (ok, out) = run(Command::new("mount").args(["-t", "fuse.keelfs"]).arg(&image).arg(&mnt));
        assert!(ok, "mount, round {round}: {out}");
        let (ok, out) = run(Command::new("umount").arg(&mnt));
        assert!(ok, "umount, round {round}: {out}");
        let (ok, out) = run(Command::new("mount").args(["-t", "fuse.keelfs"]).arg(&image).arg(&mnt));
        assert!(ok, "mount right after umount, round {round}: {out}");
        std::thread::sleep(Duration::from_millis(1500));
        assert!(is_mounted(&mnt), "round {round}: the earlier server's supervisor took the new mount down");
        assert_eq!(std::fs::read(mnt.join("kept")).unwrap(), b"through the helper");
        umount_and_wait(&mnt, &image);
    }

    // An fstab line, read-only, with a plain "fuse" type (subtype=).
    let fstab = scratch.path("fstab");
    let line = format!(
        "{} {} fuse.keelfs ro,nosuid,noatime,subtype=,nofail,x-test.option 0 0\n",
        image.display(),
        mnt.display()
    );
    std::fs::write(&fstab, line).unwrap();
    let (ok, out) = run(Command::new("mount").arg("-T").arg(&fstab).arg(&mnt));
    assert!(ok, "mount from an fstab line: {out}");
    let (_, listed) = run(Command::new("findmnt").args(["-rn", "-o", "FSTYPE,OPTIONS"]).arg(&mnt));
    assert!(listed.starts_with("fuse ro,nosuid,"), "type and options: {listed}");
    assert!(listed.contains("noatime"), "type and options: {listed}");
    assert_eq!(std::fs::read(mnt.join("kept")).unwrap(), b"through the helper");
    let err = std::fs::write(mnt.join("new"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    umount_and_wait(&mnt, &image);

    // A file that is not keelfs: the helper fails and says why, and
    // leaves nothing mounted.
    let junk = scratch.path("junk");
    std::fs::write(&junk, vec![0u8; 1 << 20]).unwrap();
    let (ok, out) = run(Command::new("mount").args(["-t", "fuse.keelfs"]).arg(&junk).arg(&mnt));
    assert!(!ok && out.contains("keelfsd serve exited"), "mounting a non-keelfs file: {out}");
    assert!(!is_mounted(&mnt));
    let (ok, out) = run(Command::new("mount").args(["-t", "fuse.keelfs", "-o", "bogus"]).arg(&image).arg(&mnt));
    assert!(!ok && out.contains("unknown mount option"), "{out}");
    assert!(std::fs::metadata(&junk).is_ok_and(|m| m.len() == 1 << 20));
}

/// `mount -o snapshot=NAME` serves a snapshot of the image read-only, for
/// a backup: the files as they were when it was taken, whatever the live
/// ones became (issue 37).
#[test]
fn a_snapshot_mounts_read_only_for_a_backup() {
    install_helper();
    let scratch = Scratch::new("mount-snapshot");
    let (image, mnt, rpc) = (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    mkfs(&image, "256M");
    std::fs::create_dir(&mnt).unwrap();
    let rpc_option = format!("cache=none,rpc={}", rpc.display());
    let (ok, out) =
        run(Command::new("mount").args(["-t", "fuse.keelfs"]).arg(&image).arg(&mnt).args(["-o", &rpc_option]));
    assert!(ok, "mount: {out}");
    std::fs::write(mnt.join("f"), b"as it was").unwrap();
    let keelfsd = env!("CARGO_BIN_EXE_keelfsd");
    let params = r#"{"export": "keelfs", "name": "before"}"#;
    let (ok, out) = run(Command::new(keelfsd).args(["rpc", "snapshot_create", params, "--rpc"]).arg(&rpc));
    assert!(ok, "snapshot_create: {out}");
    std::fs::write(mnt.join("f"), b"as it is now").unwrap();
    umount_and_wait(&mnt, &image);

    let (ok, out) =
        run(Command::new("mount").args(["-t", "fuse.keelfs"]).arg(&image).arg(&mnt).args(["-o", "snapshot=before"]));
    assert!(ok, "mount -o snapshot=before: {out}");
    assert_eq!(std::fs::read(mnt.join("f")).unwrap(), b"as it was");
    let (_, options) = run(Command::new("findmnt").args(["-rn", "-o", "OPTIONS"]).arg(&mnt));
    assert!(options.split(',').any(|o| o == "ro"), "a snapshot mounts read-only: {options}");
    assert_eq!(std::fs::write(mnt.join("x"), b"no").unwrap_err().raw_os_error(), Some(libc::EROFS));
    umount_and_wait(&mnt, &image);
    let (ok, out) =
        run(Command::new("mount").args(["-t", "fuse.keelfs"]).arg(&image).arg(&mnt).args(["-o", "snapshot=nope"]));
    assert!(!ok && out.contains("nope"), "a missing snapshot: {out}");
    assert!(!is_mounted(&mnt));
    assert_eq!(fsck(&image).0, 0);
}
