//! Size changes, preallocation and seeking.

use super::blocks_of;
use super::{DataCore, DataOps};
use crate::blocks::{offset_in_block, FileBlock};
use crate::cache::PAGE_BYTES;
use crate::extent::Segment;
use crate::format::{BLOCK_BYTES, BLOCK_SIZE};
use crate::ids::{FileOffset, Ino};
use crate::ops::{SeekTo, MAX_FILE_BYTES};
use crate::record::Record;
use crate::{FsError, FsResult};

use crate::flags::FallocateMode;

impl DataOps<'_> {
    /// Set the size. Shrinking frees whole blocks past the new end in one
    /// transaction; the bytes left past the end in the last partial block
    /// are zeroed only when the file grows over them again, so a crash
    /// before the shrink commits cannot destroy data still in the file.
    pub(crate) async fn truncate(self, ino: Ino, new_size: u64) -> FsResult<()> {
        if new_size > MAX_FILE_BYTES {
            return Err(FsError::FileTooBig);
        }
        let old = self.inner.meta.require_file(ino)?.size;
        let from = FileBlock::containing(old.min(new_size)).offset();
        let _range = self.inner.data.lock(ino, from, u64::MAX, true).await;
        let keep_blocks = FileBlock::starting_at_or_after(new_size).get();
        // Shrinking drops pages, zeroes the new last page's tail, then sets
        // the size: readers on other cores see all of it or none.
        let change = (new_size < old).then(|| self.inner.pages.shared().change(ino));
        if new_size < old {
            let released = self.inner.pages.cache_mut().discard(ino, keep_blocks);
            self.inner.space.release_delalloc(released);
            self.inner.pages.cache_mut().zero(
                (ino, FileBlock::containing(new_size).get()),
                offset_in_block(new_size) as usize,
                PAGE_BYTES,
            );
            self.inner.change().log(Record::ExtentPunch {
                ino,
                file_block: keep_blocks,
                len: u64::MAX - keep_blocks,
            })?;
        } else {
            self.core().zero_past_eof(ino, old).await?;
        }
        let t = self.inner.change().file_time();
        self.inner.change().update_inode(ino, |i| {
            i.size = new_size;
            i.mtime = t;
            i.ctime = t;
        })?;
        drop(change);
        if let Some(n) = self.inner.meta.state_mut().node_mut(ino) {
            if let Some(w) = n.writes_if_any() {
                w.persist_size_cap = w.persist_size_cap.map(|c| c.min(new_size));
                // An extending write that finished before the truncate must
                // not give the file its old size back when the next one
                // finishes.
                w.extends_done = w.extends_done.min(new_size);
            }
            n.datasync_needed = true;
        }
        Ok(())
    }

    pub async fn fallocate(self, ino: Ino, mode: FallocateMode, offset: FileOffset, len: u64) -> FsResult<()> {
        let offset = offset.get();
        if self.inner.config.read_only {
            return Err(FsError::ReadOnly);
        }
        match self.core().fallocate_once(ino, mode, offset, len).await {
            Err(FsError::NoSpace | FsError::Quota) if self.reclaim_pending_frees().await? => {
                self.core().fallocate_once(ino, mode, offset, len).await
            }
            other => other,
        }
    }

    /// SEEK_DATA / SEEK_HOLE. Unwritten extents count as holes; dirty
    /// cached pages count as data.
    pub async fn lseek(self, ino: Ino, offset: FileOffset, to: SeekTo) -> FsResult<FileOffset> {
        let offset = offset.get();
        let inode = self.inner.meta.require_file(ino)?;
        if offset >= inode.size {
            return Err(FsError::Nxio);
        }
        self.writeback(ino, 0, u64::MAX).await?;
        let first = FileBlock::containing(offset);
        let blocks = FileBlock::starting_at_or_after(inode.size) - first;
        for seg in self.inner.meta.segments(ino, first.get(), blocks)? {
            let (fb, is_data) = match seg {
                Segment::Mapped(e) => (e.file_block, !e.unwritten),
                Segment::Hole { file_block, .. } => (file_block, false),
            };
            if is_data == (to == SeekTo::Data) {
                return Ok(FileOffset::new(fb.offset().max(offset)));
            }
        }
        if to == SeekTo::Hole {
            Ok(FileOffset::new(inode.size))
        } else {
            Err(FsError::Nxio)
        }
    }
}

impl DataCore<'_> {
    pub(super) async fn fallocate_once(self, ino: Ino, mode: FallocateMode, offset: u64, len: u64) -> FsResult<()> {
        if len == 0 {
            return Err(FsError::Invalid("fallocate of zero bytes"));
        }
        let end = offset.checked_add(len).filter(|&e| e <= MAX_FILE_BYTES).ok_or(FsError::FileTooBig)?;
        self.inner.meta.require_file(ino)?;
        let punch = mode == FallocateMode::PunchHole;
        let zero = matches!(mode, FallocateMode::ZeroRange { .. });
        let (first, last) = blocks_of(offset, len);
        // Dirty cached data in the range must reach the device first, so
        // that clearing below is not undone by a later writeback.
        self.ops().flush_cache_range(ino, first, last, false).await?;
        let range_lock =
            self.inner.data.lock(ino, FileBlock::new(first).offset(), FileBlock::new(last + 1).offset(), true);
        let _range = range_lock.await;
        if punch || zero {
            self.clear_range(ino, offset, end).await?;
        }
        let old_size = self.inner.meta.inode(ino)?.size;
        let keep = mode.keeps_size();
        if !keep && end > old_size {
            self.zero_past_eof(ino, old_size).await?;
        }
        if !punch {
            self.allocate_unwritten(ino, FileBlock::containing(offset), FileBlock::starting_at_or_after(end))?;
        }
        let t = self.inner.change().file_time();
        self.inner.change().update_inode(ino, |i| {
            if !keep {
                i.size = i.size.max(end);
            }
            if punch || zero {
                i.mtime = t;
            }
            i.ctime = t;
        })?;
        self.inner.meta.set_datasync_needed(ino);
        Ok(())
    }

    /// Make [offset, end) read as zeros: unmap whole blocks, zero edges,
    /// on the device and in the cache.
    pub(super) async fn clear_range(self, ino: Ino, offset: u64, end: u64) -> FsResult<()> {
        let first_whole = FileBlock::starting_at_or_after(offset);
        let end_whole = FileBlock::containing(end);
        if first_whole < end_whole {
            let len = end_whole - first_whole;
            self.inner.change().log(Record::ExtentPunch { ino, file_block: first_whole.get(), len })?;
        }
        {
            let _change = self.inner.pages.shared().change(ino);
            self.inner.pages.cache_mut().zero_range(ino, offset, end);
        }
        let head_block = FileBlock::containing(offset);
        let tail_block = FileBlock::containing(end - 1);
        if !offset.is_multiple_of(BLOCK_SIZE) || (head_block == tail_block && !end.is_multiple_of(BLOCK_SIZE)) {
            let to = if head_block == tail_block { (end - head_block.offset()) as usize } else { BLOCK_BYTES };
            self.zero_in_block(ino, head_block, offset_in_block(offset) as usize, to).await?;
        }
        if tail_block != head_block && !end.is_multiple_of(BLOCK_SIZE) {
            self.zero_in_block(ino, tail_block, 0, offset_in_block(end) as usize).await?;
        }
        Ok(())
    }

    /// Back the holes in file blocks [first, end) with unwritten extents:
    /// space is reserved and reads still return zeros, with no data I/O.
    pub(super) fn allocate_unwritten(self, ino: Ino, first: FileBlock, end: FileBlock) -> FsResult<()> {
        let holes: Vec<(FileBlock, u64)> = self
            .inner
            .meta
            .segments(ino, first.get(), end - first)?
            .into_iter()
            .filter_map(|s| match s {
                Segment::Hole { file_block, len } => Some((file_block, len)),
                Segment::Mapped(_) => None,
            })
            .collect();
        for (fb, len) in holes {
            self.map_hole_unwritten(ino, fb, len)?;
        }
        Ok(())
    }
}
