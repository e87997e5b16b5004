//! QoS per export through the host mount: two exports on ONE reactor,
//! each with a FUSE mount, export A limited to 5000 IOPS by its config.
//! fio reads from both at once.
//!
//! What a limiter admits, and when, is asserted exactly in virtual time
//! (the limiter's unit tests and vhost/tests/qos.rs): no test here asserts
//! a rate measured by the wall clock on a shared machine. This run shows
//! the rest, end to end: the config key and the control API reach the
//! limiter of the right export, its held requests hold neither the other
//! export nor the reactor awake, and a limit lifted at run time lets every
//! request through. How close A comes to its limit, and what B keeps
//! beside it, is measured by `bench/run-qos.sh` (bench/RESULTS.md).
//!
//! fio is required (scripts/setup.sh installs it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

mod common;
use common::{keelfsd, mkfs, Scratch, Served};

const LIMIT_IOPS: u64 = 5000;
/// The limit export_set_qos sets afterwards.
const RUNTIME_LIMIT_IOPS: u64 = 2000;
const RUNTIME_S: u64 = 4;

fn fio() -> PathBuf {
    let found =
        std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join("fio")).find(|c| c.exists()));
    // Fail, not skip: without fio this test would prove nothing.
    found.expect("fio is not installed: run scripts/setup.sh")
}

/// fio's 4 KiB direct random reads on `file`, running.
fn start_fio(name: &str, file: &Path) -> Child {
    Command::new(fio())
        .arg(format!("--name={name}"))
        .arg(format!("--filename={}", file.display()))
        .args(["--size=128M", "--rw=randread", "--bs=4k", "--direct=1", "--ioengine=libaio", "--iodepth=16"])
        .args(["--time_based", &format!("--runtime={RUNTIME_S}")])
        .arg("--output-format=json")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting fio")
}

/// The read IOPS a finished fio reports.
fn fio_iops(child: Child) -> f64 {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "fio failed: {text}\n{}", String::from_utf8_lossy(&out.stderr));
    // fio may print notes before its JSON.
    let json: Value = serde_json::from_str(&text[text.find('{').expect("fio's JSON")..]).expect("fio's JSON");
    json["jobs"][0]["read"]["iops"].as_f64().expect("jobs[0].read.iops")
}

/// `keelfsd stats`.
fn stats(rpc: &Path) -> Value {
    let out = keelfsd().args(["stats", "--rpc"]).arg(rpc).output().unwrap();
    assert!(out.status.success(), "keelfsd stats: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn export_of<'a>(stats: &'a Value, tag: &str) -> &'a Value {
    stats["exports"].as_array().expect("exports").iter().find(|e| e["tag"] == tag).expect("the export in the stats")
}

fn sleeps(stats: &Value) -> u64 {
    stats["reactors"][0]["sleeps"].as_u64().unwrap()
}

fn fuse_reads(export: &Value) -> u64 {
    export["fuse_mount_ops"]["read"]["requests"].as_u64().unwrap_or(0)
}

/// Reads held by an export's limiter so far.
fn deferred_reads(export: &Value) -> u64 {
    export["qos"]["deferred"]["read"].as_u64().unwrap_or(0)
}

/// A 128 MiB file of data (not a hole) on the mount, written in 1 MiB
/// requests so that A's limit hardly slows it.
fn lay_out(file: &Path) {
    let status = Command::new("dd")
        .args(["if=/dev/urandom", "bs=1M", "count=128", "oflag=direct", "status=none"])
        .arg(format!("of={}", file.display()))
        .status()
        .unwrap();
    assert!(status.success(), "writing {}", file.display());
}

fn config(dir: &Scratch, images: [&Path; 2], mounts: [&Path; 2]) -> PathBuf {
    let rpc = dir.path("rpc.sock");
    let text = format!(
        r#"
[daemon]
reactors = 1
rpc_socket = "{rpc}"

[[device]]
name = "a"
path = "{a}"

[[device]]
name = "b"
path = "{b}"

[[export]]
tag = "a"
device = "a"
fuse_mount = "{ma}"
cache = "none"

[export.qos]
iops = 5000

[[export]]
tag = "b"
device = "b"
fuse_mount = "{mb}"
cache = "none"
"#,
        rpc = rpc.display(),
        a = images[0].display(),
        b = images[1].display(),
        ma = mounts[0].display(),
        mb = mounts[1].display(),
    );
    let path = dir.path("keelfsd.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Images removed however the test ends.
struct Images([PathBuf; 2]);

impl Drop for Images {
    fn drop(&mut self) {
        for image in &self.0 {
            let _ = std::fs::remove_file(image);
        }
    }
}

/// `keelfsd rpc export_set_qos` on export a.
fn set_iops(rpc: &Path, iops: u64) {
    let params = format!("{{\"tag\": \"a\", \"iops\": {iops}}}");
    let set = keelfsd().args(["rpc", "export_set_qos", &params, "--rpc"]).arg(rpc).output().unwrap();
    assert!(set.status.success(), "export_set_qos: {}", String::from_utf8_lossy(&set.stderr));
}

/// fio on A and on B at once: A's IOPS, B's, and the daemon's counters
/// before and after.
fn together(rpc: &Path, (fa, fb): (&Path, &Path)) -> (f64, f64, (Value, Value)) {
    let before = stats(rpc);
    let (a, b) = (start_fio("a", fa), start_fio("b", fb));
    let (a, b) = (fio_iops(a), fio_iops(b));
    (a, b, (before, stats(rpc)))
}

#[test]
fn a_limited_export_is_held_and_leaves_its_reactor_to_the_other() {
    fio();
    let dir = Scratch::new("qos");
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let images = Images([0, 1].map(|i| base.join(format!("keelfsd-qos-{}-{i}.img", std::process::id()))));
    for image in &images.0 {
        mkfs(image, "1G");
    }
    let (ma, mb) = (dir.path("a"), dir.path("b"));
    let config = config(&dir, [&images.0[0], &images.0[1]], [&ma, &mb]);
    let served = Served::start(&["--config".as_ref(), config.as_os_str()], &[&ma, &mb]);
    let rpc = dir.path("rpc.sock");
    let (fa, fb) = (ma.join("f"), mb.join("f"));
    lay_out(&fa);
    lay_out(&fb);

    // A alone: held requests wait on a timer, so the reactor, with nothing
    // else to do, sleeps between A's batches (one kept polling by them
    // would never sleep).
    let before = stats(&rpc);
    let a_alone = fio_iops(start_fio("a", &fa));
    let after = stats(&rpc);
    eprintln!("A alone, limited to {LIMIT_IOPS}: {a_alone:.0} IOPS");
    assert!(deferred_reads(export_of(&after, "a")) > 0, "A's reads were held");
    assert!(sleeps(&after) > sleeps(&before), "the reactor never slept while A alone was held");

    let (a_iops, b_iops, (before, after)) = together(&rpc, (&fa, &fb));
    let (a, b) = (export_of(&after, "a"), export_of(&after, "b"));
    let a_reads = fuse_reads(a) - fuse_reads(export_of(&before, "a"));
    eprintln!("A limited to {LIMIT_IOPS}: {a_iops:.0} IOPS ({a_reads} READs seen); B beside it: {b_iops:.0} IOPS");
    assert_eq!(a["qos"]["iops"].as_u64(), Some(LIMIT_IOPS), "the config's limit: {}", a["qos"]);
    assert!(deferred_reads(a) > 0, "A's reads were held: {}", a["qos"]);
    assert!(a_reads > 0, "A's fio reached keelfsd: its reads were FUSE READs, not a page cache's");
    assert_eq!(deferred_reads(b), 0, "B's reads were never held: {}", b["qos"]);
    assert!(b_iops > 0.0);

    // A limit set over the control API reaches the limiter, and one lifted
    // lets every request through.
    set_iops(&rpc, RUNTIME_LIMIT_IOPS);
    assert_eq!(export_of(&stats(&rpc), "a")["qos"]["iops"].as_u64(), Some(RUNTIME_LIMIT_IOPS));
    set_iops(&rpc, 0);
    let held_before = deferred_reads(export_of(&stats(&rpc), "a"));
    let before = stats(&rpc);
    fio_iops(start_fio("a", &fa));
    let after = stats(&rpc);
    let a_reads = fuse_reads(export_of(&after, "a")) - fuse_reads(export_of(&before, "a"));
    assert!(a_reads > 0, "A served reads with its limit lifted");
    assert_eq!(deferred_reads(export_of(&after, "a")), held_before, "a lifted limit holds nothing");
    assert!(served.stop().success(), "keelfsd shut down cleanly");
}
