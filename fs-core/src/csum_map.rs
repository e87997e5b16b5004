//! The dirty-region map of an image with data checksums (issue 38, step
//! C5; docs/FORMAT.md "Data checksums"; docs/plans/data-checksums.md,
//! section 10), after dm-integrity's bitmap mode.
//!
//! An overwrite in place logs nothing: its crc goes into the table's
//! overlay in memory, and reaches the device with the next checkpoint's
//! write-back. Until then a crash may leave a block with new data and its
//! old entry. The map says where that can be: a bit per *region* (the
//! data one table block covers, 1016 blocks), set on the device before the
//! first overwrite in place there, and cleared after a checkpoint has
//! written the region's table block back with no overwrite in flight and
//! none begun there since the checkpoint before (a region still being
//! overwritten stays open: closing it would only cost a map write when the
//! next overwrite reopens it). A mount after a crash sets the entries of
//! every open region's written blocks from their data before it serves
//! anything.
//!
//! A map block is laid out as a table block (eight sectors, each with its
//! own crc) whose 1016 entries are words of 32 region bits. A sector that
//! fails its crc stands for all its regions open.

use std::collections::BTreeSet;

use crate::blocks::DevBlock;
use crate::csum_table::{TableBlock, TableCache};
use crate::format::{crc, csum_entry_blocks_for, BlockRun, Superblock, BLOCK_BYTES, CSUMS_PER_TABLE_BLOCK};
use crate::format::{CSUMS_PER_SECTOR, REGIONS_PER_MAP_BLOCK};
use crate::io::Io;
use crate::record::Record;
use crate::sync::AsyncMutex;
use crate::{FsInner, FsResult};
use keelfs_base::IdMap;
use keelfs_bdev::AlignedBuf;
use smallvec::SmallVec;
use std::cell::RefCell;
use std::rc::Rc;

const _: () = assert!(CSUMS_PER_SECTOR * 32 * 8 == REGIONS_PER_MAP_BLOCK, "a map sector's words hold its bits");

/// Regions open at once, at most, unless writeback needs more, by
/// default (`FsConfig::csum_open_regions_max`): the data that a mount
/// after a crash reads again (4 GiB). A direct overwrite past it copies
/// on write instead. Three quarters of it ask for a checkpoint, which then
/// closes every region it can, busy or idle.
pub(crate) const OPEN_REGIONS_MAX: usize = 1024;

/// The region of device block `block`: the number of the table block
/// that holds its entry.
pub(crate) fn region_of(block: u64) -> u64 {
    block / CSUMS_PER_TABLE_BLOCK
}

/// The regions device run `run` touches.
fn regions_of(run: BlockRun) -> std::ops::RangeInclusive<u64> {
    assert!(run.len > 0, "an empty run");
    region_of(run.start)..=region_of(run.end() - 1)
}

/// Regions or runs of one overwrite: a direct write of a few blocks
/// touches one or two, held without an allocation.
type Few<T> = SmallVec<[T; 2]>;

/// The regions runs `runs` touch, sorted, each once.
fn regions_of_runs(runs: &[BlockRun]) -> Few<u64> {
    let mut regions: Few<u64> = runs.iter().flat_map(|r| regions_of(*r)).collect();
    regions.sort_unstable();
    regions.dedup();
    regions
}

/// How an open region is being used: overwrites in flight there, and
/// when the last one began (the count of overwrites begun before it).
#[derive(Clone, Copy, Debug, Default)]
struct RegionUse {
    in_flight: u32,
    stamp: u64,
}

/// What is open, in memory.
#[derive(Default)]
pub(crate) struct RegionMap {
    map_start: u64,
    map_blocks: u64,
    /// Regions whose bit the next map write writes.
    wanted: BTreeSet<u64>,
    /// Regions whose bit is on the device and not being cleared: an
    /// overwrite there needs no map write. Always within `wanted`.
    durable: BTreeSet<u64>,
    /// The use of regions where an overwrite in place began since they
    /// were opened (an entry lives until its region closes).
    in_use: IdMap<RegionUse>,
    /// Overwrites in place in flight, by device block.
    blocks_in_flight: IdMap<u32>,
    /// Overwrites in place begun so far: the clock of `RegionUse::stamp`.
    begun: u64,
    /// `begun` at the last close pass ([`close_clean`]): a region where no
    /// overwrite has begun since is idle.
    last_pass: u64,
    /// Set when opening regions made a checkpoint due: the commit timer
    /// would ask only at its next tick, seconds away, while overwrites
    /// past the bound copy on write.
    checkpoint_asked: bool,
    /// On a read-only mount: the regions the map had open, sorted.
    tolerated: Vec<u64>,
    /// Regions that may be open at once (see [`OPEN_REGIONS_MAX`]).
    open_max: usize,
}

impl RegionMap {
    pub(crate) fn for_superblock(sb: &Superblock) -> Self {
        Self {
            map_start: sb.csum_map_start(),
            map_blocks: sb.csum_map_blocks(),
            open_max: OPEN_REGIONS_MAX,
            ..Self::default()
        }
    }

    pub(crate) fn set_open_max(&mut self, open_max: usize) {
        self.open_max = open_max.max(1);
    }

    /// Whether as many regions are open as may be.
    pub(crate) fn full(&self) -> bool {
        self.wanted.len() >= self.open_max
    }

    /// Whether so many regions are open that a checkpoint is due: three
    /// quarters of the bound. It then closes busy regions too, not only
    /// idle ones ([`RegionMap::to_close`]).
    pub(crate) fn checkpoint_due(&self) -> bool {
        self.wanted.len() >= self.due_at()
    }

    fn due_at(&self) -> usize {
        self.open_max - self.open_max / 4
    }

    /// Whether opening regions made a checkpoint due since the last call.
    pub(crate) fn take_checkpoint_asked(&mut self) -> bool {
        std::mem::take(&mut self.checkpoint_asked)
    }

    pub(crate) fn open_regions(&self) -> usize {
        self.wanted.len()
    }

    /// Whether device block `block` is being overwritten in place: a read
    /// of it may find the old data, the new or a mix, and is not checked.
    pub(crate) fn overwriting(&self, block: u64) -> bool {
        !self.blocks_in_flight.is_empty() && self.blocks_in_flight.contains_key(&block)
    }

    /// Whether device block `block` lies in a region open for overwrites
    /// in place.
    pub(crate) fn in_open_region(&self, block: u64) -> bool {
        !self.wanted.is_empty() && self.wanted.contains(&region_of(block))
    }

    /// Whether a read of device block `block` that fails its check is
    /// let through: its region was open at a crash, and this read-only
    /// mount could not settle it.
    pub(crate) fn tolerates(&self, block: u64) -> bool {
        !self.tolerated.is_empty() && self.tolerated.binary_search(&region_of(block)).is_ok()
    }

    fn begin(&mut self, regions: &[u64], runs: &[BlockRun]) {
        for r in regions {
            debug_assert!(self.durable.contains(r));
            let used = self.in_use.entry(*r).or_default();
            used.in_flight += 1;
            used.stamp = self.begun;
        }
        self.begun += 1;
        for run in runs {
            for b in run.start..run.end() {
                *self.blocks_in_flight.entry(b).or_default() += 1;
            }
        }
    }

    fn end(&mut self, regions: &[u64], runs: &[BlockRun]) {
        for r in regions {
            let used = self.in_use.get_mut(r).expect("an overwrite in flight ends once");
            used.in_flight -= 1;
        }
        for run in runs {
            for b in run.start..run.end() {
                let n = self.blocks_in_flight.get_mut(&b).expect("an overwrite in flight ends once");
                *n -= 1;
                if *n == 0 {
                    self.blocks_in_flight.remove(&b);
                }
            }
        }
    }

    /// The open regions a close pass closes, among those whose table
    /// block is clean (`clean`):
    /// - those idle since the last pass, with no overwrite begun there;
    /// - then, if as many would stay open as make a checkpoint due, the
    ///   least recently overwritten of the others until half the bound
    ///   is left, so that a region still being overwritten closes last;
    /// - with `everything` (an unmount), all of them.
    ///
    /// Never one with an overwrite in flight.
    fn to_close(&self, clean: impl Fn(u64) -> bool, everything: bool) -> Vec<u64> {
        let mut candidates: Vec<(u64, u64)> = self
            .wanted
            .iter()
            .filter(|&&r| clean(r))
            // Ordered by the last overwrite begun: 0 for none since the
            // region opened, the overwrite's stamp + 1 otherwise.
            .filter_map(|&r| match self.in_use.get(&r) {
                None => Some((0, r)),
                Some(u) => (u.in_flight == 0).then_some((u.stamp + 1, r)),
            })
            .collect();
        candidates.sort_unstable();
        let idle = candidates.partition_point(|&(last, _)| last <= self.last_pass);
        let count = if everything {
            candidates.len()
        } else if self.wanted.len() - idle >= self.due_at() {
            (self.wanted.len() - self.open_max / 2).clamp(idle, candidates.len())
        } else {
            idle
        };
        candidates[..count].iter().map(|&(_, r)| r).collect()
    }

    /// The map block holding region `region`'s bit, and where in it.
    fn position(region: u64) -> (u64, usize, u32) {
        let at = region % REGIONS_PER_MAP_BLOCK;
        (region / REGIONS_PER_MAP_BLOCK, (at / 32) as usize, (at % 32) as u32)
    }

    /// Map block `block` as `wanted` has it.
    fn encode(&self, block: u64) -> TableBlock {
        let first = block * REGIONS_PER_MAP_BLOCK;
        let mut words = TableBlock::zeroed();
        for &r in self.wanted.range(first..first + REGIONS_PER_MAP_BLOCK) {
            let (_, word, bit) = Self::position(r);
            words.or_entry(word, 1 << bit);
        }
        words
    }
}

/// An overwrite in place under way: what [`end_overwrite`] releases.
pub(crate) struct Overwrite {
    regions: Few<u64>,
    runs: Few<BlockRun>,
}

/// The device runs of one overwrite in place.
pub(crate) type OverwriteRuns = Few<BlockRun>;

/// Make device runs `runs` ready to be overwritten in place: their regions
/// open on the device, and the overwrite counted in flight (reads of its
/// blocks are not checked until [`end_overwrite`]). None, having done
/// nothing, when that would open more regions than may be and
/// `over_bound` is not given: the caller copies on write instead.
pub(crate) async fn begin_overwrite(
    cache: &RefCell<TableCache>,
    lock: &AsyncMutex,
    io: &Io,
    runs: OverwriteRuns,
    over_bound: bool,
) -> FsResult<Option<Overwrite>> {
    let regions = regions_of_runs(&runs);
    loop {
        {
            let mut cache = cache.borrow_mut();
            let map = &mut cache.map;
            if regions.iter().all(|r| map.durable.contains(r)) {
                map.begin(&regions, &runs);
                return Ok(Some(Overwrite { regions, runs }));
            }
            let opening = regions.iter().filter(|r| !map.wanted.contains(r)).count();
            if !over_bound && map.wanted.len() + opening > map.open_max {
                return Ok(None);
            }
            // Wanted before the wait: the map write of whoever holds the
            // writer next carries these bits too, so that the overwrites
            // that find their regions closed (after a checkpoint) share a
            // map write instead of queueing one each.
            let was_due = map.checkpoint_due();
            map.wanted.extend(regions.iter().copied());
            map.checkpoint_asked |= !was_due && map.checkpoint_due();
        }
        // One map write at a time, so that a later one never lands under
        // an earlier one.
        let _writer = lock.lock().await;
        let blocks: BTreeSet<u64> = {
            let mut cache = cache.borrow_mut();
            let map = &mut cache.map;
            // A checkpoint may have closed them meanwhile: wanted again.
            let missing: Vec<u64> = regions.iter().filter(|r| !map.durable.contains(r)).copied().collect();
            map.wanted.extend(missing.iter().copied());
            missing.iter().map(|&r| RegionMap::position(r).0).collect()
        };
        write_map_blocks(cache, io, &blocks).await?;
    }
}

/// The overwrite `ow` is done: when its data was written, `crcs` are the
/// entries of its blocks (little-endian, run after run), set in the
/// table's overlay (no record: the region's bit stands for them until a
/// checkpoint writes them back).
/// Returns the runs overwritten.
pub(crate) fn end_overwrite(cache: &RefCell<TableCache>, ow: Overwrite, crcs: Option<&[u8]>) -> OverwriteRuns {
    let mut cache = cache.borrow_mut();
    if let Some(crcs) = crcs {
        let blocks: u64 = ow.runs.iter().map(|r| r.len).sum();
        assert_eq!(crcs.len() as u64, blocks * 4, "an entry per block written");
        let mut at = 0;
        for run in &ow.runs {
            let bytes = run.len as usize * 4;
            cache.set(run.start, &crcs[at..at + bytes]).expect("an overwritten block lies in the data area");
            at += bytes;
        }
    }
    cache.map.end(&ow.regions, &ow.runs);
    ow.runs
}

/// Write map blocks `blocks` as memory wants them, and make them durable
/// (one flush after all the writes); then their regions' bits are on the
/// device. The caller holds the map's writer lock.
async fn write_map_blocks(cache: &RefCell<TableCache>, io: &Io, blocks: &BTreeSet<u64>) -> FsResult<()> {
    let mut written = Vec::with_capacity(blocks.len());
    for &block in blocks {
        let (at, words, regions) = {
            let cache = cache.borrow();
            let map = &cache.map;
            assert!(block < map.map_blocks, "map block {block} of {}", map.map_blocks);
            let first = block * REGIONS_PER_MAP_BLOCK;
            let regions: Vec<u64> = map.wanted.range(first..first + REGIONS_PER_MAP_BLOCK).copied().collect();
            (DevBlock::new(map.map_start + block), map.encode(block), regions)
        };
        let mut buf = AlignedBuf::zeroed(BLOCK_BYTES, BLOCK_BYTES);
        words.encode_into(&mut buf);
        io.write_blocks(at, buf).await?;
        written.push((block, regions));
    }
    if written.is_empty() {
        return Ok(());
    }
    io.flush().await?;
    let mut cache = cache.borrow_mut();
    let map = &mut cache.map;
    for (block, regions) in written {
        let first = block * REGIONS_PER_MAP_BLOCK;
        let stale: Vec<u64> = map.durable.range(first..first + REGIONS_PER_MAP_BLOCK).copied().collect();
        for r in stale {
            map.durable.remove(&r);
        }
        // A region cleared meanwhile stays cleared: only what is still
        // wanted is durable.
        map.durable.extend(regions.into_iter().filter(|r| map.wanted.contains(r)));
    }
    Ok(())
}

/// After a checkpoint wrote the table back: close the open regions
/// [`RegionMap::to_close`] picks among those whose table block is clean.
/// Their entries are all on the device now. `everything` at an unmount.
pub(crate) async fn close_clean(
    cache: &RefCell<TableCache>,
    lock: &AsyncMutex,
    io: &Io,
    everything: bool,
) -> FsResult<()> {
    let _writer = lock.lock().await;
    let blocks: BTreeSet<u64> = {
        let mut cache = cache.borrow_mut();
        let closing = cache.map.to_close(|r| !cache.is_dirty(r), everything);
        let map = &mut cache.map;
        for r in &closing {
            // Out of `durable` first: an overwrite from now on waits for
            // the lock and opens the region again.
            map.durable.remove(r);
            map.wanted.remove(r);
            map.in_use.remove(r);
        }
        map.last_pass = map.begun;
        closing.iter().map(|&r| RegionMap::position(r).0).collect()
    };
    write_map_blocks(cache, io, &blocks).await
}

/// The regions the map on the device has open (a sector that fails its
/// crc: all of its regions), in order. Reads the map a block at a time.
pub(crate) async fn read_open_regions(io: &Io, sb: &Superblock) -> FsResult<Vec<u64>> {
    let regions = csum_entry_blocks_for(sb.total_blocks);
    let mut open = Vec::new();
    for block in 0..sb.csum_map_blocks() {
        let words = TableBlock::decode(&io.read_blocks(DevBlock::new(sb.csum_map_start() + block), 1).await?);
        let first = block * REGIONS_PER_MAP_BLOCK;
        for word in 0..CSUMS_PER_TABLE_BLOCK as usize {
            // A bad sector's words read as None: every bit set.
            let bits = words.get(word).unwrap_or(u32::MAX);
            for bit in (0..32).filter(|b| bits & (1 << b) != 0) {
                let r = first + word as u64 * 32 + bit;
                if r < regions {
                    open.push(r);
                }
            }
        }
    }
    Ok(open)
}

/// Read-only mount: the regions a crash left open are tolerated, not
/// settled (nothing is written): a block there that fails its check is
/// read as it is, since its entry may be the one before an overwrite.
pub(crate) async fn tolerate_open(fs: &FsInner) -> FsResult<()> {
    let Some(table) = &fs.csums else { return Ok(()) };
    let sb = fs.journal.sb.borrow().clone();
    let open = read_open_regions(&fs.io, &sb).await?;
    if !open.is_empty() {
        tracing::warn!(parent: &fs.span, regions = open.len(),
            "data checksum regions open at a crash: their blocks are read unchecked on this read-only mount");
    }
    table.borrow_mut().map.tolerated = open;
    Ok(())
}

/// Writable mount: set the entries of every written block in the regions
/// a crash left open from the block's data (a `CsumSet` for each that
/// differs), commit them, and clear the map. Before anything is served.
pub(crate) async fn settle_open(fs: &Rc<FsInner>) -> FsResult<()> {
    let Some(table) = &fs.csums else { return Ok(()) };
    let sb = fs.journal.sb.borrow().clone();
    let open = read_open_regions(&fs.io, &sb).await?;
    if open.is_empty() {
        return Ok(());
    }
    let pieces = written_pieces_in(fs, &open);
    let mut settled = 0u64;
    for run in pieces {
        let data = fs.io.read_blocks(DevBlock::new(run.start), run.len as usize).await?;
        for (i, block) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            let at = run.start + i as u64;
            let want = crc(block);
            if crate::csum_table::entry(table, &fs.io, at).await? != Some(want) {
                fs.change().log(Record::CsumSet { first_block: at, crcs: want.to_le_bytes().to_vec().into() })?;
                settled += 1;
            }
        }
    }
    tracing::warn!(parent: &fs.span, regions = open.len(), settled,
        "data checksum regions open at a crash: entries set from the data of the blocks overwritten in place");
    crate::journal::commit_all(fs).await?;
    let _writer = fs.csum_map_writer.lock().await;
    let all: BTreeSet<u64> = (0..sb.csum_map_blocks()).collect();
    write_map_blocks(table, &fs.io, &all).await
}

/// Write every map block as memory has it, under the map's writer lock:
/// fsck --repair's mend of map sectors that fail their crc.
pub(crate) async fn rewrite_map(fs: &FsInner) -> FsResult<()> {
    let Some(table) = &fs.csums else { return Ok(()) };
    let _writer = fs.csum_map_writer.lock().await;
    let all: BTreeSet<u64> = (0..table.borrow().map.map_blocks).collect();
    write_map_blocks(table, &fs.io, &all).await
}

/// Every written device run of every file that lies in regions `open`
/// (sorted), cut to the regions and to reads of at most 256 blocks; a
/// shared run once per name.
fn written_pieces_in(fs: &FsInner, open: &[u64]) -> Vec<BlockRun> {
    let state = fs.meta.state();
    let mut out = Vec::new();
    for node in state.nodes() {
        for e in node.extents.iter().filter(|e| !e.unwritten) {
            let run = BlockRun { start: e.disk_block.get(), len: e.len };
            for r in regions_of(run).filter(|r| open.binary_search(r).is_ok()) {
                let start = run.start.max(r * CSUMS_PER_TABLE_BLOCK);
                let end = run.end().min((r + 1) * CSUMS_PER_TABLE_BLOCK);
                let mut at = start;
                while at < end {
                    let len = (end - at).min(SETTLE_READ_BLOCKS);
                    out.push(BlockRun { start: at, len });
                    at += len;
                }
            }
        }
    }
    out
}

/// Blocks read at once when settling.
const SETTLE_READ_BLOCKS: u64 = 256;
