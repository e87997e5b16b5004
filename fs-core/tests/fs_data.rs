//! The data paths and the five seed behaviours, proven with counters and
//! with a device that holds write completions to expose concurrency.

mod common;

use keelfs_fs::FileOffset;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{busy_reactor, channel, format, ram_device, Gate, GateDevice};
use keelfs_base::testing::fill_pattern;
use keelfs_bdev::{AlignedBuf, BlockDevice};
use keelfs_fs::Ino;
use keelfs_fs::ROOT_INO;
use keelfs_fs::{Creds, FallocateMode, Fs, FsConfig, SetAttr, WriteTimes};
use keelfs_reactor as reactor;
use keelfs_reactor::yield_now;

const MIB: u64 = 1 << 20;

fn quiet_config() -> FsConfig {
    // No timer commits or writeback during a measurement.
    FsConfig {
        commit_interval: Duration::from_secs(3600),
        writeback_interval: Duration::from_secs(3600),
        ..FsConfig::default()
    }
}

async fn quiet_mount(dev: &Arc<dyn BlockDevice>) -> Fs {
    Fs::mount(channel(dev), quiet_config()).await.unwrap()
}

/// Run `test` on a reactor with `dev` freshly formatted and mounted quietly.
fn with_quiet_fs(dev: Arc<dyn BlockDevice>, test: impl AsyncFnOnce(Fs) + 'static) {
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        test(quiet_mount(&dev).await).await;
    });
}

fn block(seed: u64, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(len, 4096);
    fill_pattern(&mut b, seed);
    b
}

async fn new_file(fs: &Fs, name: &str) -> Ino {
    fs.create(&Creds::root(), ROOT_INO, name.as_bytes(), 0o644, 2).await.unwrap().0.ino()
}

#[test]
fn direct_overwrite_starts_no_transaction() {
    let dev = ram_device(64 * MIB);
    with_quiet_fs(dev, async move |fs: Fs| {
        let ino = new_file(&fs, "f").await;
        let (_, n) = fs.data().write_direct(ino, FileOffset::new(0), block(1, 1 << 20)).await;
        assert_eq!(n, Ok(1 << 20));
        fs.sync().await.unwrap();
        let before = fs.inspect().counters();
        let mtime0 = fs.getattr(ino).await.unwrap().inode.mtime;
        for i in 0..100u64 {
            let (_, n) = fs.data().write_direct(ino, FileOffset::new((i % 256) * 4096), block(i + 10, 4096)).await;
            assert_eq!(n, Ok(4096));
        }
        let after = fs.inspect().counters();
        assert_eq!(after.direct_overwrites - before.direct_overwrites, 100);
        assert_eq!(after.records_logged, before.records_logged, "an overwrite logs no record");
        assert_eq!(after.journal_commits, before.journal_commits, "and writes no journal");
        assert_eq!(after.device_flushes, before.device_flushes);
        assert!(fs.getattr(ino).await.unwrap().inode.mtime >= mtime0, "mtime moves in memory");
        let (back, n) = fs.data().read_direct(ino, FileOffset::new(99 * 4096), AlignedBuf::zeroed(4096, 4096)).await;
        assert_eq!(n, Ok(4096));
        assert!(back[..] == block(109, 4096)[..]);
    });
}

#[test]
fn disjoint_direct_overwrites_are_in_flight_together() {
    let gate = Arc::new(Gate::default());
    let dev: Arc<dyn BlockDevice> = Arc::new(GateDevice { inner: ram_device(64 * MIB), gate: gate.clone() });
    with_quiet_fs(dev, async move |fs: Fs| {
        let ino = new_file(&fs, "f").await;
        fs.data().write_direct(ino, FileOffset::new(0), block(1, 1 << 20)).await.1.unwrap();
        fs.sync().await.unwrap();
        gate.held_max.store(0, Ordering::SeqCst);
        gate.closed.store(true, Ordering::SeqCst);
        let done = Rc::new(Cell::new(0));
        for i in 0..8u64 {
            let (fs, done) = (fs.clone(), done.clone());
            reactor::spawn_local(async move {
                fs.data().write_direct(ino, FileOffset::new(i * 65536), block(i, 65536)).await.1.unwrap();
                done.set(done.get() + 1);
            });
        }
        // Barrier: all eight must reach the device while none has completed.
        for _ in 0..10_000 {
            if gate.held.load(Ordering::SeqCst) == 8 {
                break;
            }
            yield_now().await;
        }
        assert_eq!(gate.held.load(Ordering::SeqCst), 8, "disjoint overwrites were serialised");
        assert_eq!(done.get(), 0);
        gate.closed.store(false, Ordering::SeqCst);
        while done.get() < 8 {
            yield_now().await;
        }
        assert_eq!(fs.inspect().counters().direct_in_flight_max, 8);
    });
}

#[test]
fn thirty_two_appends_are_in_flight_at_once_and_size_never_covers_unwritten_data() {
    let gate = Arc::new(Gate::default());
    let dev: Arc<dyn BlockDevice> = Arc::new(GateDevice { inner: ram_device(64 * MIB), gate: gate.clone() });
    with_quiet_fs(dev, async move |fs: Fs| {
        let ino = new_file(&fs, "log").await;
        gate.closed.store(true, Ordering::SeqCst);
        gate.lifo.store(true, Ordering::SeqCst); // complete the last append first
        gate.trickle.store(1, Ordering::SeqCst);
        let completed: Rc<RefCell<Vec<u64>>> = Rc::default();
        for i in 0..32u64 {
            let (fs, completed) = (fs.clone(), completed.clone());
            reactor::spawn_local(async move {
                let (_, n) = fs.data().write_direct(ino, FileOffset::new(i * 4096), block(i, 4096)).await;
                assert_eq!(n, Ok(4096));
                completed.borrow_mut().push(i);
            });
        }
        for _ in 0..10_000 {
            if gate.held.load(Ordering::SeqCst) == 32 {
                break;
            }
            yield_now().await;
        }
        assert_eq!(gate.held.load(Ordering::SeqCst), 32, "appends waited for one another");
        assert_eq!(fs.getattr(ino).await.unwrap().inode.size, 0, "no append has completed");
        assert_eq!(fs.data().read(ino, FileOffset::new(0), 4096).await.unwrap(), b"", "nothing is visible yet");
        gate.closed.store(false, Ordering::SeqCst);
        while completed.borrow().len() < 32 {
            let size = fs.getattr(ino).await.unwrap().inode.size;
            let done = completed.borrow().clone();
            let prefix = (0..32u64).take_while(|i| done.contains(i)).count() as u64 * 4096;
            assert!(size <= prefix, "size {size} covers appends still in flight (done prefix {prefix})");
            yield_now().await;
        }
        assert_eq!(fs.getattr(ino).await.unwrap().inode.size, 32 * 4096);
        assert_eq!(fs.inspect().counters().direct_in_flight_max, 32);
        for i in 0..32u64 {
            let (b, n) = fs.data().read_direct(ino, FileOffset::new(i * 4096), AlignedBuf::zeroed(4096, 4096)).await;
            assert_eq!(n, Ok(4096));
            assert!(b[..] == block(i, 4096)[..], "append {i}");
        }
        assert_eq!(fs.inspect().extent_count(ino).unwrap(), 1, "32 appends merged into one extent");
    });
}

#[test]
fn sequential_page_writes_merge_into_few_extents() {
    let dev = ram_device(256 * MIB);
    with_quiet_fs(dev, async move |fs: Fs| {
        let buffered = new_file(&fs, "buffered").await;
        let direct = new_file(&fs, "direct").await;
        let page = vec![7u8; 4096];
        for i in 0..(64 * MIB / 4096) {
            fs.data().write(buffered, FileOffset::new(i * 4096), &page).await.unwrap();
            fs.data().write_direct(direct, FileOffset::new(i * 4096), block(i, 4096)).await.1.unwrap();
        }
        fs.sync().await.unwrap();
        // Interleaved writers of two files still get contiguous extents each.
        assert!(
            fs.inspect().extent_count(buffered).unwrap() <= 8,
            "buffered: {} extents",
            fs.inspect().extent_count(buffered).unwrap()
        );
        assert!(
            fs.inspect().extent_count(direct).unwrap() <= 8,
            "direct: {} extents",
            fs.inspect().extent_count(direct).unwrap()
        );
    });
}

#[test]
fn one_byte_writes_touch_no_journal_between_commits() {
    let dev = ram_device(64 * MIB);
    with_quiet_fs(dev, async move |fs: Fs| {
        let ino = new_file(&fs, "bytes").await;
        fs.data().write(ino, FileOffset::new(0), b"x").await.unwrap();
        fs.sync().await.unwrap();
        let before = fs.inspect().counters();
        for i in 1..20_000u64 {
            fs.data().write(ino, FileOffset::new(i), b"y").await.unwrap();
        }
        let after = fs.inspect().counters();
        assert_eq!(after.journal_commits, before.journal_commits, "no commit between commits");
        assert_eq!(after.journal_blocks_written, before.journal_blocks_written);
        assert_eq!(after.records_logged, before.records_logged, "no record, so no transaction to allocate");
        assert_eq!(fs.getattr(ino).await.unwrap().inode.size, 20_000);
        fs.sync().await.unwrap();
        assert!(fs.inspect().counters().journal_commits > after.journal_commits, "the next commit persists them");
    });
}

#[test]
fn concurrent_fsyncs_share_device_flushes() {
    let dev = ram_device(64 * MIB);
    let fault = Arc::new(keelfs_bdev::FaultDevice::new(dev));
    let dev: Arc<dyn BlockDevice> = fault; // volatile cache: flushes are real
    with_quiet_fs(dev, async move |fs: Fs| {
        let mut files = Vec::new();
        for i in 0..32 {
            files.push(new_file(&fs, &format!("f{i}")).await);
        }
        fs.sync().await.unwrap();
        let before = fs.inspect().counters();
        let done = Rc::new(Cell::new(0));
        for &ino in &files {
            let (fs, done) = (fs.clone(), done.clone());
            reactor::spawn_local(async move {
                fs.data().write(ino, FileOffset::new(0), &[1u8; 8192]).await.unwrap();
                fs.data().fsync(ino, false).await.unwrap();
                done.set(done.get() + 1);
            });
        }
        while done.get() < 32 {
            yield_now().await;
        }
        let after = fs.inspect().counters();
        let flushes = after.device_flushes - before.device_flushes;
        let fsyncs = after.fsyncs - before.fsyncs;
        eprintln!(
            "32 concurrent fsyncs: {fsyncs} fsync calls, {flushes} device flushes, {} commits",
            after.journal_commits - before.journal_commits
        );
        assert!(flushes <= 8, "32 fsyncs cost {flushes} device flushes");
    });
}

#[test]
fn fdatasync_skips_the_commit_when_only_timestamps_changed() {
    let dev: Arc<dyn BlockDevice> = Arc::new(keelfs_bdev::FaultDevice::new(ram_device(64 * MIB)));
    with_quiet_fs(dev, async move |fs: Fs| {
        let ino = new_file(&fs, "f").await;
        fs.data().write_direct(ino, FileOffset::new(0), block(1, 65536)).await.1.unwrap();
        fs.data().fsync(ino, false).await.unwrap();
        let before = fs.inspect().counters();
        fs.data().write_direct(ino, FileOffset::new(4096), block(2, 4096)).await.1.unwrap();
        fs.data().fsync(ino, true).await.unwrap();
        let after = fs.inspect().counters();
        assert_eq!(after.journal_commits, before.journal_commits, "fdatasync after an overwrite commits nothing");
        assert_eq!(after.device_flushes, before.device_flushes + 1, "but flushes the data");
        fs.data().write_direct(ino, FileOffset::new(65536), block(3, 4096)).await.1.unwrap();
        fs.data().fsync(ino, true).await.unwrap();
        assert_eq!(
            fs.inspect().counters().journal_commits,
            after.journal_commits + 1,
            "an append needs its size committed"
        );
    });
}

#[test]
fn i_version_moves_only_when_observed() {
    let dev = ram_device(64 * MIB);
    with_quiet_fs(dev, async move |fs: Fs| {
        let ino = new_file(&fs, "f").await;
        let v0 = fs.getattr(ino).await.unwrap().inode.i_version;
        fs.data().write(ino, FileOffset::new(0), b"a").await.unwrap();
        fs.data().write(ino, FileOffset::new(1), b"b").await.unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().inode.i_version, v0, "unobserved changes leave it");
        let seen = fs.i_version(ino).await.unwrap();
        fs.data().write(ino, FileOffset::new(2), b"c").await.unwrap();
        fs.data().write(ino, FileOffset::new(3), b"d").await.unwrap();
        assert_eq!(fs.i_version(ino).await.unwrap(), seen + 1, "one bump after an observation");
        fs.data().write(ino, FileOffset::new(4), b"e").await.unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().inode.i_version, seen + 2);
    });
}

#[test]
fn cached_reads_never_wait_for_a_write_to_another_range() {
    let gate = Arc::new(Gate::default());
    let dev: Arc<dyn BlockDevice> = Arc::new(GateDevice { inner: ram_device(64 * MIB), gate: gate.clone() });
    with_quiet_fs(dev, async move |fs: Fs| {
        let ino = new_file(&fs, "shared").await;
        fs.data().write(ino, FileOffset::new(0), &vec![3u8; 1 << 20]).await.unwrap();
        fs.sync().await.unwrap();
        let _ = fs.data().read(ino, FileOffset::new(0), 65536).await.unwrap(); // cached
        gate.closed.store(true, Ordering::SeqCst);
        // A write that extends the file holds its range while its I/O is stuck.
        let writer_done = Rc::new(Cell::new(false));
        {
            let (fs, done) = (fs.clone(), writer_done.clone());
            reactor::spawn_local(async move {
                fs.data().write_direct(ino, FileOffset::new(1 << 20), block(9, 65536)).await.1.unwrap();
                done.set(true);
            });
        }
        while gate.held.load(Ordering::SeqCst) == 0 {
            yield_now().await;
        }
        for _ in 0..100 {
            let data = fs.data().read(ino, FileOffset::new(4096), 8192).await.unwrap();
            assert_eq!(data, vec![3u8; 8192]);
        }
        assert!(!writer_done.get(), "reads completed while the write was still in flight");
        gate.closed.store(false, Ordering::SeqCst);
        while !writer_done.get() {
            yield_now().await;
        }
    });
}

#[test]
fn page_cache_stays_within_its_size_and_direct_io_sees_buffered_data() {
    let mut r = busy_reactor();
    let dev = ram_device(128 * MIB);
    r.block_on(async move {
        format(&dev).await;
        let config = FsConfig { cache_bytes: 4 * MIB, ..quiet_config() };
        let fs = Fs::mount(channel(&dev), config).await.unwrap();
        let ino = new_file(&fs, "big").await;
        let mut expect = vec![0u8; (32 * MIB) as usize];
        fill_pattern(&mut expect, 5);
        for (i, chunk) in expect.chunks(100_000).enumerate() {
            fs.data().write(ino, FileOffset::new(i as u64 * 100_000), chunk).await.unwrap();
            let stats = fs.inspect().cache_stats();
            assert!(stats.pages <= stats.capacity_pages, "cache grew to {} pages", stats.pages);
        }
        // Direct reads see buffered data not yet written back.
        let (b, n) = fs.data().read_direct(ino, FileOffset::new(31 * MIB), AlignedBuf::zeroed(65536, 4096)).await;
        assert_eq!(n, Ok(65536));
        assert!(b[..] == expect[(31 * MIB) as usize..(31 * MIB) as usize + 65536]);
        // Buffered reads see direct writes.
        fs.data().write_direct(ino, FileOffset::new(0), block(77, 8192)).await.1.unwrap();
        assert!(fs.data().read(ino, FileOffset::new(0), 8192).await.unwrap()[..] == block(77, 8192)[..]);
        let all = fs.data().read(ino, FileOffset::new(8192), (32 * MIB - 8192) as u32).await.unwrap();
        assert!(all[..] == expect[8192..]);
        assert!(fs.inspect().cache_stats().evictions > 0);
    });
}

#[test]
fn unaligned_direct_io_is_correct_through_a_bounce_buffer() {
    let dev = ram_device(64 * MIB);
    with_quiet_fs(dev, async move |fs: Fs| {
        let ino = new_file(&fs, "f").await;
        fs.data().write(ino, FileOffset::new(0), &vec![1u8; 10000]).await.unwrap();
        let (_, n) = fs.data().write_direct(ino, FileOffset::new(100), vec![AlignedBuf::zeroed(512, 512)]).await;
        assert_eq!(n, Ok(512));
        let data = fs.data().read(ino, FileOffset::new(0), 10000).await.unwrap();
        assert!(
            data[..100].iter().all(|&b| b == 1)
                && data[100..612].iter().all(|&b| b == 0)
                && data[612..].iter().all(|&b| b == 1)
        );
        let (b, n) = fs.data().read_direct(ino, FileOffset::new(8192), AlignedBuf::zeroed(8192, 4096)).await;
        assert_eq!(n, Ok(10000 - 8192), "short at end of file");
        assert!(b[..1808].iter().all(|&x| x == 1) && b[1808..].iter().all(|&x| x == 0), "nothing past EOF is returned");
    });
}

/// Blocks freed by a delete are reusable only once the free commits; a
/// write that finds no space with frees pending commits and retries,
/// rather than failing with ENOSPC on a filesystem that is mostly free.
/// (The vhost benchmark hit this: append, truncate, append again.)
#[test]
fn space_freed_but_not_yet_committed_is_reclaimed_on_demand() {
    with_quiet_fs(ram_device(64 * MIB), async |fs: Fs| {
        let c = Creds::root();
        let free = fs.statfs().await.unwrap().blocks_free;
        // Fill most of the device with direct writes, delete, fill again.
        for round in 0..3 {
            let (attr, fh) = fs.create(&c, ROOT_INO, format!("big{round}").as_bytes(), 0o644, 2).await.unwrap();
            let ino = attr.ino();
            let blocks = free * 3 / 4;
            let mut at = 0;
            while at < blocks {
                let n = (blocks - at).min(256);
                let (_, r) =
                    fs.data().write_direct(ino, FileOffset::new(at * 4096), block(at, (n * 4096) as usize)).await;
                assert_eq!(r.unwrap() as u64, n * 4096, "round {round}: direct write at block {at}");
                at += n;
            }
            fs.release(fh).await.unwrap();
            fs.unlink(&c, ROOT_INO, format!("big{round}").as_bytes()).await.unwrap();
            fs.forget(ino, 1).await.unwrap();
        }
        // And buffered writes, which reserve space when they dirty pages.
        for round in 0..2 {
            let (attr, fh) = fs.create(&c, ROOT_INO, format!("buf{round}").as_bytes(), 0o644, 2).await.unwrap();
            let ino = attr.ino();
            let data = vec![7u8; 1 << 20];
            for k in 0..(free * 3 / 4 / 256) {
                assert_eq!(
                    fs.data().write(ino, FileOffset::new(k << 20), &data).await.unwrap(),
                    1 << 20,
                    "round {round}: buffered write {k}"
                );
            }
            fs.sync().await.unwrap();
            fs.release(fh).await.unwrap();
            fs.unlink(&c, ROOT_INO, format!("buf{round}").as_bytes()).await.unwrap();
            fs.forget(ino, 1).await.unwrap();
        }
    });
}

/// A request refused for space that no commit could give back commits
/// nothing: a client asking again and again for more than the device
/// holds must not buy a journal write and a device flush each time (a
/// hostile client's huge ZERO_RANGE did, 8,000 times a second). With frees
/// pending, the refusal still commits them, once.
#[test]
fn a_refusal_for_space_commits_only_when_frees_are_pending() {
    with_quiet_fs(ram_device(64 * MIB), async |fs: Fs| {
        let c = Creds::root();
        let (attr, _) = fs.create(&c, ROOT_INO, b"f", 0o644, 2).await.unwrap();
        let (victim, _) = fs.create(&c, ROOT_INO, b"victim", 0o644, 2).await.unwrap();
        fs.data().write(victim.ino(), FileOffset::new(0), &vec![1u8; 1 << 20]).await.unwrap();
        fs.sync().await.unwrap();
        let too_much = FallocateMode::ZeroRange { keep_size: true };
        // Each commit writes the journal and flushes the device.
        let refuse_ten = async || {
            let before = fs.inspect().counters().journal_commits;
            for _ in 0..10 {
                let zeroed = fs.data().fallocate(attr.ino(), too_much, FileOffset::new(0), 1 << 40).await;
                assert_eq!(zeroed.err().map(|e| e.errno()), Some(libc::ENOSPC));
            }
            fs.inspect().counters().journal_commits - before
        };
        assert_eq!(refuse_ten().await, 0, "nothing to free: no commit");
        // A truncate frees the victim's blocks, pending until they commit.
        let to_zero = SetAttr { size: Some(0), ..SetAttr::default() };
        fs.setattr(&c, victim.ino(), &to_zero, false).await.unwrap();
        assert_eq!(refuse_ten().await, 1, "the pending frees commit on the first refusal, and only then");
        assert_eq!(refuse_ten().await, 0, "committed: nothing pending again");
    });
}

/// Append, truncate to zero, append again, many times over: the space of
/// each round comes back (the vhost benchmark's append wrap found a leak
/// here).
#[test]
fn append_and_truncate_cycles_do_not_leak_space() {
    with_quiet_fs(ram_device(64 * MIB), async |fs: Fs| {
        let c = Creds::root();
        let (attr, _fh) = fs.create(&c, ROOT_INO, b"cycle", 0o644, 2).await.unwrap();
        let ino = attr.ino();
        let free = fs.statfs().await.unwrap().blocks_free;
        for round in 0..40u64 {
            for k in 0..1024u64 {
                let (_, r) = fs.data().write_direct(ino, FileOffset::new(k * 4096), block(k, 4096)).await;
                r.unwrap_or_else(|e| panic!("round {round}, append {k}: {e}"));
            }
            let to_zero = SetAttr { size: Some(0), ..SetAttr::default() };
            fs.setattr(&c, ino, &to_zero, true).await.unwrap();
            if std::env::var_os("KEELFS_DEBUG_CYCLE").is_some() {
                fs.sync().await.unwrap();
                eprintln!(
                    "round {round}: free {} extents {}",
                    fs.statfs().await.unwrap().blocks_free,
                    fs.inspect().extent_count(ino).unwrap()
                );
            }
        }
        fs.sync().await.unwrap();
        let after = fs.statfs().await.unwrap().blocks_free;
        assert!(after + 8 >= free, "free blocks {free} before, {after} after");
    });
}

/// A direct write that extends the file, a truncate below its end, then a
/// direct write into a hole well inside the new size: the size stays where
/// the truncate put it. (fsx's O_DIRECT mode over /dev/fuse found the old
/// size coming back.)
#[test]
fn truncate_forgets_the_end_of_earlier_extending_writes() {
    with_quiet_fs(ram_device(64 * MIB), async |fs: Fs| {
        let c = Creds::root();
        let ino = new_file(&fs, "shrink").await;
        let (_, r) = fs.data().write_direct(ino, FileOffset::new(0xf0000), block(1, 0x10000)).await;
        r.unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().inode.size, 0x100000);
        let shrink = SetAttr { size: Some(0xd0000), ..SetAttr::default() };
        fs.setattr(&c, ino, &shrink, true).await.unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().inode.size, 0xd0000);
        let (_, r) = fs.data().write_direct(ino, FileOffset::new(0x10000), block(2, 4096)).await;
        r.unwrap();
        assert_eq!(
            fs.getattr(ino).await.unwrap().inode.size,
            0xd0000,
            "a write inside the file must not restore the pre-truncate size"
        );
        // And an extending write after that still extends.
        let (_, r) = fs.data().write_direct(ino, FileOffset::new(0xe0000), block(3, 4096)).await;
        r.unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().inode.size, 0xe1000);
        // A truncate into the middle of a written block, then a direct
        // write of that whole block: the block is allocated and written,
        // but the write still extends the file to the block's end.
        let mid = SetAttr { size: Some(0xe0dd8), ..SetAttr::default() };
        fs.setattr(&c, ino, &mid, true).await.unwrap();
        let (_, r) = fs.data().write_direct(ino, FileOffset::new(0xe0000), block(4, 4096)).await;
        r.unwrap();
        assert_eq!(fs.getattr(ino).await.unwrap().inode.size, 0xe1000, "fsx seed 33 over /dev/fuse");
    });
}

/// Multigrain timestamps: a write after someone read the attributes always
/// shows a newer mtime and ctime, even within one tick of the coarse clock
/// that unobserved writes are stamped with.
#[test]
fn observed_timestamps_always_move() {
    with_quiet_fs(ram_device(64 * MIB), async |fs: Fs| {
        let ino = new_file(&fs, "times").await;
        fs.data().write(ino, FileOffset::new(0), b"a").await.unwrap();
        for round in 0..200 {
            let before = fs.getattr(ino).await.unwrap().inode;
            fs.data().write(ino, FileOffset::new(round % 4096), b"b").await.unwrap();
            let after = fs.getattr(ino).await.unwrap().inode;
            assert!(after.ctime > before.ctime, "round {round}: ctime {:?} -> {:?}", before.ctime, after.ctime);
            assert!(after.mtime > before.mtime, "round {round}: mtime {:?} -> {:?}", before.mtime, after.mtime);
        }
        // Unobserved writes never move the stamps backwards.
        let before = fs.getattr(ino).await.unwrap().inode;
        for i in 0..1000u64 {
            fs.data().write(ino, FileOffset::new(i), b"c").await.unwrap();
        }
        let after = fs.getattr(ino).await.unwrap().inode;
        assert!(after.mtime >= before.mtime && after.ctime >= before.ctime);
    });
}

/// Pages from a client's writeback cache leave mtime and ctime to the
/// client (it stamped them at write(2) and sends them in a SETATTR that
/// may arrive first), but still grow the file; ordinary writes stamp.
#[test]
fn writes_whose_times_the_client_keeps_leave_them_alone() {
    with_quiet_fs(ram_device(64 * MIB), async |fs: Fs| {
        let ino = new_file(&fs, "kept").await;
        fs.data().write(ino, FileOffset::new(0), b"a").await.unwrap();
        for round in 0..50u64 {
            let before = fs.getattr(ino).await.unwrap().inode;
            let n = fs
                .data()
                .write_from_with(ino, FileOffset::new(4096 * round), &b"page"[..], WriteTimes::KeptByClient)
                .await
                .unwrap();
            assert_eq!(n, 4);
            let after = fs.getattr(ino).await.unwrap().inode;
            assert_eq!((after.mtime, after.ctime), (before.mtime, before.ctime), "round {round}");
            assert_eq!(after.size, (4096 * round + 4).max(before.size), "round {round}: the size still grows");
        }
        let before = fs.getattr(ino).await.unwrap().inode;
        fs.data().write(ino, FileOffset::new(0), b"b").await.unwrap();
        let after = fs.getattr(ino).await.unwrap().inode;
        assert!(after.mtime > before.mtime, "an observed ordinary write stamps");
    });
}

/// A buffered read that misses the cache can run beside a direct overwrite
/// of the same block (both take the range lock shared). Here the read takes
/// the old data from the device first, the overwrite lands, then the read
/// completes: its old page must not stay in the cache, or every later
/// buffered read returns the old data (xfstests generic/451).
#[test]
fn a_read_beside_a_direct_overwrite_leaves_no_stale_page() {
    let gate = Arc::new(Gate::default());
    let dev: Arc<dyn BlockDevice> = Arc::new(GateDevice { inner: ram_device(64 * MIB), gate: gate.clone() });
    with_quiet_fs(dev, async move |fs: Fs| {
        let ino = new_file(&fs, "f").await;
        fs.data().write_direct(ino, FileOffset::new(0), block(1, 4096)).await.1.unwrap();
        fs.sync().await.unwrap();
        let old = block(1, 4096).to_vec();
        let new = block(2, 4096).to_vec();
        gate.closed.store(true, Ordering::SeqCst);
        let read_back: Rc<RefCell<Option<Vec<u8>>>> = Rc::default();
        {
            let (fs, read_back) = (fs.clone(), read_back.clone());
            reactor::spawn_local(async move {
                *read_back.borrow_mut() = Some(fs.data().read(ino, FileOffset::new(0), 4096).await.unwrap());
            });
        }
        yield_now().await; // the read is submitted: it copies the old block
        let writer_done = Rc::new(Cell::new(false));
        {
            let (fs, writer_done) = (fs.clone(), writer_done.clone());
            reactor::spawn_local(async move {
                fs.data().write_direct(ino, FileOffset::new(0), block(2, 4096)).await.1.unwrap();
                writer_done.set(true);
            });
        }
        for _ in 0..10_000 {
            if gate.held.load(Ordering::SeqCst) == 1 && read_back.borrow().is_some() {
                break;
            }
            yield_now().await;
        }
        assert_eq!(read_back.borrow().as_deref(), Some(old.as_slice()), "the read ran before the write landed");
        gate.closed.store(false, Ordering::SeqCst);
        while !writer_done.get() {
            yield_now().await;
        }
        assert!(
            fs.data().read(ino, FileOffset::new(0), 4096).await.unwrap() == new,
            "a buffered read after the direct write saw old data"
        );
    });
}

/// Blocks freed while a checkpoint is written in pieces are held until it
/// lands; a writer that finds no space gets them back at once, because
/// the checkpoint in pieces is given up for it.
#[test]
fn a_writer_out_of_space_gets_back_what_a_checkpoint_in_pieces_holds() {
    let config = FsConfig { checkpoint_piece_nodes: 1, ..quiet_config() };
    let dev = ram_device(16 << 20);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        let fs = Fs::mount(channel(&dev), config).await.unwrap();
        let c = Creds::root();
        for i in 0..64 {
            fs.mknod(&c, ROOT_INO, format!("empty-{i}").as_bytes(), libc::S_IFREG | 0o644, 0).await.unwrap();
        }
        let (hog, fh) = fs.create(&c, ROOT_INO, b"hog", 0o644, 2).await.unwrap();
        let hog = hog.ino();
        let chunk = vec![0x5a; 256 << 10];
        let mut size = 0u64;
        loop {
            match fs.data().write(hog, FileOffset::new(size), &chunk).await {
                Ok(_) => size += chunk.len() as u64,
                Err(keelfs_fs::FsError::NoSpace) => break,
                Err(e) => panic!("filling the device: {e}"),
            }
        }
        fs.release(fh).await.unwrap();
        fs.sync().await.unwrap();
        let pieces = fs.clone();
        reactor::spawn_local(async move {
            let _ = pieces.admin().checkpoint_in_pieces().await;
        });
        for _ in 0..1000 {
            if fs.inspect().checkpointing_in_pieces() {
                break;
            }
            reactor::next_tick().await;
        }
        fs.unlink(&c, ROOT_INO, b"hog").await.unwrap();
        fs.forget(hog, 1).await.unwrap();
        fs.sync().await.unwrap();
        assert!(fs.inspect().checkpointing_in_pieces(), "the hog's blocks are held for the checkpoint in pieces");
        let after = new_file(&fs, "after").await;
        fs.data()
            .write(after, FileOffset::new(0), &vec![1u8; (size / 2) as usize])
            .await
            .expect("the held blocks came back");
        assert!(!fs.inspect().checkpointing_in_pieces(), "the checkpoint in pieces was given up for the writer");
        fs.sync().await.unwrap();
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        fs.unmount().await.unwrap();
    });
}
