//! The virtio-fs device over vhost-user.
//!
//! Two sides meet here:
//! - vhost-user threads (vhost-user-backend's connection and epoll
//!   threads) speak the control protocol and notice guest kicks. They own
//!   nothing of the filesystem: a kick only sets a bit and rings the
//!   owning reactor's doorbell (an eventfd), and control events travel
//!   over a lock-free channel.
//! - The reactor that owns the filesystem owns the virtqueues: it pops
//!   descriptor chains, runs each request as a task, and returns finished
//!   chains to the used ring in batches, signalling the guest only when
//!   EVENT_IDX says it wants to hear. While requests keep coming it polls
//!   the rings with guest notifications off; after a short idle spell it
//!   turns them back on and sleeps until the next kick.
//! - Optionally, *helper* reactors (other cores) own some request queues
//!   ([`ServeOptions::helpers`]). A helper serves a READ whose pages are
//!   all cached itself, from the page cache through a `SharedReader`,
//!   without a lock or a message; every other request it sends to the
//!   owner as a message (`reactor::remote`), which serves it as if popped
//!   there, and the helper completes the chain.
//!
//! One listener thread accepts one frontend at a time and goes back to
//! accepting when it leaves, so a VM restart needs no daemon restart.

use std::cell::{Cell, RefCell};
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::virtio::GuestRam;
use keelfs_bdev::BlockDevice;
use keelfs_fs::Fs;
use keelfs_reactor::{self as reactor, PollerClass, ReactorHandle};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::fuse::dispatch::{Session, SessionConfig};
use crate::fuse::stats::OpStats;
use crate::qos::{Gate, Qos, QosError, QosLimits};

mod backend;
mod migration;
mod poller;

use backend::FsBackend;
use migration::Attachment;
pub use migration::{ImageAccess, LocalFuture, TransferError};
use poller::{HelperServer, OwnerServer, QueuePoller, QueueState};

/// A vring over logged guest memory.
type Vring = vhost_user_backend::VringRwLock<GuestMemoryAtomic<GuestRam>>;

const VIRTIO_F_VERSION_1: u64 = 1 << 32;
const VIRTIO_RING_F_INDIRECT_DESC: u64 = 1 << 28;
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;

/// Queue 0 carries FORGET, BATCH_FORGET and INTERRUPT; the rest carry
/// requests.
pub const HIPRIO_QUEUE: usize = 0;
/// Largest ring a frontend may set up (QEMU's `queue-size` maximum).
pub const QUEUE_SIZE_MAX: usize = 1024;
/// Request queues one device may have: kicks travel as bits of a u64.
pub const REQUEST_QUEUES_MAX: usize = 63;
/// Chains popped from one queue per reactor iteration, so that one busy
/// queue cannot starve the others or the device completions.
const POP_BATCH: usize = 64;
/// How long a queue stays in polling mode with nothing available before
/// the guest is asked to kick again.
const POLL_IDLE: Duration = Duration::from_micros(200);
/// How long GET_VRING_BASE waits for the requests of a stopping queue.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum VhostUserError {
    #[error("request queues must be between 1 and {REQUEST_QUEUES_MAX}, not {0}")]
    QueueCount(usize),
    #[error("cannot listen on the vhost-user socket: {0}")]
    Listen(#[from] crate::socket::SocketError),
    #[error("cannot create the doorbell eventfd: {0}")]
    EventFd(io::Error),
    #[error("cannot duplicate the listening socket: {0}")]
    Listener(io::Error),
    #[error("cannot start the vhost-user listener thread: {0}")]
    Thread(io::Error),
    #[error("helper reactor {0} refused its queues (stopped, or its inbox is full)")]
    Helper(usize),
    #[error("a server started without its image needs a way to take it (ServeOptions::image)")]
    NoImage,
    #[error("QoS limits apply on one reactor: a server with helper reactors cannot have them")]
    QosWithHelpers,
}

/// What one frontend connection shares between the vhost-user threads and
/// the reactor.
struct Connection {
    /// The vrings, learnt from the first kick (vhost-user-backend hands
    /// them to `handle_event` only).
    vrings: OnceLock<Vec<Vring>>,
    /// One bit per queue kicked since the reactor last looked.
    kicks: AtomicU64,
    /// Guest memory; the vhost-user handler swaps in each new table.
    mem: GuestMemoryAtomic<GuestRam>,
}

enum Control {
    Connected(Arc<Connection>),
    /// GET_VRING_BASE: stop popping, finish what is in flight, then say so.
    StopQueue {
        index: usize,
        done: SyncSender<()>,
    },
    /// The frontend left: drop its requests' replies and its references.
    Disconnected {
        done: SyncSender<()>,
    },
    /// SET_DEVICE_STATE_FD, SAVE: the session's state, with the image
    /// given up.
    SaveState {
        done: SyncSender<Result<Vec<u8>, TransferError>>,
    },
    /// SET_DEVICE_STATE_FD, LOAD: take this session (and the image).
    LoadState {
        state: Box<crate::fuse::state::SessionState>,
        done: SyncSender<Result<(), TransferError>>,
    },
}

/// How the vhost-user threads reach the reactor: a channel and an eventfd
/// the reactor sleeps on.
#[derive(Clone)]
struct Doorbell {
    control: Sender<Control>,
    wake: Arc<EventFd>,
}

impl Doorbell {
    fn send(&self, control: Control) -> bool {
        let delivered = self.control.send(control).is_ok();
        self.ring();
        delivered
    }

    fn ring(&self) {
        // EAGAIN means the counter is already non-zero: the reactor will
        // wake anyway.
        let _ = self.wake.write(1);
    }

    /// Send and wait for the reactor's answer; false if it is gone or
    /// does not answer in time.
    fn call(&self, make: impl FnOnce(SyncSender<()>) -> Control, timeout: Duration) -> bool {
        let (done, answered) = mpsc::sync_channel(1);
        self.send(make(done)) && answered.recv_timeout(timeout).is_ok()
    }
}

/// The doorbells of the pollers that share a device's queues: the owner's
/// first, then the helpers'.
#[derive(Clone)]
struct Pollers {
    doorbells: Vec<Doorbell>,
}

impl Pollers {
    /// `count` doorbells, and the receiving ends of their control channels
    /// in the same order.
    fn new(count: usize) -> Result<(Self, std::vec::IntoIter<Receiver<Control>>), VhostUserError> {
        let mut doorbells = Vec::new();
        let mut receivers = Vec::new();
        for _ in 0..count {
            let wake = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(VhostUserError::EventFd)?);
            let (control, control_rx) = mpsc::channel();
            doorbells.push(Doorbell { control, wake });
            receivers.push(control_rx);
        }
        Ok((Self { doorbells }, receivers.into_iter()))
    }

    /// Which poller serves queue `index`: the owner takes the hiprio queue,
    /// and the request queues go round the pollers.
    fn index_of(queue: usize, pollers: usize) -> usize {
        if queue == HIPRIO_QUEUE {
            0
        } else {
            (queue - 1) % pollers
        }
    }

    /// The queues poller `poller` serves, as kick bits.
    fn mask(poller: usize, pollers: usize, queues: usize) -> u64 {
        (0..queues).filter(|&q| Self::index_of(q, pollers) == poller).fold(0, |m, q| m | 1 << q)
    }

    fn of_queue(&self, queue: usize) -> &Doorbell {
        &self.doorbells[Self::index_of(queue, self.doorbells.len())]
    }

    fn owner(&self) -> &Doorbell {
        &self.doorbells[0]
    }

    fn helpers(&self) -> &[Doorbell] {
        &self.doorbells[1..]
    }
}

/// Counters of the device, read on its reactor.
#[derive(Debug, Default)]
pub struct DeviceStats {
    pub connections: Cell<u64>,
    pub chains: Cell<u64>,
    pub replies: Cell<u64>,
    /// Replies to direct reads and writes whose data moved between guest
    /// pages and the device with no copy.
    pub zero_copy: Cell<u64>,
    /// Replies to buffered reads and writes whose data was copied once,
    /// between guest pages and the page cache.
    pub one_copy: Cell<u64>,
    pub no_reply: Cell<u64>,
    pub dropped: Cell<u64>,
    pub last_drop: Cell<Option<&'static str>>,
    pub signals: Cell<u64>,
    pub kicks: Cell<u64>,
    pub in_flight_max: Cell<usize>,
    /// Queues a driver broke by moving the avail index more than a ring
    /// ahead of what keelfs took.
    pub broken_queues: Cell<u64>,
}

/// Counters of the helper reactors' queues (atomics: the helpers write,
/// the owner's stats RPC reads).
#[derive(Debug, Default)]
pub struct HelperStats {
    pub chains: AtomicU64,
    /// READs served on the helper from the page cache.
    pub from_cache: AtomicU64,
    /// Requests sent to the owning reactor.
    pub forwarded: AtomicU64,
    pub in_flight: AtomicU64,
}

/// How an export's device is served.
#[derive(Default)]
pub struct ServeOptions {
    /// The device under the filesystem, told of guest memory so that it can
    /// DMA to it directly.
    pub dma: Option<Arc<dyn BlockDevice>>,
    /// Other reactors that poll some of the request queues (see the module
    /// documentation). Empty: the owner polls them all.
    pub helpers: Vec<ReactorHandle>,
    /// The socket's mode and owner, set before it can accept.
    pub socket_access: crate::socket::SocketAccess,
    /// A socket already bound at the path (see [`crate::socket::bind_listener`]),
    /// for a caller that must open it before it loses sight of the path,
    /// as the daemon does before it enters its sandbox; the caller then
    /// removes the path. None: bind here, and remove it on stop.
    pub listener: Option<std::os::unix::net::UnixListener>,
    /// Requests in flight per queue at most (None, or more than the ring
    /// holds: the ring's size). Past it, requests wait in the ring:
    /// backpressure, not an error. Requests QoS holds count in it.
    pub requests_in_flight_max: Option<usize>,
    /// How the server gives its image up and takes it back, so that its
    /// guest can migrate (see [`ImageAccess`]). None: the device refuses
    /// to save its state, and the caller unmounts the filesystem.
    pub image: Option<Rc<dyn ImageAccess>>,
    /// A session kept across a restart ([`VhostUserServer::stop_and_release`]),
    /// restored when the image is attached if it fits it.
    pub restore: Option<crate::fuse::state::SessionState>,
    /// The export's QoS limiter, shared with its other transports on this
    /// reactor (see [`crate::Qos`]); its limits may change at any time.
    /// None: never limited. Refused with helpers: their queues are polled
    /// on other reactors, which cannot share it.
    pub qos: Option<Rc<Qos>>,
    /// How long, by the reactor's clock, a kicked queue stays in polling
    /// mode with nothing available before it asks the driver to kick
    /// again. None: 200 µs. A test on a virtual clock keeps its queues
    /// polled (`Duration::MAX`), so that whatever the driver has published
    /// is taken in the reactor's next iteration, with no kick racing it.
    pub poll_idle: Option<Duration>,
}

static NEXT_SERVER_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The current session of each device owned by this reactor, for the
    /// requests helpers send here.
    static SESSIONS: RefCell<keelfs_base::IdMap<Rc<Session>>> = RefCell::default();
}

fn session_of(server: u64) -> Option<Rc<Session>> {
    SESSIONS.with(|s| s.borrow().get(&server).cloned())
}

/// A running vhost-user-fs export: the listener thread and, on the
/// reactor that created it, the queue poller.
pub struct VhostUserServer {
    id: u64,
    socket: PathBuf,
    wake_accept: std::os::unix::net::UnixListener,
    /// Whether this server bound the socket, and so removes its path.
    owns_path: bool,
    stopping: Arc<AtomicBool>,
    /// Completed by the listener's thread as it ends; taken by `stop`.
    finished: Option<reactor::Call<()>>,
    active: Arc<Mutex<Option<ShutdownHandle>>>,
    thread: Option<JoinHandle<()>>,
    stats: Rc<DeviceStats>,
    op_stats: Rc<OpStats>,
    in_flight: Vec<Rc<Cell<usize>>>,
    helper_stats: Arc<HelperStats>,
    helpers: usize,
    attachment: Rc<Attachment>,
    qos: Option<Rc<Qos>>,
}

/// What every queue poller of one server shares.
#[derive(Clone, Copy)]
struct PollerShape {
    server: u64,
    queues: usize,
    pollers: usize,
    in_flight_max: usize,
    poll_idle: Duration,
}

/// The owning reactor's queue poller, for the queues `Pollers::mask`
/// gives poller 0, started on this reactor.
fn start_owner_poller(
    attachment: &Rc<Attachment>,
    control: Receiver<Control>,
    wake: Arc<EventFd>,
    in_flight: &[Rc<Cell<usize>>],
    stats: &Rc<DeviceStats>,
    shape: PollerShape,
    qos: Option<&Rc<Qos>>,
) {
    let owner = QueuePoller {
        server: OwnerServer { attachment: attachment.clone() },
        mine: Pollers::mask(0, shape.pollers, shape.queues),
        control,
        wake,
        connection: None,
        queues: in_flight
            .iter()
            .map(|c| QueueState {
                in_flight: c.clone(),
                deferred: qos.cloned().map(Gate::new),
                ..QueueState::default()
            })
            .collect(),
        disconnects: Vec::new(),
        stats: stats.clone(),
        in_flight_max: shape.in_flight_max,
        poll_idle: shape.poll_idle,
        span: tracing::Span::current(),
        share: None,
    };
    reactor::register_poller(PollerClass::Source, Box::new(owner));
}

/// A queue poller on each helper reactor, for the queues `Pollers::mask`
/// gives it. Helper `i` takes the `i`th receiver.
fn start_helper_pollers(
    helpers: &[ReactorHandle],
    receivers: impl Iterator<Item = Receiver<Control>>,
    pollers: &Pollers,
    shape: PollerShape,
    helper_stats: &Arc<HelperStats>,
) -> Result<(), VhostUserError> {
    let owner_handle = reactor::current();
    let PollerShape { server: id, queues, pollers: poller_count, in_flight_max, poll_idle } = shape;
    for (i, (helper, control)) in helpers.iter().zip(receivers).enumerate() {
        let (wake, owner, helper_stats) =
            (pollers.helpers()[i].wake.clone(), owner_handle.clone(), helper_stats.clone());
        let mine = Pollers::mask(i + 1, poller_count, queues);
        // The export's span (current here, on the owner), not the helper's.
        let span = tracing::Span::current();
        let start = move || {
            let poller = QueuePoller {
                server: HelperServer { id, owner, handles: Rc::default(), stats: helper_stats },
                mine,
                control,
                wake,
                connection: None,
                queues: (0..queues).map(|_| QueueState::default()).collect(),
                disconnects: Vec::new(),
                stats: Rc::default(),
                in_flight_max,
                poll_idle,
                span,
                share: None,
            };
            reactor::register_poller(PollerClass::Source, Box::new(poller));
        };
        if helper.send(start).is_err() {
            return Err(VhostUserError::Helper(helper.id()));
        }
    }
    Ok(())
}

impl VhostUserServer {
    /// Listen on `socket` and serve `fs` to one frontend at a time. Must be
    /// called on the reactor that owns `fs`: its queues are polled there.
    pub fn start(fs: Fs, config: SessionConfig, socket: &Path, request_queues: usize) -> Result<Self, VhostUserError> {
        Self::start_with(fs, config, socket, request_queues, ServeOptions::default())
    }

    /// As [`Self::start`], with the options of [`ServeOptions`].
    pub fn start_with(
        fs: Fs,
        config: SessionConfig,
        socket: &Path,
        request_queues: usize,
        options: ServeOptions,
    ) -> Result<Self, VhostUserError> {
        Self::start_inner(Some(fs), config, socket, request_queues, options)
    }

    /// Serve with the image not taken yet: it is taken, through
    /// `options.image`, when a migrated session arrives or at the first
    /// request (the destination of a live migration).
    pub fn start_detached(
        config: SessionConfig,
        socket: &Path,
        request_queues: usize,
        options: ServeOptions,
    ) -> Result<Self, VhostUserError> {
        if options.image.is_none() {
            return Err(VhostUserError::NoImage);
        }
        Self::start_inner(None, config, socket, request_queues, options)
    }

    fn start_inner(
        fs: Option<Fs>,
        config: SessionConfig,
        socket: &Path,
        request_queues: usize,
        options: ServeOptions,
    ) -> Result<Self, VhostUserError> {
        if request_queues == 0 || request_queues > REQUEST_QUEUES_MAX {
            return Err(VhostUserError::QueueCount(request_queues));
        }
        let queues = request_queues + 1;
        // The pollers lower it to each ring's size.
        let in_flight_max = options.requests_in_flight_max.unwrap_or(usize::MAX).max(1);
        // A helper with no queue of its own would only cost a poller.
        let helpers: Vec<ReactorHandle> = options.helpers.into_iter().take(request_queues - 1).collect();
        if options.qos.is_some() && !helpers.is_empty() {
            return Err(VhostUserError::QosWithHelpers);
        }
        let poller_count = 1 + helpers.len();
        let id = NEXT_SERVER_ID.fetch_add(1, Ordering::Relaxed);
        let (pollers, mut receivers) = Pollers::new(poller_count)?;
        // Whoever bound the socket removes its path afterwards.
        let owns_path = options.listener.is_none();
        let bound = match options.listener {
            Some(listener) => listener,
            None => crate::socket::bind_listener(socket, options.socket_access)?,
        };
        // A second descriptor of the same socket, for stop() to wake the
        // accept with.
        let wake_accept = bound.try_clone().map_err(VhostUserError::Listener)?;
        let mut listener = Listener::from(bound);
        let stats = Rc::new(DeviceStats::default());
        let op_stats = Rc::new(OpStats::default());
        let helper_stats = Arc::new(HelperStats::default());
        let in_flight: Vec<Rc<Cell<usize>>> = (0..queues).map(|_| Rc::default()).collect();
        let attachment = Attachment::new(id, fs, config, op_stats.clone(), options.image, options.restore);
        let poll_idle = options.poll_idle.unwrap_or(POLL_IDLE);
        let shape = PollerShape { server: id, queues, pollers: poller_count, in_flight_max, poll_idle };
        let control = receivers.next().expect("one receiver per poller");
        let wake = pollers.owner().wake.clone();
        start_owner_poller(&attachment, control, wake, &in_flight, &stats, shape, options.qos.as_ref());
        start_helper_pollers(&helpers, receivers, &pollers, shape, &helper_stats)?;

        let stopping = Arc::new(AtomicBool::new(false));
        let (listener_done, finished) = reactor::oneshot();
        let active = Arc::new(Mutex::new(None));
        let dma = options.dma;
        let thread = {
            let (stopping, active) = (stopping.clone(), active.clone());
            // The listener's events belong to the export that started it.
            let span = tracing::Span::current();
            std::thread::Builder::new()
                .name("vhost-user-listen".into())
                .spawn(move || {
                    let _span = span.entered();
                    accept_loop(&mut listener, queues, &pollers, &stopping, &active, dma.as_ref());
                    listener_done.complete(());
                    pollers.owner().ring();
                })
                .map_err(VhostUserError::Thread)?
        };
        Ok(Self {
            id,
            socket: socket.to_owned(),
            wake_accept,
            owns_path,
            stopping,
            finished: Some(finished),
            active,
            thread: Some(thread),
            stats,
            op_stats,
            in_flight,
            helper_stats,
            helpers: helpers.len(),
            attachment,
            qos: options.qos,
        })
    }

    /// The filesystem served, if the image is attached (a migration's
    /// source gives it up at switch-over; its destination takes it then).
    pub fn fs(&self) -> Option<Fs> {
        self.attachment.fs()
    }

    /// [`Self::stop`], then give the session's references back and, for
    /// a server with [`ServeOptions::image`], the image up (commit,
    /// checkpoint, unlock). With `keep_session`, the references stay held
    /// in the image and the session is returned, for a restarted daemon to
    /// restore ([`ServeOptions::restore`]).
    pub async fn stop_and_release(
        self,
        keep_session: bool,
    ) -> Result<Option<crate::fuse::state::SessionState>, TransferError> {
        let attachment = self.attachment.clone();
        if keep_session {
            attachment.keep_session_at_stop();
        }
        self.stop().await;
        attachment.release(keep_session).await
    }

    pub fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    /// Counters of the queues helper reactors serve, and how many helpers
    /// there are.
    pub fn helper_stats(&self) -> (usize, &HelperStats) {
        (self.helpers, &self.helper_stats)
    }

    /// The QoS limiter the server was started with ([`ServeOptions::qos`]).
    pub fn qos(&self) -> Option<&Rc<Qos>> {
        self.qos.as_ref()
    }

    /// Change the server's QoS limits, from its reactor.
    pub fn set_qos(&self, limits: QosLimits) -> Result<(), QosError> {
        self.qos.as_ref().ok_or(QosError::NoLimiter)?.set_limits(limits)
    }

    /// Per-opcode counters across every frontend this server has had.
    pub fn op_stats(&self) -> &Rc<OpStats> {
        &self.op_stats
    }

    /// Requests being served right now, per queue (queue 0 first), on the
    /// owning reactor.
    pub fn in_flight(&self) -> Vec<usize> {
        self.in_flight.iter().map(|c| c.get()).collect()
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Disconnect the frontend, stop accepting, and wait (without blocking
    /// the reactor) until the device has drained its requests.
    pub async fn stop(mut self) {
        self.stopping.store(true, Ordering::Release);
        if let Some(handle) = self.active.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            handle.shutdown();
        }
        // Wake a listener blocked in accept: it sees `stopping` and leaves.
        crate::socket::stop_accepting(&self.wake_accept);
        // Completes with None too if the thread ended otherwise.
        if let Some(finished) = self.finished.take() {
            finished.await;
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        SESSIONS.with(|s| s.borrow_mut().remove(&self.id));
        if self.owns_path {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

fn accept_loop(
    listener: &mut Listener,
    queues: usize,
    pollers: &Pollers,
    stopping: &AtomicBool,
    active: &Mutex<Option<ShutdownHandle>>,
    dma: Option<&Arc<dyn BlockDevice>>,
) {
    while !stopping.load(Ordering::Acquire) {
        let mem = GuestMemoryAtomic::new(GuestRam::new());
        let connection = Arc::new(Connection { vrings: OnceLock::new(), kicks: AtomicU64::new(0), mem: mem.clone() });
        let backend = FsBackend {
            queues,
            connection: connection.clone(),
            pollers: pollers.clone(),
            dma: dma.cloned(),
            transfer: Arc::default(),
            span: tracing::Span::current(),
        };
        let mut daemon = match VhostUserDaemon::new("keelfs".into(), backend, mem) {
            Ok(daemon) => daemon,
            Err(e) => {
                tracing::error!("vhost-user: {e}");
                return;
            }
        };
        if !pollers.doorbells.iter().all(|d| d.send(Control::Connected(connection.clone()))) {
            return; // a reactor is gone
        }
        match daemon.start(listener) {
            Ok(()) if !stopping.load(Ordering::Acquire) => {
                *active.lock().unwrap_or_else(|e| e.into_inner()) = daemon.shutdown_handle();
                match daemon.wait() {
                    Ok(())
                    | Err(vhost_user_backend::Error::HandleRequest(
                        vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
                    )) => tracing::info!("vhost-user frontend disconnected"),
                    Err(e) => tracing::warn!("vhost-user frontend dropped after an error: {e}"),
                }
                *active.lock().unwrap_or_else(|e| e.into_inner()) = None;
            }
            Ok(()) => daemon.request_shutdown(),
            // After stop(), accept fails by design (see stop_accepting).
            Err(_) if stopping.load(Ordering::Acquire) => {}
            Err(e) => tracing::error!("vhost-user accept: {e}"),
        }
        for handler in daemon.get_epoll_handlers() {
            handler.send_exit_event();
        }
        // Wait for the reactors to drop the connection's requests before
        // accepting the next frontend, so that two never mix: the helpers
        // first, since what they sent the owner must finish there.
        let drain = |d: &Doorbell| d.call(|done| Control::Disconnected { done }, Duration::from_secs(3600));
        let drained = pollers.helpers().iter().all(drain) && drain(pollers.owner());
        // Nothing is in flight to the old guest's memory any more.
        if let Some(dma) = dma {
            let _ = dma.set_dma_memory(&[]);
        }
        if !drained {
            return;
        }
    }
}
