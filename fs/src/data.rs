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

use std::cell::RefCell;
use std::rc::Rc;

use super::cache::{CacheFull, PAGE_BYTES};
use super::extent::{Segment, Segments};
use super::format::{BlockRun, Inode, Timespec, BLOCK_BYTES, BLOCK_SIZE};
use super::ops::{
    SeekTo, COPY_RANGE_MAX, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE, MAX_FILE_BYTES,
};
use super::record::Record;
use super::{journal, Fs, FsError, FsResult};
use keelfs_bdev::AlignedBuf;
use keelfs_reactor as reactor;
use keelfs_reactor::{await_all, IoBuffer, SharedBuffer};

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

fn now() -> Timespec {
    Timespec::now()
}

/// The part of `page` inside the file range [offset, end): its byte range
/// within the page and where it lands in a buffer starting at `offset`.
fn page_part(page: u64, offset: u64, end: u64) -> Option<(std::ops::Range<usize>, usize)> {
    let page_start = page * BLOCK_SIZE;
    let (from, to) = (offset.max(page_start), end.min(page_start + BLOCK_SIZE));
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
    (offset / BLOCK_SIZE, (offset + len - 1) / BLOCK_SIZE)
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
            if inner.cache.borrow().dirty_pages() > 0 {
                let _ = Fs { inner }.writeback_all().await;
            }
        }
    });
}

/// Shared helpers.
impl Fs {
    pub(super) fn require_file(&self, ino: u64) -> FsResult<Inode> {
        let inode = self.inner.inode(ino)?;
        if inode.is_dir() {
            return Err(FsError::IsDir);
        }
        if !inode.is_reg() {
            return Err(FsError::Invalid("data operation on a special file"));
        }
        Ok(inode)
    }

    fn segments(&self, ino: u64, first: u64, count: u64) -> FsResult<Segments> {
        let state = self.inner.state.borrow();
        Ok(state.node(ino).ok_or(FsError::Stale)?.extents.segments(first, count))
    }

    /// One file block as it is on the device (zeros for holes and
    /// unwritten extents), ignoring the page cache.
    async fn read_device_block(&self, ino: u64, file_block: u64, out: &mut [u8]) -> FsResult<()> {
        match self.segments(ino, file_block, 1)?[0] {
            Segment::Mapped(e) if !e.unwritten => {
                let buf = self.inner.read_blocks(e.disk_block, 1).await?;
                out.copy_from_slice(&buf);
                self.inner.bump(|c| c.data_bytes_read += BLOCK_SIZE);
            }
            _ => out.fill(0),
        }
        Ok(())
    }

    /// Blocks for `count` file blocks from `file_block`, placed after the
    /// file's previous extent when that space is free (extent merging).
    /// Only writeback (`reserved`) may dip into space promised to dirty
    /// pages.
    fn alloc_runs(&self, ino: u64, file_block: u64, count: u64, reserved: bool) -> FsResult<Vec<BlockRun>> {
        if !reserved && self.inner.available_blocks() < count {
            return Err(FsError::NoSpace);
        }
        let mut state = self.inner.state.borrow_mut();
        let mut hint = state.node(ino).ok_or(FsError::Stale)?.extents.hint_after(file_block);
        let mut runs = Vec::new();
        let mut left = count;
        while left > 0 {
            match state.alloc.alloc(left, hint, self.inner.config.preferred_group) {
                Some(run) => {
                    left -= run.len;
                    hint = Some(run.end());
                    runs.push(run);
                }
                None => {
                    for r in runs {
                        state.alloc.free(r);
                    }
                    return Err(FsError::NoSpace);
                }
            }
        }
        drop(state);
        self.inner.journal.borrow_mut().reserved_unmapped += count;
        Ok(runs)
    }

    fn unreserve(&self, runs: &[BlockRun], back_to_free: bool) {
        let total: u64 = runs.iter().map(|r| r.len).sum();
        self.inner.journal.borrow_mut().reserved_unmapped -= total;
        if back_to_free {
            let mut state = self.inner.state.borrow_mut();
            for r in runs {
                state.alloc.free(*r);
            }
        }
    }

    /// Lock the blocks a write covers. A write that extends the file also
    /// locks from the block holding the current end of file when that
    /// block's tail must be zeroed first. Returns the guard and the size
    /// seen under it.
    async fn lock_for_write(
        &self,
        ino: u64,
        first: u64,
        last: u64,
        end: u64,
    ) -> FsResult<(super::sync::RangeGuard, u64)> {
        loop {
            let size = self.inner.inode(ino)?.size;
            let eof_block = size / BLOCK_SIZE;
            let needs_tail = end > size && size % BLOCK_SIZE != 0 && eof_block < first;
            let (start, stop) = if needs_tail {
                (eof_block * BLOCK_SIZE, u64::MAX)
            } else {
                (first * BLOCK_SIZE, (last + 1) * BLOCK_SIZE)
            };
            let guard = self.inner.ranges.lock(ino, start, stop, true).await;
            let now_size = self.inner.inode(ino).map_err(|_| FsError::Stale)?.size;
            let still_needs_tail = end > now_size && now_size % BLOCK_SIZE != 0 && now_size / BLOCK_SIZE < first;
            if !still_needs_tail || (now_size / BLOCK_SIZE) * BLOCK_SIZE >= start {
                return Ok((guard, now_size));
            }
        }
    }

    /// Zero the bytes past `size` in the block holding the end of file, on
    /// the device and in the cache: they are invisible now and about to
    /// become part of the file.
    async fn zero_past_eof(&self, ino: u64, size: u64) -> FsResult<()> {
        let tail = (size % BLOCK_SIZE) as usize;
        if tail == 0 {
            return Ok(());
        }
        let page = size / BLOCK_SIZE;
        self.inner.cache.borrow_mut().zero((ino, page), tail, PAGE_BYTES);
        self.zero_in_block(ino, page, tail, BLOCK_BYTES).await
    }

    /// Zero bytes [from, to) of one file block on the device, if it holds
    /// written data.
    async fn zero_in_block(&self, ino: u64, file_block: u64, from: usize, to: usize) -> FsResult<()> {
        let Segment::Mapped(e) = self.segments(ino, file_block, 1)?[0] else { return Ok(()) };
        if e.unwritten {
            return Ok(());
        }
        let mut buf = self.inner.read_blocks(e.disk_block, 1).await?;
        buf[from..to].fill(0);
        self.inner.write_blocks(e.disk_block, buf).await?;
        let mut j = self.inner.journal.borrow_mut();
        j.data_writes += 1;
        j.exposes_data = true;
        Ok(())
    }

    /// Write whole blocks of `image` at `first`: in place where the file
    /// already has written blocks, into new blocks where it has holes,
    /// into unwritten extents where it has those. Returns the records that
    /// map what was written; the caller logs them now that the data is on
    /// the device (ordered data).
    async fn write_image(&self, ino: u64, first: u64, image: AlignedBuf) -> FsResult<Vec<Record>> {
        let nblocks = image.len() as u64 / BLOCK_SIZE;
        let image_bytes = image.len() as u64;
        let mut targets: Vec<(u64, u64, u64, bool)> = Vec::new(); // (file, disk, len, needs record)
        let mut fresh: Vec<BlockRun> = Vec::new();
        for seg in self.segments(ino, first, nblocks)? {
            match seg {
                Segment::Mapped(e) => targets.push((e.file_block, e.disk_block, e.len, e.unwritten)),
                Segment::Hole { file_block, len } => {
                    let runs = match self.alloc_runs(ino, file_block, len, true) {
                        Ok(r) => r,
                        Err(e) => {
                            self.unreserve(&fresh, true);
                            return Err(e);
                        }
                    };
                    let mut fb = file_block;
                    for r in &runs {
                        targets.push((fb, r.start, r.len, true));
                        fb += r.len;
                    }
                    fresh.extend(runs);
                }
            }
        }
        // The image goes to the device in slices, without another copy.
        let image = SharedBuffer::new(image);
        let mut pending = Vec::new();
        for &(fb, db, len, _) in &targets {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(IO_BLOCKS_MAX);
                let src = ((fb + done - first) * BLOCK_SIZE) as usize;
                let slice = image.slice(src, (n * BLOCK_SIZE) as usize).map_err(|_| FsError::Invalid("image busy"))?;
                pending.push(self.inner.dev.write((db + done) * BLOCK_SIZE, slice));
                done += n;
            }
        }
        let result = await_all(pending).await;
        drop(image);
        self.inner.journal.borrow_mut().data_writes += 1;
        self.inner.bump(|c| c.data_bytes_written += image_bytes);
        if let Err(e) = result {
            self.unreserve(&fresh, true);
            return Err(e.into());
        }
        if self.inner.state.borrow().node(ino).is_none() {
            self.unreserve(&fresh, true);
            return Err(FsError::Stale);
        }
        self.unreserve(&fresh, false);
        Ok(targets
            .into_iter()
            .filter(|t| t.3)
            .map(|(fb, db, len, _)| Record::ExtentMap { ino, file_block: fb, disk_block: db, len, unwritten: false })
            .collect())
    }

    fn log_all(&self, records: Vec<Record>) -> FsResult<()> {
        for r in records {
            self.inner.log(r)?;
        }
        Ok(())
    }

    fn set_datasync_needed(&self, ino: u64) {
        if let Some(n) = self.inner.state.borrow_mut().node_mut(ino) {
            n.datasync_needed = true;
        }
    }
}

/// Buffered I/O through the page cache.
/// Where a buffered write's bytes come from: caller memory, or memory the
/// caller can only copy out of (a guest's pages), so that the one copy is
/// straight into the page cache.
pub trait WriteSource {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Fill `dst` with the bytes from offset `at` on.
    fn copy_to(&self, at: usize, dst: &mut [u8]);
}

impl WriteSource for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn copy_to(&self, at: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self[at..at + dst.len()]);
    }
}

/// Where a buffered read's bytes go (a guest's pages), so that a cache hit
/// is one copy from the page cache.
pub trait ReadSink {
    /// Store `src` at offset `at`.
    fn copy_from(&self, at: usize, src: &[u8]);
}

impl Fs {
    /// Read up to `size` bytes at `offset` into `sink`; the bytes read.
    /// Cached pages go straight from the cache into the sink; a read that
    /// misses goes through [`Fs::read`] and one more copy.
    pub async fn read_to<K: ReadSink + ?Sized>(&self, ino: u64, offset: u64, size: u32, sink: &K) -> FsResult<u32> {
        let inode = self.require_file(ino)?;
        let end = offset.saturating_add(u64::from(size)).min(inode.size);
        if offset < end && self.copy_cached_to(ino, offset, end, sink) {
            self.inner.accessed(ino);
            self.inner.bump(|c| c.data_bytes_read += end - offset);
            return Ok((end - offset) as u32);
        }
        // Everything else goes through `read`, which moves atime itself.
        let data = self.read(ino, offset, size).await?;
        sink.copy_from(0, &data);
        Ok(data.len() as u32)
    }

    /// Read through the page cache. Pages already cached are copied out
    /// without taking any lock; misses are loaded under a shared lock.
    pub async fn read(&self, ino: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let inode = self.require_file(ino)?;
        self.inner.accessed(ino);
        if offset >= inode.size || size == 0 {
            return Ok(Vec::new());
        }
        let end = (offset + u64::from(size)).min(inode.size);
        let (first, last) = blocks_of(offset, end - offset);
        if let Some(out) = self.copy_cached(ino, offset, end) {
            self.inner.bump(|c| c.data_bytes_read += out.len() as u64);
            return Ok(out);
        }
        let _range = self.inner.ranges.lock(ino, first * BLOCK_SIZE, (last + 1) * BLOCK_SIZE, false).await;
        let size_now = self.inner.inode(ino)?.size;
        let end = end.min(size_now);
        if offset >= end {
            return Ok(Vec::new());
        }
        // Copy what is cached now, in one synchronous step; then load the
        // rest, copying each page into the result as it arrives. The shared
        // lock keeps writers of the range out meanwhile.
        let last = (end - 1) / BLOCK_SIZE;
        let mut out = vec![0u8; (end - offset) as usize];
        let missing: Vec<u64> = {
            let mut cache = self.inner.cache.borrow_mut();
            (first..=last)
                .filter(|&page| match cache.get((ino, page)) {
                    Some(p) => {
                        copy_page_part(p, page, offset, &mut out);
                        false
                    }
                    None => true,
                })
                .collect()
        };
        self.load_pages_into(ino, &missing, size_now, offset, &mut out).await?;
        self.inner.bump(|c| c.data_bytes_read += out.len() as u64);
        Ok(out)
    }

    /// All of [offset, end) from the cache in one synchronous step, or None
    /// if any page is missing.
    fn copy_cached(&self, ino: u64, offset: u64, end: u64) -> Option<Vec<u8>> {
        let out = VecSink(RefCell::new(vec![0u8; (end - offset) as usize]));
        self.copy_cached_to(ino, offset, end, &out).then(|| out.0.into_inner())
    }

    /// [`Self::copy_cached`] into any sink; false (nothing copied) if any
    /// page is missing.
    fn copy_cached_to<K: ReadSink + ?Sized>(&self, ino: u64, offset: u64, end: u64, sink: &K) -> bool {
        let (first, last) = blocks_of(offset, end - offset);
        let mut cache = self.inner.cache.borrow_mut();
        if !(first..=last).all(|p| cache.contains((ino, p))) {
            return false;
        }
        for page in first..=last {
            let data = cache.get((ino, page)).expect("checked above");
            if let Some((in_page, at)) = page_part(page, offset, end) {
                sink.copy_from(at, &data[in_page]);
            }
        }
        true
    }

    /// Load `pages` (sorted) with as few device reads as possible (runs on
    /// consecutive device blocks become one request, all in flight
    /// together), cache them, and copy their part of [offset, ..) into
    /// `out`.
    async fn load_pages_into(&self, ino: u64, pages: &[u64], size: u64, offset: u64, out: &mut [u8]) -> FsResult<()> {
        if pages.is_empty() {
            return Ok(());
        }
        self.inner.cache.borrow_mut().note_misses(pages.len() as u64);
        let epoch = self.direct_epoch(ino);
        // (first page, device block or None for zeros, pages)
        let mut runs: Vec<(u64, Option<u64>, u64)> = Vec::new();
        for &page in pages {
            let disk = match self.segments(ino, page, 1)?[0] {
                Segment::Mapped(e) if !e.unwritten => Some(e.disk_block),
                _ => None,
            };
            match runs.last_mut() {
                Some((p0, Some(d0), n)) if disk == Some(*d0 + *n) && page == *p0 + *n && *n < IO_BLOCKS_MAX => *n += 1,
                Some((p0, None, n)) if disk.is_none() && page == *p0 + *n => *n += 1,
                _ => runs.push((page, disk, 1)),
            }
        }
        let mut pending = Vec::new();
        for &(page, disk, n) in &runs {
            let read = disk.map(|d| {
                let buf = AlignedBuf::zeroed((n * BLOCK_SIZE) as usize, BLOCK_BYTES);
                self.inner.dev.read(d * BLOCK_SIZE, buf)
            });
            pending.push((page, n, read));
        }
        const ZEROS: [u8; PAGE_BYTES] = [0u8; PAGE_BYTES];
        for (page, n, read) in pending {
            let data = match read {
                Some(f) => {
                    let (buf, result) = f.await;
                    result?;
                    self.inner.bump(|c| c.data_bytes_read += n * BLOCK_SIZE);
                    Some(buf)
                }
                None => None,
            };
            let cacheable = self.direct_epoch(ino) == epoch;
            let mut cache = self.inner.cache.borrow_mut();
            for k in 0..n {
                let mut content = ZEROS;
                if let Some(buf) = &data {
                    content.copy_from_slice(&buf[(k * BLOCK_SIZE) as usize..((k + 1) * BLOCK_SIZE) as usize]);
                }
                let page_start = (page + k) * BLOCK_SIZE;
                content[size.saturating_sub(page_start).min(BLOCK_SIZE) as usize..].fill(0);
                copy_page_part(&content, page + k, offset, out);
                if cacheable && !cache.contains((ino, page + k)) {
                    // A cache full of dirty pages just does not keep it.
                    let _ = cache.insert((ino, page + k), &content);
                }
            }
        }
        Ok(())
    }

    /// A page's contents, loading it into the cache on a miss. Bytes past
    /// `size` are zero in the cached copy.
    async fn page_for_read(&self, ino: u64, page: u64, size: u64) -> FsResult<Vec<u8>> {
        if let Some(p) = self.inner.cache.borrow_mut().get((ino, page)) {
            return Ok(p.to_vec());
        }
        let mut data = vec![0u8; PAGE_BYTES];
        let epoch = self.direct_epoch(ino);
        self.read_device_block(ino, page, &mut data).await?;
        let page_start = page * BLOCK_SIZE;
        if size < page_start + BLOCK_SIZE {
            data[size.saturating_sub(page_start) as usize..].fill(0);
        }
        if self.direct_epoch(ino) != epoch {
            return Ok(data); // read beside a direct write: not cached
        }
        let mut cache = self.inner.cache.borrow_mut();
        if !cache.contains((ino, page)) {
            // A full cache of dirty pages: serve this read uncached.
            let _ = cache.insert((ino, page), &data);
        } else if let Some(p) = cache.get((ino, page)) {
            return Ok(p.to_vec());
        }
        Ok(data)
    }

    /// copy_file_range: up to `len` bytes (at most `COPY_RANGE_MAX`) from
    /// `from` at `from_offset` to `to` at `to_offset`, through the page
    /// cache in 1 MiB steps, each of which awaits and so yields. Stops at
    /// the source's end; returns the bytes copied. Overlapping ranges of
    /// one file are EINVAL, as on Linux.
    pub async fn copy_range(&self, from: u64, from_offset: u64, to: u64, to_offset: u64, len: u64) -> FsResult<u64> {
        const STEP: u64 = 1 << 20;
        self.require_file(to)?;
        let len = len.min(COPY_RANGE_MAX);
        let overlaps = from_offset < to_offset.saturating_add(len) && to_offset < from_offset.saturating_add(len);
        if from == to && overlaps {
            return Err(FsError::Invalid("copy_file_range within overlapping ranges of one file"));
        }
        to_offset.checked_add(len).filter(|&e| e <= MAX_FILE_BYTES).ok_or(FsError::FileTooBig)?;
        let mut done = 0;
        while done < len {
            let chunk = self.read(from, from_offset + done, (len - done).min(STEP) as u32).await?;
            if chunk.is_empty() {
                break; // the source's end
            }
            done += u64::from(self.write(to, to_offset + done, &chunk).await?);
        }
        Ok(done)
    }

    /// Write through the page cache: pages are dirtied, not allocated
    /// (delayed allocation); writeback allocates and logs them later.
    pub async fn write(&self, ino: u64, offset: u64, data: &[u8]) -> FsResult<u32> {
        self.write_from(ino, offset, data).await
    }

    /// [`Fs::write`] from any [`WriteSource`]: the bytes are copied once,
    /// into the cached pages.
    pub async fn write_from<S: WriteSource + ?Sized>(&self, ino: u64, offset: u64, data: &S) -> FsResult<u32> {
        self.write_from_with(ino, offset, data, WriteTimes::Stamp).await
    }

    /// [`Fs::write_from`], saying who keeps the file's mtime and ctime.
    pub async fn write_from_with<S: WriteSource + ?Sized>(
        &self,
        ino: u64,
        offset: u64,
        data: &S,
        times: WriteTimes,
    ) -> FsResult<u32> {
        if self.read_only() {
            return Err(FsError::ReadOnly);
        }
        match self.write_from_once(ino, offset, data, times).await {
            Err(FsError::NoSpace) if self.reclaim_pending_frees().await? => {
                self.write_from_once(ino, offset, data, times).await
            }
            other => other,
        }
    }

    /// Space freed since the last commit cannot be reused before the free
    /// commits (a crash must not find a freed block already holding new
    /// data while the old owner still names it). On ENOSPC with such space
    /// pending, commit now and report that a retry may succeed, as ext4
    /// does.
    ///
    /// The frees may also be in a commit already under way (another task
    /// hit ENOSPC first): the sync waits for it. A checkpoint being written
    /// in pieces holds the frees committed since its start; it is given up
    /// first, so that they come back too. A retry is worth it only if
    /// space came back.
    async fn reclaim_pending_frees(&self) -> FsResult<bool> {
        let before = self.inner.available_blocks();
        journal::abandon_checkpoint_in_pieces(&self.inner);
        journal::commit_all(&self.inner).await?;
        Ok(self.inner.available_blocks() > before)
    }

    async fn write_from_once<S: WriteSource + ?Sized>(
        &self,
        ino: u64,
        offset: u64,
        data: &S,
        times: WriteTimes,
    ) -> FsResult<u32> {
        if data.is_empty() {
            return Ok(0);
        }
        let end = offset.checked_add(data.len() as u64).filter(|&e| e <= MAX_FILE_BYTES).ok_or(FsError::FileTooBig)?;
        self.require_file(ino)?;
        let (first, last) = blocks_of(offset, data.len() as u64);
        loop {
            // Room is made before any lock is held: writeback takes locks.
            self.make_room(last - first + 1).await?;
            let (range, old_size) = self.lock_for_write(ino, first, last, end).await?;
            if end > old_size && old_size / BLOCK_SIZE < first {
                self.zero_past_eof(ino, old_size).await?;
            }
            // Partial edge pages are read first and kept here, so that the
            // update below is one synchronous step even if they are evicted
            // while we wait.
            let mut edges: Vec<(u64, Vec<u8>)> = Vec::new();
            for page in [first, last] {
                let (ps, pe) = (page * BLOCK_SIZE, (page + 1) * BLOCK_SIZE);
                let partial = offset > ps || end < pe;
                if partial && ps < old_size && !edges.iter().any(|(p, _)| *p == page) {
                    edges.push((page, self.page_for_read(ino, page, old_size).await?));
                }
            }
            let to_reserve = self.pages_needing_reservation(ino, first, last)?;
            self.reserve_delalloc(to_reserve.len() as u64)?;
            // An extending write changes pages and then the size: readers
            // on other cores see both or neither.
            let change = (end > old_size).then(|| self.inner.file_change(ino));
            if self.apply_write(ino, offset, data, &edges, &to_reserve).is_err() {
                // Other tasks filled the cache with dirty pages meanwhile:
                // undo the reservation and start over (rewriting the same
                // bytes is harmless).
                self.inner.release_delalloc(to_reserve.len() as u64);
                drop(range);
                continue;
            }
            if end > old_size {
                if let Some(n) = self.inner.state.borrow_mut().node_mut(ino) {
                    n.persist_size_cap.get_or_insert(old_size);
                    n.datasync_needed = true;
                }
            }
            self.inner.written_with(ino, Some(end), times)?;
            drop(change);
            drop(range);
            self.throttle(ino).await?;
            return Ok(data.len() as u32);
        }
    }

    /// Copy `data` into the cached pages of its range, creating them from
    /// `edges` or zeros, and mark them dirty: all in one synchronous step.
    /// Fails, changing nothing, if there are not enough clean slots.
    fn apply_write<S: WriteSource + ?Sized>(
        &self,
        ino: u64,
        offset: u64,
        data: &S,
        edges: &[(u64, Vec<u8>)],
        reserve: &[u64],
    ) -> Result<(), CacheFull> {
        let end = offset + data.len() as u64;
        let (first, last) = blocks_of(offset, data.len() as u64);
        let mut cache = self.inner.cache.borrow_mut();
        let absent = (first..=last).filter(|&p| !cache.contains((ino, p))).count();
        if absent > cache.clean_or_free_slots() {
            return Err(CacheFull);
        }
        // Each page is opened before it changes and all are closed at the
        // end, so that readers on other cores see the whole write or none
        // of it. A page written here is dirty at once, so inserting the
        // next one cannot evict it.
        for page in first..=last {
            if !cache.contains((ino, page)) {
                let content = edges.iter().find(|(p, _)| *p == page).map_or(&[0u8; PAGE_BYTES][..], |(_, c)| &c[..]);
                if let Err(full) = cache.insert((ino, page), content) {
                    cache.write_close();
                    return Err(full);
                }
            }
            let (ps, pe) = (page * BLOCK_SIZE, (page + 1) * BLOCK_SIZE);
            let from = offset.max(ps);
            let to = end.min(pe);
            let stored = cache.write_open((ino, page), (from - ps) as usize, (to - from) as usize, |part| {
                data.copy_to((from - offset) as usize, part)
            });
            assert!(stored, "page {page} of inode {ino} was inserted above");
            cache.mark_dirty((ino, page));
            if reserve.contains(&page) {
                cache.set_reserved((ino, page));
            }
        }
        cache.write_close();
        Ok(())
    }

    /// Write back until `pages` more pages fit without evicting dirty ones.
    async fn make_room(&self, pages: u64) -> FsResult<()> {
        for _ in 0..4 {
            if self.inner.cache.borrow().clean_or_free_slots() as u64 > pages {
                return Ok(());
            }
            self.writeback_all().await?;
        }
        Err(FsError::Corrupt("the page cache is too small for this write".into()))
    }

    /// Pages of [first, last] over holes that hold no reservation yet:
    /// writeback will allocate a block for each.
    fn pages_needing_reservation(&self, ino: u64, first: u64, last: u64) -> FsResult<Vec<u64>> {
        let cache = self.inner.cache.borrow();
        let mut out = Vec::new();
        for seg in self.segments(ino, first, last - first + 1)? {
            if let Segment::Hole { file_block, len } = seg {
                out.extend((file_block..file_block + len).filter(|&p| !cache.is_reserved((ino, p))));
            }
        }
        Ok(out)
    }

    fn reserve_delalloc(&self, blocks: u64) -> FsResult<()> {
        if blocks == 0 {
            return Ok(());
        }
        if self.inner.available_blocks() < blocks {
            return Err(FsError::NoSpace);
        }
        self.inner.journal.borrow_mut().delalloc_reserved += blocks;
        Ok(())
    }

    async fn throttle(&self, ino: u64) -> FsResult<()> {
        let (dirty, capacity) = {
            let c = self.inner.cache.borrow();
            (c.dirty_pages(), c.capacity_pages())
        };
        if dirty * 100 > capacity * DIRTY_THROTTLE_PERCENT {
            self.writeback(ino, 0, u64::MAX).await?;
        }
        Ok(())
    }

    /// Write back the dirty pages of `ino` in [from, to) (page indices).
    pub(crate) async fn writeback(&self, ino: u64, from: u64, to: u64) -> FsResult<()> {
        let pages = self.inner.cache.borrow().dirty_of(ino, from, to);
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1] + 1 && (j - i) < IO_BLOCKS_MAX as usize {
                j += 1;
            }
            self.writeback_run(ino, pages[i], (j - i) as u64).await?;
            i = j;
        }
        let clean = self.inner.cache.borrow().dirty_of(ino, 0, u64::MAX).is_empty();
        if clean {
            let capped =
                self.inner.state.borrow_mut().node_mut(ino).is_some_and(|n| n.persist_size_cap.take().is_some());
            if capped {
                self.inner.mark_dirty(ino);
            }
        }
        Ok(())
    }

    async fn writeback_run(&self, ino: u64, first: u64, count: u64) -> FsResult<()> {
        // One writeback per file at a time (two could allocate the same
        // hole), holding a token range past any data; and a *shared* lock
        // on the pages: writers of them wait, readers never do.
        let _token = self.inner.ranges.lock(ino, WRITEBACK_TOKEN, u64::MAX, true).await;
        let _range = self.inner.ranges.lock(ino, first * BLOCK_SIZE, (first + count) * BLOCK_SIZE, false).await;
        if self.inner.state.borrow().node(ino).is_none() {
            return Ok(());
        }
        // Snapshot the pages still dirty (a truncate may have dropped some),
        // as whole contiguous runs.
        // Runs of pages still dirty (a truncate may have dropped some).
        let mut runs: Vec<(u64, u64)> = Vec::new();
        {
            let cache = self.inner.cache.borrow();
            for page in first..first + count {
                if !cache.is_dirty((ino, page)) {
                    continue;
                }
                match runs.last_mut() {
                    Some((f, n)) if *f + *n == page => *n += 1,
                    _ => runs.push((page, 1)),
                }
            }
        }
        let mut released = 0;
        let mut images = Vec::with_capacity(runs.len());
        {
            let mut cache = self.inner.cache.borrow_mut();
            for &(f, n) in &runs {
                let mut image = AlignedBuf::zeroed((n * BLOCK_SIZE) as usize, BLOCK_BYTES);
                for page in f..f + n {
                    let at = ((page - f) * BLOCK_SIZE) as usize;
                    image[at..at + PAGE_BYTES].copy_from_slice(cache.peek((ino, page)).expect("dirty page is cached"));
                    cache.mark_clean((ino, page));
                    released += u64::from(cache.take_reserved((ino, page)));
                }
                images.push((f, image));
            }
        }
        let runs = images;
        // The reservations become real allocations in write_image.
        self.inner.release_delalloc(released);
        for (f, image) in runs {
            let pages = image.len() as u64 / BLOCK_SIZE;
            match self.write_image(ino, f, image).await {
                Ok(records) => {
                    self.log_all(records)?;
                    self.inner.bump(|c| c.writeback_pages += pages);
                }
                Err(e) => {
                    let mut cache = self.inner.cache.borrow_mut();
                    for p in f..f + pages {
                        cache.mark_dirty((ino, p));
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Write back every dirty page.
    pub async fn writeback_all(&self) -> FsResult<()> {
        let inodes = self.inner.cache.borrow().dirty_inodes();
        for ino in inodes {
            self.writeback(ino, 0, u64::MAX).await?;
        }
        Ok(())
    }

    /// Make the file durable: its dirty pages, then (unless `datasync` and
    /// only timestamps changed) the journal, then the device cache.
    pub async fn fsync(&self, ino: u64, datasync: bool) -> FsResult<()> {
        self.inner.inode(ino)?;
        if self.read_only() {
            return Ok(());
        }
        self.writeback(ino, 0, u64::MAX).await?;
        let needed = self.inner.state.borrow().node(ino).is_some_and(|n| n.datasync_needed);
        if datasync && !needed {
            return journal::flush_data(&self.inner).await;
        }
        journal::sync(&self.inner).await
    }

    pub async fn fsyncdir(&self, ino: u64, datasync: bool) -> FsResult<()> {
        self.inner.inode(ino)?;
        if self.read_only() {
            return Ok(());
        }
        let _ = datasync;
        journal::sync(&self.inner).await
    }
}

/// Direct I/O: the caller's buffer goes to the device without a copy.
impl Fs {
    fn direct_aligned<B: IoBuffer>(&self, offset: u64, buf: &SharedBuffer<B>) -> bool {
        let align = self.inner.geometry.memory_alignment.max(512) as usize;
        offset.is_multiple_of(BLOCK_SIZE)
            && (buf.len() as u64).is_multiple_of(BLOCK_SIZE)
            && !buf.is_empty()
            && buf.iovecs().iter().all(|v| (v.base as usize).is_multiple_of(align) && v.len % 512 == 0)
    }

    /// Write back and drop cached pages of [first, last] so that direct
    /// I/O and the cache agree.
    async fn flush_cache_range(&self, ino: u64, first: u64, last: u64, drop_clean: bool) -> FsResult<()> {
        let cached = self.inner.cache.borrow().has_pages(ino, first, last + 1);
        if !cached {
            return Ok(());
        }
        self.writeback(ino, first, last + 1).await?;
        if drop_clean {
            self.inner.cache.borrow_mut().discard_clean_range(ino, first, last + 1);
        }
        Ok(())
    }

    /// Direct write of `buf` at `offset`. Returns the buffer and the bytes
    /// written. Unaligned requests are copied through a bounce buffer.
    pub async fn write_direct<B: IoBuffer>(&self, ino: u64, offset: u64, buf: B) -> (B, FsResult<u32>) {
        if self.read_only() {
            return (buf, Err(FsError::ReadOnly));
        }
        let shared = SharedBuffer::new(buf);
        let mut result = self.write_direct_shared(ino, offset, &shared).await;
        if matches!(result, Err(FsError::NoSpace)) && matches!(self.reclaim_pending_frees().await, Ok(true)) {
            result = self.write_direct_shared(ino, offset, &shared).await;
        }
        (into_inner(shared), result)
    }

    async fn write_direct_shared<B: IoBuffer>(&self, ino: u64, offset: u64, buf: &SharedBuffer<B>) -> FsResult<u32> {
        let len = buf.len() as u64;
        if len == 0 {
            return Ok(0);
        }
        let end = offset.checked_add(len).filter(|&e| e <= MAX_FILE_BYTES).ok_or(FsError::FileTooBig)?;
        self.require_file(ino)?;
        let (first, last) = blocks_of(offset, len);
        self.flush_cache_range(ino, first, last, true).await?;
        self.move_direct_epoch(ino);
        let result = self.write_direct_uncached(ino, offset, end, buf).await;
        // A read that cached the range while the write ran may hold the
        // old data; the epoch keeps later fills out, this drops earlier ones.
        self.move_direct_epoch(ino);
        self.inner.cache.borrow_mut().discard_clean_range(ino, first, last + 1);
        result
    }

    async fn write_direct_uncached<B: IoBuffer>(
        &self,
        ino: u64,
        offset: u64,
        end: u64,
        buf: &SharedBuffer<B>,
    ) -> FsResult<u32> {
        if !self.direct_aligned(offset, buf) {
            let mut bytes = vec![0u8; buf.len()];
            buf.copy_out(0, &mut bytes).map_err(|_| FsError::Invalid("buffer busy"))?;
            return self.write_uncached_copy(ino, offset, &bytes).await;
        }
        if let Some(n) = self.try_direct_overwrite(ino, offset, end, buf).await? {
            return Ok(n);
        }
        self.direct_extend(ino, offset, end, buf).await
    }

    fn move_direct_epoch(&self, ino: u64) {
        if let Some(n) = self.inner.state.borrow_mut().node_mut(ino) {
            n.direct_epoch += 1;
        }
    }

    fn direct_epoch(&self, ino: u64) -> Option<u64> {
        self.inner.state.borrow().node(ino).map(|n| n.direct_epoch)
    }

    /// The overwrite fast path: every block already written and inside the
    /// file. Shared lock, no allocation, no record. None if not applicable.
    async fn try_direct_overwrite<B: IoBuffer>(
        &self,
        ino: u64,
        offset: u64,
        end: u64,
        buf: &SharedBuffer<B>,
    ) -> FsResult<Option<u32>> {
        let (first, last) = blocks_of(offset, end - offset);
        let all_written = |fs: &Fs| -> FsResult<bool> {
            let size = fs.inner.inode(ino)?.size;
            // Past the size (even inside the last block) is an extending
            // write: it must move the size, which this path never does.
            Ok(end <= size
                && fs
                    .segments(ino, first, last - first + 1)?
                    .iter()
                    .all(|s| matches!(s, Segment::Mapped(e) if !e.unwritten)))
        };
        if !all_written(self)? {
            return Ok(None);
        }
        let _range = self.inner.ranges.lock(ino, first * BLOCK_SIZE, (last + 1) * BLOCK_SIZE, false).await;
        if !all_written(self)? {
            return Ok(None);
        }
        let segments = self.segments(ino, first, last - first + 1)?;
        self.direct_begin();
        let result = self.submit_segments(buf, first, &segments, true).await;
        self.direct_end();
        result?;
        self.inner.journal.borrow_mut().data_writes += 1;
        self.inner.written(ino, None)?;
        self.inner.bump(|c| {
            c.direct_overwrites += 1;
            c.data_bytes_written += end - offset;
        });
        Ok(Some((end - offset) as u32))
    }

    fn direct_begin(&self) {
        self.inner.bump(|c| {
            c.direct_in_flight += 1;
            c.direct_in_flight_max = c.direct_in_flight_max.max(c.direct_in_flight);
        });
    }

    fn direct_end(&self) {
        self.inner.bump(|c| c.direct_in_flight -= 1);
    }

    /// Issue device I/O for every segment: reads or writes of the mapped
    /// ones, zeros into the buffer for holes and unwritten ones (reads).
    async fn submit_segments<B: IoBuffer>(
        &self,
        buf: &SharedBuffer<B>,
        first: u64,
        segments: &[Segment],
        write: bool,
    ) -> FsResult<()> {
        // Most requests are one device I/O: keep it out of the heap (a
        // Vec per request showed up as a fifth of the CPU of pmem appends,
        // mostly in malloc's consolidation).
        let mut only = None;
        let mut pending = Vec::new();
        for seg in segments {
            let (fb, len, disk) = match *seg {
                Segment::Mapped(e) if write || !e.unwritten => (e.file_block, e.len, Some(e.disk_block)),
                Segment::Mapped(e) => (e.file_block, e.len, None),
                Segment::Hole { file_block, len } => (file_block, len, None),
            };
            let at = ((fb - first) * BLOCK_SIZE) as usize;
            let Some(disk) = disk else {
                buf.zero(at, (len * BLOCK_SIZE) as usize).map_err(|_| FsError::Invalid("buffer busy"))?;
                continue;
            };
            let mut done = 0;
            while done < len {
                let n = (len - done).min(IO_BLOCKS_MAX);
                let slice = buf
                    .slice(at + (done * BLOCK_SIZE) as usize, (n * BLOCK_SIZE) as usize)
                    .map_err(|_| FsError::Invalid("buffer busy"))?;
                let pos = (disk + done) * BLOCK_SIZE;
                let io = if write { self.inner.dev.write(pos, slice) } else { self.inner.dev.read(pos, slice) };
                match only.take() {
                    None if pending.is_empty() => only = Some(io),
                    first => {
                        pending.extend(first);
                        pending.push(io);
                    }
                }
                done += n;
            }
        }
        if let Some(io) = only {
            let (_, result) = io.await;
            result?;
        } else {
            await_all(pending).await?;
        }
        Ok(())
    }

    /// A direct write into holes, unwritten extents or past the end:
    /// allocate unwritten extents, submit at once, convert on completion.
    async fn direct_extend<B: IoBuffer>(
        &self,
        ino: u64,
        offset: u64,
        end: u64,
        buf: &SharedBuffer<B>,
    ) -> FsResult<u32> {
        let (first, last) = blocks_of(offset, end - offset);
        let (_range, old_size) = self.lock_for_write(ino, first, last, end).await?;
        if end > old_size && old_size / BLOCK_SIZE < first {
            self.zero_past_eof(ino, old_size).await?;
        }
        let mut converted = Vec::new();
        for seg in self.segments(ino, first, last - first + 1)? {
            match seg {
                Segment::Mapped(e) if e.unwritten => converted.push((e.file_block, e.disk_block, e.len)),
                Segment::Mapped(_) => {}
                Segment::Hole { file_block, len } => {
                    let runs = self.alloc_runs(ino, file_block, len, false)?;
                    self.unreserve(&runs, false);
                    let mut fb = file_block;
                    for r in runs {
                        self.inner.log(Record::ExtentMap {
                            ino,
                            file_block: fb,
                            disk_block: r.start,
                            len: r.len,
                            unwritten: true,
                        })?;
                        converted.push((fb, r.start, r.len));
                        fb += r.len;
                    }
                }
            }
        }
        if end > old_size {
            if let Some(n) = self.inner.state.borrow_mut().node_mut(ino) {
                n.extends_in_flight.insert(offset, end);
            }
        }
        let segments = self.segments(ino, first, last - first + 1)?;
        self.direct_begin();
        let result = self.submit_segments(buf, first, &segments, true).await;
        self.direct_end();
        self.inner.journal.borrow_mut().data_writes += 1;
        let new_size = self.finish_extend(ino, offset, end, result.is_ok());
        result?;
        for (fb, db, len) in converted {
            self.inner.log(Record::ExtentMap { ino, file_block: fb, disk_block: db, len, unwritten: false })?;
        }
        self.inner.written(ino, Some(new_size))?;
        self.set_datasync_needed(ino);
        self.inner.bump(|c| {
            c.direct_extends += 1;
            c.data_bytes_written += end - offset;
        });
        Ok((end - offset) as u32)
    }

    /// Retire an extending write and return the size the file may now
    /// claim: the furthest completed end, but never past the start of an
    /// earlier extending write still in flight, so the size never covers
    /// data that is not on the device.
    fn finish_extend(&self, ino: u64, offset: u64, end: u64, ok: bool) -> u64 {
        let mut state = self.inner.state.borrow_mut();
        let Some(n) = state.node_mut(ino) else { return 0 };
        n.extends_in_flight.remove(&offset);
        if ok {
            n.extends_done = n.extends_done.max(end);
        }
        let limit = n.extends_in_flight.keys().next().copied().unwrap_or(u64::MAX);
        n.extends_done.min(limit).max(n.inode.size.min(end))
    }

    /// Direct read into `buf`. Returns the buffer and the bytes read (short
    /// at end of file).
    pub async fn read_direct<B: IoBuffer>(&self, ino: u64, offset: u64, buf: B) -> (B, FsResult<u32>) {
        let shared = SharedBuffer::new(buf);
        let result = self.read_direct_shared(ino, offset, &shared).await;
        (into_inner(shared), result)
    }

    async fn read_direct_shared<B: IoBuffer>(&self, ino: u64, offset: u64, buf: &SharedBuffer<B>) -> FsResult<u32> {
        self.inner.accessed(ino);
        let inode = self.require_file(ino)?;
        let len = buf.len() as u64;
        if offset >= inode.size || len == 0 {
            return Ok(0);
        }
        let (first, last) = blocks_of(offset, len);
        self.flush_cache_range(ino, first, last, false).await?;
        if !self.direct_aligned(offset, buf) {
            let data = self.read_uncached_copy(ino, offset, len).await?;
            buf.copy_in(0, &data).map_err(|_| FsError::Invalid("buffer busy"))?;
            return Ok(data.len() as u32);
        }
        let _range = self.inner.ranges.lock(ino, first * BLOCK_SIZE, (last + 1) * BLOCK_SIZE, false).await;
        let size = self.inner.inode(ino)?.size;
        let avail = len.min(size.saturating_sub(offset));
        if avail == 0 {
            return Ok(0);
        }
        let read_last = (offset + avail - 1) / BLOCK_SIZE;
        let segments = self.segments(ino, first, read_last - first + 1)?;
        self.submit_segments(buf, first, &segments, false).await?;
        // Never hand back what lies past the end of file.
        let tail_from = avail as usize;
        let tail_to = ((read_last - first + 1) * BLOCK_SIZE) as usize;
        if tail_to > tail_from {
            buf.zero(tail_from, tail_to - tail_from).map_err(|_| FsError::Invalid("buffer busy"))?;
        }
        self.inner.bump(|c| c.data_bytes_read += avail);
        Ok(avail as u32)
    }

    /// A direct write of unaligned bytes: read-modify-write of the edge
    /// blocks, bypassing the cache.
    async fn write_uncached_copy(&self, ino: u64, offset: u64, data: &[u8]) -> FsResult<u32> {
        let end = offset + data.len() as u64;
        let (first, last) = blocks_of(offset, data.len() as u64);
        let (_range, old_size) = self.lock_for_write(ino, first, last, end).await?;
        if end > old_size && old_size / BLOCK_SIZE < first {
            self.zero_past_eof(ino, old_size).await?;
        }
        let nblocks = last - first + 1;
        let mut image = AlignedBuf::zeroed((nblocks * BLOCK_SIZE) as usize, BLOCK_BYTES);
        let head = (offset % BLOCK_SIZE) as usize;
        if head != 0 {
            self.read_device_block(ino, first, &mut image[..BLOCK_BYTES]).await?;
        }
        if !end.is_multiple_of(BLOCK_SIZE) && (nblocks > 1 || head == 0) {
            let at = ((nblocks - 1) * BLOCK_SIZE) as usize;
            self.read_device_block(ino, last, &mut image[at..]).await?;
        }
        let image_start = first * BLOCK_SIZE;
        if old_size < image_start + image.len() as u64 {
            image[old_size.saturating_sub(image_start) as usize..].fill(0);
        }
        image[head..head + data.len()].copy_from_slice(data);
        let records = self.write_image(ino, first, image).await?;
        let maps_blocks = !records.is_empty();
        self.log_all(records)?;
        self.inner.written(ino, Some(end))?;
        if maps_blocks || end > old_size {
            self.set_datasync_needed(ino);
        }
        Ok(data.len() as u32)
    }

    async fn read_uncached_copy(&self, ino: u64, offset: u64, len: u64) -> FsResult<Vec<u8>> {
        let (first, last) = blocks_of(offset, len);
        let _range = self.inner.ranges.lock(ino, first * BLOCK_SIZE, (last + 1) * BLOCK_SIZE, false).await;
        let size = self.inner.inode(ino)?.size;
        let end = (offset + len).min(size);
        if offset >= end {
            return Ok(Vec::new());
        }
        let mut out = vec![0u8; (end - offset) as usize];
        let mut block = vec![0u8; BLOCK_BYTES];
        for b in first..=((end - 1) / BLOCK_SIZE) {
            self.read_device_block(ino, b, &mut block).await?;
            let bs = b * BLOCK_SIZE;
            let from = offset.max(bs);
            let to = end.min(bs + BLOCK_SIZE);
            out[(from - offset) as usize..(to - offset) as usize]
                .copy_from_slice(&block[(from - bs) as usize..(to - bs) as usize]);
        }
        Ok(out)
    }
}

fn into_inner<B: IoBuffer>(shared: SharedBuffer<B>) -> B {
    match shared.into_inner() {
        Ok(b) => b,
        // Every slice is awaited before we return, so none can remain.
        Err(_) => unreachable!("a buffer slice outlived its request"),
    }
}

/// Size changes, preallocation and seeking.
impl Fs {
    /// Set the size. Shrinking frees whole blocks past the new end in one
    /// transaction; the bytes left past the end in the last partial block
    /// are zeroed only when the file grows over them again, so a crash
    /// before the shrink commits cannot destroy data still in the file.
    pub(crate) async fn truncate(&self, ino: u64, new_size: u64) -> FsResult<()> {
        if new_size > MAX_FILE_BYTES {
            return Err(FsError::FileTooBig);
        }
        let old = self.require_file(ino)?.size;
        let from = old.min(new_size) / BLOCK_SIZE * BLOCK_SIZE;
        let _range = self.inner.ranges.lock(ino, from, u64::MAX, true).await;
        let keep_blocks = new_size.div_ceil(BLOCK_SIZE);
        // Shrinking drops pages, zeroes the new last page's tail, then sets
        // the size: readers on other cores see all of it or none.
        let change = (new_size < old).then(|| self.inner.file_change(ino));
        if new_size < old {
            let released = self.inner.cache.borrow_mut().discard(ino, keep_blocks);
            self.inner.release_delalloc(released);
            self.inner.cache.borrow_mut().zero(
                (ino, new_size / BLOCK_SIZE),
                (new_size % BLOCK_SIZE) as usize,
                PAGE_BYTES,
            );
            self.inner.log(Record::ExtentPunch { ino, file_block: keep_blocks, len: u64::MAX - keep_blocks })?;
        } else {
            self.zero_past_eof(ino, old).await?;
        }
        let t = now();
        self.inner.update_inode(ino, |i| {
            i.size = new_size;
            i.mtime = t;
            i.ctime = t;
        })?;
        drop(change);
        if let Some(n) = self.inner.state.borrow_mut().node_mut(ino) {
            n.persist_size_cap = n.persist_size_cap.map(|c| c.min(new_size));
            // An extending write that finished before the truncate must not
            // give the file its old size back when the next one finishes.
            n.extends_done = n.extends_done.min(new_size);
            n.datasync_needed = true;
        }
        Ok(())
    }

    pub async fn fallocate(&self, ino: u64, mode: u32, offset: u64, len: u64) -> FsResult<()> {
        if self.read_only() {
            return Err(FsError::ReadOnly);
        }
        match self.fallocate_once(ino, mode, offset, len).await {
            Err(FsError::NoSpace) if self.reclaim_pending_frees().await? => {
                self.fallocate_once(ino, mode, offset, len).await
            }
            other => other,
        }
    }

    async fn fallocate_once(&self, ino: u64, mode: u32, offset: u64, len: u64) -> FsResult<()> {
        if len == 0 {
            return Err(FsError::Invalid("fallocate of zero bytes"));
        }
        let end = offset.checked_add(len).filter(|&e| e <= MAX_FILE_BYTES).ok_or(FsError::FileTooBig)?;
        self.require_file(ino)?;
        let known = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE;
        if mode & !known != 0 {
            return Err(FsError::Unsupported);
        }
        let punch = mode & FALLOC_FL_PUNCH_HOLE != 0;
        let zero = mode & FALLOC_FL_ZERO_RANGE != 0;
        if punch && (zero || mode & FALLOC_FL_KEEP_SIZE == 0) {
            return Err(FsError::Invalid("punch hole needs KEEP_SIZE alone"));
        }
        let (first, last) = blocks_of(offset, len);
        // Dirty cached data in the range must reach the device first, so
        // that clearing below is not undone by a later writeback.
        self.flush_cache_range(ino, first, last, false).await?;
        let range_lock = self.inner.ranges.lock(ino, first * BLOCK_SIZE, (last + 1) * BLOCK_SIZE, true);
        let _range = range_lock.await;
        if punch || zero {
            self.clear_range(ino, offset, end).await?;
        }
        let old_size = self.inner.inode(ino)?.size;
        let keep = mode & FALLOC_FL_KEEP_SIZE != 0;
        if !keep && end > old_size {
            self.zero_past_eof(ino, old_size).await?;
        }
        if !punch {
            self.allocate_unwritten(ino, offset / BLOCK_SIZE, end.div_ceil(BLOCK_SIZE))?;
        }
        let t = now();
        self.inner.update_inode(ino, |i| {
            if !keep {
                i.size = i.size.max(end);
            }
            if punch || zero {
                i.mtime = t;
            }
            i.ctime = t;
        })?;
        self.set_datasync_needed(ino);
        Ok(())
    }

    /// Make [offset, end) read as zeros: unmap whole blocks, zero edges,
    /// on the device and in the cache.
    async fn clear_range(&self, ino: u64, offset: u64, end: u64) -> FsResult<()> {
        let first_whole = offset.div_ceil(BLOCK_SIZE);
        let end_whole = end / BLOCK_SIZE;
        if first_whole < end_whole {
            self.inner.log(Record::ExtentPunch { ino, file_block: first_whole, len: end_whole - first_whole })?;
        }
        {
            let _change = self.inner.file_change(ino);
            self.inner.cache.borrow_mut().zero_range(ino, offset, end);
        }
        let head_block = offset / BLOCK_SIZE;
        let tail_block = (end - 1) / BLOCK_SIZE;
        if !offset.is_multiple_of(BLOCK_SIZE) || (head_block == tail_block && !end.is_multiple_of(BLOCK_SIZE)) {
            let to = if head_block == tail_block { (end - head_block * BLOCK_SIZE) as usize } else { BLOCK_BYTES };
            self.zero_in_block(ino, head_block, (offset % BLOCK_SIZE) as usize, to).await?;
        }
        if tail_block != head_block && !end.is_multiple_of(BLOCK_SIZE) {
            self.zero_in_block(ino, tail_block, 0, (end % BLOCK_SIZE) as usize).await?;
        }
        Ok(())
    }

    /// Back the holes in file blocks [first, end) with unwritten extents:
    /// space is reserved and reads still return zeros, with no data I/O.
    fn allocate_unwritten(&self, ino: u64, first: u64, end: u64) -> FsResult<()> {
        let holes: Vec<(u64, u64)> = self
            .segments(ino, first, end - first)?
            .into_iter()
            .filter_map(|s| match s {
                Segment::Hole { file_block, len } => Some((file_block, len)),
                Segment::Mapped(_) => None,
            })
            .collect();
        for (fb, len) in holes {
            let runs = self.alloc_runs(ino, fb, len, false)?;
            self.unreserve(&runs, false);
            let mut at = fb;
            for r in runs {
                self.inner.log(Record::ExtentMap {
                    ino,
                    file_block: at,
                    disk_block: r.start,
                    len: r.len,
                    unwritten: true,
                })?;
                at += r.len;
            }
        }
        Ok(())
    }

    /// SEEK_DATA / SEEK_HOLE. Unwritten extents count as holes; dirty
    /// cached pages count as data.
    pub async fn lseek(&self, ino: u64, offset: u64, to: SeekTo) -> FsResult<u64> {
        let inode = self.require_file(ino)?;
        if offset >= inode.size {
            return Err(FsError::Nxio);
        }
        self.writeback(ino, 0, u64::MAX).await?;
        let first = offset / BLOCK_SIZE;
        let blocks = inode.size.div_ceil(BLOCK_SIZE) - first;
        for seg in self.segments(ino, first, blocks)? {
            let (fb, is_data) = match seg {
                Segment::Mapped(e) => (e.file_block, !e.unwritten),
                Segment::Hole { file_block, .. } => (file_block, false),
            };
            if is_data == (to == SeekTo::Data) {
                return Ok((fb * BLOCK_SIZE).max(offset));
            }
        }
        if to == SeekTo::Hole {
            Ok(inode.size)
        } else {
            Err(FsError::Nxio)
        }
    }
}
