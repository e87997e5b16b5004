//! The two handshakes between a reactor and the threads that give it work.
//!
//! - [`SleepGate`]: a reactor about to sleep in epoll against a sender that
//!   has just queued a message or woken a task. Either the reactor sees the
//!   new work on its last look, or the sender sees it asleep and signals
//!   its eventfd; never neither (a lost wakeup: a message waits until some
//!   other event wakes the reactor).
//! - [`WakeMark`]: a task's "queued" mark, which lets any number of wakes
//!   put the task in the woken queue once. A wake that comes after the
//!   reactor has begun a poll queues the task again, and a wake that is
//!   folded into a poll is seen by it (its writes are visible).
//!
//! The atomics come from `crate::sync`, so that `reactor/tests/loom.rs`
//! can build this very file over loom's model of them and check both
//! handshakes in every interleaving the memory model allows.

use crate::sync::{fence, AtomicBool, Ordering};

/// Whether the reactor may be asleep, or about to sleep, in epoll.
pub(crate) struct SleepGate {
    sleeping: AtomicBool,
}

impl SleepGate {
    pub(crate) fn new() -> Self {
        SleepGate { sleeping: AtomicBool::new(false) }
    }

    /// Reactor, before its last look for work: from here on, a sender
    /// either sees the reactor sleeping or has its work seen by that look.
    /// The store and the look are ordered by a SeqCst fence, which pairs
    /// with the one in [`SleepGate::must_signal`].
    pub(crate) fn begin_sleep(&self) {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Reactor: awake again (or it decided not to sleep).
    pub(crate) fn end_sleep(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
    }

    /// Sender, after publishing its work: whether the reactor may be
    /// asleep without having seen it, so that its eventfd must be signalled.
    pub(crate) fn must_signal(&self) -> bool {
        fence(Ordering::SeqCst);
        self.sleeping.load(Ordering::SeqCst)
    }
}

/// A task's mark: set while the task has an entry in the woken queue that
/// its reactor has not yet begun to poll.
pub(crate) struct WakeMark {
    queued: AtomicBool,
}

impl WakeMark {
    pub(crate) fn new() -> Self {
        WakeMark { queued: AtomicBool::new(false) }
    }

    /// Waker: true when this wake must push the task to the woken queue
    /// (no entry is pending); false when a pending poll will see it.
    pub(crate) fn mark(&self) -> bool {
        !self.queued.swap(true, Ordering::AcqRel)
    }

    /// Reactor, just before polling the task: wakes from here on queue it
    /// again, and a wake folded into this poll (it found the mark still
    /// set) is seen by it.
    ///
    /// A swap, not a store: a store lets the poll's first loads pass it
    /// (a store-load reordering, which x86 does too), so a waker could
    /// publish its result, find the mark still set and leave the task
    /// unqueued, while the poll reads the result from before. The swap
    /// reads the waker's mark and acquires what it released. Loom found
    /// this (`tests/loom.rs`, `a_wake_is_never_folded_into_a_poll_that_misses_it`).
    pub(crate) fn clear(&self) {
        self.queued.swap(false, Ordering::AcqRel);
    }

    /// Reactor, when it reuses the mark for a new task that no waker can
    /// reach yet.
    pub(crate) fn reset(&self) {
        self.queued.store(false, Ordering::Relaxed);
    }
}
