//! Snapshots (issue 37): a point-in-time, read-only image of the whole
//! filesystem that keeps its blocks while the live one goes on changing;
//! deleting it gives back what only it held; it survives a remount, fsck
//! checks it, and bad requests get errors.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{channel, check, mount, with_fs};
use keelfs_bdev::{AlignedBuf, BlockDevice};
use keelfs_fs::{Creds, FallocateMode, FileOffset, Fs, FsConfig, FsError, Ino, SetAttr, Timespec, ROOT_INO};

const BLOCK: usize = 4096;
const WHEN: Timespec = Timespec { sec: 1_764_000_000, nsec: 42 };

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed.wrapping_mul(37)).collect()
}

async fn read_all(fs: &Fs, ino: Ino) -> Vec<u8> {
    let size = fs.getattr(ino).await.unwrap().inode.size;
    fs.data().read(ino, FileOffset::new(0), size as u32).await.unwrap()
}

/// Every path under `dir` with its contents ("/" after a directory's).
fn tree<'a>(
    fs: &'a Fs,
    dir: Ino,
    prefix: String,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = BTreeMap<String, Vec<u8>>> + 'a>> {
    Box::pin(async move {
        let mut out = BTreeMap::new();
        for entry in fs.readdir(dir, 0, 10_000).await.unwrap() {
            let name = String::from_utf8_lossy(&entry.name).into_owned();
            if name == "." || name == ".." {
                continue;
            }
            let path = format!("{prefix}/{name}");
            let attr = fs.getattr(entry.ino).await.unwrap();
            if attr.inode.is_dir() {
                out.insert(format!("{path}/"), Vec::new());
                out.extend(tree(fs, entry.ino, path).await);
            } else {
                out.insert(path, read_all(fs, entry.ino).await);
            }
        }
        out
    })
}

async fn snapshot_mount(dev: &Arc<dyn BlockDevice>, name: &str) -> Result<Fs, FsError> {
    let config = FsConfig { read_only: true, snapshot: Some(name.into()), ..FsConfig::default() };
    Fs::mount(channel(dev), config).await
}

async fn snapshot_tree(dev: &Arc<dyn BlockDevice>, name: &str) -> BTreeMap<String, Vec<u8>> {
    let fs = snapshot_mount(dev, name).await.unwrap();
    let t = tree(&fs, ROOT_INO, String::new()).await;
    fs.unmount().await.unwrap();
    t
}

async fn create(fs: &Fs, parent: Ino, name: &str) -> Ino {
    let (attr, fh) = fs.create(&Creds::root(), parent, name.as_bytes(), 0o644, 2).await.unwrap();
    fs.release(fh).await.unwrap();
    attr.ino()
}

async fn write_direct(fs: &Fs, ino: Ino, at: u64, data: &[u8]) {
    let mut buf = AlignedBuf::zeroed(data.len(), if data.len().is_multiple_of(BLOCK) { BLOCK } else { 1 });
    buf.copy_from_slice(data);
    let (_, written) = fs.data().write_direct(ino, FileOffset::new(at), buf).await;
    assert_eq!(written.unwrap(), data.len() as u32);
}

/// A small tree: `a` (64 blocks and a partial one, buffered), `b` (16
/// blocks, direct), `d/c` (a few bytes) and `p` (preallocated, unwritten
/// past its first block).
async fn populate(fs: &Fs) -> (Ino, Ino, Ino, Ino) {
    let c = Creds::root();
    let a = create(fs, ROOT_INO, "a").await;
    fs.data().write(a, FileOffset::new(0), &pattern(1, 64 * BLOCK + 1234)).await.unwrap();
    let b = create(fs, ROOT_INO, "b").await;
    write_direct(fs, b, 0, &pattern(2, 16 * BLOCK)).await;
    let d = fs.mkdir(&c, ROOT_INO, b"d", 0o755).await.unwrap().ino();
    let dc = create(fs, d, "c").await;
    fs.data().write(dc, FileOffset::new(0), b"hello").await.unwrap();
    let p = create(fs, ROOT_INO, "p").await;
    let prealloc = FallocateMode::Allocate { keep_size: false };
    fs.data().fallocate(p, prealloc, FileOffset::new(0), 8 * BLOCK as u64).await.unwrap();
    fs.data().write(p, FileOffset::new(0), &pattern(3, BLOCK)).await.unwrap();
    (a, b, dc, p)
}

/// Change every file every way: buffered and direct overwrites (aligned
/// and not), an append, a truncate, a write into preallocated blocks, a
/// hole punched, an unlink and a new file.
async fn rewrite_everything(fs: &Fs, (a, b, dc, p): (Ino, Ino, Ino, Ino)) {
    let c = Creds::root();
    fs.data().write(a, FileOffset::new(100), &pattern(9, 40 * BLOCK)).await.unwrap();
    write_direct(fs, b, 4 * BLOCK as u64, &pattern(8, 2 * BLOCK)).await;
    write_direct(fs, b, 9 * BLOCK as u64 + 7, &pattern(7, 999)).await;
    fs.data().write(b, FileOffset::new(16 * BLOCK as u64), b"appended").await.unwrap();
    fs.data().write(dc, FileOffset::new(0), b"HELLO, world").await.unwrap();
    write_direct(fs, p, 2 * BLOCK as u64, &pattern(6, 2 * BLOCK)).await;
    let punch = FallocateMode::PunchHole;
    fs.data().fallocate(a, punch, FileOffset::new(50 * BLOCK as u64), 4 * BLOCK as u64).await.unwrap();
    let set = SetAttr { size: Some(3 * BLOCK as u64), ..SetAttr::default() };
    fs.setattr(&c, b, &set, false).await.unwrap();
    fs.unlink(&c, ROOT_INO, b"a").await.unwrap();
    let n = create(fs, ROOT_INO, "new").await;
    fs.data().write(n, FileOffset::new(0), &pattern(5, 10 * BLOCK)).await.unwrap();
    fs.sync().await.unwrap();
}

fn assert_sound(fs: &Fs) {
    fs.inspect().assert_invariants();
    fs.inspect().check_block_ownership().unwrap();
}

#[test]
fn a_snapshot_keeps_the_tree_as_it_was_while_the_live_one_changes() {
    with_fs(64 << 20, async |fs: Fs, dev| {
        let files = populate(&fs).await;
        // Not synced: the snapshot writes dirty pages back first.
        let before = tree(&fs, ROOT_INO, String::new()).await;
        fs.admin().snapshot_create("s1", WHEN).await.unwrap();
        assert_sound(&fs);
        let listed = fs.admin().snapshot_list();
        assert_eq!(listed.len(), 1);
        assert_eq!((listed[0].name.as_str(), listed[0].created), ("s1", WHEN));
        assert_eq!(snapshot_tree(&dev, "s1").await, before, "the snapshot is the tree when it was taken");
        rewrite_everything(&fs, files).await;
        assert_sound(&fs);
        let after = tree(&fs, ROOT_INO, String::new()).await;
        assert_ne!(after, before);
        assert_eq!(snapshot_tree(&dev, "s1").await, before, "no live write reached the snapshot");
        // A second snapshot of the changed tree, then both survive a
        // remount and fsck.
        fs.admin().snapshot_create("s2", WHEN).await.unwrap();
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.snapshots, 2);
        let fs = mount(&dev).await;
        assert_sound(&fs);
        let names: Vec<String> = fs.admin().snapshot_list().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["s1", "s2"]);
        assert_eq!(tree(&fs, ROOT_INO, String::new()).await, after);
        assert_eq!(snapshot_tree(&dev, "s1").await, before);
        assert_eq!(snapshot_tree(&dev, "s2").await, after);
        fs.unmount().await.unwrap();
    });
}

#[test]
fn deleting_a_snapshot_frees_what_only_it_held() {
    with_fs(64 << 20, async |fs: Fs, dev| {
        let c = Creds::root();
        let a = create(&fs, ROOT_INO, "a").await;
        fs.data().write(a, FileOffset::new(0), &pattern(1, 256 * BLOCK)).await.unwrap();
        fs.sync().await.unwrap();
        let free_before = fs.inspect().free_blocks();
        fs.admin().snapshot_create("s", WHEN).await.unwrap();
        let taken = free_before - fs.inspect().free_blocks();
        assert!(taken < 16, "a snapshot of a 256-block file took {taken} blocks: it must copy no data");
        assert_eq!(fs.admin().snapshot_list()[0].data_blocks, 256);
        let space = fs.inspect().snapshot_space();
        assert_eq!((space.snapshots, space.data_blocks), (1, 0), "the file still names every block");
        // The live file rewritten whole: every block is copied on write,
        // and the old ones now belong to the snapshot alone.
        write_direct(&fs, a, 0, &pattern(2, 256 * BLOCK)).await;
        fs.sync().await.unwrap();
        let exclusive = fs.admin().snapshot_list()[0].exclusive_blocks;
        assert!((256..256 + 16).contains(&exclusive), "the snapshot alone holds {exclusive} blocks");
        assert_eq!(fs.inspect().snapshot_space().data_blocks, 256, "only the snapshot names the old blocks");
        assert_sound(&fs);
        let free_held = fs.inspect().free_blocks();
        fs.admin().snapshot_delete("s").await.unwrap();
        fs.sync().await.unwrap();
        assert!(fs.admin().snapshot_list().is_empty());
        let freed = fs.inspect().free_blocks() - free_held;
        assert!(freed >= 256, "deleting it freed {freed} blocks");
        assert_sound(&fs);
        // The live file is the rewrite; overwriting it again is in place.
        assert_eq!(read_all(&fs, a).await, pattern(2, 256 * BLOCK));
        let free = fs.inspect().free_blocks();
        write_direct(&fs, a, 0, &pattern(3, 16 * BLOCK)).await;
        assert_eq!(fs.inspect().free_blocks(), free, "with no snapshot, an overwrite allocates nothing");
        assert!(matches!(snapshot_mount(&dev, "s").await, Err(FsError::NotFound)));
        fs.unlink(&c, ROOT_INO, b"a").await.unwrap();
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.snapshots, 0);
    });
}

#[test]
fn a_file_deleted_after_the_snapshot_keeps_its_blocks_until_the_snapshot_goes() {
    with_fs(64 << 20, async |fs: Fs, dev| {
        let c = Creds::root();
        let a = create(&fs, ROOT_INO, "a").await;
        fs.data().write(a, FileOffset::new(0), &pattern(4, 128 * BLOCK)).await.unwrap();
        fs.admin().snapshot_create("keep", WHEN).await.unwrap();
        let free = fs.inspect().free_blocks();
        fs.unlink(&c, ROOT_INO, b"a").await.unwrap();
        fs.sync().await.unwrap();
        assert!(fs.inspect().free_blocks() < free + 128, "the unlink freed blocks the snapshot holds");
        assert_sound(&fs);
        let snap = snapshot_tree(&dev, "keep").await;
        assert_eq!(snap.get("/a"), Some(&pattern(4, 128 * BLOCK)));
        // Remounted, the counts come back from the table.
        fs.unmount().await.unwrap();
        let fs = mount(&dev).await;
        assert_sound(&fs);
        fs.admin().snapshot_delete("keep").await.unwrap();
        fs.sync().await.unwrap();
        assert!(fs.inspect().free_blocks() >= free + 128, "the snapshot's blocks came back");
        assert_sound(&fs);
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

#[test]
fn snapshot_requests_that_cannot_be_met_get_errors() {
    with_fs(64 << 20, async |fs: Fs, dev| {
        let admin = fs.admin();
        for bad in ["", ".x", "a/b", "a b", &"n".repeat(65)] {
            assert!(matches!(admin.snapshot_create(bad, WHEN).await, Err(FsError::Invalid(_))), "{bad:?}");
        }
        admin.snapshot_create("one", WHEN).await.unwrap();
        assert!(matches!(admin.snapshot_create("one", WHEN).await, Err(FsError::Exists)));
        assert!(matches!(admin.snapshot_delete("two").await, Err(FsError::NotFound)));
        for i in 1..keelfs_fs::SNAPSHOTS_MAX {
            admin.snapshot_create(&format!("n{i}"), WHEN).await.unwrap();
        }
        assert!(matches!(admin.snapshot_create("over", WHEN).await, Err(FsError::NoSpace)));
        assert_sound(&fs);
        // A snapshot mounts only read-only, and only if it exists.
        let writable = FsConfig { snapshot: Some("one".into()), ..FsConfig::default() };
        assert!(matches!(Fs::mount(channel(&dev), writable).await, Err(FsError::Invalid(_))));
        assert!(matches!(snapshot_mount(&dev, "none").await, Err(FsError::NotFound)));
        let snap = snapshot_mount(&dev, "one").await.unwrap();
        assert!(matches!(snap.admin().snapshot_create("x", WHEN).await, Err(FsError::ReadOnly)));
        let c = Creds::root();
        assert!(matches!(snap.create(&c, ROOT_INO, b"f", 0o644, 2).await, Err(FsError::ReadOnly)));
        snap.unmount().await.unwrap();
        for i in 1..keelfs_fs::SNAPSHOTS_MAX {
            admin.snapshot_delete(&format!("n{i}")).await.unwrap();
        }
        fs.unmount().await.unwrap();
        let report = check(&dev).await;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.snapshots, 1);
    });
}

/// A damaged snapshot table or snapshot checkpoint is found: fsck reports
/// it and mount refuses the image, with a message and never a panic (a
/// table that cannot be read could name blocks the live files would
/// reuse, so the image is not served without it).
#[test]
fn damage_to_a_snapshot_table_or_checkpoint_is_reported_not_served() {
    let mut r = common::busy_reactor();
    let ram = Arc::new(keelfs_bdev::MappedDevice::ram(16 << 20, 4096).unwrap());
    let dev: Arc<dyn BlockDevice> = ram.clone();
    let sb = r.block_on(async move {
        common::format(&dev).await;
        let fs = mount(&dev).await;
        populate(&fs).await;
        fs.admin().snapshot_create("old", WHEN).await.unwrap();
        let n = create(&fs, ROOT_INO, "later").await;
        fs.data().write(n, FileOffset::new(0), b"later").await.unwrap();
        fs.admin().snapshot_create("new", WHEN).await.unwrap();
        fs.admin().checkpoint().await.unwrap();
        fs.unmount().await.unwrap();
        fs.inspect().superblock()
    });
    let image = ram.snapshot();
    assert!(!sb.snapshot_table.is_empty());
    let mut s = keelfs_base::testing::test_seed("KEELFS_DAMAGE_SEED", "snapshot damage");
    for case in 0..40 {
        let mut damaged = image.clone();
        let run = sb.snapshot_table[0];
        let at = (run.start * 4096 + keelfs_base::testing::splitmix64(&mut s) % 256) as usize;
        damaged[at] ^= 1 << (keelfs_base::testing::splitmix64(&mut s) % 8);
        let ram = keelfs_bdev::MappedDevice::ram(16 << 20, 4096).unwrap();
        ram.restore(&damaged);
        let dev: Arc<dyn BlockDevice> = Arc::new(ram);
        r.block_on(async move {
            let report = check(&dev).await;
            assert!(report.problems.iter().any(|p| p.kind == "snapshots"), "case {case}: {report:?}");
            let refused = Fs::mount(channel(&dev), FsConfig::default()).await.err().map(|e| e.to_string());
            assert!(refused.is_some_and(|m| m.contains("snapshot table")), "case {case}: a damaged table mounted");
        });
    }
}
