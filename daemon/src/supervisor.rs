//! The process outside the sandbox.
//!
//! A pid namespace takes effect for children only, so `keelfsd serve`
//! forks: the child becomes pid 1 of a new pid namespace and serves,
//! sandboxed; the parent, the process its caller started, stays in the
//! host's namespaces and does only what the child can no longer do:
//! - it passes SIGTERM and SIGINT on to the child as SIGUSR1, the only
//!   signal the child acts on, so that `pkill keelfsd`, which signals both,
//!   is heard once; the child also has a process group of its own, so a
//!   terminal's ^C reaches only the supervisor;
//! - it takes down the child's /dev/fuse mounts when asked (the child
//!   cannot see their mount points), and after the child exits;
//! - it removes the child's stale sockets after it exits;
//! - it exits with the child's status, saying so when a signal (SIGSYS
//!   from the seccomp filter, say) killed it.
//!
//! The parent is confined too, once it has forked: no new privileges,
//! and a seccomp allowlist of what the above needs (no exec, no new
//! processes, no mounts, no network; `seccomp::install_supervisor`).
//!
//! The child dies with the parent (PR_SET_PDEATHSIG), so SIGKILL to the
//! process its caller knows still ends the daemon at once. The parent reads
//! nothing from a guest; from the child it accepts only "unmount N" for a
//! mount of its own configuration, and "open_export" for an image and a
//! socket inside the operator's `export_dirs` (see [`crate::broker`]).

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::broker::{self, OpenReply, OpenRequest, SocketRequest};
use crate::sandbox;
use crate::signals::Signals;

/// What the supervisor cleans up for the child.
#[derive(Clone, Debug, Default)]
pub struct Cleanup {
    /// Host mount points of /dev/fuse mounts, absolute.
    pub fuse_mounts: Vec<PathBuf>,
    /// Their filesystem types as mountinfo shows them (fuse.keelfs unless
    /// the mount helper was asked for another subtype), in the same order.
    pub fuse_types: Vec<String>,
    /// vhost-user and RPC sockets.
    pub sockets: Vec<PathBuf>,
    /// Where `export_add` may open images and bind sockets for the server
    /// (`export_dirs`); empty: nowhere.
    pub export_dirs: Vec<PathBuf>,
}

pub enum Role {
    /// This is the child: serve, sandboxed.
    Server(SupervisorLink),
    /// This is the parent: the child has exited, and this is the exit code.
    Supervisor(ExitCode),
}

/// How long the child waits for the supervisor to unmount.
const UNMOUNT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest message either side sends (an "open_export" request
/// carries two paths).
const MESSAGE_BYTES_MAX: usize = 16 << 10;

/// The child's end of the line to its supervisor.
pub struct SupervisorLink {
    stream: Mutex<UnixStream>,
    fuse_mounts: Vec<PathBuf>,
    /// An answer did not come in time: a late one would be read as the
    /// next request's, so the link is not used again.
    broken: std::sync::atomic::AtomicBool,
}

impl SupervisorLink {
    fn index_of(&self, mountpoint: &Path) -> io::Result<usize> {
        self.fuse_mounts
            .iter()
            .position(|m| m == mountpoint)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "not a mount the supervisor knows"))
    }

    /// Tell the supervisor which mount at `mountpoint` is the server's own:
    /// the one just made there, of type `fstype`. It unmounts only that
    /// one, never one made later by another daemon (a remount after umount).
    pub fn mounted(&self, mountpoint: &Path, fstype: &str) -> io::Result<()> {
        let index = self.index_of(mountpoint)?;
        let id = keelfs_mount_at(mountpoint, fstype)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the new mount is not in mountinfo"))?;
        self.request(&format!("mounted {index} {id}"))
    }

    /// Tell the supervisor the mount at `mountpoint` was unmounted by
    /// someone else: it is no longer the server's to clean up.
    pub fn gone(&self, mountpoint: &Path) -> io::Result<()> {
        let index = self.index_of(mountpoint)?;
        self.request(&format!("gone {index}"))
    }

    /// Have the supervisor unmount the /dev/fuse mount at `mountpoint`.
    pub fn unmount(&self, mountpoint: &Path) -> io::Result<()> {
        let index = self.index_of(mountpoint)?;
        self.request(&format!("unmount {index}"))
    }

    /// Have the supervisor lock and open an export's image and bind its
    /// socket (see [`crate::broker`]); a refusal comes back as an error
    /// with the supervisor's reason.
    pub fn open_export(&self, request: &OpenRequest) -> io::Result<broker::Opened> {
        let line = serde_json::to_string(request).map_err(io::Error::other)?;
        let (reply, fds) = self.request_with_fds(&format!("open_export {line}"), 3)?;
        match reply.split_once(' ') {
            Some(("0", body)) => {
                let reply: OpenReply = serde_json::from_str(body).map_err(io::Error::other)?;
                broker::Opened::from_fds(request, &reply, fds)
            }
            Some(("E", why)) => Err(io::Error::other(why.to_string())),
            _ => Err(io::ErrorKind::InvalidData.into()),
        }
    }

    /// Have the supervisor bind a socket alone (beneath export_dirs, as
    /// `open_export` does): for an export on a device the server already
    /// holds, a snapshot's beside the export that serves its image.
    /// Returns the listener and its index for `remove_socket`.
    pub fn bind_socket(&self, request: &SocketRequest) -> io::Result<(std::os::unix::net::UnixListener, usize)> {
        let line = serde_json::to_string(request).map_err(io::Error::other)?;
        let (reply, fds) = self.request_with_fds(&format!("bind_socket {line}"), 1)?;
        match (reply.split_once(' '), <[OwnedFd; 1]>::try_from(fds)) {
            (Some(("0", index)), Ok([listener])) => {
                let index = index.parse().map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
                Ok((std::os::unix::net::UnixListener::from(listener), index))
            }
            (Some(("E", why)), _) => Err(io::Error::other(why.to_string())),
            _ => Err(io::ErrorKind::InvalidData.into()),
        }
    }

    /// Have the supervisor remove the socket of an export added at runtime
    /// (its `socket_index`), once the export has stopped.
    pub fn remove_socket(&self, index: usize) -> io::Result<()> {
        self.request(&format!("remove_socket {index}"))
    }

    /// The link, unless an earlier exchange broke it.
    fn usable(&self) -> io::Result<std::sync::MutexGuard<'_, UnixStream>> {
        let stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        if self.broken.load(std::sync::atomic::Ordering::Acquire) {
            return Err(io::Error::other("the supervisor link broke (an answer came late or not at all)"));
        }
        Ok(stream)
    }

    /// An exchange failed half-way: its answer may still come, and would
    /// be taken for the next one's.
    fn broke(&self, e: io::Error) -> io::Error {
        self.broken.store(true, std::sync::atomic::Ordering::Release);
        e
    }

    /// Send one request and read its answer: 0, or an errno.
    /// Send `message` and take its one-line answer (trimmed) with the up
    /// to `fds_max` descriptors that come with it: `open_export` and
    /// `bind_socket`, which the caller reads the status of.
    fn request_with_fds(&self, message: &str, fds_max: usize) -> io::Result<(String, Vec<OwnedFd>)> {
        let mut stream = self.usable()?;
        send_line(&mut stream, message).map_err(|e| self.broke(e))?;
        let mut buf = vec![0u8; MESSAGE_BYTES_MAX];
        let (n, fds) = broker::recv_with_fds(&stream, &mut buf, fds_max).map_err(|e| self.broke(e))?;
        let mut reply = buf[..n].to_vec();
        if !reply.ends_with(b"\n") {
            reply.extend_from_slice(read_line(&mut stream).map_err(|e| self.broke(e))?.as_bytes());
        }
        Ok((String::from_utf8_lossy(&reply).trim_end().to_string(), fds))
    }

    fn request(&self, message: &str) -> io::Result<()> {
        let mut stream = self.usable()?;
        send_line(&mut stream, message).map_err(|e| self.broke(e))?;
        match read_line(&mut stream).map_err(|e| self.broke(e))?.as_str() {
            "0" => Ok(()),
            errno => {
                Err(errno.parse().map_or_else(|_| io::ErrorKind::InvalidData.into(), io::Error::from_raw_os_error))
            }
        }
    }
}

/// One message and its newline in one write.
fn send_line(stream: &mut UnixStream, message: &str) -> io::Result<()> {
    stream.write_all(format!("{message}\n").as_bytes())
}

/// One message, up to its newline; at most MESSAGE_BYTES_MAX bytes.
fn read_line(stream: &mut UnixStream) -> io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < MESSAGE_BYTES_MAX {
        if stream.read(&mut byte)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if byte[0] == b'\n' {
            return String::from_utf8(line).map_err(|_| io::ErrorKind::InvalidData.into());
        }
        line.push(byte[0]);
    }
    Err(io::ErrorKind::InvalidData.into())
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Fork into a new pid namespace. Must run before any thread starts.
pub fn fork_into_pid_namespace(cleanup: Cleanup, signals: &Signals) -> anyhow::Result<Role> {
    sandbox::ensure_single_threaded()?;
    let (parent_end, child_end) = UnixStream::pair().context("a socket pair for the supervisor")?;
    // SAFETY: unshare takes flags only.
    if let Err(e) = check(unsafe { libc::unshare(libc::CLONE_NEWPID) }) {
        bail!(crate::tools::UsageError(format!(
            "the namespace sandbox cannot create a pid namespace ({e}); it needs root. \
             Run as root, or pass --sandbox none to serve without a sandbox"
        )));
    }
    // SAFETY: the process has one thread (checked above), so the child
    // inherits no lock held by another thread.
    let pid = check(unsafe { libc::fork() }).context("fork")?;
    if pid == 0 {
        drop(parent_end);
        become_child(&child_end)?;
        return Ok(Role::Server(SupervisorLink {
            stream: Mutex::new(child_end),
            fuse_mounts: cleanup.fuse_mounts,
            broken: Default::default(),
        }));
    }
    drop(child_end);
    crate::seccomp::install_supervisor(pid, crate::hooks::seccomp_action())?;
    let code = supervise(pid, parent_end, signals, &cleanup)?;
    Ok(Role::Supervisor(code))
}

fn become_child(link: &UnixStream) -> anyhow::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) }).context("PR_SET_PDEATHSIG")?;
    // A process group of its own: a signal to the supervisor's group (^C
    // at a terminal) reaches the server once, forwarded, not twice, which
    // it would take for the "second signal" that forces an exit.
    // SAFETY: setpgid with integer arguments only.
    check(unsafe { libc::setpgid(0, 0) }).context("setpgid")?;
    // The parent may have died before the line above took effect; then its
    // end of the link is closed.
    let mut pfd = libc::pollfd { fd: link.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    check(unsafe { libc::poll(&mut pfd, 1, 0) })?;
    if pfd.revents & libc::POLLHUP != 0 {
        std::process::exit(1);
    }
    // Set now: setsockopt is not allowed in the sandbox.
    link.set_read_timeout(Some(UNMOUNT_TIMEOUT)).context("a timeout on the supervisor link")?;
    Ok(())
}

fn supervise(
    child: libc::pid_t,
    mut link: UnixStream,
    signals: &Signals,
    cleanup: &Cleanup,
) -> anyhow::Result<ExitCode> {
    // The mount id of each mount the child made, as it reported them: only
    // those are the supervisor's to unmount.
    let mut made: Vec<Option<u64>> = vec![None; cleanup.fuse_mounts.len()];
    // Sockets bound for exports added at runtime, removed when the server
    // asks or exits.
    let mut runtime_sockets: Vec<PathBuf> = Vec::new();
    // SAFETY: pidfd_open takes a pid and flags.
    let pidfd = check(unsafe { libc::syscall(libc::SYS_pidfd_open, child, 0) } as libc::c_int)
        .context("pidfd_open on the sandboxed server")?;
    // SAFETY: a new descriptor owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let mut link_open = true;
    loop {
        let mut fds = [
            poll_fd(signals.as_raw_fd()),
            poll_fd(pidfd.as_raw_fd()),
            poll_fd(if link_open { link.as_raw_fd() } else { -1 }),
        ];
        // SAFETY: three valid pollfds (a negative fd is ignored).
        match check(unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) }) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => r.context("poll")?,
        };
        if fds[0].revents != 0 && signals.wait(Some(Duration::ZERO)).is_some() {
            // SAFETY: kill takes a pid and a signal number.
            unsafe { libc::kill(child, crate::signals::FORWARDED) };
        }
        if fds[2].revents != 0 {
            link_open = answer(&mut link, cleanup, &mut made, &mut runtime_sockets);
        }
        if fds[1].revents != 0 {
            break;
        }
    }
    let mut status = 0;
    // SAFETY: the child is ours and has exited; status is a valid int.
    check(unsafe { libc::waitpid(child, &mut status, 0) }).context("waitpid")?;
    // Only a mount the child made: another daemon's, there before or
    // made since (a remount after umount), stays.
    for index in 0..made.len() {
        let _ = unmount_own(cleanup, &made, index);
    }
    for socket in cleanup.sockets.iter().chain(&runtime_sockets) {
        let _ = keelfs_vhost::clear_stale(socket);
    }
    Ok(exit_code(status))
}

fn poll_fd(fd: RawFd) -> libc::pollfd {
    libc::pollfd { fd, events: libc::POLLIN, revents: 0 }
}

/// Serve one request from the child ("mounted INDEX ID", "gone INDEX",
/// "unmount INDEX", "open_export JSON", "bind_socket JSON" or
/// "remove_socket INDEX"); false once the link is closed.
fn answer(link: &mut UnixStream, cleanup: &Cleanup, made: &mut [Option<u64>], sockets: &mut Vec<PathBuf>) -> bool {
    let Ok(request) = read_line(link) else { return false };
    if let Some(json) = request.strip_prefix("open_export ") {
        return open_export(link, json, cleanup, sockets).is_ok();
    }
    if let Some(json) = request.strip_prefix("bind_socket ") {
        return bind_socket(link, json, cleanup, sockets).is_ok();
    }
    let words: Vec<&str> = request.split(' ').collect();
    let index = words.get(1).and_then(|i| i.parse::<usize>().ok()).filter(|&i| i < made.len());
    let errno = match (words.first(), index, words.get(2).and_then(|id| id.parse::<u64>().ok())) {
        (Some(&"mounted"), Some(index), Some(id)) => {
            made[index] = Some(id);
            0
        }
        (Some(&"gone"), Some(index), None) => {
            made[index] = None;
            0
        }
        (Some(&"unmount"), Some(index), None) => {
            unmount_own(cleanup, made, index).err().map_or(0, |e| e.raw_os_error().unwrap_or(libc::EIO))
        }
        (Some(&"remove_socket"), _, None) => {
            match words.get(1).and_then(|i| i.parse::<usize>().ok()).and_then(|i| sockets.get(i)) {
                Some(socket) => keelfs_vhost::clear_stale(socket).err().map_or(0, |_| libc::EIO),
                None => libc::EINVAL,
            }
        }
        _ => libc::EINVAL,
    };
    send_line(link, &errno.to_string()).is_ok()
}

/// Open an export for the child (see [`crate::broker`]): "0 REPLY" with
/// the image's lock, the device and the socket attached, or "E WHY".
fn open_export(link: &mut UnixStream, json: &str, cleanup: &Cleanup, sockets: &mut Vec<PathBuf>) -> io::Result<()> {
    let opened = serde_json::from_str::<OpenRequest>(json)
        .map_err(anyhow::Error::from)
        .and_then(|request| broker::open_for(&request, &cleanup.export_dirs).map(|o| (request, o)));
    match opened {
        Ok((request, (fds, mut reply))) => {
            reply.socket_index = sockets.len();
            sockets.push(request.socket.clone());
            let line = format!("0 {}\n", serde_json::to_string(&reply).map_err(io::Error::other)?);
            let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
            // Ours close when `fds` drops; the child's copies stay open.
            broker::send_with_fds(link, line.as_bytes(), &raw)
        }
        Err(e) => {
            // One line: the reason, without newlines.
            let why = format!("{e:#}").replace('\n', " ");
            send_line(link, &format!("E {why}"))
        }
    }
}

/// Bind a socket for the child: "0 INDEX" with the listener attached, or
/// "E WHY".
fn bind_socket(link: &mut UnixStream, json: &str, cleanup: &Cleanup, sockets: &mut Vec<PathBuf>) -> io::Result<()> {
    let bound = serde_json::from_str::<SocketRequest>(json)
        .map_err(anyhow::Error::from)
        .and_then(|request| broker::bind_for(&request, &cleanup.export_dirs).map(|l| (request, l)));
    match bound {
        Ok((request, listener)) => {
            let line = format!("0 {}\n", sockets.len());
            sockets.push(request.socket);
            broker::send_with_fds(link, line.as_bytes(), &[listener.as_raw_fd()])
        }
        Err(e) => send_line(link, &format!("E {}", format!("{e:#}").replace('\n', " "))),
    }
}

/// Unmount the child's mount number `index` if it is still the topmost
/// mount at its mount point; anything else there is left alone.
fn unmount_own(cleanup: &Cleanup, made: &[Option<u64>], index: usize) -> io::Result<()> {
    let (mountpoint, fstype) = (&cleanup.fuse_mounts[index], &cleanup.fuse_types[index]);
    match made[index] {
        Some(id) if keelfs_mount_at(mountpoint, fstype) == Some(id) => umount(mountpoint),
        _ => Ok(()),
    }
}

fn umount(mountpoint: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let target = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())?;
    // SAFETY: a NUL-terminated path that outlives the call.
    check(unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) }).map(drop)
}

/// The mount id of the topmost /dev/fuse mount of type `fstype` at
/// `mountpoint`.
fn keelfs_mount_at(mountpoint: &Path, fstype: &str) -> Option<u64> {
    crate::mountinfo::topmost(mountpoint, fstype).map(|m| m.id)
}

fn exit_code(status: libc::c_int) -> ExitCode {
    if libc::WIFEXITED(status) {
        return ExitCode::from(libc::WEXITSTATUS(status) as u8);
    }
    let signal = libc::WTERMSIG(status);
    let why = if signal == libc::SIGSYS {
        " (SIGSYS: a system call outside the seccomp allowlist; the kernel log names it)"
    } else {
        ""
    };
    eprintln!("keelfsd: the sandboxed server was killed by signal {signal}{why}");
    ExitCode::from(128 + signal as u8)
}
