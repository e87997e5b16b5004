//! keelfs-bench's command line prints the promised JSON and rejects bad
//! arguments with a clear message.

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
