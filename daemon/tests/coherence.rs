//! Two clients of one export (issue 34): a guest (the test's vhost-user
//! frontend) and the host mount (the kernel's FUSE client).
//!
//! - Beside a guest, the host mount keeps names and attributes for a day
//!   (its kernel asks nothing again), and is told of each of the guest's
//!   changes, so that it sees them at once.
//! - A guest cannot be told (virtio-fs has no notification queue), so
//!   beside a host mount it is given 1 s timeouts; alone, a day, and no
//!   writeback cache in the default mode.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use keelfs_vhost::abi::{init_flags as f, Opcode, Reply};
use keelfs_vhost::frontend::{io_in, FsFrontend};

mod common;
use common::{connect_frontend, fsck, mkfs, named, stats, Scratch, Served};

/// The host's kernel may still hold the old state for as long as the
/// notification takes to reach it (a thread of the daemon writes it), far
/// less than the day the kernel would otherwise keep the state.
fn eventually(what: &str, holds: impl Fn() -> bool) {
    common::eventually(&format!("the host mount saw {what}"), holds);
}

/// Requests of these kinds the daemon has answered for the host mount.
fn host_requests(rpc: &Path, kinds: &[&str]) -> u64 {
    let s = stats(rpc);
    let ops = &s["exports"][0]["fuse_mount_ops"];
    kinds.iter().map(|op| ops[op]["requests"].as_u64().unwrap_or(0)).sum()
}

/// GETATTR and LOOKUP requests the daemon has answered for the host mount.
fn host_revalidations(rpc: &Path) -> u64 {
    host_requests(rpc, &["getattr", "lookup"])
}

/// The guest's view: LOOKUP `name` in the root, (node id, entry_valid).
fn guest_lookup(fe: &mut FsFrontend, name: &str) -> (u64, u64) {
    let (err, entry) = fe.fuse(1, Opcode::Lookup, 1, &named(name)).unwrap();
    assert_eq!(err, 0, "lookup {name}");
    let at = |i: usize| u64::from_le_bytes(entry[i..i + 8].try_into().unwrap());
    (at(0), at(16))
}

fn serve(image: &Path, socket: &Path, mnt: Option<&Path>, rpc: &Path) -> Served {
    let _ = std::fs::remove_file(rpc);
    let mut args: Vec<&OsStr> = vec![OsStr::new("--device"), image.as_os_str(), OsStr::new("--socket")];
    args.extend([socket.as_os_str(), OsStr::new("--rpc"), rpc.as_os_str()]);
    if let Some(mnt) = mnt {
        args.extend([OsStr::new("--fuse-mount"), mnt.as_os_str()]);
    }
    Served::start(&args, mnt.as_slice())
}

#[test]
fn the_host_mount_sees_a_guests_changes_at_once() {
    let scratch = Scratch::new("coherence");
    let (image, mnt, rpc, socket) =
        (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"), scratch.path("vhost.sock"));
    mkfs(&image, "256M");
    let served = serve(&image, &socket, Some(&mnt), &rpc);
    std::fs::write(mnt.join("f"), b"").unwrap();
    std::fs::write(mnt.join("g"), b"g").unwrap();

    // The host's kernel keeps what it looked up: a second look asks the
    // daemon nothing. Only a notification can make it see a change.
    assert_eq!(std::fs::metadata(mnt.join("f")).unwrap().len(), 0);
    assert!(mnt.join("g").exists());
    let asked = host_revalidations(&rpc);
    for _ in 0..3 {
        assert_eq!(std::fs::metadata(mnt.join("f")).unwrap().len(), 0);
        assert!(mnt.join("g").exists());
    }
    assert_eq!(host_revalidations(&rpc), asked, "the host's kernel revalidated what it should keep");

    let mut guest = connect_frontend(&socket);
    guest.init(f::INIT_EXT).unwrap();
    let (file, valid) = guest_lookup(&mut guest, "f");
    assert_eq!(valid, 1, "a guest beside a host mount keeps names for a second only");

    // A write: the size changes.
    let (err, open) = guest.fuse(1, Opcode::Open, file, &(libc::O_WRONLY as u64).to_le_bytes()).unwrap();
    assert_eq!(err, 0);
    let fh = u64::from_le_bytes(open[..8].try_into().unwrap());
    let mut write = Reply::default();
    write.raw(&io_in(fh, 0, 100)).raw(&[7u8; 100]);
    assert_eq!(guest.fuse(1, Opcode::Write, file, &write.bytes).unwrap().0, 0);
    eventually("the guest's write", || std::fs::metadata(mnt.join("f")).unwrap().len() == 100);
    assert_eq!(std::fs::read(mnt.join("f")).unwrap(), vec![7u8; 100]);

    // A chmod: the mode changes.
    let mut chmod = Reply::default();
    chmod.u32(1).u32(0).raw(&[0u8; 60]).u32(0o600).raw(&[0u8; 16]);
    assert_eq!(guest.fuse(1, Opcode::Setattr, file, &chmod.bytes).unwrap().0, 0);
    eventually("the guest's chmod", || std::fs::metadata(mnt.join("f")).unwrap().permissions().mode() & 0o777 == 0o600);

    // A rename and an unlink: names go.
    let rename = [&1u64.to_le_bytes()[..], b"g\0h\0"].concat();
    assert_eq!(guest.fuse(1, Opcode::Rename, 1, &rename).unwrap().0, 0);
    eventually("the guest's rename", || !mnt.join("g").exists() && mnt.join("h").exists());
    assert_eq!(guest.fuse(1, Opcode::Unlink, 1, &named("h")).unwrap().0, 0);
    eventually("the guest's unlink", || !mnt.join("h").exists());

    // A name the host looked for and did not find, which its kernel
    // keeps as missing (a negative entry), and the guest then creates.
    // (LOOKUPs only: the notifications of the changes above may still
    // be arriving, and make the kernel ask for the root's attributes.)
    assert!(!mnt.join("new").exists());
    let asked = host_requests(&rpc, &["lookup"]);
    assert!(!mnt.join("new").exists());
    assert_eq!(host_requests(&rpc, &["lookup"]), asked, "the missing name is kept as missing");
    common::create_with(&mut guest, "new", b"n");
    eventually("the guest's create", || mnt.join("new").exists());

    let told = stats(&rpc)["exports"][0]["fuse_mount_notifications"].as_u64().unwrap_or(0);
    assert!(told >= 8, "notifications sent to the host mount: {told}");
    drop(guest);
    assert!(served.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
}

#[test]
fn a_guest_alone_keeps_names_for_a_day_and_writes_through() {
    let scratch = Scratch::new("coherence-alone");
    let (image, rpc, socket) = (scratch.path("img"), scratch.path("rpc.sock"), scratch.path("vhost.sock"));
    mkfs(&image, "256M");
    let served = serve(&image, &socket, None, &rpc);
    let mut guest = connect_frontend(&socket);
    let flags = guest.init(f::INIT_EXT | f::WRITEBACK_CACHE).unwrap();
    assert_eq!(flags & f::WRITEBACK_CACHE, 0, "a guest writes through: its small files cost less so");
    common::create_with(&mut guest, "f", b"x");
    assert_eq!(guest_lookup(&mut guest, "f").1, 86_400);
    drop(guest);
    assert!(served.stop().success());
}
