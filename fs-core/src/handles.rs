//! Open file and directory handles: what `open`, `create` and `opendir`
//! return, and every later request names.
//!
//! The table's invariants: handle 0 is never given out (FUSE clients use
//! it for "no handle"), and the next number given out is above every
//! handle open now, including ones restored with numbers a previous
//! process chose (see `adopt`). So a number is never open twice.

use std::cell::{Cell, RefCell};

use keelfs_base::IdMapBy;

use crate::ids::{Fh, Ino};

/// What a handle holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Handle {
    pub ino: Ino,
    pub flags: u32,
    /// For a directory handle: readdir lists only entries made before this
    /// cookie (the directory's cookie end at opendir or the last rewind).
    pub dir_end: u64,
}

/// The handles open on one filesystem.
pub(crate) struct HandleTable {
    open: RefCell<IdMapBy<Fh, Handle>>,
    next: Cell<u64>,
}

/// A handle number that cannot be restored: 0, the largest, or one
/// already open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HandleTaken;

impl Default for HandleTable {
    fn default() -> Self {
        Self { open: RefCell::default(), next: Cell::new(1) }
    }
}

impl HandleTable {
    /// How many open handles name each inode.
    pub fn opens_by_inode(&self) -> IdMapBy<Ino, u64> {
        let mut opens = IdMapBy::default();
        for handle in self.open.borrow().values() {
            *opens.entry(handle.ino).or_default() += 1;
        }
        opens
    }

    /// Open a new handle.
    ///
    /// # Panics
    /// After 2^64 - 1 opens: the counter never wraps onto a live handle.
    pub fn open(&self, handle: Handle) -> Fh {
        let number = self.next.get();
        self.next.set(number.checked_add(1).expect("handle numbers exhausted"));
        let fh = Fh::new(number);
        let previous = self.open.borrow_mut().insert(fh, handle);
        assert!(previous.is_none(), "handle {number} given out while open");
        fh
    }

    /// Open `fh` again with the number it had, and give out later
    /// handles past it. The largest number is refused too: no later
    /// handle could be given out past it.
    pub fn restore(&self, fh: Fh, handle: Handle) -> Result<(), HandleTaken> {
        let mut open = self.open.borrow_mut();
        let Some(next) = fh.get().checked_add(1).filter(|_| fh.get() != 0) else {
            return Err(HandleTaken);
        };
        if open.contains_key(&fh) {
            return Err(HandleTaken);
        }
        open.insert(fh, handle);
        self.next.set(self.next.get().max(next));
        Ok(())
    }

    pub fn get(&self, fh: Fh) -> Option<Handle> {
        self.open.borrow().get(&fh).copied()
    }

    /// Close `fh`, returning what it held.
    pub fn close(&self, fh: Fh) -> Option<Handle> {
        self.open.borrow_mut().remove(&fh)
    }

    /// A directory handle's listing now ends at `dir_end` (a rewind).
    pub fn set_dir_end(&self, fh: Fh, dir_end: u64) {
        if let Some(h) = self.open.borrow_mut().get_mut(&fh) {
            h.dir_end = dir_end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(ino: u64) -> Handle {
        Handle { ino: Ino::new(ino), flags: 0, dir_end: 0 }
    }

    #[test]
    fn numbers_start_at_one_and_are_never_open_twice() {
        let table = HandleTable::default();
        let a = table.open(handle(5));
        assert_eq!(a, Fh::new(1), "0 is no handle");
        assert_eq!(table.restore(Fh::new(0), handle(6)), Err(HandleTaken));
        assert_eq!(table.restore(Fh::new(u64::MAX), handle(6)), Err(HandleTaken), "nothing could follow it");
        assert_eq!(table.restore(a, handle(6)), Err(HandleTaken), "an open number is not restored over");
        table.restore(Fh::new(40), handle(7)).expect("a free number");
        assert_eq!(table.open(handle(8)), Fh::new(41), "new handles go past restored ones");
        table.restore(Fh::new(3), handle(9)).expect("a free number below the next");
        assert_eq!(table.open(handle(8)), Fh::new(42), "a restore below the next leaves it");
        assert_eq!(table.close(a), Some(handle(5)));
        assert_eq!((table.get(a), table.close(a)), (None, None));
        table.set_dir_end(Fh::new(40), 77);
        assert_eq!(table.get(Fh::new(40)).map(|h| h.dir_end), Some(77));
    }
}
