//! File locks that every client of an export agrees on (issue 36): POSIX
//! record locks (F_SETLK, F_SETLKW, F_GETLK, and OFD locks, which Linux's
//! FUSE client sends the same way) and flock(2), held here per export
//! rather than in each client's kernel.
//!
//! Linux keeps a file's locks in the kernel that took them, so a guest
//! and a host mount of one export, each with its own kernel, would not
//! see each other's. Once a session offers FUSE_POSIX_LOCKS and
//! FUSE_FLOCK_LOCKS, its kernel sends every lock request here instead.
//!
//! The rules are Linux's (fs/locks.c):
//! - A lock is a byte range, inclusive, of a read (shared) or a write
//!   (exclusive) kind, held by an owner: a process's files for a POSIX
//!   lock, an open file for an OFD or flock lock. Linux's FUSE client
//!   sends the owner as an opaque number, unique within its connection, so
//!   an owner here is that number qualified by the client.
//! - POSIX and flock locks live in separate spaces and never conflict.
//! - Two locks conflict when they overlap, have different owners, and one
//!   of them is a write lock.
//! - A request by an owner replaces that owner's locks over its range
//!   (splitting them where it covers only part), and merges with the
//!   owner's adjacent or overlapping locks of the same kind. A request
//!   that conflicts changes nothing.
//!
//! What differs from a local kernel, and why:
//! - No deadlock detection (EDEADLK). The owner numbers cannot tell a
//!   POSIX lock from an OFD one, and Linux detects deadlocks only between
//!   POSIX owners; a wrong EDEADLK would fail a program that would not
//!   have deadlocked.
//! - F_GETLK reports the holder's pid only if the holder is of the same
//!   client: another client's pid is a number in another kernel's pid
//!   namespace, so it is reported as 0.
//!
//! Everything is bounded: an owner's client holds at most
//! [`LOCKS_PER_CLIENT_MAX`] lock records and waits in at most
//! [`WAITS_PER_CLIENT_MAX`] requests; past either, a request fails with
//! ENOLCK, as Linux answers when its lock table is full.
//!
//! A blocked request (F_SETLKW) waits as a future, never holding the
//! reactor. It is answered when a change on its inode lets it in, when its
//! client interrupts it (EINTR, which Linux's FUSE client restarts), or
//! when its waits are ended (ENOLCK: its queue stopped for a migration or
//! a reset, or its session ended). Lives on the export's reactor, like
//! [`super::coherence::Coherence`].

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use keelfs_base::IdMapBy;
use keelfs_fs::{Fh, Ino};

/// Lock records one client may hold at once, over all its owners and
/// inodes: far more than real programs take, and a bound on what a hostile
/// client can make keelfsd keep.
pub const LOCKS_PER_CLIENT_MAX: usize = 4096;
/// Requests of one client that may wait for a lock at once. Each is a
/// request in flight, which the transports bound too; this bounds the
/// host mount, whose kernel may send many.
pub const WAITS_PER_CLIENT_MAX: usize = 1024;
/// The last byte a lock can cover: Linux's OFFSET_MAX, which a lock "to
/// the end of the file" ends at.
pub const LOCK_END_MAX: u64 = i64::MAX as u64;

/// One client of an export (a session), as the lock table knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientId(u64);

/// A lock's owner: the client's own number for it, within the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LockOwner {
    pub client: ClientId,
    pub owner: u64,
}

/// Which kind of lock: POSIX locks and flock locks never conflict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockSpace {
    Posix,
    Flock,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockKind {
    Read,
    Write,
}

/// A lock held, over the bytes `start..=end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldLock {
    pub owner: LockOwner,
    pub space: LockSpace,
    pub kind: LockKind,
    pub start: u64,
    pub end: u64,
    /// The process that took it, in its client's pid namespace.
    pub pid: u32,
    /// The open file it was taken through: released with it.
    pub fh: Fh,
}

/// A request to lock (`kind` Some) or unlock (None) a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockRequest {
    pub owner: LockOwner,
    pub space: LockSpace,
    pub kind: Option<LockKind>,
    pub start: u64,
    pub end: u64,
    pub pid: u32,
    pub fh: Fh,
}

impl LockRequest {
    /// Whether `held` stands in this request's way.
    fn conflicts_with(&self, held: &HeldLock) -> bool {
        let Some(kind) = self.kind else { return false };
        held.space == self.space
            && held.owner != self.owner
            && held.start <= self.end
            && self.start <= held.end
            && (kind == LockKind::Write || held.kind == LockKind::Write)
    }

    fn mine(&self, held: &HeldLock) -> bool {
        held.owner == self.owner && held.space == self.space
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    /// Another owner holds a conflicting lock (F_SETLK's EAGAIN).
    #[error("a conflicting lock is held")]
    Conflict,
    /// The client's lock records or waits are at their bound.
    #[error("the client holds as many locks as it may")]
    TooMany,
    /// The wait was interrupted by its client.
    #[error("the wait was interrupted")]
    Interrupted,
    /// The wait was ended by the transport (a stopping queue, a session
    /// that ended).
    #[error("the wait was ended")]
    Ended,
}

impl LockError {
    pub fn errno(self) -> i32 {
        match self {
            LockError::Conflict => libc::EAGAIN,
            LockError::TooMany | LockError::Ended => libc::ENOLCK,
            LockError::Interrupted => libc::EINTR,
        }
    }
}

/// How a waiting request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WaitState {
    Waiting,
    /// Something changed on its inode: try again.
    Woken,
    Over(LockError),
}

struct Waiter {
    client: ClientId,
    /// The request's id in its client (FUSE's `unique`), for INTERRUPT.
    unique: u64,
    ino: Ino,
    state: Cell<WaitState>,
    waker: RefCell<Option<Waker>>,
}

impl Waiter {
    fn wake(&self, state: WaitState) {
        if self.state.get() == WaitState::Waiting {
            self.state.set(state);
        }
        if let Some(waker) = self.waker.borrow_mut().take() {
            waker.wake();
        }
    }
}

/// The future a blocked request awaits: ready when woken or ended. Its
/// waiter leaves the table when it is dropped, answered or not (a request
/// whose task is dropped with its session).
struct WaitTurn<'a> {
    locks: &'a Locks,
    waiter: Rc<Waiter>,
}

impl Future for WaitTurn<'_> {
    type Output = Result<(), LockError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.waiter.state.get() {
            WaitState::Waiting => {
                *self.waiter.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
            WaitState::Woken => Poll::Ready(Ok(())),
            WaitState::Over(e) => Poll::Ready(Err(e)),
        }
    }
}

impl Drop for WaitTurn<'_> {
    fn drop(&mut self) {
        self.locks.waiters.borrow_mut().retain(|w| !Rc::ptr_eq(w, &self.waiter));
    }
}

/// Counters, for stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LockCounters {
    pub held: u64,
    pub waiting: u64,
    pub granted: u64,
    pub conflicts: u64,
    pub waits: u64,
}

/// The locks of one export, shared by its sessions on its reactor.
#[derive(Default)]
pub struct Locks {
    by_ino: RefCell<IdMapBy<Ino, Vec<HeldLock>>>,
    held_per_client: RefCell<IdMapBy<u64, usize>>,
    waiters: RefCell<Vec<Rc<Waiter>>>,
    next_client: Cell<u64>,
    granted: Cell<u64>,
    conflicts: Cell<u64>,
    waits: Cell<u64>,
}

impl std::fmt::Debug for Locks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locks").field("counters", &self.counters()).finish_non_exhaustive()
    }
}

impl Locks {
    pub fn new() -> Rc<Self> {
        Rc::new(Self::default())
    }

    /// A new client: a session joining the export.
    pub fn join(&self) -> ClientId {
        let id = self.next_client.get();
        self.next_client.set(id + 1);
        ClientId(id)
    }

    /// The client is gone: its locks go, and its waits end.
    pub fn leave(&self, client: ClientId) {
        self.end_waits(client, LockError::Ended);
        let touched = self.remove_where(None, |h| h.owner.client == client);
        self.held_per_client.borrow_mut().remove(&client.0);
        self.wake_inodes(&touched);
    }

    /// End every wait of `client` with `why`.
    pub fn end_waits(&self, client: ClientId, why: LockError) {
        for waiter in self.waiters.borrow().iter().filter(|w| w.client == client) {
            waiter.wake(WaitState::Over(why));
        }
    }

    /// INTERRUPT of the request `unique`: if it waits, it ends with EINTR.
    pub fn interrupt(&self, client: ClientId, unique: u64) -> bool {
        let waiters = self.waiters.borrow();
        let found = waiters.iter().find(|w| w.client == client && w.unique == unique);
        if let Some(waiter) = found {
            waiter.wake(WaitState::Over(LockError::Interrupted));
        }
        found.is_some()
    }

    /// F_GETLK: the first lock that stands in `probe`'s way.
    pub fn test(&self, ino: Ino, probe: &LockRequest) -> Option<HeldLock> {
        self.by_ino.borrow().get(&ino)?.iter().find(|h| probe.conflicts_with(h)).copied()
    }

    /// F_SETLK: take or release at once, or fail with Conflict.
    pub fn set(&self, ino: Ino, request: &LockRequest) -> Result<(), LockError> {
        let mut by_ino = self.by_ino.borrow_mut();
        let list = by_ino.get(&ino).map_or(&[][..], Vec::as_slice);
        if list.iter().any(|h| request.conflicts_with(h)) {
            self.conflicts.set(self.conflicts.get() + 1);
            return Err(LockError::Conflict);
        }
        // The inode's locks as they would be: taken in only within bound.
        let next = apply(list, request);
        let (before, after) = (list.len(), next.len());
        let count = self.client_count(request.owner.client);
        let now_held = (count + after).checked_sub(before).expect("a client's count covers its locks");
        if now_held > LOCKS_PER_CLIENT_MAX {
            return Err(LockError::TooMany);
        }
        self.held_per_client.borrow_mut().insert(request.owner.client.0, now_held);
        if next.is_empty() {
            by_ino.remove(&ino);
        } else {
            by_ino.insert(ino, next);
        }
        drop(by_ino);
        if request.kind.is_some() {
            self.granted.set(self.granted.get() + 1);
        }
        if after < before || request.kind != Some(LockKind::Write) {
            // Something was released or weakened: a waiter may get in.
            self.wake_inodes(&[ino]);
        }
        Ok(())
    }

    /// F_SETLKW: as [`Self::set`], waiting out conflicts. At most
    /// `waits_max` requests of the client wait at once (at most
    /// [`WAITS_PER_CLIENT_MAX`]); past it, ENOLCK.
    pub async fn set_waiting(
        &self,
        ino: Ino,
        request: &LockRequest,
        unique: u64,
        waits_max: usize,
    ) -> Result<(), LockError> {
        loop {
            match self.set(ino, request) {
                Err(LockError::Conflict) => {}
                done => return done,
            }
            let waiter = self.enqueue(ino, request.owner.client, unique, waits_max.min(WAITS_PER_CLIENT_MAX))?;
            WaitTurn { locks: self, waiter }.await?;
        }
    }

    fn enqueue(&self, ino: Ino, client: ClientId, unique: u64, waits_max: usize) -> Result<Rc<Waiter>, LockError> {
        let mut waiters = self.waiters.borrow_mut();
        if waiters.iter().filter(|w| w.client == client).count() >= waits_max {
            return Err(LockError::TooMany);
        }
        let waiter =
            Rc::new(Waiter { client, unique, ino, state: Cell::new(WaitState::Waiting), waker: RefCell::new(None) });
        waiters.push(Rc::clone(&waiter));
        self.waits.set(self.waits.get() + 1);
        Ok(waiter)
    }

    /// Close (FLUSH) by `owner`: its POSIX locks on `ino` go.
    pub fn release_owner(&self, ino: Ino, owner: LockOwner) {
        let touched = self.remove_where(Some(ino), |h| h.owner == owner && h.space == LockSpace::Posix);
        self.wake_inodes(&touched);
    }

    /// The open file `fh` of `client` is released: every lock taken
    /// through it goes (its OFD and flock locks, whose owner it is, and
    /// any POSIX lock its close has not released yet).
    pub fn release_file(&self, ino: Ino, client: ClientId, fh: Fh) {
        let touched = self.remove_where(Some(ino), |h| h.owner.client == client && h.fh == fh);
        self.wake_inodes(&touched);
    }

    /// Every lock `client` holds, by inode, in a stable order: for a
    /// session's state.
    pub fn held_by(&self, client: ClientId) -> Vec<(Ino, HeldLock)> {
        let mut held: Vec<(Ino, HeldLock)> = self
            .by_ino
            .borrow()
            .iter()
            .flat_map(|(&ino, list)| list.iter().filter(|h| h.owner.client == client).map(move |h| (ino, *h)))
            .collect();
        held.sort_unstable_by_key(|(ino, h)| (ino.get(), h.owner.owner, h.start));
        held
    }

    /// Take `locks` for `client` (a restored session), all or none:
    /// refused if any conflicts with a lock held here or breaks a bound.
    pub fn restore(&self, client: ClientId, locks: &[(Ino, HeldLock)]) -> Result<(), LockError> {
        if locks.len() > LOCKS_PER_CLIENT_MAX {
            return Err(LockError::TooMany);
        }
        let requests: Vec<(Ino, LockRequest)> = locks
            .iter()
            .map(|&(ino, h)| {
                let owner = LockOwner { client, owner: h.owner.owner };
                let (space, kind, start, end, pid, fh) = (h.space, Some(h.kind), h.start, h.end, h.pid, h.fh);
                (ino, LockRequest { owner, space, kind, start, end, pid, fh })
            })
            .collect();
        if requests.iter().any(|(ino, r)| self.test(*ino, r).is_some()) {
            return Err(LockError::Conflict);
        }
        for (ino, request) in &requests {
            self.set(*ino, request).expect("checked free of conflicts, and bounded");
        }
        Ok(())
    }

    pub fn counters(&self) -> LockCounters {
        LockCounters {
            held: self.by_ino.borrow().values().map(|l| l.len() as u64).sum(),
            waiting: self.waiters.borrow().len() as u64,
            granted: self.granted.get(),
            conflicts: self.conflicts.get(),
            waits: self.waits.get(),
        }
    }

    fn client_count(&self, client: ClientId) -> usize {
        self.held_per_client.borrow().get(&client.0).copied().unwrap_or(0)
    }

    /// Remove the locks `gone` picks, on `only` or on every inode; the
    /// inodes it touched.
    fn remove_where(&self, only: Option<Ino>, gone: impl Fn(&HeldLock) -> bool) -> Vec<Ino> {
        let mut touched = Vec::new();
        let mut counts = self.held_per_client.borrow_mut();
        let mut cut = |ino: Ino, list: &mut Vec<HeldLock>| {
            let before = list.len();
            list.retain(|h| {
                let remove = gone(h);
                if remove {
                    let count = counts.get_mut(&h.owner.client.0).expect("a holder is counted");
                    *count -= 1;
                }
                !remove
            });
            if list.len() != before {
                touched.push(ino);
            }
        };
        let mut by_ino = self.by_ino.borrow_mut();
        match only {
            Some(ino) => {
                if let Some(list) = by_ino.get_mut(&ino) {
                    cut(ino, list);
                    if list.is_empty() {
                        by_ino.remove(&ino);
                    }
                }
            }
            None => by_ino.retain(|&ino, list| {
                cut(ino, list);
                !list.is_empty()
            }),
        }
        touched
    }

    fn wake_inodes(&self, inodes: &[Ino]) {
        if inodes.is_empty() {
            return;
        }
        for waiter in self.waiters.borrow().iter().filter(|w| inodes.contains(&w.ino)) {
            waiter.wake(WaitState::Woken);
        }
    }
}

/// `list`, one inode's locks, with `request` (free of conflicts) applied:
/// the owner's locks over its range are cut away, then the new lock goes
/// in, merged with the owner's adjacent locks of its kind.
fn apply(list: &[HeldLock], request: &LockRequest) -> Vec<HeldLock> {
    let (mut start, mut end) = (request.start, request.end);
    let mut kept = Vec::with_capacity(list.len() + 2);
    for &held in list {
        if !request.mine(&held) {
            kept.push(held);
            continue;
        }
        let touches = held.start <= end.saturating_add(1) && start <= held.end.saturating_add(1);
        if request.kind == Some(held.kind) && touches {
            // Merge: the new lock grows over it.
            (start, end) = (start.min(held.start), end.max(held.end));
            continue;
        }
        let overlaps = held.start <= end && start <= held.end;
        if !overlaps {
            kept.push(held);
            continue;
        }
        if held.start < start {
            kept.push(HeldLock { end: start - 1, ..held });
        }
        if held.end > end {
            kept.push(HeldLock { start: end + 1, ..held });
        }
    }
    if let Some(kind) = request.kind {
        let LockRequest { owner, space, pid, fh, .. } = *request;
        kept.push(HeldLock { owner, space, kind, start, end, pid, fh });
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(client: ClientId, owner: u64, kind: Option<LockKind>, start: u64, end: u64) -> LockRequest {
        LockRequest {
            owner: LockOwner { client, owner },
            space: LockSpace::Posix,
            kind,
            start,
            end,
            pid: 7,
            fh: Fh::new(owner),
        }
    }

    const INO: Ino = Ino::new(5);

    #[test]
    fn readers_share_and_a_writer_is_refused() {
        let locks = Locks::new();
        let (a, b) = (locks.join(), locks.join());
        locks.set(INO, &req(a, 1, Some(LockKind::Read), 0, 99)).unwrap();
        locks.set(INO, &req(b, 1, Some(LockKind::Read), 50, 149)).unwrap();
        let write = req(b, 1, Some(LockKind::Write), 0, 9);
        assert_eq!(locks.set(INO, &write), Err(LockError::Conflict));
        let holder = locks.test(INO, &write).expect("a's read lock is in the way");
        assert_eq!((holder.owner.client, holder.start, holder.end), (a, 0, 99));
        // Past a's range b may write.
        locks.set(INO, &req(b, 1, Some(LockKind::Write), 100, 149)).unwrap();
        let b_holds: Vec<(u64, u64, LockKind)> =
            locks.held_by(b).iter().map(|(_, h)| (h.start, h.end, h.kind)).collect();
        assert_eq!(b_holds, [(50, 99, LockKind::Read), (100, 149, LockKind::Write)], "b's read lock was split");
    }

    #[test]
    fn an_unlock_in_the_middle_splits_and_a_same_kind_lock_merges() {
        let locks = Locks::new();
        let a = locks.join();
        locks.set(INO, &req(a, 1, Some(LockKind::Write), 0, 99)).unwrap();
        locks.set(INO, &req(a, 1, None, 40, 59)).unwrap();
        let spans: Vec<(u64, u64)> = locks.held_by(a).iter().map(|(_, h)| (h.start, h.end)).collect();
        assert_eq!(spans, [(0, 39), (60, 99)]);
        locks.set(INO, &req(a, 1, Some(LockKind::Write), 40, 59)).unwrap();
        let spans: Vec<(u64, u64)> = locks.held_by(a).iter().map(|(_, h)| (h.start, h.end)).collect();
        assert_eq!(spans, [(0, 99)], "adjacent locks of one kind merge");
        // A read lock inside a write lock splits it in three.
        locks.set(INO, &req(a, 1, Some(LockKind::Read), 10, 19)).unwrap();
        let kinds: Vec<(u64, LockKind)> = locks.held_by(a).iter().map(|(_, h)| (h.start, h.kind)).collect();
        assert_eq!(kinds, [(0, LockKind::Write), (10, LockKind::Read), (20, LockKind::Write)]);
    }

    #[test]
    fn flock_and_posix_locks_do_not_conflict() {
        let locks = Locks::new();
        let (a, b) = (locks.join(), locks.join());
        locks.set(INO, &req(a, 1, Some(LockKind::Write), 0, LOCK_END_MAX)).unwrap();
        let flock = LockRequest { space: LockSpace::Flock, ..req(b, 2, Some(LockKind::Write), 0, LOCK_END_MAX) };
        locks.set(INO, &flock).unwrap();
        let other_flock = LockRequest { owner: LockOwner { client: a, owner: 3 }, ..flock };
        assert_eq!(locks.set(INO, &other_flock), Err(LockError::Conflict));
    }

    #[test]
    fn the_client_bound_refuses_and_leaves_nothing_changed() {
        let locks = Locks::new();
        let a = locks.join();
        for i in 0..LOCKS_PER_CLIENT_MAX as u64 {
            locks.set(INO, &req(a, 1, Some(LockKind::Write), i * 2, i * 2)).unwrap();
        }
        let one_more = req(a, 1, Some(LockKind::Write), u64::MAX - 5, u64::MAX - 5);
        assert_eq!(locks.set(INO, &one_more), Err(LockError::TooMany));
        assert_eq!(locks.counters().held, LOCKS_PER_CLIENT_MAX as u64);
        // Merging two of them into one is still allowed.
        locks.set(INO, &req(a, 1, Some(LockKind::Write), 0, 2)).unwrap();
        assert_eq!(locks.counters().held, LOCKS_PER_CLIENT_MAX as u64 - 1);
        locks.leave(a);
        assert_eq!(locks.counters().held, 0);
    }

    #[test]
    fn release_owner_and_file_drop_only_theirs() {
        let locks = Locks::new();
        let (a, b) = (locks.join(), locks.join());
        locks.set(INO, &req(a, 1, Some(LockKind::Read), 0, 9)).unwrap();
        locks.set(INO, &req(a, 2, Some(LockKind::Read), 0, 9)).unwrap();
        locks.set(INO, &req(b, 1, Some(LockKind::Read), 0, 9)).unwrap();
        locks.release_owner(INO, LockOwner { client: a, owner: 1 });
        assert_eq!(locks.held_by(a).len(), 1);
        assert_eq!(locks.held_by(b).len(), 1, "owner numbers are per client");
        locks.release_file(INO, a, Fh::new(2));
        assert!(locks.held_by(a).is_empty());
    }
}
