//! Room for data: the allocator and the runs freed since the last commit
//! ([`FreeSpace`]), the quota, the blocks promised but not yet mapped, and
//! the frees a checkpoint in pieces holds back. (Not `data::space`, which
//! is fallocate, truncate and lseek.)
//!
//! The other parts' figures arrive as a [`Usage`] of plain numbers, so
//! that this part borrows nothing of another. The metadata state applies
//! records against a `&mut FreeSpace` lent to it ([`State::apply`]): an
//! extent a record maps is claimed, and one it unmaps is freed.
//!
//! Borrows of the free space are short, as the state's are: none is held
//! across an await or a call into another part.
//!
//! Three amounts are promised and not yet visible in the allocator's free
//! count: `delalloc_reserved` (dirty cached pages over holes, which
//! writeback will allocate), `reserved_unmapped` (blocks allocated for
//! data whose extent record is not logged yet) and `held` (runs freed by
//! commits while a checkpoint is encoded in pieces).

use std::cell::{Cell, Ref, RefCell, RefMut};

use crate::alloc::AllocError;
use crate::alloc::Allocator;
use crate::discard::Discard;
use crate::format::{BlockRun, CHECKPOINT_EXTENTS_MAX};
use crate::quota::Quota;
use crate::shared_runs::SharedRuns;
use crate::{FsError, FsResult};

/// The blocks of the data area that belong to no file: the allocator's
/// free index, and the runs freed by changes not yet committed.
pub(crate) struct FreeSpace {
    pub alloc: Allocator,
    /// Runs freed by changes not yet committed: reusable only after the
    /// commit, or a crash could leave the old owner pointing at new data.
    pub pending_free: Vec<BlockRun>,
    /// Blocks named by more than one extent: a release frees only what
    /// loses its last name.
    pub shared: SharedRuns,
    /// The image may share blocks (`FEATURE_SHARED_EXTENTS`): loading
    /// counts a second name of a written run instead of refusing it.
    pub sharing_allowed: bool,
}

impl FreeSpace {
    pub fn new(alloc: Allocator) -> Self {
        Self { alloc, pending_free: Vec::new(), shared: SharedRuns::default(), sharing_allowed: false }
    }

    /// Take `run` for an extent being loaded. A block in use already is a
    /// double claim, unless the image may share blocks and the extent is
    /// written: then it gains a name. (What else may hold it, a checkpoint
    /// or an unwritten extent, is checked once everything is loaded:
    /// `Rebuilt::check_sharing`.)
    pub fn claim_for_extent(&mut self, run: BlockRun, unwritten: bool) -> Result<(), AllocError> {
        if !self.sharing_allowed || unwritten || !self.alloc.contains(run) {
            return self.alloc.claim(run);
        }
        let mut at = run.start;
        for free in self.alloc.free_within(run) {
            if free.start > at {
                self.shared.share(BlockRun { start: at, len: free.start - at });
            }
            self.alloc.claim(free)?;
            at = free.end();
        }
        if at < run.end() {
            self.shared.share(BlockRun { start: at, len: run.end() - at });
        }
        Ok(())
    }

    /// The allocator's own invariants, and every run awaiting its commit
    /// non-empty and inside the data area. (That no block has two owners
    /// is `Inspect::check_block_ownership`, which sees every part.)
    pub fn check_invariants(&self) {
        self.alloc.check_invariants();
        self.shared.check_invariants();
        for run in &self.pending_free {
            assert!(
                run.len > 0 && self.alloc.contains(*run),
                "a pending free [{}, +{}) outside the data area",
                run.start,
                run.len
            );
        }
    }
}

/// `blocks` in at most `runs_max` runs, each the first free one (from the
/// preferred group on), or none.
fn first_fit(alloc: &mut Allocator, mut blocks: u64, preferred_group: usize, runs_max: usize) -> Option<Vec<BlockRun>> {
    let mut runs = Vec::new();
    while blocks > 0 {
        match alloc.alloc(blocks, None, preferred_group) {
            Some(run) if runs.len() < runs_max => {
                blocks -= run.len;
                runs.push(run);
            }
            other => {
                runs.extend(other);
                for r in runs {
                    alloc.free(r);
                }
                return None;
            }
        }
    }
    Some(runs)
}

/// `blocks` in at most `runs_max` runs, or none: each run at least the
/// share of what is left that the runs left must hold, so that they
/// always suffice (found by a snapshot of a million files: a checkpoint
/// on free space a copy-on-write run had cut up needed more than 128
/// first-fit runs, and its delete failed with ENOSPC). When no free run
/// is that long, no choice of the runs left could hold the rest.
fn long_runs(alloc: &mut Allocator, mut blocks: u64, runs_max: usize) -> Option<Vec<BlockRun>> {
    let mut runs: Vec<BlockRun> = Vec::new();
    while blocks > 0 && runs.len() < runs_max {
        let least = blocks.div_ceil((runs_max - runs.len()) as u64);
        let Some(found) = alloc.next_free_run(0, least) else { break };
        let run = BlockRun { start: found.start, len: found.len.min(blocks) };
        alloc.claim(run).expect("a run the free index just listed is free");
        blocks -= run.len;
        runs.push(run);
    }
    if blocks > 0 {
        for r in runs {
            alloc.free(r);
        }
        return None;
    }
    Some(runs)
}

/// The smallest checkpoint reserve: 1 MiB.
const CHECKPOINT_RESERVE_MIN_BLOCKS: u64 = 256;

pub(crate) struct Space {
    free: RefCell<FreeSpace>,
    /// The quota now (FsConfig's at mount, then [`crate::Admin::set_quota`]'s).
    quota: Cell<Quota>,
    /// Blocks promised to dirty cached pages over holes (delayed
    /// allocation): writeback will need them, so nothing else may take them.
    delalloc_reserved: Cell<u64>,
    /// Blocks handed out for data not yet mapped by a record.
    reserved_unmapped: Cell<u64>,
    /// While a checkpoint is encoded in pieces: runs freed by commits
    /// since its start, held back from the allocator until a checkpoint
    /// lands, because its snapshot (the state at its start) may still give
    /// them to a file and its own blocks are allocated at the end.
    held: RefCell<Vec<BlockRun>>,
}

/// What the room for data depends on outside this part, read at one
/// moment: the live checkpoint's size and the blocks out of the allocator
/// for a discard. (The allocator's counts are this part's own.)
#[derive(Clone, Copy)]
pub(crate) struct Usage {
    pub checkpoint_blocks: u64,
    pub discarding: u64,
}

/// What [`Space::check_invariants`] compares against, read from the other
/// parts at one moment.
pub(crate) struct SpaceWitness {
    /// Pages in the cache that hold a block reservation.
    pub reserved_pages: u64,
    /// No writeback, range lock or direct write is in flight, so every
    /// allocation made for data has been mapped or given back.
    pub data_idle: bool,
    /// A checkpoint is being written in pieces, or a commit runs.
    pub journal_busy: bool,
}

impl Space {
    /// Check the promised and held blocks against the other parts
    /// (tests and fuzzers, between operations). While data is idle, the
    /// blocks promised to dirty pages are exactly the cached pages' own
    /// reservations, and none are allocated but unmapped; while no
    /// checkpoint is written in pieces and no commit runs, no free is held
    /// back. Panics on the first that does not hold.
    pub fn check_invariants(&self, seen: &SpaceWitness) {
        self.free.borrow().check_invariants();
        if seen.data_idle {
            assert_eq!(self.delalloc_reserved.get(), seen.reserved_pages, "blocks promised to dirty pages");
            assert_eq!(self.reserved_unmapped.get(), 0, "blocks allocated but never mapped");
        }
        if !seen.journal_busy {
            assert!(self.held.borrow().is_empty(), "frees held back with no checkpoint in pieces");
        }
    }

    pub fn new(quota: Quota, free: FreeSpace) -> Self {
        Self {
            free: RefCell::new(free),
            quota: Cell::new(quota),
            delalloc_reserved: Cell::new(0),
            reserved_unmapped: Cell::new(0),
            held: RefCell::default(),
        }
    }

    pub fn free(&self) -> Ref<'_, FreeSpace> {
        self.free.borrow()
    }

    pub fn free_mut(&self) -> RefMut<'_, FreeSpace> {
        self.free.borrow_mut()
    }

    pub fn quota(&self) -> Quota {
        self.quota.get()
    }

    pub fn set_quota(&self, quota: Quota) {
        self.quota.set(quota);
    }

    /// Blocks data may not take: room for the next checkpoint, which must
    /// be writable even when data has filled the device, because a
    /// transaction too large for the journal ring commits as a checkpoint,
    /// and that commit is what releases the blocks freed since the last
    /// one (and unmount always checkpoints). Twice the current checkpoint,
    /// for growth, and at least 1 MiB.
    fn checkpoint_reserve(checkpoint_blocks: u64) -> u64 {
        (2 * checkpoint_blocks).max(CHECKPOINT_RESERVE_MIN_BLOCKS)
    }

    /// Blocks free for data on the device, quota aside.
    pub fn device_available_blocks(&self, u: Usage) -> u64 {
        let free = self.free.borrow().alloc.free_blocks();
        free.saturating_sub(self.delalloc_reserved.get()).saturating_sub(Self::checkpoint_reserve(u.checkpoint_blocks))
    }

    /// Blocks the quota sees in use: everything the allocator has handed
    /// out (frees not yet committed included, which is why EDQUOT first
    /// commits and retries), plus space promised to dirty pages, less
    /// blocks out of the allocator only to be discarded (free on disk).
    fn quota_used_blocks(&self, u: Usage) -> u64 {
        let allocated = {
            let free = self.free.borrow();
            free.alloc.total_blocks() - free.alloc.free_blocks()
        };
        let promised = self.delalloc_reserved.get();
        (allocated + promised).saturating_sub(u.discarding)
    }

    /// Blocks the quota still allows, if there is one.
    fn quota_room_blocks(&self, u: Usage) -> Option<u64> {
        let limit = self.quota.get().blocks()?;
        Some(limit.saturating_sub(self.quota_used_blocks(u)))
    }

    /// Room for `blocks` more blocks of data: ENOSPC when the device is
    /// what binds, EDQUOT when the quota is.
    pub fn check_room(&self, u: Usage, blocks: u64) -> FsResult<()> {
        let device = self.device_available_blocks(u);
        match self.quota_room_blocks(u) {
            Some(room) if room < blocks && room <= device => Err(FsError::Quota),
            _ if device < blocks => Err(FsError::NoSpace),
            _ => Ok(()),
        }
    }

    /// The inode limit df shows: the device's (`inodes_max`), capped by
    /// the quota.
    pub fn inodes_limit(&self, inodes_max: u64) -> u64 {
        self.quota.get().inodes.map_or(inodes_max, |q| q.min(inodes_max))
    }

    /// Room for one more inode beside `count`: ENOSPC past the device's
    /// limit, EDQUOT past the quota.
    pub fn check_inode_room(&self, count: u64, inodes_max: u64) -> FsResult<()> {
        let quota = self.quota.get().inodes.unwrap_or(u64::MAX);
        if count >= quota && quota <= inodes_max {
            Err(FsError::Quota)
        } else if count >= inodes_max {
            Err(FsError::NoSpace)
        } else {
            Ok(())
        }
    }

    /// The filesystem's size as df shows it: the data area, or the quota
    /// if smaller.
    pub fn blocks_limit(&self) -> u64 {
        let total = self.free.borrow().alloc.total_blocks();
        self.quota.get().blocks().map_or(total, |q| q.min(total))
    }

    /// Blocks free as df shows them: those awaiting a discard are free
    /// (a writer that needs them takes them back, [`Discard::reclaim`]).
    pub fn shown_free_blocks(&self, u: Usage) -> u64 {
        let device = self.device_available_blocks(u) + u.discarding;
        self.quota_room_blocks(u).map_or(device, |room| room.min(device))
    }

    /// Blocks free for new data: the device's, capped by the quota's room.
    pub fn available_blocks(&self, u: Usage) -> u64 {
        let device = self.device_available_blocks(u);
        self.quota_room_blocks(u).map_or(device, |room| room.min(device))
    }

    /// Promise `blocks` to dirty pages over holes, if there is room.
    pub fn reserve_delalloc(&self, u: Usage, blocks: u64) -> FsResult<()> {
        if blocks == 0 {
            return Ok(());
        }
        self.check_room(u, blocks)?;
        self.delalloc_reserved.set(self.delalloc_reserved.get() + blocks);
        Ok(())
    }

    /// Give back a promise to dirty pages (written back, dropped or never
    /// applied).
    pub fn release_delalloc(&self, blocks: u64) {
        self.delalloc_reserved.set(self.delalloc_reserved.get().saturating_sub(blocks));
    }

    /// `count` blocks from the allocator, after `hint` where free (extent
    /// merging), reserved until their extent record is logged
    /// ([`Self::unreserve`]). No room check: the caller made it, or is
    /// writeback spending a promise.
    pub fn alloc_runs(&self, mut hint: Option<u64>, count: u64, preferred_group: usize) -> FsResult<Vec<BlockRun>> {
        let free = &mut *self.free.borrow_mut();
        let mut runs = Vec::new();
        let mut left = count;
        while left > 0 {
            match free.alloc.alloc(left, hint, preferred_group) {
                Some(run) => {
                    left -= run.len;
                    hint = Some(run.end());
                    runs.push(run);
                }
                None => {
                    for r in runs {
                        free.alloc.free(r);
                    }
                    return Err(FsError::NoSpace);
                }
            }
        }
        self.reserved_unmapped.set(self.reserved_unmapped.get() + count);
        Ok(runs)
    }

    /// Runs from [`Self::alloc_runs`] are mapped now, or (`back_to_free`)
    /// were not used and go back to the allocator.
    pub fn unreserve(&self, runs: &[BlockRun], back_to_free: bool) {
        let total: u64 = runs.iter().map(|r| r.len).sum();
        self.reserved_unmapped.set(self.reserved_unmapped.get() - total);
        if back_to_free {
            let mut free = self.free.borrow_mut();
            for r in runs {
                free.alloc.free(*r);
            }
        }
    }

    /// Allocate room for a checkpoint of `blocks` blocks in at most
    /// CHECKPOINT_EXTENTS_MAX runs.
    pub fn alloc_checkpoint(&self, blocks: u64, preferred_group: usize) -> FsResult<Vec<BlockRun>> {
        self.alloc_in_runs(blocks, preferred_group, CHECKPOINT_EXTENTS_MAX)
    }

    /// `blocks` in at most `runs_max` runs, or none and ENOSPC. First fit
    /// in the preferred group first; when free space is so cut up that
    /// the first runs would need more than `runs_max`, long runs only.
    pub fn alloc_in_runs(&self, blocks: u64, preferred_group: usize, runs_max: usize) -> FsResult<Vec<BlockRun>> {
        let free = &mut *self.free.borrow_mut();
        if let Some(runs) = first_fit(&mut free.alloc, blocks, preferred_group, runs_max) {
            return Ok(runs);
        }
        long_runs(&mut free.alloc, blocks, runs_max).ok_or(FsError::NoSpace)
    }

    /// The runs freed since the last commit, for the commit that frees
    /// them on disk.
    pub fn take_uncommitted_frees(&self) -> Vec<BlockRun> {
        std::mem::take(&mut self.free.borrow_mut().pending_free)
    }

    /// Whether runs were freed since the last commit took its frees.
    pub fn has_uncommitted_frees(&self) -> bool {
        !self.free.borrow().pending_free.is_empty()
    }

    /// Runs a failed commit took: still freed only in memory.
    pub fn give_back_uncommitted_frees(&self, runs: Vec<BlockRun>) {
        self.free.borrow_mut().pending_free.extend(runs);
    }

    /// The free count a commit records: free now, plus what it frees
    /// (`freed`), plus what is free on disk but out of the allocator (held
    /// for a checkpoint, awaiting a discard, allocated but not mapped),
    /// plus the checkpoint's own blocks where the format counts them.
    pub fn free_after_commit(&self, freed: u64, discarding: u64, checkpoint: u64) -> u64 {
        let held: u64 = self.held.borrow().iter().map(|r| r.len).sum::<u64>() + discarding;
        self.free.borrow().alloc.free_blocks() + freed + held + self.reserved_unmapped.get() + checkpoint
    }

    /// A run a commit made free, in the one place that chooses where it
    /// goes: held while a checkpoint is encoded in pieces (`sliced`), else
    /// to the discard queue if continuous discard is on and the filesystem
    /// is mounted, else back to the allocator.
    pub fn release_committed(&self, run: BlockRun, sliced: bool, discard: &Discard, unmounted: bool) {
        if sliced {
            self.held.borrow_mut().push(run);
        } else {
            discard.release_freed(&mut self.free.borrow_mut(), run, unmounted);
        }
    }

    /// Frees held for a checkpoint in pieces go on once none is in
    /// progress (it landed, failed or was replaced).
    pub fn release_held_frees(&self, discard: &Discard, unmounted: bool) {
        // Not sliced, so release_committed leaves `held` alone.
        let mut held = self.held.borrow_mut();
        for run in held.drain(..) {
            self.release_committed(run, false, discard, unmounted);
        }
    }

    /// Every run held for a checkpoint (for ownership checks).
    pub fn held_runs(&self) -> Vec<BlockRun> {
        self.held.borrow().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Free space cut into 1-block holes before one long free run: first
    /// fit would need a run per hole.
    fn cut_up() -> Allocator {
        let mut alloc = Allocator::new(100, 10_100, 1);
        for b in (100..2100).step_by(2) {
            alloc.claim(BlockRun { start: b, len: 1 }).unwrap();
        }
        alloc
    }

    #[test]
    fn a_checkpoint_fits_cut_up_free_space_in_long_runs() {
        let space = Space::new(Quota::default(), FreeSpace::new(cut_up()));
        let free_before = space.free().alloc.free_blocks();
        let runs = space.alloc_in_runs(3000, 0, 16).expect("room in long runs");
        assert!(runs.len() <= 16, "{} runs", runs.len());
        assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), 3000);
        assert!(runs.iter().all(|r| r.len >= 3000 / 16), "only long runs: {runs:?}");
        assert_eq!(space.free().alloc.free_blocks(), free_before - 3000);
        // More than the long runs hold: nothing is taken.
        assert!(matches!(space.alloc_in_runs(6000, 0, 4), Err(FsError::NoSpace)));
        assert_eq!(space.free().alloc.free_blocks(), free_before - 3000);
        space.free().alloc.check_invariants();
    }

    #[test]
    fn first_fit_stays_first_when_it_fits() {
        let space = Space::new(Quota::default(), FreeSpace::new(cut_up()));
        // Few enough holes for the runs allowed: the first ones are taken.
        let runs = space.alloc_in_runs(3, 0, 16).unwrap();
        assert_eq!(runs, [101, 103, 105].map(|start| BlockRun { start, len: 1 }));
    }
}
