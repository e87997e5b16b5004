//! The device side of keelfs's vhost-user tests: a daemon on its own
//! reactor thread over a RAM disk, and FUSE requests as a driver sends them.

#![allow(dead_code)] // each test binary uses its own part

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_fs::{mkfs, MkfsOptions};
use keelfs_fs::{Fs, FsConfig};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{Clock, PollMode, Reactor, ReactorConfig, VirtualClock};
use keelfs_vhost::abi::{Opcode, Reply, ENTRY_OUT_BYTES};
use keelfs_vhost::frontend::{io_in, io_request, FrontendConfig, FsFrontend, Used};
use keelfs_vhost::SessionConfig;
use keelfs_vhost::{Qos, QosLimits, ServeOptions, VhostUserServer};

pub const TIMEOUT: Duration = Duration::from_secs(60);

/// Run `test` on a busy-polling reactor, given a freshly made and mounted
/// filesystem on a 64 MiB RAM disk: for the tests that drive a
/// [`keelfs_vhost::Session`] directly, with no transport.
pub fn with_fs(test: impl AsyncFnOnce(Fs) + 'static) {
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).unwrap();
    let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(64 << 20, 4096).unwrap());
    reactor.block_on(async move {
        let ch = || DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
        mkfs(ch(), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
        test(Fs::mount(ch(), FsConfig::default()).await.unwrap()).await;
    });
}

/// keelfsd's device side on its own reactor thread, over a RAM disk.
pub struct Daemon {
    pub socket: PathBuf,
    /// The device's zero-copy and one-copy reply counts, its helper
    /// reactors' reads from the cache and requests forwarded, and the
    /// queues a driver broke, sent at shutdown.
    zero_copy: std::sync::mpsc::Receiver<[u64; 6]>,
    /// The device's reactor (its statistics show whether it spins).
    pub reactor: keelfs_reactor::ReactorHandle,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: TempDir,
}

thread_local! {
    /// Set by `Daemon::start_with_checksums` around the start.
    static DATA_CHECKSUMS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Daemon {
    pub fn start(request_queues: usize) -> Self {
        Self::start_with_helpers(request_queues, 0)
    }

    /// With `helpers` more reactors polling request queues.
    pub fn start_with_helpers(request_queues: usize, helpers: usize) -> Self {
        Self::start_with_options(request_queues, helpers, None)
    }

    /// With a limit on requests in flight per queue too.
    pub fn start_with_options(request_queues: usize, helpers: usize, requests_in_flight_max: Option<usize>) -> Self {
        Self::start_with_commit_interval(request_queues, helpers, requests_in_flight_max, Duration::from_millis(50))
    }

    /// With commits every `commit_interval` (50 ms elsewhere, so that
    /// freed blocks come back within a test).
    pub fn start_with_commit_interval(
        request_queues: usize,
        helpers: usize,
        requests_in_flight_max: Option<usize>,
        commit_interval: Duration,
    ) -> Self {
        Self::start_limited(request_queues, helpers, requests_in_flight_max, commit_interval, None, Clock::Monotonic)
    }

    /// With QoS limits too.
    pub fn start_with_qos(request_queues: usize, qos: QosLimits) -> Self {
        Self::start_limited(request_queues, 0, None, Duration::from_millis(50), Some(qos), Clock::Monotonic)
    }

    /// With QoS limits, on a reactor whose time is `clock`. Its queues are
    /// polled once kicked, so that `reactor.settle` returns once it has
    /// done all that the time and the requests published allow, with no
    /// kick (relayed by another thread) racing it.
    pub fn start_on_clock(request_queues: usize, qos: QosLimits, clock: Arc<VirtualClock>) -> Self {
        let clock = Clock::Virtual(clock);
        Self::start_limited(request_queues, 0, None, Duration::from_millis(50), Some(qos), clock)
    }

    /// On an image made with data checksums (issue 38).
    pub fn start_with_checksums(request_queues: usize) -> Self {
        DATA_CHECKSUMS.with(|c| c.set(true));
        let daemon = Self::start_with_commit_interval(request_queues, 0, None, Duration::from_millis(50));
        DATA_CHECKSUMS.with(|c| c.set(false));
        daemon
    }

    fn start_limited(
        request_queues: usize,
        helpers: usize,
        requests_in_flight_max: Option<usize>,
        commit_interval: Duration,
        qos: Option<QosLimits>,
        clock: Clock,
    ) -> Self {
        let data_checksums = DATA_CHECKSUMS.with(|c| c.get());
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "keelfs-vu-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("fs.sock");
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (zero_copy_tx, zero_copy) = std::sync::mpsc::channel();
        let thread = {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let virtual_time = matches!(clock, Clock::Virtual(_));
                let mode = if virtual_time { PollMode::Interrupt } else { PollMode::ADAPTIVE_DEFAULT };
                let mut reactor = Reactor::new(ReactorConfig { mode, clock, ..ReactorConfig::default() }).unwrap();
                let handle = reactor.handle();
                let helper_reactors: Vec<_> = (1..=helpers)
                    .map(|id| Reactor::spawn(ReactorConfig { id, ..ReactorConfig::default() }, || {}).unwrap())
                    .collect();
                let helper_handles: Vec<_> = helper_reactors.iter().map(|(h, _)| h.clone()).collect();
                let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(64 << 20, 4096).unwrap());
                reactor.block_on(async move {
                    let ch = || DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
                    mkfs(ch(), &MkfsOptions { force: true, data_checksums, ..MkfsOptions::default() }).await.unwrap();
                    let config = FsConfig { commit_interval, ..FsConfig::default() };
                    let fs = Fs::mount(ch(), config).await.unwrap();
                    let options = ServeOptions {
                        dma: None,
                        helpers: helper_handles,
                        requests_in_flight_max,
                        qos: qos.map(|limits| Qos::new(limits).unwrap()),
                        poll_idle: virtual_time.then_some(Duration::MAX),
                        ..ServeOptions::default()
                    };
                    let server = VhostUserServer::start_with(
                        fs.clone(),
                        SessionConfig::default(),
                        &socket,
                        request_queues,
                        options,
                    )
                    .unwrap();
                    ready_tx.send(handle).unwrap();
                    stop_asked().await;
                    let (_, h) = server.helper_stats();
                    let _ = zero_copy_tx.send([
                        server.stats().zero_copy.get(),
                        server.stats().one_copy.get(),
                        h.from_cache.load(Ordering::Relaxed),
                        h.forwarded.load(Ordering::Relaxed),
                        server.stats().broken_queues.get(),
                        server.stats().in_flight_max.get() as u64,
                    ]);
                    server.stop().await;
                    fs.unmount().await.unwrap();
                });
                for (handle, join) in helper_reactors {
                    handle.stop();
                    join.join().expect("helper reactor exits cleanly");
                }
            })
        };
        let reactor = ready_rx.recv_timeout(TIMEOUT).expect("daemon started");
        Self { socket, zero_copy, reactor, thread: Some(thread), _dir: TempDir(dir) }
    }

    pub fn connect(&self, request_queues: usize) -> FsFrontend {
        FsFrontend::connect(&self.socket, FrontendConfig { request_queues, ..FrontendConfig::default() }).unwrap()
    }
}

impl Daemon {
    /// Shut down; returns how many replies moved data with no copy, and
    /// how many with one.
    pub fn stop(self) -> (u64, u64) {
        let [zero_copy, one_copy, ..] = self.stop_all();
        (zero_copy, one_copy)
    }

    /// Shut down; returns zero-copy and one-copy replies, helper reads from
    /// the cache, requests helpers forwarded to the owner, broken queues,
    /// and the most requests a queue had in flight.
    pub fn stop_all(mut self) -> [u64; 6] {
        ask_to_stop(&self.reactor).expect("the daemon's reactor runs until asked to stop");
        if let Some(t) = self.thread.take() {
            t.join().expect("daemon thread exits cleanly");
        }
        self.zero_copy.recv_timeout(TIMEOUT).expect("the daemon reports its counters")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A reactor that stopped already (its thread panicked) is joined
        // below, which reports the panic.
        let _ = ask_to_stop(&self.reactor);
        if let Some(t) = self.thread.take() {
            t.join().expect("daemon thread exits cleanly");
        }
    }
}

thread_local! {
    /// On a daemon's reactor thread: shutdown was asked for, and the task
    /// waiting for it.
    static STOP: std::cell::RefCell<(bool, Option<std::task::Waker>)> = const { std::cell::RefCell::new((false, None)) };
}

/// Ask a daemon's reactor to shut down. A message, not a flag polled on a
/// timer: a reactor on a virtual clock sees it without time moving.
fn ask_to_stop(reactor: &keelfs_reactor::ReactorHandle) -> Result<(), keelfs_reactor::SendError> {
    reactor.send(|| {
        let waker = STOP.with_borrow_mut(|(asked, waker)| {
            *asked = true;
            waker.take()
        });
        waker.into_iter().for_each(std::task::Waker::wake);
    })
}

/// On the daemon's reactor: complete once [`ask_to_stop`] has been called.
async fn stop_asked() {
    std::future::poll_fn(|cx| {
        STOP.with_borrow_mut(|(asked, waker)| {
            if *asked {
                return std::task::Poll::Ready(());
            }
            *waker = Some(cx.waker().clone());
            std::task::Poll::Pending
        })
    })
    .await
}

pub fn named(name: &str) -> Vec<u8> {
    let mut b = name.as_bytes().to_vec();
    b.push(0);
    b
}

/// CREATE `name` in the root: (nodeid, fh).
pub fn create(fe: &mut FsFrontend, queue: usize, name: &str) -> (u64, u64) {
    let mut body = Reply::default();
    body.u32(libc::O_RDWR as u32).u32(0o100644).u32(0).u32(0).raw(&named(name));
    let (err, reply) = fe.fuse(queue, Opcode::Create, 1, &body.bytes).unwrap();
    assert_eq!(err, 0, "create {name}");
    let nodeid = u64::from_le_bytes(reply[..8].try_into().unwrap());
    let fh = u64::from_le_bytes(reply[ENTRY_OUT_BYTES..ENTRY_OUT_BYTES + 8].try_into().unwrap());
    (nodeid, fh)
}

pub fn io_body(fh: u64, offset: u64, size: u32) -> Reply {
    let mut b = Reply::default();
    b.raw(&io_in(fh, offset, size));
    b
}

/// A READ (`read_len` bytes) or WRITE (`data`) laid out as Linux's driver
/// lays it out, waited for: the used entry and the reply's (length, errno).
pub fn split_io(
    fe: &mut FsFrontend,
    (nodeid, fh): (u64, u64),
    opcode: Opcode,
    offset: u64,
    data: &[u8],
    read_len: u32,
) -> (Used, (u32, i32)) {
    let unique = fe.next_unique();
    let size = if opcode == Opcode::Write { data.len() as u32 } else { read_len };
    let header = io_request(opcode, unique, nodeid, fh, offset, size);
    let head = fe.submit_split(1, &header, data, read_len).unwrap();
    let used = fe.wait_for(1, head, TIMEOUT).unwrap();
    (used, fuse_status(&fe.reply(1, used).unwrap()))
}

pub fn write(fe: &mut FsFrontend, queue: usize, nodeid: u64, fh: u64, offset: u64, data: &[u8]) -> i32 {
    let mut body = io_body(fh, offset, data.len() as u32);
    body.raw(data);
    let (err, reply) = fe.fuse(queue, Opcode::Write, nodeid, &body.bytes).unwrap();
    if err == 0 {
        assert_eq!(u32::from_le_bytes(reply[..4].try_into().unwrap()) as usize, data.len());
    }
    err
}

pub fn read(fe: &mut FsFrontend, queue: usize, nodeid: u64, fh: u64, offset: u64, size: u32) -> Vec<u8> {
    let (err, reply) = fe.fuse(queue, Opcode::Read, nodeid, &io_body(fh, offset, size).bytes).unwrap();
    assert_eq!(err, 0);
    reply
}

pub fn statfs_free(fe: &mut FsFrontend) -> u64 {
    let (err, reply) = fe.fuse(1, Opcode::Statfs, 1, &[]).unwrap();
    assert_eq!(err, 0);
    u64::from_le_bytes(reply[8..16].try_into().unwrap())
}

pub fn fuse_status(reply: &[u8]) -> (u32, i32) {
    (u32::from_le_bytes(reply[..4].try_into().unwrap()), -i32::from_le_bytes(reply[4..8].try_into().unwrap()))
}

/// Whether `name` is missing from the directory `parent`, as the client
/// sees it: ENOENT, or a negative entry (node id 0, kept for the entry
/// timeout), which keelfs answers while names are cached.
pub fn is_missing(fe: &mut FsFrontend, parent: u64, name: &str) -> bool {
    let (err, entry) = fe.fuse(1, Opcode::Lookup, parent, &named(name)).unwrap();
    err == libc::ENOENT || (err == 0 && entry.get(..8) == Some(&[0u8; 8][..]))
}
