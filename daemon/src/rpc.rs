//! The stats RPC: a unix socket that answers `stats` with one JSON object.
//!
//! The RPC thread holds no filesystem state. It asks each reactor, through
//! its inbox, for a snapshot of its exports, and reads the reactors' own
//! counters (atomics) directly.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::Context;
use keelfs_core::reactor::ReactorHandle;
use serde_json::{json, Value};

/// How long a reactor may take to answer a snapshot request.
const REACTOR_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

pub struct RpcServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RpcServer {
    pub fn start(path: &Path, reactors: Vec<ReactorHandle>) -> anyhow::Result<Self> {
        if path.exists() {
            // A socket left by a daemon that died; a live one would answer.
            if UnixStream::connect(path).is_ok() {
                anyhow::bail!("{} is in use by another daemon", path.display());
            }
            std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
        }
        let listener = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new().name("keelfsd-rpc".into()).spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    if let Ok(stream) = stream {
                        let _ = answer(stream, &reactors);
                    }
                }
            })?
        };
        Ok(Self { path: path.to_owned(), stop, thread: Some(thread) })
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = UnixStream::connect(&self.path); // wake the accept
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn answer(stream: UnixStream, reactors: &[ReactorHandle]) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
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
