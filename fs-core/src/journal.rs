//! The metadata journal and checkpoints.
//!
//! A transaction is a run of blocks in the journal ring: a 64-byte header
//! (magic, checksum, filesystem UUID, sequence, length, payload checksum,
//! free-block count) followed by the encoded records. Commits are
//! serialised by one async mutex; whoever holds it commits everything
//! logged so far, which is what makes concurrent fsyncs share one journal
//! write and one device flush (group commit).
//!
//! Commit order on a device with a volatile cache (ordered data):
//! 1. flush, if data writes completed since the last flush, so that data a
//!    record makes visible is durable before the record;
//! 2. write the transaction;
//! 3. flush, so that the transaction is durable before fsync returns.
//!
//! A checkpoint writes the whole in-memory state, taken in the same
//! synchronous step that takes the pending records, to freshly allocated
//! blocks, then a new superblock generation that points at it with the
//! journal start moved to the head. It runs when the ring is half full,
//! when a transaction would not fit, and at unmount.

use std::cell::RefCell;
use std::rc::Rc;

use super::blocks::{block_bytes, whole_blocks, DevBlock};
use super::codec::{Reader, Writer};
use super::format::{
    crc, BlockRun, Superblock, SuperblockError, BLOCK_BYTES, FEATURE_FREE_COUNT_HOLDS_CHECKPOINT, JOURNAL_FIRST_BLOCK,
    SUPERBLOCK_SLOTS, XATTR_NAME_MAX, XATTR_VALUE_MAX,
};
use super::record::{decode_all, Record};
use super::space::Space;
use super::state::{ApplyMode, SnapshotBytes, State};
use super::sync::AsyncMutex;
use super::{FsError, FsInner, FsResult};
use keelfs_bdev::AlignedBuf;
use keelfs_reactor as reactor;
use keelfs_reactor::DeviceChannel;

pub const JOURNAL_TX_MAGIC: u32 = u32::from_le_bytes(*b"KFTX");
pub const CHECKPOINT_BLOCK_MAGIC: u32 = u32::from_le_bytes(*b"KFCP");
const TX_HEADER_BYTES: usize = 64;
const CP_HEADER_BYTES: usize = 24;
const CP_PAYLOAD_PER_BLOCK: usize = BLOCK_BYTES - CP_HEADER_BYTES;
/// Largest single read while loading (1 MiB, the device request limit).
const READ_BLOCKS_MAX: u64 = 256;

/// The journal's part of a mounted filesystem (step S7a of
/// docs/plans/fs-parts.md): the superblock, the ring's position and the
/// records waiting to go into it, the lock that orders commits, and the
/// transactions replay applied at mount. The commit functions below still
/// take the whole `FsInner` and reach these through `fs.journal`.
pub(crate) struct Journal {
    pub(crate) sb: RefCell<Superblock>,
    pub(crate) ring: RefCell<super::JournalState>,
    pub(crate) commit_lock: AsyncMutex,
    pub(crate) replayed_at_mount: u64,
}

/// Everything a mount (or fsck) learns from the device.
pub(crate) struct Loaded {
    pub sb: Superblock,
    pub state: State,
    pub journal_head: u64,
    pub journal_seq: u64,
    pub replayed: u64,
}

fn corrupt(msg: impl Into<String>) -> FsError {
    FsError::Corrupt(msg.into())
}

async fn read_blocks(dev: &DeviceChannel, block: u64, count: usize) -> FsResult<AlignedBuf> {
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

/// Load the checkpoint the superblock names into a fresh state.
///
/// Streamed: blocks are read 256 at a time and each record is applied
/// as soon as it is decoded, so loading holds the state and about a
/// megabyte, not the whole checkpoint and its decoded records beside it
/// (at 10M files those were 1.7 GB and several more; issue 34).
pub(crate) async fn load_checkpoint(dev: &DeviceChannel, sb: &Superblock) -> FsResult<(State, u64)> {
    let mut alloc = super::alloc::Allocator::new(sb.data_start(), sb.total_blocks, sb.allocation_groups);
    for run in &sb.checkpoint_extents {
        alloc.claim(*run).map_err(|e| corrupt(format!("checkpoint extents overlap: {e}")))?;
    }
    let total_data = sb.total_blocks - sb.data_start();
    let mut state = State::new(alloc);
    if sb.checkpoint_bytes == 0 {
        // A freshly made filesystem before its first checkpoint.
        return Ok((state, total_data));
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
            stream.apply_ready(&mut state, false)?;
            b += n;
        }
    }
    if stream.taken < sb.checkpoint_bytes {
        return Err(corrupt("checkpoint is shorter than the superblock says"));
    }
    stream.apply_ready(&mut state, true)?;
    Ok((state, stream.recorded_free.expect("8 bytes or more were taken")))
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
    fn apply_ready(&mut self, state: &mut State, at_end: bool) -> FsResult<()> {
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
            state.apply(&record, ApplyMode::Replay).map_err(|e| corrupt(format!("checkpoint: {e}")))?;
        }
        let used = start + r.pos();
        self.pending.drain(..used);
        Ok(())
    }
}

fn parse_checkpoint_block(block: &[u8], seq: u64, index: u32) -> Result<&[u8], &'static str> {
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

struct TxHeader {
    seq: u64,
    blocks: u32,
    payload_len: u32,
    payload_crc: u32,
    free_blocks: u64,
}

fn encode_tx_header(uuid: &[u8; 16], h: &TxHeader) -> [u8; TX_HEADER_BYTES] {
    let mut w = Writer::new();
    w.u32(JOURNAL_TX_MAGIC);
    w.u32(0);
    w.bytes(uuid);
    w.u64(h.seq);
    w.u32(h.blocks);
    w.u32(h.payload_len);
    w.u32(h.payload_crc);
    w.u64(h.free_blocks);
    w.buf.resize(TX_HEADER_BYTES, 0);
    let sum = crc(&w.buf[8..]);
    w.buf[4..8].copy_from_slice(&sum.to_le_bytes());
    w.buf.try_into().expect("64 bytes")
}

fn decode_tx_header(block: &[u8], uuid: &[u8; 16], seq: u64) -> Option<TxHeader> {
    let mut r = Reader::new(&block[..TX_HEADER_BYTES]);
    if r.u32("magic").ok()? != JOURNAL_TX_MAGIC {
        return None;
    }
    let stored = r.u32("crc").ok()?;
    if crc(&block[8..TX_HEADER_BYTES]) != stored || r.take(16, "uuid").ok()? != uuid {
        return None;
    }
    let h = TxHeader {
        seq: r.u64("seq").ok()?,
        blocks: r.u32("blocks").ok()?,
        payload_len: r.u32("payload len").ok()?,
        payload_crc: r.u32("payload crc").ok()?,
        free_blocks: r.u64("free").ok()?,
    };
    (h.seq == seq).then_some(h)
}

fn ring_block(sb: &Superblock, logical: u64) -> u64 {
    JOURNAL_FIRST_BLOCK + logical % sb.journal_blocks
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

/// Replay transactions from the superblock's journal start until the first
/// one that is missing or torn. Returns (head, next seq, count, free).
pub(crate) async fn replay(
    dev: &DeviceChannel,
    sb: &Superblock,
    state: &mut State,
    mut recorded_free: u64,
) -> FsResult<(u64, u64, u64, u64)> {
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
            break;
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
            state.apply(r, ApplyMode::Replay).map_err(|e| corrupt(format!("journal transaction {seq}: {e}")))?;
        }
        recorded_free = h.free_blocks;
        pos += u64::from(h.blocks);
        seq += 1;
        count += 1;
    }
    Ok((pos, seq, count, recorded_free))
}

pub(crate) async fn load(dev: &DeviceChannel, require_root: bool) -> FsResult<Loaded> {
    let capacity_blocks = whole_blocks(dev.geometry().capacity_bytes);
    let (sb, _other_copy_problems) = choose_superblock(read_superblocks(dev).await?, capacity_blocks)?;
    let (mut state, recorded_free) = load_checkpoint(dev, &sb).await?;
    let (journal_head, journal_seq, replayed, _) = replay(dev, &sb, &mut state, recorded_free).await?;
    match state.node(super::format::ROOT_INO) {
        // Mount frees inodes with no links: a crafted root among them
        // would free the whole tree.
        Some(root) if root.inode.is_dir() && root.inode.nlink == 0 => {
            return Err(corrupt("the root directory has no links"));
        }
        Some(root) if root.inode.is_dir() => {}
        _ if !require_root => {}
        _ => return Err(corrupt("the root directory is missing")),
    }
    Ok(Loaded { sb, state, journal_head, journal_seq, replayed })
}

/// What one commit takes from the live state, in one synchronous step.
struct Taken {
    payload: Vec<u8>,
    /// The records expose newly written data: flush it before them.
    exposes_data: bool,
    ops: u64,
    data_writes: u64,
    frees: Vec<BlockRun>,
    free_after: u64,
    /// The whole state, when this commit is a checkpoint.
    snapshot: Option<SnapshotBytes>,
}

impl Taken {
    fn is_empty(&self) -> bool {
        self.payload.is_empty() && self.snapshot.is_none()
    }
}

fn take_pending(fs: &FsInner, force_checkpoint: bool) -> Taken {
    let mut j = fs.journal.ring.borrow_mut();
    let mut state = fs.meta.state_mut();
    let mut w = Writer::new();
    // Inode images first, so that entries and extents later in the same
    // transaction find their inodes at replay.
    for ino in std::mem::take(&mut j.dirty) {
        if let Some(node) = state.node_mut(ino) {
            let mut image = node.inode.clone();
            // Buffered data past the cap is not on the device yet; once no
            // dirty page is left and no writeback is still writing (and
            // mapping) pages it took, the cap no longer applies.
            if let Some(cap) = node.writes().persist_size_cap {
                if fs.pages.settled(ino) {
                    node.writes_mut().persist_size_cap = None;
                } else {
                    image.size = image.size.min(cap);
                    j.dirty_later.insert(ino);
                }
            }
            node.datasync_needed = false;
            Record::InodeSet(image).encode(&mut w);
        }
    }
    for image in std::mem::take(&mut j.freed_images) {
        Record::InodeSet(image).encode(&mut w);
    }
    let later = std::mem::take(&mut j.dirty_later);
    j.dirty.extend(later);
    w.bytes(&std::mem::take(&mut j.pending).buf);
    let frees = std::mem::take(&mut state.pending_free);
    let freed: u64 = frees.iter().map(|r| r.len).sum();
    // Runs held for a checkpoint or awaiting a discard are free on disk too.
    let checkpoint = fs.journal.sb.borrow().free_count_checkpoint_blocks();
    let free_after = fs.space.free_after_commit(&state, freed, fs.discard.blocks(), checkpoint);
    let tx_blocks = tx_blocks_for(w.buf.len());
    let used = j.head - fs.journal.sb.borrow().journal_start;
    let fits = used + tx_blocks <= fs.journal.sb.borrow().journal_blocks;
    let snapshot = (force_checkpoint || !fits).then(|| {
        // A whole checkpoint replaces one being written in pieces.
        if j.sliced.take().is_some() {
            state.abort_snapshot();
        }
        state.start_snapshot();
        state.snapshot_step(usize::MAX);
        state.finish_snapshot()
    });
    let exposes_data = std::mem::take(&mut j.exposes_data);
    Taken { payload: w.buf, exposes_data, ops: j.logged_ops, data_writes: j.data_writes, frees, free_after, snapshot }
}

fn tx_blocks_for(payload: usize) -> u64 {
    (TX_HEADER_BYTES + payload).div_ceil(BLOCK_BYTES) as u64
}

/// Put what a failed commit took back, ahead of anything logged since.
fn restore(fs: &FsInner, taken: Taken) {
    let mut j = fs.journal.ring.borrow_mut();
    let mut payload = taken.payload;
    payload.extend_from_slice(&j.pending.buf);
    j.pending.buf = payload;
    fs.meta.state_mut().pending_free.extend(taken.frees);
}

fn finish(fs: &FsInner, taken: &Taken) {
    let mut state = fs.meta.state_mut();
    let mut j = fs.journal.ring.borrow_mut();
    let sliced = j.sliced.is_some();
    for run in &taken.frees {
        fs.space.release_committed(&mut state, *run, sliced, &fs.discard, fs.unmounted.get());
    }
    j.committed_ops = j.committed_ops.max(taken.ops);
    j.flushed_data_writes = j.flushed_data_writes.max(taken.data_writes);
}

/// Commit everything logged so far; make completed data writes durable.
pub(crate) async fn sync(fs: &Rc<FsInner>) -> FsResult<()> {
    fs.bump(|c| c.fsyncs += 1);
    commit_all(fs).await
}

/// [`sync`] without counting an fsync: for commits the filesystem needs
/// itself (releasing freed blocks when space runs out).
pub(crate) async fn commit_all(fs: &Rc<FsInner>) -> FsResult<()> {
    let (ops, data) = {
        let j = fs.journal.ring.borrow();
        (j.logged_ops, j.data_writes)
    };
    let _guard = fs.journal.commit_lock.lock().await;
    let satisfied = {
        let j = fs.journal.ring.borrow();
        j.committed_ops >= ops && j.flushed_data_writes >= data
    };
    if satisfied {
        return Ok(());
    }
    commit_locked(fs, false).await
}

/// Make completed data writes durable without a commit (fdatasync when
/// only timestamps changed).
pub(crate) async fn flush_data(fs: &Rc<FsInner>) -> FsResult<()> {
    fs.bump(|c| c.fsyncs += 1);
    let data = fs.journal.ring.borrow().data_writes;
    let _guard = fs.journal.commit_lock.lock().await;
    if fs.journal.ring.borrow().flushed_data_writes >= data {
        return Ok(());
    }
    fs.io.flush().await?;
    let mut j = fs.journal.ring.borrow_mut();
    j.flushed_data_writes = j.flushed_data_writes.max(data);
    Ok(())
}

pub(crate) async fn checkpoint(fs: &Rc<FsInner>) -> FsResult<()> {
    let _guard = fs.journal.commit_lock.lock().await;
    commit_locked(fs, true).await
}

async fn commit_locked(fs: &Rc<FsInner>, force_checkpoint: bool) -> FsResult<()> {
    let taken = take_pending(fs, force_checkpoint);
    commit_taken(fs, taken).await
}

/// Write what [`take_pending`] took: a transaction, or a whole checkpoint.
async fn commit_taken(fs: &Rc<FsInner>, taken: Taken) -> FsResult<()> {
    let data_unflushed = fs.journal.ring.borrow().flushed_data_writes < taken.data_writes;
    if taken.is_empty() {
        if data_unflushed {
            fs.io.flush().await?;
        }
        finish(fs, &taken);
        return Ok(());
    }
    let result = async {
        // Ordered data: what the records expose must be durable first. Data
        // that only overwrote blocks already visible needs no such order;
        // the flush after the transaction makes it durable too.
        if data_unflushed && (taken.exposes_data || taken.snapshot.is_some()) {
            fs.io.flush().await?;
        }
        match &taken.snapshot {
            Some(snapshot) => {
                let start = {
                    let j = fs.journal.ring.borrow();
                    (j.head, j.seq)
                };
                write_checkpoint(fs, snapshot, taken.free_after, start).await
            }
            None => write_transaction(fs, &taken).await,
        }
    }
    .await;
    match result {
        Ok(()) => {
            finish(fs, &taken);
            maybe_schedule_checkpoint(fs);
            Ok(())
        }
        Err(e) => {
            fs.journal.ring.borrow_mut().exposes_data |= taken.exposes_data;
            restore(fs, taken);
            Err(e)
        }
    }
}

async fn write_transaction(fs: &FsInner, taken: &Taken) -> FsResult<()> {
    let sb = fs.journal.sb.borrow().clone();
    let (head, seq) = {
        let j = fs.journal.ring.borrow();
        (j.head, j.seq)
    };
    let blocks = tx_blocks_for(taken.payload.len());
    // The caller checked that the transaction fits the ring's free part,
    // so both lengths fit their u32 header fields.
    assert!(blocks <= sb.journal_blocks, "a transaction of {blocks} blocks in a ring of {}", sb.journal_blocks);
    let mut buf = AlignedBuf::zeroed(blocks as usize * BLOCK_BYTES, BLOCK_BYTES);
    let header = TxHeader {
        seq,
        blocks: u32::try_from(blocks).expect("transaction blocks fit u32"),
        payload_len: u32::try_from(taken.payload.len()).expect("transaction payload fits u32"),
        payload_crc: crc(&taken.payload),
        free_blocks: taken.free_after,
    };
    buf[..TX_HEADER_BYTES].copy_from_slice(&encode_tx_header(&sb.uuid, &header));
    buf[TX_HEADER_BYTES..TX_HEADER_BYTES + taken.payload.len()].copy_from_slice(&taken.payload);
    // Split at the ring's end; both parts go out before the flush.
    let ring_off = head % sb.journal_blocks;
    let first = (sb.journal_blocks - ring_off).min(blocks);
    if first == blocks {
        fs.io.write_blocks(DevBlock::new(ring_block(&sb, head)), buf).await?;
    } else {
        let mut a = AlignedBuf::zeroed(first as usize * BLOCK_BYTES, BLOCK_BYTES);
        let mut b = AlignedBuf::zeroed((blocks - first) as usize * BLOCK_BYTES, BLOCK_BYTES);
        a.copy_from_slice(&buf[..first as usize * BLOCK_BYTES]);
        b.copy_from_slice(&buf[first as usize * BLOCK_BYTES..]);
        let (ra, rb) = (
            fs.io.write_blocks(DevBlock::new(ring_block(&sb, head)), a),
            fs.io.write_blocks(DevBlock::new(JOURNAL_FIRST_BLOCK), b),
        );
        ra.await?;
        rb.await?;
    }
    fs.io.flush().await?;
    let mut j = fs.journal.ring.borrow_mut();
    j.head = head + blocks;
    j.seq = seq + 1;
    drop(j);
    fs.bump(|c| {
        c.journal_commits += 1;
        c.journal_blocks_written += blocks;
    });
    Ok(())
}

/// Write `snapshot`, the state as it was at journal position `start`
/// (logical block, sequence), and a superblock that points at it with
/// replay starting there. Then the old checkpoint's blocks, and any frees
/// held for the checkpoint, go back to the allocator.
async fn write_checkpoint(
    fs: &FsInner,
    snapshot: &SnapshotBytes,
    free_at_snapshot: u64,
    start: (u64, u64),
) -> FsResult<()> {
    let old = fs.journal.sb.borrow().clone();
    let total = 8 + snapshot.len();
    let blocks = total.div_ceil(CP_PAYLOAD_PER_BLOCK).max(1) as u64;
    // The state's borrow ends here: the error path releases held frees.
    let allocated = Space::alloc_checkpoint(&mut fs.meta.state_mut(), blocks, fs.config.preferred_group);
    let runs = match allocated {
        Ok(runs) => runs,
        Err(e) => {
            release_held_frees(fs);
            return Err(e);
        }
    };
    let recorded_free = if old.features & FEATURE_FREE_COUNT_HOLDS_CHECKPOINT != 0 {
        free_at_snapshot
    } else {
        free_at_snapshot + old.checkpoint_blocks() - blocks
    };
    let recorded = recorded_free.to_le_bytes();
    let payload = [&recorded[..], &snapshot.inodes, &snapshot.entries];
    let seq = old.checkpoint_seq + 1;
    let result = write_checkpoint_blocks(fs, &runs, payload, seq).await;
    let result = match result {
        Ok(()) => {
            let mut sb = old.clone();
            sb.generation += 1;
            (sb.journal_start, sb.journal_seq) = start;
            sb.checkpoint_seq = seq;
            sb.checkpoint_bytes = total as u64;
            sb.checkpoint_extents = runs.clone();
            write_superblock(fs, &sb).await.map(|()| sb)
        }
        Err(e) => Err(e),
    };
    let mut state = fs.meta.state_mut();
    let result = match result {
        Ok(sb) => {
            for r in &old.checkpoint_extents {
                state.alloc.free(*r);
            }
            let blocks = sb.checkpoint_blocks();
            *fs.journal.sb.borrow_mut() = sb;
            drop(state);
            fs.bump(|c| c.checkpoints += 1);
            tracing::debug!(parent: &fs.span, blocks, "checkpoint written");
            Ok(())
        }
        Err(e) => {
            for r in runs {
                state.alloc.free(r);
            }
            drop(state);
            Err(e)
        }
    };
    release_held_frees(fs);
    result
}

/// Frees held for a checkpoint in pieces go back to the allocator once
/// none is in progress (it landed, failed or was replaced).
fn release_held_frees(fs: &FsInner) {
    if fs.journal.ring.borrow().sliced.is_some() {
        return;
    }
    fs.space.release_held_frees(&mut fs.meta.state_mut(), &fs.discard, fs.unmounted.get());
}

/// Blocks of checkpoint written per device request: each is formatted
/// (headers and checksums) between two awaits, so the reactor serves
/// requests between them.
const CHECKPOINT_WRITE_BLOCKS: u64 = 256;

async fn write_checkpoint_blocks(fs: &FsInner, runs: &[BlockRun], payload: [&[u8]; 3], seq: u64) -> FsResult<()> {
    let mut source = Chained { parts: payload, part: 0, at: 0 };
    let (mut index, mut written) = (0u32, 0usize);
    for run in runs {
        let mut done = 0;
        while done < run.len {
            let n = (run.len - done).min(CHECKPOINT_WRITE_BLOCKS);
            let mut buf = AlignedBuf::zeroed(n as usize * BLOCK_BYTES, BLOCK_BYTES);
            for block in buf.chunks_mut(BLOCK_BYTES) {
                let len = source.fill(&mut block[CP_HEADER_BYTES..]);
                assert!(len <= BLOCK_BYTES - CP_HEADER_BYTES, "a checkpoint block overfilled: {len} bytes");
                written += len;
                let mut w = Writer::new();
                w.u32(CHECKPOINT_BLOCK_MAGIC);
                w.u32(0);
                w.u64(seq);
                w.u32(index);
                w.u32(len as u32);
                block[..CP_HEADER_BYTES].copy_from_slice(&w.buf);
                let sum = crc(&block[8..]);
                block[4..8].copy_from_slice(&sum.to_le_bytes());
                index = index.checked_add(1).expect("checkpoint block index fits u32");
            }
            fs.io.write_blocks(DevBlock::new(run.start + done), buf).await?;
            done += n;
        }
    }
    debug_assert_eq!(written, payload.iter().map(|p| p.len()).sum::<usize>(), "the whole payload written");
    fs.io.flush().await
}

/// Byte slices read as one, without joining them.
struct Chained<'a> {
    parts: [&'a [u8]; 3],
    part: usize,
    at: usize,
}

impl Chained<'_> {
    /// Copy the next bytes into `out`, as many as fit; returns how many.
    fn fill(&mut self, out: &mut [u8]) -> usize {
        let mut filled = 0;
        while filled < out.len() && self.part < self.parts.len() {
            let rest = &self.parts[self.part][self.at..];
            let n = rest.len().min(out.len() - filled);
            out[filled..filled + n].copy_from_slice(&rest[..n]);
            (filled, self.at) = (filled + n, self.at + n);
            if self.at == self.parts[self.part].len() {
                (self.part, self.at) = (self.part + 1, 0);
            }
        }
        filled
    }
}

async fn write_superblock(fs: &FsInner, sb: &Superblock) -> FsResult<()> {
    let slot = SUPERBLOCK_SLOTS[(sb.generation % 2) as usize];
    let mut buf = AlignedBuf::zeroed(BLOCK_BYTES, BLOCK_BYTES);
    buf.copy_from_slice(&sb.encode());
    fs.io.write_blocks(DevBlock::new(slot), buf).await?;
    fs.io.flush().await
}

fn ring_half_used(fs: &FsInner) -> bool {
    let used = fs.journal.ring.borrow().head - fs.journal.sb.borrow().journal_start;
    used * 2 >= fs.journal.sb.borrow().journal_blocks
}

/// Give up the checkpoint being written in pieces, if any, so that the
/// frees held for it are usable now: for a writer that found no space.
/// Its first transaction stays committed; the next checkpoint starts over.
pub(crate) fn abandon_checkpoint_in_pieces(fs: &FsInner) {
    if fs.journal.ring.borrow_mut().sliced.take().is_some() {
        fs.meta.state_mut().abort_snapshot();
        release_held_frees(fs);
        tracing::info!(parent: &fs.span, "checkpoint in pieces given up: a writer needs the blocks it held");
    }
}

/// Whether a checkpoint is being written in pieces (for tests).
pub(crate) fn checkpoint_in_pieces(fs: &FsInner) -> bool {
    fs.journal.ring.borrow().sliced.is_some()
}

/// Start a checkpoint in the background once the ring is half used.
fn maybe_schedule_checkpoint(fs: &Rc<FsInner>) {
    if !ring_half_used(fs) || fs.unmounted.get() {
        return;
    }
    if fs.journal.ring.borrow().sliced.is_some() {
        return; // one is being written
    }
    let weak = Rc::downgrade(fs);
    reactor::spawn_local(async move {
        let Some(fs) = weak.upgrade() else { return };
        // Failure leaves the journal as it was; the next commit that does
        // not fit retries, and reports the error to its caller.
        if let Err(e) = scheduled_checkpoint(&fs, true).await {
            tracing::warn!(parent: &fs.span, error = %e, "background checkpoint failed");
        }
    });
}

/// A checkpoint in pieces now, whatever the journal's use.
pub(crate) async fn checkpoint_in_pieces_now(fs: &Rc<FsInner>) -> FsResult<()> {
    scheduled_checkpoint(fs, false).await
}

/// The checkpoint a half-full ring asks for. On a filesystem whose free
/// counts leave the checkpoint out, it is written in pieces while
/// requests and commits go on (ARCHITECTURE, "Metadata at scale"):
/// 1. with the commit lock, pending records commit as a transaction, and
///    a snapshot of the state as it is after them starts in the same
///    synchronous step; the journal position after that transaction is
///    where the new checkpoint's replay will start;
/// 2. without the lock, the snapshot is encoded a piece at a time;
/// 3. with the lock, it is written, and the superblock moves the
///    journal's start to that position.
///
/// A whole checkpoint (unmount, a transaction that does not fit) meanwhile
/// replaces this one, which then stops.
async fn scheduled_checkpoint(fs: &Rc<FsInner>, only_if_half_used: bool) -> FsResult<()> {
    let (epoch, start, free_at_start) = {
        let _guard = fs.journal.commit_lock.lock().await;
        // Unmount may have come first: it checkpointed, and nothing may
        // touch the device after it returns (found by the request fuzzer:
        // a checkpoint scheduled by the last commit ran after unmount,
        // under the feet of an fsck).
        if fs.unmounted.get() || fs.journal.ring.borrow().sliced.is_some() || (only_if_half_used && !ring_half_used(fs))
        {
            return Ok(());
        }
        let in_pieces = fs.journal.sb.borrow().features & FEATURE_FREE_COUNT_HOLDS_CHECKPOINT != 0;
        let taken = take_pending(fs, !in_pieces);
        if taken.snapshot.is_some() {
            return commit_taken(fs, taken).await; // whole, as asked or as needed
        }
        let free_at_start = taken.free_after;
        let epoch = fs.meta.state_mut().start_snapshot();
        if let Err(e) = commit_taken(fs, taken).await {
            fs.meta.state_mut().abort_snapshot();
            return Err(e);
        }
        let mut j = fs.journal.ring.borrow_mut();
        j.sliced = Some(epoch);
        (epoch, (j.head, j.seq), free_at_start)
    };
    let still_ours = || fs.journal.ring.borrow().sliced == Some(epoch) && !fs.unmounted.get();
    loop {
        if !still_ours() {
            return Ok(());
        }
        if fs.meta.state_mut().snapshot_step(fs.config.checkpoint_piece_nodes.max(1)) {
            break;
        }
        reactor::next_tick().await;
    }
    let _guard = fs.journal.commit_lock.lock().await;
    if !still_ours() {
        return Ok(());
    }
    let snapshot = fs.meta.state_mut().finish_snapshot();
    fs.journal.ring.borrow_mut().sliced = None;
    write_checkpoint(fs, &snapshot, free_at_start, start).await
}

/// Commit pending changes every `commit_interval`.
pub(crate) fn start_commit_timer(fs: &Rc<FsInner>) {
    let weak = Rc::downgrade(fs);
    let interval = fs.config.commit_interval;
    reactor::spawn_local(async move {
        loop {
            reactor::sleep(interval).await;
            let Some(fs) = weak.upgrade() else { return };
            if fs.unmounted.get() {
                return;
            }
            let pending = {
                let j = fs.journal.ring.borrow();
                !j.pending.buf.is_empty() || !j.dirty.is_empty()
            };
            if pending {
                if let Err(e) = sync(&fs).await {
                    tracing::warn!(parent: &fs.span, error = %e, "background commit failed");
                }
            }
        }
    });
}
