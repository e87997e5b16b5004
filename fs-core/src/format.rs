//! The on-disk format (documented in docs/FORMAT.md). All integers are
//! little-endian and fixed-width; every structure has a checksum.

use super::codec::{DecodeError, Reader, Writer};
use super::ids::Ino;

pub const BLOCK_SIZE: u64 = 4096;
pub const BLOCK_BYTES: usize = BLOCK_SIZE as usize;
pub const SUPERBLOCK_MAGIC: u64 = u64::from_le_bytes(*b"KEELFS01");
pub const FORMAT_VERSION: u32 = 1;
/// Superblock copies live in blocks 0 and 1.
pub const SUPERBLOCK_SLOTS: [u64; 2] = [0, 1];
pub const JOURNAL_FIRST_BLOCK: u64 = 2;
pub const ROOT_INO: Ino = Ino::new(1);
pub const NAME_MAX: usize = 255;
pub const SYMLINK_MAX: usize = 4095;
pub const XATTR_NAME_MAX: usize = 255;
pub const XATTR_VALUE_MAX: usize = 65536;
/// Names (each with its NUL) and values of one inode's xattrs together, at
/// most: xattrs live in memory and in every checkpoint, so a client may
/// not grow them without bound. Past it, setxattr fails with ENOSPC, as on
/// a filesystem whose xattr space is full.
pub const XATTR_INODE_BYTES_MAX: usize = 256 << 10;
/// One inode's names with their NULs, at most: what one listxattr may
/// return (Linux's XATTR_LIST_MAX).
pub const XATTR_LIST_BYTES_MAX: usize = 65536;
/// Checkpoint extents a superblock can name.
pub const CHECKPOINT_EXTENTS_MAX: usize = 128;
/// Feature bit: the free-block counts in transaction headers and in the
/// checkpoint count the current checkpoint's blocks as free, so that one
/// count is right whichever checkpoint a crash leaves current (a
/// checkpoint written in pieces while transactions go on needs that).
/// Without it they count them as used, and checkpoints are written whole.
pub const FEATURE_FREE_COUNT_HOLDS_CHECKPOINT: u64 = 1 << 0;
/// Feature bit: written extents of regular files may name the same
/// blocks (clones; docs/plans/shared-extents.md). Loading counts the
/// names instead of refusing the second; writes to a shared block copy
/// on write. The first clone sets it.
pub const FEATURE_SHARED_EXTENTS: u64 = 1 << 1;
/// Feature bit: the superblock names a snapshot table (issue 37,
/// docs/FORMAT.md "Snapshots"): retained checkpoints whose written
/// extents keep their blocks. Set, with bit 1, by the checkpoint that
/// installs the first table.
pub const FEATURE_SNAPSHOTS: u64 = 1 << 2;
/// Feature bit: a crc32c of every data block, kept in the data checksum
/// table between the journal and the data area (issue 38, docs/FORMAT.md
/// "Data checksums"). Chosen at mkfs, never set or cleared later: the
/// table's blocks move the data area.
pub const FEATURE_DATA_CHECKSUMS: u64 = 1 << 3;
pub const FEATURES_KNOWN: u64 =
    FEATURE_FREE_COUNT_HOLDS_CHECKPOINT | FEATURE_SHARED_EXTENTS | FEATURE_SNAPSHOTS | FEATURE_DATA_CHECKSUMS;
/// Snapshot table extents a superblock can name.
pub const SNAPSHOT_TABLE_EXTENTS_MAX: usize = 16;
/// The data checksum table is written in sectors of this size: the unit
/// every supported device writes whole, so a torn table write leaves each
/// sector old or new, and each one checks against its own crc.
pub const CSUM_SECTOR_BYTES: usize = 512;
/// Entries in one table sector: 127 crcs of 4 bytes, then the sector's
/// own crc32c over them.
pub const CSUMS_PER_SECTOR: u64 = 127;
pub const CSUM_SECTORS_PER_BLOCK: u64 = BLOCK_SIZE / CSUM_SECTOR_BYTES as u64;
/// Entries in one table block: 1016 device blocks, about 4 MiB of data.
pub const CSUMS_PER_TABLE_BLOCK: u64 = CSUMS_PER_SECTOR * CSUM_SECTORS_PER_BLOCK;

/// Regions whose bits one block of the dirty-region map holds: a region
/// is the data one table block covers, and a map block is laid out as a
/// table block whose 1016 entries are words of 32 bits.
pub const REGIONS_PER_MAP_BLOCK: u64 = CSUMS_PER_TABLE_BLOCK * 32;

/// The blocks of a data checksum table's entries for a device of
/// `total_blocks`. The table has an entry for every device block, the
/// superblocks', journal's and its own included (about 0.1% of it
/// unused), so that its size depends on the device alone and an entry's
/// index is the block's number.
pub const fn csum_entry_blocks_for(total_blocks: u64) -> u64 {
    total_blocks.div_ceil(CSUMS_PER_TABLE_BLOCK)
}

/// The blocks of the whole data checksum area for a device of
/// `total_blocks`: the table's entries, then the dirty-region map, a bit
/// per table block (docs/FORMAT.md "Data checksums").
pub const fn csum_table_blocks_for(total_blocks: u64) -> u64 {
    let entries = csum_entry_blocks_for(total_blocks);
    entries + entries.div_ceil(REGIONS_PER_MAP_BLOCK)
}

pub fn crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// Packed to 12 bytes: every resident inode holds four (issue 34,
/// memory per file). Fields are read by value, never by reference.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(C, packed(4))]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

impl Timespec {
    pub fn now() -> Self {
        let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Self { sec: d.as_secs() as i64, nsec: d.subsec_nanos() }
    }

    /// Now, at the kernel tick's resolution (see `keelfs_base::realtime_coarse`).
    pub fn now_coarse() -> Self {
        let (sec, nsec) = keelfs_base::realtime_coarse();
        Self { sec, nsec }
    }

    /// The next representable instant.
    pub fn next(self) -> Self {
        if self.nsec >= 999_999_999 {
            Self { sec: self.sec + 1, nsec: 0 }
        } else {
            Self { sec: self.sec, nsec: self.nsec + 1 }
        }
    }
}

/// A contiguous run of device blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockRun {
    pub start: u64,
    pub len: u64,
}

impl BlockRun {
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// Counters the format only ever increments (journal positions and
/// sequence numbers, the superblock generation) stay below this, so adding
/// a journal's worth to one can never overflow: 2^62 blocks or commits is
/// far past any device's life.
pub const COUNTER_MAX: u64 = 1 << 62;
/// The largest device keelfs formats, in blocks: 2^52 blocks of 4 KiB,
/// 16 EiB, so that block * BLOCK_SIZE fits a u64.
pub const TOTAL_BLOCKS_MAX: u64 = 1 << 52;
/// The largest journal, in blocks (mkfs picks at most 64 MiB; 4 GiB
/// leaves room to grow).
pub const JOURNAL_BLOCKS_MAX: u64 = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub uuid: [u8; 16],
    pub features: u64,
    /// Bumped on every superblock write; the valid copy with the highest
    /// generation wins at mount.
    pub generation: u64,
    pub total_blocks: u64,
    pub journal_blocks: u64,
    pub allocation_groups: u32,
    /// Where replay starts: a logical journal block (position modulo
    /// journal_blocks is the ring offset) and the sequence expected there.
    pub journal_start: u64,
    pub journal_seq: u64,
    pub checkpoint_seq: u64,
    pub checkpoint_bytes: u64,
    pub checkpoint_extents: Vec<BlockRun>,
    /// The snapshot table's blocks and length (FEATURE_SNAPSHOTS only;
    /// empty when there are none), written in checkpoint blocks numbered
    /// `snapshot_table_seq`: the sequence of the checkpoint that
    /// installed it.
    pub snapshot_table: Vec<BlockRun>,
    pub snapshot_table_bytes: u64,
    pub snapshot_table_seq: u64,
    /// The data checksum area's blocks, the table's entries and then the
    /// dirty-region map (FEATURE_DATA_CHECKSUMS only; 0 without it): they
    /// follow the journal, and always number
    /// `csum_table_blocks_for(total_blocks)`.
    pub csum_table_blocks: u64,
}

impl Superblock {
    /// The first block after the journal and the data checksum table.
    pub fn data_start(&self) -> u64 {
        self.csum_table_start() + self.csum_table_blocks
    }

    /// Where the data checksum table begins (or would): after the journal.
    pub fn csum_table_start(&self) -> u64 {
        JOURNAL_FIRST_BLOCK + self.journal_blocks
    }

    /// Where the dirty-region map begins: after the table's entries.
    pub fn csum_map_start(&self) -> u64 {
        self.csum_table_start() + csum_entry_blocks_for(self.total_blocks)
    }

    /// The dirty-region map's blocks (0 without data checksums).
    pub fn csum_map_blocks(&self) -> u64 {
        self.csum_table_blocks.saturating_sub(csum_entry_blocks_for(self.total_blocks))
    }

    pub fn has_data_checksums(&self) -> bool {
        self.features & FEATURE_DATA_CHECKSUMS != 0
    }

    /// The checkpoint's blocks.
    pub fn checkpoint_blocks(&self) -> u64 {
        self.checkpoint_extents.iter().map(|r| r.len).sum()
    }

    /// What the recorded free-block counts add to the allocator's free
    /// blocks: the checkpoint's, under FEATURE_FREE_COUNT_HOLDS_CHECKPOINT.
    pub fn free_count_checkpoint_blocks(&self) -> u64 {
        if self.features & FEATURE_FREE_COUNT_HOLDS_CHECKPOINT != 0 {
            self.checkpoint_blocks()
        } else {
            0
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u64(SUPERBLOCK_MAGIC);
        w.u32(FORMAT_VERSION);
        w.u32(BLOCK_SIZE as u32);
        w.bytes(&self.uuid);
        w.u64(self.features);
        w.u64(self.generation);
        w.u64(self.total_blocks);
        w.u64(self.journal_blocks);
        w.u32(self.allocation_groups);
        w.u64(self.journal_start);
        w.u64(self.journal_seq);
        w.u64(self.checkpoint_seq);
        w.u64(self.checkpoint_bytes);
        // decode refuses more, so never write more.
        assert!(self.checkpoint_extents.len() <= CHECKPOINT_EXTENTS_MAX, "too many checkpoint extents");
        w.u32(self.checkpoint_extents.len() as u32);
        for run in &self.checkpoint_extents {
            w.u64(run.start);
            w.u64(run.len);
        }
        if self.features & FEATURE_SNAPSHOTS != 0 {
            assert!(self.snapshot_table.len() <= SNAPSHOT_TABLE_EXTENTS_MAX, "too many snapshot table extents");
            w.u64(self.snapshot_table_bytes);
            w.u64(self.snapshot_table_seq);
            w.u32(self.snapshot_table.len() as u32);
            for run in &self.snapshot_table {
                w.u64(run.start);
                w.u64(run.len);
            }
        } else {
            assert!(self.snapshot_table.is_empty(), "a snapshot table without its feature bit");
        }
        if self.has_data_checksums() {
            w.u64(self.csum_table_blocks);
        } else {
            assert_eq!(self.csum_table_blocks, 0, "a data checksum table without its feature bit");
        }
        let sum = crc(&w.buf);
        w.u32(sum);
        let mut block = w.buf;
        assert!(block.len() <= BLOCK_BYTES);
        block.resize(BLOCK_BYTES, 0);
        block
    }

    pub fn decode(block: &[u8]) -> Result<Self, SuperblockError> {
        let mut r = Reader::new(block);
        if r.u64("superblock magic")? != SUPERBLOCK_MAGIC {
            return Err(SuperblockError::NotKeelfs);
        }
        let version = r.u32("version")?;
        if version != FORMAT_VERSION {
            return Err(SuperblockError::Version(version));
        }
        if r.u32("block size")? != BLOCK_SIZE as u32 {
            return Err(SuperblockError::Field("block size"));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(r.take(16, "uuid")?);
        let features = r.u64("features")?;
        let generation = r.u64("generation")?;
        let total_blocks = r.u64("total blocks")?;
        let journal_blocks = r.u64("journal blocks")?;
        let allocation_groups = r.u32("allocation groups")?;
        let journal_start = r.u64("journal start")?;
        let journal_seq = r.u64("journal seq")?;
        let checkpoint_seq = r.u64("checkpoint seq")?;
        let checkpoint_bytes = r.u64("checkpoint bytes")?;
        let count = r.u32("checkpoint extent count")? as usize;
        if count > CHECKPOINT_EXTENTS_MAX {
            return Err(SuperblockError::Field("checkpoint extent count"));
        }
        let mut checkpoint_extents = Vec::with_capacity(count);
        for _ in 0..count {
            checkpoint_extents.push(BlockRun { start: r.u64("checkpoint extent")?, len: r.u64("checkpoint extent")? });
        }
        let (snapshot_table, snapshot_table_bytes, snapshot_table_seq) = match features & FEATURE_SNAPSHOTS {
            0 => (Vec::new(), 0, 0),
            _ => decode_snapshot_fields(&mut r)?,
        };
        let csum_table_blocks =
            if features & FEATURE_DATA_CHECKSUMS != 0 { r.u64("data checksum table blocks")? } else { 0 };
        let covered = r.pos();
        let stored = r.u32("superblock checksum")?;
        if crc(&block[..covered]) != stored {
            return Err(SuperblockError::Checksum);
        }
        if features & !FEATURES_KNOWN != 0 {
            return Err(SuperblockError::Features(features));
        }
        let sb = Superblock {
            uuid,
            features,
            generation,
            total_blocks,
            journal_blocks,
            allocation_groups,
            journal_start,
            journal_seq,
            checkpoint_seq,
            checkpoint_bytes,
            checkpoint_extents,
            snapshot_table,
            snapshot_table_bytes,
            snapshot_table_seq,
            csum_table_blocks,
        };
        sb.check_geometry()?;
        Ok(sb)
    }

    /// Every field against the format's limits, with checked arithmetic:
    /// a crafted superblock carries a valid checksum as easily as a real
    /// one. (Against the device size: `journal::choose_superblock`.)
    fn check_geometry(&self) -> Result<(), SuperblockError> {
        use SuperblockError::Field;
        let journal_end = JOURNAL_FIRST_BLOCK.checked_add(self.journal_blocks).ok_or(Field("journal size"))?;
        if self.journal_blocks < 16 || self.journal_blocks > JOURNAL_BLOCKS_MAX || journal_end >= self.total_blocks {
            return Err(Field("journal size"));
        }
        if self.total_blocks > TOTAL_BLOCKS_MAX {
            return Err(Field("total blocks"));
        }
        let table_blocks_expected =
            if self.has_data_checksums() { csum_table_blocks_for(self.total_blocks) } else { 0 };
        if self.csum_table_blocks != table_blocks_expected {
            return Err(Field("data checksum table size"));
        }
        // No overflow: both terms are at most total_blocks <= 2^52.
        let data_start = journal_end + self.csum_table_blocks;
        if data_start >= self.total_blocks {
            return Err(Field("data checksum table size"));
        }
        if self.allocation_groups == 0 || u64::from(self.allocation_groups) > self.total_blocks {
            return Err(Field("allocation groups"));
        }
        for (value, name) in [
            (self.generation, "generation"),
            (self.journal_start, "journal start"),
            (self.journal_seq, "journal seq"),
            (self.checkpoint_seq, "checkpoint seq"),
            (self.snapshot_table_seq, "snapshot table seq"),
        ] {
            if value >= COUNTER_MAX {
                return Err(Field(name));
            }
        }
        let cp_blocks = runs_in_data_area(&self.checkpoint_extents, data_start, self.total_blocks)
            .ok_or(Field("checkpoint extent outside the data area"))?;
        if self.checkpoint_bytes > crate::blocks::block_bytes(cp_blocks) {
            return Err(Field("checkpoint size"));
        }
        let table_blocks = runs_in_data_area(&self.snapshot_table, data_start, self.total_blocks)
            .ok_or(Field("snapshot table extent outside the data area"))?;
        if self.snapshot_table_bytes > crate::blocks::block_bytes(table_blocks) {
            return Err(Field("snapshot table size"));
        }
        Ok(())
    }
}

/// The snapshot table's superblock fields (FEATURE_SNAPSHOTS): its
/// extents, bytes and seq.
fn decode_snapshot_fields(r: &mut Reader<'_>) -> Result<(Vec<BlockRun>, u64, u64), SuperblockError> {
    let bytes = r.u64("snapshot table bytes")?;
    let seq = r.u64("snapshot table seq")?;
    let count = r.u32("snapshot table extent count")? as usize;
    if count > SNAPSHOT_TABLE_EXTENTS_MAX {
        return Err(SuperblockError::Field("snapshot table extent count"));
    }
    let mut table = Vec::with_capacity(count);
    for _ in 0..count {
        table.push(BlockRun { start: r.u64("table extent")?, len: r.u64("table extent")? });
    }
    Ok((table, bytes, seq))
}

/// The blocks of `runs`, if each is non-empty and inside the data area
/// [data_start, total).
pub(crate) fn runs_in_data_area(runs: &[BlockRun], data_start: u64, total: u64) -> Option<u64> {
    let mut blocks = 0u64;
    for run in runs {
        let end = run.start.checked_add(run.len)?;
        if run.len == 0 || run.start < data_start || end > total {
            return None;
        }
        // No overflow: every run lies inside total <= 2^52.
        blocks += run.len;
    }
    Some(blocks)
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SuperblockError {
    #[error("no keelfs superblock (bad magic)")]
    NotKeelfs,
    #[error("unsupported format version {0}")]
    Version(u32),
    #[error("unknown feature flags {0:#x}")]
    Features(u64),
    #[error("superblock checksum mismatch")]
    Checksum,
    #[error("superblock field '{0}' is invalid")]
    Field(&'static str),
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// File types, as in the mode's S_IFMT bits.
pub const S_IFMT: u32 = libc::S_IFMT;
pub const S_IFDIR: u32 = libc::S_IFDIR;
pub const S_IFREG: u32 = libc::S_IFREG;
pub const S_IFLNK: u32 = libc::S_IFLNK;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inode {
    pub ino: Ino,
    pub generation: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub rdev: u32,
    pub flags: u32,
    pub size: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub btime: Timespec,
    pub i_version: u64,
}

impl Inode {
    pub const ENCODED_BYTES: usize = 8 * 4 + 4 * 6 + 12 * 4;

    /// A new, empty inode created at `now` (all four times): a directory
    /// starts with two links ("." and its entry), anything else with one.
    pub fn new(ino: Ino, mode: u32, uid: u32, gid: u32, rdev: u32, now: Timespec) -> Self {
        let t = now;
        Inode {
            ino,
            generation: 1,
            mode,
            uid,
            gid,
            nlink: if mode & S_IFMT == S_IFDIR { 2 } else { 1 },
            rdev,
            flags: 0,
            size: 0,
            atime: t,
            mtime: t,
            ctime: t,
            btime: t,
            i_version: 1,
        }
    }

    pub fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }
    pub fn is_reg(&self) -> bool {
        self.mode & S_IFMT == S_IFREG
    }
    pub fn is_symlink(&self) -> bool {
        self.mode & S_IFMT == S_IFLNK
    }
    pub fn file_type(&self) -> u32 {
        self.mode & S_IFMT
    }

    pub fn encode(&self, w: &mut Writer) {
        w.u64(self.ino.get());
        w.u64(self.generation);
        w.u32(self.mode);
        w.u32(self.uid);
        w.u32(self.gid);
        w.u32(self.nlink);
        w.u32(self.rdev);
        w.u32(self.flags);
        w.u64(self.size);
        for t in [self.atime, self.mtime, self.ctime, self.btime] {
            w.i64(t.sec);
            w.u32(t.nsec);
        }
        w.u64(self.i_version);
    }

    pub fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let ino = Ino::new(r.u64("inode number")?);
        let generation = r.u64("inode generation")?;
        let mode = r.u32("mode")?;
        let uid = r.u32("uid")?;
        let gid = r.u32("gid")?;
        let nlink = r.u32("nlink")?;
        let rdev = r.u32("rdev")?;
        let flags = r.u32("flags")?;
        let size = r.u64("size")?;
        let mut times = [Timespec::default(); 4];
        for t in &mut times {
            let at = r.pos();
            *t = Timespec { sec: r.i64("time")?, nsec: r.u32("time")? };
            if t.nsec >= 1_000_000_000 {
                return Err(DecodeError { what: "nanoseconds", at });
            }
        }
        let i_version = r.u64("i_version")?;
        let [atime, mtime, ctime, btime] = times;
        Ok(Inode { ino, generation, mode, uid, gid, nlink, rdev, flags, size, atime, mtime, ctime, btime, i_version })
    }
}

const _: () = assert!(Inode::ENCODED_BYTES == 104);
