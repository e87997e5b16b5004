//! Opening an export for a sandboxed server: the `export_add` RPC reaches
//! the server, which can no longer open a file or bind a socket, so it
//! asks its supervisor (outside the sandbox) to do it and hand back the
//! descriptors over their socket pair (SCM_RIGHTS).
//!
//! The server reads guests' requests, so the supervisor trusts nothing it
//! asks: it opens only images and binds only sockets inside the
//! directories the operator listed (`export_dirs`), with no symlink in the
//! last component, and only io_uring images (no VFIO, no mount).

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Component, Path, PathBuf};

use keelfs_bdev::{Geometry, UringDevice, UringOptions};
use serde::{Deserialize, Serialize};

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

/// `path` is absolute, has no `..`, and lies in one of `dirs` once its
/// directory's symlinks are resolved; its last component is not a symlink.
pub fn allowed(path: &Path, dirs: &[PathBuf]) -> Result<PathBuf, String> {
    if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        return Err(format!("{} is not an absolute path without ..", path.display()));
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(format!("{} names no file", path.display()));
    };
    let dir = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let inside = dirs.iter().filter_map(|d| std::fs::canonicalize(d).ok()).any(|d| dir.starts_with(d));
    if !inside {
        return Err(format!("{} is outside export_dirs {dirs:?}", path.display()));
    }
    let resolved = dir.join(name);
    if std::fs::symlink_metadata(&resolved).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(format!("{} is a symlink", path.display()));
    }
    Ok(resolved)
}

/// The supervisor's side: check `request` against `dirs`, lock and open the
/// image, bind the socket. Returns the descriptors to send and the reply.
pub fn open_for(request: &OpenRequest, dirs: &[PathBuf]) -> anyhow::Result<(Vec<OwnedFd>, OpenReply)> {
    let device_path = allowed(&request.device, dirs).map_err(anyhow::Error::msg)?;
    let socket_path = allowed(&request.socket, dirs).map_err(anyhow::Error::msg)?;
    if !std::fs::metadata(&device_path)
        .is_ok_and(|m| m.is_file() || std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
    {
        anyhow::bail!("{} is not a file or block device", device_path.display());
    }
    let lock = match request.read_only {
        true => ImageLock::shared(&device_path, "serve")?,
        false => ImageLock::exclusive(&device_path, "serve")?,
    };
    let lock = lock.ok_or_else(|| anyhow::anyhow!("no lock for {}", device_path.display()))?;
    let options = UringOptions { sqpoll_idle_ms: request.sqpoll_idle_ms, read_only: request.read_only };
    let device = UringDevice::open(&device_path, options)?;
    let access = keelfs_vhost::SocketAccess {
        mode: request.socket_mode.unwrap_or(keelfs_vhost::SocketAccess::default().mode),
        owner: request.socket_owner,
    };
    let listener = keelfs_vhost::bind_listener(&socket_path, access)?;
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
    let fds = vec![lock.into_file().into(), device.file().try_clone()?.into(), OwnedFd::from(listener)];
    Ok((fds, reply))
}

/// Send `data` with `fds` attached (SCM_RIGHTS).
pub fn send_with_fds(stream: &UnixStream, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut space = vec![0u8; cmsg_space(fds.len())];
    let iov = [IoSlice::new(data)];
    // SAFETY: msghdr is plain data; zeroed is valid, and every pointer set
    // below points at live buffers that outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = space.as_mut_ptr().cast();
        msg.msg_controllen = space.len() as _;
        // SAFETY: msg_control holds CMSG_SPACE(fds) bytes, so the first
        // header and its data fit.
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

/// Receive into `buf`, taking at most `fds_max` descriptors sent with it;
/// returns the bytes read and the descriptors (owned: closed on drop).
pub fn recv_with_fds(stream: &UnixStream, buf: &mut [u8], fds_max: usize) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = vec![0u8; cmsg_space(fds_max)];
    let mut iov = [IoSliceMut::new(buf)];
    // SAFETY: as in send_with_fds; the buffers outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr().cast();
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = space.len() as _;
    // SAFETY: a valid msghdr on a socket the caller keeps open;
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
    fn only_paths_inside_the_listed_directories() {
        let dir = std::env::temp_dir().join(format!("keelfs-broker-{}", std::process::id()));
        let inside = dir.join("ok");
        std::fs::create_dir_all(&inside).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", inside.join("link")).unwrap();
        std::os::unix::fs::symlink("/etc", inside.join("etc")).unwrap();
        let dirs = [inside.clone()];
        assert!(allowed(&inside.join("a.img"), &dirs).is_ok());
        assert!(allowed(&inside.join("link"), &dirs).is_err(), "a symlink");
        assert!(allowed(&inside.join("etc/passwd"), &dirs).is_err(), "a symlinked directory");
        assert!(allowed(&inside.join("../x.img"), &dirs).is_err(), "..");
        assert!(allowed(Path::new("/etc/shadow"), &dirs).is_err());
        assert!(allowed(Path::new("rel.img"), &dirs).is_err());
        assert!(allowed(&dir.join("b.img"), &dirs).is_err(), "the parent of a listed directory");
        assert!(allowed(&inside.join("a.img"), &[]).is_err(), "nothing listed, nothing allowed");
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
