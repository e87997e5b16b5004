//! contrib/keelfsd.service is hardened (issue 16) and stays loadable:
//! systemd accepts every directive, rates its exposure 3.0 or better, and
//! its system call filter admits what keelfsd's start-up needs before it
//! installs its own, stricter filter. scripts/setup.sh installs systemd
//! for systemd-analyze.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn unit() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib/keelfsd.service")
}

fn analyze(args: &[&str]) -> std::process::Output {
    Command::new("systemd-analyze")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("systemd-analyze ({e}) is missing: run scripts/setup.sh"))
}

#[test]
fn the_unit_loads_with_the_built_daemon() {
    // verify checks ExecStart's binary: point it at the one just built.
    let text = std::fs::read_to_string(unit()).unwrap();
    let text = text.replace("/usr/local/bin/keelfsd", env!("CARGO_BIN_EXE_keelfsd"));
    let dir = std::env::temp_dir().join(format!("keelfsd-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("keelfsd.service");
    std::fs::write(&copy, text).unwrap();
    let out = analyze(&["verify", copy.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "systemd-analyze verify: {said}");
    assert!(said.trim().is_empty(), "systemd-analyze verify complains: {said}");
}

#[test]
fn the_unit_is_hardened() {
    // --threshold is in tenths: exit non-zero above an exposure of 3.0
    // (the unhardened unit rated 9.4, "UNSAFE").
    let out = analyze(&["security", "--offline=true", "--threshold=30", unit().to_str().unwrap()]);
    let report = String::from_utf8_lossy(&out.stdout);
    let overall = report.lines().find(|l| l.contains("Overall exposure")).unwrap_or("no overall line");
    assert!(out.status.success(), "{overall}");
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
    let text = std::fs::read_to_string(unit()).unwrap();
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
