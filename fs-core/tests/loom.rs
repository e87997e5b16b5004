//! The seqlock under the shared page cache, model-checked by loom.
//!
//! `src/seqlock.rs` is built here over loom's atomics instead of std's.
//! The owner's change and the reader's copy are those of `shared.rs`: the
//! owner opens every sequence a change touches, stores the words with
//! relaxed stores, and closes them; a reader notes the sequences, loads the
//! words with relaxed loads, and asks [`seqlock::unchanged_since`]. Loom
//! runs each model in every interleaving and every value its memory model
//! lets a load return, and fails if any accepted copy mixes versions.

#![allow(dead_code)]

/// What `src/seqlock.rs` imports as `crate::atomics`.
mod atomics {
    pub(crate) use loom::sync::atomic::{fence, AtomicU64, Ordering};
}

#[path = "../src/seqlock.rs"]
mod seqlock;

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use seqlock::Seq;

/// Two pages of one word each, as a write spanning pages sees them.
struct Pages {
    seqs: [Seq; 2],
    words: [AtomicU64; 2],
}

impl Pages {
    fn new() -> Self {
        Pages { seqs: [Seq::default(), Seq::default()], words: [AtomicU64::new(0), AtomicU64::new(0)] }
    }

    /// Owner: one change that writes `version` to both pages (all of its
    /// pages made odd before any is changed, as `shared.rs` does).
    fn write(&self, version: u64) {
        self.seqs.iter().for_each(Seq::open);
        self.words.iter().for_each(|w| w.store(version, Ordering::Relaxed));
        self.seqs.iter().for_each(Seq::close);
    }

    /// Reader: both words as one version, or None (busy: retry).
    fn read(&self) -> Option<[u64; 2]> {
        let seen = [self.seqs[0].begin()?, self.seqs[1].begin()?];
        let copy = [self.words[0].load(Ordering::Relaxed), self.words[1].load(Ordering::Relaxed)];
        seqlock::unchanged_since(self.seqs.iter().zip(seen)).then_some(copy)
    }
}

/// One change against one reader: an accepted copy is all of the old
/// version or all of the new one.
#[test]
fn a_copy_is_never_half_a_write() {
    loom::model(|| {
        let pages = Arc::new(Pages::new());
        let owner = {
            let pages = Arc::clone(&pages);
            thread::spawn(move || pages.write(1))
        };
        if let Some([a, b]) = pages.read() {
            assert_eq!(a, b, "a copy mixed two versions");
        }
        owner.join().unwrap();
    });
}

/// Two changes in a row against a reader: a copy that passes the check
/// holds one of the three versions, whole, and never one older than a
/// version it has seen in its sequences.
#[test]
fn a_copy_across_two_writes_is_one_version() {
    loom::model(|| {
        let pages = Arc::new(Pages::new());
        let owner = {
            let pages = Arc::clone(&pages);
            thread::spawn(move || {
                pages.write(1);
                pages.write(2);
            })
        };
        if let Some([a, b]) = pages.read() {
            assert_eq!(a, b, "a copy mixed two versions");
        }
        owner.join().unwrap();
        // After the owner has finished, a read succeeds and sees its last
        // version.
        assert_eq!(pages.read(), Some([2, 2]));
    });
}
