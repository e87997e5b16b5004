//! Per-filesystem quotas: a cap on the bytes and inodes an export may use,
//! below what its device holds. Each export is one filesystem, so a quota
//! is plain configuration, not on disk: the used counts come from the
//! allocator and the inode table, which every mount rebuilds.
//!
//! A quota binds like a smaller device, but answers EDQUOT rather than
//! ENOSPC, so a guest can tell its share from the disk running out. It
//! never stands in the way of giving space back: unlink, truncate, punch
//! and overwrites of allocated blocks need no room, and commits and
//! checkpoints (metadata) are not charged against it.

use super::format::BLOCK_BYTES;
use super::{Admin, FsError};

/// Limits on one filesystem; None is no limit beyond the device's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    /// Bytes of blocks (data, and the checkpoint that describes it) the
    /// filesystem may hold, rounded down to whole 4 KiB blocks.
    pub bytes: Option<u64>,
    /// Inodes the filesystem may hold, the root included.
    pub inodes: Option<u64>,
}

impl Quota {
    pub(crate) fn blocks(&self) -> Option<u64> {
        self.bytes.map(|b| b / BLOCK_BYTES as u64)
    }
}

impl Admin<'_> {
    /// Change the quota, effective for the next allocation. Lowering it
    /// below what is in use refuses new blocks and inodes (EDQUOT) and
    /// nothing else: removing, truncating and overwriting go on.
    pub fn set_quota(self, quota: Quota) -> Result<(), FsError> {
        if self.inner.unmounted.get() {
            return Err(FsError::Invalid("the filesystem is unmounted"));
        }
        self.inner.space.set_quota(quota);
        tracing::info!(parent: &self.inner.span, bytes = ?quota.bytes, inodes = ?quota.inodes, "quota set");
        Ok(())
    }

    pub fn quota(self) -> Quota {
        self.inner.space.quota()
    }
}
