//! One FUSE dispatcher over keelfs-fs, shared by the virtio-fs backend and
//! the /dev/fuse transport: request bytes in, reply bytes out.

use keelfs_fs::FileOffset;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keelfs_bdev::AlignedBuf;
use keelfs_fs::{Attr as FsAttr, Creds, DirEntry, Fs, FsError, ReadSink, SharedReader, WriteSource, WriteTimes};
use keelfs_fs::{Fh, HandleState, Ino, XattrFlags, BLOCK_BYTES};
use keelfs_reactor::IoBuffer;

use super::abi::{
    error_reply, init_flags as f, open_flags, Attr, InHeader, Opcode, Reply, ShortReply, KERNEL_MINOR_VERSION,
    KERNEL_VERSION, MIN_MINOR_VERSION, OUT_HEADER_BYTES,
};
use super::coherence::{Change, Coherence};
use super::locks::{
    ClientId, HeldLock, LockError, LockKind, LockOwner, LockRequest, LockSpace, Locks, WAITS_PER_CLIENT_MAX,
};
use super::request::{
    parse, InPlaceIo, LockIn, LockOp, Request, FITRIM, FSTRIM_RANGE_BYTES, IOCTL_UNRESTRICTED, IO_PREFIX_BYTES,
    OPEN_KILL_SUIDGID, SETXATTR_ACL_KILL_SGID, WRITE_CACHE, WRITE_KILL_SUIDGID,
};
use super::state::{SavedLock, SessionState, StateError};
use super::stats::OpStats;
use super::trace::TraceWriter;
use super::uring::ENTRIES_PER_QUEUE_MAX;

#[derive(Clone, Debug)]
pub struct SessionConfig {
    pub entry_timeout: Duration,
    pub attr_timeout: Duration,
    pub max_write: u32,
    /// Let the client cache writes: the `always` cache mode, and `auto`
    /// for a sole client ([`CacheMode::session_config_for`]).
    pub writeback_cache: bool,
    /// What the client may cache, as virtiofsd's `--cache`.
    pub cache: CacheMode,
    /// Let the client keep a file's cached pages across opens
    /// (FOPEN_KEEP_CACHE): the `always` mode, and `auto` for a sole
    /// client, whose cache nobody else can make stale.
    pub keep_cache: bool,
    /// Open handles the session may hold at once; past it, opens fail
    /// with EMFILE. Default [`SESSION_HANDLES_MAX`].
    pub open_handles_max: usize,
    /// The export's other clients, told of this session's changes (and,
    /// for a host mount that listens, telling it of theirs). None: no
    /// other client can be told anything.
    pub coherence: Option<Rc<Coherence>>,
    /// Serve extended attributes. Off, the four xattr requests answer
    /// ENOSYS, which tells Linux's FUSE client to stop sending them (so a
    /// new file no longer costs a GETXATTR of `security.capability` at
    /// its first write), and POSIX ACLs and security contexts are not
    /// offered: virtiofsd's default (`--xattr` off).
    pub xattr: bool,
    /// Where to record every exchange (`--trace-requests`), for replaying
    /// a real workload's requests elsewhere ([`TraceWriter`]).
    pub trace: Option<Rc<TraceWriter>>,
    /// The export's lock table, when keelfs holds its clients' locks
    /// (offering POSIX_LOCKS and FLOCK_LOCKS at INIT). None: each client
    /// kernel keeps its own, and the lock requests answer ENOSYS.
    pub locks: Option<Rc<Locks>>,
}

/// Who else uses the filesystem a session serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clients {
    /// This session's client is the only one (a guest whose export has no
    /// host mount, or a host mount no guest shares): nobody else can
    /// change a name, an attribute or a page behind its kernel's back,
    /// so it may keep them as long as it likes, and own written pages,
    /// the size and mtime (writeback caching).
    Sole,
    /// Other clients may share it and this one cannot be told of their
    /// changes (a guest beside a host mount: Linux's virtio-fs has no
    /// notification queue): names and attributes for short timeouts, and
    /// writes reach the filesystem before write(2) returns.
    Shared,
    /// Other clients share it, and this one is told of each of their
    /// changes as they happen ([`Coherence`]: a host mount beside a
    /// guest): it may keep names and attributes long, but its writes still
    /// reach the filesystem before write(2) returns, for the others.
    SharedNotified,
}

/// How much the client (guest or host kernel) may cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    /// Nothing: every open is direct I/O and names and attributes are
    /// revalidated on every use (timeouts 0).
    None,
    /// Names and attributes for 1 s; data cached until a change is seen.
    Auto,
    /// Names and attributes for a day, file data kept across opens, and
    /// writeback caching in the client.
    Always,
}

impl CacheMode {
    /// Session settings for this mode, for a client that may share the
    /// filesystem with others.
    pub fn session_config(self) -> SessionConfig {
        self.session_config_for(Clients::Shared)
    }

    /// Session settings for this mode and these clients: `auto` gives a
    /// sole client what `always` gives any (names and attributes for a
    /// day, writeback caching, pages kept across opens), a client told of
    /// the others' changes the long timeouts only, and a shared client
    /// that cannot be told 1 s; `none` never caches.
    pub fn session_config_for(self, clients: Clients) -> SessionConfig {
        let sole_or_always = match self {
            CacheMode::None => false,
            CacheMode::Auto => clients == Clients::Sole,
            CacheMode::Always => true,
        };
        let timeout = match (self, clients) {
            (CacheMode::None, _) => Duration::ZERO,
            (CacheMode::Auto, Clients::Shared) => SHARED_TIMEOUT,
            (CacheMode::Auto, Clients::Sole | Clients::SharedNotified) | (CacheMode::Always, _) => LONG_TIMEOUT,
        };
        SessionConfig {
            entry_timeout: timeout,
            attr_timeout: timeout,
            max_write: 1 << 20,
            writeback_cache: sole_or_always,
            cache: self,
            keep_cache: sole_or_always,
            open_handles_max: SESSION_HANDLES_MAX,
            coherence: None,
            xattr: true,
            trace: None,
            locks: None,
        }
    }
}

/// How long a client that nobody else can surprise keeps names and
/// attributes: as long as they live, in effect (a day, then one
/// revalidation).
pub const LONG_TIMEOUT: Duration = Duration::from_secs(86_400);
/// How long a client that shares the export and cannot be told of the
/// others' changes keeps them: a change elsewhere shows within this.
pub const SHARED_TIMEOUT: Duration = Duration::from_secs(1);

impl Default for SessionConfig {
    fn default() -> Self {
        CacheMode::Auto.session_config()
    }
}

/// What keelfs implements and therefore offers at INIT.
const OFFERED: u64 = f::ASYNC_READ
    | f::ATOMIC_O_TRUNC
    | f::BIG_WRITES
    | f::DO_READDIRPLUS
    | f::READDIRPLUS_AUTO
    | f::ASYNC_DIO
    | f::PARALLEL_DIROPS
    | f::MAX_PAGES
    | f::SETXATTR_EXT
    | f::DIRECT_IO_ALLOW_MMAP
    | f::HANDLE_KILLPRIV_V2
    | f::POSIX_ACL
    | f::DONT_MASK
    | f::CREATE_SUPP_GROUP
    | f::SECURITY_CTX
    | f::EXPORT_SUPPORT
    | f::INIT_EXT;

/// What a session without xattrs does not offer: each needs xattrs.
const XATTR_FLAGS: u64 = f::SETXATTR_EXT | f::POSIX_ACL | f::SECURITY_CTX;

pub struct Session {
    fs: Fs,
    config: SessionConfig,
    stats: Rc<OpStats>,
    initialized: Cell<bool>,
    flags: Cell<u64>,
    /// Offer FUSE_OVER_IO_URING at INIT: set by the /dev/fuse transport
    /// when it has a ring ready (`fuse::uring`).
    offer_io_uring: Cell<bool>,
    /// Handles whose reads other reactors serve from the page cache
    /// ([`Self::shared_reader`]), and the flag that tells them the handle
    /// was released.
    shared_handles: RefCell<keelfs_base::IdMap<Arc<AtomicBool>>>,
    /// What this session holds of the filesystem's shared tables.
    holdings: RefCell<Holdings>,
    /// Sends a notification to the client kernel, where the transport can
    /// (/dev/fuse; Linux's virtio-fs has no notification queue).
    notifier: RefCell<Option<Notifier>>,
    /// The span current when the session was made (the export's, inside
    /// its reactor's): the parent of this session's events, which requests
    /// run as tasks of their own log outside it.
    span: tracing::Span,
    /// The limit of this session's failure warnings: its own, so that a
    /// guest that fills its disk cannot silence another export's.
    failures_logged: keelfs_base::RateLimit,
    /// This session among the export's clients (from
    /// [`SessionConfig::coherence`]): the export's coherence and this
    /// session's member id in it.
    member: Option<(Rc<Coherence>, u64)>,
    /// The list the last READDIR used, empty, kept for the next one (at
    /// most [`READDIR_ENTRIES_KEPT`] entries' room). Taken while a READDIR
    /// runs, so a second one at the same time makes its own.
    readdir_entries: Cell<Vec<DirEntry>>,
    /// The export's lock table and this session's client number in it.
    locks: Option<(Rc<Locks>, ClientId)>,
}

/// The transport's memory that a READ served in place fills.
pub trait ReadInPlace: IoBuffer + ReadSink {
    /// Zero the buffer from byte `from` on. A direct read's device
    /// writes whole blocks, so past what the reply counts the buffer may
    /// hold the device's bytes from past the file's end; they must not
    /// reach the client. (A buffered read copies only what it counts, so
    /// it needs no zeroing: the rest is the client's own memory.)
    fn zero_from(&self, from: usize);
}

/// How a session's notifications (each a fuse_out_header with unique 0,
/// then its body) reach its kernel.
pub trait Notify {
    /// Hand `message` on without blocking: it reaches the kernel soon,
    /// in order with the others queued.
    fn queue(&self, message: &[u8]);

    /// Have the kernel take `message` before this returns, ahead of any
    /// still queued. Only for a message the kernel acts on without
    /// waiting for a request this reactor has yet to answer: an
    /// invalidation of the attributes alone of an inode that the request
    /// being served pins.
    fn deliver_now(&self, message: &[u8]);
}

/// A session's way to its kernel's notifications.
pub type Notifier = Box<dyn Notify>;

/// The open handles and lookup references one session (one guest, or the
/// host mount) holds. A filesystem serves several sessions at once, and
/// each may only use, release or forget its own: at INIT or disconnect a
/// session gives back exactly these, never another's.
#[derive(Default)]
struct Holdings {
    handles: keelfs_base::IdMap<()>,
    /// Lookup references per inode, as the kernel counts them for FORGET.
    lookups: keelfs_base::IdMap<u64>,
}

/// Open handles one session may hold at once by default: far more than a
/// guest's kernel keeps open, and a bound on what a hostile one can make
/// keelfsd hold. Past it, opens fail with EMFILE.
pub const SESSION_HANDLES_MAX: usize = 1 << 16;

/// The client kernel's page: INIT's max_pages counts these.
const FUSE_PAGE_BYTES: u32 = 4096;

impl Drop for Session {
    fn drop(&mut self) {
        if let Some((coherence, member)) = &self.member {
            coherence.leave(*member);
        }
        // Its locks go with it, and its waits end.
        if let Some((locks, client)) = &self.locks {
            locks.leave(*client);
        }
        // The frontend is gone: every handle it had is.
        for released in self.shared_handles.borrow().values() {
            released.store(true, Ordering::Release);
        }
    }
}

/// What another reactor needs to serve one handle's reads from the cache.
#[derive(Clone)]
pub struct SharedHandle {
    pub reader: SharedReader,
    /// Set when the handle is released: its reads go back to the owner,
    /// which answers EBADF.
    pub released: Arc<AtomicBool>,
}

fn errno_of(e: &FsError) -> i32 {
    e.errno()
}

fn to_abi_attr(a: &FsAttr) -> Attr {
    let i = &a.inode;
    Attr {
        ino: i.ino.get(),
        size: i.size,
        blocks: a.blocks_512,
        atime: i.atime.sec as u64,
        mtime: i.mtime.sec as u64,
        ctime: i.ctime.sec as u64,
        atimensec: i.atime.nsec,
        mtimensec: i.mtime.nsec,
        ctimensec: i.ctime.nsec,
        mode: i.mode,
        nlink: i.nlink,
        uid: i.uid,
        gid: i.gid,
        rdev: i.rdev,
        blksize: BLOCK_BYTES as u32,
        flags: 0,
    }
}

type Outcome = Result<Option<Reply>, i32>;

/// What `req` changes, should it succeed, that another client of the
/// export may hold in its cache: names it adds, removes or replaces, and
/// the inodes whose attributes (or pages) it changes.
fn changes_of<'a>(h: &InHeader, req: &Request<'a>) -> Vec<Change<'a>> {
    let ino = Ino::new(h.nodeid);
    let attrs = |ino| Change::Inode { ino, pages: None };
    let entry = |parent, name| Change::Entry { parent, name };
    match *req {
        Request::Symlink { name, .. }
        | Request::Mknod { name, .. }
        | Request::Mkdir { name, .. }
        | Request::Create { name, .. }
        | Request::Unlink { name }
        | Request::Rmdir { name } => vec![entry(ino, name), attrs(ino)],
        Request::Link { oldnodeid, newname } => vec![entry(ino, newname), attrs(ino), attrs(oldnodeid)],
        Request::Rename { newdir, name, newname, .. } => {
            vec![entry(ino, name), entry(newdir, newname), attrs(ino), attrs(newdir)]
        }
        // A new size drops the pages past it; other attributes only
        // themselves.
        Request::Setattr { ref set, .. } => {
            vec![Change::Inode { ino, pages: set.size.map(|size| (size, 0)) }]
        }
        Request::Open { flags, .. } if flags as i32 & libc::O_TRUNC != 0 => {
            vec![Change::Inode { ino, pages: Some((0, 0)) }]
        }
        Request::Write { offset, data, .. } => {
            vec![Change::Inode { ino, pages: Some((offset, (data.len() as u64).max(1))) }]
        }
        Request::Fallocate { offset, length, .. } => vec![Change::Inode { ino, pages: Some((offset, length.max(1))) }],
        Request::CopyFileRange { nodeid_out, off_out, len, .. } => {
            vec![Change::Inode { ino: nodeid_out, pages: Some((off_out, len.max(1))) }]
        }
        Request::Setxattr { .. } | Request::Removexattr { .. } => vec![attrs(ino)],
        _ => Vec::new(),
    }
}

impl Session {
    pub fn new(fs: Fs, config: SessionConfig) -> Self {
        Self::with_stats(fs, config, Rc::default())
    }

    /// A session that counts into `stats`, which may outlive it (a
    /// reconnecting guest gets a new session and keeps the counters).
    pub fn with_stats(fs: Fs, config: SessionConfig, stats: Rc<OpStats>) -> Self {
        let member = config.coherence.as_ref().map(|c| (Rc::clone(c), c.member()));
        let locks = config.locks.as_ref().map(|l| (Rc::clone(l), l.join()));
        Self {
            member,
            locks,
            fs,
            config,
            stats,
            initialized: Cell::new(false),
            offer_io_uring: Cell::new(false),
            flags: Cell::new(0),
            shared_handles: RefCell::default(),
            holdings: RefCell::default(),
            notifier: RefCell::default(),
            span: tracing::Span::current(),
            failures_logged: keelfs_base::RateLimit::new(),
            readdir_entries: Cell::default(),
        }
    }

    /// What this session holds, by number: to move it to another keelfsd.
    pub fn save_state(&self) -> SessionState {
        let holdings = self.holdings.borrow();
        let mut lookups: Vec<(Ino, u64)> =
            holdings.lookups.iter().filter(|(_, &n)| n > 0).map(|(&ino, &n)| (Ino::new(ino), n)).collect();
        lookups.sort_unstable_by_key(|(ino, _)| ino.get());
        let mut handles: Vec<(Fh, HandleState)> = holdings
            .handles
            .keys()
            .filter_map(|&fh| self.fs.handover().handle_state(Fh::new(fh)).ok().map(|h| (Fh::new(fh), h)))
            .collect();
        handles.sort_unstable_by_key(|(fh, _)| fh.get());
        SessionState {
            fs_uuid: self.fs.handover().uuid(),
            initialized: self.initialized.get(),
            init_flags: self.flags.get(),
            lookups,
            handles,
            locks: self.saved_locks(),
        }
    }

    fn saved_locks(&self) -> Vec<SavedLock> {
        let Some((locks, client)) = &self.locks else { return Vec::new() };
        let saved = |(ino, h): (Ino, HeldLock)| SavedLock {
            ino,
            owner: h.owner.owner,
            start: h.start,
            end: h.end,
            fh: h.fh,
            write: h.kind == LockKind::Write,
            flock: h.space == LockSpace::Flock,
            pid: h.pid,
        };
        locks.held_by(*client).into_iter().map(saved).collect()
    }

    /// Take the locks of a restored session, all or none: each through a
    /// handle the state restores, and free of conflicts with the locks
    /// held here.
    fn restore_locks(&self, state: &SessionState) -> Result<(), StateError> {
        if state.locks.is_empty() {
            return Ok(());
        }
        let Some((locks, client)) = &self.locks else {
            return Err(StateError::Locks("this export leaves locks to its clients"));
        };
        let handles: keelfs_base::IdMap<Ino> = state.handles.iter().map(|(fh, h)| (fh.get(), h.ino)).collect();
        let mut held = Vec::with_capacity(state.locks.len());
        for l in &state.locks {
            if handles.get(&l.fh.get()) != Some(&l.ino) {
                return Err(StateError::Locks("a lock is not through a restored handle of its inode"));
            }
            let (owner, space, kind) = (
                LockOwner { client: *client, owner: l.owner },
                if l.flock { LockSpace::Flock } else { LockSpace::Posix },
                if l.write { LockKind::Write } else { LockKind::Read },
            );
            let (start, end, pid, fh) = (l.start, l.end, l.pid, l.fh);
            held.push((l.ino, HeldLock { owner, space, kind, start, end, pid, fh }));
        }
        locks.restore(*client, &held).map_err(|e| match e {
            LockError::Conflict => StateError::Locks("a lock conflicts with one held here"),
            _ => StateError::Locks("more locks than a session may hold"),
        })
    }

    /// A session over `fs` that holds what `state` says. Everything is
    /// checked against the image first (inodes that exist, handles that
    /// fit their inode and are not open), so a refused state takes nothing.
    pub fn restore(
        fs: Fs,
        config: SessionConfig,
        stats: Rc<OpStats>,
        state: &SessionState,
    ) -> Result<Self, StateError> {
        if state.fs_uuid != fs.handover().uuid() {
            let uuid: String = state.fs_uuid.iter().map(|b| format!("{b:02x}")).collect();
            return Err(StateError::OtherFilesystem(uuid));
        }
        if state.handles.len() > config.open_handles_max {
            return Err(StateError::TooManyHandles(state.handles.len()));
        }
        if let Some((ino, _)) = state.lookups.iter().find(|(ino, _)| !fs.handover().exists(*ino)) {
            return Err(StateError::NoInode(ino.get()));
        }
        for (fh, h) in &state.handles {
            let refuse = |why: String| StateError::Handle { fh: fh.get(), why };
            fs.handover().check_handle(h).map_err(|e| refuse(e.to_string()))?;
            if fs.handover().handle_state(*fh).is_ok() {
                return Err(refuse("the number is open already".into()));
            }
        }
        let session = Self::with_stats(fs, config, stats);
        // First, as it can still be refused: a refused state takes nothing.
        session.restore_locks(state)?;
        {
            let mut holdings = session.holdings.borrow_mut();
            for &(ino, n) in &state.lookups {
                session.fs.handover().hold_lookups(ino, n).expect("the inode was checked to exist");
                holdings.lookups.insert(ino.get(), n);
            }
            for &(fh, h) in &state.handles {
                session.fs.handover().restore_handle(fh, h).expect("the handle was checked, and numbers are unique");
                holdings.handles.insert(fh.get(), ());
            }
        }
        session.initialized.set(state.initialized);
        session.flags.set(state.init_flags);
        tracing::info!(
            parent: &session.span,
            lookups = state.lookups.len(),
            handles = state.handles.len(),
            locks = state.locks.len(),
            "session restored"
        );
        Ok(session)
    }

    /// Let the session tell its kernel about changes it did not ask for.
    pub fn set_notifier(&self, notifier: Notifier) {
        *self.notifier.borrow_mut() = Some(notifier);
    }

    /// Tell this session's kernel of the export's other clients'
    /// changes as they happen (a host mount, whose notifier is set).
    pub fn listen_for_changes(self: &Rc<Self>) {
        let Some((coherence, member)) = &self.member else { return };
        let session = Rc::downgrade(self);
        coherence.listen(
            *member,
            Rc::new(move |message: &[u8]| {
                if let Some(session) = session.upgrade() {
                    session.notify(message);
                }
            }),
        );
    }

    /// Send `message` to this session's kernel, if its transport can.
    fn notify(&self, message: &[u8]) {
        if let Some(notifier) = self.notifier.borrow().as_ref() {
            notifier.queue(message);
            self.stats.count_notification();
        }
    }

    /// [`Self::notify`], with the message taken by the kernel before the
    /// request being served is answered (see [`Notify::deliver_now`]).
    fn notify_before_reply(&self, message: &[u8]) {
        if let Some(notifier) = self.notifier.borrow().as_ref() {
            notifier.deliver_now(message);
            self.stats.count_notification();
        }
    }

    /// Whether another client listens for this session's changes.
    fn watched(&self) -> bool {
        self.member.as_ref().is_some_and(|(c, member)| c.has_listeners_besides(*member))
    }

    /// Tell the export's other clients of `changes`.
    fn publish(&self, changes: &[Change<'_>]) {
        if let Some((coherence, member)) = &self.member {
            coherence.publish(*member, changes);
        }
    }

    /// `len` bytes at `offset` of `ino` were written outside
    /// [`Self::handle`] (the zero-copy path): tell the other clients.
    fn data_changed(&self, ino: Ino, offset: u64, len: u64) {
        if self.watched() {
            self.publish(&[Change::Inode { ino, pages: Some((offset, len.max(1))) }]);
        }
    }

    /// The daemon changed `ino`'s attributes behind the kernel's back
    /// (cleared set-id bits on a write): have it drop its cached ones
    /// before the reply, so that a stat right after sees the new mode. A
    /// queued notification could reach it after the writer has seen its
    /// reply and run stat. The request pins `ino` in the kernel, so the
    /// kernel takes this at once.
    fn attributes_changed(&self, ino: Ino) {
        let change = Change::Inode { ino, pages: None };
        self.notify_before_reply(&change.notification());
        if self.watched() {
            self.publish(&[change]);
        }
    }

    /// Clear `ino`'s set-id bits and tell the kernel if that changed them.
    fn kill_setid(&self, ino: Ino, writer: &Creds) -> Result<(), i32> {
        if self.fs.kill_setid(ino, writer).map_err(|e| e.errno())? {
            self.attributes_changed(ino);
        }
        Ok(())
    }

    /// Count a lookup reference the kernel now holds on `ino`.
    fn hold_entry(&self, ino: Ino) {
        *self.holdings.borrow_mut().lookups.entry(ino.get()).or_default() += 1;
    }

    /// Record a handle this session opened; over the limit it is closed
    /// again and the open fails with EMFILE.
    async fn own_handle(&self, fh: Fh) -> Result<Fh, i32> {
        let full = {
            let mut h = self.holdings.borrow_mut();
            let full = h.handles.len() >= self.config.open_handles_max;
            if !full {
                h.handles.insert(fh.get(), ());
            }
            full
        };
        if full {
            let _ = self.fs.release(fh).await;
            return Err(libc::EMFILE);
        }
        Ok(fh)
    }

    /// `fh`, if this session opened it and it is a handle of `nodeid`: its
    /// open flags. Anything else is EBADF, as a closed fd would be.
    fn own_handle_of(&self, fh: Fh, nodeid: Ino) -> Result<u32, i32> {
        if !self.holdings.borrow().handles.contains_key(&fh.get()) {
            return Err(libc::EBADF);
        }
        match self.fs.handle(fh) {
            Ok((ino, flags)) if ino == nodeid => Ok(flags),
            _ => Err(libc::EBADF),
        }
    }

    /// Give back everything this session holds: at a second INIT (the
    /// guest rebooted) or when its frontend is gone.
    pub async fn give_back(&self) {
        let Holdings { handles, lookups } = std::mem::take(&mut *self.holdings.borrow_mut());
        for released in self.shared_handles.borrow_mut().drain().map(|(_, r)| r) {
            released.store(true, Ordering::Release);
        }
        for (fh, ()) in handles {
            let _ = self.fs.release(Fh::new(fh)).await;
        }
        for (ino, n) in lookups {
            let _ = self.fs.forget(Ino::new(ino), n).await;
        }
    }

    /// A reader of `fh`'s cached pages for another reactor, if `fh` is a
    /// buffered handle of `nodeid` in a live session.
    pub fn shared_reader(&self, fh: Fh, nodeid: Ino) -> Option<SharedHandle> {
        if !self.buffered_file(fh, nodeid) {
            return None;
        }
        let reader = self.fs.data().shared_reader(nodeid).ok()?;
        let released = self.shared_handles.borrow_mut().entry(fh.get()).or_default().clone();
        Some(SharedHandle { reader, released })
    }

    pub fn stats(&self) -> &Rc<OpStats> {
        &self.stats
    }

    /// Count a request served outside [`Self::handle`] (the zero-copy
    /// path): its opcode, bytes moved, whether it failed, and its latency.
    /// The reactor's idle policy counts it too: it compares how many
    /// requests are served per second spinning and asleep.
    pub fn record(&self, opcode: u32, bytes: usize, failed: bool, started: Instant) {
        self.stats.record(opcode, bytes, failed, started.elapsed());
        keelfs_reactor::note_served(1);
    }

    /// The kernel and this session agreed at INIT to move requests to
    /// io_uring ring entries.
    /// The largest WRITE (and READ) this session agreed to at INIT.
    pub fn max_write(&self) -> usize {
        self.config.max_write as usize
    }

    /// Offer FUSE_OVER_IO_URING at the next INIT.
    pub fn offer_io_uring(&self, offer: bool) {
        self.offer_io_uring.set(offer);
    }

    pub fn over_io_uring(&self) -> bool {
        self.flags.get() & f::OVER_IO_URING != 0
    }

    pub fn fs(&self) -> &Fs {
        &self.fs
    }

    /// The export's lock table and this session's number in it, if keelfs
    /// holds this session's locks (offered, and taken at INIT).
    fn lock_table(&self) -> Option<(&Locks, ClientId)> {
        let (locks, client) = self.locks.as_ref()?;
        let agreed = self.flags.get() & (f::POSIX_LOCKS | f::FLOCK_LOCKS) != 0;
        agreed.then_some((&**locks, *client))
    }

    fn holds_locks(&self) -> bool {
        self.lock_table().is_some()
    }

    /// End this session's lock waits with ENOLCK: its queues are stopping
    /// (a migration, a reset) and wait for every request to be answered.
    pub fn end_lock_waits(&self) {
        if let Some((locks, client)) = &self.locks {
            locks.end_waits(*client, LockError::Ended);
        }
    }

    /// GETLK, SETLK or SETLKW of `wanted` on `ino`.
    async fn lock(&self, unique: u64, ino: Ino, wanted: LockIn) -> Outcome {
        let op = wanted.op;
        let Some((locks, client)) = self.lock_table() else { return Err(libc::ENOSYS) };
        let kind = match wanted.kind as i32 {
            libc::F_RDLCK => Some(LockKind::Read),
            libc::F_WRLCK => Some(LockKind::Write),
            libc::F_UNLCK if op != LockOp::Test => None,
            _ => return Err(libc::EINVAL),
        };
        if wanted.start > wanted.end {
            return Err(libc::EINVAL);
        }
        let request = LockRequest {
            owner: LockOwner { client, owner: wanted.owner },
            space: if wanted.flock { LockSpace::Flock } else { LockSpace::Posix },
            kind,
            start: wanted.start,
            end: wanted.end,
            pid: wanted.pid,
            fh: wanted.fh,
        };
        match op {
            LockOp::Test => {
                let mut r = Reply::default();
                match locks.test(ino, &request) {
                    // Another client's pid means nothing in this client's
                    // pid namespace: 0, which Linux reports as no pid.
                    Some(h) => {
                        let pid = if h.owner.client == client { h.pid } else { 0 };
                        let kind = if h.kind == LockKind::Read { libc::F_RDLCK } else { libc::F_WRLCK };
                        r.u64(h.start).u64(h.end).u32(kind as u32).u32(pid);
                    }
                    None => {
                        r.u64(wanted.start).u64(wanted.end).u32(libc::F_UNLCK as u32).u32(0);
                    }
                }
                Ok(Some(r))
            }
            LockOp::Set => locks.set(ino, &request).map(|()| None).map_err(LockError::errno),
            LockOp::SetWaiting => {
                // Over io_uring each waiting request holds one of the ring
                // entries of its CPU's queue: no more than half of one.
                let waits_max = if self.over_io_uring() { ENTRIES_PER_QUEUE_MAX / 2 } else { WAITS_PER_CLIENT_MAX };
                locks.set_waiting(ino, &request, unique, waits_max).await.map(|()| None).map_err(LockError::errno)
            }
        }
    }

    /// Handle one request. None means FUSE expects no reply (FORGET,
    /// BATCH_FORGET, INTERRUPT, or bytes too broken to name a request).
    pub async fn handle(&self, request: &[u8]) -> Option<Vec<u8>> {
        let started = Instant::now();
        let reply = self.handle_unrecorded(request).await;
        if let Some(trace) = &self.config.trace {
            trace.exchange(request, reply.as_deref());
        }
        if let Some(opcode) = request.get(4..8) {
            let opcode = u32::from_le_bytes(opcode.try_into().expect("4 bytes"));
            let failed = reply.as_ref().is_some_and(|r| r.get(4..8).is_some_and(|e| e != [0u8; 4]));
            let bytes = request.len() + reply.as_ref().map_or(0, Vec::len);
            self.record(opcode, bytes, failed, started);
        }
        reply
    }

    async fn handle_unrecorded(&self, request: &[u8]) -> Option<Vec<u8>> {
        let (header, body, extensions) = match InHeader::parse_with_extensions(request) {
            Ok(parsed) => parsed,
            Err(e) => {
                let unique = request.get(8..16)?.try_into().ok().map(u64::from_le_bytes)?;
                return Some(error_reply(unique, e.errno()));
            }
        };
        let req = match parse(&header, body, self.flags.get() & f::SETXATTR_EXT != 0) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(
                    parent: &self.span,
                    opcode = ?Opcode::from_u32(header.opcode).ok_or(header.opcode),
                    ino = header.nodeid,
                    error = %e,
                    "request refused by the parser"
                );
                return Some(error_reply(header.unique, e.errno()));
            }
        };
        if matches!(req, Request::Forget { .. } | Request::BatchForget { .. } | Request::Interrupt { .. }) {
            self.forget(&header, &req).await;
            return None;
        }
        if !self.initialized.get() && !matches!(req, Request::Init { .. }) {
            return Some(error_reply(header.unique, libc::EIO));
        }
        // What the request changes, worked out only when another client
        // listens, and told to it only if the request succeeds.
        let changes = if self.watched() { changes_of(&header, &req) } else { Vec::new() };
        let outcome = self.dispatch(&header, req, extensions).await;
        if outcome.is_ok() && !changes.is_empty() {
            self.publish(&changes);
        }
        Some(match outcome {
            Ok(Some(reply)) => reply.finish(header.unique, 0),
            Ok(None) => Reply::default().finish(header.unique, 0),
            Err(errno) => {
                self.log_failure(&header, errno);
                error_reply(header.unique, errno)
            }
        })
    }

    /// A failed request: routine errnos (ENOENT, EEXIST, ...) at trace
    /// level, where a guest's misses would flood nothing; those an operator
    /// must hear of (the device or keelfs failed, the space or the quota
    /// ran out) as a warning, at most a burst per window of this session:
    /// a guest can provoke them at will.
    fn log_failure(&self, header: &InHeader, errno: i32) {
        let (ino, opcode) = (header.nodeid, header.opcode);
        // Fields are evaluated only when the event is enabled.
        if matches!(errno, libc::EIO | libc::ENOSPC | libc::EDQUOT) {
            keelfs_base::ratelimited!(
                limit = &self.failures_logged,
                tracing::warn!(
                    parent: &self.span,
                    opcode = ?Opcode::from_u32(opcode),
                    ino,
                    errno,
                    "request failed"
                )
            );
        } else {
            tracing::trace!(parent: &self.span, opcode = ?Opcode::from_u32(opcode), ino, errno, "request failed");
        }
    }

    async fn forget(&self, header: &InHeader, req: &Request<'_>) {
        match req {
            Request::Forget { nlookup } => self.forget_own(Ino::new(header.nodeid), *nlookup).await,
            Request::BatchForget { items } => {
                for &(ino, n) in items {
                    self.forget_own(ino, n).await;
                }
            }
            // Only a lock wait is answered early; any other request runs
            // to its end, as keelfs's requests do not block.
            Request::Interrupt { unique } => {
                if let Some((locks, client)) = self.lock_table() {
                    locks.interrupt(client, *unique);
                }
            }
            _ => {}
        }
    }

    /// FORGET of at most the references this session holds on `ino`.
    async fn forget_own(&self, ino: Ino, n: u64) {
        let n = {
            let mut h = self.holdings.borrow_mut();
            let Some(held) = h.lookups.get_mut(&ino.get()) else { return };
            let n = n.min(*held);
            *held -= n;
            if *held == 0 {
                h.lookups.remove(&ino.get());
            }
            n
        };
        let _ = self.fs.forget(ino, n).await;
    }

    fn valid_ns(d: Duration) -> u64 {
        d.as_nanos() as u64
    }

    /// An entry reply: the kernel holds one more lookup reference on it.
    fn entry(&self, a: &FsAttr) -> Reply {
        let mut r = Reply::default();
        self.entry_into(&mut r, a);
        r
    }

    /// Whether a missing `name` is answered with a negative entry (node
    /// id 0) that the kernel keeps for the entry timeout, instead of
    /// ENOENT, which it does not keep: then a search path, or a config
    /// file that is not there, is asked for once. Any name but "." and
    /// ".." (a "." lookup is how a file handle is found again, and its
    /// failure must stay an error), whenever names are kept at all. A
    /// client that cannot be told of another's create keeps it no longer
    /// than it keeps a name that exists; one that can is told
    /// (FUSE_NOTIFY_INVAL_ENTRY drops a negative entry too).
    fn caches_negative(&self, name: &[u8]) -> bool {
        !self.config.entry_timeout.is_zero() && name != b"." && name != b".."
    }

    /// fuse_entry_out for a name that is not there: node id 0.
    fn negative_entry(&self) -> Reply {
        let mut r = Reply::default();
        r.entry(0, 0, Self::valid_ns(self.config.entry_timeout), &Attr::default());
        r
    }

    /// fuse_entry_out for `a`, appended to `r`, holding a lookup of it.
    fn entry_into(&self, r: &mut Reply, a: &FsAttr) {
        self.hold_entry(a.ino());
        r.entry(a.ino().get(), a.inode.generation, Self::valid_ns(self.config.entry_timeout), &to_abi_attr(a));
    }

    fn attr(&self, a: &FsAttr) -> Reply {
        let mut r = Reply::default();
        r.attr_out(Self::valid_ns(self.config.attr_timeout), &to_abi_attr(a));
        r
    }

    fn init(&self, major: u32, minor: u32, max_readahead: u32, kernel_flags: u64) -> Outcome {
        if major < KERNEL_VERSION || (major == KERNEL_VERSION && minor < MIN_MINOR_VERSION) {
            return Err(libc::EPROTO);
        }
        let mut offered = OFFERED;
        if !self.config.xattr {
            offered &= !XATTR_FLAGS;
        }
        if self.config.writeback_cache {
            offered |= f::WRITEBACK_CACHE;
        }
        if self.offer_io_uring.get() {
            offered |= f::OVER_IO_URING;
        }
        if self.locks.is_some() {
            offered |= f::POSIX_LOCKS | f::FLOCK_LOCKS;
        }
        let flags = kernel_flags & offered;
        self.flags.set(flags);
        self.initialized.set(true);
        tracing::info!(parent: &self.span, major, minor, flags = format_args!("{flags:#x}"), "session started");
        let mut r = Reply::default();
        r.u32(KERNEL_VERSION).u32(KERNEL_MINOR_VERSION.min(if major > KERNEL_VERSION {
            KERNEL_MINOR_VERSION
        } else {
            minor
        }));
        r.u32(max_readahead).u32(flags as u32);
        r.u16(256).u16(192); // max_background, congestion_threshold
        r.u32(self.config.max_write).u32(1); // max_write, time_gran (ns)
        r.u16((self.config.max_write / FUSE_PAGE_BYTES) as u16).u16(0); // max_pages, map_alignment
        r.u32((flags >> 32) as u32).u32(0); // flags2, max_stack_depth
        r.raw(&[0u8; 24]);
        Ok(Some(r))
    }

    /// The caller of `req`. Both transports mount with default_permissions
    /// (virtio-fs always does), so the client kernel has checked the
    /// request with the caller's full credentials: keelfs-fs applies only
    /// the side effects (docs/ARCHITECTURE.md, "Permissions").
    fn creds(h: &InHeader, req: &Request<'_>, extensions: &[u8]) -> Creds {
        let mut c = Creds::checked_by_kernel(h.uid, h.gid);
        c.groups.extend(super::abi::supplementary_group(extensions));
        if let Request::Create { umask, .. }
        | Request::Mkdir { umask, .. }
        | Request::Mknod { umask, .. }
        | Request::Tmpfile { umask, .. } = req
        {
            c.umask = *umask;
        }
        c
    }

    /// Label a new inode with the security contexts its create carried
    /// (FUSE_SECURITY_CTX). No await separates this from the create, so
    /// both reach the journal in one transaction.
    async fn label(&self, a: &FsAttr, extensions: &[u8]) -> Result<(), i32> {
        let kernel = Creds::checked_by_kernel(0, 0);
        for (name, value) in super::abi::security_contexts(extensions) {
            if name.starts_with(b"security.") {
                self.fs.setxattr(&kernel, a.ino(), name, value, XattrFlags::default()).await.map_err(|e| e.errno())?;
            }
        }
        Ok(())
    }

    /// The reply to CREATE or TMPFILE: the new inode labelled, its handle
    /// owned, and fuse_entry_out with fuse_open_out. A failed label
    /// releases the handle.
    async fn created_open(&self, a: &FsAttr, fh: Fh, flags: u32, extensions: &[u8]) -> Outcome {
        if let Err(errno) = self.label(a, extensions).await {
            let _ = self.fs.release(fh).await;
            return Err(errno);
        }
        let fh = self.own_handle(fh).await?;
        let mut r = self.entry(a);
        put_open_out(&mut r, fh, self.open_reply_flags(flags));
        Ok(Some(r))
    }

    /// fuse_open_out.open_flags for a file opened with `flags`.
    ///
    /// FLUSH has nothing to do here unless keelfs holds the session's
    /// locks: writes are answered once they are in the filesystem, and
    /// otherwise POSIX locks are the client kernel's own (INIT offers no
    /// POSIX_LOCKS), so no lock owner needs its close. NOFLUSH then spares
    /// a client without the writeback cache (a guest, by default) one
    /// round trip per close(2); Linux still flushes when it has that
    /// cache. With the locks here, every close(2) must reach keelfs, which
    /// releases the closing process's POSIX locks then (as Linux does at
    /// close, and as a FUSE client leaves to its server).
    fn open_reply_flags(&self, flags: u32) -> u32 {
        let mut open = if self.holds_locks() { 0 } else { open_flags::NOFLUSH };
        if flags as i32 & libc::O_DIRECT != 0 || self.config.cache == CacheMode::None {
            open |= open_flags::DIRECT_IO | open_flags::PARALLEL_DIRECT_WRITES;
        }
        if self.config.keep_cache {
            open |= open_flags::KEEP_CACHE;
        }
        open
    }

    /// The flags a new handle keeps. Under writeback caching the client
    /// kernel reads through whichever handle it writes with, to fill a
    /// page before a partial write (fuse_write_begin), so a write-only
    /// open must read too: the kernel has already checked the caller's
    /// right to write, and the caller itself cannot read through it.
    fn handle_flags(&self, flags: u32) -> u32 {
        let wronly = flags as i32 & libc::O_ACCMODE == libc::O_WRONLY;
        if wronly && self.flags.get() & f::WRITEBACK_CACHE != 0 {
            (flags & !(libc::O_ACCMODE as u32)) | libc::O_RDWR as u32
        } else {
            flags
        }
    }

    /// A change Linux makes only under CAP_FSETID, which FUSE does not
    /// carry for fallocate and copy_file_range: only root is assumed to
    /// hold it, and anyone else clears the file's set-id bits.
    fn kill_setid_unless_root(&self, ino: Ino, caller: &Creds) -> Result<(), i32> {
        if caller.uid == 0 {
            return Ok(());
        }
        self.kill_setid(ino, caller)
    }

    /// The entry reply for an inode just made, labelled first.
    async fn created(&self, a: &FsAttr, extensions: &[u8]) -> Outcome {
        self.label(a, extensions).await?;
        Ok(Some(self.entry(a)))
    }

    // A flat table, one arm per opcode, each a call or two: split, it would
    // scatter the one place that says what every opcode does.
    #[allow(clippy::too_many_lines)]
    async fn dispatch(&self, h: &InHeader, req: Request<'_>, extensions: &[u8]) -> Outcome {
        let c = Self::creds(h, &req, extensions);
        let fs = &self.fs;
        let ino = Ino::new(h.nodeid);
        let e = |err: FsError| errno_of(&err);
        if fs.read_only() && req.modifies() {
            return Err(libc::EROFS);
        }
        match req {
            Request::Init { major, minor, max_readahead, flags } => {
                if self.initialized.get() {
                    // A rebooted guest starts over on the same connection:
                    // the references its previous kernel held are gone.
                    self.give_back().await;
                }
                self.init(major, minor, max_readahead, flags)
            }
            Request::Destroy => Ok(None),
            Request::Lookup { name } => match fs.lookup(&c, ino, name).await {
                Ok(a) => Ok(Some(self.entry(&a))),
                Err(FsError::NotFound) if self.caches_negative(name) => Ok(Some(self.negative_entry())),
                Err(err) => Err(e(err)),
            },
            Request::Getattr => Ok(Some(self.attr(&fs.getattr(ino).await.map_err(e)?))),
            Request::Statx => {
                let a = fs.getattr(ino).await.map_err(e)?;
                let btime = (a.inode.btime.sec as u64, a.inode.btime.nsec);
                let mut r = Reply::default();
                r.statx_out(Self::valid_ns(self.config.attr_timeout), &to_abi_attr(&a), btime);
                Ok(Some(r))
            }
            Request::Setattr { set, via_handle } => {
                let a = fs.setattr(&c, ino, &set, via_handle).await.map_err(e)?;
                Ok(Some(self.attr(&a)))
            }
            Request::Readlink => {
                let mut r = Reply::default();
                r.raw(&fs.readlink(ino).await.map_err(e)?);
                Ok(Some(r))
            }
            Request::Symlink { name, target } => {
                self.created(&fs.symlink(&c, ino, name, target).await.map_err(e)?, extensions).await
            }
            Request::Mknod { mode, rdev, name, .. } => {
                self.created(&fs.mknod(&c, ino, name, mode, rdev).await.map_err(e)?, extensions).await
            }
            Request::Mkdir { mode, name, .. } => {
                self.created(&fs.mkdir(&c, ino, name, mode).await.map_err(e)?, extensions).await
            }
            Request::Unlink { name } => fs.unlink(&c, ino, name).await.map(|_| None).map_err(e),
            Request::Rmdir { name } => fs.rmdir(&c, ino, name).await.map(|_| None).map_err(e),
            Request::Rename { newdir, mode, name, newname } => {
                fs.rename(&c, ino, name, newdir, newname, mode.map_err(e)?).await.map(|_| None).map_err(e)
            }
            Request::Link { oldnodeid, newname } => {
                Ok(Some(self.entry(&fs.link(&c, oldnodeid, ino, newname).await.map_err(e)?)))
            }
            Request::Open { flags, open_flags } => {
                let flags = self.handle_flags(flags);
                let fh = self.own_handle(fs.open(&c, ino, flags).await.map_err(e)?).await?;
                if open_flags & OPEN_KILL_SUIDGID != 0 && flags as i32 & libc::O_TRUNC != 0 {
                    self.kill_setid(ino, &c)?;
                }
                Ok(Some(open_out(fh, self.open_reply_flags(flags))))
            }
            Request::Opendir { .. } => {
                let fh = self.own_handle(fs.opendir(&c, ino).await.map_err(e)?).await?;
                Ok(Some(open_out(fh, open_flags::NOFLUSH)))
            }
            Request::Create { flags, mode, name, open_flags, .. } => {
                let flags = self.handle_flags(flags);
                let (a, fh) = fs.create(&c, ino, name, mode, flags).await.map_err(e)?;
                if open_flags & OPEN_KILL_SUIDGID != 0 && flags as i32 & libc::O_TRUNC != 0 {
                    self.kill_setid(a.ino(), &c)?;
                }
                self.created_open(&a, fh, flags, extensions).await
            }
            Request::Tmpfile { flags, mode, .. } => {
                let flags = self.handle_flags(flags);
                let (mut a, fh) = fs.tmpfile(&c, ino, mode, flags).await.map_err(e)?;
                // The kernel takes the file's one link away itself
                // (d_tmpfile), so it must see one: keelfs's inode has none.
                a.inode.nlink = 1;
                self.created_open(&a, fh, flags, extensions).await
            }
            Request::Read { fh, offset, size } => self.read(fh, ino, offset, size).await,
            Request::Write { fh, offset, write_flags, data } => {
                self.kill_setid_on_write(ino, write_flags, &c)?;
                self.write(fh, ino, offset, write_flags, data).await
            }
            Request::Readdir { fh, offset, size, plus } => {
                self.own_handle_of(fh, ino)?;
                self.readdir(&c, fh, ino, offset, size, plus).await
            }
            Request::Statfs => {
                let s = fs.statfs().await.map_err(e)?;
                let mut r = Reply::default();
                r.u64(s.blocks).u64(s.blocks_free).u64(s.blocks_free).u64(s.files).u64(s.files_free);
                r.u32(s.block_size).u32(s.name_max).u32(s.block_size).u32(0).raw(&[0u8; 24]);
                Ok(Some(r))
            }
            Request::Release { fh, .. } | Request::Releasedir { fh } => {
                self.own_handle_of(fh, ino)?;
                if let Some((locks, client)) = self.lock_table() {
                    // Its OFD and flock locks, whose owner it is: Linux
                    // says so only for flock (RELEASE_FLOCK_UNLOCK), and
                    // sends an OFD lock's release nowhere else.
                    locks.release_file(ino, client, fh);
                }
                self.holdings.borrow_mut().handles.remove(&fh.get());
                if let Some(released) = self.shared_handles.borrow_mut().remove(&fh.get()) {
                    released.store(true, Ordering::Release);
                }
                fs.release(fh).await.map(|_| None).map_err(e)
            }
            Request::Flush { fh, lock_owner } => {
                self.own_handle_of(fh, ino)?;
                if let Some((locks, client)) = self.lock_table() {
                    locks.release_owner(ino, LockOwner { client, owner: lock_owner });
                }
                Ok(None)
            }
            // ENOSYS before any check of the request, when keelfs does not
            // hold the session's locks: it tells the kernel to keep its own.
            Request::Lock(_) if !self.holds_locks() => Err(libc::ENOSYS),
            Request::Lock(wanted) => {
                self.own_handle_of(wanted.fh, ino)?;
                self.lock(h.unique, ino, wanted).await
            }
            Request::Fsync { fh, datasync, dir } => {
                self.own_handle_of(fh, ino)?;
                let r =
                    if dir { fs.data().fsyncdir(ino, datasync).await } else { fs.data().fsync(ino, datasync).await };
                r.map(|_| None).map_err(e)
            }
            Request::Setxattr { .. }
            | Request::Getxattr { .. }
            | Request::Listxattr { .. }
            | Request::Removexattr { .. }
                if !self.config.xattr =>
            {
                Err(libc::ENOSYS)
            }
            Request::Setxattr { flags, setxattr_flags, name, value } => {
                fs.setxattr(&c, ino, name, value, flags).await.map_err(e)?;
                if setxattr_flags & SETXATTR_ACL_KILL_SGID != 0 && name == b"system.posix_acl_access" {
                    fs.kill_sgid(ino).map_err(e)?;
                }
                Ok(None)
            }
            Request::Getxattr { size, name } => sized(size, fs.getxattr(&c, ino, name).await.map_err(e)?),
            Request::Listxattr { size } => sized(size, fs.listxattr(ino).await.map_err(e)?),
            Request::Removexattr { name } => fs.removexattr(&c, ino, name).await.map(|_| None).map_err(e),
            Request::Access { mask } => fs.access(&c, ino, mask).await.map(|_| None).map_err(e),
            Request::Fallocate { fh, offset, length, mode } => {
                // The mode first, as vfs_fallocate checks it before the file.
                let mode = mode.map_err(e)?;
                writable(self.own_handle_of(fh, ino)?)?;
                // Linux clears set-id bits on fallocate (file_modified).
                self.kill_setid_unless_root(ino, &c)?;
                fs.data().fallocate(ino, mode, FileOffset::new(offset), length).await.map(|_| None).map_err(e)
            }
            Request::Lseek { fh, offset, to } => {
                self.own_handle_of(fh, ino)?;
                let at = fs.data().lseek(ino, FileOffset::new(offset), to.ok_or(libc::EINVAL)?).await.map_err(e)?;
                let mut r = Reply::default();
                r.u64(at.get());
                Ok(Some(r))
            }
            Request::Syncfs => fs.sync().await.map(|_| None).map_err(e),
            Request::CopyFileRange { fh_in, off_in, nodeid_out, fh_out, off_out, len, flags } => {
                if flags != 0 {
                    return Err(libc::EINVAL);
                }
                readable(self.own_handle_of(fh_in, ino)?)?;
                writable(self.own_handle_of(fh_out, nodeid_out)?)?;
                self.kill_setid_unless_root(nodeid_out, &c)?;
                let copied = fs
                    .data()
                    .copy_range(ino, FileOffset::new(off_in), nodeid_out, FileOffset::new(off_out), len)
                    .await
                    .map_err(e)?;
                Ok(Some(write_out(copied as u32)))
            }
            Request::Ioctl { fh, flags, cmd, input, out_size } => {
                self.own_handle_of(fh, ino)?;
                self.ioctl(h, flags, cmd, input, out_size).await
            }
            Request::Unsupported(_) => Err(libc::ENOSYS),
            Request::Forget { .. } | Request::BatchForget { .. } | Request::Interrupt { .. } => Ok(None),
        }
    }

    /// FUSE_IOCTL: FITRIM (a guest's fstrim, made on the mount's root)
    /// runs [`keelfs_fs::Admin::trim`] over the whole filesystem; any other command gets
    /// ENOTTY, as from a filesystem without that ioctl. The reply is
    /// fuse_ioctl_out, then the fstrim_range with `len` set to the bytes
    /// trimmed.
    async fn ioctl(&self, h: &InHeader, flags: u32, cmd: u32, input: &[u8], out_size: u32) -> Outcome {
        if cmd != FITRIM || flags & IOCTL_UNRESTRICTED != 0 {
            return Err(libc::ENOTTY);
        }
        // The guest kernel checks no capability for a FUSE ioctl (only
        // that the caller may use the mount), and a trim costs the host
        // device time: root only, as FITRIM's CAP_SYS_ADMIN elsewhere.
        if h.uid != 0 {
            return Err(libc::EPERM);
        }
        if input.len() != FSTRIM_RANGE_BYTES || out_size as usize != FSTRIM_RANGE_BYTES {
            return Err(libc::EINVAL);
        }
        let word = |i: usize| u64::from_le_bytes(input[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let (start, minlen) = (word(0), word(2));
        let trimmed = self.fs.admin().trim(minlen).await.map_err(|e| e.errno())?;
        let mut r = Reply::default();
        r.u32(0).u32(0).u32(0).u32(0); // result, flags, in_iovs, out_iovs
        r.u64(start).u64(trimmed).u64(minlen);
        Ok(Some(r))
    }

    /// Whether `io` is served in the transport's memory: Some(true) on an
    /// O_DIRECT handle (that memory is the device I/O's), Some(false) on
    /// a buffered one (copied once, to or from the page cache). None
    /// sends it to the copying path, which answers it, errors included:
    /// a WRITE larger than the agreed max_write is EINVAL there, and a
    /// READ is cut to it, on both paths alike. A session that records a
    /// trace sends every request there, where the trace is kept.
    pub fn in_place_handle(&self, io: &InPlaceIo) -> Option<bool> {
        if io.size > self.config.max_write || self.config.trace.is_some() {
            return None;
        }
        self.io_handle(io.fh, io.nodeid, io.write)
    }

    /// The READ or WRITE that `prefix` starts, in a request of `len`
    /// bytes, when it can be served in the transport's memory, with what
    /// [`Self::in_place_handle`] says of its handle. None sends the
    /// request to the copying path.
    pub fn in_place_request(&self, prefix: &[u8; IO_PREFIX_BYTES], len: usize) -> Option<(InPlaceIo, bool)> {
        let io = InPlaceIo::parse(prefix, len)?;
        let direct = self.in_place_handle(&io)?;
        Some((io, direct))
    }

    /// Serve the WRITE `io`, whose data `data` holds in the transport's
    /// memory, on a handle [`Self::in_place_handle`] allowed. Gives
    /// `data` back, for the transport to reuse.
    pub async fn write_in_place<B>(&self, io: &InPlaceIo, direct: bool, data: B) -> (B, ShortReply)
    where
        B: IoBuffer + WriteSource,
    {
        debug_assert!(io.write && data.len() == io.size as usize);
        let started = Instant::now();
        let writer = Creds::checked_by_kernel(io.uid, io.gid);
        let (data, result) = match self.kill_setid_on_write(io.nodeid, io.write_flags, &writer) {
            Err(errno) => (data, Err(errno)),
            Ok(()) if direct => self.write_direct_from(io.nodeid, io.offset, data).await,
            Ok(()) => {
                let result = self.write_buffered_from(io.nodeid, io.offset, io.write_flags, &data).await;
                (data, result)
            }
        };
        let reply = match result {
            Ok(written) => {
                self.data_changed(io.nodeid, io.offset, u64::from(io.size));
                ShortReply::written(io.unique, written)
            }
            Err(errno) => ShortReply::error(io.unique, errno),
        };
        self.record(Opcode::Write as u32, io.request_len() + reply.as_bytes().len(), reply.is_error(), started);
        (data, reply)
    }

    /// Serve the READ `io` into `into`, the transport's memory after the
    /// reply's header, on a handle [`Self::in_place_handle`] allowed.
    pub async fn read_in_place<B: ReadInPlace>(&self, io: &InPlaceIo, direct: bool, into: B) -> ShortReply {
        debug_assert!(!io.write);
        let started = Instant::now();
        let (into, result) = if direct {
            self.read_direct_into(io.nodeid, io.offset, into).await
        } else {
            let result = self.read_buffered_into(io.nodeid, io.offset, io.size, &into).await;
            (into, result)
        };
        let (reply, moved) = match result {
            Ok(n) => {
                // A buffered read copied exactly `n` bytes; only the device
                // writes whole blocks, past the file's end too.
                if direct {
                    into.zero_from(n as usize);
                }
                (ShortReply::data_header(io.unique, n as usize), n as usize)
            }
            Err(errno) => (ShortReply::error(io.unique, errno), 0),
        };
        self.record(Opcode::Read as u32, io.request_len() + OUT_HEADER_BYTES + moved, reply.is_error(), started);
        reply
    }

    /// A WRITE whose flags say the writer lacks CAP_FSETID clears the
    /// file's set-id bits first, as Linux's file_remove_privs.
    fn kill_setid_on_write(&self, ino: Ino, write_flags: u32, writer: &Creds) -> Result<(), i32> {
        if write_flags & WRITE_KILL_SUIDGID == 0 {
            return Ok(());
        }
        self.kill_setid(ino, writer)
    }

    /// For a READ (`write` false) or WRITE through `fh` on `nodeid`: Some(true)
    /// for an O_DIRECT handle, Some(false) for a buffered one, None when
    /// the handle is not this live session's, names another inode, or was
    /// not opened for that access (the copying path then answers EBADF).
    fn io_handle(&self, fh: Fh, nodeid: Ino, write: bool) -> Option<bool> {
        if !self.initialized.get() {
            return None;
        }
        let flags = self.own_handle_of(fh, nodeid).ok()?;
        let flags = if write { writable(flags) } else { readable(flags) }.ok()?;
        Some(flags as i32 & libc::O_DIRECT != 0)
    }

    /// True when `fh` is an open, non-O_DIRECT handle of `nodeid` in a live
    /// session: its data goes through the page cache.
    pub fn buffered_file(&self, fh: Fh, nodeid: Ino) -> bool {
        self.initialized.get() && self.own_handle_of(fh, nodeid).is_ok_and(|flags| flags as i32 & libc::O_DIRECT == 0)
    }

    /// FUSE_WRITE on a buffered handle, copying once from `data` (guest
    /// pages) into the page cache: the bytes written, or an errno.
    async fn write_buffered_from<S: WriteSource + ?Sized>(
        &self,
        ino: Ino,
        offset: u64,
        write_flags: u32,
        data: &S,
    ) -> Result<u32, i32> {
        debug_assert!(data.len() <= self.config.max_write as usize, "in_place_handle held it to max_write");
        self.fs
            .data()
            .write_from_with(ino, FileOffset::new(offset), data, self.write_times(write_flags))
            .await
            .map_err(|e| e.errno())
    }

    /// FUSE_READ on a buffered handle into `sink` (guest pages): the bytes
    /// read, or an errno.
    async fn read_buffered_into<K: ReadSink + ?Sized>(
        &self,
        ino: Ino,
        offset: u64,
        size: u32,
        sink: &K,
    ) -> Result<u32, i32> {
        debug_assert!(size <= self.config.max_write, "in_place_handle held it to max_write");
        self.fs.data().read_to(ino, FileOffset::new(offset), size, sink).await.map_err(|e| e.errno())
    }

    /// FUSE_WRITE on a direct handle with the data already in I/O memory
    /// (guest pages): the bytes written, or an errno.
    async fn write_direct_from<B: IoBuffer>(&self, ino: Ino, offset: u64, data: B) -> (B, Result<u32, i32>) {
        let (data, written) = self.fs.data().write_direct(ino, FileOffset::new(offset), data).await;
        (data, written.map_err(|e| e.errno()))
    }

    /// FUSE_READ on a direct handle into I/O memory (guest pages): the
    /// bytes read, or an errno.
    async fn read_direct_into<B: IoBuffer>(&self, ino: Ino, offset: u64, into: B) -> (B, Result<u32, i32>) {
        let (buf, n) = self.fs.data().read_direct(ino, FileOffset::new(offset), into).await;
        (buf, n.map_err(|e| e.errno()))
    }

    async fn read(&self, fh: Fh, ino: Ino, offset: u64, size: u32) -> Outcome {
        let flags = readable(self.own_handle_of(fh, ino)?)?;
        let size = size.min(self.config.max_write);
        let data = if flags as i32 & libc::O_DIRECT != 0 {
            let buf = AlignedBuf::zeroed((size as usize).div_ceil(BLOCK_BYTES).max(1) * BLOCK_BYTES, BLOCK_BYTES);
            let (buf, n) = self.fs.data().read_direct(ino, FileOffset::new(offset), buf).await;
            buf[..n.map_err(|e| e.errno())? as usize].to_vec()
        } else {
            self.fs.data().read(ino, FileOffset::new(offset), size).await.map_err(|e| e.errno())?
        };
        let mut r = Reply::default();
        r.raw(&data[..data.len().min(size as usize)]);
        Ok(Some(r))
    }

    /// Who keeps the file's times for a write with these flags: the
    /// client kernel, for pages its writeback cache sends (it stamped
    /// mtime at write(2) and sends it in a SETATTR, which may arrive
    /// before the pages do).
    pub fn write_times(&self, write_flags: u32) -> WriteTimes {
        let cached = write_flags & WRITE_CACHE != 0 && self.flags.get() & f::WRITEBACK_CACHE != 0;
        if cached {
            WriteTimes::KeptByClient
        } else {
            WriteTimes::Stamp
        }
    }

    async fn write(&self, fh: Fh, ino: Ino, offset: u64, write_flags: u32, data: &[u8]) -> Outcome {
        let flags = writable(self.own_handle_of(fh, ino)?)?;
        if data.len() > self.config.max_write as usize {
            return Err(libc::EINVAL);
        }
        // O_DIRECT handles bypass the page cache. (The virtio-fs path
        // hands guest pages over directly and never gets here for them.)
        let n = if flags as i32 & libc::O_DIRECT != 0 && !data.is_empty() {
            let mut buf = AlignedBuf::zeroed(data.len(), BLOCK_BYTES);
            buf.copy_from_slice(data);
            self.fs.data().write_direct(ino, FileOffset::new(offset), buf).await.1
        } else {
            self.fs.data().write_from_with(ino, FileOffset::new(offset), data, self.write_times(write_flags)).await
        }
        .map_err(|e| e.errno())?;
        Ok(Some(write_out(n)))
    }

    async fn readdir(&self, c: &Creds, fh: Fh, ino: Ino, offset: u64, size: u32, plus: bool) -> Outcome {
        // No more entries than the reply can hold: each takes at least a
        // dirent of 32 bytes (a name of 1 to 8 bytes), and fuse_entry_out
        // with plus. Asking for more made listing a large directory
        // quadratic: every page built the names of all the entries after it.
        let entry_min = 32 + if plus { super::abi::ENTRY_OUT_BYTES } else { 0 };
        let most = (size as usize / entry_min).clamp(1, READDIR_ENTRIES_MAX);
        // The session's list from the last READDIR, when no other is using
        // it: a steady listing allocates none.
        let mut entries = self.readdir_entries.take();
        let listed = self.fs.readdir_handle_into(fh, offset, most, false, &mut entries).await;
        let outcome = match listed {
            Ok(()) => self.encode_dirents(c, ino, size, plus, entry_min, &entries).await,
            Err(e) => Err(e.errno()),
        };
        if entries.capacity() <= READDIR_ENTRIES_KEPT {
            entries.clear();
            self.readdir_entries.set(entries);
        }
        outcome
    }

    /// READDIR's reply: as many of `entries` as `size` holds, each with its
    /// entry (and a lookup reference) for READDIRPLUS.
    async fn encode_dirents(
        &self,
        c: &Creds,
        ino: Ino,
        size: u32,
        plus: bool,
        entry_min: usize,
        entries: &[DirEntry],
    ) -> Outcome {
        // Room for what these entries take with names of up to 40 bytes,
        // never more than asked for: `size` is the client's, and a hostile
        // one asking 1 MiB of a small directory gets no 1 MiB buffer.
        let mut r = Reply::default();
        r.bytes.reserve((entries.len() * (entry_min + 40)).min(size as usize));
        for ent in entries {
            let namelen = ent.name.len();
            let dirent_len = (24 + namelen).div_ceil(8) * 8;
            let need = dirent_len + if plus { super::abi::ENTRY_OUT_BYTES } else { 0 };
            if r.bytes.len() + need > size as usize {
                break;
            }
            if plus {
                let dots = *ent.name == *b"." || *ent.name == *b"..";
                if dots {
                    // No lookup reference for "." and "..": a zeroed entry.
                    r.raw(&[0u8; super::abi::ENTRY_OUT_BYTES]);
                } else {
                    let a = self.fs.lookup(c, ino, &ent.name).await.map_err(|e| e.errno())?;
                    self.entry_into(&mut r, &a);
                }
            }
            r.u64(ent.ino.get()).u64(ent.next_offset).u32(namelen as u32).u32(ent.file_type >> 12);
            r.raw(&ent.name);
            r.raw(&[0u8; 8][..dirent_len - 24 - namelen]);
        }
        Ok(Some(r))
    }
}

/// Directory entries one READDIR reply holds at most.
const READDIR_ENTRIES_MAX: usize = 4096;

/// The most entries' room a session keeps for its next READDIR: a 4 KiB
/// page of short names (128); a hostile client's 1 MiB READDIR is not kept.
const READDIR_ENTRIES_KEPT: usize = 256;

/// A handle's flags if it was opened for reading, else EBADF (read(2) on a
/// write-only fd).
fn readable(flags: u32) -> Result<u32, i32> {
    if flags as i32 & libc::O_ACCMODE == libc::O_WRONLY {
        Err(libc::EBADF)
    } else {
        Ok(flags)
    }
}

/// A handle's flags if it was opened for writing, else EBADF.
fn writable(flags: u32) -> Result<u32, i32> {
    if flags as i32 & libc::O_ACCMODE == libc::O_RDONLY {
        Err(libc::EBADF)
    } else {
        Ok(flags)
    }
}

/// fuse_write_out: the bytes written.
fn write_out(written: u32) -> Reply {
    let mut r = Reply::default();
    r.u32(written).u32(0);
    r
}

fn open_out(fh: Fh, open: u32) -> Reply {
    let mut r = Reply::default();
    put_open_out(&mut r, fh, open);
    r
}

/// fuse_open_out, at the end of `r`: CREATE's follows its entry, in the
/// one pooled buffer. `open` is [`Session::open_reply_flags`]'s.
fn put_open_out(r: &mut Reply, fh: Fh, open: u32) {
    r.u64(fh.get()).u32(open).u32(0);
}

/// getxattr/listxattr: a size query, the value, or ERANGE.
fn sized(size: u32, value: Vec<u8>) -> Outcome {
    let mut r = Reply::default();
    if size == 0 {
        r.u32(value.len() as u32).u32(0);
    } else if (size as usize) < value.len() {
        return Err(libc::ERANGE);
    } else {
        r.raw(&value);
    }
    Ok(Some(r))
}
