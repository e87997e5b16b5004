//! Making a new filesystem.

use super::blocks::{whole_blocks, DevBlock};
use super::csum_table::TableBlock;
use super::format::{
    csum_table_blocks_for, Inode, Superblock, BLOCK_BYTES, FEATURE_DATA_CHECKSUMS, FEATURE_FREE_COUNT_HOLDS_CHECKPOINT,
    JOURNAL_BLOCKS_MAX, ROOT_INO, SUPERBLOCK_SLOTS, S_IFDIR, TOTAL_BLOCKS_MAX,
};
use super::journal;
use super::{FileClock, FsConfig, FsError};
use keelfs_bdev::AlignedBuf;
use keelfs_reactor::DeviceChannel;

#[derive(Clone, Debug)]
pub struct MkfsOptions {
    /// Journal size in blocks; 0 picks 1/64 of the device, between 1 MiB
    /// and 64 MiB.
    pub journal_blocks: u64,
    pub allocation_groups: u32,
    /// Format even if the device already holds a keelfs.
    pub force: bool,
    pub root_uid: u32,
    pub root_gid: u32,
    /// The clock that stamps the root directory's times.
    pub file_clock: FileClock,
    /// Keep a crc32c of every data block (FEATURE_DATA_CHECKSUMS): mkfs
    /// reserves and writes the checksum table after the journal.
    pub data_checksums: bool,
}

impl Default for MkfsOptions {
    fn default() -> Self {
        Self {
            journal_blocks: 0,
            allocation_groups: 1,
            force: false,
            root_uid: 0,
            root_gid: 0,
            file_clock: FileClock::System,
            data_checksums: false,
        }
    }
}

/// Smallest device mkfs accepts.
pub const MIN_DEVICE_BYTES: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum MkfsError {
    #[error("the device already holds a keelfs filesystem (use --force to overwrite it)")]
    AlreadyFormatted,
    #[error("the device is {0} bytes; keelfs needs at least {MIN_DEVICE_BYTES}")]
    TooSmall(u64),
    #[error("a journal of {0} blocks is outside 16..={JOURNAL_BLOCKS_MAX}")]
    JournalSize(u64),
    #[error("the device is {0} bytes; keelfs formats at most {TOTAL_BLOCKS_MAX} blocks")]
    TooLarge(u64),
    #[error("cannot read random bytes for the UUID: {0}")]
    Random(std::io::Error),
    #[error(transparent)]
    Fs(#[from] FsError),
}

fn random_uuid() -> Result<[u8; 16], MkfsError> {
    use std::io::Read;
    let mut uuid = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut uuid)).map_err(MkfsError::Random)?;
    uuid[6] = (uuid[6] & 0x0f) | 0x40; // version 4
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    Ok(uuid)
}

/// Table blocks written at once while mkfs fills the checksum table.
const CSUM_TABLE_WRITE_BLOCKS: u64 = 256;

/// Write every block of `sb`'s data checksum table (if it has one) with
/// zero entries and good sector crcs, over whatever a reused device held:
/// a stale table from an earlier format must not vouch for anything.
/// Entries are consulted only for written extents, which set them first.
async fn write_empty_csum_table(dev: &DeviceChannel, sb: &Superblock) -> Result<(), MkfsError> {
    let mut one = vec![0u8; BLOCK_BYTES];
    TableBlock::zeroed().encode_into(&mut one);
    let mut at = 0;
    while at < sb.csum_table_blocks {
        let blocks = (sb.csum_table_blocks - at).min(CSUM_TABLE_WRITE_BLOCKS);
        let mut buf = AlignedBuf::zeroed(blocks as usize * BLOCK_BYTES, BLOCK_BYTES);
        for chunk in buf.chunks_exact_mut(BLOCK_BYTES) {
            chunk.copy_from_slice(&one);
        }
        let (_, r) = dev.write(DevBlock::new(sb.csum_table_start() + at).offset(), buf).await;
        r.map_err(FsError::from)?;
        at += blocks;
    }
    Ok(())
}

/// Format `dev`: two superblocks, an empty journal and a first checkpoint
/// holding the root directory. Returns the superblock written.
pub async fn mkfs(dev: DeviceChannel, options: &MkfsOptions) -> Result<Superblock, MkfsError> {
    let capacity = dev.geometry().capacity_bytes;
    if capacity < MIN_DEVICE_BYTES {
        return Err(MkfsError::TooSmall(capacity));
    }
    if !options.force && journal::read_superblocks(&dev).await?.iter().any(|c| c.is_ok()) {
        return Err(MkfsError::AlreadyFormatted);
    }
    let total_blocks = whole_blocks(capacity);
    if total_blocks > TOTAL_BLOCKS_MAX {
        return Err(MkfsError::TooLarge(capacity));
    }
    let journal_blocks =
        if options.journal_blocks > 0 { options.journal_blocks } else { (total_blocks / 64).clamp(256, 16384) };
    if !(16..=JOURNAL_BLOCKS_MAX).contains(&journal_blocks) {
        return Err(MkfsError::JournalSize(journal_blocks));
    }
    let (checksum_feature, csum_table_blocks) = match options.data_checksums {
        true => (FEATURE_DATA_CHECKSUMS, csum_table_blocks_for(total_blocks)),
        false => (0, 0),
    };
    let sb = Superblock {
        uuid: random_uuid()?,
        features: FEATURE_FREE_COUNT_HOLDS_CHECKPOINT | checksum_feature,
        generation: 0,
        total_blocks,
        journal_blocks,
        allocation_groups: options.allocation_groups.max(1),
        journal_start: 0,
        journal_seq: 1,
        checkpoint_seq: 0,
        checkpoint_bytes: 0,
        checkpoint_extents: Vec::new(),
        snapshot_table: Vec::new(),
        snapshot_table_bytes: 0,
        snapshot_table_seq: 0,
        csum_table_blocks,
    };
    if sb.data_start() + 16 > total_blocks {
        return Err(MkfsError::TooSmall(capacity));
    }
    write_empty_csum_table(&dev, &sb).await?;
    for (generation, slot) in SUPERBLOCK_SLOTS.iter().enumerate() {
        let copy = Superblock { generation: generation as u64, ..sb.clone() };
        let mut buf = AlignedBuf::zeroed(BLOCK_BYTES, BLOCK_BYTES);
        buf.copy_from_slice(&copy.encode());
        let (_, r) = dev.write(DevBlock::new(*slot).offset(), buf).await;
        r.map_err(FsError::from)?;
    }
    let config = FsConfig { file_clock: options.file_clock.clone(), ..FsConfig::default() };
    let fs = super::mount_with(dev, config, false).await?;
    let root =
        Inode::new(ROOT_INO, S_IFDIR | 0o755, options.root_uid, options.root_gid, 0, fs.inner.change().file_time());
    fs.inner.change().create_inode(root)?;
    fs.unmount().await?;
    Ok(fs.inspect().superblock())
}
