//! Clones (issue 37, docs/plans/shared-extents.md, step S4): whole blocks
//! of one file made to name the device blocks of another's, with no data
//! copied. Either file's writes afterwards copy on write: `write_image`
//! and `zero_in_block` give shared blocks new ones, and the direct path's
//! in-place writers hand shared ranges to the copying path.

use super::DataOps;
use crate::blocks::{offset_in_block, FileBlock};
use crate::extent::Segment;
use crate::format::{BlockRun, FEATURE_SHARED_EXTENTS};
use crate::ids::Ino;
use crate::ops::MAX_FILE_BYTES;
use crate::record::Record;
use crate::{journal, FsError, FsResult};

/// Most blocks one clone maps (1 GiB): a FUSE copy_file_range reply counts
/// bytes in a u32, and the client loops on a short copy. Its cost is the
/// source's extents in the range, not its bytes.
pub(crate) const CLONE_BLOCKS_MAX: u64 = 1 << 18;

/// The block holding the end of a file of `size`, if it has bytes past
/// the end and lies before `start`: a clone to `start` must zero them.
fn tail_block(size: u64, start: FileBlock) -> Option<FileBlock> {
    let eof = FileBlock::containing(size);
    (offset_in_block(size) != 0 && eof < start).then_some(eof)
}

impl DataOps<'_> {
    /// Make `count` blocks of `to` from `to_block` name what `from`'s
    /// blocks from `from_block` name: written blocks are shared, holes and
    /// unwritten blocks become holes (a preallocation is not cloned). Only
    /// whole blocks inside `from`'s size (the caller copies a partial last
    /// block); `to` grows to cover them. Returns the blocks cloned.
    pub(super) async fn clone_blocks(
        self,
        from: Ino,
        from_block: FileBlock,
        to: Ino,
        to_block: FileBlock,
        count: u64,
    ) -> FsResult<u64> {
        let count = count.min(CLONE_BLOCKS_MAX);
        if count == 0 {
            return Ok(0);
        }
        if self.inner.config.read_only {
            return Err(FsError::ReadOnly);
        }
        self.inner.meta.require_file(from)?;
        self.inner.meta.require_file(to)?;
        let overlaps = from_block < to_block + count && to_block < from_block + count;
        if from == to && overlaps {
            return Err(FsError::Invalid("clone within overlapping ranges of one file"));
        }
        if (to_block + count).offset() > MAX_FILE_BYTES {
            return Err(FsError::FileTooBig);
        }
        self.enable_sharing().await?;
        // A clone shares what the device holds: the source's dirty pages
        // go there first. The destination's cached pages go: they will
        // name other blocks.
        self.flush_cache_range(from, from_block.get(), (from_block + count).get() - 1, false).await?;
        self.flush_cache_range(to, to_block.get(), (to_block + count).get() - 1, true).await?;
        let (_first, _second) = loop {
            // A clone that starts past the destination's last block grows
            // the file over the rest of that block: its bytes past the end
            // are zeroed first, under the same lock (found by the model
            // test: after a crash they read back as the old data).
            let to_start = tail_block(self.inner.meta.require_file(to)?.size, to_block).unwrap_or(to_block);
            // Both ranges exclusive, in one order (inode, then block), so
            // that two clones crossing each other cannot deadlock.
            let from_range = (from, from_block, from_block + count);
            let to_range = (to, to_start, to_block + count);
            let (a, b) = if from_range <= to_range { (from_range, to_range) } else { (to_range, from_range) };
            let first = self.inner.data.lock(a.0, a.1.offset(), a.2.offset(), true).await;
            let second = self.inner.data.lock(b.0, b.1.offset(), b.2.offset(), true).await;
            let size = self.inner.meta.require_file(to)?.size;
            match tail_block(size, to_block) {
                Some(tail) if tail < to_start => continue, // shrunk meanwhile: lock again
                Some(_) => self.core().zero_past_eof(to, size).await?,
                None => {}
            }
            break (first, second);
        };
        let source_blocks = FileBlock::containing(self.inner.meta.require_file(from)?.size);
        let count = count.min(source_blocks.get().saturating_sub(from_block.get()));
        if count == 0 {
            return Ok(0);
        }
        self.inner.meta.move_direct_epoch(to);
        let mapped = self.map_clone(from, from_block, to, to_block, count);
        self.inner.meta.move_direct_epoch(to);
        self.inner.pages.cache_mut().discard_clean_range(to, to_block.get(), (to_block + count).get());
        mapped?;
        self.inner.meta.set_datasync_needed(to);
        Ok(count)
    }

    /// The clone's records, logged with no await between them so that
    /// they are one operation in one transaction: the destination's range
    /// punched, then each written run of the source named again there.
    /// Each run gains its name as its record is applied.
    fn map_clone(self, from: Ino, from_block: FileBlock, to: Ino, to_block: FileBlock, count: u64) -> FsResult<()> {
        let segments = self.inner.meta.segments(from, from_block.get(), count)?;
        let change = self.inner.change();
        change.log(Record::ExtentPunch { ino: to, file_block: to_block.get(), len: count })?;
        for segment in segments {
            let Segment::Mapped(e) = segment else { continue };
            if e.unwritten {
                continue;
            }
            let file_block = to_block + (e.file_block - from_block);
            let disk_block = e.disk_block.get();
            change.log(Record::ExtentMap {
                ino: to,
                file_block: file_block.get(),
                disk_block,
                len: e.len,
                unwritten: false,
            })?;
            self.inner.space.free_mut().shared.share(BlockRun { start: disk_block, len: e.len });
        }
        change.written(to, Some((to_block + count).offset()))
    }

    /// Before the first clone: feature bit 1 reaches the superblock, by a
    /// checkpoint (written and flushed), before any record that shares a
    /// block. A keelfsd without shared extents then refuses the image
    /// rather than taking a shared block for damage.
    async fn enable_sharing(self) -> FsResult<()> {
        let journal = &self.inner.journal;
        if journal.sb.borrow().features & FEATURE_SHARED_EXTENTS != 0 {
            return Ok(());
        }
        journal.features_on.set(journal.features_on.get() | FEATURE_SHARED_EXTENTS);
        journal::checkpoint(self.inner).await?;
        if journal.sb.borrow().features & FEATURE_SHARED_EXTENTS == 0 {
            return Err(FsError::Corrupt("the checkpoint did not record shared extents".into()));
        }
        tracing::info!(parent: &self.inner.span, "shared extents on: keelfs before issue 37 no longer mounts this image");
        Ok(())
    }
}
