//! Clones through copy_file_range and copy on write (issue 37): whole
//! blocks are shared, not copied; every way of writing either copy leaves
//! the other as it was; space comes back with a block's last name only;
//! and the counts come back the same from the image.

mod common;

use std::sync::Arc;

use common::{check, mount, with_fs};
use keelfs_bdev::{AlignedBuf, BlockDevice};
use keelfs_fs::{Creds, FallocateMode, FileOffset, Fs, Ino, SetAttr, ROOT_INO};

const BLOCK: usize = 4096;
/// The source: 64 blocks and a partial one.
const SOURCE_BYTES: usize = 64 * BLOCK + 1234;
/// Feature bit 1, shared extents (docs/FORMAT.md).
const SHARED_EXTENTS: u64 = 1 << 1;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed.wrapping_mul(37)).collect()
}

async fn read_all(fs: &Fs, ino: Ino) -> Vec<u8> {
    let size = fs.getattr(ino).await.unwrap().inode.size;
    fs.data().read(ino, FileOffset::new(0), size as u32).await.unwrap()
}

/// `a` with SOURCE_BYTES of pattern 1 on the device, and an empty `b`.
async fn source_and_empty(fs: &Fs) -> (Ino, Ino) {
    let c = Creds::root();
    let (a, a_handle) = fs.create(&c, ROOT_INO, b"a", 0o644, 2).await.unwrap();
    let (b, b_handle) = fs.create(&c, ROOT_INO, b"b", 0o644, 2).await.unwrap();
    fs.release(a_handle).await.unwrap();
    fs.release(b_handle).await.unwrap();
    fs.data().write(a.ino(), FileOffset::new(0), &pattern(1, SOURCE_BYTES)).await.unwrap();
    fs.data().fsync(a.ino(), false).await.unwrap();
    (a.ino(), b.ino())
}

async fn clone_all(fs: &Fs, a: Ino, b: Ino) {
    let len = SOURCE_BYTES as u64;
    let copied = fs.data().copy_range(a, FileOffset::new(0), b, FileOffset::new(0), len).await.unwrap();
    assert_eq!(copied, len);
}

/// fsck finds the image clean, and a mount counts the same shared blocks.
async fn clean_and_counted(fs: Fs, dev: &Arc<dyn BlockDevice>) -> Fs {
    let shared = fs.inspect().shared_blocks();
    fs.unmount().await.unwrap();
    let report = check(dev).await;
    assert!(report.is_clean(), "{report:?}");
    let fs = mount(dev).await;
    assert_eq!(fs.inspect().shared_blocks(), shared, "the counts come back the same from the image");
    fs
}

#[test]
fn copy_file_range_shares_whole_blocks_and_copies_the_rest() {
    with_fs(32 << 20, async |fs: Fs, dev| {
        let (a, b) = source_and_empty(&fs).await;
        assert_eq!(fs.inspect().superblock().features & SHARED_EXTENTS, 0, "no clone yet");
        let free = fs.inspect().free_blocks();
        clone_all(&fs, a, b).await;
        assert_eq!(fs.inspect().shared_blocks(), 64, "the whole blocks are shared");
        assert_ne!(fs.inspect().superblock().features & SHARED_EXTENTS, 0, "the first clone turns the bit on");
        // One block for the copied partial one; the checkpoint that
        // turned the bit on may have moved.
        let used = free.saturating_sub(fs.inspect().free_blocks());
        assert!(used <= 8, "a clone of 64 blocks took {used} blocks");
        assert_eq!(read_all(&fs, b).await, pattern(1, SOURCE_BYTES));
        let fs = clean_and_counted(fs, &dev).await;
        assert_eq!(read_all(&fs, b).await, pattern(1, SOURCE_BYTES));
        fs.unmount().await.unwrap();
    });
}

#[test]
fn offsets_that_do_not_line_up_are_copied() {
    with_fs(32 << 20, async |fs: Fs, _dev| {
        let (a, b) = source_and_empty(&fs).await;
        let copied = fs.data().copy_range(a, FileOffset::new(0), b, FileOffset::new(100), 8 * BLOCK as u64).await;
        assert_eq!(copied.unwrap(), 8 * BLOCK as u64);
        assert_eq!(fs.inspect().shared_blocks(), 0);
        assert_eq!(fs.inspect().superblock().features & SHARED_EXTENTS, 0);
        // Lined up but starting inside a block: the head is copied, the
        // whole blocks after it shared.
        let (from, to) = (FileOffset::new(BLOCK as u64 + 7), FileOffset::new(20 * BLOCK as u64 + 7));
        assert_eq!(fs.data().copy_range(a, from, b, to, 5 * BLOCK as u64).await.unwrap(), 5 * BLOCK as u64);
        assert_eq!(fs.inspect().shared_blocks(), 4);
        let got = fs.data().read(b, to, 5 * BLOCK as u32).await.unwrap();
        assert_eq!(got, pattern(1, SOURCE_BYTES)[BLOCK + 7..6 * BLOCK + 7]);
    });
}

/// One way of writing a file.
type Write = fn(&Fs, Ino) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + '_>>;
/// A write's name, the write, and what it does to the file's bytes.
type WriteCase = (&'static str, Write, fn(&mut Vec<u8>));

fn writes() -> Vec<WriteCase> {
    vec![
        (
            "buffered, unaligned, written back",
            |fs, ino| {
                Box::pin(async move {
                    fs.data().write(ino, FileOffset::new(4146), &pattern(2, 3 * BLOCK + 100)).await.unwrap();
                    fs.data().fsync(ino, false).await.unwrap();
                })
            },
            |v| v[4146..4146 + 3 * BLOCK + 100].copy_from_slice(&pattern(2, 3 * BLOCK + 100)),
        ),
        (
            "direct, aligned",
            |fs, ino| {
                Box::pin(async move {
                    let mut buf = AlignedBuf::zeroed(2 * BLOCK, BLOCK);
                    buf.copy_from_slice(&pattern(3, 2 * BLOCK));
                    let (_, written) = fs.data().write_direct(ino, FileOffset::new(10 * BLOCK as u64), buf).await;
                    assert_eq!(written.unwrap(), 2 * BLOCK as u32);
                })
            },
            |v| v[10 * BLOCK..12 * BLOCK].copy_from_slice(&pattern(3, 2 * BLOCK)),
        ),
        (
            "direct, unaligned",
            |fs, ino| {
                Box::pin(async move {
                    let data = pattern(4, 1000);
                    let mut buf = AlignedBuf::zeroed(1000, 1);
                    buf.copy_from_slice(&data);
                    let (_, written) = fs.data().write_direct(ino, FileOffset::new(20 * BLOCK as u64 + 5), buf).await;
                    assert_eq!(written.unwrap(), 1000);
                })
            },
            |v| v[20 * BLOCK + 5..20 * BLOCK + 1005].copy_from_slice(&pattern(4, 1000)),
        ),
        (
            "a hole punched, its edges zeroed",
            |fs, ino| {
                Box::pin(async move {
                    let (at, len) = (FileOffset::new(30 * BLOCK as u64 + 100), 2 * BLOCK as u64);
                    fs.data().fallocate(ino, FallocateMode::PunchHole, at, len).await.unwrap();
                })
            },
            |v| v[30 * BLOCK + 100..32 * BLOCK + 100].fill(0),
        ),
        (
            "truncated inside a block, then grown",
            |fs, ino| {
                Box::pin(async move {
                    let c = Creds::root();
                    let shrink = SetAttr { size: Some(40 * BLOCK as u64 + 10), ..SetAttr::default() };
                    fs.setattr(&c, ino, &shrink, false).await.unwrap();
                    let grow = SetAttr { size: Some(SOURCE_BYTES as u64), ..SetAttr::default() };
                    fs.setattr(&c, ino, &grow, false).await.unwrap();
                })
            },
            |v| v[40 * BLOCK + 10..].fill(0),
        ),
    ]
}

#[test]
fn every_write_to_either_copy_leaves_the_other_alone() {
    for written_is_clone in [true, false] {
        for (what, write, apply) in writes() {
            with_fs(32 << 20, async move |fs: Fs, dev| {
                let (a, b) = source_and_empty(&fs).await;
                clone_all(&fs, a, b).await;
                let (target, other) = if written_is_clone { (b, a) } else { (a, b) };
                write(&fs, target).await;
                let mut expected = pattern(1, SOURCE_BYTES);
                apply(&mut expected);
                let check_both = async |fs: &Fs| {
                    assert_eq!(read_all(fs, other).await, pattern(1, SOURCE_BYTES), "{what}: the other copy changed");
                    assert!(read_all(fs, target).await == expected, "{what}: the written copy is wrong");
                };
                check_both(&fs).await;
                assert!(fs.inspect().shared_blocks() < 64, "{what}: the written blocks are no longer shared");
                let fs = clean_and_counted(fs, &dev).await;
                check_both(&fs).await;
                fs.unmount().await.unwrap();
            });
        }
    }
}

#[test]
fn a_shared_block_is_freed_with_its_last_name() {
    with_fs(32 << 20, async |fs: Fs, dev| {
        let c = Creds::root();
        let (a, b) = source_and_empty(&fs).await;
        clone_all(&fs, a, b).await;
        fs.sync().await.unwrap();
        let free = fs.inspect().free_blocks();
        fs.unlink(&c, ROOT_INO, b"a").await.unwrap();
        fs.forget(a, 1).await.unwrap();
        fs.sync().await.unwrap();
        // a's partial last block was its own: one block back, no more.
        assert_eq!(fs.inspect().free_blocks(), free + 1, "b still names the shared blocks");
        assert_eq!(fs.inspect().shared_blocks(), 0);
        assert_eq!(read_all(&fs, b).await, pattern(1, SOURCE_BYTES));
        let fs = clean_and_counted(fs, &dev).await;
        let free = fs.inspect().free_blocks();
        fs.unlink(&c, ROOT_INO, b"b").await.unwrap();
        fs.forget(b, 1).await.unwrap();
        fs.sync().await.unwrap();
        assert_eq!(fs.inspect().free_blocks(), free + 65, "b's blocks, shared ones included, come back");
        fs.unmount().await.unwrap();
        assert!(check(&dev).await.is_clean());
    });
}

/// copy_file_range within one file, to past its end, copies what the
/// source held when the copy started: the file it grows does not feed the
/// copy more bytes (Linux bounds the length by the source's size first).
#[test]
fn a_copy_within_one_file_stops_at_the_size_it_started_with() {
    with_fs(32 << 20, async |fs: Fs, _dev| {
        let (a, _) = source_and_empty(&fs).await;
        let len = SOURCE_BYTES as u64;
        let to = 100 * BLOCK as u64;
        let copied = fs.data().copy_range(a, FileOffset::new(0), a, FileOffset::new(to), len + 1).await.unwrap();
        assert_eq!(copied, len, "the copy read on into what it wrote");
        let all = read_all(&fs, a).await;
        assert_eq!(all.len() as u64, to + len);
        assert_eq!(&all[to as usize..], &pattern(1, SOURCE_BYTES)[..]);
    });
}

/// A clone that starts past the destination's end grows it over the rest
/// of its last block: those bytes read as zeros after a crash too, not as
/// what the block held before a truncate (the model test's case).
#[test]
fn a_clone_past_the_end_zeroes_the_old_tail_on_the_device() {
    with_fs(48 << 20, async |fs: Fs, dev| {
        let c = Creds::root();
        let mk = async |name: &[u8]| {
            let (a, h) = fs.create(&c, ROOT_INO, name, 0o644, 2).await.unwrap();
            fs.release(h).await.unwrap();
            a.ino()
        };
        let bb = mk(b"bb").await;
        let ba = mk(b"ba").await;
        fs.data().write(bb, FileOffset::new(90493), &pattern(7, 56963)).await.unwrap();
        fs.data().write(ba, FileOffset::new(577), &pattern(8, 56767)).await.unwrap();
        assert_eq!(
            fs.data().copy_range(ba, FileOffset::new(49152), bb, FileOffset::new(4096), 68975).await.unwrap(),
            8192
        );
        fs.setattr(&c, ba, &SetAttr { size: Some(56923), ..Default::default() }, false).await.unwrap();
        assert_eq!(
            fs.data().copy_range(bb, FileOffset::new(143360), ba, FileOffset::new(159744), 82478).await.unwrap(),
            4096
        );
        let want_a = read_all(&fs, ba).await;
        let want_b = read_all(&fs, bb).await;
        fs.sync().await.unwrap();
        drop(fs);
        let fs = mount(&dev).await;
        let got_b = read_all(&fs, bb).await;
        assert!(got_b == want_b, "bb differs");
        let got_a = read_all(&fs, ba).await;
        let first = got_a.iter().zip(&want_a).position(|(x, y)| x != y);
        assert!(got_a == want_a, "ba differs at {first:?} (len {} vs {})", got_a.len(), want_a.len());
    });
}
