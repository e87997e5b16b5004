//! Crash consistency. Each workload runs on a recording fault device; the
//! device is then rebuilt as a crash could leave it at every flush point
//! and at random points between (later writes kept, lost or torn at random
//! from a printed seed). Every rebuilt image must pass fsck and mount, keep
//! everything whose fsync returned byte for byte, and never show stale
//! device content (freed blocks are filled with 0xEE first to catch it).
//! The `_reordered` variants hold completions back and reorder them as
//! RBD does, from the printed seed; the `_on_rbd` ones record on RBD.

mod common;

use keelfs_fs::FileOffset;
use std::sync::Arc;

use common::{busy_reactor, channel, mount};
use keelfs_base::testing::splitmix64;
use keelfs_bdev::{AlignedBuf, BlockDevice, FaultDevice, FaultRule, MappedDevice};
use keelfs_fs::Ino;
use keelfs_fs::RenameMode;
use keelfs_fs::ROOT_INO;
use keelfs_fs::{fsck_with, mkfs, FsckOptions, MkfsOptions};
use keelfs_fs::{Creds, Fs, FsConfig, SetAttr};

const DEVICE_BYTES: u64 = 24 << 20;
const STALE: u8 = 0xEE;

struct Recorded<P> {
    base: Vec<u8>,
    log: keelfs_bdev::WriteLog,
    /// (log length when the sync returned, what it promised)
    promises: Vec<(usize, P)>,
}

/// Format, poison free space with STALE, then run `workload` while
/// recording. The workload pushes a promise after each sync it makes.
fn record<P: 'static>(workload: impl AsyncFnOnce(Fs, Arc<FaultDevice>, &mut Vec<(usize, P)>) + 'static) -> Recorded<P> {
    record_with_journal(0, workload)
}

/// As `record`, with a journal of `journal_blocks` (0: the default).
fn record_with_journal<P: 'static>(
    journal_blocks: u64,
    workload: impl AsyncFnOnce(Fs, Arc<FaultDevice>, &mut Vec<(usize, P)>) + 'static,
) -> Recorded<P> {
    record_with_config(journal_blocks, FsConfig::default(), workload)
}

/// As `record_with_journal`, the workload's mount configured by `config`.
fn record_with_config<P: 'static>(
    journal_blocks: u64,
    config: FsConfig,
    workload: impl AsyncFnOnce(Fs, Arc<FaultDevice>, &mut Vec<(usize, P)>) + 'static,
) -> Recorded<P> {
    let mut r = busy_reactor();
    let (inner, _image) = match ON_RBD.get() {
        false => (common::ram_device(DEVICE_BYTES), None),
        true => {
            let (dev, image) = common::rbd_device("crash", DEVICE_BYTES);
            (dev, Some(image))
        }
    };
    let fault = Arc::new(FaultDevice::new(inner.clone()));
    let dev: Arc<dyn BlockDevice> = fault.clone();
    let (inner2, fault2) = (inner.clone(), fault.clone());
    let recorded = r.block_on(async move {
        let data_checksums = CHECKSUMS.get();
        let options = MkfsOptions { force: true, journal_blocks, data_checksums, ..MkfsOptions::default() };
        mkfs(channel(&dev), &options).await.unwrap();
        let fs = mount(&dev).await;
        let c = Creds::root();
        let (junk, _) = fs.create(&c, ROOT_INO, b"junk", 0o644, 2).await.unwrap();
        fs.data().write(junk.ino(), FileOffset::new(0), &vec![STALE; 16 << 20]).await.unwrap();
        fs.sync().await.unwrap();
        fs.unlink(&c, ROOT_INO, b"junk").await.unwrap();
        fs.forget(junk.ino(), 1).await.unwrap();
        fs.unmount().await.unwrap();
        let base = common::read_whole(inner2.as_ref());
        let mut config = config;
        if let Some(seed) = REORDER.get() {
            fault2.add_rule(FaultRule::ReorderCompletions { max_polls: REORDER_MAX_POLLS, seed });
            // The writeback timer runs by the wall clock: off, so that the
            // seed replays exactly. Workloads that want background
            // writeback start it themselves at fixed points.
            config.writeback_interval = std::time::Duration::from_secs(3600);
        }
        fault2.start_recording();
        let fs = Fs::mount(channel(&dev), config).await.expect("mount");
        let mut promises = Vec::new();
        workload(fs, fault2.clone(), &mut promises).await;
        Recorded { base, log: fault2.log(), promises }
    });
    drop((fault, inner));
    recorded
}

thread_local! {
    /// Record the workload on an RBD image of the dev cluster instead of
    /// RAM (the `_on_rbd` tests): the filesystem's requests then complete
    /// from librbd's threads, in librbd's order. The crash images are
    /// rebuilt from the log in memory either way.
    static ON_RBD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `test` with its workload recorded on RBD.
fn on_rbd(test: impl FnOnce()) {
    ON_RBD.set(true);
    test();
    ON_RBD.set(false);
}

thread_local! {
    /// Format with data checksums (the `_with_data_checksums` tests), and
    /// have fsck check every written block against its checksum at each
    /// crash point.
    static CHECKSUMS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `test` on an image with data checksums.
fn with_data_checksums(test: impl FnOnce()) {
    CHECKSUMS.set(true);
    test();
    CHECKSUMS.set(false);
}

thread_local! {
    /// Record the workload with the device's completions held back and
    /// reordered from this seed (the `_reordered` tests): what RBD does,
    /// but on RAM and replayable.
    static REORDER: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// How many polls a completion may be held back under `reordered`.
const REORDER_MAX_POLLS: u32 = 24;

/// Run `test` with its workload's completions reordered from the crash
/// seed (printed, and replayable with KEELFS_CRASH_SEED).
fn reordered(test: impl FnOnce()) {
    let seed = test_seed();
    REORDER.set(Some(seed));
    test();
    REORDER.set(None);
}

/// Crash positions: every flush point, the end, and `extra` random ones.
fn crash_points(log_len: usize, flush_points: Vec<usize>, seed: u64, extra: usize) -> Vec<usize> {
    let mut s = seed;
    let mut points = flush_points;
    points.push(log_len);
    points.extend((0..extra).map(|_| (splitmix64(&mut s) % (log_len as u64 + 1)) as usize));
    points.sort_unstable();
    points.dedup();
    points
}

fn test_seed() -> u64 {
    keelfs_base::testing::test_seed("KEELFS_CRASH_SEED", "crash")
}

/// Rebuild each crash image and hand a mounted Fs to `verify` with the
/// newest promise the crash must honour.
fn check_crashes<P: Clone + 'static>(
    rec: &Recorded<P>,
    seed: u64,
    verify: impl AsyncFn(&Fs, Option<&P>, Option<&P>) + Clone + 'static,
) {
    check_crashes_on(rec, seed, async move |fs: &Fs, _dev: &Arc<dyn BlockDevice>, promised, next| {
        verify(fs, promised, next).await
    });
}

/// As `check_crashes`, `verify` also given the rebuilt device (to mount
/// it again, as a snapshot).
fn check_crashes_on<P: Clone + 'static>(
    rec: &Recorded<P>,
    seed: u64,
    verify: impl AsyncFn(&Fs, &Arc<dyn BlockDevice>, Option<&P>, Option<&P>) + Clone + 'static,
) {
    let points = crash_points(rec.log.len(), rec.log.flush_points(), seed, 24);
    assert!(points.len() > 4, "the workload must produce flush points");
    for (i, &at) in points.iter().enumerate() {
        let mut image = rec.base.clone();
        let fate_seed = seed ^ (at as u64).wrapping_mul(0x9E37);
        rec.log.rebuild_seeded(&mut image, at, fate_seed);
        let ram = MappedDevice::ram(DEVICE_BYTES, 4096).unwrap();
        ram.restore(&image);
        let dev: Arc<dyn BlockDevice> = Arc::new(ram);
        let promised = rec.promises.iter().rev().find(|(len, _)| *len <= at).map(|(_, p)| p.clone());
        let next = rec.promises.iter().find(|(len, _)| *len > at).map(|(_, p)| p.clone());
        let verify = verify.clone();
        let mut r = busy_reactor();
        let data = CHECKSUMS.get();
        r.block_on(async move {
            let report = fsck_with(channel(&dev), FsckOptions { data }, |_| {}).await.expect("fsck ran");
            assert!(report.is_clean(), "crash point {at} (#{i}, fate seed {fate_seed}): fsck {report:?}");
            let fs = Fs::mount(channel(&dev), FsConfig::default())
                .await
                .unwrap_or_else(|e| panic!("crash point {at}: mount failed: {e}"));
            verify(&fs, &dev, promised.as_ref(), next.as_ref()).await;
        });
    }
}

async fn read_all(fs: &Fs, ino: Ino) -> Vec<u8> {
    let size = fs.getattr(ino).await.unwrap().inode.size;
    fs.data().read(ino, FileOffset::new(0), size as u32).await.unwrap()
}

async fn lookup(fs: &Fs, parent: Ino, name: &str) -> Option<Ino> {
    fs.lookup(&Creds::root(), parent, name.as_bytes()).await.ok().map(|a| a.ino())
}

type StormPromise = Vec<(String, Vec<(String, Vec<u8>)>)>;

#[test]
fn create_rename_unlink_storm() {
    storm(0, 8, FsConfig::default());
}

/// A 16-block journal fills every few rounds, so commits wrap the ring
/// and checkpoints run between them: crashes land inside both.
#[test]
fn storm_with_a_tiny_journal_crosses_wraps_and_checkpoints() {
    storm(16, 24, FsConfig::default());
}

/// Checkpoints written a few inodes at a time while the storm goes on:
/// crashes land between pieces, during the transactions that commit
/// meanwhile, and as the checkpoint lands.
#[test]
fn storm_with_checkpoints_in_small_pieces() {
    storm(24, 40, FsConfig { checkpoint_piece_nodes: 4, ..FsConfig::default() });
}

/// The tiny-journal storm on an image with data checksums: the table's
/// dirty blocks are written back by every checkpoint, and every crash
/// image's written blocks must match their checksums.
#[test]
fn storm_with_a_tiny_journal_with_data_checksums() {
    with_data_checksums(|| storm(16, 24, FsConfig::default()));
}

#[test]
fn storm_with_checkpoints_in_small_pieces_with_data_checksums() {
    with_data_checksums(|| storm(24, 40, FsConfig { checkpoint_piece_nodes: 4, ..FsConfig::default() }));
}

#[test]
fn create_rename_unlink_storm_on_rbd() {
    on_rbd(|| storm(16, 24, FsConfig::default()));
}

/// A writeback of everything started after each file and not waited for,
/// as the writeback timer does: the round's sync runs while it still has
/// a file's data in flight, and must wait for it. On RAM, completions at
/// once; the timer is off so that runs replay.
#[test]
fn create_rename_unlink_storm_with_background_writeback() {
    let config = FsConfig { writeback_interval: std::time::Duration::from_secs(3600), ..FsConfig::default() };
    storm_with(16, 24, config, true);
}

/// The RBD storm on RAM, replayable: completions come back late and out
/// of order, and a background writeback (what the writeback timer starts)
/// begins after every file, so it often has a file's data in flight when
/// the round's sync runs.
#[test]
fn create_rename_unlink_storm_reordered() {
    reordered(|| storm_with(16, 24, FsConfig::default(), true));
}

fn storm(journal_blocks: u64, rounds: usize, config: FsConfig) {
    storm_with(journal_blocks, rounds, config, false);
}

/// `background`: start a writeback of everything, not waited for, after
/// each file is written.
fn storm_with(journal_blocks: u64, rounds: usize, config: FsConfig, background: bool) {
    let seed = test_seed();
    type Promise = StormPromise;
    let in_pieces = config.checkpoint_piece_nodes < 16;
    let rec =
        record_with_config(journal_blocks, config, async move |fs: Fs, _f, promises: &mut Vec<(usize, Promise)>| {
            let mut done_during_pieces = 0;
            let c = Creds::root();
            let mut done: Promise = Vec::new();
            for round in 0..rounds {
                let dname = format!("r{round}");
                let d = fs.mkdir(&c, ROOT_INO, dname.as_bytes(), 0o755).await.unwrap().ino();
                let mut names = Vec::new();
                for i in 0..12 {
                    let body = format!("round {round} file {i}").repeat(i + 1).into_bytes();
                    let (f, fh) = fs.create(&c, d, format!("t{i}").as_bytes(), 0o644, 2).await.unwrap();
                    fs.data().write(f.ino(), FileOffset::new(0), &body).await.unwrap();
                    fs.release(fh).await.unwrap();
                    if background {
                        let fs = fs.clone();
                        // As the timer does, ignoring failures: the file may
                        // be unlinked and forgotten before its write is done.
                        keelfs_reactor::spawn_local(async move {
                            let _ = fs.data().writeback_all().await;
                        });
                    }
                    let name = if i % 2 == 0 {
                        let (from, to) = (format!("t{i}"), format!("f{i}"));
                        fs.rename(&c, d, from.as_bytes(), d, to.as_bytes(), RenameMode::Replace).await.unwrap();
                        to
                    } else {
                        format!("t{i}")
                    };
                    if i % 3 == 0 {
                        fs.unlink(&c, d, name.as_bytes()).await.unwrap();
                    } else {
                        names.push((name, body));
                    }
                    done_during_pieces += usize::from(fs.inspect().checkpointing_in_pieces());
                    fs.inspect().check_block_ownership().unwrap();
                    fs.inspect().assert_invariants();
                    if in_pieces {
                        // Requests are tasks of their own on a server: let the
                        // checkpoint's next piece run between two.
                        keelfs_reactor::yield_now().await;
                    }
                }
                names.sort();
                done.push((dname, names));
                fs.sync().await.unwrap();
                promises.push((_f.log_len(), done.clone()));
            }
            let checkpoints = fs.inspect().counters().checkpoints;
            if journal_blocks > 0 {
                assert!(checkpoints >= 2, "the tiny journal forced checkpoints ({checkpoints})");
            }
            if in_pieces {
                assert!(done_during_pieces > 0, "files were made while a checkpoint was written in pieces");
            }
        });
    check_crashes(&rec, seed, async |fs: &Fs, promised: Option<&Promise>, _next| verify_storm(fs, promised).await);
}

/// Every directory and file a storm's sync promised is there, with its
/// contents.
async fn verify_storm(fs: &Fs, promised: Option<&StormPromise>) {
    let Some(promised) = promised else { return };
    for (dname, files) in promised {
        let d = lookup(fs, ROOT_INO, dname).await.unwrap_or_else(|| panic!("synced directory {dname} lost"));
        let listed: Vec<String> = fs
            .readdir(d, 0, 1000)
            .await
            .unwrap()
            .into_iter()
            .map(|e| String::from_utf8(e.name.to_vec()).unwrap())
            .filter(|n| n != "." && n != "..")
            .collect();
        let mut listed = listed;
        listed.sort();
        let want: Vec<String> = files.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(listed, want, "directory {dname} after crash");
        for (name, body) in files {
            let ino = lookup(fs, d, name).await.unwrap();
            assert_eq!(&read_all(fs, ino).await, body, "{dname}/{name} content");
        }
    }
}

fn append_byte(offset: u64) -> u8 {
    (offset % 251) as u8
}

/// After a crash the log file keeps at least what was synced, and every
/// byte it has is the one appended there: nothing stale, nothing torn in.
async fn verify_appends(fs: &Fs, promised: Option<&u64>) {
    let Some(ino) = lookup(fs, ROOT_INO, "log").await else {
        assert!(promised.is_none(), "fsynced file lost");
        return;
    };
    let data = read_all(fs, ino).await;
    assert!(data.len() as u64 >= promised.copied().unwrap_or(0), "synced length lost");
    for (o, &b) in data.iter().enumerate() {
        assert_eq!(b, append_byte(o as u64), "byte {o} of {} is not what was appended", data.len());
    }
}

#[test]
fn appends_with_fsync_never_show_stale_data() {
    appends_with_fsync_never_show_stale_data_workload();
}

#[test]
fn appends_with_fsync_never_show_stale_data_reordered() {
    reordered(appends_with_fsync_never_show_stale_data_workload);
}

#[test]
fn appends_with_fsync_never_show_stale_data_with_data_checksums() {
    with_data_checksums(appends_with_fsync_never_show_stale_data_workload);
}

#[test]
fn appends_with_fsync_never_show_stale_data_on_rbd() {
    on_rbd(appends_with_fsync_never_show_stale_data_workload);
}

fn appends_with_fsync_never_show_stale_data_workload() {
    let seed = test_seed();
    let rec = record(async move |fs: Fs, f, promises: &mut Vec<(usize, u64)>| {
        let c = Creds::root();
        let (file, _) = fs.create(&c, ROOT_INO, b"log", 0o644, 2).await.unwrap();
        let ino = file.ino();
        let mut size = 0u64;
        let mut s = seed;
        for i in 0..40 {
            let len = 1000 + splitmix64(&mut s) % 9000;
            let chunk: Vec<u8> = (size..size + len).map(append_byte).collect();
            fs.data().write(ino, FileOffset::new(size), &chunk).await.unwrap();
            size += len;
            if i % 3 == 2 {
                fs.data().fsync(ino, false).await.unwrap();
                promises.push((f.log_len(), size));
            }
        }
    });
    check_crashes(&rec, seed, async |fs: &Fs, promised: Option<&u64>, _next| verify_appends(fs, promised).await);
}

/// The same append workload through direct I/O: unwritten extents are
/// allocated, submitted, and converted on completion.
#[test]
fn direct_appends_with_fsync_never_show_stale_data() {
    direct_appends_with_fsync_never_show_stale_data_workload();
}

#[test]
fn direct_appends_with_fsync_never_show_stale_data_reordered() {
    reordered(direct_appends_with_fsync_never_show_stale_data_workload);
}

#[test]
fn direct_appends_with_fsync_never_show_stale_data_with_data_checksums() {
    with_data_checksums(direct_appends_with_fsync_never_show_stale_data_workload);
}

#[test]
fn direct_appends_with_fsync_never_show_stale_data_on_rbd() {
    on_rbd(direct_appends_with_fsync_never_show_stale_data_workload);
}

fn direct_appends_with_fsync_never_show_stale_data_workload() {
    let seed = test_seed();
    let rec = record(async move |fs: Fs, f, promises: &mut Vec<(usize, u64)>| {
        let c = Creds::root();
        let (file, _) = fs.create(&c, ROOT_INO, b"log", 0o644, 2).await.unwrap();
        let ino = file.ino();
        let mut size = 0u64;
        let mut s = seed;
        for _round in 0..12 {
            // Four appends in flight at once, then fdatasync.
            let done = std::rc::Rc::new(std::cell::Cell::new(0));
            for _ in 0..4 {
                let len = 4096 * (1 + splitmix64(&mut s) % 4);
                let mut buf = AlignedBuf::zeroed(len as usize, 4096);
                for (k, b) in buf.iter_mut().enumerate() {
                    *b = append_byte(size + k as u64);
                }
                let (fs, done, at) = (fs.clone(), done.clone(), size);
                keelfs_reactor::spawn_local(async move {
                    fs.data().write_direct(ino, FileOffset::new(at), buf).await.1.unwrap();
                    done.set(done.get() + 1);
                });
                size += len;
            }
            while done.get() < 4 {
                keelfs_reactor::yield_now().await;
            }
            fs.data().fsync(ino, true).await.unwrap();
            promises.push((f.log_len(), size));
        }
    });
    check_crashes(&rec, seed, async |fs: &Fs, promised: Option<&u64>, _next| verify_appends(fs, promised).await);
}

/// Direct overwrites: no journal at all, only the device and its flushes.
#[test]
fn direct_overwrites_with_fsync_keep_a_synced_or_newer_version() {
    direct_overwrites_with_fsync_keep_a_synced_or_newer_version_workload();
}

#[test]
fn direct_overwrites_with_fsync_keep_a_synced_or_newer_version_reordered() {
    reordered(direct_overwrites_with_fsync_keep_a_synced_or_newer_version_workload);
}

/// On an image with data checksums, overwrites go in place and log
/// nothing: their regions are open on the device, checkpoints (one every
/// 20 writes) write their entries back and close them, and a crash
/// anywhere is settled by the mount, after which every block checks.
#[test]
fn direct_overwrites_with_fsync_keep_a_synced_or_newer_version_with_data_checksums() {
    with_data_checksums(direct_overwrites_with_fsync_keep_a_synced_or_newer_version_workload);
}

#[test]
fn direct_overwrites_with_fsync_keep_a_synced_or_newer_version_on_rbd() {
    on_rbd(direct_overwrites_with_fsync_keep_a_synced_or_newer_version_workload);
}

fn direct_overwrites_with_fsync_keep_a_synced_or_newer_version_workload() {
    const BLOCKS: u64 = 32;
    let seed = test_seed();
    let rec = record(async move |fs: Fs, f, promises: &mut Vec<(usize, Vec<u64>)>| {
        let c = Creds::root();
        let (file, _) = fs.create(&c, ROOT_INO, b"db", 0o644, 2).await.unwrap();
        let ino = file.ino();
        let mut gens = vec![0u64; BLOCKS as usize];
        for b in 0..BLOCKS {
            fs.data().write(ino, FileOffset::new(b * 4096), &sector_image(b, 0)).await.unwrap();
        }
        fs.data().fsync(ino, false).await.unwrap();
        promises.push((f.log_len(), gens.clone()));
        let mut s = seed;
        for i in 1..=80u64 {
            let b = splitmix64(&mut s) % BLOCKS;
            let mut buf = AlignedBuf::zeroed(4096, 4096);
            buf.copy_from_slice(&sector_image(b, i));
            fs.data().write_direct(ino, FileOffset::new(b * 4096), buf).await.1.unwrap();
            gens[b as usize] = i;
            if i % 8 == 0 {
                fs.data().fsync(ino, true).await.unwrap();
                promises.push((f.log_len(), gens.clone()));
            }
            checkpoint_now_and_then(&fs, i).await;
        }
    });
    check_crashes_on(&rec, seed, async move |fs: &Fs, dev: &Arc<dyn BlockDevice>, promised: Option<&Vec<u64>>, _| {
        verify_overwrites(fs, promised, BLOCKS).await;
        all_blocks_check_after_mount(dev).await;
    });
}

/// With data checksums: a checkpoint every 20 writes, which writes the
/// entries of overwrites in place back and closes their regions.
async fn checkpoint_now_and_then(fs: &Fs, i: u64) {
    if CHECKSUMS.get() && i % 20 == 10 {
        fs.admin().checkpoint().await.unwrap();
    }
}

/// With data checksums: once mounted, no region is left open, and every
/// written block matches its entry (the mount set those a crash left
/// behind their data).
async fn all_blocks_check_after_mount(dev: &Arc<dyn BlockDevice>) {
    if !CHECKSUMS.get() {
        return;
    }
    let report = fsck_with(channel(dev), FsckOptions { data: true }, |_| {}).await.expect("fsck ran");
    assert!(report.is_clean(), "after the mount: {:?}", report.problems);
    assert_eq!((report.data_regions_open, report.data_blocks_unverifiable), (0, 0), "after the mount: {report:?}");
}

/// Every sector of the "db" file holds its own block's data at the synced
/// generation or a newer one: never another block's, never older.
async fn verify_overwrites(fs: &Fs, promised: Option<&Vec<u64>>, blocks: u64) {
    let Some(promised) = promised else { return };
    let ino = lookup(fs, ROOT_INO, "db").await.expect("fsynced file exists");
    let data = read_all(fs, ino).await;
    assert_eq!(data.len() as u64, blocks * 4096);
    for b in 0..blocks {
        for sector in 0..8u64 {
            let at = (b * 4096 + sector * 512) as usize;
            let s = &data[at..at + 512];
            let blk = u64::from_le_bytes(s[..8].try_into().unwrap());
            let generation = u64::from_le_bytes(s[8..16].try_into().unwrap());
            assert_eq!(blk, b, "sector {sector} of block {b} holds another block's data");
            assert!(generation >= promised[b as usize], "block {b} went back to generation {generation}");
            assert_eq!(s, &sector_image(b, generation)[sector as usize * 512..(sector as usize + 1) * 512]);
        }
    }
}

fn sector_image(block: u64, generation: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(4096);
    for sector in 0..8u64 {
        let mut s = vec![0u8; 512];
        s[..8].copy_from_slice(&block.to_le_bytes());
        s[8..16].copy_from_slice(&generation.to_le_bytes());
        s[16..24].copy_from_slice(&sector.to_le_bytes());
        s[24..].fill((block * 31 + generation) as u8);
        out.extend(s);
    }
    out
}

#[test]
fn overwrites_with_fsync_keep_a_synced_or_newer_version_of_every_sector() {
    overwrites_with_fsync_keep_a_synced_or_newer_version_of_every_sector_workload();
}

/// Buffered overwrites on an image with data checksums: writeback writes
/// in place, with the crcs of the page cache's pages.
#[test]
fn overwrites_with_fsync_keep_a_synced_or_newer_version_of_every_sector_with_data_checksums() {
    with_data_checksums(overwrites_with_fsync_keep_a_synced_or_newer_version_of_every_sector_workload);
}

fn overwrites_with_fsync_keep_a_synced_or_newer_version_of_every_sector_workload() {
    const BLOCKS: u64 = 64;
    let seed = test_seed();
    let rec = record(async move |fs: Fs, f, promises: &mut Vec<(usize, Vec<u64>)>| {
        let c = Creds::root();
        let (file, _) = fs.create(&c, ROOT_INO, b"db", 0o644, 2).await.unwrap();
        let ino = file.ino();
        let mut gens = vec![0u64; BLOCKS as usize];
        for b in 0..BLOCKS {
            fs.data().write(ino, FileOffset::new(b * 4096), &sector_image(b, 0)).await.unwrap();
        }
        fs.data().fsync(ino, false).await.unwrap();
        promises.push((f.log_len(), gens.clone()));
        let mut s = seed;
        for i in 1..=120u64 {
            let b = splitmix64(&mut s) % BLOCKS;
            fs.data().write(ino, FileOffset::new(b * 4096), &sector_image(b, i)).await.unwrap();
            gens[b as usize] = i;
            if i % 10 == 0 {
                fs.data().fsync(ino, false).await.unwrap();
                promises.push((f.log_len(), gens.clone()));
            }
            checkpoint_now_and_then(&fs, i).await;
        }
    });
    check_crashes_on(&rec, seed, async move |fs: &Fs, dev: &Arc<dyn BlockDevice>, promised: Option<&Vec<u64>>, _| {
        verify_overwrites(fs, promised, BLOCKS).await;
        all_blocks_check_after_mount(dev).await;
    });
}

#[test]
fn truncates_with_fsync_land_on_a_synced_state() {
    let seed = test_seed();
    let rec = record(async move |fs: Fs, f, promises: &mut Vec<(usize, Vec<u8>)>| {
        let c = Creds::root();
        let (file, _) = fs.create(&c, ROOT_INO, b"t", 0o644, 2).await.unwrap();
        let ino = file.ino();
        let mut model: Vec<u8> = Vec::new();
        let mut s = seed;
        fs.data().fsync(ino, false).await.unwrap();
        promises.push((f.log_len(), model.clone()));
        for i in 0..30u8 {
            if splitmix64(&mut s).is_multiple_of(2) {
                let size = splitmix64(&mut s) % 200_000;
                fs.setattr(&c, ino, &SetAttr { size: Some(size), ..Default::default() }, true).await.unwrap();
                model.resize(size as usize, 0);
            } else {
                let off = splitmix64(&mut s) % 150_000;
                let len = 1 + splitmix64(&mut s) % 30_000;
                let data = vec![i + 1; len as usize];
                fs.data().write(ino, FileOffset::new(off), &data).await.unwrap();
                if model.len() < (off + len) as usize {
                    model.resize((off + len) as usize, 0);
                }
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
            }
            fs.data().fsync(ino, false).await.unwrap();
            promises.push((f.log_len(), model.clone()));
        }
    });
    check_crashes(&rec, seed, async |fs: &Fs, promised: Option<&Vec<u8>>, next: Option<&Vec<u8>>| {
        let Some(promised) = promised else { return };
        let ino = lookup(fs, ROOT_INO, "t").await.expect("fsynced file exists");
        let data = read_all(fs, ino).await;
        let empty = Vec::new();
        let next = next.unwrap_or(&empty);
        assert!(
            data.len() == promised.len() || data.len() == next.len(),
            "size {} is neither the synced {} nor the next {}",
            data.len(),
            promised.len(),
            next.len()
        );
        // The one operation after the sync may be partly on the device, but
        // every byte is from the synced state or the next one: never stale,
        // never garbage.
        for (o, &b) in data.iter().enumerate() {
            let old = promised.get(o).copied().unwrap_or(0);
            let new = next.get(o).copied().unwrap_or(0);
            assert!(b == old || b == new, "byte {o} is {b:#x}, expected {old:#x} or {new:#x}");
        }
    });
}

/// A file's blocks freed while a checkpoint is written in pieces stay out
/// of the allocator until it lands: the checkpoint is the state at its
/// start, where the file still owns them, so neither its own blocks nor
/// another file's may be those.
#[test]
fn blocks_freed_during_a_checkpoint_in_pieces_stay_its_files() {
    let seed = test_seed();
    let config = FsConfig { checkpoint_piece_nodes: 1, ..FsConfig::default() };
    let rec = record_with_config(0, config, async move |fs: Fs, f, promises: &mut Vec<(usize, Vec<u8>)>| {
        let c = Creds::root();
        for i in 0..64 {
            fs.mknod(&c, ROOT_INO, format!("empty-{i}").as_bytes(), libc::S_IFREG | 0o644, 0).await.unwrap();
        }
        let (big, fh) = fs.create(&c, ROOT_INO, b"big", 0o644, 2).await.unwrap();
        fs.data().write(big.ino(), FileOffset::new(0), &vec![0x42; 1 << 20]).await.unwrap();
        fs.release(fh).await.unwrap();
        fs.sync().await.unwrap();
        let before = fs.inspect().counters().checkpoints;
        let pieces = fs.clone();
        keelfs_reactor::spawn_local(async move { pieces.admin().checkpoint_in_pieces().await.unwrap() });
        for _ in 0..1000 {
            if fs.inspect().checkpointing_in_pieces() {
                break;
            }
            keelfs_reactor::next_tick().await;
        }
        assert!(fs.inspect().checkpointing_in_pieces(), "the checkpoint is in its pieces");
        fs.unlink(&c, ROOT_INO, b"big").await.unwrap();
        fs.forget(big.ino(), 1).await.unwrap();
        fs.sync().await.unwrap();
        assert!(fs.inspect().checkpointing_in_pieces(), "the frees were committed during the pieces");
        for _ in 0..10_000 {
            if fs.inspect().counters().checkpoints > before {
                break;
            }
            keelfs_reactor::next_tick().await;
        }
        assert_eq!(fs.inspect().counters().checkpoints, before + 1, "the checkpoint in pieces landed");
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
        // Then a file that may take the blocks big had.
        let (after, fh) = fs.create(&c, ROOT_INO, b"after", 0o644, 2).await.unwrap();
        let body = vec![0x17; 256 << 10];
        fs.data().write(after.ino(), FileOffset::new(0), &body).await.unwrap();
        fs.release(fh).await.unwrap();
        fs.sync().await.unwrap();
        promises.push((f.log_len(), body));
    });
    check_crashes(&rec, seed, async |fs: &Fs, promised: Option<&Vec<u8>>, _next| {
        let Some(body) = promised else { return };
        assert_eq!(lookup(fs, ROOT_INO, "big").await, None, "big was unlinked before the promise");
        let after = lookup(fs, ROOT_INO, "after").await.expect("after was synced");
        assert_eq!(&read_all(fs, after).await, body);
        fs.inspect().check_block_ownership().unwrap();
        fs.inspect().assert_invariants();
    });
}

/// What a crash must keep of the clone workload: each file's bytes (`b`
/// None before its clone's fsync returned).
#[derive(Clone)]
struct ClonePromise {
    a: Vec<u8>,
    b: Option<Vec<u8>>,
}

const CLONE_SOURCE_BYTES: usize = 16 * 4096 + 1234;

fn clone_pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed.wrapping_mul(37)).collect()
}

/// Clones and copy on write (issue 37): a file cloned through
/// copy_file_range, then each copy written (copy on write) and fsynced.
/// At every crash point each 4 KiB block of each file is what the newest
/// promise says or what the next one will (a write in flight shows whole
/// blocks or none), never stale, and never the other file's write: a
/// shared block is never written in place.
#[test]
fn clones_and_copy_on_write_survive_a_crash_anywhere() {
    let seed = test_seed();
    let rec = record(async move |fs: Fs, f, promises: &mut Vec<(usize, ClonePromise)>| {
        let c = Creds::root();
        let (a, _) = fs.create(&c, ROOT_INO, b"a", 0o644, 2).await.unwrap();
        let (b, _) = fs.create(&c, ROOT_INO, b"b", 0o644, 2).await.unwrap();
        let (a, b) = (a.ino(), b.ino());
        let mut a_now = clone_pattern(1, CLONE_SOURCE_BYTES);
        fs.data().write(a, FileOffset::new(0), &a_now).await.unwrap();
        fs.data().fsync(a, false).await.unwrap();
        promises.push((f.log_len(), ClonePromise { a: a_now.clone(), b: None }));
        let len = CLONE_SOURCE_BYTES as u64;
        assert_eq!(fs.data().copy_range(a, FileOffset::new(0), b, FileOffset::new(0), len).await.unwrap(), len);
        fs.data().fsync(b, false).await.unwrap();
        let mut b_now = a_now.clone();
        promises.push((f.log_len(), ClonePromise { a: a_now.clone(), b: Some(b_now.clone()) }));
        let patch = clone_pattern(2, 3 * 4096 + 100);
        fs.data().write(b, FileOffset::new(4146), &patch).await.unwrap();
        fs.data().fsync(b, false).await.unwrap();
        b_now[4146..4146 + patch.len()].copy_from_slice(&patch);
        promises.push((f.log_len(), ClonePromise { a: a_now.clone(), b: Some(b_now.clone()) }));
        let patch = clone_pattern(3, 8192);
        let at = CLONE_SOURCE_BYTES - 9000;
        fs.data().write(a, FileOffset::new(at as u64), &patch).await.unwrap();
        fs.data().fsync(a, false).await.unwrap();
        a_now[at..at + patch.len()].copy_from_slice(&patch);
        promises.push((f.log_len(), ClonePromise { a: a_now, b: Some(b_now) }));
    });
    check_crashes(&rec, seed, async |fs: &Fs, promised: Option<&ClonePromise>, next| {
        verify_clones(fs, promised, next).await;
    });
}

async fn verify_clones(fs: &Fs, promised: Option<&ClonePromise>, next: Option<&ClonePromise>) {
    let Some(promised) = promised else { return };
    let a = read_all(fs, lookup(fs, ROOT_INO, "a").await.expect("a was fsynced")).await;
    blocks_from(&a, &promised.a, next.map(|n| &n.a), "a");
    let b = read_all(fs, lookup(fs, ROOT_INO, "b").await.expect("b was fsynced with a")).await;
    match &promised.b {
        Some(want) => blocks_from(&b, want, next.and_then(|n| n.b.as_ref()), "b"),
        // The clone may have committed before its fsync returned: whole.
        None => assert!(b.is_empty() || Some(&b) == next.and_then(|n| n.b.as_ref()), "b half cloned"),
    }
}

/// Each 4 KiB block of `got` is `promised`'s or `next`'s.
fn blocks_from(got: &[u8], promised: &[u8], next: Option<&Vec<u8>>, name: &str) {
    assert_eq!(got.len(), promised.len(), "{name}'s size");
    for (i, block) in got.chunks(4096).enumerate() {
        let at = i * 4096..(i * 4096 + block.len());
        let from_next = next.is_some_and(|n| n.get(at.clone()) == Some(block));
        assert!(block == &promised[at] || from_next, "{name}'s block {i} is neither promised nor in flight");
    }
}

/// What a snapshot workload promised at a sync: the live file, and the
/// snapshots that must exist with the file as each holds it.
#[derive(Clone)]
struct SnapshotPromise {
    live: Vec<u8>,
    snapshots: Vec<(&'static str, Vec<u8>)>,
}

const WHEN: keelfs_fs::Timespec = keelfs_fs::Timespec { sec: 1_764_000_000, nsec: 0 };

/// Snapshots created and deleted while a file is rewritten, crashed
/// anywhere: fsck is clean (so every count and the free-block count hold
/// whichever superblock the crash left), the live file is a synced or
/// newer version block by block, and every snapshot the mount lists was
/// promised (or was being made) and holds the file as it was when taken.
#[test]
fn snapshots_survive_a_crash_anywhere() {
    let seed = test_seed();
    let rec = record(async move |fs: Fs, f, promises: &mut Vec<(usize, SnapshotPromise)>| {
        let (a, _) = fs.create(&Creds::root(), ROOT_INO, b"a", 0o644, 2).await.unwrap();
        let a = a.ino();
        let v1 = clone_pattern(1, CLONE_SOURCE_BYTES);
        fs.data().write(a, FileOffset::new(0), &v1).await.unwrap();
        fs.data().fsync(a, false).await.unwrap();
        promises.push((f.log_len(), SnapshotPromise { live: v1.clone(), snapshots: vec![] }));
        fs.admin().snapshot_create("s1", WHEN).await.unwrap();
        promises.push((f.log_len(), SnapshotPromise { live: v1.clone(), snapshots: vec![("s1", v1.clone())] }));
        // Direct and buffered rewrites copy on write.
        let mut v2 = v1.clone();
        let patch = clone_pattern(2, 4 * 4096);
        let mut buf = AlignedBuf::zeroed(patch.len(), 4096);
        buf.copy_from_slice(&patch);
        assert!(fs.data().write_direct(a, FileOffset::new(8192), buf).await.1.is_ok());
        v2[8192..8192 + patch.len()].copy_from_slice(&patch);
        let patch = clone_pattern(3, 5000);
        fs.data().write(a, FileOffset::new(30_000), &patch).await.unwrap();
        v2[30_000..35_000].copy_from_slice(&patch);
        fs.data().fsync(a, false).await.unwrap();
        promises.push((f.log_len(), SnapshotPromise { live: v2.clone(), snapshots: vec![("s1", v1.clone())] }));
        fs.admin().snapshot_create("s2", WHEN).await.unwrap();
        let both = vec![("s1", v1.clone()), ("s2", v2.clone())];
        promises.push((f.log_len(), SnapshotPromise { live: v2.clone(), snapshots: both }));
        fs.admin().snapshot_delete("s1").await.unwrap();
        promises.push((f.log_len(), SnapshotPromise { live: v2.clone(), snapshots: vec![("s2", v2.clone())] }));
        let v3 = clone_pattern(4, CLONE_SOURCE_BYTES);
        fs.data().write(a, FileOffset::new(0), &v3).await.unwrap();
        fs.data().fsync(a, false).await.unwrap();
        promises.push((f.log_len(), SnapshotPromise { live: v3.clone(), snapshots: vec![("s2", v2.clone())] }));
        fs.admin().snapshot_delete("s2").await.unwrap();
        promises.push((f.log_len(), SnapshotPromise { live: v3, snapshots: vec![] }));
    });
    check_crashes_on(
        &rec,
        seed,
        async |fs: &Fs, dev: &Arc<dyn BlockDevice>, promised: Option<&SnapshotPromise>, next| {
            verify_snapshots(fs, dev, promised, next).await;
        },
    );
}

async fn verify_snapshots(
    fs: &Fs,
    dev: &Arc<dyn BlockDevice>,
    promised: Option<&SnapshotPromise>,
    next: Option<&SnapshotPromise>,
) {
    fs.inspect().assert_invariants();
    fs.inspect().check_block_ownership().unwrap();
    let Some(promised) = promised else { return };
    let a = read_all(fs, lookup(fs, ROOT_INO, "a").await.expect("a was fsynced")).await;
    blocks_from(&a, &promised.live, next.map(|n| &n.live), "a");
    let listed: Vec<String> = fs.admin().snapshot_list().into_iter().map(|s| s.name).collect();
    let in_next = |name: &str| next.into_iter().flat_map(|n| n.snapshots.iter()).find(|s| s.0 == name);
    for (name, _) in &promised.snapshots {
        let going = next.is_some() && in_next(name).is_none();
        assert!(going || listed.iter().any(|l| l == name), "snapshot {name} was promised and is gone");
    }
    for name in &listed {
        let want = promised.snapshots.iter().find(|s| s.0 == name).or_else(|| in_next(name));
        let Some((_, want)) = want else { panic!("snapshot {name} was neither promised nor being made") };
        let config = FsConfig { read_only: true, snapshot: Some(name.clone()), ..FsConfig::default() };
        let snap = Fs::mount(channel(dev), config).await.unwrap();
        let got = read_all(&snap, lookup(&snap, ROOT_INO, "a").await.expect("a is in every snapshot")).await;
        assert!(&got == want, "snapshot {name} does not hold a as it was");
        snap.unmount().await.unwrap();
    }
}
