//! A directory's entries, packed: every entry is one record in a byte
//! arena, found by name through an open-addressing index of arena
//! offsets, and in cookie order by walking the arena.
//!
//! Why not a map by name beside a map by cookie: at a million 35-byte
//! names that cost about 190 bytes per entry (a hash slot, a B-tree slot
//! and a shared heap name); packed it is about 60 (issue 34). A record's
//! cookie and inode are varints: a directory's cookies and a filesystem's
//! inode numbers are small, so each takes 2 to 4 bytes instead of 8.
//!
//! Each entry carries a cookie, assigned once and never reused in the
//! directory, which is its stable readdir offset. Entries are appended in
//! cookie order (the live path takes cookies from a counter, and the
//! journal and checkpoint replay them in the order they were taken), so
//! the arena is sorted by cookie and a readdir from any cookie starts at
//! a binary search of a sparse index instead of at the first entry. A
//! record that would break the order comes from a crafted image, and is
//! refused.

use std::hash::BuildHasher;
use std::sync::OnceLock;

use super::format::NAME_MAX;
use super::ids::Ino;

/// Offsets 1 and 2 are "." and ".."; entries start at 3.
pub const FIRST_COOKIE: u64 = 3;

/// The largest arena a directory may have: offsets must fit the index's
/// u32 slots beside the two reserved values. About 8M entries of the
/// longest names, 40M of typical ones.
const ARENA_MAX: usize = 1 << 31;

/// One record: cookie and inode (0 once removed) as LEB128 varints, name
/// length, name. A removed record's inode keeps its width, written as a
/// padded zero (0x80 .. 0x80 0x00), so records never move on removal.
const HEADER_MAX: usize = VARINT_MAX + VARINT_MAX + 1;

/// The longest varint: 64 bits in 7-bit groups.
const VARINT_MAX: usize = 10;

fn varint_len(mut v: u64) -> usize {
    let mut len = 1;
    while v >= 0x80 {
        v >>= 7;
        len += 1;
    }
    len
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The varint at `at` (this module wrote it, padded zeros included), and
/// where the next field starts.
fn get_varint(buf: &[u8], at: usize) -> (u64, usize) {
    let (mut v, mut shift, mut i) = (0u64, 0, at);
    loop {
        let b = buf[i];
        v |= u64::from(b & 0x7f) << shift;
        i += 1;
        if b & 0x80 == 0 {
            return (v, i);
        }
        shift += 7;
        assert!(i - at < VARINT_MAX, "a varint of at most {VARINT_MAX} bytes");
    }
}

fn record_len(cookie: u64, ino: u64, name: &[u8]) -> usize {
    varint_len(cookie) + varint_len(ino) + 1 + name.len()
}

/// The index's reserved slot values: 0 is empty, this a removed entry
/// (probing goes on past it). Any other value is an arena offset + 1.
const EMPTY: u32 = 0;
const REMOVED: u32 = u32::MAX;

/// The index's slots: 16 bits while every arena offset fits them (a
/// directory of up to about 1,500 entries of 35-byte names, which is most
/// of them), 32 bits past that. Half the index's bytes for most
/// directories (issue 34: memory per file).
#[derive(Clone, Debug)]
enum Slots {
    Narrow(Vec<u16>),
    Wide(Vec<u32>),
}

/// REMOVED as a narrow slot holds it; values below it are as they are.
const NARROW_REMOVED: u16 = u16::MAX;

impl Slots {
    /// Whether a narrow index can hold the record at arena offset `at`.
    fn narrow_holds(at: usize) -> bool {
        at + 1 < usize::from(NARROW_REMOVED)
    }

    fn len(&self) -> usize {
        match self {
            Slots::Narrow(v) => v.len(),
            Slots::Wide(v) => v.len(),
        }
    }

    fn is_narrow(&self) -> bool {
        matches!(self, Slots::Narrow(_))
    }

    fn get(&self, slot: usize) -> u32 {
        match self {
            Slots::Narrow(v) if v[slot] == NARROW_REMOVED => REMOVED,
            Slots::Narrow(v) => u32::from(v[slot]),
            Slots::Wide(v) => v[slot],
        }
    }

    fn set(&mut self, slot: usize, value: u32) {
        match self {
            Slots::Narrow(v) if value == REMOVED => v[slot] = NARROW_REMOVED,
            Slots::Narrow(v) => v[slot] = u16::try_from(value).ok().filter(|&n| n != NARROW_REMOVED).expect("fits"),
            Slots::Wide(v) => v[slot] = value,
        }
    }

    /// `size` empty slots, of the width given, reusing the allocation when
    /// the width stays.
    fn reset(&mut self, size: usize, narrow: bool) {
        match self {
            Slots::Narrow(v) if narrow => {
                v.clear();
                v.resize(size, EMPTY as u16);
            }
            Slots::Wide(v) if !narrow => {
                v.clear();
                v.resize(size, EMPTY);
            }
            _ if narrow => *self = Slots::Narrow(vec![EMPTY as u16; size]),
            _ => *self = Slots::Wide(vec![EMPTY; size]),
        }
    }

    fn fill_empty(&mut self) {
        match self {
            Slots::Narrow(v) => v.fill(EMPTY as u16),
            Slots::Wide(v) => v.fill(EMPTY),
        }
    }
}

impl Default for Slots {
    fn default() -> Self {
        Slots::Narrow(Vec::new())
    }
}

/// An emptied directory keeps buffers up to this size for its next entries.
const EMPTY_KEEP_BYTES: usize = 64 << 10;

/// Every this many records appended, one (cookie, offset) pair is kept for
/// the binary search that starts a readdir.
const SPARSE_EVERY: u32 = 32;

/// Names are chosen by the guest, so they are hashed with a keyed hash
/// (SipHash, with a key drawn once per process): a guest cannot make its
/// names collide without the key.
fn name_hash(name: &[u8]) -> u64 {
    static KEY: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    KEY.get_or_init(Default::default).hash_one(name)
}

/// Why an entry cannot be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DirError {
    #[error("the directory is full")]
    Full,
    #[error("cookie {cookie} is not above the directory's last ({last})")]
    CookieOrder { cookie: u64, last: u64 },
    #[error("an entry may not name inode 0")]
    InodeZero,
    #[error("a name of {0} bytes")]
    BadName(usize),
}

/// A directory's entries; see the module's notes.
#[derive(Clone, Debug)]
pub struct Directory {
    pub parent: Ino,
    arena: Vec<u8>,
    /// Power-of-two sized (or empty); at most 70% used, counting removed
    /// slots, so that a probe for a missing name ends after a few slots.
    index: Slots,
    sparse: Vec<(u64, u32)>,
    live: u32,
    /// Records in the arena, live or removed.
    records: u32,
    /// Index slots that hold REMOVED.
    removed_slots: u32,
    /// Bytes of the arena's live records.
    live_bytes: usize,
    /// The largest cookie ever inserted (0 before the first): the next
    /// insert must be above it, which keeps the arena in cookie order.
    last_cookie: u64,
    next_cookie: u64,
    /// ARENA_MAX, or less in tests that fill a directory.
    arena_max: usize,
}

/// One record read from the arena.
struct Entry<'a> {
    cookie: u64,
    ino: u64,
    /// Where the inode's varint lies, to zero it on removal.
    ino_span: std::ops::Range<usize>,
    name: &'a [u8],
    /// Where the next record starts.
    end: usize,
}

impl Directory {
    pub fn new(parent: Ino) -> Self {
        Self {
            parent,
            arena: Vec::new(),
            index: Slots::default(),
            sparse: Vec::new(),
            live: 0,
            records: 0,
            removed_slots: 0,
            live_bytes: 0,
            last_cookie: 0,
            next_cookie: FIRST_COOKIE,
            arena_max: ARENA_MAX,
        }
    }

    /// A directory that fills at `arena_max` bytes, for tests.
    #[cfg(test)]
    fn with_arena_max(parent: Ino, arena_max: usize) -> Self {
        Self { arena_max, ..Self::new(parent) }
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// The cookie the next entry will get: every entry now has a smaller one.
    pub fn cookie_end(&self) -> u64 {
        self.next_cookie
    }

    pub fn take_cookie(&mut self) -> u64 {
        let c = self.next_cookie;
        self.next_cookie += 1;
        c
    }

    /// Whether an entry named `name` can be added (after removing what is
    /// removed, the arena stays within its bound).
    pub fn has_room(&self, name: &[u8]) -> bool {
        self.live_bytes + HEADER_MAX + name.len() <= self.arena_max && self.live < u32::MAX / 2
    }

    fn entry_at(&self, at: usize) -> Entry<'_> {
        let a = &self.arena;
        let (cookie, ino_at) = get_varint(a, at);
        let (ino, len_at) = get_varint(a, ino_at);
        let len = usize::from(a[len_at]);
        let name = &a[len_at + 1..len_at + 1 + len];
        Entry { cookie, ino, ino_span: ino_at..len_at, name, end: len_at + 1 + len }
    }

    /// The index slot that holds `name` (whose hash is `hash`), or None.
    fn find_slot(&self, name: &[u8], hash: u64) -> Option<usize> {
        if self.index.len() == 0 {
            return None;
        }
        let mask = self.index.len() - 1;
        let mut slot = hash as usize & mask;
        // Triangular probing visits every slot of a power-of-two table, and
        // at most 70% are used, so an empty one ends the walk.
        for step in 1..=self.index.len() {
            match self.index.get(slot) {
                EMPTY => return None,
                REMOVED => {}
                v => {
                    let e = self.entry_at(v as usize - 1);
                    if e.name == name {
                        return Some(slot);
                    }
                }
            }
            slot = (slot + step) & mask;
        }
        unreachable!("the index always has an empty slot")
    }

    pub fn lookup(&self, name: &[u8]) -> Option<Ino> {
        self.find_slot(name, name_hash(name)).map(|s| Ino::new(self.entry_at(self.index.get(s) as usize - 1).ino))
    }

    /// Entries with cookie >= `from`, in cookie order: (cookie, name, ino).
    pub fn entries_from(&self, from: u64) -> impl Iterator<Item = (u64, &[u8], Ino)> + '_ {
        // The last sampled record at or before `from`; records before it
        // all have smaller cookies.
        let start = match self.sparse.partition_point(|&(c, _)| c <= from) {
            0 => 0,
            i => self.sparse[i - 1].1 as usize,
        };
        let mut at = start;
        std::iter::from_fn(move || {
            while at < self.arena.len() {
                let e = self.entry_at(at);
                at = e.end;
                if e.ino != 0 && e.cookie >= from {
                    return Some((e.cookie, e.name, Ino::new(e.ino)));
                }
            }
            None
        })
    }

    /// Add `name` -> `ino` with `cookie`, replacing an entry of that name.
    pub fn insert(&mut self, name: &[u8], ino: Ino, cookie: u64) -> Result<(), DirError> {
        let ino = ino.get();
        if name.is_empty() || name.len() > NAME_MAX {
            return Err(DirError::BadName(name.len()));
        }
        if ino == 0 {
            return Err(DirError::InodeZero);
        }
        if cookie <= self.last_cookie {
            return Err(DirError::CookieOrder { cookie, last: self.last_cookie });
        }
        let hash = name_hash(name);
        self.remove_hashed(name, hash);
        if !self.has_room(name) {
            return Err(DirError::Full);
        }
        let len = record_len(cookie, ino, name);
        if self.arena.len() + len > self.arena_max {
            self.compact();
        }
        self.grow_index_for_one_more();
        let at = self.arena.len();
        self.reserve_arena(len);
        put_varint(&mut self.arena, cookie);
        put_varint(&mut self.arena, ino);
        self.arena.push(name.len() as u8);
        self.arena.extend_from_slice(name);
        if self.records.is_multiple_of(SPARSE_EVERY) {
            self.sparse.push((cookie, at as u32));
        }
        self.records += 1;
        self.live += 1;
        self.live_bytes += len;
        debug_assert_eq!(self.arena.len(), at + len);
        if place_in(&mut self.index, hash, at) {
            self.removed_slots -= 1;
        }
        self.last_cookie = cookie;
        self.next_cookie = self.next_cookie.max(cookie + 1);
        Ok(())
    }

    /// Remove `name`, returning the inode it named.
    pub fn remove(&mut self, name: &[u8]) -> Option<Ino> {
        self.remove_hashed(name, name_hash(name)).map(Ino::new)
    }

    fn remove_hashed(&mut self, name: &[u8], hash: u64) -> Option<u64> {
        let slot = self.find_slot(name, hash)?;
        let at = self.index.get(slot) as usize - 1;
        let entry = self.entry_at(at);
        let (ino, ino_span, len) = (entry.ino, entry.ino_span, entry.end - at);
        // Zero in the same width: 0x80 continues, the last byte ends.
        let last = ino_span.end - 1;
        self.arena[ino_span.start..last].fill(0x80);
        self.arena[last] = 0;
        self.index.set(slot, REMOVED);
        self.removed_slots += 1;
        self.live -= 1;
        self.live_bytes -= len;
        if self.live == 0 {
            self.empty_out();
            return Some(ino);
        }
        // Removed records are dropped once they outweigh the live ones, so
        // the arena stays within twice its live bytes (plus a floor that
        // keeps small directories from compacting at every removal).
        if self.arena.len() - self.live_bytes > self.live_bytes.max(4096) {
            self.compact();
        }
        Some(ino)
    }

    /// Grow the arena by 1/4 at a time rather than doubling: at a million
    /// entries the difference is most of a megabyte per directory of
    /// slack, and the copies stay amortized O(1).
    fn reserve_arena(&mut self, more: usize) {
        let need = self.arena.len() + more;
        if need > self.arena.capacity() {
            let grown = (self.arena.capacity() + self.arena.capacity() / 4).max(need).max(256);
            self.arena.reserve_exact(grown.min(self.arena_max) - self.arena.len());
        }
    }

    /// Make room in the index for one more entry, at the arena's end.
    fn grow_index_for_one_more(&mut self) {
        let used = (self.live + self.removed_slots + 1) as usize;
        if used * 10 > self.index.len() * 7 {
            let size = ((self.live as usize + 1) * 10 / 5).next_power_of_two().max(8);
            self.rebuild_index(size);
        } else if self.index.is_narrow() && !Slots::narrow_holds(self.arena.len()) {
            self.rebuild_index(self.index.len());
        }
    }

    /// Index every live record again, in a table of `size` slots. The
    /// table's allocation is reused when it is large enough.
    fn rebuild_index(&mut self, size: usize) {
        debug_assert!(size.is_power_of_two() && size * 7 >= (self.live as usize + 1) * 10);
        let mut index = std::mem::take(&mut self.index);
        // Narrow if it holds the next record too (at the arena's end).
        index.reset(size, Slots::narrow_holds(self.arena.len()));
        let mut at = 0;
        while at < self.arena.len() {
            let e = self.entry_at(at);
            if e.ino != 0 {
                place_in(&mut index, name_hash(e.name), at);
            }
            at = e.end;
        }
        self.index = index;
        self.removed_slots = 0;
    }

    /// No entries left: drop every record, keeping the buffers of a small
    /// directory (one that fills and empties again, a build's temporary
    /// directory, allocates nothing) and freeing a large one's. Cookies
    /// stay: they are never reused.
    fn empty_out(&mut self) {
        if self.arena.capacity() > EMPTY_KEEP_BYTES {
            (self.arena, self.index, self.sparse) = (Vec::new(), Slots::default(), Vec::new());
        } else {
            self.arena.clear();
            self.sparse.clear();
            self.index.fill_empty();
        }
        (self.records, self.removed_slots) = (0, 0);
    }

    /// Drop removed records, moving the live ones down in place: they keep
    /// their order and cookies, so open readdirs are unaffected, and
    /// nothing is allocated unless the arena is far larger than it needs.
    fn compact(&mut self) {
        self.sparse.clear();
        let (mut read, mut write, mut records) = (0, 0, 0u32);
        while read < self.arena.len() {
            let e = self.entry_at(read);
            let (live, cookie, end) = (e.ino != 0, e.cookie, e.end);
            if live {
                if records.is_multiple_of(SPARSE_EVERY) {
                    self.sparse.push((cookie, write as u32));
                }
                self.arena.copy_within(read..end, write);
                write += end - read;
                records += 1;
            }
            read = end;
        }
        debug_assert_eq!(records, self.live);
        debug_assert_eq!(write, self.live_bytes);
        self.arena.truncate(write);
        if self.arena.capacity() > 4 * write.max(EMPTY_KEEP_BYTES) {
            self.arena.shrink_to(2 * write);
        }
        self.records = records;
        if self.live == 0 {
            self.empty_out();
        } else {
            self.rebuild_index(((self.live as usize + 1) * 10 / 5).next_power_of_two().max(8));
        }
    }
}

/// Put the record at `at` into `index`, in the first free slot of its
/// probe sequence. True if that slot held a removed entry.
fn place_in(index: &mut Slots, hash: u64, at: usize) -> bool {
    let mask = index.len() - 1;
    let mut slot = hash as usize & mask;
    let mut step = 1;
    while index.get(slot) != EMPTY && index.get(slot) != REMOVED {
        slot = (slot + step) & mask;
        step += 1;
    }
    let was_removed = index.get(slot) == REMOVED;
    index.set(slot, at as u32 + 1);
    was_removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_a_padded_zero_reads_as_zero() {
        for v in [0, 1, 127, 128, 16_383, 16_384, u64::from(u32::MAX), u64::MAX >> 1, u64::MAX] {
            let mut buf = vec![0xaa];
            put_varint(&mut buf, v);
            assert_eq!(buf.len() - 1, varint_len(v));
            assert_eq!(get_varint(&buf, 1), (v, buf.len()));
        }
        assert_eq!(varint_len(u64::MAX), VARINT_MAX);
        assert_eq!(get_varint(&[0x80, 0x80, 0x80, 0x00, 0x55], 0), (0, 4));
    }

    /// Removing an entry whose inode takes several varint bytes leaves its
    /// neighbours readable, in order, with their inodes.
    #[test]
    fn removal_keeps_wide_records_in_place() {
        let mut d = Directory::new(Ino::new(1));
        let inos = [5, 300, 1 << 40, u64::MAX - 1, 77];
        for (i, &ino) in inos.iter().enumerate() {
            d.insert(format!("n{i}").as_bytes(), Ino::new(ino), FIRST_COOKIE + (i as u64) * 1000).expect("insert");
        }
        assert_eq!(d.remove(b"n2").map(Ino::get), Some(1 << 40));
        assert_eq!(d.remove(b"n3").map(Ino::get), Some(u64::MAX - 1));
        let left: Vec<u64> = d.entries_from(0).map(|(_, _, ino)| ino.get()).collect();
        assert_eq!(left, vec![5, 300, 77]);
        assert_eq!(d.lookup(b"n4").map(Ino::get), Some(77));
        assert_eq!(d.lookup(b"n2").map(Ino::get), None);
    }

    fn names(d: &Directory, from: u64) -> Vec<(u64, String, u64)> {
        d.entries_from(from).map(|(c, n, i)| (c, String::from_utf8_lossy(n).into_owned(), i.get())).collect()
    }

    /// Against a model (a map by name and one by cookie, as the
    /// directory was before it was packed), through a long random mix of
    /// inserts, replacements and removals: every lookup and every listing
    /// from every cookie agree.
    #[test]
    fn agrees_with_a_model_through_random_changes() {
        use std::collections::{BTreeMap, HashMap};
        let mut seed = 34u64;
        let mut below = |n: u64| keelfs_base::testing::splitmix64(&mut seed) % n;
        let mut d = Directory::new(Ino::new(1));
        let mut by_name: HashMap<Vec<u8>, (u64, u64)> = HashMap::new();
        let mut by_cookie: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        for step in 0..20_000u64 {
            let name = format!("n{}-{}", below(3000), "x".repeat(below(40) as usize)).into_bytes();
            if below(3) == 0 {
                let got = d.remove(&name).map(Ino::get);
                let want = by_name.remove(&name).map(|(ino, cookie)| {
                    by_cookie.remove(&cookie);
                    ino
                });
                assert_eq!(got, want, "remove at step {step}");
            } else {
                let cookie = d.take_cookie();
                let ino = step + 1;
                d.insert(&name, Ino::new(ino), cookie).expect("insert");
                if let Some((_, old)) = by_name.insert(name.clone(), (ino, cookie)) {
                    by_cookie.remove(&old);
                }
                by_cookie.insert(cookie, name.clone());
            }
            assert_eq!(d.live as usize, by_name.len());
            if step % 997 == 0 {
                for (n, &(ino, _)) in &by_name {
                    assert_eq!(d.lookup(n).map(Ino::get), Some(ino));
                }
                let from = FIRST_COOKIE + below(d.cookie_end());
                let want: Vec<_> = by_cookie
                    .range(from..)
                    .map(|(&c, n)| (c, String::from_utf8_lossy(n).into_owned(), by_name[n].0))
                    .collect();
                assert_eq!(names(&d, from), want, "listing from {from} at step {step}");
            }
        }
        assert!(d.arena.len() <= 2 * d.live_bytes.max(4096) + HEADER_MAX + NAME_MAX, "removed records are dropped");
    }

    #[test]
    fn readdir_from_a_cookie_resumes_after_it() {
        let mut d = Directory::new(Ino::new(1));
        for i in 0..200u64 {
            let c = d.take_cookie();
            d.insert(format!("f{i}").as_bytes(), Ino::new(10 + i), c).unwrap();
        }
        let all = names(&d, 0);
        assert_eq!(all.len(), 200);
        for (k, (cookie, _, _)) in all.iter().enumerate() {
            assert_eq!(names(&d, cookie + 1), all[k + 1..].to_vec());
        }
        assert!(d.remove(b"f0").is_some() && d.lookup(b"f0").is_none());
        assert_eq!(names(&d, 0), all[1..].to_vec(), "a removed entry is not listed");
    }

    /// Records a crafted image could hold are refused, not trusted.
    #[test]
    fn hostile_entries_are_refused() {
        let mut d = Directory::new(Ino::new(1));
        d.insert(b"a", Ino::new(5), 10).unwrap();
        assert_eq!(d.insert(b"b", Ino::new(6), 10), Err(DirError::CookieOrder { cookie: 10, last: 10 }));
        assert_eq!(d.insert(b"b", Ino::new(6), 4), Err(DirError::CookieOrder { cookie: 4, last: 10 }));
        assert_eq!(d.insert(b"c", Ino::new(0), 11), Err(DirError::InodeZero));
        assert_eq!(d.insert(b"", Ino::new(6), 11), Err(DirError::BadName(0)));
        assert_eq!(d.insert(&[b'x'; 256], Ino::new(6), 11), Err(DirError::BadName(256)));
        assert_eq!(names(&d, 0), vec![(10, "a".to_string(), 5)], "nothing refused was added");
    }

    /// The index widens when the arena passes what 16-bit slots can hold,
    /// and narrows again when compaction brings it back, finding every
    /// name throughout.
    #[test]
    fn the_index_widens_and_narrows_with_the_arena() {
        let mut d = Directory::new(Ino::new(1));
        let name = |i: u64| format!("a-name-of-about-thirty-bytes-{i:06}");
        let mut count = 0;
        while d.index.is_narrow() {
            let c = d.take_cookie();
            d.insert(name(count).as_bytes(), Ino::new(count + 2), c).unwrap();
            count += 1;
            assert!(count < 10_000, "the index widens");
        }
        assert!(d.arena.len() > 60_000, "narrow slots served until the arena outgrew them");
        for i in 0..count {
            assert_eq!(d.lookup(name(i).as_bytes()).map(Ino::get), Some(i + 2));
        }
        for i in 0..count - 100 {
            assert_eq!(d.remove(name(i).as_bytes()).map(Ino::get), Some(i + 2));
        }
        assert!(d.index.is_narrow(), "compaction narrowed the index again");
        for i in 0..count {
            assert_eq!(d.lookup(name(i).as_bytes()).map(Ino::get), (i >= count - 100).then_some(i + 2));
        }
        assert_eq!(
            d.remove(name(count - 1).as_bytes()).map(Ino::get),
            Some(count + 1),
            "a removal through a narrow slot"
        );
        assert_eq!(d.entries_from(0).count(), 99);
    }

    /// A full directory refuses a new entry, and takes one again once a
    /// removal makes room (the removed record compacted away first).
    #[test]
    fn a_full_directory_refuses_entries_until_one_is_removed() {
        let mut d = Directory::with_arena_max(Ino::new(1), 1000);
        // 10 bytes; cookies and inodes below 128 take a byte each: 13 a record.
        let name = |i: u64| format!("entry-{i:04}");
        let mut added = 0;
        while d.has_room(name(added).as_bytes()) {
            let c = d.take_cookie();
            d.insert(name(added).as_bytes(), Ino::new(added + 2), c).unwrap();
            added += 1;
        }
        // Room is judged by the widest record a name can make.
        assert_eq!(added as usize, (1000 - (HEADER_MAX + 10)) / 13 + 1);
        let c = d.take_cookie();
        assert_eq!(d.insert(name(added).as_bytes(), Ino::new(99), c), Err(DirError::Full));
        assert!(d.lookup(name(added).as_bytes()).is_none(), "a refused entry is not added");
        assert!(d.arena.len() <= 1000);
        d.remove(name(0).as_bytes()).unwrap();
        let c = d.take_cookie();
        d.insert(name(added).as_bytes(), Ino::new(99), c).expect("room again after a removal");
        assert!(d.arena.len() <= 1000, "the removed record was compacted away to make room");
        assert_eq!(d.entries_from(0).count(), added as usize);
    }

    /// A removal that empties the directory drops every record; a small
    /// directory keeps its buffers for the next entries, a large one
    /// gives them back.
    #[test]
    fn an_emptied_directory_holds_nothing() {
        for (count, kept) in [(1000u64, true), (5000, false)] {
            let mut d = Directory::new(Ino::new(1));
            let name = |i: u64| format!("file-with-a-longer-name-{i:06}");
            for i in 0..count {
                let c = d.take_cookie();
                d.insert(name(i).as_bytes(), Ino::new(i + 2), c).unwrap();
            }
            for i in 0..count {
                assert_eq!(d.remove(name(i).as_bytes()).map(Ino::get), Some(i + 2));
            }
            assert!(d.is_empty() && d.arena.is_empty() && d.entries_from(0).next().is_none());
            assert_eq!(d.cookie_end(), FIRST_COOKIE + count, "cookies are never reused");
            assert_eq!(d.arena.capacity() > 0, kept, "{count} entries: buffers kept only when small");
            assert!(d.arena.capacity() <= EMPTY_KEEP_BYTES);
            let c = d.take_cookie();
            d.insert(b"again", Ino::new(7), c).unwrap();
            assert_eq!(
                (d.lookup(b"again").map(Ino::get), d.lookup(name(0).as_bytes()).map(Ino::get)),
                (Some(7), None),
                "usable again"
            );
        }
    }
}
