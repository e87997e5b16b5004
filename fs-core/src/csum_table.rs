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
use crate::FsResult;
use keelfs_bdev::AlignedBuf;
use keelfs_reactor::DeviceChannel;

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

    /// The block as written: every sector with its crc, bad ones made good
    /// with the entries held now.
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
            stored.copy_from_slice(&sum.to_le_bytes());
        }
    }

    /// The entry at `index` (0..1016), or None when its sector failed its
    /// crc.
    #[cfg_attr(not(test), allow(dead_code))] // the table cache uses it (issue 38, step C3)
    pub(crate) fn get(&self, index: usize) -> Option<u32> {
        assert!(index < ENTRIES_PER_BLOCK, "table entry {index} of {ENTRIES_PER_BLOCK}");
        let sector = index / ENTRIES_PER_SECTOR;
        (self.bad_sectors & (1 << sector) == 0).then_some(self.entries[index])
    }

    /// Set the entry at `index`. A bad sector stays bad (its other
    /// entries are still unknown) until `rebuild_sector` vouches for it.
    #[cfg_attr(not(test), allow(dead_code))] // the table cache uses it (issue 38, step C3)
    pub(crate) fn set(&mut self, index: usize, value: u32) {
        assert!(index < ENTRIES_PER_BLOCK, "table entry {index} of {ENTRIES_PER_BLOCK}");
        self.entries[index] = value;
    }

    pub(crate) fn bad_sectors(&self) -> u8 {
        self.bad_sectors
    }
}

/// Table blocks read at once by [`bad_table_sectors`].
const SCAN_READ_BLOCKS: u64 = 256;

/// Every table sector of `sb`'s data checksum table that fails its crc,
/// as (table block from the table's start, sector bitmap): fsck's check.
/// Reads the table in bounded pieces; returns at most `limit` entries,
/// and the count of bad blocks.
pub(crate) async fn bad_table_sectors(
    dev: &DeviceChannel,
    sb: &Superblock,
    limit: usize,
) -> FsResult<(Vec<(u64, u8)>, u64)> {
    let (mut listed, mut count) = (Vec::new(), 0u64);
    let mut at = 0;
    while at < sb.csum_table_blocks {
        let blocks = (sb.csum_table_blocks - at).min(SCAN_READ_BLOCKS);
        let buf = AlignedBuf::zeroed(blocks as usize * BLOCK_BYTES, BLOCK_BYTES);
        let (buf, result) = dev.read(DevBlock::new(sb.csum_table_start() + at).offset(), buf).await;
        result?;
        for (i, block) in buf.chunks_exact(BLOCK_BYTES).enumerate() {
            let bad = TableBlock::decode(block).bad_sectors();
            if bad != 0 {
                count += 1;
                if listed.len() < limit {
                    listed.push((at + i as u64, bad));
                }
            }
        }
        at += blocks;
    }
    Ok((listed, count))
}

/// Where the entry of device block `block` lives: the table block (from
/// the table's start) and the index in it.
#[cfg_attr(not(test), allow(dead_code))] // the table cache uses it (issue 38, step C3)
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

    #[test]
    fn entry_positions_cover_each_block_once() {
        assert_eq!(entry_position(0), (0, 0));
        assert_eq!(entry_position(CSUMS_PER_TABLE_BLOCK - 1), (0, ENTRIES_PER_BLOCK - 1));
        assert_eq!(entry_position(CSUMS_PER_TABLE_BLOCK), (1, 0));
    }
}
