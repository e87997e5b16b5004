//! keelfs-bench's command line prints the promised JSON and rejects bad
//! arguments with a clear message.

use std::path::Path;
use std::process::Command;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_keelfs-bench"))
}

fn scratch(tag: &str) -> std::path::PathBuf {
    let dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
    dir.join(format!("keelfs-bench-test-{tag}-{}", std::process::id()))
}

#[test]
fn bdev_prints_one_json_line_with_the_fio_ratio() {
    let path = scratch("bdev");
    for (backend, rw) in [("uring", "randread"), ("uring", "write"), ("pmem", "randwrite")] {
        let out = bench()
            .args(["bdev", "--backend", backend, "--size", "64M", "--rw", rw, "--bs", "4k", "--iodepth", "8"])
            .args(["--seconds", "1", "--vs-fio", "--json", "--path"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), 1, "one JSON object per result line: {stdout}");
        let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        for key in ["iops", "mib_s", "lat_us_p50", "lat_us_p99", "fio_iops", "ratio_vs_fio"] {
            assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{backend} {rw}: {key} missing or zero in {v}");
        }
        let ratio = v["iops"].as_f64().unwrap() / v["fio_iops"].as_f64().unwrap();
        assert!((ratio - v["ratio_vs_fio"].as_f64().unwrap()).abs() < 0.01);
        assert!(v["lat_us_p50"].as_f64() <= v["lat_us_p99"].as_f64());
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn bad_arguments_fail_with_a_message() {
    let path = scratch("bad");
    let out = bench()
        .args(["bdev", "--backend", "uring", "--bs", "1000", "--seconds", "1", "--path"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--bs must be a multiple of 512"));
    let out = bench().args(["bdev", "--backend", "uring", "--size", "12q", "--path"]).arg(&path).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown size suffix"));
    let refused: &[(&[&str], &str)] = &[
        (&["--backend", "uring", "--rw", "randread", "--step", "8k"], "--step is for --rw read or write"),
        (&["--backend", "uring", "--rw", "write", "--step", "6k"], "--step must be a non-zero multiple of --bs"),
        (&["--backend", "uring", "--rw", "read", "--vs-qemu-img", "rbd:p/i"], "--vs-qemu-img is the peer of"),
        (&["--backend", "rbd", "--rw", "randread", "--vs-qemu-img", "rbd:p/i"], "qemu-img bench cannot do random"),
        (&["--backend", "rbd", "--vs-fio"], "with --backend rbd use --vs-qemu-img"),
    ];
    for (args, message) in refused {
        let out = bench().arg("bdev").args(*args).args(["--seconds", "1", "--path"]).arg(&path).output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_file(&path);
}

/// --step walks the device as qemu-img bench's --step-size does,
/// --wait eventfd sleeps on the queue's eventfd between completions, and
/// --count bounds the requests.
#[test]
fn bdev_steps_through_the_device_and_can_sleep() {
    let path = scratch("step");
    let out = bench()
        .args(["bdev", "--backend", "uring", "--size", "16M", "--rw", "write", "--bs", "4k", "--step", "1028k"])
        .args(["--iodepth", "4", "--seconds", "5", "--count", "1000", "--wait", "eventfd", "--json", "--path"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["step"], 1028 << 10, "{v}");
    assert_eq!(v["wait"], "eventfd", "{v}");
    assert_eq!(v["ios"], 1000, "{v}");
    assert!(v["iops"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn core_workloads_print_their_figures() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["--workload", "dio-overwrite", "--file-size", "16M", "--threads", "2"], &["iops", "direct_overwrites"]),
        (&["--workload", "aio-append", "--file-size", "64M", "--iodepth", "8"], &["iops", "direct_in_flight_max"]),
        (
            &["--workload", "buffered-randrw", "--file-size", "16M"],
            &["read_only_iops", "mixed_read_iops", "mixed_read_ratio"],
        ),
        (&["--workload", "fsync-storm", "--threads", "8"], &["fsyncs", "device_flushes"]),
        (
            &["--workload", "lookup", "--entries", "2000", "--lookups", "1000", "--rounds", "1"],
            &["ns_per_lookup_large"],
        ),
    ];
    for (args, keys) in cases {
        let out = bench()
            .args(["core", "--backend", "mem", "--size", "256M", "--seconds", "1", "--json"])
            .args(*args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for key in *keys {
            assert!(v[key].as_f64().is_some(), "{args:?}: {key} missing in {v}");
        }
        if args[1] == "dio-overwrite" {
            assert_eq!(v["during_run"]["records_logged"], 0, "overwrites logged records: {v}");
            assert!(v["direct_overwrites"].as_u64().unwrap() > 0);
        }
        if args[1] == "aio-append" {
            assert_eq!(v["direct_in_flight_max"], 8);
        }
    }
}

/// A keelfs vhost-user-fs device served from this process, on a RAM
/// device, until stopped.
struct InProcessDaemon {
    socket: std::path::PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl InProcessDaemon {
    fn start(tag: &str) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;

        use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
        use keelfs_fs::{mkfs, MkfsOptions};
        use keelfs_fs::{Fs, FsConfig};
        use keelfs_reactor::DeviceChannel;
        use keelfs_reactor::{self as reactor, Reactor, ReactorConfig};
        use keelfs_vhost::SessionConfig;
        use keelfs_vhost::VhostUserServer;

        let socket = scratch(tag);
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let (socket, stop) = (socket.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
                let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(256 << 20, 4096).unwrap());
                reactor.block_on(async move {
                    let ch = || DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
                    mkfs(ch(), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
                    let fs = Fs::mount(ch(), FsConfig::default()).await.unwrap();
                    let server = VhostUserServer::start(fs.clone(), SessionConfig::default(), &socket, 2).unwrap();
                    ready_tx.send(()).unwrap();
                    while !stop.load(Ordering::Acquire) {
                        reactor::sleep(std::time::Duration::from_millis(2)).await;
                    }
                    server.stop().await;
                    fs.unmount().await.unwrap();
                });
            })
        };
        ready_rx.recv().unwrap();
        Self { socket, stop, thread }
    }

    fn stop(self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.thread.join().unwrap();
    }
}

/// The vhost load generator against an in-process keelfs vhost-user-fs
/// device: every workload runs and reports the promised fields.
#[test]
fn vhost_drives_a_vhost_user_fs_daemon_and_reports_iops_and_latency() {
    let daemon = InProcessDaemon::start("vhost.sock");
    let socket = daemon.socket.clone();
    // (workload, threads, driver flags, the driver reported)
    for (workload, threads, driver, kind) in [
        ("dio-overwrite", "2", &["--driver", "busy"][..], "busy"),
        ("dio-overwrite", "1", &[][..], "sleep"),
        ("dio-randrw", "1", &["--driver", "sleep"][..], "sleep"),
        ("aio-append", "1", &[][..], "sleep"),
        ("buffered-randrw", "1", &["--driver", "busy"][..], "busy"),
        ("byte-writes", "1", &["--spin"][..], "busy"),
    ] {
        let out = bench()
            .args(["vhost", "--workload", workload, "--threads", threads, "--iodepth", "4", "--seconds", "1"])
            .args(["--file-size", "4M", "--json", "--socket"])
            .arg(&socket)
            .args(driver)
            .output()
            .unwrap();
        assert!(out.status.success(), "{workload}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for key in ["iops", "read_iops", "write_iops", "mib_s", "lat_us_p50", "lat_us_p99", "lat_us_p999"] {
            assert!(v[key].as_f64().is_some(), "{workload}: {key} missing in {v}");
        }
        for key in ["bench_cpu_us_per_op", "machine_cpu_us_per_op", "driver_cpu_share"] {
            assert!(v[key].as_f64().unwrap() > 0.0, "{workload}: {key} in {v}");
        }
        assert_eq!(v["driver"], kind, "{v}");
        assert_eq!(v["driver_waits"], if kind == "sleep" { "eventfd" } else { "spin" }, "{v}");
        assert_eq!(v["threads"].as_u64(), threads.parse().ok(), "{v}");
        assert!(v.get("daemon_cpu_share").is_none(), "no daemon pid given, no daemon charged: {v}");
        assert!(v["iops"].as_f64().unwrap() > 0.0, "{workload}: {v}");
        let mixed = matches!(workload, "dio-randrw" | "buffered-randrw");
        assert_eq!(v["read_iops"].as_f64().unwrap() > 0.0, mixed, "{workload}: {v}");
    }
    busy_driver_and_daemon_are_charged_apart(&socket);
    daemon.stop();
}

/// Run `command`: its JSON line, or what it said on stderr when it failed.
fn json_line_or_error(command: &mut Command) -> Result<serde_json::Value, String> {
    let out = command.output().unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&out.stdout).unwrap())
}

/// The metadata workloads as phases over one tree, against an
/// in-process keelfs device: each counts what it promises, and unlink
/// leaves nothing behind.
#[test]
fn vhost_metadata_workloads_make_read_and_remove_a_tree() {
    let daemon = InProcessDaemon::start("vhost-meta.sock");
    let run = |workload: &str, extra: &[&str]| {
        json_line_or_error(
            bench()
                .args(["vhost", "--workload", workload, "--threads", "2", "--iodepth", "3", "--seconds", "1"])
                .args(["--json", "--socket"])
                .arg(&daemon.socket)
                .args(extra),
        )
    };
    for tree in ["wide", "deep"] {
        let shape = ["--files", "1100", "--tree", tree];
        let missing = run("stat", &shape).unwrap_err();
        assert!(missing.contains("run --workload create"), "{tree}: {missing}");
        let made = run("create", &shape).unwrap();
        assert_eq!(made["ops"], 2 * 1100, "{tree}: a file per op, 1100 per thread: {made}");
        let per_op = made["requests_per_op"].as_f64().unwrap();
        // keelfs answers opens with FOPEN_NOFLUSH, so the driver, as Linux
        // without the writeback cache, sends no FLUSH at close.
        assert!((3.0..3.1).contains(&per_op), "CREATE, WRITE, RELEASE and a share of forgets: {made}");
        let cold = run("stat", &[&shape[..], &["--passes", "1"]].concat()).unwrap();
        assert_eq!(cold["ops"], 2 * 1100, "one pass over both trees: {cold}");
        let warm = run("stat", &[&shape[..], &["--driver", "busy"]].concat()).unwrap();
        assert!(warm["ops"].as_u64().unwrap() > 0 && warm["driver"] == "busy", "{warm}");
        let listed = run("readdirplus", &[&shape[..], &["--passes", "1"]].concat()).unwrap();
        let dirs = if tree == "wide" { 2 } else { 1100_u64.div_ceil(16) };
        assert_eq!(listed["ops"], 2 * dirs, "{tree}: each directory listed once: {listed}");
        assert!(listed["entries_s"].as_f64().unwrap() > 0.0, "{listed}");
        let read = run("open-read-close", &shape).unwrap();
        let per_op = read["requests_per_op"].as_f64().unwrap();
        assert!((3.0..3.1).contains(&per_op), "OPEN, READ, RELEASE: {read}");
        let gone = run("unlink", &shape).unwrap();
        assert_eq!(gone["ops"], 2 * 1100, "{gone}");
        let after = run("stat", &shape).unwrap_err();
        assert!(after.contains("is missing"), "unlink removed the directories too: {after}");
    }
    for storm in ["rename", "mkdir-rmdir"] {
        let v = run(storm, &[]).unwrap();
        assert!(v["iops"].as_f64().unwrap() > 0.0, "{storm}: {v}");
        let again = run(storm, &[]).unwrap();
        assert!(again["ops"].as_u64().unwrap() > 0, "{storm} runs again over what it left: {again}");
    }
    daemon.stop();
}

/// The mixed profile: the committed trace of a real untar, stat, read
/// and removal (bench/workloads/untar-libc.trace.xz) replays against an
/// in-process keelfs twice over (it leaves the tree as it found it), every
/// request with the outcome it had when recorded.
#[test]
fn vhost_trace_replays_a_recorded_untar_with_the_recorded_outcomes() {
    let xz = Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads/untar-libc.trace.xz");
    let out = Command::new("xz").arg("-dc").arg(&xz).output().expect("xz (scripts/setup.sh installs xz-utils)");
    assert!(out.status.success(), "xz -dc {}", xz.display());
    let trace = scratch("untar.trace");
    std::fs::write(&trace, &out.stdout).unwrap();
    let daemon = InProcessDaemon::start("vhost-trace.sock");
    let replayed = json_line_or_error(
        bench()
            .args(["vhost", "--workload", "trace", "--passes", "2", "--json", "--trace"])
            .arg(&trace)
            .arg("--socket")
            .arg(&daemon.socket),
    )
    .unwrap();
    assert_eq!(replayed["passes"], 2, "{replayed}");
    assert_eq!(replayed["divergent"], 0, "keelfs answers as it did when recorded: {replayed}");
    let per_pass = replayed["requests_per_pass"].as_u64().unwrap();
    assert!(per_pass > 10_000, "452 files untarred, listed, read and removed: {replayed}");
    assert_eq!(replayed["ops"].as_u64(), Some(2 * per_pass), "an operation is a request: {replayed}");
    let refused = json_line_or_error(bench().args(["vhost", "--workload", "trace", "--socket"]).arg(&daemon.socket));
    assert!(refused.unwrap_err().contains("--trace FILE"), "a trace workload needs its trace");
    daemon.stop();
    std::fs::remove_file(&trace).unwrap();
}

/// posix-meta runs the same phases through system calls on a directory:
/// each counts what it promises, and unlink leaves the directory empty.
#[test]
fn posix_metadata_workloads_make_read_and_remove_a_tree() {
    let dir = scratch("posix-meta");
    std::fs::create_dir_all(&dir).unwrap();
    let run = |workload: &str, extra: &[&str]| {
        json_line_or_error(
            bench()
                .args(["posix-meta", "--workload", workload, "--threads", "2", "--seconds", "1", "--files", "1100"])
                .args(["--tree", "deep", "--json", "--dir"])
                .arg(&dir)
                .args(extra),
        )
    };
    let missing = run("stat", &[]).unwrap_err();
    assert!(missing.contains("run --workload create"), "{missing}");
    assert_eq!(run("create", &[]).unwrap()["ops"], 2 * 1100);
    assert_eq!(run("stat", &["--passes", "1"]).unwrap()["ops"], 2 * 1100);
    assert_eq!(run("readdir", &["--passes", "1"]).unwrap()["ops"], 2 * 1100_u64.div_ceil(16));
    let read = run("open-read-close", &[]).unwrap();
    assert!(read["ops"].as_u64().unwrap() > 0 && read["bench_cpu_us_per_op"].as_f64().is_some(), "{read}");
    for storm in ["rename", "mkdir-rmdir"] {
        assert!(run(storm, &[]).unwrap()["iops"].as_f64().unwrap() > 0.0, "{storm}");
    }
    assert_eq!(run("unlink", &[]).unwrap()["ops"], 2 * 1100);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "the trees and storms are gone");
    std::fs::remove_dir(&dir).unwrap();
}

/// A busy driver beside a daemon (here the test process, whose reactor
/// thread serves on `socket`): each is charged its own CPU.
fn busy_driver_and_daemon_are_charged_apart(socket: &std::path::Path) {
    let out = bench()
        .args(["vhost", "--workload", "dio-randrw", "--driver", "busy", "--iodepth", "4", "--seconds", "1"])
        .args(["--file-size", "4M", "--json", "--daemon-pid", &std::process::id().to_string(), "--socket"])
        .arg(socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["driver"], "busy", "{v}");
    for key in ["bench_cpu_us_per_op", "driver_cpu_share", "daemon_cpu_us_per_op", "daemon_cpu_share"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key} in {v}");
    }
    assert!(v["other_cpu_us_per_op"].as_f64().is_some(), "{v}");
}

/// Every subcommand runs with its defaults: only what it cannot default
/// (a path, a workload, a socket) and a short run are given. core sizes
/// its device from the workload unless --size says otherwise.
#[test]
fn every_core_workload_runs_with_a_default_device() {
    for workload in
        ["lookup", "dio-overwrite", "aio-append", "buffered-randrw", "byte-writes", "seq-extents", "fsync-storm"]
    {
        // Small files, few operations: a smoke run, not a measurement.
        let small: &[&str] = match workload {
            "lookup" => &["--entries", "2000", "--lookups", "1000", "--rounds", "1"],
            "byte-writes" => &["--writes", "2000"],
            _ => &["--file-size", "16M"],
        };
        let out = bench()
            .args(["core", "--workload", workload, "--seconds", "1", "--json"])
            .args(small)
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{workload}: {stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["workload"], workload, "{v}");
        assert_eq!(v["backend"], "mem", "the default backend: {v}");
    }
}

#[test]
fn seq_extents_on_its_default_device_writes_one_extent_per_file() {
    // seq-extents writes its file twice; the old fixed 2 GiB device ran
    // out of space at its own defaults.
    let out = bench().args(["core", "--workload", "seq-extents", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["extents"], 1, "{v}");
}

#[test]
fn a_device_too_small_for_the_workload_is_refused_in_one_line() {
    let out = bench()
        .args(["core", "--workload", "seq-extents", "--size", "64M", "--json"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "one line, no backtrace: {stderr}");
    assert!(stderr.contains("--size 64 MiB is too small for --workload seq-extents"), "{stderr}");
}

#[test]
fn bdev_and_bdev_check_run_with_their_defaults() {
    // bdev-check needs 128 MiB; bdev makes the file that size.
    let path = scratch("defaults");
    let out = bench()
        .args(["bdev", "--backend", "uring", "--size", "128M", "--seconds", "1", "--json", "--path"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "bdev: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["iops"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    let out = bench().args(["bdev-check", "--json", "--path"]).arg(&path).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bdev-check: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    let checks: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(checks.len() >= 3, "{stdout}");
    assert!(checks.iter().all(|c| c["ok"] == true), "{stdout}");
    let _ = std::fs::remove_file(&path);
}

/// metadata-fill leaves an image that metadata-mount (another process)
/// mounts, and both report what the issue asks of them.
#[test]
fn metadata_fill_then_mount_report_memory_time_and_checkpoint() {
    let path = scratch("metadata");
    let run = |workload: &str| {
        let out = bench()
            .args(["core", "--workload", workload, "--backend", "uring", "--entries", "2500", "--json", "--path"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{workload}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let fill = run("metadata-fill");
    assert_eq!(fill["files"], 2500, "{fill}");
    assert_eq!(fill["directories"], 3, "{fill}");
    // What the image holds is exact; what the clock and the allocator
    // show is only reported: at 2,500 files the resident size may not
    // move past what earlier work left free (it did not once in CI:
    // 0 bytes per file), and a checkpoint this small may round to 0 s.
    assert!(fill["checkpoint_bytes_per_file"].as_f64().unwrap() > 0.0, "{fill}");
    for key in ["files_created_per_s", "checkpoint_s", "rss_bytes_per_file"] {
        assert!(fill[key].as_f64().is_some_and(|v| v >= 0.0), "{key} in {fill}");
    }
    let mount = run("metadata-mount");
    // The files, their 3 directories and the root.
    assert_eq!(mount["inodes"], 2504, "{mount}");
    assert_eq!(mount["replayed_transactions"], 0, "a clean unmount left nothing to replay: {mount}");
    assert!(mount["mount_s"].as_f64().is_some_and(|v| v >= 0.0), "{mount}");
    let _ = std::fs::remove_file(&path);
}

/// RESULTS.md's headline tables are what bench/headline.py makes of the
/// raw files they name: nobody edits a figure there by hand.
#[test]
fn results_headline_tables_are_generated_from_raw_results() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = Command::new("python3")
        .args(["bench/headline.py", "--check", "bench/RESULTS.md"])
        .current_dir(repo)
        .output()
        .expect("python3 runs bench/headline.py");
    assert!(
        out.status.success(),
        "{}{}\nregenerate with: bench/headline.py --update bench/RESULTS.md",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `crc` checks the crate's crc32c against a table crc32c on the blocks it
/// measures (and fails if they disagree), then prints one JSON line with
/// the per-block costs and their ratios; absurd sizes are refused.
#[test]
fn crc_reports_the_cost_of_a_block_checksum_against_its_peers() {
    let out = bench().args(["crc", "--mib", "2", "--rounds", "1", "--label", "t", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
    assert_eq!(line["bench"], "crc");
    assert_eq!(line["label"], "t");
    assert_eq!(line["block_bytes"], 4096);
    assert!(line["sse42"].is_boolean(), "{line}");
    for field in [
        "crc_ns_per_block",
        "copy_ns_per_block",
        "table_crc_ns_per_block",
        "crc_over_copy",
        "table_over_crc",
        "in_place_ns_per_block",
        "in_place_gb_per_cpu_s",
        "in_place_over_crate",
    ] {
        assert!(line[field].is_number(), "{field}: {line}");
    }
    // Every way this CPU has is timed, the copying one always, and the
    // daemon's way is one of them.
    let ways = line["ways_ns_per_block"].as_object().expect("ways_ns_per_block");
    assert!(ways["by_copy"].is_number(), "{line}");
    let way = line["in_place_way"].as_str().expect("in_place_way");
    assert_eq!(ways[way], line["in_place_ns_per_block"], "{line}");
    for (args, message) in
        [(["--mib", "0"], "--mib must be 1 to 4096"), (["--rounds", "0"], "--rounds must be 1 to 100")]
    {
        let out = bench().arg("crc").args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(String::from_utf8_lossy(&out.stderr).contains(message), "{}", String::from_utf8_lossy(&out.stderr));
    }
}
