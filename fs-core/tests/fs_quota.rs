//! Per-filesystem quotas: EDQUOT when the quota rather than the device
//! binds, df showing the quota as the size, and room coming back.

mod common;

use keelfs_fs::FileOffset;
use std::sync::Arc;

use common::{check, with_fs};
use keelfs_bdev::{AlignedBuf, BlockDevice};
use keelfs_fs::{Creds, FallocateMode, Fs, FsError, Quota, SetAttr, ROOT_INO};

const MIB: u64 = 1 << 20;

/// Write `bytes` to a new file named `name` in 256 KiB buffered writes and
/// return its inode, or the first error. The file is closed and forgotten
/// (as the kernel would), so that unlinking it frees it.
async fn fill(fs: &Fs, name: &str, bytes: u64) -> Result<keelfs_fs::Ino, FsError> {
    let (f, fh) = fs.create(&Creds::root(), ROOT_INO, name.as_bytes(), 0o644, 2).await?;
    let chunk = vec![0x5a; 256 << 10];
    let mut at = 0;
    let mut result = Ok(());
    while at < bytes && result.is_ok() {
        result = fs.data().write(f.ino(), FileOffset::new(at), &chunk).await.map(|_| ());
        at += chunk.len() as u64;
    }
    if result.is_ok() {
        result = fs.sync().await;
    }
    fs.release(fh).await?;
    fs.forget(f.ino(), 1).await?;
    result.map(|()| f.ino())
}

#[test]
fn the_byte_quota_gives_edquot_and_is_the_size_df_shows() {
    with_fs(64 * MIB, async |fs: Fs, dev: Arc<dyn BlockDevice>| {
        let c = Creds::root();
        let before = fs.statfs().await.unwrap();
        fs.admin().set_quota(Quota { bytes: Some(8 * MIB), inodes: None }).unwrap();
        assert_eq!(fs.admin().quota(), Quota { bytes: Some(8 * MIB), inodes: None });
        let st = fs.statfs().await.unwrap();
        assert_eq!(st.blocks, 8 * MIB / 4096, "df shows the quota as the size");
        assert!(st.blocks_free < st.blocks && st.blocks_free > st.blocks - 64, "{st:?}");
        assert!(before.blocks > st.blocks);

        // Buffered: the delalloc reservation is refused.
        assert_eq!(fill(&fs, "big", 16 * MIB).await.err(), Some(FsError::Quota));
        assert!(fs.statfs().await.unwrap().blocks_free < 64, "the quota is (nearly) all used");
        // Direct and fallocate hit it too.
        let (g, _) = fs.create(&c, ROOT_INO, b"direct", 0o644, 2).await.unwrap();
        let (_, r) = fs.data().write_direct(g.ino(), FileOffset::new(0), AlignedBuf::zeroed(MIB as usize, 4096)).await;
        assert_eq!(r.err(), Some(FsError::Quota));
        // Unaligned, through the copying path (write_image), as well.
        let (_, r) = fs.data().write_direct(g.ino(), FileOffset::new(100), AlignedBuf::zeroed(MIB as usize, 512)).await;
        assert_eq!(r.err(), Some(FsError::Quota));
        assert_eq!(
            fs.data()
                .fallocate(g.ino(), FallocateMode::Allocate { keep_size: false }, FileOffset::new(0), MIB)
                .await
                .err(),
            Some(FsError::Quota)
        );
        assert_eq!(FsError::Quota.errno(), libc::EDQUOT);

        // Raising the quota at runtime lets writes go on.
        fs.admin().set_quota(Quota { bytes: Some(32 * MIB), inodes: None }).unwrap();
        let big2 = fill(&fs, "big2", 16 * MIB).await.unwrap();
        assert_eq!(fs.statfs().await.unwrap().blocks, 32 * MIB / 4096);

        // Lowered below use: unlink, truncate and overwrites still work.
        fs.admin().set_quota(Quota { bytes: Some(4 * MIB), inodes: None }).unwrap();
        let data = vec![0xa5; 64 << 10];
        assert_eq!(
            fs.data().write(big2, FileOffset::new(0), &data).await.unwrap() as usize,
            data.len(),
            "overwrite in place"
        );
        fs.sync().await.unwrap();
        let (_, r) = fs.data().write_direct(big2, FileOffset::new(MIB), AlignedBuf::zeroed(MIB as usize, 4096)).await;
        assert_eq!(r.unwrap(), MIB as u32, "a direct overwrite of allocated blocks");
        fs.setattr(&c, big2, &SetAttr { size: Some(MIB), ..Default::default() }, false).await.unwrap();
        assert_eq!(fs.data().write(big2, FileOffset::new(8 * MIB), &data).await.err(), Some(FsError::Quota));
        fs.unlink(&c, ROOT_INO, b"big").await.unwrap();
        fs.unlink(&c, ROOT_INO, b"big2").await.unwrap();
        // Deleting frees room: the frees commit on the EDQUOT retry, no
        // sync needed.
        fill(&fs, "small", 2 * MIB).await.unwrap();
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn the_device_binds_with_enospc_when_the_quota_is_larger() {
    with_fs(16 * MIB, async |fs: Fs, _dev: Arc<dyn BlockDevice>| {
        fs.admin().set_quota(Quota { bytes: Some(1 << 40), inodes: Some(1 << 30) }).unwrap();
        let st = fs.statfs().await.unwrap();
        assert!(st.blocks < 16 * MIB / 4096, "the device is smaller than the quota: {st:?}");
        assert_eq!(fill(&fs, "big", 32 * MIB).await.err(), Some(FsError::NoSpace));
    });
}

#[test]
fn the_inode_quota_gives_edquot_and_caps_df() {
    with_fs(64 * MIB, async |fs: Fs, _dev: Arc<dyn BlockDevice>| {
        let c = Creds::root();
        fs.admin().set_quota(Quota { bytes: None, inodes: Some(10) }).unwrap();
        let st = fs.statfs().await.unwrap();
        assert_eq!((st.files, st.files_free), (10, 9), "the root uses one");
        for i in 0..9 {
            fs.mkdir(&c, ROOT_INO, format!("d{i}").as_bytes(), 0o755).await.unwrap();
        }
        assert_eq!(fs.mkdir(&c, ROOT_INO, b"x", 0o755).await.err(), Some(FsError::Quota));
        assert_eq!(fs.create(&c, ROOT_INO, b"x", 0o644, 2).await.err(), Some(FsError::Quota));
        assert_eq!(fs.tmpfile(&c, ROOT_INO, 0o644, 2).await.err(), Some(FsError::Quota));
        assert_eq!(fs.statfs().await.unwrap().files_free, 0);
        let d0 = fs.lookup(&c, ROOT_INO, b"d0").await.unwrap().ino();
        fs.rmdir(&c, ROOT_INO, b"d0").await.unwrap();
        fs.forget(d0, 2).await.unwrap(); // mkdir's lookup and lookup's
        fs.mkdir(&c, ROOT_INO, b"x", 0o755).await.unwrap();
        fs.admin().set_quota(Quota::default()).unwrap();
        fs.mkdir(&c, ROOT_INO, b"y", 0o755).await.unwrap();
        assert!(fs.statfs().await.unwrap().files > 1000);
    });
}
