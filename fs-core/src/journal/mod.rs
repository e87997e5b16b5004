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

//!
//! The code is in three parts: [`load`] reads the superblocks, the
//! checkpoint and the ring at mount (and for fsck); [`commit`] takes what
//! was logged and writes transactions; [`checkpoint`] writes the whole
//! state, at once or in pieces.

mod checkpoint;
mod commit;
mod load;
#[cfg(test)]
mod sharing_tests;
mod snapshots;

use std::cell::{Cell, RefCell};

use super::codec::{Reader, Writer};
use super::discard::Discard;
use super::format::{crc, Superblock, BLOCK_BYTES, JOURNAL_FIRST_BLOCK};
use super::io::Io;
use super::meta::Meta;
use super::pages::Pages;
use super::space::Space;
use super::state::State;
use super::sync::AsyncMutex;
use super::{FsConfig, FsCounters, FsError, FsInner};

pub(crate) use checkpoint::{checkpoint_in_pieces_now, maybe_schedule_checkpoint};
pub(crate) use commit::{checkpoint, commit_all, start_commit_timer, sync};
pub(crate) use load::{choose_superblock, load, load_checkpoint, read_superblocks, replay};
pub(crate) use snapshots::{
    create_snapshot, delete_snapshot, list_snapshots, load_snapshot, load_snapshots, snapshot_space, Snapshots,
};
pub use snapshots::{SnapshotInfo, SnapshotSpace};

pub const JOURNAL_TX_MAGIC: u32 = u32::from_le_bytes(*b"KFTX");
pub const CHECKPOINT_BLOCK_MAGIC: u32 = u32::from_le_bytes(*b"KFCP");
const TX_HEADER_BYTES: usize = 64;
const CP_HEADER_BYTES: usize = 24;
// Both headers share a block with their payload, and each field written
// into them is counted here: magic, crc, uuid, seq, blocks, payload
// length, payload crc and free blocks; magic, crc, seq, index, length.
const _: () = assert!(4 + 4 + 16 + 8 + 4 + 4 + 4 + 8 <= TX_HEADER_BYTES && TX_HEADER_BYTES < BLOCK_BYTES);
const _: () = assert!(4 + 4 + 8 + 4 + 4 == CP_HEADER_BYTES);
const CP_PAYLOAD_PER_BLOCK: usize = BLOCK_BYTES - CP_HEADER_BYTES;
/// Largest single read while loading (1 MiB, the device request limit).
const READ_BLOCKS_MAX: u64 = 256;

/// The journal's part of a mounted filesystem (step S7a of
/// docs/plans/fs-parts.md): the superblock, the ring's position and the
/// records waiting to go into it, the lock that orders commits, the
/// transactions replay applied at mount, and what it counts. Its commit
/// and checkpoint methods get the other parts they touch in a
/// [`CommitCx`]; what may
/// start a background task (a checkpoint once the ring is half used, the
/// commit timer) stays a function of the filesystem's `Rc`.
pub(crate) struct Journal {
    pub(crate) sb: RefCell<Superblock>,
    pub(crate) ring: RefCell<super::JournalState>,
    pub(crate) commit_lock: AsyncMutex,
    pub(crate) replayed_at_mount: u64,
    pub(crate) counters: Cell<JournalCounters>,
    /// Feature bits turned on since the mount: every superblock written
    /// from now on carries them, whatever copy of the superblock a
    /// checkpoint in pieces started from.
    pub(crate) features_on: Cell<u64>,
    /// The snapshots the superblock's table names, with what they hold.
    pub(crate) snapshots: RefCell<Snapshots>,
}

/// What the journal counts, merged into [`FsCounters`] by
/// `Inspect::counters`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct JournalCounters {
    pub(crate) journal_commits: u64,
    pub(crate) journal_blocks_written: u64,
    pub(crate) checkpoints: u64,
    pub(crate) fsyncs: u64,
    pub(crate) records_logged: u64,
}

impl Journal {
    pub(crate) fn bump(&self, f: impl FnOnce(&mut JournalCounters)) {
        let mut c = self.counters.get();
        f(&mut c);
        self.counters.set(c);
    }

    /// Check the journal's bookkeeping (tests and fuzzers, between
    /// operations): commits never pass what was logged, flushes never
    /// pass the data writes they cover, and the ring holds no more than
    /// its size. While no commit runs (`commit_lock` free), a checkpoint
    /// is being written in pieces exactly when the state holds its
    /// snapshot (`in_snapshot`). Panics on the first that does not hold.
    pub(crate) fn check_invariants(&self, in_snapshot: bool) {
        let j = self.ring.borrow();
        let sb = self.sb.borrow();
        assert!(j.committed_ops <= j.logged_ops, "{} ops committed of {} logged", j.committed_ops, j.logged_ops);
        assert!(
            j.flushed_data_writes <= j.data_writes,
            "{} data writes flushed of {} done",
            j.flushed_data_writes,
            j.data_writes
        );
        let used = j.head.checked_sub(sb.journal_start).expect("the ring's head is behind its start");
        assert!(used <= sb.journal_blocks, "{used} ring blocks in use of {}", sb.journal_blocks);
        if !self.commit_lock.is_locked() {
            assert_eq!(j.sliced.is_some(), in_snapshot, "a checkpoint in pieces without its snapshot, or the reverse");
        }
    }

    /// Whether a checkpoint is being written in pieces or a commit runs:
    /// the times when frees may be held back.
    pub(crate) fn busy(&self) -> bool {
        self.commit_lock.is_locked() || self.ring.borrow().sliced.is_some()
    }

    /// Fill in the journal's counters.
    pub(crate) fn report(&self, out: &mut FsCounters) {
        let c = self.counters.get();
        out.journal_commits = c.journal_commits;
        out.journal_blocks_written = c.journal_blocks_written;
        out.checkpoints = c.checkpoints;
        out.fsyncs = c.fsyncs;
        out.records_logged = c.records_logged;
    }
}

/// What the journal's commits and checkpoints reach besides the journal
/// itself: the other parts of the mounted filesystem, lent for one call.
/// It owns nothing, so a part is never stored in another.
pub(crate) struct CommitCx<'a> {
    pub(crate) io: &'a Io,
    pub(crate) meta: &'a Meta,
    pub(crate) space: &'a Space,
    pub(crate) discard: &'a Discard,
    pub(crate) pages: &'a Pages,
    pub(crate) csums: Option<&'a RefCell<crate::csum_table::TableCache>>,
    pub(crate) csum_map_writer: &'a crate::sync::AsyncMutex,
    pub(crate) config: &'a FsConfig,
    /// A cell, not a bool: a checkpoint in pieces looks again after each
    /// await.
    pub(crate) unmounted: &'a Cell<bool>,
    pub(crate) span: &'a tracing::Span,
}

impl FsInner {
    pub(crate) fn commit_cx(&self) -> CommitCx<'_> {
        CommitCx {
            io: &self.io,
            meta: &self.meta,
            space: &self.space,
            discard: &self.discard,
            pages: &self.pages,
            csums: self.csums.as_ref(),
            csum_map_writer: &self.csum_map_writer,
            config: &self.config,
            unmounted: &self.unmounted,
            span: &self.span,
        }
    }
}

/// Everything a mount (or fsck) learns from the device.
pub(crate) struct Loaded {
    pub sb: Superblock,
    pub state: State,
    pub free: crate::space::FreeSpace,
    pub csums: Option<crate::csum_table::TableCache>,
    pub journal_head: u64,
    pub journal_seq: u64,
    pub replayed: u64,
    /// Headers past the journal's end a writable mount erases
    /// (`load::Replayed::stale`).
    pub stale_headers: Vec<u64>,
    pub snapshots: Snapshots,
}

fn corrupt(msg: impl Into<String>) -> FsError {
    FsError::Corrupt(msg.into())
}

#[derive(Debug, PartialEq, Eq)]
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
    decode_any_tx_header(block, uuid).filter(|h| h.seq == seq)
}

/// A whole transaction header of the filesystem with `uuid`, whatever its
/// sequence.
fn decode_any_tx_header(block: &[u8], uuid: &[u8; 16]) -> Option<TxHeader> {
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
    Some(h)
}

/// Erase the stale transaction headers at logical journal blocks
/// `blocks` ([`Loaded::stale_headers`]) before anything is written past
/// the journal's end, so that no later replay can take one for a
/// continuation of the new transactions.
pub(crate) async fn erase_stale_headers(io: &Io, sb: &Superblock, blocks: &[u64]) -> crate::FsResult<()> {
    for &logical in blocks {
        let zero = keelfs_bdev::AlignedBuf::zeroed(BLOCK_BYTES, BLOCK_BYTES);
        io.write_blocks(crate::blocks::DevBlock::new(ring_block(sb, logical)), zero).await?;
    }
    if !blocks.is_empty() {
        io.flush().await?;
    }
    Ok(())
}

fn ring_block(sb: &Superblock, logical: u64) -> u64 {
    JOURNAL_FIRST_BLOCK + logical % sb.journal_blocks
}
