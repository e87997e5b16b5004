//! Cached reads from other cores.
//!
//! An [`super::Fs`] belongs to one reactor, but its cached pages can be read
//! from any thread without a lock, so that readers on one core never queue
//! behind writers on the owning core (seed 004). The owner is the only
//! writer; readers take optimistic snapshots and validate them with
//! sequence counters, as Linux's seqlocks do:
//!
//! - every page slot has a sequence number, odd while the owner changes the
//!   slot's contents or its identity (which page of which file it holds);
//! - every file opened for shared reads has one too, odd while the owner
//!   changes its size or makes a change that spans steps (truncate, an
//!   extending write);
//! - a reader notes the sequences, copies, and accepts the copy only if no
//!   sequence moved. A write spanning pages makes all of them odd before
//!   changing any, so a read sees all of a write or none of it.
//!
//! Page data lives in atomic words: readers load them while the owner may
//! be storing, and atomic accesses make that race defined. The owner reads
//! its own pages as plain bytes (no other thread ever stores).
//!
//! A reader finds a page's slot through a table of hints: two candidate
//! buckets of 8 entries (one cache line each) per page, an entry holding
//! the slot and a fingerprint of the page's key. A hint can be missing or
//! stale, which only sends the read to the owner. The table is at most
//! half full; filling a cache of 65,536 pages lost no hint (unit test
//! `a_full_cache_keeps_a_hint_for_every_page`). A miss of any page sends
//! the whole read to the owner.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use keelfs_base::IdMapBy;

use super::cache::{PageKey, PAGE_BYTES};
use super::seqlock::{self, Seq};
use crate::ids::FileOffset;

const WORDS_PER_PAGE: usize = PAGE_BYTES / 8;
const NO_INODE: u64 = u64::MAX;
/// Attempts before a read that keeps colliding with writes goes to the
/// owner instead. A write holds its pages for about a microsecond, and
/// sending the read to a busy owner costs far more than waiting.
const READ_ATTEMPTS: usize = 64;
const BUCKET_ENTRIES: usize = 8;
/// Larger reads go to the owner (their page list would not fit the stack).
const SHARED_READ_PAGES_MAX: usize = 64;

struct SlotTag {
    seq: Seq,
    ino: AtomicU64,
    page: AtomicU64,
    /// Set by remote readers, cleared by the owner's eviction: the owner's
    /// replacement policy cannot see remote hits otherwise.
    referenced: AtomicBool,
}

/// Counters of shared reads, readable by anyone.
#[derive(Default)]
struct SharedCounters {
    hits: AtomicU64,
    misses: AtomicU64,
    retries: AtomicU64,
    /// Pages whose two hint buckets were both full.
    hints_dropped: AtomicU64,
}

/// The right to write a [`SharedPages`]' bytes, held by its one owner.
///
/// A store takes it by `&mut`, and the owner's byte view of a page
/// borrows it: so the borrow checker, not a comment, keeps every store
/// out of the lifetime of a view. Made only with its arena, and matched to
/// it by id.
pub(crate) struct PageOwner {
    arena: u64,
}

/// The page cache's memory, shared with readers on other cores.
pub(crate) struct SharedPages {
    /// Matches its [`PageOwner`].
    id: u64,
    words: Box<[AtomicU64]>,
    tags: Box<[SlotTag]>,
    /// Buckets of [`BUCKET_ENTRIES`] hints: (fingerprint << 32) | (slot + 1),
    /// 0 for none.
    hints: Box<[AtomicU64]>,
    bucket_mask: usize,
    counters: SharedCounters,
}

/// A zeroed array of atomics from calloc, so that untouched pages cost no
/// memory.
fn zeroed_words(n: usize) -> Box<[AtomicU64]> {
    let words = vec![0u64; n].into_boxed_slice();
    let raw = Box::into_raw(words);
    // SAFETY: AtomicU64 has the size, alignment and bit validity of u64
    // (std documents it), so a boxed [u64] of n elements is a valid boxed
    // [AtomicU64] of n elements, freed with the same layout.
    unsafe { Box::from_raw(raw as *mut [AtomicU64]) }
}

impl SharedPages {
    /// An arena of `slots` pages, and the right to write it.
    pub(crate) fn new(slots: usize) -> (Self, PageOwner) {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let buckets = (slots * 2 / BUCKET_ENTRIES).next_power_of_two().max(2);
        let arena = Self {
            id,
            words: zeroed_words(slots * WORDS_PER_PAGE),
            tags: (0..slots)
                .map(|_| SlotTag {
                    seq: Seq::default(),
                    ino: AtomicU64::new(NO_INODE),
                    page: AtomicU64::new(0),
                    referenced: AtomicBool::new(false),
                })
                .collect(),
            hints: zeroed_words(buckets * BUCKET_ENTRIES),
            bucket_mask: buckets - 1,
            counters: SharedCounters::default(),
        };
        (arena, PageOwner { arena: id })
    }

    fn page_words(&self, slot: u32) -> &[AtomicU64] {
        let at = slot as usize * WORDS_PER_PAGE;
        &self.words[at..at + WORDS_PER_PAGE]
    }

    /// The owner's view of a page.
    ///
    /// Only stores change a page's bytes, and each needs `&mut PageOwner`,
    /// which this borrow of the owner excludes for as long as the slice
    /// lives; other threads only load. So the bytes do not change while
    /// the slice exists.
    pub(crate) fn page<'a>(&'a self, owner: &'a PageOwner, slot: u32) -> &'a [u8] {
        assert_eq!(owner.arena, self.id, "the owner of another arena");
        let words = self.page_words(slot);
        // SAFETY: the words are PAGE_BYTES of initialized memory, aligned
        // for u8. No store can run during the returned borrow, which holds
        // `owner` shared while every store needs it exclusive; concurrent
        // atomic loads by readers do not conflict with plain reads.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), PAGE_BYTES) }
    }

    /// Owner: store `src` at byte `at` of a slot. Call inside
    /// [`Self::open`]/[`Self::close`] if the slot is published.
    pub(crate) fn store(&self, owner: &mut PageOwner, slot: u32, at: usize, src: &[u8]) {
        assert_eq!(owner.arena, self.id, "the owner of another arena");
        assert!(at + src.len() <= PAGE_BYTES);
        let words = self.page_words(slot);
        // A partial first word, whole words, a partial last word.
        let head = ((8 - at % 8) % 8).min(src.len());
        if head > 0 {
            self.merge(&words[at / 8], at % 8, &src[..head]);
        }
        let body = &src[head..];
        let first = (at + head) / 8;
        let whole = body.chunks_exact(8);
        let tail = whole.remainder();
        for (word, bytes) in words[first..].iter().zip(whole) {
            word.store(u64::from_ne_bytes(bytes.try_into().expect("8 bytes")), Ordering::Relaxed);
        }
        if !tail.is_empty() {
            self.merge(&words[first + body.len() / 8], 0, tail);
        }
    }

    /// Owner: store `bytes` into one word at byte `at` of it.
    fn merge(&self, word: &AtomicU64, at: usize, bytes: &[u8]) {
        let mut value = word.load(Ordering::Relaxed).to_ne_bytes();
        value[at..at + bytes.len()].copy_from_slice(bytes);
        word.store(u64::from_ne_bytes(value), Ordering::Relaxed);
    }

    /// Owner: set bytes [from, to) of a slot to zero.
    pub(crate) fn zero(&self, owner: &mut PageOwner, slot: u32, from: usize, to: usize) {
        const ZEROS: [u8; PAGE_BYTES] = [0; PAGE_BYTES];
        self.store(owner, slot, from, &ZEROS[..to - from]);
    }

    /// Owner: start changing a slot (its sequence becomes odd).
    pub(crate) fn open(&self, slot: u32) {
        self.tags[slot as usize].seq.open();
    }

    /// Owner: the change of a slot is complete.
    pub(crate) fn close(&self, slot: u32) {
        self.tags[slot as usize].seq.close();
    }

    /// The two buckets (as index ranges into `hints`) where `key`'s hint
    /// may be, and its fingerprint.
    fn buckets(&self, key: PageKey) -> ([std::ops::Range<usize>; 2], u64) {
        let h = key.0.get().wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ key.1.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
        let h = (h ^ (h >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let h = h ^ (h >> 32);
        let a = (h as usize) & self.bucket_mask;
        let b = ((h >> 20) as usize) & self.bucket_mask;
        let b = if b == a { a ^ 1 } else { b };
        let fingerprint = (h >> 40) | 1;
        let range = |i: usize| i * BUCKET_ENTRIES..(i + 1) * BUCKET_ENTRIES;
        ([range(a), range(b)], fingerprint)
    }

    fn hint(slot: u32, fingerprint: u64) -> u64 {
        (fingerprint << 32) | u64::from(slot + 1)
    }

    fn hint_slot(hint: u64) -> u32 {
        (hint as u32) - 1
    }

    fn tag_is(&self, slot: u32, key: PageKey) -> bool {
        let t = &self.tags[slot as usize];
        t.ino.load(Ordering::Relaxed) == key.0.get() && t.page.load(Ordering::Relaxed) == key.1
    }

    /// Owner: a slot now holds `key` (its data already stored).
    pub(crate) fn publish(&self, slot: u32, key: PageKey) {
        debug_assert!(key.0.get() != NO_INODE);
        self.open(slot);
        let t = &self.tags[slot as usize];
        t.ino.store(key.0.get(), Ordering::Relaxed);
        t.page.store(key.1, Ordering::Relaxed);
        t.referenced.store(false, Ordering::Relaxed);
        self.close(slot);
        let (buckets, fingerprint) = self.buckets(key);
        // A free entry in the emptier bucket: two choices keep the buckets
        // even. (Retire clears the one hint publish wrote, so no entry is
        // ever stale.)
        let is_free = |p: &usize| self.hints[*p].load(Ordering::Relaxed) == 0;
        let [a, b] = buckets;
        let (free_a, free_b) = (a.clone().filter(is_free).count(), b.clone().filter(is_free).count());
        let emptier = if free_b > free_a { b } else { a };
        match emptier.into_iter().find(is_free) {
            Some(at) => self.hints[at].store(Self::hint(slot, fingerprint), Ordering::Release),
            None => {
                self.counters.hints_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Owner: a slot no longer holds `key`.
    pub(crate) fn retire(&self, slot: u32, key: PageKey) {
        self.open(slot);
        self.tags[slot as usize].ino.store(NO_INODE, Ordering::Relaxed);
        self.close(slot);
        let (buckets, fingerprint) = self.buckets(key);
        let hint = Self::hint(slot, fingerprint);
        for p in buckets.into_iter().flatten() {
            if self.hints[p].load(Ordering::Relaxed) == hint {
                self.hints[p].store(0, Ordering::Relaxed);
            }
        }
    }

    /// Owner: whether a remote reader hit the slot since the last call.
    pub(crate) fn take_referenced(&self, slot: u32) -> bool {
        let r = &self.tags[slot as usize].referenced;
        r.load(Ordering::Relaxed) && r.swap(false, Ordering::Relaxed)
    }

    pub(crate) fn remote_hits(&self) -> u64 {
        self.counters.hits.load(Ordering::Relaxed)
    }

    pub(crate) fn remote_misses(&self) -> u64 {
        self.counters.misses.load(Ordering::Relaxed)
    }

    pub(crate) fn remote_retries(&self) -> u64 {
        self.counters.retries.load(Ordering::Relaxed)
    }

    pub(crate) fn hints_dropped(&self) -> u64 {
        self.counters.hints_dropped.load(Ordering::Relaxed)
    }

    /// Reader: the slot holding `key` and its (even) sequence, if a hint
    /// leads to it; `Busy` if the slot is being changed.
    fn find(&self, key: PageKey) -> Result<(u32, u64), SharedMiss> {
        let (buckets, fingerprint) = self.buckets(key);
        let mut busy = false;
        for p in buckets.into_iter().flatten() {
            let h = self.hints[p].load(Ordering::Acquire);
            if h >> 32 != fingerprint {
                continue;
            }
            let slot = Self::hint_slot(h);
            match self.tags[slot as usize].seq.begin() {
                None => busy = true,
                Some(seq) if self.tag_is(slot, key) => return Ok((slot, seq)),
                Some(_) => {}
            }
        }
        Err(if busy { SharedMiss::Busy } else { SharedMiss::NotCached })
    }

    /// Reader: copy bytes [at, at + dst.len()) of a slot.
    fn load(&self, slot: u32, at: usize, dst: &mut [u8]) {
        assert!(at + dst.len() <= PAGE_BYTES);
        let words = self.page_words(slot);
        let head = ((8 - at % 8) % 8).min(dst.len());
        let (dst_head, body) = dst.split_at_mut(head);
        if head > 0 {
            let bytes = words[at / 8].load(Ordering::Relaxed).to_ne_bytes();
            dst_head.copy_from_slice(&bytes[at % 8..at % 8 + head]);
        }
        let first = (at + head) / 8;
        let whole_words = body.len() / 8;
        let (whole, tail) = body.split_at_mut(whole_words * 8);
        for (bytes, word) in whole.chunks_exact_mut(8).zip(&words[first..first + whole_words]) {
            bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes());
        }
        if !tail.is_empty() {
            let bytes = words[first + whole_words].load(Ordering::Relaxed).to_ne_bytes();
            tail.copy_from_slice(&bytes[..tail.len()]);
        }
    }
}

/// What readers on other cores know of one file: its size, and whether it
/// still exists, under a sequence number.
pub(crate) struct SharedFile {
    seq: Seq,
    size: AtomicU64,
    alive: AtomicBool,
}

impl SharedFile {
    pub(crate) fn new(size: u64) -> Self {
        Self { seq: Seq::default(), size: AtomicU64::new(size), alive: AtomicBool::new(true) }
    }

    /// Owner: start a change readers must see whole.
    pub(crate) fn open(&self) {
        self.seq.open();
    }

    pub(crate) fn close(&self) {
        self.seq.close();
    }

    /// Owner: run `change` as part of the change under way, or as one of
    /// its own.
    fn within_change(&self, change: impl FnOnce()) {
        let own_change = !self.seq.is_open();
        if own_change {
            self.open();
        }
        change();
        if own_change {
            self.close();
        }
    }

    /// Owner: publish a new size.
    pub(crate) fn set_size_published(&self, size: u64) {
        if self.size.load(Ordering::Relaxed) != size {
            self.within_change(|| self.size.store(size, Ordering::Relaxed));
        }
    }

    /// Owner: the inode is gone.
    pub(crate) fn kill_published(&self) {
        self.within_change(|| self.alive.store(false, Ordering::Relaxed));
    }
}

/// The files with readers on other cores ([`crate::DataOps::shared_reader`]),
/// by inode, on the owning reactor. A file enters at its first shared
/// reader and leaves when its inode is freed; a file not here has no
/// reader to tell of any change.
#[derive(Default)]
pub(crate) struct SharedFiles {
    by_ino: RefCell<IdMapBy<crate::Ino, Arc<SharedFile>>>,
}

impl SharedFiles {
    /// `ino`'s shared state, made with `size` if it has none yet.
    pub(crate) fn share(&self, ino: crate::Ino, size: u64) -> Arc<SharedFile> {
        Arc::clone(self.by_ino.borrow_mut().entry(ino).or_insert_with(|| Arc::new(SharedFile::new(size))))
    }

    /// Begin a change of several steps to `ino` (pages and size) that
    /// readers on other cores must not see half done. Free when the file
    /// has no such readers.
    pub(crate) fn change(&self, ino: crate::Ino) -> FileChange {
        let file = self.by_ino.borrow().get(&ino).cloned();
        if let Some(f) = &file {
            f.open();
        }
        FileChange(file)
    }

    /// Tell readers on other cores the file's size (after any change to an
    /// inode, which is where sizes change).
    pub(crate) fn publish_size(&self, ino: crate::Ino, size: u64) {
        if let Some(f) = self.by_ino.borrow().get(&ino) {
            f.set_size_published(size);
        }
    }

    /// The inode is gone: its shared readers must go to the owner, which
    /// will answer that the file no longer exists.
    pub(crate) fn forget(&self, ino: crate::Ino) {
        if let Some(f) = self.by_ino.borrow_mut().remove(&ino) {
            f.kill_published();
        }
    }
}

/// A change to a file that readers on other cores must see whole (see
/// [`SharedFiles::change`]); ends when dropped.
pub(crate) struct FileChange(Option<Arc<SharedFile>>);

impl Drop for FileChange {
    fn drop(&mut self) {
        if let Some(file) = &self.0 {
            file.close();
        }
    }
}

/// Why a shared read did not complete; the caller sends the read to the
/// owning reactor instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedMiss {
    /// A page of the range is not cached (or its hint was lost).
    NotCached,
    /// The owner kept changing the range or the file.
    Busy,
    /// The file was deleted since the reader was made.
    Gone,
    /// The read spans more pages than a shared read takes.
    TooLarge,
}

/// Reads one file's cached pages from any thread, without locks.
/// Made by [`super::DataOps::shared_reader`] on the owning reactor.
#[derive(Clone)]
pub struct SharedReader {
    pub(crate) pages: Arc<SharedPages>,
    pub(crate) file: Arc<SharedFile>,
    pub(crate) ino: crate::Ino,
}

impl SharedReader {
    pub fn ino(&self) -> crate::Ino {
        self.ino
    }

    /// Read up to `size` bytes at `offset` if every page is cached: the
    /// same bytes a read on the owner would return at some instant during
    /// this call (a short read at end of file, empty past it).
    pub fn read(&self, offset: FileOffset, size: u32) -> Result<Vec<u8>, SharedMiss> {
        let offset = offset.get();
        let mut out = Vec::new();
        self.read_into(offset, size, &mut out)?;
        Ok(out)
    }

    /// [`Self::read`] into a reused buffer, which is resized to the bytes
    /// read.
    pub fn read_into(&self, offset: u64, size: u32, out: &mut Vec<u8>) -> Result<(), SharedMiss> {
        let counters = &self.pages.counters;
        for attempt in 0..READ_ATTEMPTS {
            if attempt > 0 {
                counters.retries.fetch_add(1, Ordering::Relaxed);
                std::hint::spin_loop();
            }
            match self.try_read(offset, size, out) {
                Ok(()) => {
                    counters.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Err(SharedMiss::Busy) => continue,
                Err(miss) => {
                    counters.misses.fetch_add(1, Ordering::Relaxed);
                    return Err(miss);
                }
            }
        }
        counters.misses.fetch_add(1, Ordering::Relaxed);
        Err(SharedMiss::Busy)
    }

    fn try_read(&self, offset: u64, size: u32, out: &mut Vec<u8>) -> Result<(), SharedMiss> {
        let file_seq = self.file.seq.begin().ok_or(SharedMiss::Busy)?;
        if !self.file.alive.load(Ordering::Relaxed) {
            return Err(SharedMiss::Gone);
        }
        let file_size = self.file.size.load(Ordering::Relaxed);
        let end = offset.saturating_add(u64::from(size)).min(file_size);
        out.clear();
        let mut seen = [(0u32, 0u64); SHARED_READ_PAGES_MAX];
        let mut count = 0;
        if offset < end {
            let page_bytes = PAGE_BYTES as u64;
            let (first, last) = (offset / page_bytes, (end - 1) / page_bytes);
            count = (last - first + 1) as usize;
            if count > SHARED_READ_PAGES_MAX {
                return Err(SharedMiss::TooLarge);
            }
            for (i, page) in (first..=last).enumerate() {
                seen[i] = self.pages.find((self.ino, page))?;
            }
            out.resize((end - offset) as usize, 0);
            for (i, page) in (first..=last).enumerate() {
                let start = page * page_bytes;
                let from = offset.max(start);
                let to = end.min(start + page_bytes);
                let dst = &mut out[(from - offset) as usize..(to - offset) as usize];
                self.pages.load(seen[i].0, (from - start) as usize, dst);
            }
        }
        let pages = seen[..count].iter().map(|&(slot, seq)| (&self.pages.tags[slot as usize].seq, seq));
        if !seqlock::unchanged_since(pages.chain([(&self.file.seq, file_seq)])) {
            return Err(SharedMiss::Busy);
        }
        for &(slot, _) in &seen[..count] {
            let referenced = &self.pages.tags[slot as usize].referenced;
            if !referenced.load(Ordering::Relaxed) {
                referenced.store(true, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Ino;

    #[test]
    fn stores_and_loads_at_any_alignment() {
        let (p, mut o) = SharedPages::new(4);
        let data: Vec<u8> = (0..100u8).collect();
        p.store(&mut o, 2, 13, &data);
        let mut back = vec![0u8; 100];
        p.load(2, 13, &mut back);
        assert_eq!(back, data);
        assert_eq!(&p.page(&o, 2)[13..113], &data[..]);
        assert!(p.page(&o, 2)[..13].iter().all(|&b| b == 0));
        p.zero(&mut o, 2, 20, 30);
        assert!(p.page(&o, 2)[20..30].iter().all(|&b| b == 0));
        assert_eq!(p.page(&o, 2)[30], 17);
        assert!(p.page(&o, 1).iter().all(|&b| b == 0), "neighbouring slots untouched");
    }

    #[test]
    fn every_offset_and_length_round_trips() {
        let (p, mut o) = SharedPages::new(1);
        let mut model = vec![0u8; PAGE_BYTES];
        let mut seed = 5u64;
        for _ in 0..2000 {
            let at = (keelfs_base::testing::splitmix64(&mut seed) % PAGE_BYTES as u64) as usize;
            let len = (keelfs_base::testing::splitmix64(&mut seed) % 40) as usize;
            let len = len.min(PAGE_BYTES - at);
            let data: Vec<u8> = (0..len).map(|_| keelfs_base::testing::splitmix64(&mut seed) as u8).collect();
            p.store(&mut o, 0, at, &data);
            model[at..at + len].copy_from_slice(&data);
            let mut back = vec![0u8; len];
            p.load(0, at, &mut back);
            assert_eq!(back, data);
        }
        assert_eq!(p.page(&o, 0), &model[..]);
        let mut whole = vec![0u8; PAGE_BYTES];
        p.load(0, 0, &mut whole);
        assert_eq!(whole, model);
    }

    #[test]
    fn a_full_cache_keeps_a_hint_for_every_page() {
        let slots = 1 << 16;
        let (p, _owner) = SharedPages::new(slots);
        for slot in 0..slots as u32 {
            // Keys as a big file's pages and a few files' pages come.
            p.publish(slot, (Ino::new(2 + u64::from(slot % 3)), u64::from(slot) * 7));
        }
        assert_eq!(p.hints_dropped(), 0);
    }

    #[test]
    fn hints_find_published_pages_and_forget_retired_ones() {
        let (p, _owner) = SharedPages::new(64);
        for slot in 0..64u32 {
            p.publish(slot, (Ino::new(7), u64::from(slot) * 3));
        }
        let found = (0..64u64).filter(|&i| p.find((Ino::new(7), i * 3)).is_ok()).count();
        assert_eq!(found, 64, "every page has a hint");
        assert_eq!(p.hints_dropped(), 0);
        let (slot, _) = p.find((Ino::new(7), 9)).expect("page 9 published");
        p.retire(slot, (Ino::new(7), 9));
        assert_eq!(p.find((Ino::new(7), 9)), Err(SharedMiss::NotCached));
        p.publish(slot, (Ino::new(8), 9));
        assert!(p.find((Ino::new(7), 9)).is_err(), "a reused slot never answers for its old page");
        assert!(p.find((Ino::new(8), 9)).is_ok());
        p.open(slot);
        assert_eq!(p.find((Ino::new(8), 9)), Err(SharedMiss::Busy), "a slot being changed is busy, not missing");
        p.close(slot);
    }
}
