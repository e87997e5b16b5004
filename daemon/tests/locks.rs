//! Locks that a guest and the host mount of one export agree on (issue
//! 36): the guest is the test's vhost-user frontend, the host mount is
//! the kernel's FUSE client, and both ask keelfsd, which holds the
//! export's locks (`locks = "auto"` with both clients).

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use keelfs_vhost::abi::{init_flags as f, Opcode, Reply};
use keelfs_vhost::frontend::FsFrontend;

mod common;
use common::{connect_frontend, eventually, fsck, mkfs, named, stats, Scratch, Served};

const LOCK_END_MAX: u64 = i64::MAX as u64;

/// A keelfsd serving a fresh image to a guest socket and a host mount,
/// with `--locks LOCKS`.
struct Export {
    served: Served,
    image: PathBuf,
    mnt: PathBuf,
    rpc: PathBuf,
    socket: PathBuf,
    _scratch: Scratch,
}

impl Export {
    fn serve(name: &str, locks: &str) -> Self {
        let scratch = Scratch::new(name);
        let (image, mnt, rpc, socket) =
            (scratch.path("img"), scratch.path("mnt"), scratch.path("rpc.sock"), scratch.path("vhost.sock"));
        mkfs(&image, "256M");
        let mut args: Vec<&OsStr> = vec![OsStr::new("--device"), image.as_os_str(), OsStr::new("--socket")];
        args.extend([socket.as_os_str(), OsStr::new("--rpc"), rpc.as_os_str()]);
        args.extend([OsStr::new("--fuse-mount"), mnt.as_os_str(), OsStr::new("--locks"), OsStr::new(locks)]);
        let served = Served::start(&args, &[&mnt]);
        Self { served, image, mnt, rpc, socket, _scratch: scratch }
    }
}

/// The guest's lock request on `node` through `fh`: the errno, and for
/// GETLK (type, start, end, pid).
fn guest_lock(fe: &mut FsFrontend, op: Opcode, node: u64, fh: u64, kind: i32, range: (u64, u64)) -> (i32, Vec<u8>) {
    guest_lock_as(fe, op, node, fh, 1, kind, range, false)
}

#[allow(clippy::too_many_arguments)]
fn guest_lock_as(
    fe: &mut FsFrontend,
    op: Opcode,
    node: u64,
    fh: u64,
    owner: u64,
    kind: i32,
    (start, end): (u64, u64),
    flock: bool,
) -> (i32, Vec<u8>) {
    let mut lk = Reply::default();
    lk.u64(fh).u64(owner).u64(start).u64(end).u32(kind as u32).u32(4242).u32(u32::from(flock)).u32(0);
    fe.fuse(1, op, node, &lk.bytes).unwrap()
}

/// The host's fcntl lock request: Ok, or the errno.
fn host_fcntl(file: &File, cmd: i32, kind: i32, start: i64, len: i64) -> Result<libc::flock, i32> {
    // SAFETY: an all-zero flock is a valid value of the C struct.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    (fl.l_start, fl.l_len) = (start, len);
    // SAFETY: the fd is open for the call's length, and fl outlives it.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) };
    if r == 0 {
        Ok(fl)
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    }
}

fn host_flock(file: &File, op: i32) -> Result<(), i32> {
    // SAFETY: flock(2) on an open fd.
    let r = unsafe { libc::flock(file.as_raw_fd(), op) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    }
}

fn open_rw(path: &Path) -> File {
    File::options().read(true).write(true).open(path).unwrap()
}

/// The guest's view of `name`: (node, handle) of an O_RDWR open.
fn guest_open(fe: &mut FsFrontend, name: &str) -> (u64, u64) {
    let (err, entry) = fe.fuse(1, Opcode::Lookup, 1, &named(name)).unwrap();
    assert_eq!(err, 0);
    let node = u64::from_le_bytes(entry[..8].try_into().unwrap());
    let (err, open) = fe.fuse(1, Opcode::Open, node, &(libc::O_RDWR as u64).to_le_bytes()).unwrap();
    assert_eq!(err, 0);
    (node, u64::from_le_bytes(open[..8].try_into().unwrap()))
}

#[test]
fn a_guest_and_the_host_mount_exclude_each_other() {
    let Export { served, image, mnt, rpc, socket, _scratch } = Export::serve("locks", "auto");
    let path = mnt.join("f");
    std::fs::write(&path, vec![0u8; 4096]).unwrap();

    let mut guest = connect_frontend(&socket);
    let agreed = guest.init(f::INIT_EXT | f::POSIX_LOCKS | f::FLOCK_LOCKS).unwrap();
    assert_eq!(agreed & (f::POSIX_LOCKS | f::FLOCK_LOCKS), f::POSIX_LOCKS | f::FLOCK_LOCKS, "{agreed:#x}");
    let (node, fh) = guest_open(&mut guest, "f");

    // The guest's write lock keeps the host's processes out.
    assert_eq!(guest_lock(&mut guest, Opcode::Setlk, node, fh, libc::F_WRLCK, (0, 99)).0, 0);
    let host = open_rw(&path);
    assert_eq!(host_fcntl(&host, libc::F_SETLK, libc::F_RDLCK, 50, 10).err(), Some(libc::EAGAIN));
    let holder = host_fcntl(&host, libc::F_GETLK, libc::F_WRLCK, 0, 0).unwrap();
    assert_eq!((i32::from(holder.l_type), holder.l_start, holder.l_len), (libc::F_WRLCK, 0, 100));
    assert_eq!(holder.l_pid, 0, "another kernel's pid means nothing here");
    host_fcntl(&host, libc::F_SETLK, libc::F_WRLCK, 100, 0).expect("past the guest's range");

    // And the host's keeps the guest out; GETLK names it.
    let (err, _) = guest_lock(&mut guest, Opcode::Setlk, node, fh, libc::F_RDLCK, (200, 200));
    assert_eq!(err, libc::EAGAIN);
    let (err, lk) = guest_lock(&mut guest, Opcode::Getlk, node, fh, libc::F_RDLCK, (0, LOCK_END_MAX));
    assert_eq!(err, 0);
    let at = |i: usize| u64::from_le_bytes(lk[i..i + 8].try_into().unwrap());
    assert_eq!((at(0), at(8), i32::from_le_bytes(lk[16..20].try_into().unwrap())), (100, LOCK_END_MAX, libc::F_WRLCK));

    // flock(2) locks, apart from the POSIX ones.
    let host_other = open_rw(&path);
    host_flock(&host_other, libc::LOCK_EX | libc::LOCK_NB).expect("no flock lock is held");
    let flock_fh = guest_open(&mut guest, "f").1;
    let (err, _) =
        guest_lock_as(&mut guest, Opcode::Setlk, node, flock_fh, flock_fh, libc::F_RDLCK, (0, LOCK_END_MAX), true);
    assert_eq!(err, libc::EAGAIN, "the host's flock keeps the guest's out");
    // Its last close releases the flock lock, with the file's RELEASE,
    // which Linux sends after close(2) returns.
    drop(host_other);
    eventually("the host's flock released with its file", || {
        let r =
            guest_lock_as(&mut guest, Opcode::Setlk, node, flock_fh, flock_fh, libc::F_RDLCK, (0, LOCK_END_MAX), true);
        r.0 == 0
    });

    // The host closes its file: its process's POSIX locks go (FLUSH).
    drop(host);
    assert_eq!(guest_lock(&mut guest, Opcode::Setlk, node, fh, libc::F_WRLCK, (0, LOCK_END_MAX)).0, 0);

    // A host process waits (F_SETLKW) until the guest lets go; the
    // daemon serves the guest meanwhile.
    let (tx, rx) = mpsc::channel();
    let waiter_path = path.clone();
    let waiter = std::thread::spawn(move || {
        let file = open_rw(&waiter_path);
        let got = host_fcntl(&file, libc::F_SETLKW, libc::F_WRLCK, 10, 1).map(|_| ());
        tx.send(got).unwrap();
        // Held until the thread's file closes.
        std::thread::sleep(Duration::from_millis(50));
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "the host's wait ended while the guest held the lock"
    );
    assert_eq!(guest.fuse(1, Opcode::Getattr, node, &[0u8; 16]).unwrap().0, 0, "the guest is served meanwhile");
    assert_eq!(guest_lock(&mut guest, Opcode::Setlk, node, fh, libc::F_UNLCK, (0, LOCK_END_MAX)).0, 0);
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)).expect("granted at the release"), Ok(()));
    waiter.join().unwrap();

    let locks = &stats(&rpc)["exports"][0]["locks"];
    assert!(locks["granted"].as_u64().unwrap() >= 5, "{locks}");
    assert!(locks["waits"].as_u64().unwrap() >= 1, "{locks}");
    drop(guest);
    assert!(served.stop().success());
    let (code, report) = fsck(&image);
    assert_eq!(code, 0, "{report}");
}

extern "C" fn ignore_signal(_: i32) {}

/// A host process waiting in F_SETLKW is interrupted by a signal: Linux
/// sends FUSE_INTERRUPT, keelfsd answers the wait EINTR, and fcntl(2)
/// returns EINTR to a handler installed without SA_RESTART. The guest's
/// lock is untouched.
#[test]
fn a_host_process_waiting_for_a_lock_can_be_interrupted() {
    let Export { served, mnt, rpc, socket, _scratch, .. } = Export::serve("locks-intr", "auto");
    let path = mnt.join("f");
    std::fs::write(&path, b"x").unwrap();
    let mut guest = connect_frontend(&socket);
    guest.init(f::INIT_EXT | f::POSIX_LOCKS | f::FLOCK_LOCKS).unwrap();
    let (node, fh) = guest_open(&mut guest, "f");
    assert_eq!(guest_lock(&mut guest, Opcode::Setlk, node, fh, libc::F_WRLCK, (0, LOCK_END_MAX)).0, 0);

    // SAFETY: a handler that does nothing, installed without SA_RESTART
    // so that the interrupted call returns EINTR.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = ignore_signal as extern "C" fn(i32) as usize;
        assert_eq!(libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut()), 0);
    }
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // SAFETY: pthread_self has no preconditions.
        tx.send(unsafe { libc::pthread_self() }).unwrap();
        let file = open_rw(&path);
        host_fcntl(&file, libc::F_SETLKW, libc::F_RDLCK, 0, 1).map(|_| ())
    });
    let thread = rx.recv().unwrap();
    let rpc_path = rpc.clone();
    eventually("the host's request waits in keelfsd", || {
        stats(&rpc_path)["exports"][0]["locks"]["waiting"].as_u64() == Some(1)
    });
    // SAFETY: the thread is alive: it waits in fcntl until the signal.
    assert_eq!(unsafe { libc::pthread_kill(thread, libc::SIGUSR1) }, 0);
    assert_eq!(waiter.join().unwrap(), Err(libc::EINTR));
    assert_eq!(stats(&rpc)["exports"][0]["locks"]["waiting"].as_u64(), Some(0));
    let (err, _) = guest_lock_as(&mut guest, Opcode::Setlk, node, fh, 2, libc::F_RDLCK, (0, 0), false);
    assert_eq!(err, libc::EAGAIN, "the guest's lock still holds");
    drop(guest);
    assert!(served.stop().success());
}

/// `locks = "client"`: keelfs offers no locks, and each client's kernel
/// keeps its own (the guest's requests answer ENOSYS).
#[test]
fn with_locks_left_to_clients_none_are_offered() {
    let Export { served, mnt, socket, _scratch, .. } = Export::serve("locks-client", "client");
    std::fs::write(mnt.join("f"), b"x").unwrap();
    let mut guest = connect_frontend(&socket);
    let agreed = guest.init(f::INIT_EXT | f::POSIX_LOCKS | f::FLOCK_LOCKS).unwrap();
    assert_eq!(agreed & (f::POSIX_LOCKS | f::FLOCK_LOCKS), 0);
    let (node, fh) = guest_open(&mut guest, "f");
    assert_eq!(guest_lock(&mut guest, Opcode::Setlk, node, fh, libc::F_WRLCK, (0, 0)).0, libc::ENOSYS);
    let host = open_rw(&mnt.join("f"));
    host_fcntl(&host, libc::F_SETLK, libc::F_WRLCK, 0, 1).expect("the host kernel's own lock");
    drop((guest, host));
    assert!(served.stop().success());
}
