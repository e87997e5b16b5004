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
use super::{Fs, FsError, FsInner, FsResult};

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
    fn blocks(&self) -> Option<u64> {
        self.bytes.map(|b| b / BLOCK_BYTES as u64)
    }
}

impl FsInner {
    /// Blocks the quota sees in use: everything the allocator has handed
    /// out (frees not yet committed included, which is why EDQUOT first
    /// commits and retries), plus space promised to dirty pages, less
    /// blocks out of the allocator only to be discarded (free on disk).
    pub(crate) fn quota_used_blocks(&self) -> u64 {
        let state = self.state.borrow();
        let allocated = state.alloc.total_blocks() - state.alloc.free_blocks();
        let promised = self.journal.borrow().delalloc_reserved;
        (allocated + promised).saturating_sub(self.discarding_blocks())
    }

    /// Blocks the quota still allows, if there is one.
    fn quota_room_blocks(&self) -> Option<u64> {
        let limit = self.quota.get().blocks()?;
        Some(limit.saturating_sub(self.quota_used_blocks()))
    }

    /// Room for `blocks` more blocks of data: ENOSPC when the device is
    /// what binds, EDQUOT when the quota is.
    pub(crate) fn check_room(&self, blocks: u64) -> FsResult<()> {
        let device = self.device_available_blocks();
        match self.quota_room_blocks() {
            Some(room) if room < blocks && room <= device => Err(FsError::Quota),
            _ if device < blocks => Err(FsError::NoSpace),
            _ => Ok(()),
        }
    }

    /// The inode limit df shows: the device's, capped by the quota.
    pub(crate) fn inodes_limit(&self) -> u64 {
        let device = self.inodes_max();
        self.quota.get().inodes.map_or(device, |q| q.min(device))
    }

    /// Room for one more inode: ENOSPC past the device's limit, EDQUOT
    /// past the quota.
    pub(crate) fn check_inode_room(&self) -> FsResult<()> {
        let count = self.state.borrow().inode_count() as u64;
        let quota = self.quota.get().inodes.unwrap_or(u64::MAX);
        if count >= quota && quota <= self.inodes_max() {
            Err(FsError::Quota)
        } else if count >= self.inodes_max() {
            Err(FsError::NoSpace)
        } else {
            Ok(())
        }
    }

    /// The filesystem's size as df shows it: the data area, or the quota
    /// if smaller.
    pub(crate) fn blocks_limit(&self) -> u64 {
        let total = self.state.borrow().alloc.total_blocks();
        self.quota.get().blocks().map_or(total, |q| q.min(total))
    }

    /// Blocks free as df shows them: those awaiting a discard are free
    /// (a writer that needs them takes them back, [`super::discard::reclaim`]).
    pub(crate) fn shown_free_blocks(&self) -> u64 {
        let device = self.device_available_blocks() + self.discarding_blocks();
        self.quota_room_blocks().map_or(device, |room| room.min(device))
    }

    /// Blocks free for new data: the device's, capped by the quota's room.
    pub(crate) fn available_blocks(&self) -> u64 {
        let device = self.device_available_blocks();
        self.quota_room_blocks().map_or(device, |room| room.min(device))
    }
}

impl Fs {
    /// Change the quota, effective for the next allocation. Lowering it
    /// below what is in use refuses new blocks and inodes (EDQUOT) and
    /// nothing else: removing, truncating and overwriting go on.
    pub fn set_quota(&self, quota: Quota) -> Result<(), FsError> {
        if self.inner.unmounted.get() {
            return Err(FsError::Invalid("the filesystem is unmounted"));
        }
        self.inner.quota.set(quota);
        tracing::info!(parent: &self.inner.span, bytes = ?quota.bytes, inodes = ?quota.inodes, "quota set");
        Ok(())
    }

    pub fn quota(&self) -> Quota {
        self.inner.quota.get()
    }
}
