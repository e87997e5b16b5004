//! What tests, benchmarks and the daemon's stats read of a mounted
//! filesystem: counters, geometry, the superblock, free space, and the
//! consistency checks that tests and fuzzers run between operations.

use std::collections::BTreeMap;
use std::rc::Rc;

use crate::format::BlockRun;
use crate::space::SpaceWitness;
use crate::{cache, BlockClaim, DoubleOwner, Fs, FsCounters, FsInner, FsResult, Geometry, Ino, Superblock};

/// Reading a filesystem's figures, reached through [`Fs::inspect`]: a
/// `Copy` borrow made per call, so that these do not crowd the
/// filesystem's own operations (issue 35). Nothing here changes the
/// filesystem but [`Inspect::debug_set_nlink`], which tests use to damage
/// an image on purpose, and the benchmarks' file-times switch.
#[derive(Clone, Copy)]
pub struct Inspect<'a> {
    inner: &'a Rc<FsInner>,
}

impl Fs {
    /// The filesystem's figures and consistency checks.
    pub fn inspect(&self) -> Inspect<'_> {
        Inspect { inner: &self.inner }
    }
}

impl Inspect<'_> {
    pub fn geometry(self) -> Geometry {
        self.inner.io.geometry()
    }

    pub fn counters(self) -> FsCounters {
        let mut c = FsCounters { device_flushes: self.inner.io.flushes(), ..FsCounters::default() };
        self.inner.journal.report(&mut c);
        self.inner.data.report(&mut c);
        self.inner.discard.report(&mut c);
        c.data_checksum_errors = self.inner.csums.as_ref().map_or(0, |t| t.borrow().mismatches());
        c.data_regions_open = self.inner.csums.as_ref().map_or(0, |t| t.borrow().map.open_regions() as u64);
        c
    }

    /// Benchmarks only: stop (or resume) setting mtime and ctime on data
    /// writes, to measure what their upkeep costs. keelfsd never turns it
    /// off.
    pub fn set_file_times_for_benchmark(self, on: bool) {
        self.inner.data.set_file_times(on);
    }

    /// Blocks that sharing saves: each shared block once per name beyond
    /// its first.
    pub fn shared_blocks(self) -> u64 {
        self.inner.space.free().shared.saved_blocks()
    }

    /// Journal transactions the mount replayed (0 after a clean unmount).
    pub fn replayed_at_mount(self) -> u64 {
        self.inner.journal.replayed_at_mount
    }

    pub fn superblock(self) -> Superblock {
        self.inner.journal.sb.borrow().clone()
    }

    /// Blocks free for new data right now (delayed-allocation reservations
    /// excluded), within the quota if there is one.
    pub fn free_blocks(self) -> u64 {
        self.inner.space.available_blocks(self.inner.usage())
    }

    /// Range-lock acquisitions that had to wait: (shared, exclusive).
    pub fn range_lock_waits(self) -> (u64, u64) {
        self.inner.data.range_lock_waits()
    }

    pub fn cache_stats(self) -> cache::CacheStats {
        self.inner.pages.cache().stats()
    }

    /// Extents of a file (for tests and benchmarks of the allocator).
    pub fn extent_count(self, ino: Ino) -> FsResult<usize> {
        self.inner.meta.extent_count(ino)
    }

    /// The snapshots, and the space only they hold (linear in their runs).
    pub fn snapshot_space(self) -> crate::SnapshotSpace {
        crate::journal::snapshot_space(self.inner)
    }

    /// Whether a checkpoint is being written in pieces now (for tests).
    #[doc(hidden)]
    pub fn checkpointing_in_pieces(self) -> bool {
        self.inner.journal.checkpoint_in_pieces()
    }

    /// Every block has at most one owner: files' extents (several only
    /// where `SharedRuns` counts exactly those names, all written), the
    /// live checkpoint, a free awaiting its commit, a checkpoint or a
    /// discard, or the allocator's free list. For tests and fuzzers that
    /// run the filesystem through many operations: a block with two owners
    /// is a corruption waiting for its next write. Linear in extents and
    /// free runs (and their log).
    pub fn check_block_ownership(self) -> Result<(), DoubleOwner> {
        let mut owned = self.extents_agree_with_their_counts()?;
        let sb = self.inner.journal.sb.borrow();
        // What precedes the data area is never the allocator's to give.
        owned.push((0, sb.data_start(), "the superblocks, journal and checksum table".to_string()));
        owned.extend(sb.checkpoint_extents.iter().map(|r| (r.start, r.len, "the checkpoint".to_string())));
        owned.extend(sb.snapshot_table.iter().map(|r| (r.start, r.len, "the snapshot table".to_string())));
        let snapshots = self.inner.journal.snapshots.borrow();
        let kept = snapshots.checkpoint_runs_besides(sb.checkpoint_seq);
        owned.extend(kept.map(|r| (r.start, r.len, "a snapshot's checkpoint".to_string())));
        let free = self.inner.space.free();
        owned.extend(free.pending_free.iter().map(|r| (r.start, r.len, "a pending free".to_string())));
        let held = self.inner.space.held_runs();
        owned.extend(held.iter().map(|r| (r.start, r.len, "a free held for a checkpoint".to_string())));
        owned.extend(
            self.inner.discard.runs().into_iter().map(|r| (r.start, r.len, "a free awaiting its discard".to_string())),
        );
        owned.extend(free.alloc.free_runs().iter().map(|r| (r.start, r.len, "the free list".to_string())));
        owned.sort_by_key(|o| o.0);
        for pair in owned.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if a.0 + a.1 > b.0 {
                let claim = |o: &(u64, u64, String)| BlockClaim { start: o.0, len: o.1, owner: o.2.clone() };
                return Err(DoubleOwner { first: claim(a), second: claim(b) });
            }
        }
        Ok(())
    }

    /// The blocks files' extents name, as runs named by the same number
    /// of extents: `SharedRuns` must count each name past the first, and
    /// only written extents may share. Returns the runs as one owner each.
    fn extents_agree_with_their_counts(self) -> Result<Vec<(u64, u64, String)>, DoubleOwner> {
        let claim = |start: u64, len: u64, owner: String| BlockClaim { start, len, owner };
        // +1 name at an extent's start, -1 at its end; unwritten ones
        // counted apart.
        let mut edges: BTreeMap<u64, (i64, i64)> = BTreeMap::new();
        let state = self.inner.meta.state();
        let snapshots = self.inner.journal.snapshots.borrow();
        // A snapshot's hold is one written name on each of its blocks.
        let held = snapshots.held_runs().map(|r| (r.start, r.len, false));
        let named = state.nodes().flat_map(|n| n.extents.iter()).map(|e| (e.disk_block.get(), e.len, e.unwritten));
        for (start, len, unwritten) in named.chain(held) {
            let end = start + len;
            let step = if unwritten { (1, 1) } else { (1, 0) };
            let at = edges.entry(start).or_default();
            (at.0, at.1) = (at.0 + step.0, at.1 + step.1);
            let at = edges.entry(end).or_default();
            (at.0, at.1) = (at.0 - step.0, at.1 - step.1);
        }
        drop((state, snapshots));
        let free = self.inner.space.free();
        let (mut names, mut unwritten, mut saved) = (0i64, 0i64, 0u64);
        let mut runs: Vec<(u64, u64, String)> = Vec::new();
        let mut from = 0;
        for (&at, &(step, unwritten_step)) in &edges {
            if names > 0 && at > from {
                let run = BlockRun { start: from, len: at - from };
                let extra = names as u64 - 1;
                let counted = free.shared.uniform_extra(run);
                if (extra > 0 && unwritten > 0) || counted != Some(extra) {
                    let named = format!("{names} extents ({unwritten} unwritten)");
                    let index = format!("the shared index, {counted:?} names past the first");
                    return Err(DoubleOwner { first: claim(from, run.len, named), second: claim(from, 0, index) });
                }
                saved += run.len * extra;
                runs.push((from, run.len, format!("{names} extent(s)")));
            }
            (names, unwritten, from) = (names + step, unwritten + unwritten_step, at);
        }
        if saved != free.shared.saved_blocks() {
            let index = format!("the shared index, {} blocks saved", free.shared.saved_blocks());
            return Err(DoubleOwner { first: claim(0, saved, "the extents".into()), second: claim(0, 0, index) });
        }
        Ok(runs)
    }

    /// Overwrite an inode's link count, bypassing every rule: for tests
    /// that need a damaged image to check fsck against.
    #[doc(hidden)]
    pub fn debug_set_nlink(self, ino: Ino, nlink: u32) {
        let _ = self.inner.change().update_inode(ino, |i| i.nlink = nlink);
    }

    /// Check every part's invariants, and the ones that span parts
    /// (docs/plans/fs-parts.md, section 2): the page cache's indexes and
    /// counts, the discard queue's sums, the journal's counts and ring
    /// bounds, the promised and held blocks against the cache and the
    /// journal, and the nodes' open counts against the handles. For tests
    /// and fuzzers, between operations; some checks hold only while no
    /// data operation or commit is in flight, and are skipped otherwise.
    /// Panics on the first that does not hold, naming it.
    ///
    /// These are what the code establishes, not what an image holds: a
    /// crafted image's shape (dangling entries, wrong link counts) is
    /// fsck's to find.
    #[doc(hidden)]
    pub fn assert_invariants(self) {
        let fs = &**self.inner;
        let reserved_pages = fs.pages.cache().check_invariants();
        fs.discard.check_invariants();
        fs.journal.check_invariants(fs.meta.state().in_snapshot());
        let data_idle = fs.data.is_idle() && !fs.pages.writeback_running();
        let seen = SpaceWitness { reserved_pages, data_idle, journal_busy: fs.journal.busy() };
        fs.space.check_invariants(&seen);
        fs.meta.check_invariants(&fs.handles.opens_by_inode());
    }
}
