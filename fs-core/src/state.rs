//! The in-memory metadata: every inode with its extents, xattrs, symlink
//! target and directory entries, plus free space. All changes go through
//! [`State::apply`], so the live path, journal replay and checkpoint
//! loading share one implementation.

use std::borrow::Cow;
use std::collections::BTreeMap;

use super::blocks::{DevBlock, FileBlock};
use super::codec::Writer;
pub use super::dir::{Directory, FIRST_COOKIE};
use super::extent::ExtentMap;
use super::format::{BlockRun, Inode, COUNTER_MAX};
use super::ids::Ino;
use super::node_table::NodeTable;
use super::ops::MAX_FILE_BYTES;
use super::record::{Record, DATA_ERRORS_MAX};
use super::space::FreeSpace;

/// Inode numbers stay below this (an image naming a larger one is
/// refused), so the next-inode counter can never wrap onto the root.
pub const INO_MAX: u64 = COUNTER_MAX;

#[derive(Clone, Debug)]
pub struct Node {
    pub inode: Inode,
    /// Runtime references, never persisted: kernel lookups not yet
    /// forgotten, and open handles. An unlinked inode lives until both are 0.
    pub lookups: RefCount,
    pub opens: RefCount,
    /// Runtime only: someone read i_version since it last changed, so the
    /// next change must bump it (Linux's multigrain rule).
    pub i_version_queried: bool,
    /// Runtime only: someone read the attributes (and so the timestamps)
    /// since the last data write stamped them, so the next write must show
    /// a new ctime even within one clock tick (multigrain, as in Linux).
    pub times_queried: std::cell::Cell<bool>,
    /// Runtime only: a change fdatasync must commit (size or block map),
    /// as opposed to timestamps alone.
    pub datasync_needed: bool,
    /// Runtime only: the epoch of the last snapshot that encoded this node,
    /// or the epoch current when it was made (see [`Snapshot`]).
    pub snapshot_epoch: u32,
    pub extents: ExtentMap,
    /// Boxed: most inodes are not directories, and a directory's tables
    /// inline would cost every file their size.
    pub dir: Option<Box<Directory>>,
    /// Boxed, and made on first use: few inodes have xattrs or a target,
    /// and a node not written since mount has no write state (issue 34:
    /// memory per file). One box for the three: a written file pays for
    /// two empty fields, and every node saves a pointer.
    extras: Option<Box<Extras>>,
}

/// A runtime reference count in 32 bits (a node is resident for every
/// file). A count that would pass the top sticks there: the inode then
/// lives until unmount, rather than being freed while a holder that the
/// count lost track of still names it. Only a client's own endless
/// lookups can get it there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefCount(u32);

impl RefCount {
    pub const ZERO: RefCount = RefCount(0);

    pub fn is_zero(self) -> bool {
        self.0 == 0
    }

    pub fn add(&mut self, n: u64) {
        self.0 = u32::try_from(u64::from(self.0).saturating_add(n)).unwrap_or(u32::MAX);
    }

    /// The count, or None once it has stuck at the top.
    pub fn count(self) -> Option<u64> {
        (self.0 != u32::MAX).then_some(u64::from(self.0))
    }

    /// Drop `n`, at most to 0; a stuck count stays.
    pub fn sub(&mut self, n: u64) {
        if self.0 != u32::MAX {
            self.0 = u32::try_from(u64::from(self.0).saturating_sub(n)).expect("below a u32");
        }
    }
}

/// What few inodes have: xattrs, a symlink's target, and the state of
/// writes since mount.
#[derive(Clone, Debug, Default)]
pub struct Extras {
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    pub symlink: Option<Vec<u8>>,
    pub writes: WriteState,
}

/// Runtime only: the state of writes to a file. Kept for the node's life
/// once made, so a counter never starts again from 0 under a reader that
/// saw it.
#[derive(Clone, Debug, Default)]
pub struct WriteState {
    /// The size to log while buffered data past it is not yet written
    /// back, so a logged size never covers unwritten data.
    pub persist_size_cap: Option<u64>,
    /// Direct writes past the end of file in flight (start -> end), and
    /// the furthest end of those that completed.
    pub extends_in_flight: BTreeMap<u64, u64>,
    pub extends_done: u64,
    /// Moves when a direct write of the file starts and when it ends. A
    /// page read from the device may be cached only if this did not move
    /// while it was read: a direct overwrite (shared range lock) can run
    /// beside the read, which may then hold the old data.
    pub direct_epoch: u64,
}

static NO_EXTRAS: Extras = Extras {
    xattrs: BTreeMap::new(),
    symlink: None,
    writes: WriteState { persist_size_cap: None, extends_in_flight: BTreeMap::new(), extends_done: 0, direct_epoch: 0 },
};

impl Node {
    fn new(inode: Inode, snapshot_epoch: u32) -> Self {
        let dir = inode.is_dir().then(|| Box::new(Directory::new(inode.ino)));
        Node {
            inode,
            lookups: RefCount::ZERO,
            opens: RefCount::ZERO,
            i_version_queried: false,
            times_queried: std::cell::Cell::new(false),
            datasync_needed: false,
            snapshot_epoch,
            extents: ExtentMap::default(),
            dir,
            extras: None,
        }
    }

    pub fn xattrs(&self) -> &BTreeMap<Vec<u8>, Vec<u8>> {
        &self.extras.as_deref().unwrap_or(&NO_EXTRAS).xattrs
    }

    pub fn symlink(&self) -> Option<&[u8]> {
        self.extras.as_deref().and_then(|e| e.symlink.as_deref())
    }

    fn extras_mut(&mut self) -> &mut Extras {
        self.extras.get_or_insert_with(Default::default)
    }

    pub fn writes(&self) -> &WriteState {
        &self.extras.as_deref().unwrap_or(&NO_EXTRAS).writes
    }

    /// The write state, made if this is the first write.
    pub fn writes_mut(&mut self) -> &mut WriteState {
        &mut self.extras_mut().writes
    }

    /// The write state if it was made (the file was written, or has
    /// extras), for changes that only undo or lower what a write set.
    pub fn writes_if_any(&mut self) -> Option<&mut WriteState> {
        self.extras.as_deref_mut().map(|e| &mut e.writes)
    }
}

// A node is resident for every file: 144 bytes, kept densely in the node
// table's pages (it was 280 bytes, boxed in a hash map, before issue 34).
const _: () = assert!(std::mem::size_of::<Node>() <= 144, "a node is resident for every file");

/// A finished snapshot's records: the inodes' part, then the entries'.
/// Kept as two parts so that writing them out copies neither (at 1M
/// files they are 167 MB).
pub struct SnapshotBytes {
    pub inodes: Vec<u8>,
    pub entries: Vec<u8>,
}

impl SnapshotBytes {
    pub fn len(&self) -> usize {
        self.inodes.len() + self.entries.len()
    }

    /// Both parts in one buffer (for tests).
    #[cfg(test)]
    pub fn to_vec(&self) -> Vec<u8> {
        [&self.inodes[..], &self.entries[..]].concat()
    }
}

/// A checkpoint's snapshot of the state as it was when the snapshot
/// started, encoded in pieces while the state goes on changing: a node is
/// encoded by [`State::snapshot_step`], or just before its first change
/// after the start, whichever comes first (copy before write). Nodes made
/// after the start are not in it; the journal after the start holds them.
pub struct Snapshot {
    epoch: u32,
    /// Inode numbers present at the start, not yet visited (last first).
    to_visit: Vec<Ino>,
    /// NextIno, then each inode's image, symlink, xattrs and extents.
    inodes: Writer,
    /// Directory entries: loaded after every inode, so that each entry
    /// finds its directory and a subdirectory its parent.
    entries: Writer,
}

impl Snapshot {
    fn encode(&mut self, node: &mut Node) {
        debug_assert_ne!(node.snapshot_epoch, self.epoch, "a node is encoded once per snapshot");
        node.snapshot_epoch = self.epoch;
        let ino = node.inode.ino;
        let w = &mut self.inodes;
        Record::InodeSet(node.inode.clone()).encode(w);
        if let Some(target) = node.symlink() {
            Record::Symlink { ino, target: Cow::Borrowed(target) }.encode(w);
        }
        for (name, value) in node.xattrs() {
            Record::XattrSet { ino, name: Cow::Borrowed(name), value: Cow::Borrowed(value) }.encode(w);
        }
        for e in node.extents.iter() {
            let (file_block, disk_block, len, unwritten) = (e.file_block.get(), e.disk_block.get(), e.len, e.unwritten);
            Record::ExtentMap { ino, file_block, disk_block, len, unwritten }.encode(w);
        }
        if let Some(dir) = &node.dir {
            for (cookie, name, child) in dir.entries_from(0) {
                Record::DirentSet { dir: ino, name: Cow::Borrowed(name), ino: child, cookie }.encode(&mut self.entries);
            }
        }
    }
}

/// Whether a change is made live (freed blocks wait for the commit that
/// frees them) or replayed from disk (allocator claims and frees at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyMode {
    Live,
    Replay,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("inconsistent metadata record: {0}")]
pub struct ApplyError(pub String);

pub struct State {
    /// Private: every change goes through [`State::node_mut`] or
    /// [`State::apply`].
    nodes: NodeTable<Node>,
    pub next_ino: u64,
    /// The snapshot being encoded, if any, and the epoch of the last one
    /// started (nodes made meanwhile carry it, so it skips them).
    snapshot: Option<Snapshot>,
    epoch: u32,
    /// The scrub in progress, as its last `ScrubCursor` record left it.
    pub scrub: Option<ScrubSaved>,
    /// Data blocks that failed their checksum at run time (`DataError`
    /// records), by device block; at most `DATA_ERRORS_MAX`.
    data_errors: BTreeMap<u64, DataErrorAt>,
}

/// Where a recorded bad data block was found: the inode and file block
/// that named it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataErrorAt {
    pub ino: Ino,
    pub file_block: u64,
}

/// Where a scrub stands, kept in the state so that checkpoints carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScrubSaved {
    pub ino: Ino,
    pub file_block: u64,
    pub bytes_per_sec: u64,
}

fn err<T>(msg: String) -> Result<T, ApplyError> {
    Err(ApplyError(msg))
}

/// No inodes yet; the first one made is 2 (the root is made as 1).
impl Default for State {
    fn default() -> Self {
        Self {
            nodes: NodeTable::default(),
            next_ino: 2,
            snapshot: None,
            epoch: 0,
            scrub: None,
            data_errors: BTreeMap::new(),
        }
    }
}

impl State {
    pub fn node(&self, ino: Ino) -> Option<&Node> {
        self.nodes.get(ino)
    }

    /// How many inodes there are.
    pub fn inode_count(&self) -> usize {
        self.nodes.len()
    }

    /// Every inode, in no particular order.
    pub fn nodes(&self) -> impl Iterator<Item = &Node> + '_ {
        self.nodes.values()
    }

    /// The data blocks recorded as failing their checksum, by device
    /// block.
    pub fn data_errors(&self) -> &BTreeMap<u64, DataErrorAt> {
        &self.data_errors
    }

    pub fn node_mut(&mut self, ino: Ino) -> Option<&mut Node> {
        self.before_change(ino);
        self.nodes.get_mut(ino)
    }

    /// Copy before write: a snapshot in progress encodes `ino` as it is now,
    /// before the caller changes it, unless it has already.
    fn before_change(&mut self, ino: Ino) {
        let Some(snapshot) = self.snapshot.as_mut() else { return };
        if let Some(node) = self.nodes.get_mut(ino) {
            if node.snapshot_epoch != snapshot.epoch {
                snapshot.encode(node);
            }
        }
    }

    /// Start a snapshot of the state as it is now.
    ///
    /// # Panics
    /// If one is in progress.
    /// Returns the snapshot's epoch, which names it.
    /// Whether a checkpoint's snapshot is being encoded.
    pub fn in_snapshot(&self) -> bool {
        self.snapshot.is_some()
    }

    pub fn start_snapshot(&mut self) -> u32 {
        assert!(self.snapshot.is_none(), "one snapshot at a time");
        if self.epoch == u32::MAX {
            // Once in 2^32 snapshots: no node may keep an epoch the new
            // one could be mistaken for.
            self.nodes.values_mut().for_each(|n| n.snapshot_epoch = 0);
            self.epoch = 0;
        }
        self.epoch += 1;
        let mut to_visit: Vec<Ino> = self.nodes.keys().collect();
        // Descending, so that popping visits in ascending order.
        to_visit.sort_unstable_by(|a, b| b.cmp(a));
        let mut inodes = Writer::new();
        Record::NextIno { next: self.next_ino }.encode(&mut inodes);
        if let Some(s) = self.scrub {
            Record::ScrubCursor { ino: s.ino.get(), file_block: s.file_block, bytes_per_sec: s.bytes_per_sec }
                .encode(&mut inodes);
        }
        for (&block, at) in &self.data_errors {
            Record::DataError { block, ino: at.ino.get(), file_block: at.file_block }.encode(&mut inodes);
        }
        self.snapshot = Some(Snapshot { epoch: self.epoch, to_visit, inodes, entries: Writer::new() });
        self.epoch
    }

    /// Encode up to `nodes` more nodes of the snapshot in progress. True
    /// when every node is encoded.
    ///
    /// # Panics
    /// If no snapshot is in progress.
    pub fn snapshot_step(&mut self, nodes: usize) -> bool {
        let snapshot = self.snapshot.as_mut().expect("a snapshot in progress");
        for _ in 0..nodes {
            let Some(ino) = snapshot.to_visit.pop() else { break };
            // Gone since the start: encoded before it went.
            if let Some(node) = self.nodes.get_mut(ino) {
                if node.snapshot_epoch != snapshot.epoch {
                    snapshot.encode(node);
                }
            }
        }
        snapshot.to_visit.is_empty()
    }

    /// The finished snapshot's records: every record needed to rebuild
    /// the state as it was at [`State::start_snapshot`].
    ///
    /// # Panics
    /// If none is in progress, or nodes are left to encode.
    pub fn finish_snapshot(&mut self) -> SnapshotBytes {
        let snapshot = self.snapshot.take().expect("a snapshot in progress");
        assert!(snapshot.to_visit.is_empty(), "every node encoded before the snapshot finishes");
        SnapshotBytes { inodes: snapshot.inodes.buf, entries: snapshot.entries.buf }
    }

    /// Drop the snapshot in progress, if any.
    pub fn abort_snapshot(&mut self) {
        self.snapshot = None;
    }
}

/// Runs a record unmapped: what loses its last name is freed, at the
/// next commit when live, at once when replayed (the commit that freed it
/// is on disk).
/// A block freed is no longer bad data of anyone's: its `DataError`
/// record goes with it, the same way live and at replay.
fn release(free: &mut FreeSpace, errors: &mut BTreeMap<u64, DataErrorAt>, runs: Vec<BlockRun>, mode: ApplyMode) {
    let FreeSpace { alloc, pending_free, shared, .. } = free;
    for run in runs.into_iter().filter(|r| r.len > 0) {
        shared.release(run, |gone| {
            if !errors.is_empty() {
                errors.retain(|&block, _| !(gone.start..gone.end()).contains(&block));
            }
            match mode {
                ApplyMode::Live => pending_free.push(gone),
                ApplyMode::Replay => alloc.free(gone),
            }
        });
    }
}

impl State {
    fn apply_inode_free(&mut self, ino: Ino, mode: ApplyMode, free: &mut FreeSpace) -> Result<(), ApplyError> {
        self.before_change(ino);
        let Some(node) = self.nodes.remove(ino) else {
            return if mode == ApplyMode::Replay { Ok(()) } else { err(format!("free of missing inode {ino}")) };
        };
        let runs = node.extents.iter().map(|e| BlockRun { start: e.disk_block.get(), len: e.len }).collect();
        release(free, &mut self.data_errors, runs, mode);
        Ok(())
    }

    fn apply_dirent_set(&mut self, dir: Ino, name: &[u8], ino: Ino, cookie: u64) -> Result<(), ApplyError> {
        // Cookies count up from FIRST_COOKIE per directory; one at the
        // counter limit comes from a crafted image.
        if !(FIRST_COOKIE..COUNTER_MAX).contains(&cookie) {
            return err(format!("entry of {dir} with cookie {cookie} outside {FIRST_COOKIE}..{COUNTER_MAX}"));
        }
        self.before_change(dir);
        let Some(d) = self.nodes.get_mut(dir).and_then(|n| n.dir.as_mut()) else {
            return err(format!("entry added to {dir}, which is not a directory"));
        };
        d.insert(name, ino, cookie).map_err(|e| ApplyError(format!("entry of {dir}: {e}")))?;
        if let Some(child) = self.nodes.get_mut(ino).and_then(|n| n.dir.as_mut()) {
            child.parent = dir;
        }
        Ok(())
    }

    fn apply_dirent_delete(&mut self, dir: Ino, name: &[u8], mode: ApplyMode) -> Result<(), ApplyError> {
        self.before_change(dir);
        let Some(d) = self.nodes.get_mut(dir).and_then(|n| n.dir.as_mut()) else {
            return err(format!("entry removed from {dir}, which is not a directory"));
        };
        if d.remove(name).is_none() && mode == ApplyMode::Live {
            return err(format!("removal of a missing entry in {dir}"));
        }
        Ok(())
    }

    /// Apply `record`. Runs it maps are claimed from `free` (on replay;
    /// live, the operation allocated them), and runs it unmaps go back to
    /// it ([`release`]).
    pub fn apply(&mut self, record: &Record, mode: ApplyMode, free: &mut FreeSpace) -> Result<(), ApplyError> {
        match record {
            Record::InodeSet(inode) => self.apply_inode_set(inode),
            Record::InodeFree { ino } => self.apply_inode_free(*ino, mode, free),
            Record::DirentSet { dir, name, ino, cookie } => self.apply_dirent_set(*dir, name, *ino, *cookie),
            Record::DirentDelete { dir, name } => self.apply_dirent_delete(*dir, name, mode),
            Record::ExtentMap { ino, file_block, disk_block, len, unwritten } => {
                let extent = (FileBlock::new(*file_block), DevBlock::new(*disk_block), *len, *unwritten);
                self.apply_extent_map(*ino, extent, mode, free)
            }
            Record::ExtentPunch { ino, file_block, len } => {
                self.before_change(*ino);
                let Some(node) = self.nodes.get_mut(*ino) else { return err(format!("punch in missing inode {ino}")) };
                let runs = node.extents.punch(FileBlock::new(*file_block), *len);
                release(free, &mut self.data_errors, runs, mode);
                Ok(())
            }
            Record::XattrSet { ino, name, value } => {
                self.before_change(*ino);
                let Some(node) = self.nodes.get_mut(*ino) else { return err(format!("xattr on missing inode {ino}")) };
                node.extras_mut().xattrs.insert(name.to_vec(), value.to_vec());
                Ok(())
            }
            Record::XattrDelete { ino, name } => {
                self.before_change(*ino);
                let Some(node) = self.nodes.get_mut(*ino) else { return err(format!("xattr on missing inode {ino}")) };
                if let Some(extras) = node.extras.as_mut() {
                    extras.xattrs.remove(&name[..]);
                }
                Ok(())
            }
            Record::Symlink { ino, target } => {
                self.before_change(*ino);
                let Some(node) = self.nodes.get_mut(*ino) else {
                    return err(format!("symlink on missing inode {ino}"));
                };
                node.extras_mut().symlink = Some(target.to_vec());
                Ok(())
            }
            Record::NextIno { next } => {
                if *next > INO_MAX {
                    return err(format!("next inode number {next} is past the largest ({INO_MAX})"));
                }
                self.next_ino = self.next_ino.max(*next);
                Ok(())
            }
            // The checksum table is not state: replay gives these to it,
            // and a checkpoint never holds one.
            Record::CsumSet { .. } => err("a data checksum record where only state belongs".to_string()),
            Record::ScrubCursor { ino, file_block, bytes_per_sec } => {
                // INO_MAX: the walk's second part, over the snapshots' blocks.
                if *ino > INO_MAX || *bytes_per_sec == 0 {
                    return err(format!("a scrub cursor at inode {ino}, {bytes_per_sec} bytes/s"));
                }
                let at = Ino::new(*ino);
                self.scrub = (*ino != 0).then_some(ScrubSaved {
                    ino: at,
                    file_block: *file_block,
                    bytes_per_sec: *bytes_per_sec,
                });
                Ok(())
            }
            Record::DataError { block, ino, file_block } => self.apply_data_error(*block, *ino, *file_block),
        }
    }

    fn apply_data_error(&mut self, block: u64, ino: u64, file_block: u64) -> Result<(), ApplyError> {
        if ino == 0 {
            self.data_errors.remove(&block);
            return Ok(());
        }
        if ino >= INO_MAX {
            return err(format!("a bad data block {block} named by inode {ino}"));
        }
        if self.data_errors.len() >= DATA_ERRORS_MAX && !self.data_errors.contains_key(&block) {
            return err(format!("more than {DATA_ERRORS_MAX} bad data blocks recorded"));
        }
        self.data_errors.insert(block, DataErrorAt { ino: Ino::new(ino), file_block });
        Ok(())
    }

    fn apply_inode_set(&mut self, inode: &Inode) -> Result<(), ApplyError> {
        if inode.ino.get() == 0 || inode.ino.get() >= INO_MAX {
            return err(format!("inode number {} outside 1..{INO_MAX}", inode.ino));
        }
        if inode.size > MAX_FILE_BYTES {
            return err(format!(
                "inode {} is {} bytes, past the largest file ({MAX_FILE_BYTES})",
                inode.ino, inode.size
            ));
        }
        self.next_ino = self.next_ino.max(inode.ino.get() + 1);
        self.before_change(inode.ino);
        match self.nodes.get_mut(inode.ino) {
            Some(node) => {
                if node.inode.file_type() != inode.file_type() {
                    return err(format!("inode {} changed type", inode.ino));
                }
                node.inode = inode.clone();
            }
            None => {
                let node = Node::new(inode.clone(), self.epoch);
                self.nodes.insert(inode.ino, node);
            }
        }
        Ok(())
    }

    /// `extent`: where in the file, where on the device, how many
    /// blocks, and whether they are unwritten.
    fn apply_extent_map(
        &mut self,
        ino: Ino,
        extent: (FileBlock, DevBlock, u64, bool),
        mode: ApplyMode,
        free: &mut FreeSpace,
    ) -> Result<(), ApplyError> {
        let (file_block, disk_block, len, unwritten) = extent;
        if len == 0 || file_block.get().checked_add(len).is_none() || disk_block.get().checked_add(len).is_none() {
            return err(format!("extent of inode {ino} has a bad length"));
        }
        self.before_change(ino);
        let Some(node) = self.nodes.get_mut(ino) else { return err(format!("extent for missing inode {ino}")) };
        if !node.inode.is_reg() {
            return err(format!("extent for inode {ino}, which is not a regular file"));
        }
        let replaced = node.extents.map(file_block, disk_block, len, unwritten);
        let new = BlockRun { start: disk_block.get(), len };
        match mode {
            ApplyMode::Live => {
                // Only runs outside the new mapping change owner; the rest
                // is the same blocks changing state (unwritten -> written).
                let outside = replaced.into_iter().flat_map(|r| subtract(r, new)).collect();
                release(free, &mut self.data_errors, outside, mode);
            }
            ApplyMode::Replay => {
                release(free, &mut self.data_errors, replaced, mode);
                if free.claim_for_extent(new, unwritten).is_err() {
                    let start = disk_block.get();
                    return err(format!("extent of inode {ino} claims blocks [{start}, +{len}) already in use"));
                }
            }
        }
        Ok(())
    }
}

/// The parts of `a` outside `b`.
fn subtract(a: BlockRun, b: BlockRun) -> Vec<BlockRun> {
    let mut out = Vec::new();
    if a.start < b.start {
        out.push(BlockRun { start: a.start, len: a.end().min(b.start) - a.start });
    }
    if a.end() > b.end() {
        let s = a.start.max(b.end());
        out.push(BlockRun { start: s, len: a.end() - s });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Timespec;
    use crate::format::S_IFDIR;

    fn state() -> State {
        State::default()
    }

    /// A data area of blocks 100 to 999, all free.
    fn free_space() -> FreeSpace {
        FreeSpace::new(crate::alloc::Allocator::new(100, 1000, 1))
    }

    #[test]
    fn a_reference_count_floors_at_zero_and_sticks_at_the_top() {
        let mut c = RefCount::ZERO;
        c.add(3);
        c.sub(5);
        assert!(c.is_zero(), "a client forgetting more than it held");
        c.add(u64::from(u32::MAX) - 1);
        c.sub(1);
        assert_eq!(c, RefCount(u32::MAX - 2), "below the top a count is exact");
        c.add(u64::MAX);
        c.sub(u64::MAX);
        assert!(!c.is_zero(), "a count past the top never frees what it lost track of");
    }

    /// Records from a crafted image (checksums valid, fields hostile) are
    /// refused when loaded, before anything trusts them.
    #[test]
    fn hostile_inode_records_are_refused() {
        let (mut s, free) = (state(), &mut free_space());
        let file = |ino: u64, size: u64| {
            let mut inode = Inode::new(Ino::new(ino), libc::S_IFREG | 0o644, 0, 0, 0, Timespec::default());
            inode.size = size;
            Record::InodeSet(inode)
        };
        for (record, why) in [
            (file(0, 0), "inode number 0"),
            (file(u64::MAX, 0), "the largest inode number (next_ino would wrap to 0)"),
            (file(INO_MAX, 0), "an inode number at the limit"),
            (file(5, MAX_FILE_BYTES + 1), "a size past the largest file"),
            (file(5, u64::MAX), "a size a read would overflow on"),
            (Record::NextIno { next: u64::MAX }, "a next-inode counter about to wrap"),
        ] {
            assert!(s.apply(&record, ApplyMode::Replay, free).is_err(), "accepted {why}");
        }
        assert_eq!(s.next_ino, 2, "nothing refused moved the counter");
        s.apply(&file(INO_MAX - 1, MAX_FILE_BYTES), ApplyMode::Replay, free).expect("the largest valid inode");
        assert_eq!(s.next_ino, INO_MAX);
        let dir = Record::InodeSet(Inode::new(Ino::new(7), S_IFDIR | 0o755, 0, 0, 0, Timespec::default()));
        s.apply(&dir, ApplyMode::Replay, free).expect("a directory");
        // Directory entries' cookies: replay keeps the next one above each,
        // so one at the counter limit would overflow it.
        for cookie in [0, 1, COUNTER_MAX, u64::MAX] {
            let entry = Record::DirentSet { dir: Ino::new(7), name: b"e".to_vec().into(), ino: Ino::new(7), cookie };
            assert!(s.apply(&entry, ApplyMode::Replay, free).is_err(), "accepted cookie {cookie}");
        }
        let entry =
            Record::DirentSet { dir: Ino::new(7), name: b"e".to_vec().into(), ino: Ino::new(7), cookie: FIRST_COOKIE };
        s.apply(&entry, ApplyMode::Replay, free).expect("the first cookie");
    }

    /// Bad data blocks: a crafted record names an inode past the limit, or
    /// one more than the bound; a snapshot carries those recorded; freeing
    /// a block (here by a punch) forgets it, as does inode 0.
    #[test]
    fn data_errors_are_bounded_carried_and_forgotten_when_freed() {
        let (mut s, free) = (state(), &mut free_space());
        let bad = |block: u64, ino: u64| Record::DataError { block, ino, file_block: 0 };
        assert!(s.apply(&bad(200, INO_MAX), ApplyMode::Replay, free).is_err(), "an inode at the limit");
        let file = Record::InodeSet(Inode::new(Ino::new(5), libc::S_IFREG | 0o644, 0, 0, 0, Timespec::default()));
        s.apply(&file, ApplyMode::Replay, free).unwrap();
        let extent = Record::ExtentMap { ino: Ino::new(5), file_block: 0, disk_block: 300, len: 4, unwritten: false };
        s.apply(&extent, ApplyMode::Replay, free).unwrap();
        for block in 0..DATA_ERRORS_MAX as u64 {
            s.apply(&bad(298 + block, 5), ApplyMode::Replay, free).unwrap();
        }
        s.apply(&bad(300, 5), ApplyMode::Replay, free).expect("a block recorded again takes no room");
        assert!(s.apply(&bad(5000, 5), ApplyMode::Replay, free).is_err(), "one past the bound");
        assert_eq!(loaded(&whole_snapshot(&mut s)).data_errors(), s.data_errors(), "a checkpoint carries them");
        let punch = Record::ExtentPunch { ino: Ino::new(5), file_block: 1, len: 2 };
        s.apply(&punch, ApplyMode::Replay, free).unwrap();
        assert_eq!(s.data_errors().len(), DATA_ERRORS_MAX - 2);
        assert!(!s.data_errors().contains_key(&301) && !s.data_errors().contains_key(&302), "blocks 301, 302 freed");
        assert!(s.data_errors().contains_key(&300) && s.data_errors().contains_key(&303));
        s.apply(&bad(300, 0), ApplyMode::Replay, free).expect("inode 0 forgets a block");
        assert!(!s.data_errors().contains_key(&300));
    }

    /// Apply every record of `bytes` to a fresh state, as loading does.
    fn loaded(bytes: &[u8]) -> State {
        let (mut s, mut free) = (state(), free_space());
        for r in crate::record::decode_all(bytes).expect("snapshot records decode") {
            s.apply(&r, ApplyMode::Replay, &mut free).expect("snapshot records apply");
        }
        s
    }

    fn whole_snapshot(s: &mut State) -> Vec<u8> {
        s.start_snapshot();
        assert!(s.snapshot_step(usize::MAX));
        s.finish_snapshot().to_vec()
    }

    /// A directory with three files, one with an extent and an xattr.
    fn populated() -> State {
        let (mut s, mut free) = (state(), free_space());
        let mut apply = |r: Record| s.apply(&r, ApplyMode::Live, &mut free).expect("applies");
        apply(Record::InodeSet(Inode::new(Ino::new(1), S_IFDIR | 0o755, 0, 0, 0, Timespec::default())));
        for (ino, name) in [(2u64, "a"), (3, "b"), (4, "c")] {
            apply(Record::InodeSet(Inode::new(Ino::new(ino), libc::S_IFREG | 0o644, 0, 0, 0, Timespec::default())));
            let cookie = FIRST_COOKIE + ino;
            apply(Record::DirentSet {
                dir: Ino::new(1),
                name: name.as_bytes().to_vec().into(),
                ino: Ino::new(ino),
                cookie,
            });
        }
        apply(Record::ExtentMap { ino: Ino::new(2), file_block: 0, disk_block: 200, len: 4, unwritten: false });
        apply(Record::XattrSet { ino: Ino::new(3), name: b"user.k".to_vec().into(), value: b"v".to_vec().into() });
        s
    }

    /// A snapshot encoded in pieces while the state changes is the state
    /// as it was at its start: changed nodes are encoded before their
    /// change, removed ones before they go, new ones not at all.
    #[test]
    fn a_snapshot_in_pieces_is_the_state_at_its_start() {
        let mut s = populated();
        let at_start = whole_snapshot(&mut s);
        s.start_snapshot();
        assert!(!s.snapshot_step(2), "five nodes are not done in a piece of two");
        let mut free = free_space();
        let mut apply = |s: &mut State, r: Record| s.apply(&r, ApplyMode::Live, &mut free).expect("applies");
        apply(&mut s, Record::ExtentMap { ino: Ino::new(2), file_block: 4, disk_block: 300, len: 2, unwritten: false });
        apply(&mut s, Record::DirentDelete { dir: Ino::new(1), name: b"c".to_vec().into() });
        apply(&mut s, Record::InodeFree { ino: Ino::new(4) });
        apply(&mut s, Record::XattrDelete { ino: Ino::new(3), name: b"user.k".to_vec().into() });
        apply(&mut s, Record::InodeSet(Inode::new(Ino::new(9), libc::S_IFREG | 0o600, 0, 0, 0, Timespec::default())));
        apply(
            &mut s,
            Record::DirentSet {
                dir: Ino::new(1),
                name: b"new".to_vec().into(),
                ino: Ino::new(9),
                cookie: FIRST_COOKIE + 9,
            },
        );
        s.node_mut(Ino::new(3)).expect("b").inode.size = 77;
        while !s.snapshot_step(1) {}
        let pieces = s.finish_snapshot().to_vec();
        assert_eq!(whole_snapshot(&mut loaded(&pieces)), whole_snapshot(&mut loaded(&at_start)));
        // And the live state did change.
        let now = whole_snapshot(&mut s);
        assert_ne!(whole_snapshot(&mut loaded(&now)), whole_snapshot(&mut loaded(&at_start)));
        assert!(
            s.node(Ino::new(9)).is_some()
                && s.node(Ino::new(4)).is_none()
                && s.node(Ino::new(3)).expect("b").inode.size == 77
        );
    }
}
