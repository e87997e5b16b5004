//! Reactor-local synchronisation: an async mutex and per-file range locks.
//! Both are single-threaded (Rc/RefCell): they order tasks on one reactor
//! and never block a thread.

use crate::ids::Ino;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// A FIFO async mutex.
#[derive(Default)]
pub struct AsyncMutex {
    state: RefCell<MutexState>,
}

#[derive(Default)]
struct MutexState {
    locked: bool,
    next_ticket: u64,
    serving: u64,
    waiters: VecDeque<Waker>,
}

pub struct MutexGuard<'a> {
    mutex: &'a AsyncMutex,
}

impl AsyncMutex {
    /// Whether a task holds the mutex now (for the invariant checks: some
    /// hold only while no commit runs).
    pub fn is_locked(&self) -> bool {
        self.state.borrow().locked
    }

    pub async fn lock(&self) -> MutexGuard<'_> {
        let ticket = {
            let mut s = self.state.borrow_mut();
            let t = s.next_ticket;
            s.next_ticket += 1;
            t
        };
        std::future::poll_fn(|cx| {
            let mut s = self.state.borrow_mut();
            if !s.locked && s.serving == ticket {
                s.locked = true;
                Poll::Ready(())
            } else {
                s.waiters.push_back(cx.waker().clone());
                Poll::Pending
            }
        })
        .await;
        MutexGuard { mutex: self }
    }
}

impl Drop for MutexGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.mutex.state.borrow_mut();
        s.locked = false;
        s.serving += 1;
        for w in s.waiters.drain(..) {
            w.wake();
        }
    }
}

/// A byte-range lock table: shared and exclusive holds on [start, end) of
/// a file. Holds on disjoint ranges never wait for each other, which is
/// what keeps random reads from queueing behind writes elsewhere in the file.
#[derive(Default)]
pub struct RangeLocks {
    files: RefCell<keelfs_base::IdMapBy<Ino, FileLocks>>,
    next_id: std::cell::Cell<u64>,
    /// Acquisitions that had to wait, shared and exclusive.
    shared_waits: std::cell::Cell<u64>,
    exclusive_waits: std::cell::Cell<u64>,
}

/// Inline up to a few holders and waiters: an uncontended lock allocates
/// nothing, even when its file's entry was just made.
#[derive(Default)]
struct FileLocks {
    held: smallvec::SmallVec<[Held; 4]>,
    waiters: smallvec::SmallVec<[Waker; 2]>,
}

#[derive(Clone, Copy)]
struct Held {
    id: u64,
    start: u64,
    end: u64,
    exclusive: bool,
}

impl Held {
    fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        self.start < end && start < self.end && (self.exclusive || exclusive)
    }
}

pub struct RangeGuard {
    locks: Rc<RangeLocks>,
    ino: Ino,
    id: u64,
}

impl RangeLocks {
    pub fn lock(self: &Rc<Self>, ino: Ino, start: u64, end: u64, exclusive: bool) -> impl Future<Output = RangeGuard> {
        assert!(start < end, "empty lock range");
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        RangeLockFuture { locks: Rc::clone(self), ino, held: Held { id, start, end, exclusive }, counted: false }
    }

    /// (shared, exclusive) acquisitions that had to wait so far.
    /// No range of any file is held or awaited.
    pub fn is_idle(&self) -> bool {
        self.files.borrow().is_empty()
    }

    pub fn waits(&self) -> (u64, u64) {
        (self.shared_waits.get(), self.exclusive_waits.get())
    }
}

struct RangeLockFuture {
    locks: Rc<RangeLocks>,
    ino: Ino,
    held: Held,
    counted: bool,
}

impl Future for RangeLockFuture {
    type Output = RangeGuard;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<RangeGuard> {
        let locks = Rc::clone(&self.locks);
        let mut files = locks.files.borrow_mut();
        let file = files.entry(self.ino).or_default();
        let h = self.held;
        if file.held.iter().any(|o| o.conflicts(h.start, h.end, h.exclusive)) {
            file.waiters.push(cx.waker().clone());
            if !self.counted {
                self.counted = true;
                let c = if h.exclusive { &locks.exclusive_waits } else { &locks.shared_waits };
                c.set(c.get() + 1);
            }
            return Poll::Pending;
        }
        file.held.push(h);
        drop(files);
        Poll::Ready(RangeGuard { locks: Rc::clone(&self.locks), ino: self.ino, id: h.id })
    }
}

impl Drop for RangeGuard {
    fn drop(&mut self) {
        let mut files = self.locks.files.borrow_mut();
        let Some(file) = files.get_mut(&self.ino) else { return };
        file.held.retain(|h| h.id != self.id);
        for w in file.waiters.drain(..) {
            w.wake();
        }
        if file.held.is_empty() && file.waiters.is_empty() {
            files.remove(&self.ino);
        }
    }
}
