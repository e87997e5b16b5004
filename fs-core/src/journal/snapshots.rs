//! Snapshots (issue 37; docs/FORMAT.md, "Snapshots"): a snapshot is a
//! retained checkpoint. Creating one writes a whole checkpoint, as a full
//! journal does, and keeps it: the superblock that installs the checkpoint
//! also installs a snapshot table that names it, in one slot switch. Its
//! written extents each hold one reference on their blocks (`SharedRuns`
//! counts them with the files' names), so every later write to them copies
//! on write, and no punch frees them. Deleting one is the same kind of
//! checkpoint, with a table that no longer names it; then its references
//! go, and its checkpoint's blocks with them.
//!
//! Both run under the commit lock from the state's capture to the
//! superblock, so no transaction is ever written between a table change's
//! capture and its install. That is what keeps the free-block counts
//! exact whichever superblock a crash leaves: a transaction is replayed
//! only under the table it was counted under.

use std::rc::Rc;

use keelfs_reactor::DeviceChannel;

use super::commit::maybe_schedule_after;
use super::load::{choose_superblock, load_checkpoint, read_blocks, read_superblocks, Rebuilt};
use super::{corrupt, CommitCx, Journal, Loaded};
use crate::format::{
    BlockRun, Superblock, Timespec, BLOCK_BYTES, FEATURE_FREE_COUNT_HOLDS_CHECKPOINT, FEATURE_SHARED_EXTENTS,
    FEATURE_SNAPSHOTS, ROOT_INO, SNAPSHOT_TABLE_EXTENTS_MAX,
};
use crate::shared_runs::SharedRuns;
use crate::snapshot_table::{
    check_snapshot_name, decode_table, encode_table, SnapshotEntry, SNAPSHOTS_MAX, TABLE_BYTES_MAX,
};
use crate::state::State;
use crate::{FsError, FsInner, FsResult};

/// A snapshot of the mounted image: its entry in the table, and the runs
/// its written extents name (sorted, apart), each holding one reference.
pub(crate) struct LiveSnapshot {
    pub entry: SnapshotEntry,
    pub held: Vec<BlockRun>,
}

impl LiveSnapshot {
    /// The first of its runs that ends past device block `from`.
    fn run_from(&self, from: u64) -> Option<&BlockRun> {
        self.held.get(self.held.partition_point(|r| r.end() <= from))
    }

    fn holds(&self, block: u64) -> bool {
        self.run_from(block).is_some_and(|r| r.start <= block)
    }
}

/// The snapshots of the mounted image, in the table's order.
#[derive(Default)]
pub(crate) struct Snapshots {
    pub list: Vec<LiveSnapshot>,
}

impl Snapshots {
    /// Whether a snapshot keeps the checkpoint numbered `seq`.
    pub fn retains(&self, seq: u64) -> bool {
        self.list.iter().any(|s| s.entry.checkpoint_seq == seq)
    }

    pub fn find(&self, name: &str) -> Option<&LiveSnapshot> {
        self.list.iter().find(|s| s.entry.name == name)
    }

    /// The checkpoint runs snapshots keep, but for the live checkpoint's
    /// (numbered `live_seq`), which the superblock names already.
    pub fn checkpoint_runs_besides(&self, live_seq: u64) -> impl Iterator<Item = BlockRun> + '_ {
        let kept = self.list.iter().filter(move |s| s.entry.checkpoint_seq != live_seq);
        kept.flat_map(|s| s.entry.checkpoint_extents.iter().copied())
    }

    /// Every run a snapshot holds a reference on, snapshot by snapshot.
    pub fn held_runs(&self) -> impl Iterator<Item = BlockRun> + '_ {
        self.list.iter().flat_map(|s| s.held.iter().copied())
    }

    /// The first blocks any snapshot holds at or after device block
    /// `from`: a run of one snapshot's, cut to start at `from` (another
    /// snapshot may hold more of them). A binary search per snapshot.
    pub fn next_held(&self, from: u64) -> Option<BlockRun> {
        self.list
            .iter()
            .filter_map(|s| {
                let run = s.run_from(from)?;
                let start = run.start.max(from);
                Some(BlockRun { start, len: run.end() - start })
            })
            .min_by_key(|run| run.start)
    }

    /// Whether any snapshot holds device block `block`.
    pub fn holds(&self, block: u64) -> bool {
        self.list.iter().any(|s| s.holds(block))
    }

    /// The snapshots that hold device block `block`.
    fn holding(&self, block: u64) -> u64 {
        self.list.iter().filter(|s| s.holds(block)).count() as u64
    }

    /// Whether a live file names device block `block`, which a snapshot
    /// holds: it has more names (`shared` counts them past the first)
    /// than snapshots that hold it, each of which names it once.
    pub fn live_names(&self, shared: &SharedRuns, block: u64) -> bool {
        let names = 1 + shared.uniform_extra(BlockRun { start: block, len: 1 }).unwrap_or(0);
        names > self.holding(block)
    }

    /// The next piece, of at most `max` blocks, of what snapshots hold
    /// from device block `from`: a run whose blocks a live file names
    /// (true), or none of them does (false). The walks over the
    /// snapshots' blocks check only the second kind, as the walk over
    /// the files has read the first.
    pub fn next_held_piece(&self, shared: &SharedRuns, from: u64, max: u64) -> Option<(BlockRun, bool)> {
        let run = self.next_held(from)?;
        let len = run.len.min(max.max(1));
        let named = self.live_names(shared, run.start);
        let same = (1..len).find(|&i| self.live_names(shared, run.start + i) != named).unwrap_or(len);
        Some((BlockRun { start: run.start, len: same }, named))
    }
}

/// The blocks the written extents of `state` name, as sorted runs apart
/// from one another: each block once, however many extents name it.
pub(crate) fn written_runs(state: &State) -> Vec<BlockRun> {
    let mut runs: Vec<BlockRun> = state
        .nodes()
        .flat_map(|n| n.extents.iter())
        .filter(|e| !e.unwritten)
        .map(|e| BlockRun { start: e.disk_block.get(), len: e.len })
        .collect();
    runs.sort_unstable_by_key(|r| r.start);
    let mut merged: Vec<BlockRun> = Vec::with_capacity(runs.len());
    for run in runs {
        match merged.last_mut() {
            Some(last) if run.start <= last.end() => last.len = last.len.max(run.end() - last.start),
            _ => merged.push(run),
        }
    }
    merged
}

/// The blocks of `held` (runs apart) that nothing else names: what
/// dropping its references frees.
pub(crate) fn exclusive_blocks(held: &[BlockRun], shared: &SharedRuns) -> u64 {
    let all: u64 = held.iter().map(|r| r.len).sum();
    let named_again: u64 = held.iter().flat_map(|r| shared.shared_within(*r)).map(|r| r.len).sum();
    all - named_again
}

/// A change to the table, carried by the whole checkpoint that installs
/// it. Each is captured in the synchronous step that encodes the state.
pub(crate) enum TableChange {
    /// Keep the new checkpoint as `name`; `held` are the runs the state's
    /// written extents named, each given a reference at the capture.
    Create { name: String, created: Timespec, held: Vec<BlockRun> },
    /// Forget `name`; `freed` of its blocks had no other name at the
    /// capture.
    Delete { name: String, freed: u64 },
}

/// The table a checkpoint installs, and where it is written.
pub(super) struct TablePlan {
    pub entries: Vec<SnapshotEntry>,
    pub bytes: Vec<u8>,
    pub runs: Vec<BlockRun>,
}

impl TablePlan {
    fn blocks(&self) -> u64 {
        self.runs.iter().map(|r| r.len).sum()
    }
}

impl Journal {
    /// The blocks the recorded free counts add to the allocator's: the
    /// live checkpoint's, under FEATURE_FREE_COUNT_HOLDS_CHECKPOINT, unless
    /// a snapshot keeps it (then the next checkpoint will not free them).
    pub(crate) fn free_count_checkpoint_blocks(&self) -> u64 {
        let sb = self.sb.borrow();
        if self.snapshots.borrow().retains(sb.checkpoint_seq) {
            0
        } else {
            sb.free_count_checkpoint_blocks()
        }
    }

    /// The table after `change`, with the new checkpoint (`seq`, `bytes`
    /// in `runs`) as the snapshot a create names, and blocks for it.
    pub(super) fn plan_table(
        &self,
        cx: &CommitCx<'_>,
        change: &TableChange,
        checkpoint: (u64, u64, &[BlockRun]),
    ) -> FsResult<TablePlan> {
        let mut entries: Vec<SnapshotEntry> = self.snapshots.borrow().list.iter().map(|s| s.entry.clone()).collect();
        match change {
            TableChange::Create { name, created, .. } => {
                let (checkpoint_seq, checkpoint_bytes, runs) = checkpoint;
                let checkpoint_extents = runs.to_vec();
                entries.push(SnapshotEntry {
                    name: name.clone(),
                    created: *created,
                    checkpoint_seq,
                    checkpoint_bytes,
                    checkpoint_extents,
                });
            }
            TableChange::Delete { name, .. } => entries.retain(|e| &e.name != name),
        }
        assert!(entries.len() <= SNAPSHOTS_MAX, "the caller checked the limit");
        if entries.is_empty() {
            return Ok(TablePlan { entries, bytes: Vec::new(), runs: Vec::new() });
        }
        let bytes = encode_table(&entries);
        let blocks = bytes.len().div_ceil(super::CP_PAYLOAD_PER_BLOCK) as u64;
        let runs = cx.space.alloc_in_runs(blocks, cx.config.preferred_group, SNAPSHOT_TABLE_EXTENTS_MAX)?;
        Ok(TablePlan { entries, bytes, runs })
    }

    /// The free-block count a checkpoint records: what a mount of it
    /// alone computes. `free_at_capture` counted the old checkpoint as
    /// free unless a snapshot kept it; the new one is counted so unless
    /// the plan keeps it. Table blocks, a deleted snapshot's checkpoint
    /// and the blocks only it held change hands at the install.
    pub(super) fn recorded_free(
        &self,
        old: &Superblock,
        free_at_capture: u64,
        new_cp: (u64, u64),
        plan: Option<(&TablePlan, &TableChange)>,
    ) -> u64 {
        let (new_seq, new_blocks) = (new_cp.0, new_cp.1);
        let old_blocks = old.checkpoint_blocks();
        if old.features & FEATURE_FREE_COUNT_HOLDS_CHECKPOINT == 0 {
            assert!(plan.is_none(), "snapshots need the free-count feature");
            return free_at_capture + old_blocks - new_blocks;
        }
        let snapshots = self.snapshots.borrow();
        let kept_now = |seq| snapshots.retains(seq);
        let kept_after = |seq| match plan {
            Some((p, _)) => p.entries.iter().any(|e| e.checkpoint_seq == seq),
            None => kept_now(seq),
        };
        let mut free = i128::from(free_at_capture);
        let blocks = |b: u64| i128::from(b);
        free -= if kept_now(old.checkpoint_seq) { 0 } else { blocks(old_blocks) };
        free += if kept_after(old.checkpoint_seq) { 0 } else { blocks(old_blocks) };
        free += if kept_after(new_seq) { 0 } else { blocks(new_blocks) };
        free -= blocks(new_blocks);
        if let Some((p, change)) = plan {
            free += blocks(old.snapshot_table.iter().map(|r| r.len).sum()) - blocks(p.blocks());
            if let TableChange::Delete { name, freed } = change {
                let gone = snapshots.find(name).expect("the caller found it");
                if gone.entry.checkpoint_seq != old.checkpoint_seq {
                    free += blocks(gone.entry.checkpoint_blocks());
                }
                free += blocks(*freed);
            }
        }
        u64::try_from(free).expect("a free-block count between zero and the device's blocks")
    }

    /// After the superblock that installs `plan` is on the device: the
    /// table in memory follows, the old table's blocks are free, and a
    /// deleted snapshot's checkpoint and references go.
    pub(super) fn install_table(&self, cx: &CommitCx<'_>, old: &Superblock, plan: TablePlan, change: TableChange) {
        let mut snapshots = self.snapshots.borrow_mut();
        let mut free = cx.space.free_mut();
        for run in &old.snapshot_table {
            free.alloc.free(*run);
        }
        match change {
            TableChange::Create { name, held, .. } => {
                let entry = plan.entries.into_iter().find(|e| e.name == name).expect("the plan names it");
                snapshots.list.push(LiveSnapshot { entry, held });
            }
            TableChange::Delete { name, .. } => {
                let at = snapshots.list.iter().position(|s| s.entry.name == name).expect("the caller found it");
                let gone = snapshots.list.remove(at);
                // The old live checkpoint's blocks are the caller's to free.
                if gone.entry.checkpoint_seq != old.checkpoint_seq {
                    for run in &gone.entry.checkpoint_extents {
                        free.alloc.free(*run);
                    }
                }
                // Live, these wait for the next commit as any free does.
                let crate::space::FreeSpace { shared, pending_free, .. } = &mut *free;
                for run in gone.held {
                    shared.release(run, |gone| pending_free.push(gone));
                }
            }
        }
    }
}

/// A table change whose checkpoint failed: a create's references go
/// (what lost its last name meanwhile is freed at the next commit).
pub(super) fn abandon_table(cx: &CommitCx<'_>, change: TableChange) {
    if let TableChange::Create { held, .. } = change {
        let crate::space::FreeSpace { shared, pending_free, .. } = &mut *cx.space.free_mut();
        for run in held {
            shared.release(run, |gone| pending_free.push(gone));
        }
    }
}

/// What a snapshot operation checks first: a writable mount, a name, and
/// an image that can hold snapshots.
fn check_request(fs: &FsInner, name: &str) -> FsResult<()> {
    if fs.config.read_only {
        return Err(FsError::ReadOnly);
    }
    check_snapshot_name(name).map_err(FsError::Invalid)?;
    if fs.journal.sb.borrow().features & FEATURE_FREE_COUNT_HOLDS_CHECKPOINT == 0 {
        // Images made before checkpoints in pieces: their free counts
        // cannot leave a kept checkpoint out.
        return Err(FsError::Unsupported);
    }
    Ok(())
}

/// Take a snapshot named `name` of the state as it is after everything
/// committed so far and everything logged (the caller wrote dirty pages
/// back first). The guest-visible pause is the state's encoding, in one
/// synchronous step; the writes after it hold only the commit lock.
pub(crate) async fn create_snapshot(fs: &Rc<FsInner>, name: &str, created: Timespec) -> FsResult<()> {
    check_request(fs, name)?;
    let journal = &fs.journal;
    let _guard = journal.commit_lock.lock().await;
    if fs.unmounted.get() {
        return Err(FsError::ReadOnly);
    }
    {
        let snapshots = journal.snapshots.borrow();
        if snapshots.find(name).is_some() {
            return Err(FsError::Exists);
        }
        if snapshots.list.len() >= SNAPSHOTS_MAX {
            return Err(FsError::NoSpace);
        }
    }
    journal.features_on.set(journal.features_on.get() | FEATURE_SHARED_EXTENTS | FEATURE_SNAPSHOTS);
    let cx = fs.commit_cx();
    let mut taken = journal.take_pending(&cx, true);
    // In the step that encoded the state: from here every block it names
    // is shared, so no write lands on one in place.
    let held = written_runs(&cx.meta.state());
    {
        let mut free = cx.space.free_mut();
        for run in &held {
            free.shared.share(*run);
        }
    }
    // A failed checkpoint gives the references back (`abandon_table`).
    taken.table = Some(TableChange::Create { name: name.to_string(), created, held });
    let result = journal.commit_taken(&cx, taken).await;
    if result.is_ok() {
        tracing::info!(parent: &fs.span, name, "snapshot created");
    }
    maybe_schedule_after(fs, result)
}

/// Delete the snapshot `name`, freeing what only it held.
pub(crate) async fn delete_snapshot(fs: &Rc<FsInner>, name: &str) -> FsResult<()> {
    check_request(fs, name)?;
    let journal = &fs.journal;
    let _guard = journal.commit_lock.lock().await;
    if fs.unmounted.get() {
        return Err(FsError::ReadOnly);
    }
    if journal.snapshots.borrow().find(name).is_none() {
        return Err(FsError::NotFound);
    }
    let cx = fs.commit_cx();
    let mut taken = journal.take_pending(&cx, true);
    let freed = {
        let snapshots = journal.snapshots.borrow();
        let gone = snapshots.find(name).expect("found above, under the lock");
        exclusive_blocks(&gone.held, &cx.space.free().shared)
    };
    taken.table = Some(TableChange::Delete { name: name.to_string(), freed });
    journal.commit_taken(&cx, taken).await?;
    tracing::info!(parent: &fs.span, name, freed_blocks = freed, "snapshot deleted");
    // Its blocks wait for a commit, as any free does (some are still named
    // by the new checkpoint, by files whose punch is not committed): this
    // one, so that the space shows at once.
    let taken = journal.take_pending(&cx, false);
    maybe_schedule_after(fs, journal.commit_taken(&cx, taken).await)
}

/// The table the superblock names, read and checked.
async fn read_table(dev: &DeviceChannel, sb: &Superblock) -> FsResult<Vec<SnapshotEntry>> {
    if sb.snapshot_table.is_empty() {
        return Ok(Vec::new());
    }
    if sb.features & FEATURE_SHARED_EXTENTS == 0 {
        return Err(corrupt("a snapshot table on an image without shared extents"));
    }
    if sb.snapshot_table_bytes > TABLE_BYTES_MAX {
        return Err(corrupt(format!("a snapshot table of {} bytes", sb.snapshot_table_bytes)));
    }
    let want = sb.snapshot_table_bytes as usize;
    let mut payload = Vec::with_capacity(want);
    let mut index = 0u32;
    for run in &sb.snapshot_table {
        // Bounded: the table's bytes need at most TABLE_BYTES_MAX / 4 KiB
        // blocks, whatever a run claims.
        let mut at = 0;
        while at < run.len && payload.len() < want {
            let block = read_blocks(dev, run.start + at, 1).await?;
            let chunk = super::load::parse_checkpoint_block(&block, sb.snapshot_table_seq, index)
                .map_err(|why| corrupt(format!("snapshot table block {index}: {why}")))?;
            let take = chunk.len().min(want - payload.len());
            payload.extend_from_slice(&chunk[..take]);
            (at, index) = (at + 1, index + 1);
        }
    }
    if payload.len() < want {
        return Err(corrupt("the snapshot table is shorter than the superblock says"));
    }
    decode_table(&payload, sb.data_start(), sb.total_blocks).map_err(|why| corrupt(format!("snapshot table: {why}")))
}

/// The superblock as it would be if `entry` were its checkpoint: to load
/// a snapshot with the checkpoint loader.
fn superblock_of(sb: &Superblock, entry: &SnapshotEntry) -> Superblock {
    Superblock {
        checkpoint_seq: entry.checkpoint_seq,
        checkpoint_bytes: entry.checkpoint_bytes,
        checkpoint_extents: entry.checkpoint_extents.clone(),
        ..sb.clone()
    }
}

/// Read the snapshot table and each snapshot's checkpoint, and claim in
/// `rebuilt` what they hold: the table's blocks, their checkpoints (the
/// live one is claimed already) and a reference on every block their
/// written extents name. Loads one snapshot's state at a time.
pub(crate) async fn load_snapshots(dev: &DeviceChannel, sb: &Superblock, rebuilt: &mut Rebuilt) -> FsResult<Snapshots> {
    let entries = read_table(dev, sb).await?;
    let mut snapshots = Snapshots::default();
    for run in &sb.snapshot_table {
        rebuilt.free.alloc.claim(*run).map_err(claim_err("the snapshot table"))?;
    }
    for entry in entries {
        if entry.checkpoint_seq == sb.checkpoint_seq {
            if entry.checkpoint_extents != sb.checkpoint_extents || entry.checkpoint_bytes != sb.checkpoint_bytes {
                return Err(corrupt(format!("snapshot {:?} and the live checkpoint disagree", entry.name)));
            }
        } else {
            for run in &entry.checkpoint_extents {
                rebuilt.free.alloc.claim(*run).map_err(claim_err("a snapshot's checkpoint"))?;
            }
        }
        let (loaded, _) = load_checkpoint(dev, &superblock_of(sb, &entry))
            .await
            .map_err(|e| corrupt(format!("snapshot {:?}: {e}", entry.name)))?;
        let held = written_runs(&loaded.state);
        drop(loaded);
        for run in &held {
            rebuilt.free.claim_for_extent(*run, false).map_err(claim_err("a snapshot's extent"))?;
        }
        snapshots.list.push(LiveSnapshot { entry, held });
    }
    Ok(snapshots)
}

/// The snapshot `name` as a mount loads it: its checkpoint alone, under
/// a superblock that names it (read-only mounts only: the allocator it
/// rebuilds knows nothing of the live files). ENOENT if there is none.
pub(crate) async fn load_snapshot(dev: &DeviceChannel, name: &str) -> FsResult<Loaded> {
    let capacity_blocks = crate::blocks::whole_blocks(dev.geometry().capacity_bytes);
    let (sb, _) = choose_superblock(read_superblocks(dev).await?, capacity_blocks)?;
    let entry = read_table(dev, &sb).await?.into_iter().find(|e| e.name == name).ok_or(FsError::NotFound)?;
    let view = superblock_of(&sb, &entry);
    let (rebuilt, _) = load_checkpoint(dev, &view).await?;
    if !rebuilt.state.node(ROOT_INO).is_some_and(|root| root.inode.is_dir() && root.inode.nlink > 0) {
        return Err(corrupt(format!("snapshot {name:?} has no root directory")));
    }
    let Rebuilt { state, free, csums } = rebuilt;
    let (journal_head, journal_seq) = (view.journal_start, view.journal_seq);
    let snapshots = Snapshots::default();
    let stale_headers = Vec::new();
    Ok(Loaded { sb: view, state, free, csums, journal_head, journal_seq, replayed: 0, stale_headers, snapshots })
}

fn claim_err(what: &'static str) -> impl Fn(crate::alloc::AllocError) -> FsError {
    move |e| corrupt(format!("{what} claims blocks already in use: {e}"))
}

/// The space snapshots hold, for stats and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotSpace {
    pub snapshots: u64,
    /// Their checkpoints (but the live one) and the table.
    pub metadata_blocks: u64,
    /// Data blocks only snapshots name: what deleting every snapshot
    /// frees besides their metadata.
    pub data_blocks: u64,
}

/// What the snapshots hold that no live file does. Linear in their runs
/// (a sweep over the holds, then one range query each).
pub(crate) fn snapshot_space(fs: &FsInner) -> SnapshotSpace {
    let snapshots = fs.journal.snapshots.borrow();
    let sb = fs.journal.sb.borrow();
    let table: u64 = sb.snapshot_table.iter().map(|r| r.len).sum();
    let checkpoints: u64 = snapshots.checkpoint_runs_besides(sb.checkpoint_seq).map(|r| r.len).sum();
    // +1 hold where a snapshot's run starts, -1 where it ends.
    let mut edges: Vec<(u64, i64)> = snapshots.held_runs().flat_map(|r| [(r.start, 1), (r.end(), -1)]).collect();
    edges.sort_unstable();
    let free = fs.space.free();
    let (mut holds, mut from, mut data_blocks) = (0i64, 0u64, 0u64);
    for (at, step) in edges {
        if holds > 0 && at > from {
            let run = BlockRun { start: from, len: at - from };
            data_blocks += free.shared.blocks_named(run, holds as u64);
        }
        (holds, from) = (holds + step, at);
    }
    SnapshotSpace { snapshots: snapshots.list.len() as u64, metadata_blocks: table + checkpoints, data_blocks }
}

/// What `snapshot_list` reports of one snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    pub created: Timespec,
    /// Data blocks its files name, each once.
    pub data_blocks: u64,
    /// Blocks that deleting it frees: its checkpoint's, unless it is the
    /// live one, and the data blocks nothing else names.
    pub exclusive_blocks: u64,
}

impl SnapshotInfo {
    pub fn exclusive_bytes(&self) -> u64 {
        self.exclusive_blocks * BLOCK_BYTES as u64
    }
}

/// Every snapshot, in the order they were taken.
pub(crate) fn list_snapshots(fs: &FsInner) -> Vec<SnapshotInfo> {
    let snapshots = fs.journal.snapshots.borrow();
    let live_seq = fs.journal.sb.borrow().checkpoint_seq;
    let free = fs.space.free();
    snapshots
        .list
        .iter()
        .map(|s| {
            let own_checkpoint = if s.entry.checkpoint_seq == live_seq { 0 } else { s.entry.checkpoint_blocks() };
            SnapshotInfo {
                name: s.entry.name.clone(),
                created: s.entry.created,
                data_blocks: s.held.iter().map(|r| r.len).sum(),
                exclusive_blocks: exclusive_blocks(&s.held, &free.shared) + own_checkpoint,
            }
        })
        .collect()
}
