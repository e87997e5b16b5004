//! A file's extent map: file block -> device run, each written or
//! unwritten. An in-memory B-tree keyed by file block; adjacent compatible
//! extents merge, so sequential allocation yields one long extent.

use std::collections::BTreeMap;

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

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtentMap {
    /// file_block -> (disk_block, len, unwritten)
    map: BTreeMap<u64, (u64, u64, bool)>,
}

impl ExtentMap {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = Extent> + '_ {
        self.map.iter().map(|(&file_block, &(disk_block, len, unwritten))| Extent {
            file_block: FileBlock(file_block),
            disk_block: DevBlock(disk_block),
            len,
            unwritten,
        })
    }

    pub fn blocks(&self) -> u64 {
        self.map.values().map(|&(_, len, _)| len).sum()
    }

    /// The last mapped file block's device successor: the allocation hint
    /// for extending the file.
    pub fn hint_after(&self, file_block: FileBlock) -> Option<DevBlock> {
        let file_block = file_block.0;
        let (&fb, &(db, len, _)) = self.map.range(..=file_block).next_back()?;
        Some(DevBlock(db + (file_block - fb).min(len)))
    }

    /// Remove mappings in [file_block, +len), splitting extents at the
    /// edges. Returns the device runs that were unmapped.
    pub fn punch(&mut self, file_block: FileBlock, len: u64) -> Vec<BlockRun> {
        let file_block = file_block.0;
        let end = file_block.saturating_add(len);
        let mut freed = Vec::new();
        let overlapping: Vec<u64> = {
            let mut keys: Vec<u64> = self.map.range(file_block..end).map(|(&k, _)| k).collect();
            if let Some((&k, &(_, l, _))) = self.map.range(..file_block).next_back() {
                if k + l > file_block {
                    keys.insert(0, k);
                }
            }
            keys
        };
        for k in overlapping {
            let (db, l, unwritten) = self.map.remove(&k).expect("key from range");
            let (cut_start, cut_end) = (k.max(file_block), (k + l).min(end));
            if k < cut_start {
                self.map.insert(k, (db, cut_start - k, unwritten));
            }
            if cut_end < k + l {
                self.map.insert(cut_end, (db + (cut_end - k), k + l - cut_end, unwritten));
            }
            freed.push(BlockRun { start: db + (cut_start - k), len: cut_end - cut_start });
        }
        freed
    }

    /// Map [file_block, +len) to [disk_block, +len), replacing whatever was
    /// there (returned), and merging with neighbours that continue it.
    pub fn map(&mut self, file_block: FileBlock, disk_block: DevBlock, len: u64, unwritten: bool) -> Vec<BlockRun> {
        assert!(len > 0);
        let replaced = self.punch(file_block, len);
        let (mut fb, mut db, mut l) = (file_block.0, disk_block.0, len);
        if let Some((&pk, &(pdb, pl, pu))) = self.map.range(..fb).next_back() {
            if pk + pl == fb && pdb + pl == db && pu == unwritten {
                self.map.remove(&pk);
                fb = pk;
                db = pdb;
                l += pl;
            }
        }
        if let Some(&(ndb, nl, nu)) = self.map.get(&(fb + l)) {
            if ndb == db + l && nu == unwritten {
                self.map.remove(&(fb + l));
                l += nl;
            }
        }
        self.map.insert(fb, (db, l, unwritten));
        replaced
    }

    /// The pieces of [file_block, +len): mapped extents clipped to the
    /// range, and holes between them.
    pub fn segments(&self, file_block: FileBlock, len: u64) -> Segments {
        let file_block = file_block.0;
        let end = file_block.saturating_add(len);
        let mut out = Segments::new();
        let mut at = file_block;
        let start_key = match self.map.range(..=file_block).next_back() {
            Some((&k, &(_, l, _))) if k + l > file_block => k,
            _ => file_block,
        };
        for (&k, &(db, l, unwritten)) in self.map.range(start_key..end) {
            let s = k.max(at);
            if s > at {
                out.push(Segment::Hole { file_block: FileBlock(at), len: s - at });
            }
            let e = (k + l).min(end);
            if e > s {
                let (file_block, disk_block) = (FileBlock(s), DevBlock(db + (s - k)));
                out.push(Segment::Mapped(Extent { file_block, disk_block, len: e - s, unwritten }));
                at = e;
            }
        }
        if at < end {
            out.push(Segment::Hole { file_block: FileBlock(at), len: end - at });
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
            m.map(FileBlock(i), DevBlock(1000 + i), 1, false);
        }
        assert_eq!(m.len(), 1);
        assert_eq!(m.blocks(), 100);
        m.map(FileBlock(100), DevBlock(5000), 1, false);
        assert_eq!(m.len(), 2, "a discontiguous device block starts a new extent");
    }

    #[test]
    fn punch_splits_and_reports_freed_runs() {
        let mut m = ExtentMap::default();
        m.map(FileBlock(0), DevBlock(100), 10, false);
        let freed = m.punch(FileBlock(3), 4);
        assert_eq!(freed, vec![BlockRun { start: 103, len: 4 }]);
        assert_eq!(
            m.segments(FileBlock(0), 12).to_vec(),
            vec![
                Segment::Mapped(Extent {
                    file_block: FileBlock(0),
                    disk_block: DevBlock(100),
                    len: 3,
                    unwritten: false
                }),
                Segment::Hole { file_block: FileBlock(3), len: 4 },
                Segment::Mapped(Extent {
                    file_block: FileBlock(7),
                    disk_block: DevBlock(107),
                    len: 3,
                    unwritten: false
                }),
                Segment::Hole { file_block: FileBlock(10), len: 2 },
            ]
        );
    }

    #[test]
    fn converting_unwritten_to_written_replaces_in_place() {
        let mut m = ExtentMap::default();
        m.map(FileBlock(0), DevBlock(100), 8, true);
        let replaced = m.map(FileBlock(2), DevBlock(102), 2, false);
        assert_eq!(replaced, vec![BlockRun { start: 102, len: 2 }]);
        assert_eq!(m.len(), 3);
        m.map(FileBlock(0), DevBlock(100), 2, false);
        m.map(FileBlock(4), DevBlock(104), 4, false);
        assert_eq!(m.len(), 1, "all written again: one extent");
    }
}
