//! A file's extent map: file block -> device run, each written or
//! unwritten. An in-memory B-tree keyed by file block; adjacent compatible
//! extents merge, so sequential allocation yields one long extent.

use std::collections::BTreeMap;
use std::ops::RangeBounds;

use super::blocks::{DevBlock, FileBlock};
use super::format::BlockRun;

/// The pieces of a range of a file: inline up to four, so that a request
/// within one extent or two allocates nothing to find them.
pub type Segments = smallvec::SmallVec<[Segment; 4]>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub file_block: FileBlock,
    pub disk_block: DevBlock,
    pub len: u64,
    pub unwritten: bool,
}

impl Extent {
    pub fn file_end(&self) -> FileBlock {
        self.file_block + self.len
    }
}

/// One piece of a file range: mapped (maybe unwritten) or a hole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment {
    Hole { file_block: FileBlock, len: u64 },
    Mapped(Extent),
}

/// A mapping as the map keeps it: file block -> (disk block, len, unwritten).
type Entry = (u64, (u64, u64, bool));

/// Most files are small and written once: they have no extent or one.
/// Such a map costs one pointer in the node and, with one extent, a small
/// box; a B-tree's first leaf would cost about 380 bytes per file (issue
/// 34: memory per file). A second extent moves the map to a B-tree.
#[derive(Clone, Debug, Default)]
pub struct ExtentMap {
    repr: Option<Box<Repr>>,
}

#[derive(Clone, Debug)]
enum Repr {
    One(Entry),
    /// Two or more entries between calls: a change that leaves fewer
    /// settles to the small form, or to nothing.
    Tree(BTreeMap<u64, (u64, u64, bool)>),
}

impl PartialEq for ExtentMap {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for ExtentMap {}

/// The entries of a key range, from either representation, without
/// allocating (reads run on every request).
enum Entries<'a> {
    One(Option<Entry>),
    Tree(std::collections::btree_map::Range<'a, u64, (u64, u64, bool)>),
}

impl Iterator for Entries<'_> {
    type Item = Entry;
    fn next(&mut self) -> Option<Entry> {
        match self {
            Entries::One(one) => one.take(),
            Entries::Tree(range) => range.next().map(|(&k, &v)| (k, v)),
        }
    }
}

impl DoubleEndedIterator for Entries<'_> {
    fn next_back(&mut self) -> Option<Entry> {
        match self {
            Entries::One(one) => one.take(),
            Entries::Tree(range) => range.next_back().map(|(&k, &v)| (k, v)),
        }
    }
}

impl ExtentMap {
    pub fn len(&self) -> usize {
        match self.repr.as_deref() {
            None => 0,
            Some(Repr::One(_)) => 1,
            Some(Repr::Tree(map)) => map.len(),
        }
    }

    fn range(&self, keys: impl RangeBounds<u64>) -> Entries<'_> {
        match self.repr.as_deref() {
            None => Entries::One(None),
            Some(Repr::One(entry)) => Entries::One(keys.contains(&entry.0).then_some(*entry)),
            Some(Repr::Tree(map)) => Entries::Tree(map.range(keys)),
        }
    }

    /// The map as a B-tree, for the general case of a change.
    fn tree_mut(&mut self) -> &mut BTreeMap<u64, (u64, u64, bool)> {
        let repr = self.repr.get_or_insert_with(|| Box::new(Repr::Tree(BTreeMap::new())));
        if let Repr::One((k, v)) = **repr {
            **repr = Repr::Tree(BTreeMap::from([(k, v)]));
        }
        match &mut **repr {
            Repr::Tree(map) => map,
            Repr::One(_) => unreachable!("made a tree above"),
        }
    }

    /// After a general change: an empty map holds nothing, and a map of
    /// one extent goes back to its small form.
    fn settle(&mut self) {
        let Some(Repr::Tree(map)) = self.repr.as_deref() else { return };
        match map.len() {
            0 => self.repr = None,
            1 => {
                let (&k, &v) = map.iter().next().expect("one entry");
                self.repr = Some(Box::new(Repr::One((k, v))));
            }
            _ => {}
        }
    }

    /// Check the map (tests and fuzzers, between operations): the small
    /// form holds one extent and a tree two or more, as `settle` leaves
    /// them; every extent is non-empty, ends inside the block range on the
    /// file and on the device, and starts after the one before it ends.
    /// Panics on the first that does not hold.
    pub fn check_invariants(&self) {
        if let Some(Repr::Tree(map)) = self.repr.as_deref() {
            assert!(map.len() >= 2, "a tree of {} extents left unsettled", map.len());
        }
        let mut previous_end = None;
        for (file_block, (disk_block, len, _)) in self.range(..) {
            assert!(len > 0, "an empty extent at file block {file_block}");
            let file_end = file_block.checked_add(len).expect("an extent's file range overflows");
            disk_block.checked_add(len).expect("an extent's device range overflows");
            if let Some(end) = previous_end {
                assert!(end <= file_block, "extents overlap at file block {file_block}");
            }
            previous_end = Some(file_end);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = Extent> + '_ {
        self.range(..).map(|(file_block, (disk_block, len, unwritten))| Extent {
            file_block: FileBlock::new(file_block),
            disk_block: DevBlock::new(disk_block),
            len,
            unwritten,
        })
    }

    pub fn blocks(&self) -> u64 {
        self.range(..).map(|(_, (_, len, _))| len).sum()
    }

    /// The last mapped file block's device successor: the allocation hint
    /// for extending the file.
    pub fn hint_after(&self, file_block: FileBlock) -> Option<DevBlock> {
        let file_block = file_block.get();
        let (fb, (db, len, _)) = self.range(..=file_block).next_back()?;
        Some(DevBlock::new(db + (file_block - fb).min(len)))
    }

    /// The key of the extent holding `file_block`, or `file_block` itself
    /// when none does: where the extents meeting a range start.
    fn start_key(&self, file_block: u64) -> u64 {
        match self.range(..=file_block).next_back() {
            Some((k, (_, l, _))) if k + l > file_block => k,
            _ => file_block,
        }
    }

    /// Remove mappings in [file_block, +len), splitting extents at the
    /// edges. Returns the device runs that were unmapped.
    pub fn punch(&mut self, file_block: FileBlock, len: u64) -> Vec<BlockRun> {
        let freed = self.punch_unsettled(file_block, len);
        self.settle();
        freed
    }

    /// [`ExtentMap::punch`], leaving a B-tree a B-tree: [`ExtentMap::map`]
    /// inserts into it next, and settling in between would make the
    /// small form only to undo it.
    fn punch_unsettled(&mut self, file_block: FileBlock, len: u64) -> Vec<BlockRun> {
        let file_block = file_block.get();
        let end = file_block.saturating_add(len);
        let start_key = self.start_key(file_block);
        let mut freed = Vec::new();
        if self.range(start_key..end).next().is_none() {
            return freed;
        }
        let map = self.tree_mut();
        let overlapping: Vec<u64> = map.range(start_key..end).map(|(&k, _)| k).collect();
        for k in overlapping {
            let (db, l, unwritten) = map.remove(&k).expect("key from range");
            let (cut_start, cut_end) = (k.max(file_block), (k + l).min(end));
            if k < cut_start {
                map.insert(k, (db, cut_start - k, unwritten));
            }
            if cut_end < k + l {
                map.insert(cut_end, (db + (cut_end - k), k + l - cut_end, unwritten));
            }
            freed.push(BlockRun { start: db + (cut_start - k), len: cut_end - cut_start });
        }
        freed
    }

    /// Map [file_block, +len) to [disk_block, +len), replacing whatever was
    /// there (returned), and merging with neighbours that continue it.
    pub fn map(&mut self, file_block: FileBlock, disk_block: DevBlock, len: u64, unwritten: bool) -> Vec<BlockRun> {
        assert!(len > 0);
        // The small form's common changes: a file's first extent, and an
        // append that continues its one extent on the device.
        match self.repr.as_deref_mut() {
            None => {
                self.repr = Some(Box::new(Repr::One((file_block.get(), (disk_block.get(), len, unwritten)))));
                return Vec::new();
            }
            Some(Repr::One((k, (d, l, u))))
                if *k + *l == file_block.get() && *d + *l == disk_block.get() && *u == unwritten =>
            {
                *l += len;
                return Vec::new();
            }
            Some(_) => {}
        }
        if let Some(replaced) = self.map_within_one(file_block.get(), disk_block.get(), len, unwritten) {
            return replaced;
        }
        let replaced = self.punch_unsettled(file_block, len);
        let map = self.tree_mut();
        let (mut fb, mut db, mut l) = (file_block.get(), disk_block.get(), len);
        if let Some((&pk, &(pdb, pl, pu))) = map.range(..fb).next_back() {
            if pk + pl == fb && pdb + pl == db && pu == unwritten {
                map.remove(&pk);
                fb = pk;
                db = pdb;
                l += pl;
            }
        }
        if let Some(&(ndb, nl, nu)) = map.get(&(fb + l)) {
            if ndb == db + l && nu == unwritten {
                map.remove(&(fb + l));
                l += nl;
            }
        }
        map.insert(fb, (db, l, unwritten));
        self.settle();
        replaced
    }

    /// [`ExtentMap::map`] of a range within one extent of a tree, where
    /// the new extent merges with nothing: a copy on write into a shared
    /// extent, the common case once a clone is being rewritten. Four or
    /// so steps in the tree, where the general path takes about nine,
    /// each a walk down a tree that such writes grow to hundreds of
    /// thousands of entries. None when the case does not hold (nothing
    /// changed).
    fn map_within_one(&mut self, fb: u64, db: u64, len: u64, unwritten: bool) -> Option<Vec<BlockRun>> {
        let Some(Repr::Tree(map)) = self.repr.as_deref_mut() else { return None };
        let (end, new_end_db) = (fb.checked_add(len)?, db.checked_add(len)?);
        let (&k, &(old_db, old_len, old_unwritten)) = map.range(..=fb).next_back()?;
        let old_end = k + old_len;
        if end > old_end {
            return None; // (so fb < old_end too: len > 0)
        }
        let (head_end_db, tail_db) = (old_db + (fb - k), old_db + (end - k));
        // The merges the general path would make: with the pieces of this
        // extent left on either side, or, where the range reaches one of
        // its ends, with the extent beyond.
        let same_kind = old_unwritten == unwritten;
        if same_kind && (head_end_db == db || new_end_db == tail_db) {
            return None;
        }
        if fb == k {
            let before = map.range(..k).next_back();
            if before.is_some_and(|(&pk, &(pdb, pl, pu))| pk + pl == fb && pdb + pl == db && pu == unwritten) {
                return None;
            }
        }
        if end == old_end && map.get(&end).is_some_and(|&(ndb, _, nu)| ndb == new_end_db && nu == unwritten) {
            return None;
        }
        let kept = map.get_mut(&k).expect("found above");
        if fb > k {
            kept.1 = fb - k;
            map.insert(fb, (db, len, unwritten));
        } else {
            *kept = (db, len, unwritten);
        }
        if end < old_end {
            map.insert(end, (tail_db, old_end - end, old_unwritten));
        }
        Some(vec![BlockRun { start: head_end_db, len }])
    }

    /// The first written extent at or after `file_block`, cut to start
    /// there: what a scrub reads next.
    pub fn written_from(&self, file_block: FileBlock) -> Option<Extent> {
        let fb = file_block.get();
        let holding = self.range(..=fb).next_back().filter(|&(k, (_, l, unwritten))| k + l > fb && !unwritten);
        let (k, (db, l, _)) = holding.or_else(|| self.range(fb + 1..).find(|&(_, (_, _, unwritten))| !unwritten))?;
        let from = k.max(fb);
        Some(Extent {
            file_block: FileBlock::new(from),
            disk_block: DevBlock::new(db + (from - k)),
            len: k + l - from,
            unwritten: false,
        })
    }

    /// The pieces of [file_block, +len): mapped extents clipped to the
    /// range, and holes between them.
    pub fn segments(&self, file_block: FileBlock, len: u64) -> Segments {
        let file_block = file_block.get();
        let end = file_block.saturating_add(len);
        let mut out = Segments::new();
        let mut at = file_block;
        // The extent holding the first block, if any, in the step that
        // start_key would take: a range inside one extent (a 4 KiB write)
        // needs no second walk down the tree. Later extents start at or
        // past its end.
        if let Some((k, (db, l, unwritten))) = self.range(..=file_block).next_back() {
            let e = (k + l).min(end);
            if e > file_block {
                let disk_block = DevBlock::new(db + (file_block - k));
                out.push(Segment::Mapped(Extent {
                    file_block: FileBlock::new(file_block),
                    disk_block,
                    len: e - file_block,
                    unwritten,
                }));
                at = e;
            }
        }
        if at == end {
            return out;
        }
        for (k, (db, l, unwritten)) in self.range(at..end) {
            let s = k.max(at);
            if s > at {
                out.push(Segment::Hole { file_block: FileBlock::new(at), len: s - at });
            }
            let e = (k + l).min(end);
            if e > s {
                let (file_block, disk_block) = (FileBlock::new(s), DevBlock::new(db + (s - k)));
                out.push(Segment::Mapped(Extent { file_block, disk_block, len: e - s, unwritten }));
                at = e;
            }
        }
        if at < end {
            out.push(Segment::Hole { file_block: FileBlock::new(at), len: end - at });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_maps_merge_into_one_extent() {
        let mut m = ExtentMap::default();
        for i in 0..100 {
            m.map(FileBlock::new(i), DevBlock::new(1000 + i), 1, false);
        }
        assert_eq!(m.len(), 1);
        assert_eq!(m.blocks(), 100);
        m.map(FileBlock::new(100), DevBlock::new(5000), 1, false);
        assert_eq!(m.len(), 2, "a discontiguous device block starts a new extent");
    }

    #[test]
    fn punch_splits_and_reports_freed_runs() {
        let mut m = ExtentMap::default();
        m.map(FileBlock::new(0), DevBlock::new(100), 10, false);
        let freed = m.punch(FileBlock::new(3), 4);
        assert_eq!(freed, vec![BlockRun { start: 103, len: 4 }]);
        assert_eq!(
            m.segments(FileBlock::new(0), 12).to_vec(),
            vec![
                Segment::Mapped(Extent {
                    file_block: FileBlock::new(0),
                    disk_block: DevBlock::new(100),
                    len: 3,
                    unwritten: false
                }),
                Segment::Hole { file_block: FileBlock::new(3), len: 4 },
                Segment::Mapped(Extent {
                    file_block: FileBlock::new(7),
                    disk_block: DevBlock::new(107),
                    len: 3,
                    unwritten: false
                }),
                Segment::Hole { file_block: FileBlock::new(10), len: 2 },
            ]
        );
    }

    #[test]
    fn converting_unwritten_to_written_replaces_in_place() {
        let mut m = ExtentMap::default();
        m.map(FileBlock::new(0), DevBlock::new(100), 8, true);
        let replaced = m.map(FileBlock::new(2), DevBlock::new(102), 2, false);
        assert_eq!(replaced, vec![BlockRun { start: 102, len: 2 }]);
        assert_eq!(m.len(), 3);
        m.map(FileBlock::new(0), DevBlock::new(100), 2, false);
        m.map(FileBlock::new(4), DevBlock::new(104), 4, false);
        assert_eq!(m.len(), 1, "all written again: one extent");
    }

    /// Every block of [0, BLOCKS) as the map says: (disk block, unwritten).
    fn blockwise(m: &ExtentMap) -> Vec<Option<(u64, bool)>> {
        blockwise_range(m, 0, BLOCKS)
    }

    /// [from, +len) block by block, from `segments`, whose pieces must
    /// follow each other from `from` without a gap.
    fn blockwise_range(m: &ExtentMap, from: u64, len: u64) -> Vec<Option<(u64, bool)>> {
        let mut out = Vec::new();
        for segment in m.segments(FileBlock::new(from), len) {
            let start = match segment {
                Segment::Hole { file_block, .. } => file_block,
                Segment::Mapped(e) => e.file_block,
            };
            assert_eq!(start.get(), from + out.len() as u64, "segments follow each other");
            match segment {
                Segment::Hole { len, .. } => out.extend((0..len).map(|_| None)),
                Segment::Mapped(e) => out.extend((0..e.len).map(|i| Some((e.disk_block.get() + i, e.unwritten)))),
            }
        }
        out
    }

    const BLOCKS: u64 = 48;

    /// Random maps and punches against a model of one slot per block: the
    /// same blocks, the same freed runs, and extents always merged, in
    /// both the small form and the B-tree.
    #[test]
    fn random_changes_match_a_blockwise_model() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |bound: u64| keelfs_base::testing::splitmix64(&mut seed) % bound;
        // Miri interprets the rounds: fewer there take the same paths.
        let rounds = if cfg!(miri) { 10 } else { 200 };
        for _round in 0..rounds {
            let mut m = ExtentMap::default();
            let mut model: Vec<Option<(u64, bool)>> = vec![None; BLOCKS as usize];
            for _step in 0..40 {
                let fb = next(BLOCKS);
                let len = 1 + next(BLOCKS - fb);
                let before: Vec<u64> = model[fb as usize..(fb + len) as usize].iter().flatten().map(|b| b.0).collect();
                let mut freed: Vec<BlockRun> = if next(3) == 0 {
                    model[fb as usize..(fb + len) as usize].fill(None);
                    m.punch(FileBlock::new(fb), len)
                } else {
                    // Often continue the block before on the device, to merge.
                    let db = match (fb.checked_sub(1)).and_then(|p| model[p as usize]) {
                        Some((d, _)) if next(2) == 0 => d + 1,
                        _ => 1000 + next(4) * 100 + fb,
                    };
                    let unwritten = next(4) == 0;
                    for i in 0..len {
                        model[(fb + i) as usize] = Some((db + i, unwritten));
                    }
                    m.map(FileBlock::new(fb), DevBlock::new(db), len, unwritten)
                };
                freed.sort_by_key(|r| r.start);
                let mut freed_blocks: Vec<u64> = freed.iter().flat_map(|r| r.start..r.start + r.len).collect();
                let mut before = before;
                before.sort_unstable();
                freed_blocks.sort_unstable();
                assert_eq!(freed_blocks, before, "the runs a change frees are the blocks it replaced");
                assert_eq!(blockwise(&m), model);
                let from = next(BLOCKS);
                let span = next(BLOCKS - from + 1);
                let part = &model[from as usize..(from + span) as usize];
                assert_eq!(blockwise_range(&m, from, span), part, "segments of [{from}, +{span})");
                let extents: Vec<Extent> = m.iter().collect();
                assert_eq!(extents.len(), m.len());
                for pair in extents.windows(2) {
                    let mergeable = pair[0].file_end() == pair[1].file_block
                        && pair[0].disk_block + pair[0].len == pair[1].disk_block
                        && pair[0].unwritten == pair[1].unwritten;
                    assert!(!mergeable, "extents that continue each other are merged: {pair:?}");
                }
                assert_eq!(m.blocks(), model.iter().flatten().count() as u64);
                m.check_invariants();
            }
        }
    }

    /// The invariant check refuses what the map's own changes never
    /// leave: overlapping extents, an empty one, a tree of one.
    #[test]
    fn the_invariant_check_finds_a_broken_map() {
        let broken = |entries: &[Entry]| {
            let m = ExtentMap { repr: Some(Box::new(Repr::Tree(entries.iter().copied().collect()))) };
            std::panic::catch_unwind(|| m.check_invariants()).is_err()
        };
        assert!(!broken(&[(0, (100, 4, false)), (4, (300, 2, true))]), "a valid map passes");
        assert!(broken(&[(0, (100, 4, false)), (2, (300, 2, false))]), "overlapping extents");
        assert!(broken(&[(0, (100, 0, false)), (4, (300, 2, false))]), "an empty extent");
        assert!(broken(&[(0, (100, 4, false))]), "a tree of one extent");
        assert!(broken(&[(0, (100, 4, false)), (u64::MAX - 1, (300, 2, false))]), "a file range past the last block");
    }

    #[test]
    fn a_file_of_one_extent_keeps_the_small_form() {
        assert_eq!(std::mem::size_of::<ExtentMap>(), 8, "a pointer in every node");
        let mut m = ExtentMap::default();
        for i in 0..8 {
            m.map(FileBlock::new(i * 4), DevBlock::new(500 + i * 4), 4, false);
        }
        assert!(matches!(m.repr.as_deref(), Some(Repr::One((0, (500, 32, false))))));
        m.map(FileBlock::new(40), DevBlock::new(900), 1, false);
        assert!(matches!(m.repr.as_deref(), Some(Repr::Tree(_))));
        m.punch(FileBlock::new(40), 1);
        assert!(matches!(m.repr.as_deref(), Some(Repr::One(_))), "back to one extent, back to the small form");
        m.punch(FileBlock::new(0), 100);
        assert!(m.repr.is_none());
        assert_eq!(m, ExtentMap::default());
    }
}
