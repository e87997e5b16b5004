//! The inode table: every resident inode, found by number.
//!
//! Inode numbers come from a counter, so the live ones cluster. The table
//! groups them in pages of [`PAGE_SLOTS`] consecutive numbers, each page a
//! small index and a dense vector of its items. Against a hash map of boxed
//! nodes this saves, per inode, the allocator's header and rounding (16
//! bytes) and the map's slot with its share of empty ones (about 27 bytes);
//! and the map that remains, one entry per page, is 64 times smaller, so a
//! lookup's probe mostly hits the cache (issue 34: memory and mount time at
//! scale).
//!
//! An image chooses its inode numbers, so numbers may also be sparse: a
//! page with one item costs, by the types' sizes, less than twice what a
//! boxed node in a hash map did (about 340 bytes against 220).

use keelfs_base::IdMap;

use crate::ids::Ino;

/// Consecutive inode numbers per page.
pub const PAGE_SLOTS: usize = 64;

/// An index entry for a slot with no item.
const EMPTY: u8 = u8::MAX;

const _: () = assert!(PAGE_SLOTS < EMPTY as usize, "an item's index fits below EMPTY");

struct Page<T> {
    /// Slot -> position in `items`, or EMPTY.
    index: [u8; PAGE_SLOTS],
    /// In no order; never more than PAGE_SLOTS, and never empty while the
    /// page is in the table.
    items: Vec<T>,
}

impl<T> Page<T> {
    fn new() -> Self {
        Page { index: [EMPTY; PAGE_SLOTS], items: Vec::new() }
    }

    fn push(&mut self, slot: usize, item: T) {
        assert!(self.index[slot] == EMPTY);
        assert!(self.items.len() < PAGE_SLOTS);
        if self.items.len() == self.items.capacity() {
            // Doubling up to exactly a page: a page filled in order ends
            // with no spare capacity.
            let target = (self.items.capacity() * 2).clamp(1, PAGE_SLOTS);
            self.items.reserve_exact(target - self.items.len());
        }
        self.index[slot] = self.items.len() as u8;
        self.items.push(item);
    }

    fn take(&mut self, slot: usize) -> Option<T> {
        let at = self.index[slot];
        if at == EMPTY {
            return None;
        }
        self.index[slot] = EMPTY;
        let last = self.items.len() - 1;
        let item = self.items.swap_remove(usize::from(at));
        if usize::from(at) != last {
            // The last item moved into the hole: point its slot there.
            let moved = self.index.iter().position(|&i| usize::from(i) == last).expect("every item has a slot");
            self.index[moved] = at;
        }
        if self.items.capacity() > 4 && self.items.len() * 4 <= self.items.capacity() {
            self.items.shrink_to(self.items.len() * 2);
        }
        Some(item)
    }
}

/// Items keyed by inode number; see the module's comment.
pub struct NodeTable<T> {
    pages: IdMap<Page<T>>,
    len: usize,
}

impl<T> Default for NodeTable<T> {
    fn default() -> Self {
        NodeTable { pages: IdMap::default(), len: 0 }
    }
}

fn split(ino: Ino) -> (u64, usize) {
    let ino = ino.get();
    (ino / PAGE_SLOTS as u64, (ino % PAGE_SLOTS as u64) as usize)
}

impl<T> NodeTable<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn get(&self, ino: Ino) -> Option<&T> {
        let (page, slot) = split(ino);
        let page = self.pages.get(&page)?;
        let at = page.index[slot];
        (at != EMPTY).then(|| &page.items[usize::from(at)])
    }

    pub fn get_mut(&mut self, ino: Ino) -> Option<&mut T> {
        let (page, slot) = split(ino);
        let page = self.pages.get_mut(&page)?;
        let at = page.index[slot];
        (at != EMPTY).then(|| &mut page.items[usize::from(at)])
    }

    /// Put `item` at `ino`, returning what was there.
    pub fn insert(&mut self, ino: Ino, item: T) -> Option<T> {
        let (page, slot) = split(ino);
        let page = self.pages.entry(page).or_insert_with(Page::new);
        match page.index[slot] {
            EMPTY => {
                page.push(slot, item);
                self.len += 1;
                None
            }
            at => Some(std::mem::replace(&mut page.items[usize::from(at)], item)),
        }
    }

    pub fn remove(&mut self, ino: Ino) -> Option<T> {
        let (page_no, slot) = split(ino);
        let page = self.pages.get_mut(&page_no)?;
        let item = page.take(slot)?;
        if page.items.is_empty() {
            self.pages.remove(&page_no);
        }
        self.len -= 1;
        Some(item)
    }

    /// Every inode number present, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = Ino> + '_ {
        self.pages.iter().flat_map(|(&page, p)| {
            let base = page * PAGE_SLOTS as u64;
            p.index
                .iter()
                .enumerate()
                .filter(|&(_, &at)| at != EMPTY)
                .map(move |(slot, _)| Ino::new(base + slot as u64))
        })
    }

    /// Every item, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &T> + '_ {
        self.pages.values().flat_map(|p| p.items.iter())
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> + '_ {
        self.pages.values_mut().flat_map(|p| p.items.iter_mut())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Random inserts, replacements and removals over dense and sparse
    /// numbers agree with a B-tree: lookups, length, keys and values.
    #[test]
    fn random_changes_match_a_map() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |bound: u64| keelfs_base::testing::splitmix64(&mut seed) % bound;
        let mut table = NodeTable::default();
        let mut model = BTreeMap::new();
        for step in 0..20_000u64 {
            // Mostly a few dense pages, sometimes far apart.
            let ino = Ino::new(if next(10) == 0 { next(u64::MAX / 2) } else { next(300) });
            if next(3) == 0 {
                assert_eq!(table.remove(ino), model.remove(&ino));
            } else {
                assert_eq!(table.insert(ino, step), model.insert(ino, step));
            }
            assert_eq!(table.get(ino), model.get(&ino));
            assert_eq!(table.len(), model.len());
        }
        let mut keys: Vec<Ino> = table.keys().collect();
        keys.sort_unstable();
        assert_eq!(keys, model.keys().copied().collect::<Vec<_>>());
        for ino in keys {
            assert_eq!(table.get(ino), model.get(&ino));
            *table.get_mut(ino).expect("present") += 1;
        }
        let mut values: Vec<u64> = table.values().copied().collect();
        values.sort_unstable();
        let mut expected: Vec<u64> = model.values().map(|v| v + 1).collect();
        expected.sort_unstable();
        assert_eq!(values, expected);
    }

    #[test]
    fn a_page_filled_in_order_has_no_spare_room_and_empties_away() {
        let mut table = NodeTable::default();
        for ino in 64..128 {
            table.insert(Ino::new(ino), ino);
        }
        assert_eq!(table.pages.len(), 1);
        assert_eq!(table.pages[&1].items.capacity(), PAGE_SLOTS);
        for ino in 64..126 {
            assert_eq!(table.remove(Ino::new(ino)), Some(ino));
        }
        assert!(table.pages[&1].items.capacity() <= 8, "a page shrinks as it empties");
        assert_eq!(table.get(Ino::new(126)), Some(&126));
        assert_eq!(table.remove(Ino::new(126)), Some(126));
        assert_eq!(table.remove(Ino::new(127)), Some(127));
        assert!(table.pages.is_empty(), "an empty page is dropped");
        assert_eq!(table.remove(Ino::new(127)), None);
    }
}
