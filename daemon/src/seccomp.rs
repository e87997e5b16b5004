//! The system calls the sandboxed daemon may make, as a seccomp filter
//! built with rust-vmm's seccompiler. Anything else kills the process.
//!
//! The list is what serving takes once every file is open: memory,
//! threads, polling, the vhost-user socket (accept and messages with
//! descriptors), guest memory mappings, the device (io_uring, or reads,
//! writes and syncs for pmem), /dev/fuse reads and writes, and time. No
//! open, no exec, no new sockets, no new processes: clone is allowed for
//! threads only. io_uring operations are not system calls and bypass this
//! filter; each ring is restricted to its opcodes instead (see the uring
//! backend).

use std::collections::BTreeMap;

use anyhow::Context;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

use crate::sandbox::Needs;

/// What a forbidden system call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Kill the process (always, in the release binary).
    Kill,
    /// Allow it and have the kernel log it: a developer's aid, which only
    /// a build with the `test-utils` feature can choose (test_hooks.rs).
    #[cfg_attr(not(feature = "test-utils"), allow(dead_code))]
    Log,
}

/// Allowed whatever their arguments.
#[rustfmt::skip]
const ALWAYS: &[libc::c_long] = &[
    // memory
    libc::SYS_brk, libc::SYS_mmap, libc::SYS_munmap, libc::SYS_mremap, libc::SYS_mprotect, libc::SYS_madvise,
    // threads and their signals
    libc::SYS_futex, libc::SYS_set_robust_list, libc::SYS_rseq, libc::SYS_gettid, libc::SYS_getpid,
    libc::SYS_sched_yield, libc::SYS_sched_getaffinity, libc::SYS_sched_setaffinity, libc::SYS_exit,
    libc::SYS_exit_group, libc::SYS_rt_sigprocmask, libc::SYS_rt_sigaction, libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack, libc::SYS_tgkill, libc::SYS_restart_syscall, libc::SYS_getrandom,
    // descriptors already open
    libc::SYS_read, libc::SYS_write, libc::SYS_readv, libc::SYS_writev, libc::SYS_pread64, libc::SYS_pwrite64,
    libc::SYS_preadv, libc::SYS_pwritev, libc::SYS_preadv2, libc::SYS_pwritev2, libc::SYS_close, libc::SYS_lseek,
    libc::SYS_fstat, libc::SYS_newfstatat, libc::SYS_statx, libc::SYS_fcntl, libc::SYS_fsync, libc::SYS_fdatasync,
    libc::SYS_fallocate, libc::SYS_msync, libc::SYS_ftruncate,
    // polling and waking
    libc::SYS_epoll_create1, libc::SYS_epoll_ctl, libc::SYS_epoll_pwait, libc::SYS_epoll_pwait2, libc::SYS_ppoll,
    libc::SYS_eventfd2,
    // the device
    libc::SYS_io_uring_setup, libc::SYS_io_uring_enter, libc::SYS_io_uring_register,
    // sockets already bound: vhost-user and RPC connections
    libc::SYS_accept4, libc::SYS_recvmsg, libc::SYS_sendmsg, libc::SYS_recvfrom, libc::SYS_sendto,
    libc::SYS_shutdown, libc::SYS_getsockopt,
    // time
    libc::SYS_clock_gettime, libc::SYS_clock_getres, libc::SYS_clock_nanosleep, libc::SYS_gettimeofday,
    libc::SYS_getrusage,
];

/// The x86_64 names of calls that newer architectures only have in their
/// generic forms (listed above).
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
const ALWAYS_LEGACY: &[libc::c_long] = &[
    libc::SYS_epoll_wait, libc::SYS_poll, libc::SYS_accept, libc::SYS_nanosleep, libc::SYS_time,
];
#[cfg(not(target_arch = "x86_64"))]
const ALWAYS_LEGACY: &[libc::c_long] = &[];

/// asm-generic/socket.h: the 64-bit-time forms glibc may use.
const SO_RCVTIMEO_NEW: libc::c_int = 66;
const SO_SNDTIMEO_NEW: libc::c_int = 67;

fn arg_eq(index: u8, value: u64) -> SeccompCondition {
    SeccompCondition::new(index, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value).expect("a valid condition")
}

fn rule(conditions: Vec<SeccompCondition>) -> SeccompRule {
    SeccompRule::new(conditions).expect("a valid rule")
}

/// The allowlist for `needs`, as rules by system call number.
fn rules(needs: Needs) -> BTreeMap<i64, Vec<SeccompRule>> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALWAYS.iter().chain(ALWAYS_LEGACY).map(|&nr| (nr, Vec::new())).collect();
    // Threads, never processes: CLONE_THREAD must be set.
    let thread = libc::CLONE_THREAD as u64;
    let clone_thread = SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(thread), thread)
        .expect("a valid condition");
    rules.insert(libc::SYS_clone, vec![rule(vec![clone_thread])]);
    // clone3 passes its flags in memory a filter cannot read: refused with
    // ENOSYS by the second filter (see install), glibc falls back to clone.
    rules.insert(libc::SYS_clone3, Vec::new());
    // Timeouts on accepted RPC connections, and nothing else.
    let timeouts = [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO, SO_RCVTIMEO_NEW, SO_SNDTIMEO_NEW];
    let setsockopt =
        timeouts.iter().map(|&opt| rule(vec![arg_eq(1, libc::SOL_SOCKET as u64), arg_eq(2, opt as u64)])).collect();
    rules.insert(libc::SYS_setsockopt, setsockopt);
    // Thread names.
    rules.insert(libc::SYS_prctl, vec![rule(vec![arg_eq(0, libc::PR_SET_NAME as u64)])]);
    // std's set_nonblocking on a socket.
    // FIONBIO's type differs between libcs.
    #[allow(clippy::unnecessary_cast)]
    let mut ioctls = vec![rule(vec![arg_eq(1, libc::FIONBIO as u64)])];
    if needs.vfio {
        // VFIO's requests are _IO(';', 100 + n): type ';' in bits 8..16.
        let vfio = SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(0xff00), 0x3b00)
            .expect("a valid condition");
        ioctls.push(rule(vec![vfio]));
        // vfio-ioctls reads the device's iommu_group link when it lets
        // the device go (a read-only /sys is in the sandbox's root for it).
        rules.insert(libc::SYS_readlinkat, Vec::new());
        #[cfg(target_arch = "x86_64")]
        rules.insert(libc::SYS_readlink, Vec::new());
    }
    rules.insert(libc::SYS_ioctl, ioctls);
    if needs.network {
        add_network_rules(&mut rules);
    }
    rules
}

/// What librados's messenger threads need (see [`Needs::network`]): TCP
/// sockets, inet only, connected and tuned; the pipes and epoll sets of
/// its event loops; uname for its entity address. Opening a file is
/// allowed here and refused with EACCES by the first filter (see
/// [`programs`]).
fn add_network_rules(rules: &mut BTreeMap<i64, Vec<SeccompRule>>) {
    let inet = [libc::AF_INET, libc::AF_INET6].map(|family| rule(vec![arg_eq(0, family as u64)]));
    rules.insert(libc::SYS_socket, inet.to_vec());
    let levels = [libc::IPPROTO_TCP, libc::IPPROTO_IP, libc::IPPROTO_IPV6];
    let setsockopt = rules.entry(libc::SYS_setsockopt).or_default();
    setsockopt.extend(levels.map(|level| rule(vec![arg_eq(1, level as u64)])));
    let buffers = [libc::SO_RCVBUF, libc::SO_SNDBUF, libc::SO_KEEPALIVE, libc::SO_PRIORITY, libc::SO_REUSEADDR];
    setsockopt.extend(buffers.map(|opt| rule(vec![arg_eq(1, libc::SOL_SOCKET as u64), arg_eq(2, opt as u64)])));
    for nr in FILE_OPENS.iter().chain(NETWORK_ALWAYS) {
        rules.insert(*nr, Vec::new());
    }
}

/// Calls librados makes whatever their arguments (see [`add_network_rules`]).
#[rustfmt::skip]
const NETWORK_ALWAYS: &[libc::c_long] = &[
    libc::SYS_connect, libc::SYS_getsockname, libc::SYS_getpeername, libc::SYS_pipe2, libc::SYS_uname,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_epoll_create,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_pipe,
];

/// The calls that open a file by name.
#[rustfmt::skip]
const FILE_OPENS: &[libc::c_long] = &[
    libc::SYS_openat, libc::SYS_openat2,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_open,
];

fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>, mismatch: SeccompAction, on_match: SeccompAction) -> BpfProgram {
    let arch = std::env::consts::ARCH.try_into().expect("seccompiler supports this architecture");
    let filter = SeccompFilter::new(rules, mismatch, on_match, arch).expect("a valid filter");
    filter.try_into().expect("the filter compiles")
}

/// The filters that turn clone3 into ENOSYS and (for [`Needs::network`])
/// opening a file into EACCES, then the allowlist: in that order, since
/// the allowlist forbids seccomp(2) itself. The kernel takes the most
/// severe answer of all filters, so a call the first ones refuse with an
/// errno never reaches the allowlist's.
pub fn programs(needs: Needs, action: Action) -> Vec<BpfProgram> {
    let mismatch = match action {
        Action::Kill => SeccompAction::KillProcess,
        Action::Log => SeccompAction::Log,
    };
    let refuse = |calls: &[libc::c_long], errno: i32| {
        let calls = calls.iter().map(|&nr| (nr, Vec::new())).collect();
        compile(calls, SeccompAction::Allow, SeccompAction::Errno(errno as u32))
    };
    let mut programs = vec![refuse(&[libc::SYS_clone3], libc::ENOSYS)];
    if needs.network {
        programs.push(refuse(FILE_OPENS, libc::EACCES));
    }
    programs.push(compile(rules(needs), mismatch, SeccompAction::Allow));
    programs
}

/// Install the filters on every thread of the process. Needs
/// no_new_privs (or CAP_SYS_ADMIN).
pub fn install(needs: Needs, action: Action) -> anyhow::Result<()> {
    for program in programs(needs, action) {
        seccompiler::apply_filter_all_threads(&program).context("installing the seccomp filter")?;
    }
    Ok(())
}

/// What the supervisor may call, whatever the arguments: it keeps the
/// rights to open images and bind sockets (the broker), to unmount the
/// server's host mounts and remove its sockets, and to wait for its
/// child. What it never needs, it loses: exec, new processes, mounts,
/// namespaces, identity changes, module loading, tracing, io_uring.
/// Found with strace over a serve with a host mount, export_add and
/// export_remove, then SIGTERM (`supervisor_syscalls` in the tests
/// checks the list stays what the broker needs).
#[rustfmt::skip]
const SUPERVISOR_ALWAYS: &[libc::c_long] = &[
    // memory, signals, exit
    libc::SYS_brk, libc::SYS_mmap, libc::SYS_munmap, libc::SYS_mremap, libc::SYS_mprotect, libc::SYS_madvise,
    libc::SYS_futex, libc::SYS_rt_sigprocmask, libc::SYS_rt_sigaction, libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack, libc::SYS_restart_syscall, libc::SYS_exit, libc::SYS_exit_group, libc::SYS_getpid,
    libc::SYS_gettid, libc::SYS_getrandom, libc::SYS_clock_gettime, libc::SYS_clock_nanosleep,
    // descriptors: the link, the signalfd, images, mountinfo, sysfs
    libc::SYS_read, libc::SYS_write, libc::SYS_readv, libc::SYS_writev, libc::SYS_pread64, libc::SYS_close,
    libc::SYS_lseek, libc::SYS_fstat, libc::SYS_newfstatat, libc::SYS_statx, libc::SYS_fstatfs, libc::SYS_statfs,
    libc::SYS_fcntl, libc::SYS_openat, libc::SYS_openat2, libc::SYS_readlinkat, libc::SYS_getdents64,
    libc::SYS_getcwd, libc::SYS_ppoll, libc::SYS_pidfd_open, libc::SYS_wait4, libc::SYS_waitid,
    // sockets: the link, binding an export's socket, probing a stale one
    libc::SYS_connect, libc::SYS_bind, libc::SYS_listen, libc::SYS_sendto, libc::SYS_sendmsg,
    libc::SYS_recvfrom, libc::SYS_recvmsg, libc::SYS_getsockopt, libc::SYS_shutdown,
    // an export's socket staged, owned and renamed into place; stale ones removed
    libc::SYS_unlinkat, libc::SYS_mkdirat, libc::SYS_renameat2, libc::SYS_fchmodat, libc::SYS_fchmod,
    libc::SYS_fchownat, libc::SYS_fchown,
    // the server's host mounts, taken down
    libc::SYS_umount2,
];

#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
const SUPERVISOR_LEGACY: &[libc::c_long] = &[
    libc::SYS_poll, libc::SYS_open, libc::SYS_stat, libc::SYS_lstat, libc::SYS_readlink, libc::SYS_unlink,
    libc::SYS_mkdir, libc::SYS_rmdir, libc::SYS_rename, libc::SYS_chmod, libc::SYS_chown, libc::SYS_lchown,
    libc::SYS_nanosleep,
];
#[cfg(not(target_arch = "x86_64"))]
const SUPERVISOR_LEGACY: &[libc::c_long] = &[];

/// linux/fs.h: the block-device geometry the broker probes.
const BLKSSZGET: u64 = 0x1268;
const BLKGETSIZE64: u64 = 0x8008_1272;

/// The supervisor's allowlist, for a supervisor of `child`.
fn supervisor_rules(child: libc::pid_t) -> BTreeMap<i64, Vec<SeccompRule>> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        SUPERVISOR_ALWAYS.iter().chain(SUPERVISOR_LEGACY).map(|&nr| (nr, Vec::new())).collect();
    // Unix sockets only.
    rules.insert(libc::SYS_socket, vec![rule(vec![arg_eq(0, libc::AF_UNIX as u64)])]);
    // Signals to its own child only (the forwarded SIGTERM).
    rules.insert(libc::SYS_kill, vec![rule(vec![arg_eq(0, child as u32 as u64)])]);
    let timeouts = [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO, SO_RCVTIMEO_NEW, SO_SNDTIMEO_NEW];
    let setsockopt =
        timeouts.iter().map(|&opt| rule(vec![arg_eq(1, libc::SOL_SOCKET as u64), arg_eq(2, opt as u64)])).collect();
    rules.insert(libc::SYS_setsockopt, setsockopt);
    // FIONBIO's type differs between libcs.
    #[allow(clippy::unnecessary_cast)]
    let ioctls = [libc::FIONBIO as u64, BLKSSZGET, BLKGETSIZE64].map(|request| rule(vec![arg_eq(1, request)]));
    rules.insert(libc::SYS_ioctl, ioctls.to_vec());
    rules
}

/// Confine the supervisor of `child` (issue 36): no new privileges, and
/// the allowlist above. It must run single-threaded, as it does after the
/// fork. A forbidden call kills it, and with it the server (its
/// PR_SET_PDEATHSIG).
pub fn install_supervisor(child: libc::pid_t, action: Action) -> anyhow::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error()).context("PR_SET_NO_NEW_PRIVS for the supervisor");
    }
    let mismatch = match action {
        Action::Kill => SeccompAction::KillProcess,
        Action::Log => SeccompAction::Log,
    };
    let program = compile(supervisor_rules(child), mismatch, SeccompAction::Allow);
    seccompiler::apply_filter_all_threads(&program).context("installing the supervisor's seccomp filter")
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, ExitStatus};

    use super::*;

    /// Set in the re-executed test binary: the call to make under the filter.
    const CHILD_ENV: &str = "KEELFS_SECCOMP_TEST_CALL";

    /// Under the supervisor's filter: what the broker does works, then
    /// `call`.
    fn as_supervisor(call: &str) -> ! {
        // SAFETY: getppid takes nothing; the parent is a process we may
        // not signal, but the filter is only asked whether kill may go.
        let child = unsafe { libc::getppid() };
        install_supervisor(child, Action::Kill).unwrap();
        let dir = std::env::temp_dir().join(format!("keelfs-supervisor-seccomp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("image"), b"x").unwrap();
        drop(std::fs::File::options().read(true).write(true).open(dir.join("image")).unwrap());
        let listener = std::os::unix::net::UnixListener::bind(dir.join("sock")).unwrap();
        drop(std::os::unix::net::UnixStream::connect(dir.join("sock")).unwrap());
        drop(listener);
        std::fs::remove_dir_all(&dir).unwrap();
        match call {
            // SAFETY: a fork that the filter must stop.
            "fork" => unsafe {
                if libc::fork() == 0 {
                    libc::_exit(0);
                }
            },
            "exec" => drop(std::process::Command::new("/bin/true").status()),
            // SAFETY: an inet socket, which the filter must stop.
            "inet" => unsafe {
                libc::close(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0));
            },
            // SAFETY: kill of pid 1 with signal 0, which the filter must stop.
            "kill-other" => unsafe {
                libc::kill(1, 0);
            },
            _ => {}
        }
        std::process::exit(0)
    }

    /// Under the filter: threads still start and work, then `call`.
    fn as_child(call: &str) -> ! {
        if let Some(call) = call.strip_prefix("supervisor-") {
            as_supervisor(call);
        }
        let (needs, call) = match call.strip_prefix("network-") {
            Some(call) => (Needs { network: true, ..Needs::default() }, call),
            None => (Needs::default(), call),
        };
        // SAFETY: prctl with integer arguments only.
        assert_eq!(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }, 0);
        install(needs, Action::Kill).unwrap();
        let worker = std::thread::spawn(|| (0..1000u64).map(|i| vec![i; 100].iter().sum::<u64>()).sum::<u64>());
        assert!(worker.join().unwrap() > 0);
        match call {
            "open" => drop(std::fs::File::open("/etc/hostname")),
            // SAFETY: socket(2) with integer arguments; the result is closed.
            "socket" => unsafe {
                libc::close(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0));
            },
            // What librados does: an inet socket, its buffers, a pipe.
            "inet" => {
                // SAFETY: socket(2) and setsockopt(2) on the socket made
                // here, with a value that outlives the call; closed after.
                unsafe {
                    let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                    assert!(fd >= 0);
                    let one: libc::c_int = 1;
                    let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                    let rc = libc::setsockopt(
                        fd,
                        libc::IPPROTO_TCP,
                        libc::TCP_NODELAY,
                        (&one as *const libc::c_int).cast(),
                        len,
                    );
                    assert_eq!(rc, 0);
                    libc::close(fd);
                }
                let mut fds = [0; 2];
                // SAFETY: pipe2 writes two descriptors into the array.
                assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
            }
            // Refused, not killed.
            "open-refused" => {
                let e = std::fs::File::open("/etc/hostname").unwrap_err();
                assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}");
            }
            // SAFETY: socket(2) with integer arguments; the result is closed.
            "unix" => unsafe {
                libc::close(libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0));
            },
            // SAFETY: a fork that the filter must stop; a child, if any,
            // exits at once.
            "fork" => unsafe {
                if libc::fork() == 0 {
                    libc::_exit(0);
                }
            },
            _ => {}
        }
        std::process::exit(0)
    }

    /// Run this test binary's `test` again, as a child making `call`.
    fn child(test: &str, call: &str) -> ExitStatus {
        if let Ok(call) = std::env::var(CHILD_ENV) {
            as_child(&call);
        }
        let exe = std::env::current_exe().unwrap();
        let out = Command::new(exe)
            .args([test, "--exact", "--test-threads=1", "--nocapture"])
            .env(CHILD_ENV, call)
            .output()
            .unwrap();
        out.status
    }

    #[test]
    fn both_filters_compile_for_every_backend() {
        for (vfio, network) in [(false, false), (true, false), (false, true)] {
            for program in programs(Needs { vfio, network }, Action::Kill) {
                assert!(!program.is_empty());
            }
        }
    }

    #[test]
    fn threads_work_under_the_filter() {
        let status = child("seccomp::tests::threads_work_under_the_filter", "nothing");
        assert!(status.success(), "{status:?}");
    }

    #[test]
    fn opening_a_file_is_killed() {
        let status = child("seccomp::tests::opening_a_file_is_killed", "open");
        assert_eq!(status.signal(), Some(libc::SIGSYS), "{status:?}");
    }

    #[test]
    fn a_new_socket_is_killed() {
        let status = child("seccomp::tests::a_new_socket_is_killed", "socket");
        assert_eq!(status.signal(), Some(libc::SIGSYS), "{status:?}");
    }

    #[test]
    fn the_supervisor_brokers_but_cannot_exec_fork_or_reach_the_network() {
        let test = "seccomp::tests::the_supervisor_brokers_but_cannot_exec_fork_or_reach_the_network";
        assert!(child(test, "supervisor-nothing").success(), "the broker's calls are allowed");
        for call in ["fork", "exec", "inet", "kill-other"] {
            let status = child(test, &format!("supervisor-{call}"));
            assert_eq!(status.signal(), Some(libc::SIGSYS), "{call}: {status:?}");
        }
    }

    /// An RBD daemon's filter: TCP sockets and their options, pipes; a
    /// file open refused with EACCES; still no unix socket, no fork.
    #[test]
    fn librados_gets_tcp_and_an_open_is_refused_not_killed() {
        let test = "seccomp::tests::librados_gets_tcp_and_an_open_is_refused_not_killed";
        for call in ["inet", "open-refused"] {
            let status = child(test, &format!("network-{call}"));
            assert!(status.success(), "{call}: {status:?}");
        }
        for call in ["unix", "fork"] {
            let status = child(test, &format!("network-{call}"));
            assert_eq!(status.signal(), Some(libc::SIGSYS), "{call}: {status:?}");
        }
    }

    #[test]
    fn a_new_process_is_killed() {
        let status = child("seccomp::tests::a_new_process_is_killed", "fork");
        assert_eq!(status.signal(), Some(libc::SIGSYS), "{status:?}");
    }
}
