//! The I/O workloads of `keelfs-bench core`: the five seed behaviours,
//! driven in process as concurrent tasks on one reactor.

use keelfs_fs::FileOffset;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

use keelfs_base::testing::splitmix64;
use keelfs_bdev::AlignedBuf;
use keelfs_fs::Ino;
use keelfs_fs::ROOT_INO;
use keelfs_fs::{Creds, Fs, FsCounters, SharedReader};
use keelfs_reactor as reactor;
use serde_json::{json, Value};

use crate::core::Params;
use crate::hist::Histogram;

async fn create(fs: &Fs, name: &str) -> anyhow::Result<Ino> {
    Ok(fs.create(&Creds::root(), ROOT_INO, name.as_bytes(), 0o644, 2).await?.0.ino())
}

/// Fill `ino` with `size` bytes through direct 1 MiB writes, then sync.
async fn preallocate(fs: &Fs, ino: Ino, size: u64) -> anyhow::Result<()> {
    let mut off = 0;
    while off < size {
        let len = (size - off).min(1 << 20);
        let mut buf = AlignedBuf::zeroed(len as usize, 4096);
        buf.fill(0x5a);
        fs.data().write_direct(ino, FileOffset::new(off), buf).await.1?;
        off += len;
    }
    fs.sync().await?;
    Ok(())
}

#[derive(Default)]
struct Tally {
    ops: Cell<u64>,
    hist: RefCell<Option<Histogram>>,
}

impl Tally {
    fn new() -> Rc<Self> {
        Rc::new(Tally { ops: Cell::new(0), hist: RefCell::new(Some(Histogram::new())) })
    }
    fn record(&self, started: Instant) {
        self.ops.set(self.ops.get() + 1);
        if let Some(h) = self.hist.borrow_mut().as_mut() {
            h.record(started.elapsed().as_nanos() as u64);
        }
    }
    fn latency(&self) -> (f64, f64) {
        let h = self.hist.borrow();
        let h = h.as_ref().expect("histogram");
        (h.quantile(0.5) as f64 / 1000.0, h.quantile(0.99) as f64 / 1000.0)
    }
}

/// Run `tasks` until `deadline`; each calls `op(task, iteration)`, which
/// returns false to stop early.
async fn run_tasks<F, Fut>(tasks: u32, duration: Duration, op: F) -> anyhow::Result<(Rc<Tally>, f64)>
where
    F: Fn(u32, u64) -> Fut + Clone + 'static,
    Fut: std::future::Future<Output = anyhow::Result<bool>> + 'static,
{
    let tally = Tally::new();
    let finished = Rc::new(Cell::new(0u32));
    let failure: Rc<RefCell<Option<anyhow::Error>>> = Rc::default();
    let start = Instant::now();
    let deadline = start + duration;
    for t in 0..tasks {
        let (op, tally, finished, failure) = (op.clone(), tally.clone(), finished.clone(), failure.clone());
        reactor::spawn_local(async move {
            let mut i = 0;
            while Instant::now() < deadline {
                let began = Instant::now();
                match op(t, i).await {
                    Ok(true) => tally.record(began),
                    Ok(false) => break,
                    Err(e) => {
                        failure.borrow_mut().get_or_insert(e);
                        break;
                    }
                }
                i += 1;
                reactor::yield_now().await;
            }
            finished.set(finished.get() + 1);
        });
    }
    while finished.get() < tasks {
        reactor::sleep(Duration::from_millis(1)).await;
    }
    if let Some(e) = failure.borrow_mut().take() {
        return Err(e);
    }
    Ok((tally, start.elapsed().as_secs_f64()))
}

fn delta(a: FsCounters, b: FsCounters) -> Value {
    json!({
        "journal_commits": b.journal_commits - a.journal_commits,
        "journal_blocks_written": b.journal_blocks_written - a.journal_blocks_written,
        "records_logged": b.records_logged - a.records_logged,
        "device_flushes": b.device_flushes - a.device_flushes,
    })
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

pub async fn dio_overwrite(fs: &Fs, p: &Params) -> anyhow::Result<Value> {
    let ino = create(fs, "dio").await?;
    preallocate(fs, ino, p.file_size).await?;
    let blocks = p.file_size / 4096;
    let before = fs.inspect().counters();
    let fs2 = fs.clone();
    let (tally, secs) = run_tasks(p.threads, p.seconds, move |t, i| {
        let fs = fs2.clone();
        async move {
            let mut s = (u64::from(t) << 40) ^ i;
            let off = (splitmix64(&mut s) % blocks) * 4096;
            let mut buf = AlignedBuf::zeroed(4096, 4096);
            buf[0] = i as u8;
            fs.data().write_direct(ino, FileOffset::new(off), buf).await.1?;
            Ok(true)
        }
    })
    .await?;
    let after = fs.inspect().counters();
    let (p50, p99) = tally.latency();
    Ok(json!({
        "bench": "core", "workload": "dio-overwrite", "threads": p.threads,
        "iops": (tally.ops.get() as f64 / secs).round(),
        "lat_us_p50": p50, "lat_us_p99": p99,
        "direct_overwrites": after.direct_overwrites - before.direct_overwrites,
        "direct_in_flight_max": after.direct_in_flight_max,
        "during_run": delta(before, after),
    }))
}

pub async fn aio_append(fs: &Fs, p: &Params) -> anyhow::Result<Value> {
    let ino = create(fs, "append").await?;
    let next = Rc::new(Cell::new(0u64));
    let limit = p.file_size;
    let before = fs.inspect().counters();
    let (fs2, next2) = (fs.clone(), next.clone());
    let (tally, secs) = run_tasks(p.iodepth, p.seconds, move |_, _| {
        let (fs, next) = (fs2.clone(), next2.clone());
        async move {
            let off = next.get();
            if off + 4096 > limit {
                return Ok(false); // the file is full: stop
            }
            next.set(off + 4096);
            fs.data().write_direct(ino, FileOffset::new(off), AlignedBuf::zeroed(4096, 4096)).await.1?;
            Ok(true)
        }
    })
    .await?;
    let after = fs.inspect().counters();
    let (p50, p99) = tally.latency();
    Ok(json!({
        "bench": "core", "workload": "aio-append", "iodepth": p.iodepth,
        "iops": (tally.ops.get() as f64 / secs).round(),
        "lat_us_p50": p50, "lat_us_p99": p99,
        "direct_in_flight_max": after.direct_in_flight_max,
        "file_bytes": fs.getattr(ino).await?.inode.size,
        "extents": fs.inspect().extent_count(ino)?,
        "during_run": delta(before, after),
    }))
}

thread_local! {
    /// The filesystem of the reactor that owns it, for jobs other reactors
    /// send there (reads that missed the shared cache).
    static OWNER_FS: RefCell<Option<Fs>> = const { RefCell::new(None) };
}

/// Where seed 004's readers run.
enum Readers {
    /// As tasks on the reactor that owns the filesystem, beside the writers.
    OnOwner,
    /// As tasks on a second reactor (another core): cached pages are read
    /// there without a lock; a read that misses goes to the owner as a
    /// message.
    Apart { reactor: reactor::ReactorHandle, shared: SharedReader, owner: reactor::ReactorHandle },
}

/// What a phase of reads did.
struct ReadPhase {
    ops: u64,
    secs: f64,
    sent_to_owner: u64,
}

/// 8k random reads by 2 tasks for `seconds`, where `readers` says.
async fn read_phase(fs: &Fs, readers: &Readers, ino: Ino, pages: u64, seconds: Duration) -> anyhow::Result<ReadPhase> {
    let read_offset = move |t: u32, i: u64| {
        let mut s = (u64::from(t) << 40) ^ i ^ 0xabc;
        (splitmix64(&mut s) % pages) * 8192
    };
    match readers {
        Readers::OnOwner => {
            let fs = fs.clone();
            let (tally, secs) = run_tasks(2, seconds, move |t, i| {
                let fs = fs.clone();
                async move {
                    std::hint::black_box(fs.data().read(ino, FileOffset::new(read_offset(t, i)), 8192).await?);
                    Ok(true)
                }
            })
            .await?;
            Ok(ReadPhase { ops: tally.ops.get(), secs, sent_to_owner: 0 })
        }
        Readers::Apart { reactor, shared, owner } => {
            let (shared, owner) = (shared.clone(), owner.clone());
            let job = move || async move {
                let sent = Rc::new(Cell::new(0u64));
                let sent2 = sent.clone();
                let (tally, secs) = run_tasks(2, seconds, move |t, i| {
                    let (shared, owner, sent) = (shared.clone(), owner.clone(), sent2.clone());
                    async move {
                        let off = read_offset(t, i);
                        let mut buf = Vec::with_capacity(8192);
                        if shared.read_into(off, 8192, &mut buf).is_err() {
                            sent.set(sent.get() + 1);
                            let read = reactor::call_and_wait(&owner, move || async move {
                                let fs = OWNER_FS.with(|o| o.borrow().clone()).expect("the owner's filesystem");
                                fs.data().read(ino, FileOffset::new(off), 8192).await.map(|d| d.len())
                            });
                            read.await.ok_or_else(|| anyhow::anyhow!("the owning reactor stopped"))??;
                        }
                        std::hint::black_box(&buf);
                        Ok(true)
                    }
                })
                .await?;
                anyhow::Ok(ReadPhase { ops: tally.ops.get(), secs, sent_to_owner: sent.get() })
            };
            let phase = reactor::call_and_wait(reactor, job).await;
            phase.ok_or_else(|| anyhow::anyhow!("the reader reactor stopped"))?
        }
    }
}

type ReaderThread = (reactor::ReactorHandle, std::thread::JoinHandle<()>);

/// buffered-randrw's readers: beside the writers, or on a second reactor
/// that reads the owner's cache through a shared reader.
fn start_readers(fs: &Fs, p: &Params, ino: Ino) -> anyhow::Result<(Readers, Option<ReaderThread>)> {
    if p.readers_on_owner {
        return Ok((Readers::OnOwner, None));
    }
    OWNER_FS.with(|o| *o.borrow_mut() = Some(fs.clone()));
    // The readers' reactor sleeps while both readers wait on the owner (a
    // miss), leaving the core to the owner and io_uring's workers.
    let config = reactor::ReactorConfig { id: 1, mode: reactor::PollMode::Interrupt, ..Default::default() };
    let (handle, join) = reactor::Reactor::spawn(config, || {})?;
    let readers =
        Readers::Apart { reactor: handle.clone(), shared: fs.data().shared_reader(ino)?, owner: reactor::current() };
    Ok((readers, Some((handle, join))))
}

fn stop_readers(reader_thread: Option<ReaderThread>) -> anyhow::Result<()> {
    if let Some((handle, join)) = reader_thread {
        handle.stop();
        join.join().map_err(|_| anyhow::anyhow!("the reader reactor panicked"))?;
        OWNER_FS.with(|o| o.borrow_mut().take());
    }
    Ok(())
}

/// Polls `slot` each millisecond until a task leaves its result there.
async fn wait_for(slot: &Cell<Option<anyhow::Result<()>>>) -> anyhow::Result<()> {
    loop {
        if let Some(result) = slot.take() {
            return result;
        }
        reactor::sleep(Duration::from_millis(1)).await;
    }
}

/// Seed 004: 8k random reads and writes on one file, 2 reader and 2
/// writer streams. The writers run on the filesystem's reactor; the
/// readers on a second reactor (default) or beside the writers.
pub async fn buffered_randrw(fs: &Fs, p: &Params) -> anyhow::Result<Value> {
    let ino = create(fs, "randrw").await?;
    preallocate(fs, ino, p.file_size).await?;
    let pages = p.file_size / 8192;
    let (readers, reader_thread) = start_readers(fs, p, ino)?;
    // Warm the cache, then alternate readers-alone and readers-with-writers
    // phases, so that both see the same machine noise.
    read_phase(fs, &readers, ino, pages, p.seconds).await?;
    let data = Rc::new(vec![0x77u8; 8192]);
    let writers_ops = Rc::new(Cell::new(0u64));
    let (fs_w, data_w, wops) = (fs.clone(), data.clone(), writers_ops.clone());
    let write_op = move |t: u32, i: u64| {
        let (fs, data, wops) = (fs_w.clone(), data_w.clone(), wops.clone());
        async move {
            let mut s = (u64::from(t) << 40) ^ i ^ 0xdef;
            let off = (splitmix64(&mut s) % pages) * 8192;
            fs.data().write(ino, FileOffset::new(off), &data).await?;
            wops.set(wops.get() + 1);
            Ok(true)
        }
    };
    let (mut alone_iops, mut mixed_iops, mut write_iops) = (Vec::new(), Vec::new(), Vec::new());
    let (mut mixed_reads, mut shared_waits, mut sent_to_owner) = (0u64, 0u64, 0u64);
    let shared_before = fs.inspect().cache_stats();
    for _ in 0..p.rounds.max(1) {
        let alone = read_phase(fs, &readers, ino, pages, p.seconds).await?;
        alone_iops.push(alone.ops as f64 / alone.secs);
        writers_ops.set(0);
        let start = Instant::now();
        let writers: Rc<Cell<Option<anyhow::Result<()>>>> = Rc::default();
        {
            let (done, seconds, write_op) = (writers.clone(), p.seconds, write_op.clone());
            reactor::spawn_local(async move {
                done.set(Some(run_tasks(2, seconds, write_op).await.map(|_| ())));
            });
        }
        let waits_before = fs.inspect().range_lock_waits().0;
        let mixed = read_phase(fs, &readers, ino, pages, p.seconds).await?;
        shared_waits += fs.inspect().range_lock_waits().0 - waits_before;
        mixed_reads += mixed.ops;
        sent_to_owner += mixed.sent_to_owner;
        wait_for(&writers).await?;
        mixed_iops.push(mixed.ops as f64 / mixed.secs);
        write_iops.push(writers_ops.get() as f64 / start.elapsed().as_secs_f64());
    }
    stop_readers(reader_thread)?;
    let ratios: Vec<f64> = mixed_iops.iter().zip(&alone_iops).map(|(m, a)| m / a).collect();
    let (read_only_iops, mixed_read_iops) = (median(&alone_iops), median(&mixed_iops));
    let stats = fs.inspect().cache_stats();
    Ok(json!({
        "bench": "core", "workload": "buffered-randrw", "readers": 2, "writers": 2, "bs": 8192,
        "readers_on": if p.readers_on_owner { "owner reactor" } else { "second reactor" },
        "file_bytes": p.file_size,
        "rounds": p.rounds,
        "read_only_iops": read_only_iops.round(),
        "mixed_read_iops": mixed_read_iops.round(),
        "mixed_write_iops": median(&write_iops).round(),
        "mixed_read_ratio": round2(median(&ratios)),
        "mixed_read_ratio_per_round": ratios.iter().map(|r| round2(*r)).collect::<Vec<_>>(),
        "mixed_reads": mixed_reads,
        "mixed_read_lock_waits": shared_waits,
        "mixed_reads_sent_to_owner": sent_to_owner,
        "mixed_total_ops_vs_read_only": round2((mixed_read_iops + median(&write_iops)) / read_only_iops),
        "cache_hits": stats.hits, "cache_misses": stats.misses, "cache_pages": stats.pages,
        "cache_capacity_pages": stats.capacity_pages,
        "shared_hits": stats.shared_hits - shared_before.shared_hits,
        "shared_misses": stats.shared_misses - shared_before.shared_misses,
        "shared_retries": stats.shared_retries - shared_before.shared_retries,
        "shared_hints_dropped": stats.shared_hints_dropped,
    }))
}

/// Seed 003: 1-byte writes, as `dd bs=1` does them. Rounds alternate
/// between normal upkeep of mtime/ctime (in memory, persisted lazily) and
/// none at all, so the difference is what timestamp upkeep costs; a third
/// kind of round reads i_version after every write (an NFS server's worst
/// case), which makes every write bump it.
const BYTE_WRITES_ROUNDS: usize = 5;
const BYTE_WRITES_MODES: [&str; 3] = ["with_times", "without_times", "i_version_observed"];
/// What byte-writes leaves on the device at most: a file per pattern,
/// round and mode, each at most one byte a write.
pub fn byte_writes_bytes(writes_per_round: u64) -> u64 {
    2 * BYTE_WRITES_ROUNDS as u64 * BYTE_WRITES_MODES.len() as u64 * writes_per_round
}

pub async fn byte_writes(fs: &Fs, p: &Params) -> anyhow::Result<Value> {
    let writes_per_round = p.writes;
    let mut journal_writes = 0;
    let before_all = fs.inspect().counters();
    let mut out = json!({"bench": "core", "workload": "byte-writes", "writes_per_round": writes_per_round - 1, "rounds": BYTE_WRITES_ROUNDS});
    for pattern in ["append", "overwrite"] {
        // Nanoseconds per write, per mode, the modes interleaved per round.
        let mut samples: [Vec<f64>; 3] = Default::default();
        for r in 0..BYTE_WRITES_ROUNDS {
            for (m, mode) in BYTE_WRITES_MODES.iter().enumerate() {
                let ino = create(fs, &format!("bytes-{pattern}-{r}-{m}")).await?;
                fs.data().write(ino, FileOffset::new(0), b"x").await?;
                fs.sync().await?;
                fs.inspect().set_file_times_for_benchmark(*mode != "without_times");
                let observe = *mode == "i_version_observed";
                let before = fs.inspect().counters();
                let start = Instant::now();
                for i in 1..writes_per_round {
                    let offset = if pattern == "append" { i } else { i % 4096 };
                    fs.data().write(ino, FileOffset::new(offset), b"y").await?;
                    if observe {
                        fs.i_version(ino).await?;
                    }
                }
                samples[m].push(start.elapsed().as_nanos() as f64 / (writes_per_round - 1) as f64);
                journal_writes += fs.inspect().counters().journal_blocks_written - before.journal_blocks_written;
                fs.inspect().set_file_times_for_benchmark(true);
            }
        }
        let [with, without, observed] = samples.map(|v| median(&v));
        out[pattern] = json!({
            "ns_per_write": round2(with),
            "ns_per_write_without_times": round2(without),
            "ns_per_write_i_version_observed": round2(observed),
            "timestamp_upkeep_cost": round2(with / without - 1.0),
        });
    }
    out["ns_per_write"] = out["append"]["ns_per_write"].clone();
    out["journal_writes"] = json!(journal_writes);
    out["during_run"] = delta(before_all, fs.inspect().counters());
    Ok(out)
}

pub async fn seq_extents(fs: &Fs, p: &Params) -> anyhow::Result<Value> {
    let size = p.file_size;
    anyhow::ensure!(size >= 4096, "--file-size must be at least 4k for seq-extents");
    let buffered = create(fs, "seq-buffered").await?;
    let direct = create(fs, "seq-direct").await?;
    let page = vec![0x33u8; 4096];
    let start = Instant::now();
    for i in 0..size / 4096 {
        fs.data().write(buffered, FileOffset::new(i * 4096), &page).await?;
    }
    fs.sync().await?;
    let buffered_secs = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for i in 0..size / 4096 {
        fs.data().write_direct(direct, FileOffset::new(i * 4096), AlignedBuf::zeroed(4096, 4096)).await.1?;
    }
    fs.sync().await?;
    let direct_secs = start.elapsed().as_secs_f64();
    let mib = size as f64 / f64::from(1 << 20);
    Ok(json!({
        "bench": "core", "workload": "seq-extents", "bytes": size, "write_bytes": 4096,
        "extents_buffered": fs.inspect().extent_count(buffered)?,
        "extents_direct": fs.inspect().extent_count(direct)?,
        "extents": fs.inspect().extent_count(buffered)?.max(fs.inspect().extent_count(direct)?),
        "buffered_mib_s": round2(mib / buffered_secs),
        "direct_mib_s": round2(mib / direct_secs),
    }))
}

/// Pages each fsync-storm task rewrites in turn.
const FSYNC_STORM_PAGES: u64 = 64;
pub const FSYNC_STORM_FILE_BYTES: u64 = FSYNC_STORM_PAGES * 4096;

pub async fn fsync_storm(fs: &Fs, p: &Params) -> anyhow::Result<Value> {
    let mut files = Vec::new();
    for i in 0..p.threads {
        files.push(create(fs, &format!("storm-{i}")).await?);
    }
    fs.sync().await?;
    let before = fs.inspect().counters();
    let files = Rc::new(files);
    let (fs2, files2) = (fs.clone(), files.clone());
    let (tally, secs) = run_tasks(p.threads, p.seconds, move |t, i| {
        let (fs, files) = (fs2.clone(), files2.clone());
        async move {
            let ino = files[t as usize];
            fs.data().write(ino, FileOffset::new((i % FSYNC_STORM_PAGES) * 4096), &[t as u8; 4096]).await?;
            fs.data().fsync(ino, false).await?;
            Ok(true)
        }
    })
    .await?;
    let after = fs.inspect().counters();
    let (p50, p99) = tally.latency();
    let fsyncs = after.fsyncs - before.fsyncs;
    let flushes = after.device_flushes - before.device_flushes;
    Ok(json!({
        "bench": "core", "workload": "fsync-storm", "threads": p.threads,
        "fsyncs": fsyncs, "device_flushes": flushes,
        "journal_commits": after.journal_commits - before.journal_commits,
        "fsyncs_per_flush": round2(fsyncs as f64 / flushes.max(1) as f64),
        "fsync_per_s": (tally.ops.get() as f64 / secs).round(),
        "lat_us_p50": p50, "lat_us_p99": p99,
    }))
}
