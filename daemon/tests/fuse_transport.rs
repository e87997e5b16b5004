//! The host mount's FUSE transport is the one configured, and says so in
//! `keelfsd stats`: `fuse_transport = "uring"` serves through io_uring
//! ring entries (no silent fallback to /dev/fuse passes here), "dev"
//! through /dev/fuse, "auto" through io_uring when the kernel has it on;
//! and "uring" on a kernel without it is an error at start.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Stdio;

mod common;
use common::{is_mounted, keelfsd, mkfs, require_fuse_transport, stats, Scratch, Served};

fn serve(image: &Path, mnt: &Path, rpc: &Path, transport: &str) -> Served {
    let _ = std::fs::remove_file(rpc);
    let os = OsStr::new;
    let args = [
        os("--fuse-transport"),
        os(transport),
        os("--device"),
        image.as_os_str(),
        os("--fuse-mount"),
        mnt.as_os_str(),
        os("--rpc"),
        rpc.as_os_str(),
    ];
    Served::start(&args, &[mnt])
}

/// Write and read a file through the mount; then the export's transport
/// in stats, and the requests that came through ring entries.
fn transport_after_io(mnt: &Path, rpc: &Path) -> (String, u64) {
    std::fs::write(mnt.join("f"), vec![5u8; 300_000]).unwrap();
    assert_eq!(std::fs::read(mnt.join("f")).unwrap(), vec![5u8; 300_000]);
    let stats = stats(rpc);
    let export = &stats["exports"][0];
    let transport = export["fuse_transport"].as_str().unwrap_or("none").to_string();
    (transport, export["fuse_ring_requests"].as_u64().unwrap_or(0))
}

/// A host mount serves WRITEs with their data where the kernel put it,
/// on either transport (the /dev/fuse read's buffer, the ring entry's
/// payload): an O_DIRECT write goes to the device from there, and a
/// buffered one is copied only into the page cache. Both land whole.
#[test]
fn host_mount_writes_are_served_where_the_kernel_put_them() {
    require_fuse_transport("uring");
    let scratch = Scratch::new("fuse-in-place");
    let (image, mnt, rpc) = (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    mkfs(&image, "128M");
    let source = scratch.path("pattern");
    let pattern: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
    std::fs::write(&source, &pattern).unwrap();
    for transport in ["dev", "uring"] {
        let served = serve(&image, &mnt, &rpc, transport);
        let file = mnt.join(transport);
        let in_place = || stats(&rpc)["exports"][0]["fuse_in_place_writes"].as_u64().expect("a host mount's count");
        let before = in_place();
        for (flag, block) in [("oflag=direct", "bs=64k"), ("oflag=direct", "bs=1M"), ("conv=fsync", "bs=128k")] {
            let dd = std::process::Command::new("dd")
                .arg(format!("if={}", source.display()))
                .arg(format!("of={}", file.display()))
                .args([flag, block, "conv=notrunc", "status=none"])
                .status()
                .unwrap();
            assert!(dd.success(), "{transport}: dd {flag} {block}");
            let back = std::fs::read(&file).unwrap();
            assert!(back == pattern, "{transport}: dd {flag} {block}: the file reads back whole");
        }
        let served_in_place = in_place() - before;
        // 16 + 1 direct WRITEs at least; the buffered ones as the kernel
        // gathers its pages.
        assert!(served_in_place >= 17, "{transport}: {served_in_place} WRITEs served in place");
        assert!(served.stop().success(), "{transport}: keelfsd's exit");
    }
}

#[test]
fn each_transport_asked_for_is_the_one_in_stats() {
    require_fuse_transport("uring");
    let scratch = Scratch::new("fuse-transport");
    let (image, mnt, rpc) = (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    mkfs(&image, "128M");
    for (asked, expected) in [("uring", "uring"), ("dev", "dev"), ("auto", "uring")] {
        let served = serve(&image, &mnt, &rpc, asked);
        let (transport, ring_requests) = transport_after_io(&mnt, &rpc);
        assert_eq!(transport, expected, "fuse_transport = {asked:?}");
        if expected == "uring" {
            assert!(ring_requests > 0, "{asked:?}: no request came through a ring entry");
        } else {
            assert_eq!(ring_requests, 0, "{asked:?}: requests came through ring entries");
        }
        assert!(served.stop().success(), "{asked:?}: keelfsd's exit");
        assert!(!is_mounted(&mnt), "{asked:?}: unmounted at shutdown");
    }
}

/// A kernel without FUSE over io_uring, played by a stand-in for the
/// fuse module's parameter (a test hook of test-utils builds).
#[test]
fn uring_without_kernel_support_is_an_error_and_auto_falls_back() {
    let scratch = Scratch::new("fuse-transport-off");
    let (image, mnt, rpc) = (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    let parameter = scratch.path("enable_uring");
    std::fs::write(&parameter, "N\n").unwrap();
    mkfs(&image, "128M");
    std::fs::create_dir_all(&mnt).unwrap();
    let out = keelfsd()
        .env("KEELFS_TEST_FUSE_URING_PARAMETER", &parameter)
        .args(["serve", "--sandbox", "none", "--fuse-transport", "uring", "--device"])
        .arg(&image)
        .arg("--fuse-mount")
        .arg(&mnt)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "fuse_transport uring on a kernel without it started:\n{stderr}");
    assert!(stderr.contains("FUSE over io_uring is unavailable"), "the error says why:\n{stderr}");
    assert!(!is_mounted(&mnt), "nothing left mounted");

    // auto serves through /dev/fuse, and says so.
    let log = scratch.path("keelfsd.log");
    let child = keelfsd()
        .env("KEELFS_TEST_FUSE_URING_PARAMETER", &parameter)
        .args(["serve", "--sandbox", "none", "--fuse-transport", "auto", "--device"])
        .arg(&image)
        .arg("--fuse-mount")
        .arg(&mnt)
        .arg("--rpc")
        .arg(&rpc)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let served = Served::adopt(child, &[&mnt]);
    let (transport, ring_requests) = transport_after_io(&mnt, &rpc);
    assert_eq!((transport.as_str(), ring_requests), ("dev", 0));
    assert!(served.stop().success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("served through /dev/fuse"), "the log names the fallback:\n{text}");
}
