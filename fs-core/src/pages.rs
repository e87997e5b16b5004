//! File data in memory: the page cache, the files whose writeback is
//! running, and what readers on other cores are told of each file.
//!
//! A file is *settled* when it has no dirty page and no writeback
//! running: then every byte written through the cache is on the device
//! and mapped, which is what lets a commit log the file's full size
//! (see `journal::take_pending`). A writeback takes dirty pages, which
//! look clean from then on, and keeps its file unsettled
//! ([`Pages::writing_back`]) until the pages are written and mapped.

use std::cell::{Ref, RefCell, RefMut};
use std::collections::BTreeSet;

use crate::cache::PageCache;
use crate::ids::Ino;
use crate::shared::SharedFiles;

pub(crate) struct Pages {
    cache: RefCell<PageCache>,
    /// Files whose writeback is running: pages it took are clean in the
    /// cache but neither on the device nor mapped until it ends.
    writing_back: RefCell<BTreeSet<Ino>>,
    shared: SharedFiles,
}

impl Pages {
    pub fn new(cache: PageCache) -> Self {
        Self { cache: RefCell::new(cache), writing_back: RefCell::default(), shared: SharedFiles::default() }
    }

    pub fn cache(&self) -> Ref<'_, PageCache> {
        self.cache.borrow()
    }

    pub fn cache_mut(&self) -> RefMut<'_, PageCache> {
        self.cache.borrow_mut()
    }

    /// The files with readers on other cores.
    pub fn shared(&self) -> &SharedFiles {
        &self.shared
    }

    /// `ino` has no dirty page and no writeback running.
    pub fn settled(&self, ino: Ino) -> bool {
        self.cache.borrow().dirty_of(ino, 0, u64::MAX).is_empty() && !self.writing_back.borrow().contains(&ino)
    }

    /// Whether any file's writeback is running.
    pub fn writeback_running(&self) -> bool {
        !self.writing_back.borrow().is_empty()
    }

    /// Every file that is not settled, in order, each once.
    pub fn unsettled_files(&self) -> Vec<Ino> {
        let mut files = self.cache.borrow().dirty_inodes();
        files.extend(self.writing_back.borrow().iter().copied());
        files.sort_unstable();
        files.dedup();
        files
    }

    /// Mark `ino` as being written back until the guard drops.
    ///
    /// A writeback holds its file's writeback token (an exclusive range
    /// lock), so two of one file never overlap; debug builds assert it.
    pub fn writing_back(&self, ino: Ino) -> WritingBack<'_> {
        let fresh = self.writing_back.borrow_mut().insert(ino);
        debug_assert!(fresh, "two writebacks of inode {ino} at once");
        WritingBack { pages: self, ino }
    }
}

/// A writeback of one file in progress ([`Pages::writing_back`]).
pub(crate) struct WritingBack<'a> {
    pages: &'a Pages,
    ino: Ino,
}

impl Drop for WritingBack<'_> {
    fn drop(&mut self) {
        let removed = self.pages.writing_back.borrow_mut().remove(&self.ino);
        debug_assert!(removed, "a writeback's mark went before it ended");
    }
}
