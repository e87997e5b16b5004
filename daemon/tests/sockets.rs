//! keelfsd's sockets on a shared path: the vhost-user and RPC sockets get
//! their final mode before they accept, a path holding anything but a
//! stale socket is never replaced, and the RPC bounds what a client may
//! send and serves other clients while one stalls.

mod common;

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::{keelfsd, mkfs, Scratch, Served};

fn wait_for_socket(path: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        assert!(Instant::now() < deadline, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sockets_are_private_and_the_rpc_survives_hostile_clients() {
    let dir = Scratch::new("sockets");
    let image = dir.path("k.img");
    mkfs(&image, "256M");
    let (sock, rpc, mnt) = (dir.path("fs.sock"), dir.path("rpc.sock"), dir.path("mnt"));
    let served = Served::start(
        &[
            OsStr::new("--device"),
            image.as_os_str(),
            OsStr::new("--socket"),
            sock.as_os_str(),
            OsStr::new("--rpc"),
            rpc.as_os_str(),
            OsStr::new("--fuse-mount"),
            mnt.as_os_str(),
        ],
        &[&mnt],
    );
    wait_for_socket(&sock);
    wait_for_socket(&rpc);
    for path in [&sock, &rpc] {
        let mode = std::fs::metadata(path).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o600, "{} is mode {mode:o}", path.display());
    }
    let leftovers: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(".keelfs-socket"))
        .collect();
    assert!(leftovers.is_empty(), "private directories left: {leftovers:?}");

    // A client that connects and sends nothing, and one that sends a
    // line far too long: the stats query still answers, and the long one
    // gets an error instead of an unbounded buffer.
    let silent = UnixStream::connect(&rpc).unwrap();
    let mut long = UnixStream::connect(&rpc).unwrap();
    let _ = long.write_all(&vec![b'x'; 128 << 10]);
    let out = keelfsd().arg("stats").arg("--rpc").arg(&rpc).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(stats["exports"].is_array(), "{stats}");
    // Served beside the silent client, not after it: that one is still
    // connected (a daemon serving one client at a time would have cut it
    // off before answering).
    silent.set_nonblocking(true).unwrap();
    let still_open = matches!((&silent).read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    assert!(still_open, "stats was answered only after the silent client was dropped");
    silent.set_nonblocking(false).unwrap();
    long.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut reply = String::new();
    let _ = long.read_to_string(&mut reply);
    assert!(reply.contains("request longer than 65536 bytes"), "{reply:?}");
    // The silent client is cut off after the request timeout: its read
    // ends at the daemon's close, not at this side's 60 s hang guard.
    let mut silent = silent;
    silent.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut rest = Vec::new();
    let read = silent.read_to_end(&mut rest);
    assert!(read.is_ok(), "the silent client was kept: {read:?}");
    assert!(served.stop().success());
}

#[test]
fn a_path_that_is_not_a_stale_socket_is_never_replaced() {
    let dir = Scratch::new("sockpath");
    let image = dir.path("k.img");
    mkfs(&image, "256M");
    let precious = dir.path("precious");
    std::fs::write(&precious, b"not a socket").unwrap();
    let out = keelfsd().arg("serve").arg("--device").arg(&image).arg("--socket").arg(&precious).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is not a socket; refusing to replace it"), "{stderr}");
    assert_eq!(std::fs::read(&precious).unwrap(), b"not a socket");
}
