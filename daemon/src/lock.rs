//! Exclusive ownership of an image while it is served, formatted or
//! repaired, as QEMU locks its images: an open-file-description (OFD)
//! write lock on the file or block device. OFD locks belong to the open
//! file, not the process, so they conflict inside one process too (two
//! exports naming one image by two paths), survive other descriptors of
//! the same file being closed, and vanish with the process however it
//! ends. A refusal names the holders, found by the device and inode
//! numbers of their open files (the lock itself does not record them).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::tools::UsageError;

/// How long a lock request waits for a holder to let go before refusing.
const EXITING_HOLDER_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// A held lock; dropping it (closing the file, or the RBD image)
/// releases it.
pub enum ImageLock {
    /// An OFD lock on an image file or block device.
    File(File),
    /// An RBD image's exclusive lock, which librbd holds for the open
    /// image: the device is the lock.
    Rbd(std::sync::Arc<keelfs_bdev::RbdDevice>),
    /// A read-only export's shared lock on an RBD image, which keeps
    /// writers out while held (None once let go for a migration).
    RbdReader(std::sync::Arc<keelfs_bdev::RbdDevice>, std::sync::Mutex<Option<keelfs_bdev::RbdReaderLock>>),
}

impl std::fmt::Debug for ImageLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageLock::File(file) => f.debug_tuple("File").field(file).finish(),
            ImageLock::Rbd(dev) => f.debug_tuple("Rbd").field(&keelfs_bdev::BlockDevice::name(dev.as_ref())).finish(),
            ImageLock::RbdReader(dev, _) => {
                f.debug_tuple("RbdReader").field(&keelfs_bdev::BlockDevice::name(dev.as_ref())).finish()
            }
        }
    }
}

impl ImageLock {
    /// Lock `path` for this process alone, or say who holds it. NVMe names
    /// are not files: VFIO gives a group to one process at a time already.
    /// Nor are RBD names: opening the image writable takes its lock
    /// ([`Self::Rbd`]).
    pub fn exclusive(path: &Path, purpose: &str) -> anyhow::Result<Option<ImageLock>> {
        Self::acquire(path, purpose, libc::F_WRLCK)
    }

    /// Lock `path` against writers only (a read lock, on a descriptor open
    /// read-only): read-only exports of one image may share it, and no
    /// writable export or repair may start while one serves.
    pub fn shared(path: &Path, purpose: &str) -> anyhow::Result<Option<ImageLock>> {
        Self::acquire(path, purpose, libc::F_RDLCK)
    }

    fn acquire(path: &Path, purpose: &str, kind: libc::c_int) -> anyhow::Result<Option<ImageLock>> {
        if is_not_a_file(path) {
            return Ok(None);
        }
        // A write lock needs a descriptor open for writing; a read lock
        // one open for reading.
        let file = open_image(path, kind == libc::F_WRLCK)?;
        Self::acquire_on(file, path, purpose, kind == libc::F_WRLCK).map(Some)
    }

    /// Lock `file`, already open (for writing when `write`), as
    /// [`Self::exclusive`] (`write`) or [`Self::shared`] would lock `path`;
    /// the lock is on `file`'s open file description, so a descriptor
    /// duplicated from it, before or after, holds it too.
    pub fn acquire_on(file: File, path: &Path, purpose: &str, write: bool) -> anyhow::Result<ImageLock> {
        let kind = if write { libc::F_WRLCK } else { libc::F_RDLCK };
        // A holder that is being killed (a sandboxed daemon dies a moment
        // after its supervisor) lets go within milliseconds: wait that out.
        let deadline = std::time::Instant::now() + EXITING_HOLDER_GRACE;
        loop {
            match set_lock(&file, kind) {
                Ok(true) => return Ok(ImageLock::File(file)),
                Ok(false) => {}
                Err(err) => return Err(anyhow::Error::new(err).context(format!("locking {}", path.display()))),
            }
            if std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Err(UsageError(format!("{} is in use{}: refusing to {purpose} it", path.display(), holders_text(path))).into())
    }

    /// `path` open for writing but not locked yet, for a server that takes
    /// the lock later ([`Self::try_lock`]): the destination of a
    /// migration. None for NVMe names, as with [`Self::exclusive`].
    pub fn unlocked(path: &Path) -> anyhow::Result<Option<ImageLock>> {
        if is_not_a_file(path) {
            return Ok(None);
        }
        Ok(Some(ImageLock::File(open_image(path, true)?)))
    }

    /// A file another process opened and locked, handed over: the lock is
    /// the open file description's, so it comes along.
    pub fn from_locked(file: File) -> ImageLock {
        ImageLock::File(file)
    }

    /// The locked file, to hand to another process (see
    /// [`Self::from_locked`]); None for an RBD image's lock, which stays
    /// with the client that took it.
    pub fn into_file(self) -> Option<File> {
        match self {
            ImageLock::File(file) => Some(file),
            ImageLock::Rbd(_) | ImageLock::RbdReader(..) => None,
        }
    }

    /// Take the write lock if nobody holds it; false if somebody does.
    /// An RBD lock costs a round trip to the cluster.
    pub fn try_lock(&self) -> anyhow::Result<bool> {
        match self {
            ImageLock::File(file) => Ok(set_lock(file, libc::F_WRLCK)?),
            ImageLock::Rbd(dev) => Ok(dev.try_take_lock()?),
            ImageLock::RbdReader(dev, held) => {
                let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
                if held.is_none() {
                    match dev.take_reader_lock() {
                        Ok(lock) => *held = Some(lock),
                        Err(keelfs_bdev::RbdError::Locked { .. }) => return Ok(false),
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(true)
            }
        }
    }

    /// Let go of the lock, keeping the file (or image) open to take it
    /// again: a migration's source hands the image over, and takes it back
    /// if the migration fails.
    pub fn unlock(&self) -> anyhow::Result<()> {
        match self {
            ImageLock::File(file) => Ok(set_lock(file, libc::F_UNLCK).map(drop)?),
            ImageLock::Rbd(dev) => Ok(dev.release_lock()?),
            ImageLock::RbdReader(_, held) => {
                drop(held.lock().unwrap_or_else(|e| e.into_inner()).take());
                Ok(())
            }
        }
    }

    /// Whether another open file holds a lock on `path` (it is being served):
    /// fsck without --repair reads a live image and says so.
    pub fn is_held(path: &Path) -> bool {
        let Ok(file) = File::open(path) else { return false };
        let mut probe = whole_file(libc::F_WRLCK);
        // SAFETY: as in `set_lock`; F_OFD_GETLK only writes into `probe`.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut probe) };
        rc == 0 && probe.l_type != libc::F_UNLCK as libc::c_short
    }
}

/// Whether `path` names something other than a file or block device: an
/// NVMe controller or an RBD image, whose ownership is not an OFD lock.
fn is_not_a_file(path: &Path) -> bool {
    let name = path.to_string_lossy();
    keelfs_bdev::NvmeAddress::is_nvme_name(&name) || keelfs_bdev::RbdAddress::is_rbd_name(&name)
}

/// The image at `path`, open for reading and, with `write`, writing.
fn open_image(path: &Path, write: bool) -> anyhow::Result<File> {
    let opened = std::fs::OpenOptions::new().read(true).write(write).open(path);
    opened.map_err(|e| UsageError(format!("cannot open {}: {e}", path.display())).into())
}

/// Set (F_RDLCK, F_WRLCK) or clear (F_UNLCK) `file`'s OFD lock on the
/// whole file without waiting: false if another open file holds one
/// that conflicts.
fn set_lock(file: &File, kind: libc::c_int) -> std::io::Result<bool> {
    let mut lock = whole_file(kind);
    // SAFETY: fcntl on a descriptor `file` keeps open, with a pointer to a
    // live, initialised flock.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut lock) };
    if rc == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EAGAIN | libc::EACCES) => Ok(false),
        _ => Err(err),
    }
}

fn whole_file(kind: libc::c_int) -> libc::flock {
    // SAFETY: flock is plain data; all zeros is a valid value (l_pid must
    // be 0 for OFD locks).
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = 0;
    lock.l_len = 0; // to the end, however large the file grows
    lock
}

/// " (open by pid N (NAME), ...)" for the processes with `path` open, or
/// "". A sandboxed daemon's server (a child, in a pid namespace of its own)
/// is named with the pid of the daemon that was started, its supervisor.
fn holders_text(path: &Path) -> String {
    let holders = holders(path);
    if holders.is_empty() {
        return String::new();
    }
    // This process's pid as /proc numbers it: in a pid namespace of its
    // own (a sandboxed server) process::id() is 1.
    let me = std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str().and_then(|p| p.parse().ok()))
        .unwrap_or_else(std::process::id);
    let list: Vec<String> = holders
        .iter()
        .map(|(pid, name)| {
            if *pid == me {
                return format!("pid {pid} ({name}, this process)");
            }
            match parent_of(*pid).filter(|(_, parent_name)| parent_name == name) {
                Some((parent, _)) => format!("pid {pid} ({name}, the server of pid {parent})"),
                None => format!("pid {pid} ({name})"),
            }
        })
        .collect();
    format!(" (open by {})", list.join(", "))
}

/// The parent of `pid` and its name, from /proc.
fn parent_of(pid: u32) -> Option<(u32, String)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let ppid: u32 = status.lines().find_map(|l| l.strip_prefix("PPid:"))?.trim().parse().ok()?;
    let name = std::fs::read_to_string(format!("/proc/{ppid}/comm")).ok()?.trim().to_string();
    Some((ppid, name))
}

/// Processes with the file of `path` open, found by device and inode
/// number. Bounded: at most 16 reported, and /proc is read once.
fn holders(path: &Path) -> Vec<(u32, String)> {
    const HOLDERS_MAX: usize = 16;
    let Ok(meta) = std::fs::metadata(path) else { return Vec::new() };
    let same = |m: &std::fs::Metadata| {
        if meta.file_type().is_file() {
            m.dev() == meta.dev() && m.ino() == meta.ino()
        } else {
            m.rdev() == meta.rdev() && meta.rdev() != 0
        }
    };
    let mut out = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else { return out };
    for entry in procs.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else { continue };
        let open = fds.flatten().any(|fd| std::fs::metadata(fd.path()).is_ok_and(|m| same(&m)));
        if open {
            let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default().trim().to_string();
            out.push((pid, name));
            if out.len() == HOLDERS_MAX {
                break;
            }
        }
    }
    out
}
