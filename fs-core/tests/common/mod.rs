#![allow(dead_code)]

use std::path::PathBuf;

/// A scratch file removed on drop; in /dev/shm when it exists (RAM-backed,
/// O_DIRECT capable), else the temp dir.
pub struct ScratchFile {
    pub path: PathBuf,
}

impl ScratchFile {
    pub fn new(tag: &str, len: u64) -> Self {
        let dir =
            if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let path = dir.join(format!("keelfs-test-{tag}-{}-{}", std::process::id(), unique()));
        let f = std::fs::File::create(&path).expect("create scratch file");
        f.set_len(len).expect("size scratch file");
        Self { path }
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// A byte pattern that differs per (seed, position), so misplaced data shows.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (seed.wrapping_mul(31).wrapping_add(i as u64 / 7) ^ (i as u64 >> 9)) as u8;
    }
}

use std::sync::Arc;

use keelfs_core::bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_core::fs::fsck::{fsck, FsckReport};
use keelfs_core::fs::mkfs::{mkfs, MkfsOptions};
use keelfs_core::fs::{Fs, FsConfig};
use keelfs_core::reactor::io::DeviceChannel;
use keelfs_core::reactor::{PollMode, Reactor, ReactorConfig};

pub fn busy_reactor() -> Reactor {
    Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).expect("reactor")
}

pub fn ram_device(bytes: u64) -> Arc<dyn BlockDevice> {
    Arc::new(MappedDevice::ram(bytes, 4096).expect("ram device"))
}

/// A channel to `dev` on the current reactor.
pub fn channel(dev: &Arc<dyn BlockDevice>) -> DeviceChannel {
    DeviceChannel::attach(dev.open_queue(QueueConfig { depth: 64, completion_eventfd: false }).expect("queue"))
}

pub async fn format(dev: &Arc<dyn BlockDevice>) {
    mkfs(channel(dev), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.expect("mkfs");
}

pub async fn mount(dev: &Arc<dyn BlockDevice>) -> Fs {
    Fs::mount(channel(dev), FsConfig::default()).await.expect("mount")
}

pub async fn check(dev: &Arc<dyn BlockDevice>) -> FsckReport {
    fsck(channel(dev), |_| {}).await.expect("fsck ran")
}
