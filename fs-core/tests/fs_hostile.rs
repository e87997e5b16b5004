//! Requests whose cost a client chooses are bounded by what the filesystem
//! holds, not by the numbers in the request: a guest must not be able to
//! stall a reactor (and every export on it) with one request.

mod common;

use keelfs_fs::FileOffset;
use std::sync::Arc;
use std::time::Duration;

use common::with_fs;
use keelfs_bdev::BlockDevice;
use keelfs_fs::ROOT_INO;
use keelfs_fs::{Creds, Fs};
use keelfs_fs::{FallocateMode, XattrFlags};

const MIB: u64 = 1 << 20;
/// The largest range a request may name (MAX_FILE_BYTES).
const HUGE: u64 = 1 << 52;

/// Runs `body` on its own thread and fails if it takes longer than a
/// minute; the unbounded walks this guards against took hours.
fn within_a_minute(name: &str, body: impl FnOnce() + Send + 'static) {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            body();
            let _ = done_tx.send(());
        })
        .unwrap();
    match done_rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("{name}: still running after 60 s"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{name}: the test body panicked"),
    }
}

#[test]
fn punching_or_zeroing_the_largest_range_is_bounded_by_the_cache() {
    within_a_minute("fallocate-huge", || {
        with_fs(32 * MIB, async |fs: Fs, _dev: Arc<dyn BlockDevice>| {
            let c = Creds::root();
            let (f, _) = fs.create(&c, ROOT_INO, b"f", 0o644, libc::O_RDWR as u32).await.unwrap();
            let ino = f.ino();
            fs.data().write(ino, FileOffset::new(0), &vec![0xaa; 3 * 4096]).await.unwrap();
            fs.data().write(ino, FileOffset::new(1 << 40), b"far").await.unwrap();
            fs.data().fallocate(ino, FallocateMode::PunchHole, FileOffset::new(4096), HUGE - 4096).await.unwrap();
            let data = fs.data().read(ino, FileOffset::new(0), 3 * 4096).await.unwrap();
            assert!(data[..4096].iter().all(|&b| b == 0xaa), "before the hole: kept");
            assert!(data[4096..].iter().all(|&b| b == 0), "inside the hole: zeros");
            assert!(fs.data().read(ino, FileOffset::new(1 << 40), 3).await.unwrap().iter().all(|&b| b == 0));
            // Zeroing the same range would reserve 2^40 blocks: refused as
            // ENOSPC, quickly, after the zeroing itself.
            fs.data().write(ino, FileOffset::new(8192), b"again").await.unwrap();
            let zeroed = fs
                .data()
                .fallocate(ino, FallocateMode::ZeroRange { keep_size: true }, FileOffset::new(4096), HUGE - 4096)
                .await;
            assert_eq!(zeroed.err().map(|e| e.errno()), Some(libc::ENOSPC));
        });
    });
}

#[test]
fn an_inodes_xattrs_are_bounded_and_refused_with_enospc() {
    with_fs(32 * MIB, async |fs: Fs, _dev: Arc<dyn BlockDevice>| {
        let c = Creds::root();
        let (f, _) = fs.create(&c, ROOT_INO, b"x", 0o644, libc::O_RDWR as u32).await.unwrap();
        let ino = f.ino();
        let big = vec![7u8; 65536];
        let mut stored = 0;
        let refused = loop {
            match fs.setxattr(&c, ino, format!("user.v{stored}").as_bytes(), &big, XattrFlags::default()).await {
                Ok(()) => stored += 1,
                Err(e) => break e,
            }
            assert!(stored < 100, "no bound on xattr bytes per inode");
        };
        assert_eq!(refused.errno(), libc::ENOSPC);
        assert_eq!(stored, 3, "256 KiB holds three 64 KiB values and their names");
        // Replacing one in place still fits; removing one makes room.
        fs.setxattr(&c, ino, b"user.v0", &big, XattrFlags::default()).await.unwrap();
        fs.removexattr(&c, ino, b"user.v0").await.unwrap();
        fs.setxattr(&c, ino, b"user.again", &big, XattrFlags::default()).await.unwrap();

        // Names alone: one listxattr's worth (64 KiB) at most.
        let (g, _) = fs.create(&c, ROOT_INO, b"y", 0o644, libc::O_RDWR as u32).await.unwrap();
        let mut names = 0;
        let refused = loop {
            let name = format!("user.{names:0>200}");
            match fs.setxattr(&c, g.ino(), name.as_bytes(), b"", XattrFlags::default()).await {
                Ok(()) => names += 1,
                Err(e) => break e,
            }
            assert!(names < 1000, "no bound on xattr names per inode");
        };
        assert_eq!(refused.errno(), libc::ENOSPC);
        let listed = fs.listxattr(g.ino()).await.unwrap();
        assert!(listed.len() <= 65536, "listxattr fits XATTR_LIST_MAX: {}", listed.len());
    });
}

#[test]
fn the_inode_count_is_bounded_and_refused_with_enospc() {
    use keelfs_fs::FsConfig;
    let dev = common::ram_device(32 * MIB);
    let mut r = common::busy_reactor();
    r.block_on(async move {
        common::format(&dev).await;
        let config = FsConfig { inodes_max: Some(100), ..FsConfig::default() };
        let fs = Fs::mount(common::channel(&dev), config).await.unwrap();
        let c = Creds::root();
        let mut made = 0;
        let refused = loop {
            match fs.mknod(&c, ROOT_INO, format!("n{made}").as_bytes(), libc::S_IFREG | 0o644, 0).await {
                Ok(_) => made += 1,
                Err(e) => break e,
            }
            assert!(made < 1000, "no bound on inodes");
        };
        assert_eq!(refused.errno(), libc::ENOSPC);
        assert_eq!(made, 99, "the root and 99 more");
        let s = fs.statfs().await.unwrap();
        assert_eq!((s.files, s.files_free), (100, 0));
        assert_eq!(fs.mkdir(&c, ROOT_INO, b"d", 0o755).await.err().map(|e| e.errno()), Some(libc::ENOSPC));
        // Unlinked and forgotten (mknod's reference and this lookup's), n0
        // is freed.
        let n0 = fs.lookup(&c, ROOT_INO, b"n0").await.unwrap().ino();
        fs.unlink(&c, ROOT_INO, b"n0").await.unwrap();
        fs.forget(n0, 2).await.unwrap();
        fs.mkdir(&c, ROOT_INO, b"d", 0o755).await.expect("room again once one is gone");
        fs.unmount().await.unwrap();
    });
}

#[test]
fn the_xattr_bytes_per_inode_limit_is_configurable() {
    let mut r = common::busy_reactor();
    let dev = common::ram_device(32 * MIB);
    r.block_on(async move {
        common::format(&dev).await;
        let config = keelfs_fs::FsConfig { xattr_bytes_per_inode_max: 8192, ..Default::default() };
        let fs = Fs::mount(common::channel(&dev), config).await.unwrap();
        let c = Creds::root();
        let (f, _) = fs.create(&c, ROOT_INO, b"x", 0o644, libc::O_RDWR as u32).await.unwrap();
        let value = vec![1u8; 3000];
        fs.setxattr(&c, f.ino(), b"user.a", &value, XattrFlags::default()).await.unwrap();
        fs.setxattr(&c, f.ino(), b"user.b", &value, XattrFlags::default()).await.unwrap();
        let refused = fs.setxattr(&c, f.ino(), b"user.c", &value, XattrFlags::default()).await.unwrap_err();
        assert_eq!(refused.errno(), libc::ENOSPC, "9 KiB is past the configured 8 KiB");
        fs.unmount().await.unwrap();
    });
}
