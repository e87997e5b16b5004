//! Scrub (issue 38, docs/plans/data-checksums.md section 5): read every
//! written block of an image with data checksums and check it, a piece at
//! a time, so that damage is found before a guest reads it. The
//! filesystem does one bounded step per call; the caller (keelfsd's
//! `scrub_*` RPCs) paces the steps and keeps the cursor, which a
//! `ScrubCursor` record makes durable so that a restart resumes.
//!
//! The walk is by inode, then file block, and then over the blocks that
//! snapshots hold and no file names, in device order. A block that
//! several files share is read with the first of them the walk meets
//! ([`SeenShared`], which the caller keeps for the pass; after a restart
//! some are read again), and one that only snapshots hold, once however
//! many hold it.

use crate::admin::Admin;
use crate::blocks::{DevBlock, FileBlock};
use crate::csum_table;
use crate::extent::Segment;
use crate::format::{crc, BlockRun, BLOCK_BYTES};
use crate::ids::Ino;
use crate::record::Record;
use crate::seen_shared::SeenShared;
use crate::state::{ScrubSaved, INO_MAX};
use crate::{FsError, FsResult};

/// Inodes one step looks at while it finds nothing to read: bounds the
/// synchronous part of a step on an image of many empty files.
const INODES_PER_STEP: u64 = 4096;
/// Blocks one step reads at most (one device request).
pub const SCRUB_STEP_BLOCKS_MAX: u64 = 256;

/// Where a scrub goes on from: an inode, and a file block in it; or, in
/// the walk's second part, the inode number [`INO_MAX`] (which no file
/// has) and a device block (see [`ScrubCursor::snapshot_block`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScrubCursor {
    pub ino: Ino,
    pub file_block: u64,
}

impl ScrubCursor {
    /// The first inode's first block: a scrub's start.
    pub const START: ScrubCursor = ScrubCursor { ino: Ino::new(1), file_block: 0 };

    /// The second part of the walk, from device block `block`: the
    /// blocks snapshots hold.
    pub const fn in_snapshots(block: u64) -> ScrubCursor {
        ScrubCursor { ino: Ino::new(INO_MAX), file_block: block }
    }

    /// The device block the walk goes on from, in its second part.
    pub fn snapshot_block(self) -> Option<u64> {
        (self.ino.get() == INO_MAX).then_some(self.file_block)
    }
}

/// A block a scrub found bad: it does not match its checksum (or its
/// checksum is unreadable), or the device failed to read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadBlock {
    /// The file that names it, and the block's byte offset there; None
    /// for a block found in the walk over what snapshots hold.
    pub file: Option<(Ino, u64)>,
    pub device_block: u64,
    pub unreadable: bool,
}

/// What one step did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScrubStep {
    /// Where the next step starts; None once the walk is done.
    pub next: Option<ScrubCursor>,
    pub blocks_checked: u64,
    pub bad: Vec<BadBlock>,
}

/// Whose blocks a piece is.
#[derive(Clone, Copy)]
enum Owner {
    /// A file's, from file block `file_block` on.
    File { ino: Ino, file_block: FileBlock },
    /// Held by one snapshot or more.
    Snapshots,
}

/// The piece a step reads: a written extent's blocks, or a run a
/// snapshot holds, at most a request.
struct Piece {
    owner: Owner,
    disk_block: DevBlock,
    len: u64,
}

impl Admin<'_> {
    /// Check the next written blocks from `from`, at most `max_blocks`
    /// (and one device request), stepping over the shared blocks `seen`
    /// (this pass's) says were read. EOPNOTSUPP on an image without data
    /// checksums.
    pub async fn scrub_step(self, from: ScrubCursor, max_blocks: u64, seen: &mut SeenShared) -> FsResult<ScrubStep> {
        let table = self.inner.csums.as_ref().ok_or(FsError::Unsupported)?;
        let max_blocks = max_blocks.clamp(1, SCRUB_STEP_BLOCKS_MAX);
        let found = match from.snapshot_block() {
            Some(block) => self.next_held_piece(block, max_blocks),
            None => self.next_piece(from, max_blocks, seen),
        };
        let piece = match found {
            Ok(piece) => piece,
            Err(next) => return Ok(ScrubStep { next, ..ScrubStep::default() }),
        };
        let mut step = ScrubStep { next: Some(piece.next()), blocks_checked: piece.len, bad: Vec::new() };
        let data = match self.inner.io.read_blocks(piece.disk_block, piece.len as usize).await {
            Ok(data) => data,
            Err(_) => {
                step.bad.extend((0..piece.len).map(|i| piece.bad_block(i, true)));
                return Ok(step);
            }
        };
        for (i, block) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            let at = piece.disk_block + i as u64;
            if csum_table::entry(table, &self.inner.io, at.get()).await? == Some(crc(block)) {
                continue;
            }
            if self.still_bad(&piece, i as u64).await? {
                let bad = piece.bad_block(i as u64, false);
                self.note_bad(&bad)?;
                step.bad.push(bad);
            } else {
                // Not conclusive (the name it was read under moved, or a
                // second read matched): another name of it, a clone's,
                // reads it again.
                seen.forget(at.get());
            }
        }
        Ok(step)
    }

    /// Count and log a block that failed its check (once per block), and
    /// record a file's for fsck. One only snapshots may hold is not
    /// recorded: the record names a file's block, and fsck --data walks
    /// the snapshots' blocks too.
    fn note_bad(self, bad: &BadBlock) -> FsResult<()> {
        let table = self.inner.csums.as_ref().expect("scrub runs with checksums");
        let (ino, offset) = bad.file.map_or((None, None), |(ino, offset)| (Some(ino.get()), Some(offset)));
        if table.borrow_mut().note_mismatch(bad.device_block) {
            tracing::error!(parent: &self.inner.span, ino, offset, block = bad.device_block,
                "scrub: data checksum mismatch (logged once per block)");
        }
        match bad.file {
            Some((ino, offset)) => {
                self.inner.change().record_data_error(bad.device_block, ino, FileBlock::containing(offset).get())
            }
            None => Ok(()),
        }
    }

    /// The next piece to read from `from`, or where the next step starts
    /// (None: the walk is done) when this one found nothing in its bound:
    /// [`INODES_PER_STEP`] inodes, or as many extents stepped over because
    /// `seen` says they were read. Past the last file, the walk goes on
    /// over the snapshots' blocks, if any snapshot holds one.
    fn next_piece(
        self,
        from: ScrubCursor,
        max_blocks: u64,
        seen: &mut SeenShared,
    ) -> Result<Piece, Option<ScrubCursor>> {
        let state = self.inner.meta.state();
        let free = self.inner.space.free();
        let window_end = from.ino.get().saturating_add(INODES_PER_STEP).min(state.next_ino);
        let mut file_block = from.file_block;
        let mut looked = 0;
        for ino in from.ino.get()..window_end {
            let ino = Ino::new(ino);
            while let Some(e) = state.node(ino).and_then(|n| n.extents.written_from(FileBlock::new(file_block))) {
                let run = BlockRun { start: e.disk_block.get(), len: e.len.min(max_blocks) };
                let next = seen.next_read(&free.shared, run);
                let file_block_read = e.file_block + next.skip;
                if next.read > 0 {
                    let owner = Owner::File { ino, file_block: file_block_read };
                    return Ok(Piece { owner, disk_block: e.disk_block + next.skip, len: next.read });
                }
                file_block = file_block_read.get();
                looked += 1;
                if looked >= INODES_PER_STEP {
                    return Err(Some(ScrubCursor { ino, file_block }));
                }
            }
            file_block = 0;
        }
        if window_end < state.next_ino {
            return Err(Some(ScrubCursor { ino: Ino::new(window_end), file_block: 0 }));
        }
        let held = self.inner.journal.snapshots.borrow().next_held(0).is_some();
        Err(held.then_some(ScrubCursor::in_snapshots(0)))
    }

    /// The next run from device block `from` that snapshots hold and no
    /// live file names (those the walk over the files read), or where
    /// the next step starts when this one skips a run that a file names
    /// (None: the walk is done).
    fn next_held_piece(self, from: u64, max_blocks: u64) -> Result<Piece, Option<ScrubCursor>> {
        let found = {
            let free = self.inner.space.free();
            self.inner.journal.snapshots.borrow().next_held_piece(&free.shared, from, max_blocks)
        };
        match found {
            None => Err(None),
            Some((run, true)) => Err(Some(ScrubCursor::in_snapshots(run.end()))),
            Some((run, false)) => {
                Ok(Piece { owner: Owner::Snapshots, disk_block: DevBlock::new(run.start), len: run.len })
            }
        }
    }

    /// A block that failed its check while the step's read was in flight
    /// may have been remapped meanwhile (a copy on write, or a snapshot
    /// deleted) and its old place reused: bad only if it is still named
    /// the same way, and a second read fails too.
    async fn still_bad(self, piece: &Piece, i: u64) -> FsResult<bool> {
        let disk = piece.disk_block + i;
        if !self.still_names(piece, i) {
            return Ok(false);
        }
        let again = self.inner.io.read_blocks(disk, 1).await?;
        let table = self.inner.csums.as_ref().expect("scrub runs with checksums");
        let want = csum_table::entry(table, &self.inner.io, disk.get()).await?;
        Ok(self.still_names(piece, i) && want != Some(crc(&again)))
    }

    /// Whether block `i` of `piece` is still its owner's: the file maps
    /// it there, written, or a snapshot holds it (and no file names it).
    fn still_names(self, piece: &Piece, i: u64) -> bool {
        let disk = piece.disk_block + i;
        match piece.owner {
            Owner::File { ino, file_block } => {
                let segments = self.inner.meta.segments(ino, (file_block + i).get(), 1);
                matches!(segments.as_deref(), Ok([Segment::Mapped(e), ..]) if !e.unwritten && e.disk_block == disk)
            }
            Owner::Snapshots => {
                let snapshots = self.inner.journal.snapshots.borrow();
                snapshots.holds(disk.get()) && !snapshots.live_names(&self.inner.space.free().shared, disk.get())
            }
        }
    }

    /// The scrub the image says is in progress (a `ScrubCursor` record),
    /// if any: where it stands and its rate.
    pub fn scrub_saved(self) -> Option<(ScrubCursor, u64)> {
        let saved = self.inner.meta.state().scrub?;
        Some((ScrubCursor { ino: saved.ino, file_block: saved.file_block }, saved.bytes_per_sec))
    }

    /// Record where a scrub stands (None: no scrub), for a restart to
    /// resume from: a record, committed with the next transaction.
    pub fn scrub_save(self, at: Option<(ScrubCursor, u64)>) -> FsResult<()> {
        if self.inner.csums.is_none() {
            return Err(FsError::Unsupported);
        }
        let saved = at.map(|(c, rate)| ScrubSaved { ino: c.ino, file_block: c.file_block, bytes_per_sec: rate.max(1) });
        if self.inner.meta.state().scrub == saved {
            return Ok(());
        }
        let record = match saved {
            Some(s) => {
                Record::ScrubCursor { ino: s.ino.get(), file_block: s.file_block, bytes_per_sec: s.bytes_per_sec }
            }
            None => Record::ScrubCursor { ino: 0, file_block: 0, bytes_per_sec: 1 },
        };
        self.inner.change().log(record)
    }
}

impl Piece {
    /// Where the walk goes on after this piece.
    fn next(&self) -> ScrubCursor {
        match self.owner {
            Owner::File { ino, file_block } => ScrubCursor { ino, file_block: (file_block + self.len).get() },
            Owner::Snapshots => ScrubCursor::in_snapshots((self.disk_block + self.len).get()),
        }
    }

    fn bad_block(&self, i: u64, unreadable: bool) -> BadBlock {
        let file = match self.owner {
            Owner::File { ino, file_block } => Some((ino, (file_block + i).offset())),
            Owner::Snapshots => None,
        };
        BadBlock { file, device_block: (self.disk_block + i).get(), unreadable }
    }
}
