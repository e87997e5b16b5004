//! mkfs and fsck: tools that run one reactor on the calling thread.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use keelfs_bdev::{BlockDevice, QueueConfig};
use keelfs_fs::FsckReport;
use keelfs_fs::MkfsOptions;
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{PollMode, Reactor, ReactorConfig};
use serde_json::json;

use crate::device;
use crate::lock::ImageLock;

/// A mistake in how the command was called (exit code 2).
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

pub const DEFAULT_IMAGE_BYTES: u64 = 8 << 30;

fn run_on_reactor<T: 'static>(
    dev: Arc<dyn BlockDevice>,
    job: impl AsyncFnOnce(DeviceChannel) -> T + 'static,
) -> anyhow::Result<T> {
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() })?;
    let queue = dev.open_queue(QueueConfig { depth: 64, completion_eventfd: false })?;
    Ok(reactor.block_on(async move {
        let channel = DeviceChannel::attach(queue);
        job(channel).await
    }))
}

/// Create a sparse file of `size` if `path` does not exist, or grow a file
/// that is smaller than `size`.
fn prepare_file(path: &Path, size: Option<u64>) -> anyhow::Result<()> {
    if device::is_rbd(path) {
        return prepare_rbd_image(path, size);
    }
    if keelfs_bdev::NvmeAddress::is_nvme_name(&path.to_string_lossy()) {
        if size.is_some() {
            return Err(UsageError("--size applies only to regular files, not to an NVMe namespace".into()).into());
        }
        return Ok(());
    }
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let size = size.unwrap_or(DEFAULT_IMAGE_BYTES);
            let f = std::fs::File::create(path)
                .map_err(|e| UsageError(format!("cannot create {}: {e}", path.display())))?;
            f.set_len(size).with_context(|| format!("sizing {}", path.display()))?;
            eprintln!("keelfsd mkfs: created sparse file {} of {size} bytes", path.display());
        }
        Err(e) => return Err(UsageError(format!("cannot open {}: {e}", path.display())).into()),
        Ok(m) if m.is_file() => {
            if let Some(size) = size.filter(|&s| s > m.len()) {
                let f = std::fs::OpenOptions::new().write(true).open(path)?;
                f.set_len(size)?;
                eprintln!("keelfsd mkfs: grew {} to {size} bytes", path.display());
            }
        }
        Ok(_) if size.is_some() => {
            return Err(UsageError("--size applies only to regular files".into()).into());
        }
        Ok(_) => {}
    }
    Ok(())
}

/// An RBD image's counterpart of [`prepare_file`]: create the image if it
/// does not exist (`--size` is then required: an image in a shared cluster
/// has no sensible default), or grow it to `--size`.
fn prepare_rbd_image(path: &Path, size: Option<u64>) -> anyhow::Result<()> {
    let address = device::rbd_address(path)?;
    let Some(size) = size else { return Ok(()) };
    if size % 4096 != 0 {
        return Err(UsageError("--size of an RBD image is a multiple of 4096 bytes".into()).into());
    }
    match keelfs_bdev::RbdDevice::create_or_grow(&address, size).map_err(device::rbd_error)? {
        (true, size) => eprintln!("keelfsd mkfs: {address} is {size} bytes (created or grown)"),
        (false, size) => eprintln!("keelfsd mkfs: {address} exists with {size} bytes"),
    }
    Ok(())
}

/// `keelfsd mkfs`'s flags beyond the path and size.
pub struct MkfsFlags {
    pub force: bool,
    pub journal: Option<u64>,
    pub groups: u32,
    pub data_checksums: bool,
}

pub fn mkfs(path: &Path, size: Option<u64>, flags: MkfsFlags) -> anyhow::Result<ExitCode> {
    prepare_file(path, size)?;
    let _lock = ImageLock::exclusive(path, "format")?;
    let dev = device::open(path)?;
    let options = MkfsOptions {
        journal_blocks: flags.journal.map_or(0, |j| j / 4096),
        allocation_groups: flags.groups,
        force: flags.force,
        data_checksums: flags.data_checksums,
        ..MkfsOptions::default()
    };
    eprintln!("keelfsd mkfs: formatting {} ({} bytes)", path.display(), dev.geometry().capacity_bytes);
    let sb = run_on_reactor(dev, async move |ch| keelfs_fs::mkfs(ch, &options).await)??;
    let uuid: String = sb.uuid.iter().map(|b| format!("{b:02x}")).collect();
    let checksums = if sb.has_data_checksums() { ", data checksums" } else { "" };
    println!(
        "keelfs created on {}: {} blocks of 4096 bytes, journal {} blocks, {} allocation group(s){checksums}, uuid \
         {uuid}",
        path.display(),
        sb.total_blocks,
        sb.journal_blocks,
        sb.allocation_groups
    );
    Ok(ExitCode::SUCCESS)
}

pub fn fsck(path: &Path, as_json: bool, repair: bool, data: bool) -> anyhow::Result<ExitCode> {
    // Repair writes: it needs the image to itself. A check only reads, so
    // it may look at a live image, and says so.
    let _lock = if repair { ImageLock::exclusive(path, "repair")? } else { None };
    let live = !repair && is_served(path)?;
    if live {
        eprintln!(
            "keelfsd fsck: {} is in use (being served): checking it live, read-only; damage reported now may be \
             work in flight",
            path.display()
        );
    }
    let dev = match device::is_rbd(path) {
        // Checking only reads: no lock, so a served image can be checked.
        true => Arc::new(device::open_rbd(path, keelfs_bdev::RbdOptions { read_only: !repair, defer_lock: false })?),
        false => device::open(path)?,
    };
    let progress = |stage: &str| eprintln!("keelfsd fsck: checking {stage}");
    let report = run_on_reactor(dev, async move |ch| {
        if repair {
            keelfs_fs::repair(ch, progress).await
        } else {
            keelfs_fs::fsck_with(ch, keelfs_fs::FsckOptions { data }, progress).await
        }
    })??;
    if as_json {
        let mut line = report_json(&report);
        line["live"] = json!(live);
        println!("{line}");
    } else {
        print_report(path, &report);
    }
    Ok(if report.is_clean() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Whether another process serves the image (holds its lock).
fn is_served(path: &Path) -> anyhow::Result<bool> {
    if !device::is_rbd(path) {
        return Ok(ImageLock::is_held(path));
    }
    let rbd = device::open_rbd(path, keelfs_bdev::RbdOptions { read_only: true, defer_lock: false })?;
    Ok(rbd.holders().map_err(device::rbd_error)? != "nobody")
}

/// `keelfsd break-lock rbd:...`: fence a dead keelfsd's client and break
/// its lock on the image, so another can serve it. librbd blocklists the
/// holder before it breaks the lock, so a holder that was only cut off
/// can write no more. A holder that still watches the image may be alive:
/// refused unless `fence_live`.
pub fn break_lock(path: &Path, fence_live: bool) -> anyhow::Result<ExitCode> {
    if !device::is_rbd(path) {
        return Err(UsageError(format!(
            "{}: only RBD images have a lock to break; a file's lock ends with its process",
            path.display()
        ))
        .into());
    }
    let rbd = device::open_rbd(path, keelfs_bdev::RbdOptions { read_only: false, defer_lock: true })?;
    let broken = rbd.break_lock(fence_live).map_err(device::rbd_error)?;
    if broken.is_empty() {
        println!("{}: nobody holds the lock", path.display());
    } else {
        println!("{}: blocklisted and broke the lock of {}", path.display(), broken.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}

fn report_json(r: &FsckReport) -> serde_json::Value {
    json!({
        "clean": r.is_clean(),
        "problems": r.problems.iter().map(|p| json!({"kind": p.kind, "detail": p.detail, "repairable": p.repairable})).collect::<Vec<_>>(),
        "repaired": r.repaired,
        "inodes": r.inodes,
        "directories": r.directories,
        "data_blocks_used": r.data_blocks_used,
        "free_blocks": r.free_blocks,
        "journal_transactions_replayed": r.journal_transactions_replayed,
        "orphans": r.orphans,
        "data_blocks_checked": r.data_blocks_checked,
        "data_blocks_unverifiable": r.data_blocks_unverifiable,
        "data_errors_recorded": r.data_errors_recorded,
        "data_regions_open": r.data_regions_open,
    })
}

fn print_report(path: &Path, r: &FsckReport) {
    for fix in &r.repaired {
        println!("repaired: {fix}");
    }
    for p in &r.problems {
        let how = if p.repairable { " (--repair fixes this)" } else { "" };
        println!("damage [{}]: {}{how}", p.kind, p.detail);
    }
    println!(
        "{}: {} — {} inodes, {} directories, {} data blocks used, {} free, {} journal transactions replayed, {} orphans",
        path.display(),
        if r.is_clean() { "clean" } else { "DAMAGED" },
        r.inodes,
        r.directories,
        r.data_blocks_used,
        r.free_blocks,
        r.journal_transactions_replayed,
        r.orphans
    );
}

/// `keelfsd stats --table`: the stats object as tables for people.
pub fn stats_table(stats: &serde_json::Value) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let empty = Vec::new();
    let _ = writeln!(out, "{:<8} {:>7} {:>12} {:>10} {:>12}", "REACTOR", "BUSY%", "TICKS", "SLEEPS", "REQUESTS");
    for r in stats["reactors"].as_array().unwrap_or(&empty) {
        let _ = writeln!(
            out,
            "{:<8} {:>7.1} {:>12} {:>10} {:>12}",
            r["id"],
            r["busy_share"].as_f64().unwrap_or(0.0) * 100.0,
            r["ticks"],
            r["sleeps"],
            r["virtio_fs_requests"]
        );
    }
    let _ = writeln!(
        out,
        "\n{:<16} {:>3} {:>12} {:>8} {:>12} {:>9} {:>7} {:>10} {:>10}",
        "EXPORT", "R", "REQUESTS", "ERRORS", "BYTES", "P99MAX_US", "HIT%", "FREE_MIB", "SIZE_MIB"
    );
    for e in stats["exports"].as_array().unwrap_or(&empty) {
        let ops: Vec<&serde_json::Value> =
            ["ops", "fuse_mount_ops"].iter().filter_map(|k| e[*k].as_object()).flat_map(|m| m.values()).collect();
        let sum = |field: &str| ops.iter().filter_map(|o| o[field].as_u64()).sum::<u64>();
        let p99 = ops.iter().filter_map(|o| o["p99_us"].as_f64()).fold(0.0, f64::max);
        let (hits, misses) = (e["cache"]["hits"].as_u64().unwrap_or(0), e["cache"]["misses"].as_u64().unwrap_or(0));
        let hit = if hits + misses == 0 { 0.0 } else { hits as f64 * 100.0 / (hits + misses) as f64 };
        let mib = |field: &str| e["space"][field].as_u64().map_or("-".to_string(), |b| (b >> 20).to_string());
        let _ = writeln!(
            out,
            "{:<16} {:>3} {:>12} {:>8} {:>12} {:>9.0} {:>7.1} {:>10} {:>10}",
            e["tag"].as_str().unwrap_or_default(),
            e["reactor"],
            sum("requests"),
            sum("errors"),
            sum("bytes"),
            p99,
            hit,
            mib("free_bytes"),
            mib("size_bytes"),
        );
    }
    out
}
