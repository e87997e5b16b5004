//! What a client session holds of the filesystem, read out and taken back
//! by number: how a session moves to another process (live migration, or
//! a daemon restart) without the client noticing.
//!
//! A client names files by inode number and open handles by handle
//! number. Inode numbers are never reused (`next_ino` only grows and is
//! persisted), so a number that a client kept across a move names the
//! same file or none: a freed inode is refused, never confused with a
//! newer one. FUSE's entry generation can therefore stay 0.
//!
//! Inodes unlinked while open (orphans) would be freed by a mount; a mount
//! that is to take a session back keeps them ([`crate::FsConfig::keep_orphans`])
//! until [`Handover::free_unheld_orphans`] runs after the session's holdings are
//! restored.

use crate::handles::{Handle, HandleTaken};
use crate::ids::{Fh, Ino};
use std::rc::Rc;

use crate::{Fs, FsError, FsInner, FsResult};

/// One open handle as a session sees it, to be restored by number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandleState {
    pub ino: Ino,
    /// The open(2) flags it was opened with.
    pub flags: u32,
    /// For a directory handle, readdir's end cookie (see `readdir_handle`).
    pub dir_end: u64,
}

/// Taking a session's holdings out and back in, reached through
/// [`Fs::handover`]: a `Copy` borrow made per call (issue 35).
#[derive(Clone, Copy)]
pub struct Handover<'a> {
    inner: &'a Rc<FsInner>,
}

impl Fs {
    /// What a moving session reads out and restores.
    pub fn handover(&self) -> Handover<'_> {
        Handover { inner: &self.inner }
    }
}

impl Handover<'_> {
    /// The filesystem's identity, made by mkfs: a session names inodes by
    /// number, which only mean something on the filesystem it came from.
    pub fn uuid(self) -> [u8; 16] {
        self.inner.journal.sb.borrow().uuid
    }

    /// The state of open handle `fh`.
    pub fn handle_state(self, fh: Fh) -> FsResult<HandleState> {
        let h = self.inner.handles.get(fh).ok_or(FsError::BadHandle)?;
        Ok(HandleState { ino: h.ino, flags: h.flags, dir_end: h.dir_end })
    }

    /// Whether `state` could be restored as a handle: its inode exists,
    /// and is a directory exactly when the flags say O_DIRECTORY. Checked
    /// for a whole session before any of it is taken.
    pub fn check_handle(self, state: &HandleState) -> FsResult<()> {
        let inode = self.inner.meta.inode(state.ino)?;
        let wants_dir = state.flags & libc::O_DIRECTORY as u32 != 0;
        match (wants_dir, inode.is_dir()) {
            (true, false) => Err(FsError::NotDir),
            (false, true) if state.flags as i32 & libc::O_ACCMODE != libc::O_RDONLY => Err(FsError::IsDir),
            _ => Ok(()),
        }
    }

    /// Open handle `fh` again, as it was. Fails if the inode is gone or
    /// `fh` is open already; later handles get numbers past it.
    pub fn restore_handle(self, fh: Fh, state: HandleState) -> FsResult<()> {
        self.check_handle(&state)?;
        let ino = state.ino;
        let handle = Handle { ino, flags: state.flags, dir_end: state.dir_end };
        self.inner.handles.restore(fh, handle).map_err(|HandleTaken| FsError::BadHandle)?;
        self.inner.meta.add_open(ino);
        Ok(())
    }

    /// Whether inode `ino` exists (linked, or an orphan still held).
    pub fn exists(self, ino: Ino) -> bool {
        self.inner.meta.exists(ino)
    }

    /// Take `n` lookup references on `ino` again, as a client that looked
    /// it up `n` times holds them.
    pub fn hold_lookups(self, ino: Ino, n: u64) -> FsResult<()> {
        self.inner.meta.hold_lookups(ino, n)
    }

    /// Free the orphans a mount kept ([`crate::FsConfig::keep_orphans`])
    /// that no restored session holds; how many were freed.
    pub fn free_unheld_orphans(self) -> FsResult<u64> {
        if self.inner.config.read_only {
            return Ok(0);
        }
        let orphans: Vec<Ino> = {
            let state = self.inner.meta.state();
            state
                .nodes()
                .filter(|n| n.inode.nlink == 0 && n.lookups.is_zero() && n.opens.is_zero())
                .map(|n| n.inode.ino)
                .collect()
        };
        for &ino in &orphans {
            self.inner.change().maybe_free(ino)?;
        }
        if !orphans.is_empty() {
            tracing::info!(parent: &self.inner.span, orphans = orphans.len(), "freed inodes unlinked while open");
        }
        Ok(orphans.len() as u64)
    }
}
