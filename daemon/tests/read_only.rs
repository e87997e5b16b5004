//! `serve --read-only` (issue 17): the device is opened read-only, every
//! modifying request from a guest gets EROFS, the host mount is read-only,
//! a journal left by a crash is replayed in memory only, and the image's
//! bytes are the same afterwards.

use std::path::Path;
use std::time::{Duration, Instant};

use keelfs_vhost::abi::{init_flags as f, Opcode, Reply};
use keelfs_vhost::frontend::{FrontendConfig, FsFrontend};

mod common;
use common::{is_mounted, keelfsd, mkfs, Scratch, Served};

fn named(prefix: &[u8], name: &str) -> Vec<u8> {
    [prefix, name.as_bytes(), b"\0"].concat()
}

fn wait_for_socket(socket: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every modifying request a guest could send, each refused with EROFS.
fn guest_changes_are_refused(socket: &Path) {
    let mut fe = FsFrontend::connect(socket, FrontendConfig::default()).unwrap();
    fe.init(f::INIT_EXT).unwrap();
    let (err, entry) = fe.fuse(1, Opcode::Lookup, 1, &named(b"", "kept")).unwrap();
    assert_eq!(err, 0, "the file written before is there");
    let ino = u64::from_le_bytes(entry[..8].try_into().unwrap());
    let (err, open) = fe.fuse(1, Opcode::Open, ino, &[0u8; 8]).unwrap();
    assert_eq!(err, 0, "opening read-only works");
    let fh = u64::from_le_bytes(open[..8].try_into().unwrap());
    let mut read = Reply::default();
    read.u64(fh).u64(0).u32(4096).u32(0).u64(0).u32(0).u32(0);
    assert_eq!(fe.fuse(1, Opcode::Read, ino, &read.bytes).unwrap(), (0, b"kept bytes".to_vec()));

    let mut write = Reply::default();
    write.u64(fh).u64(0).u32(1).u32(0).u64(0).u32(0).u32(0).raw(b"x");
    let mut chmod = Reply::default();
    chmod
        .u32(1)
        .u32(0)
        .u64(0)
        .u64(0)
        .u64(0)
        .u64(0)
        .u64(0)
        .u64(0)
        .u32(0)
        .u32(0)
        .u32(0)
        .u32(0o600)
        .u32(0)
        .u32(0)
        .u32(0)
        .u32(0);
    let create_in = [libc::O_RDWR as u32, 0o644, 0o022, 0].map(u32::to_le_bytes).concat();
    let mut falloc = Reply::default();
    falloc.u64(fh).u64(0).u64(4096).u32(0).u32(0);
    let rdwr = (libc::O_RDWR as u32).to_le_bytes();
    let cases: Vec<(&str, Opcode, u64, Vec<u8>)> = vec![
        ("create", Opcode::Create, 1, named(&create_in, "new")),
        ("mkdir", Opcode::Mkdir, 1, named(&[0o755u32.to_le_bytes(), 0u32.to_le_bytes()].concat(), "d")),
        ("mknod", Opcode::Mknod, 1, named(&[0o100644u32, 0, 0, 0].map(u32::to_le_bytes).concat(), "n")),
        ("symlink", Opcode::Symlink, 1, [b"s\0".as_slice(), b"kept\0"].concat()),
        ("link", Opcode::Link, 1, named(&ino.to_le_bytes(), "l")),
        ("unlink", Opcode::Unlink, 1, named(b"", "kept")),
        ("rename", Opcode::Rename, 1, [1u64.to_le_bytes().as_slice(), b"kept\0moved\0"].concat()),
        ("setattr", Opcode::Setattr, ino, chmod.bytes.clone()),
        ("write", Opcode::Write, ino, write.bytes.clone()),
        ("fallocate", Opcode::Fallocate, ino, falloc.bytes.clone()),
        ("setxattr", Opcode::Setxattr, ino, [[1u32, 0].map(u32::to_le_bytes).concat(), b"user.a\0v".to_vec()].concat()),
        ("removexattr", Opcode::Removexattr, ino, named(b"", "user.k")),
        ("open for writing", Opcode::Open, ino, [rdwr, [0u8; 4]].concat()),
    ];
    for (what, op, node, body) in cases {
        assert_eq!(fe.fuse(1, op, node, &body).unwrap().0, libc::EROFS, "{what}");
    }
}

#[test]
fn a_read_only_export_refuses_every_change_and_leaves_the_image_as_it_was() {
    let dir = Scratch::new("read-only");
    let (image, mnt, socket) = (dir.path("k.img"), dir.path("mnt"), dir.path("k.sock"));
    mkfs(&image, "64M");
    // Written and checkpointed, then written again and only journalled:
    // SIGKILL leaves that for the next mount to replay.
    let served =
        Served::start(&["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()], &[&mnt]);
    std::fs::write(mnt.join("kept"), b"kept bytes").unwrap();
    assert!(served.stop().success());
    let mut served =
        Served::start(&["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()], &[&mnt]);
    std::fs::write(mnt.join("journalled"), b"only in the journal").unwrap();
    std::fs::File::open(mnt.join("journalled")).unwrap().sync_all().unwrap();
    served.signal(libc::SIGKILL);
    let _ = served.child.wait();
    drop(served);
    let before = std::fs::read(&image).unwrap();

    let args =
        ["--read-only".as_ref(), "--device".as_ref(), image.as_os_str(), "--socket".as_ref(), socket.as_os_str()];
    let served = Served::start(&[&args[..], &["--fuse-mount".as_ref(), mnt.as_os_str()]].concat(), &[&mnt]);
    wait_for_socket(&socket);
    // The journal was replayed, in memory.
    assert_eq!(std::fs::read(mnt.join("journalled")).unwrap(), b"only in the journal");
    // The host mount is read-only.
    let err = std::fs::write(mnt.join("new"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    let c = std::ffi::CString::new(mnt.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path and a statvfs for the kernel to fill.
    let flags = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(c.as_ptr(), &mut st), 0);
        st.f_flag
    };
    assert_ne!(flags & libc::ST_RDONLY, 0, "statfs does not report ST_RDONLY");
    // A guest's kernel mounts read-write: the daemon refuses for it.
    guest_changes_are_refused(&socket);
    // A writable export of the same image is refused while this one serves.
    let out = keelfsd().arg("fsck").arg(&image).arg("--repair").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "fsck --repair ran on a served image");

    assert!(served.stop().success());
    assert!(!is_mounted(&mnt));
    assert!(std::fs::read(&image).unwrap() == before, "the read-only export changed the image");
}
