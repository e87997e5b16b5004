//! Prometheus metrics: an HTTP endpoint (`metrics_listen`) that renders the
//! stats RPC's snapshot in the Prometheus text format.
//!
//! Both views come from the one snapshot ([`crate::rpc::snapshot`]), so a
//! scrape and `keelfsd stats` taken at the same moment agree by
//! construction; nothing on the I/O path changes for a scrape. The
//! exposition format is written by the prometheus-client crate.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::accept::AcceptLoop;
use keelfs_reactor::ReactorHandle;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde_json::Value;

/// The longest HTTP request head a scraper may send.
const REQUEST_HEAD_BYTES_MAX: usize = 8192;
/// How long a scraper may take to send its request, and to read the reply.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Scrapes served at once; more wait in the listen backlog.
const CLIENTS_MAX: usize = 4;
/// Latency buckets' upper bounds: powers of two of nanoseconds, 2^10 (about
/// 1 µs) to 2^34 (about 17 s), which the log-linear histograms fold into
/// exactly (see `LatencyHistogram::power_of_two_buckets`).
const LATENCY_BOUND_POWERS: std::ops::RangeInclusive<u32> = 10..=34;

const OPENMETRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PROMETHEUS_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Bind the metrics listener. Called before the sandbox: the sandboxed
/// server may not create sockets, and the listener stays in the host's
/// network namespace when the server leaves it.
/// Returns the address it got (a port of 0 picks one): asking later would
/// take getsockname(2), which the sandbox forbids.
pub fn bind(addr: SocketAddr) -> anyhow::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).with_context(|| format!("binding the metrics listener on {addr}"))?;
    let bound = listener.local_addr().context("the metrics listener's address")?;
    Ok((listener, bound))
}

pub struct MetricsServer {
    addr: SocketAddr,
    _accept: AcceptLoop,
}

impl MetricsServer {
    pub fn start((listener, addr): (TcpListener, SocketAddr), reactors: Vec<ReactorHandle>) -> anyhow::Result<Self> {
        let refuse = |stream: &TcpStream| {
            let _ = reply(stream, "503 Service Unavailable", "text/plain", "too many scrapes at once\n");
        };
        let accept = AcceptLoop::start("keelfsd-metrics", listener, CLIENTS_MAX, refuse, move |stream| {
            let _ = answer(stream, &reactors);
        })?;
        Ok(Self { addr, _accept: accept })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// The request's head (request line and headers), read within
/// REQUEST_TIMEOUT and REQUEST_HEAD_BYTES_MAX.
fn read_head(stream: &TcpStream) -> std::io::Result<Option<String>> {
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() > REQUEST_HEAD_BYTES_MAX {
            return Ok(None);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let n = (&*stream).read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(Some(String::from_utf8_lossy(&head).into_owned()))
}

fn answer(stream: TcpStream, reactors: &[ReactorHandle]) -> std::io::Result<()> {
    stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let Some(head) = read_head(&stream)? else {
        return reply(&stream, "431 Request Header Fields Too Large", "text/plain", "request head too long\n");
    };
    let mut lines = head.lines();
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    if method != "GET" {
        return reply(&stream, "405 Method Not Allowed", "text/plain", "only GET\n");
    }
    if target.split('?').next() != Some("/metrics") {
        return reply(&stream, "404 Not Found", "text/plain", "metrics are at /metrics\n");
    }
    // Prometheus asks for OpenMetrics first when it can read it.
    let openmetrics = lines.any(|l| {
        l.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("accept") && value.contains("application/openmetrics-text")
        })
    });
    let snapshot = crate::rpc::snapshot(reactors);
    match render(snapshot, openmetrics) {
        Ok(body) => reply(&stream, "200 OK", if openmetrics { OPENMETRICS_TYPE } else { PROMETHEUS_TYPE }, &body),
        Err(_) => reply(&stream, "500 Internal Server Error", "text/plain", "encoding failed\n"),
    }
}

fn reply(stream: &TcpStream, status: &str, content_type: &str, body: &str) -> std::io::Result<()> {
    let mut out = stream;
    write!(
        out,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// The snapshot in the Prometheus text format (0.0.4), or OpenMetrics 1.0.
pub fn render(snapshot: Value, openmetrics: bool) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(snapshot)));
    let mut body = String::new();
    if openmetrics {
        prometheus_client::encoding::text::encode(&mut body, &registry)?;
    } else {
        prometheus_client::encoding::prometheus_text::encode(&mut body, &registry)?;
    }
    Ok(body)
}

#[derive(Debug)]
struct Snapshot(Value);

/// A per-export number: its metric, help, type, and where the stats JSON
/// keeps it (a JSON pointer within the export's object).
struct ExportMetric {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    pointer: &'static str,
}

const fn counter(name: &'static str, help: &'static str, pointer: &'static str) -> ExportMetric {
    ExportMetric { name, help, kind: MetricType::Counter, pointer }
}

const fn gauge(name: &'static str, help: &'static str, pointer: &'static str) -> ExportMetric {
    ExportMetric { name, help, kind: MetricType::Gauge, pointer }
}

const EXPORT_METRICS: &[ExportMetric] = &[
    gauge(
        "keelfs_image_attached",
        "1 while the export's image is mounted here (0: handed to a migration)",
        "/image_attached",
    ),
    counter("keelfs_cache_hits", "page-cache hits", "/cache/hits"),
    counter("keelfs_cache_misses", "page-cache misses", "/cache/misses"),
    counter("keelfs_cache_evictions", "pages evicted from the page cache", "/cache/evictions"),
    gauge("keelfs_cache_pages", "pages in the page cache", "/cache/pages"),
    gauge("keelfs_cache_dirty_pages", "dirty pages in the page cache", "/cache/dirty_pages"),
    gauge("keelfs_cache_capacity_pages", "the page cache's capacity in pages", "/cache/capacity_pages"),
    counter("keelfs_journal_commits", "journal transactions committed", "/fs/journal_commits"),
    counter("keelfs_journal_blocks_written", "journal blocks written", "/fs/journal_blocks_written"),
    counter("keelfs_device_flushes", "device cache flushes", "/fs/device_flushes"),
    counter("keelfs_checkpoints", "journal checkpoints", "/fs/checkpoints"),
    counter("keelfs_fsyncs", "fsync and fdatasync requests", "/fs/fsyncs"),
    counter("keelfs_data_read_bytes", "file data bytes read from the device", "/fs/data_bytes_read"),
    counter("keelfs_data_written_bytes", "file data bytes written to the device", "/fs/data_bytes_written"),
    counter("keelfs_qos_deferred_reads", "READs the export's QoS limits held back", "/qos/deferred/read"),
    counter("keelfs_qos_deferred_writes", "WRITEs the export's QoS limits held back", "/qos/deferred/write"),
    gauge("keelfs_qos_waiting_reads", "READs waiting for the export's QoS limits now", "/qos/waiting/read"),
    gauge("keelfs_qos_waiting_writes", "WRITEs waiting for the export's QoS limits now", "/qos/waiting/write"),
    counter(
        "keelfs_qos_debts",
        "requests that cost more when served than when QoS charged them (rewritten by the guest meanwhile)",
        "/qos/debts",
    ),
    counter("keelfs_discards", "discard (trim, punch, deallocate) requests sent to the device", "/fs/discards"),
    counter("keelfs_discard_bytes", "bytes discarded on the device", "/fs/discard_bytes"),
    counter("keelfs_discard_errors", "discards the device failed", "/fs/discard_errors"),
    gauge("keelfs_discard_pending_blocks", "freed blocks waiting for their discard", "/fs/discard_pending_blocks"),
    counter(
        "keelfs_checksum_errors",
        "device reads of data that failed their checksum (EIO)",
        "/fs/data_checksum_errors",
    ),
    gauge("keelfs_quota_bytes", "the export's byte quota (absent: none)", "/space/quota_bytes"),
    gauge("keelfs_quota_inodes", "the export's inode quota (absent: none)", "/space/quota_inodes"),
    gauge("keelfs_fs_size_bytes", "the filesystem's size as statfs reports it", "/space/size_bytes"),
    gauge("keelfs_fs_free_bytes", "bytes available to files, as statfs reports them", "/space/free_bytes"),
    gauge("keelfs_fs_inodes", "inodes the filesystem may hold", "/space/inodes"),
    gauge("keelfs_fs_inodes_free", "inodes still available", "/space/inodes_free"),
    gauge("keelfs_snapshots", "snapshots the export's image keeps", "/space/snapshots"),
    gauge(
        "keelfs_snapshot_held_bytes",
        "bytes only snapshots hold: what deleting them all frees",
        "/space/snapshot_held_bytes",
    ),
    counter("keelfs_virtio_connections", "vhost-user frontends that connected", "/virtio_fs/connections"),
    counter("keelfs_virtio_dropped", "descriptor chains dropped as malformed", "/virtio_fs/dropped"),
    gauge("keelfs_virtio_in_flight", "virtio-fs requests being served", "/virtio_fs/in_flight"),
];

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let empty = Vec::new();
        let reactors = self.0["reactors"].as_array().unwrap_or(&empty);
        let exports = self.0["exports"].as_array().unwrap_or(&empty);
        encode_reactors(&mut encoder, reactors)?;
        for m in EXPORT_METRICS {
            let mut family = encoder.encode_descriptor(m.name, m.help, None, m.kind)?;
            for export in exports {
                let Some(value) = export.pointer(m.pointer).and_then(number) else { continue };
                let labels = [("export", export["tag"].as_str().unwrap_or_default())];
                match m.kind {
                    MetricType::Counter => ConstCounter::new(value).encode(family.encode_family(&labels)?)?,
                    _ => ConstGauge::new(value).encode(family.encode_family(&labels)?)?,
                }
            }
        }
        encode_requests(&mut encoder, exports)
    }
}

/// A JSON number or boolean as a u64 (metrics here are counts).
fn number(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| v.as_bool().map(u64::from))
}

fn encode_reactors(encoder: &mut DescriptorEncoder, reactors: &[Value]) -> Result<(), std::fmt::Error> {
    let series = [
        ("keelfs_reactor_busy_seconds", "time in reactor iterations that found work", "busy_ns"),
        ("keelfs_reactor_idle_seconds", "time idle: polling without work, or asleep", "idle_ns"),
    ];
    for (name, help, field) in series {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for r in reactors {
            let id = r["id"].to_string();
            let seconds = r[field].as_u64().unwrap_or(0) as f64 / 1e9;
            ConstCounter::new(seconds).encode(family.encode_family(&[("reactor", id.as_str())])?)?;
        }
    }
    let counts = [
        ("keelfs_reactor_sleeps", "times asleep in epoll", &["sleeps"][..]),
        ("keelfs_reactor_poll_switches", "times the adaptive idle policy changed regime", &["poll", "switches"]),
        ("keelfs_reactor_share_refusals", "requests held back for an export's fair share", &["shares", "refusals"]),
        ("keelfs_reactor_share_rounds", "rounds of fair-share top-ups", &["shares", "rounds"]),
    ];
    for (name, help, path) in counts {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for r in reactors {
            let id = r["id"].to_string();
            let value = path.iter().fold(r, |v, key| &v[*key]).as_u64().unwrap_or(0);
            ConstCounter::new(value).encode(family.encode_family(&[("reactor", id.as_str())])?)?;
        }
    }
    let help = "1 while an idle reactor spins, 0 while it sleeps at once";
    let mut family = encoder.encode_descriptor("keelfs_reactor_spinning", help, None, MetricType::Gauge)?;
    for r in reactors {
        let id = r["id"].to_string();
        let spinning = u64::from(r["poll"]["regime"].as_str() == Some("spin"));
        ConstGauge::new(spinning).encode(family.encode_family(&[("reactor", id.as_str())])?)?;
    }
    Ok(())
}

/// Every export's per-opcode lines, for each transport, with its labels.
fn op_lines(exports: &[Value]) -> Vec<([(&'static str, String); 3], &Value)> {
    let mut lines = Vec::new();
    for export in exports {
        let tag = export["tag"].as_str().unwrap_or_default();
        for (transport, key) in [("virtiofs", "ops"), ("fuse", "fuse_mount_ops")] {
            let Some(ops) = export[key].as_object() else { continue };
            for (op, line) in ops {
                lines.push((
                    [("export", tag.to_string()), ("transport", transport.to_string()), ("op", op.clone())],
                    line,
                ));
            }
        }
    }
    lines
}

fn encode_requests(encoder: &mut DescriptorEncoder, exports: &[Value]) -> Result<(), std::fmt::Error> {
    let lines = op_lines(exports);
    let series = [
        ("keelfs_requests", "FUSE requests served", "requests"),
        ("keelfs_request_errors", "FUSE requests answered with an error", "errors"),
        ("keelfs_request_bytes", "request and reply bytes, data included", "bytes"),
    ];
    for (name, help, field) in series {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (labels, line) in &lines {
            ConstCounter::new(line[field].as_u64().unwrap_or(0)).encode(family.encode_family(labels)?)?;
        }
    }
    let mut family = encoder.encode_descriptor(
        "keelfs_request_duration_seconds",
        "time from a request's arrival to its reply (bucket bounds are exclusive by 1 ns)",
        None,
        MetricType::Histogram,
    )?;
    for (labels, line) in &lines {
        let (count, buckets) = latency_buckets(line);
        let sum = line["latency_sum_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
        family
            .encode_family(labels)?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)?;
    }
    Ok(())
}

/// An op's sparse power-of-two buckets, as the fixed bucket set Prometheus
/// wants: (upper bound in seconds, count in that bucket alone; the encoder
/// accumulates), the last one +Inf.
fn latency_buckets(line: &Value) -> (u64, Vec<(f64, u64)>) {
    let mut buckets: Vec<(f64, u64)> =
        LATENCY_BOUND_POWERS.map(|p| ((1u64 << p) as f64 / 1e9, 0)).chain([(f64::INFINITY, 0)]).collect();
    let mut count = 0u64;
    for pair in line["latency_buckets"].as_array().into_iter().flatten() {
        let (Some(bound), Some(n)) = (pair[0].as_u64(), pair[1].as_u64()) else { continue };
        count += n;
        // The first fixed bound at or above this bucket's bound holds it.
        let slot = LATENCY_BOUND_POWERS.clone().position(|p| bound <= 1u64 << p).unwrap_or(buckets.len() - 1);
        buckets[slot].1 += n;
    }
    (count, buckets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> Value {
        json!({
            "reactors": [{"id": 0, "busy_ns": 2_000_000_000u64, "idle_ns": 1_000_000_000u64, "sleeps": 5,
                          "poll": {"mode": "adaptive", "regime": "spin", "reason": "core-free", "switches": 3}}],
            "exports": [{
                "tag": "vm\"1", "image_attached": true,
                "cache": {"hits": 7, "misses": 3, "evictions": 0, "pages": 2, "dirty_pages": 1, "capacity_pages": 9},
                "fs": {"journal_commits": 4},
                "ops": {"read": {"requests": 3, "errors": 1, "bytes": 12288, "latency_sum_ns": 6000,
                                 "latency_buckets": [[512, 1], [2048, 1], [1u64 << 40, 1]]}},
            }],
        })
    }

    #[test]
    fn renders_counters_gauges_and_cumulative_buckets() {
        let text = render(sample(), false).expect("encodes");
        assert!(text.contains("keelfs_cache_hits_total{export=\"vm\\\"1\"} 7"), "{text}");
        assert!(text.contains("keelfs_cache_dirty_pages{export=\"vm\\\"1\"} 1"), "{text}");
        assert!(text.contains("keelfs_reactor_busy_seconds_total{reactor=\"0\"} 2"), "{text}");
        assert!(text.contains("keelfs_reactor_poll_switches_total{reactor=\"0\"} 3"), "{text}");
        assert!(text.contains("keelfs_reactor_spinning{reactor=\"0\"} 1"), "{text}");
        assert!(text.contains("keelfs_requests_total{export=\"vm\\\"1\",transport=\"virtiofs\",op=\"read\"} 3"));
        // 512 ns folds into the first bound (1024 ns), 2048 into 2^11, 2^40
        // past the last bound into +Inf; the encoder accumulates.
        let buckets: Vec<&str> =
            text.lines().filter(|l| l.starts_with("keelfs_request_duration_seconds_bucket")).collect();
        assert_eq!(buckets.len(), LATENCY_BOUND_POWERS.count() + 1, "{text}");
        assert!(buckets[0].ends_with(" 1"), "{}", buckets[0]);
        assert!(buckets[1].ends_with(" 2"), "{}", buckets[1]);
        assert!(buckets[buckets.len() - 2].ends_with(" 2"), "{}", buckets[buckets.len() - 2]);
        let inf = buckets.last().unwrap();
        assert!(inf.contains("le=\"+Inf\"") && inf.ends_with(" 3"), "{inf}");
        assert!(text.contains("_count{export=\"vm\\\"1\",transport=\"virtiofs\",op=\"read\"} 3"), "{text}");
    }

    #[test]
    fn openmetrics_ends_with_eof() {
        let text = render(sample(), true).expect("encodes");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn a_snapshot_without_exports_still_renders() {
        let text = render(json!({"reactors": [], "exports": []}), false).expect("encodes");
        assert!(text.contains("# TYPE keelfs_requests_total counter"), "{text}");
    }
}
