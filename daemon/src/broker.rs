//! Opening an export for a sandboxed server: the `export_add` RPC reaches
//! the server, which can no longer open a file or bind a socket, so it
//! asks its supervisor (outside the sandbox) to do it and hand back the
//! descriptors over their socket pair (SCM_RIGHTS).
//!
//! The server reads guests' requests, so the supervisor trusts nothing it
//! asks: it opens only images and binds only sockets inside the
//! directories the operator listed (`export_dirs`), with no symlink in the
//! last component, and only io_uring images (no VFIO, no mount).

use anyhow::Context;
use keelfs_bdev::{Geometry, UringDevice, UringOptions};
use serde::{Deserialize, Serialize};
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Component, Path, PathBuf};

use crate::lock::ImageLock;

/// What the server asks for: one export's image and socket.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct OpenRequest {
    pub device: PathBuf,
    pub read_only: bool,
    pub sqpoll_idle_ms: Option<u32>,
    pub socket: PathBuf,
    pub socket_mode: Option<u32>,
    pub socket_owner: Option<(u32, u32)>,
}

/// A socket to bind, and who may connect to it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SocketRequest {
    pub socket: PathBuf,
    pub socket_mode: Option<u32>,
    pub socket_owner: Option<(u32, u32)>,
}

impl OpenRequest {
    /// Its socket's part.
    pub fn socket_request(&self) -> SocketRequest {
        SocketRequest { socket: self.socket.clone(), socket_mode: self.socket_mode, socket_owner: self.socket_owner }
    }
}

/// The geometry the supervisor probed, and the socket's index for a
/// later "remove_socket".
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct OpenReply {
    pub capacity_bytes: u64,
    pub logical_block_size: u32,
    pub memory_alignment: u32,
    pub volatile_write_cache: bool,
    pub max_iovecs_per_request: u32,
    pub max_request_bytes: u32,
    /// Whether the device can discard (a block device says so in sysfs).
    pub discards: bool,
    pub socket_index: usize,
}

impl OpenReply {
    pub fn geometry(&self) -> Geometry {
        Geometry {
            capacity_bytes: self.capacity_bytes,
            logical_block_size: self.logical_block_size,
            memory_alignment: self.memory_alignment,
            volatile_write_cache: self.volatile_write_cache,
            max_iovecs_per_request: self.max_iovecs_per_request,
            max_request_bytes: self.max_request_bytes,
        }
    }
}

/// What the server gets: the locked image, the device and the socket.
pub struct Opened {
    pub lock: ImageLock,
    pub device: UringDevice,
    pub listener: std::os::unix::net::UnixListener,
    pub socket_index: usize,
}

impl Opened {
    /// The three descriptors the supervisor sent, in its order.
    pub fn from_fds(request: &OpenRequest, reply: &OpenReply, fds: Vec<OwnedFd>) -> io::Result<Self> {
        let [lock, device, listener]: [OwnedFd; 3] =
            fds.try_into().map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "the supervisor sent no 3 files"))?;
        let options = UringOptions { sqpoll_idle_ms: request.sqpoll_idle_ms, read_only: request.read_only };
        let name = request.device.display().to_string();
        Ok(Opened {
            lock: ImageLock::from_locked(std::fs::File::from(lock)),
            device: UringDevice::from_parts(
                std::fs::File::from(device),
                name,
                reply.geometry(),
                options,
                reply.discards,
            ),
            listener: std::os::unix::net::UnixListener::from(listener),
            socket_index: reply.socket_index,
        })
    }
}

/// The directory holding `path`, open (O_PATH) by walking down from the
/// listed directory `path` lies in without following any symlink, and
/// `path`'s last component. `path` must be absolute and free of `..`, and
/// must start with one of `dirs` (as listed, or with the list's own
/// symlinks resolved: the operator's paths are trusted, the request's are
/// not). The walk is one openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS),
/// so nothing swapped in meanwhile can lead it elsewhere.
pub fn beneath(path: &Path, dirs: &[PathBuf]) -> anyhow::Result<(OwnedFd, std::ffi::OsString)> {
    if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        anyhow::bail!("{} is not an absolute path without ..", path.display());
    }
    let name = path.file_name().ok_or_else(|| anyhow::anyhow!("{} names no file", path.display()))?.to_owned();
    let parent = path.parent().unwrap_or(Path::new("/"));
    let listed = dirs.iter().flat_map(|d| [Some(d.clone()), std::fs::canonicalize(d).ok()]).flatten();
    let (root, below) = listed
        .filter_map(|d| parent.strip_prefix(&d).ok().map(|rest| (d.clone(), rest.to_path_buf())))
        .next()
        .ok_or_else(|| anyhow::anyhow!("{} is outside export_dirs {dirs:?}", path.display()))?;
    let root = std::fs::File::open(&root).map_err(|e| anyhow::anyhow!("{}: {e}", root.display()))?;
    let below = if below.as_os_str().is_empty() { Path::new(".") } else { below.as_path() };
    let dir = openat2(&root, below, libc::O_PATH | libc::O_DIRECTORY)
        .map_err(|e| anyhow::anyhow!("{}: {e} (a symlink, or not a directory)", path.display()))?;
    if on_fuse(&dir) {
        anyhow::bail!("{} is on a FUSE filesystem", path.display());
    }
    Ok((dir, name))
}

/// openat2(2) of `path` below `dir`, never following a symlink nor leaving
/// `dir`; close-on-exec.
fn openat2(dir: &impl AsRawFd, path: &Path, flags: libc::c_int) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: open_how is plain data; zeroed is valid (no mode, no resolve).
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: a NUL-terminated path and an open_how that outlive the call,
    // with its true size; the kernel returns a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(libc::SYS_openat2, dir.as_raw_fd(), path.as_ptr(), &how, std::mem::size_of::<libc::open_how>())
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Whether `fd` lies on a FUSE filesystem, which the sandboxed server
/// itself may be serving: nothing there is opened for it.
fn on_fuse(fd: &impl AsRawFd) -> bool {
    // SAFETY: statfs is plain data; all zeros is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs through a valid pointer, on a
    // descriptor the caller keeps open.
    let rc = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) };
    rc != 0 || st.f_type == libc::FUSE_SUPER_MAGIC
}

/// The supervisor's side: open the image and the socket's directory
/// beneath the listed directories, lock the very file it serves, bind the
/// socket. Returns the descriptors to send and the reply.
pub fn open_for(request: &OpenRequest, dirs: &[PathBuf]) -> anyhow::Result<(Vec<OwnedFd>, OpenReply)> {
    let (dir, name) = beneath(&request.device, dirs)?;
    let access = if request.read_only { libc::O_RDONLY } else { libc::O_RDWR };
    let file = std::fs::File::from(openat2(&dir, Path::new(&name), access | libc::O_DIRECT)?);
    let kind = file.metadata()?.file_type();
    if on_fuse(&file) || !(kind.is_file() || std::os::unix::fs::FileTypeExt::is_block_device(&kind)) {
        anyhow::bail!("{} is not a file or block device", request.device.display());
    }
    // The lock and the device share the open file description: the lock
    // is on the file served.
    let lock = ImageLock::acquire_on(file.try_clone()?, &request.device, "serve", !request.read_only)?;
    let options = UringOptions { sqpoll_idle_ms: request.sqpoll_idle_ms, read_only: request.read_only };
    let device = UringDevice::from_file(file, request.device.display().to_string(), options)?;
    let listener = bind_beneath(&request.socket_request(), dirs)?;
    let g = keelfs_bdev::BlockDevice::geometry(&device);
    let reply = OpenReply {
        capacity_bytes: g.capacity_bytes,
        logical_block_size: g.logical_block_size,
        memory_alignment: g.memory_alignment,
        volatile_write_cache: g.volatile_write_cache,
        max_iovecs_per_request: g.max_iovecs_per_request,
        max_request_bytes: g.max_request_bytes,
        discards: keelfs_bdev::BlockDevice::supports_discard(&device),
        socket_index: 0,
    };
    let lock = lock.into_file().context("an image file's lock is a file")?;
    let fds = vec![lock.into(), device.file().try_clone()?.into(), OwnedFd::from(listener)];
    Ok((fds, reply))
}

/// The supervisor's side of a socket alone: bound beneath the listed
/// directories, as an export's is.
pub fn bind_for(request: &SocketRequest, dirs: &[PathBuf]) -> anyhow::Result<std::os::unix::net::UnixListener> {
    bind_beneath(request, dirs)
}

/// Bind the request's socket in its directory, reached as [`beneath`]
/// does. Nothing may be at the path yet: probing a stale socket means
/// connecting to it, which can block on a listener that is not accepting.
fn bind_beneath(request: &SocketRequest, dirs: &[PathBuf]) -> anyhow::Result<std::os::unix::net::UnixListener> {
    let (dir, name) = beneath(&request.socket, dirs)?;
    // Through the directory's descriptor, whatever its path becomes.
    let path = Path::new("/proc/self/fd").join(dir.as_raw_fd().to_string()).join(&name);
    if std::fs::symlink_metadata(&path).is_ok() {
        anyhow::bail!("{} exists; remove it first", request.socket.display());
    }
    let access = keelfs_vhost::SocketAccess {
        mode: request.socket_mode.unwrap_or(keelfs_vhost::SocketAccess::default().mode),
        owner: request.socket_owner,
    };
    Ok(keelfs_vhost::bind_listener(&path, access)?)
}

/// Send `data` with `fds` attached (SCM_RIGHTS).
pub fn send_with_fds(stream: &UnixStream, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut space = control_buffer(cmsg_space(fds.len()));
    let iov = [IoSlice::new(data)];
    // SAFETY: msghdr is plain data; zeroed is valid, and every pointer set
    // below points at live buffers that outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = space.as_mut_ptr().cast();
        msg.msg_controllen = cmsg_space(fds.len()) as _;
        // SAFETY: msg_control holds CMSG_SPACE(fds) bytes, aligned for
        // cmsghdr (control_buffer), so the first header and its data fit.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast::<RawFd>(), fds.len());
        }
    }
    // SAFETY: a valid msghdr on a socket the caller keeps open.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    if sent as usize != data.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "a short send"));
    }
    Ok(())
}

fn cmsg_space(fds: usize) -> usize {
    // SAFETY: CMSG_SPACE is arithmetic.
    unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// A zeroed control buffer of at least `bytes`, aligned for cmsghdr (u64
/// words: cmsghdr's alignment is that of size_t).
fn control_buffer(bytes: usize) -> Vec<u64> {
    vec![0u64; bytes.div_ceil(8)]
}

/// Receive into `buf`, taking at most `fds_max` descriptors sent with it;
/// returns the bytes read and the descriptors (owned: closed on drop).
pub fn recv_with_fds(stream: &UnixStream, buf: &mut [u8], fds_max: usize) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = control_buffer(cmsg_space(fds_max));
    let mut iov = [IoSliceMut::new(buf)];
    // SAFETY: as in send_with_fds; the buffers outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr().cast();
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = cmsg_space(fds_max) as _;
    // SAFETY: a valid msghdr, its control buffer aligned for cmsghdr, on a
    // socket the caller keeps open;
    // MSG_CMSG_CLOEXEC keeps the descriptors from any exec.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control; CMSG_FIRSTHDR/NXTHDR walk it
    // within msg_controllen, and SCM_RIGHTS data holds whole RawFds.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "more descriptors than expected"));
    }
    Ok((n as usize, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_paths_beneath_the_listed_directories_without_symlinks() {
        let dir = std::env::temp_dir().join(format!("keelfs-broker-{}", std::process::id()));
        let inside = dir.join("ok");
        std::fs::create_dir_all(inside.join("sub")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", inside.join("link")).unwrap();
        std::os::unix::fs::symlink("/etc", inside.join("etc")).unwrap();
        std::os::unix::fs::symlink(&inside, dir.join("alias")).unwrap();
        let dirs = [inside.clone()];
        let named = |p: &Path| beneath(p, &dirs).map(|(_, name)| name.to_string_lossy().into_owned()).ok();
        assert_eq!(named(&inside.join("a.img")).as_deref(), Some("a.img"));
        assert_eq!(named(&inside.join("sub/b.img")).as_deref(), Some("b.img"));
        assert!(named(&inside.join("etc/passwd")).is_none(), "a symlinked directory");
        assert!(named(&inside.join("../x.img")).is_none(), "..");
        assert!(named(Path::new("/etc/shadow")).is_none());
        assert!(named(Path::new("rel.img")).is_none());
        assert!(named(&dir.join("b.img")).is_none(), "the parent of a listed directory");
        assert!(named(&dir.join("alias/a.img")).is_none(), "a symlink to a listed directory is not listed");
        assert!(beneath(&inside.join("a.img"), &[]).is_err(), "nothing listed, nothing allowed");
        // The last component is opened without following it.
        let (parent, name) = beneath(&inside.join("link"), &dirs).unwrap();
        assert!(openat2(&parent, Path::new(&name), libc::O_RDONLY).is_err(), "a symlink at the end");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn descriptors_cross_a_socket_pair() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/status").unwrap();
        send_with_fds(&a, b"0 hello\n", &[file.as_raw_fd(), file.as_raw_fd()]).unwrap();
        let mut buf = [0u8; 64];
        let (n, fds) = recv_with_fds(&b, &mut buf, 3).unwrap();
        assert_eq!(&buf[..n], b"0 hello\n");
        assert_eq!(fds.len(), 2);
        let received = std::fs::File::from(fds.into_iter().next().unwrap());
        assert!(received.metadata().unwrap().is_file());
    }
}
