//! POSIX ACLs behave on keelfs as on ext4: one sequence of setfacl,
//! getfacl, chmod, create and access commands (tests/data/acl-sequence.sh)
//! runs on a host `--fuse-mount` of keelfs and on a loop-mounted ext4, and
//! the two transcripts must be identical.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{keelfsd, mkfs, Scratch, Served};

fn run_sequence(dir: &Path) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/acl-sequence.sh");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new("sh").arg(script).current_dir(dir).output().expect("sh runs");
    String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
}

/// An ext4 image mounted on a loop device, unmounted on drop.
struct Ext4(std::path::PathBuf);

impl Ext4 {
    fn mount(image: &Path, dir: &Path) -> Self {
        let f = std::fs::File::create(image).unwrap();
        f.set_len(64 << 20).unwrap();
        let ok = |c: &mut Command| c.status().is_ok_and(|s| s.success());
        assert!(ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(image)), "mkfs.ext4 (e2fsprogs) failed");
        std::fs::create_dir_all(dir).unwrap();
        assert!(ok(Command::new("mount").args(["-o", "loop"]).arg(image).arg(dir)), "loop-mounting ext4 failed");
        Ext4(dir.to_owned())
    }
}

impl Drop for Ext4 {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn acl_commands_give_the_same_transcript_as_on_ext4() {
    let scratch = Scratch::new("acl");
    let (image, mnt) = (scratch.path("img"), scratch.path("mnt"));
    mkfs(&image, "256M");
    let served =
        Served::start(&["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()], &[&mnt]);
    std::fs::set_permissions(&scratch.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let ext4 = Ext4::mount(&scratch.path("ext4.img"), &scratch.path("ext4"));

    let on_ext4 = run_sequence(&ext4.0);
    let on_keelfs = run_sequence(&mnt);
    // The transcript must show the sequence doing what it is for: ACLs
    // inherited and masked, and an access refused and one granted by them.
    for expected in ["default:user:3000:rwx", "user:3000:rwx\t#effective:rw-", "write=0", "write=2", "cat=1"] {
        assert!(on_ext4.contains(expected), "the ext4 transcript lacks {expected:?}:\n{on_ext4}");
    }
    let diff: Vec<_> = on_ext4.lines().zip(on_keelfs.lines()).filter(|(a, b)| a != b).take(10).collect();
    assert!(
        on_ext4 == on_keelfs,
        "keelfs's ACL transcript differs from ext4's; first differing lines (ext4, keelfs): {diff:#?}\n\
         --- keelfs:\n{on_keelfs}"
    );
    drop(ext4);
    assert!(served.stop().success());
}

/// `--no-xattr`: a host mount's xattr calls fail with EOPNOTSUPP (the
/// kernel's answer once the daemon says ENOSYS), while the same calls work
/// on a mount of the same image served with xattrs.
#[test]
fn no_xattr_turns_extended_attributes_off_for_the_mount() {
    let scratch = Scratch::new("noxattr");
    let (image, mnt) = (scratch.path("img"), scratch.path("mnt"));
    mkfs(&image, "64M");
    for xattr in [true, false] {
        let mut args = vec!["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()];
        if !xattr {
            args.push("--no-xattr".as_ref());
        }
        let served = Served::start(&args, &[&mnt]);
        let file = mnt.join(format!("f-{xattr}"));
        std::fs::write(&file, b"x").unwrap();
        let path = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: path is NUL-terminated, and name and value outlive the call.
        let set = unsafe { libc::setxattr(path.as_ptr(), c"user.k".as_ptr(), b"v".as_ptr().cast(), 1, 0) };
        let errno = std::io::Error::last_os_error().raw_os_error();
        if xattr {
            assert_eq!(set, 0, "setxattr with xattrs on: {errno:?}");
        } else {
            assert_eq!((set, errno), (-1, Some(libc::EOPNOTSUPP)), "setxattr with --no-xattr");
        }
        drop(served);
    }
}

/// A host mount of a fresh image in `scratch`, recording its exchanges
/// (`--trace-requests`), with `extra` arguments: the daemon, the mount
/// point and the trace file.
fn traced_host_mount(scratch: &Scratch, extra: &[&str]) -> (Served, PathBuf, PathBuf) {
    let (image, mnt, trace) = (scratch.path("img"), scratch.path("mnt"), scratch.path("t.trace"));
    mkfs(&image, "64M");
    let mut args: Vec<&OsStr> = vec!["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()];
    args.extend(["--trace-requests".as_ref(), trace.as_os_str()]);
    args.extend(extra.iter().map(OsStr::new));
    let served = Served::start(&args, &[&mnt]);
    (served, mnt, trace)
}

fn opcode_of(e: &keelfs_vhost::Exchange) -> u32 {
    u32::from_le_bytes(e.request[4..8].try_into().unwrap())
}

/// `--trace-requests` records the host mount's exchanges from INIT on,
/// file data left out: what `keelfs-bench vhost --workload trace`
/// replays.
#[test]
fn trace_requests_records_the_host_mounts_exchanges() {
    use keelfs_vhost::abi::Opcode;
    let scratch = Scratch::new("trace");
    let (served, mnt, trace) = traced_host_mount(&scratch, &[]);
    let image = scratch.path("img");
    std::fs::create_dir(mnt.join("d")).unwrap();
    std::fs::write(mnt.join("d/f"), vec![7u8; 10_000]).unwrap();
    std::fs::remove_file(mnt.join("d/f")).unwrap();
    drop(served);
    let exchanges = keelfs_vhost::parse_trace(&std::fs::read(&trace).unwrap()).unwrap();
    let seen = |op: Opcode| exchanges.iter().filter(|e| opcode_of(e) == op as u32).count();
    assert_eq!(opcode_of(&exchanges[0]), Opcode::Init as u32, "the trace starts at INIT");
    for op in [Opcode::Mkdir, Opcode::Create, Opcode::Write, Opcode::Unlink] {
        assert!(seen(op) >= 1, "{op:?} recorded");
    }
    let writes = exchanges.iter().filter(|e| opcode_of(e) == Opcode::Write as u32);
    assert!(writes.clone().all(|e| e.request.len() == keelfs_vhost::WRITE_HEADERS), "no file data kept");
    let written: u64 = writes.map(|e| u64::from(u32::from_le_bytes(e.request[56..60].try_into().unwrap()))).sum();
    assert_eq!(written, 10_000, "the WRITEs' sizes add up to what was written");

    let refused = keelfsd().args(["serve", "--device"]).arg(&image).arg("--trace-requests").arg(&trace).output();
    let stderr = String::from_utf8_lossy(&refused.unwrap().stderr).into_owned();
    assert!(stderr.contains("needs --fuse-mount"), "{stderr}");
}

/// Opens answer FOPEN_NOFLUSH (FLUSH does nothing in keelfs), so a client
/// without the writeback cache, as a guest is by default, sends no FLUSH
/// at close(2): one round trip fewer per close. With the writeback cache
/// (a sole host mount's default) Linux flushes at close all the same.
/// RELEASE is not counted: it is sent in the background after close(2).
#[test]
fn a_close_sends_no_flush_without_the_writeback_cache() {
    use keelfs_vhost::abi::Opcode;
    for (cache, flushes) in [("none", false), ("auto", true)] {
        let scratch = Scratch::new(&format!("noflush-{cache}"));
        let (served, mnt, trace) = traced_host_mount(&scratch, &["--cache", cache]);
        std::fs::write(mnt.join("f"), b"small file").unwrap();
        for _ in 0..3 {
            assert_eq!(std::fs::read(mnt.join("f")).unwrap(), b"small file");
        }
        drop(served);
        let exchanges = keelfs_vhost::parse_trace(&std::fs::read(&trace).unwrap()).unwrap();
        let seen = |op: Opcode| exchanges.iter().filter(|e| opcode_of(e) == op as u32).count();
        // OPEN is answered before open(2) returns, and a FLUSH is sent
        // inside close(2), so both are traced by now. RELEASE is not:
        // Linux sends it in the background, and it may still be in
        // flight when the daemon is killed.
        assert!(seen(Opcode::Open) >= 3, "cache {cache}: an OPEN per read");
        if flushes {
            assert!(seen(Opcode::Flush) >= 1, "cache {cache}: the writeback cache flushes at close");
        } else {
            assert_eq!(seen(Opcode::Flush), 0, "cache {cache}: no FLUSH without the writeback cache");
        }
    }
}
