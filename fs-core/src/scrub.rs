//! Scrub (issue 38, docs/plans/data-checksums.md section 5): read every
//! written block of an image with data checksums and check it, a piece at
//! a time, so that damage is found before a guest reads it. The
//! filesystem does one bounded step per call; the caller (keelfsd's
//! `scrub_*` RPCs) paces the steps and keeps the cursor, which a
//! `ScrubCursor` record makes durable so that a restart resumes.
//!
//! The walk is by inode, then file block: a block that several files
//! share is read once per name.

use crate::admin::Admin;
use crate::blocks::{DevBlock, FileBlock};
use crate::csum_table;
use crate::extent::Segment;
use crate::format::{crc, BLOCK_BYTES};
use crate::ids::Ino;
use crate::record::Record;
use crate::state::ScrubSaved;
use crate::{FsError, FsResult};

/// Inodes one step looks at while it finds nothing to read: bounds the
/// synchronous part of a step on an image of many empty files.
const INODES_PER_STEP: u64 = 4096;
/// Blocks one step reads at most (one device request).
pub const SCRUB_STEP_BLOCKS_MAX: u64 = 256;

/// Where a scrub goes on from: an inode, and a file block in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScrubCursor {
    pub ino: Ino,
    pub file_block: u64,
}

impl ScrubCursor {
    /// The first inode's first block: a scrub's start.
    pub const START: ScrubCursor = ScrubCursor { ino: Ino::new(1), file_block: 0 };
}

/// A block a scrub found bad: it does not match its checksum (or its
/// checksum is unreadable), or the device failed to read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadBlock {
    pub ino: Ino,
    /// The block's byte offset in the file.
    pub offset: u64,
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

/// The piece a step reads: a written extent's blocks, at most a request.
struct Piece {
    ino: Ino,
    file_block: FileBlock,
    disk_block: DevBlock,
    len: u64,
}

impl Admin<'_> {
    /// Check the next written blocks from `from`, at most `max_blocks`
    /// (and one device request). EOPNOTSUPP on an image without data
    /// checksums.
    pub async fn scrub_step(self, from: ScrubCursor, max_blocks: u64) -> FsResult<ScrubStep> {
        let table = self.inner.csums.as_ref().ok_or(FsError::Unsupported)?;
        let max_blocks = max_blocks.clamp(1, SCRUB_STEP_BLOCKS_MAX);
        let piece = match self.next_piece(from, max_blocks) {
            Ok(piece) => piece,
            Err(next) => return Ok(ScrubStep { next, ..ScrubStep::default() }),
        };
        let next = Some(ScrubCursor { ino: piece.ino, file_block: (piece.file_block + piece.len).get() });
        let mut step = ScrubStep { next, blocks_checked: piece.len, bad: Vec::new() };
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
                if table.borrow_mut().note_mismatch(at.get()) {
                    tracing::error!(parent: &self.inner.span, ino = %bad.ino, offset = bad.offset, block = at.get(),
                        "scrub: data checksum mismatch (logged once per block)");
                }
                self.inner.change().record_data_error(at.get(), bad.ino, piece.file_block.get() + i as u64)?;
                step.bad.push(bad);
            }
        }
        Ok(step)
    }

    /// The next piece to read from `from`, or where the next step starts
    /// (None: the walk is done) when this one found nothing in its bound.
    fn next_piece(self, from: ScrubCursor, max_blocks: u64) -> Result<Piece, Option<ScrubCursor>> {
        let state = self.inner.meta.state();
        let window_end = from.ino.get().saturating_add(INODES_PER_STEP).min(state.next_ino);
        let mut file_block = from.file_block;
        for ino in from.ino.get()..window_end {
            let ino = Ino::new(ino);
            let written = state.node(ino).and_then(|n| n.extents.written_from(FileBlock::new(file_block)));
            if let Some(e) = written {
                let len = e.len.min(max_blocks);
                return Ok(Piece { ino, file_block: e.file_block, disk_block: e.disk_block, len });
            }
            file_block = 0;
        }
        Err((window_end < state.next_ino).then_some(ScrubCursor { ino: Ino::new(window_end), file_block: 0 }))
    }

    /// A block that failed its check while the step's read was in flight
    /// may have been remapped meanwhile (a copy on write) and its old
    /// place reused: bad only if the file still maps it there, written,
    /// and a second read fails too.
    async fn still_bad(self, piece: &Piece, i: u64) -> FsResult<bool> {
        let (file_block, disk) = ((piece.file_block + i).get(), piece.disk_block + i);
        let maps_it = |segments: &[Segment]| matches!(segments.first(), Some(Segment::Mapped(e)) if !e.unwritten && e.disk_block == disk);
        match self.inner.meta.segments(piece.ino, file_block, 1) {
            Ok(segments) if maps_it(&segments) => {}
            _ => return Ok(false),
        }
        let again = self.inner.io.read_blocks(disk, 1).await?;
        let table = self.inner.csums.as_ref().expect("scrub runs with checksums");
        let want = csum_table::entry(table, &self.inner.io, disk.get()).await?;
        let mapped = self.inner.meta.segments(piece.ino, file_block, 1).is_ok_and(|s| maps_it(&s));
        Ok(mapped && want != Some(crc(&again)))
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
    fn bad_block(&self, i: u64, unreadable: bool) -> BadBlock {
        BadBlock {
            ino: self.ino,
            offset: (self.file_block + i).offset(),
            device_block: (self.disk_block + i).get(),
            unreadable,
        }
    }
}
