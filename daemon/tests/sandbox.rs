//! `keelfsd serve` runs sandboxed by default (issue 16): the process that
//! serves is pid 1 of its own pid namespace, with private mount, ipc, uts
//! and network namespaces, an empty root, no capabilities and a seccomp
//! filter that kills it on a forbidden system call. `--sandbox none`
//! keeps the old process model.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{is_mounted, keelfsd, mkfs, Scratch, Served};

/// The pids of `pid`'s children.
fn children(pid: u32) -> Vec<u32> {
    let list = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    list.split_whitespace().map(|c| c.parse().unwrap()).collect()
}

/// The one child of the daemon started (its sandboxed server), waiting for
/// it to appear.
/// The sandboxed server under `supervisor`, once it is sandboxed: it
/// mounts and binds before it enters the sandbox, whose last step is the
/// seccomp filter, so a mount seen is no sign of the sandbox yet.
fn server_of(supervisor: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let [server] = children(supervisor)[..] {
            let status = std::fs::read_to_string(format!("/proc/{server}/status")).unwrap_or_default();
            if status.lines().any(|l| l.starts_with("Seccomp:") && l.ends_with('2')) {
                return server;
            }
        }
        assert!(Instant::now() < deadline, "the sandboxed server never started, or never entered the sandbox");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(&format!("{field}:"))).unwrap_or_else(|| panic!("no {field}"));
    line[field.len() + 1..].trim().to_string()
}

fn namespace(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

fn args<'a>(image: &'a Path, mnt: &'a Path, socket: &'a Path, extra: &[&'a str]) -> Vec<&'a std::ffi::OsStr> {
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "--device".as_ref(),
        image.as_os_str(),
        "--fuse-mount".as_ref(),
        mnt.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ];
    args.extend(extra.iter().map(|a| std::ffi::OsStr::new(*a)));
    args
}

#[test]
fn serve_is_sandboxed_by_default_and_still_serves() {
    let dir = Scratch::new("sandboxed");
    let (image, mnt, socket, rpc) = (dir.path("k.img"), dir.path("mnt"), dir.path("k.sock"), dir.path("rpc.sock"));
    mkfs(&image, "256M");
    let rpc_arg = rpc.to_str().unwrap();
    let served = Served::start(&args(&image, &mnt, &socket, &["--rpc", rpc_arg]), &[&mnt]);
    let server = server_of(served.child.id());

    // The serving process: namespaces of its own, for every kind.
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        let ours = namespace("self", kind);
        let (theirs, supervisor) =
            (namespace(&server.to_string(), kind), namespace(&served.child.id().to_string(), kind));
        assert_ne!(ours, theirs, "the server shares the host's {kind} namespace");
        // Only the server is sandboxed; its supervisor stays with the host.
        assert_eq!(ours, supervisor, "the supervisor left the host's {kind} namespace");
    }
    assert_eq!(status_field(server, "NSpid").split_whitespace().last(), Some("1"), "pid 1 of its namespace");
    // No capabilities in any set, and no way to regain them.
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(server, set), "0000000000000000", "{set}");
    }
    assert_eq!(status_field(server, "NoNewPrivs"), "1");
    assert_eq!(status_field(server, "Seccomp"), "2", "a seccomp filter is installed");
    // The supervisor, outside the sandbox, is filtered too (issue 36).
    let supervisor = served.child.id();
    assert_eq!(status_field(supervisor, "NoNewPrivs"), "1", "the supervisor may gain privileges");
    assert_eq!(status_field(supervisor, "Seccomp"), "2", "the supervisor is not filtered");
    // An empty root: nothing of the host is visible.
    let root: Vec<_> = std::fs::read_dir(format!("/proc/{server}/root")).unwrap().collect();
    assert!(root.is_empty(), "the server's root holds {} entries", root.len());

    // It still serves the host mount, and the vhost-user socket is there.
    std::fs::write(mnt.join("hello"), b"sandboxed").unwrap();
    assert_eq!(std::fs::read(mnt.join("hello")).unwrap(), b"sandboxed");
    assert!(socket.exists());
    assert_idle_policy_sees_the_run_queue(&rpc, &mnt);

    // A clean stop: the supervisor unmounts (the server cannot see the
    // mount point) and removes the socket.
    let status = served.stop();
    assert!(status.success(), "exit status {status}");
    assert!(!is_mounted(&mnt), "the host mount is left behind");
    assert!(!socket.exists(), "the socket is left behind");
    assert_eq!(common::fsck(&image).0, 0);
}

/// The adaptive idle policy reads the machine's run queue from a file the
/// server opened before its sandbox took /proc away: the stats show a
/// count, not null. Each write to the mount wakes the reactor, which ends
/// a policy window once 10 ms have passed; bounded tries, no timing.
fn assert_idle_policy_sees_the_run_queue(rpc: &Path, mnt: &Path) {
    for attempt in 0..200 {
        std::fs::write(mnt.join("wake"), attempt.to_string()).unwrap();
        let out = keelfsd().arg("stats").arg("--rpc").arg(rpc).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let poll = &stats["reactors"][0]["poll"];
        assert_eq!(poll["mode"], "adaptive", "{stats}");
        assert!(poll["regime"] == "spin" || poll["regime"] == "sleep", "{stats}");
        if poll["others_runnable"].is_u64() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the sandboxed reactor's idle policy never saw the run queue");
}

#[test]
fn a_forbidden_system_call_kills_the_sandboxed_daemon() {
    let dir = Scratch::new("forbidden");
    let (image, mnt, socket) = (dir.path("k.img"), dir.path("mnt"), dir.path("k.sock"));
    std::fs::create_dir_all(&mnt).unwrap();
    mkfs(&image, "256M");
    // The probe opens a file once the daemon is ready: the filter kills it.
    let spawn_probe = |extra: &[&str]| {
        keelfsd()
            .arg("serve")
            .args(args(&image, &mnt, &socket, extra))
            .env("KEELFS_TEST_FORBIDDEN_SYSCALL", "1")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut child = spawn_probe(&[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the sandboxed daemon survived a forbidden system call");
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::io::read_to_string(child.stderr.unwrap()).unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGSYS), "{stderr}");
    assert!(stderr.contains("SIGSYS"), "the supervisor does not say why: {stderr}");
    assert!(!is_mounted(&mnt), "the supervisor did not take the dead server's mount down");
    assert!(!socket.exists(), "the supervisor did not remove the dead server's socket");

    // Unsandboxed, the same open succeeds and the daemon serves on: the
    // kill above was the filter's doing.
    let mut child = spawn_probe(&["--sandbox", "none"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !is_mounted(&mnt) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let status = child.try_wait().unwrap();
    assert!(status.is_none(), "unsandboxed, the daemon died: {status:?}");
    assert!(children(child.id()).is_empty(), "--sandbox none forked a server");
    assert_eq!(status_field(child.id(), "Seccomp"), "0");
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    assert!(!is_mounted(&mnt));
    assert!(!socket.exists(), "unsandboxed, serve removes its own socket");
}

/// Many threads allocating at once, as under load, pass the filter: glibc
/// reads the CPU count from /sys for its malloc arena limit the first time
/// it needs more than 8 arenas, a file open the filter would kill the
/// server for (seen: `keelfsd stats` during a benchmark, in a fresh RPC
/// client thread). The sandbox sets the limit before it confines.
#[test]
fn threads_allocating_at_once_pass_the_filter() {
    let dir = Scratch::new("arenas");
    let (image, mnt, socket) = (dir.path("k.img"), dir.path("mnt"), dir.path("k.sock"));
    std::fs::create_dir_all(&mnt).unwrap();
    mkfs(&image, "256M");
    let mut child = keelfsd()
        .arg("serve")
        .args(args(&image, &mnt, &socket, &[]))
        .env("KEELFS_TEST_ALLOCATING_THREADS", "64")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let mut line = String::new();
    loop {
        line.clear();
        let read = std::io::BufRead::read_line(&mut stderr, &mut line).unwrap();
        seen.push_str(&line);
        assert!(read > 0, "the daemon ended before its threads allocated: {:?}\n{seen}", child.wait());
        if line.contains("threads allocated") {
            break;
        }
    }
    assert!(line.contains("64 threads allocated"), "{seen}");
    assert!(seen.contains("sandboxed:"), "not sandboxed: {seen}");
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let rest = std::io::read_to_string(stderr).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}: {seen}{rest}");
    assert!(!socket.exists(), "the socket is left behind");
    assert!(!is_mounted(&mnt), "the mount is left behind");
}

#[test]
fn killing_the_supervisor_kills_the_server() {
    let dir = Scratch::new("kill-supervisor");
    let (image, mnt, socket) = (dir.path("k.img"), dir.path("mnt"), dir.path("k.sock"));
    mkfs(&image, "256M");
    let mut served = Served::start(&args(&image, &mnt, &socket, &[]), &[&mnt]);
    let server = server_of(served.child.id());
    served.signal(libc::SIGKILL);
    let _ = served.child.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    // Gone, or a zombie waiting for whoever adopted it to reap it.
    let alive = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
    };
    while alive(server) {
        assert!(Instant::now() < deadline, "the server outlived its supervisor");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(served);
    // The image is free again at once.
    let out = keelfsd().arg("fsck").arg(&image).arg("--repair").output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn the_pmem_backend_serves_sandboxed_too() {
    let dir = Scratch::new("sandboxed-pmem");
    let (image, mnt) = (dir.path("p.img"), dir.path("mnt"));
    mkfs(&image, "256M");
    let config = dir.path("keelfsd.toml");
    let text = format!(
        "[[device]]\nname = \"p\"\nbackend = \"pmem\"\npath = \"{}\"\n[[export]]\ntag = \"p\"\ndevice = \"p\"\nfuse_mount = \"{}\"\n",
        image.display(),
        mnt.display()
    );
    std::fs::write(&config, text).unwrap();
    let served = Served::start(&["--config".as_ref(), config.as_os_str()], &[&mnt]);
    let server = server_of(served.child.id());
    assert_eq!(status_field(server, "Seccomp"), "2");
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(mnt.join("f"), &data).unwrap();
    std::fs::File::open(mnt.join("f")).unwrap().sync_all().unwrap();
    assert_eq!(std::fs::read(mnt.join("f")).unwrap(), data);
    let status = served.stop();
    assert!(status.success(), "exit status {status}");
    assert_eq!(common::fsck(&image).0, 0);
}

#[test]
fn a_failed_daemon_leaves_another_daemons_mount_alone() {
    let dir = Scratch::new("mount-owner");
    let (image, mnt) = (dir.path("a.img"), dir.path("mnt"));
    mkfs(&image, "256M");
    let first =
        Served::start(&["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()], &[&mnt]);
    std::fs::write(mnt.join("mine"), b"first").unwrap();
    // A second daemon on the same mount point fails before it mounts (its
    // device is missing); its supervisor must not take the first's down.
    let out = keelfsd()
        .arg("serve")
        .args(["--device".as_ref(), dir.path("missing.img").as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(is_mounted(&mnt), "the failed daemon's supervisor unmounted the first daemon's mount");
    assert_eq!(std::fs::read(mnt.join("mine")).unwrap(), b"first");
    assert!(first.stop().success());
}

/// `keelfsd serve` of a fresh image mounted at `dir`/mnt, as `shape`
/// starts it (stderr piped), once the mount is there.
fn serve_mounted(dir: &Scratch, shape: impl FnOnce(&mut Command) -> &mut Command) -> Child {
    let (image, mnt) = (dir.path("k.img"), dir.path("mnt"));
    std::fs::create_dir_all(&mnt).unwrap();
    mkfs(&image, "256M");
    let mut cmd = keelfsd();
    cmd.arg("serve")
        .args(["--device".as_ref(), image.as_os_str(), "--fuse-mount".as_ref(), mnt.as_os_str()])
        .stderr(Stdio::piped())
        .stdout(Stdio::null());
    let child = shape(&mut cmd).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !is_mounted(&mnt) {
        assert!(Instant::now() < deadline, "keelfsd did not mount");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// The daemon's exit after a shutdown signal: clean, and taken as one.
fn assert_one_clean_shutdown(child: Child) {
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("clean shutdown") && !stderr.contains("second signal, exiting"), "{stderr}");
}

#[test]
fn a_signal_to_the_process_group_shuts_down_cleanly() {
    use std::os::unix::process::CommandExt;
    let dir = Scratch::new("pgrp-signal");
    // As at a terminal: the daemon leads a process group, and ^C signals
    // the whole group.
    let child = serve_mounted(&dir, |cmd| cmd.process_group(0));
    // The server leads a group of its own, so that the group's signal
    // reaches it once (forwarded), not twice (which forces an exit).
    let server = server_of(child.id());
    // SAFETY: getpgid(2) reads another process's group id.
    assert_eq!(unsafe { libc::getpgid(server as i32) }, server as i32, "the server is in its supervisor's group");
    // SAFETY: killpg(2) on the group our child leads.
    unsafe { libc::killpg(child.id() as i32, libc::SIGINT) };
    assert_one_clean_shutdown(child);
}

#[test]
fn a_signal_sent_twice_as_timeout_sends_it_shuts_down_cleanly() {
    use std::os::unix::process::CommandExt;
    let dir = Scratch::new("timeout-signal");
    // As `timeout -s INT` does: the daemon in a group of its own, signalled
    // directly and then through the group. The supervisor forwards each
    // copy it reads; a copy that comes while the first is being served is
    // the same request, not the second signal that forces an exit. The
    // shutdown pauses 300 ms as it begins, so that the copy always finds
    // it under way.
    let child = serve_mounted(&dir, |cmd| cmd.process_group(0).env("KEELFS_TEST_SHUTDOWN_PAUSE_MS", "300"));
    // SAFETY: kill(2) on our child, alive.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    std::thread::sleep(Duration::from_millis(5));
    // SAFETY: killpg(2) on the group our child leads.
    unsafe { libc::killpg(child.id() as i32, libc::SIGINT) };
    assert_one_clean_shutdown(child);
}

#[test]
fn a_second_signal_a_second_later_forces_the_exit() {
    let dir = Scratch::new("second-signal");
    // The shutdown pauses 1.5 s as it begins; the second signal comes
    // 1.2 s after the first.
    let child = serve_mounted(&dir, |cmd| cmd.env("KEELFS_TEST_SHUTDOWN_PAUSE_MS", "1500"));
    // SAFETY: kill(2) on our child, alive.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    std::thread::sleep(Duration::from_millis(1200));
    // SAFETY: as above; the pause keeps it alive.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("second signal, exiting"), "{stderr}");
}

#[test]
fn a_signal_to_every_keelfsd_process_shuts_down_cleanly() {
    let dir = Scratch::new("pkill-signal");
    let child = serve_mounted(&dir, |cmd| cmd);
    // As `pkill keelfsd` or `killall keelfsd` do: one signal to each
    // process, the sandboxed server included. The server acts only on the
    // supervisor's forwarded copy, so this is one request, not the second
    // signal that forces an exit.
    let server = server_of(child.id());
    for pid in [server, child.id()] {
        // SAFETY: kill(2) on our child and on its child, both alive.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    assert_one_clean_shutdown(child);
}
