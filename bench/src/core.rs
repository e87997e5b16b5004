//! `keelfs-bench core`: keelfs-fs driven in process, on one reactor, with no
//! FUSE or virtqueue in between.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use keelfs_base::parse_size;
use keelfs_base::testing::splitmix64;
use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig, UringDevice, UringOptions};
use keelfs_fs::Ino;
use keelfs_fs::ROOT_INO;
use keelfs_fs::{mkfs, MkfsOptions};
use keelfs_fs::{Creds, Fs, FsConfig};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{PollMode, Reactor, ReactorConfig};
use serde_json::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// Lookup cost in a directory of --entries entries against one of 1,000.
    Lookup,
    /// 4k random direct overwrites of a preallocated file (seed 000).
    DioOverwrite,
    /// 4k direct appends to one file, --iodepth in flight (seed 002).
    AioAppend,
    /// 8k buffered random reads and writes on one file (seed 004).
    BufferedRandrw,
    /// 1-byte buffered appends (seed 003).
    ByteWrites,
    /// --file-size written 4 KiB at a time, buffered and direct (seed 001).
    SeqExtents,
    /// --threads tasks each writing 4k and calling fsync.
    FsyncStorm,
    /// --entries empty files: create rate, memory, checkpoint (no mkfs
    /// of its own image afterwards: metadata-mount reads it).
    MetadataFill,
    /// Mount the image metadata-fill left at --path: time and memory.
    MetadataMount,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Mem,
    Uring,
    Pmem,
}

#[derive(Args, Debug)]
pub struct CoreArgs {
    #[arg(long, value_enum)]
    workload: Workload,
    #[arg(long, value_enum, default_value = "mem")]
    backend: Backend,
    /// Backing file for uring and pmem (created if missing).
    #[arg(long, default_value = "/dev/shm/keelfs-bench-core.img")]
    path: std::path::PathBuf,
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Entries in the large directory (lookup).
    #[arg(long, default_value_t = 1_000_000)]
    entries: u64,
    /// Lookups measured per directory and round.
    #[arg(long, default_value_t = 500_000)]
    lookups: u64,
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// byte-writes: 1-byte writes per round and mode.
    #[arg(long, default_value_t = 400_000, value_parser = clap::value_parser!(u64).range(2..))]
    writes: u64,
    /// metadata-fill: bytes written to each file (0: empty files).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    file_bytes: u64,
    /// Concurrent tasks (each at queue depth 1) for the I/O workloads.
    #[arg(long, default_value_t = 4)]
    threads: u32,
    /// Appends in flight (aio-append).
    #[arg(long, default_value_t = 32)]
    iodepth: u32,
    /// Seconds per measured phase.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// File size for the I/O workloads.
    #[arg(long, value_parser = parse_size, default_value = "256M")]
    file_size: u64,
    /// The filesystem's page cache (default: FsConfig's, 256 MiB). Seed 004
    /// runs with the file in the page cache, so buffered-randrw wants a
    /// cache larger than --file-size.
    #[arg(long, value_parser = parse_size)]
    cache_size: Option<u64>,
    /// uring backend: a kernel submission thread (SQPOLL) that idles
    /// after this many milliseconds, so that device submissions (and, on a
    /// tmpfs-backed file, their copies) run on another core.
    #[arg(long)]
    sqpoll_idle_ms: Option<u32>,
    /// buffered-randrw: run the readers beside the writers on the
    /// filesystem's reactor instead of on a second one.
    #[arg(long)]
    readers_on_owner: bool,
    #[arg(long)]
    json: bool,
}

/// The device size when --size is not given: the old fixed default, or
/// more when the workload needs it.
const DEFAULT_DEVICE_BYTES: u64 = 2 << 30;

/// Bytes of device a workload needs: what it writes, plus an eighth and
/// 64 MiB for keelfs's journal (64 MiB at most), inodes and extent maps.
fn device_bytes_needed(p: &Params) -> u64 {
    let data = match p.workload {
        // Inodes and directory blocks, about 1 KiB an entry, in two
        // directories (the large one and the small one).
        Workload::Lookup => (p.entries + 1000) * 1024,
        // Inodes, directory blocks and two checkpoints' room.
        Workload::MetadataFill | Workload::MetadataMount => p.entries * (1024 + p.file_bytes.next_multiple_of(4096)),
        Workload::DioOverwrite | Workload::AioAppend | Workload::BufferedRandrw => p.file_size,
        Workload::ByteWrites => crate::core_io::byte_writes_bytes(p.writes),
        // A buffered copy and a direct copy.
        Workload::SeqExtents => 2 * p.file_size,
        Workload::FsyncStorm => u64::from(p.threads) * crate::core_io::FSYNC_STORM_FILE_BYTES,
    };
    data + data / 8 + (64 << 20)
}

/// --size, or a default that fits the workload; a --size too small for it
/// is refused before anything runs.
fn device_bytes(args: &CoreArgs, p: &Params) -> anyhow::Result<u64> {
    let needed = device_bytes_needed(p);
    match args.size {
        None => Ok(needed.max(DEFAULT_DEVICE_BYTES)),
        Some(size) if size >= needed => Ok(size),
        Some(size) => bail!(
            "--size {} MiB is too small for --workload {}: it needs {} MiB (give a larger --size, or omit it)",
            size >> 20,
            p.workload.to_possible_value().expect("no skipped variants").get_name(),
            needed.div_ceil(1 << 20)
        ),
    }
}

fn open_device(args: &CoreArgs, size: u64) -> anyhow::Result<Arc<dyn BlockDevice>> {
    if args.backend != Backend::Mem {
        let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&args.path)?;
        if f.metadata()?.len() < size {
            f.set_len(size)?;
        }
    }
    Ok(match args.backend {
        Backend::Mem => Arc::new(MappedDevice::ram(size, 4096)?),
        Backend::Uring => Arc::new(UringDevice::open(
            &args.path,
            UringOptions { sqpoll_idle_ms: args.sqpoll_idle_ms, ..UringOptions::default() },
        )?),
        Backend::Pmem => Arc::new(MappedDevice::pmem(&args.path, 4096)?),
    })
}

pub fn run(args: &CoreArgs) -> anyhow::Result<()> {
    if args.entries < 1000 {
        bail!("--entries must be at least 1000");
    }
    let params = Params {
        workload: args.workload,
        entries: args.entries,
        lookups: args.lookups,
        rounds: args.rounds,
        threads: args.threads.max(1),
        iodepth: args.iodepth.max(1),
        seconds: Duration::from_secs(args.seconds.max(1)),
        file_size: args.file_size,
        backend: format!("{:?}", args.backend).to_lowercase(),
        readers_on_owner: args.readers_on_owner,
        writes: args.writes,
        file_bytes: args.file_bytes,
    };
    let size = device_bytes(args, &params)?;
    let dev = open_device(args, size).context("opening the device")?;
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() })?;
    let queue = dev.open_queue(QueueConfig { depth: 128, completion_eventfd: false })?;
    let queue2 = dev.open_queue(QueueConfig { depth: 128, completion_eventfd: false })?;
    let cache_size = args.cache_size;
    let line = reactor.block_on(async move {
        if params.workload != Workload::MetadataMount {
            let opts = MkfsOptions { force: true, ..MkfsOptions::default() };
            mkfs(DeviceChannel::attach(queue), &opts).await?;
        }
        // No timer commits during a measurement unless the workload wants
        // them: what each one measures is stated in its output.
        // The lookup workload makes a million files on a small device:
        // the benches measure speed, not the inode limit.
        let mut config = FsConfig {
            commit_interval: Duration::from_secs(3600),
            inodes_max: Some(u64::from(u32::MAX)),
            ..FsConfig::default()
        };
        if let Some(bytes) = cache_size {
            config.cache_bytes = bytes;
        }
        config.read_only = params.workload == Workload::MetadataMount;
        let rss_before = crate::core_meta::rss_bytes();
        let mount_started = Instant::now();
        let fs = Fs::mount(DeviceChannel::attach(queue2), config).await?;
        let mount_s = mount_started.elapsed().as_secs_f64();
        let mut line = match params.workload {
            Workload::Lookup => lookup_workload(&fs, params.entries, params.lookups, params.rounds).await?,
            Workload::DioOverwrite => crate::core_io::dio_overwrite(&fs, &params).await?,
            Workload::AioAppend => crate::core_io::aio_append(&fs, &params).await?,
            Workload::BufferedRandrw => crate::core_io::buffered_randrw(&fs, &params).await?,
            Workload::ByteWrites => crate::core_io::byte_writes(&fs, &params).await?,
            Workload::SeqExtents => crate::core_io::seq_extents(&fs, &params).await?,
            Workload::FsyncStorm => crate::core_io::fsync_storm(&fs, &params).await?,
            Workload::MetadataFill => crate::core_meta::fill(&fs, params.entries, params.file_bytes).await?,
            Workload::MetadataMount => crate::core_meta::mounted(&fs, mount_s, rss_before).await?,
        };
        line["backend"] = json!(params.backend);
        line["rss_mib"] = json!(rss_mib());
        line["cache_capacity_mib"] = json!(cache_size.unwrap_or(FsConfig::default().cache_bytes) >> 20);
        anyhow::Ok(line)
    })?;
    let mut line = line;
    if let Some(ms) = args.sqpoll_idle_ms {
        line["sqpoll_idle_ms"] = json!(ms);
    }
    emit(&line, args.json);
    Ok(())
}

/// Resident memory of this process (VmRSS) in MiB, for the memory bound.
fn rss_mib() -> f64 {
    (crate::core_meta::rss_bytes() as f64 / f64::from(1 << 20) * 10.0).round() / 10.0
}

/// What the workloads need from the command line.
pub struct Params {
    pub workload: Workload,
    pub entries: u64,
    pub lookups: u64,
    pub rounds: u32,
    pub threads: u32,
    pub iodepth: u32,
    pub seconds: Duration,
    pub file_size: u64,
    pub backend: String,
    pub readers_on_owner: bool,
    pub writes: u64,
    pub file_bytes: u64,
}

fn emit(line: &serde_json::Value, as_json: bool) {
    if as_json {
        println!("{line}");
    } else {
        println!("{}", serde_json::to_string_pretty(line).expect("JSON value"));
    }
}

async fn fill_dir(fs: &Fs, name: &str, entries: u64) -> anyhow::Result<Ino> {
    let c = Creds::root();
    let dir = fs.mkdir(&c, ROOT_INO, name.as_bytes(), 0o755).await?.ino();
    for i in 0..entries {
        fs.mknod(&c, dir, format!("entry-{i:08}").as_bytes(), libc::S_IFREG | 0o644, 0).await?;
    }
    Ok(dir)
}

async fn time_lookups(fs: &Fs, targets: &[(Ino, Vec<u8>)]) -> anyhow::Result<f64> {
    let c = Creds::root();
    let start = Instant::now();
    for (dir, name) in targets {
        let attr = fs.lookup(&c, *dir, name).await?;
        std::hint::black_box(attr);
    }
    Ok(start.elapsed().as_nanos() as f64 / targets.len() as f64)
}

/// Random (directory, name) pairs over `dirs`, each of `entries` entries.
fn sample(dirs: &[Ino], entries: u64, count: u64, seed: u64) -> Vec<(Ino, Vec<u8>)> {
    let mut s = seed;
    (0..count)
        .map(|_| {
            let d = dirs[(splitmix64(&mut s) % dirs.len() as u64) as usize];
            (d, format!("entry-{:08}", splitmix64(&mut s) % entries).into_bytes())
        })
        .collect()
}

/// Three lookup mixes, rounds interleaved:
/// - `large`: random names in one directory of `entries`;
/// - `small`: random names in one directory of 1,000 (all of it cached);
/// - `spread`: random names over `entries / 1000` directories of 1,000,
///   the same number of files as `large` in small directories. It holds
///   the working set equal, so `large / spread` isolates what directory
///   size itself costs, while `large / small` also counts the cache
///   misses that any 1M-file working set pays.
async fn lookup_workload(fs: &Fs, entries: u64, lookups: u64, rounds: u32) -> anyhow::Result<serde_json::Value> {
    const SMALL: u64 = 1000;
    let fill_start = Instant::now();
    let large = fill_dir(fs, "large", entries).await?;
    let mut spread_dirs = Vec::new();
    for d in 0..entries / SMALL {
        spread_dirs.push(fill_dir(fs, &format!("small-{d}"), SMALL).await?);
    }
    let fill_s = fill_start.elapsed().as_secs_f64();
    let mixes = [
        sample(&[large], entries, lookups, 1),
        sample(&spread_dirs[..1], SMALL, lookups, 2),
        sample(&spread_dirs, SMALL, lookups, 3),
    ];
    let mut ns: [Vec<f64>; 3] = Default::default();
    for _ in 0..rounds.max(1) {
        for (i, mix) in mixes.iter().enumerate() {
            ns[i].push(time_lookups(fs, mix).await?);
        }
    }
    let [l, s, sp] = ns.map(|v| crate::core_io::median(&v));
    let r = |x: f64| (x * 1000.0).round() / 1000.0;
    Ok(json!({
        "bench": "core",
        "workload": "lookup",
        "entries_small": SMALL,
        "entries_large": entries,
        "lookups_per_round": lookups,
        "rounds": rounds,
        "ns_per_lookup_large": (l * 10.0).round() / 10.0,
        "ns_per_lookup_small": (s * 10.0).round() / 10.0,
        "ns_per_lookup_spread": (sp * 10.0).round() / 10.0,
        "ratio_large_vs_spread": r(l / sp),
        "ratio_large_vs_small": r(l / s),
        "files_created_per_s": ((2 * entries) as f64 / fill_s).round(),
    }))
}
