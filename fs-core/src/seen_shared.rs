//! The shared blocks a walk over the files has read already: scrub and
//! fsck --data read a block that several files name (clones) with the
//! first name they meet, and step over it at the others, so that a
//! hundred clones of an image cost one read of it, not a hundred
//! (docs/plans/data-checksums.md, section 5).
//!
//! Only blocks the shared-run index counts are looked up or kept: a block
//! with one name is always read. (A file's block that a snapshot also
//! holds is counted too, and kept, though no other file names it.) The
//! set is bounded: past [`SEEN_RUNS_MAX`] runs it is forgotten whole, and
//! the walk then reads some shared blocks again, which costs reads, never
//! a block unchecked; so does a block whose check was not conclusive
//! ([`SeenShared::forget`]).

use std::collections::BTreeMap;

use crate::format::BlockRun;
use crate::shared_runs::SharedRuns;

/// Runs kept at most (about 48 bytes each in the tree).
pub const SEEN_RUNS_MAX: usize = 1 << 20;

/// Shared device blocks read so far, as runs that never touch or
/// overlap: first block to end.
#[derive(Debug, Default)]
pub struct SeenShared {
    runs: BTreeMap<u64, u64>,
}

/// What to do with the front of a run: step over `skip` blocks (shared
/// and read already), then read `read` blocks (none read already).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NextRead {
    pub skip: u64,
    pub read: u64,
}

impl SeenShared {
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// What to do with the front of `run`, whose blocks `shared` counts:
    /// the shared blocks of the part to read are from now on read.
    pub(crate) fn next_read(&mut self, shared: &SharedRuns, run: BlockRun) -> NextRead {
        // (None of an empty run, or with nothing shared, is.)
        if !shared.any_shared(run) {
            return NextRead { skip: 0, read: run.len };
        }
        let parts = shared.shared_within(run);
        let seen = self.seen_within(&parts);
        let skip = match seen.first() {
            Some(first) if first.start == run.start => first.len,
            _ => 0,
        };
        let from = run.start + skip;
        let to = seen.iter().map(|s| s.start).find(|&s| s > from).unwrap_or(run.end());
        let read = BlockRun { start: from, len: to - from };
        for part in &parts {
            let (start, end) = (part.start.max(read.start), part.end().min(read.end()));
            if start < end {
                self.insert(start, end);
            }
        }
        debug_assert!(skip + read.len <= run.len);
        NextRead { skip, read: read.len }
    }

    /// Device block `block` is to be read again at its next name: a walk
    /// whose check of it was not conclusive (the name it was read under
    /// moved while the read was in flight) must not step over it at the
    /// others.
    pub(crate) fn forget(&mut self, block: u64) {
        let Some((&start, &end)) = self.runs.range(..=block).next_back() else { return };
        if end <= block {
            return;
        }
        self.runs.remove(&start);
        if start < block {
            self.runs.insert(start, block);
        }
        if block + 1 < end {
            self.runs.insert(block + 1, end);
        }
    }

    /// The parts of `parts` (sorted, apart) that are seen, sorted; two
    /// that touch are one.
    fn seen_within(&self, parts: &[BlockRun]) -> Vec<BlockRun> {
        let mut out: Vec<BlockRun> = Vec::new();
        for part in parts {
            let before = self.runs.range(..=part.start).next_back().map(|(&s, &e)| (s, e));
            let inside = self.runs.range(part.start + 1..part.end()).map(|(&s, &e)| (s, e));
            for (s, e) in before.into_iter().chain(inside) {
                let (start, end) = (s.max(part.start), e.min(part.end()));
                if start >= end {
                    continue;
                }
                match out.last_mut() {
                    Some(last) if last.end() == start => last.len += end - start,
                    _ => out.push(BlockRun { start, len: end - start }),
                }
            }
        }
        out
    }

    /// [start, end) is read: merged with the runs it touches.
    fn insert(&mut self, mut start: u64, mut end: u64) {
        debug_assert!(start < end);
        if self.runs.len() >= SEEN_RUNS_MAX {
            self.runs.clear();
        }
        if let Some((&s, &e)) = self.runs.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
                self.runs.remove(&s);
            }
        }
        while let Some((&s, &e)) = self.runs.range(start..=end).next() {
            end = end.max(e);
            self.runs.remove(&s);
        }
        self.runs.insert(start, end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(start: u64, len: u64) -> BlockRun {
        BlockRun { start, len }
    }

    /// Blocks [10, 20) and [30, 40) named twice.
    fn two_shared() -> SharedRuns {
        let mut shared = SharedRuns::default();
        shared.share(run(10, 10));
        shared.share(run(30, 10));
        shared
    }

    #[test]
    fn unshared_blocks_are_always_read() {
        let mut seen = SeenShared::default();
        let none = SharedRuns::default();
        assert_eq!(seen.next_read(&none, run(0, 50)), NextRead { skip: 0, read: 50 });
        assert_eq!(seen.next_read(&none, run(0, 50)), NextRead { skip: 0, read: 50 });
        let shared = two_shared();
        assert_eq!(seen.next_read(&shared, run(0, 10)), NextRead { skip: 0, read: 10 });
        assert_eq!(seen.next_read(&shared, run(0, 10)), NextRead { skip: 0, read: 10 });
        assert_eq!(seen.runs(), 0);
    }

    /// The second name of a shared run steps over it, and reads what
    /// only it names around it.
    #[test]
    fn a_shared_run_is_read_once() {
        let shared = two_shared();
        let mut seen = SeenShared::default();
        assert_eq!(seen.next_read(&shared, run(5, 40)), NextRead { skip: 0, read: 40 });
        assert_eq!(seen.runs(), 2);
        // Again from the start: [5, 10) is read (one name), up to the
        // seen [10, 20).
        assert_eq!(seen.next_read(&shared, run(5, 40)), NextRead { skip: 0, read: 5 });
        assert_eq!(seen.next_read(&shared, run(10, 35)), NextRead { skip: 10, read: 10 });
        assert_eq!(seen.next_read(&shared, run(30, 15)), NextRead { skip: 10, read: 5 });
        assert_eq!(seen.next_read(&shared, run(12, 3)), NextRead { skip: 3, read: 0 });
    }

    /// Part of a shared run read: the rest is read at the next name.
    #[test]
    fn only_what_was_read_is_seen() {
        let shared = two_shared();
        let mut seen = SeenShared::default();
        assert_eq!(seen.next_read(&shared, run(14, 2)), NextRead { skip: 0, read: 2 });
        assert_eq!(seen.next_read(&shared, run(10, 10)), NextRead { skip: 0, read: 4 });
        assert_eq!(seen.next_read(&shared, run(14, 6)), NextRead { skip: 2, read: 4 });
        assert_eq!(seen.next_read(&shared, run(10, 10)), NextRead { skip: 10, read: 0 });
        assert_eq!(seen.runs(), 1, "[10, 20) merged");
    }

    /// A block forgotten is read at the next name; the rest of its run
    /// stays stepped over.
    #[test]
    fn a_forgotten_block_is_read_again() {
        let shared = two_shared();
        let mut seen = SeenShared::default();
        assert_eq!(seen.next_read(&shared, run(10, 10)), NextRead { skip: 0, read: 10 });
        seen.forget(14);
        seen.forget(14);
        seen.forget(25);
        assert_eq!(seen.next_read(&shared, run(10, 10)), NextRead { skip: 4, read: 1 });
        assert_eq!(seen.next_read(&shared, run(15, 5)), NextRead { skip: 5, read: 0 });
        seen.forget(10);
        seen.forget(19);
        assert_eq!(seen.next_read(&shared, run(10, 1)), NextRead { skip: 0, read: 1 });
        assert_eq!(seen.next_read(&shared, run(19, 1)), NextRead { skip: 0, read: 1 });
        assert_eq!(seen.next_read(&shared, run(10, 10)), NextRead { skip: 10, read: 0 });
        assert_eq!(seen.runs(), 1);
    }

    #[test]
    fn the_set_is_forgotten_when_full() {
        let mut shared = SharedRuns::default();
        let mut seen = SeenShared::default();
        // Every other block shared, each read once: one run apiece.
        let count = SEEN_RUNS_MAX as u64 + 1;
        for i in 0..count {
            shared.share(run(2 * i, 1));
        }
        for i in 0..count {
            assert_eq!(seen.next_read(&shared, run(2 * i, 1)).read, 1);
        }
        assert_eq!(seen.runs(), 1, "cleared at the bound, then one more");
        assert_eq!(seen.next_read(&shared, run(0, 1)).read, 1, "forgotten: read again");
    }
}
