//! Device blocks named by more than one extent (issue 37,
//! docs/plans/shared-extents.md): the reference counts that keelfs derives
//! from its extent maps, as it derives free space, kept only where they
//! exceed one. A block with no entry has at most one name; the direct
//! overwrite path asks only whether the index is empty.
//!
//! Everything here is bounded by the runs it holds: an operation over a
//! range touches the entries in that range and the two around it.

use std::collections::BTreeMap;

use crate::format::BlockRun;

/// A run of blocks with the same count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SharedRun {
    len: u64,
    /// References beyond the first: at least 1. (A u64: no image can name
    /// a block 2^64 times, so no count can overflow.)
    extra: u64,
}

/// Runs named two or more times, by first block. They never overlap, and
/// two that touch have different counts (otherwise they are one run).
#[derive(Debug, Default)]
pub(crate) struct SharedRuns {
    runs: BTreeMap<u64, SharedRun>,
}

impl SharedRuns {
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Every block of `run`, each already named once or more, gains a
    /// name.
    pub fn share(&mut self, run: BlockRun) {
        if run.len == 0 {
            return;
        }
        let gaps = self.split_around(run);
        for entry in self.runs.range_mut(run.start..run.end()) {
            entry.1.extra += 1;
        }
        for gap in gaps {
            self.runs.insert(gap.start, SharedRun { len: gap.len, extra: 1 });
        }
        self.merge_around(run);
    }

    /// Every block of `run` loses a name; `freed` gets the parts that lost
    /// their last, in order.
    pub fn release(&mut self, run: BlockRun, mut freed: impl FnMut(BlockRun)) {
        if run.len == 0 {
            return;
        }
        if self.runs.is_empty() {
            freed(run); // nothing is shared: the common case, first
            return;
        }
        if self.release_within_one(run) {
            return;
        }
        let gaps = self.split_around(run);
        let mut emptied = Vec::new();
        for (&start, entry) in self.runs.range_mut(run.start..run.end()) {
            entry.extra -= 1;
            if entry.extra == 0 {
                emptied.push(start);
            }
        }
        for start in emptied {
            self.runs.remove(&start);
        }
        self.merge_around(run);
        gaps.into_iter().for_each(&mut freed);
    }

    /// [`SharedRuns::release`] of a run within one entry, where the run's
    /// new count joins no entry beyond that one: a copy on write into a
    /// shared run, the common case once a clone is being rewritten.
    /// Nothing is freed (each block keeps a name). The entry keeps its
    /// head, its tail goes in as an entry of the same count, and the run,
    /// one name fewer, as its own entry or (down to one name) none. Two
    /// to four steps in the tree, where the general path takes about
    /// nine. False when the case does not hold (nothing changed).
    fn release_within_one(&mut self, run: BlockRun) -> bool {
        let Some((&start, &entry)) = self.runs.range(..=run.start).next_back() else { return false };
        let end = start + entry.len;
        if run.end() > end {
            return false; // (so run.start < end too: run.len > 0)
        }
        let extra = entry.extra;
        if extra > 1 {
            let joins_before = run.start == start
                && self
                    .runs
                    .range(..start)
                    .next_back()
                    .is_some_and(|(&s, e)| s + e.len == start && e.extra == extra - 1);
            let joins_after = run.end() == end && self.runs.get(&end).is_some_and(|e| e.extra == extra - 1);
            if joins_before || joins_after {
                return false;
            }
        }
        let released = SharedRun { len: run.len, extra: extra - 1 };
        if run.start > start {
            self.runs.get_mut(&start).expect("found above").len = run.start - start;
            if extra > 1 {
                self.runs.insert(run.start, released);
            }
        } else if extra > 1 {
            *self.runs.get_mut(&start).expect("found above") = released;
        } else {
            self.runs.remove(&start);
        }
        if run.end() < end {
            self.runs.insert(run.end(), SharedRun { len: end - run.end(), extra });
        }
        true
    }

    /// Whether any block of `run` is named more than once: one step in
    /// the tree. Entries do not overlap, so the last that starts before
    /// `run` ends is the only one that can reach into it from before, and
    /// any other that overlaps it starts inside it, after that one.
    pub fn any_shared(&self, run: BlockRun) -> bool {
        run.len > 0
            && self.runs.range(..run.end()).next_back().is_some_and(|(&start, entry)| start + entry.len > run.start)
    }

    /// The parts of `run` named more than once, in order, each as long as
    /// it runs.
    pub fn shared_within(&self, run: BlockRun) -> Vec<BlockRun> {
        let mut out: Vec<BlockRun> = Vec::new();
        for (from, to, _) in self.overlapping(run) {
            match out.last_mut() {
                // Touching runs of different counts: one part.
                Some(last) if last.end() == from => last.len += to - from,
                _ => out.push(BlockRun { start: from, len: to - from }),
            }
        }
        out
    }

    /// The names past the first that every block of `run` has, if they
    /// are the same for all of them (0 where nothing is shared).
    pub fn uniform_extra(&self, run: BlockRun) -> Option<u64> {
        let mut covered = 0;
        let mut extra = None;
        for (from, to, entry_extra) in self.overlapping(run) {
            if extra.is_some_and(|e| e != entry_extra) {
                return None;
            }
            extra = Some(entry_extra);
            covered += to - from;
        }
        match extra {
            None => Some(0),
            Some(e) if covered == run.len => Some(e),
            Some(_) => None,
        }
    }

    /// The blocks of `run`, each named once or more, that have exactly
    /// `names` names.
    pub fn blocks_named(&self, run: BlockRun, names: u64) -> u64 {
        let (mut covered, mut matching) = (0, 0);
        for (from, to, extra) in self.overlapping(run) {
            covered += to - from;
            if extra + 1 == names {
                matching += to - from;
            }
        }
        if names == 1 {
            matching += run.len - covered;
        }
        matching
    }

    /// The entries that overlap `run`, cut to it: (first block, end,
    /// names past the first), in order.
    fn overlapping(&self, run: BlockRun) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let before = self.runs.range(..run.start).next_back();
        before.into_iter().chain(self.runs.range(run.start..run.end())).filter_map(move |(&start, entry)| {
            let (from, to) = (start.max(run.start), (start + entry.len).min(run.end()));
            (from < to).then_some((from, to, entry.extra))
        })
    }

    /// The blocks sharing saves: each block counted once per name beyond
    /// its first.
    pub fn saved_blocks(&self) -> u64 {
        self.runs.values().map(|r| r.len.saturating_mul(r.extra)).fold(0, u64::saturating_add)
    }

    /// Split the entries that cross `run`'s ends, so that every entry is
    /// wholly inside or outside it; returns the parts of `run` no entry
    /// covers (named once), in order.
    fn split_around(&mut self, run: BlockRun) -> Vec<BlockRun> {
        self.split_at(run.start);
        self.split_at(run.end());
        let mut gaps = Vec::new();
        let mut at = run.start;
        for (&start, entry) in self.runs.range(run.start..run.end()) {
            if start > at {
                gaps.push(BlockRun { start: at, len: start - at });
            }
            at = start + entry.len;
        }
        if at < run.end() {
            gaps.push(BlockRun { start: at, len: run.end() - at });
        }
        gaps
    }

    /// Cut the entry that holds `at` inside it (not at its start) in two.
    fn split_at(&mut self, at: u64) {
        let Some((&start, &entry)) = self.runs.range(..at).next_back() else { return };
        if start + entry.len > at {
            self.runs.insert(start, SharedRun { len: at - start, extra: entry.extra });
            self.runs.insert(at, SharedRun { len: start + entry.len - at, extra: entry.extra });
        }
    }

    /// Join touching entries of equal count from the one before `run` to
    /// the one after it.
    fn merge_around(&mut self, run: BlockRun) {
        let low = self.runs.range(..run.start).next_back().map_or(run.start, |(&s, _)| s);
        let high = self.runs.range(run.end()..).next().map_or(run.end(), |(&s, _)| s);
        let starts: Vec<u64> = self.runs.range(low..=high).map(|(&s, _)| s).collect();
        let mut current: Option<u64> = None;
        for start in starts {
            let entry = self.runs[&start];
            if let Some(held) = current {
                let previous = self.runs.get_mut(&held).expect("the entry merged into is kept");
                if held + previous.len == start && previous.extra == entry.extra {
                    previous.len += entry.len;
                    self.runs.remove(&start);
                    continue;
                }
            }
            current = Some(start);
        }
    }

    /// Entries non-empty, counted, apart, and merged where they touch.
    pub fn check_invariants(&self) {
        let mut previous: Option<(u64, SharedRun)> = None;
        for (&start, &entry) in &self.runs {
            assert!(entry.len > 0 && entry.extra > 0, "an empty shared run at {start}: {entry:?}");
            assert!(start.checked_add(entry.len).is_some(), "a shared run at {start} past the last block");
            if let Some((before, held)) = previous {
                assert!(before + held.len <= start, "shared runs at {before} and {start} overlap");
                assert!(
                    before + held.len < start || held.extra != entry.extra,
                    "shared runs at {before} and {start} touch with one count"
                );
            }
            previous = Some((start, entry));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(start: u64, len: u64) -> BlockRun {
        BlockRun { start, len }
    }

    /// Blocks whose count fell to zero, one by one.
    fn released(shared: &mut SharedRuns, r: BlockRun) -> Vec<u64> {
        let mut freed = Vec::new();
        shared.release(r, |gone| freed.extend(gone.start..gone.end()));
        freed
    }

    #[test]
    fn an_index_with_nothing_shared_frees_whatever_is_released() {
        let mut shared = SharedRuns::default();
        assert_eq!(released(&mut shared, run(10, 3)), vec![10, 11, 12]);
        assert!(shared.is_empty());
        assert_eq!(shared.saved_blocks(), 0);
    }

    #[test]
    fn a_shared_run_is_freed_by_its_last_release_only() {
        let mut shared = SharedRuns::default();
        shared.share(run(100, 8));
        shared.share(run(104, 2));
        assert_eq!(shared.saved_blocks(), 10);
        assert_eq!(shared.shared_within(run(0, 1000)), vec![run(100, 8)]);
        assert_eq!(shared.shared_within(run(102, 3)), vec![run(102, 3)]);
        // The middle has three names, the rest two.
        assert_eq!(shared.uniform_extra(run(104, 2)), Some(2));
        assert_eq!(shared.uniform_extra(run(100, 3)), Some(1));
        assert_eq!(shared.uniform_extra(run(103, 2)), None, "two counts");
        assert_eq!(shared.uniform_extra(run(99, 2)), None, "part shared");
        assert_eq!(shared.uniform_extra(run(0, 50)), Some(0));
        assert!(released(&mut shared, run(100, 8)).is_empty());
        assert_eq!(shared.shared_within(run(0, 1000)), vec![run(104, 2)]);
        assert_eq!(released(&mut shared, run(98, 12)), vec![98, 99, 100, 101, 102, 103, 106, 107, 108, 109]);
        assert_eq!(released(&mut shared, run(104, 2)), vec![104, 105]);
        assert!(shared.is_empty());
        shared.check_invariants();
    }

    proptest! {
        /// Against a count per block: shares and releases of random runs
        /// (each only where every block is named) keep the index equal to
        /// the counts above one, free exactly the blocks whose count
        /// reaches zero, and keep the invariants.
        #[test]
        fn the_index_agrees_with_a_count_per_block(ops in prop::collection::vec((any::<bool>(), 0u64..60, 1u64..12), 1..200)) {
            const BLOCKS: usize = 72;
            let mut counts = [1u64; BLOCKS];
            let mut shared = SharedRuns::default();
            for (share, start, len) in ops {
                let r = run(start, len);
                let blocks = start as usize..(start + len) as usize;
                if counts[blocks.clone()].contains(&0) {
                    continue; // a block no extent names: neither op applies
                }
                if share {
                    shared.share(r);
                    counts[blocks].iter_mut().for_each(|c| *c += 1);
                } else {
                    let freed = released(&mut shared, r);
                    counts[blocks.clone()].iter_mut().for_each(|c| *c -= 1);
                    let expected: Vec<u64> = blocks.filter(|&b| counts[b] == 0).map(|b| b as u64).collect();
                    prop_assert_eq!(freed, expected);
                }
                shared.check_invariants();
                for (block, &count) in counts.iter().enumerate() {
                    let named_twice = !shared.shared_within(run(block as u64, 1)).is_empty();
                    prop_assert_eq!(named_twice, count > 1, "block {}", block);
                }
                for (from, len) in [(start, len), (start.saturating_sub(3), len + 6), (0, BLOCKS as u64)] {
                    let to = (from + len).min(BLOCKS as u64);
                    let any = counts[from as usize..to as usize].iter().any(|&c| c > 1);
                    prop_assert_eq!(shared.any_shared(run(from, to - from)), any, "{}..{}", from, to);
                }
                let saved: u64 = counts.iter().map(|&c| c.saturating_sub(1)).sum();
                prop_assert_eq!(shared.saved_blocks(), saved);
            }
        }
    }
}
