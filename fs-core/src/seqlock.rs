//! The sequence numbers that let readers on other cores copy cached pages
//! without a lock (see `shared.rs`), as Linux's seqlocks do.
//!
//! The owner makes a number odd, stores, and makes it even again; a reader
//! notes the even numbers, copies with relaxed loads, and accepts the copy
//! only if [`unchanged_since`] finds every number where it was. The fences
//! are the whole protocol:
//!
//! - [`Seq::open`] stores the odd number, then a release fence, so that a
//!   reader whose relaxed load sees any store after it also sees the odd
//!   number once it has passed its acquire fence;
//! - [`unchanged_since`] runs that acquire fence before it rereads.
//!
//! The atomics come from `crate::atomics`, so that `tests/loom.rs` builds
//! this very file over loom's model of them and checks that no accepted
//! copy mixes two versions.

use crate::atomics::{fence, AtomicU64, Ordering};

/// A sequence number only the owner advances: odd while it changes what
/// the number guards. Readers note it before copying and check it after.
pub(crate) struct Seq(AtomicU64);

impl Default for Seq {
    fn default() -> Self {
        Seq(AtomicU64::new(0))
    }
}

impl Seq {
    /// Owner: a change begins.
    pub(crate) fn open(&self) {
        let s = self.0.load(Ordering::Relaxed);
        assert!(s.is_multiple_of(2), "a change opened twice");
        self.0.store(s + 1, Ordering::Relaxed);
        // Orders the odd sequence before the stores that follow it.
        fence(Ordering::Release);
    }

    /// Owner: the change is complete.
    pub(crate) fn close(&self) {
        let s = self.0.load(Ordering::Relaxed);
        assert!(!s.is_multiple_of(2), "a change closed without being opened");
        self.0.store(s + 1, Ordering::Release);
    }

    pub(crate) fn is_open(&self) -> bool {
        !self.0.load(Ordering::Relaxed).is_multiple_of(2)
    }

    /// Reader: the sequence before copying; None while a change is open.
    pub(crate) fn begin(&self) -> Option<u64> {
        let s = self.0.load(Ordering::Acquire);
        s.is_multiple_of(2).then_some(s)
    }
}

/// Reader, after copying with relaxed loads: whether no sequence in `seen`
/// (each with the value [`Seq::begin`] returned) has moved, so that the
/// copy holds one version of everything those sequences guard.
pub(crate) fn unchanged_since<'a>(seen: impl IntoIterator<Item = (&'a Seq, u64)>) -> bool {
    // Orders the copy's loads before the rereads below.
    fence(Ordering::Acquire);
    seen.into_iter().all(|(seq, value)| seq.0.load(Ordering::Relaxed) == value)
}
