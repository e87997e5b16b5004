//! The namespace sandbox `keelfsd serve` enters by default, after it has
//! opened every device, socket and /dev/fuse mount it will use.
//!
//! A guest (or the VMM that holds the vhost-user socket) that found a bug
//! in the daemon would then hold a process that:
//! - is pid 1 of a pid namespace of its own (see [`crate::supervisor`]),
//!   with private mount, ipc, uts and network namespaces;
//! - sees an empty, read-only root: no host file can be opened, and the
//!   seccomp filter forbids opening anything anyway;
//! - has no capabilities, an empty bounding set, locked securebits and
//!   no_new_privs, so nothing it could exec would regain any;
//! - dumps no core (guest memory is mapped into it) and has bounded file
//!   descriptors;
//! - may make only the system calls of [`crate::seccomp`], and any other
//!   kills it.
//!
//! The backends need some of it relaxed; [`Needs`] says which and why.

use std::ffi::CString;
use std::io;

use anyhow::{bail, Context};

use crate::seccomp;

/// `--sandbox`: as virtiofsd's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxMode {
    /// Namespaces, an empty root, no capabilities, rlimits and seccomp.
    #[default]
    Namespace,
    /// None of that: the daemon keeps every right it was started with.
    None,
}

/// What the backends in use need left to them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// The NVMe driver (VFIO). It maps each guest's memory into the IOMMU
    /// when the guest connects, with ioctls on the VFIO container, and the
    /// type1 IOMMU pins those pages against RLIMIT_MEMLOCK unless the
    /// caller has CAP_IPC_LOCK. And when it releases the device at
    /// shutdown, vfio-ioctls reads the device's `iommu_group` link in
    /// sysfs again (and panics if it cannot). So it keeps CAP_IPC_LOCK,
    /// the VFIO ioctls, a read-only /sys in the empty root, and readlink;
    /// nothing else is relaxed (no open: the filter still forbids it).
    pub vfio: bool,
    /// Ceph RBD (librados). It talks to the cluster's monitors and OSDs
    /// over TCP for as long as an image is open, and opens new
    /// connections when they move or restart. So it keeps the host's
    /// network namespace, and its threads may make TCP sockets (inet
    /// only), connect them and set their options. librados reads its conf
    /// and key before the sandbox (see `RbdPrepared`); files it would
    /// open later (OpenSSL's config, thread names in /proc) fail with
    /// EACCES rather than kill it, as the empty root holds nothing to
    /// open anyway.
    pub network: bool,
}

/// Open file descriptors allowed once sandboxed. A daemon's own needs are
/// tens per export (queues' eventfds, rings, guest memory regions); a
/// frontend that sends descriptors without end meets this bound.
pub const OPEN_FILES_MAX: u64 = 8192;

const CAP_IPC_LOCK: u32 = 14;

/// Enter the sandbox, all of it but the seccomp filter ([`confine`]):
/// namespaces, the empty root, limits, capabilities and no_new_privs.
/// Must run before any thread is started: a mount namespace cannot be
/// entered by a process with other threads. The network namespace is kept
/// when `needs.network`.
pub fn enter_namespaces(needs: Needs) -> anyhow::Result<()> {
    ensure_single_threaded()?;
    let mut namespaces = libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
    if !needs.network {
        namespaces |= libc::CLONE_NEWNET;
    }
    // SAFETY: unshare takes flags only.
    check(unsafe { libc::unshare(namespaces) }).context("unsharing the mount, ipc, uts and network namespaces")?;
    let name = b"keelfsd";
    // SAFETY: a buffer of the given length that outlives the call.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).context("naming the uts namespace")?;
    settle_malloc_arena_limit()?;
    pivot_into_empty_root(needs)?;
    limit_resources()?;
    drop_capabilities(if needs.vfio { &[CAP_IPC_LOCK] } else { &[] })?;
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }).context("setting no_new_privs")?;
    Ok(())
}

/// glibc computes its limit on malloc arenas the first time a thread
/// needs a ninth, from /sys/devices/system/cpu/online: a file open, which
/// the filter answers by killing the server (a fresh RPC client thread
/// beside a loaded reactor and its vring workers did). Settled here, while
/// files can be read, at glibc's own default: eight per CPU.
fn settle_malloc_arena_limit() -> anyhow::Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let arenas = libc::c_int::try_from(cpus.saturating_mul(8)).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt takes two integers; glibc's malloc is not yet shared
    // with another thread (enter_namespaces checked that none runs).
    if unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) } != 1 {
        bail!("mallopt(M_ARENA_MAX, {arenas}) failed");
    }
    Ok(())
}

/// The seccomp filter, on every thread (librados's too, when they run;
/// threads started later inherit it). After [`enter_namespaces`].
pub fn confine(needs: Needs, action: seccomp::Action) -> anyhow::Result<()> {
    seccomp::install(needs, action)?;
    let network = if needs.network { ", the host's network kept for Ceph" } else { "" };
    tracing::info!("sandboxed: namespaces, empty root, no capabilities, seccomp ({action:?} on violation){network}");
    Ok(())
}

/// The number of threads of this process, from /proc (before the sandbox
/// hides it).
pub fn ensure_single_threaded() -> anyhow::Result<()> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let threads = status.lines().find_map(|l| l.strip_prefix("Threads:")).map(|n| n.trim().parse::<u32>());
    match threads {
        Some(Ok(1)) => Ok(()),
        Some(Ok(n)) => bail!("the sandbox must be entered before threads start, and {n} run"),
        _ => bail!("/proc/self/status has no thread count"),
    }
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn mount(source: &str, target: &str, fstype: Option<&str>, flags: libc::c_ulong, data: &str) -> io::Result<()> {
    let c = |s: &str| CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
    let (source, target, data) = (c(source)?, c(target)?, c(data)?);
    let fstype = fstype.map(c).transpose()?;
    let fstype_ptr = fstype.as_ref().map_or(std::ptr::null(), |f| f.as_ptr());
    // SAFETY: NUL-terminated strings (or null for the type) that outlive
    // the call; mount(2) copies them.
    check(unsafe { libc::mount(source.as_ptr(), target.as_ptr(), fstype_ptr, flags, data.as_ptr().cast()) })
}

/// Make the root an empty read-only tmpfs. The old root, and with it every
/// host mount, is detached from this namespace; the host is untouched.
/// VFIO keeps a read-only view of /sys (see [`Needs::vfio`]).
fn pivot_into_empty_root(needs: Needs) -> anyhow::Result<()> {
    // Nothing done here propagates back to the host's mounts.
    mount("none", "/", None, libc::MS_REC | libc::MS_PRIVATE, "").context("making / private")?;
    // Any existing directory serves as the mount point; /tmp is on every
    // system, and the mount is seen only in this namespace.
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount("keelfs-sandbox", "/tmp", Some("tmpfs"), flags, "size=16k,nr_inodes=4,mode=0555")
        .context("mounting the empty root")?;
    if needs.vfio {
        std::fs::create_dir("/tmp/sys").context("creating /sys in the empty root")?;
        mount("/sys", "/tmp/sys", None, libc::MS_BIND, "").context("binding /sys into the empty root")?;
        let read_only = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | flags;
        mount("none", "/tmp/sys", None, read_only, "").context("making /sys read-only")?;
    }
    std::env::set_current_dir("/tmp").context("entering the empty root")?;
    let dot = CString::new(".").expect("no NUL");
    // pivot_root(".", ".") stacks the old root on the new one; unmounting
    // "." then takes the old root away (pivot_root(2), NOTES).
    // SAFETY: NUL-terminated paths that outlive the call.
    match check(unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) as libc::c_int }) {
        Ok(()) => {
            // SAFETY: as above.
            check(unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) }).context("detaching the old root")?;
        }
        // The root is the initial ramfs (a guest booted from an initramfs,
        // as the NVMe guest test is), which cannot be pivoted away from.
        // Move the new root over it and chroot instead, as switch_root
        // does: the ramfs stays beneath, out of reach of a process without
        // CAP_SYS_CHROOT (dropped below) and without open(2) (seccomp).
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            mount(".", "/", None, libc::MS_MOVE, "").context("moving the empty root over the initial ramfs")?;
            // SAFETY: as above.
            check(unsafe { libc::chroot(dot.as_ptr()) }).context("chroot into the empty root")?;
        }
        Err(e) => return Err(e).context("pivot_root into the empty root"),
    }
    std::env::set_current_dir("/").context("entering /")?;
    mount("none", "/", None, libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | flags, "")
        .context("making the root read-only")?;
    Ok(())
}

fn set_limit(resource: libc::__rlimit_resource_t, value: u64) -> io::Result<()> {
    let limit = libc::rlimit { rlim_cur: value, rlim_max: value };
    // SAFETY: a valid rlimit that outlives the call.
    check(unsafe { libc::setrlimit(resource, &limit) })
}

/// A zero core limit and no dumping (a core would hold guest memory), and
/// at most [`OPEN_FILES_MAX`] descriptors: process-wide, so it also holds
/// for a daemon that cannot enter the sandbox (an RBD export's).
pub fn limit_resources() -> anyhow::Result<()> {
    // A core dump would write out guest memory.
    set_limit(libc::RLIMIT_CORE, 0).context("RLIMIT_CORE")?;
    // SAFETY: prctl with integer arguments only. Not dumpable: no core, and
    // no ptrace or /proc access by other unprivileged processes.
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }).context("PR_SET_DUMPABLE")?;
    let mut now = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: an rlimit for the kernel to fill.
    check(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) }).context("reading RLIMIT_NOFILE")?;
    set_limit(libc::RLIMIT_NOFILE, OPEN_FILES_MAX.min(now.rlim_max)).context("RLIMIT_NOFILE")?;
    // RLIMIT_NPROC is left alone: it counts every process of the user
    // (root), not this daemon's, and the seccomp filter already refuses
    // new processes. RLIMIT_AS cannot bound anything useful: guest memory
    // is mapped in.
    Ok(())
}

/// linux/capability.h, version 3: two 32-bit words per set.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAPABILITY_VERSION_3: u32 = 0x2008_0522;
const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;
const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;
const SECBIT_KEEP_CAPS_LOCKED: libc::c_ulong = 1 << 5;
const CAPABILITIES_MAX: u32 = 64;

/// Drop every capability but `keep`, from every set and the bounding set,
/// and lock the securebits so that uid 0 gains none back.
fn drop_capabilities(keep: &[u32]) -> anyhow::Result<()> {
    for cap in 0..CAPABILITIES_MAX {
        if keep.contains(&cap) {
            continue;
        }
        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
            // EINVAL: past the last capability this kernel knows.
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                break;
            }
            return Err(e).with_context(|| format!("dropping capability {cap} from the bounding set"));
        }
    }
    let bits = SECBIT_NOROOT
        | SECBIT_NOROOT_LOCKED
        | SECBIT_NO_SETUID_FIXUP
        | SECBIT_NO_SETUID_FIXUP_LOCKED
        | SECBIT_KEEP_CAPS_LOCKED;
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_SECUREBITS, bits, 0, 0, 0) }).context("locking the securebits")?;
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) })
        .context("clearing the ambient capabilities")?;
    let mut data = [CapData::default(); 2];
    for &cap in keep {
        let word = &mut data[(cap / 32) as usize];
        word.effective |= 1 << (cap % 32);
        word.permitted |= 1 << (cap % 32);
    }
    let header = CapHeader { version: CAPABILITY_VERSION_3, pid: 0 };
    // SAFETY: a version-3 header and the two data words it calls for, both
    // alive for the call.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr()) };
    check(rc as libc::c_int).context("capset")?;
    Ok(())
}
