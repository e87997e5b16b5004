//! The /dev/fuse transport: mount keelfs on the host and serve the
//! kernel's requests from a reactor with the same dispatcher the
//! virtio-fs backend uses.

use std::ffi::CString;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use keelfs_reactor::{self as reactor, Poller, PollerClass};

use keelfs_bdev::AlignedBuf;
use keelfs_reactor::AlignedWindow;

use super::abi::{opcode_of, Opcode};
use super::dispatch::{Notify, Session};
use super::request::{InPlaceIo, IO_PREFIX_BYTES};
use super::uring::{self, UringError, UringPlan};
use crate::qos::{Charge, Gate, Qos};

/// Requests read per poll: bounds one reactor iteration.
const REQUESTS_PER_POLL_MAX: usize = 32;
/// Large enough for a 1 MiB write plus its headers, as the kernel requires.
const REQUEST_BUFFER_BYTES: usize = (1 << 20) + 4096;
/// Where a request is read into its buffer: so that a WRITE's data,
/// after its prefix, starts on a page and goes to the device as it is.
const REQUEST_AT: usize = DATA_ALIGN - IO_PREFIX_BYTES;
const DATA_ALIGN: usize = 4096;
/// Request buffers kept for reuse once a WRITE gives its own back. The
/// kernel has few requests outstanding on a mount (max_background, and a
/// blocked caller for each other); past this many, a buffer is freed.
const SPARE_BUFFERS_MAX: usize = 16;

/// A buffer for one request read from /dev/fuse, aligned for direct I/O.
fn request_buffer() -> AlignedBuf {
    AlignedBuf::zeroed((REQUEST_AT + REQUEST_BUFFER_BYTES).next_multiple_of(DATA_ALIGN), DATA_ALIGN)
}

/// Who takes a mount down: by default this process, with umount2(2).
/// A process that can no longer see the mount point (the daemon inside its
/// sandbox) asks another that can.
pub type Unmounter = Box<dyn Fn(&Path) -> std::io::Result<()> + Send>;

/// A mounted /dev/fuse session; unmounted on drop.
pub struct FuseMount {
    device: File,
    mountpoint: PathBuf,
    mounted: std::cell::Cell<bool>,
    unmounter: Option<Unmounter>,
    /// Told when the mount is found gone (someone ran umount).
    on_gone: Option<Unmounter>,
}

impl FuseMount {
    /// Open /dev/fuse and mount it at `mountpoint` (needs CAP_SYS_ADMIN).
    pub fn mount(mountpoint: &Path, fsname: &str) -> std::io::Result<Self> {
        Self::mount_with(mountpoint, fsname, &format!("fuse.{fsname}"), libc::MS_NOSUID | libc::MS_NODEV)
    }

    /// [`Self::mount`] with the mount's `source` and `fstype` ("fuse" or
    /// "fuse.SUBTYPE") as mount(8) shows them, and mount(2)'s `flags`
    /// (MS_RDONLY makes the host kernel refuse changes itself, and statfs
    /// report ST_RDONLY; MS_NOATIME and the like are the kernel's to apply).
    pub fn mount_with(mountpoint: &Path, source: &str, fstype: &str, flags: libc::c_ulong) -> std::io::Result<Self> {
        if fstype != "fuse" && !fstype.starts_with("fuse.") {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "a FUSE mount's type is fuse[.SUBTYPE]"));
        }
        let device = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/fuse")?;
        // default_permissions: the kernel checks permissions with the
        // caller's full credentials, as virtio-fs always does.
        let options =
            format!("fd={},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions", device.as_raw_fd());
        let (src, target, fstype, data) = (
            CString::new(source)?,
            CString::new(mountpoint.as_os_str().as_bytes())?,
            CString::new(fstype)?,
            CString::new(options)?,
        );
        // SAFETY: every pointer is a NUL-terminated string that outlives
        // the call; mount(2) copies them.
        let rc = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), fstype.as_ptr(), flags, data.as_ptr().cast()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mounted = std::cell::Cell::new(true);
        Ok(Self { device, mountpoint: mountpoint.to_path_buf(), mounted, unmounter: None, on_gone: None })
    }

    /// Take the mount down with `unmounter` instead of umount2(2).
    pub fn set_unmounter(&mut self, unmounter: Unmounter) {
        self.unmounter = Some(unmounter);
    }

    /// Call `on_gone` once the kernel ends the session because the mount
    /// was unmounted by someone else: whoever cleans up after this server
    /// must then leave the mount point alone, since a new mount (reusing
    /// the old one's mount id) may already sit there.
    pub fn set_on_gone(&mut self, on_gone: Unmounter) {
        self.on_gone = Some(on_gone);
    }

    /// The kernel ended the session: nothing is left to unmount.
    fn gone(&self) {
        if self.mounted.replace(false) {
            if let Some(on_gone) = &self.on_gone {
                let _ = on_gone(&self.mountpoint);
            }
        }
    }

    pub fn fd(&self) -> RawFd {
        self.device.as_raw_fd()
    }

    /// Detach the mount; the kernel then ends the session.
    pub fn unmount(&self) -> std::io::Result<()> {
        if !self.mounted.replace(false) {
            return Ok(());
        }
        if let Some(unmounter) = &self.unmounter {
            return unmounter(&self.mountpoint);
        }
        let target = CString::new(self.mountpoint.as_os_str().as_bytes())?;
        // SAFETY: a NUL-terminated path that outlives the call.
        if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        let _ = self.unmount();
    }
}

/// Serve `mount` with `session` on the current reactor. `on_end` runs once
/// the kernel ends the session: the mount was unmounted, by keelfsd or by
/// anyone else (`umount DIR`).
pub fn serve(session: Rc<Session>, mount: Rc<FuseMount>, on_end: Box<dyn FnOnce()>) {
    serve_with(session, mount, None, on_end);
}

/// [`serve`], with the READs and WRITEs limited by `qos` (the export's
/// limiter, shared with its vhost-user device on this reactor).
pub fn serve_with(session: Rc<Session>, mount: Rc<FuseMount>, qos: Option<Rc<Qos>>, on_end: Box<dyn FnOnce()>) {
    serve_over(session, mount, qos, None, on_end).expect("no ring to set up");
}

/// [`serve_with`], moving the requests to FUSE over io_uring after INIT
/// when `uring` is given (see [`uring`]). The ring is set up here, before
/// INIT: failing that is an error. Should the kernel not agree at INIT or
/// refuse the ring's registration, /dev/fuse serves on, unless
/// `uring.required`, which unmounts. `session.stats()` names the transport
/// in use.
pub fn serve_over(
    session: Rc<Session>,
    mount: Rc<FuseMount>,
    qos: Option<Rc<Qos>>,
    uring: Option<UringPlan>,
    on_end: Box<dyn FnOnce()>,
) -> Result<(), UringError> {
    let ring = match uring {
        Some(plan) => Some((uring::prepare(Rc::clone(&mount), plan, session.max_write())?, plan.required)),
        None => None,
    };
    session.offer_io_uring(ring.is_some());
    session.stats().set_transport("dev");
    session.set_notifier(Box::new(NotifyWriter::new(Rc::clone(&mount))));
    session.listen_for_changes();
    let poller = DevFusePoller {
        session,
        mount,
        buf: request_buffer(),
        spares: Rc::default(),
        closed: false,
        on_end: Some(on_end),
        deferred: qos.clone().map(Gate::new),
        after_init: Rc::new(AfterInit { ring: std::cell::Cell::new(ring), qos, ended: Rc::default() }),
    };
    reactor::register_poller(PollerClass::Source, Box::new(poller));
    Ok(())
}

/// Notifications queued for the kernel at most; past it they are dropped
/// (and counted), rather than the reactor waiting.
pub const NOTIFY_QUEUE_MAX: usize = 4096;

/// Writes notifications to /dev/fuse from a thread of its own, in order.
/// The kernel may hold such a write on a lock that a request this reactor
/// has yet to answer holds (a directory's, for FUSE_NOTIFY_INVAL_ENTRY
/// beside a create in it; a page's, for pages being read), so the reactor
/// writes none of those itself. The thread starts with the first
/// notification, and ends when the session is gone. The one kind the
/// reactor does write is [`Notify::deliver_now`]'s: attributes alone, of
/// an inode the request being served pins, which the kernel applies
/// without waiting for any request's answer.
struct NotifyWriter {
    mount: Rc<FuseMount>,
    queue: std::cell::RefCell<Option<std::sync::mpsc::SyncSender<Vec<u8>>>>,
    dropped: std::cell::Cell<u64>,
    dropped_logged: keelfs_base::RateLimit,
}

impl NotifyWriter {
    fn new(mount: Rc<FuseMount>) -> Self {
        Self {
            mount,
            queue: std::cell::RefCell::default(),
            dropped: std::cell::Cell::new(0),
            dropped_logged: keelfs_base::RateLimit::new(),
        }
    }

    fn start(&self) -> std::io::Result<std::sync::mpsc::SyncSender<Vec<u8>>> {
        let device = self.mount.device.try_clone()?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(NOTIFY_QUEUE_MAX);
        std::thread::Builder::new().name("keelfs-notify".into()).spawn(move || {
            for message in rx {
                // A notification the kernel refuses (the mount is going
                // away, or the inode is gone) needs nothing more.
                let _ = (&device).write_all(&message);
            }
        })?;
        Ok(tx)
    }

    fn drop_one(&self, why: &str) {
        self.dropped.set(self.dropped.get() + 1);
        keelfs_base::ratelimited!(
            limit = &self.dropped_logged,
            tracing::warn!(dropped = self.dropped.get(), "a notification to the host kernel was dropped: {why}")
        );
    }
}

impl Notify for NotifyWriter {
    fn queue(&self, message: &[u8]) {
        let mut queue = self.queue.borrow_mut();
        if queue.is_none() {
            match self.start() {
                Ok(tx) => *queue = Some(tx),
                Err(e) => return self.drop_one(&format!("no writer thread: {e}")),
            }
        }
        let tx = queue.as_ref().expect("started above");
        if let Err(e) = tx.try_send(message.to_vec()) {
            self.drop_one(&e.to_string());
        }
    }

    fn deliver_now(&self, message: &[u8]) {
        // A refusal (ENOENT: the kernel holds no such inode) leaves it
        // nothing cached to drop.
        let _ = (&self.mount.device).write_all(message);
    }
}

/// What the first INIT's answer leads to: the ring, if one is ready.
struct AfterInit {
    ring: std::cell::Cell<Option<(uring::Prepared, bool)>>,
    qos: Option<Rc<Qos>>,
    /// Set when the kernel ends the session, for the ring's poller.
    ended: Rc<std::cell::Cell<bool>>,
}

impl AfterInit {
    /// INIT was answered: register the ring if the kernel agreed to it.
    fn run(&self, session: &Rc<Session>, mount: &FuseMount) {
        let Some((prepared, required)) = self.ring.take() else {
            tracing::info!("host mount served through /dev/fuse");
            return;
        };
        let entries = prepared.entries();
        let outcome = match session.over_io_uring() {
            true => uring::start(Rc::clone(session), prepared, self.qos.clone(), Rc::clone(&self.ended)),
            false => Err(UringError::Unavailable("the kernel did not offer FUSE_OVER_IO_URING at INIT".into())),
        };
        match outcome {
            Ok(()) => {
                session.stats().set_transport("uring");
                tracing::info!(entries, "host mount served through FUSE over io_uring");
            }
            // Refused or never offered: the kernel sends everything
            // through /dev/fuse.
            Err(e @ (UringError::Refused(_) | UringError::Unavailable(_))) if !required => {
                tracing::warn!("{e}; host mount served through /dev/fuse");
            }
            // Otherwise the kernel may hold every request for a ring that
            // will not come, or the configuration asked for io_uring only.
            Err(e) => {
                tracing::error!("{e}; unmounting the host mount");
                let _ = mount.unmount();
            }
        }
    }
}

struct DevFusePoller {
    session: Rc<Session>,
    mount: Rc<FuseMount>,
    /// Where the next request is read, from [`REQUEST_AT`] on.
    buf: AlignedBuf,
    /// Request buffers that WRITEs served in place gave back.
    spares: Rc<std::cell::RefCell<Vec<AlignedBuf>>>,
    closed: bool,
    on_end: Option<Box<dyn FnOnce()>>,
    /// Requests QoS holds back. The kernel bounds them: it has only so
    /// many requests outstanding per mount (max_background for the
    /// asynchronous ones, a blocked caller for each other).
    deferred: Option<Gate<Vec<u8>>>,
    after_init: Rc<AfterInit>,
}

impl DevFusePoller {
    fn start(&self, request: Vec<u8>) {
        let (session, mount) = (Rc::clone(&self.session), Rc::clone(&self.mount));
        let is_init = opcode_of(&request) == Some(Opcode::Init as u32);
        let after_init = is_init.then(|| Rc::clone(&self.after_init));
        reactor::spawn_local(async move {
            if let Some(reply) = session.handle(&request).await {
                // ENOENT: the kernel gave up on the request
                // (interrupted); nothing else to do.
                let _ = (&mount.device).write_all(&reply);
                crate::bufpool::give(reply);
            }
            // The kernel took the INIT reply in the write: the ring's
            // registration needs it to have.
            if let Some(after_init) = after_init {
                after_init.run(&session, &mount);
            }
        });
    }

    /// The WRITE of the `len` bytes just read, when it can be served
    /// with its data where it was read: none is copied on an O_DIRECT
    /// handle, and only into the page cache on another. Not while a QoS
    /// limit is on, whose gate holds requests as copies.
    fn in_place_write(&self, len: usize) -> Option<(InPlaceIo, bool)> {
        if self.deferred.as_ref().is_some_and(|gate| !gate.open()) {
            return None;
        }
        let prefix = self.buf.get(REQUEST_AT..REQUEST_AT + IO_PREFIX_BYTES)?.try_into().expect("the prefix's length");
        self.session.in_place_request(prefix, len).filter(|(io, _)| io.write)
    }

    /// Serve the WRITE `io` in the buffer it was read into, which goes
    /// with it; a spare takes its place for the next request.
    fn start_write(&mut self, io: InPlaceIo, direct: bool) {
        let spare = self.spares.borrow_mut().pop().unwrap_or_else(request_buffer);
        let buf = std::mem::replace(&mut self.buf, spare);
        // InPlaceIo::parse held the size to what the read returned.
        let data = AlignedWindow::new(buf, DATA_ALIGN, io.size as usize).expect("the data lies inside what was read");
        self.session.stats().count_in_place_write();
        let (session, mount, spares) = (Rc::clone(&self.session), Rc::clone(&self.mount), Rc::clone(&self.spares));
        reactor::spawn_local(async move {
            let (data, reply) = session.write_in_place(&io, direct, data).await;
            // ENOENT: the kernel gave up on the request.
            let _ = (&mount.device).write_all(reply.as_bytes());
            let mut spares = spares.borrow_mut();
            if spares.len() < SPARE_BUFFERS_MAX {
                spares.push(data.into_inner());
            }
        });
    }

    /// Start the held requests whose turn came.
    fn release_deferred(&mut self, now: Instant) -> bool {
        let Some(mut gate) = self.deferred.take() else { return false };
        let ran = gate.drain(now, |request| self.start(request));
        self.deferred = Some(gate);
        ran
    }
}

impl Poller for DevFusePoller {
    fn poll(&mut self, now: Instant) -> bool {
        if self.closed {
            return false;
        }
        let mut busy = self.release_deferred(now);
        for _ in 0..REQUESTS_PER_POLL_MAX {
            match (&self.mount.device).read(&mut self.buf[REQUEST_AT..]) {
                Ok(0) => break,
                Ok(n) => {
                    busy = true;
                    if let Some((io, direct)) = self.in_place_write(n) {
                        self.start_write(io, direct);
                        continue;
                    }
                    let read = &self.buf[REQUEST_AT..REQUEST_AT + n];
                    let request = read.to_vec();
                    let request = match &mut self.deferred {
                        Some(gate) if !gate.open() => match gate.offer(request, Charge::of_request(read), now) {
                            Some(request) => request,
                            None => continue,
                        },
                        _ => request,
                    };
                    self.start(request);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) || e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    // ENODEV after unmount, or a broken session: stop.
                    // There is nothing left to unmount.
                    self.closed = true;
                    self.after_init.ended.set(true);
                    // Nobody is left to answer.
                    self.deferred = None;
                    self.mount.gone();
                    if let Some(on_end) = self.on_end.take() {
                        on_end();
                    }
                    break;
                }
            }
        }
        busy
    }

    fn wake_fd(&self) -> Option<RawFd> {
        (!self.closed).then(|| self.mount.fd())
    }

    fn wake_fd_is_eventfd(&self) -> bool {
        false
    }
}
