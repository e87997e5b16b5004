//! The stats RPC: a unix socket that answers `stats` with one JSON object.
//!
//! The RPC thread holds no filesystem state. It asks each reactor, through
//! its inbox, for a snapshot of its exports, and reads the reactors' own
//! counters (atomics) directly.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::Context;
use keelfs_reactor::ReactorHandle;
use keelfs_vhost::{bind_listener, SocketAccess};
use serde_json::{json, Value};

/// The longest request line a client may send ("stats" is 5 bytes).
const REQUEST_BYTES_MAX: usize = 4096;
/// How long a client may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Clients served at once; more wait in the listen backlog.
const CLIENTS_MAX: usize = 8;

/// How long a reactor may take to answer a snapshot request.
const REACTOR_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Bind the RPC socket: only this user may ask (0600), set before the
/// socket can accept; a live socket or anything not a socket at the path
/// is refused.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    bind_listener(path, SocketAccess::default()).context("the RPC socket")
}

pub struct RpcServer {
    /// The listening socket, to wake the accept with on drop.
    wake_accept: UnixListener,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RpcServer {
    /// Serve on `listener`, bound by [`bind`].
    pub fn start(listener: UnixListener, reactors: Vec<ReactorHandle>) -> anyhow::Result<Self> {
        let wake_accept = listener.try_clone().context("duplicating the RPC socket")?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            let reactors = Arc::new(reactors);
            std::thread::Builder::new().name("keelfsd-rpc".into()).spawn(move || {
                // Each client on its own thread, at most CLIENTS_MAX at once,
                // so that one slow client does not hold up the others.
                let busy = Arc::new(AtomicUsize::new(0));
                for stream in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    if busy.fetch_add(1, Ordering::AcqRel) >= CLIENTS_MAX {
                        busy.fetch_sub(1, Ordering::AcqRel);
                        let mut out = &stream;
                        let _ = writeln!(out, "{}", json!({"error": "too many RPC clients at once; try again"}));
                        continue;
                    }
                    let (reactors, done) = (reactors.clone(), busy.clone());
                    let spawned = std::thread::Builder::new().name("keelfsd-rpc-client".into()).spawn(move || {
                        let _ = answer(stream, &reactors);
                        done.fetch_sub(1, Ordering::AcqRel);
                    });
                    if spawned.is_err() {
                        // The closure (and its decrement) never ran.
                        busy.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })?
        };
        Ok(Self { wake_accept, stop, thread: Some(thread) })
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        keelfs_vhost::stop_accepting(&self.wake_accept);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // The path is removed by whoever bound it (serve, or its
        // supervisor): this thread may not see it.
    }
}

fn answer(stream: UnixStream, reactors: &[ReactorHandle]) -> std::io::Result<()> {
    // A request is one short line, sent within REQUEST_TIMEOUT in all: a
    // client that trickles bytes or never sends a newline is cut off.
    let deadline = std::time::Instant::now() + REQUEST_TIMEOUT;
    let mut line = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let n = (&stream).read(&mut buf)?;
        line.extend_from_slice(&buf[..n]);
        if let Some(end) = line.iter().position(|&b| b == b'\n') {
            line.truncate(end);
            break;
        }
        if n == 0 {
            break;
        }
        if line.len() > REQUEST_BYTES_MAX {
            let mut out = &stream;
            return writeln!(out, "{}", json!({"error": format!("request longer than {REQUEST_BYTES_MAX} bytes")}));
        }
    }
    let line = String::from_utf8_lossy(&line);
    let reply = match line.trim() {
        "stats" | "" => snapshot(reactors),
        other => json!({"error": format!("unknown request {other:?}; the one request is \"stats\"")}),
    };
    let mut out = &stream;
    writeln!(out, "{reply}")
}

fn snapshot(reactors: &[ReactorHandle]) -> Value {
    let mut reactor_lines = Vec::new();
    let mut exports = Vec::new();
    for handle in reactors {
        let (tx, rx) = mpsc::channel();
        let asked = handle.send(move || {
            let _ = tx.send(crate::serve::local_stats());
        });
        let local = if asked.is_ok() { rx.recv_timeout(REACTOR_ANSWER_TIMEOUT).ok() } else { None };
        let s = handle.stats();
        let busy_ns = s.busy_ns.load(Ordering::Relaxed);
        let loop_ns = s.loop_ns.load(Ordering::Relaxed).max(1);
        let mut requests = 0;
        for export in local.iter().flatten() {
            let mut e = export.clone();
            e["reactor"] = json!(handle.id());
            requests += e["ops"].as_object().map_or(0, |ops| ops.values().filter_map(|o| o["requests"].as_u64()).sum());
            exports.push(e);
        }
        reactor_lines.push(json!({
            "id": handle.id(),
            "answered": local.is_some(),
            "busy_share": busy_ns as f64 / loop_ns as f64,
            "ticks": s.ticks.load(Ordering::Relaxed),
            "busy_ticks": s.busy_ticks.load(Ordering::Relaxed),
            "sleeps": s.sleeps.load(Ordering::Relaxed),
            "messages": s.messages.load(Ordering::Relaxed),
            "task_polls": s.task_polls.load(Ordering::Relaxed),
            "virtio_fs_requests": requests,
        }));
    }
    json!({"reactors": reactor_lines, "exports": exports})
}

/// `keelfsd stats --rpc PATH`: ask and print.
pub fn query(path: &Path) -> anyhow::Result<String> {
    let stream = UnixStream::connect(path)
        .map_err(|e| crate::tools::UsageError(format!("cannot reach keelfsd at {}: {e}", path.display())))?;
    // Each reactor has REACTOR_ANSWER_TIMEOUT to answer; a loaded machine
    // with several may need all of it.
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut w = &stream;
    writeln!(w, "stats")?;
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply)?;
    let parsed: Value = serde_json::from_str(&reply).context("keelfsd sent something that is not JSON")?;
    Ok(serde_json::to_string_pretty(&parsed)?)
}
