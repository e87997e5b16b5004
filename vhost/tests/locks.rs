//! Locks that the clients of one export agree on (issue 36): two sessions
//! over one filesystem and one lock table, as a guest and the host mount
//! of an export are, driven with the request bytes Linux's FUSE client
//! sends for fcntl(2) and flock(2) locks.

use std::cell::Cell;
use std::rc::Rc;

use keelfs_vhost::abi::{encode_request, open_flags, Opcode, Reply};
use keelfs_vhost::{Locks, OpStats, Session, SessionConfig, SessionState, LOCK_END_MAX};

mod common;

const F_RDLCK: u32 = libc::F_RDLCK as u32;
const F_WRLCK: u32 = libc::F_WRLCK as u32;
const F_UNLCK: u32 = libc::F_UNLCK as u32;
const LK_FLOCK: u32 = 1;

fn init_body() -> Vec<u8> {
    let mut r = Reply::default();
    r.u32(7).u32(38).u32(128 << 10).u32(u32::MAX).u32(0).raw(&[0u8; 44]);
    r.bytes
}

/// (error, body) of the reply to `op`.
async fn call(s: &Session, unique: u64, op: Opcode, nodeid: u64, body: &[u8]) -> (i32, Vec<u8>) {
    let bytes = s.handle(&encode_request(op as u32, unique, nodeid, 0, 0, body)).await.expect("a reply");
    assert_eq!(u64::from_le_bytes(bytes[8..16].try_into().unwrap()), unique);
    (i32::from_le_bytes(bytes[4..8].try_into().unwrap()), bytes[16..].to_vec())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// A lock request as Linux's FUSE client sends one.
#[derive(Clone, Copy)]
struct Lk {
    fh: u64,
    owner: u64,
    start: u64,
    end: u64,
    kind: u32,
    pid: u32,
    flock: bool,
}

impl Lk {
    fn posix(fh: u64, owner: u64, kind: u32, start: u64, end: u64) -> Self {
        Self { fh, owner, start, end, kind, pid: 100 + owner as u32, flock: false }
    }
    fn flock(fh: u64, kind: u32) -> Self {
        Self { fh, owner: fh, start: 0, end: LOCK_END_MAX, kind, pid: 1, flock: true }
    }
    fn body(&self) -> Vec<u8> {
        let mut r = Reply::default();
        r.u64(self.fh).u64(self.owner).u64(self.start).u64(self.end).u32(self.kind).u32(self.pid);
        r.u32(if self.flock { LK_FLOCK } else { 0 }).u32(0);
        r.bytes
    }
}

/// The holder GETLK reports: (type, start, end, pid).
async fn getlk(s: &Session, ino: u64, lk: Lk) -> (u32, u64, u64, u32) {
    let (err, body) = call(s, 50, Opcode::Getlk, ino, &lk.body()).await;
    assert_eq!(err, 0);
    (u32_at(&body, 16), u64_at(&body, 0), u64_at(&body, 8), u32_at(&body, 20))
}

async fn setlk(s: &Session, ino: u64, lk: Lk) -> i32 {
    call(s, 51, Opcode::Setlk, ino, &lk.body()).await.0
}

/// Two sessions and the file they share.
struct Two {
    guest: Rc<Session>,
    host: Rc<Session>,
    ino: u64,
    /// The guest's handle of the file, and the host's.
    gfh: u64,
    hfh: u64,
    locks: Option<Rc<Locks>>,
}

/// Two sessions sharing one filesystem and, with `shared_locks`, one lock
/// table; both initialized, with one file created by the first and opened
/// by the second.
fn with_two_sessions(shared_locks: bool, test: impl AsyncFnOnce(Two) + 'static) {
    common::with_fs(async move |fs| {
        let locks = shared_locks.then(Locks::new);
        let config = SessionConfig { locks: locks.clone(), ..SessionConfig::default() };
        let guest = Rc::new(Session::new(fs.clone(), config.clone()));
        let host = Rc::new(Session::new(fs, config));
        for s in [&guest, &host] {
            assert_eq!(call(s, 1, Opcode::Init, 0, &init_body()).await.0, 0);
        }
        let create_in = [libc::O_RDWR as u32, 0o644, 0, 0].map(u32::to_le_bytes).concat();
        let (err, body) = call(&guest, 2, Opcode::Create, 1, &[&create_in[..], b"f\0"].concat()).await;
        assert_eq!(err, 0);
        let (ino, guest_fh) = (u64_at(&body, 0), u64_at(&body, 128));
        let open_in = [libc::O_RDWR as u32, 0].map(u32::to_le_bytes).concat();
        let (err, body) = call(&host, 3, Opcode::Open, ino, &open_in).await;
        assert_eq!(err, 0);
        test(Two { guest, host, ino, gfh: guest_fh, hfh: u64_at(&body, 0), locks }).await;
    });
}

/// Offered at INIT, and closes reach keelfs (no NOFLUSH) only when keelfs
/// holds the locks.
#[test]
fn locks_are_offered_and_closes_flushed_only_with_a_lock_table() {
    for shared in [false, true] {
        with_two_sessions(shared, async move |t: Two| {
            let Two { guest, ino, .. } = t;
            let (_, init) = call(&guest, 4, Opcode::Init, 0, &init_body()).await;
            let flags = u32_at(&init, 12);
            let wanted = (1 << 1) | (1 << 10); // POSIX_LOCKS, FLOCK_LOCKS
            assert_eq!(flags & wanted, if shared { wanted } else { 0 });
            let open_in = [libc::O_RDONLY as u32, 0].map(u32::to_le_bytes).concat();
            let (err, body) = call(&guest, 5, Opcode::Open, ino, &open_in).await;
            assert_eq!(err, 0);
            assert_eq!(u32_at(&body, 8) & open_flags::NOFLUSH != 0, !shared);
            let lk = Lk::posix(u64_at(&body, 0), 1, F_WRLCK, 0, 0);
            let expected = if shared { 0 } else { -libc::ENOSYS };
            assert_eq!(setlk(&guest, ino, lk).await, expected);
        });
    }
}

/// The guest's lock keeps the host out and the other way round; GETLK
/// names the holder's range and kind (and its pid only to its own
/// client); flock and POSIX locks are separate, as in Linux.
#[test]
fn the_guest_and_the_host_exclude_each_other() {
    with_two_sessions(true, async |t: Two| {
        let Two { guest, host, ino, gfh, hfh, .. } = t;
        assert_eq!(setlk(&guest, ino, Lk::posix(gfh, 1, F_WRLCK, 0, 99)).await, 0);
        assert_eq!(setlk(&host, ino, Lk::posix(hfh, 1, F_RDLCK, 50, 60)).await, -libc::EAGAIN);
        assert_eq!(getlk(&host, ino, Lk::posix(hfh, 1, F_RDLCK, 0, LOCK_END_MAX)).await, (F_WRLCK, 0, 99, 0));
        // The guest's other process sees the holder's pid.
        assert_eq!(getlk(&guest, ino, Lk::posix(gfh, 2, F_RDLCK, 10, 10)).await, (F_WRLCK, 0, 99, 101));
        assert_eq!(getlk(&guest, ino, Lk::posix(gfh, 1, F_WRLCK, 0, 99)).await.0, F_UNLCK, "its own lock");
        // Past the guest's range the host may write-lock.
        assert_eq!(setlk(&host, ino, Lk::posix(hfh, 1, F_WRLCK, 100, LOCK_END_MAX)).await, 0);
        assert_eq!(setlk(&guest, ino, Lk::posix(gfh, 1, F_RDLCK, 200, 300)).await, -libc::EAGAIN);
        // flock locks: the host's keeps the guest's out, whatever the
        // POSIX locks.
        assert_eq!(setlk(&host, ino, Lk::flock(hfh, F_WRLCK)).await, 0);
        assert_eq!(setlk(&guest, ino, Lk::flock(gfh, F_RDLCK)).await, -libc::EAGAIN);
        assert_eq!(setlk(&host, ino, Lk::flock(hfh, F_UNLCK)).await, 0);
        assert_eq!(setlk(&guest, ino, Lk::flock(gfh, F_RDLCK)).await, 0);
        // A close by the owner (FLUSH) releases its POSIX locks there.
        let flush_in = [&gfh.to_le_bytes()[..], &[0u8; 8], &1u64.to_le_bytes()].concat();
        assert_eq!(call(&guest, 6, Opcode::Flush, ino, &flush_in).await.0, 0);
        assert_eq!(setlk(&host, ino, Lk::posix(hfh, 1, F_WRLCK, 0, 99)).await, 0);
        // Nonsense is refused, not taken.
        assert_eq!(setlk(&host, ino, Lk::posix(hfh, 1, 7, 0, 1)).await, -libc::EINVAL);
        assert_eq!(setlk(&host, ino, Lk::posix(hfh, 1, F_WRLCK, 9, 3)).await, -libc::EINVAL);
        assert_eq!(setlk(&host, ino, Lk::posix(999, 1, F_WRLCK, 0, 1)).await, -libc::EBADF);
    });
}

/// Start a SETLKW as the transports do, as a task of its own; the errno
/// lands in the cell once it is answered.
fn setlkw(s: &Rc<Session>, unique: u64, ino: u64, lk: Lk) -> Rc<Cell<Option<i32>>> {
    let answer: Rc<Cell<Option<i32>>> = Rc::default();
    let (s, out) = (Rc::clone(s), Rc::clone(&answer));
    keelfs_reactor::spawn_local(async move {
        out.set(Some(call(&s, unique, Opcode::Setlkw, ino, &lk.body()).await.0));
    });
    answer
}

async fn settle() {
    for _ in 0..8 {
        keelfs_reactor::next_tick().await;
    }
}

/// A blocked SETLKW waits without holding the reactor (the other session
/// is served meanwhile) and is answered at the release; another is
/// answered EINTR at its INTERRUPT, and another ENOLCK when its session's
/// waits end (a stopping queue).
#[test]
fn a_waiting_lock_is_answered_on_release_interrupt_or_stop() {
    with_two_sessions(true, async |t: Two| {
        let Two { guest, host, ino, gfh, hfh, .. } = t;
        assert_eq!(setlk(&guest, ino, Lk::posix(gfh, 1, F_WRLCK, 0, LOCK_END_MAX)).await, 0);
        let granted = setlkw(&host, 60, ino, Lk::posix(hfh, 1, F_WRLCK, 0, 9));
        let interrupted = setlkw(&host, 61, ino, Lk::posix(hfh, 2, F_RDLCK, 5, 5));
        settle().await;
        assert_eq!((granted.get(), interrupted.get()), (None, None), "both wait");
        // The reactor serves the guest meanwhile.
        assert_eq!(call(&guest, 7, Opcode::Getattr, ino, &[0u8; 16]).await.0, 0);
        let interrupt = encode_request(Opcode::Interrupt as u32, 62, 0, 0, 0, &61u64.to_le_bytes());
        assert!(host.handle(&interrupt).await.is_none(), "INTERRUPT has no reply of its own");
        settle().await;
        assert_eq!((granted.get(), interrupted.get()), (None, Some(-libc::EINTR)));
        // The guest's unlock of a range the waiter does not need keeps it waiting.
        assert_eq!(setlk(&guest, ino, Lk::posix(gfh, 1, F_UNLCK, 100, 200)).await, 0);
        settle().await;
        assert_eq!(granted.get(), None);
        assert_eq!(setlk(&guest, ino, Lk::posix(gfh, 1, F_UNLCK, 0, 99)).await, 0);
        settle().await;
        assert_eq!(granted.get(), Some(0), "granted at the release");
        assert_eq!(setlk(&guest, ino, Lk::posix(gfh, 1, F_RDLCK, 0, 0)).await, -libc::EAGAIN);

        let stopped = setlkw(&guest, 63, ino, Lk::posix(gfh, 1, F_WRLCK, 0, 0));
        settle().await;
        assert_eq!(stopped.get(), None);
        guest.end_lock_waits();
        settle().await;
        assert_eq!(stopped.get(), Some(-libc::ENOLCK), "a stopping queue ends the wait");
    });
}

/// A session that ends takes its locks with it; releasing a handle takes
/// the locks taken through it (an OFD or flock lock's owner is its file).
#[test]
fn locks_go_with_their_file_and_their_session() {
    with_two_sessions(true, async |t: Two| {
        let Two { guest, host, ino, gfh, hfh, .. } = t;
        assert_eq!(setlk(&host, ino, Lk::flock(hfh, F_WRLCK)).await, 0);
        let release_in = [&hfh.to_le_bytes()[..], &[0u8; 4], &2u32.to_le_bytes(), &hfh.to_le_bytes()].concat();
        assert_eq!(call(&host, 8, Opcode::Release, ino, &release_in).await.0, 0);
        assert_eq!(setlk(&guest, ino, Lk::flock(gfh, F_WRLCK)).await, 0, "released with its file");
        assert_eq!(setlk(&guest, ino, Lk::flock(gfh, F_UNLCK)).await, 0);

        let open_in = [libc::O_RDWR as u32, 0].map(u32::to_le_bytes).concat();
        let (_, body) = call(&host, 9, Opcode::Open, ino, &open_in).await;
        let hfh = u64_at(&body, 0);
        assert_eq!(setlk(&host, ino, Lk::posix(hfh, 3, F_WRLCK, 0, 0)).await, 0);
        let waiter = setlkw(&guest, 64, ino, Lk::posix(gfh, 1, F_WRLCK, 0, 0));
        settle().await;
        assert_eq!(waiter.get(), None);
        drop(host);
        settle().await;
        assert_eq!(waiter.get(), Some(0), "the host's session ended and its lock with it");
    });
}

/// A migrated session keeps its locks: saved with the session's state,
/// taken again by the restored session, in force against the others; a
/// state whose locks conflict with those held where it lands is refused,
/// and takes nothing.
#[test]
fn locks_survive_a_migration_of_their_session() {
    with_two_sessions(true, async |t: Two| {
        let Two { guest, host, ino, gfh, hfh, locks } = t;
        assert_eq!(setlk(&guest, ino, Lk::posix(gfh, 1, F_WRLCK, 10, 19)).await, 0);
        assert_eq!(setlk(&guest, ino, Lk::flock(gfh, F_RDLCK)).await, 0);
        let bytes = guest.save_state().encode();
        let state = SessionState::decode(&bytes).unwrap();
        assert_eq!(state.locks.len(), 2);
        let fs = guest.fs().clone();
        guest.give_back().await;
        drop(guest);
        assert_eq!(setlk(&host, ino, Lk::posix(hfh, 1, F_WRLCK, 10, 10)).await, 0, "the source let go");
        let config = SessionConfig { locks, ..SessionConfig::default() };
        let refused = Session::restore(fs.clone(), config.clone(), Rc::new(OpStats::default()), &state);
        assert!(refused.is_err(), "the host holds byte 10 here");
        assert_eq!(setlk(&host, ino, Lk::posix(hfh, 1, F_UNLCK, 10, 10)).await, 0);
        let moved = Session::restore(fs, config, Rc::new(OpStats::default()), &state).unwrap();
        assert_eq!(getlk(&host, ino, Lk::posix(hfh, 1, F_RDLCK, 0, LOCK_END_MAX)).await, (F_WRLCK, 10, 19, 0));
        assert_eq!(setlk(&host, ino, Lk::flock(hfh, F_WRLCK)).await, -libc::EAGAIN);
        assert_eq!(getlk(&moved, ino, Lk::posix(gfh, 9, F_RDLCK, 15, 15)).await, (F_WRLCK, 10, 19, 101));
    });
}
