//! Maintenance a mounted filesystem takes on request, apart from client
//! operations: checkpoints, the quota (in quota.rs) and fstrim (in
//! discard.rs).

use std::rc::Rc;

use crate::journal::SnapshotInfo;
use crate::{journal, Fs, FsError, FsInner, FsResult, Timespec};

/// Maintenance of a mounted filesystem, reached through [`Fs::admin`]: a
/// `Copy` borrow made per call (issue 35). Its async methods take `self`
/// by value, so their futures hold only the borrow of the `Fs`.
#[derive(Clone, Copy)]
pub struct Admin<'a> {
    pub(crate) inner: &'a Rc<FsInner>,
}

impl Fs {
    /// Checkpoints, the quota and fstrim.
    pub fn admin(&self) -> Admin<'_> {
        Admin { inner: &self.inner }
    }
}

impl Admin<'_> {
    /// Write a checkpoint in pieces now, as a half-full journal does,
    /// letting other tasks run between the pieces (whole on images
    /// without the free-count feature, or when a whole one replaces it).
    pub async fn checkpoint_in_pieces(self) -> FsResult<()> {
        if self.inner.config.read_only {
            return Err(FsError::ReadOnly);
        }
        journal::checkpoint_in_pieces_now(self.inner).await
    }

    /// Take a snapshot of the whole filesystem named `name`, at `now`: a
    /// read-only point-in-time image that keeps every block it names
    /// (docs/FORMAT.md, "Snapshots"). Dirty pages are written back first,
    /// so every write acknowledged before the call is in it. EEXIST for a
    /// name in use, ENOSPC past `SNAPSHOTS_MAX`, EINVAL for a bad name,
    /// EOPNOTSUPP on an image too old to keep one.
    pub async fn snapshot_create(self, name: &str, now: Timespec) -> FsResult<()> {
        if self.inner.config.read_only {
            return Err(FsError::ReadOnly);
        }
        crate::DataOps { inner: self.inner }.writeback_all().await?;
        journal::create_snapshot(self.inner, name, now).await
    }

    /// Delete the snapshot `name` (ENOENT if there is none), freeing the
    /// blocks only it held.
    pub async fn snapshot_delete(self, name: &str) -> FsResult<()> {
        journal::delete_snapshot(self.inner, name).await
    }

    /// The snapshots, oldest first.
    pub fn snapshot_list(self) -> Vec<SnapshotInfo> {
        journal::list_snapshots(self.inner)
    }

    /// Write a checkpoint now (normally triggered by journal usage).
    pub async fn checkpoint(self) -> FsResult<()> {
        if self.inner.config.read_only {
            return Err(FsError::ReadOnly);
        }
        journal::checkpoint(self.inner).await
    }
}
