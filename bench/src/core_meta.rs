//! Metadata at scale (issue 18): what N files cost in memory, at mount,
//! and in the checkpoint. Two phases, each in its own process so that
//! each resident-set figure is that phase's alone:
//!
//! - `metadata-fill`: mkfs, N files (empty, or of `--file-bytes` each,
//!   written through the page cache) in directories of
//!   [`FILES_PER_DIR`] with names of about 35 bytes, a whole checkpoint
//!   and one in pieces, each beside a task that asks for attributes in a
//!   loop, and an unmount; reports the create rate, each checkpoint's
//!   time and the longest the other task waited, the checkpoint's size,
//!   and the resident memory the files added;
//! - `metadata-mount`: mount that image (read-only: nothing is written),
//!   report the mount time and resident memory.
//!
//! bench/run-metadata.sh runs both, then fsck and a mount through
//! keelfsd, at 1M and 10M files.

use keelfs_fs::FileOffset;
use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use keelfs_fs::ROOT_INO;
use keelfs_fs::{Creds, Fs};
use keelfs_reactor as reactor;
use serde_json::json;

/// Entries per directory: a tree of many mid-sized directories, as a
/// package manager or container image makes.
pub const FILES_PER_DIR: u64 = 1000;

/// A file name of 35 bytes, unique per (directory, index).
fn file_name(dir: u64, i: u64) -> Vec<u8> {
    format!("lib-{dir:06}-component-{i:05}.so.1.2").into_bytes()
}

/// Resident memory of this process in bytes (VmRSS).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    kib * 1024
}

/// `files` files under the root (empty, or of `file_bytes` each),
/// checkpointed and unmounted.
pub async fn fill(fs: &Fs, files: u64, file_bytes: u64) -> anyhow::Result<serde_json::Value> {
    let c = Creds::root();
    let data = vec![0x5a_u8; usize::try_from(file_bytes)?];
    let rss_empty = rss_bytes();
    let started = Instant::now();
    let dirs = files.div_ceil(FILES_PER_DIR);
    for d in 0..dirs {
        let dir = fs.mkdir(&c, ROOT_INO, format!("dir-{d:06}").as_bytes(), 0o755).await?.ino();
        let in_this = FILES_PER_DIR.min(files - d * FILES_PER_DIR);
        for i in 0..in_this {
            let file = fs.mknod(&c, dir, &file_name(d, i), libc::S_IFREG | 0o644, 0).await?;
            if !data.is_empty() {
                fs.data().write(file.ino(), FileOffset::new(0), &data).await?;
            }
        }
    }
    let fill_s = started.elapsed().as_secs_f64();
    let (checkpoint_s, whole_wait_s) = checkpoint_beside_requests(fs, false).await?;
    let (pieces_s, pieces_wait_s) = checkpoint_beside_requests(fs, true).await?;
    let rss_full = rss_bytes();
    let checkpoint_bytes = fs.inspect().superblock().checkpoint_bytes;
    fs.unmount().await?;
    let per_file = |bytes: u64| (bytes as f64 / files as f64).round();
    Ok(json!({
        "bench": "core",
        "workload": "metadata-fill",
        "files": files,
        "file_bytes": file_bytes,
        "directories": dirs,
        "files_created_per_s": (files as f64 / fill_s).round(),
        "checkpoint_s": (checkpoint_s * 1000.0).round() / 1000.0,
        "checkpoint_longest_wait_ms": (whole_wait_s * 1e4).round() / 10.0,
        "checkpoint_in_pieces_s": (pieces_s * 1000.0).round() / 1000.0,
        "checkpoint_in_pieces_longest_wait_ms": (pieces_wait_s * 1e4).round() / 10.0,
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_bytes_per_file": per_file(checkpoint_bytes),
        "rss_empty_mib": rss_empty >> 20,
        "rss_full_mib": rss_full >> 20,
        "rss_bytes_per_file": per_file(rss_full.saturating_sub(rss_empty)),
    }))
}

/// A checkpoint (whole, or in pieces) while another task asks for the
/// root's attributes in a loop, as a guest's requests would: seconds the
/// checkpoint took, and the longest the other task waited between two of
/// its requests.
async fn checkpoint_beside_requests(fs: &Fs, in_pieces: bool) -> anyhow::Result<(f64, f64)> {
    let stop = Rc::new(Cell::new(false));
    let longest = Rc::new(Cell::new(Duration::ZERO));
    let prober = {
        let (fs, stop, longest) = (fs.clone(), stop.clone(), longest.clone());
        async move {
            let mut last = Instant::now();
            while !stop.get() {
                let _ = fs.getattr(ROOT_INO).await;
                reactor::yield_now().await;
                let now = Instant::now();
                longest.set(longest.get().max(now - last));
                last = now;
            }
        }
    };
    reactor::spawn_local(prober);
    // Spawned tasks join at the next tick: let the prober start first.
    reactor::next_tick().await;
    reactor::next_tick().await;
    let started = Instant::now();
    if in_pieces {
        fs.admin().checkpoint_in_pieces().await?;
    } else {
        fs.admin().checkpoint().await?;
    }
    let took = started.elapsed().as_secs_f64();
    stop.set(true);
    reactor::yield_now().await;
    Ok((took, longest.get().as_secs_f64()))
}

/// What mounting the image cost: time (load and replay) and memory.
pub async fn mounted(fs: &Fs, mount_s: f64, rss_before: u64) -> anyhow::Result<serde_json::Value> {
    let rss = rss_bytes();
    let s = fs.statfs().await?;
    let inodes = s.files - s.files_free;
    Ok(json!({
        "bench": "core",
        "workload": "metadata-mount",
        "inodes": inodes,
        "mount_s": (mount_s * 1000.0).round() / 1000.0,
        "mount_s_per_million_inodes": (mount_s / inodes.max(1) as f64 * 1e6 * 1000.0).round() / 1000.0,
        "replayed_transactions": fs.inspect().replayed_at_mount(),
        "rss_mib": rss >> 20,
        "rss_bytes_per_inode": (rss.saturating_sub(rss_before) as f64 / inodes.max(1) as f64).round(),
    }))
}
