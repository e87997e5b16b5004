//! A guest's session moving between two vhost-user-fs servers over one
//! image, as QEMU's internal virtio-fs migration moves it between two
//! keelfsd processes: the source saves (stopping its rings, committing and
//! giving the image up), the destination loads before it has guest memory,
//! and the guest's node ids and open handles keep working there. Hostile
//! states are refused by CHECK_DEVICE_STATE, and the server lives on.

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_fs::{fsck, mkfs, Fh, Fs, FsConfig, HandleState, Ino, MkfsOptions};
use keelfs_reactor::{self as reactor, DeviceChannel, Reactor, ReactorConfig};
use keelfs_vhost::abi::{init_flags as f, Opcode, Reply};
use keelfs_vhost::frontend::{FrontendConfig, FsFrontend};
use keelfs_vhost::{
    ImageAccess, LocalFuture, Locks, ServeOptions, SessionConfig, SessionState, TransferError, VhostUserServer,
};

mod common;
use common::{create, named, read, write, TempDir, TIMEOUT};

/// The test's stand-in for keelfsd's image: a shared RAM disk, and a flag
/// for the lock that one server at a time holds.
struct RamImage {
    dev: Arc<dyn BlockDevice>,
    lock: Arc<AtomicBool>,
    mine: Cell<bool>,
}

impl RamImage {
    fn channel(&self) -> DeviceChannel {
        DeviceChannel::attach(self.dev.open_queue(QueueConfig::default()).unwrap())
    }
}

impl ImageAccess for RamImage {
    fn attach(&self) -> LocalFuture<'_, Result<Fs, TransferError>> {
        Box::pin(async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !self.mine.get() {
                if self.lock.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    self.mine.set(true);
                } else if Instant::now() > deadline {
                    return Err(TransferError::Image("the image stays locked".into()));
                } else {
                    reactor::sleep(Duration::from_millis(5)).await;
                }
            }
            let config =
                FsConfig { keep_orphans: true, commit_interval: Duration::from_millis(50), ..FsConfig::default() };
            Fs::mount(self.channel(), config).await.map_err(|e| TransferError::Image(e.to_string()))
        })
    }

    fn detach(&self, fs: Fs) -> LocalFuture<'_, Result<(), TransferError>> {
        Box::pin(async move {
            let unmounted = fs.unmount().await.map_err(|e| TransferError::Image(e.to_string()));
            self.mine.set(false);
            self.lock.store(false, Ordering::Release);
            unmounted
        })
    }
}

/// One server on its own reactor thread over the shared image, attached
/// at start or (`incoming`) not.
struct Server {
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: TempDir,
}

impl Server {
    fn start(name: &str, dev: &Arc<dyn BlockDevice>, lock: &Arc<AtomicBool>, incoming: bool) -> Self {
        Self::start_restoring(name, dev, lock, incoming, None, false)
    }

    /// Holding its guest's locks (a lock table of its own).
    fn start_locking(name: &str, dev: &Arc<dyn BlockDevice>, lock: &Arc<AtomicBool>, incoming: bool) -> Self {
        Self::start_restoring(name, dev, lock, incoming, None, true)
    }

    /// With a session kept by an earlier daemon to restore.
    fn start_restoring(
        name: &str,
        dev: &Arc<dyn BlockDevice>,
        lock: &Arc<AtomicBool>,
        incoming: bool,
        restore: Option<SessionState>,
        locks: bool,
    ) -> Self {
        let dir = std::env::temp_dir().join(format!("keelfs-mig-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("fs.sock");
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let (socket, stop, dev, lock) = (socket.clone(), stop.clone(), dev.clone(), lock.clone());
            std::thread::spawn(move || {
                let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
                reactor.block_on(async move {
                    let image = std::rc::Rc::new(RamImage { dev, lock, mine: Cell::new(false) });
                    let options = ServeOptions { image: Some(image.clone()), restore, ..ServeOptions::default() };
                    let config = SessionConfig { locks: locks.then(Locks::new), ..SessionConfig::default() };
                    let server = if incoming {
                        VhostUserServer::start_detached(config, &socket, 1, options).unwrap()
                    } else {
                        let fs = image.attach().await.unwrap();
                        VhostUserServer::start_with(fs, config, &socket, 1, options).unwrap()
                    };
                    ready_tx.send(()).unwrap();
                    while !stop.load(Ordering::Acquire) {
                        reactor::sleep(Duration::from_millis(2)).await;
                    }
                    server.stop_and_release(false).await.unwrap();
                });
            })
        };
        ready_rx.recv_timeout(TIMEOUT).expect("server started");
        Self { socket, stop, thread: Some(thread), _dir: TempDir(dir) }
    }

    fn connect(&self) -> FsFrontend {
        FsFrontend::connect(&self.socket, FrontendConfig::default()).unwrap()
    }

    fn load(&self, state: &[u8]) -> Result<FsFrontend, String> {
        FsFrontend::connect_with_state(&self.socket, FrontendConfig::default(), state).map_err(|e| e.to_string())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.join().expect("server thread exits cleanly");
        }
    }
}

fn image() -> (Arc<dyn BlockDevice>, Arc<AtomicBool>) {
    let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(64 << 20, 4096).unwrap());
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    let ch = DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
    r.block_on(async move { mkfs(ch, &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap() });
    (dev, Arc::new(AtomicBool::new(false)))
}

fn fsck_clean(dev: &Arc<dyn BlockDevice>) {
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    let ch = DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
    let report = r.block_on(async move { fsck(ch, |_| {}).await.unwrap() });
    assert!(report.problems.is_empty(), "fsck after the move: {:?}", report.problems);
}

fn status(fe: &mut FsFrontend, opcode: Opcode, nodeid: u64, body: &[u8]) -> i32 {
    fe.fuse(1, opcode, nodeid, body).unwrap().0
}

fn open_dir(fe: &mut FsFrontend, nodeid: u64) -> u64 {
    let mut body = Reply::default();
    body.u32(libc::O_RDONLY as u32).u32(0);
    let (err, reply) = fe.fuse(1, Opcode::Opendir, nodeid, &body.bytes).unwrap();
    assert_eq!(err, 0);
    u64::from_le_bytes(reply[..8].try_into().unwrap())
}

/// What the guest holds before the move: a file open for writing, a file
/// unlinked while open (an orphan only the handle keeps), a directory open
/// for listing.
struct Held {
    file: (u64, u64),
    orphan: (u64, u64),
    dir: (u64, u64),
}

fn hold_things(fe: &mut FsFrontend) -> Held {
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    let file = create(fe, 1, "held");
    assert_eq!(write(fe, 1, file.0, file.1, 0, b"before the move"), 0);
    let orphan = create(fe, 1, "ghost");
    assert_eq!(write(fe, 1, orphan.0, orphan.1, 0, b"only a handle keeps me"), 0);
    assert_eq!(status(fe, Opcode::Unlink, 1, &named("ghost")), 0);
    let mut mkdir = Reply::default();
    mkdir.u32(0o755).u32(0).raw(&named("dir"));
    let (err, reply) = fe.fuse(1, Opcode::Mkdir, 1, &mkdir.bytes).unwrap();
    assert_eq!(err, 0);
    let dir_ino = u64::from_le_bytes(reply[..8].try_into().unwrap());
    for i in 0..20 {
        let mut body = Reply::default();
        body.u32(0o100644).u32(0).u32(0).u32(0).raw(&named(&format!("f{i}")));
        assert_eq!(status(fe, Opcode::Mknod, dir_ino, &body.bytes), 0);
    }
    let dir = (dir_ino, open_dir(fe, dir_ino));
    Held { file, orphan, dir }
}

fn readdir_names(fe: &mut FsFrontend, (ino, fh): (u64, u64)) -> usize {
    let mut body = Reply::default();
    body.u64(fh).u64(0).u32(65536).u32(0).u64(0).u32(0).u32(0);
    let (err, reply) = fe.fuse(1, Opcode::Readdir, ino, &body.bytes).unwrap();
    assert_eq!(err, 0);
    // fuse_dirent: ino, off, namelen, type, name padded to 8.
    let (mut at, mut names) = (0, 0);
    while at + 24 <= reply.len() {
        let namelen = u32::from_le_bytes(reply[at + 16..at + 20].try_into().unwrap()) as usize;
        names += 1;
        at += (24 + namelen).div_ceil(8) * 8;
    }
    names
}

#[test]
fn a_session_moves_to_a_second_server_with_its_handles_and_lookups() {
    let (dev, lock) = image();
    let source = Server::start("src", &dev, &lock, false);
    let destination = Server::start("dst", &dev, &lock, true);
    let mut fe = source.connect();
    let held = hold_things(&mut fe);

    let state = fe.save_state().unwrap();
    let decoded = SessionState::decode(&state).unwrap();
    assert!(decoded.initialized);
    assert_eq!(decoded.handles.len(), 3, "two files and a directory are open");
    assert!(decoded.lookups.iter().any(|&(ino, _)| ino.get() == held.orphan.0));
    assert!(!lock.load(Ordering::Acquire), "the source gave the image up");
    drop(fe);

    let mut fe = destination.load(&state).expect("the destination takes the session");
    // No INIT: the guest's kernel is the same one.
    assert_eq!(read(&mut fe, 1, held.file.0, held.file.1, 0, 15), b"before the move");
    assert_eq!(write(&mut fe, 1, held.file.0, held.file.1, 15, b", and after"), 0);
    assert_eq!(read(&mut fe, 1, held.orphan.0, held.orphan.1, 0, 22), b"only a handle keeps me");
    assert_eq!(readdir_names(&mut fe, held.dir), 22, ". and .. and 20 files");
    assert_eq!(status(&mut fe, Opcode::Getattr, held.file.0, &[0u8; 16]), 0);
    // The handles were restored, not made up: a number never opened is
    // still refused.
    assert_eq!(status(&mut fe, Opcode::Read, held.file.0, &common::io_body(999, 0, 4).bytes), libc::EBADF);
    let mut release = Reply::default();
    release.u64(held.orphan.1).u32(0).u32(0).u64(0);
    assert_eq!(status(&mut fe, Opcode::Release, held.orphan.0, &release.bytes), 0);
    drop(fe);
    drop(destination);
    drop(source);
    fsck_clean(&dev);
}

/// fuse_lk_in for `owner`'s lock of `kind` over `start..=end`.
fn lk(fh: u64, owner: u64, kind: i32, start: u64, end: u64) -> Vec<u8> {
    let mut body = Reply::default();
    body.u64(fh).u64(owner).u64(start).u64(end).u32(kind as u32).u32(1000 + owner as u32).u32(0).u32(0);
    body.bytes
}

/// A guest's locks move with its session (issue 36), and a lock request
/// still waiting when QEMU stops the rings is answered (ENOLCK) rather
/// than holding the stop, and so the migration, up for ever.
#[test]
fn locks_move_with_the_session_and_a_waiting_lock_does_not_hold_the_move_up() {
    let (dev, lock) = image();
    let source = Server::start_locking("locks-src", &dev, &lock, false);
    let destination = Server::start_locking("locks-dst", &dev, &lock, true);
    let mut fe = source.connect();
    let agreed = fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT | f::POSIX_LOCKS | f::FLOCK_LOCKS).unwrap();
    assert_ne!(agreed & f::POSIX_LOCKS, 0);
    let (ino, fh) = create(&mut fe, 1, "locked");
    assert_eq!(status(&mut fe, Opcode::Setlk, ino, &lk(fh, 1, libc::F_WRLCK, 0, 9)), 0);
    // Another process of the guest waits for byte 5.
    let unique = fe.next_unique();
    let wait =
        keelfs_vhost::abi::encode_request(Opcode::Setlkw as u32, unique, ino, 0, 0, &lk(fh, 2, libc::F_WRLCK, 5, 5));
    let head = fe.submit(1, &wait, 4096).unwrap();
    assert!(fe.wait_for(1, head, Duration::from_millis(200)).is_err(), "it waits");

    let state = fe.save_state().unwrap();
    let used = fe.wait_for(1, head, TIMEOUT).expect("answered at the stop");
    let reply = fe.reply(1, used).unwrap();
    assert_eq!(i32::from_le_bytes(reply[4..8].try_into().unwrap()), -libc::ENOLCK);
    let decoded = SessionState::decode(&state).unwrap();
    assert_eq!(decoded.locks.len(), 1, "{decoded:?}");
    drop(fe);

    let mut fe = destination.load(&state).expect("the destination takes the session and its lock");
    assert_eq!(status(&mut fe, Opcode::Setlk, ino, &lk(fh, 2, libc::F_WRLCK, 5, 5)), libc::EAGAIN, "still held");
    assert_eq!(status(&mut fe, Opcode::Setlk, ino, &lk(fh, 1, libc::F_UNLCK, 0, 9)), 0);
    assert_eq!(status(&mut fe, Opcode::Setlk, ino, &lk(fh, 2, libc::F_WRLCK, 5, 5)), 0);
    drop(fe);
    drop(destination);
    drop(source);
    fsck_clean(&dev);
}

#[test]
fn a_failed_migration_resumes_on_the_source() {
    let (dev, lock) = image();
    let source = Server::start("resume", &dev, &lock, false);
    let mut fe = source.connect();
    let held = hold_things(&mut fe);
    let _state = fe.save_state().unwrap();
    assert!(!lock.load(Ordering::Acquire), "the image was given up");
    // The destination never took it; QEMU restarts the source's rings on
    // the same connection, and the guest's next request takes the image
    // back with the saved session.
    fe.resume_queues().unwrap();
    assert_eq!(read(&mut fe, 1, held.file.0, held.file.1, 0, 15), b"before the move");
    assert!(lock.load(Ordering::Acquire), "the image was taken back");
    assert_eq!(read(&mut fe, 1, held.orphan.0, held.orphan.1, 0, 22), b"only a handle keeps me");
    assert_eq!(readdir_names(&mut fe, held.dir), 22);
    drop(fe);
    drop(source);
    fsck_clean(&dev);
}

/// States that must be refused: damaged ones, and checksummed ones that
/// name what the image does not have.
fn hostile_states(good: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    let fs_uuid = SessionState::decode(good).unwrap().fs_uuid;
    let mut out = vec![("empty", Vec::new()), ("truncated", good[..good.len() - 8].to_vec())];
    let mut version = good.to_vec();
    version[8] = 9;
    out.push(("a future version", version));
    let mut crc = good.to_vec();
    *crc.last_mut().unwrap() ^= 1;
    out.push(("a bad checksum", crc));
    let absent =
        SessionState { fs_uuid, initialized: true, lookups: vec![(Ino::new(1 << 40), 1)], ..SessionState::default() };
    out.push(("a node id the image does not have", absent.encode()));
    let handle = HandleState { ino: Ino::new(1 << 40), flags: 2, dir_end: 0 };
    let dangling = SessionState { fs_uuid, handles: vec![(Fh::new(7), handle)], ..SessionState::default() };
    out.push(("a handle of a missing inode", dangling.encode()));
    let not_dir = HandleState { ino: Ino::new(1), flags: libc::O_RDWR as u32, dir_end: 0 };
    let wrong = SessionState { fs_uuid, handles: vec![(Fh::new(7), not_dir)], ..SessionState::default() };
    out.push(("a directory opened for writing", wrong.encode()));
    let other = SessionState { fs_uuid: [7; 16], initialized: true, ..SessionState::default() };
    out.push(("another filesystem's session", other.encode()));
    out.push(("garbage", vec![0xa5; 4096]));
    out
}

#[test]
fn hostile_states_are_refused_and_the_destination_lives_on() {
    let (dev, lock) = image();
    // A good state, of this image: an empty session saved by a source.
    let good = {
        let source = Server::start("hostile-src", &dev, &lock, false);
        let mut fe = source.connect();
        fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
        fe.save_state().unwrap()
    };
    let destination = Server::start("hostile", &dev, &lock, true);
    for (what, state) in hostile_states(&good) {
        let refused = destination.load(&state);
        assert!(refused.is_err(), "{what} was accepted");
        assert!(!lock.load(Ordering::Acquire), "after {what}, the image was given back");
    }
    // The same server takes a good state, and serves.
    let mut fe = destination.load(&good).expect("a good state after the hostile ones");
    assert_eq!(status(&mut fe, Opcode::Getattr, 1, &[0u8; 16]), 0);
    // And refuses a hostile one while attached, keeping its image.
    drop(fe);
    let mut fe = destination.connect();
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    drop(fe);
    for (what, state) in hostile_states(&good) {
        assert!(destination.load(&state).is_err(), "{what} was accepted by an attached server");
    }
    let mut fe = destination.connect();
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    assert_eq!(status(&mut fe, Opcode::Getattr, 1, &[0u8; 16]), 0);
    drop(fe);
    drop(destination);
    fsck_clean(&dev);
}

#[test]
fn a_destination_whose_guest_never_ran_gives_the_image_back_to_the_source() {
    let (dev, lock) = image();
    let source = Server::start("back-src", &dev, &lock, false);
    let destination = Server::start("back-dst", &dev, &lock, true);
    let mut fe = source.connect();
    let held = hold_things(&mut fe);
    let state = fe.save_state().unwrap();
    // The destination loads, then its QEMU leaves: the migration failed
    // after the device state went across.
    let loaded = destination.load(&state).expect("the destination takes the session");
    assert!(lock.load(Ordering::Acquire));
    drop(loaded);
    let deadline = Instant::now() + TIMEOUT;
    while lock.load(Ordering::Acquire) {
        assert!(Instant::now() < deadline, "the destination kept the image");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The source's guest resumes with everything it held.
    fe.resume_queues().unwrap();
    assert_eq!(read(&mut fe, 1, held.file.0, held.file.1, 0, 15), b"before the move");
    assert_eq!(read(&mut fe, 1, held.orphan.0, held.orphan.1, 0, 22), b"only a handle keeps me");
    drop(fe);
    drop(destination);
    drop(source);
    fsck_clean(&dev);
}

#[test]
fn a_kept_session_that_does_not_fit_gives_way_to_a_fresh_one() {
    let (dev, lock) = image();
    // Another filesystem's session, as a session file beside an image
    // that was formatted again would hold.
    let stale = SessionState { fs_uuid: [7; 16], initialized: true, ..SessionState::default() };
    for incoming in [true, false] {
        let server = Server::start_restoring("stale", &dev, &lock, incoming, Some(stale.clone()), false);
        let mut fe = server.connect();
        // Without the fallback, the attach fails and so does every request.
        fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
        assert_eq!(status(&mut fe, Opcode::Getattr, 1, &[0u8; 16]), 0, "served (incoming: {incoming})");
        drop(fe);
        drop(server);
    }
    fsck_clean(&dev);
}
