//! SIGTERM and SIGINT, read on the main thread from a signalfd. The
//! signals are blocked in every thread (main blocks them before starting
//! any), so no handler runs asynchronously; the main thread turns the first
//! signal into shutdown messages for the reactors, and a second one into an
//! immediate exit.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// The signal by which the sandbox's supervisor passes a termination
/// signal on to the server it started. The server reads only this one:
/// `pkill keelfsd` or `killall keelfsd` signals both processes, and if the
/// server also acted on what it got directly, the forwarded copy would be
/// the "second signal" that forces an exit without a clean shutdown.
pub const FORWARDED: libc::c_int = libc::SIGUSR1;

fn signal_set(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &signal in signals {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// Block SIGTERM and SIGINT in the calling thread and every thread it
/// starts afterwards, and give them their default dispositions. Call first
/// thing in main.
///
/// A blocked signal waits for the signalfd whatever its disposition, but
/// keelfsd does not rely on that alone: a non-interactive shell starts its
/// background jobs with SIGINT ignored (issue 32), and an ignored signal
/// that reaches a thread without it blocked is dropped. The defaults also
/// reach the processes keelfsd starts (the embedded default's mkfs), so
/// ^C stops them. Blocked first, so the default action never runs here.
pub fn block_termination_signals() -> std::io::Result<()> {
    let set = signal_set(&[libc::SIGTERM, libc::SIGINT, FORWARDED]);
    // SAFETY: a valid, initialised signal set; no old mask requested.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: SIG_DFL for a catchable signal; no handler is installed.
        if unsafe { libc::signal(signal, libc::SIG_DFL) } == libc::SIG_ERR {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The termination signals as a file descriptor.
pub struct Signals {
    fd: OwnedFd,
}

impl Signals {
    /// SIGTERM and SIGINT.
    pub fn new() -> std::io::Result<Self> {
        Self::of(&[libc::SIGTERM, libc::SIGINT])
    }

    /// [`FORWARDED`] only: the sandboxed server's, whose supervisor
    /// passes each SIGTERM or SIGINT on.
    pub fn forwarded() -> std::io::Result<Self> {
        Self::of(&[FORWARDED])
    }

    fn of(signals: &[libc::c_int]) -> std::io::Result<Self> {
        let set = signal_set(signals);
        // SAFETY: a valid signal set; -1 asks for a new fd.
        let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the fd is new and owned by nobody else.
        Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    pub fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }

    /// Wait up to `timeout` (forever if None) for a signal; its number.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<i32> {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ready <= 0 {
            return None;
        }
        let mut info = [0u8; 128]; // sizeof(struct signalfd_siginfo)
                                   // SAFETY: reads at most 128 bytes into a live buffer.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), info.as_mut_ptr().cast(), info.len()) };
        (n == 128).then(|| i32::from_le_bytes(info[..4].try_into().expect("4 bytes")))
    }
}
