//! The operating-system calls the reactor needs: eventfds, epoll, CPU
//! pinning and per-thread CPU time. All of the reactor's `unsafe` is here.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is new and owned by nobody else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn signal(&self) {
        signal_eventfd(self.0.as_raw_fd());
    }

    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

pub fn signal_eventfd(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64. EAGAIN (counter saturated)
    // still leaves the fd readable, which is all a waker needs.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Reset an eventfd's counter; it is non-blocking, so this never waits.
pub fn drain_eventfd(fd: RawFd) {
    let mut value: u64 = 0;
    // SAFETY: reads at most 8 bytes into a live u64.
    unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
}

pub struct Epoll(OwnedFd);

/// Marks an epoll entry whose fd is an eventfd to reset after waking.
const DRAIN_BIT: u64 = 1 << 63;

impl Epoll {
    pub fn new() -> io::Result<Self> {
        // SAFETY: epoll_create1 takes no pointers.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is new and owned by nobody else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Watch `fd` for readability, edge-triggered: every signal after the
    /// last wait produces one wake-up. An eventfd (`drain`) has its counter
    /// reset after a wake-up; any other fd is left for its poller to read.
    pub fn add(&self, fd: RawFd, drain: bool) -> io::Result<()> {
        let data = fd as u64 | if drain { DRAIN_BIT } else { 0 };
        let mut event = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLET) as u32, u64: data };
        // SAFETY: event is a valid epoll_event for the duration of the call.
        if unsafe { libc::epoll_ctl(self.0.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Wait until a watched fd fires or `timeout` passes, and drain the
    /// eventfds that fired.
    pub fn wait(&self, timeout: Option<Duration>) {
        const EVENTS_MAX: usize = 16;
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; EVENTS_MAX];
        let ms = match timeout {
            None => -1,
            // Rounded up: a timer due in under a millisecond would
            // otherwise make the reactor spin through epoll_wait(0) until
            // it fires, taking the CPU from everything else on the host.
            Some(t) => t.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32,
        };
        // SAFETY: events is a live array of EVENTS_MAX entries.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), events.as_mut_ptr(), EVENTS_MAX as i32, ms) };
        for event in events.iter().take(n.max(0) as usize) {
            if event.u64 & DRAIN_BIT != 0 {
                drain_eventfd((event.u64 & !DRAIN_BIT) as RawFd);
            }
        }
    }
}

/// Pin the calling thread to one CPU.
/// The CPUs the calling thread may run on (at least one). A system call
/// only: sysconf and std's available_parallelism read /sys and /proc,
/// which a sandboxed daemon has neither of (and may not open).
pub fn cpus_allowed() -> u32 {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most
    // size_of::<cpu_set_t>() bytes into it, and CPU_COUNT only reads it.
    let count = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return 1;
        }
        libc::CPU_COUNT(&set)
    };
    u32::try_from(count).unwrap_or(1).max(1)
}

pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it; the
    // syscall reads size_of::<cpu_set_t>() bytes from it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// CPU time consumed by the calling thread.
pub fn thread_cpu_time() -> Duration {
    // SAFETY: timespec is plain data and a valid out-pointer.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
