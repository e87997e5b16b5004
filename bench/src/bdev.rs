//! `keelfs-bench bdev`: one thread drives one backend queue at a fixed
//! depth, the way a reactor would, and reports IOPS and latency. With
//! `--vs-fio`, fio's io_uring engine runs on the same file with the same
//! parameters in the same invocation, rounds interleaved.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use keelfs_base::testing::splitmix64;
use keelfs_bdev::{
    BlockDevice, BufferPool, Completion, IoRequest, MappedDevice, NvmeAddress, NvmeDevice, NvmeOptions, PoolBuf,
    QueueConfig, UringDevice, UringOptions,
};
use serde_json::json;

use crate::fio::{self, FioJob};
use crate::hist::Histogram;
use keelfs_base::parse_size;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Uring,
    Pmem,
    /// The userspace NVMe driver; --path nvme:PCI[/NSID].
    Nvme,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Rw {
    Randread,
    Randwrite,
    Read,
    Write,
}

impl Rw {
    fn name(self) -> &'static str {
        match self {
            Rw::Randread => "randread",
            Rw::Randwrite => "randwrite",
            Rw::Read => "read",
            Rw::Write => "write",
        }
    }
    fn is_write(self) -> bool {
        matches!(self, Rw::Randwrite | Rw::Write)
    }
    fn is_random(self) -> bool {
        matches!(self, Rw::Randread | Rw::Randwrite)
    }
}

#[derive(Args, Debug)]
pub struct BdevArgs {
    #[arg(long, value_enum)]
    backend: Backend,
    /// File or block device (a missing file is created and preallocated),
    /// or nvme:PCI[/NSID] with --backend nvme.
    #[arg(long)]
    path: PathBuf,
    /// Bytes of the device to use, e.g. 1G.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    size: u64,
    #[arg(long, value_enum, default_value = "randread")]
    rw: Rw,
    #[arg(long, value_parser = parse_size, default_value = "4k")]
    bs: u64,
    #[arg(long, default_value_t = 32)]
    iodepth: u32,
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Alternate this many rounds of ours and fio's (with --vs-fio).
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Use io_uring's registered (fixed) buffers for the data.
    #[arg(long)]
    fixed_buffers: bool,
    /// Use an io_uring SQPOLL kernel thread.
    #[arg(long)]
    sqpoll: bool,
    /// Also run fio's io_uring engine on the same file and report the ratio.
    #[arg(long)]
    vs_fio: bool,
    /// Print one JSON object per result line.
    #[arg(long)]
    json: bool,
}

struct RoundResult {
    ios: u64,
    elapsed: Duration,
    hist: Histogram,
    /// This process's CPU time (user + system) over the round.
    cpu: Duration,
}

pub fn run(args: &BdevArgs) -> anyhow::Result<()> {
    if args.bs == 0 || !args.bs.is_multiple_of(512) || args.bs > 1 << 20 {
        bail!("--bs must be a multiple of 512 up to 1M, got {}", args.bs);
    }
    if args.iodepth == 0 || args.iodepth > 4096 {
        bail!("--iodepth must be between 1 and 4096, got {}", args.iodepth);
    }
    if args.size < args.bs {
        bail!("--size {} is smaller than --bs {}", args.size, args.bs);
    }
    if args.backend != Backend::Nvme {
        prepare_file(args)?;
    } else if args.vs_fio {
        bail!(
            "--vs-fio needs a file; with --backend nvme compare against --backend uring on the kernel's /dev/nvmeXnY"
        );
    }
    let device: Arc<dyn BlockDevice> = match args.backend {
        Backend::Nvme => {
            let address = NvmeAddress::parse(&args.path.to_string_lossy())?;
            Arc::new(NvmeDevice::open(&address, NvmeOptions::default()).with_context(|| format!("opening {address}"))?)
        }
        Backend::Uring => Arc::new(
            UringDevice::open(
                &args.path,
                UringOptions { sqpoll_idle_ms: args.sqpoll.then_some(100), ..UringOptions::default() },
            )
            .with_context(|| format!("opening {} with io_uring", args.path.display()))?,
        ),
        Backend::Pmem => Arc::new(
            MappedDevice::pmem(&args.path, 512).with_context(|| format!("mapping {} as pmem", args.path.display()))?,
        ),
    };
    let mut ours = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..args.rounds.max(1) {
        ours.push(drive(device.as_ref(), args)?);
        if args.vs_fio {
            let job = FioJob {
                path: &args.path,
                rw: args.rw.name(),
                bs: args.bs,
                iodepth: args.iodepth,
                size: args.size,
                seconds: args.seconds,
            };
            peers.push(fio::run_io_uring(&job)?);
        }
    }
    report(args, &ours, &peers);
    Ok(())
}

fn prepare_file(args: &BdevArgs) -> anyhow::Result<()> {
    let meta = std::fs::metadata(&args.path);
    if let Ok(m) = &meta {
        if !m.is_file() || m.len() >= args.size {
            return Ok(());
        }
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&args.path)
        .with_context(|| format!("creating {}", args.path.display()))?;
    // Allocate every block so that reads measure the device, not holes.
    let rc = {
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fallocate on an open descriptor takes no pointers.
        unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, args.size as libc::off_t) }
    };
    if rc != 0 {
        bail!("preallocating {}: {}", args.path.display(), std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

struct Driver {
    blocks: u64,
    bs: u64,
    random: bool,
    next_seq: u64,
    rng: u64,
}

impl Driver {
    fn next_offset(&mut self) -> u64 {
        let block = if self.random {
            splitmix64(&mut self.rng) % self.blocks
        } else {
            let b = self.next_seq;
            self.next_seq = (self.next_seq + 1) % self.blocks;
            b
        };
        block * self.bs
    }
}

fn drive(device: &dyn BlockDevice, args: &BdevArgs) -> anyhow::Result<RoundResult> {
    let depth = args.iodepth;
    let mut queue = device.open_queue(QueueConfig { depth, completion_eventfd: false })?;
    let mut pool = BufferPool::new(depth as usize, args.bs as usize, 4096);
    queue.register_pool(&pool)?;
    let mut buffers: Vec<PoolBuf> = (0..depth).map(|_| pool.take().expect("pool sized to depth")).collect();
    for (i, b) in buffers.iter_mut().enumerate() {
        b.as_mut_slice().fill(i as u8 ^ 0x5a);
    }
    let mut driver = Driver {
        blocks: args.size / args.bs,
        bs: args.bs,
        random: args.rw.is_random(),
        next_seq: 0,
        rng: 0x6b65_656c_6673,
    };
    let mut started = vec![Instant::now(); depth as usize];
    let mut hist = Histogram::new();
    let mut completions: Vec<Completion> = Vec::with_capacity(depth as usize);
    let submit = |queue: &mut Box<dyn keelfs_bdev::IoQueue>, buf: &mut PoolBuf, slot: u64, offset: u64| {
        let iov = [buf.iovec()];
        let req =
            if args.rw.is_write() { IoRequest::write(slot, offset, &iov) } else { IoRequest::read(slot, offset, &iov) };
        let req = if args.fixed_buffers { req.with_pool_index(buf.index()) } else { req };
        // SAFETY: the buffers live until every completion has been drained
        // at the end of this function.
        unsafe { queue.submit(&req) }
    };
    let cpu_start = crate::procstat::own_cpu_ns(std::process::id())?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.seconds);
    for slot in 0..depth as usize {
        started[slot] = Instant::now();
        submit(&mut queue, &mut buffers[slot], slot as u64, driver.next_offset())?;
    }
    let mut ios = 0u64;
    let mut stopping = false;
    let mut end = start;
    while queue.in_flight() > 0 {
        completions.clear();
        if queue.poll(&mut completions, depth as usize) == 0 {
            continue;
        }
        let now = Instant::now();
        for c in &completions {
            let slot = c.token as usize;
            c.result.with_context(|| format!("I/O failed on {}", device.name()))?;
            if !stopping {
                hist.record((now - started[slot]).as_nanos() as u64);
                ios += 1;
                end = now;
            }
            if now >= deadline {
                stopping = true;
                continue;
            }
            started[slot] = now;
            submit(&mut queue, &mut buffers[slot], slot as u64, driver.next_offset())?;
        }
    }
    drop(queue);
    for b in buffers {
        pool.put(b);
    }
    let cpu = Duration::from_nanos(crate::procstat::own_cpu_ns(std::process::id())?.saturating_sub(cpu_start));
    Ok(RoundResult { ios, elapsed: end - start, hist, cpu })
}

fn report(args: &BdevArgs, ours: &[RoundResult], peers: &[fio::FioResult]) {
    let ios: u64 = ours.iter().map(|r| r.ios).sum();
    let secs: f64 = ours.iter().map(|r| r.elapsed.as_secs_f64()).sum();
    let iops = ios as f64 / secs;
    let mut hist = Histogram::new();
    // Merge by re-weighting quantiles is lossy; the rounds' histograms are
    // summed instead, bucket by bucket.
    for r in ours {
        hist.merge(&r.hist);
    }
    let cpu: f64 = ours.iter().map(|r| r.cpu.as_secs_f64()).sum();
    let cpu_us_per_io = (cpu * 1e6 / ios.max(1) as f64 * 100.0).round() / 100.0;
    let mut line = json!({
        "bench": "bdev",
        "backend": match args.backend {
            Backend::Uring => if args.sqpoll { "uring-sqpoll" } else { "uring" },
            Backend::Pmem => "pmem",
            Backend::Nvme => "nvme",
        },
        "rw": args.rw.name(),
        "bs": args.bs,
        "iodepth": args.iodepth,
        "seconds": args.seconds,
        "rounds": ours.len(),
        "fixed_buffers": args.fixed_buffers,
        "sqpoll": args.sqpoll,
        "ios": ios,
        "iops": iops.round(),
        "mib_s": (iops * args.bs as f64 / (1u64 << 20) as f64 * 10.0).round() / 10.0,
        "lat_us_p50": hist.quantile(0.50) as f64 / 1000.0,
        "lat_us_p99": hist.quantile(0.99) as f64 / 1000.0,
        "cpu_us_per_io": cpu_us_per_io,
    });
    if !peers.is_empty() {
        let fio_iops = peers.iter().map(|p| p.iops).sum::<f64>() / peers.len() as f64;
        line["fio_iops"] = json!(fio_iops.round());
        line["fio_lat_us_p50"] = json!(peers.iter().map(|p| p.lat_us_p50).fold(0.0, f64::max));
        line["fio_lat_us_p99"] = json!(peers.iter().map(|p| p.lat_us_p99).fold(0.0, f64::max));
        line["ratio_vs_fio"] = json!((iops / fio_iops * 1000.0).round() / 1000.0);
    }
    if args.json {
        println!("{line}");
    } else {
        println!("{}", serde_json::to_string_pretty(&line).expect("a JSON value serialises"));
    }
}
