//! The dirty log of guest memory that live migration reads (vhost-user
//! LOG_SHMFD): one bit per 4 KiB guest page, in a memfd QEMU shares with
//! SET_LOG_BASE.
//!
//! vhost-user-backend's own `BitmapMmapRegion` clones an `Arc` for every
//! slice vm-memory makes and takes a `RwLock` for every write it marks,
//! logging or not: a buffered 8 KiB read costs several of each. Here a
//! slice borrows its region's log (`RefSlice`), and marking reads one
//! flag until QEMU turns logging on; only then does it take the lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vhost_user_backend::bitmap::{AtomicBitmapMmap, BitmapMmapRegion, BitmapReplace};
use vm_memory::bitmap::{Bitmap, NewBitmap, RefSlice, WithBitmapSlice};

/// The log of one guest memory region: vhost-user-backend's, behind a
/// flag that says whether QEMU gave it one.
#[derive(Clone, Debug, Default)]
pub struct DirtyLog {
    /// Set once SET_LOG_BASE gave this region a log.
    on: Arc<AtomicBool>,
    log: BitmapMmapRegion,
}

impl<'a> WithBitmapSlice<'a> for DirtyLog {
    type S = RefSlice<'a, Self>;
}

impl Bitmap for DirtyLog {
    fn mark_dirty(&self, offset: usize, len: usize) {
        // Acquire pairs with `replace`: a write that sees logging off
        // finished before SET_LOG_BASE was answered, so QEMU's first pass
        // over guest memory, which comes after, copies it anyway.
        if self.on.load(Ordering::Acquire) {
            self.log.mark_dirty(offset, len);
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.on.load(Ordering::Acquire) && self.log.dirty_at(offset)
    }

    fn slice_at(&self, offset: usize) -> RefSlice<'_, Self> {
        RefSlice::new(self, offset)
    }
}

impl NewBitmap for DirtyLog {
    fn with_len(_len: usize) -> Self {
        Self::default()
    }
}

impl BitmapReplace for DirtyLog {
    type InnerBitmap = AtomicBitmapMmap;

    fn replace(&self, bitmap: AtomicBitmapMmap) {
        self.log.replace(bitmap);
        self.on.store(true, Ordering::Release);
    }
}
