//! `keelfs-bench bdev`: one thread drives one backend queue at a fixed
//! depth, the way a reactor would, and reports IOPS and latency. With
//! `--vs-fio`, fio's io_uring engine runs on the same file with the same
//! parameters in the same invocation, rounds interleaved. With
//! `--vs-qemu-img` (RBD), `qemu-img bench` through QEMU's rbd driver runs
//! on a second image likewise.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use keelfs_base::testing::splitmix64;
use keelfs_bdev::{
    BlockDevice, BufferPool, Completion, IoRequest, MappedDevice, NvmeAddress, NvmeDevice, NvmeOptions, PoolBuf,
    QueueConfig, RbdAddress, RbdDevice, RbdOptions, UringDevice, UringOptions,
};
use serde_json::json;

use crate::fio::{self, FioJob};
use crate::hist::Histogram;
use crate::qemu_img::{self, QemuImgJob, QemuImgResult};
use keelfs_base::parse_size;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Uring,
    Pmem,
    /// The userspace NVMe driver; --path nvme:PCI[/NSID].
    Nvme,
    /// A Ceph RBD image through librbd; --path rbd:POOL/IMAGE[@CONF][:id=CLIENT].
    Rbd,
}

/// What the thread does when a poll finds nothing to complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Wait {
    /// Poll again at once: a busy reactor (a core of its own).
    Spin,
    /// Sleep on the queue's completion eventfd, as a reactor in interrupt
    /// mode does (and as qemu-img's event loop does).
    Eventfd,
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
    /// nvme:PCI[/NSID] with --backend nvme, or rbd:POOL/IMAGE with
    /// --backend rbd.
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
    /// Stop after this many requests, if --seconds has not passed first:
    /// a bound on what a round writes.
    #[arg(long)]
    count: Option<u64>,
    /// With --rw read or write: each offset is the previous one plus STEP,
    /// wrapping at --size, as qemu-img bench's --step-size (default --bs).
    #[arg(long, value_parser = parse_size)]
    step: Option<u64>,
    /// How to wait for completions.
    #[arg(long, value_enum, default_value = "spin")]
    wait: Wait,
    /// Alternate this many rounds of ours and the peer's.
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
    /// Also run `qemu-img bench` (QEMU's rbd driver) on this image of the
    /// same size, rbd:POOL/IMAGE, with the same block size, depth,
    /// direction and offsets (needs --rw read or write), and report the
    /// ratios. Each of its rounds does as many requests as ours did.
    #[arg(long, value_name = "RBD_IMAGE")]
    vs_qemu_img: Option<String>,
    /// A process charged to neither side (a Ceph OSD): its CPU time per
    /// request is reported for each.
    #[arg(long)]
    osd_pid: Option<u32>,
    /// Run qemu-img before ours in the first round. Which side goes first
    /// alternates over rounds anyway: writes leave the OSD background
    /// work (its database's flushes) that the next run pays for.
    #[arg(long)]
    peer_first: bool,
    /// Print one JSON object per result line.
    #[arg(long)]
    json: bool,
}

struct RoundResult {
    ios: u64,
    elapsed: Duration,
    hist: Histogram,
    /// This process's CPU time (user + system, all threads) over the round.
    cpu: Duration,
    /// --osd-pid's CPU time over the round.
    osd_cpu: Option<Duration>,
}

pub fn run(args: &BdevArgs) -> anyhow::Result<()> {
    check_args(args)?;
    let peer_image = args.vs_qemu_img.as_deref().map(RbdAddress::parse).transpose()?;
    if matches!(args.backend, Backend::Uring | Backend::Pmem) {
        prepare_file(args)?;
    }
    let device = open_device(args)?;
    let capacity = device.geometry().capacity_bytes;
    if args.size > capacity {
        bail!("--size {} is larger than {} ({capacity} bytes)", args.size, device.name());
    }
    // qemu-img's fixed cost (connecting, opening the image, taking its
    // lock, closing) is charged to one request, and subtracted.
    let peer_setup = match &peer_image {
        Some(image) => Some(qemu_img::run(&qemu_job(args, image, 1))?),
        None => None,
    };
    let mut ours: Vec<RoundResult> = Vec::new();
    let mut fio_peers = Vec::new();
    let mut qemu_peers = Vec::new();
    for i in 0..args.rounds.max(1) {
        let peer_first = args.peer_first != (i % 2 == 1);
        if let (Some(image), true) = (&peer_image, peer_first) {
            // As many requests as ours did last round, or as qemu-img
            // does in --seconds by a short probe's rate.
            let count = match ours.last() {
                Some(r) => r.ios.max(u64::from(args.iodepth)),
                None => probe_count(args, image)?,
            };
            qemu_peers.push(qemu_img::run(&qemu_job(args, image, count))?);
        }
        let round = drive(device.as_ref(), args)?;
        if args.vs_fio {
            let job = FioJob {
                path: &args.path,
                rw: args.rw.name(),
                bs: args.bs,
                iodepth: args.iodepth,
                size: args.size,
                seconds: args.seconds,
            };
            fio_peers.push(fio::run_io_uring(&job)?);
        }
        if let (Some(image), false) = (&peer_image, peer_first) {
            // As many requests as ours did, so that both run about as long.
            let count = round.ios.max(u64::from(args.iodepth));
            qemu_peers.push(qemu_img::run(&qemu_job(args, image, count))?);
        }
        ours.push(round);
    }
    let mut line = report(args, &ours);
    if !fio_peers.is_empty() {
        add_fio(&mut line, &fio_peers);
    }
    if let Some(setup) = &peer_setup {
        add_qemu_img(&mut line, args, &qemu_peers, setup);
    }
    if args.json {
        println!("{line}");
    } else {
        println!("{}", serde_json::to_string_pretty(&line).expect("a JSON value serialises"));
    }
    Ok(())
}

fn check_args(args: &BdevArgs) -> anyhow::Result<()> {
    if args.bs == 0 || !args.bs.is_multiple_of(512) || args.bs > 1 << 20 {
        bail!("--bs must be a multiple of 512 up to 1M, got {}", args.bs);
    }
    if args.iodepth == 0 || args.iodepth > 4096 {
        bail!("--iodepth must be between 1 and 4096, got {}", args.iodepth);
    }
    if args.size < args.bs {
        bail!("--size {} is smaller than --bs {}", args.size, args.bs);
    }
    if args.count == Some(0) {
        bail!("--count must be at least 1");
    }
    if let Some(step) = args.step {
        if args.rw.is_random() {
            bail!("--step is for --rw read or write: random offsets take no step");
        }
        if step == 0 || !step.is_multiple_of(args.bs) {
            bail!("--step must be a non-zero multiple of --bs {}, got {step}", args.bs);
        }
    }
    if args.vs_fio && matches!(args.backend, Backend::Nvme | Backend::Rbd) {
        bail!(
            "--vs-fio needs a file; with --backend nvme compare against --backend uring on the kernel's \
             /dev/nvmeXnY, with --backend rbd use --vs-qemu-img"
        );
    }
    if args.vs_qemu_img.is_some() {
        if args.backend != Backend::Rbd {
            bail!("--vs-qemu-img is the peer of --backend rbd");
        }
        if args.rw.is_random() {
            bail!("qemu-img bench cannot do random offsets: use --rw read or write (with --step to scatter them)");
        }
    }
    Ok(())
}

fn open_device(args: &BdevArgs) -> anyhow::Result<Arc<dyn BlockDevice>> {
    Ok(match args.backend {
        Backend::Nvme => {
            let address = NvmeAddress::parse(&args.path.to_string_lossy())?;
            Arc::new(NvmeDevice::open(&address, NvmeOptions::default()).with_context(|| format!("opening {address}"))?)
        }
        Backend::Rbd => {
            let address = RbdAddress::parse(&args.path.to_string_lossy())?;
            Arc::new(RbdDevice::open(&address, RbdOptions::default()).with_context(|| format!("opening {address}"))?)
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
    })
}

/// How many requests qemu-img does in --seconds (at most --count), from a
/// short run's rate.
fn probe_count(args: &BdevArgs, image: &RbdAddress) -> anyhow::Result<u64> {
    let depth = u64::from(args.iodepth);
    let budget = args.count.unwrap_or(u64::MAX);
    let probe = qemu_img::run(&qemu_job(args, image, (depth * 64).max(256).min(budget / 4).max(depth)))?;
    let rate = probe.ios as f64 / probe.elapsed.as_secs_f64();
    Ok(((rate * args.seconds as f64) as u64).min(budget).max(depth))
}

fn qemu_job<'a>(args: &BdevArgs, image: &'a RbdAddress, count: u64) -> QemuImgJob<'a> {
    QemuImgJob {
        image,
        write: args.rw.is_write(),
        bs: args.bs,
        iodepth: args.iodepth,
        step: args.step.unwrap_or(args.bs),
        count,
        osd_pid: args.osd_pid,
    }
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
    /// Sequential: the next offset, and how far each request moves it on
    /// (wrapping at blocks * bs, as qemu-img bench wraps at the image's end).
    next: u64,
    step: u64,
    rng: u64,
}

impl Driver {
    fn new(args: &BdevArgs) -> Self {
        Self {
            blocks: args.size / args.bs,
            bs: args.bs,
            random: args.rw.is_random(),
            next: 0,
            step: args.step.unwrap_or(args.bs),
            rng: 0x6b65_656c_6673,
        }
    }

    fn next_offset(&mut self) -> u64 {
        if self.random {
            return splitmix64(&mut self.rng) % self.blocks * self.bs;
        }
        let offset = self.next;
        self.next = (self.next + self.step) % (self.blocks * self.bs);
        offset
    }
}

/// Sleep until `fd` (a queue's completion eventfd) is signalled or a
/// second passes, then reset it. A completion that lands after the reset
/// is in the queue before its signal, so the next poll finds it.
fn wait_for_completion(fd: std::os::fd::RawFd) {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: poll reads and writes one live pollfd.
    unsafe { libc::poll(&mut pfd, 1, 1000) };
    let mut count = 0u64;
    // SAFETY: reads at most 8 bytes into a live u64; the eventfd is
    // non-blocking, so an unsignalled one answers EAGAIN at once.
    unsafe { libc::read(fd, (&mut count as *mut u64).cast(), 8) };
}

/// A buffer of --bs per slot, from a pool registered with the queue, each
/// filled with a non-zero byte of its own.
fn buffers(queue: &mut dyn keelfs_bdev::IoQueue, args: &BdevArgs) -> anyhow::Result<(BufferPool, Vec<PoolBuf>)> {
    let mut pool = BufferPool::new(args.iodepth as usize, args.bs as usize, 4096);
    queue.register_pool(&pool)?;
    let mut buffers: Vec<PoolBuf> = (0..args.iodepth).map(|_| pool.take().expect("pool sized to depth")).collect();
    for (i, b) in buffers.iter_mut().enumerate() {
        b.as_mut_slice().fill(i as u8 ^ 0x5a);
    }
    Ok((pool, buffers))
}

fn drive(device: &dyn BlockDevice, args: &BdevArgs) -> anyhow::Result<RoundResult> {
    let depth = args.iodepth;
    let sleep = args.wait == Wait::Eventfd;
    let mut queue = device.open_queue(QueueConfig { depth, completion_eventfd: sleep })?;
    let wake = queue.completion_eventfd();
    if sleep && wake.is_none() {
        bail!("--wait eventfd: {}'s queues have no completion eventfd", device.name());
    }
    let (mut pool, mut buffers) = buffers(queue.as_mut(), args)?;
    let mut driver = Driver::new(args);
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
    let osd_start = args.osd_pid.map(crate::procstat::own_cpu_ns).transpose()?;
    let cpu_start = crate::procstat::own_cpu_ns(std::process::id())?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.seconds);
    let budget = args.count.unwrap_or(u64::MAX);
    let mut submitted = u64::from(depth).min(budget);
    for slot in 0..submitted as usize {
        started[slot] = Instant::now();
        submit(&mut queue, &mut buffers[slot], slot as u64, driver.next_offset())?;
    }
    let mut ios = 0u64;
    let mut stopping = false;
    let mut end = start;
    while queue.in_flight() > 0 {
        completions.clear();
        if queue.poll(&mut completions, depth as usize) == 0 {
            if let Some(fd) = wake {
                wait_for_completion(fd);
            }
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
            }
            if stopping || submitted >= budget {
                continue;
            }
            started[slot] = now;
            submit(&mut queue, &mut buffers[slot], slot as u64, driver.next_offset())?;
            submitted += 1;
        }
    }
    drop(queue);
    for b in buffers {
        pool.put(b);
    }
    let cpu = Duration::from_nanos(crate::procstat::own_cpu_ns(std::process::id())?.saturating_sub(cpu_start));
    let osd_end = args.osd_pid.map(crate::procstat::own_cpu_ns).transpose()?;
    let osd_cpu = osd_start.zip(osd_end).map(|(s, e)| Duration::from_nanos(e.saturating_sub(s)));
    Ok(RoundResult { ios, elapsed: end - start, hist, cpu, osd_cpu })
}

/// µs per request to 0.01.
fn us_per_io(total: Duration, ios: u64) -> f64 {
    (total.as_secs_f64() * 1e6 / ios.max(1) as f64 * 100.0).round() / 100.0
}

fn report(args: &BdevArgs, ours: &[RoundResult]) -> serde_json::Value {
    let ios: u64 = ours.iter().map(|r| r.ios).sum();
    let secs: f64 = ours.iter().map(|r| r.elapsed.as_secs_f64()).sum();
    let iops = ios as f64 / secs;
    let mut hist = Histogram::new();
    // Merge by re-weighting quantiles is lossy; the rounds' histograms are
    // summed instead, bucket by bucket.
    for r in ours {
        hist.merge(&r.hist);
    }
    let cpu: Duration = ours.iter().map(|r| r.cpu).sum();
    let mut line = json!({
        "bench": "bdev",
        "backend": match args.backend {
            Backend::Uring => if args.sqpoll { "uring-sqpoll" } else { "uring" },
            Backend::Pmem => "pmem",
            Backend::Nvme => "nvme",
            Backend::Rbd => "rbd",
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
        "cpu_us_per_io": us_per_io(cpu, ios),
    });
    if args.wait != Wait::Spin {
        line["wait"] = json!("eventfd");
    }
    if let Some(step) = args.step {
        line["step"] = json!(step);
    }
    if args.osd_pid.is_some() {
        line["osd_cpu_us_per_io"] = json!(us_per_io(ours.iter().filter_map(|r| r.osd_cpu).sum(), ios));
    }
    if args.iodepth == 1 || args.vs_qemu_img.is_some() {
        // By Little's law; what qemu-img's total time gives for it too.
        line["lat_us_mean"] = json!((secs * 1e6 * f64::from(args.iodepth) / ios.max(1) as f64 * 10.0).round() / 10.0);
    }
    line
}

fn add_fio(line: &mut serde_json::Value, peers: &[fio::FioResult]) {
    let iops = line["iops"].as_f64().unwrap_or(0.0);
    let fio_iops = peers.iter().map(|p| p.iops).sum::<f64>() / peers.len() as f64;
    line["fio_iops"] = json!(fio_iops.round());
    line["fio_lat_us_p50"] = json!(peers.iter().map(|p| p.lat_us_p50).fold(0.0, f64::max));
    line["fio_lat_us_p99"] = json!(peers.iter().map(|p| p.lat_us_p99).fold(0.0, f64::max));
    line["ratio_vs_fio"] = json!((iops / fio_iops * 1000.0).round() / 1000.0);
}

/// The qemu-img rounds' figures beside ours, and the ratios: IOPS ours /
/// qemu-img's, and CPU per request (each client's own process, librbd's
/// threads included) ours / qemu-img's. qemu-img's fixed cost, `setup`
/// (a run of one request), is taken off its CPU and the OSD's.
fn add_qemu_img(line: &mut serde_json::Value, args: &BdevArgs, peers: &[QemuImgResult], setup: &QemuImgResult) {
    let ios: u64 = peers.iter().map(|p| p.ios).sum();
    let secs: f64 = peers.iter().map(|p| p.elapsed.as_secs_f64()).sum();
    let iops = ios as f64 / secs;
    let cpu: Duration = peers.iter().map(|p| p.cpu.saturating_sub(setup.cpu)).sum();
    let cpu_us = us_per_io(cpu, ios);
    line["peer"] = json!("qemu-img");
    line["peer_first"] = json!(args.peer_first);
    line["qemu_setup_cpu_ms"] = json!((setup.cpu.as_secs_f64() * 1e4).round() / 10.0);
    line["qemu_iops"] = json!(iops.round());
    line["qemu_mib_s"] = json!((iops * args.bs as f64 / (1u64 << 20) as f64 * 10.0).round() / 10.0);
    line["qemu_lat_us_mean"] = json!((secs * 1e6 * f64::from(args.iodepth) / ios.max(1) as f64 * 10.0).round() / 10.0);
    line["qemu_cpu_us_per_io"] = json!(cpu_us);
    if let Some(setup_osd) = setup.osd_cpu {
        let osd: Duration = peers.iter().filter_map(|p| p.osd_cpu).map(|c| c.saturating_sub(setup_osd)).sum();
        line["qemu_osd_cpu_us_per_io"] = json!(us_per_io(osd, ios));
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { (a / b * 1000.0).round() / 1000.0 } else { 0.0 };
    line["ratio_vs_qemu"] = json!(ratio(line["iops"].as_f64().unwrap_or(0.0), iops));
    line["cpu_ratio_vs_qemu"] = json!(ratio(line["cpu_us_per_io"].as_f64().unwrap_or(0.0), cpu_us));
}
