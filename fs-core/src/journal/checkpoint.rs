//! Checkpoints: the whole state written to fresh blocks and a new
//! superblock generation that points at it. A whole one is taken with the
//! pending records; a scheduled one, on a filesystem whose free counts
//! leave the checkpoint out, is encoded in pieces while requests go on.

use std::rc::Rc;

use keelfs_bdev::AlignedBuf;
use keelfs_reactor as reactor;

use super::commit::maybe_schedule_after;
use super::load::parse_checkpoint_block;
use super::snapshots::{abandon_table, TableChange, TablePlan};
use super::{CommitCx, Journal, CHECKPOINT_BLOCK_MAGIC, CP_HEADER_BYTES, CP_PAYLOAD_PER_BLOCK};
use crate::blocks::DevBlock;
use crate::codec::Writer;
use crate::csum_table;
use crate::format::{crc, BlockRun, Superblock, BLOCK_BYTES, FEATURE_FREE_COUNT_HOLDS_CHECKPOINT, SUPERBLOCK_SLOTS};
use crate::io::Io;
use crate::state::SnapshotBytes;
use crate::{FsInner, FsResult};

impl Journal {
    /// Write `snapshot`, the state as it was at journal position `start`
    /// (logical block, sequence), and a superblock that points at it with
    /// replay starting there, installing the snapshot table `change` makes
    /// if any. Then the old checkpoint's blocks (unless a snapshot keeps
    /// them), and any frees held for the checkpoint, go back to the
    /// allocator.
    pub(super) async fn write_checkpoint(
        &self,
        cx: &CommitCx<'_>,
        snapshot: &SnapshotBytes,
        free_at_snapshot: u64,
        start: (u64, u64),
        change: Option<TableChange>,
    ) -> FsResult<()> {
        let old = self.sb.borrow().clone();
        let total = 8 + snapshot.len();
        let blocks = total.div_ceil(CP_PAYLOAD_PER_BLOCK) as u64;
        let seq = old.checkpoint_seq + 1;
        let (runs, plan) = match self.allocate_checkpoint(cx, blocks.max(1), (seq, total as u64), change.as_ref()) {
            Ok(allocated) => allocated,
            Err(e) => {
                if let Some(change) = change {
                    abandon_table(cx, change);
                }
                self.release_held_frees(cx);
                return Err(e);
            }
        };
        let new_cp = (seq, runs.iter().map(|r| r.len).sum());
        let recorded_free = self.recorded_free(&old, free_at_snapshot, new_cp, plan.as_ref().zip(change.as_ref()));
        let recorded = recorded_free.to_le_bytes();
        let payload = [&recorded[..], &snapshot.inodes, &snapshot.entries];
        let mut table_written = None;
        let result = write_before_superblock(cx, (&runs, payload, seq), plan.as_ref(), &mut table_written).await;
        let result = match result {
            Ok(()) => {
                let mut sb = old.clone();
                sb.features |= self.features_on.get();
                sb.generation += 1;
                (sb.journal_start, sb.journal_seq) = start;
                sb.checkpoint_seq = seq;
                sb.checkpoint_bytes = total as u64;
                sb.checkpoint_extents = runs.clone();
                if let Some(plan) = &plan {
                    sb.snapshot_table = plan.runs.clone();
                    sb.snapshot_table_bytes = plan.bytes.len() as u64;
                    sb.snapshot_table_seq = seq;
                }
                write_superblock(cx.io, &sb).await.map(|()| sb)
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(sb) => {
                if let (Some(table), Some(done)) = (cx.csums, table_written) {
                    csum_table::written_back(table, done);
                    // The idle regions written back close (all of them at
                    // an unmount). Not fatal if this fails: a bit left set
                    // costs only work after a crash.
                    let everything = cx.unmounted.get();
                    if let Err(e) = crate::csum_map::close_clean(table, cx.csum_map_writer, cx.io, everything).await {
                        tracing::warn!(parent: cx.span, error = %e, "the dirty-region map was not cleared");
                    }
                }
                self.checkpoint_installed(cx, &old, sb, plan.zip(change))
            }
            Err(e) => {
                let mut free = cx.space.free_mut();
                for r in runs.iter().chain(plan.iter().flat_map(|p| p.runs.iter())) {
                    free.alloc.free(*r);
                }
                drop(free);
                if let Some(change) = change {
                    abandon_table(cx, change);
                }
                self.release_held_frees(cx);
                return Err(e);
            }
        }
        self.release_held_frees(cx);
        Ok(())
    }

    /// Blocks for a checkpoint of `blocks`, and for the table `change`
    /// makes (the new checkpoint, numbered and sized `new_cp`, is the
    /// snapshot a create names), or none and the error.
    fn allocate_checkpoint(
        &self,
        cx: &CommitCx<'_>,
        blocks: u64,
        new_cp: (u64, u64),
        change: Option<&TableChange>,
    ) -> FsResult<(Vec<BlockRun>, Option<TablePlan>)> {
        let runs = cx.space.alloc_checkpoint(blocks, cx.config.preferred_group)?;
        let Some(change) = change else { return Ok((runs, None)) };
        match self.plan_table(cx, change, (new_cp.0, new_cp.1, &runs)) {
            Ok(plan) => Ok((runs, Some(plan))),
            Err(e) => {
                let mut free = cx.space.free_mut();
                for r in runs {
                    free.alloc.free(r);
                }
                Err(e)
            }
        }
    }

    /// The superblock `sb` is on the device: it becomes the mount's, the
    /// old checkpoint's blocks are free unless a snapshot keeps them, and
    /// the table it installs takes effect.
    fn checkpoint_installed(
        &self,
        cx: &CommitCx<'_>,
        old: &Superblock,
        sb: Superblock,
        table: Option<(TablePlan, TableChange)>,
    ) {
        if let Some((plan, change)) = table {
            self.install_table(cx, old, plan, change);
        }
        if !self.snapshots.borrow().retains(old.checkpoint_seq) {
            let mut free = cx.space.free_mut();
            for r in &old.checkpoint_extents {
                free.alloc.free(*r);
            }
        }
        let blocks = sb.checkpoint_blocks();
        *self.sb.borrow_mut() = sb;
        self.bump(|c| c.checkpoints += 1);
        tracing::debug!(parent: cx.span, blocks, "checkpoint written");
    }

    /// Frees held for a checkpoint in pieces go back to the allocator once
    /// none is in progress (it landed, failed or was replaced).
    fn release_held_frees(&self, cx: &CommitCx<'_>) {
        if self.ring.borrow().sliced.is_some() {
            return;
        }
        cx.space.release_held_frees(cx.discard, cx.unmounted.get());
    }

    fn ring_half_used(&self) -> bool {
        let used = self.ring.borrow().head - self.sb.borrow().journal_start;
        used * 2 >= self.sb.borrow().journal_blocks
    }

    /// Whether a checkpoint is due: the ring is half used, or the checksum
    /// table holds as many dirty blocks as it may (its overlay's memory),
    /// or three quarters of the regions that may be open are (a checkpoint
    /// closes them).
    fn checkpoint_due(&self, csums: Option<&std::cell::RefCell<csum_table::TableCache>>) -> bool {
        self.ring_half_used()
            || csums.is_some_and(|t| {
                let t = t.borrow();
                t.dirty_blocks() >= csum_table::DIRTY_BLOCKS_CHECKPOINT || t.map.checkpoint_due()
            })
    }

    /// Give up the checkpoint being written in pieces, if any, so that the
    /// frees held for it are usable now: for a writer that found no space.
    /// Its first transaction stays committed; the next checkpoint starts over.
    pub(crate) fn abandon_checkpoint_in_pieces(&self, cx: &CommitCx<'_>) {
        if self.ring.borrow_mut().sliced.take().is_some() {
            cx.meta.state_mut().abort_snapshot();
            self.release_held_frees(cx);
            tracing::info!(parent: cx.span, "checkpoint in pieces given up: a writer needs the blocks it held");
        }
    }

    /// Whether a checkpoint is being written in pieces (for tests).
    pub(crate) fn checkpoint_in_pieces(&self) -> bool {
        self.ring.borrow().sliced.is_some()
    }
}

/// What a checkpoint writes before its superblock: the checksum table's
/// dirty blocks (flushed with the checkpoint, since the superblock ends
/// replay of the records that set them; `table_written` says which), the
/// checkpoint's blocks, and the snapshot table `plan` makes.
async fn write_before_superblock(
    cx: &CommitCx<'_>,
    (runs, payload, seq): (&[BlockRun], [&[u8]; 3], u64),
    plan: Option<&TablePlan>,
    table_written: &mut Option<csum_table::WrittenBack>,
) -> FsResult<()> {
    if let Some(table) = cx.csums {
        *table_written = Some(csum_table::write_back(table, cx.io).await?);
    }
    write_checkpoint_blocks(cx.io, runs, payload, seq).await?;
    if let Some(plan) = plan.filter(|p| !p.runs.is_empty()) {
        write_checkpoint_blocks(cx.io, &plan.runs, [&plan.bytes, &[], &[]], seq).await?;
    }
    Ok(())
}

/// Blocks of checkpoint written per device request: each is formatted
/// (headers and checksums) between two awaits, so the reactor serves
/// requests between them.
const CHECKPOINT_WRITE_BLOCKS: u64 = 256;

async fn write_checkpoint_blocks(io: &Io, runs: &[BlockRun], payload: [&[u8]; 3], seq: u64) -> FsResult<()> {
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
                // Mount will read this block back with the same parser.
                let read_back = parse_checkpoint_block(block, seq, index).map(<[u8]>::len);
                assert_eq!(read_back, Ok(len), "a checkpoint block parses as written");
                index = index.checked_add(1).expect("checkpoint block index fits u32");
            }
            io.write_blocks(DevBlock::new(run.start + done), buf).await?;
            done += n;
        }
    }
    debug_assert_eq!(written, payload.iter().map(|p| p.len()).sum::<usize>(), "the whole payload written");
    io.flush().await
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

async fn write_superblock(io: &Io, sb: &Superblock) -> FsResult<()> {
    let slot = SUPERBLOCK_SLOTS[(sb.generation % 2) as usize];
    let mut buf = AlignedBuf::zeroed(BLOCK_BYTES, BLOCK_BYTES);
    buf.copy_from_slice(&sb.encode());
    assert_eq!(Superblock::decode(&buf).as_ref(), Ok(sb), "a superblock decodes to what was encoded");
    io.write_blocks(DevBlock::new(slot), buf).await?;
    io.flush().await
}

// The filesystem's side: these start or run the background checkpoint,
// a task that holds the filesystem, so they take its `Rc`.

/// Start a checkpoint in the background once one is due
/// ([`Journal::checkpoint_due`]).
pub(crate) fn maybe_schedule_checkpoint(fs: &Rc<FsInner>) {
    if !fs.journal.checkpoint_due(fs.csums.as_ref()) || fs.unmounted.get() {
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
        if fs.unmounted.get()
            || fs.journal.ring.borrow().sliced.is_some()
            || (only_if_half_used && !fs.journal.checkpoint_due(fs.csums.as_ref()))
        {
            return Ok(());
        }
        let in_pieces = fs.journal.sb.borrow().features & FEATURE_FREE_COUNT_HOLDS_CHECKPOINT != 0;
        let cx = fs.commit_cx();
        let taken = fs.journal.take_pending(&cx, !in_pieces);
        if taken.snapshot.is_some() {
            // Whole, as asked or as needed.
            return maybe_schedule_after(fs, fs.journal.commit_taken(&cx, taken).await);
        }
        let free_at_start = taken.free_after;
        let epoch = fs.meta.state_mut().start_snapshot();
        if let Err(e) = maybe_schedule_after(fs, fs.journal.commit_taken(&cx, taken).await) {
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
    fs.journal.write_checkpoint(&fs.commit_cx(), &snapshot, free_at_start, start, None).await
}
