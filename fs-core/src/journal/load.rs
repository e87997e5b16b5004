//! Reading a filesystem back: both superblock copies, the checkpoint they
//! name, streamed into a fresh state, and the transactions in the ring
//! after it.

use keelfs_bdev::AlignedBuf;
use keelfs_reactor::DeviceChannel;

use super::snapshots::{load_snapshots, Snapshots};
use super::{
    corrupt, decode_any_tx_header, decode_tx_header, ring_block, Loaded, CHECKPOINT_BLOCK_MAGIC, CP_HEADER_BYTES,
    CP_PAYLOAD_PER_BLOCK, READ_BLOCKS_MAX, TX_HEADER_BYTES,
};
use crate::blocks::{block_bytes, whole_blocks, DevBlock};
use crate::codec::Reader;
use crate::csum_table::TableCache;
use crate::format::{
    crc, BlockRun, Superblock, SuperblockError, BLOCK_BYTES, FEATURE_SHARED_EXTENTS, SUPERBLOCK_SLOTS,
};
use crate::format::{XATTR_NAME_MAX, XATTR_VALUE_MAX};
use crate::record::{decode_all, Record};
use crate::space::FreeSpace;
use crate::state::{ApplyError, ApplyMode, State};
use crate::FsResult;

pub(super) async fn read_blocks(dev: &DeviceChannel, block: u64, count: usize) -> FsResult<AlignedBuf> {
    let buf = AlignedBuf::zeroed(count * BLOCK_BYTES, BLOCK_BYTES);
    let (buf, result) = dev.read(DevBlock::new(block).offset(), buf).await;
    result?;
    Ok(buf)
}

/// Both superblock copies, decoded.
pub(crate) async fn read_superblocks(dev: &DeviceChannel) -> FsResult<Vec<Result<Superblock, SuperblockError>>> {
    let mut out = Vec::new();
    for slot in SUPERBLOCK_SLOTS {
        let buf = read_blocks(dev, slot, 1).await?;
        out.push(Superblock::decode(&buf));
    }
    Ok(out)
}

/// The valid copy with the highest generation, and complaints about the
/// other one.
pub(crate) fn choose_superblock(
    copies: Vec<Result<Superblock, SuperblockError>>,
    capacity_blocks: u64,
) -> FsResult<(Superblock, Vec<String>)> {
    let mut problems = Vec::new();
    let mut best: Option<Superblock> = None;
    let mut reasons = Vec::new();
    for (slot, copy) in copies.into_iter().enumerate() {
        match copy {
            Ok(sb) if sb.total_blocks > capacity_blocks => {
                problems.push(format!(
                    "superblock copy {slot} describes {} blocks, device has {capacity_blocks}",
                    sb.total_blocks
                ));
            }
            Ok(sb) => {
                if best.as_ref().is_none_or(|b| sb.generation > b.generation) {
                    best = Some(sb);
                }
            }
            Err(e) => {
                reasons.push(e.to_string());
                problems.push(format!("superblock copy {slot}: {e}"));
            }
        }
    }
    match best {
        Some(sb) => Ok((sb, problems)),
        None if reasons.iter().all(|r| r.contains("bad magic")) => Err(corrupt("not a keelfs device (no superblock)")),
        None => Err(corrupt(format!("no valid superblock: {}", problems.join("; ")))),
    }
}

/// The longest record a checkpoint can hold (an xattr of the largest
/// name and value), with room to spare: the streaming loader decodes a
/// record only once this many bytes are buffered or the payload has
/// ended, so a record cut by a read's end is never mistaken for damage.
const RECORD_BYTES_MAX: usize = 1 << 17;
const _: () = assert!(1 + 8 + 4 + XATTR_NAME_MAX + 4 + XATTR_VALUE_MAX + 64 < RECORD_BYTES_MAX);

/// What loading rebuilds from the checkpoint and the journal: the
/// metadata, and the free space the extents leave.
pub(crate) struct Rebuilt {
    pub state: State,
    pub free: FreeSpace,
    /// The data checksum table, with the entries the journal sets (an
    /// image with FEATURE_DATA_CHECKSUMS only).
    pub csums: Option<TableCache>,
}

impl Rebuilt {
    fn replay(&mut self, record: &Record) -> Result<(), ApplyError> {
        self.state.apply(record, ApplyMode::Replay, &mut self.free)
    }

    /// A journal record: a checksum record goes to the table, which only
    /// the journal sets (a checkpoint never holds one).
    fn replay_journal(&mut self, record: &Record) -> Result<(), String> {
        match (record, &mut self.csums) {
            (Record::CsumSet { first_block, crcs }, Some(table)) => table.set(*first_block, crcs),
            (Record::CsumSet { .. }, None) => Err("a data checksum record on an image that keeps none".into()),
            _ => self.replay(record).map_err(|e| e.to_string()),
        }
    }

    /// Once everything is loaded: a block with two names is named only by
    /// written extents. Loading took the second name of any block in use,
    /// and the other may have been the checkpoint's or an unwritten
    /// extent's; either is damage (a checkpoint's blocks are freed by the
    /// next one, and writing an unwritten block in place would show in
    /// every file that names it). One pass over the extents, only when
    /// something is shared.
    pub(crate) fn check_sharing(&self, sb: &Superblock, snapshots: &Snapshots) -> Result<(), String> {
        let shared = &self.free.shared;
        if shared.is_empty() {
            return Ok(());
        }
        let metadata = sb.checkpoint_extents.iter().copied().chain(sb.snapshot_table.iter().copied());
        let mut metadata = metadata.chain(snapshots.checkpoint_runs_besides(sb.checkpoint_seq));
        if let Some(run) = metadata.find_map(|cp| shared.shared_within(cp).into_iter().next()) {
            return Err(format!(
                "blocks [{}, +{}) belong to a checkpoint or the snapshot table, and to a file",
                run.start, run.len
            ));
        }
        for node in self.state.nodes() {
            for extent in node.extents.iter().filter(|e| e.unwritten) {
                let run = BlockRun { start: extent.disk_block.get(), len: extent.len };
                if let Some(both) = shared.shared_within(run).into_iter().next() {
                    let ino = node.inode.ino;
                    return Err(format!(
                        "unwritten extent of inode {ino} shares blocks [{}, +{})",
                        both.start, both.len
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Load the checkpoint the superblock names into a fresh state.
///
/// Streamed: blocks are read 256 at a time and each record is applied
/// as soon as it is decoded, so loading holds the state and about a
/// megabyte, not the whole checkpoint and its decoded records beside it
/// (at 10M files those were 1.7 GB and several more; issue 34).
pub(crate) async fn load_checkpoint(dev: &DeviceChannel, sb: &Superblock) -> FsResult<(Rebuilt, u64)> {
    let mut alloc = crate::alloc::Allocator::new(sb.data_start(), sb.total_blocks, sb.allocation_groups);
    for run in &sb.checkpoint_extents {
        alloc.claim(*run).map_err(|e| corrupt(format!("checkpoint extents overlap: {e}")))?;
    }
    let total_data = sb.total_blocks - sb.data_start();
    let mut rebuilt =
        Rebuilt { state: State::default(), free: FreeSpace::new(alloc), csums: TableCache::for_superblock(sb) };
    rebuilt.free.sharing_allowed = sb.features & FEATURE_SHARED_EXTENTS != 0;
    if sb.checkpoint_bytes == 0 {
        // A freshly made filesystem before its first checkpoint.
        return Ok((rebuilt, total_data));
    }
    if sb.checkpoint_bytes < 8 {
        return Err(corrupt("checkpoint is too short to hold its free-block count"));
    }
    let mut stream = CheckpointStream { pending: Vec::new(), taken: 0, recorded_free: None, index: 0 };
    for run in &sb.checkpoint_extents {
        let mut b = 0;
        while b < run.len && stream.taken < sb.checkpoint_bytes {
            let n = (run.len - b).min(READ_BLOCKS_MAX);
            let buf = read_blocks(dev, run.start + b, n as usize).await?;
            for (i, block) in buf.chunks_exact(BLOCK_BYTES).enumerate() {
                stream.push_block(block, sb, run.start + b + i as u64)?;
            }
            stream.apply_ready(&mut rebuilt, false)?;
            b += n;
        }
    }
    if stream.taken < sb.checkpoint_bytes {
        return Err(corrupt("checkpoint is shorter than the superblock says"));
    }
    stream.apply_ready(&mut rebuilt, true)?;
    Ok((rebuilt, stream.recorded_free.expect("8 bytes or more were taken")))
}

/// A checkpoint's payload on its way from blocks to the state.
struct CheckpointStream {
    /// Payload bytes read and not yet decoded.
    pending: Vec<u8>,
    /// Payload bytes taken so far (the superblock says how many there are).
    taken: u64,
    recorded_free: Option<u64>,
    /// The next block's index in the checkpoint.
    index: u32,
}

impl CheckpointStream {
    fn push_block(&mut self, block: &[u8], sb: &Superblock, device_block: u64) -> FsResult<()> {
        if self.taken >= sb.checkpoint_bytes {
            return Ok(());
        }
        let chunk = parse_checkpoint_block(block, sb.checkpoint_seq, self.index)
            .map_err(|why| corrupt(format!("checkpoint block {} (device block {device_block}): {why}", self.index)))?;
        let want = (sb.checkpoint_bytes - self.taken).min(chunk.len() as u64) as usize;
        self.pending.extend_from_slice(&chunk[..want]);
        self.taken += want as u64;
        self.index += 1;
        Ok(())
    }

    /// Decode and apply every whole record buffered (all of them at the end).
    fn apply_ready(&mut self, rebuilt: &mut Rebuilt, at_end: bool) -> FsResult<()> {
        let mut start = 0;
        if self.recorded_free.is_none() {
            if self.pending.len() < 8 {
                return if at_end {
                    Err(corrupt("checkpoint is too short to hold its free-block count"))
                } else {
                    Ok(())
                };
            }
            self.recorded_free = Some(u64::from_le_bytes(self.pending[..8].try_into().expect("8 bytes")));
            start = 8;
        }
        let mut r = Reader::new(&self.pending[start..]);
        while r.remaining() > 0 && (at_end || r.remaining() >= RECORD_BYTES_MAX) {
            let record = Record::decode(&mut r).map_err(|e| corrupt(format!("checkpoint records: {e}")))?;
            rebuilt.replay(&record).map_err(|e| corrupt(format!("checkpoint: {e}")))?;
        }
        let used = start + r.pos();
        self.pending.drain(..used);
        Ok(())
    }
}

pub(super) fn parse_checkpoint_block(block: &[u8], seq: u64, index: u32) -> Result<&[u8], &'static str> {
    let mut r = Reader::new(block);
    let bad = |_| "truncated header";
    if r.u32("magic").map_err(bad)? != CHECKPOINT_BLOCK_MAGIC {
        return Err("bad magic");
    }
    let stored = r.u32("crc").map_err(bad)?;
    if crc(&block[8..]) != stored {
        return Err("checksum mismatch");
    }
    if r.u64("seq").map_err(bad)? != seq {
        return Err("belongs to another checkpoint");
    }
    if r.u32("index").map_err(bad)? != index {
        return Err("out of order");
    }
    let len = r.u32("len").map_err(bad)? as usize;
    if len > CP_PAYLOAD_PER_BLOCK {
        return Err("payload length too large");
    }
    Ok(&block[CP_HEADER_BYTES..CP_HEADER_BYTES + len])
}

/// Read `count` logical journal blocks starting at `logical`, across the
/// ring's end if need be.
async fn read_ring(dev: &DeviceChannel, sb: &Superblock, logical: u64, count: u64) -> FsResult<Vec<u8>> {
    let mut out = Vec::with_capacity(block_bytes(count) as usize);
    let mut at = logical;
    while at < logical + count {
        let ring_off = at % sb.journal_blocks;
        let n = (sb.journal_blocks - ring_off).min(logical + count - at).min(READ_BLOCKS_MAX);
        let buf = read_blocks(dev, ring_block(sb, at), n as usize).await?;
        out.extend_from_slice(&buf);
        at += n;
    }
    Ok(out)
}

/// What replay found: where the log ends, what it applied, and the stale
/// headers past its end that a later replay could take for its
/// continuation.
pub(crate) struct Replayed {
    /// The logical block after the last transaction, and the sequence
    /// expected there: where the next transaction goes.
    pub head: u64,
    pub seq: u64,
    /// Transactions applied.
    pub count: u64,
    /// The free-block count the last of them recorded.
    pub free: u64,
    /// Logical blocks past the end holding a transaction of this
    /// filesystem numbered at or after `seq` ([`stale_continuations`]).
    pub stale: Vec<u64>,
}

/// Replay transactions from the superblock's journal start until the first
/// one that is missing or torn.
pub(crate) async fn replay(
    dev: &DeviceChannel,
    sb: &Superblock,
    rebuilt: &mut Rebuilt,
    mut recorded_free: u64,
) -> FsResult<Replayed> {
    let (mut pos, mut seq, mut count) = (sb.journal_start, sb.journal_seq, 0u64);
    loop {
        if pos - sb.journal_start >= sb.journal_blocks {
            break;
        }
        let first = read_ring(dev, sb, pos, 1).await?;
        let Some(h) = decode_tx_header(&first, &sb.uuid, seq) else { break };
        let room = sb.journal_blocks - (pos - sb.journal_start);
        if h.blocks == 0
            || u64::from(h.blocks) > room
            || h.payload_len as usize > h.blocks as usize * BLOCK_BYTES - TX_HEADER_BYTES
        {
            // Its checksum says the header was written whole, so this is
            // not a torn tail: it was written so (found by the image
            // fuzzer: taken for the end, it let the transactions after it
            // come back under the ones this mount then wrote).
            return Err(corrupt(format!(
                "journal transaction {seq} claims {} blocks and {} payload bytes, past the ring",
                h.blocks, h.payload_len
            )));
        }
        let whole = read_ring(dev, sb, pos, u64::from(h.blocks)).await?;
        let payload = &whole[TX_HEADER_BYTES..TX_HEADER_BYTES + h.payload_len as usize];
        if crc(payload) != h.payload_crc {
            // A torn tail (the commit never completed) is the end of the
            // log. A damaged transaction with a valid one after it is not.
            let next = pos + u64::from(h.blocks);
            if next - sb.journal_start < sb.journal_blocks {
                let after = read_ring(dev, sb, next, 1).await?;
                if decode_tx_header(&after, &sb.uuid, seq + 1).is_some() {
                    return Err(corrupt(format!(
                        "journal transaction {seq} is damaged (checksum mismatch) and later ones exist"
                    )));
                }
            }
            break;
        }
        let records = decode_all(payload).map_err(|e| corrupt(format!("journal transaction {seq}: {e}")))?;
        for r in &records {
            rebuilt.replay_journal(r).map_err(|e| corrupt(format!("journal transaction {seq}: {e}")))?;
        }
        recorded_free = h.free_blocks;
        pos += u64::from(h.blocks);
        seq += 1;
        count += 1;
    }
    let stale = stale_continuations(dev, sb, pos, seq).await?;
    Ok(Replayed { head: pos, seq, count, free: recorded_free, stale })
}

/// After replay ends at logical block `end`, expecting transaction `seq`
/// there: the blocks in the rest of the ring that hold a transaction of
/// this filesystem numbered `seq` or later. An honest ring holds only
/// earlier laps there, numbered lower, and at most a torn tail at `end`
/// itself. A crafted or damaged one may not: a transaction that claims
/// more blocks than it needs hides the ones it covers, and once the
/// journal's start passes them they lie past the end, numbered on. New
/// transactions written from `end` could then lead the next replay into
/// one of them, as if it continued them (found by the image fuzzer). A
/// mount that will write erases these headers first; fsck reports them.
/// Reads the rest of the ring once, in bounded pieces.
async fn stale_continuations(dev: &DeviceChannel, sb: &Superblock, end: u64, seq: u64) -> FsResult<Vec<u64>> {
    let ring_end = sb.journal_start + sb.journal_blocks;
    let mut stale = Vec::new();
    let mut at = end + 1;
    while at < ring_end {
        // Up to the ring's physical end at most, read in place: this runs
        // at every mount, over the whole rest of the journal.
        let n = (ring_end - at).min(READ_BLOCKS_MAX).min(sb.journal_blocks - at % sb.journal_blocks);
        let blocks = read_blocks(dev, ring_block(sb, at), n as usize).await?;
        for (i, block) in blocks.chunks_exact(BLOCK_BYTES).enumerate() {
            if decode_any_tx_header(block, &sb.uuid).is_some_and(|h| h.seq >= seq) {
                stale.push(at + i as u64);
            }
        }
        at += n;
    }
    Ok(stale)
}

pub(crate) async fn load(dev: &DeviceChannel, require_root: bool) -> FsResult<Loaded> {
    let capacity_blocks = whole_blocks(dev.geometry().capacity_bytes);
    let (sb, _other_copy_problems) = choose_superblock(read_superblocks(dev).await?, capacity_blocks)?;
    let (mut rebuilt, recorded_free) = load_checkpoint(dev, &sb).await?;
    let replayed = replay(dev, &sb, &mut rebuilt, recorded_free).await?;
    let snapshots = load_snapshots(dev, &sb, &mut rebuilt).await?;
    match rebuilt.state.node(crate::format::ROOT_INO) {
        // Mount frees inodes with no links: a crafted root among them
        // would free the whole tree.
        Some(root) if root.inode.is_dir() && root.inode.nlink == 0 => {
            return Err(corrupt("the root directory has no links"));
        }
        Some(root) if root.inode.is_dir() => {}
        _ if !require_root => {}
        _ => return Err(corrupt("the root directory is missing")),
    }
    rebuilt.check_sharing(&sb, &snapshots).map_err(corrupt)?;
    let Rebuilt { state, free, csums } = rebuilt;
    let Replayed { head: journal_head, seq: journal_seq, count, stale, .. } = replayed;
    Ok(Loaded { sb, state, free, csums, journal_head, journal_seq, replayed: count, stale_headers: stale, snapshots })
}
