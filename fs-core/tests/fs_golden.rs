//! A golden record of what a fixed workload leaves behind, for the
//! refactors that split `Fs` into parts (docs/plans/fs-parts.md): each is
//! meant to change no behaviour, and this test says whether one did.
//!
//! The workload runs on a RAM device with a manual file clock, timers
//! that never fire and a journal it cannot half fill, so everything it
//! records is a function of the code alone: the tree with every inode's
//! attributes, xattrs, link targets, extent counts and a checksum of its
//! data; the counters; and the superblock (all but its random uuid).
//! The record is compared with `tests/golden/fs_golden.txt`.
//!
//! A change that is meant to change behaviour (another allocation
//! policy, say) changes the record too. Then write the new one with
//! `KEELFS_GOLDEN_RECORD=1 cargo test -p keelfs-fs --test fs_golden`,
//! read its diff, and commit it with the change that explains it.

mod common;

use keelfs_fs::FileOffset;
use std::fmt::Write as _;
use std::time::Duration;

use common::{busy_reactor, ram_device};
use keelfs_fs::{crc, Creds, FallocateMode, FileClock, Fs, FsConfig, Ino, ManualClock, RenameMode, SetAttr};
use keelfs_fs::{mkfs, MkfsOptions, Timespec, XattrFlags, ROOT_INO};

const MIB: u64 = 1 << 20;
const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/fs_golden.txt");

/// Bytes that differ by position and by seed, so that a block written to
/// the wrong place shows in the checksum.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The config of every mount: a manual clock, and timers that never fire
/// within the test, so that only the workload decides what happens.
fn config(clock: &std::sync::Arc<ManualClock>) -> FsConfig {
    let day = Duration::from_secs(86_400);
    FsConfig {
        file_clock: FileClock::Manual(clock.clone()),
        commit_interval: day,
        writeback_interval: day,
        ..FsConfig::default()
    }
}

/// Namespace changes of every kind: directories, files, links, renames
/// (plain, replacing, exchanging), removals, xattrs and attributes.
async fn namespace_work(fs: &Fs, clock: &ManualClock) {
    let c = Creds::root();
    let tick = || clock.advance(Duration::from_millis(1500));
    let src = fs.mkdir(&c, ROOT_INO, b"src", 0o755).await.unwrap().ino();
    let docs = fs.mkdir(&c, ROOT_INO, b"docs", 0o750).await.unwrap().ino();
    for i in 0..40u32 {
        tick();
        let (f, fh) = fs.create(&c, src, format!("f{i:02}").as_bytes(), 0o644, libc::O_RDWR as u32).await.unwrap();
        fs.data().write(f.ino(), FileOffset::new(0), &pattern(i as u8, 100 + 97 * i as usize)).await.unwrap();
        fs.release(fh).await.unwrap();
    }
    fs.symlink(&c, docs, b"link", b"../src/f01").await.unwrap();
    let f02 = fs.lookup(&c, src, b"f02").await.unwrap().ino();
    fs.link(&c, f02, docs, b"hard").await.unwrap();
    tick();
    fs.rename(&c, src, b"f03", docs, b"moved", RenameMode::Replace).await.unwrap();
    fs.rename(&c, src, b"f04", src, b"f05", RenameMode::Replace).await.unwrap();
    fs.rename(&c, src, b"f06", src, b"f07", RenameMode::Exchange).await.unwrap();
    for i in (10..40u32).step_by(3) {
        fs.unlink(&c, src, format!("f{i:02}").as_bytes()).await.unwrap();
    }
    tick();
    let f08 = fs.lookup(&c, src, b"f08").await.unwrap().ino();
    fs.setxattr(&c, f08, b"user.tag", b"golden", XattrFlags::default()).await.unwrap();
    fs.setxattr(&c, src, b"user.dir", &[7u8; 300], XattrFlags::default()).await.unwrap();
    let set = SetAttr { mode: Some(0o600), uid: Some(1000), gid: Some(100), ..SetAttr::default() };
    fs.setattr(&c, f08, &set, false).await.unwrap();
    let empty = fs.mkdir(&c, docs, b"empty", 0o700).await.unwrap().ino();
    fs.rmdir(&c, docs, b"empty").await.unwrap();
    fs.forget(empty, 1).await.unwrap();
}

/// Data through each path: buffered writes and overwrites, a direct
/// write and an extending one, truncates both ways, and fallocate.
async fn data_work(fs: &Fs, clock: &ManualClock) {
    let c = Creds::root();
    let big = fs.mkdir(&c, ROOT_INO, b"data", 0o755).await.unwrap().ino();
    let (f, fh) = fs.create(&c, big, b"buffered", 0o644, libc::O_RDWR as u32).await.unwrap();
    for step in 0..16u64 {
        clock.advance(Duration::from_millis(700));
        fs.data().write(f.ino(), FileOffset::new(step * 200_000), &pattern(step as u8, 150_000)).await.unwrap();
    }
    fs.data().write(f.ino(), FileOffset::new(1_000_000), &pattern(99, 10_000)).await.unwrap();
    fs.release(fh).await.unwrap();
    let (d, dh) = fs.create(&c, big, b"direct", 0o644, (libc::O_RDWR | libc::O_DIRECT) as u32).await.unwrap();
    let mut block = keelfs_bdev::AlignedBuf::zeroed(8 * MIB as usize, 4096);
    block.copy_from_slice(&pattern(5, 8 * MIB as usize));
    let (block, written) = fs.data().write_direct(d.ino(), FileOffset::new(0), block).await;
    assert_eq!(written.unwrap(), 8 * MIB as u32);
    let (_, overwritten) = fs.data().write_direct(d.ino(), FileOffset::new(4 * MIB), block).await;
    assert_eq!(overwritten.unwrap(), 8 * MIB as u32);
    fs.release(dh).await.unwrap();
    fs.setattr(&c, d.ino(), &SetAttr { size: Some(5 * MIB + 123), ..SetAttr::default() }, false).await.unwrap();
    let (s, sh) = fs.create(&c, big, b"sparse", 0o644, libc::O_RDWR as u32).await.unwrap();
    fs.data()
        .fallocate(s.ino(), FallocateMode::Allocate { keep_size: false }, FileOffset::new(0), 2 * MIB)
        .await
        .unwrap();
    fs.data().write(s.ino(), FileOffset::new(MIB / 2), &pattern(3, 5000)).await.unwrap();
    fs.data().fallocate(s.ino(), FallocateMode::PunchHole, FileOffset::new(MIB), 64 * 1024).await.unwrap();
    fs.setattr(&c, s.ino(), &SetAttr { size: Some(3 * MIB), ..SetAttr::default() }, false).await.unwrap();
    fs.release(sh).await.unwrap();
}

fn time(t: Timespec) -> String {
    let (sec, nsec) = (t.sec, t.nsec);
    format!("{sec}.{nsec:09}")
}

/// One line per inode, depth first from the root, in name order.
async fn dump_tree(fs: &Fs, out: &mut String) {
    let mut dirs = vec![(String::from("/"), ROOT_INO)];
    while let Some((path, dir)) = dirs.pop() {
        dump_inode(fs, &path, dir, out).await;
        let mut entries = fs.readdir(dir, 0, usize::MAX).await.unwrap();
        entries.retain(|e| e.name.as_slice() != b"." && e.name.as_slice() != b"..");
        entries.sort_by(|a, b| b.name.cmp(&a.name));
        for e in entries {
            let child = format!("{path}{}", String::from_utf8_lossy(&e.name));
            if e.file_type == libc::S_IFDIR {
                dirs.push((format!("{child}/"), e.ino));
            } else {
                dump_inode(fs, &child, e.ino, out).await;
            }
        }
    }
}

async fn dump_inode(fs: &Fs, path: &str, ino: Ino, out: &mut String) {
    let a = fs.getattr(ino).await.unwrap();
    let i = &a.inode;
    write!(
        out,
        "{path} ino={} mode={:o} nlink={} uid={} gid={} size={} blocks={} extents={} a={} m={} c={} b={}",
        i.ino,
        i.mode,
        i.nlink,
        i.uid,
        i.gid,
        i.size,
        a.blocks_512,
        fs.inspect().extent_count(ino).unwrap(),
        time(i.atime),
        time(i.mtime),
        time(i.ctime),
        time(i.btime),
    )
    .unwrap();
    if i.mode & libc::S_IFMT == libc::S_IFREG {
        let data = fs.data().read(ino, FileOffset::new(0), u32::try_from(i.size).expect("small files")).await.unwrap();
        write!(out, " crc={:08x}", crc(&data)).unwrap();
    }
    if i.mode & libc::S_IFMT == libc::S_IFLNK {
        write!(out, " target={}", String::from_utf8_lossy(&fs.readlink(ino).await.unwrap())).unwrap();
    }
    let names = fs.listxattr(ino).await.unwrap();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let value = fs.getxattr(&Creds::root(), ino, name).await.unwrap();
        write!(out, " xattr:{}={:08x}", String::from_utf8_lossy(name), crc(&value)).unwrap();
    }
    out.push('\n');
}

fn dump_state(fs: &Fs, out: &mut String) {
    let sb = fs.inspect().superblock();
    writeln!(
        out,
        "superblock generation={} total_blocks={} journal_blocks={} groups={} journal_start={} journal_seq={} \
         checkpoint_seq={} checkpoint_bytes={} checkpoint_extents={:?} features={}",
        sb.generation,
        sb.total_blocks,
        sb.journal_blocks,
        sb.allocation_groups,
        sb.journal_start,
        sb.journal_seq,
        sb.checkpoint_seq,
        sb.checkpoint_bytes,
        sb.checkpoint_extents,
        sb.features
    )
    .unwrap();
    writeln!(out, "free_blocks={}", fs.inspect().free_blocks()).unwrap();
    writeln!(out, "counters {:?}", fs.inspect().counters()).unwrap();
    fs.inspect().check_block_ownership().expect("every block has one owner");
}

/// The workload, with a sync and a remount in the middle and the record
/// taken before the final unmount.
fn record() -> String {
    let dev = ram_device(64 * MIB);
    busy_reactor().block_on(async move {
        let clock = ManualClock::new(Timespec { sec: 1_600_000_000, nsec: 0 });
        // A journal the workload cannot half fill: a checkpoint scheduled
        // in the background would interleave with it by device timing.
        let file_clock = FileClock::Manual(clock.clone());
        let options = MkfsOptions { force: true, journal_blocks: 4096, file_clock, ..MkfsOptions::default() };
        mkfs(common::channel(&dev), &options).await.unwrap();
        let fs = Fs::mount(common::channel(&dev), config(&clock)).await.unwrap();
        namespace_work(&fs, &clock).await;
        fs.sync().await.unwrap();
        fs.unmount().await.unwrap();
        let fs = Fs::mount(common::channel(&dev), config(&clock)).await.unwrap();
        data_work(&fs, &clock).await;
        fs.sync().await.unwrap();
        let mut out = String::new();
        dump_tree(&fs, &mut out).await;
        dump_state(&fs, &mut out);
        fs.unmount().await.unwrap();
        assert!(common::check(&dev).await.is_clean(), "fsck after the workload");
        out
    })
}

#[test]
fn a_fixed_workload_leaves_the_recorded_filesystem() {
    let got = record();
    assert_eq!(record(), got, "the workload is not deterministic: two runs differ");
    if std::env::var_os("KEELFS_GOLDEN_RECORD").is_some() {
        std::fs::create_dir_all(std::path::Path::new(GOLDEN).parent().unwrap()).unwrap();
        std::fs::write(GOLDEN, &got).unwrap();
        eprintln!("fs_golden: wrote {GOLDEN}");
        return;
    }
    let want = std::fs::read_to_string(GOLDEN)
        .unwrap_or_else(|e| panic!("{GOLDEN}: {e}; write it with KEELFS_GOLDEN_RECORD=1 (see this file's comment)"));
    for (n, (w, g)) in want.lines().zip(got.lines()).enumerate() {
        assert_eq!(g, w, "line {} of the record differs from {GOLDEN}", n + 1);
    }
    assert_eq!(got.lines().count(), want.lines().count(), "the record has another number of lines");
}
