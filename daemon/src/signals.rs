//! SIGTERM and SIGINT as a reactor event: the signals are blocked in every
//! thread and read from a signalfd that the reactor polls, so shutdown
//! runs as an ordinary task. A second signal forces the exit.

use std::cell::RefCell;
use std::future::poll_fn;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Instant;

use keelfs_core::reactor::{self, Poller, PollerClass};

#[derive(Default)]
struct State {
    received: u32,
    waker: Option<Waker>,
}

/// Resolves when SIGTERM or SIGINT arrives.
#[derive(Clone)]
pub struct Shutdown {
    state: Rc<RefCell<State>>,
}

fn signal_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        set
    }
}

/// Block SIGTERM and SIGINT in the calling thread and every thread it
/// starts afterwards. Call first thing in main.
pub fn block_termination_signals() -> std::io::Result<()> {
    let set = signal_set();
    // SAFETY: a valid, initialised signal set; no old mask requested.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

impl Shutdown {
    /// Register the signalfd poller on the current reactor.
    pub fn install() -> std::io::Result<Self> {
        let set = signal_set();
        // SAFETY: a valid signal set; -1 asks for a new fd.
        let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the fd is new and owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let state = Rc::new(RefCell::new(State::default()));
        reactor::register_poller(PollerClass::Source, Box::new(SignalPoller { fd, state: state.clone() }));
        Ok(Self { state })
    }

    pub async fn wait(&self) {
        poll_fn(|cx| {
            let mut s = self.state.borrow_mut();
            if s.received > 0 {
                Poll::Ready(())
            } else {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

struct SignalPoller {
    fd: OwnedFd,
    state: Rc<RefCell<State>>,
}

impl Poller for SignalPoller {
    fn poll(&mut self, _now: Instant) -> bool {
        let mut info = [0u8; 128]; // sizeof(struct signalfd_siginfo)
                                   // SAFETY: reads at most 128 bytes into a live buffer.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), info.as_mut_ptr().cast(), info.len()) };
        if n <= 0 {
            return false;
        }
        let mut s = self.state.borrow_mut();
        s.received += 1;
        if s.received > 1 {
            eprintln!("keelfsd: second signal, exiting without a clean shutdown");
            std::process::exit(1);
        }
        eprintln!("keelfsd: shutting down (a second signal forces the exit)");
        if let Some(w) = s.waker.take() {
            w.wake();
        }
        true
    }

    fn wake_fd(&self) -> Option<RawFd> {
        Some(self.fd.as_raw_fd())
    }

    fn wake_fd_is_eventfd(&self) -> bool {
        false
    }
}
