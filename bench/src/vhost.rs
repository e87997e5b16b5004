//! `keelfs-bench vhost`: a host-side load generator that speaks
//! vhost-user-fs directly, acting as VMM and guest driver at once, so that
//! keelfsd and virtiofsd can be measured at full speed rather than through
//! a TCG guest. Built on keelfs-vhost's test frontend: memfd guest memory,
//! the vhost crate's frontend, one worker thread per request queue, each
//! keeping `iodepth` FUSE requests in flight.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use keelfs_base::testing::splitmix64;
use keelfs_vhost::abi::{init_flags as f, Opcode, Reply, ENTRY_OUT_BYTES, OUT_HEADER_BYTES};
use keelfs_vhost::frontend::{io_request, FrontendConfig, FsFrontend, QueueDriver, Used};
use serde_json::json;

use crate::hist::Histogram;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// 4k random writes through O_DIRECT handles to preallocated files.
    DioOverwrite,
    /// Seed 000's 50/50 mix of 4k random reads and writes, O_DIRECT.
    DioRandrw,
    /// 4k random reads through O_DIRECT handles of preallocated files
    /// (each read goes to the device: issue 38's verified reads).
    DioRead,
    /// 4k O_DIRECT writes at the end of a growing file.
    AioAppend,
    /// Seed 004: 8k random reads and writes, buffered, on one file: half
    /// the requests in flight are reads, half writes.
    BufferedRandrw,
    /// Seed 003: 1-byte buffered appends.
    ByteWrites,
    /// Metadata (bench/src/vhost_meta.rs): make the tree of --files, each
    /// file a CREATE, a 1-4 KiB WRITE, FLUSH and RELEASE (no FLUSH when
    /// the daemon's open says FOPEN_NOFLUSH, as Linux).
    Create,
    /// LOOKUP and GETATTR of every file in the tree (what `git status`,
    /// `find` and `ls -lR` send).
    Stat,
    /// OPEN, a 4 KiB READ, FLUSH and RELEASE of every file in the tree
    /// (no FLUSH after FOPEN_NOFLUSH).
    OpenReadClose,
    /// OPENDIR, READDIRPLUS to the end, RELEASEDIR of each directory.
    Readdirplus,
    /// UNLINK every file of the tree, then its directories.
    Unlink,
    /// RENAME a file back and forth, one per slot.
    Rename,
    /// MKDIR and RMDIR of a directory, one per slot.
    MkdirRmdir,
    /// Replay a recorded workload's FUSE requests (--trace FILE, from
    /// `keelfsd serve --trace-requests`; bench/src/vhost_trace.rs).
    Trace,
}

impl Workload {
    /// Whether this is one of the metadata workloads.
    pub(crate) fn is_metadata(self) -> bool {
        !matches!(
            self,
            Workload::DioOverwrite
                | Workload::DioRandrw
                | Workload::DioRead
                | Workload::AioAppend
                | Workload::BufferedRandrw
                | Workload::ByteWrites
                | Workload::Trace
        )
    }

    /// Whether the workload runs a count of operations (the whole tree)
    /// rather than until --seconds pass.
    pub(crate) fn counted(self) -> bool {
        matches!(self, Workload::Create | Workload::Unlink)
    }
}

/// How the driver threads wait for replies, as a guest's vCPUs would.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Driver {
    /// Sleep on the call eventfd while every request is in flight, as a
    /// halted vCPU does: the driver leaves its core to the daemon.
    Sleep,
    /// Keep the CPU busy between submissions, spinning on the used ring,
    /// as a running vCPU does: the driver's threads never leave their
    /// cores, and a daemon on the same cores competes with them.
    Busy,
}

impl Driver {
    fn name(self) -> &'static str {
        match self {
            Driver::Sleep => "sleep",
            Driver::Busy => "busy",
        }
    }
}

#[derive(Args, Debug)]
pub struct VhostArgs {
    /// The vhost-user-fs socket of the daemon under test.
    #[arg(long)]
    pub(crate) socket: PathBuf,
    #[arg(long, value_enum)]
    pub(crate) workload: Workload,
    /// Worker threads, each driving its own request queue.
    #[arg(long, default_value_t = 1)]
    pub(crate) threads: usize,
    /// Requests in flight per thread.
    #[arg(long, default_value_t = 32)]
    pub(crate) iodepth: usize,
    /// Request queues to ask for (at least --threads).
    #[arg(long)]
    pub(crate) queues: Option<usize>,
    #[arg(long, default_value_t = 5)]
    pub(crate) seconds: u64,
    /// Bytes per file (overwrite and randrw workloads).
    #[arg(long, value_parser = keelfs_base::parse_size, default_value = "64M")]
    file_size: u64,
    /// The daemon's pid, to report its CPU time per operation.
    #[arg(long)]
    daemon_pid: Option<u32>,
    /// A process serving the daemon's device but charged to neither (a
    /// Ceph OSD): its CPU time per operation is reported apart, and left
    /// out of "other".
    #[arg(long)]
    osd_pid: Option<u32>,
    /// A label for the JSON line (the system under test).
    #[arg(long, default_value = "")]
    pub(crate) label: String,
    /// How the driver threads wait: `sleep` on the call eventfd (a halted
    /// vCPU), or `busy` spinning on the used ring (a running vCPU, which
    /// takes its core from the daemon).
    #[arg(long, value_enum, default_value = "sleep")]
    pub(crate) driver: Driver,
    /// The same as `--driver busy` (its older name).
    #[arg(long, conflicts_with = "driver")]
    pub(crate) spin: bool,
    /// Metadata workloads: files in each thread's tree.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) files: u64,
    /// Metadata workloads: the tree's shape.
    #[arg(long, value_enum, default_value = "wide")]
    pub(crate) tree: crate::vhost_meta::Tree,
    /// stat, open-read-close and readdirplus: whole passes over the tree
    /// (1: a cold pass), instead of running for --seconds.
    #[arg(long, default_value_t = 0)]
    pub(crate) passes: u64,
    /// --workload trace: the recorded trace to replay.
    #[arg(long)]
    pub(crate) trace: Option<PathBuf>,
    /// Overwrite workloads: clone each file once filled (FUSE_COPY_FILE_RANGE
    /// to a twin), so that its blocks are shared and a write to one copies
    /// on write (issue 37). With --once, every write of the first pass is
    /// one.
    #[arg(long)]
    shared: bool,
    /// Overwrite workloads: write the blocks in a fixed permutation rather
    /// than at random, so that none is written twice until all have been.
    #[arg(long)]
    once: bool,
    #[arg(long)]
    pub(crate) json: bool,
}

impl VhostArgs {
    /// How the driver threads wait (--spin is --driver busy).
    pub(crate) fn driver(&self) -> Driver {
        if self.spin {
            Driver::Busy
        } else {
            self.driver
        }
    }
}

/// An errno from a FUSE reply as an error naming `what` failed.
pub(crate) fn check(err: i32, what: &str) -> anyhow::Result<()> {
    if err != 0 {
        bail!("{what}: {}", std::io::Error::from_raw_os_error(err));
    }
    Ok(())
}

/// Connect as a frontend with `queues` request queues, each with room for
/// `depth` requests in flight of `slot_bytes` each way.
pub(crate) fn connect(socket: &Path, queues: usize, depth: u16, slot_bytes: u64) -> anyhow::Result<FsFrontend> {
    let slots = depth.next_power_of_two().max(4);
    let config =
        FrontendConfig { request_queues: queues, queue_size: (slots * 8).max(256), slots, slot_bytes, event_idx: true };
    FsFrontend::connect(socket, config).with_context(|| format!("connecting to {}", socket.display()))
}

/// CREATE (or truncate) `name` in the root; (nodeid, fh).
pub(crate) fn create(q: &mut QueueDriver, name: &str, flags: i32) -> anyhow::Result<(u64, u64)> {
    let mut body = Reply::default();
    let mut n = name.as_bytes().to_vec();
    n.push(0);
    body.u32((libc::O_RDWR | libc::O_TRUNC | flags) as u32).u32(0o100644).u32(0o022).u32(0).raw(&n);
    let (err, reply) = q.fuse(Opcode::Create, 1, &body.bytes)?;
    check(err, &format!("create {name}"))?;
    if reply.len() < ENTRY_OUT_BYTES + 16 {
        bail!("create {name}: short reply");
    }
    let nodeid = u64::from_le_bytes(reply[..8].try_into()?);
    let fh = u64::from_le_bytes(reply[ENTRY_OUT_BYTES..ENTRY_OUT_BYTES + 8].try_into()?);
    Ok((nodeid, fh))
}

/// Write the whole file once, so that later writes overwrite written blocks.
fn fill(q: &mut QueueDriver, nodeid: u64, fh: u64, bytes: u64) -> anyhow::Result<()> {
    const CHUNK: usize = 64 << 10;
    let data = vec![0x5au8; CHUNK];
    let mut offset = 0;
    while offset < bytes {
        let unique = q.next_unique();
        let head = q.submit_split(&io_request(Opcode::Write, unique, nodeid, fh, offset, CHUNK as u32), &data, 0)?;
        let used = q.wait_for(head, Duration::from_secs(30))?;
        let reply = q.reply(used)?;
        check(-i32::from_le_bytes(reply[4..8].try_into()?), "filling the file")?;
        offset += CHUNK as u64;
    }
    Ok(())
}

/// COPY_FILE_RANGE the first `bytes` of `from` to `to`, looping on short
/// copies: on keelfs the whole blocks are then shared.
fn clone_file(q: &mut QueueDriver, from: (u64, u64), to: (u64, u64), bytes: u64) -> anyhow::Result<()> {
    let mut done = 0;
    while done < bytes {
        let mut body = Reply::default();
        body.u64(from.1).u64(done).u64(to.0).u64(to.1).u64(done).u64(bytes - done).u64(0);
        let (err, reply) = q.fuse(Opcode::CopyFileRange, from.0, &body.bytes)?;
        check(err, "copy_file_range to the twin")?;
        let copied = u64::from(u32::from_le_bytes(reply.get(..4).context("a short copy reply")?.try_into()?));
        if copied == 0 {
            bail!("copy_file_range copied nothing at {done} of {bytes}");
        }
        done += copied;
    }
    Ok(())
}

/// The `i`th block of a permutation of `blocks`: an odd stride, far from
/// sequential, visits every block once per pass when `blocks` is a power
/// of two (else it may revisit some early).
fn permuted(i: u64, blocks: u64) -> u64 {
    const STRIDE: u64 = 0x9E37_79B9_7F4A_7C15 | 1;
    i.wrapping_mul(STRIDE) % blocks
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

struct WorkerResult {
    reads: u64,
    writes: u64,
    bytes: u64,
    latency: Histogram,
}

struct Target {
    nodeid: u64,
    fh: u64,
}

/// One thread's queue: it keeps `iodepth` requests in flight until the
/// deadline, then drains.
struct Worker<'a> {
    q: QueueDriver,
    args: &'a WorkerArgs,
    target: Target,
    bs: usize,
    data: Vec<u8>,
    blocks: u64,
    rng: u64,
    mix: u64,
    append_at: u64,
    in_flight: HashMap<u16, (Kind, Instant)>,
    issued_reads: usize,
    issued_writes: usize,
    /// Requests submitted so far (--once walks its permutation by it).
    issued_total: u64,
    deadline: Instant,
    result: WorkerResult,
}

fn worker(q: QueueDriver, args: &WorkerArgs, target: Target) -> anyhow::Result<WorkerResult> {
    let bs: usize = match args.workload {
        Workload::BufferedRandrw => 8192,
        Workload::ByteWrites => 1,
        _ => 4096,
    };
    let index = q.index() as u64;
    let mut w = Worker {
        q,
        args,
        target,
        bs,
        data: vec![0xa5u8; bs],
        blocks: (args.file_size / bs as u64).max(1),
        rng: 0x1234_5678 ^ index << 32,
        mix: 0x8765_4321 ^ index << 32,
        append_at: 0,
        in_flight: HashMap::new(),
        issued_reads: 0,
        issued_writes: 0,
        issued_total: 0,
        deadline: Instant::now() + Duration::from_secs(args.seconds),
        result: WorkerResult { reads: 0, writes: 0, bytes: 0, latency: Histogram::new() },
    };
    loop {
        let running = Instant::now() < w.deadline;
        // Appends wrap at --file-size: once the file is full and drained,
        // truncate it to 0, so that a run never fills the filesystem.
        if w.full() && w.in_flight.is_empty() {
            w.truncate()?;
        }
        while running && !w.full() && w.in_flight.len() < args.iodepth {
            let kind = w.next_kind();
            w.submit(kind)?;
        }
        if !running && w.in_flight.is_empty() {
            break;
        }
        let used = if w.in_flight.is_empty() {
            Vec::new()
        } else if args.driver == Driver::Busy {
            w.q.poll()?
        } else {
            w.q.wait_signalled(Duration::from_secs(30))?
        };
        for u in used {
            w.complete(u)?;
        }
    }
    Ok(w.result)
}

impl Worker<'_> {
    fn full(&self) -> bool {
        self.args.workload == Workload::AioAppend && self.append_at + self.bs as u64 > self.args.file_size
    }

    fn truncate(&mut self) -> anyhow::Result<()> {
        let mut setattr = Reply::default();
        setattr.u32(1 << 3 | 1 << 6).u32(0).u64(self.target.fh).u64(0).raw(&[0u8; 64]);
        let (err, _) = self.q.fuse(Opcode::Setattr, self.target.nodeid, &setattr.bytes)?;
        check(err, "truncating the append file")?;
        self.append_at = 0;
        Ok(())
    }

    fn next_kind(&mut self) -> Kind {
        let kind = match self.args.workload {
            Workload::DioRandrw => {
                if splitmix64(&mut self.mix) & 1 == 0 {
                    Kind::Read
                } else {
                    Kind::Write
                }
            }
            // Half the slots read, half write: two streams of each at the
            // default depth of 4.
            Workload::BufferedRandrw => {
                if self.issued_reads <= self.issued_writes {
                    Kind::Read
                } else {
                    Kind::Write
                }
            }
            Workload::DioRead => Kind::Read,
            _ => Kind::Write,
        };
        match kind {
            Kind::Read => self.issued_reads += 1,
            Kind::Write => self.issued_writes += 1,
        }
        kind
    }

    fn submit(&mut self, kind: Kind) -> anyhow::Result<()> {
        let bs = self.bs;
        let offset = match self.args.workload {
            Workload::AioAppend | Workload::ByteWrites => {
                let at = self.append_at;
                self.append_at = at + bs as u64;
                at
            }
            _ if self.args.once => {
                let i = self.issued_total;
                self.issued_total += 1;
                permuted(i, self.blocks) * bs as u64
            }
            _ => (splitmix64(&mut self.rng) % self.blocks) * bs as u64,
        };
        let unique = self.q.next_unique();
        // Latency starts before the kick: a daemon may serve the request
        // while the kick's syscall is still returning.
        let started = Instant::now();
        let (opcode, data, read_len) = match kind {
            Kind::Write => (Opcode::Write, &self.data[..], 0),
            Kind::Read => (Opcode::Read, &[][..], bs as u32),
        };
        let header = io_request(opcode, unique, self.target.nodeid, self.target.fh, offset, bs as u32);
        let head = self.q.submit_split(&header, data, read_len)?;
        self.in_flight.insert(head, (kind, started));
        Ok(())
    }

    fn complete(&mut self, Used { head, len }: Used) -> anyhow::Result<()> {
        let Some((kind, started)) = self.in_flight.remove(&head) else { bail!("unexpected head {head}") };
        match kind {
            Kind::Read => self.issued_reads -= 1,
            Kind::Write => self.issued_writes -= 1,
        }
        let reply = self.q.reply(Used { head, len: len.min(OUT_HEADER_BYTES as u32) })?;
        if reply.len() < OUT_HEADER_BYTES {
            bail!("a reply shorter than its header ({len} bytes)");
        }
        check(-i32::from_le_bytes(reply[4..8].try_into()?), "I/O")?;
        if Instant::now() <= self.deadline {
            self.result.latency.record(started.elapsed().as_nanos() as u64);
            self.result.bytes += self.bs as u64;
            match kind {
                Kind::Read => self.result.reads += 1,
                Kind::Write => self.result.writes += 1,
            }
        }
        Ok(())
    }
}

/// One file per thread, or one shared file for buffered-randrw; filled
/// first where the workload overwrites.
fn create_targets(args: &VhostArgs, drivers: &mut [QueueDriver], direct: i32) -> anyhow::Result<Vec<Target>> {
    let mut targets = Vec::new();
    for (t, q) in drivers.iter_mut().enumerate() {
        let shared = args.workload == Workload::BufferedRandrw;
        let name = if shared { "bench-shared".to_string() } else { format!("bench-{t}") };
        let (nodeid, fh) = create(q, &name, direct)?;
        let fills = [Workload::DioOverwrite, Workload::DioRandrw, Workload::DioRead, Workload::BufferedRandrw];
        if fills.contains(&args.workload) && (!shared || t == 0) {
            fill(q, nodeid, fh, args.file_size)?;
            if args.shared {
                let (twin, twin_fh) = create(q, &format!("{name}-twin"), direct)?;
                clone_file(q, (nodeid, fh), (twin, twin_fh), args.file_size)?;
            }
        }
        targets.push(Target { nodeid, fh });
    }
    Ok(targets)
}

/// A thread per queue; their counts and latencies summed.
fn run_workers(drivers: Vec<QueueDriver>, targets: Vec<Target>, args: &WorkerArgs) -> anyhow::Result<WorkerResult> {
    let results: Vec<anyhow::Result<WorkerResult>> = std::thread::scope(|s| {
        let handles: Vec<_> =
            drivers.into_iter().zip(targets).map(|(q, target)| s.spawn(move || worker(q, args, target))).collect();
        handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
    });
    let mut total = WorkerResult { reads: 0, writes: 0, bytes: 0, latency: Histogram::new() };
    for r in results {
        let r = r?;
        total.reads += r.reads;
        total.writes += r.writes;
        total.bytes += r.bytes;
        total.latency.merge(&r.latency);
    }
    Ok(total)
}

struct WorkerArgs {
    workload: Workload,
    iodepth: usize,
    seconds: u64,
    file_size: u64,
    driver: Driver,
    once: bool,
}

pub fn run(args: &VhostArgs) -> anyhow::Result<()> {
    if args.threads == 0 || args.iodepth == 0 {
        bail!("--threads and --iodepth must be at least 1");
    }
    if args.workload == Workload::Trace {
        return crate::vhost_trace::run(args);
    }
    if args.workload.is_metadata() {
        return crate::vhost_meta::run(args);
    }
    let queues = args.queues.unwrap_or(args.threads);
    if queues < args.threads {
        bail!("each thread drives its own queue: --queues must be at least --threads");
    }
    let mut fe = connect(&args.socket, queues, args.iodepth as u16, 128 << 10)?;
    init(&mut fe)?;
    let direct = match args.workload {
        Workload::DioOverwrite | Workload::DioRandrw | Workload::DioRead | Workload::AioAppend => libc::O_DIRECT,
        _ => 0,
    };
    let mut drivers: Vec<QueueDriver> = (1..=args.threads).map(|q| fe.take_queue(q)).collect();
    let targets = create_targets(args, &mut drivers, direct)?;
    let driver = args.driver();
    let cpu = CpuCounters::read(args)?;
    let started = Instant::now();
    let worker_args = WorkerArgs {
        workload: args.workload,
        iodepth: args.iodepth,
        seconds: args.seconds,
        file_size: args.file_size,
        driver,
        once: args.once,
    };
    let results = run_workers(drivers, targets, &worker_args);
    let secs = started.elapsed().as_secs_f64().min(args.seconds as f64).max(1e-9);
    let cpu = CpuCounters::read(args)?.since(&cpu);
    let WorkerResult { reads, writes, bytes, latency } = results?;
    let ops = reads + writes;
    let mut line = result_line(args, ops, secs, &latency);
    line["read_iops"] = json!((reads as f64 / secs).round());
    line["write_iops"] = json!((writes as f64 / secs).round());
    line["mib_s"] = json!(((bytes as f64 / secs / (1 << 20) as f64) * 100.0).round() / 100.0);
    line["shared"] = json!(args.shared);
    line["once"] = json!(args.once);
    // Writes per block of each file: at most 1 means every write of a
    // --shared --once run copied on write.
    let blocks = (args.file_size / 4096).max(1) * args.threads as u64;
    line["writes_per_block"] = json!((writes as f64 / blocks as f64 * 1000.0).round() / 1000.0);
    cpu.charge(&mut line, ops, secs);
    print_line(args, &line)
}

/// Negotiate the session as Linux's virtio-fs driver does.
pub(crate) fn init(fe: &mut FsFrontend) -> anyhow::Result<()> {
    // Linux's virtio-fs offers POSIX and flock locks too: a daemon that
    // holds them then has every close send FLUSH (issue 36).
    let flags = f::ASYNC_READ | f::BIG_WRITES | f::MAX_PAGES | f::PARALLEL_DIROPS | f::INIT_EXT;
    fe.init(flags | f::POSIX_LOCKS | f::FLOCK_LOCKS)?;
    Ok(())
}

/// The fields every workload's JSON line has: what ran, its rate in
/// operations per second over `secs`, and their latencies.
pub(crate) fn result_line(args: &VhostArgs, ops: u64, secs: f64, latency: &Histogram) -> serde_json::Value {
    let driver = args.driver();
    let percentiles: serde_json::Map<String, serde_json::Value> =
        [1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.9]
            .iter()
            .map(|p: &f64| (format!("{p:.6}"), json!(latency.quantile(p / 100.0) as f64 / 1000.0)))
            .collect();
    json!({
        "bench": "vhost",
        "label": args.label,
        "workload": format!("{:?}", args.workload),
        "threads": args.threads,
        "queues": args.queues.unwrap_or(args.threads),
        "iodepth": args.iodepth,
        "seconds": args.seconds,
        "driver": driver.name(),
        "driver_waits": if driver == Driver::Busy { "spin" } else { "eventfd" },
        "iops": (ops as f64 / secs).round(),
        "lat_us_p50": latency.quantile(0.5) as f64 / 1000.0,
        "lat_us_p99": latency.quantile(0.99) as f64 / 1000.0,
        "lat_us_p999": latency.quantile(0.999) as f64 / 1000.0,
        "lat_us_max": latency.quantile(1.0) as f64 / 1000.0,
        "lat_us_percentiles": percentiles,
    })
}

/// Print `line`: one JSON object per line with --json, else pretty.
pub(crate) fn print_line(args: &VhostArgs, line: &serde_json::Value) -> anyhow::Result<()> {
    if args.json {
        println!("{line}");
    } else {
        println!("{}", serde_json::to_string_pretty(line)?);
    }
    Ok(())
}

/// CPU time counters, in nanoseconds: the daemon's (with its children),
/// the OSD's, this process's and the whole machine's busy time.
pub(crate) struct CpuCounters {
    daemon: Option<u64>,
    osd: Option<u64>,
    own: u64,
    machine: u64,
}

impl CpuCounters {
    pub(crate) fn read(args: &VhostArgs) -> anyhow::Result<Self> {
        Ok(Self {
            daemon: args.daemon_pid.map(crate::procstat::tree_cpu_ns).transpose()?,
            osd: args.osd_pid.map(crate::procstat::own_cpu_ns).transpose()?,
            own: crate::procstat::own_cpu_ns(std::process::id())?,
            machine: crate::procstat::machine_busy_ns()?,
        })
    }

    /// Each one's CPU over `ops` operations in `secs` of run, into
    /// `line`: the load generator's (the driver's: a busy driver is
    /// charged its spinning too), the machine's, and where known the
    /// daemon's, the OSD's and what none of them was charged for.
    /// `*_cpu_share`: cores' worth over the run.
    pub(crate) fn charge(&self, line: &mut serde_json::Value, ops: u64, secs: f64) {
        line["bench_cpu_us_per_op"] = us_per_op(self.own, ops);
        line["driver_cpu_share"] = cpu_share(self.own, secs);
        line["machine_cpu_us_per_op"] = us_per_op(self.machine, ops);
        if let Some(osd) = self.osd {
            line["osd_cpu_us_per_op"] = us_per_op(osd, ops);
        }
        if let Some(daemon) = self.daemon {
            line["daemon_cpu_us_per_op"] = us_per_op(daemon, ops);
            line["daemon_cpu_share"] = cpu_share(daemon, secs);
            // Neither the daemon's nor the load generator's (nor the OSD's):
            // kernel workers (loop, io-wq punts not charged to the submitter)
            // and noise.
            let others = self.machine.saturating_sub(daemon + self.own + self.osd.unwrap_or(0));
            line["other_cpu_us_per_op"] = us_per_op(others, ops);
        }
    }

    /// What each spent between `earlier` and `self`.
    pub(crate) fn since(&self, earlier: &Self) -> Self {
        let diff = |a: Option<u64>, b: Option<u64>| a.zip(b).map(|(a, b)| a.saturating_sub(b));
        Self {
            daemon: diff(self.daemon, earlier.daemon),
            osd: diff(self.osd, earlier.osd),
            own: self.own.saturating_sub(earlier.own),
            machine: self.machine.saturating_sub(earlier.machine),
        }
    }
}

/// CPU nanoseconds over `secs` of run, in cores' worth to 0.01.
fn cpu_share(ns: u64, secs: f64) -> serde_json::Value {
    json!((ns as f64 / 1e9 / secs * 100.0).round() / 100.0)
}

/// CPU nanoseconds spread over `ops`, in µs per operation to 0.01.
fn us_per_op(ns: u64, ops: u64) -> serde_json::Value {
    json!((ns as f64 / 1000.0 / ops.max(1) as f64 * 100.0).round() / 100.0)
}
