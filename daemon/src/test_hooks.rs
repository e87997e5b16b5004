//! Hooks for keelfsd's own tests, read from the environment. Only a build
//! with the `test-utils` feature has this module (the daemon's tests turn
//! it on through a dev-dependency on the package itself); the release
//! binary never reads these variables, so whoever can set its environment
//! cannot weaken its seccomp filter (issue 32).
//! scripts/check-release-symbols.sh finds this module by its cfg and
//! checks that neither its code nor its variable names are in the release
//! binary.

use crate::seccomp::Action;

/// With this variable set, `serve` makes one forbidden system call once it
/// is ready: the test that the filter kills the daemon uses it.
const PROBE_ENV: &str = "KEELFS_TEST_FORBIDDEN_SYSCALL";

/// `KEELFS_SECCOMP=log`: the kernel logs a forbidden call (dmesg: `type=1326
/// ... syscall=N`) instead of killing the daemon. A developer's aid for
/// finding what a new code path calls, in a `--features test-utils` build.
const ACTION_ENV: &str = "KEELFS_SECCOMP";

/// What a forbidden system call does: kill, unless [`ACTION_ENV`] says log.
pub fn seccomp_action() -> Action {
    match std::env::var(ACTION_ENV).as_deref() {
        Ok("log") => Action::Log,
        _ => Action::Kill,
    }
}

/// `KEELFS_TEST_FUSE_URING_PARAMETER=PATH`: read PATH instead of the fuse
/// module's enable_uring, to play a kernel without FUSE over io_uring.
const FUSE_URING_PARAMETER_ENV: &str = "KEELFS_TEST_FUSE_URING_PARAMETER";

/// The kernel's switch for FUSE over io_uring, or the test's stand-in.
pub fn fuse_uring_parameter() -> std::path::PathBuf {
    std::env::var_os(FUSE_URING_PARAMETER_ENV).map_or_else(|| keelfs_vhost::FUSE_URING_PARAMETER.into(), Into::into)
}

/// With this variable set to N, `serve` starts N threads at once once it
/// is ready, each allocating before any ends: what a loaded daemon does
/// (a vring worker per queue, a thread per RPC client). glibc gives each
/// its own malloc arena up to a limit it computes, on first need, by
/// reading /sys/devices/system/cpu/online: the sandbox must have settled
/// that limit before it took file opens away.
const ALLOCATING_THREADS_ENV: &str = "KEELFS_TEST_ALLOCATING_THREADS";

/// With this variable set to N, `serve` waits N ms as its shutdown begins,
/// before it asks the reactors to stop: a signal sent meanwhile is read by
/// the shutdown, as one that races a slow shutdown is.
const SHUTDOWN_PAUSE_ENV: &str = "KEELFS_TEST_SHUTDOWN_PAUSE_MS";

/// Called as the shutdown begins: waits as [`SHUTDOWN_PAUSE_ENV`] says.
pub fn as_shutdown_begins() {
    if let Some(ms) = std::env::var(SHUTDOWN_PAUSE_ENV).ok().and_then(|v| v.parse::<u64>().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Called once the daemon is ready: with [`PROBE_ENV`] set, make a call
/// the sandbox forbids (the filter kills the process; unsandboxed, it
/// just works or fails). `unix-socket` makes a unix socket, which even an
/// RBD daemon's filter forbids (its file opens fail with EACCES instead);
/// any other value opens a file.
pub fn after_ready() {
    if let Some(count) = std::env::var(ALLOCATING_THREADS_ENV).ok().and_then(|n| n.parse::<usize>().ok()) {
        start_allocating_threads(count);
    }
    let Some(probe) = std::env::var_os(PROBE_ENV) else {
        return;
    };
    if probe == "unix-socket" {
        eprintln!("keelfsd: {PROBE_ENV} is set: making a unix socket, which the sandbox forbids");
        let made = std::os::unix::net::UnixDatagram::unbound();
        eprintln!("keelfsd: the forbidden socket call returned {:?}", made.map(drop));
        return;
    }
    eprintln!("keelfsd: {PROBE_ENV} is set: opening /etc/hostname, which the sandbox forbids");
    let opened = std::fs::File::open("/etc/hostname");
    eprintln!("keelfsd: the forbidden open returned {:?}", opened.map(drop));
}

/// [`ALLOCATING_THREADS_ENV`]: `count` threads, each holding an allocation
/// until all have made theirs, so that none can reuse another's arena.
fn start_allocating_threads(count: usize) {
    let all_allocated = std::sync::Arc::new(std::sync::Barrier::new(count));
    let threads: Vec<_> = (0..count)
        .map(|i| {
            let all_allocated = all_allocated.clone();
            std::thread::spawn(move || {
                let held = std::hint::black_box(vec![i as u8; 4096]);
                all_allocated.wait();
                held.len()
            })
        })
        .collect();
    let allocated: usize = threads.into_iter().map(|t| t.join().expect("an allocating thread")).sum();
    eprintln!("keelfsd: {count} threads allocated {allocated} bytes at once");
}
