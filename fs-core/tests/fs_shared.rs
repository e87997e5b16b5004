//! Cached reads from another thread (`DataOps::shared_reader`) while the owning
//! reactor writes, truncates and deletes: every read must return bytes the
//! file held at one instant, never a half-applied change.

mod common;

use keelfs_fs::FileOffset;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{busy_reactor, channel, format, ram_device};
use keelfs_base::testing::splitmix64;
use keelfs_fs::Ino;
use keelfs_fs::ROOT_INO;
use keelfs_fs::{Creds, Fs, FsConfig, SetAttr, SharedMiss, SharedReader};
use keelfs_reactor::yield_now;

const MIB: u64 = 1 << 20;
const REGION: usize = 8192;
/// The most changes an owner makes waiting for the reader's progress, 30
/// times its fixed rounds: a bound in work, not time, so that a reader
/// that can never progress fails the test rather than hang it.
const OWNER_ROUNDS_MAX: u32 = 2_000_000;

/// Set when the reader's thread has ended, by returning or by a panic: an
/// owner waiting on the reader's progress fails then, rather than hang.
/// No deadline: a loaded machine may let the reader run only a little,
/// and the owner keeps going until it has.
#[derive(Clone, Default)]
struct ReaderGone(Arc<AtomicBool>);

impl ReaderGone {
    /// # Panics
    /// If the reader's thread has ended: it can make no more progress.
    fn check(&self, waiting_for: &str) {
        assert!(!self.0.load(Ordering::Acquire), "the reader ended before {waiting_for}");
    }
}

/// Sets [`ReaderGone`] when dropped, as the reader's thread ends.
struct MarkGone(ReaderGone);

impl Drop for MarkGone {
    fn drop(&mut self) {
        self.0 .0.store(true, Ordering::Release);
    }
}

fn config() -> FsConfig {
    FsConfig {
        commit_interval: Duration::from_secs(3600),
        writeback_interval: Duration::from_millis(20),
        cache_bytes: 16 * MIB,
        ..FsConfig::default()
    }
}

async fn new_file(fs: &Fs, name: &str) -> Ino {
    fs.create(&Creds::root(), ROOT_INO, name.as_bytes(), 0o644, 2).await.unwrap().0.ino()
}

/// Run `owner` on a reactor with a fresh filesystem while `reader` runs on
/// a plain thread with a reader of the file `owner` creates first.
fn owner_and_reader<R>(
    setup: impl AsyncFnOnce(&Fs) -> Ino + 'static,
    owner: impl AsyncFnOnce(Fs, Ino, ReaderGone) + 'static,
    reader: impl FnOnce(SharedReader, &AtomicBool) -> R + Send + 'static,
) -> R
where
    R: Send + 'static,
{
    let dev = ram_device(64 * MIB);
    let mut r = busy_reactor();
    let stop = Arc::new(AtomicBool::new(false));
    r.block_on(async move {
        format(&dev).await;
        let fs = Fs::mount(channel(&dev), config()).await.unwrap();
        let ino = setup(&fs).await;
        let shared = fs.data().shared_reader(ino).unwrap();
        let (stop2, gone) = (stop.clone(), ReaderGone::default());
        let mark = MarkGone(gone.clone());
        let thread = std::thread::spawn(move || {
            let _mark = mark;
            reader(shared, &stop2)
        });
        owner(fs.clone(), ino, gone).await;
        stop.store(true, Ordering::Release);
        fs.unmount().await.unwrap();
        thread.join().expect("reader thread")
    })
}

#[test]
fn shared_reads_see_whole_writes_and_never_go_back() {
    const REGIONS: u64 = 64;
    const HITS_MIN: u64 = 1000;
    let reader_hits = Arc::new(AtomicU64::new(0));
    let (owner_sees, reader_counts) = (reader_hits.clone(), reader_hits.clone());
    let hits = owner_and_reader(
        async |fs| {
            let ino = new_file(fs, "f").await;
            fs.data().write(ino, FileOffset::new(0), &vec![0u8; REGIONS as usize * REGION]).await.unwrap();
            ino
        },
        async move |fs, ino, reader_gone| {
            // Each write fills one 8 KiB region (two pages) with the next
            // value for that region: 60,000 of them, and more until the
            // reader has had its share of the CPU.
            let mut seed = 1;
            let mut versions = [0u64; REGIONS as usize];
            for round in 0.. {
                if round >= 60_000 && owner_sees.load(Ordering::Relaxed) >= HITS_MIN {
                    break;
                }
                reader_gone.check("it had its reads");
                assert!(round < OWNER_ROUNDS_MAX, "the reader made too little progress in {round} writes");
                let region = splitmix64(&mut seed) % REGIONS;
                let v = &mut versions[region as usize];
                *v += 1;
                let data: Vec<u8> = (0..REGION / 8).flat_map(|_| v.to_le_bytes()).collect();
                fs.data().write(ino, FileOffset::new(region * REGION as u64), &data).await.unwrap();
                yield_now().await;
            }
        },
        move |reader, stop| {
            let mut seed = 7;
            let mut last_seen = [0u64; REGIONS as usize];
            let mut hits = 0u64;
            let mut buf = Vec::new();
            while !stop.load(Ordering::Acquire) {
                let region = splitmix64(&mut seed) % REGIONS;
                match reader.read_into(region * REGION as u64, REGION as u32, &mut buf) {
                    Ok(()) => {
                        hits += 1;
                        reader_counts.store(hits, Ordering::Relaxed);
                        assert_eq!(buf.len(), REGION);
                        let word = |i: usize| u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap());
                        let v = word(0);
                        assert!((0..REGION / 8).all(|i| word(i) == v), "a read saw part of a write (region {region})");
                        let last = &mut last_seen[region as usize];
                        assert!(v >= *last, "region {region} went back from version {last} to {v}");
                        *last = v;
                    }
                    Err(SharedMiss::Busy | SharedMiss::NotCached) => {}
                    Err(other) => panic!("unexpected miss {other:?}"),
                }
            }
            hits
        },
    );
    assert!(hits >= HITS_MIN, "the reader completed only {hits} reads from the cache");
}

#[test]
fn shared_reads_never_see_a_truncate_half_done() {
    const FULL: usize = 64 * 1024;
    const CHECKED_MIN: u64 = 100;
    let reader_checked = Arc::new(AtomicU64::new(0));
    let (owner_sees, reader_counts) = (reader_checked.clone(), reader_checked.clone());
    let checked = owner_and_reader(
        async |fs| {
            let ino = new_file(fs, "t").await;
            fs.data().write(ino, FileOffset::new(0), &vec![1u8; FULL]).await.unwrap();
            ino
        },
        async move |fs, ino, reader_gone| {
            // Shrink to a random size (the kept bytes keep their value, the
            // tail of the last page is zeroed in the cache), then rewrite
            // the whole file with a new value, extending it: 40,000 times,
            // and more until the reader has checked enough reads.
            let mut seed = 3;
            for i in 0u32.. {
                if i >= 40_000 && owner_sees.load(Ordering::Relaxed) >= CHECKED_MIN {
                    break;
                }
                reader_gone.check("it had checked its reads");
                assert!(i < OWNER_ROUNDS_MAX, "the reader made too little progress in {i} changes");
                let size = 1 + splitmix64(&mut seed) % (FULL as u64 - 1);
                fs.setattr(&Creds::root(), ino, &SetAttr { size: Some(size), ..Default::default() }, false)
                    .await
                    .unwrap();
                yield_now().await;
                let v = (i % 250) as u8 + 2;
                fs.data().write(ino, FileOffset::new(0), &[v; FULL]).await.unwrap();
                yield_now().await;
            }
        },
        move |reader, stop| {
            let mut checked = 0u64;
            let mut buf = Vec::new();
            let mut seed = 11;
            while !stop.load(Ordering::Acquire) {
                // Reads of any length: one ending in the last page of a
                // shrunk file, with the old size, would find zeros.
                let len = 1 + splitmix64(&mut seed) % FULL as u64;
                if reader.read_into(0, len as u32, &mut buf).is_ok() {
                    checked += 1;
                    reader_counts.store(checked, Ordering::Relaxed);
                    assert!(!buf.is_empty(), "the file is never empty");
                    let v = buf[0];
                    assert!(v != 0, "a read saw zeros at the start");
                    if let Some(at) = buf.iter().position(|&b| b != v) {
                        panic!("read of {} bytes changes from {v} to {} at {at}", buf.len(), buf[at]);
                    }
                }
            }
            checked
        },
    );
    assert!(checked >= CHECKED_MIN, "only {checked} reads completed from the cache");
}

#[test]
fn shared_reads_of_deleted_uncached_and_past_eof() {
    let dev = ram_device(64 * MIB);
    let mut r = busy_reactor();
    r.block_on(async move {
        format(&dev).await;
        let fs = Fs::mount(channel(&dev), config()).await.unwrap();
        let c = Creds::root();
        let (attr, fh) = fs.create(&c, ROOT_INO, b"d", 0o644, 2).await.unwrap();
        let ino = attr.ino();
        fs.data().write(ino, FileOffset::new(0), &[5u8; 10_000]).await.unwrap();
        let reader = fs.data().shared_reader(ino).unwrap();
        assert_eq!(reader.read(FileOffset::new(0), 4).unwrap(), vec![5u8; 4]);
        assert_eq!(reader.read(FileOffset::new(9_998), 100).unwrap(), vec![5u8; 2], "short at end of file");
        assert_eq!(reader.read(FileOffset::new(10_000), 100).unwrap(), Vec::<u8>::new(), "empty at end of file");
        assert_eq!(reader.read(FileOffset::new(1 << 30), 100).unwrap(), Vec::<u8>::new(), "empty past end of file");
        // Past the cached pages (the file grew by truncate, no page).
        fs.setattr(&c, ino, &SetAttr { size: Some(1 << 20), ..Default::default() }, false).await.unwrap();
        assert_eq!(reader.read(FileOffset::new(512 << 10), 4096), Err(SharedMiss::NotCached));
        assert_eq!(reader.read(FileOffset::new(0), 1 << 20), Err(SharedMiss::TooLarge));
        // Another file's pages never answer for this one.
        let other = new_file(&fs, "e").await;
        fs.data().write(other, FileOffset::new(0), &[9u8; 4096]).await.unwrap();
        assert_eq!(fs.data().shared_reader(other).unwrap().read(FileOffset::new(0), 1).unwrap(), vec![9]);
        fs.unlink(&c, ROOT_INO, b"d").await.unwrap();
        fs.forget(ino, 1).await.unwrap();
        assert_eq!(reader.read(FileOffset::new(0), 4).unwrap(), vec![5u8; 4], "unlinked but open: still readable");
        fs.release(fh).await.unwrap();
        assert_eq!(
            reader.read(FileOffset::new(0), 4),
            Err(SharedMiss::Gone),
            "a deleted file's reader goes to the owner"
        );
        let stats = fs.inspect().cache_stats();
        assert_eq!((stats.shared_hits, stats.shared_misses), (6, 3));
        fs.unmount().await.unwrap();
    });
}

#[test]
fn owner_writes_are_visible_to_shared_reads_at_once() {
    // Writes on the owner, each followed by a read on another thread that
    // it hands the expected value to: the read must see it (no stale page
    // from before the write).
    let expected = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let (e2, d2) = (expected.clone(), done.clone());
    let rounds = owner_and_reader(
        async |fs| {
            let ino = new_file(fs, "v").await;
            fs.data().write(ino, FileOffset::new(0), &[0u8; 4096]).await.unwrap();
            ino
        },
        async move |fs, ino, reader_gone| {
            for v in 1..=2000u64 {
                fs.data().write(ino, FileOffset::new(0), &v.to_le_bytes()).await.unwrap();
                e2.store(v, Ordering::Release);
                while d2.load(Ordering::Acquire) != v {
                    // A reader that panicked never confirms: fail, not hang.
                    reader_gone.check(&format!("it confirmed value {v}"));
                    yield_now().await;
                }
            }
        },
        move |reader, stop| {
            let mut seen = 0;
            while !stop.load(Ordering::Acquire) {
                let v = expected.load(Ordering::Acquire);
                if v == seen {
                    // Yield, not spin: on a loaded machine the owner may
                    // share this core.
                    std::thread::yield_now();
                    continue;
                }
                let bytes = loop {
                    match reader.read(FileOffset::new(0), 8) {
                        Ok(b) => break b,
                        Err(SharedMiss::Busy) => continue,
                        Err(other) => panic!("page 0 is cached: {other:?}"),
                    }
                };
                assert_eq!(u64::from_le_bytes(bytes.try_into().unwrap()), v, "a stale read");
                seen = v;
                done.store(v, Ordering::Release);
            }
            seen
        },
    );
    assert_eq!(rounds, 2000);
}
