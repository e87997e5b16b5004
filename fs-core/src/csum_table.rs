//! The data checksum table's on-disk unit (issue 38, docs/FORMAT.md "Data
//! checksums"): a block of eight 512-byte sectors, each holding 127 crc32c
//! entries and a crc32c of those entries.
//!
//! A sector is what every supported device writes whole, so a torn table
//! write leaves each sector old or new, and each still checks. A sector
//! that fails its own crc vouches for none of the blocks it covers.

use crate::blocks::DevBlock;
use crate::format::{
    crc, Superblock, BLOCK_BYTES, CSUMS_PER_SECTOR, CSUMS_PER_TABLE_BLOCK, CSUM_SECTORS_PER_BLOCK, CSUM_SECTOR_BYTES,
};
use crate::io::Io;
use crate::FsResult;
use keelfs_bdev::AlignedBuf;
use std::cell::RefCell;

const ENTRIES_PER_SECTOR: usize = CSUMS_PER_SECTOR as usize;
const SECTORS_PER_BLOCK: usize = CSUM_SECTORS_PER_BLOCK as usize;
const ENTRIES_PER_BLOCK: usize = CSUMS_PER_TABLE_BLOCK as usize;
/// The bytes of a sector its crc covers: the entries.
const SECTOR_ENTRY_BYTES: usize = ENTRIES_PER_SECTOR * 4;

const _: () = assert!(SECTOR_ENTRY_BYTES + 4 == CSUM_SECTOR_BYTES);
const _: () = assert!(SECTORS_PER_BLOCK * CSUM_SECTOR_BYTES == BLOCK_BYTES);

/// One table block in memory: its entries, and which of its sectors
/// failed their crc when it was read (their entries are then zero and
/// must not be trusted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TableBlock {
    entries: Box<[u32; ENTRIES_PER_BLOCK]>,
    /// Bit i: sector i failed its crc.
    bad_sectors: u8,
}

impl TableBlock {
    /// A block whose entries are all zero, every sector good: what mkfs
    /// writes.
    pub(crate) fn zeroed() -> Self {
        Self { entries: Box::new([0; ENTRIES_PER_BLOCK]), bad_sectors: 0 }
    }

    /// Decode a block read from the device. Never fails: a sector whose
    /// crc does not match is marked bad, and the others stand.
    pub(crate) fn decode(block: &[u8]) -> Self {
        assert_eq!(block.len(), BLOCK_BYTES);
        let mut out = Self::zeroed();
        for (sector_index, sector) in block.chunks_exact(CSUM_SECTOR_BYTES).enumerate() {
            let (entry_bytes, stored) = sector.split_at(SECTOR_ENTRY_BYTES);
            if crc(entry_bytes) != u32::from_le_bytes(stored.try_into().expect("4 bytes")) {
                out.bad_sectors |= 1 << sector_index;
                continue;
            }
            let first = sector_index * ENTRIES_PER_SECTOR;
            for (slot, bytes) in
                out.entries[first..first + ENTRIES_PER_SECTOR].iter_mut().zip(entry_bytes.chunks_exact(4))
            {
                *slot = u32::from_le_bytes(bytes.try_into().expect("4 bytes"));
            }
        }
        out
    }

    /// The block as written: every sector with its crc. A bad sector
    /// stays bad (its crc is written inverted): its entries that were
    /// never set since are still unknown, and must not be vouched for.
    pub(crate) fn encode_into(&self, block: &mut [u8]) {
        assert_eq!(block.len(), BLOCK_BYTES);
        for (sector_index, sector) in block.chunks_exact_mut(CSUM_SECTOR_BYTES).enumerate() {
            let first = sector_index * ENTRIES_PER_SECTOR;
            let (entry_bytes, stored) = sector.split_at_mut(SECTOR_ENTRY_BYTES);
            for (bytes, entry) in entry_bytes.chunks_exact_mut(4).zip(&self.entries[first..first + ENTRIES_PER_SECTOR])
            {
                bytes.copy_from_slice(&entry.to_le_bytes());
            }
            let sum = crc(entry_bytes);
            let sum = if self.bad_sectors & (1 << sector_index) != 0 { !sum } else { sum };
            stored.copy_from_slice(&sum.to_le_bytes());
        }
    }

    /// The entry at `index` (0..1016), or None when its sector failed its
    /// crc.
    pub(crate) fn get(&self, index: usize) -> Option<u32> {
        assert!(index < ENTRIES_PER_BLOCK, "table entry {index} of {ENTRIES_PER_BLOCK}");
        let sector = index / ENTRIES_PER_SECTOR;
        (self.bad_sectors & (1 << sector) == 0).then_some(self.entries[index])
    }

    /// Set bits `bits` in the entry at `index` (the dirty-region map's
    /// blocks are laid out as table blocks of bit words).
    pub(crate) fn or_entry(&mut self, index: usize, bits: u32) {
        assert!(index < ENTRIES_PER_BLOCK, "table entry {index} of {ENTRIES_PER_BLOCK}");
        self.entries[index] |= bits;
    }

    /// Set the entry at `index`. A bad sector stays bad (its other
    /// entries are still unknown) until all of its entries are set.
    #[cfg(test)]
    pub(crate) fn set(&mut self, index: usize, value: u32) {
        assert!(index < ENTRIES_PER_BLOCK, "table entry {index} of {ENTRIES_PER_BLOCK}");
        self.entries[index] = value;
    }

    /// Take the entries `dirty` set. A bad sector all of whose entries
    /// it sets is good again.
    fn merge(&mut self, dirty: &DirtyBlock) {
        for (index, value) in dirty.set_entries() {
            self.entries[index] = value;
        }
        for sector in 0..SECTORS_PER_BLOCK {
            let first = sector * ENTRIES_PER_SECTOR;
            if (first..first + ENTRIES_PER_SECTOR).all(|i| dirty.is_set(i)) {
                self.bad_sectors &= !(1 << sector);
            }
        }
    }

    pub(crate) fn bad_sectors(&self) -> u8 {
        self.bad_sectors
    }
}

/// Entries per line of a dirty block, with the line's bits of those set.
const LINE_ENTRIES: usize = 15;
/// Lines per dirty block.
const DIRTY_LINES: usize = ENTRIES_PER_BLOCK.div_ceil(LINE_ENTRIES);

/// One cache line of a dirty block: 15 entries and the bits of those set
/// (bit i: entry i), so that a lookup of a set entry touches this line
/// only. A random read's lookup is a cache miss; with the bits apart, it
/// was two.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct DirtyLine {
    entries: [u32; LINE_ENTRIES],
    set: u32,
}

const _: () = assert!(std::mem::size_of::<DirtyLine>() == 64 && LINE_ENTRIES < 32);

/// The entries of one table block set since they were last written back:
/// an overlay on whatever the device holds, so that setting an entry
/// never waits for a read.
#[derive(Clone)]
struct DirtyBlock {
    lines: Box<[DirtyLine; DIRTY_LINES]>,
    /// Bumped by each change: a write-back cleans the block only if
    /// nothing changed it while the write was in flight.
    changes: u64,
}

impl DirtyBlock {
    fn new() -> Self {
        Self { lines: Box::new([DirtyLine::default(); DIRTY_LINES]), changes: 0 }
    }

    fn position(index: usize) -> (usize, usize) {
        assert!(index < ENTRIES_PER_BLOCK, "table entry {index} of {ENTRIES_PER_BLOCK}");
        (index / LINE_ENTRIES, index % LINE_ENTRIES)
    }

    /// The entry at `index` if it was set.
    fn get(&self, index: usize) -> Option<u32> {
        let (line, at) = Self::position(index);
        let line = &self.lines[line];
        (line.set & (1 << at) != 0).then_some(line.entries[at])
    }

    fn is_set(&self, index: usize) -> bool {
        self.get(index).is_some()
    }

    fn put(&mut self, index: usize, value: u32) {
        let (line, at) = Self::position(index);
        let line = &mut self.lines[line];
        line.entries[at] = value;
        line.set |= 1 << at;
    }

    /// The entries set, with their indices, in order.
    fn set_entries(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        (0..ENTRIES_PER_BLOCK).filter_map(|i| self.get(i).map(|v| (i, v)))
    }
}

/// Clean table blocks kept in memory: 4 MiB, covering 4 GiB of data.
pub(crate) const CLEAN_BLOCKS_MAX: usize = 1024;
/// Dirty table blocks past which a checkpoint is asked for, so that the
/// overlay's memory stays bounded (17 MiB) whatever the writes' spread.
pub(crate) const DIRTY_BLOCKS_CHECKPOINT: usize = 4096;

/// The data checksum table of one mounted image: the entries set since
/// the last checkpoint (journalled by `CsumSet`, written back by the
/// next checkpoint), over a bounded cache of table blocks read on demand.
pub(crate) struct TableCache {
    /// The table's first device block, and its length in blocks.
    start: u64,
    blocks: u64,
    /// Device blocks an entry may be set for: the data area.
    data_area: std::ops::Range<u64>,
    /// Both keyed by table block, a number keelfs derives from device
    /// blocks it allocates: IdHasher, as every read looks an entry up here.
    dirty: keelfs_base::IdMap<DirtyBlock>,
    clean: keelfs_base::IdMap<TableBlock>,
    /// The clean blocks in the order they came in: the oldest goes first.
    clean_order: std::collections::VecDeque<u64>,
    /// Reads that failed their checksum, and the device blocks logged
    /// (each once, at most MISMATCHES_LOGGED_MAX of them).
    mismatches: u64,
    logged: std::collections::BTreeSet<u64>,
    /// The dirty-region map: which regions' entries may be behind their
    /// data (overwrites in place, written back at checkpoints).
    pub(crate) map: crate::csum_map::RegionMap,
}

/// Device blocks whose checksum mismatch is logged, at most: past it, the
/// count still grows, and fsck --data and scrub name the rest.
const MISMATCHES_LOGGED_MAX: usize = 1024;

/// A table block written back: which, and its change count then.
pub(crate) struct WrittenBack(Vec<(u64, u64)>);

impl TableCache {
    /// The table of `sb`, or None when it keeps no data checksums.
    pub(crate) fn for_superblock(sb: &Superblock) -> Option<Self> {
        sb.has_data_checksums().then(|| Self {
            start: sb.csum_table_start(),
            blocks: crate::format::csum_entry_blocks_for(sb.total_blocks),
            data_area: sb.data_start()..sb.total_blocks,
            dirty: Default::default(),
            clean: Default::default(),
            clean_order: Default::default(),
            mismatches: 0,
            logged: Default::default(),
            map: crate::csum_map::RegionMap::for_superblock(sb),
        })
    }

    /// Whether table block `table_block` has entries set since it was
    /// last written back.
    pub(crate) fn is_dirty(&self, table_block: u64) -> bool {
        self.dirty.contains_key(&table_block)
    }

    /// A read of device `block` failed its checksum: counted; whether it
    /// is the first time for this block (and should be logged).
    pub(crate) fn note_mismatch(&mut self, block: u64) -> bool {
        self.mismatches += 1;
        self.logged.len() < MISMATCHES_LOGGED_MAX && self.logged.insert(block)
    }

    pub(crate) fn mismatches(&self) -> u64 {
        self.mismatches
    }

    /// Set the entries of device blocks [first, +crcs/4) from `crcs`,
    /// little-endian u32s (a `CsumSet`'s). Refused, changing nothing, for
    /// blocks outside the data area: replay gets these from the image.
    pub(crate) fn set(&mut self, first: u64, crcs: &[u8]) -> Result<(), String> {
        let count = (crcs.len() / 4) as u64;
        let end = first.checked_add(count).ok_or("a checksum run past 2^64")?;
        if !crcs.len().is_multiple_of(4) || count == 0 || first < self.data_area.start || end > self.data_area.end {
            return Err(format!("checksums of blocks [{first}, +{count}) outside the data area {:?}", self.data_area));
        }
        for (block, bytes) in (first..end).zip(crcs.chunks_exact(4)) {
            let (table_block, index) = entry_position(block);
            debug_assert!(table_block < self.blocks);
            let dirty = self.dirty.entry(table_block).or_insert_with(DirtyBlock::new);
            dirty.put(index, u32::from_le_bytes(bytes.try_into().expect("4 bytes")));
            dirty.changes += 1;
        }
        Ok(())
    }

    /// Set all 127 entries of sector `sector` of table block
    /// `table_block` from `crcs`, so that the sector checks again once
    /// written back: fsck --repair's rebuild of a sector that fails its
    /// crc. Unlike [`Self::set`] it reaches the entries of blocks outside
    /// the data area, which nothing reads.
    pub(crate) fn rebuild_sector(&mut self, table_block: u64, sector: usize, crcs: &[u32; ENTRIES_PER_SECTOR]) {
        assert!(table_block < self.blocks, "table block {table_block} of {}", self.blocks);
        assert!(sector < SECTORS_PER_BLOCK, "sector {sector} of {SECTORS_PER_BLOCK}");
        let dirty = self.dirty.entry(table_block).or_insert_with(DirtyBlock::new);
        for (i, &crc) in crcs.iter().enumerate() {
            dirty.put(sector * ENTRIES_PER_SECTOR + i, crc);
        }
        dirty.changes += 1;
    }

    pub(crate) fn dirty_blocks(&self) -> usize {
        self.dirty.len()
    }

    /// The entry of device `block` if memory holds it: Some(None) when its
    /// sector is bad, None when the table block must be read first.
    pub(crate) fn cached_entry(&self, block: u64) -> Option<Option<u32>> {
        let (table_block, index) = entry_position(block);
        if let Some(value) = self.dirty.get(&table_block).and_then(|d| d.get(index)) {
            return Some(Some(value));
        }
        self.clean.get(&table_block).map(|t| t.get(index))
    }

    /// Bring the lines that hold device `block`'s entry toward this core
    /// ([`keelfs_base::prefetch`]), ahead of [`Self::cached_entry`] or
    /// [`Self::set`] once its data's I/O completes.
    pub(crate) fn prefetch_entry(&self, block: u64) {
        let (table_block, index) = entry_position(block);
        if let Some(dirty) = self.dirty.get(&table_block) {
            keelfs_base::prefetch(&dirty.lines[DirtyBlock::position(index).0]);
        }
        if let Some(clean) = self.clean.get(&table_block) {
            keelfs_base::prefetch(&clean.entries[index]);
        }
    }

    fn insert_clean(&mut self, table_block: u64, block: TableBlock) {
        if self.clean.insert(table_block, block).is_none() {
            self.clean_order.push_back(table_block);
        }
        while self.clean_order.len() > CLEAN_BLOCKS_MAX {
            let oldest = self.clean_order.pop_front().expect("longer than the bound");
            self.clean.remove(&oldest);
        }
    }

    fn device_block(&self, table_block: u64) -> DevBlock {
        assert!(table_block < self.blocks, "table block {table_block} of {}", self.blocks);
        DevBlock::new(self.start + table_block)
    }
}

/// The entry of device `block` (None: its sector fails its crc), reading
/// its table block if no copy is in memory. The cache is not borrowed
/// across the read.
pub(crate) async fn entry(cache: &RefCell<TableCache>, io: &Io, block: u64) -> FsResult<Option<u32>> {
    if let Some(found) = cache.borrow().cached_entry(block) {
        return Ok(found);
    }
    let (table_block, _) = entry_position(block);
    let at = cache.borrow().device_block(table_block);
    let read = TableBlock::decode(&io.read_blocks(at, 1).await?);
    let mut cache = cache.borrow_mut();
    cache.insert_clean(table_block, read);
    Ok(cache.cached_entry(block).expect("just read"))
}

/// Write every dirty table block, merged over what the device holds, in
/// place. The caller flushes, and then calls [`written_back`]: a
/// checkpoint, before its superblock, so that the entries of every record
/// before its journal start are on the device.
pub(crate) async fn write_back(cache: &RefCell<TableCache>, io: &Io) -> FsResult<WrittenBack> {
    // In the table's order: a write-back of neighbours is sequential.
    let mut keys: Vec<u64> = cache.borrow().dirty.keys().copied().collect();
    keys.sort_unstable();
    let mut written = Vec::with_capacity(keys.len());
    for table_block in keys {
        let at = cache.borrow().device_block(table_block);
        let base = cache.borrow().clean.get(&table_block).cloned();
        let mut merged = match base {
            Some(base) => base,
            None => TableBlock::decode(&io.read_blocks(at, 1).await?),
        };
        let changes = {
            let cache = cache.borrow();
            let dirty = cache.dirty.get(&table_block).expect("only write_back cleans");
            merged.merge(dirty);
            dirty.changes
        };
        let mut buf = AlignedBuf::zeroed(BLOCK_BYTES, BLOCK_BYTES);
        merged.encode_into(&mut buf);
        cache.borrow_mut().insert_clean(table_block, merged);
        io.write_blocks(at, buf).await?;
        written.push((table_block, changes));
    }
    Ok(WrittenBack(written))
}

/// The blocks `done` wrote are durable: each is clean unless it changed
/// since. A block that changed keeps its whole overlay, which the next
/// write-back writes again.
pub(crate) fn written_back(cache: &RefCell<TableCache>, done: WrittenBack) {
    let mut cache = cache.borrow_mut();
    for (table_block, changes) in done.0 {
        if cache.dirty.get(&table_block).is_some_and(|d| d.changes == changes) {
            cache.dirty.remove(&table_block);
        }
    }
}

/// Table blocks read at once by [`bad_sectors_from`].
const SCAN_READ_BLOCKS: u64 = 256;

/// The table blocks with sectors that fail their crc among those from
/// table block `at` (counted from the table's start) up to `end`, at most
/// [`SCAN_READ_BLOCKS`] of them read at once: (table block, sector
/// bitmap) each, and the table block the next piece starts at.
pub(crate) async fn bad_sectors_from(io: &Io, sb: &Superblock, at: u64, end: u64) -> FsResult<(Vec<(u64, u8)>, u64)> {
    assert!(at < end && end <= sb.csum_table_blocks, "table blocks [{at}, {end}) of {}", sb.csum_table_blocks);
    let blocks = (end - at).min(SCAN_READ_BLOCKS);
    let buf = io.read_blocks(DevBlock::new(sb.csum_table_start() + at), blocks as usize).await?;
    let bad = buf
        .chunks_exact(BLOCK_BYTES)
        .enumerate()
        .map(|(i, block)| (at + i as u64, TableBlock::decode(block).bad_sectors()))
        .filter(|&(_, sectors)| sectors != 0)
        .collect();
    Ok((bad, at + blocks))
}

/// Every table sector of `sb`'s data checksum table (its entries and its
/// dirty-region map) that fails its crc, as (table block from the
/// table's start, sector bitmap): fsck's check. Reads the table in
/// bounded pieces; returns at most `limit` entries, and the count of bad
/// blocks.
pub(crate) async fn bad_table_sectors(io: &Io, sb: &Superblock, limit: usize) -> FsResult<(Vec<(u64, u8)>, u64)> {
    let (mut listed, mut count) = (Vec::new(), 0u64);
    let mut at = 0;
    while at < sb.csum_table_blocks {
        let (bad, next) = bad_sectors_from(io, sb, at, sb.csum_table_blocks).await?;
        count += bad.len() as u64;
        let room = limit.saturating_sub(listed.len());
        listed.extend(bad.into_iter().take(room));
        at = next;
    }
    Ok((listed, count))
}

/// Where the entry of device block `block` lives: the table block (from
/// the table's start) and the index in it.
pub(crate) fn entry_position(block: u64) -> (u64, usize) {
    (block / CSUMS_PER_TABLE_BLOCK, (block % CSUMS_PER_TABLE_BLOCK) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> TableBlock {
        let mut t = TableBlock::zeroed();
        for i in 0..ENTRIES_PER_BLOCK {
            t.set(i, (i as u32).wrapping_mul(0x9e37_79b9));
        }
        t
    }

    #[test]
    fn a_table_block_round_trips() {
        let t = sample();
        let mut block = vec![0u8; BLOCK_BYTES];
        t.encode_into(&mut block);
        assert_eq!(TableBlock::decode(&block), t);
    }

    #[test]
    fn a_torn_sector_is_bad_and_its_neighbours_stand() {
        let t = sample();
        let mut block = vec![0u8; BLOCK_BYTES];
        t.encode_into(&mut block);
        block[3 * CSUM_SECTOR_BYTES + 17] ^= 0x40;
        let got = TableBlock::decode(&block);
        assert_eq!(got.bad_sectors(), 1 << 3);
        for i in 0..ENTRIES_PER_BLOCK {
            let in_bad_sector = i / ENTRIES_PER_SECTOR == 3;
            assert_eq!(got.get(i), (!in_bad_sector).then(|| t.get(i).unwrap()), "entry {i}");
        }
    }

    #[test]
    fn a_zeroed_device_block_is_not_a_valid_table_block() {
        // What a never-written table looks like: every sector fails, so
        // nothing it covers is vouched for by accident.
        let got = TableBlock::decode(&[0u8; BLOCK_BYTES]);
        assert_eq!(got.bad_sectors(), 0xff);
    }

    /// Entries set in a dirty block, on both sides of its line edges and
    /// at its last, read back as set; the others as unset; a merge takes
    /// exactly the set ones.
    #[test]
    fn a_dirty_block_keeps_each_entry_with_its_bit() {
        let mut dirty = DirtyBlock::new();
        let set = [0, 14, 15, 16, 29, 30, 500, ENTRIES_PER_BLOCK - 1];
        for &i in &set {
            dirty.put(i, 0xdead_0000 + i as u32);
        }
        for i in 0..ENTRIES_PER_BLOCK {
            let want = set.contains(&i).then_some(0xdead_0000 + i as u32);
            assert_eq!(dirty.get(i), want, "entry {i}");
        }
        let listed: Vec<usize> = dirty.set_entries().map(|(i, _)| i).collect();
        assert_eq!(listed, set);
        let mut block = sample();
        let before = block.clone();
        block.merge(&dirty);
        for i in 0..ENTRIES_PER_BLOCK {
            let want = if set.contains(&i) { Some(0xdead_0000 + i as u32) } else { before.get(i) };
            assert_eq!(block.get(i), want, "merged entry {i}");
        }
    }

    #[test]
    fn entry_positions_cover_each_block_once() {
        assert_eq!(entry_position(0), (0, 0));
        assert_eq!(entry_position(CSUMS_PER_TABLE_BLOCK - 1), (0, ENTRIES_PER_BLOCK - 1));
        assert_eq!(entry_position(CSUMS_PER_TABLE_BLOCK), (1, 0));
    }
}
