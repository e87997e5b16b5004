//! Data operations.
//!
//! - Buffered reads and writes go through the page cache. Writes only dirty
//!   pages (delayed allocation); writeback allocates, writes and logs the
//!   extents later, in the background, at fsync, or under memory pressure.
//!   A read that finds every page cached takes no lock at all, so it never
//!   waits for writers; a read that misses takes a shared range lock.
//! - Direct reads and writes move data between the caller's buffer (guest
//!   pages, on the vhost-user path) and the device with no copy. An overwrite of written
//!   blocks takes a *shared* range lock and logs nothing: no transaction,
//!   no record, only the in-memory mtime. A write into holes or past the
//!   end allocates unwritten extents, submits at once, and converts the
//!   extents and advances the size when its own I/O completes, so appends
//!   never wait for one another.

mod buffered;
mod clone;
mod direct;
mod space;
mod state;

pub use buffered::{copy_range_copied_bytes, ReadSink, WriteSource};
pub(crate) use state::DataState;
use std::cell::RefCell;
use std::rc::Rc;

use super::blocks::{block_bytes, offset_in_block, whole_blocks, DevBlock, FileBlock};
use super::cache::PAGE_BYTES;
use super::csum_map;
use super::csum_table::{self, TableCache};
use super::extent::Segment;
use super::format::{crc, BlockRun, BLOCK_BYTES};
use super::record::{Record, CSUM_SET_BLOCKS_MAX};
use super::{Fs, FsError, FsInner, FsResult};
use crate::ids::Ino;
use crate::shared::SharedReader;
use keelfs_bdev::AlignedBuf;
use keelfs_reactor as reactor;
use keelfs_reactor::{await_all, IoBuffer, SharedBuffer};

/// Where blocks of a written image go: (file block, device block, blocks,
/// whether a record must map them).
type ImageTarget = (FileBlock, DevBlock, u64, bool);

/// Device requests are split at 1 MiB (256 blocks).
pub(crate) const IO_BLOCKS_MAX: u64 = 256;
/// Who keeps a file's mtime and ctime when data is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteTimes {
    /// keelfs stamps them, as a local filesystem does.
    Stamp,
    /// The client does: a FUSE kernel with writeback caching stamps its
    /// own copy at write(2) and sends it in a SETATTR; pages written back
    /// later must not move them again.
    KeptByClient,
}

/// The range lock that serialises writeback of one file: far past any
/// file offset (MAX_FILE_BYTES), so only truncation and writeback take it.
const WRITEBACK_TOKEN: u64 = u64::MAX - 1;
/// Writers write their own file back once this share of the cache is dirty.
const DIRTY_THROTTLE_PERCENT: usize = 50;

/// The part of `page` inside the file range [offset, end): its byte range
/// within the page and where it lands in a buffer starting at `offset`.
fn page_part(page: u64, offset: u64, end: u64) -> Option<(std::ops::Range<usize>, usize)> {
    let page_start = FileBlock::new(page).offset();
    let (from, to) = (offset.max(page_start), end.min(FileBlock::new(page + 1).offset()));
    (from < to).then(|| (((from - page_start) as usize..(to - page_start) as usize), (from - offset) as usize))
}

/// Copy the part of `page` that falls in `out` (which starts at file
/// offset `offset`).
fn copy_page_part(page_data: &[u8], page: u64, offset: u64, out: &mut [u8]) {
    if let Some((in_page, at)) = page_part(page, offset, offset + out.len() as u64) {
        out[at..at + in_page.len()].copy_from_slice(&page_data[in_page]);
    }
}

/// A plain buffer as a [`ReadSink`], for the copying read path.
struct VecSink(RefCell<Vec<u8>>);

impl ReadSink for VecSink {
    fn copy_from(&self, at: usize, src: &[u8]) {
        self.0.borrow_mut()[at..at + src.len()].copy_from_slice(src);
    }
}

fn blocks_of(offset: u64, len: u64) -> (u64, u64) {
    (FileBlock::containing(offset).get(), FileBlock::containing(offset + len - 1).get())
}

/// Write dirty pages back every `writeback_interval`.
pub(crate) fn start_writeback_timer(fs: &Fs) {
    let weak = Rc::downgrade(&fs.inner);
    let interval = fs.inner.config.writeback_interval;
    reactor::spawn_local(async move {
        loop {
            reactor::sleep(interval).await;
            let Some(inner) = weak.upgrade() else { return };
            if inner.unmounted.get() {
                return;
            }
            if inner.pages.cache().dirty_pages() > 0 {
                let span = inner.span.clone();
                if let Err(e) = (DataOps { inner: &inner }).writeback_all().await {
                    tracing::warn!(parent: &span, error = %e, "background writeback failed");
                }
            }
        }
    });
}

/// The data operations of a mounted filesystem (reads, writes, fsync,
/// fallocate, lseek), reached through [`Fs::data`].
///
/// A sub-handle, not a part: a `Copy` borrow of the filesystem, made per
/// call, that groups these operations apart from the namespace's so that
/// neither group's type grows past a few dozen methods (issue 35). Its
/// methods take `self` by value, so a future keeps only the borrow of the
/// `Fs` and a caller may hold several at once.
#[derive(Clone, Copy)]
pub struct DataOps<'a> {
    pub(crate) inner: &'a Rc<FsInner>,
}

/// The helpers the data paths share: reading a device block, allocating
/// and mapping runs, range locks for writers, zeroing past the end, and
/// writing a file's blocks with the records that map them. With
/// [`Buffered`] and [`Direct`], the data operations' private parts: each
/// a `Copy` borrow of the filesystem, like [`DataOps`], so that no one
/// type carries all of them (issue 35).
#[derive(Clone, Copy)]
pub(super) struct DataCore<'a> {
    inner: &'a Rc<FsInner>,
}

/// The page cache's side of the data path (buffered.rs): loading and
/// copying pages, delayed allocation, throttling and writeback runs.
#[derive(Clone, Copy)]
pub(super) struct Buffered<'a> {
    inner: &'a Rc<FsInner>,
}

/// The device's side of the data path (direct.rs): overwrites in place,
/// extending writes, and the copying fallbacks for unaligned requests.
#[derive(Clone, Copy)]
pub(super) struct Direct<'a> {
    inner: &'a Rc<FsInner>,
}

impl<'a> DataOps<'a> {
    fn buffered(self) -> Buffered<'a> {
        Buffered { inner: self.inner }
    }

    fn core(self) -> DataCore<'a> {
        DataCore { inner: self.inner }
    }

    fn direct(self) -> Direct<'a> {
        Direct { inner: self.inner }
    }
}

impl<'a> DataCore<'a> {
    fn ops(self) -> DataOps<'a> {
        DataOps { inner: self.inner }
    }
}

impl<'a> Buffered<'a> {
    fn core(self) -> DataCore<'a> {
        DataCore { inner: self.inner }
    }

    fn ops(self) -> DataOps<'a> {
        DataOps { inner: self.inner }
    }
}

impl<'a> Direct<'a> {
    fn core(self) -> DataCore<'a> {
        DataCore { inner: self.inner }
    }

    fn ops(self) -> DataOps<'a> {
        DataOps { inner: self.inner }
    }
}

impl Fs {
    /// The data operations on this filesystem's files.
    pub fn data(&self) -> DataOps<'_> {
        DataOps { inner: &self.inner }
    }
}

impl DataOps<'_> {
    /// A reader of `ino`'s cached pages for another thread (another
    /// reactor): reads that find every page cached complete there without
    /// a lock or a message; the others the caller sends here.
    pub fn shared_reader(self, ino: Ino) -> FsResult<SharedReader> {
        let size = self.inner.meta.require_file(ino)?.size;
        let file = self.inner.pages.shared().share(ino, size);
        Ok(SharedReader { pages: self.inner.pages.cache().shared().clone(), file, ino })
    }
}

impl DataCore<'_> {
    /// Check `data`, whole blocks read from device block `disk` on for
    /// `ino`'s file block `file_block` on, against their checksums (on an
    /// image that keeps them). A block in a region open for overwrites in
    /// place that fails is read again, into `data`, and checked again: the
    /// first read may have raced an overwrite of it (the new entry, the
    /// old data). One being overwritten now is let through unchecked, as
    /// is one a read-only mount could not settle after a crash. The first
    /// that still fails is counted, logged once, and fails the read.
    /// Whether a block was read again.
    pub(super) async fn verify_read(
        self,
        ino: Ino,
        file_block: u64,
        disk: DevBlock,
        data: &mut [u8],
    ) -> FsResult<bool> {
        let Some(table) = &self.inner.csums else { return Ok(false) };
        let mut reread = false;
        for (i, block) in data.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            let at = disk.get() + i as u64;
            let (want, got) = (self.entry(table, at).await?, crc(block));
            if want == Some(got) {
                continue;
            }
            if table.borrow().map.in_open_region(at) {
                let again = self.inner.io.read_blocks(DevBlock::new(at), 1).await?;
                block.copy_from_slice(&again);
                reread = true;
                if self.entry(table, at).await? == Some(crc(block)) {
                    continue;
                }
            }
            let let_through = {
                let table = table.borrow();
                table.map.overwriting(at) || table.map.tolerates(at)
            };
            if let_through {
                continue;
            }
            return Err(self.checksum_mismatch(ino, file_block + i as u64, at, want.is_none()));
        }
        Ok(reread)
    }

    /// The entry of device block `at`; most are in memory, with no future
    /// to build for them.
    async fn entry(self, table: &RefCell<TableCache>, at: u64) -> FsResult<Option<u32>> {
        let cached = table.borrow().cached_entry(at);
        match cached {
            Some(want) => Ok(want),
            None => csum_table::entry(table, &self.inner.io, at).await,
        }
    }

    /// Ask for the table lines of the first [`PREFETCHED_ENTRIES_MAX`]
    /// written blocks `segments` map before a direct read of them is
    /// issued: a random block's entry is a cache miss of
    /// several hundred cycles, a third of a checked 4 KiB read's extra
    /// CPU, and it then arrives while the device works. (Not before an
    /// overwrite's: there the two lookups cost more than the miss they
    /// hid, in a profile.)
    pub(super) fn prefetch_entries(self, segments: &[Segment]) {
        let Some(table) = &self.inner.csums else { return };
        let table = table.borrow();
        let blocks = written_extents(segments).flat_map(|e| (0..e.len).map(move |i| (e.disk_block + i).get()));
        for block in blocks.take(PREFETCHED_ENTRIES_MAX) {
            table.prefetch_entry(block);
        }
    }

    /// [`Self::verify_read`] of blocks a direct read placed in `buf` (a
    /// guest's memory: each block's crc is read in place by volatile
    /// loads; one that fails is copied out to be checked again, and copied
    /// back if it was read again), for `segments` from file block `first`.
    /// On a mismatch the whole buffer is zeroed before the read fails.
    pub(super) async fn verify_buffer<B: IoBuffer>(
        self,
        ino: Ino,
        buf: &SharedBuffer<B>,
        first: u64,
        segments: &[Segment],
    ) -> FsResult<()> {
        let Some(table) = &self.inner.csums else { return Ok(()) };
        let busy = |_| FsError::Invalid("buffer busy");
        for e in written_extents(segments) {
            for i in 0..e.len {
                let at = block_bytes(e.file_block - FileBlock::new(first) + i) as usize;
                // Most blocks match their entry: checked in place, with no
                // copy. One that does not takes the copy's path, which may
                // read it again.
                let want = self.entry(table, (e.disk_block + i).get()).await?;
                if want == Some(buf.crc32c(at, BLOCK_BYTES).map_err(busy)?) {
                    continue;
                }
                let mut block = BlockBuf::zeroed();
                let block = &mut block.0;
                buf.copy_out(at, block).map_err(busy)?;
                match self.verify_read(ino, (e.file_block + i).get(), e.disk_block + i, block).await {
                    Ok(false) => {}
                    Ok(true) => buf.copy_in(at, block).map_err(busy)?,
                    Err(e) => {
                        let _ = buf.zero(0, buf.len());
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    fn checksum_mismatch(self, ino: Ino, file_block: u64, block: u64, unverifiable: bool) -> FsError {
        let table = self.inner.csums.as_ref().expect("only an image with checksums verifies");
        let offset = FileBlock::new(file_block).offset();
        if table.borrow_mut().note_mismatch(block) {
            tracing::error!(
                parent: &self.inner.span,
                %ino,
                offset,
                block,
                unverifiable,
                "data checksum mismatch: the read fails with EIO (logged once per block)"
            );
        }
        if let Err(e) = self.inner.change().record_data_error(block, ino, file_block) {
            tracing::warn!(parent: &self.inner.span, %ino, block, "a bad data block not recorded for fsck: {e}");
        }
        FsError::ChecksumMismatch { ino, offset, block }
    }

    /// One file block as it is on the device (zeros for holes and
    /// unwritten extents), ignoring the page cache.
    pub(super) async fn read_device_block(self, ino: Ino, file_block: u64, out: &mut [u8]) -> FsResult<()> {
        match self.inner.meta.segments(ino, file_block, 1)?[0] {
            Segment::Mapped(e) if !e.unwritten => {
                let mut buf = self.inner.io.read_blocks(e.disk_block, 1).await?;
                self.verify_read(ino, file_block, e.disk_block, &mut buf).await?;
                out.copy_from_slice(&buf);
                self.inner.data.count_read(block_bytes(1));
            }
            _ => out.fill(0),
        }
        Ok(())
    }

    /// Blocks for `count` file blocks from `file_block`, placed after the
    /// file's previous extent when that space is free (extent merging).
    /// Only writeback (`reserved`) may dip into space promised to dirty
    /// pages.
    pub(super) fn alloc_runs(
        self,
        ino: Ino,
        file_block: FileBlock,
        count: u64,
        reserved: bool,
    ) -> FsResult<Vec<BlockRun>> {
        if !reserved {
            self.inner.space.check_room(self.inner.usage(), count)?;
        }
        let hint = {
            let state = self.inner.meta.state();
            state.node(ino).ok_or(FsError::Stale)?.extents.hint_after(file_block).map(|b| b.get())
        };
        self.inner.space.alloc_runs(hint, count, self.inner.config.preferred_group)
    }

    /// Runs from [`Self::alloc_runs`] are mapped now, or (`back_to_free`)
    /// go back to the allocator unused.
    pub(super) fn unreserve(self, runs: &[BlockRun], back_to_free: bool) {
        self.inner.space.unreserve(runs, back_to_free);
    }

    /// Lock the blocks a write covers. A write that extends the file also
    /// locks from the block holding the current end of file when that
    /// block's tail must be zeroed first. Returns the guard and the size
    /// seen under it.
    pub(super) async fn lock_for_write(
        self,
        ino: Ino,
        first: u64,
        last: u64,
        end: u64,
    ) -> FsResult<(super::sync::RangeGuard, u64)> {
        loop {
            let size = self.inner.meta.inode(ino)?.size;
            let eof_block = FileBlock::containing(size).get();
            let needs_tail = end > size && offset_in_block(size) != 0 && eof_block < first;
            let (start, stop) = if needs_tail {
                (FileBlock::new(eof_block).offset(), u64::MAX)
            } else {
                (FileBlock::new(first).offset(), FileBlock::new(last + 1).offset())
            };
            let guard = self.inner.data.lock(ino, start, stop, true).await;
            let now_size = self.inner.meta.inode(ino).map_err(|_| FsError::Stale)?.size;
            let still_needs_tail =
                end > now_size && offset_in_block(now_size) != 0 && FileBlock::containing(now_size).get() < first;
            if !still_needs_tail || FileBlock::containing(now_size).offset() >= start {
                return Ok((guard, now_size));
            }
        }
    }

    /// Zero the bytes past `size` in the block holding the end of file, on
    /// the device and in the cache: they are invisible now and about to
    /// become part of the file.
    pub(super) async fn zero_past_eof(self, ino: Ino, size: u64) -> FsResult<()> {
        let tail = offset_in_block(size) as usize;
        if tail == 0 {
            return Ok(());
        }
        let block = FileBlock::containing(size);
        // The cache indexes pages by file block (PAGE_BYTES is BLOCK_BYTES).
        self.inner.pages.cache_mut().zero((ino, block.get()), tail, PAGE_BYTES);
        self.zero_in_block(ino, block, tail, BLOCK_BYTES).await
    }

    /// Allocate blocks for the hole of `len` blocks at `file_block` and log
    /// them as unwritten extents (they read as zeros until converted).
    /// Returns the new mappings: (file block, device block, blocks).
    pub(super) fn map_hole_unwritten(
        self,
        ino: Ino,
        file_block: FileBlock,
        len: u64,
    ) -> FsResult<Vec<(FileBlock, DevBlock, u64)>> {
        let runs = self.alloc_runs(ino, file_block, len, false)?;
        self.unreserve(&runs, false);
        let mut mapped = Vec::with_capacity(runs.len());
        let mut fb = file_block;
        for r in runs {
            self.inner.change().log(Record::ExtentMap {
                ino,
                file_block: fb.get(),
                disk_block: r.start,
                len: r.len,
                unwritten: true,
            })?;
            mapped.push((fb, DevBlock::new(r.start), r.len));
            fb = fb + r.len;
        }
        Ok(mapped)
    }

    /// Whether the writers that have no overwrite-in-place path of their
    /// own on an image with data checksums (an extending direct write over
    /// written blocks, the zeroing of a block's tail) copy every written
    /// block on write: there, a block's data and entry change together
    /// only when the data goes to a new block, mapped with its `CsumSet`
    /// in one transaction.
    pub(super) fn writes_out_of_place(self) -> bool {
        self.inner.csums.is_some()
    }

    /// Whether an image with data checksums has as many regions open for
    /// overwrites in place as it may (`csum_map`): a write that need not
    /// go in place copies on write instead.
    pub(super) fn open_regions_full(self) -> bool {
        self.inner.csums.as_ref().is_some_and(|t| t.borrow().map.full())
    }

    /// The parts of device run `run` that another extent names too: a
    /// write there goes to new blocks (copy on write), never in place.
    pub(super) fn shared_parts(self, run: BlockRun) -> Vec<BlockRun> {
        let free = self.inner.space.free();
        if free.shared.is_empty() {
            return Vec::new(); // nothing shared: every image that never cloned
        }
        free.shared.shared_within(run)
    }

    /// Whether a written block of file blocks [first, last] of `ino` is
    /// shared, or written at all when writes go out of place. Writers that
    /// write in place ask under their range lock.
    pub(super) fn range_shares_blocks(self, ino: Ino, first: u64, last: u64) -> FsResult<bool> {
        if self.inner.space.free().shared.is_empty() && !self.writes_out_of_place() {
            return Ok(false);
        }
        let segments = self.inner.meta.segments(ino, first, last - first + 1)?;
        if self.writes_out_of_place() {
            return Ok(segments.iter().any(|s| matches!(s, Segment::Mapped(e) if !e.unwritten)));
        }
        Ok(self.segments_share_blocks(&segments))
    }

    /// Whether a written block of `segments` (a reading of a file's map)
    /// is shared.
    pub(super) fn segments_share_blocks(self, segments: &[Segment]) -> bool {
        let free = self.inner.space.free();
        if free.shared.is_empty() {
            return false;
        }
        segments.iter().any(|s| match s {
            Segment::Mapped(e) if !e.unwritten => {
                free.shared.any_shared(BlockRun { start: e.disk_block.get(), len: e.len })
            }
            _ => false,
        })
    }

    /// Zero bytes [from, to) of one file block on the device, if it holds
    /// written data: in place, or into a new block if it is shared.
    pub(super) async fn zero_in_block(self, ino: Ino, file_block: FileBlock, from: usize, to: usize) -> FsResult<()> {
        let Segment::Mapped(e) = self.inner.meta.segments(ino, file_block.get(), 1)?[0] else { return Ok(()) };
        if e.unwritten {
            return Ok(());
        }
        let mut buf = self.inner.io.read_blocks(e.disk_block, 1).await?;
        self.verify_read(ino, file_block.get(), e.disk_block, &mut buf).await?;
        buf[from..to].fill(0);
        let shared = self.writes_out_of_place()
            || self.inner.space.free().shared.any_shared(BlockRun { start: e.disk_block.get(), len: 1 });
        if shared {
            let records = self.write_image(ino, file_block.get(), buf, false).await?;
            return self.log_all(records);
        }
        self.inner.io.write_blocks(e.disk_block, buf).await?;
        let mut j = self.inner.journal.ring.borrow_mut();
        j.data_writes += 1;
        j.exposes_data = true;
        Ok(())
    }

    /// Where each of the `nblocks` blocks from `first` goes: (file block,
    /// device block, blocks, whether a record must map it), and the runs
    /// allocated for that (holes, and shared blocks: copy on write),
    /// reserved until mapped. Nothing stays reserved on an error.
    fn image_targets(
        self,
        ino: Ino,
        first: u64,
        nblocks: u64,
        reserved: bool,
    ) -> FsResult<(Vec<ImageTarget>, Vec<BlockRun>)> {
        let mut targets: Vec<ImageTarget> = Vec::new();
        let mut fresh: Vec<BlockRun> = Vec::new();
        let mut new_blocks = |file_block: FileBlock, len: u64, targets: &mut Vec<_>| -> FsResult<()> {
            let runs = match self.alloc_runs(ino, file_block, len, reserved) {
                Ok(r) => r,
                Err(e) => {
                    self.unreserve(&fresh, true);
                    return Err(e);
                }
            };
            let mut fb = file_block;
            for r in &runs {
                targets.push((fb, DevBlock::new(r.start), r.len, true));
                fb = fb + r.len;
            }
            fresh.extend(runs);
            Ok(())
        };
        for seg in self.inner.meta.segments(ino, first, nblocks)? {
            match seg {
                Segment::Mapped(e) if e.unwritten => targets.push((e.file_block, e.disk_block, e.len, true)),
                Segment::Mapped(e) if !reserved && self.open_regions_full() => {
                    new_blocks(e.file_block, e.len, &mut targets)?
                }
                Segment::Mapped(e) => {
                    // The shared parts go to new blocks, the rest in place.
                    let mut at = e.disk_block.get();
                    let file_of = |disk: u64| e.file_block + (disk - e.disk_block.get());
                    for part in self.shared_parts(BlockRun { start: at, len: e.len }) {
                        if part.start > at {
                            targets.push((file_of(at), DevBlock::new(at), part.start - at, false));
                        }
                        new_blocks(file_of(part.start), part.len, &mut targets)?;
                        at = part.end();
                    }
                    let end = e.disk_block.get() + e.len;
                    if at < end {
                        targets.push((file_of(at), DevBlock::new(at), end - at, false));
                    }
                }
                Segment::Hole { file_block, len } => new_blocks(file_block, len, &mut targets)?,
            }
        }
        Ok((targets, fresh))
    }

    /// Write whole blocks of `image` at `first`: in place where the file
    /// already has written blocks of its own, into new blocks where it has
    /// holes or blocks another extent shares (copy on write), into
    /// unwritten extents where it has those. Returns the records that map
    /// what was written; the caller logs them now that the data is on the
    /// device (ordered data). A shared block's remap drops one of its
    /// names; until it commits, the file names the old block, intact.
    /// New blocks must fit the room and the quota, unless `reserved`:
    /// writeback's, whose pages reserved them when they were dirtied.
    pub(super) async fn write_image(
        self,
        ino: Ino,
        first: u64,
        image: AlignedBuf,
        reserved: bool,
    ) -> FsResult<Vec<Record<'static>>> {
        // The image goes to the device in slices, without another copy.
        let image = SharedBuffer::new(image);
        self.write_image_from(ino, first, &image, reserved).await
    }

    /// [`Self::write_image`] from any buffer of whole blocks: a direct
    /// write's own buffer goes to the device as it is.
    pub(super) async fn write_image_from<B: IoBuffer>(
        self,
        ino: Ino,
        first: u64,
        image: &SharedBuffer<B>,
        reserved: bool,
    ) -> FsResult<Vec<Record<'static>>> {
        let nblocks = whole_blocks(image.len() as u64);
        let image_bytes = image.len() as u64;
        let (targets, fresh) = self.image_targets(ino, first, nblocks, reserved)?;
        // Taken before the writes, which hold the buffer's slices: a guest
        // that changes its buffer meanwhile hurts only its own blocks.
        // The targets a record maps: new blocks and unwritten ones.
        let mapped = targets.iter().filter(|t| t.3).map(|&(fb, db, len, _)| (fb, db, len));
        let checksummed = self.new_block_checksums(image, first, mapped);
        let begun = match checksummed {
            Ok(_) => {
                let in_place = targets.iter().filter(|t| !t.3).map(|&(fb, db, len, _)| (fb, db, len));
                self.begin_in_place(image, first, in_place, true).await
            }
            Err(_) => Ok(InPlaceStart::Unchecked),
        };
        let (csums, in_place) = match (checksummed, begun) {
            (Ok(csums), Ok(in_place)) => (csums, in_place),
            (Err(e), _) | (_, Err(e)) => {
                self.unreserve(&fresh, true);
                return Err(e);
            }
        };
        let mut pending = Vec::new();
        for &(fb, db, len, _) in &targets {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(IO_BLOCKS_MAX);
                let src = block_bytes((fb + done) - FileBlock::new(first)) as usize;
                let slice = image.slice(src, block_bytes(n) as usize).map_err(|_| FsError::Invalid("image busy"))?;
                pending.push(self.inner.io.write(db + done, n, slice));
                done += n;
            }
        }
        let result = await_all(pending).await;
        self.finish_in_place(in_place, result.is_ok())?;
        self.inner.journal.ring.borrow_mut().data_writes += 1;
        self.inner.data.count_written(image_bytes);
        if let Err(e) = result {
            self.unreserve(&fresh, true);
            return Err(e.into());
        }
        if self.inner.meta.state().node(ino).is_none() {
            self.unreserve(&fresh, true);
            return Err(FsError::Stale);
        }
        self.unreserve(&fresh, false);
        let maps = targets.into_iter().filter(|t| t.3).map(|(fb, db, len, _)| Record::ExtentMap {
            ino,
            file_block: fb.get(),
            disk_block: db.get(),
            len,
            unwritten: false,
        });
        Ok(maps.chain(csums).collect())
    }

    /// The `CsumSet` records of `runs` (file block, device block, blocks)
    /// written from `buf`, which starts at file block `first`, taken
    /// before the writes hold its slices; none on an image without data
    /// checksums.
    pub(super) fn new_block_checksums<B: IoBuffer>(
        self,
        buf: &SharedBuffer<B>,
        first: u64,
        runs: impl IntoIterator<Item = (FileBlock, DevBlock, u64)>,
    ) -> FsResult<Vec<Record<'static>>> {
        let mut out = Vec::new();
        if self.inner.csums.is_none() {
            return Ok(out);
        }
        for (fb, db, len) in runs {
            let at = block_bytes(fb - FileBlock::new(first)) as usize;
            out.extend(checksum_records(buf, at, db.get(), len)?);
        }
        Ok(out)
    }

    /// On an image with data checksums, before a write in place of
    /// `pieces` (file block, device block, blocks) from `image`, which
    /// starts at file block `first`: their crcs, taken before the writes
    /// hold the buffer, and their regions made ready for it
    /// ([`csum_map::begin_overwrite`]; past the bound on open regions only
    /// if `over_bound`).
    pub(super) async fn begin_in_place<B: IoBuffer>(
        self,
        image: &SharedBuffer<B>,
        first: u64,
        pieces: impl Iterator<Item = (FileBlock, DevBlock, u64)>,
        over_bound: bool,
    ) -> FsResult<InPlaceStart> {
        let Some(table) = &self.inner.csums else { return Ok(InPlaceStart::Unchecked) };
        let (mut runs, mut crcs) = (csum_map::OverwriteRuns::new(), InPlaceCrcs::new());
        for (fb, db, len) in pieces {
            let at = block_bytes(fb - FileBlock::new(first)) as usize;
            runs.push(BlockRun { start: db.get(), len });
            append_block_crcs(image, at, len, &mut crcs)?;
        }
        if runs.is_empty() {
            return Ok(InPlaceStart::Unchecked);
        }
        let writer = &self.inner.csum_map_writer;
        let begun = csum_map::begin_overwrite(table, writer, &self.inner.io, runs, over_bound).await;
        if table.borrow_mut().map.take_checkpoint_asked() {
            crate::journal::maybe_schedule_checkpoint(self.inner);
        }
        Ok(match begun? {
            Some(ow) => InPlaceStart::Begun(ow, crcs),
            None => InPlaceStart::RegionsFull,
        })
    }

    /// After the writes [`Self::begin_in_place`] prepared: their entries
    /// set if they succeeded (`written`), the overwrite ended, and the
    /// blocks recorded as bad there forgotten.
    pub(super) fn finish_in_place(self, start: InPlaceStart, written: bool) -> FsResult<()> {
        let (Some(table), InPlaceStart::Begun(ow, crcs)) = (&self.inner.csums, start) else { return Ok(()) };
        let runs = csum_map::end_overwrite(table, ow, written.then_some(&crcs[..]));
        if written {
            self.inner.change().forget_data_errors(&runs)?;
        }
        Ok(())
    }

    pub(super) fn log_all(self, records: Vec<Record<'_>>) -> FsResult<()> {
        for r in records {
            self.inner.change().log(r)?;
        }
        Ok(())
    }
}

/// What [`DataCore::begin_in_place`] made of a write in place.
pub(super) enum InPlaceStart {
    /// No checksums to keep: an image without them, or nothing in place.
    Unchecked,
    /// Under way: the map's hold on the regions, and the crcs of its
    /// blocks, run after run.
    Begun(csum_map::Overwrite, InPlaceCrcs),
    /// As many regions are open as may be: the caller copies on write.
    RegionsFull,
}

/// One data block in the daemon's own memory, aligned so that a copy out
/// of a guest's buffer into it takes the widest volatile loads (a stack
/// array of bytes may sit at any address, and fall to byte copies).
#[repr(C, align(64))]
pub(super) struct BlockBuf(pub(super) [u8; BLOCK_BYTES]);

impl BlockBuf {
    pub(super) fn zeroed() -> Self {
        Self([0; BLOCK_BYTES])
    }
}

/// `CsumSet` records for `len` device blocks from `disk_block`, whose data
/// is `buf` from byte `at`: each block's crc read in place (through
/// volatile reads: the buffer may be a guest's).
pub(super) fn checksum_records<B: IoBuffer>(
    buf: &SharedBuffer<B>,
    at: usize,
    disk_block: u64,
    len: u64,
) -> FsResult<Vec<Record<'static>>> {
    let mut out = Vec::new();
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CSUM_SET_BLOCKS_MAX as u64);
        let crcs = block_crcs(buf, at + block_bytes(done) as usize, n)?;
        out.push(Record::CsumSet { first_block: disk_block + done, crcs: crcs.into() });
        done += n;
    }
    Ok(out)
}

/// The crcs of an overwrite in place: held without an allocation for up
/// to 8 blocks (32 KiB), the most a small direct write covers.
pub(super) type InPlaceCrcs = smallvec::SmallVec<[u8; 32]>;

/// The written extents among `segments`: the blocks a read checks.
fn written_extents(segments: &[Segment]) -> impl Iterator<Item = &crate::extent::Extent> {
    segments.iter().filter_map(|s| match s {
        Segment::Mapped(e) if !e.unwritten => Some(e),
        _ => None,
    })
}

/// Blocks of a request whose table lines are asked for ahead
/// ([`DataCore::prefetch_entries`]): a 32 KiB request's.
const PREFETCHED_ENTRIES_MAX: usize = 8;

/// The crc32c of each of `len` blocks of `buf` from byte `at`, as
/// little-endian u32s, read in place (through volatile reads: the buffer
/// may be a guest's).
pub(super) fn block_crcs<B: IoBuffer>(buf: &SharedBuffer<B>, at: usize, len: u64) -> FsResult<Vec<u8>> {
    let mut crcs = Vec::with_capacity(len as usize * 4);
    append_block_crcs(buf, at, len, &mut crcs)?;
    Ok(crcs)
}

/// [`block_crcs`], appended to `out`.
fn append_block_crcs<B: IoBuffer>(
    buf: &SharedBuffer<B>,
    at: usize,
    len: u64,
    out: &mut impl Extend<u8>,
) -> FsResult<()> {
    for i in 0..len {
        let crc = buf.crc32c(at + block_bytes(i) as usize, BLOCK_BYTES).map_err(|_| FsError::Invalid("buffer busy"))?;
        out.extend(crc.to_le_bytes());
    }
    Ok(())
}
