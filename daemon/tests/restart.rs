//! keelfsd restarted under a client that reconnects (the test frontend
//! plays one; QEMU 10's vhost-user-fs cannot yet, so a guest moves to a
//! new daemon by live migration instead: qemu-scripts/upgrade.sh). After
//! SIGTERM the session is kept beside the image and restored: the client's
//! node ids and open handles work, an unlinked file it holds included.
//! After SIGKILL nothing is kept: its handles fail with EBADF, never
//! naming another file, and its node ids still name their files (inode
//! numbers are never reused). fsck is clean after both.
//!
//! The same session moved by migration to a second keelfsd (`--incoming`)
//! takes the image's snapshots with it.

use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, Instant};

use keelfs_vhost::abi::{init_flags as f, Opcode, Reply};
use keelfs_vhost::frontend::{FrontendConfig, FsFrontend};
use serde_json::{json, Value};

mod common;
use common::{connect_frontend, create_with, fsck, mkfs, named, read, Scratch, Served};

fn serve(image: &Path, socket: &Path) -> Served {
    serve_with(image, socket, &[])
}

/// `serve` with `extra` arguments.
fn serve_with(image: &Path, socket: &Path, extra: &[&OsStr]) -> Served {
    let mut args: Vec<&OsStr> = vec![
        "--device".as_ref(),
        image.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
        "--tag".as_ref(),
        "restart".as_ref(),
    ];
    args.extend_from_slice(extra);
    let served = Served::start(&args, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "keelfsd did not bind {}", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    served
}

/// A client with a file open and an unlinked file it still holds.
fn hold(socket: &Path) -> (FsFrontend, (u64, u64), (u64, u64)) {
    let mut fe = connect_frontend(socket);
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    let file = create_with(&mut fe, "kept", b"written before the restart");
    let ghost = create_with(&mut fe, "ghost", b"unlinked, held open");
    assert_eq!(fe.fuse(1, Opcode::Unlink, 1, &named("ghost")).unwrap().0, 0);
    (fe, file, ghost)
}

#[test]
fn a_clean_restart_keeps_the_clients_handles() {
    let dir = Scratch::new("restart-clean");
    let (image, socket) = (dir.path("image"), dir.path("fs.sock"));
    mkfs(&image, "256M");
    let daemon = serve(&image, &socket);
    let (fe, file, ghost) = hold(&socket);
    assert!(daemon.stop().success());
    drop(fe);
    let kept = std::fs::metadata(dir.path("image.session")).expect("the session was kept beside the image");
    assert!(kept.len() > 0);

    let daemon = serve(&image, &socket);
    // The same client, back without an INIT: its numbers still work.
    let mut fe = connect_frontend(&socket);
    assert_eq!(read(&mut fe, file, 26).unwrap(), b"written before the restart");
    assert_eq!(read(&mut fe, ghost, 19).unwrap(), b"unlinked, held open", "the orphan survived the restart");
    assert_eq!(fe.fuse(1, Opcode::Getattr, file.0, &[0u8; 16]).unwrap().0, 0);
    assert_eq!(std::fs::metadata(dir.path("image.session")).unwrap().len(), 0, "read once, then emptied");
    drop(fe);
    assert!(daemon.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
}

#[test]
fn after_a_crash_old_handles_fail_cleanly_and_node_ids_keep_their_files() {
    let dir = Scratch::new("restart-kill");
    let (image, socket) = (dir.path("image"), dir.path("fs.sock"));
    mkfs(&image, "256M");
    let daemon = serve(&image, &socket);
    let (mut fe, file, ghost) = hold(&socket);
    // What was written is on the device before the crash.
    let mut fsync = Reply::default();
    fsync.u64(file.1).u32(0).u32(0);
    assert_eq!(fe.fuse(1, Opcode::Fsync, file.0, &fsync.bytes).unwrap().0, 0);
    daemon.signal(libc::SIGKILL);
    drop(daemon);
    drop(fe);

    let daemon = serve(&image, &socket);
    let mut fe = connect_frontend(&socket);
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    assert_eq!(read(&mut fe, file, 26), Err(libc::EBADF), "a handle from before the crash");
    assert_eq!(read(&mut fe, ghost, 19), Err(libc::EBADF));
    let (err, reply) = fe.fuse(1, Opcode::Getattr, file.0, &[0u8; 16]).unwrap();
    assert_eq!(err, 0, "the node id still names its file");
    assert_eq!(u64::from_le_bytes(reply[16..24].try_into().unwrap()), file.0);
    assert_eq!(fe.fuse(1, Opcode::Getattr, ghost.0, &[0u8; 16]).unwrap().0, libc::ENOENT, "the orphan was freed");
    drop(fe);
    assert!(daemon.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
}

#[test]
fn a_default_session_file_that_cannot_be_made_costs_only_the_session() {
    let dir = Scratch::new("restart-nofile");
    let (image, socket) = (dir.path("image"), dir.path("fs.sock"));
    mkfs(&image, "256M");
    // Something else has the name: keelfsd serves, keeping no session.
    std::fs::create_dir(dir.path("image.session")).unwrap();
    let daemon = serve(&image, &socket);
    let (mut fe, file, _) = hold(&socket);
    assert_eq!(fe.fuse(1, Opcode::Getattr, file.0, &[0u8; 16]).unwrap().0, 0);
    drop(fe);
    assert!(daemon.stop().success());
    assert!(dir.path("image.session").is_dir());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
}

fn rpc(socket: &Path, method: &str, params: Value) -> Value {
    let wait_for = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(Instant::now() < wait_for, "no RPC socket at {}", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = common::keelfsd().args(["rpc", method, &params.to_string(), "--rpc"]).arg(socket).output().unwrap();
    assert!(out.status.success(), "{method}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("keelfsd rpc prints JSON")
}

/// The errno of LOOKUP `name` in the root through `fe` (ENOENT for a
/// negative entry), and the node id when found.
fn lookup(fe: &mut FsFrontend, name: &str) -> Result<u64, i32> {
    let (err, reply) = fe.fuse(1, Opcode::Lookup, 1, &named(name)).unwrap();
    match (err, u64::from_le_bytes(reply.get(..8).map_or([0; 8], |b| b.try_into().unwrap()))) {
        (0, 0) => Err(libc::ENOENT),
        (0, node) => Ok(node),
        (err, _) => Err(err),
    }
}

/// Issue 37: snapshots live on the image, so a guest's session moved by
/// migration finds them at the destination, which lists them and serves
/// one beside the export as it was when taken.
#[test]
fn a_migration_takes_the_images_snapshots_to_the_destination() {
    let dir = Scratch::new("migrate-snapshots");
    let (image, socket, dst_socket) = (dir.path("image"), dir.path("src.sock"), dir.path("dst.sock"));
    let (src_rpc, dst_rpc, snap_socket) = (dir.path("src-rpc.sock"), dir.path("dst-rpc.sock"), dir.path("snap.sock"));
    mkfs(&image, "256M");
    let source = serve_with(&image, &socket, &["--rpc".as_ref(), src_rpc.as_os_str()]);
    let mut fe = connect_frontend(&socket);
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    let kept = create_with(&mut fe, "kept", b"before the snapshot");
    rpc(&src_rpc, "snapshot_create", json!({"export": "restart", "name": "s"}));
    create_with(&mut fe, "later", b"after it");
    let state = fe.save_state().expect("the source gives the session and the image up");

    // (Unsandboxed: a sandboxed daemon adds exports only beneath the
    // export_dirs of a config file; operations.rs tests that path.)
    let incoming =
        ["--rpc".as_ref(), dst_rpc.as_os_str(), "--incoming".as_ref(), "--sandbox".as_ref(), "none".as_ref()];
    let destination = serve_with(&image, &dst_socket, &incoming);
    let mut moved = FsFrontend::connect_with_state(&dst_socket, FrontendConfig::default(), &state).unwrap();
    assert_eq!(read(&mut moved, kept, 19).unwrap(), b"before the snapshot", "the handle moved");
    assert!(lookup(&mut moved, "later").is_ok());
    let listed = rpc(&dst_rpc, "snapshot_list", json!({"export": "restart"}));
    assert_eq!(listed.as_array().map(|l| l.len()), Some(1), "{listed}");
    assert_eq!(listed[0]["name"], "s", "{listed}");

    let export = json!({"tag": "restart-s", "device": image, "read_only": true, "snapshot": "s",
                        "socket": snap_socket});
    rpc(&dst_rpc, "export_add", json!({"export": export}));
    let mut snap = connect_frontend(&snap_socket);
    snap.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    assert!(lookup(&mut snap, "kept").is_ok(), "the snapshot has what was there when taken");
    assert_eq!(lookup(&mut snap, "later"), Err(libc::ENOENT), "and not what came after");
    drop((snap, moved, fe));
    assert!(source.stop().success(), "the source, its image gone, stops cleanly");
    assert!(destination.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
}
