//! The daemon's page cache: 4 KiB pages of file data, bounded, with 2Q
//! replacement so that a one-pass scan cannot flush the working set.
//!
//! 2Q (Johnson and Shasha, 1994): a page seen for the first time enters
//! A1in, a FIFO of a quarter of the cache. Pages leaving A1in are
//! remembered (key only) in the ghost list A1out. A page missed again while
//! its key is in A1out has proven reuse and enters Am, an LRU. A scan only
//! ever cycles through A1in.
//!
//! Dirty pages are never evicted: writeback cleans them first. Memory is
//! the configured capacity plus about 300 bytes of bookkeeping per page
//! (measured, with the allocator's slack: bench/RESULTS.md).
//!
//! Page memory is shared with readers on other cores ([`super::shared`]):
//! every change to a page's bytes or identity goes through the slot's
//! sequence number, so the owner stores through methods here, never
//! through a `&mut [u8]`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::shared::{PageOwner, SharedPages};
use crate::ids::Ino;
use keelfs_base::SeededState;

pub const PAGE_BYTES: usize = 4096;

pub type PageKey = (Ino, u64); // (inode, page index)

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Queue {
    A1in,
    Am,
}

struct Slot {
    key: PageKey,
    dirty: bool,
    /// Delayed allocation: a block is reserved for this page's hole.
    reserved: bool,
    queue: Queue,
    /// For Am's lazy LRU: the stamp of this page's newest queue entry.
    stamp: u64,
    live: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub pages: u64,
    pub dirty_pages: u64,
    pub capacity_pages: u64,
    /// Reads served on other cores straight from the cache, and those
    /// that had to go to the owner.
    pub shared_hits: u64,
    pub shared_misses: u64,
    /// Shared reads that collided with a change and tried again.
    pub shared_retries: u64,
    /// Pages cached but invisible to shared reads (both of their hint
    /// buckets were full).
    pub shared_hints_dropped: u64,
}

pub struct PageCache {
    capacity: usize,
    /// Page data, slot i at [i * PAGE_BYTES, (i + 1) * PAGE_BYTES): one
    /// allocation made up front (calloc'd, so untouched pages cost no
    /// memory), no per-page allocation or fragmentation. Shared with
    /// readers on other cores.
    shared: Arc<SharedPages>,
    /// The right to write `shared`'s bytes: stores take it `&mut`, views
    /// of a page borrow it.
    owner: PageOwner,
    /// Slots opened by a write in progress ([`Self::write_open`]).
    open_slots: Vec<u32>,
    /// Where a write's bytes land before they are stored into a page as
    /// atomic words; kept so that no write pays for zeroing a page.
    staging: Box<[u8]>,
    a1in_target: usize,
    a1out_max: usize,
    /// Keyed by guest-chosen offsets, so seeded (`SeededState`).
    map: HashMap<PageKey, u32, SeededState>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    a1in: VecDeque<u32>,
    am: VecDeque<(u32, u64)>,
    am_len: usize,
    a1out: VecDeque<PageKey>,
    a1out_set: HashSet<PageKey, SeededState>,
    by_inode: keelfs_base::IdMapBy<Ino, BTreeSet<u64>>,
    dirty: BTreeMap<Ino, BTreeSet<u64>>,
    dirty_count: usize,
    stamp: u64,
    stats: CacheStats,
}

/// Every page is dirty: write some back before inserting more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheFull;

impl PageCache {
    pub fn new(capacity_bytes: u64) -> Self {
        let capacity = ((capacity_bytes as usize) / PAGE_BYTES).max(16);
        let (shared, owner) = SharedPages::new(capacity);
        Self {
            capacity,
            shared: Arc::new(shared),
            owner,
            open_slots: Vec::new(),
            staging: vec![0u8; PAGE_BYTES].into_boxed_slice(),
            a1in_target: (capacity / 4).max(1),
            a1out_max: (capacity / 2).max(1),
            map: HashMap::with_capacity_and_hasher(capacity, SeededState::default()),
            slots: Vec::new(),
            free: Vec::new(),
            a1in: VecDeque::new(),
            am: VecDeque::new(),
            am_len: 0,
            a1out: VecDeque::new(),
            a1out_set: HashSet::default(),
            by_inode: keelfs_base::IdMapBy::default(),
            dirty: BTreeMap::new(),
            dirty_count: 0,
            stamp: 0,
            stats: CacheStats { capacity_pages: capacity as u64, ..CacheStats::default() },
        }
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            pages: self.map.len() as u64,
            dirty_pages: self.dirty_count as u64,
            shared_hits: self.shared.remote_hits(),
            shared_misses: self.shared.remote_misses(),
            shared_retries: self.shared.remote_retries(),
            shared_hints_dropped: self.shared.hints_dropped(),
            ..self.stats
        }
    }

    /// Check the cache's bookkeeping against its pages (tests and
    /// fuzzers, between operations): every cached page sits in a live
    /// slot under its own key and in its inode's set, the dirty flags, the
    /// dirty index and the dirty count agree, and the cache holds no more
    /// than its capacity. Panics on the first that does not hold; returns
    /// how many pages hold a block reservation, for [`crate::space`]'s
    /// check.
    pub(crate) fn check_invariants(&self) -> u64 {
        let (mut dirty, mut reserved) = (0usize, 0u64);
        for (key, &slot) in &self.map {
            let s = &self.slots[slot as usize];
            assert!(s.live && s.key == *key, "page {key:?}: its slot {slot} holds {:?} (live {})", s.key, s.live);
            let indexed = self.by_inode.get(&key.0).is_some_and(|pages| pages.contains(&key.1));
            assert!(indexed, "page {key:?} is cached but not in its inode's set");
            let dirty_indexed = self.dirty.get(&key.0).is_some_and(|pages| pages.contains(&key.1));
            assert_eq!(s.dirty, dirty_indexed, "page {key:?}: the dirty flag and the dirty index disagree");
            dirty += usize::from(s.dirty);
            reserved += u64::from(s.reserved);
        }
        assert_eq!(self.slots.iter().filter(|s| s.live).count(), self.map.len(), "live slots against cached pages");
        assert_eq!(self.by_inode.values().map(BTreeSet::len).sum::<usize>(), self.map.len(), "the per-inode sets");
        assert_eq!(dirty, self.dirty_count, "the dirty count");
        assert_eq!(self.dirty.values().map(BTreeSet::len).sum::<usize>(), dirty, "the dirty index");
        assert!(self.map.len() <= self.capacity, "{} pages cached, capacity {}", self.map.len(), self.capacity);
        reserved
    }

    pub(crate) fn shared(&self) -> &Arc<SharedPages> {
        &self.shared
    }

    pub fn capacity_pages(&self) -> usize {
        self.capacity
    }

    pub fn dirty_pages(&self) -> usize {
        self.dirty_count
    }

    /// Pages that can be inserted without evicting a dirty one.
    pub fn clean_or_free_slots(&self) -> usize {
        self.capacity - self.dirty_count
    }

    fn touch(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if s.queue == Queue::Am {
            self.stamp += 1;
            s.stamp = self.stamp;
            self.am.push_back((slot, self.stamp));
            if self.am.len() > 4 * self.capacity {
                self.compact_am();
            }
        }
    }

    fn compact_am(&mut self) {
        let slots = &self.slots;
        self.am.retain(|&(slot, stamp)| {
            let s = &slots[slot as usize];
            s.live && s.queue == Queue::Am && s.stamp == stamp
        });
    }

    /// A cached page, counted as a hit or a miss.
    pub fn get(&mut self, key: PageKey) -> Option<&[u8]> {
        match self.map.get(&key).copied() {
            Some(slot) => {
                self.stats.hits += 1;
                self.touch(slot);
                Some(self.page(slot))
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Count lookups that found a page missing without calling `get`.
    pub fn note_misses(&mut self, n: u64) {
        self.stats.misses += n;
    }

    pub fn contains(&self, key: PageKey) -> bool {
        self.map.contains_key(&key)
    }

    /// A cached page, without counting a hit or touching its recency
    /// (writeback's view).
    pub fn peek(&self, key: PageKey) -> Option<&[u8]> {
        self.map.get(&key).map(|&slot| self.page(slot))
    }

    /// Zero bytes [from, to) of a cached page, if cached.
    pub fn zero(&mut self, key: PageKey, from: usize, to: usize) {
        if let Some(&slot) = self.map.get(&key) {
            self.shared.open(slot);
            self.shared.zero(&mut self.owner, slot, from, to);
            self.shared.close(slot);
        }
    }

    /// Zero bytes [offset, end) of `ino` in whichever of its pages are
    /// cached. The walk follows the inode's cached pages, not the range, so
    /// its length is bounded by the cache whatever range a client names.
    pub fn zero_range(&mut self, ino: Ino, offset: u64, end: u64) {
        debug_assert!(offset < end);
        let page_bytes = PAGE_BYTES as u64;
        let (first, last) = (offset / page_bytes, (end - 1) / page_bytes);
        let pages: Vec<u64> =
            self.by_inode.get(&ino).map(|s| s.range(first..=last).copied().collect()).unwrap_or_default();
        for page in pages {
            let start = page * page_bytes;
            let from = offset.max(start) - start;
            let to = end.min(start + page_bytes) - start;
            self.zero((ino, page), from as usize, to as usize);
        }
    }

    /// A write spanning several pages: open each page before changing it
    /// ([`Self::write_open`]), and close them all together at the end
    /// ([`Self::write_close`]), so that a reader on another core sees all
    /// of the write or none of it.
    ///
    /// `fill` writes the `len` bytes to store at `at`.
    pub fn write_open(&mut self, key: PageKey, at: usize, len: usize, fill: impl FnOnce(&mut [u8])) -> bool {
        let Some(&slot) = self.map.get(&key) else { return false };
        self.touch(slot);
        if !self.open_slots.contains(&slot) {
            self.shared.open(slot);
            self.open_slots.push(slot);
        }
        let staged = &mut self.staging[..len];
        fill(staged);
        self.shared.store(&mut self.owner, slot, at, staged);
        true
    }

    pub fn write_close(&mut self) {
        for slot in self.open_slots.drain(..) {
            self.shared.close(slot);
        }
    }

    /// Add a page holding `data` (replacing a cached copy), evicting a
    /// clean page if the cache is full.
    pub fn insert(&mut self, key: PageKey, data: &[u8]) -> Result<(), CacheFull> {
        assert_eq!(data.len(), PAGE_BYTES);
        if let Some(&slot) = self.map.get(&key) {
            assert!(!self.open_slots.contains(&slot), "a page replaced during a write to it");
            self.shared.open(slot);
            self.shared.store(&mut self.owner, slot, 0, data);
            self.shared.close(slot);
            return Ok(());
        }
        if self.map.len() >= self.capacity {
            self.evict_one().ok_or(CacheFull)?;
        }
        let queue = if self.a1out_set.remove(&key) { Queue::Am } else { Queue::A1in };
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                assert!(self.slots.len() < self.capacity, "slots never outnumber the arena");
                self.slots.push(Slot { key, dirty: false, reserved: false, queue, stamp: 0, live: false });
                (self.slots.len() - 1) as u32
            }
        };
        // Not yet published: no reader can match this slot until then.
        self.shared.store(&mut self.owner, slot, 0, data);
        let s = &mut self.slots[slot as usize];
        s.key = key;
        s.dirty = false;
        s.reserved = false;
        s.queue = queue;
        s.live = true;
        match queue {
            Queue::A1in => self.a1in.push_back(slot),
            Queue::Am => {
                self.am_len += 1;
                self.stamp += 1;
                s.stamp = self.stamp;
                self.am.push_back((slot, self.stamp));
            }
        }
        self.map.insert(key, slot);
        self.by_inode.entry(key.0).or_default().insert(key.1);
        self.shared.publish(slot, key);
        Ok(())
    }

    fn page(&self, slot: u32) -> &[u8] {
        self.shared.page(&self.owner, slot)
    }

    /// Evict one clean page: from A1in while it is over its share, else the
    /// least recently used page of Am. Returns None if all are dirty.
    fn evict_one(&mut self) -> Option<()> {
        let prefer_a1in = self.a1in.len() > self.a1in_target || self.am_len == 0;
        let order = if prefer_a1in { [Queue::A1in, Queue::Am] } else { [Queue::Am, Queue::A1in] };
        for q in order {
            let victim = match q {
                Queue::A1in => self.pop_clean_a1in(),
                Queue::Am => self.pop_clean_am(),
            };
            if let Some(slot) = victim {
                self.drop_slot(slot, q == Queue::A1in);
                self.stats.evictions += 1;
                return Some(());
            }
        }
        None
    }

    fn pop_clean_a1in(&mut self) -> Option<u32> {
        for _ in 0..self.a1in.len() {
            let slot = self.a1in.pop_front()?;
            if !self.slots[slot as usize].dirty {
                return Some(slot);
            }
            self.a1in.push_back(slot);
        }
        None
    }

    fn pop_clean_am(&mut self) -> Option<u32> {
        let mut skipped = Vec::new();
        let mut found = None;
        while let Some((slot, stamp)) = self.am.pop_front() {
            let s = &self.slots[slot as usize];
            if !s.live || s.queue != Queue::Am || s.stamp != stamp {
                continue; // a stale entry
            }
            if s.dirty {
                skipped.push((slot, stamp));
                continue;
            }
            if self.shared.take_referenced(slot) {
                // Read on another core since it was last used here: its
                // second chance, as if the owner had read it. The bit is
                // now clear, so this loop ends.
                self.stamp += 1;
                self.slots[slot as usize].stamp = self.stamp;
                self.am.push_back((slot, self.stamp));
                continue;
            }
            found = Some(slot);
            break;
        }
        for e in skipped.into_iter().rev() {
            self.am.push_front(e);
        }
        found
    }

    fn drop_slot(&mut self, slot: u32, remember: bool) {
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.live && !s.dirty);
        let key = s.key;
        self.shared.retire(slot, key);
        if s.queue == Queue::Am {
            self.am_len -= 1;
        }
        s.live = false;
        self.map.remove(&key);
        if let Some(set) = self.by_inode.get_mut(&key.0) {
            set.remove(&key.1);
            if set.is_empty() {
                self.by_inode.remove(&key.0);
            }
        }
        if remember {
            self.a1out.push_back(key);
            self.a1out_set.insert(key);
            while self.a1out.len() > self.a1out_max {
                if let Some(old) = self.a1out.pop_front() {
                    self.a1out_set.remove(&old);
                }
            }
        }
        self.free.push(slot);
    }

    pub fn mark_dirty(&mut self, key: PageKey) {
        let Some(&slot) = self.map.get(&key) else { return };
        let s = &mut self.slots[slot as usize];
        if !s.dirty {
            s.dirty = true;
            self.dirty_count += 1;
            self.dirty.entry(key.0).or_default().insert(key.1);
        }
    }

    pub fn mark_clean(&mut self, key: PageKey) {
        let Some(&slot) = self.map.get(&key) else { return };
        let s = &mut self.slots[slot as usize];
        if s.dirty {
            s.dirty = false;
            self.dirty_count -= 1;
            if let Some(set) = self.dirty.get_mut(&key.0) {
                set.remove(&key.1);
                if set.is_empty() {
                    self.dirty.remove(&key.0);
                }
            }
        }
    }

    pub fn is_reserved(&self, key: PageKey) -> bool {
        self.map.get(&key).is_some_and(|&s| self.slots[s as usize].reserved)
    }

    pub fn set_reserved(&mut self, key: PageKey) {
        if let Some(&slot) = self.map.get(&key) {
            self.slots[slot as usize].reserved = true;
        }
    }

    /// Clear the page's reservation; true if it had one.
    pub fn take_reserved(&mut self, key: PageKey) -> bool {
        match self.map.get(&key) {
            Some(&slot) => std::mem::take(&mut self.slots[slot as usize].reserved),
            None => false,
        }
    }

    pub fn is_dirty(&self, key: PageKey) -> bool {
        self.map.get(&key).is_some_and(|&s| self.slots[s as usize].dirty)
    }

    /// Dirty page indices of `ino` in [from, to), in order.
    pub fn dirty_of(&self, ino: Ino, from: u64, to: u64) -> Vec<u64> {
        self.dirty.get(&ino).map(|set| set.range(from..to).copied().collect()).unwrap_or_default()
    }

    /// Inodes with dirty pages.
    pub fn dirty_inodes(&self) -> Vec<Ino> {
        self.dirty.keys().copied().collect()
    }

    /// Drop every cached page of `ino` at or after page `from`, dirty or
    /// not (the data is gone: truncation or deletion). Returns how many
    /// block reservations went with them.
    pub fn discard(&mut self, ino: Ino, from: u64) -> u64 {
        let pages: Vec<u64> = self.by_inode.get(&ino).map(|s| s.range(from..).copied().collect()).unwrap_or_default();
        let mut released = 0;
        for page in pages {
            released += u64::from(self.take_reserved((ino, page)));
            self.mark_clean((ino, page));
            if let Some(&slot) = self.map.get(&(ino, page)) {
                if let Some(pos) = self.a1in.iter().position(|&s| s == slot) {
                    self.a1in.remove(pos);
                }
                self.drop_slot(slot, false);
            }
        }
        released
    }

    /// Drop clean cached pages of `ino` in [from, to).
    pub fn discard_clean_range(&mut self, ino: Ino, from: u64, to: u64) {
        let pages: Vec<u64> = self.by_inode.get(&ino).map(|s| s.range(from..to).copied().collect()).unwrap_or_default();
        for page in pages {
            if self.is_dirty((ino, page)) {
                continue;
            }
            if let Some(&slot) = self.map.get(&(ino, page)) {
                if let Some(pos) = self.a1in.iter().position(|&s| s == slot) {
                    self.a1in.remove(pos);
                }
                self.drop_slot(slot, false);
            }
        }
    }

    pub fn has_pages(&self, ino: Ino, from: u64, to: u64) -> bool {
        self.by_inode.get(&ino).is_some_and(|s| s.range(from..to).next().is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Ino;

    fn page(v: u8) -> Vec<u8> {
        vec![v; PAGE_BYTES]
    }

    #[test]
    fn bounded_and_dirty_pages_stay() {
        let mut c = PageCache::new(16 * PAGE_BYTES as u64);
        for i in 0..16 {
            c.insert((Ino::new(1), i), &page(i as u8)).unwrap();
            c.mark_dirty((Ino::new(1), i));
        }
        assert_eq!(c.insert((Ino::new(1), 99), &page(0)), Err(CacheFull));
        c.mark_clean((Ino::new(1), 3));
        c.insert((Ino::new(1), 99), &page(9)).unwrap();
        assert!(!c.contains((Ino::new(1), 3)), "the only clean page was evicted");
        assert_eq!(c.get((Ino::new(1), 5)).unwrap()[0], 5);
        assert_eq!(c.stats().pages, 16);
    }

    #[test]
    fn a_scan_does_not_flush_the_hot_set() {
        let mut c = PageCache::new(64 * PAGE_BYTES as u64);
        // Make pages 0..20 hot: seen, evicted to the ghost list by other
        // traffic, then seen again.
        for round in 0..6 {
            for i in 0..20 {
                if c.get((Ino::new(1), i)).is_none() {
                    c.insert((Ino::new(1), i), &page(1)).unwrap();
                }
            }
            for i in 0..30 {
                c.insert((Ino::new(2), round * 1000 + i), &page(2)).unwrap();
            }
        }
        // A long scan of cold pages.
        for i in 0..10_000 {
            c.insert((Ino::new(3), i), &page(3)).unwrap();
        }
        let hot = (0..20).filter(|&i| c.contains((Ino::new(1), i))).count();
        assert_eq!(hot, 20, "the scan evicted hot pages");
    }

    #[test]
    fn discard_drops_pages_and_dirty_state() {
        let mut c = PageCache::new(64 * PAGE_BYTES as u64);
        for i in 0..10 {
            c.insert((Ino::new(7), i), &page(0)).unwrap();
            c.mark_dirty((Ino::new(7), i));
        }
        c.set_reserved((Ino::new(7), 5));
        assert_eq!(c.discard(Ino::new(7), 4), 1);
        assert_eq!(c.dirty_pages(), 4);
        assert_eq!(c.dirty_of(Ino::new(7), 0, u64::MAX), vec![0, 1, 2, 3]);
        assert!(!c.contains((Ino::new(7), 4)));
    }
}
