//! The metadata write path (step S8 of docs/plans/fs-parts.md): every
//! change to an inode or the namespace that is not a data write goes
//! through these few functions, which keep the live state, the journal's
//! pending records and dirty set, and the page cache's published sizes in
//! step.
//!
//! `Change` is a view, not a part: a `Copy` bundle of references to the
//! parts it touches, made per call by [`FsInner::change`]. It owns
//! nothing, so no part stores another. Nothing here awaits, which is what
//! lets a namespace operation be atomic with respect to other tasks.

use std::cell::RefCell;

use crate::csum_table::TableCache;
use crate::data::{DataState, WriteTimes};
use crate::format::{Inode, Timespec, ROOT_INO};
use crate::ids::Ino;
use crate::journal::Journal;
use crate::meta::Meta;
use crate::pages::Pages;
use crate::record::{Record, DATA_ERRORS_MAX};
use crate::space::Space;
use crate::{AtimeUpdates, FsConfig, FsError, FsInner, FsResult};

/// The parts the metadata write path touches, lent for one call.
#[derive(Clone, Copy)]
pub(crate) struct Change<'a> {
    meta: &'a Meta,
    journal: &'a Journal,
    pages: &'a Pages,
    space: &'a Space,
    data: &'a DataState,
    csums: Option<&'a RefCell<TableCache>>,
    config: &'a FsConfig,
}

impl FsInner {
    pub(crate) fn change(&self) -> Change<'_> {
        Change {
            meta: &self.meta,
            journal: &self.journal,
            pages: &self.pages,
            space: &self.space,
            data: &self.data,
            csums: self.csums.as_ref(),
            config: &self.config,
        }
    }
}

impl Change<'_> {
    /// Apply a record to the live state and queue it for the journal.
    pub(crate) fn log(&self, record: Record) -> FsResult<()> {
        if self.config.read_only {
            return Err(FsError::ReadOnly);
        }
        match (&record, self.csums) {
            (Record::CsumSet { first_block, crcs }, Some(table)) => {
                // The writer computed these for blocks it allocated: a
                // refusal is keelfs's bug, not an image's.
                table
                    .borrow_mut()
                    .set(*first_block, crcs)
                    .map_err(|e| FsError::Corrupt(format!("live change refused: {e}")))?;
            }
            (Record::CsumSet { .. }, None) => panic!("a data checksum logged on an image that keeps none"),
            _ => self.meta.apply_live(&record, &mut self.space.free_mut())?,
        }
        let mut j = self.journal.ring.borrow_mut();
        record.encode(&mut j.pending);
        j.logged_ops += 1;
        if let Record::ExtentMap { unwritten: false, .. } = record {
            j.exposes_data = true;
        }
        drop(j);
        self.journal.bump(|c| c.records_logged += 1);
        Ok(())
    }

    /// Record that device block `block`, file block `file_block` of `ino`,
    /// failed its checksum, so that fsck finds it: once per block, up to
    /// `DATA_ERRORS_MAX` blocks. A read-only mount records nothing (the
    /// read still fails, and is logged and counted).
    pub(crate) fn record_data_error(&self, block: u64, ino: Ino, file_block: u64) -> FsResult<()> {
        let errors_len = {
            let state = self.meta.state();
            if self.config.read_only || state.data_errors().contains_key(&block) {
                return Ok(());
            }
            state.data_errors().len()
        };
        if errors_len >= DATA_ERRORS_MAX {
            return Ok(());
        }
        self.log(Record::DataError { block, ino: ino.get(), file_block })
    }

    /// Device runs `runs` were overwritten in place: forget those of their
    /// blocks recorded as bad.
    pub(crate) fn forget_data_errors(&self, runs: &[crate::format::BlockRun]) -> FsResult<()> {
        let rewritten: Vec<u64> = {
            let state = self.meta.state();
            if state.data_errors().is_empty() {
                return Ok(());
            }
            runs.iter().flat_map(|r| state.data_errors().range(r.start..r.end()).map(|(&b, _)| b)).collect()
        };
        for block in rewritten {
            self.log(Record::DataError { block, ino: 0, file_block: 0 })?;
        }
        Ok(())
    }

    /// Add a new inode. Its image reaches the journal with the other dirty
    /// inode images, at the start of the next transaction, so that records
    /// after it (its directory entry) find it at replay.
    pub(crate) fn create_inode(&self, inode: Inode) -> FsResult<()> {
        let ino = inode.ino;
        self.meta.apply_live(&Record::InodeSet(inode), &mut self.space.free_mut())?;
        self.mark_dirty(ino);
        Ok(())
    }

    pub(crate) fn mark_dirty(&self, ino: Ino) {
        let mut j = self.journal.ring.borrow_mut();
        j.dirty.insert(ino);
        j.logged_ops += 1;
    }

    /// Change an inode in memory; its image reaches the journal with the
    /// next commit (the lazy path: no I/O, no record now). i_version moves
    /// only if someone read it since its last change.
    pub(crate) fn update_inode(&self, ino: Ino, f: impl FnOnce(&mut Inode)) -> FsResult<()> {
        if self.config.read_only {
            return Err(FsError::ReadOnly);
        }
        let mut state = self.meta.state_mut();
        let node = state.node_mut(ino).ok_or(FsError::NotFound)?;
        let version = node.inode.i_version;
        f(&mut node.inode);
        node.inode.i_version = version;
        if node.i_version_queried {
            node.inode.i_version += 1;
            node.i_version_queried = false;
        }
        let size = node.inode.size;
        drop(state);
        self.pages.shared().publish_size(ino, size);
        self.mark_dirty(ino);
        Ok(())
    }

    /// Free an inode once nothing names or holds it.
    pub(crate) fn maybe_free(&self, ino: Ino) -> FsResult<()> {
        let unreferenced = match self.meta.state().node(ino) {
            Some(n) => n.inode.nlink == 0 && n.lookups.is_zero() && n.opens.is_zero(),
            None => return Ok(()),
        };
        if unreferenced && ino != ROOT_INO {
            self.pages.shared().forget(ino);
            let released = self.pages.cache_mut().discard(ino, 0);
            self.space.release_delalloc(released);
            let image = self.meta.state().node(ino).map(|n| n.inode.clone());
            {
                let mut j = self.journal.ring.borrow_mut();
                j.dirty_later.remove(&ino);
                if j.dirty.remove(&ino) {
                    j.freed_images.extend(image);
                }
            }
            self.log(Record::InodeFree { ino })?;
        }
        Ok(())
    }

    /// After data reached a file: grow its size to `end` if given, and
    /// stamp mtime and ctime, in memory only (persisted with the next
    /// commit).
    ///
    /// Stamps come from the coarse clock, and a write that would not move
    /// them (the same tick) changes nothing and dirties nothing, unless
    /// someone read the attributes or i_version since the last stamp: then
    /// the precise clock makes the change visible (multigrain timestamps).
    pub(crate) fn written(&self, ino: Ino, end: Option<u64>) -> FsResult<()> {
        self.written_with(ino, end, WriteTimes::Stamp)
    }

    /// [`Self::written`], leaving the times alone when the client keeps them.
    pub(crate) fn written_with(&self, ino: Ino, end: Option<u64>, times: WriteTimes) -> FsResult<()> {
        let mut state = self.meta.state_mut();
        let node = state.node_mut(ino).ok_or(FsError::NotFound)?;
        let grows = end.is_some_and(|e| e > node.inode.size);
        let mut stamp = None;
        if self.data.file_times() && times == WriteTimes::Stamp {
            let ctime = node.inode.ctime;
            if node.times_queried.get() || node.i_version_queried {
                stamp = Some(self.config.file_clock.now().max(ctime.next()));
            } else {
                let coarse = self.config.file_clock.now_coarse();
                if coarse > ctime || coarse > node.inode.mtime {
                    stamp = Some(coarse.max(ctime));
                }
            }
        }
        if stamp.is_none() && !grows {
            return Ok(());
        }
        node.times_queried.set(false);
        drop(state);
        self.update_inode(ino, |i| {
            if let Some(end) = end {
                i.size = i.size.max(end);
            }
            if let Some(t) = stamp {
                i.mtime = t;
                i.ctime = t;
            }
        })
    }

    /// `ino`'s data or entries were read: move its atime as the config's
    /// atime mode says. In memory only; the commit carries it. i_version
    /// stays, as on Linux.
    pub(crate) fn accessed(&self, ino: Ino) {
        if self.config.read_only || self.config.atime == AtimeUpdates::Never {
            return;
        }
        let mut state = self.meta.state_mut();
        let Some(node) = state.node_mut(ino) else { return };
        let i = &node.inode;
        if i.is_dir() && !self.config.dir_atime {
            return;
        }
        // Most reads of a file read since its last change take this
        // branch: no clock read, no update.
        let update = match self.config.atime {
            AtimeUpdates::Always => true,
            _ => {
                i.atime <= i.mtime
                    || i.atime <= i.ctime
                    || self.config.file_clock.now_coarse().sec - i.atime.sec >= 24 * 3600
            }
        };
        if update {
            // The tick's time (a cheap clock, as Linux's atime), but after
            // the last change: a fine-grained mtime may be ahead of the
            // tick, and relatime would then update on every read.
            node.inode.atime = self.config.file_clock.now_coarse().max(i.mtime.next()).max(i.ctime.next());
            drop(state);
            self.mark_dirty(ino);
        }
    }

    /// Now, to the nanosecond, by the filesystem's file clock.
    pub(crate) fn file_time(&self) -> Timespec {
        self.config.file_clock.now()
    }
}
