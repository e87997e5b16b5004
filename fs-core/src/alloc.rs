//! Free-space management: the data area is split into allocation groups,
//! each with its own index of free runs (start -> length), so that cores
//! allocating in different groups never touch the same structure.
//!
//! Allocation prefers the block right after the caller's hint (the end of
//! the file's previous extent), which is what makes sequential writes
//! extend one extent instead of producing many.

use std::collections::BTreeMap;

use super::format::BlockRun;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("blocks [{start}, +{len}) are claimed twice or lie outside the data area")]
    Conflict { start: u64, len: u64 },
}

#[derive(Clone, Debug)]
struct Group {
    start: u64,
    end: u64,
    free: BTreeMap<u64, u64>,
    free_blocks: u64,
}

impl Group {
    fn insert_free(&mut self, mut start: u64, mut len: u64) {
        if let Some((&prev, &prev_len)) = self.free.range(..start).next_back() {
            if prev + prev_len == start {
                self.free.remove(&prev);
                start = prev;
                len += prev_len;
            }
        }
        if let Some(&next_len) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += next_len;
        }
        self.free.insert(start, len);
    }

    fn is_free(&self, start: u64, len: u64) -> bool {
        self.free.range(..=start).next_back().is_some_and(|(&run, &run_len)| run + run_len >= start + len)
    }

    /// Remove [start, start+len) from the free index; it must be free.
    fn carve(&mut self, start: u64, len: u64) -> bool {
        let Some((&run, &run_len)) = self.free.range(..=start).next_back() else { return false };
        if run + run_len < start + len {
            return false;
        }
        self.free.remove(&run);
        if run < start {
            self.free.insert(run, start - run);
        }
        if start + len < run + run_len {
            self.free.insert(start + len, run + run_len - (start + len));
        }
        self.free_blocks -= len;
        true
    }

    /// Up to `want` contiguous blocks, at `hint` if that block is free,
    /// else the first run at or after it, else the first run.
    fn alloc(&mut self, want: u64, hint: u64) -> Option<BlockRun> {
        let at_hint = self.free.range(..=hint).next_back().filter(|(&s, &l)| s <= hint && hint < s + l);
        let (start, avail) = if let Some((&s, &l)) = at_hint {
            (hint, s + l - hint)
        } else if let Some((&s, &l)) = self.free.range(hint..).next() {
            (s, l)
        } else {
            let (&s, &l) = self.free.iter().next()?;
            (s, l)
        };
        let len = want.min(avail);
        let carved = self.carve(start, len);
        debug_assert!(carved);
        Some(BlockRun { start, len })
    }
}

#[derive(Clone, Debug)]
pub struct Allocator {
    groups: Vec<Group>,
    data_start: u64,
    data_end: u64,
}

impl Allocator {
    /// Everything in [data_start, data_end) free, split into `groups`.
    pub fn new(data_start: u64, data_end: u64, groups: u32) -> Self {
        assert!(data_start < data_end && groups > 0);
        let total = data_end - data_start;
        let per = total.div_ceil(u64::from(groups)).max(1);
        let mut out = Vec::new();
        let mut s = data_start;
        while s < data_end {
            let e = (s + per).min(data_end);
            let mut free = BTreeMap::new();
            free.insert(s, e - s);
            out.push(Group { start: s, end: e, free, free_blocks: e - s });
            s = e;
        }
        Self { groups: out, data_start, data_end }
    }

    pub fn free_blocks(&self) -> u64 {
        self.groups.iter().map(|g| g.free_blocks).sum()
    }

    pub fn total_blocks(&self) -> u64 {
        self.data_end - self.data_start
    }

    fn group_of(&self, block: u64) -> Option<usize> {
        if block < self.data_start || block >= self.data_end {
            return None;
        }
        self.groups.iter().position(|g| g.start <= block && block < g.end)
    }

    /// Up to `want` contiguous blocks near `hint`, or in group `preferred`.
    /// Returns fewer blocks when no longer run is free; None when full.
    pub fn alloc(&mut self, want: u64, hint: Option<u64>, preferred: usize) -> Option<BlockRun> {
        assert!(want > 0);
        let first = hint.and_then(|h| self.group_of(h)).unwrap_or(preferred % self.groups.len());
        let n = self.groups.len();
        for i in 0..n {
            let g = (first + i) % n;
            let group = &mut self.groups[g];
            if group.free_blocks == 0 {
                continue;
            }
            let h = hint.filter(|_| i == 0).unwrap_or(group.start);
            if let Some(run) = group.alloc(want, h) {
                return Some(run);
            }
        }
        None
    }

    /// Mark a run used (loading an image). A run that is not wholly free is
    /// a double claim: the image is damaged.
    pub fn claim(&mut self, run: BlockRun) -> Result<(), AllocError> {
        let conflict = AllocError::Conflict { start: run.start, len: run.len };
        // Check every piece first, so a refused claim changes nothing.
        let mut pieces = Vec::new();
        let mut at = run.start;
        while at < run.end() {
            let g = self.group_of(at).ok_or(conflict.clone())?;
            let piece = (self.groups[g].end.min(run.end())) - at;
            if !self.groups[g].is_free(at, piece) {
                return Err(conflict);
            }
            pieces.push((g, at, piece));
            at += piece;
        }
        for (g, at, piece) in pieces {
            let carved = self.groups[g].carve(at, piece);
            debug_assert!(carved);
        }
        Ok(())
    }

    pub fn free(&mut self, run: BlockRun) {
        let mut at = run.start;
        while at < run.end() {
            let g = self.group_of(at).expect("freed blocks lie in the data area");
            let group = &mut self.groups[g];
            let piece = group.end.min(run.end()) - at;
            debug_assert!(
                group.free.range(..at + piece).next_back().is_none_or(|(&s, &l)| s + l <= at),
                "double free of block {at}"
            );
            group.insert_free(at, piece);
            group.free_blocks += piece;
            at += piece;
        }
    }

    /// The first free run that ends after `from`, cut to start no earlier
    /// than it (an fstrim's cursor), and at least `min_len` blocks long
    /// once cut.
    pub fn next_free_run(&self, from: u64, min_len: u64) -> Option<BlockRun> {
        for g in self.groups.iter().filter(|g| g.end > from) {
            let containing = g.free.range(..=from).next_back().filter(|(&s, &l)| s + l > from);
            let runs = containing.into_iter().chain(g.free.range(from + 1..));
            let mut cut = runs.map(|(&s, &l)| {
                let start = s.max(from);
                BlockRun { start, len: s + l - start }
            });
            if let Some(run) = cut.find(|r| r.len >= min_len) {
                return Some(run);
            }
        }
        None
    }

    /// Check the free index (tests and fuzzers, between operations): each
    /// group's runs lie inside it, are non-empty, in order, neither
    /// overlapping nor touching (freeing merges with both neighbours),
    /// and add up to its free count. Panics on the first that does not.
    pub fn check_invariants(&self) {
        let mut group_start = self.data_start;
        for g in &self.groups {
            assert_eq!(g.start, group_start, "allocation groups tile the data area");
            assert!(g.start < g.end && g.end <= self.data_end, "group [{}, {}) inside the data area", g.start, g.end);
            let mut previous_end = None;
            for (&start, &len) in &g.free {
                assert!(len > 0, "an empty free run at {start}");
                assert!(g.start <= start && start + len <= g.end, "free run [{start}, +{len}) outside its group");
                if let Some(end) = previous_end {
                    assert!(end < start, "free runs overlap or touch at {start}");
                }
                previous_end = Some(start + len);
            }
            assert_eq!(g.free.values().sum::<u64>(), g.free_blocks, "group at {}: its free count", g.start);
            group_start = g.end;
        }
        assert_eq!(group_start, self.data_end, "allocation groups tile the data area");
    }

    /// Whether every block of `run` lies in the data area.
    pub fn contains(&self, run: BlockRun) -> bool {
        self.data_start <= run.start && run.start.checked_add(run.len).is_some_and(|end| end <= self.data_end)
    }

    /// The free parts of `run`, in order; `run` must lie in the data area.
    pub fn free_within(&self, run: BlockRun) -> Vec<BlockRun> {
        let mut out = Vec::new();
        for g in self.groups.iter().filter(|g| g.start < run.end() && run.start < g.end) {
            let before = g.free.range(..run.start).next_back();
            for (&start, &len) in before.into_iter().chain(g.free.range(run.start..run.end())) {
                let (from, to) = (start.max(run.start), (start + len).min(run.end()));
                if from < to {
                    out.push(BlockRun { start: from, len: to - from });
                }
            }
        }
        out
    }

    /// The free runs, in order (for fsck and tests).
    pub fn free_runs(&self) -> Vec<BlockRun> {
        self.groups.iter().flat_map(|g| g.free.iter().map(|(&start, &len)| BlockRun { start, len })).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hinted_allocation_extends_in_place() {
        let mut a = Allocator::new(10, 1010, 4);
        let first = a.alloc(1, None, 0).unwrap();
        assert_eq!(first, BlockRun { start: 10, len: 1 });
        let mut end = first.end();
        for _ in 0..100 {
            let next = a.alloc(1, Some(end), 0).unwrap();
            assert_eq!(next.start, end, "sequential allocation continues the run");
            end = next.end();
        }
        assert_eq!(a.free_blocks(), 1000 - 101);
    }

    #[test]
    fn free_merges_and_claim_detects_double_use() {
        let mut a = Allocator::new(0, 100, 1);
        let r1 = a.alloc(10, None, 0).unwrap();
        let r2 = a.alloc(10, None, 0).unwrap();
        a.free(r1);
        a.free(r2);
        assert_eq!(a.free_runs(), vec![BlockRun { start: 0, len: 100 }]);
        a.claim(BlockRun { start: 5, len: 5 }).unwrap();
        assert!(a.claim(BlockRun { start: 8, len: 5 }).is_err());
        assert!(a.claim(BlockRun { start: 99, len: 5 }).is_err());
        assert_eq!(a.free_blocks(), 95);
    }

    #[test]
    fn next_free_run_skips_short_runs_and_resumes_inside_one() {
        let mut a = Allocator::new(0, 100, 2);
        a.claim(BlockRun { start: 2, len: 8 }).unwrap(); // free: [0,2) [10,50) [50,100)
        a.claim(BlockRun { start: 20, len: 1 }).unwrap(); // free: [0,2) [10,20) [21,50) [50,100)
        assert_eq!(a.next_free_run(0, 1), Some(BlockRun { start: 0, len: 2 }));
        assert_eq!(a.next_free_run(0, 20), Some(BlockRun { start: 21, len: 29 }));
        assert_eq!(a.next_free_run(30, 20), Some(BlockRun { start: 30, len: 20 }));
        assert_eq!(a.next_free_run(50, 1), Some(BlockRun { start: 50, len: 50 }));
        assert_eq!(a.next_free_run(100, 1), None);
    }

    #[test]
    fn next_free_run_measures_the_run_cut_at_the_cursor() {
        let mut a = Allocator::new(0, 100, 1);
        a.claim(BlockRun { start: 40, len: 10 }).unwrap(); // free: [0,40) [50,100)
                                                           // 5 blocks of [0,40) lie past the cursor: too short for 10.
        assert_eq!(a.next_free_run(35, 10), Some(BlockRun { start: 50, len: 50 }));
        assert_eq!(a.next_free_run(35, 5), Some(BlockRun { start: 35, len: 5 }));
        assert_eq!(a.next_free_run(95, 6), None);
    }

    #[test]
    fn allocation_spills_to_other_groups_and_reports_full() {
        let mut a = Allocator::new(0, 40, 4);
        let mut got = 0;
        while let Some(run) = a.alloc(7, None, 2) {
            got += run.len;
        }
        assert_eq!(got, 40);
        assert_eq!(a.free_blocks(), 0);
        a.check_invariants();
    }

    /// Random allocations and frees keep the index whole, and the check
    /// refuses an index whose count or runs are wrong.
    #[test]
    fn the_invariant_check_holds_through_changes_and_finds_damage() {
        let mut seed = 0x51_7cc1_b727_220a_u64;
        let mut next = |bound: u64| keelfs_base::testing::splitmix64(&mut seed) % bound;
        let mut a = Allocator::new(16, 1016, 3);
        let mut held = Vec::new();
        for _ in 0..if cfg!(miri) { 50 } else { 2000 } {
            if next(2) == 0 || held.is_empty() {
                held.extend(a.alloc(1 + next(40), Some(16 + next(1000)), next(3) as usize));
            } else {
                a.free(held.swap_remove(next(held.len() as u64) as usize));
            }
            a.check_invariants();
        }
        let damaged = |change: fn(&mut Allocator)| {
            let mut copy = Allocator::new(0, 100, 2);
            copy.claim(BlockRun { start: 10, len: 5 }).expect("free");
            change(&mut copy);
            std::panic::catch_unwind(|| copy.check_invariants()).is_err()
        };
        assert!(!damaged(|_| {}), "an index the allocator made passes");
        assert!(damaged(|a| a.groups[0].free_blocks += 1), "a free count off by one");
        assert!(
            damaged(|a| {
                a.groups[0].free.insert(12, 1);
            }),
            "a run inside another"
        );
        assert!(
            damaged(|a| {
                a.groups[0].free.insert(15, 0);
            }),
            "an empty run"
        );
        // Free [0, 10) and [15, 50): grow the first to touch the second,
        // with the count kept right.
        assert!(
            damaged(|a| {
                a.groups[0].free.insert(0, 15);
                a.groups[0].free_blocks += 5;
            }),
            "a run that touches the next"
        );
    }
}
