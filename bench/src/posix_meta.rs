//! `keelfs-bench posix-meta`: the metadata workloads of `vhost` (see
//! vhost_meta.rs) through system calls on any mounted filesystem: keelfs's
//! host mount, ext4 and xfs side by side (bench/run-seeds.sh --matrix
//! metadata). The tree and the phases are the same: `create` makes the
//! tree (open O_CREAT|O_EXCL, a 1-4 KiB write, close), `stat` lstats
//! every file, `open-read-close` reads each whole, `readdir` lists each
//! directory and lstats every entry (`ls -l`), `unlink` removes the tree,
//! and `rename` and `mkdir-rmdir` are storms in a directory of their own.
//! Each thread works its own tree, one system call after another, as a
//! single-threaded tool does.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use keelfs_base::testing::splitmix64;
use serde_json::json;

use crate::hist::Histogram;
use crate::vhost_meta::{file_name, Tree, FILES_MAX};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PosixWorkload {
    Create,
    Stat,
    OpenReadClose,
    Readdir,
    Unlink,
    Rename,
    MkdirRmdir,
}

#[derive(Args, Debug)]
pub struct PosixMetaArgs {
    /// A directory on the filesystem under test.
    #[arg(long)]
    dir: PathBuf,
    #[arg(long, value_enum)]
    workload: PosixWorkload,
    /// Threads, each in its own tree.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Files in each thread's tree.
    #[arg(long, default_value_t = 10_000)]
    files: u64,
    #[arg(long, value_enum, default_value = "wide")]
    tree: Tree,
    /// stat, open-read-close and readdir: whole passes over the tree (1: a
    /// cold pass) instead of running for --seconds.
    #[arg(long, default_value_t = 0)]
    passes: u64,
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// The pid of a daemon serving --dir (keelfsd): its CPU per operation.
    #[arg(long)]
    daemon_pid: Option<u32>,
    /// A label for the JSON line (the system under test).
    #[arg(long, default_value = "")]
    label: String,
    #[arg(long)]
    json: bool,
}

struct Outcome {
    ops: u64,
    latency: Histogram,
}

fn dir_of(args: &PosixMetaArgs, thread: usize, k: u64) -> PathBuf {
    args.tree.dir_path(thread, k).iter().fold(args.dir.clone(), |p, c| p.join(c))
}

fn file_of(args: &PosixMetaArgs, thread: usize, n: u64) -> PathBuf {
    let per_dir = args.tree.files_per_dir();
    dir_of(args, thread, n / per_dir).join(file_name(n % per_dir))
}

/// The operations a workload runs: a count, or until the deadline.
fn budget(args: &PosixMetaArgs) -> Option<u64> {
    let dirs = args.files.div_ceil(args.tree.files_per_dir());
    match args.workload {
        PosixWorkload::Create | PosixWorkload::Unlink => Some(args.files),
        PosixWorkload::Readdir if args.passes > 0 => Some(dirs * args.passes),
        PosixWorkload::Stat | PosixWorkload::OpenReadClose if args.passes > 0 => Some(args.files * args.passes),
        _ => None,
    }
}

fn one_op(args: &PosixMetaArgs, thread: usize, i: u64, rng: &mut u64, buf: &mut [u8]) -> anyhow::Result<()> {
    let dirs = args.files.div_ceil(args.tree.files_per_dir());
    let storm = args.dir.join(format!("meta-{thread}-storm"));
    match args.workload {
        PosixWorkload::Create => {
            let path = file_of(args, thread, i);
            let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(&path)?;
            let len = 1024 + (splitmix64(rng) as usize) % 3073;
            f.write_all(&buf[..len])?;
        }
        PosixWorkload::Stat => {
            std::fs::symlink_metadata(file_of(args, thread, i % args.files))?;
        }
        PosixWorkload::OpenReadClose => {
            let mut f = std::fs::File::open(file_of(args, thread, i % args.files))?;
            // To the end, as `cat` does: the last read returns 0.
            while f.read(&mut buf[..4096])? > 0 {}
        }
        PosixWorkload::Readdir => {
            for entry in std::fs::read_dir(dir_of(args, thread, i % dirs))? {
                std::fs::symlink_metadata(entry?.path())?;
            }
        }
        PosixWorkload::Unlink => std::fs::remove_file(file_of(args, thread, i))?,
        PosixWorkload::Rename => {
            let (a, b) = (storm.join("ren-a"), storm.join("ren-b"));
            if i.is_multiple_of(2) {
                std::fs::rename(a, b)?
            } else {
                std::fs::rename(b, a)?
            }
        }
        PosixWorkload::MkdirRmdir => {
            let d = storm.join("mk");
            std::fs::create_dir(&d)?;
            std::fs::remove_dir(&d)?;
        }
    }
    Ok(())
}

/// What a phase needs before the clock starts: the tree's directories
/// for create, the storm's directory and file.
fn prepare(args: &PosixMetaArgs, thread: usize) -> anyhow::Result<()> {
    let dirs = args.files.div_ceil(args.tree.files_per_dir());
    match args.workload {
        PosixWorkload::Create => {
            for k in 0..dirs {
                std::fs::create_dir_all(dir_of(args, thread, k))?;
            }
        }
        PosixWorkload::Rename | PosixWorkload::MkdirRmdir => {
            let storm = args.dir.join(format!("meta-{thread}-storm"));
            let _ = std::fs::remove_dir_all(&storm);
            std::fs::create_dir_all(&storm)?;
            std::fs::write(storm.join("ren-a"), b"")?;
        }
        _ => {
            let first = file_of(args, thread, 0);
            if !first.exists() {
                bail!("{} is missing: run --workload create with the same --tree and --files first", first.display());
            }
        }
    }
    Ok(())
}

/// After an unlink, the emptied tree's directories; after a storm, its
/// directory.
fn clean_up(args: &PosixMetaArgs, thread: usize) -> anyhow::Result<()> {
    match args.workload {
        PosixWorkload::Unlink => std::fs::remove_dir_all(args.dir.join(format!("meta-{thread}")))?,
        PosixWorkload::Rename | PosixWorkload::MkdirRmdir => {
            std::fs::remove_dir_all(args.dir.join(format!("meta-{thread}-storm")))?
        }
        _ => {}
    }
    Ok(())
}

fn worker(args: &PosixMetaArgs, thread: usize) -> anyhow::Result<Outcome> {
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let budget = budget(args);
    let mut out = Outcome { ops: 0, latency: Histogram::new() };
    let mut rng = 0x5eed ^ (thread as u64) << 40;
    let mut buf = vec![0x6bu8; 4096];
    for i in 0.. {
        let more = match budget {
            Some(n) => i < n,
            None => Instant::now() < deadline,
        };
        if !more {
            break;
        }
        let started = Instant::now();
        one_op(args, thread, i, &mut rng, &mut buf).with_context(|| format!("{:?} #{i}", args.workload))?;
        out.latency.record(started.elapsed().as_nanos() as u64);
        out.ops += 1;
    }
    Ok(out)
}

pub fn run(args: &PosixMetaArgs) -> anyhow::Result<()> {
    if args.files == 0 || args.files > FILES_MAX || args.threads == 0 {
        bail!("--files must be 1 to {FILES_MAX}, and --threads at least 1");
    }
    for t in 0..args.threads {
        prepare(args, t)?;
    }
    let cpu = Cpu::read(args.daemon_pid)?;
    let started = Instant::now();
    let results: Vec<anyhow::Result<Outcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.threads).map(|t| s.spawn(move || worker(args, t))).collect();
        handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
    });
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let cpu = Cpu::read(args.daemon_pid)?.since(&cpu);
    let mut ops = 0;
    let mut latency = Histogram::new();
    for r in results {
        let r = r?;
        ops += r.ops;
        latency.merge(&r.latency);
    }
    for t in 0..args.threads {
        clean_up(args, t)?;
    }
    let per_op = |ns: u64| json!((ns as f64 / 1000.0 / ops.max(1) as f64 * 100.0).round() / 100.0);
    let mut line = json!({
        "bench": "posix-meta",
        "label": args.label,
        "workload": format!("{:?}", args.workload),
        "tree": format!("{:?}", args.tree).to_lowercase(),
        "files": args.files,
        "passes": args.passes,
        "threads": args.threads,
        "ops": ops,
        "iops": (ops as f64 / secs).round(),
        "lat_us_p50": latency.quantile(0.5) as f64 / 1000.0,
        "lat_us_p99": latency.quantile(0.99) as f64 / 1000.0,
        "bench_cpu_us_per_op": per_op(cpu.own),
    });
    if let Some(daemon) = cpu.daemon {
        line["daemon_cpu_us_per_op"] = per_op(daemon);
    }
    if args.json {
        println!("{line}");
    } else {
        println!("{}", serde_json::to_string_pretty(&line)?);
    }
    Ok(())
}

/// CPU nanoseconds: this process's (its system calls: all of ext4's and
/// xfs's work, and the FUSE client's), and the daemon's with its children.
struct Cpu {
    own: u64,
    daemon: Option<u64>,
}

impl Cpu {
    fn read(daemon_pid: Option<u32>) -> anyhow::Result<Self> {
        Ok(Self {
            own: crate::procstat::own_cpu_ns(std::process::id())?,
            daemon: daemon_pid.map(crate::procstat::tree_cpu_ns).transpose()?,
        })
    }

    fn since(&self, earlier: &Self) -> Self {
        Self {
            own: self.own.saturating_sub(earlier.own),
            daemon: self.daemon.zip(earlier.daemon).map(|(a, b)| a.saturating_sub(b)),
        }
    }
}
