//! The keelfs filesystem core.
//!
//! Metadata lives in memory (`state::State`) and is made durable by a
//! write-ahead journal of `record::Record`s with group commit, plus
//! periodic checkpoints that write the whole state and let the journal
//! ring be reused. Data lives in extents on the device; metadata that makes
//! data visible commits only after that data is durable (ordered mode).
//! See docs/FORMAT.md for the layout and the crash analysis.
//!
//! An [`Fs`] belongs to one reactor: its operations are async functions run
//! as tasks there, and no thread ever blocks on I/O.

// The filesystem is safe code but for the seqlocked page words that readers
// on other reactors share, in one module.
#![deny(unsafe_code)]

mod access;
mod admin;
/// The atomics of [`seqlock`]: std's here, loom's in `tests/loom.rs`.
mod atomics {
    pub(crate) use std::sync::atomic::{fence, AtomicU64, Ordering};
}
mod adopt;
mod alloc;
mod blocks;
mod cache;
mod change;
mod codec;
mod csum_map;
mod csum_table;
mod data;
mod dir;
mod discard;
mod error;
mod extent;
mod file_clock;
mod flags;
mod format;
mod fsck;
mod handles;
mod ids;
mod inspect;
mod io;
mod journal;
mod meta;
mod mkfs;
mod namespace;
mod node_table;
mod ops;
mod pages;
mod quota;
mod record;
mod scrub;
mod seen_shared;
mod seqlock;
#[allow(unsafe_code)]
mod shared;
mod shared_runs;
mod snapshot_table;
mod space;
mod state;
mod sync;

pub use access::{Creds, PermissionCheck};
pub use admin::Admin;
pub use adopt::{HandleState, Handover};
pub use data::{copy_range_copied_bytes, DataOps, ReadSink, WriteSource, WriteTimes};
pub use discard::DiscardConfig;
pub use error::{BlockClaim, DoubleOwner, FsError, FsResult};
pub use file_clock::{FileClock, ManualClock};
pub use flags::{FallocateMode, RenameMode, XattrFlags};
pub use format::{
    crc, Superblock, Timespec, BLOCK_BYTES, CSUMS_PER_TABLE_BLOCK, FEATURE_DATA_CHECKSUMS, ROOT_INO,
    XATTR_INODE_BYTES_MAX,
};
pub use fsck::{fsck, fsck_with, repair, FsckOptions, FsckReport, Problem};
pub use ids::{Fh, FileOffset, Ino};
pub use inspect::Inspect;
pub use journal::{SnapshotInfo, SnapshotSpace, CHECKPOINT_BLOCK_MAGIC, JOURNAL_TX_MAGIC};
pub use mkfs::{mkfs, MkfsError, MkfsOptions};
pub use ops::{Attr, DirEntry, SeekTo, SetAttr, TimeSet};
pub use quota::Quota;
pub use scrub::{BadBlock, ScrubCursor, ScrubStep, SCRUB_STEP_BLOCKS_MAX};
pub use seen_shared::SeenShared;
pub use shared::{SharedMiss, SharedReader};
pub use snapshot_table::{check_snapshot_name, SNAPSHOTS_MAX, SNAPSHOT_NAME_MAX};

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::Duration;

use codec::Writer;
use keelfs_bdev::Geometry;
use keelfs_reactor::DeviceChannel;

/// Settings of a mounted filesystem.
#[derive(Clone, Debug)]
pub struct FsConfig {
    /// Commit the journal at least this often while changes are pending.
    pub commit_interval: Duration,
    /// Allocation group this reactor prefers for new files.
    pub preferred_group: usize,
    /// Page cache size.
    pub cache_bytes: u64,
    /// Write dirty pages back at least this often.
    pub writeback_interval: Duration,
    /// Inodes the filesystem may hold (each lives in daemon memory); past
    /// it, creating one fails with ENOSPC. None: one per 16 KiB of device,
    /// as ext4's default, between 1,024 and 2^32 - 1.
    pub inodes_max: Option<u64>,
    /// Bytes of xattr names and values one inode may hold; past it,
    /// setxattr fails with ENOSPC. At most the format's
    /// [`format::XATTR_INODE_BYTES_MAX`] (the default).
    pub xattr_bytes_per_inode_max: usize,
    /// Serve without writing: no orphan cleanup, commits, checkpoints or
    /// writeback; every change fails with EROFS. A journal left by a crash
    /// is replayed in memory only.
    pub read_only: bool,
    /// Mount this snapshot of the image instead of its live state: read
    /// only (with `read_only` set, or the mount fails with EINVAL), and
    /// nothing of the journal is replayed.
    pub snapshot: Option<String>,
    /// When reads move an inode's atime (FUSE leaves atime to the server).
    pub atime: AtimeUpdates,
    /// Whether reading a directory moves its atime (false: nodiratime).
    pub dir_atime: bool,
    /// Inodes a checkpoint encodes between two yields to the reactor:
    /// what bounds the wait of a request behind it (a directory is
    /// encoded whole, entries and all).
    pub checkpoint_piece_nodes: usize,
    /// Keep the inodes unlinked while open (orphans) at mount instead of
    /// freeing them, for a session that is to be restored and may still
    /// hold some; [`Handover::free_unheld_orphans`] frees the rest afterwards.
    pub keep_orphans: bool,
    /// Limits on bytes and inodes below the device's; [`Admin::set_quota`]
    /// changes them while mounted.
    pub quota: Quota,
    /// Continuous discard of freed space (off by default).
    pub discard: DiscardConfig,
    /// The clock file times are stamped with: the system's, or a test's.
    pub file_clock: FileClock,
    /// On an image with data checksums: regions (4 MiB each) open for
    /// overwrites in place at once, at most; half of it asks for a
    /// checkpoint. What bounds the data a mount reads after a crash.
    pub csum_open_regions_max: usize,
}

/// Linux's atime mount modes, which the server applies under FUSE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtimeUpdates {
    /// noatime: reads never change atime.
    Never,
    /// relatime (Linux's default): a read moves atime if it is not after
    /// mtime or ctime, or is a day old; one inode update per change, not
    /// one per read.
    Relative,
    /// strictatime: every read moves atime.
    Always,
}

impl Default for FsConfig {
    fn default() -> Self {
        Self {
            commit_interval: Duration::from_secs(5),
            preferred_group: 0,
            cache_bytes: 256 << 20,
            writeback_interval: Duration::from_millis(500),
            inodes_max: None,
            xattr_bytes_per_inode_max: format::XATTR_INODE_BYTES_MAX,
            read_only: false,
            snapshot: None,
            atime: AtimeUpdates::Relative,
            dir_atime: true,
            checkpoint_piece_nodes: 256,
            keep_orphans: false,
            quota: Quota::default(),
            discard: DiscardConfig::default(),
            file_clock: FileClock::System,
            csum_open_regions_max: csum_map::OPEN_REGIONS_MAX,
        }
    }
}

/// Counters that prove what the I/O paths did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FsCounters {
    pub journal_commits: u64,
    pub journal_blocks_written: u64,
    pub device_flushes: u64,
    pub checkpoints: u64,
    pub data_bytes_written: u64,
    pub data_bytes_read: u64,
    pub fsyncs: u64,
    /// Records appended to the pending journal (0 for pure overwrites and
    /// timestamp updates).
    pub records_logged: u64,
    pub direct_overwrites: u64,
    pub direct_extends: u64,
    /// Direct writes in flight now, and the most seen at once.
    pub direct_in_flight: u64,
    pub direct_in_flight_max: u64,
    pub writeback_pages: u64,
    /// Discards that completed (continuous and fstrim), the bytes they
    /// covered, and those that failed (their blocks were freed anyway).
    pub discards: u64,
    pub discard_bytes: u64,
    pub discard_errors: u64,
    /// Blocks freed but held out of the allocator for a discard, now.
    pub discard_pending_blocks: u64,
    /// Device reads of data that failed their checksum (EIO).
    pub data_checksum_errors: u64,
    /// Regions of the data checksum table open for overwrites in place
    /// now (`csum_map`).
    pub data_regions_open: u64,
}

/// The journal's position and what is waiting to go into it.
struct JournalState {
    /// Next logical journal block to write, and the sequence it gets.
    head: u64,
    seq: u64,
    /// Encoded records of operations not yet committed.
    pending: Writer,
    /// Changes made (records logged and inodes dirtied), and how many of
    /// them the last commit made durable: an fsync waits until the commit
    /// count passes the change count it saw, which lets one commit serve
    /// every fsync that arrived while another was running.
    logged_ops: u64,
    committed_ops: u64,
    /// Inodes whose in-memory image differs from the last logged one.
    dirty: BTreeSet<Ino>,
    /// Inodes logged with a capped size, to log again once written back.
    dirty_later: BTreeSet<Ino>,
    /// Images of dirty inodes freed before the commit. Records already
    /// pending may name them (an entry added to a directory that was then
    /// removed), so the transaction still carries their image up front,
    /// then the records, then the free.
    freed_images: Vec<format::Inode>,
    /// Pending records make newly written data visible (an extent mapped
    /// written, or a zeroed tail): that data must be durable before the
    /// transaction, so the commit flushes first.
    exposes_data: bool,
    /// Data writes completed, and how many were covered by the last flush.
    data_writes: u64,
    flushed_data_writes: u64,
    /// The epoch of the checkpoint being encoded in pieces, if any (the
    /// frees it holds back are [`space::Space`]'s).
    sliced: Option<u32>,
}

pub(crate) struct FsInner {
    io: io::Io,
    config: FsConfig,
    /// The inodes and the allocator.
    meta: meta::Meta,
    /// The quota, and the blocks promised, unmapped or held back.
    space: space::Space,
    /// The superblock, the journal ring and what waits to go into it,
    /// the lock that orders commits, what replay found at mount, and the
    /// journal's counters.
    journal: journal::Journal,
    handles: handles::HandleTable,
    /// Range locks, file-time stamping and the data paths' counters.
    data: data::DataState,
    pages: pages::Pages,
    /// The data checksum table, on an image that keeps data checksums.
    csums: Option<RefCell<csum_table::TableCache>>,
    /// One write of the dirty-region map at a time (`csum_map`).
    csum_map_writer: sync::AsyncMutex,
    /// Freed runs out of the allocator until their discard completes,
    /// and the discards' counters.
    discard: discard::Discard,
    unmounted: Cell<bool>,
    /// The span current at mount (the daemon's export span, inside its
    /// reactor's): the parent of this filesystem's events, which are often
    /// logged from timer tasks that run outside it.
    pub(crate) span: tracing::Span,
}

/// A mounted filesystem. Cheap to clone; all clones share one state.
#[derive(Clone)]
pub struct Fs {
    inner: Rc<FsInner>,
}

impl FsInner {
    /// Inodes with no links left when the last mount ended (unlinked while
    /// open, then a crash) are freed now. A mount that keeps them for a
    /// session frees them later, in `Handover::free_unheld_orphans`.
    fn free_orphans(&self) -> FsResult<()> {
        let orphans: Vec<Ino> = {
            let state = self.meta.state();
            state.nodes().filter(|n| n.inode.nlink == 0).map(|n| n.inode.ino).collect()
        };
        if !orphans.is_empty() {
            tracing::info!(parent: &self.span, orphans = orphans.len(), "freeing inodes unlinked while open");
        }
        for ino in orphans {
            self.change().log(record::Record::InodeFree { ino })?;
        }
        Ok(())
    }

    /// What [`space::Space`]'s room checks need of the other parts, read
    /// now: the checkpoint's size and the blocks awaiting a discard.
    fn usage(&self) -> space::Usage {
        space::Usage {
            checkpoint_blocks: self.journal.sb.borrow().checkpoint_blocks(),
            discarding: self.discard.blocks(),
        }
    }
}

impl Fs {
    /// Commit everything logged so far and make all completed data writes
    /// durable. Concurrent callers share commits (group commit).
    pub async fn sync(&self) -> FsResult<()> {
        if self.read_only() {
            return Ok(()); // nothing was written, nothing is pending
        }
        self.data().writeback_all().await?;
        journal::sync(&self.inner).await
    }

    /// Whether this mount is read-only ([`FsConfig::read_only`]).
    pub fn read_only(&self) -> bool {
        self.inner.config.read_only
    }

    /// Commit, checkpoint and flush; the Fs must not be used afterwards.
    /// Read-only, nothing is written.
    pub async fn unmount(&self) -> FsResult<()> {
        if self.read_only() {
            self.inner.unmounted.set(true);
            return Ok(());
        }
        // An fstrim would compete with the writeback for the device and
        // for free space: it stops at its next piece; settle waits for
        // the piece it holds.
        self.inner.discard.stop_trims(true);
        if let Err(e) = self.data().writeback_all().await {
            self.inner.discard.stop_trims(false);
            return Err(e);
        }
        self.inner.unmounted.set(true);
        self.inner.discard.settle(&self.inner.space, &self.inner.span).await;
        journal::checkpoint(&self.inner).await
    }

    /// Mount the filesystem on `dev`: pick the newest valid superblock,
    /// load its checkpoint, replay the journal, and free orphans.
    pub async fn mount(dev: DeviceChannel, config: FsConfig) -> FsResult<Fs> {
        mount_with(dev, config, true).await
    }
}

/// What a mount configured by `config` serves: the live state, or the
/// snapshot it names (read-only only).
async fn load_for(dev: &DeviceChannel, config: &FsConfig, require_root: bool) -> FsResult<journal::Loaded> {
    match &config.snapshot {
        Some(_) if !config.read_only => Err(FsError::Invalid("a snapshot mounts read-only")),
        Some(name) => journal::load_snapshot(dev, name).await,
        None => journal::load(dev, require_root).await,
    }
}

/// The data checksum table a mount keeps, on an image with data
/// checksums, bounded as `config` says.
fn checksum_table(table: Option<csum_table::TableCache>, config: &FsConfig) -> Option<RefCell<csum_table::TableCache>> {
    let mut table = table?;
    table.map.set_open_max(config.csum_open_regions_max);
    Some(RefCell::new(table))
}

/// [`Fs::mount`], or mkfs's mount of an image without a root yet
/// (`require_root` false).
async fn mount_with(dev: DeviceChannel, config: FsConfig, require_root: bool) -> FsResult<Fs> {
    let mut loaded = load_for(&dev, &config, require_root).await?;
    let stale_headers = std::mem::take(&mut loaded.stale_headers);
    let fs = Fs {
        inner: Rc::new(FsInner {
            io: io::Io::new(dev),
            config: config.clone(),

            meta: meta::Meta::new(loaded.state),
            space: space::Space::new(config.quota, loaded.free),
            journal: journal::Journal {
                sb: RefCell::new(loaded.sb),
                ring: RefCell::new(JournalState {
                    head: loaded.journal_head,
                    seq: loaded.journal_seq,
                    pending: Writer::new(),
                    logged_ops: 0,
                    committed_ops: 0,
                    dirty: BTreeSet::new(),
                    dirty_later: BTreeSet::new(),
                    freed_images: Vec::new(),
                    exposes_data: false,
                    data_writes: 0,
                    flushed_data_writes: 0,
                    sliced: None,
                }),
                commit_lock: sync::AsyncMutex::default(),
                replayed_at_mount: loaded.replayed,
                counters: Cell::default(),
                features_on: Cell::new(0),
                snapshots: RefCell::new(std::mem::take(&mut loaded.snapshots)),
            },
            handles: handles::HandleTable::default(),
            pages: pages::Pages::new(cache::PageCache::new(config.cache_bytes)),
            csums: checksum_table(loaded.csums.take(), &config),
            csum_map_writer: sync::AsyncMutex::default(),
            data: data::DataState::default(),
            discard: discard::Discard::new(config.discard, config.read_only),
            unmounted: Cell::new(false),
            span: tracing::Span::current(),
        }),
    };
    tracing::info!(
        parent: &fs.inner.span,
        replayed = loaded.replayed,
        inodes = fs.inner.meta.inode_count(),
        read_only = config.read_only,
        snapshot = config.snapshot.as_deref(),
        "mounted"
    );
    if config.read_only {
        // Orphans stay (unreachable, freed by the next writable mount),
        // and nothing is ever committed or written back. Regions a crash
        // left open are read without their checks failing.
        csum_map::tolerate_open(&fs.inner).await?;
        return Ok(fs);
    }
    if !stale_headers.is_empty() {
        tracing::warn!(
            parent: &fs.inner.span,
            headers = stale_headers.len(),
            "erasing stale journal transactions past the end numbered as if they continued it"
        );
        let sb = fs.inner.journal.sb.borrow().clone();
        journal::erase_stale_headers(&fs.inner.io, &sb, &stale_headers).await?;
    }
    if !config.keep_orphans {
        fs.inner.free_orphans()?;
    }
    csum_map::settle_open(&fs.inner).await?;
    start_tasks(&fs);
    Ok(fs)
}

/// The tasks a writable mount runs: commits, discards and writeback.
fn start_tasks(fs: &Fs) {
    journal::start_commit_timer(&fs.inner);
    discard::start_discard_task(&fs.inner);
    data::start_writeback_timer(fs);
}
