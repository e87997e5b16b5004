//! contrib/keelfsd.service is hardened (issue 16) and stays loadable, alone
//! and with its drop-ins in contrib/keelfsd.service.d (issue 32):
//! - systemd accepts every directive of the unit and of each drop-in, and
//!   reports a broken drop-in (so the check really reads them);
//! - `systemd-analyze security` rates the unit 3.0 or better, and the unit
//!   with drop-ins no worse than measured when they were written (metrics
//!   3.1, rbd 3.3, both 3.3);
//! - the settings in effect: the unit alone allows no internet socket, no
//!   host network and no address; with metrics.conf internet sockets, the
//!   host's network and localhost only; with rbd.conf any address;
//! - its system call filter admits what keelfsd's start-up needs before it
//!   installs its own, stricter filter;
//! - under a real systemd (PID 1 of a systemd-nspawn container over this
//!   machine's root, sharing its network): keelfsd with metrics_listen
//!   cannot start under the unit alone, serves /metrics to localhost and
//!   nobody else with metrics.conf, and to another address once a drop-in
//!   allows it; an RBD export cannot start under the unit alone and serves
//!   I/O with rbd.conf.
//!
//! scripts/setup.sh installs systemd (systemd-analyze) and systemd-container
//! (systemd-nspawn); these tests fail without them.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::Scratch;
use keelfs_bdev::{RbdDevice, RbdOptions, RbdScratchImage};
use keelfs_vhost::abi::{init_flags, Opcode};
use keelfs_vhost::frontend::{FrontendConfig, FsFrontend};
use serde_json::Value;

fn contrib() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib")
}

fn unit_text() -> String {
    std::fs::read_to_string(contrib().join("keelfsd.service")).unwrap()
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout)
}

/// A unit directory as systemd reads one: keelfsd.service, running the
/// keelfsd just built, and keelfsd.service.d/ holding the named drop-ins
/// of contrib/ and the `extra` (file name, text) ones.
struct Units(Scratch);

impl Units {
    fn new(name: &str, drop_ins: &[&str], extra: &[(&str, &str)]) -> Self {
        let units = Units(Scratch::new(name));
        let service = unit_text().replace("/usr/local/bin/keelfsd", env!("CARGO_BIN_EXE_keelfsd"));
        std::fs::write(units.service(), service).unwrap();
        std::fs::create_dir_all(units.drop_in_dir()).unwrap();
        for name in drop_ins {
            let file = format!("{name}.conf");
            std::fs::copy(contrib().join("keelfsd.service.d").join(&file), units.drop_in_dir().join(file)).unwrap();
        }
        for (file, text) in extra {
            units.add(file, text);
        }
        units
    }

    fn service(&self) -> PathBuf {
        self.0.path("keelfsd.service")
    }

    fn drop_in_dir(&self) -> PathBuf {
        self.0.path("keelfsd.service.d")
    }

    fn add(&self, file: &str, text: &str) {
        std::fs::write(self.drop_in_dir().join(file), text).unwrap();
    }

    fn add_contrib(&self, name: &str) {
        self.add(
            &format!("{name}.conf"),
            &std::fs::read_to_string(contrib().join(format!("keelfsd.service.d/{name}.conf"))).unwrap(),
        );
    }

    /// `systemd-analyze ARGS... keelfsd.service`. systemd-analyze finds
    /// the drop-ins beside the unit; SYSTEMD_UNIT_PATH keeps it from adding
    /// a keelfsd.service.d this machine may have in /etc or /run.
    fn analyze(&self, args: &[&str]) -> Output {
        Command::new("systemd-analyze")
            .args(args)
            .arg(self.service())
            .env("SYSTEMD_UNIT_PATH", "/usr/lib/systemd/system")
            .output()
            .unwrap_or_else(|e| panic!("systemd-analyze ({e}) is missing: run scripts/setup.sh"))
    }

    /// What `systemd-analyze verify` says (nothing when all is well).
    fn verify(&self) -> String {
        let out = self.analyze(&["verify"]);
        let said = text(&out);
        assert!(out.status.success(), "systemd-analyze verify: {said}");
        said.trim().to_string()
    }

    /// `systemd-analyze security`'s view of each setting, by json_field:
    /// (set, description); `set` is false also where the option does not
    /// apply (null).
    fn security(&self) -> BTreeMap<String, (bool, String)> {
        let out = self.analyze(&["security", "--offline=true", "--json=short"]);
        assert!(out.status.success(), "systemd-analyze security: {}", text(&out));
        let all: Vec<Value> = serde_json::from_slice(&out.stdout).expect("security --json prints a JSON array");
        all.iter()
            .map(|e| {
                let field = e["json_field"].as_str().unwrap().to_string();
                (field, (e["set"] == true, e["description"].as_str().unwrap_or_default().to_string()))
            })
            .collect()
    }
}

fn analyze(args: &[&str]) -> Output {
    Command::new("systemd-analyze")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("systemd-analyze ({e}) is missing: run scripts/setup.sh"))
}

const DROP_IN_SETS: [&[&str]; 4] = [&[], &["metrics"], &["rbd"], &["metrics", "rbd"]];

#[test]
fn the_unit_loads_alone_and_with_each_drop_in() {
    for drop_ins in DROP_IN_SETS {
        let units = Units::new(&format!("unit-verify-{}", drop_ins.join("-")), drop_ins, &[]);
        let said = units.verify();
        assert!(said.is_empty(), "systemd-analyze verify with {drop_ins:?} complains: {said}");
    }
}

#[test]
fn verify_reads_the_drop_ins() {
    // A typo in a drop-in is reported: the test above is not passing by
    // never reading them.
    let typo = ("typo.conf", "[Service]\nRestrictAddressFamilies=AF_INTERNET\n");
    let units = Units::new("unit-typo", &["metrics"], &[typo]);
    let said = units.verify();
    assert!(said.contains("typo.conf") && said.contains("AF_INTERNET"), "not reported: {said:?}");
}

/// The overall exposure line of `systemd-analyze security`.
fn overall(out: &Output) -> String {
    let report = String::from_utf8_lossy(&out.stdout);
    report.lines().find(|l| l.contains("Overall exposure")).unwrap_or("no overall line").to_string()
}

#[test]
fn the_unit_is_hardened() {
    // --threshold is in tenths: exit non-zero above it. The unit alone
    // rated 2.4 (the unhardened one 9.4, "UNSAFE"); with metrics.conf 3.1,
    // with rbd.conf 3.3 (it allows any address), with both 3.3, each
    // asserted as measured: a drop-in that opens more fails here.
    for (drop_ins, threshold) in DROP_IN_SETS.into_iter().zip(["30", "31", "33", "33"]) {
        let units = Units::new(&format!("unit-security-{}", drop_ins.join("-")), drop_ins, &[]);
        let out = units.analyze(&["security", "--offline=true", &format!("--threshold={threshold}")]);
        assert!(out.status.success(), "with {drop_ins:?}, above {threshold}: {}", overall(&out));
    }
}

#[test]
fn only_the_drop_ins_open_the_network() {
    let setting = |drop_ins: &[&str], extra: &[(&str, &str)], field: &str| {
        let units = Units::new(&format!("unit-settings-{}-{}", drop_ins.join("-"), extra.len()), drop_ins, extra);
        let all = units.security();
        all.get(field).unwrap_or_else(|| panic!("no {field} in systemd-analyze security: {all:?}")).clone()
    };
    // set: the restriction holds.
    let inet = "RestrictAddressFamilies_AF_INET_INET6";
    assert!(setting(&[], &[], inet).0, "the unit alone allows internet sockets");
    assert!(setting(&[], &[], "PrivateNetwork").0, "the unit alone has the host's network");
    let alone = setting(&[], &[], "IPAddressDeny");
    assert!(alone.0 && alone.1.contains("blocks all IP address ranges"), "{alone:?}");

    for drop_ins in [&["metrics"][..], &["rbd"]] {
        assert!(!setting(drop_ins, &[], inet).0, "{drop_ins:?} does not allow internet sockets");
        assert!(!setting(drop_ins, &[], "PrivateNetwork").0, "{drop_ins:?} keeps a private network");
        // Unix sockets stay allowed (vhost-user), packet and netlink
        // sockets stay denied.
        assert!(!setting(drop_ins, &[], "RestrictAddressFamilies_AF_UNIX").0);
        assert!(setting(drop_ins, &[], "RestrictAddressFamilies_AF_PACKET").0);
        assert!(setting(drop_ins, &[], "RestrictAddressFamilies_AF_NETLINK").0);
    }
    let metrics = setting(&["metrics"], &[], "IPAddressDeny");
    assert!(metrics.1.contains("allow list with only localhost entries"), "{metrics:?}");
    // metrics.conf's advice for a remote scraper.
    let remote = ("remote-scraper.conf", "[Service]\nIPAddressAllow=192.0.2.10\n");
    let remote = setting(&["metrics"], &[remote], "IPAddressDeny");
    assert!(remote.1.contains("allow list with non-localhost entries"), "{remote:?}");
    let rbd = setting(&["rbd"], &[], "IPAddressDeny");
    assert!(rbd.1.contains("does not define an IP address allow list"), "{rbd:?}");
    // rbd.conf's advice for keeping keelfsd to the cluster's network.
    let cluster = setting(&[], &[("rbd.conf", &rbd_kept_to("10.87.0.0/24"))], "IPAddressDeny");
    assert!(cluster.1.contains("allow list with non-localhost entries"), "{cluster:?}");
}

/// rbd.conf as its comments say to edit it to keep keelfsd to `network`.
fn rbd_kept_to(network: &str) -> String {
    let text = std::fs::read_to_string(contrib().join("keelfsd.service.d/rbd.conf")).unwrap();
    assert_eq!(text.matches("\nIPAddressDeny=\n").count(), 1, "rbd.conf resets IPAddressDeny= once");
    text.replace("\nIPAddressDeny=\n", &format!("\nIPAddressAllow={network}\n"))
}

/// Every system call a `@group` (or a name) stands for, expanding nested
/// groups.
fn expand(name: &str, groups: &mut BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
    if !name.starts_with('@') {
        return BTreeSet::from([name.to_string()]);
    }
    if let Some(known) = groups.get(name) {
        return known.clone();
    }
    let out = analyze(&["syscall-filter", name]);
    assert!(out.status.success(), "systemd-analyze syscall-filter {name}");
    let mut calls = BTreeSet::new();
    for line in String::from_utf8_lossy(&out.stdout).lines().skip(1) {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        calls.extend(expand(line, groups));
    }
    groups.insert(name.to_string(), calls.clone());
    calls
}

#[test]
fn the_units_filter_admits_keelfsds_start_up() {
    let mut text = unit_text();
    for name in ["metrics", "rbd"] {
        text += &std::fs::read_to_string(contrib().join(format!("keelfsd.service.d/{name}.conf"))).unwrap();
    }
    let mut groups = BTreeMap::new();
    let (mut allowed, mut denied) = (BTreeSet::new(), BTreeSet::new());
    for value in text.lines().filter_map(|l| l.strip_prefix("SystemCallFilter=")) {
        let (deny, list) = match value.strip_prefix('~') {
            Some(list) => (true, list),
            None => (false, value),
        };
        for name in list.split_whitespace() {
            let calls = expand(name, &mut groups);
            if deny {
                denied.extend(calls)
            } else {
                allowed.extend(calls)
            }
        }
    }
    // Start-up (supervisor, namespaces, empty root, capabilities, rlimits,
    // seccomp) and serving (a sample of the daemon's own allowlist).
    let needed = [
        "unshare",
        "fork",
        "clone",
        "pidfd_open",
        "wait4",
        "kill",
        "mount",
        "umount2",
        "pivot_root",
        "sethostname",
        "capset",
        "prctl",
        "setrlimit",
        "seccomp",
        "socketpair",
        "renameat2",
        "fchmodat",
        "fchownat",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "accept4",
        "recvmsg",
        "sendmsg",
        "epoll_pwait",
        "eventfd2",
        "sched_setaffinity",
        "fdatasync",
        "pwritev2",
        "madvise",
    ];
    let refused: Vec<_> = needed.iter().filter(|c| !allowed.contains(**c) || denied.contains(**c)).collect();
    assert!(refused.is_empty(), "the unit's SystemCallFilter refuses {refused:?}");
    // ProtectHostname=yes adds a filter of its own that refuses
    // sethostname, which the sandbox calls to name its uts namespace.
    assert!(
        !text.lines().any(|l| l.starts_with("ProtectHostname=") && l != "ProtectHostname=no"),
        "ProtectHostname= refuses sethostname"
    );
}

// ---- Under a real systemd ----

/// One booted container at a time in this process: each is named, and
/// given cgroups, after the process, and two would only compete for cores.
static BOOTS: Mutex<()> = Mutex::new(());

/// How long a step under the booted systemd may take: generous, since the
/// machine may be busy; none is timed.
const STEP: Duration = Duration::from_secs(60);

/// A systemd booted as PID 1 of a systemd-nspawn container, so that
/// keelfsd runs under contrib/keelfsd.service exactly as on a host.
///
/// The container sees this machine's root read-only, with its writes going
/// to a tmpfs overlay (--volatile=overlay; nspawn takes no root directory
/// itself, so `/` is bind-mounted, without its submounts, inside a mount
/// namespace of the container's own), and shares its network, so the test
/// scrapes keelfsd's metrics from outside. /etc/systemd/system is `units`
/// (the host's enabled services stay out); `binds` are further
/// (host path, container path) bind mounts.
///
/// nspawn's own system call filter leaves out bpf(2), without which systemd
/// cannot attach its IP firewall and IPAddressDeny= would go unenforced:
/// --system-call-filter=bpf puts it back. The machine has no systemd of
/// its own to register with (--register=no, --keep-unit), so nspawn makes
/// the container's cgroups below its own: a cgroup of this test's, or two
/// test processes' containers would share them, and the units in them.
struct Booted {
    nspawn: Child,
    init: u32,
    log: PathBuf,
    root: PathBuf,
    cgroups: Vec<PathBuf>,
}

/// The cgroup hierarchies nspawn splits its own cgroup in (a payload for
/// the container, a supervisor for itself): the unified one and, on a
/// hybrid host, systemd's named v1 one.
fn cgroup_roots() -> Vec<PathBuf> {
    let all = Path::new("/sys/fs/cgroup");
    if all.join("cgroup.subtree_control").exists() {
        return vec![all.to_path_buf()];
    }
    let roots: Vec<PathBuf> =
        ["unified", "systemd"].iter().map(|h| all.join(h)).filter(|h| h.join("cgroup.procs").exists()).collect();
    assert!(!roots.is_empty(), "no cgroup hierarchy for systemd under {}", all.display());
    roots
}

/// rmdir a cgroup and the cgroups below it, deepest first (their files go
/// with them; a cgroup still holding a process stays).
fn remove_cgroup(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup(&entry.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl Booted {
    fn boot(scratch: &Scratch, units: &Units, binds: &[(&Path, &str)]) -> Self {
        which("systemd-nspawn", "systemd-container");
        // The mount point of `/`, outside any Scratch: nothing may ever
        // delete it recursively (the bind exists only in the container's
        // mount namespace, but should it ever leak...).
        let root = std::env::temp_dir().join(format!("keelfsd-nspawn-root-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let log = scratch.path("nspawn.log");
        let machine = format!("keelfsd-unit-{}", std::process::id());
        let cgroups: Vec<PathBuf> = cgroup_roots().iter().map(|h| h.join(&machine)).collect();
        let mut procs = String::new();
        for cgroup in &cgroups {
            std::fs::create_dir_all(cgroup).unwrap_or_else(|e| panic!("creating cgroup {}: {e}", cgroup.display()));
            procs += &format!(" {}", cgroup.join("cgroup.procs").display());
        }
        let mut nspawn = Command::new("unshare");
        nspawn
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                r#"for p in{procs}; do echo $$ >"$p" || exit 1; done && mount --bind / "$0" && exec systemd-nspawn --directory="$0" "$@""#
            ))
            .arg(&root)
            .args(["--volatile=overlay", "--register=no", "--keep-unit", "--capability=all"])
            .args(["--system-call-filter=bpf", "--console=read-only", "--machine", &machine])
            .arg(format!("--bind={}:/etc/systemd/system", units.0 .0.display()));
        for (host, inside) in binds {
            nspawn.arg(format!("--bind={}:{inside}", host.display()));
        }
        nspawn.args(["--boot", "--", "--unit=basic.target"]);
        let out = std::fs::File::create(&log).unwrap();
        let child = nspawn
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("unshare ({e}) is missing"));
        let mut booted = Booted { nspawn: child, init: 0, log, root, cgroups };
        booted.init = booted.wait_for_init();
        // Boot is done once is-system-running can answer and stops waiting.
        let deadline = Instant::now() + STEP;
        loop {
            let out = booted.run(&["systemctl", "is-system-running", "--wait"]);
            let state = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if state == "running" || state == "degraded" {
                break;
            }
            assert!(Instant::now() < deadline, "systemd did not boot ({state}): {}", booted.console());
            std::thread::sleep(Duration::from_millis(100));
        }
        booted
    }

    /// The container's PID 1: nspawn's child, once it has become systemd.
    fn wait_for_init(&mut self) -> u32 {
        let pid = self.nspawn.id();
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(status) = self.nspawn.try_wait().unwrap() {
                panic!("systemd-nspawn exited ({status}): {}", self.console());
            }
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
            for child in children.split_whitespace() {
                let comm = std::fs::read_to_string(format!("/proc/{child}/comm")).unwrap_or_default();
                if comm.trim() == "systemd" {
                    return child.parse().unwrap();
                }
            }
            assert!(Instant::now() < deadline, "no systemd in the container: {}", self.console());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn console(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A command run inside the container (all its namespaces).
    fn run(&self, args: &[&str]) -> Output {
        Command::new("nsenter")
            .args(["--target", &self.init.to_string(), "--all"])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("nsenter ({e}) is missing"))
    }

    fn systemctl(&self, args: &[&str]) {
        let out = self.run(&[&["systemctl"], args].concat());
        assert!(out.status.success(), "systemctl {args:?}: {}", text(&out));
    }

    fn property(&self, name: &str) -> String {
        let out = self.run(&["systemctl", "show", "--value", "--property", name, "keelfsd.service"]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// keelfsd's journal.
    fn journal(&self) -> String {
        text(&self.run(&["journalctl", "--no-pager", "--output=cat", "--unit=keelfsd.service"]))
    }

    /// Start keelfsd afresh after the drop-ins changed.
    fn restart(&self) {
        self.systemctl(&["daemon-reload"]);
        // Every unit's: an inactive keelfsd is no longer loaded.
        self.systemctl(&["reset-failed"]);
        self.systemctl(&["restart", "keelfsd.service"]);
    }

    /// Wait until keelfsd's journal says `what` (or fails to within STEP).
    fn wait_for_journal(&self, what: &str) -> String {
        let deadline = Instant::now() + STEP;
        loop {
            let journal = self.journal();
            if journal.contains(what) {
                return journal;
            }
            assert!(Instant::now() < deadline, "keelfsd's journal never said {what:?}:\n{journal}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Booted {
    fn drop(&mut self) {
        // SIGTERM: nspawn asks the container's systemd to halt, and waits.
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.nspawn.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + STEP;
        while self.nspawn.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.nspawn.kill();
                let _ = self.nspawn.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Not remove_dir_all: an empty directory or nothing.
        let _ = std::fs::remove_dir(&self.root);
        for cgroup in &self.cgroups {
            remove_cgroup(cgroup);
        }
    }
}

/// Fails the test when `tool` is missing.
fn which(tool: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()))
        .unwrap_or(false);
    assert!(found, "{tool} is missing: run scripts/setup.sh (it installs {package})");
}

/// An extra address of this machine's, on lo, removed on drop: traffic
/// from it to keelfsd comes from an address that is not localhost, as a
/// remote scraper's would.
struct ExtraAddress(String);

impl ExtraAddress {
    /// One of 198.51.100.0/24 (TEST-NET-2) that no other test holds.
    fn add() -> Self {
        which("ip", "iproute2");
        for n in 0..254 {
            let addr = format!("198.51.100.{}", 1 + (std::process::id() + n) % 254);
            let out = Command::new("ip").args(["addr", "add", &format!("{addr}/32"), "dev", "lo"]).output().unwrap();
            if out.status.success() {
                return ExtraAddress(addr);
            }
            assert!(text(&out).contains("File exists"), "ip addr add {addr}: {}", text(&out));
        }
        panic!("every address of 198.51.100.0/24 is taken on lo");
    }
}

impl Drop for ExtraAddress {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["addr", "del", &format!("{}/32", self.0), "dev", "lo"]).output();
    }
}

/// GET /metrics: the reply's head and body, or why there was none.
fn scrape(addr: SocketAddr) -> Result<(String, String), String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(3)).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).map_err(|e| e.to_string())?;
    let (head, body) = reply.split_once("\r\n\r\n").ok_or(format!("not an HTTP reply: {reply:?}"))?;
    Ok((head.to_string(), body.to_string()))
}

/// Scrape `addr` until keelfsd answers (it may still be starting), failing
/// as soon as systemd gives up on it.
fn scrape_when_up(booted: &Booted, addr: SocketAddr) -> String {
    let deadline = Instant::now() + STEP;
    loop {
        match scrape(addr) {
            Ok((head, body)) => {
                assert!(head.starts_with("HTTP/1.1 200"), "{head}");
                return body;
            }
            Err(e) => {
                let state = booted.property("ActiveState");
                assert!(state != "failed", "keelfsd failed, scraping {addr}: {e}\n{}", booted.journal());
                assert!(Instant::now() < deadline, "no metrics on {addr} ({state}): {e}\n{}", booted.journal());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The test frontend on keelfsd's socket once it accepts, failing as soon
/// as systemd gives up on keelfsd.
fn connect_when_up(booted: &Booted, socket: &Path) -> FsFrontend {
    let deadline = Instant::now() + STEP;
    loop {
        match FsFrontend::connect(socket, FrontendConfig::default()) {
            Ok(mut fe) => {
                fe.init(init_flags::ASYNC_READ | init_flags::MAX_PAGES | init_flags::INIT_EXT).unwrap();
                return fe;
            }
            Err(e) => {
                let state = booted.property("ActiveState");
                assert!(state != "failed", "keelfsd failed: {e}\n{}", booted.journal());
                assert!(
                    Instant::now() < deadline,
                    "no keelfsd on {} ({state}): {e}\n{}",
                    socket.display(),
                    booted.journal()
                );
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `f()`, and keelfsd's journal printed should it panic.
fn with_journal<T>(booted: &Booted, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(value) => value,
        Err(panic) => {
            eprintln!("keelfsd's journal:\n{}", booted.journal());
            std::panic::resume_unwind(panic)
        }
    }
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn keelfsd_serves_metrics_under_systemd_only_with_the_metrics_drop_in() {
    let _one = BOOTS.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("unit-metrics");
    let lib = scratch.path("lib");
    std::fs::create_dir_all(&lib).unwrap();
    common::mkfs(&lib.join("vm.img"), "256M");
    let port = free_port();
    // On every address, so that only the unit's IP filter keeps others out.
    let config = scratch.path("keelfsd.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nmetrics_listen = \"0.0.0.0:{port}\"\nreactors = 1\n\n\
             [[device]]\nname = \"disk\"\nbackend = \"uring\"\npath = \"/var/lib/keelfs/vm.img\"\n\n\
             [[export]]\ntag = \"vm\"\ndevice = \"disk\"\nsocket = \"/run/keelfsd/vm.sock\"\n"
        ),
    )
    .unwrap();
    let units = Units::new("unit-metrics-units", &[], &[]);
    let booted = Booted::boot(&scratch, &units, &[(&lib, "/var/lib/keelfs"), (&config, "/etc/keelfsd.toml")]);

    // The unit alone: no internet sockets, so keelfsd cannot bind the
    // listener and fails at start (systemd restarts it, then gives up).
    booted.systemctl(&["start", "keelfsd.service"]);
    let journal = booted.wait_for_journal("binding the metrics listener");
    assert!(journal.contains("Address family not supported"), "{journal}");
    let local = SocketAddr::from(([127, 0, 0, 1], port));
    assert!(scrape(local).is_err(), "metrics served under the unit alone");

    // With metrics.conf: localhost scrapes, any other address does not.
    let other = ExtraAddress::add();
    let remote: SocketAddr = format!("{}:{port}", other.0).parse().unwrap();
    units.add_contrib("metrics");
    booted.restart();
    let body = scrape_when_up(&booted, local);
    assert!(body.contains("keelfs_image_attached{export=\"vm\"} 1"), "{body}");
    // Its server sandboxed itself under the unit (sethostname included).
    assert!(booted.journal().contains("sandboxed: namespaces"), "{}", booted.journal());
    let refused = scrape(remote);
    assert!(refused.is_err(), "scraped from {remote} though only localhost is allowed: {refused:?}");

    // metrics.conf's advice for a remote scraper: allow its address.
    units.add("remote-scraper.conf", &format!("[Service]\nIPAddressAllow={}\n", other.0));
    booted.restart();
    let body = scrape_when_up(&booted, remote);
    assert!(body.contains("keelfs_image_attached{export=\"vm\"} 1"), "{body}");

    // And it stops as the unit says: drained, flushed, exit 0.
    booted.systemctl(&["stop", "keelfsd.service"]);
    assert_eq!(booted.property("Result"), "success", "{}", booted.journal());
    assert_eq!(booted.property("ExecMainStatus"), "0", "{}", booted.journal());
}

/// Who holds the image's lock, as its lock record says.
fn holders(image: &RbdScratchImage) -> String {
    let reader = RbdDevice::open(&image.address, RbdOptions { read_only: true, ..RbdOptions::default() }).unwrap();
    reader.holders().unwrap()
}

#[test]
fn keelfsd_serves_rbd_under_systemd_only_with_the_rbd_drop_in() {
    let _one = BOOTS.lock().unwrap_or_else(|e| e.into_inner());
    // The dev cluster is up (or brought up) before the container is made,
    // so its /etc/ceph is the one the container sees.
    let image = RbdScratchImage::new("unit", 1 << 30);
    let name = image.name();
    let out = common::keelfsd().args(["mkfs", &name]).output().unwrap();
    assert!(out.status.success(), "mkfs: {}", text(&out));
    let scratch = Scratch::new("unit-rbd");
    let lib = scratch.path("lib");
    std::fs::create_dir_all(&lib).unwrap();
    let config = scratch.path("keelfsd.toml");
    // The socket in the bind-mounted directory, so the test connects to it.
    std::fs::write(
        &config,
        format!(
            "[daemon]\nreactors = 1\n\n\
             [[device]]\nname = \"disk\"\nbackend = \"rbd\"\npath = \"{name}\"\n\n\
             [[export]]\ntag = \"vm\"\ndevice = \"disk\"\nsocket = \"/var/lib/keelfs/vm.sock\"\n"
        ),
    )
    .unwrap();
    let units = Units::new("unit-rbd-units", &[], &[]);
    let booted = Booted::boot(&scratch, &units, &[(&lib, "/var/lib/keelfs"), (&config, "/etc/keelfsd.toml")]);

    // The unit alone: librados cannot reach the cluster.
    booted.systemctl(&["start", "keelfsd.service"]);
    booted.wait_for_journal("cannot reach the Ceph cluster");
    booted.systemctl(&["stop", "keelfsd.service"]);
    assert_eq!(holders(&image), "nobody");

    // With rbd.conf it serves: a file written through the socket reads
    // back, and keelfsd holds the image's lock.
    units.add_contrib("rbd");
    booted.restart();
    let mut fe = connect_when_up(&booted, &lib.join("vm.sock"));
    let data = common::named("written under keelfsd.service with rbd.conf");
    with_journal(&booted, || {
        let file = common::create_with(&mut fe, "f", &data);
        assert_eq!(common::read(&mut fe, file, 4096).unwrap(), data);
    });
    let held = holders(&image);
    assert!(held.contains("client."), "{held}\n{}", booted.journal());
    assert_eq!(booted.property("ActiveState"), "active", "{}", booted.journal());
    drop(fe);

    // rbd.conf kept to the cluster's network, as its comments say: the
    // cluster is still reached (monitor and OSD on the dev bridge).
    units.add("rbd.conf", &rbd_kept_to("10.87.0.0/24"));
    booted.restart();
    let mut fe = connect_when_up(&booted, &lib.join("vm.sock"));
    let lookup = fe.fuse(1, Opcode::Lookup, 1, &common::named("f")).unwrap();
    assert_eq!(lookup.0, 0, "f after a restart\n{}", booted.journal());
    assert!(holders(&image).contains("client."), "{}", booted.journal());
    drop(fe);

    // A clean stop releases the lock.
    booted.systemctl(&["stop", "keelfsd.service"]);
    assert_eq!(booted.property("Result"), "success", "{}", booted.journal());
    assert_eq!(holders(&image), "nobody", "{}", booted.journal());
    let fsck = common::keelfsd().args(["fsck", &name]).output().unwrap();
    assert_eq!(fsck.status.code(), Some(0), "{}", text(&fsck));
}
