//! The accept loop the RPC and metrics servers share: a thread that
//! accepts connections and serves each on a thread of its own, at most a
//! few at once, so that one stalled client holds up no one.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// A listening socket of either kind.
pub trait Listener: AsFd + Send + 'static {
    type Stream: Send + 'static;
    fn accept_one(&self) -> std::io::Result<Self::Stream>;
}

impl Listener for std::net::TcpListener {
    type Stream = std::net::TcpStream;
    fn accept_one(&self) -> std::io::Result<Self::Stream> {
        self.accept().map(|(stream, _)| stream)
    }
}

impl Listener for std::os::unix::net::UnixListener {
    type Stream = std::os::unix::net::UnixStream;
    fn accept_one(&self) -> std::io::Result<Self::Stream> {
        self.accept().map(|(stream, _)| stream)
    }
}

/// Serving until dropped.
pub struct AcceptLoop {
    /// The listener, to wake the accept with on drop.
    wake_accept: OwnedFd,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AcceptLoop {
    /// Accept on `listener` in a thread named `name`; serve each client
    /// with `serve` on a thread of its own, at most `clients_max` at once.
    /// A client past that is handed to `refuse` and closed.
    pub fn start<L: Listener>(
        name: &str,
        listener: L,
        clients_max: usize,
        refuse: fn(&L::Stream),
        serve: impl Fn(L::Stream) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let wake_accept = listener.as_fd().try_clone_to_owned()?;
        let stop = Arc::new(AtomicBool::new(false));
        let serve = Arc::new(serve);
        let stopped = stop.clone();
        let client_name = format!("{name}-client");
        let thread = std::thread::Builder::new().name(name.into()).spawn(move || {
            let busy = Arc::new(AtomicUsize::new(0));
            loop {
                let stream = listener.accept_one();
                if stopped.load(Ordering::Acquire) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                if busy.fetch_add(1, Ordering::AcqRel) >= clients_max {
                    busy.fetch_sub(1, Ordering::AcqRel);
                    refuse(&stream);
                    continue;
                }
                let (serve, done) = (serve.clone(), busy.clone());
                let spawned = std::thread::Builder::new().name(client_name.clone()).spawn(move || {
                    serve(stream);
                    done.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    // The closure (and its decrement) never ran.
                    busy.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })?;
        Ok(Self { wake_accept, stop, thread: Some(thread) })
    }
}

impl Drop for AcceptLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        keelfs_vhost::stop_accepting(&self.wake_accept);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
