//! Buffered I/O through the page cache: reads that take no lock on a hit,
//! writes that dirty pages, and writeback that allocates and logs them.

use std::cell::RefCell;

use super::clone::CLONE_BLOCKS_MAX;
use super::{
    blocks_of, copy_page_part, page_part, VecSink, WriteTimes, DIRTY_THROTTLE_PERCENT, IO_BLOCKS_MAX, WRITEBACK_TOKEN,
};
use super::{Buffered, DataOps};
use crate::blocks::{block_bytes, whole_blocks, DevBlock, FileBlock};
use crate::cache::{CacheFull, PAGE_BYTES};
use crate::extent::Segment;
use crate::format::{BlockRun, BLOCK_BYTES, BLOCK_SIZE};
use crate::ids::{FileOffset, Ino};
use crate::ops::{COPY_RANGE_MAX, MAX_FILE_BYTES};

/// Most bytes one copy_file_range clones, with a block of head and tail
/// copied (within a FUSE reply's u32).
const CLONE_RANGE_MAX: u64 = (CLONE_BLOCKS_MAX + 2) * BLOCK_SIZE;
use crate::{journal, FsError, FsResult};
use keelfs_bdev::AlignedBuf;

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

/// A request's data in the aligned buffer it was read into.
impl WriteSource for keelfs_reactor::AlignedWindow {
    fn len(&self) -> usize {
        self.bytes().len()
    }

    fn copy_to(&self, at: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self.bytes()[at..at + dst.len()]);
    }
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

/// The bytes a copy_file_range of `len` from `from_offset` to `to_offset`
/// copies at most, rather than shares: at most `COPY_RANGE_MAX` when the
/// offsets sit at different places in a block, else the partial blocks
/// at either end. What a QoS limiter charges it as writing; the whole
/// blocks it shares cost an extent each, not their bytes.
pub fn copy_range_copied_bytes(from_offset: u64, to_offset: u64, len: u64) -> u64 {
    if from_offset % BLOCK_SIZE != to_offset % BLOCK_SIZE {
        return len.min(COPY_RANGE_MAX);
    }
    let head = ((BLOCK_SIZE - from_offset % BLOCK_SIZE) % BLOCK_SIZE).min(len);
    head + (len - head) % BLOCK_SIZE
}

impl DataOps<'_> {
    /// Read up to `size` bytes at `offset` into `sink`; the bytes read.
    /// Cached pages go straight from the cache into the sink; a read that
    /// misses goes through [`DataOps::read`] and one more copy.
    pub async fn read_to<K: ReadSink + ?Sized>(
        self,
        ino: Ino,
        offset: FileOffset,
        size: u32,
        sink: &K,
    ) -> FsResult<u32> {
        let offset = offset.get();
        let inode = self.inner.meta.require_file(ino)?;
        let end = offset.saturating_add(u64::from(size)).min(inode.size);
        if offset < end && self.buffered().copy_cached_to(ino, offset, end, sink) {
            self.inner.change().accessed(ino);
            self.inner.data.count_read(end - offset);
            return Ok((end - offset) as u32);
        }
        // Everything else goes through `read`, which moves atime itself.
        let data = self.read(ino, FileOffset::new(offset), size).await?;
        sink.copy_from(0, &data);
        Ok(data.len() as u32)
    }

    /// Read through the page cache. Pages already cached are copied out
    /// without taking any lock; misses are loaded under a shared lock.
    pub async fn read(self, ino: Ino, offset: FileOffset, size: u32) -> FsResult<Vec<u8>> {
        let offset = offset.get();
        let inode = self.inner.meta.require_file(ino)?;
        self.inner.change().accessed(ino);
        if offset >= inode.size || size == 0 {
            return Ok(Vec::new());
        }
        let end = (offset + u64::from(size)).min(inode.size);
        let (first, last) = blocks_of(offset, end - offset);
        if let Some(out) = self.buffered().copy_cached(ino, offset, end) {
            self.inner.data.count_read(out.len() as u64);
            return Ok(out);
        }
        let _range =
            self.inner.data.lock(ino, FileBlock::new(first).offset(), FileBlock::new(last + 1).offset(), false).await;
        let size_now = self.inner.meta.inode(ino)?.size;
        let end = end.min(size_now);
        if offset >= end {
            return Ok(Vec::new());
        }
        // Copy what is cached now, in one synchronous step; then load the
        // rest, copying each page into the result as it arrives. The shared
        // lock keeps writers of the range out meanwhile.
        let last = FileBlock::containing(end - 1).get();
        let mut out = vec![0u8; (end - offset) as usize];
        let missing: Vec<u64> = {
            let mut cache = self.inner.pages.cache_mut();
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
        self.buffered().load_pages_into(ino, &missing, size_now, offset, &mut out).await?;
        self.inner.data.count_read(out.len() as u64);
        Ok(out)
    }

    /// copy_file_range: up to `len` bytes from `from` at `from_offset` to
    /// `to` at `to_offset`. Stops at the source's end; returns the bytes
    /// copied. Overlapping ranges of one file are EINVAL, as on Linux.
    ///
    /// When both offsets sit at the same place within a block, the whole
    /// blocks between are cloned (shared, issue 37), up to
    /// `CLONE_BLOCKS_MAX` of them, and only the edges are copied. Otherwise
    /// at most `COPY_RANGE_MAX` bytes are copied through the page cache.
    pub async fn copy_range(
        self,
        from: Ino,
        from_offset: FileOffset,
        to: Ino,
        to_offset: FileOffset,
        len: u64,
    ) -> FsResult<u64> {
        let from_offset = from_offset.get();
        let to_offset = to_offset.get();
        self.inner.meta.require_file(to)?;
        // The source's size when the copy starts bounds it, as Linux's
        // generic checks do: a copy within one file that grows it must not
        // then read on into what it wrote (found by the model test).
        let source_size = self.inner.meta.require_file(from)?.size;
        let len = len.min(source_size.saturating_sub(from_offset));
        let lined_up = from_offset % BLOCK_SIZE == to_offset % BLOCK_SIZE;
        let len = len.min(if lined_up { CLONE_RANGE_MAX } else { COPY_RANGE_MAX });
        let overlaps = from_offset < to_offset.saturating_add(len) && to_offset < from_offset.saturating_add(len);
        if from == to && overlaps {
            return Err(FsError::Invalid("copy_file_range within overlapping ranges of one file"));
        }
        to_offset.checked_add(len).filter(|&e| e <= MAX_FILE_BYTES).ok_or(FsError::FileTooBig)?;
        if !lined_up {
            return self.copy_bytes(from, from_offset, to, to_offset, len).await;
        }
        // The head up to the first whole block, copied.
        let head = ((BLOCK_SIZE - from_offset % BLOCK_SIZE) % BLOCK_SIZE).min(len);
        let mut done = self.copy_bytes(from, from_offset, to, to_offset, head).await?;
        if done < head {
            return Ok(done); // the source's end
        }
        // The whole blocks, cloned: as many as lie inside the source.
        let blocks = (len - done) / BLOCK_SIZE;
        let from_block = FileBlock::containing(from_offset + done);
        let cloned = self.clone_blocks(from, from_block, to, FileBlock::containing(to_offset + done), blocks).await?;
        done += cloned * BLOCK_SIZE;
        if cloned == CLONE_BLOCKS_MAX {
            return Ok(done); // a short copy: the client asks for the rest
        }
        // The tail, and a partial last block of the source, copied.
        let rest = (len - done).min(COPY_RANGE_MAX);
        Ok(done + self.copy_bytes(from, from_offset + done, to, to_offset + done, rest).await?)
    }

    /// Copy `len` bytes through the page cache in 1 MiB steps, each of
    /// which awaits and so yields; stops at the source's end. Returns the
    /// bytes copied.
    async fn copy_bytes(self, from: Ino, from_offset: u64, to: Ino, to_offset: u64, len: u64) -> FsResult<u64> {
        const STEP: u64 = 1 << 20;
        let mut done = 0;
        while done < len {
            let chunk = self.read(from, FileOffset::new(from_offset + done), (len - done).min(STEP) as u32).await?;
            if chunk.is_empty() {
                break; // the source's end
            }
            done += u64::from(self.write(to, FileOffset::new(to_offset + done), &chunk).await?);
        }
        Ok(done)
    }

    /// Write through the page cache: pages are dirtied, not allocated
    /// (delayed allocation); writeback allocates and logs them later.
    pub async fn write(self, ino: Ino, offset: FileOffset, data: &[u8]) -> FsResult<u32> {
        let offset = offset.get();
        self.write_from(ino, FileOffset::new(offset), data).await
    }

    /// [`DataOps::write`] from any [`WriteSource`]: the bytes are copied once,
    /// into the cached pages.
    pub async fn write_from<S: WriteSource + ?Sized>(self, ino: Ino, offset: FileOffset, data: &S) -> FsResult<u32> {
        let offset = offset.get();
        self.write_from_with(ino, FileOffset::new(offset), data, WriteTimes::Stamp).await
    }

    /// [`DataOps::write_from`], saying who keeps the file's mtime and ctime.
    pub async fn write_from_with<S: WriteSource + ?Sized>(
        self,
        ino: Ino,
        offset: FileOffset,
        data: &S,
        times: WriteTimes,
    ) -> FsResult<u32> {
        let offset = offset.get();
        if self.inner.config.read_only {
            return Err(FsError::ReadOnly);
        }
        match self.buffered().write_from_once(ino, offset, data, times).await {
            Err(FsError::NoSpace | FsError::Quota) if self.reclaim_pending_frees().await? => {
                self.buffered().write_from_once(ino, offset, data, times).await
            }
            other => other,
        }
    }

    /// Space freed since the last commit cannot be reused before the free
    /// commits (a crash must not find a freed block already holding new
    /// data while the old owner still names it). On ENOSPC with such space
    /// pending, commit now and report that a retry may succeed, as ext4
    /// does. EDQUOT does the same: the quota counts those frees as used
    /// until they commit.
    ///
    /// The frees may also be in a commit already under way (another task
    /// hit ENOSPC first): the sync waits for it. A checkpoint being written
    /// in pieces holds the frees committed since its start; it is given up
    /// first, so that they come back too, and so are runs awaiting a
    /// discard. A retry is worth it only if space came back.
    ///
    /// With none of those, nothing can come back, so it neither commits
    /// nor flushes: a client asking again and again for more than the
    /// device holds must not buy a journal write and a device flush with
    /// each failed request (issue 36).
    pub(super) async fn reclaim_pending_frees(self) -> FsResult<bool> {
        let usage = self.inner.usage();
        if !self.inner.space.has_uncommitted_frees() && !self.inner.journal.busy() && usage.discarding == 0 {
            return Ok(false);
        }
        let before = self.inner.space.available_blocks(usage);
        self.inner.journal.abandon_checkpoint_in_pieces(&self.inner.commit_cx());
        journal::commit_all(self.inner).await?;
        // The commit may have queued its frees for discard: take them
        // (and any queued before) back now.
        let discarded = self.inner.discard.reclaim(&self.inner.space).await;
        Ok(discarded || self.inner.space.available_blocks(self.inner.usage()) > before)
    }

    /// Write back the dirty pages of `ino` in [from, to) (page indices).
    /// Returns once they are on the device and their extents logged, and
    /// so is any writeback of the file that was running when it began.
    pub(crate) async fn writeback(self, ino: Ino, from: u64, to: u64) -> FsResult<()> {
        // One writeback per file at a time (two could allocate the same
        // hole), holding a token range past any data. Taken before looking
        // for dirty pages: a running writeback has marked the pages it took
        // clean, but they are neither on the device nor mapped until it
        // ends, and a caller that finds nothing dirty (sync, fsync, a
        // direct write) must still wait for them.
        let _token = self.inner.data.lock(ino, WRITEBACK_TOKEN, u64::MAX, true).await;
        let _busy = self.inner.pages.writing_back(ino);
        let pages = self.inner.pages.cache().dirty_of(ino, from, to);
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1] + 1 && (j - i) < IO_BLOCKS_MAX as usize {
                j += 1;
            }
            self.buffered().writeback_run(ino, pages[i], (j - i) as u64).await?;
            i = j;
        }
        let clean = self.inner.pages.cache().dirty_of(ino, 0, u64::MAX).is_empty();
        if clean {
            let capped = self
                .inner
                .meta
                .state_mut()
                .node_mut(ino)
                .and_then(|n| n.writes_if_any())
                .is_some_and(|w| w.persist_size_cap.take().is_some());
            if capped {
                self.inner.change().mark_dirty(ino);
            }
        }
        Ok(())
    }

    /// Write back every dirty page, and wait for writebacks already
    /// running (the timer's), whose pages no longer look dirty.
    pub async fn writeback_all(self) -> FsResult<()> {
        for ino in self.inner.pages.unsettled_files() {
            self.writeback(ino, 0, u64::MAX).await?;
        }
        Ok(())
    }

    /// Make the file durable: its dirty pages, then (unless `datasync` and
    /// only timestamps changed) the journal, then the device cache.
    pub async fn fsync(self, ino: Ino, datasync: bool) -> FsResult<()> {
        self.inner.meta.inode(ino)?;
        if self.inner.config.read_only {
            return Ok(());
        }
        self.writeback(ino, 0, u64::MAX).await?;
        let needed = self.inner.meta.state().node(ino).is_some_and(|n| n.datasync_needed);
        if datasync && !needed {
            return self.inner.journal.flush_data(&self.inner.commit_cx()).await;
        }
        journal::sync(self.inner).await
    }

    pub async fn fsyncdir(self, ino: Ino, datasync: bool) -> FsResult<()> {
        self.inner.meta.inode(ino)?;
        if self.inner.config.read_only {
            return Ok(());
        }
        let _ = datasync;
        journal::sync(self.inner).await
    }
}

impl Buffered<'_> {
    /// All of [offset, end) from the cache in one synchronous step, or None
    /// if any page is missing.
    pub(super) fn copy_cached(self, ino: Ino, offset: u64, end: u64) -> Option<Vec<u8>> {
        let out = VecSink(RefCell::new(vec![0u8; (end - offset) as usize]));
        self.copy_cached_to(ino, offset, end, &out).then(|| out.0.into_inner())
    }

    /// [`Self::copy_cached`] into any sink; false (nothing copied) if any
    /// page is missing.
    pub(super) fn copy_cached_to<K: ReadSink + ?Sized>(self, ino: Ino, offset: u64, end: u64, sink: &K) -> bool {
        let (first, last) = blocks_of(offset, end - offset);
        let mut cache = self.inner.pages.cache_mut();
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
    pub(super) async fn load_pages_into(
        self,
        ino: Ino,
        pages: &[u64],
        size: u64,
        offset: u64,
        out: &mut [u8],
    ) -> FsResult<()> {
        if pages.is_empty() {
            return Ok(());
        }
        self.inner.pages.cache_mut().note_misses(pages.len() as u64);
        let epoch = self.inner.meta.direct_epoch(ino);
        // (first page, device block or None for zeros, pages)
        let mut runs: Vec<(u64, Option<DevBlock>, u64)> = Vec::new();
        for &page in pages {
            let disk = match self.inner.meta.segments(ino, page, 1)?[0] {
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
                let buf = AlignedBuf::zeroed(block_bytes(n) as usize, BLOCK_BYTES);
                self.inner.io.read(d, n, buf)
            });
            pending.push((page, n, disk, read));
        }
        const ZEROS: [u8; PAGE_BYTES] = [0u8; PAGE_BYTES];
        for (page, n, disk, read) in pending {
            let data = match (read, disk) {
                (Some(f), Some(disk)) => {
                    let (mut buf, result) = f.await;
                    result?;
                    self.core().verify_read(ino, page, disk, &mut buf).await?;
                    self.inner.data.count_read(block_bytes(n));
                    Some(buf)
                }
                _ => None,
            };
            let cacheable = self.inner.meta.direct_epoch(ino) == epoch;
            let mut cache = self.inner.pages.cache_mut();
            for k in 0..n {
                let mut content = ZEROS;
                if let Some(buf) = &data {
                    content.copy_from_slice(&buf[block_bytes(k) as usize..block_bytes(k + 1) as usize]);
                }
                let page_start = FileBlock::new(page + k).offset();
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
    pub(super) async fn page_for_read(self, ino: Ino, page: u64, size: u64) -> FsResult<Vec<u8>> {
        if let Some(p) = self.inner.pages.cache_mut().get((ino, page)) {
            return Ok(p.to_vec());
        }
        let mut data = vec![0u8; PAGE_BYTES];
        let epoch = self.inner.meta.direct_epoch(ino);
        self.core().read_device_block(ino, page, &mut data).await?;
        let page_start = FileBlock::new(page).offset();
        if size < FileBlock::new(page + 1).offset() {
            data[size.saturating_sub(page_start) as usize..].fill(0);
        }
        if self.inner.meta.direct_epoch(ino) != epoch {
            return Ok(data); // read beside a direct write: not cached
        }
        let mut cache = self.inner.pages.cache_mut();
        if !cache.contains((ino, page)) {
            // A full cache of dirty pages: serve this read uncached.
            let _ = cache.insert((ino, page), &data);
        } else if let Some(p) = cache.get((ino, page)) {
            return Ok(p.to_vec());
        }
        Ok(data)
    }

    pub(super) async fn write_from_once<S: WriteSource + ?Sized>(
        self,
        ino: Ino,
        offset: u64,
        data: &S,
        times: WriteTimes,
    ) -> FsResult<u32> {
        if data.is_empty() {
            return Ok(0);
        }
        let end = offset.checked_add(data.len() as u64).filter(|&e| e <= MAX_FILE_BYTES).ok_or(FsError::FileTooBig)?;
        self.inner.meta.require_file(ino)?;
        let (first, last) = blocks_of(offset, data.len() as u64);
        loop {
            // Room is made before any lock is held: writeback takes locks.
            self.make_room(last - first + 1).await?;
            let (range, old_size) = self.core().lock_for_write(ino, first, last, end).await?;
            if end > old_size && FileBlock::containing(old_size).get() < first {
                self.core().zero_past_eof(ino, old_size).await?;
            }
            // Partial edge pages are read first and kept here, so that the
            // update below is one synchronous step even if they are evicted
            // while we wait.
            let mut edges: Vec<(u64, Vec<u8>)> = Vec::new();
            for page in [first, last] {
                let (ps, pe) = (FileBlock::new(page).offset(), FileBlock::new(page + 1).offset());
                let partial = offset > ps || end < pe;
                if partial && ps < old_size && !edges.iter().any(|(p, _)| *p == page) {
                    edges.push((page, self.page_for_read(ino, page, old_size).await?));
                }
            }
            let to_reserve = self.pages_needing_reservation(ino, first, last)?;
            if !to_reserve.is_empty() {
                // The usage figures sum the allocator's groups: only for a
                // write that needs room.
                self.inner.space.reserve_delalloc(self.inner.usage(), to_reserve.len() as u64)?;
            }
            // An extending write changes pages and then the size: readers
            // on other cores see both or neither.
            let change = (end > old_size).then(|| self.inner.pages.shared().change(ino));
            if self.apply_write(ino, offset, data, &edges, &to_reserve).is_err() {
                // Other tasks filled the cache with dirty pages meanwhile:
                // undo the reservation and start over (rewriting the same
                // bytes is harmless).
                self.inner.space.release_delalloc(to_reserve.len() as u64);
                drop(range);
                continue;
            }
            if end > old_size {
                if let Some(n) = self.inner.meta.state_mut().node_mut(ino) {
                    n.writes_mut().persist_size_cap.get_or_insert(old_size);
                    n.datasync_needed = true;
                }
            }
            self.inner.change().written_with(ino, Some(end), times)?;
            drop(change);
            drop(range);
            self.throttle(ino).await?;
            return Ok(data.len() as u32);
        }
    }

    /// Copy `data` into the cached pages of its range, creating them from
    /// `edges` or zeros, and mark them dirty: all in one synchronous step.
    /// Fails, changing nothing, if there are not enough clean slots.
    pub(super) fn apply_write<S: WriteSource + ?Sized>(
        self,
        ino: Ino,
        offset: u64,
        data: &S,
        edges: &[(u64, Vec<u8>)],
        reserve: &[u64],
    ) -> Result<(), CacheFull> {
        let end = offset + data.len() as u64;
        let (first, last) = blocks_of(offset, data.len() as u64);
        let mut cache = self.inner.pages.cache_mut();
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
            let (ps, pe) = (FileBlock::new(page).offset(), FileBlock::new(page + 1).offset());
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
    pub(super) async fn make_room(self, pages: u64) -> FsResult<()> {
        for _ in 0..4 {
            if self.inner.pages.cache().clean_or_free_slots() as u64 > pages {
                return Ok(());
            }
            self.ops().writeback_all().await?;
        }
        Err(FsError::Corrupt("the page cache is too small for this write".into()))
    }

    /// Pages of [first, last] over holes, or over blocks another extent
    /// shares, that hold no reservation yet: writeback will allocate a
    /// block for each (copy on write for the shared ones), so ENOSPC comes
    /// at write time, not at writeback.
    pub(super) fn pages_needing_reservation(self, ino: Ino, first: u64, last: u64) -> FsResult<Vec<u64>> {
        let cache = self.inner.pages.cache();
        let mut out = Vec::new();
        // Pages are file blocks (PAGE_BYTES is BLOCK_BYTES).
        let mut add = |pages: std::ops::Range<u64>| out.extend(pages.filter(|&p| !cache.is_reserved((ino, p))));
        for seg in self.inner.meta.segments(ino, first, last - first + 1)? {
            match seg {
                Segment::Hole { file_block, len } => add(file_block.get()..(file_block + len).get()),
                Segment::Mapped(e) if !e.unwritten => {
                    for part in self.core().shared_parts(BlockRun { start: e.disk_block.get(), len: e.len }) {
                        let page = e.file_block.get() + (part.start - e.disk_block.get());
                        add(page..page + part.len);
                    }
                }
                Segment::Mapped(_) => {}
            }
        }
        Ok(out)
    }

    pub(super) async fn throttle(self, ino: Ino) -> FsResult<()> {
        let (dirty, capacity) = {
            let c = self.inner.pages.cache();
            (c.dirty_pages(), c.capacity_pages())
        };
        if dirty * 100 > capacity * DIRTY_THROTTLE_PERCENT {
            self.ops().writeback(ino, 0, u64::MAX).await?;
        }
        Ok(())
    }

    /// Write back the pages of one run. The caller holds the file's
    /// writeback token.
    pub(super) async fn writeback_run(self, ino: Ino, first: u64, count: u64) -> FsResult<()> {
        // A *shared* lock on the pages: writers of them wait, readers
        // never do.
        let _range = self
            .inner
            .data
            .lock(ino, FileBlock::new(first).offset(), FileBlock::new(first + count).offset(), false)
            .await;
        if self.inner.meta.state().node(ino).is_none() {
            return Ok(());
        }
        // Snapshot the pages still dirty (a truncate may have dropped some),
        // as whole contiguous runs.
        // Runs of pages still dirty (a truncate may have dropped some).
        let mut runs: Vec<(u64, u64)> = Vec::new();
        {
            let cache = self.inner.pages.cache();
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
            let mut cache = self.inner.pages.cache_mut();
            for &(f, n) in &runs {
                let mut image = AlignedBuf::zeroed(block_bytes(n) as usize, BLOCK_BYTES);
                for page in f..f + n {
                    let at = block_bytes(page - f) as usize;
                    image[at..at + PAGE_BYTES].copy_from_slice(cache.peek((ino, page)).expect("dirty page is cached"));
                    cache.mark_clean((ino, page));
                    released += u64::from(cache.take_reserved((ino, page)));
                }
                images.push((f, image));
            }
        }
        let runs = images;
        // The reservations become real allocations in write_image.
        self.inner.space.release_delalloc(released);
        for (f, image) in runs {
            let pages = whole_blocks(image.len() as u64);
            match self.core().write_image(ino, f, image, true).await {
                Ok(records) => {
                    self.core().log_all(records)?;
                    self.inner.data.count_written_back(pages);
                }
                Err(e) => {
                    let mut cache = self.inner.pages.cache_mut();
                    for p in f..f + pages {
                        cache.mark_dirty((ino, p));
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}
