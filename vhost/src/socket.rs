//! Listening unix sockets that are safe to put on a shared path: the
//! vhost-user socket a VMM connects to, and the daemon's RPC socket.
//!
//! The socket is bound inside a fresh directory only this process can
//! enter, given its final mode and owner there (no other process can swap
//! the path for a symlink in between, so nothing follows one), and only
//! then renamed onto its path, refusing to replace anything. So it never
//! accepts a connection before its access is final. A path that is already
//! taken is refused unless it is a stale socket (one nobody answers on);
//! a regular file, a directory or a symlink there is never removed.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Who may connect: the socket's mode and owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketAccess {
    pub mode: u32,
    /// uid and gid to give the socket; None keeps this process's.
    pub owner: Option<(u32, u32)>,
}

impl Default for SocketAccess {
    /// Only this process's user may connect (the owner needs write
    /// permission to connect to a unix socket).
    fn default() -> Self {
        Self { mode: 0o600, owner: None }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("{path} is in use: something answers on it")]
    InUse { path: PathBuf },
    #[error("{path} exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error("{path}: {what}: {source}")]
    Io { path: PathBuf, what: &'static str, source: io::Error },
}

/// Bind a listening socket at `path` with `access`, as the module says.
pub fn bind_listener(path: &Path, access: SocketAccess) -> Result<UnixListener, SocketError> {
    let io_err = |what: &'static str| move |source| SocketError::Io { path: path.to_owned(), what, source };
    clear_stale(path)?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let private = PrivateDir::create(&parent).map_err(io_err("creating a private directory beside it"))?;
    let staged = private.0.join("s");
    let listener = UnixListener::bind(&staged).map_err(io_err("binding"))?;
    // Inside a directory no one else can enter: these paths are ours.
    if let Some((uid, gid)) = access.owner {
        std::os::unix::fs::lchown(&staged, Some(uid), Some(gid)).map_err(io_err("setting the owner"))?;
    }
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(access.mode))
        .map_err(io_err("setting the mode"))?;
    rename_noreplace(&staged, path).map_err(|source| match source.raw_os_error() {
        Some(libc::EEXIST) => SocketError::NotASocket { path: path.to_owned() },
        _ => SocketError::Io { path: path.to_owned(), what: "moving into place", source },
    })?;
    Ok(listener)
}

/// Remove `path` if it is a socket nobody answers on; refuse anything else
/// that is there. A missing path is fine.
pub fn clear_stale(path: &Path) -> Result<(), SocketError> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(SocketError::Io { path: path.to_owned(), what: "looking at it", source }),
        Ok(m) => m,
    };
    if !meta.file_type().is_socket() {
        return Err(SocketError::NotASocket { path: path.to_owned() });
    }
    if UnixStream::connect(path).is_ok() {
        return Err(SocketError::InUse { path: path.to_owned() });
    }
    std::fs::remove_file(path).map_err(|source| SocketError::Io {
        path: path.to_owned(),
        what: "removing the stale socket",
        source,
    })
}

/// Wake every thread blocked in accept(2) on `listener` (it returns
/// EINVAL) and make later accepts fail. Unlike a wake-up connection this
/// needs no path, so it works inside the sandbox, where the socket's path
/// is not visible.
pub fn stop_accepting(listener: &impl std::os::fd::AsFd) {
    use std::os::fd::AsRawFd;
    // SAFETY: shutdown(2) on a descriptor the caller keeps open; no memory
    // is passed.
    unsafe { libc::shutdown(listener.as_fd().as_raw_fd(), libc::SHUT_RDWR) };
}

/// A directory of mode 0700, removed (with what is left in it) on drop.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn create(parent: &Path) -> io::Result<PrivateDir> {
        use std::os::unix::fs::DirBuilderExt;
        for attempt in 0..16u32 {
            let name = format!(".keelfs-socket.{}.{}.{attempt}", std::process::id(), nanos());
            let dir = parent.join(name);
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(PrivateDir(dir)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(io::ErrorKind::AlreadyExists, "no free private directory name"))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0.join("s"));
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn nanos() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
}

/// rename(2) that fails with EEXIST instead of replacing `to`.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput);
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: both are NUL-terminated strings that outlive the call.
    let rc =
        unsafe { libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_NOREPLACE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("keelfs-socket-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_socket_has_its_final_mode_and_owner_when_it_appears() {
        let dir = scratch("mode");
        let path = dir.join("fs.sock");
        let access = SocketAccess { mode: 0o660, owner: Some((1234, 5678)) };
        let listener = bind_listener(&path, access).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.mode() & 0o7777, 0o660);
        assert_eq!((meta.uid(), meta.gid()), (1234, 5678));
        assert!(UnixStream::connect(&path).is_ok(), "the listener answers at its final path");
        drop(listener);
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("fs.sock")], "no private directory left behind");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_a_stale_socket_is_replaced() {
        let dir = scratch("replace");
        let file = dir.join("file");
        std::fs::write(&file, b"precious").unwrap();
        assert!(matches!(bind_listener(&file, SocketAccess::default()), Err(SocketError::NotASocket { .. })));
        assert_eq!(std::fs::read(&file).unwrap(), b"precious");
        let link = dir.join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(matches!(bind_listener(&link, SocketAccess::default()), Err(SocketError::NotASocket { .. })));
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the symlink stays");
        let subdir = dir.join("d");
        std::fs::create_dir(&subdir).unwrap();
        assert!(matches!(bind_listener(&subdir, SocketAccess::default()), Err(SocketError::NotASocket { .. })));

        let sock = dir.join("s.sock");
        let live = bind_listener(&sock, SocketAccess::default()).unwrap();
        assert!(matches!(bind_listener(&sock, SocketAccess::default()), Err(SocketError::InUse { .. })));
        drop(live); // leaves a stale socket file behind
        assert!(std::fs::symlink_metadata(&sock).is_ok());
        let again = bind_listener(&sock, SocketAccess::default()).expect("a stale socket is replaced");
        drop(again);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
