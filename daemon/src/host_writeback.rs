//! The host kernel's dirty-page limits for a writeback-cached host mount.
//!
//! Linux gives every FUSE mount a strict limit of 1% of the dirty-page
//! allowance (`/sys/class/bdi/MAJOR:MINOR/max_ratio` 1, `strict_limit` 1),
//! because an unprivileged FUSE server may never write back. With that
//! limit a writeback cache barely caches: writers stall on writeback
//! after a few MiB (buffered random writes through a writeback-cached
//! mount ran at 0.06x ext4; bench/RESULTS.md has the figures with the
//! limit lifted). keelfsd
//! runs as root and answers writeback like a disk, so wherever the host
//! mount has the writeback cache (cache `always`, or `auto` on an export
//! no guest shares) it lifts the strict limit and grants the mount
//! `host_dirty_ratio` percent of the allowance.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Lift FUSE's strict limit on the mount at `mountpoint` and let it hold
/// `ratio` percent of the dirty-page allowance. Returns the bdi changed.
pub fn lift_dirty_limit(mountpoint: &Path, fstype: &str, ratio: u8) -> anyhow::Result<PathBuf> {
    assert!((1..=100).contains(&ratio), "a ratio of {ratio}%");
    let mount = crate::mountinfo::topmost(mountpoint, fstype)
        .with_context(|| format!("no {fstype} mount at {} in mountinfo", mountpoint.display()))?;
    let bdi = Path::new("/sys/class/bdi").join(&mount.dev);
    // max_ratio before strict_limit: the mount is never unlimited.
    for (knob, value) in [("max_ratio", ratio.to_string()), ("strict_limit", "0".to_string())] {
        std::fs::write(bdi.join(knob), &value)
            .with_context(|| format!("writing {value} to {}", bdi.join(knob).display()))?;
    }
    Ok(bdi)
}
