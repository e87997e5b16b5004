//! Operating a running keelfsd: the Prometheus endpoint agrees with
//! `keelfsd stats` and parses as the text format; the JSON-RPC control API
//! adds and removes exports while another export serves fio; logs come out
//! as JSON lines on request.
//!
//! The scrapes are parsed by the Prometheus project's own Python parser
//! (python3-prometheus-client, which scripts/setup.sh installs; a missing
//! one fails the test).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fsck, is_mounted, keelfsd, mkfs, Scratch, Served};
use serde_json::{json, Value};

/// A `keelfsd serve --config` child whose stderr goes to a file.
struct Daemon {
    served: Served,
    stderr: PathBuf,
}

impl Daemon {
    fn start(scratch: &Scratch, config: &str, mounts: &[&Path]) -> Daemon {
        let config_path = scratch.path("keelfsd.toml");
        std::fs::write(&config_path, config).unwrap();
        let stderr = scratch.path("stderr.log");
        let log = std::fs::File::create(&stderr).unwrap();
        let served = Served::start_to(&["--config".as_ref(), config_path.as_os_str()], mounts, log.into());
        let daemon = Daemon { served, stderr };
        daemon.wait_for_log("keelfsd: ready", Duration::from_secs(60));
        daemon
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// The first log line holding `text`.
    fn wait_for_log(&self, text: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.log().lines().find(|l| l.contains(text)) {
                return line.to_string();
            }
            assert!(Instant::now() < deadline, "no {text:?} in keelfsd's log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM; keelfsd must exit 0.
    fn stop(self) {
        let log = self.stderr.clone();
        let status = self.served.stop();
        assert!(status.success(), "keelfsd exited {status}:\n{}", std::fs::read_to_string(log).unwrap_or_default());
    }
}

/// `keelfsd rpc METHOD PARAMS`: Ok(result) or Err(stderr) on an error reply.
fn rpc(socket: &Path, method: &str, params: Value) -> Result<Value, String> {
    let out = keelfsd().args(["rpc", method, &params.to_string(), "--rpc"]).arg(socket).output().unwrap();
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).expect("keelfsd rpc prints JSON"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).to_string())
    }
}

fn stats(socket: &Path) -> Value {
    let out = keelfsd().args(["stats", "--rpc"]).arg(socket).output().unwrap();
    assert!(out.status.success(), "stats: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stats prints JSON")
}

fn scrape(addr: &str, accept: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\n\r\n").unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// The scrape as the Prometheus parser reads it: one `[name, labels,
/// value]` per sample. `openmetrics` picks the strict OpenMetrics parser,
/// which also checks that histogram buckets are cumulative and end in +Inf.
fn parse_with_prometheus(text: &str, openmetrics: bool) -> Vec<(String, Value, f64)> {
    let module = if openmetrics { "prometheus_client.openmetrics.parser" } else { "prometheus_client.parser" };
    let script = format!(
        "import sys, json\nfrom {module} import text_string_to_metric_families as parse\n\
         out = [[s.name, s.labels, s.value] for f in parse(sys.stdin.read()) for s in f.samples]\n\
         print(json.dumps(out))\n"
    );
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("/usr/bin/python3 (scripts/setup.sh installs it)");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the Prometheus parser refused the scrape: {}", String::from_utf8_lossy(&out.stderr));
    let samples: Vec<(String, Value, f64)> = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!samples.is_empty());
    samples
}

fn sample(samples: &[(String, Value, f64)], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples.iter().find(|(n, l, _)| n == name && labels.iter().all(|(k, v)| l[*k] == *v)).map(|(_, _, v)| *v)
}

/// The stats with what moves on its own (clocks, reactor loops) removed.
fn settled(stats: &Value) -> Value {
    json!({"exports": stats["exports"]})
}

#[test]
fn a_scrape_parses_and_matches_keelfsd_stats() {
    let scratch = Scratch::new("metrics");
    let (image, mnt, rpc_path) = (scratch.path("a.img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    mkfs(&image, "256M");
    // Sandboxed (the default): the listener is bound before the sandbox
    // and keeps serving from the host's network namespace.
    let config = format!(
        "[daemon]\nrpc_socket = {rpc_path:?}\nmetrics_listen = \"127.0.0.1:0\"\ncommit_interval_ms = 600000\n\
         [[device]]\nname = \"a\"\npath = {image:?}\n[[export]]\ntag = \"vol-a\"\ndevice = \"a\"\nfuse_mount = {mnt:?}\n"
    );
    let daemon = Daemon::start(&scratch, &config, &[&mnt]);
    let line = daemon.wait_for_log("metrics on http://", Duration::from_secs(5));
    let addr = line.split("http://").nth(1).unwrap().trim_end_matches("/metrics").trim().to_string();

    for i in 0..20 {
        std::fs::write(mnt.join(format!("f{i}")), vec![i as u8; 64 << 10]).unwrap();
        assert_eq!(std::fs::read(mnt.join(format!("f{i}"))).unwrap().len(), 64 << 10);
    }
    let fd = std::fs::File::open(&mnt).unwrap();
    fd.sync_all().unwrap();

    // A scrape between two equal stats saw the same counters.
    let (before, text, after) = (0..20)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(200));
            (stats(&rpc_path), scrape(&addr, "text/plain"), stats(&rpc_path))
        })
        .find(|(b, _, a)| settled(b) == settled(a))
        .expect("the counters never held still for a scrape");
    drop(before);
    let samples = parse_with_prometheus(&text, false);
    let export = &after["exports"][0];
    let ops = export["fuse_mount_ops"].as_object().expect("the host mount's ops");
    assert!(ops.len() >= 4, "{ops:?}");
    for (op, line) in ops {
        let labels = [("export", "vol-a"), ("transport", "fuse"), ("op", op.as_str())];
        for (metric, field) in [
            ("keelfs_requests_total", "requests"),
            ("keelfs_request_errors_total", "errors"),
            ("keelfs_request_bytes_total", "bytes"),
        ] {
            let scraped = sample(&samples, metric, &labels).unwrap_or_else(|| panic!("no {metric} for {op}"));
            assert_eq!(scraped as u64, line[field].as_u64().unwrap(), "{metric} of {op}");
        }
        let count = sample(&samples, "keelfs_request_duration_seconds_count", &labels).unwrap();
        assert_eq!(count as u64, line["requests"].as_u64().unwrap(), "histogram count of {op}");
        let inf = [("export", "vol-a"), ("transport", "fuse"), ("op", op.as_str()), ("le", "+Inf")];
        assert_eq!(sample(&samples, "keelfs_request_duration_seconds_bucket", &inf), Some(count));
    }
    let writes = ops["write"]["requests"].as_u64().unwrap();
    assert!(writes >= 20, "20 files were written: {writes} WRITEs");
    for (metric, pointer) in [
        ("keelfs_journal_commits_total", "/fs/journal_commits"),
        ("keelfs_cache_hits_total", "/cache/hits"),
        ("keelfs_cache_misses_total", "/cache/misses"),
        ("keelfs_fs_free_bytes", "/space/free_bytes"),
        ("keelfs_fs_inodes_free", "/space/inodes_free"),
    ] {
        let scraped = sample(&samples, metric, &[("export", "vol-a")]).unwrap_or_else(|| panic!("no {metric}"));
        assert_eq!(scraped as u64, export.pointer(pointer).unwrap().as_u64().unwrap(), "{metric}");
    }
    assert!(export["fs"]["journal_commits"].as_u64().unwrap() > 0, "the fsync committed");
    assert!(sample(&samples, "keelfs_reactor_busy_seconds_total", &[("reactor", "0")]).unwrap() > 0.0);
    assert!(sample(&samples, "keelfs_reactor_idle_seconds_total", &[("reactor", "0")]).unwrap() > 0.0);
    // The strict OpenMetrics parser checks the histograms' shape.
    parse_with_prometheus(&scrape(&addr, "application/openmetrics-text; version=1.0.0"), true);

    top_under_tmux(&rpc_path, &mnt);
    check_stats_table(&rpc_path, writes);

    // The sandboxed server cannot open a new export, and says so.
    let refused =
        rpc(&rpc_path, "export_add", json!({"export": {"tag": "b", "device": "/nonexistent", "fuse_mount": "/x"}}));
    let message = refused.expect_err("export_add in the sandbox");
    assert!(message.contains("-32004") && message.contains("sandbox"), "{message}");
    daemon.stop();
    assert_eq!(fsck(&image).0, 0);
}

/// `keelfsd stats --table`: its headers, and vol-a's row counting at least
/// `writes` requests.
fn check_stats_table(rpc_path: &Path, writes: u64) {
    let table = keelfsd().args(["stats", "--table", "--rpc"]).arg(rpc_path).output().unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    let row = table.lines().find(|l| l.starts_with("vol-a")).unwrap_or_else(|| panic!("no vol-a row:\n{table}"));
    let requests: u64 = row.split_whitespace().nth(2).and_then(|w| w.parse().ok()).unwrap_or(0);
    assert!(requests >= writes, "the table's request count: {row}");
    assert!(table.contains("REACTOR") && table.contains("BUSY%") && table.contains("FREE_MIB"), "{table}");
}

fn tmux(args: &[&str]) -> std::process::Output {
    Command::new("tmux").args(args).output().expect("tmux (scripts/setup.sh installs it)")
}

/// `keelfsd top` in a real terminal (tmux): it draws both tables with the
/// export's live numbers, and quits on `q`.
fn top_under_tmux(rpc_path: &Path, mnt: &Path) {
    let session = format!("keelfs-top-{}", std::process::id());
    let command = format!("{} top --rpc {} --interval-ms 300", env!("CARGO_BIN_EXE_keelfsd"), rpc_path.display());
    let started = tmux(&["new-session", "-d", "-s", &session, "-x", "110", "-y", "30", &command]);
    assert!(started.status.success(), "tmux: {}", String::from_utf8_lossy(&started.stderr));
    // Reads while it samples, so that the export has a rate to show:
    // direct ones, since this host mount (no guest beside it) keeps f0's
    // pages cached across opens.
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(mnt.join("f0")).unwrap();
        f.read_to_end(&mut Vec::new()).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    let frame = String::from_utf8_lossy(&tmux(&["capture-pane", "-p", "-t", &session]).stdout).to_string();
    for word in ["Reactors", "Exports", "BUSY%", "IOPS", "P99 us", "vol-a"] {
        assert!(frame.contains(word), "no {word} in top's frame:\n{frame}");
    }
    let line = frame.lines().find(|l| l.contains("vol-a")).unwrap();
    let iops: f64 =
        line.split_whitespace().filter(|w| !w.contains('│')).nth(2).and_then(|w| w.parse().ok()).unwrap_or(-1.0);
    assert!(iops > 0.0, "top shows no IOPS while the export is read: {line}");
    tmux(&["send-keys", "-t", &session, "q"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while tmux(&["has-session", "-t", &session]).status.success() {
        assert!(Instant::now() < deadline, "top did not quit on q:\n{frame}");
        std::thread::sleep(Duration::from_millis(50));
    }
    if std::env::var_os("KEELFS_PRINT_TOP").is_some() {
        println!("{frame}");
    }
}

/// Two adds of one tag at once: one wins, the other is a conflict. Then
/// removing the config's own host mount over the API does not end a daemon
/// that serves host mounts only: vol-b is still served.
fn adds_race_and_the_config_mount_goes(rpc_path: &Path, b: &Path, mnt_b: &Path) {
    let both: Vec<Result<Value, String>> = std::thread::scope(|s| {
        let add = || {
            s.spawn(|| {
                rpc(rpc_path, "export_add", json!({"export": {"tag": "vol-b", "device": b, "fuse_mount": mnt_b}}))
            })
        };
        let (x, y) = (add(), add());
        vec![x.join().unwrap(), y.join().unwrap()]
    });
    assert_eq!(both.iter().filter(|r| r.is_ok()).count(), 1, "{both:?}");
    assert!(both.iter().any(|r| r.as_ref().is_err_and(|e| e.contains("-32002"))), "{both:?}");
    rpc(rpc_path, "export_remove", json!({"tag": "vol-a"})).expect("removing vol-a");
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(mnt_b.join("after-a"), b"still here").expect("vol-b still served");
    let list = rpc(rpc_path, "export_list", json!({})).expect("the daemon still answers");
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
}

/// A small random-write fio job on `dir` for `seconds`, checked by fio.
fn fio(dir: &Path, seconds: u32) -> std::process::Child {
    Command::new("fio")
        .args(["--name=steady", "--rw=randwrite", "--bs=4k", "--size=16M", "--ioengine=psync", "--time_based"])
        .arg(format!("--runtime={seconds}"))
        .arg(format!("--directory={}", dir.display()))
        .args(["--verify=crc32c", "--do_verify=1", "--verify_state_save=0", "--output-format=json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio (scripts/setup.sh installs it)")
}

#[test]
fn exports_come_and_go_at_runtime_while_another_runs_fio() {
    let scratch = Scratch::new("runtime-exports");
    let (a, b) = (scratch.path("a.img"), scratch.path("b.img"));
    let (mnt_a, mnt_b, rpc_path) = (scratch.path("mnt-a"), scratch.path("mnt-b"), scratch.path("rpc.sock"));
    mkfs(&a, "256M");
    mkfs(&b, "256M");
    std::fs::create_dir_all(&mnt_b).unwrap();
    let config = format!(
        "[daemon]\nrpc_socket = {rpc_path:?}\nsandbox = \"none\"\nlog_format = \"json\"\n\
         [[device]]\nname = \"a\"\npath = {a:?}\n[[export]]\ntag = \"vol-a\"\ndevice = \"a\"\nfuse_mount = {mnt_a:?}\n"
    );
    let daemon = Daemon::start(&scratch, &config, &[&mnt_a]);
    let load = fio(&mnt_a, 20);

    for round in 0..3 {
        let added = rpc(
            &rpc_path,
            "export_add",
            json!({"export": {"tag": "vol-b", "device": b, "fuse_mount": mnt_b, "cache": "none"}}),
        )
        .expect("export_add");
        assert_eq!(added["tag"], "vol-b");
        assert!(is_mounted(&mnt_b));
        let list = rpc(&rpc_path, "export_list", json!({})).unwrap();
        let tags: Vec<&str> = list.as_array().unwrap().iter().map(|e| e["tag"].as_str().unwrap()).collect();
        assert_eq!(tags, ["vol-a", "vol-b"]);
        // Each round finds the last one's file, written before its removal.
        if round > 0 {
            assert_eq!(std::fs::read(mnt_b.join(format!("r{}", round - 1))).unwrap(), vec![round as u8 - 1; 100_000]);
        }
        std::fs::write(mnt_b.join(format!("r{round}")), vec![round as u8; 100_000]).unwrap();
        let twice =
            rpc(&rpc_path, "export_add", json!({"export": {"tag": "vol-c", "device": b, "fuse_mount": "/tmp"}}));
        assert!(twice.expect_err("the same image twice").contains("-32002"));
        rpc(&rpc_path, "export_remove", json!({"tag": "vol-b"})).expect("export_remove");
        assert!(!is_mounted(&mnt_b), "export_remove unmounts");
        // Removed means committed and closed: the image is clean, and no
        // longer locked.
        assert_eq!(fsck(&b).0, 0, "vol-b after export_remove");
    }
    let missing = rpc(&rpc_path, "export_remove", json!({"tag": "vol-b"}));
    assert!(missing.expect_err("no such export").contains("-32001"));

    let out = load.wait_with_output().unwrap();
    assert!(out.status.success(), "fio on vol-a: {}", String::from_utf8_lossy(&out.stderr));
    // fio may print notes before its JSON.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&stdout[stdout.find("\n{").map_or(0, |i| i + 1)..])
        .unwrap_or_else(|e| panic!("fio's JSON: {e}: {stdout}"));
    assert_eq!(report["jobs"][0]["error"], 0, "fio on vol-a failed");
    assert!(report["jobs"][0]["write"]["io_bytes"].as_u64().unwrap() > 0);

    // Every log line is a JSON object, and the lifecycle is in them with
    // the export's tag.
    let log = daemon.log();
    let events: Vec<Value> = log
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let said = |text: &str| events.iter().any(|e| e["message"].as_str().is_some_and(|m| m.contains(text)));
    assert!(said("export vol-b: serving") && said("export vol-b: stopped"), "{log}");
    assert!(events.iter().all(|e| e["level"].is_string() && e["timestamp"].is_string()));
    assert!(events.iter().any(|e| e["span"]["tag"] == "vol-b"), "events carry the export's span");

    adds_race_and_the_config_mount_goes(&rpc_path, &b, &mnt_b);
    daemon.stop();
    assert_eq!(fsck(&b).0, 0);
    assert_eq!(fsck(&a).0, 0);
}

/// CREATE `name` with `data` through the vhost-user device, read it back.
fn write_and_read_back(socket: &Path, name: &str, data: &[u8]) {
    use keelfs_vhost::abi::{init_flags as f, Opcode, Reply};
    let mut fe = common::connect_frontend(socket);
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    let (node, fh) = common::create_with(&mut fe, name, data);
    assert_eq!(common::read(&mut fe, (node, fh), data.len() as u32), Ok(data.to_vec()));
    let mut fsync = Reply::default();
    fsync.u64(fh).u32(0).u32(0);
    assert_eq!(fe.fuse(1, Opcode::Fsync, node, &fsync.bytes).unwrap().0, 0);
}

#[test]
fn a_sandboxed_daemon_adds_exports_through_its_supervisor() {
    let scratch = Scratch::new("brokered-exports");
    let allowed = scratch.path("images");
    std::fs::create_dir_all(&allowed).unwrap();
    let (a, b, outside) = (scratch.path("a.img"), allowed.join("b.img"), scratch.path("c.img"));
    let (mnt, rpc_path, socket) = (scratch.path("mnt"), scratch.path("rpc.sock"), allowed.join("b.sock"));
    for image in [&a, &b, &outside] {
        mkfs(image, "256M");
    }
    let config = format!(
        "[daemon]\nrpc_socket = {rpc_path:?}\nexport_dirs = [{allowed:?}]\n\
         [[device]]\nname = \"a\"\npath = {a:?}\n[[export]]\ntag = \"vol-a\"\ndevice = \"a\"\nfuse_mount = {mnt:?}\n"
    );
    let daemon = Daemon::start(&scratch, &config, &[&mnt]);
    for round in 0..2 {
        let added = rpc(&rpc_path, "export_add", json!({"export": {"tag": "vm-b", "device": b, "socket": socket}}));
        assert_eq!(added.expect("export_add through the supervisor")["tag"], "vm-b");
        write_and_read_back(&socket, &format!("f{round}"), format!("round {round}").as_bytes());
        // The image is locked while served.
        assert_ne!(fsck_repair(&b), 0, "the served image is locked against repair");
        rpc(&rpc_path, "export_remove", json!({"tag": "vm-b"})).expect("export_remove");
        assert!(!socket.exists(), "the supervisor removed the socket");
        assert_eq!(fsck(&b).0, 0, "vm-b after export_remove");
    }
    snapshot_served_through_the_supervisor(&rpc_path, &b, &allowed);
    let log = daemon.log();
    assert!(log.contains("serves a snapshot of this image here"), "the refusal's reason is logged:\n{log}");
    // The supervisor opens nothing outside export_dirs.
    let socket_c = allowed.join("c.sock");
    let refused =
        rpc(&rpc_path, "export_add", json!({"export": {"tag": "vm-c", "device": outside, "socket": socket_c}}));
    let message = refused.expect_err("an image outside export_dirs");
    assert!(message.contains("-32005") && message.contains("outside export_dirs"), "{message}");
    let refused =
        rpc(&rpc_path, "export_add", json!({"export": {"tag": "vm-c", "device": b, "socket": "/tmp/c.sock"}}));
    assert!(refused.expect_err("a socket outside export_dirs").contains("outside export_dirs"));
    assert!(!socket_c.exists() && !Path::new("/tmp/c.sock").exists());
    // Nor through a symlink inside them, nor over something already there.
    std::os::unix::fs::symlink(&outside, allowed.join("link.img")).unwrap();
    let via_link = json!({"export": {"tag": "vm-c", "device": allowed.join("link.img"), "socket": socket_c}});
    assert!(rpc(&rpc_path, "export_add", via_link).expect_err("a symlinked image").contains("-32005"));
    std::fs::write(&socket_c, b"not a socket").unwrap();
    let taken = rpc(&rpc_path, "export_add", json!({"export": {"tag": "vm-c", "device": b, "socket": socket_c}}));
    assert!(taken.expect_err("a taken socket path").contains("exists"));
    assert_eq!(std::fs::read(&socket_c).unwrap(), b"not a socket", "left alone");
    let list = rpc(&rpc_path, "export_list", json!({})).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 1, "only vol-a is left: {list}");
    daemon.stop();
    assert_eq!(fsck(&a).0, 0);
}

/// Read file `name` of the root through the vhost-user device at
/// `socket`: its first 4 KiB, or the errno.
fn read_named(socket: &Path, name: &str) -> Result<Vec<u8>, i32> {
    use keelfs_vhost::abi::{init_flags as f, Opcode, Reply};
    let mut fe = common::connect_frontend(socket);
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    let (err, reply) = fe.fuse(1, Opcode::Lookup, 1, &common::named(name)).unwrap();
    if err != 0 {
        return Err(err);
    }
    let node = u64::from_le_bytes(reply[..8].try_into().unwrap());
    if node == 0 {
        return Err(libc::ENOENT); // a negative entry, for the kernel to cache
    }
    let mut open = Reply::default();
    open.u32(libc::O_RDONLY as u32).u32(0);
    let (err, reply) = fe.fuse(1, Opcode::Open, node, &open.bytes).unwrap();
    assert_eq!(err, 0, "open {name}");
    let fh = u64::from_le_bytes(reply[..8].try_into().unwrap());
    common::read(&mut fe, (node, fh), 4096)
}

/// In the sandbox: a snapshot of the served image `b`, served beside it
/// on its device through a socket the supervisor binds alone.
fn snapshot_served_through_the_supervisor(rpc_path: &Path, b: &Path, allowed: &Path) {
    let (socket, snap_socket) = (allowed.join("b.sock"), allowed.join("b-snap.sock"));
    rpc(rpc_path, "export_add", json!({"export": {"tag": "vm-b", "device": b, "socket": socket}})).unwrap();
    write_and_read_back(&socket, "kept", b"before the snapshot");
    rpc(rpc_path, "snapshot_create", json!({"export": "vm-b", "name": "s"})).unwrap();
    write_and_read_back(&socket, "later", b"after it");
    let export = json!({"tag": "vm-b-s", "device": b, "read_only": true, "snapshot": "s", "socket": snap_socket});
    let added = rpc(rpc_path, "export_add", json!({"export": export}));
    assert_eq!(added.expect("a snapshot export through the supervisor")["tag"], "vm-b-s");
    assert_eq!(read_named(&snap_socket, "kept"), Ok(b"before the snapshot".to_vec()));
    assert_eq!(read_named(&snap_socket, "later"), Err(libc::ENOENT), "written after the snapshot");
    let busy = rpc(rpc_path, "snapshot_delete", json!({"export": "vm-b", "name": "s"}));
    assert!(busy.expect_err("a served snapshot").contains("-32003"));
    snapshot_pins_the_image_against_a_migration(rpc_path, &socket, &export);
    rpc(rpc_path, "snapshot_delete", json!({"export": "vm-b", "name": "s"})).expect("snapshot_delete");
    rpc(rpc_path, "export_remove", json!({"tag": "vm-b"})).expect("export_remove");
    assert_eq!(fsck(b).0, 0, "vm-b after its snapshot came and went");
}

/// While export vm-b-s (`snapshot_export`) serves a snapshot of vm-b's
/// image, vm-b cannot give the image up to a migration's destination,
/// which could delete the snapshot and reuse its blocks under the reader:
/// the save is refused and vm-b serves on. Once vm-b-s is gone the image
/// may move, and while it is away no snapshot of it is served here; a
/// failed migration takes it back. Leaves vm-b serving, vm-b-s removed.
fn snapshot_pins_the_image_against_a_migration(rpc_path: &Path, socket: &Path, snapshot_export: &Value) {
    use keelfs_vhost::abi::{init_flags as f, Opcode};
    let mut fe = common::connect_frontend(socket);
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    assert!(fe.save_state().is_err(), "a migration while a snapshot of the image is served here");
    drop(fe);
    write_and_read_back(socket, "after-refusal", b"still served");
    rpc(rpc_path, "export_remove", json!({"tag": "vm-b-s"})).expect("export_remove of the snapshot");
    assert!(!snapshot_export["socket"].as_str().map(Path::new).unwrap().exists(), "the snapshot's socket is gone");

    let mut fe = common::connect_frontend(socket);
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT).unwrap();
    fe.save_state().expect("the image moves once no snapshot of it is served");
    let away = rpc(rpc_path, "export_add", json!({"export": snapshot_export}));
    let message = away.expect_err("a snapshot of an image that is not here");
    assert!(message.contains("does not hold its image now"), "{message}");
    // The destination never took it: the source's rings restart and the
    // next request takes the image back.
    fe.resume_queues().unwrap();
    assert_eq!(fe.fuse(1, Opcode::Lookup, 1, &common::named("kept")).unwrap().0, 0);
    drop(fe);
    write_and_read_back(socket, "after-return", b"served again");
}

fn fsck_repair(image: &Path) -> i32 {
    keelfsd().arg("fsck").arg(image).arg("--repair").output().unwrap().status.code().unwrap_or(-1)
}

#[test]
fn quota_and_trim_over_rpc() {
    let scratch = Scratch::new("quota-trim-rpc");
    let (image, mnt, rpc_path) = (scratch.path("a.img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    mkfs(&image, "512M");
    let config = format!(
        "[daemon]\nrpc_socket = {rpc_path:?}\n[[device]]\nname = \"a\"\npath = {image:?}\n\
         [[export]]\ntag = \"vol-a\"\ndevice = \"a\"\nfuse_mount = {mnt:?}\ncache = \"none\"\n"
    );
    let daemon = Daemon::start(&scratch, &config, &[&mnt]);
    let statvfs_mib = || {
        let out = Command::new("stat").args(["-f", "-c", "%b %S"]).arg(&mnt).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let mut words = text.split_whitespace().map(|w| w.parse::<u64>().unwrap());
        (words.next().unwrap() * words.next().unwrap()) >> 20
    };
    assert!(statvfs_mib() > 400, "no quota yet: {} MiB", statvfs_mib());
    let set = rpc(&rpc_path, "export_set_quota", json!({"tag": "vol-a", "bytes": 64u64 << 20})).unwrap();
    assert_eq!(set["bytes"], 64u64 << 20);
    assert_eq!(statvfs_mib(), 64, "df shows the quota at once");
    let too_small = rpc(&rpc_path, "export_set_quota", json!({"tag": "vol-a", "bytes": 4096}));
    assert!(too_small.expect_err("a 4 KiB quota").contains("-32602"));

    // 48 MiB written and deleted: the image keeps its blocks until trimmed.
    let mut big = std::fs::File::create(mnt.join("big")).unwrap();
    std::io::Write::write_all(&mut big, &vec![7u8; 48 << 20]).unwrap();
    big.sync_all().unwrap();
    drop(big);
    let before = keelfs_base::testing::allocated_bytes(&image);
    std::fs::remove_file(mnt.join("big")).unwrap();
    std::fs::File::open(&mnt).unwrap().sync_all().unwrap();
    let trimmed = rpc(&rpc_path, "export_trim", json!({"tag": "vol-a"})).unwrap();
    let trimmed = trimmed["trimmed_bytes"].as_u64().unwrap();
    assert!(trimmed >= 40 << 20, "trimmed {trimmed} bytes");
    let after = keelfs_base::testing::allocated_bytes(&image);
    assert!(before.saturating_sub(after) >= 40 << 20, "allocated {before} before, {after} after");
    let stats = stats(&rpc_path);
    assert_eq!(stats["exports"][0]["space"]["quota_bytes"], 64u64 << 20);

    let lifted = rpc(&rpc_path, "export_set_quota", json!({"tag": "vol-a", "bytes": 0})).unwrap();
    assert!(lifted["bytes"].is_null());
    assert!(statvfs_mib() > 400);
    let missing = rpc(&rpc_path, "export_trim", json!({"tag": "nope"}));
    assert!(missing.expect_err("no such export").contains("-32001"));
    daemon.stop();
    assert_eq!(fsck(&image).0, 0);
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 253) as u8 ^ seed.wrapping_mul(41)).collect()
}

/// Snapshots over the RPC (issue 37): one taken while the export serves,
/// the live files changed afterwards, a restart, the snapshot served as a read-only
/// export beside it (sharing its device), and the guards: a served
/// snapshot cannot be deleted, nor the export under it removed.
#[test]
fn snapshots_over_rpc_are_served_beside_the_live_export() {
    let scratch = Scratch::new("snapshots-rpc");
    let (image, mnt, rpc_path) = (scratch.path("a.img"), scratch.path("mnt"), scratch.path("rpc.sock"));
    let snap_mnt = scratch.path("snap");
    std::fs::create_dir_all(&snap_mnt).unwrap();
    mkfs(&image, "256M");
    let config = format!(
        "[daemon]\nrpc_socket = {rpc_path:?}\nsandbox = \"none\"\n[[device]]\nname = \"a\"\npath = {image:?}\n\
         [[export]]\ntag = \"vol-a\"\ndevice = \"a\"\nfuse_mount = {mnt:?}\ncache = \"none\"\n"
    );
    let daemon = Daemon::start(&scratch, &config, &[&mnt]);
    std::fs::create_dir(mnt.join("d")).unwrap();
    std::fs::write(mnt.join("f"), pattern(1, 8 << 20)).unwrap();
    std::fs::write(mnt.join("d/g"), b"kept").unwrap();
    let made = rpc(&rpc_path, "snapshot_create", json!({"export": "vol-a", "name": "s1"})).unwrap();
    assert_eq!(made["name"], "s1");
    assert!(made["data_bytes"].as_u64().unwrap() >= 8 << 20, "{made}");
    let twice = rpc(&rpc_path, "snapshot_create", json!({"export": "vol-a", "name": "s1"}));
    assert!(twice.expect_err("a second s1").contains("exists"));
    let bad = rpc(&rpc_path, "snapshot_create", json!({"export": "vol-a", "name": "../x"}));
    assert!(bad.expect_err("a bad name").contains("-32602"));
    let nowhere = rpc(&rpc_path, "snapshot_create", json!({"export": "nope", "name": "s"}));
    assert!(nowhere.expect_err("no such export").contains("-32001"));

    // The live files change: the snapshot's blocks are copied on write.
    std::fs::write(mnt.join("f"), pattern(2, 8 << 20)).unwrap();
    std::fs::remove_file(mnt.join("d/g")).unwrap();
    std::fs::write(mnt.join("new"), b"after").unwrap();
    std::fs::File::open(&mnt).unwrap().sync_all().unwrap();
    // A restart keeps the snapshot: it lives on the image.
    daemon.stop();
    let daemon = Daemon::start(&scratch, &config, &[&mnt]);
    let list = rpc(&rpc_path, "snapshot_list", json!({"export": "vol-a"})).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert!(list[0]["exclusive_bytes"].as_u64().unwrap() >= 8 << 20, "{list}");
    let space = &stats(&rpc_path)["exports"][0]["space"];
    assert_eq!(space["snapshots"], 1);
    assert!(space["snapshot_held_bytes"].as_u64().unwrap() >= 8 << 20, "{space}");

    // Served read-only beside the live export, on its device.
    let export = json!({"tag": "vol-a-s1", "device": image, "read_only": true, "snapshot": "s1",
                        "fuse_mount": snap_mnt, "cache": "none"});
    rpc(&rpc_path, "export_add", json!({"export": export})).unwrap();
    assert!(std::fs::read(snap_mnt.join("f")).unwrap() == pattern(1, 8 << 20), "the snapshot's f changed");
    assert_eq!(std::fs::read(snap_mnt.join("d/g")).unwrap(), b"kept");
    assert!(!snap_mnt.join("new").exists());
    let refused = std::fs::write(snap_mnt.join("x"), b"no");
    assert_eq!(refused.unwrap_err().raw_os_error(), Some(libc::EROFS));
    assert!(std::fs::read(mnt.join("f")).unwrap() == pattern(2, 8 << 20), "the live f");

    let busy = rpc(&rpc_path, "snapshot_delete", json!({"export": "vol-a", "name": "s1"}));
    assert!(busy.expect_err("a served snapshot").contains("-32003"));
    let under = rpc(&rpc_path, "export_remove", json!({"tag": "vol-a"}));
    assert!(under.expect_err("the export under a snapshot export").contains("vol-a-s1"));
    rpc(&rpc_path, "export_remove", json!({"tag": "vol-a-s1"})).unwrap();
    let deleted = rpc(&rpc_path, "snapshot_delete", json!({"export": "vol-a", "name": "s1"})).unwrap();
    assert_eq!(deleted["deleted"], true);
    assert_eq!(rpc(&rpc_path, "snapshot_list", json!({"export": "vol-a"})).unwrap(), json!([]));
    assert_eq!(stats(&rpc_path)["exports"][0]["space"]["snapshot_held_bytes"], 0);
    daemon.stop();
    assert_eq!(fsck(&image).0, 0);
}
