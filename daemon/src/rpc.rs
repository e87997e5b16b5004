//! The control RPC: JSON-RPC 2.0 on a unix socket, one request (or batch)
//! per line, one reply line each (docs/RPC.md has the schema). The bare
//! line `stats` still answers with the stats object, as before JSON-RPC.
//!
//! The RPC thread holds no filesystem state. It asks each reactor, through
//! its inbox, for a snapshot of its exports, and reads the reactors' own
//! counters (atomics) directly; changes go through [`Control`].

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use keelfs_reactor::{self as reactor, ReactorHandle};
use keelfs_vhost::{bind_listener, SocketAccess};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::accept::AcceptLoop;
use crate::control::{Control, ControlError, STOP_TIMEOUT_DEFAULT};

/// The longest request line a client may send (an `export_add` carries an
/// export's settings).
const REQUEST_BYTES_MAX: usize = 64 << 10;
/// Requests in one batch at most.
const BATCH_MAX: usize = 64;
/// How long a client may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Clients served at once; more wait in the listen backlog.
const CLIENTS_MAX: usize = 8;

/// How long a reactor may take to answer a snapshot request.
const REACTOR_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// JSON-RPC 2.0's error codes, and keelfsd's own (-32000 to -32099).
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    pub const NO_SUCH_EXPORT: i64 = -32001;
    pub const CONFLICT: i64 = -32002;
    pub const BUSY: i64 = -32003;
    pub const NOT_POSSIBLE: i64 = -32004;
    pub const FAILED: i64 = -32005;
    pub const TIMEOUT: i64 = -32006;
}

/// Every method, for `rpc_get_methods`.
pub const METHODS: [&str; 15] = [
    "stats",
    "export_list",
    "export_add",
    "export_remove",
    "export_set_qos",
    "export_set_quota",
    "export_trim",
    "snapshot_create",
    "snapshot_list",
    "snapshot_delete",
    "scrub_start",
    "scrub_status",
    "scrub_cancel",
    "rpc_get_methods",
    "framework_uptime",
];

/// A JSON-RPC error object.
#[derive(Debug)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
}

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
}

impl From<ControlError> for RpcError {
    fn from(e: ControlError) -> Self {
        let code = match &e {
            ControlError::NoSuchExport(_) => code::NO_SUCH_EXPORT,
            ControlError::Conflict(_) => code::CONFLICT,
            ControlError::Busy(_) => code::BUSY,
            ControlError::NotPossible(_) => code::NOT_POSSIBLE,
            ControlError::Failed(_) => code::FAILED,
            ControlError::Timeout(_) => code::TIMEOUT,
        };
        Self::new(code, e.to_string())
    }
}

/// Bind the RPC socket: only this user may ask (0600), set before the
/// socket can accept; a live socket or anything not a socket at the path
/// is refused.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    bind_listener(path, SocketAccess::default()).context("the RPC socket")
}

pub struct RpcServer {
    _accept: AcceptLoop,
}

impl RpcServer {
    /// Serve on `listener`, bound by [`bind`]. The path is removed by
    /// whoever bound it (serve, or its supervisor): this thread may not
    /// see it.
    pub fn start(listener: UnixListener, control: Arc<Control>) -> anyhow::Result<Self> {
        let refuse = |mut stream: &UnixStream| {
            let _ =
                writeln!(stream, "{}", error_reply(Value::Null, &RpcError::new(code::BUSY, "too many RPC clients")));
        };
        let accept = AcceptLoop::start("keelfsd-rpc", listener, CLIENTS_MAX, refuse, move |stream| {
            let _ = answer(stream, &control);
        })
        .context("starting the RPC thread")?;
        Ok(Self { _accept: accept })
    }
}

/// One request line, read within REQUEST_TIMEOUT and REQUEST_BYTES_MAX;
/// None when it is too long.
fn read_line(stream: &UnixStream) -> std::io::Result<Option<Vec<u8>>> {
    // A client that trickles bytes or never sends a newline is cut off.
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let mut line = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let n = (&*stream).read(&mut buf)?;
        line.extend_from_slice(&buf[..n]);
        if let Some(end) = line.iter().position(|&b| b == b'\n') {
            line.truncate(end);
            return Ok(Some(line));
        }
        if n == 0 {
            return Ok(Some(line));
        }
        if line.len() > REQUEST_BYTES_MAX {
            return Ok(None);
        }
    }
}

fn answer(stream: UnixStream, control: &Control) -> std::io::Result<()> {
    let reply = match read_line(&stream)? {
        None => Some(error_reply(
            Value::Null,
            &RpcError::new(code::INVALID_REQUEST, format!("request longer than {REQUEST_BYTES_MAX} bytes")),
        )),
        Some(line) => handle_line(&String::from_utf8_lossy(&line), control),
    };
    match reply {
        Some(reply) => writeln!(&stream, "{reply}"),
        None => Ok(()),
    }
}

/// The reply to one line, or None when it held only notifications.
pub fn handle_line(line: &str, control: &Control) -> Option<Value> {
    let line = line.trim();
    // The line protocol before JSON-RPC: `stats` alone.
    if line == "stats" || line.is_empty() {
        return Some(snapshot(&control.reactors));
    }
    let parsed: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => {
            return Some(error_reply(Value::Null, &RpcError::new(code::PARSE_ERROR, format!("parse error: {e}"))))
        }
    };
    match parsed {
        Value::Array(batch) if batch.is_empty() => {
            Some(error_reply(Value::Null, &RpcError::new(code::INVALID_REQUEST, "an empty batch")))
        }
        Value::Array(batch) if batch.len() > BATCH_MAX => Some(error_reply(
            Value::Null,
            &RpcError::new(code::INVALID_REQUEST, format!("a batch holds at most {BATCH_MAX} requests")),
        )),
        Value::Array(batch) => {
            let replies: Vec<Value> = batch.into_iter().filter_map(|r| handle_request(r, control)).collect();
            (!replies.is_empty()).then_some(Value::Array(replies))
        }
        request => handle_request(request, control),
    }
}

/// One JSON-RPC request; None for a notification (no `id`).
fn handle_request(request: Value, control: &Control) -> Option<Value> {
    let Value::Object(mut fields) = request else {
        return Some(error_reply(Value::Null, &RpcError::new(code::INVALID_REQUEST, "a request is a JSON object")));
    };
    let id = fields.remove("id");
    let valid_id = matches!(id, None | Some(Value::Null | Value::Number(_) | Value::String(_)));
    let reply_id = if valid_id { id.clone().unwrap_or(Value::Null) } else { Value::Null };
    if fields.get("jsonrpc") != Some(&json!("2.0")) || !valid_id {
        return Some(error_reply(reply_id, &RpcError::new(code::INVALID_REQUEST, "not a JSON-RPC 2.0 request")));
    }
    let Some(Value::String(method)) = fields.remove("method") else {
        return Some(error_reply(reply_id, &RpcError::new(code::INVALID_REQUEST, "the method is not a string")));
    };
    let params = fields.remove("params").unwrap_or(Value::Null);
    if !matches!(params, Value::Null | Value::Object(_) | Value::Array(_)) {
        return Some(error_reply(reply_id, &RpcError::new(code::INVALID_REQUEST, "params is an object")));
    }
    let outcome = call(&method, params, control);
    if outcome.is_ok() && method != "stats" && method != "export_list" && !method.starts_with("rpc_") {
        tracing::info!("rpc: {method} done");
    }
    if let Err(e) = &outcome {
        tracing::warn!("rpc: {method} failed ({}): {}", e.code, e.message);
    }
    id.as_ref()?;
    Some(match outcome {
        Ok(result) => json!({"jsonrpc": "2.0", "id": reply_id, "result": result}),
        Err(e) => error_reply(reply_id, &e),
    })
}

fn error_reply(id: Value, e: &RpcError) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": e.code, "message": e.message}})
}

/// Parameters as `T`; absent ones as `{}`.
fn params<T: for<'de> Deserialize<'de>>(params: Value) -> Result<T, RpcError> {
    let params = if params.is_null() { json!({}) } else { params };
    serde_json::from_value(params).map_err(|e| RpcError::new(code::INVALID_PARAMS, format!("invalid params: {e}")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParams {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddParams {
    export: Value,
    reactor: Option<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveParams {
    tag: String,
    timeout_ms: Option<u64>,
}

fn call(method: &str, raw: Value, control: &Control) -> Result<Value, RpcError> {
    match method {
        "stats" => params::<NoParams>(raw).map(|_| snapshot(&control.reactors)),
        "export_list" => params::<NoParams>(raw).map(|_| control.list()),
        "export_add" => {
            let p: AddParams = params(raw)?;
            let export = crate::config::parse_runtime_export(&p.export)
                .map_err(|e| RpcError::new(code::INVALID_PARAMS, e.message))?;
            Ok(control.add(export, p.reactor)?)
        }
        "export_remove" => {
            let p: RemoveParams = params(raw)?;
            let timeout = p.timeout_ms.map_or(STOP_TIMEOUT_DEFAULT, Duration::from_millis);
            Ok(control.remove(&p.tag, timeout)?)
        }
        "export_set_qos" => crate::settings::set_qos(raw, control),
        "export_set_quota" => crate::settings::set_quota(raw, control),
        "export_trim" => crate::settings::trim(raw, control),
        "snapshot_create" => crate::snapshots::create(raw, control),
        "snapshot_list" => crate::snapshots::list(raw, control),
        "snapshot_delete" => crate::snapshots::delete(raw, control),
        "scrub_start" => crate::scrub::start(raw, control),
        "scrub_status" => crate::scrub::status(raw, control),
        "scrub_cancel" => crate::scrub::cancel(raw, control),
        "rpc_get_methods" => params::<NoParams>(raw).map(|_| json!(METHODS)),
        "framework_uptime" => params::<NoParams>(raw).map(|_| json!({"uptime_ns": uptime_ns()})),
        other => Err(RpcError::new(code::METHOD_NOT_FOUND, format!("no method {other:?}; see rpc_get_methods"))),
    }
}

/// Nanoseconds since the daemon started: the clock a client divides
/// counter differences by.
fn uptime_ns() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Every reactor's counters and exports.
pub fn snapshot(reactors: &[ReactorHandle]) -> Value {
    let mut reactor_lines = Vec::new();
    let mut exports = Vec::new();
    let taken_at = uptime_ns();
    for handle in reactors {
        let (tx, rx) = mpsc::channel();
        let asked = handle.send(move || {
            reactor::spawn_local(async move {
                let _ = tx.send(crate::serve::local_stats().await);
            });
        });
        let local = if asked.is_ok() { rx.recv_timeout(REACTOR_ANSWER_TIMEOUT).ok() } else { None };
        let s = handle.stats();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let (busy_ns, loop_ns, sleep_ns) = (load(&s.busy_ns), load(&s.loop_ns), load(&s.sleep_ns));
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
            "busy_share": busy_ns as f64 / loop_ns.max(1) as f64,
            "busy_ns": busy_ns,
            "loop_ns": loop_ns,
            "sleep_ns": sleep_ns,
            "idle_ns": loop_ns.saturating_sub(busy_ns) + sleep_ns,
            "ticks": s.ticks.load(Ordering::Relaxed),
            "busy_ticks": s.busy_ticks.load(Ordering::Relaxed),
            "sleeps": s.sleeps.load(Ordering::Relaxed),
            "messages": s.messages.load(Ordering::Relaxed),
            "task_polls": s.task_polls.load(Ordering::Relaxed),
            "shares": {
                "refusals": s.share_refusals.load(Ordering::Relaxed),
                "rounds": s.share_rounds.load(Ordering::Relaxed),
                "idle_rounds": s.share_idle_rounds.load(Ordering::Relaxed),
            },
            "virtio_fs_requests": requests,
            "poll": poll_json(&s.poll_state()),
        }));
    }
    json!({"uptime_ns": taken_at, "reactors": reactor_lines, "exports": exports})
}

/// The idle policy's state: what an idle iteration does now and why.
fn poll_json(p: &keelfs_reactor::PollState) -> Value {
    json!({
        "mode": p.mode,
        "regime": p.regime.name(),
        "reason": p.reason.name(),
        "switches": p.switches,
        "off_cpu_share": f64::from(p.off_cpu_ppm) / 1e6,
        "others_runnable": p.others_runnable,
        "cpu_pressure_share": p.pressure_ppm.map(|ppm| f64::from(ppm) / 1e6),
        "spin_hits": p.spin_hits,
        "spin_misses": p.spin_misses,
        "quick_wakes": p.quick_wakes,
        "served": p.served,
        "comparison": p.comparison.map(|c| json!({
            "spinning_per_s": c.spinning_per_s,
            "asleep_per_s": c.asleep_per_s,
            "winner": if c.spin_won { "spin" } else { "sleep" },
        })),
    })
}

/// Connect to a running keelfsd's RPC socket.
fn connect(path: &Path) -> anyhow::Result<UnixStream> {
    let stream = UnixStream::connect(path)
        .map_err(|e| crate::tools::UsageError(format!("cannot reach keelfsd at {}: {e}", path.display())))?;
    // Each reactor has REACTOR_ANSWER_TIMEOUT to answer, and a removal may
    // wait for a drain; a loaded machine may need all of it.
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    Ok(stream)
}

/// Send one JSON-RPC call and return its reply object.
pub fn call_remote(path: &Path, method: &str, params: Value) -> anyhow::Result<Value> {
    let stream = connect(path)?;
    let request = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    writeln!(&stream, "{request}")?;
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply)?;
    serde_json::from_str(&reply).context("keelfsd sent something that is not JSON")
}

/// `keelfsd stats --rpc PATH`: the stats object.
pub fn query(path: &Path) -> anyhow::Result<Value> {
    let reply = call_remote(path, "stats", json!({}))?;
    match reply.get("result") {
        Some(result) => Ok(result.clone()),
        None => anyhow::bail!("keelfsd answered: {}", reply["error"]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ExportTable;

    fn control() -> Control {
        Control {
            reactors: Vec::new(),
            table: Arc::new(ExportTable::default()),
            events: std::sync::Mutex::new(mpsc::channel().0),
            commit_interval: Duration::from_secs(5),
            sandbox: crate::sandbox::SandboxMode::None,
            link: None,
        }
    }

    fn error_code(reply: &Value) -> i64 {
        reply["error"]["code"].as_i64().unwrap_or_else(|| panic!("not an error: {reply}"))
    }

    #[test]
    fn protocol_errors_carry_the_spec_codes() {
        let c = control();
        let reply = |line: &str| handle_line(line, &c).expect("a reply");
        assert_eq!(error_code(&reply("{not json")), code::PARSE_ERROR);
        assert_eq!(error_code(&reply("[]")), code::INVALID_REQUEST);
        assert_eq!(error_code(&reply("42")), code::INVALID_REQUEST);
        assert_eq!(error_code(&reply(r#"{"jsonrpc":"1.0","id":1,"method":"stats"}"#)), code::INVALID_REQUEST);
        assert_eq!(error_code(&reply(r#"{"jsonrpc":"2.0","id":1,"method":7}"#)), code::INVALID_REQUEST);
        assert_eq!(error_code(&reply(r#"{"jsonrpc":"2.0","id":{},"method":"stats"}"#)), code::INVALID_REQUEST);
        assert_eq!(error_code(&reply(r#"{"jsonrpc":"2.0","id":1,"method":"nope"}"#)), code::METHOD_NOT_FOUND);
        let bad = reply(r#"{"jsonrpc":"2.0","id":"x","method":"export_remove","params":{"tog":"a"}}"#);
        assert_eq!((error_code(&bad), &bad["id"]), (code::INVALID_PARAMS, &json!("x")));
        let missing = reply(r#"{"jsonrpc":"2.0","id":2,"method":"export_remove","params":{"tag":"a"}}"#);
        assert_eq!(error_code(&missing), code::NO_SUCH_EXPORT);
        let bad_export = reply(r#"{"jsonrpc":"2.0","id":3,"method":"export_add","params":{"export":{"tag":"a"}}}"#);
        assert_eq!(error_code(&bad_export), code::INVALID_PARAMS, "{bad_export}");
    }

    #[test]
    fn batches_notifications_and_the_old_line() {
        let c = control();
        let batch = handle_line(
            r#"[{"jsonrpc":"2.0","id":1,"method":"rpc_get_methods"},{"jsonrpc":"2.0","method":"export_list"},5]"#,
            &c,
        )
        .expect("a reply");
        let replies = batch.as_array().expect("a batch reply");
        assert_eq!(replies.len(), 2, "the notification has no reply: {batch}");
        assert_eq!(replies[0]["result"], json!(METHODS));
        assert_eq!(error_code(&replies[1]), code::INVALID_REQUEST);
        assert!(handle_line(r#"{"jsonrpc":"2.0","method":"export_list"}"#, &c).is_none());
        let too_many = format!("[{}]", vec![r#"{"jsonrpc":"2.0","method":"export_list"}"#; BATCH_MAX + 1].join(","));
        assert_eq!(error_code(&handle_line(&too_many, &c).unwrap()), code::INVALID_REQUEST);
        let old = handle_line("stats", &c).expect("the stats object");
        assert!(old["reactors"].is_array() && old["exports"].is_array(), "{old}");
    }
}
