//! Linux permission semantics through a host `--fuse-mount`, exercised by
//! processes running under other uids and groups (setpriv, util-linux):
//! supplementary groups count, a non-owner's write, truncate or a chown
//! clears set-id bits, setgid directories pass on their group, and the
//! sticky bit protects other users' entries. Each expectation is what ext4
//! does for the same commands.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

mod common;
use common::{mkfs, Scratch, Served};

/// A group the users below share only as a supplementary group.
const SHARED_GID: u32 = 2000;
/// In SHARED_GID only as a supplementary group.
const MEMBER: u32 = 3000;
/// In no group but its own.
const OUTSIDER: u32 = 3001;

/// Run `script` under `sh` as `uid` (primary group `uid`) with the
/// supplementary `groups`: whether it succeeded, and its stderr.
fn run_as(uid: u32, groups: &[u32], script: &str) -> (bool, String) {
    let groups = groups.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}")).arg(format!("--regid={uid}"));
    if groups.is_empty() {
        cmd.arg("--clear-groups");
    } else {
        cmd.arg(format!("--groups={groups}"));
    }
    let out = cmd.args(["--", "sh", "-c", script]).output().expect("setpriv (util-linux) runs");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
}

fn member(script: &str) -> (bool, String) {
    run_as(MEMBER, &[SHARED_GID], script)
}

fn outsider(script: &str) -> (bool, String) {
    run_as(OUTSIDER, &[], script)
}

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().mode() & 0o7777
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
}

fn served(scratch: &Scratch) -> (Served, std::path::PathBuf) {
    let (image, mnt) = (scratch.path("img"), scratch.path("mnt"));
    mkfs(&image, "256M");
    let served =
        Served::start(&["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()], &[&mnt]);
    // Others must reach the mount point through the scratch directory.
    set_mode(&scratch.0, 0o755);
    set_mode(&mnt, 0o755);
    (served, mnt)
}

#[test]
fn a_supplementary_group_grants_write_create_and_rename() {
    let scratch = Scratch::new("perm-groups");
    let (served, mnt) = served(&scratch);
    let shared = mnt.join("shared");
    std::fs::create_dir(&shared).unwrap();
    chown(&shared, 0, SHARED_GID);
    set_mode(&shared, 0o775);
    std::fs::write(shared.join("f"), b"root\n").unwrap();
    chown(&shared.join("f"), 0, SHARED_GID);
    set_mode(&shared.join("f"), 0o664);
    let d = shared.display();

    let (ok, err) = member(&format!("echo member >> {d}/f && touch {d}/new && mv {d}/new {d}/renamed"));
    assert!(ok, "a member through a supplementary group was refused: {err}");
    assert_eq!(std::fs::read_to_string(shared.join("f")).unwrap(), "root\nmember\n");
    let made = std::fs::metadata(shared.join("renamed")).unwrap();
    assert_eq!((made.uid(), made.gid()), (MEMBER, MEMBER), "a new file takes the creator's ids");

    let (ok, err) = outsider(&format!("echo outsider >> {d}/f"));
    assert!(!ok && err.contains("Permission denied"), "an outsider wrote a group file: {err}");
    let (ok, err) = outsider(&format!("touch {d}/intruder"));
    assert!(!ok && err.contains("Permission denied"), "an outsider created in a group directory: {err}");
    assert!(served.stop().success());
}

#[test]
fn a_non_owners_write_truncate_or_chown_clears_setid_bits() {
    let scratch = Scratch::new("perm-setid");
    let (served, mnt) = served(&scratch);
    let f = mnt.join("setid");
    std::fs::write(&f, b"data").unwrap();
    chown(&f, 0, SHARED_GID);
    set_mode(&f, 0o6775);
    assert_eq!(mode_of(&f), 0o6775);

    let (ok, err) = member(&format!("echo more >> {}", f.display()));
    assert!(ok, "{err}");
    assert_eq!(mode_of(&f), 0o775, "a write without CAP_FSETID keeps S_ISUID/S_ISGID");

    set_mode(&f, 0o6775);
    let (ok, err) = member(&format!("truncate -s 1 {}", f.display()));
    assert!(ok, "{err}");
    assert_eq!(mode_of(&f), 0o775, "a truncate without CAP_FSETID keeps S_ISUID/S_ISGID");

    // An O_DIRECT write, then stat(1) asking for the mode alone: the
    // kernel must not answer from attributes it cached before the write.
    set_mode(&f, 0o6775);
    let _ = mode_of(&f);
    let (ok, err) =
        member(&format!("dd if=/dev/zero of={} bs=4096 count=1 oflag=direct conv=notrunc status=none", f.display()));
    assert!(ok, "{err}");
    let shown = Command::new("stat").args(["-c", "%a"]).arg(&f).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&shown.stdout).trim(), "775", "stat shows a stale mode after a direct write");

    // S_ISGID without group execute marks mandatory locking: it stays
    // when the writer is in the file's group (here its primary group;
    // FUSE does not tell the daemon a writer's supplementary groups).
    chown(&f, 0, MEMBER);
    set_mode(&f, 0o6764);
    let (ok, err) = member(&format!("echo again >> {}", f.display()));
    assert!(ok, "{err}");
    assert_eq!(mode_of(&f), 0o2764);
    // A writer outside the group clears it too.
    chown(&f, 0, SHARED_GID);
    set_mode(&f, 0o6766);
    let (ok, err) = outsider(&format!("echo outside >> {}", f.display()));
    assert!(ok, "{err}");
    assert_eq!(mode_of(&f), 0o766);

    // chown clears the set-id bits, even done by root.
    set_mode(&f, 0o6775);
    chown(&f, MEMBER, SHARED_GID);
    assert_eq!(mode_of(&f), 0o775, "chown keeps S_ISUID/S_ISGID");

    // root writes with CAP_FSETID: the bits stay.
    set_mode(&f, 0o6775);
    std::fs::OpenOptions::new().append(true).open(&f).unwrap();
    std::fs::write(&f, b"root").unwrap();
    assert_eq!(mode_of(&f), 0o6775, "root's write cleared set-id bits");
    assert!(served.stop().success());
}

#[test]
fn setgid_directories_pass_on_their_group_and_sticky_ones_protect_entries() {
    let scratch = Scratch::new("perm-dirs");
    let (served, mnt) = served(&scratch);
    let sgid = mnt.join("sgid");
    std::fs::create_dir(&sgid).unwrap();
    chown(&sgid, 0, SHARED_GID);
    set_mode(&sgid, 0o2777);
    let d = sgid.display();
    let (ok, err) = outsider(&format!("touch {d}/file && mkdir {d}/sub"));
    assert!(ok, "{err}");
    let file = std::fs::metadata(sgid.join("file")).unwrap();
    let sub = std::fs::metadata(sgid.join("sub")).unwrap();
    assert_eq!((file.uid(), file.gid()), (OUTSIDER, SHARED_GID), "a file in a setgid directory takes its group");
    assert_eq!(sub.gid(), SHARED_GID);
    assert_eq!(sub.mode() & 0o2000, 0o2000, "a directory in a setgid directory is setgid");

    let sticky = mnt.join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    set_mode(&sticky, 0o1777);
    let s = sticky.display();
    let (ok, err) = member(&format!("echo mine > {s}/owned"));
    assert!(ok, "{err}");
    let (ok, err) = outsider(&format!("rm -f {s}/owned"));
    assert!(!ok && err.contains("Operation not permitted"), "sticky: another user removed the entry: {err}");
    let (ok, err) = outsider(&format!("mv {s}/owned {s}/taken"));
    assert!(!ok && err.contains("Operation not permitted"), "sticky: another user renamed the entry: {err}");
    let (ok, err) = member(&format!("mv {s}/owned {s}/kept && rm {s}/kept"));
    assert!(ok, "sticky: the owner could not rename and remove: {err}");
    assert!(served.stop().success());
}
