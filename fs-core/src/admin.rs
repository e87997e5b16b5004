//! Maintenance a mounted filesystem takes on request, apart from client
//! operations: checkpoints, the quota (in quota.rs) and fstrim (in
//! discard.rs).

use std::rc::Rc;

use crate::{journal, Fs, FsError, FsInner, FsResult};

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

    /// Write a checkpoint now (normally triggered by journal usage).
    pub async fn checkpoint(self) -> FsResult<()> {
        if self.inner.config.read_only {
            return Err(FsError::ReadOnly);
        }
        journal::checkpoint(self.inner).await
    }
}
