//! `keelfsd top`: a live view of a running daemon, like `spdk_top`. It
//! polls the `stats` RPC and shows what changed between two samples: per
//! reactor, the busy share; per export, IOPS, MiB/s, p99 latency and
//! queue depth.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::widgets::{Block, Paragraph, Row, Table};
use ratatui::Frame;
use serde_json::Value;

use crate::rpc;

/// One reactor's line.
#[derive(Debug, PartialEq)]
pub struct ReactorRow {
    pub id: u64,
    pub busy_percent: f64,
    pub sleeps_per_sec: f64,
    /// What the idle policy has the reactor do when idle, and why:
    /// "spin (core-free)", "sleep (contended)", "sleep (interrupt)".
    pub poll: String,
}

/// The idle policy's line: a forced mode names itself, the adaptive one
/// its regime and the reason it chose it.
fn poll_text(poll: &Value) -> String {
    let (mode, regime, reason) = (poll["mode"].as_str(), poll["regime"].as_str(), poll["reason"].as_str());
    match (mode, regime, reason) {
        (Some("adaptive"), Some(regime), Some(reason)) => format!("{regime} ({reason})"),
        (Some(mode), Some(regime), _) => format!("{regime} ({mode})"),
        _ => "-".into(),
    }
}

/// One export's line.
#[derive(Debug, PartialEq)]
pub struct ExportRow {
    pub tag: String,
    pub reactor: u64,
    pub iops: f64,
    pub read_mib_s: f64,
    pub write_mib_s: f64,
    /// Over the interval's requests of every kind; None without requests.
    pub p99_us: Option<f64>,
    pub queue_depth: u64,
    pub errors_per_sec: f64,
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// The export's op lines of both transports.
fn op_lines(export: &Value) -> Vec<(&String, &Value)> {
    ["ops", "fuse_mount_ops"].iter().filter_map(|k| export[*k].as_object()).flat_map(|m| m.iter()).collect()
}

/// `field` summed over the export's ops named in `ops` (all when empty).
fn sum_ops(export: &Value, ops: &[&str], field: &str) -> u64 {
    op_lines(export)
        .iter()
        .filter(|(op, _)| ops.is_empty() || ops.contains(&op.as_str()))
        .map(|(_, l)| u(&l[field]))
        .sum()
}

/// The latency buckets of every op, summed: bound (ns) -> count.
fn buckets(export: &Value) -> std::collections::BTreeMap<u64, u64> {
    let mut all = std::collections::BTreeMap::new();
    for (_, line) in op_lines(export) {
        for pair in line["latency_buckets"].as_array().into_iter().flatten() {
            *all.entry(u(&pair[0])).or_insert(0) += u(&pair[1]);
        }
    }
    all
}

/// The 99th percentile of the requests between two samples, as the upper
/// bound of its power-of-two bucket, in µs.
fn p99_between(prev: Option<&Value>, cur: &Value) -> Option<f64> {
    let before = prev.map(buckets).unwrap_or_default();
    let delta: Vec<(u64, u64)> =
        buckets(cur).into_iter().map(|(b, n)| (b, n.saturating_sub(*before.get(&b).unwrap_or(&0)))).collect();
    let total: u64 = delta.iter().map(|d| d.1).sum();
    if total == 0 {
        return None;
    }
    let rank = total - total / 100;
    let mut seen = 0;
    delta
        .iter()
        .find(|(_, n)| {
            seen += n;
            seen >= rank
        })
        .map(|(bound, _)| *bound as f64 / 1000.0)
}

/// The lines between two samples (`prev` None: since the daemon started).
pub fn rows(prev: Option<&Value>, cur: &Value) -> (Vec<ReactorRow>, Vec<ExportRow>) {
    let seconds = (u(&cur["uptime_ns"]).saturating_sub(prev.map_or(0, |p| u(&p["uptime_ns"]))) as f64 / 1e9).max(1e-3);
    let empty = Vec::new();
    let find = |list: &str, key: &str, value: &Value| {
        prev.and_then(|p| p[list].as_array()).and_then(|l| l.iter().find(|x| x[key] == *value)).cloned()
    };
    let reactors = cur["reactors"]
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .map(|r| {
            let before = find("reactors", "id", &r["id"]).unwrap_or(Value::Null);
            let busy = u(&r["busy_ns"]).saturating_sub(u(&before["busy_ns"]));
            let idle = u(&r["idle_ns"]).saturating_sub(u(&before["idle_ns"]));
            let sleeps = u(&r["sleeps"]).saturating_sub(u(&before["sleeps"]));
            ReactorRow {
                id: u(&r["id"]),
                busy_percent: busy as f64 * 100.0 / (busy + idle).max(1) as f64,
                sleeps_per_sec: sleeps as f64 / seconds,
                poll: poll_text(&r["poll"]),
            }
        })
        .collect();
    let exports = cur["exports"]
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .map(|e| {
            let before = find("exports", "tag", &e["tag"]);
            let delta = |ops: &[&str], field: &str| {
                sum_ops(e, ops, field).saturating_sub(before.as_ref().map_or(0, |b| sum_ops(b, ops, field)))
            };
            ExportRow {
                tag: e["tag"].as_str().unwrap_or_default().to_string(),
                reactor: u(&e["reactor"]),
                iops: delta(&["read", "write"], "requests") as f64 / seconds,
                read_mib_s: delta(&["read"], "bytes") as f64 / seconds / (1 << 20) as f64,
                write_mib_s: delta(&["write"], "bytes") as f64 / seconds / (1 << 20) as f64,
                p99_us: p99_between(before.as_ref(), e),
                queue_depth: u(&e["virtio_fs"]["in_flight"]),
                errors_per_sec: delta(&[], "errors") as f64 / seconds,
            }
        })
        .collect();
    (reactors, exports)
}

/// The frame: a header, the reactors, the exports.
pub fn draw(
    frame: &mut Frame,
    socket: &Path,
    interval: Duration,
    (reactors, exports): &(Vec<ReactorRow>, Vec<ExportRow>),
) {
    let areas =
        Layout::vertical([Constraint::Length(3), Constraint::Length(reactors.len() as u16 + 3), Constraint::Min(4)])
            .split(frame.area());
    let header = format!(
        "keelfsd top: {}  every {} ms  {} reactor(s), {} export(s)   q quits",
        socket.display(),
        interval.as_millis(),
        reactors.len(),
        exports.len()
    );
    frame.render_widget(Paragraph::new(header).block(Block::bordered()), areas[0]);
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let reactor_rows = reactors.iter().map(|r| {
        Row::new(vec![
            r.id.to_string(),
            format!("{:.1}", r.busy_percent),
            format!("{:.0}", r.sleeps_per_sec),
            r.poll.clone(),
        ])
    });
    let widths = [Constraint::Length(8), Constraint::Length(8), Constraint::Length(10), Constraint::Length(24)];
    let reactor_table = Table::new(reactor_rows, widths)
        .header(Row::new(vec!["REACTOR", "BUSY%", "SLEEPS/s", "IDLE POLICY"]).style(bold))
        .block(Block::bordered().title("Reactors"));
    frame.render_widget(reactor_table, areas[1]);
    let export_rows = exports.iter().map(|e| {
        Row::new(vec![
            e.tag.clone(),
            e.reactor.to_string(),
            format!("{:.0}", e.iops),
            format!("{:.1}", e.read_mib_s),
            format!("{:.1}", e.write_mib_s),
            e.p99_us.map_or("-".to_string(), |p| format!("{p:.0}")),
            e.queue_depth.to_string(),
            format!("{:.0}", e.errors_per_sec),
        ])
    });
    let widths = [12, 3, 9, 9, 9, 9, 4, 8].map(Constraint::Length);
    let export_table = Table::new(export_rows, widths)
        .header(Row::new(vec!["EXPORT", "R", "IOPS", "RD MiB/s", "WR MiB/s", "P99 us", "QD", "ERR/s"]).style(bold))
        .block(Block::bordered().title("Exports"));
    frame.render_widget(export_table, areas[2]);
}

/// `keelfsd top --rpc PATH [--interval MS] [--once]`.
pub fn run(socket: &Path, interval: Duration, once: bool) -> anyhow::Result<ExitCode> {
    let mut prev = rpc::query(socket)?;
    if once {
        std::thread::sleep(interval);
        let cur = rpc::query(socket)?;
        let mut terminal = ratatui::Terminal::new(ratatui::backend::TestBackend::new(100, 30))?;
        terminal.draw(|f| draw(f, socket, interval, &rows(Some(&prev), &cur)))?;
        let buffer = terminal.backend().buffer().clone();
        for y in 0..buffer.area.height {
            let line: String = (0..buffer.area.width).map(|x| buffer[(x, y)].symbol()).collect();
            println!("{}", line.trim_end());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut terminal = ratatui::init();
    let result = (|| -> anyhow::Result<()> {
        let mut view = rows(None, &prev);
        loop {
            terminal.draw(|f| draw(f, socket, interval, &view))?;
            let deadline = Instant::now() + interval;
            while let Some(left) = deadline.checked_duration_since(Instant::now()) {
                if event::poll(left)? {
                    if let Event::Key(key) = event::read()? {
                        if key.kind == KeyEventKind::Press && matches!(key.code, KeyCode::Char('q') | KeyCode::Esc) {
                            return Ok(());
                        }
                    }
                }
            }
            let cur = rpc::query(socket)?;
            view = rows(Some(&prev), &cur);
            prev = cur;
        }
    })();
    ratatui::restore();
    result.map(|()| ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample(uptime_s: u64, reads: u64, busy_ns: u64, buckets: Value) -> Value {
        json!({
            "uptime_ns": uptime_s * 1_000_000_000,
            "reactors": [{"id": 0, "busy_ns": busy_ns, "idle_ns": uptime_s * 1_000_000_000 - busy_ns, "sleeps": 0,
                          "poll": {"mode": "adaptive", "regime": "sleep", "reason": "contended"}}],
            "exports": [{"tag": "vm1", "reactor": 0, "virtio_fs": {"in_flight": 3},
                         "ops": {"read": {"requests": reads, "errors": 0, "bytes": reads * 4096,
                                          "latency_buckets": buckets}}}],
        })
    }

    #[test]
    fn rates_and_p99_come_from_the_difference() {
        let prev = sample(10, 1000, 1_000_000_000, json!([[1024, 1000]]));
        // 5000 reads in 2 s: 4950 below 2^13 ns, 50 below 2^20 ns.
        let cur = sample(12, 6000, 2_000_000_000, json!([[1024, 1000], [8192, 4950], [1_048_576, 50]]));
        let (reactors, exports) = rows(Some(&prev), &cur);
        assert!((reactors[0].busy_percent - 50.0).abs() < 0.01, "{reactors:?}");
        assert_eq!(reactors[0].poll, "sleep (contended)");
        let forced = json!({"mode": "busy", "regime": "spin", "reason": "start"});
        assert_eq!(poll_text(&forced), "spin (busy)");
        assert_eq!(poll_text(&Value::Null), "-", "an older daemon's stats have no poll");
        let e = &exports[0];
        assert!((e.iops - 2500.0).abs() < 0.01, "{e:?}");
        assert!((e.read_mib_s - 2500.0 * 4096.0 / 1048576.0).abs() < 0.01);
        assert_eq!(e.p99_us, Some(8.192), "the 99th percentile is in the 2^13 ns bucket");
        assert_eq!(e.queue_depth, 3);
        assert_eq!(rows(Some(&cur), &cur).1[0].p99_us, None, "no requests, no p99");
    }

    #[test]
    fn draws_both_tables() {
        let cur = sample(2, 10, 1, json!([[1024, 10]]));
        let mut terminal = ratatui::Terminal::new(ratatui::backend::TestBackend::new(100, 20)).unwrap();
        terminal.draw(|f| draw(f, Path::new("/r.sock"), Duration::from_secs(1), &rows(None, &cur))).unwrap();
        let text: String = terminal.backend().buffer().content().iter().map(|c| c.symbol()).collect();
        for word in ["Reactors", "Exports", "BUSY%", "IDLE POLICY", "sleep (contended)", "P99 us", "vm1"] {
            assert!(text.contains(word), "{word} missing");
        }
    }
}
