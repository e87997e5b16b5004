//! Writeback caching (`--cache always`, and the default `auto` on a host
//! mount no guest shares) on a host mount: the kernel caches writes and
//! owns the size and mtime; fsync and close flush to the daemon (issues
//! 18 and 33). Each property here fails without the semantics that
//! writeback caching needs.

use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::process::Command;

mod common;
use common::{fsck, keelfsd, mkfs, Scratch, Served};

fn serve(image: &Path, mountpoint: &Path, rpc: &Path) -> Served {
    let os = |s: &'static str| OsStr::new(s);
    serve_with(&[os("--cache"), os("always"), os("--sandbox"), os("none")], image, mountpoint, rpc)
}

/// keelfsd serving `image` at `mountpoint` with `args` besides.
fn serve_with(args: &[&OsStr], image: &Path, mountpoint: &Path, rpc: &Path) -> Served {
    let _ = std::fs::remove_file(rpc);
    let os = |s: &'static str| OsStr::new(s);
    let mut all = args.to_vec();
    all.extend([os("--device"), image.as_os_str(), os("--fuse-mount"), mountpoint.as_os_str()]);
    all.extend([os("--rpc"), rpc.as_os_str()]);
    Served::start(&all, &[mountpoint])
}

/// WRITE requests the daemon has answered through the host mount.
fn write_requests(rpc: &Path) -> u64 {
    let out = keelfsd().arg("stats").arg("--rpc").arg(rpc).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    stats["exports"][0]["fuse_mount_ops"]["write"]["requests"].as_u64().unwrap_or(0)
}

/// /sys/class/bdi/MAJOR:MINOR of the mount at `dir`.
fn bdi_of(dir: &Path) -> std::path::PathBuf {
    let dir = std::fs::canonicalize(dir).unwrap();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = info.lines().rfind(|l| l.split(' ').nth(4) == dir.to_str()).expect("the mount in mountinfo");
    Path::new("/sys/class/bdi").join(line.split(' ').nth(2).unwrap())
}

const STAMPED_PAGES: u64 = 2048;

#[test]
fn writeback_caching_on_a_host_mount() {
    let scratch = Scratch::new("writeback");
    let (image, mnt, rpc) = (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    mkfs(&image, "256M");
    let served = serve(&image, &mnt, &rpc);

    // FUSE's strict 1% dirty limit is lifted for this mount (the
    // default host_dirty_ratio, 20%), or writers would stall at once.
    let bdi = bdi_of(&mnt);
    let knob = |name: &str| std::fs::read_to_string(bdi.join(name)).unwrap().trim().to_string();
    assert_eq!((knob("strict_limit"), knob("max_ratio")), ("0".into(), "20".into()), "{}", bdi.display());

    // 1-byte writes stay in the kernel's page cache until fsync: far
    // fewer WRITE requests than write(2) calls.
    let before = write_requests(&rpc);
    let mut file = std::fs::File::create(mnt.join("bytes")).unwrap();
    for i in 0..20_000u32 {
        file.write_all(&[b'a' + (i % 26) as u8]).unwrap();
    }
    file.sync_all().unwrap();
    drop(file);
    let sent = write_requests(&rpc) - before;
    assert!((1..=64).contains(&sent), "20,000 1-byte writes reached the daemon as {sent} WRITE requests");

    // O_APPEND through two handles: the kernel places appends.
    let open_append = || std::fs::OpenOptions::new().append(true).open(mnt.join("bytes")).unwrap();
    let (mut a, mut b) = (open_append(), open_append());
    a.write_all(b"AAAA").unwrap();
    b.write_all(b"BBBB").unwrap();
    drop((a, b));
    let kernel_mtime = std::fs::metadata(mnt.join("bytes")).unwrap().mtime_nsec();

    // Dirty pages, then an explicit mtime: the SETATTR must stand after
    // the pages are written back. A kernel that ends page writeback
    // before the daemon answers (the guests' 6.12 copies pages aside)
    // sends the times from syncfs while WRITEs are still queued, and those
    // must not stamp the file again (the guest suite's persist-write
    // race; vhost's dispatch test pins the rule on any kernel). The host
    // kernel sends no SYNCFS, so a clean restart makes them durable.
    let past = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    // Scattered pages make many background WRITEs.
    let stamped = std::fs::File::create(mnt.join("stamped")).unwrap();
    for page in 0..STAMPED_PAGES {
        stamped.write_at(b"late pages", page * 8192).unwrap();
    }
    stamped.set_modified(past).unwrap();
    // SAFETY: the descriptor is open for the call.
    assert_eq!(unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&stamped)) }, 0);
    drop(stamped);

    // A file written, then the daemon restarted: its pages are cold.
    std::fs::write(mnt.join("cold"), b"hello world").unwrap();
    assert!(served.stop().success());
    let served = serve(&image, &mnt, &rpc);
    let stamped = std::fs::metadata(mnt.join("stamped")).unwrap();
    assert_eq!(
        (stamped.len(), stamped.modified().unwrap()),
        ((STAMPED_PAGES - 1) * 8192 + 10, past),
        "the SETATTR's mtime stands"
    );

    // A partial-page write through a write-only handle makes the kernel
    // read the page through that handle first.
    let wronly = std::fs::OpenOptions::new().write(true).open(mnt.join("cold")).unwrap();
    wronly.write_at(b"J", 4).unwrap();
    wronly.sync_all().unwrap();
    drop(wronly);
    let meta = std::fs::metadata(mnt.join("bytes")).unwrap();
    assert_eq!(meta.len(), 20_008, "appends from two handles both landed at the end");
    assert_eq!(meta.mtime_nsec(), kernel_mtime, "the kernel's mtime reached the daemon by close");

    // Written, fsynced, then the daemon killed: the data is there after
    // a restart, and the image is clean.
    let mut f = std::fs::File::create(mnt.join("durable")).unwrap();
    f.write_all(&vec![7u8; 1 << 20]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    served.signal(libc::SIGKILL);
    drop(served);
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "fsck after SIGKILL: {report}");
    let served = serve(&image, &mnt, &rpc);
    assert_eq!(std::fs::read(mnt.join("cold")).unwrap(), b"hellJ world");
    assert_eq!(std::fs::read(mnt.join("durable")).unwrap(), vec![7u8; 1 << 20]);
    let bytes = std::fs::read(mnt.join("bytes")).unwrap();
    assert_eq!(&bytes[..3], b"abc");
    assert_eq!(&bytes[20_000..], b"AAAABBBB");
    assert!(served.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
    assert!(!Command::new("mountpoint").arg("-q").arg(&mnt).status().unwrap().success());
}

/// The contents `small_writes` leaves in its file.
fn small_writes_contents(count: usize) -> Vec<u8> {
    (0..count).flat_map(|i| std::iter::repeat_n(b'a' + (i % 26) as u8, 1 + i % 100)).collect()
}

/// `count` buffered writes of 1 to 100 bytes to `path`, then fsync: the
/// WRITE requests the daemon answered meanwhile.
fn small_writes(path: &Path, rpc: &Path, count: usize) -> u64 {
    let expected = small_writes_contents(count);
    let before = write_requests(rpc);
    let mut file = std::fs::File::create(path).unwrap();
    let mut at = 0;
    for i in 0..count {
        let len = 1 + i % 100;
        file.write_all(&expected[at..at + len]).unwrap();
        at += len;
    }
    assert_eq!(at, expected.len());
    file.sync_all().unwrap();
    drop(file);
    write_requests(rpc) - before
}

const SMALL_WRITES: usize = 4096;

/// The default cache mode on a host mount no guest shares: the kernel's
/// writeback cache, with FUSE's dirty limit lifted, so small buffered
/// writes reach the daemon batched; what was written survives fsync, a
/// clean unmount and a remount.
#[test]
fn the_default_cache_batches_writes_on_a_host_only_mount() {
    let scratch = Scratch::new("writeback-default");
    let (image, mnt, rpc) = (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    mkfs(&image, "256M");
    // The default sandbox, as a plain `keelfsd serve --fuse-mount` runs.
    let served = serve_with(&[], &image, &mnt, &rpc);
    let bdi = bdi_of(&mnt);
    let knob = |name: &str| std::fs::read_to_string(bdi.join(name)).unwrap().trim().to_string();
    assert_eq!((knob("strict_limit"), knob("max_ratio")), ("0".into(), "20".into()), "{}", bdi.display());

    let sent = small_writes(&mnt.join("small"), &rpc, SMALL_WRITES);
    assert!(
        (1..=SMALL_WRITES as u64 / 16).contains(&sent),
        "{SMALL_WRITES} small writes(2) reached the daemon as {sent} WRITE requests"
    );
    // Scattered pages, closed without fsync: the unmount flushes them.
    let scattered = std::fs::File::create(mnt.join("scattered")).unwrap();
    for page in 0..256u64 {
        scattered.write_at(&page.to_le_bytes(), page * 12_288 + 100).unwrap();
    }
    drop(scattered);
    assert!(served.stop().success());
    assert!(!Command::new("mountpoint").arg("-q").arg(&mnt).status().unwrap().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");

    let served = serve_with(&[], &image, &mnt, &rpc);
    assert!(std::fs::read(mnt.join("small")).unwrap() == small_writes_contents(SMALL_WRITES), "small writes kept");
    let scattered = std::fs::read(mnt.join("scattered")).unwrap();
    assert_eq!(scattered.len() as u64, 255 * 12_288 + 108);
    for page in 0..256u64 {
        let at = (page * 12_288 + 100) as usize;
        assert_eq!(scattered[at..at + 8], page.to_le_bytes(), "page {page}");
    }
    assert!(served.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
}

/// A host mount beside a guest (the export has a vhost-user socket)
/// keeps the default mode coherent: no writeback cache, FUSE's dirty
/// limit untouched, each write(2) a WRITE the daemon answers at once.
#[test]
fn the_default_cache_writes_through_beside_a_guest() {
    let scratch = Scratch::new("writeback-shared");
    let (image, mnt, rpc) = (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    let socket = scratch.path("vhost.sock");
    mkfs(&image, "256M");
    let served = serve_with(&[OsStr::new("--socket"), socket.as_os_str()], &image, &mnt, &rpc);
    let bdi = bdi_of(&mnt);
    let knob = |name: &str| std::fs::read_to_string(bdi.join(name)).unwrap().trim().to_string();
    assert_eq!(knob("strict_limit"), "1", "FUSE's strict limit stays: {}", bdi.display());

    const WRITES: usize = 200;
    let sent = small_writes(&mnt.join("small"), &rpc, WRITES);
    assert!(sent >= WRITES as u64, "{WRITES} writes(2) reached the daemon as only {sent} WRITE requests");
    assert!(served.stop().success());
    let served = serve_with(&[OsStr::new("--socket"), socket.as_os_str()], &image, &mnt, &rpc);
    assert!(std::fs::read(mnt.join("small")).unwrap() == small_writes_contents(WRITES));
    assert!(served.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
}
