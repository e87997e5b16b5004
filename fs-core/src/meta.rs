//! The metadata in memory: every inode's node (its image, directory
//! entries, xattrs, extent map and the counts that hold it), the next
//! inode number, and the snapshot of a checkpoint being encoded. The
//! allocator and the runs freed since the last commit are
//! [`crate::space::Space`]'s, lent to [`Meta::apply_live`] for one record.
//!
//! Borrows of the state are short: a caller drops its borrow before any
//! await and before it calls into another part, which may borrow the
//! state itself. A function that needs the state while its caller holds
//! it takes `&State` or `&mut State`, never `&Meta`.

use std::cell::{Ref, RefCell, RefMut};

use keelfs_base::IdMapBy;

use crate::blocks::FileBlock;
use crate::extent::Segments;
use crate::format::{Inode, BLOCK_SIZE};
use crate::ids::Ino;
use crate::ops::Attr;
use crate::record::Record;
use crate::space::FreeSpace;
use crate::state::{ApplyMode, Node, State, INO_MAX};
use crate::{FsError, FsResult};

pub(crate) struct Meta {
    state: RefCell<State>,
}

impl Meta {
    pub fn new(state: State) -> Self {
        Self { state: RefCell::new(state) }
    }

    pub fn state(&self) -> Ref<'_, State> {
        self.state.borrow()
    }

    pub fn state_mut(&self) -> RefMut<'_, State> {
        self.state.borrow_mut()
    }

    /// Apply `record` to the live state. The operation checked everything
    /// the record needs, so a refusal means the state is not what the
    /// operation saw: corruption, not the caller's error.
    pub fn apply_live(&self, record: &Record, free: &mut FreeSpace) -> FsResult<()> {
        self.state
            .borrow_mut()
            .apply(record, ApplyMode::Live, free)
            .map_err(|e| FsError::Corrupt(format!("live change refused: {e}")))
    }

    /// Check the nodes against the open handles (tests and fuzzers,
    /// between operations): every inode number is below the next one to
    /// be given, only regular files map blocks and each extent map holds
    /// its own invariants, every node's open count is the number of
    /// handles naming it (unless the count has stuck at its top), and no
    /// handle names an inode that is gone. Panics on the first that does
    /// not hold.
    pub fn check_invariants(&self, opens_by_handle: &IdMapBy<Ino, u64>) {
        let state = self.state.borrow();
        for node in state.nodes() {
            let ino = node.inode.ino;
            assert!(ino.get() < state.next_ino, "inode {ino} is not below next_ino {}", state.next_ino);
            assert!(node.extents.len() == 0 || node.inode.is_reg(), "inode {ino} maps blocks and is not a file");
            node.extents.check_invariants();
            if let Some(opens) = node.opens.count() {
                let handles = opens_by_handle.get(&ino).copied().unwrap_or(0);
                assert_eq!(opens, handles, "inode {ino}: its open count against the handles naming it");
            }
        }
        for ino in opens_by_handle.keys() {
            assert!(state.node(*ino).is_some(), "a handle names inode {ino}, which is gone");
        }
    }

    /// A new inode number, never given out before.
    pub fn take_next_ino(&self) -> Ino {
        let mut state = self.state.borrow_mut();
        let ino = state.next_ino;
        // Loading refuses any inode number at or past INO_MAX, and
        // 2^62 creates would take centuries.
        assert!(ino < INO_MAX, "inode numbers exhausted");
        debug_assert!(state.node(Ino::new(ino)).is_none(), "next_ino {ino} is a live inode");
        state.next_ino += 1;
        Ino::new(ino)
    }

    /// Whether inode `ino` exists (linked, or an orphan still held).
    pub fn exists(&self, ino: Ino) -> bool {
        self.state.borrow().node(ino).is_some()
    }

    /// Inodes in memory, orphans included.
    pub fn inode_count(&self) -> usize {
        self.state.borrow().inode_count()
    }

    /// A copy of `ino`'s inode.
    pub fn inode(&self, ino: Ino) -> FsResult<Inode> {
        self.state.borrow().node(ino).map(|n| n.inode.clone()).ok_or(FsError::NotFound)
    }

    /// `ino`'s inode, if it is a regular file; the error a data operation
    /// on anything else fails with.
    pub fn require_file(&self, ino: Ino) -> FsResult<Inode> {
        let inode = self.inode(ino)?;
        if inode.is_dir() {
            return Err(FsError::IsDir);
        }
        if !inode.is_reg() {
            return Err(FsError::Invalid("data operation on a special file"));
        }
        Ok(inode)
    }

    /// `ino`'s attributes. Someone has now seen its times, so the next
    /// change stamps them with the precise clock (multigrain timestamps).
    pub fn attr(&self, ino: Ino) -> FsResult<Attr> {
        let state = self.state.borrow();
        let node = state.node(ino).ok_or(FsError::NotFound)?;
        node.times_queried.set(true);
        Ok(Attr { inode: node.inode.clone(), blocks_512: node.extents.blocks() * (BLOCK_SIZE / 512) })
    }

    /// The extent map's pieces of `count` blocks from file block `first`.
    /// A file gone meanwhile is Stale: its caller held it a moment ago.
    pub fn segments(&self, ino: Ino, first: u64, count: u64) -> FsResult<Segments> {
        let state = self.state.borrow();
        Ok(state.node(ino).ok_or(FsError::Stale)?.extents.segments(FileBlock::new(first), count))
    }

    /// Extents of a file (for tests and benchmarks of the allocator).
    pub fn extent_count(&self, ino: Ino) -> FsResult<usize> {
        let state = self.state.borrow();
        Ok(state.node(ino).ok_or(FsError::NotFound)?.extents.len())
    }

    /// Change `ino`'s node in memory if it exists; nothing at all
    /// otherwise (a node freed meanwhile needs none of these changes).
    fn with_node(&self, ino: Ino, f: impl FnOnce(&mut Node)) {
        if let Some(node) = self.state.borrow_mut().node_mut(ino) {
            f(node);
        }
    }

    /// Take `n` lookup references on `ino`, which must exist.
    pub fn hold_lookups(&self, ino: Ino, n: u64) -> FsResult<()> {
        let mut state = self.state.borrow_mut();
        state.node_mut(ino).ok_or(FsError::NotFound)?.lookups.add(n);
        Ok(())
    }

    /// Take `n` lookup references on `ino`, if it exists.
    pub fn add_lookup(&self, ino: Ino, n: u64) {
        self.with_node(ino, |node| node.lookups.add(n));
    }

    /// Drop `n` lookup references on `ino`, if it exists.
    pub fn drop_lookups(&self, ino: Ino, n: u64) {
        self.with_node(ino, |node| node.lookups.sub(n));
    }

    /// A handle on `ino` opened.
    pub fn add_open(&self, ino: Ino) {
        self.with_node(ino, |node| node.opens.add(1));
    }

    /// A handle on `ino` closed.
    pub fn drop_open(&self, ino: Ino) {
        self.with_node(ino, |node| node.opens.sub(1));
    }

    /// The count of direct writes into `ino` that bypassed the page cache:
    /// a read that loads pages into the cache keeps them only if it did
    /// not move meanwhile.
    pub fn direct_epoch(&self, ino: Ino) -> Option<u64> {
        self.state.borrow().node(ino).map(|n| n.writes().direct_epoch)
    }

    pub fn move_direct_epoch(&self, ino: Ino) {
        self.with_node(ino, |node| node.writes_mut().direct_epoch += 1);
    }

    /// `ino`'s data reached the device with a change of its metadata
    /// (size or mapping) that fdatasync must commit.
    pub fn set_datasync_needed(&self, ino: Ino) {
        self.with_node(ino, |node| node.datasync_needed = true);
    }
}
