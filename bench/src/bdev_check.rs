//! `keelfs-bench bdev-check`: a correctness pass over a block-device backend,
//! written for the NVMe driver (run inside a guest with an emulated
//! controller) and also runnable on a file through io_uring. Every check
//! prints one JSON line; the exit status is 1 if any failed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use keelfs_base::testing::splitmix64;
use keelfs_bdev::{
    AlignedBuf, BdevError, BlockDevice, BufferPool, Completion, IoQueue, IoRequest, IoVec, NvmeAddress, NvmeDevice,
    NvmeOptions, NvmeQueue, QueueConfig, UringDevice, UringOptions,
};
use serde_json::{json, Value};

#[derive(Args, Debug)]
pub struct BdevCheckArgs {
    /// `nvme:PCI[/NSID]` for the NVMe driver, or a file or block device
    /// (io_uring; the controller-specific checks are skipped).
    #[arg(long)]
    path: String,
    /// Queue pairs to open and check at once.
    #[arg(long, default_value_t = 2)]
    queues: usize,
    /// Print one JSON object per check (the default prints them too, pretty).
    #[arg(long)]
    json: bool,
}

struct Report {
    json: bool,
    failed: usize,
}

impl Report {
    fn line(&mut self, check: &str, ok: bool, mut detail: Value) {
        detail["check"] = json!(check);
        detail["ok"] = json!(ok);
        if !ok {
            self.failed += 1;
        }
        if self.json {
            println!("{detail}");
        } else {
            println!("{}", serde_json::to_string_pretty(&detail).expect("JSON serialises"));
        }
    }
}

enum Device {
    Nvme(Arc<NvmeDevice>),
    Uring(Arc<UringDevice>),
}

impl Device {
    fn as_block(&self) -> &dyn BlockDevice {
        match self {
            Device::Nvme(d) => d.as_ref(),
            Device::Uring(d) => d.as_ref(),
        }
    }
    fn open_queue(&self, depth: u32) -> anyhow::Result<Box<dyn IoQueue>> {
        Ok(self.as_block().open_queue(QueueConfig { depth, completion_eventfd: false })?)
    }
}

fn open(path: &str, options: NvmeOptions) -> anyhow::Result<Device> {
    if NvmeAddress::is_nvme_name(path) {
        let address = NvmeAddress::parse(path)?;
        Ok(Device::Nvme(Arc::new(NvmeDevice::open(&address, options).with_context(|| format!("opening {address}"))?)))
    } else {
        let p = PathBuf::from(path);
        Ok(Device::Uring(Arc::new(
            UringDevice::open(&p, UringOptions::default()).with_context(|| format!("opening {path} with io_uring"))?,
        )))
    }
}

/// Submit, retrying on QueueFull after polling, and collect completions.
fn wait_all(queue: &mut dyn IoQueue, out: &mut Vec<Completion>, deadline: Duration) -> bool {
    let start = Instant::now();
    while queue.in_flight() > 0 {
        queue.poll(out, 64);
        if start.elapsed() > deadline {
            return false;
        }
    }
    true
}

fn pattern_byte(pattern: u32, offset: u64, i: usize) -> u8 {
    match pattern {
        0 => 0x00,
        1 => 0xff,
        _ => {
            let mut seed = offset ^ (i as u64 / 8).wrapping_mul(0x9e37_79b9);
            (splitmix64(&mut seed) >> ((i % 8) * 8)) as u8
        }
    }
}

/// One pass: write `count` requests of `bytes` from `base` with `depth` in
/// flight, read them back and compare with `pattern`.
#[derive(Clone, Copy)]
struct Round {
    base: u64,
    bytes: usize,
    count: usize,
    depth: usize,
    pattern: u32,
}

/// 32 × 4 KiB at depth 32: the quick check that a queue still works.
const SMALL_ROUND: Round = Round { base: 0, bytes: 4096, count: 32, depth: 32, pattern: 2 };

/// Where a round's buffers come from.
enum Buffers<'a> {
    /// A registered pool (the NVMe driver maps it for DMA).
    Pool(&'a mut BufferPool),
    /// Fresh heap buffers starting `skew` bytes into a page; unregistered,
    /// so the NVMe driver bounces them.
    Heap { skew: usize },
}

fn verify_round(queue: &mut dyn IoQueue, round: Round, buffers: Buffers<'_>) -> Result<(), String> {
    let Round { bytes, count, .. } = round;
    let mut heap: Vec<AlignedBuf> = Vec::new();
    let mut iovs: Vec<IoVec> = Vec::new();
    let mut pool_bufs = Vec::new();
    let pool = match buffers {
        Buffers::Pool(pool) => {
            for _ in 0..count {
                let mut b = pool.take().ok_or("pool exhausted")?;
                iovs.push(IoVec { base: b.iovec().base, len: bytes });
                pool_bufs.push(b);
            }
            Some(pool)
        }
        Buffers::Heap { skew } => {
            for _ in 0..count {
                let mut b = AlignedBuf::zeroed(bytes + 4096, 4096);
                // SAFETY: skew + bytes <= the allocation's length.
                iovs.push(IoVec { base: unsafe { b.as_mut_ptr().add(skew) }, len: bytes });
                heap.push(b);
            }
            None
        }
    };
    let result = transfer_and_compare(queue, round, &iovs);
    if let Some(pool) = pool {
        for b in pool_bufs {
            pool.put(b);
        }
    }
    drop(heap);
    result
}

fn transfer_and_compare(queue: &mut dyn IoQueue, round: Round, iovs: &[IoVec]) -> Result<(), String> {
    let Round { base, bytes, count, depth, pattern } = round;
    let fill = |iov: &IoVec, offset: u64, p: u32| {
        // SAFETY: each iovec names `bytes` bytes of a buffer this function owns.
        let s = unsafe { std::slice::from_raw_parts_mut(iov.base, iov.len) };
        for (i, b) in s.iter_mut().enumerate() {
            *b = pattern_byte(p, offset, i);
        }
    };
    for (i, iov) in iovs.iter().enumerate() {
        fill(iov, base + (i * bytes) as u64, pattern);
    }
    let mut out = Vec::new();
    for write in [true, false] {
        if !write {
            for iov in iovs {
                // SAFETY: as above; scrub so that a read that does nothing fails.
                unsafe { std::ptr::write_bytes(iov.base, 0xa5, iov.len) };
            }
        }
        let mut next = 0;
        out.clear();
        let start = Instant::now();
        while next < count || queue.in_flight() > 0 {
            while next < count && queue.in_flight() < depth {
                let one = [iovs[next]];
                let offset = base + (next * bytes) as u64;
                let req = if write {
                    IoRequest::write(next as u64, offset, &one)
                } else {
                    IoRequest::read(next as u64, offset, &one)
                };
                // SAFETY: the buffers outlive the loop, which waits for every
                // completion.
                match unsafe { queue.submit(&req) } {
                    Ok(()) => next += 1,
                    Err(BdevError::QueueFull) => break,
                    Err(e) => return Err(format!("submit failed: {e}")),
                }
            }
            queue.poll(&mut out, 64);
            if start.elapsed() > Duration::from_secs(60) {
                return Err("requests did not complete within 60 s".into());
            }
        }
        if let Some(c) = out.iter().find(|c| c.result.is_err()) {
            return Err(format!("request {} failed: {:?}", c.token, c.result));
        }
        if out.len() != count {
            return Err(format!("{} completions for {count} requests", out.len()));
        }
    }
    for (i, iov) in iovs.iter().enumerate() {
        let offset = base + (i * bytes) as u64;
        // SAFETY: as above.
        let s = unsafe { std::slice::from_raw_parts(iov.base, iov.len) };
        if let Some(at) = s.iter().enumerate().position(|(j, &b)| b != pattern_byte(pattern, offset, j)) {
            return Err(format!("data mismatch at device offset {} (request {i}, byte {at})", offset + at as u64));
        }
    }
    Ok(())
}

pub fn run(args: &BdevCheckArgs) -> anyhow::Result<()> {
    if args.queues == 0 || args.queues > 16 {
        bail!("--queues must be between 1 and 16");
    }
    let mut report = Report { json: args.json, failed: 0 };
    let device = open(&args.path, NvmeOptions::default())?;
    let geometry = device.as_block().geometry();
    if let Device::Nvme(d) = &device {
        check_identify(&mut report, d);
    }
    // Every queue pair, open at once, each on its own stripe of the device.
    let mut queues = Vec::new();
    for _ in 0..args.queues {
        queues.push(device.open_queue(64)?);
    }
    let stripe = 64u64 << 20;
    if geometry.capacity_bytes < stripe * args.queues as u64 {
        bail!("the device is smaller than {} MiB", (stripe >> 20) * args.queues as u64);
    }
    for (q, queue) in queues.iter_mut().enumerate() {
        check_verify(&mut report, q, queue.as_mut(), q as u64 * stripe)?;
    }
    check_flush(&mut report, queues[0].as_mut());
    check_out_of_range(&mut report, queues[0].as_mut());
    if let Device::Nvme(d) = &device {
        check_discard(&mut report, d, queues[0].as_mut())?;
        check_reset_recovery(&mut report, d, &mut queues, stripe);
    }
    // Counters of the queues (NVMe): how much moved by DMA to caller
    // memory, how much was bounced.
    drop(queues);
    if let Device::Nvme(d) = &device {
        let c = d.closed_queue_counters();
        report.line(
            "dma_paths",
            c.direct > 0 && c.bounced > 0,
            json!({"direct": c.direct, "bounced": c.bounced, "commands": c.commands, "rebuilds": c.rebuilds}),
        );
    }
    let nvme = matches!(device, Device::Nvme(_));
    drop(device);
    if nvme {
        check_command_timeout(&mut report, &args.path)?;
    }
    if report.failed > 0 {
        eprintln!("keelfs-bench bdev-check: {} check(s) failed", report.failed);
        std::process::exit(1);
    }
    Ok(())
}

fn check_identify(report: &mut Report, d: &NvmeDevice) {
    let info = d.controller_info();
    let ns = d.namespace_info();
    report.line(
        "identify",
        d.geometry().capacity_bytes > 0 && !info.model.is_empty(),
        json!({
            "model": info.model, "serial": info.serial, "firmware": info.firmware,
            "vendor_id": format!("{:#06x}", info.vendor_id), "version": format!("{:#x}", d.version()),
            "namespaces": info.namespaces, "size_blocks": ns.size_blocks, "block_bytes": ns.block_bytes,
            "volatile_write_cache": info.volatile_write_cache, "dataset_management": info.dataset_management,
            "max_transfer_bytes": d.max_transfer_bytes(), "io_queues_granted": d.queue_limit(),
        }),
    );
}

/// Queue `q`'s rounds on its stripe from `base`: depths 1 and 32, three
/// patterns, pooled, heap and unaligned buffers.
fn check_verify(report: &mut Report, q: usize, queue: &mut dyn IoQueue, base: u64) -> anyhow::Result<()> {
    // The "unaligned" rounds place buffers off a page boundary, as far as
    // the device allows: NVMe's PRPs take any dword-aligned address; an
    // O_DIRECT file wants its memory alignment, often a whole page.
    let align = queue.geometry().memory_alignment as usize;
    let skew = if align < 4096 { align.max(512) } else { 0 };
    let mut pool = BufferPool::new(64, 128 << 10, 4096);
    queue.register_pool(&pool)?;
    let mut failures = Vec::new();
    let mut rounds = 0;
    for (depth_index, depth) in [1usize, 32].into_iter().enumerate() {
        for pattern in 0..3u32 {
            for (bytes, unaligned, use_pool) in
                [(4096usize, false, true), (128 << 10, false, true), (4096, true, false), (1 << 20, false, false)]
            {
                let count = if bytes >= 1 << 20 { 4 } else { 32 };
                // Six 8 MiB slots per 64 MiB stripe, one per depth and
                // pattern; the largest round (4 MiB) fits in its slot.
                let offset = base + ((depth_index as u64 * 3 + u64::from(pattern)) * (8 << 20));
                let buffers = if unaligned {
                    Buffers::Heap { skew }
                } else if use_pool {
                    Buffers::Pool(&mut pool)
                } else {
                    Buffers::Heap { skew: 0 }
                };
                let round = Round { base: offset, bytes, count, depth, pattern };
                if let Err(e) = verify_round(queue, round, buffers) {
                    failures.push(format!(
                        "depth {depth}, pattern {pattern}, {bytes} B{}: {e}",
                        if unaligned { format!(" at page offset {skew}") } else { String::new() }
                    ));
                }
                rounds += 1;
            }
        }
    }
    report.line(
        "verify",
        failures.is_empty(),
        json!({"queue": q, "rounds": rounds, "depths": [1, 32], "unaligned_skew": skew, "failures": failures}),
    );
    Ok(())
}

fn check_flush(report: &mut Report, queue: &mut dyn IoQueue) {
    let mut out = Vec::new();
    // SAFETY: a flush names no memory.
    let submitted = unsafe { queue.submit(&IoRequest::flush(7)) };
    let done = submitted.is_ok() && wait_all(queue, &mut out, Duration::from_secs(30));
    let ok = done && out.len() == 1 && out[0].result.is_ok();
    report.line("flush", ok, json!({"result": format!("{:?}", out.first().map(|c| c.result))}));
}

/// An LBA past the end is a typed error, refused before the device.
fn check_out_of_range(report: &mut Report, queue: &mut dyn IoQueue) {
    let mut buf = AlignedBuf::zeroed(4096, 4096);
    let iov = [buf.iovec()];
    let capacity = queue.geometry().capacity_bytes;
    // SAFETY: the buffer outlives the call, and the request is refused.
    let r = unsafe { queue.submit(&IoRequest::read(8, capacity, &iov)) };
    let ok = matches!(r, Err(BdevError::OutOfRange { .. }));
    report.line("out_of_range", ok, json!({"result": format!("{r:?}")}));
}

/// Deallocate, where the controller has it; refused as unsupported where
/// it has not.
fn check_discard(report: &mut Report, d: &NvmeDevice, queue: &mut dyn IoQueue) -> anyhow::Result<()> {
    let mut out = Vec::new();
    // Data first, so that zeros afterwards mean the discard took.
    let written = verify_round(
        queue,
        Round { base: 0, bytes: 4096, count: 16, depth: 16, pattern: 1 },
        Buffers::Heap { skew: 0 },
    );
    // SAFETY: a discard names no memory.
    let r = unsafe { queue.submit(&IoRequest::discard(9, 0, 1 << 20)) };
    let supported = d.controller_info().dataset_management;
    let ok = match r {
        Ok(()) => {
            supported && wait_all(queue, &mut out, Duration::from_secs(30)) && out.iter().all(|c| c.result.is_ok())
        }
        Err(BdevError::Unsupported(_)) => !supported,
        Err(_) => false,
    };
    let mut zeroes = Value::Null;
    if ok && supported && d.namespace_info().deallocated_reads_zero {
        let mut buf = AlignedBuf::zeroed(4096, 4096);
        buf.fill(0x77);
        let iov = [buf.iovec()];
        // SAFETY: the buffer outlives the wait below.
        unsafe { queue.submit(&IoRequest::read(10, 0, &iov)) }?;
        out.clear();
        let read_ok = wait_all(queue, &mut out, Duration::from_secs(30)) && out.iter().all(|c| c.result.is_ok());
        zeroes = json!(read_ok && buf.iter().all(|&b| b == 0));
    }
    let ok = ok && written.is_ok() && zeroes != json!(false);
    report.line(
        "discard",
        ok,
        json!({"supported": supported, "reads_zero_after": zeroes, "pattern_written_first": format!("{written:?}")}),
    );
    Ok(())
}

/// A controller reset with requests in flight: each one completes (with an
/// error or not), and every queue works again afterwards.
fn check_reset_recovery(report: &mut Report, d: &NvmeDevice, queues: &mut [Box<dyn IoQueue>], stripe: u64) {
    let mut pool = BufferPool::new(32, 4096, 4096);
    let mut bufs: Vec<_> = (0..32).map(|_| pool.take().expect("sized")).collect();
    let mut submitted = 0;
    for (i, b) in bufs.iter_mut().enumerate() {
        let iov = [b.iovec()];
        // SAFETY: the buffers live until every completion is collected.
        if unsafe { queues[0].submit(&IoRequest::write(100 + i as u64, (i as u64) << 12, &iov)) }.is_ok() {
            submitted += 1;
        }
    }
    let reset = d.reset();
    let mut out = Vec::new();
    let drained = wait_all(queues[0].as_mut(), &mut out, Duration::from_secs(30));
    let failed_by_reset = out.iter().filter(|c| c.result.is_err()).count();
    let mut after = Vec::new();
    for (q, queue) in queues.iter_mut().enumerate() {
        if let Err(e) =
            verify_round(queue.as_mut(), Round { base: q as u64 * stripe, ..SMALL_ROUND }, Buffers::Heap { skew: 0 })
        {
            after.push(format!("queue {q}: {e}"));
        }
    }
    let ok = reset.is_ok() && drained && out.len() == submitted && after.is_empty();
    report.line(
        "reset_recovery",
        ok,
        json!({"reset": format!("{reset:?}"), "in_flight": submitted, "completed": out.len(),
               "failed_by_reset": failed_by_reset, "io_after_reset_failures": after}),
    );
    drop(bufs);
}

/// Command timeouts: with a 1 µs limit, commands outlive it; each must
/// still complete (as ETIMEDOUT or done), and the device must work once
/// opened again with the normal limit.
fn check_command_timeout(report: &mut Report, path: &str) -> anyhow::Result<()> {
    let fast = open(path, NvmeOptions { command_timeout: Duration::from_micros(1), ..NvmeOptions::default() })?;
    let Device::Nvme(d) = &fast else { unreachable!("opened as NVMe before") };
    let mut queue: NvmeQueue = d.open_nvme_queue(QueueConfig { depth: 32, completion_eventfd: false })?;
    let mut pool = BufferPool::new(32, 4096, 4096);
    queue.register_pool(&pool)?;
    let mut bufs: Vec<_> = (0..32).map(|_| pool.take().expect("sized")).collect();
    let mut out = Vec::new();
    let mut submitted = 0;
    for round in 0..20u64 {
        for (i, b) in bufs.iter_mut().enumerate() {
            let iov = [b.iovec()];
            // SAFETY: the buffers outlive the wait below.
            if unsafe { queue.submit(&IoRequest::read(round * 100 + i as u64, (i as u64) << 12, &iov)) }.is_ok() {
                submitted += 1;
            }
        }
        wait_all(&mut queue, &mut out, Duration::from_secs(60));
    }
    let timeouts = queue.counters.timeouts;
    let timed_out = out.iter().filter(|c| c.result == Err(BdevError::Io(libc::ETIMEDOUT))).count();
    let other_errors = out.iter().filter(|c| c.result.is_err()).count() - timed_out;
    drop(queue);
    drop(bufs);
    drop(fast);
    let again = open(path, NvmeOptions::default())?;
    let mut q = again.open_queue(32)?;
    let after = verify_round(q.as_mut(), SMALL_ROUND, Buffers::Heap { skew: 0 });
    let ok = out.len() == submitted && other_errors == 0 && after.is_ok() && (timeouts == 0 || timed_out > 0);
    report.line(
        "command_timeout",
        ok,
        json!({"submitted": submitted, "completed": out.len(), "timeouts_detected": timeouts,
               "failed_with_etimedout": timed_out, "other_errors": other_errors,
               "io_after_reopen": format!("{after:?}")}),
    );
    Ok(())
}
