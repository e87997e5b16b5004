//! Offline consistency checking, and repair of the simple cases.
//!
//! fsck loads the image the way mount does (superblocks, checkpoint,
//! journal replay, each block checksummed), which already proves that no
//! block is owned twice and that every extent lies in the data area. It
//! then checks the invariants that loading does not: link counts,
//! directory structure and connectivity, and free-space accounting.

use std::borrow::Cow;
use std::collections::HashMap;

use super::blocks::{whole_blocks, DevBlock, FileBlock};
use std::cell::RefCell;

use super::csum_table::{self, TableCache};
use super::format::{crc, BlockRun, BLOCK_BYTES, CSUMS_PER_SECTOR, CSUMS_PER_TABLE_BLOCK, CSUM_SECTORS_PER_BLOCK};
use super::format::{Superblock, ROOT_INO};
use super::io::Io;
use super::journal;
use super::record::Record;
use super::seen_shared::SeenShared;
use super::shared_runs::SharedRuns;
use super::space::FreeSpace;
use super::state::State;
use super::{Fs, FsConfig, FsError, FsResult};
use crate::ids::Ino;
use keelfs_reactor::DeviceChannel;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// A stable name for the kind of damage.
    pub kind: &'static str,
    pub detail: String,
    /// Whether `--repair` fixes it.
    pub repairable: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FsckReport {
    pub problems: Vec<Problem>,
    pub inodes: u64,
    pub directories: u64,
    pub data_blocks_used: u64,
    pub free_blocks: u64,
    pub journal_transactions_replayed: u64,
    /// Unlinked inodes still allocated (open at a crash); mount frees them.
    pub orphans: u64,
    /// Snapshots the image keeps.
    pub snapshots: u64,
    /// Written data blocks `--data` checked (a block files share once per
    /// name; one only snapshots hold, once).
    pub data_blocks_checked: u64,
    /// Written data blocks `--data` could not check: their table sector
    /// fails its crc, or they fail in a region open at a crash.
    pub data_blocks_unverifiable: u64,
    /// Data blocks the image records as having failed their checksum at
    /// run time; those that still fail are problems.
    pub data_errors_recorded: u64,
    /// Regions of the data checksum table the dirty-region map has open
    /// (a crash during overwrites in place); their blocks that fail are
    /// unverifiable, not damage, until a mount sets their entries.
    pub data_regions_open: u64,
    pub repaired: Vec<String>,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

fn problem(kind: &'static str, detail: String, repairable: bool) -> Problem {
    Problem { kind, detail, repairable }
}

/// What fsck checks beyond the metadata.
#[derive(Clone, Copy, Debug, Default)]
pub struct FsckOptions {
    /// Read every written data block and check it against its checksum
    /// (an image with data checksums; `keelfsd fsck --data`).
    pub data: bool,
}

/// Check the filesystem on `dev`. `progress` hears each stage's name.
pub async fn fsck(dev: DeviceChannel, progress: impl FnMut(&str)) -> FsResult<FsckReport> {
    fsck_with(dev, FsckOptions::default(), progress).await
}

/// [`fsck`], with `options`.
pub async fn fsck_with(
    dev: DeviceChannel,
    options: FsckOptions,
    mut progress: impl FnMut(&str),
) -> FsResult<FsckReport> {
    let mut report = FsckReport::default();
    progress("superblocks");
    let capacity_blocks = whole_blocks(dev.geometry().capacity_bytes);
    let (sb, sb_problems) = match journal::choose_superblock(journal::read_superblocks(&dev).await?, capacity_blocks) {
        Ok(found) => found,
        Err(e) => {
            report.problems.push(problem("superblock", e.to_string(), false));
            return Ok(report);
        }
    };
    for p in sb_problems {
        report.problems.push(problem("superblock-copy", p, true));
    }
    progress("checkpoint");
    let (mut rebuilt, recorded) = match journal::load_checkpoint(&dev, &sb).await {
        Ok(loaded) => loaded,
        Err(e) => {
            report.problems.push(problem("checkpoint", e.to_string(), false));
            return Ok(report);
        }
    };
    progress("journal");
    let recorded_free = match journal::replay(&dev, &sb, &mut rebuilt, recorded).await {
        Ok(replayed) => {
            report.journal_transactions_replayed = replayed.count;
            if let Some(&first) = replayed.stale.first() {
                let detail = format!(
                    "{} transaction headers past the journal's end (the first {} blocks past it) are numbered \
                     at or after the next transaction, as if they continued the log; a mount erases them",
                    replayed.stale.len(),
                    first - replayed.head
                );
                report.problems.push(problem("journal-stale", detail, true));
            }
            replayed.free
        }
        Err(e) => {
            report.problems.push(problem("journal", e.to_string(), false));
            return Ok(report);
        }
    };
    progress("snapshots");
    let snapshots = match journal::load_snapshots(&dev, &sb, &mut rebuilt).await {
        Ok(snapshots) => snapshots,
        Err(e) => {
            report.problems.push(problem("snapshots", e.to_string(), false));
            return Ok(report);
        }
    };
    report.snapshots = snapshots.list.len() as u64;
    if let Err(why) = rebuilt.check_sharing(&sb, &snapshots) {
        report.problems.push(problem("shared-extents", why, false));
        return Ok(report);
    }
    progress("inodes and directories");
    check_state(&rebuilt.state, &rebuilt.free, (&sb, &snapshots), recorded_free, &mut report);
    if sb.has_data_checksums() {
        let table = rebuilt.csums.take();
        let image = (&rebuilt.state, &snapshots, &rebuilt.free.shared);
        check_checksummed(dev, &sb, image, table, options, progress, &mut report).await?;
    }
    Ok(report)
}

/// The checks of an image with data checksums: its table, the blocks
/// recorded as bad at run time, and with `--data` every written block
/// (the files', then those only snapshots hold).
async fn check_checksummed(
    dev: DeviceChannel,
    sb: &Superblock,
    (state, snapshots, shared): (&State, &journal::Snapshots, &SharedRuns),
    table: Option<TableCache>,
    options: FsckOptions,
    mut progress: impl FnMut(&str),
    report: &mut FsckReport,
) -> FsResult<()> {
    progress("data checksum table");
    let io = Io::new(dev);
    check_csum_table(&io, sb, report).await?;
    let Some(table) = table else { return Ok(()) };
    let table = RefCell::new(table);
    // A crash leaves these regions' entries possibly behind their data
    // (overwrites in place); mount sets them from the data.
    let open = crate::csum_map::read_open_regions(&io, sb).await?;
    report.data_regions_open = open.len() as u64;
    let checked = Checked { state, snapshots, shared, table: &table, open: &open };
    progress("recorded bad data blocks");
    check_recorded_errors(&io, &checked, report).await?;
    if options.data {
        progress("data blocks");
        check_data(&io, &checked, report).await?;
    }
    Ok(())
}

/// What the data checks read: the state, the snapshots and the counts of
/// shared blocks, the table, and the regions the dirty-region map has
/// open, sorted.
struct Checked<'a> {
    state: &'a State,
    snapshots: &'a journal::Snapshots,
    shared: &'a SharedRuns,
    table: &'a RefCell<TableCache>,
    open: &'a [u64],
}

impl Checked<'_> {
    /// Whether device block `block`'s data `data` fails its entry, where
    /// that means damage: Some(true) if it fails, Some(false) if it
    /// checks, None if it cannot be checked (its table sector is bad, or
    /// its region was open at a crash).
    async fn fails(&self, io: &Io, block: u64, data: &[u8]) -> FsResult<Option<bool>> {
        let open = self.open.binary_search(&crate::csum_map::region_of(block)).is_ok();
        Ok(match csum_table::entry(self.table, io, block).await? {
            None => None,
            Some(want) if want == crc(data) => Some(false),
            Some(_) if open => None,
            Some(_) => Some(true),
        })
    }
}

/// The data blocks the image records as having failed their checksum at
/// run time (`DataError`): each one that its file still names, and that
/// still fails, is damage. One freed since is forgotten with its free.
async fn check_recorded_errors(io: &Io, checked: &Checked<'_>, report: &mut FsckReport) -> FsResult<()> {
    let state = checked.state;
    report.data_errors_recorded = state.data_errors().len() as u64;
    for (&block, at) in state.data_errors() {
        let Some(node) = state.node(at.ino) else { continue };
        let named = node.extents.written_from(FileBlock::new(at.file_block));
        if named.is_none_or(|e| e.file_block.get() != at.file_block || e.disk_block.get() != block) {
            continue;
        }
        let data = io.read_blocks(DevBlock::new(block), 1).await?;
        if checked.fails(io, block, &data).await? != Some(true) {
            continue;
        }
        let detail = format!(
            "inode {} at offset {} (device block {block}): recorded as failing its checksum at run time, \
             and still does",
            at.ino,
            FileBlock::new(at.file_block).offset()
        );
        report.problems.push(problem("data-checksum-recorded", detail, false));
    }
    Ok(())
}

/// Data blocks whose mismatch fsck names one by one.
const BAD_DATA_BLOCKS_LISTED: usize = 32;
/// Data blocks read at once by `check_data`.
const DATA_READ_BLOCKS: u64 = 256;

/// Every written block of every file against its checksum (a block
/// several files share, once), then every block only snapshots hold.
/// Reads in bounded pieces; names the first mismatches with inode and
/// offset (or as a snapshot's), and counts the rest. A block whose table
/// sector is bad is counted apart (the table check names the sector).
async fn check_data(io: &Io, checked: &Checked<'_>, report: &mut FsckReport) -> FsResult<()> {
    let mut tally = DataTally::default();
    // A block several files name is read with the first of them.
    let mut seen = SeenShared::default();
    for node in checked.state.nodes() {
        for e in node.extents.iter().filter(|e| !e.unwritten) {
            let mut done = 0;
            while done < e.len {
                let rest = BlockRun { start: e.disk_block.get() + done, len: e.len - done };
                let next = seen.next_read(checked.shared, rest);
                let from = done + next.skip;
                let run = BlockRun { start: rest.start + next.skip, len: next.read };
                let name =
                    |i: u64| format!("inode {} at offset {}", node.inode.ino, (e.file_block + from + i).offset());
                check_run(io, checked, run, name, &mut tally, report).await?;
                done = from + next.read;
            }
        }
    }
    check_snapshot_data(io, checked, &mut tally, report).await?;
    tally.finish(report);
    Ok(())
}

/// Every block that snapshots hold and no file names, once however many
/// hold it: what a guest reads later through a snapshot or a clone of
/// it. (Those a file names were read with the file.)
async fn check_snapshot_data(
    io: &Io,
    checked: &Checked<'_>,
    tally: &mut DataTally,
    report: &mut FsckReport,
) -> FsResult<()> {
    let mut at = 0;
    while let Some((run, named)) = checked.snapshots.next_held_piece(checked.shared, at, DATA_READ_BLOCKS) {
        if !named {
            let name = |_| "a block only snapshots hold".to_string();
            check_run(io, checked, run, name, tally, report).await?;
        }
        at = run.end();
    }
    Ok(())
}

/// What the data checks found: blocks that fail, and blocks that could
/// not be checked.
#[derive(Default)]
struct DataTally {
    bad: u64,
    unverifiable: u64,
}

impl DataTally {
    fn finish(self, report: &mut FsckReport) {
        if self.bad as usize > BAD_DATA_BLOCKS_LISTED {
            let more = self.bad as usize - BAD_DATA_BLOCKS_LISTED;
            let detail = format!("{more} more data blocks do not match their checksums");
            report.problems.push(problem("data-checksum", detail, false));
        }
        report.data_blocks_unverifiable += self.unverifiable;
    }
}

/// Check the blocks of `run`, in reads of at most [`DATA_READ_BLOCKS`];
/// `name(i)` says whose block `i` of it is, for the first mismatches.
async fn check_run(
    io: &Io,
    checked: &Checked<'_>,
    run: BlockRun,
    name: impl Fn(u64) -> String,
    tally: &mut DataTally,
    report: &mut FsckReport,
) -> FsResult<()> {
    let mut done = 0;
    while done < run.len {
        let n = (run.len - done).min(DATA_READ_BLOCKS);
        let data = io.read_blocks(DevBlock::new(run.start + done), n as usize).await?;
        for (i, block) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            let disk = run.start + done + i as u64;
            report.data_blocks_checked += 1;
            match checked.fails(io, disk, block).await? {
                None => tally.unverifiable += 1,
                Some(false) => {}
                Some(true) => {
                    tally.bad += 1;
                    if tally.bad as usize <= BAD_DATA_BLOCKS_LISTED {
                        let detail = format!(
                            "{} (device block {disk}): the data does not match its checksum",
                            name(done + i as u64)
                        );
                        report.problems.push(problem("data-checksum", detail, false));
                    }
                }
            }
        }
        done += n;
    }
    Ok(())
}

/// Table blocks with bad sectors that fsck names one by one.
const BAD_TABLE_BLOCKS_LISTED: usize = 16;

/// Every sector of the data checksum table against its own crc. A bad
/// sector vouches for none of the 127 blocks it covers: reads of them
/// fail until `--repair` rebuilds it from the data. (A bad sector of
/// the dirty-region map stands for its regions open; `--repair` rewrites
/// the map.)
async fn check_csum_table(io: &Io, sb: &Superblock, report: &mut FsckReport) -> FsResult<()> {
    let (listed, count) = csum_table::bad_table_sectors(io, sb, BAD_TABLE_BLOCKS_LISTED).await?;
    for (table_block, sectors) in &listed {
        let detail = format!(
            "data checksum table block {table_block} (device block {}): sectors {sectors:#010b} fail their crc",
            sb.csum_table_start() + table_block
        );
        report.problems.push(problem("csum-table-sector", detail, true));
    }
    if count > listed.len() as u64 {
        let detail = format!("{} more data checksum table blocks have bad sectors", count - listed.len() as u64);
        report.problems.push(problem("csum-table-sector", detail, true));
    }
    Ok(())
}

/// A count per inode, for fsck's passes over millions of them: an array
/// indexed by inode number when the numbers are dense (as keelfs hands
/// them out: 4 bytes per inode), a map when an image scatters them.
enum PerInode {
    Dense(Vec<u32>),
    Sparse(keelfs_base::IdMapBy<Ino, u32>),
}

impl PerInode {
    fn for_state(state: &State) -> Self {
        let count = state.inode_count() as u64;
        match usize::try_from(state.next_ino) {
            Ok(n) if state.next_ino <= 4 * count + 4096 => PerInode::Dense(vec![0; n]),
            _ => PerInode::Sparse(Default::default()),
        }
    }

    fn get(&self, ino: Ino) -> u32 {
        match self {
            PerInode::Dense(v) => usize::try_from(ino.get()).ok().and_then(|i| v.get(i)).copied().unwrap_or(0),
            PerInode::Sparse(m) => m.get(&ino).copied().unwrap_or(0),
        }
    }

    /// Add one to `ino`'s count, returning the count before.
    fn bump(&mut self, ino: Ino) -> u32 {
        let slot = match self {
            // Every inode of the state is below next_ino.
            PerInode::Dense(v) => &mut v[usize::try_from(ino.get()).expect("an inode of the state")],
            PerInode::Sparse(m) => m.entry(ino).or_default(),
        };
        let before = *slot;
        *slot = slot.saturating_add(1);
        before
    }
}

fn check_state(
    state: &State,
    free: &FreeSpace,
    (sb, snapshots): (&Superblock, &journal::Snapshots),
    recorded_free: u64,
    report: &mut FsckReport,
) {
    let alloc = &free.alloc;
    report.inodes = state.inode_count() as u64;
    report.free_blocks = alloc.free_blocks();
    let mut names_of = PerInode::for_state(state);
    let mut subdirs: HashMap<Ino, u32> = HashMap::new();
    let mut parents: HashMap<Ino, Vec<Ino>> = HashMap::new();
    for node in state.nodes() {
        report.data_blocks_used += node.extents.blocks();
        if node.inode.nlink == 0 {
            report.orphans += 1;
        }
        let Some(dir) = &node.dir else { continue };
        report.directories += 1;
        for (_, name, child) in dir.entries_from(0) {
            let Some(target) = state.node(child) else {
                let detail = format!(
                    "entry '{}' in directory {} names missing inode {child}",
                    String::from_utf8_lossy(name),
                    node.inode.ino
                );
                report.problems.push(problem("dangling-entry", detail, true));
                continue;
            };
            names_of.bump(child);
            if target.inode.is_dir() {
                *subdirs.entry(node.inode.ino).or_default() += 1;
                parents.entry(child).or_default().push(node.inode.ino);
            }
        }
    }
    // Snapshots hold a name on each block of theirs; a block named by
    // several extents or snapshots is used once.
    report.data_blocks_used += snapshots.held_runs().map(|r| r.len).sum::<u64>();
    report.data_blocks_used = report.data_blocks_used.saturating_sub(free.shared.saved_blocks());
    check_links(state, &names_of, &subdirs, &parents, report);
    check_connectivity(state, report);
    let snapshot_metadata =
        snapshots.checkpoint_runs_besides(sb.checkpoint_seq).chain(sb.snapshot_table.iter().copied());
    let cp_blocks = sb.checkpoint_blocks() + snapshot_metadata.map(|r| r.len).sum::<u64>();
    let expected_free = alloc.total_blocks().saturating_sub(report.data_blocks_used + cp_blocks);
    if alloc.free_blocks() != expected_free {
        let detail = format!("free index has {} blocks, extents leave {expected_free}", alloc.free_blocks());
        report.problems.push(problem("free-space", detail, true));
    }
    let kept = snapshots.retains(sb.checkpoint_seq);
    let computed_free = alloc.free_blocks() + if kept { 0 } else { sb.free_count_checkpoint_blocks() };
    if recorded_free != computed_free {
        let detail = format!("recorded free count {recorded_free}, computed {computed_free}");
        report.problems.push(problem("free-count", detail, true));
    }
    for node in state.nodes() {
        let mut last_end = FileBlock::new(0);
        for e in node.extents.iter() {
            if e.file_block < last_end {
                report.problems.push(problem(
                    "extent-overlap",
                    format!("inode {} has overlapping extents", node.inode.ino),
                    false,
                ));
            }
            last_end = e.file_end();
        }
        if node.inode.is_symlink() && node.symlink().is_none() {
            report.problems.push(problem("symlink", format!("symlink {} has no target", node.inode.ino), false));
        }
    }
}

fn check_links(
    state: &State,
    names_of: &PerInode,
    subdirs: &HashMap<Ino, u32>,
    parents: &HashMap<Ino, Vec<Ino>>,
    report: &mut FsckReport,
) {
    for node in state.nodes() {
        let ino = node.inode.ino;
        let names = names_of.get(ino);
        // (The root has no name; with no links it is not an orphan but
        // damage, which mount refuses.)
        if node.inode.nlink == 0 && names == 0 && ino != ROOT_INO {
            continue; // an orphan, freed at mount
        }
        let expected = if node.inode.is_dir() {
            if ino != ROOT_INO && names != 1 {
                report.problems.push(problem("directory-names", format!("directory {ino} has {names} names"), false));
            }
            if let Some(p) = parents.get(&ino).and_then(|p| p.first()) {
                if node.dir.as_ref().is_some_and(|d| d.parent != *p) {
                    report.problems.push(problem("dotdot", format!("directory {ino}'s '..' is wrong"), false));
                }
            }
            2 + subdirs.get(&ino).copied().unwrap_or(0)
        } else {
            names
        };
        if node.inode.nlink != expected {
            let detail = format!("inode {ino} has link count {}, expected {expected}", node.inode.nlink);
            report.problems.push(problem("link-count", detail, true));
        }
    }
}

fn check_connectivity(state: &State, report: &mut FsckReport) {
    // A walk from the root that queues only directories: files are marked
    // where they are found, so the queue holds directories, not files.
    let mut seen = PerInode::for_state(state);
    let mut dirs = vec![ROOT_INO];
    if state.node(ROOT_INO).is_some() {
        seen.bump(ROOT_INO);
    }
    while let Some(ino) = dirs.pop() {
        let Some(dir) = state.node(ino).and_then(|n| n.dir.as_ref()) else { continue };
        for (_, _, child) in dir.entries_from(0) {
            let Some(node) = state.node(child) else { continue };
            if seen.bump(child) == 0 && node.dir.is_some() {
                dirs.push(child);
            }
        }
    }
    for node in state.nodes() {
        if node.inode.nlink > 0 && seen.get(node.inode.ino) == 0 {
            let detail = format!("inode {} is not reachable from the root", node.inode.ino);
            report.problems.push(problem("disconnected", detail, false));
        }
    }
}

/// Fix what can be fixed: link counts, dangling entries, and whatever a
/// fresh checkpoint rewrites (free counts, a bad superblock copy). Returns
/// the report of a check run after the repair.
pub async fn repair(dev: DeviceChannel, mut progress: impl FnMut(&str)) -> FsResult<FsckReport> {
    let before = fsck(dev.clone(), &mut progress).await?;
    if before.problems.iter().any(|p| !p.repairable) {
        return Err(FsError::Corrupt(format!(
            "damage that --repair cannot fix: {}",
            before.problems.iter().filter(|p| !p.repairable).map(|p| p.detail.as_str()).collect::<Vec<_>>().join("; ")
        )));
    }
    progress("repair");
    let fs = Fs::mount(dev.clone(), FsConfig::default()).await?;
    let mut repaired = Vec::new();
    fix_entries_and_links(&fs, &mut repaired)?;
    rebuild_table_sectors(&fs, &mut repaired).await?;
    // Two checkpoints write both superblock slots.
    fs.admin().checkpoint().await?;
    fs.unmount().await?;
    repaired.push("rewrote the checkpoint and both superblock copies".to_string());
    let mut after = fsck(dev, &mut progress).await?;
    after.repaired = repaired;
    Ok(after)
}

/// Table blocks whose rebuilt sectors `--repair` names one by one.
const REBUILT_TABLE_BLOCKS_LISTED: u64 = 16;
/// Rebuilt table blocks held in memory before a checkpoint writes them
/// back (4 MiB).
const REBUILT_DIRTY_MAX: usize = 1024;

/// Rebuild every sector of the data checksum table's entries that fails
/// its crc, from the data of the 127 blocks it covers as the device holds
/// them now (btrfs's `check --init-csum-tree`, for a sector): every entry,
/// written block or not, since an entry of a free or unwritten block is
/// never read. The price, which the report states: a block under such a
/// sector whose data went bad is vouched for from now on. A bounded piece
/// of the table at a time; a checkpoint writes them back (the repair's
/// own, at the end, writes the last). Then the dirty-region map, if any
/// of its sectors fails.
async fn rebuild_table_sectors(fs: &Fs, repaired: &mut Vec<String>) -> FsResult<()> {
    let inner = fs.inner();
    let Some(table) = &inner.csums else { return Ok(()) };
    let sb = inner.journal.sb.borrow().clone();
    let entry_blocks = crate::format::csum_entry_blocks_for(sb.total_blocks);
    let (mut at, mut rebuilt) = (0, 0u64);
    while at < entry_blocks {
        let (bad, next) = csum_table::bad_sectors_from(&inner.io, &sb, at, entry_blocks).await?;
        for &(table_block, sectors) in &bad {
            for sector in (0..CSUM_SECTORS_PER_BLOCK as usize).filter(|s| sectors & (1 << s) != 0) {
                let crcs = sector_crcs_from_data(&inner.io, &sb, table_block, sector).await?;
                table.borrow_mut().rebuild_sector(table_block, sector, &crcs);
            }
            rebuilt += 1;
            if rebuilt <= REBUILT_TABLE_BLOCKS_LISTED {
                repaired.push(format!(
                    "rebuilt data checksum table block {table_block} (sectors {sectors:#010b}) from the data it \
                     covers: a block there that had gone bad now passes its check"
                ));
            }
        }
        if table.borrow().dirty_blocks() >= REBUILT_DIRTY_MAX {
            fs.admin().checkpoint().await?;
        }
        at = next;
    }
    if rebuilt > REBUILT_TABLE_BLOCKS_LISTED {
        repaired.push(format!(
            "rebuilt {} more data checksum table blocks the same way",
            rebuilt - REBUILT_TABLE_BLOCKS_LISTED
        ));
    }
    rewrite_bad_map(fs, &sb, entry_blocks, repaired).await
}

/// Rewrite the dirty-region map whole if any of its sectors fails its
/// crc. The mount took such a sector's regions as open, and set the
/// entries of their blocks from the data; it rewrites the map itself only
/// when one of them was a region the table has, which a sector covering
/// only regions past the table's end never is.
async fn rewrite_bad_map(fs: &Fs, sb: &Superblock, entry_blocks: u64, repaired: &mut Vec<String>) -> FsResult<()> {
    let inner = fs.inner();
    let (mut at, mut bad_blocks) = (entry_blocks, 0u64);
    while at < sb.csum_table_blocks {
        let (bad, next) = csum_table::bad_sectors_from(&inner.io, sb, at, sb.csum_table_blocks).await?;
        bad_blocks += bad.len() as u64;
        at = next;
    }
    if bad_blocks > 0 {
        crate::csum_map::rewrite_map(inner).await?;
        repaired.push(format!(
            "rewrote the data checksum table's dirty-region map ({bad_blocks} of its blocks had sectors that \
             failed their crc; their regions' entries were set from the data)"
        ));
    }
    Ok(())
}

/// The crc32c of each of the 127 device blocks sector `sector` of table
/// block `table_block` covers, read from the device; zero for a block
/// outside the data area (the superblocks, journal and table, and past
/// the device's end), whose entry nothing reads.
async fn sector_crcs_from_data(
    io: &Io,
    sb: &Superblock,
    table_block: u64,
    sector: usize,
) -> FsResult<[u32; CSUMS_PER_SECTOR as usize]> {
    let first = table_block * CSUMS_PER_TABLE_BLOCK + sector as u64 * CSUMS_PER_SECTOR;
    let data = sb.data_start()..sb.total_blocks;
    let (start, end) = (first.max(data.start), (first + CSUMS_PER_SECTOR).min(data.end));
    let mut crcs = [0u32; CSUMS_PER_SECTOR as usize];
    if start < end {
        let blocks = io.read_blocks(DevBlock::new(start), (end - start) as usize).await?;
        for (i, block) in blocks.chunks_exact(BLOCK_BYTES).enumerate() {
            crcs[(start - first) as usize + i] = crc(block);
        }
    }
    Ok(crcs)
}

fn fix_entries_and_links(fs: &Fs, repaired: &mut Vec<String>) -> FsResult<()> {
    let inner = fs.inner();
    let (dangling, counts) = {
        let state = inner.meta.state();
        let mut dangling = Vec::new();
        let mut names: HashMap<Ino, u32> = HashMap::new();
        let mut subdirs: HashMap<Ino, u32> = HashMap::new();
        for node in state.nodes() {
            let Some(dir) = &node.dir else { continue };
            for (_, name, child) in dir.entries_from(0) {
                match state.node(child) {
                    None => dangling.push((node.inode.ino, name.to_vec())),
                    Some(c) => {
                        *names.entry(child).or_default() += 1;
                        if c.inode.is_dir() {
                            *subdirs.entry(node.inode.ino).or_default() += 1;
                        }
                    }
                }
            }
        }
        let counts: Vec<(Ino, u32)> = state
            .nodes()
            .filter(|n| n.inode.nlink != 0 || names.contains_key(&n.inode.ino))
            .map(|n| {
                let ino = n.inode.ino;
                let want = if n.inode.is_dir() {
                    2 + subdirs.get(&ino).copied().unwrap_or(0)
                } else {
                    names.get(&ino).copied().unwrap_or(0)
                };
                (ino, want)
            })
            .filter(|(ino, want)| state.node(*ino).is_some_and(|n| n.inode.nlink != *want))
            .collect();
        (dangling, counts)
    };
    for (dir, name) in dangling {
        inner.change().log(Record::DirentDelete { dir, name: Cow::Borrowed(&name[..]) })?;
        repaired.push(format!("removed entry '{}' from directory {dir}", String::from_utf8_lossy(&name)));
    }
    for (ino, want) in counts {
        inner.change().update_inode(ino, |i| i.nlink = want)?;
        repaired.push(format!("set link count of inode {ino} to {want}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::Allocator;
    use crate::format::Timespec;
    use crate::format::{Inode, S_IFDIR};
    use crate::state::{ApplyMode, FIRST_COOKIE};

    /// A root, a directory in it, a file in that, and a file with a link
    /// count but no name: (root, dir, named file, nameless file).
    fn tree(inos: [u64; 4]) -> State {
        let mut s = State::default();
        let mut free = FreeSpace::new(Allocator::new(100, 1000, 1));
        let [root, dir, named, nameless] = inos.map(Ino::new);
        let mut apply = |r: Record| s.apply(&r, ApplyMode::Replay, &mut free).expect("applies");
        apply(Record::InodeSet(Inode::new(root, S_IFDIR | 0o755, 0, 0, 0, Timespec::default())));
        apply(Record::InodeSet(Inode::new(dir, S_IFDIR | 0o755, 0, 0, 0, Timespec::default())));
        for ino in [named, nameless] {
            apply(Record::InodeSet(Inode::new(ino, libc::S_IFREG | 0o644, 0, 0, 0, Timespec::default())));
        }
        apply(Record::DirentSet { dir: root, name: b"d".to_vec().into(), ino: dir, cookie: FIRST_COOKIE });
        apply(Record::DirentSet { dir, name: b"f".to_vec().into(), ino: named, cookie: FIRST_COOKIE });
        s
    }

    fn disconnected(state: &State) -> Vec<String> {
        let mut report = FsckReport::default();
        check_connectivity(state, &mut report);
        report.problems.into_iter().map(|p| p.detail).collect()
    }

    /// Inode numbers as keelfs hands them out are counted in an array;
    /// scattered ones (a crafted image) in a map, never in an array as
    /// long as the largest number. Both find the same damage.
    #[test]
    fn connectivity_is_found_with_dense_and_scattered_inode_numbers() {
        let dense = tree([ROOT_INO.get(), 2, 3, 4]);
        assert!(matches!(PerInode::for_state(&dense), PerInode::Dense(ref v) if v.len() == 5));
        assert_eq!(disconnected(&dense), ["inode 4 is not reachable from the root"]);

        let scattered = tree([ROOT_INO.get(), 5_000_000, 9_000_000, 7_777_777]);
        assert!(matches!(PerInode::for_state(&scattered), PerInode::Sparse(_)));
        assert_eq!(disconnected(&scattered), ["inode 7777777 is not reachable from the root"]);
    }

    #[test]
    fn per_inode_counts_saturate_instead_of_wrapping() {
        let mut counts = PerInode::Dense(vec![u32::MAX - 1; 3]);
        assert_eq!(counts.bump(Ino::new(2)), u32::MAX - 1);
        assert_eq!(counts.bump(Ino::new(2)), u32::MAX);
        assert_eq!(counts.get(Ino::new(2)), u32::MAX);
        assert_eq!(counts.get(Ino::new(99)), 0, "past the array is a count of 0");
    }
}
