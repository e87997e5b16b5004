//! Commits: what was logged since the last one is taken from the live
//! state in one synchronous step and written as one transaction (or, when
//! it would not fit the ring, as a whole checkpoint), under the commit
//! lock that orders them.

use std::rc::Rc;

use keelfs_bdev::AlignedBuf;
use keelfs_reactor as reactor;

use super::checkpoint::maybe_schedule_checkpoint;
use super::snapshots::{abandon_table, TableChange};
use super::{decode_tx_header, encode_tx_header, ring_block, CommitCx, Journal, TxHeader, TX_HEADER_BYTES};
use crate::blocks::DevBlock;
use crate::codec::Writer;
use crate::format::{crc, BlockRun, BLOCK_BYTES, JOURNAL_FIRST_BLOCK};
use crate::record::Record;
use crate::state::SnapshotBytes;
use crate::{FsInner, FsResult};

/// What one commit takes from the live state, in one synchronous step.
pub(super) struct Taken {
    payload: Vec<u8>,
    /// The records expose newly written data: flush it before them.
    exposes_data: bool,
    ops: u64,
    data_writes: u64,
    frees: Vec<BlockRun>,
    /// The free-block count once this commit is durable.
    pub(super) free_after: u64,
    /// The whole state, when this commit is a checkpoint.
    pub(super) snapshot: Option<SnapshotBytes>,
    /// A change to the snapshot table the checkpoint installs (set by the
    /// snapshot operations after `take_pending`, in the same step).
    pub(super) table: Option<TableChange>,
}

impl Taken {
    fn is_empty(&self) -> bool {
        self.payload.is_empty() && self.snapshot.is_none()
    }
}

fn tx_blocks_for(payload: usize) -> u64 {
    (TX_HEADER_BYTES + payload).div_ceil(BLOCK_BYTES) as u64
}

impl Journal {
    pub(super) fn take_pending(&self, cx: &CommitCx<'_>, force_checkpoint: bool) -> Taken {
        let mut j = self.ring.borrow_mut();
        let mut state = cx.meta.state_mut();
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
                    if cx.pages.settled(ino) {
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
        let frees = cx.space.take_uncommitted_frees();
        let freed: u64 = frees.iter().map(|r| r.len).sum();
        // Runs held for a checkpoint or awaiting a discard are free on disk too.
        let checkpoint = self.free_count_checkpoint_blocks();
        let free_after = cx.space.free_after_commit(freed, cx.discard.blocks(), checkpoint);
        let tx_blocks = tx_blocks_for(w.buf.len());
        let used = j.head - self.sb.borrow().journal_start;
        let fits = used + tx_blocks <= self.sb.borrow().journal_blocks;
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
        Taken {
            payload: w.buf,
            exposes_data,
            ops: j.logged_ops,
            data_writes: j.data_writes,
            frees,
            free_after,
            snapshot,
            table: None,
        }
    }

    /// Put what a failed commit took back, ahead of anything logged since.
    fn restore(&self, cx: &CommitCx<'_>, taken: Taken) {
        let mut j = self.ring.borrow_mut();
        let mut payload = taken.payload;
        payload.extend_from_slice(&j.pending.buf);
        j.pending.buf = payload;
        cx.space.give_back_uncommitted_frees(taken.frees);
    }

    fn finish(&self, cx: &CommitCx<'_>, taken: &Taken) {
        let mut j = self.ring.borrow_mut();
        let sliced = j.sliced.is_some();
        for run in &taken.frees {
            cx.space.release_committed(*run, sliced, cx.discard, cx.unmounted.get());
        }
        j.committed_ops = j.committed_ops.max(taken.ops);
        j.flushed_data_writes = j.flushed_data_writes.max(taken.data_writes);
    }

    /// Make completed data writes durable without a commit (fdatasync when
    /// only timestamps changed).
    pub(crate) async fn flush_data(&self, cx: &CommitCx<'_>) -> FsResult<()> {
        self.bump(|c| c.fsyncs += 1);
        let data = self.ring.borrow().data_writes;
        let _guard = self.commit_lock.lock().await;
        if self.ring.borrow().flushed_data_writes >= data {
            return Ok(());
        }
        cx.io.flush().await?;
        let mut j = self.ring.borrow_mut();
        j.flushed_data_writes = j.flushed_data_writes.max(data);
        Ok(())
    }

    /// Write what [`Self::take_pending`] took: a transaction, or a whole checkpoint.
    pub(super) async fn commit_taken(&self, cx: &CommitCx<'_>, mut taken: Taken) -> FsResult<()> {
        let table = taken.table.take();
        let data_unflushed = self.ring.borrow().flushed_data_writes < taken.data_writes;
        if taken.is_empty() {
            if data_unflushed {
                cx.io.flush().await?;
            }
            self.finish(cx, &taken);
            return Ok(());
        }
        let result = async {
            // Ordered data: what the records expose must be durable first. Data
            // that only overwrote blocks already visible needs no such order;
            // the flush after the transaction makes it durable too.
            if data_unflushed && (taken.exposes_data || taken.snapshot.is_some()) {
                if let Err(e) = cx.io.flush().await {
                    if let Some(change) = table {
                        abandon_table(cx, change);
                    }
                    return Err(e);
                }
            }
            match &taken.snapshot {
                Some(snapshot) => {
                    let start = {
                        let j = self.ring.borrow();
                        (j.head, j.seq)
                    };
                    self.write_checkpoint(cx, snapshot, taken.free_after, start, table).await
                }
                None => {
                    assert!(table.is_none(), "a snapshot table changes only with a checkpoint");
                    self.write_transaction(cx, &taken).await
                }
            }
        }
        .await;
        match result {
            Ok(()) => {
                self.finish(cx, &taken);
                Ok(())
            }
            Err(e) => {
                self.ring.borrow_mut().exposes_data |= taken.exposes_data;
                self.restore(cx, taken);
                Err(e)
            }
        }
    }

    async fn write_transaction(&self, cx: &CommitCx<'_>, taken: &Taken) -> FsResult<()> {
        let sb = self.sb.borrow().clone();
        let (head, seq) = {
            let j = self.ring.borrow();
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
        // What replay will read back is what was meant: the header
        // decodes, under this filesystem's uuid and this sequence, to the
        // same fields.
        let read_back = decode_tx_header(&buf, &sb.uuid, seq).expect("a transaction header decodes as written");
        assert_eq!(read_back, header, "a transaction header decodes to what was encoded");
        buf[TX_HEADER_BYTES..TX_HEADER_BYTES + taken.payload.len()].copy_from_slice(&taken.payload);
        // Split at the ring's end; both parts go out before the flush.
        let ring_off = head % sb.journal_blocks;
        let first = (sb.journal_blocks - ring_off).min(blocks);
        if first == blocks {
            cx.io.write_blocks(DevBlock::new(ring_block(&sb, head)), buf).await?;
        } else {
            let mut a = AlignedBuf::zeroed(first as usize * BLOCK_BYTES, BLOCK_BYTES);
            let mut b = AlignedBuf::zeroed((blocks - first) as usize * BLOCK_BYTES, BLOCK_BYTES);
            a.copy_from_slice(&buf[..first as usize * BLOCK_BYTES]);
            b.copy_from_slice(&buf[first as usize * BLOCK_BYTES..]);
            let (ra, rb) = (
                cx.io.write_blocks(DevBlock::new(ring_block(&sb, head)), a),
                cx.io.write_blocks(DevBlock::new(JOURNAL_FIRST_BLOCK), b),
            );
            ra.await?;
            rb.await?;
        }
        cx.io.flush().await?;
        let mut j = self.ring.borrow_mut();
        j.head = head + blocks;
        j.seq = seq + 1;
        drop(j);
        self.bump(|c| {
            c.journal_commits += 1;
            c.journal_blocks_written += blocks;
        });
        Ok(())
    }
}

// The filesystem's side: these may start a background checkpoint or
// timer, a task that holds the filesystem, so they take its `Rc`.

/// Commit everything logged so far; make completed data writes durable.
pub(crate) async fn sync(fs: &Rc<FsInner>) -> FsResult<()> {
    fs.journal.bump(|c| c.fsyncs += 1);
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

pub(crate) async fn checkpoint(fs: &Rc<FsInner>) -> FsResult<()> {
    let _guard = fs.journal.commit_lock.lock().await;
    commit_locked(fs, true).await
}

async fn commit_locked(fs: &Rc<FsInner>, force_checkpoint: bool) -> FsResult<()> {
    let cx = fs.commit_cx();
    let taken = fs.journal.take_pending(&cx, force_checkpoint);
    maybe_schedule_after(fs, fs.journal.commit_taken(&cx, taken).await)
}

/// After a commit: a successful one may have filled the ring past half,
/// which starts a background checkpoint.
pub(super) fn maybe_schedule_after(fs: &Rc<FsInner>, committed: FsResult<()>) -> FsResult<()> {
    if committed.is_ok() {
        maybe_schedule_checkpoint(fs);
    }
    committed
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
            } else {
                // Overwrites in place log nothing, yet the regions they
                // open ask for a checkpoint to close them.
                super::checkpoint::maybe_schedule_checkpoint(&fs);
            }
        }
    });
}
