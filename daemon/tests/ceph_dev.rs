//! scripts/ceph-dev.sh's one-node Ceph cluster, which the RBD backend's
//! tests use: `up` (idempotent; quick when the cluster is already up)
//! leaves it HEALTH_OK with pool `keelfs` of one replica, and a network
//! namespace made by `host add` reaches it as another machine would, with
//! the restricted client.keelfs creating and removing an image. These
//! tests fail, never skip, when the cluster cannot come up (run
//! scripts/setup.sh). They never call `down`: other tests share the
//! cluster.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ceph-dev.sh")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env_remove("CEPH_ARGS")
        .output()
        .unwrap_or_else(|e| panic!("{program} ({e}) is missing: run scripts/setup.sh"))
}

/// Runs PROGRAM ARGS and returns its stdout, failing the test (with what
/// it said) when it fails.
fn ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    assert!(out.status.success(), "{program} {} failed ({}):\n{}", args.join(" "), out.status, text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ceph_dev(args: &[&str]) -> Output {
    run("bash", &[&[script().to_str().unwrap()], args].concat())
}

/// `ceph-dev.sh up`, which must succeed.
fn up() {
    let out = ceph_dev(&["up"]);
    assert!(out.status.success(), "scripts/ceph-dev.sh up failed ({}):\n{}", out.status, text(&out));
}

/// Client options that bound every wait (librados waits 300 s for a
/// monitor by default).
const BOUNDED: &[&str] =
    &["--client_mount_timeout", "10", "--rados_mon_op_timeout", "10", "--rados_osd_op_timeout", "30"];

#[test]
fn up_leaves_the_cluster_healthy_with_pool_keelfs_of_one_replica() {
    up();
    let health = ok("ceph", &["--connect-timeout", "10", "health"]);
    assert_eq!(health.trim(), "HEALTH_OK");
    let size = ok("ceph", &["--connect-timeout", "10", "osd", "pool", "get", "keelfs", "size"]);
    assert_eq!(size.trim(), "size: 1");
    let apps = ok("ceph", &["--connect-timeout", "10", "osd", "pool", "application", "get", "keelfs"]);
    assert!(apps.contains("\"rbd\""), "pool keelfs is not an rbd pool: {apps}");
    // A second up finds it up and says so.
    let again = ceph_dev(&["up"]);
    assert!(again.status.success(), "{}", text(&again));
    assert!(text(&again).contains("already up"), "{}", text(&again));
}

/// A namespace made by `host add`; dropping it removes it (`host del`),
/// also when an assertion failed.
struct Host {
    name: String,
    deleted: bool,
}

impl Host {
    /// Adds host NAME on the first free address of 10.87.0.100-249,
    /// starting at one picked by the pid: tests of another run may hold
    /// some.
    fn add(name: &str) -> Host {
        let first = std::process::id() % 150;
        for i in 0..20 {
            let addr = format!("10.87.0.{}", 100 + (first + i) % 150);
            let out = ceph_dev(&["host", "add", name, &addr]);
            if out.status.success() {
                return Host { name: name.to_string(), deleted: false };
            }
            assert!(text(&out).contains("is taken"), "host add {name} {addr} failed ({}):\n{}", out.status, text(&out));
        }
        panic!("host add {name}: no free address");
    }

    /// Runs PROGRAM ARGS in the namespace; see ok().
    fn ok(&self, program: &str, args: &[&str]) -> String {
        ok("ip", &[&["netns", "exec", &self.name, program], args].concat())
    }

    /// `host del`, which must succeed.
    fn del(mut self) {
        self.deleted = true;
        let out = ceph_dev(&["host", "del", &self.name]);
        assert!(out.status.success(), "host del {}: {}", self.name, text(&out));
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if !self.deleted {
            let _ = ceph_dev(&["host", "del", &self.name]);
        }
    }
}

fn namespaces() -> String {
    ok("ip", &["netns", "list"])
}

#[test]
fn a_host_namespace_reaches_the_cluster_and_client_keelfs_makes_an_image() {
    up();
    let pid = std::process::id();
    let name = format!("keelfs-cephtest-{pid}");
    let host = Host::add(&name);
    assert!(namespaces().lines().any(|l| l.split_whitespace().next() == Some(&name)), "{}", namespaces());

    // The monitor, through the bridge.
    let status = host.ok("ceph", &["--connect-timeout", "10", "-s"]);
    assert!(status.contains("HEALTH_OK") && status.contains("quorum a"), "ceph -s in {name}:\n{status}");

    // client.keelfs (its own keyring in /etc/ceph): create, see, remove.
    let image = format!("keelfs/cephtest-{pid}");
    let rbd = |args: &[&str]| host.ok("rbd", &[&["--id", "keelfs"], BOUNDED, args].concat());
    rbd(&["create", "--size", "64M", &image]);
    let info = rbd(&["info", &image]);
    assert!(info.contains("size 64 MiB"), "rbd info {image}:\n{info}");
    rbd(&["rm", "--no-progress", &image]);
    let images = rbd(&["ls", "keelfs"]);
    assert!(!images.lines().any(|l| format!("keelfs/{l}") == image), "{image} is still there: {images}");

    host.del();
    assert!(!namespaces().lines().any(|l| l.split_whitespace().next() == Some(&name)), "{}", namespaces());
}
