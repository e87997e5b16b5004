//! Direct I/O: the caller's buffer goes to the device without a copy.

use super::{blocks_of, IO_BLOCKS_MAX};
use super::{DataOps, Direct, InPlaceStart};
use crate::blocks::{block_bytes, offset_in_block, FileBlock};
use crate::extent::Segment;
use crate::format::{BLOCK_BYTES, BLOCK_SIZE};
use crate::ids::{FileOffset, Ino};
use crate::ops::MAX_FILE_BYTES;
use crate::record::Record;
use crate::{FsError, FsResult};
use keelfs_bdev::AlignedBuf;
use keelfs_reactor::{await_all, IoBuffer, SharedBuffer};

impl DataOps<'_> {
    /// Write back and drop cached pages of [first, last] so that direct
    /// I/O and the cache agree.
    pub(super) async fn flush_cache_range(self, ino: Ino, first: u64, last: u64, drop_clean: bool) -> FsResult<()> {
        let cached = self.inner.pages.cache().has_pages(ino, first, last + 1);
        if !cached {
            return Ok(());
        }
        self.writeback(ino, first, last + 1).await?;
        if drop_clean {
            self.inner.pages.cache_mut().discard_clean_range(ino, first, last + 1);
        }
        Ok(())
    }

    /// Direct write of `buf` at `offset`. Returns the buffer and the bytes
    /// written. Unaligned requests are copied through a bounce buffer.
    pub async fn write_direct<B: IoBuffer>(self, ino: Ino, offset: FileOffset, buf: B) -> (B, FsResult<u32>) {
        let offset = offset.get();
        if self.inner.config.read_only {
            return (buf, Err(FsError::ReadOnly));
        }
        let shared = SharedBuffer::new(buf);
        let mut result = self.direct().write_direct_shared(ino, offset, &shared).await;
        if matches!(result, Err(FsError::NoSpace | FsError::Quota))
            && matches!(self.reclaim_pending_frees().await, Ok(true))
        {
            result = self.direct().write_direct_shared(ino, offset, &shared).await;
        }
        (into_inner(shared), result)
    }

    /// Direct read into `buf`. Returns the buffer and the bytes read (short
    /// at end of file).
    pub async fn read_direct<B: IoBuffer>(self, ino: Ino, offset: FileOffset, buf: B) -> (B, FsResult<u32>) {
        let offset = offset.get();
        let shared = SharedBuffer::new(buf);
        let result = self.direct().read_direct_shared(ino, offset, &shared).await;
        (into_inner(shared), result)
    }
}

/// What the overwrite fast path did.
pub(super) enum InPlace {
    /// Wrote these bytes in place.
    Written(u32),
    /// Nothing: every block is written and inside the file, but some are
    /// shared (copy on write).
    Shared,
    /// Nothing: a block is a hole or unwritten, or the write passes the end.
    NotThere,
}

impl Direct<'_> {
    pub(super) fn direct_aligned<B: IoBuffer>(self, offset: u64, buf: &SharedBuffer<B>) -> bool {
        let align = self.inner.io.geometry().memory_alignment.max(512) as usize;
        offset.is_multiple_of(BLOCK_SIZE)
            && (buf.len() as u64).is_multiple_of(BLOCK_SIZE)
            && !buf.is_empty()
            && buf.iovecs().iter().all(|v| (v.base as usize).is_multiple_of(align) && v.len % 512 == 0)
    }

    pub(super) async fn write_direct_shared<B: IoBuffer>(
        self,
        ino: Ino,
        offset: u64,
        buf: &SharedBuffer<B>,
    ) -> FsResult<u32> {
        let len = buf.len() as u64;
        if len == 0 {
            return Ok(0);
        }
        let end = offset.checked_add(len).filter(|&e| e <= MAX_FILE_BYTES).ok_or(FsError::FileTooBig)?;
        self.inner.meta.require_file(ino)?;
        let (first, last) = blocks_of(offset, len);
        self.ops().flush_cache_range(ino, first, last, true).await?;
        self.inner.meta.move_direct_epoch(ino);
        let result = self.write_direct_uncached(ino, offset, end, buf).await;
        // A read that cached the range while the write ran may hold the
        // old data; the epoch keeps later fills out, this drops earlier ones.
        self.inner.meta.move_direct_epoch(ino);
        self.inner.pages.cache_mut().discard_clean_range(ino, first, last + 1);
        result
    }

    pub(super) async fn write_direct_uncached<B: IoBuffer>(
        self,
        ino: Ino,
        offset: u64,
        end: u64,
        buf: &SharedBuffer<B>,
    ) -> FsResult<u32> {
        if !self.direct_aligned(offset, buf) {
            return self.write_copied(ino, offset, buf).await;
        }
        match self.try_direct_overwrite(ino, offset, end, buf).await? {
            InPlace::Written(n) => return Ok(n),
            // Every block written and inside the file, some shared: copy
            // on write, without asking the extending path first.
            InPlace::Shared => return self.write_shared_aligned(ino, offset, end, buf).await,
            InPlace::NotThere => {}
        }
        match self.direct_extend(ino, offset, end, buf).await? {
            Some(n) => Ok(n),
            // Blocks another file shares: copy on write.
            None => self.write_shared_aligned(ino, offset, end, buf).await,
        }
    }

    /// An aligned direct write over blocks another file shares: the
    /// buffer goes as it is to new blocks for the shared ones (in place for
    /// the file's own), and the remap is logged once the data is on the
    /// device. No bounce copy and no edge read: every block is whole.
    async fn write_shared_aligned<B: IoBuffer>(
        self,
        ino: Ino,
        offset: u64,
        end: u64,
        buf: &SharedBuffer<B>,
    ) -> FsResult<u32> {
        debug_assert!(self.direct_aligned(offset, buf), "whole blocks only");
        let (first, last) = blocks_of(offset, end - offset);
        let (_range, old_size) = self.lock_to_write(ino, first, last, end).await?;
        let records = self.core().write_image_from(ino, first, buf, false).await?;
        self.image_written(ino, records, end, old_size)?;
        Ok((end - offset) as u32)
    }

    /// Lock blocks [first, last] of `ino` for a write ending at `end`, the
    /// bytes past the old end zeroed first when the write starts beyond
    /// its block. Returns the guard and the size before the write.
    async fn lock_to_write(
        self,
        ino: Ino,
        first: u64,
        last: u64,
        end: u64,
    ) -> FsResult<(crate::sync::RangeGuard, u64)> {
        let (range, old_size) = self.core().lock_for_write(ino, first, last, end).await?;
        if end > old_size && FileBlock::containing(old_size).get() < first {
            self.core().zero_past_eof(ino, old_size).await?;
        }
        Ok((range, old_size))
    }

    /// After a write of whole blocks through `write_image`: log what maps
    /// them, move the size to `end` and the times, and mark the file for
    /// fdatasync when blocks or the size changed.
    fn image_written(self, ino: Ino, records: Vec<Record<'_>>, end: u64, old_size: u64) -> FsResult<()> {
        let maps_blocks = !records.is_empty();
        self.core().log_all(records)?;
        self.inner.change().written(ino, Some(end))?;
        if maps_blocks || end > old_size {
            self.inner.meta.set_datasync_needed(ino);
        }
        Ok(())
    }

    /// The copying path for a direct write: unaligned, or over shared
    /// blocks.
    async fn write_copied<B: IoBuffer>(self, ino: Ino, offset: u64, buf: &SharedBuffer<B>) -> FsResult<u32> {
        let mut bytes = vec![0u8; buf.len()];
        buf.copy_out(0, &mut bytes).map_err(|_| FsError::Invalid("buffer busy"))?;
        self.write_uncached_copy(ino, offset, &bytes).await
    }

    /// The overwrite fast path: every block already written, inside the
    /// file and named by this file only. Shared lock, no allocation, no
    /// record.
    pub(super) async fn try_direct_overwrite<B: IoBuffer>(
        self,
        ino: Ino,
        offset: u64,
        end: u64,
        buf: &SharedBuffer<B>,
    ) -> FsResult<InPlace> {
        let (first, last) = blocks_of(offset, end - offset);
        // Past the size (even inside the last block) is an extending
        // write: it must move the size, which this path never does. The
        // size is checked before the lock too, so that appends never take
        // it here.
        let inside = || -> FsResult<bool> { Ok(end <= self.inner.meta.inode(ino)?.size) };
        if !inside()? {
            return Ok(InPlace::NotThere);
        }
        let _range =
            self.inner.data.lock(ino, FileBlock::new(first).offset(), FileBlock::new(last + 1).offset(), false).await;
        // The mapping is read once, under the lock, and the I/O is issued
        // from that same reading: no write can change it until the lock
        // is released.
        let segments = self.inner.meta.segments(ino, first, last - first + 1)?;
        let all_written = segments.iter().all(|s| matches!(s, Segment::Mapped(e) if !e.unwritten));
        if !all_written || !inside()? {
            return Ok(InPlace::NotThere);
        }
        if self.core().segments_share_blocks(&segments) {
            return Ok(InPlace::Shared);
        }
        let mapped = segments.iter().map(|s| match s {
            Segment::Mapped(e) => (e.file_block, e.disk_block, e.len),
            Segment::Hole { .. } => unreachable!("an overwrite of holes"),
        });
        let in_place = self.core().begin_in_place(buf, first, mapped, false).await?;
        if matches!(in_place, InPlaceStart::RegionsFull) {
            return Ok(InPlace::Shared); // too many regions open: copy on write
        }
        self.inner.data.direct_begin();
        let result = self.submit_segments(buf, first, &segments, true).await;
        self.inner.data.direct_end();
        self.core().finish_in_place(in_place, result.is_ok())?;
        result?;
        self.inner.journal.ring.borrow_mut().data_writes += 1;
        self.inner.change().written(ino, None)?;
        self.inner.data.count_direct_overwrite(end - offset);
        Ok(InPlace::Written((end - offset) as u32))
    }

    /// Issue device I/O for every segment: reads or writes of the mapped
    /// ones, zeros into the buffer for holes and unwritten ones (reads).
    pub(super) async fn submit_segments<B: IoBuffer>(
        self,
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
            let at = block_bytes(fb - FileBlock::new(first)) as usize;
            let Some(disk) = disk else {
                buf.zero(at, block_bytes(len) as usize).map_err(|_| FsError::Invalid("buffer busy"))?;
                continue;
            };
            let mut done = 0;
            while done < len {
                let n = (len - done).min(IO_BLOCKS_MAX);
                let slice = buf
                    .slice(at + block_bytes(done) as usize, block_bytes(n) as usize)
                    .map_err(|_| FsError::Invalid("buffer busy"))?;
                let pos = disk + done;
                let io = if write { self.inner.io.write(pos, n, slice) } else { self.inner.io.read(pos, n, slice) };
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
    /// None, having done nothing, if the range holds shared blocks.
    pub(super) async fn direct_extend<B: IoBuffer>(
        self,
        ino: Ino,
        offset: u64,
        end: u64,
        buf: &SharedBuffer<B>,
    ) -> FsResult<Option<u32>> {
        let (first, last) = blocks_of(offset, end - offset);
        let (_range, old_size) = self.core().lock_for_write(ino, first, last, end).await?;
        if self.core().range_shares_blocks(ino, first, last)? {
            return Ok(None);
        }
        if end > old_size && FileBlock::containing(old_size).get() < first {
            self.core().zero_past_eof(ino, old_size).await?;
        }
        let mut converted = Vec::new();
        for seg in self.inner.meta.segments(ino, first, last - first + 1)? {
            match seg {
                Segment::Mapped(e) if e.unwritten => converted.push((e.file_block, e.disk_block, e.len)),
                Segment::Mapped(_) => {}
                Segment::Hole { file_block, len } => {
                    converted.extend(self.core().map_hole_unwritten(ino, file_block, len)?)
                }
            }
        }
        if end > old_size {
            if let Some(n) = self.inner.meta.state_mut().node_mut(ino) {
                n.writes_mut().extends_in_flight.insert(offset, end);
            }
        }
        let segments = self.inner.meta.segments(ino, first, last - first + 1)?;
        self.inner.data.direct_begin();
        let result = async {
            let csums = self.core().new_block_checksums(buf, first, converted.iter().copied())?;
            self.submit_segments(buf, first, &segments, true).await.map(|()| csums)
        }
        .await;
        self.inner.data.direct_end();
        self.inner.journal.ring.borrow_mut().data_writes += 1;
        let new_size = self.finish_extend(ino, offset, end, result.is_ok());
        self.core().log_all(result?)?;
        for (fb, db, len) in converted {
            self.inner.change().log(Record::ExtentMap {
                ino,
                file_block: fb.get(),
                disk_block: db.get(),
                len,
                unwritten: false,
            })?;
        }
        self.inner.change().written(ino, Some(new_size))?;
        self.inner.meta.set_datasync_needed(ino);
        self.inner.data.count_direct_extend(end - offset);
        Ok(Some((end - offset) as u32))
    }

    /// Retire an extending write and return the size the file may now
    /// claim: the furthest completed end, but never past the start of an
    /// earlier extending write still in flight, so the size never covers
    /// data that is not on the device.
    pub(super) fn finish_extend(self, ino: Ino, offset: u64, end: u64, ok: bool) -> u64 {
        let mut state = self.inner.meta.state_mut();
        let Some(n) = state.node_mut(ino) else { return 0 };
        let size = n.inode.size;
        let w = n.writes_mut();
        w.extends_in_flight.remove(&offset);
        if ok {
            w.extends_done = w.extends_done.max(end);
        }
        let limit = w.extends_in_flight.keys().next().copied().unwrap_or(u64::MAX);
        w.extends_done.min(limit).max(size.min(end))
    }

    pub(super) async fn read_direct_shared<B: IoBuffer>(
        self,
        ino: Ino,
        offset: u64,
        buf: &SharedBuffer<B>,
    ) -> FsResult<u32> {
        self.inner.change().accessed(ino);
        let inode = self.inner.meta.require_file(ino)?;
        let len = buf.len() as u64;
        if offset >= inode.size || len == 0 {
            return Ok(0);
        }
        let (first, last) = blocks_of(offset, len);
        self.ops().flush_cache_range(ino, first, last, false).await?;
        if !self.direct_aligned(offset, buf) {
            let data = self.read_uncached_copy(ino, offset, len).await?;
            buf.copy_in(0, &data).map_err(|_| FsError::Invalid("buffer busy"))?;
            return Ok(data.len() as u32);
        }
        let _range =
            self.inner.data.lock(ino, FileBlock::new(first).offset(), FileBlock::new(last + 1).offset(), false).await;
        let size = self.inner.meta.inode(ino)?.size;
        let avail = len.min(size.saturating_sub(offset));
        if avail == 0 {
            return Ok(0);
        }
        let read_last = FileBlock::containing(offset + avail - 1).get();
        let segments = self.inner.meta.segments(ino, first, read_last - first + 1)?;
        self.core().prefetch_entries(&segments);
        self.submit_segments(buf, first, &segments, false).await?;
        self.core().verify_buffer(ino, buf, first, &segments).await?;
        // Never hand back what lies past the end of file.
        let tail_from = avail as usize;
        let tail_to = block_bytes(read_last - first + 1) as usize;
        if tail_to > tail_from {
            buf.zero(tail_from, tail_to - tail_from).map_err(|_| FsError::Invalid("buffer busy"))?;
        }
        self.inner.data.count_read(avail);
        Ok(avail as u32)
    }

    /// A direct write of unaligned bytes: read-modify-write of the edge
    /// blocks, bypassing the cache.
    pub(super) async fn write_uncached_copy(self, ino: Ino, offset: u64, data: &[u8]) -> FsResult<u32> {
        let end = offset + data.len() as u64;
        let (first, last) = blocks_of(offset, data.len() as u64);
        let (_range, old_size) = self.lock_to_write(ino, first, last, end).await?;
        let nblocks = last - first + 1;
        let mut image = AlignedBuf::zeroed(block_bytes(nblocks) as usize, BLOCK_BYTES);
        let head = offset_in_block(offset) as usize;
        if head != 0 {
            self.core().read_device_block(ino, first, &mut image[..BLOCK_BYTES]).await?;
        }
        if !end.is_multiple_of(BLOCK_SIZE) && (nblocks > 1 || head == 0) {
            let at = block_bytes(nblocks - 1) as usize;
            self.core().read_device_block(ino, last, &mut image[at..]).await?;
        }
        let image_start = FileBlock::new(first).offset();
        if old_size < image_start + image.len() as u64 {
            image[old_size.saturating_sub(image_start) as usize..].fill(0);
        }
        image[head..head + data.len()].copy_from_slice(data);
        let records = self.core().write_image(ino, first, image, false).await?;
        self.image_written(ino, records, end, old_size)?;
        Ok(data.len() as u32)
    }

    pub(super) async fn read_uncached_copy(self, ino: Ino, offset: u64, len: u64) -> FsResult<Vec<u8>> {
        let (first, last) = blocks_of(offset, len);
        let _range =
            self.inner.data.lock(ino, FileBlock::new(first).offset(), FileBlock::new(last + 1).offset(), false).await;
        let size = self.inner.meta.inode(ino)?.size;
        let end = (offset + len).min(size);
        if offset >= end {
            return Ok(Vec::new());
        }
        let mut out = vec![0u8; (end - offset) as usize];
        let mut block = vec![0u8; BLOCK_BYTES];
        for b in first..=FileBlock::containing(end - 1).get() {
            self.core().read_device_block(ino, b, &mut block).await?;
            let bs = FileBlock::new(b).offset();
            let from = offset.max(bs);
            let to = end.min(FileBlock::new(b + 1).offset());
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
