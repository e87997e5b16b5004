//! A read-only mount (issue 17): a journal left by a crash is replayed in
//! memory only, every change fails with EROFS, reads work, and the image's
//! bytes are the same afterwards.

mod common;

use keelfs_fs::FileOffset;
use std::sync::Arc;

use common::{busy_reactor, channel, format, mount};
use keelfs_bdev::{BlockDevice, MappedDevice};
use keelfs_fs::ROOT_INO;
use keelfs_fs::{Creds, Fs, FsConfig, FsError, SetAttr};
use keelfs_fs::{FallocateMode, RenameMode, XattrFlags};

const BYTES: u64 = 32 << 20;

#[test]
fn a_read_only_mount_changes_nothing_and_refuses_every_change() {
    let mut r = busy_reactor();
    let ram = Arc::new(MappedDevice::ram(BYTES, 4096).unwrap());
    let dev: Arc<dyn BlockDevice> = ram.clone();
    // A filesystem whose last changes are only in the journal: committed
    // by sync, never checkpointed (as after a crash).
    let d2 = dev.clone();
    r.block_on(async move {
        format(&d2).await;
        let fs = mount(&d2).await;
        let c = Creds::root();
        let dir = fs.mkdir(&c, ROOT_INO, b"dir", 0o755).await.unwrap().ino();
        fs.mkdir(&c, ROOT_INO, b"empty", 0o755).await.unwrap();
        let (f, _) = fs.create(&c, dir, b"file", 0o644, libc::O_RDWR as u32).await.unwrap();
        fs.data().write(f.ino(), FileOffset::new(0), b"journalled").await.unwrap();
        fs.setxattr(&c, f.ino(), b"user.k", b"v", XattrFlags::default()).await.unwrap();
        fs.sync().await.unwrap();
    });
    let before = ram.snapshot();
    let d3 = dev.clone();
    r.block_on(async move {
        let config = FsConfig { read_only: true, ..FsConfig::default() };
        let fs = Fs::mount(channel(&d3), config).await.unwrap();
        let c = Creds::root();
        // What the journal held is there, replayed in memory.
        let dir = fs.lookup(&c, ROOT_INO, b"dir").await.unwrap().ino();
        let file = fs.lookup(&c, dir, b"file").await.unwrap().ino();
        assert_eq!(fs.data().read(file, FileOffset::new(0), 100).await.unwrap(), b"journalled");
        assert_eq!(fs.getxattr(&c, file, b"user.k").await.unwrap(), b"v");
        fs.data().fsync(file, false).await.unwrap();
        fs.sync().await.unwrap();

        let refused = |what: &str, r: Result<(), FsError>| {
            assert!(matches!(r, Err(FsError::ReadOnly)), "{what}: {r:?}");
        };
        refused("create", fs.create(&c, dir, b"new", 0o644, 0).await.map(drop));
        refused("mkdir", fs.mkdir(&c, dir, b"d", 0o755).await.map(drop));
        refused("mknod", fs.mknod(&c, dir, b"n", libc::S_IFREG | 0o644, 0).await.map(drop));
        refused("symlink", fs.symlink(&c, dir, b"s", b"file").await.map(drop));
        refused("link", fs.link(&c, file, dir, b"l").await.map(drop));
        refused("unlink", fs.unlink(&c, dir, b"file").await);
        refused("rmdir", fs.rmdir(&c, ROOT_INO, b"empty").await);
        refused("rename", fs.rename(&c, dir, b"file", dir, b"moved", RenameMode::Replace).await);
        let chmod = SetAttr { mode: Some(0o600), ..SetAttr::default() };
        refused("setattr", fs.setattr(&c, file, &chmod, false).await.map(drop));
        let truncate = SetAttr { size: Some(0), ..SetAttr::default() };
        refused("truncate", fs.setattr(&c, file, &truncate, false).await.map(drop));
        refused("write", fs.data().write(file, FileOffset::new(0), b"x").await.map(drop));
        refused(
            "fallocate",
            fs.data().fallocate(file, FallocateMode::Allocate { keep_size: false }, FileOffset::new(0), 4096).await,
        );
        refused("setxattr", fs.setxattr(&c, file, b"user.k2", b"v", XattrFlags::default()).await);
        refused("removexattr", fs.removexattr(&c, file, b"user.k").await);
        refused("checkpoint", fs.admin().checkpoint().await);
        assert_eq!(FsError::ReadOnly.errno(), libc::EROFS);
        fs.unmount().await.unwrap();
    });
    assert!(ram.snapshot() == before, "a read-only mount changed the image");
}

#[test]
fn read_only_devices_refuse_writes() {
    use keelfs_bdev::{AlignedBuf, BdevError, IoRequest, QueueConfig, UringDevice, UringOptions};
    let path = std::env::temp_dir().join(format!("keelfs-ro-{}", std::process::id()));
    std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
    let uring: Arc<dyn BlockDevice> =
        Arc::new(UringDevice::open(&path, UringOptions { read_only: true, ..UringOptions::default() }).unwrap());
    let pmem: Arc<dyn BlockDevice> = Arc::new(MappedDevice::pmem_with(&path, 4096, true).unwrap());
    for dev in [uring, pmem] {
        assert!(dev.read_only());
        let mut q = dev.open_queue(QueueConfig { depth: 4, completion_eventfd: false }).unwrap();
        let mut buf = AlignedBuf::zeroed(4096, 4096);
        let iov = [buf.iovec()];
        // SAFETY: the buffer outlives the (refused) request.
        let refused = unsafe { q.submit(&IoRequest::write(1, 0, &iov)) };
        assert!(matches!(refused, Err(BdevError::ReadOnly)), "{}: {refused:?}", dev.name());
    }
    std::fs::remove_file(&path).unwrap();
}
