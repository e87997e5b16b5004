//! Requests whose cost a client chooses are bounded by what the filesystem
//! holds, not by the numbers in the request: a guest must not be able to
//! stall a reactor (and every export on it) with one request.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::with_fs;
use keelfs_core::bdev::BlockDevice;
use keelfs_core::fs::format::ROOT_INO;
use keelfs_core::fs::{Creds, Fs};

const MIB: u64 = 1 << 20;
/// The largest range a request may name (MAX_FILE_BYTES).
const HUGE: u64 = 1 << 52;
const KEEP_SIZE: u32 = 0x01;
const PUNCH_HOLE: u32 = 0x02;
const ZERO_RANGE: u32 = 0x10;

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
            let ino = f.inode.ino;
            fs.write(ino, 0, &vec![0xaa; 3 * 4096]).await.unwrap();
            fs.write(ino, 1 << 40, b"far").await.unwrap();
            fs.fallocate(ino, PUNCH_HOLE | KEEP_SIZE, 4096, HUGE - 4096).await.unwrap();
            let data = fs.read(ino, 0, 3 * 4096).await.unwrap();
            assert!(data[..4096].iter().all(|&b| b == 0xaa), "before the hole: kept");
            assert!(data[4096..].iter().all(|&b| b == 0), "inside the hole: zeros");
            assert!(fs.read(ino, 1 << 40, 3).await.unwrap().iter().all(|&b| b == 0));
            // Zeroing the same range would reserve 2^40 blocks: refused as
            // ENOSPC, quickly, after the zeroing itself.
            fs.write(ino, 8192, b"again").await.unwrap();
            let zeroed = fs.fallocate(ino, ZERO_RANGE | KEEP_SIZE, 4096, HUGE - 4096).await;
            assert_eq!(zeroed.err().map(|e| e.errno()), Some(libc::ENOSPC));
        });
    });
}
