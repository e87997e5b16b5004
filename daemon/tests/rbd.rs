//! keelfsd on a Ceph RBD image (the dev cluster of scripts/ceph-dev.sh,
//! which these tests bring up, and fail without):
//! - mkfs creates the image, serve mounts it, fsck checks it live;
//! - a second writer is refused and told who holds the image;
//! - the export moves between two daemons in separate network namespaces
//!   (two "hosts" on this machine) by stop and start, with its data intact
//!   and the lock held by exactly one;
//! - after a daemon is killed, `keelfsd break-lock` fences it and breaks
//!   its lock, and refuses while the holder may still be alive;
//! - every one of them serves sandboxed, as by default (issue 36): its
//!   server and all of librados's threads under the seccomp filter, with
//!   no capabilities, in mount namespace of its own and the host's
//!   network; a forbidden call kills it.

mod common;

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{is_mounted, keelfsd, Scratch, Served};
use keelfs_bdev::{RbdDevice, RbdOptions, RbdScratchImage};

/// A network namespace on the dev cluster's bridge, removed on drop.
struct Host {
    name: String,
    addr: String,
}

impl Host {
    fn add(name: &str, addr: &str) -> Self {
        let out = Command::new(ceph_dev()).args(["host", "add", name, addr]).output().unwrap();
        assert!(out.status.success(), "ceph-dev.sh host add: {}", text(&out));
        Host { name: name.into(), addr: addr.into() }
    }

    /// `keelfsd serve ARGS` in this host's network namespace only (the
    /// mounts stay visible to the test), waiting for `mount` to appear.
    fn serve(&self, args: &[&OsStr], mount: &Path) -> Served {
        std::fs::create_dir_all(mount).unwrap();
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.name))
            .arg(env!("CARGO_BIN_EXE_keelfsd"))
            .arg("serve")
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let served = Served { child, mounts: vec![mount.to_path_buf()] };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !is_mounted(mount) {
            assert!(Instant::now() < deadline, "keelfsd on {} did not mount {}", self.name, mount.display());
            std::thread::sleep(Duration::from_millis(50));
        }
        served
    }

    /// `keelfsd ARGS` run to its end in this host's network namespace.
    fn run(&self, args: &[&OsStr]) -> Output {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.name)).arg(env!("CARGO_BIN_EXE_keelfsd")).args(args);
        cmd.output().unwrap()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = Command::new(ceph_dev()).args(["host", "del", &self.name]).output();
    }
}

fn ceph_dev() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ceph-dev.sh")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Who holds the image's lock, as its lock record says.
fn holders(image: &RbdScratchImage) -> String {
    let reader = RbdDevice::open(&image.address, RbdOptions { read_only: true, ..RbdOptions::default() }).unwrap();
    reader.holders().unwrap()
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// A new scratch image of `bytes`, formatted by `keelfsd mkfs`, and its
/// name.
fn formatted(tag: &str, bytes: u64) -> (RbdScratchImage, String) {
    let image = RbdScratchImage::new(tag, bytes);
    let name = image.name();
    let out = keelfsd().args(["mkfs", &name]).output().unwrap();
    assert!(out.status.success(), "mkfs: {}", text(&out));
    (image, name)
}

fn sync_file(path: &Path) {
    std::fs::File::open(path).unwrap().sync_all().unwrap();
}

fn status_field(pid: u32, task: &str, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{task}/status")).unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with(&format!("{field}:")));
    line.map(|l| l[field.len() + 1..].trim().to_string()).unwrap_or_default()
}

/// The sandboxed server under `supervisor`, once every thread it has,
/// librados's included, runs under the seccomp filter with no
/// capabilities, in the host's network namespace and a mount namespace of
/// its own. (It mounts before it enters the sandbox: a mount seen is no
/// sign of the filter yet, so this waits for it, up to 30 s.)
fn sandboxed_server(supervisor: u32) -> u32 {
    let children = std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children")).unwrap();
    let servers: Vec<u32> = children.split_whitespace().map(|c| c.parse().unwrap()).collect();
    assert_eq!(servers.len(), 1, "one sandboxed server under the supervisor: {servers:?}");
    let server = servers[0];
    let ns = |pid: &str, kind: &str| std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match unconfined_threads(server) {
            Ok(()) => break,
            Err(why) if Instant::now() > deadline => panic!("{why}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    assert_eq!(ns(&server.to_string(), "net"), ns("self", "net"), "the host's network namespace is kept");
    assert_ne!(ns(&server.to_string(), "mnt"), ns("self", "mnt"), "a mount namespace of its own");
    server
}

/// Whether librados's threads run and every thread of `server` is under
/// the filter (Seccomp 2) with no capabilities; if not, why.
fn unconfined_threads(server: u32) -> Result<(), String> {
    let tasks: Vec<String> = std::fs::read_dir(format!("/proc/{server}/task"))
        .unwrap()
        .map(|t| t.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    if tasks.len() <= 5 {
        return Err(format!("librados's threads do not run: {tasks:?}"));
    }
    for task in &tasks {
        let comm = std::fs::read_to_string(format!("/proc/{server}/task/{task}/comm")).unwrap_or_default();
        // A thread that ended meanwhile reads "".
        let seccomp = status_field(server, task, "Seccomp");
        if seccomp != "2" && !seccomp.is_empty() {
            return Err(format!("thread {task} ({}) is not filtered", comm.trim()));
        }
        let caps = status_field(server, task, "CapEff");
        if !caps.bytes().all(|b| b == b'0') {
            return Err(format!("thread {task} ({}) has capabilities {caps}", comm.trim()));
        }
    }
    Ok(())
}

#[test]
fn mkfs_creates_the_image_serve_mounts_it_and_a_second_writer_is_refused() {
    let image = RbdScratchImage::new("serve", 1 << 30);
    RbdDevice::remove(&image.address).unwrap();
    let name = image.name();
    let out = keelfsd().args(["mkfs", &name, "--size", "1G"]).output().unwrap();
    assert!(out.status.success(), "mkfs: {}", text(&out));
    let dir = Scratch::new("rbd-serve");
    let mnt = dir.path("mnt");
    // No --sandbox: sandboxed, as by default.
    let log = dir.path("serve.log");
    let stderr = std::fs::File::create(&log).unwrap();
    let served =
        Served::start_to(&[os("--device"), os(&name), os("--fuse-mount"), mnt.as_os_str()], &[&mnt], stderr.into());
    let data = common::named("on rbd");
    std::fs::write(mnt.join("f"), &data).unwrap();
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("sandboxed: namespaces, empty root, no capabilities, seccomp"), "{logged}");
    assert!(logged.contains("the host's network kept for Ceph"), "{logged}");
    assert!(logged.contains("the reactors sleep between completions"), "{logged}");
    let server = sandboxed_server(served.child.id());
    let limits = std::fs::read_to_string(format!("/proc/{server}/limits")).unwrap();
    let core = limits.lines().find(|l| l.starts_with("Max core file size")).unwrap();
    assert_eq!(core.split_whitespace().nth(4), Some("0"), "{core}");
    sync_file(&mnt.join("f"));
    assert_eq!(std::fs::read(mnt.join("f")).unwrap(), data);

    let second = keelfsd().args(["serve", "--device", &name, "--socket"]).arg(dir.path("s")).output().unwrap();
    let said = text(&second);
    assert_eq!(second.status.code(), Some(2), "{said}");
    assert!(said.contains("is locked by client.") && said.contains(" at 10.87.0.1:"), "{said}");
    let socket = dir.path("s");
    let refused = |extra: &[&str]| {
        let out = keelfsd().args(["serve", "--device", &name]).args(extra).arg("--socket").arg(&socket).output();
        let out = out.unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        text(&out)
    };
    let said = refused(&["--read-only"]);
    assert!(said.contains("is locked by client."), "a reader is refused while a writer holds it: {said}");

    let live = keelfsd().args(["fsck", &name]).output().unwrap();
    assert_eq!(live.status.code(), Some(0), "{}", text(&live));
    assert!(text(&live).contains("checking it live"), "{}", text(&live));
    assert!(served.stop().success());
    assert_eq!(holders(&image), "nobody", "a clean stop must release the lock");
    let fsck = keelfsd().args(["fsck", &name]).output().unwrap();
    assert_eq!(fsck.status.code(), Some(0), "{}", text(&fsck));
    assert!(!text(&fsck).contains("checking it live"), "{}", text(&fsck));
}

#[test]
fn an_export_moves_between_two_hosts_and_a_dead_owner_is_fenced() {
    // Sandboxed, each daemon keeps the network namespace it was started in.
    let (image, name) = formatted("hosts", 1 << 30);
    let pid = std::process::id();
    let (a, b) = (Host::add(&format!("kfa{pid}"), "10.87.0.31"), Host::add(&format!("kfb{pid}"), "10.87.0.32"));
    let dir = Scratch::new("rbd-hosts");
    let (mnt_a, mnt_b) = (dir.path("a"), dir.path("b"));
    let serve_args =
        |mnt: &Path| [os("--device"), os(&name), os("--fuse-mount"), mnt.as_os_str()].map(|s| s.to_owned());
    let args_a = serve_args(&mnt_a);
    let args_a: Vec<&OsStr> = args_a.iter().map(|s| s.as_os_str()).collect();
    let args_b = serve_args(&mnt_b);
    let args_b: Vec<&OsStr> = args_b.iter().map(|s| s.as_os_str()).collect();

    // Host A serves and writes; B is refused while A holds the image.
    let served_a = a.serve(&args_a, &mnt_a);
    let first = common::named("written on host a");
    std::fs::write(mnt_a.join("a"), &first).unwrap();
    assert!(holders(&image).contains(&format!(" at {}:", a.addr)), "{}", holders(&image));
    let refused = b.run(&[os("serve"), os("--device"), os(&name), os("--socket"), dir.path("s").as_os_str()]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(text(&refused).contains(&format!(" at {}:", a.addr)), "B not told A holds it: {}", text(&refused));

    // Stop on A, start on B: the data moved, and only B holds the lock.
    assert!(served_a.stop().success());
    let served_b = b.serve(&args_b, &mnt_b);
    assert_eq!(std::fs::read(mnt_b.join("a")).unwrap(), first, "host a's file on host b");
    let held = holders(&image);
    assert!(held.contains(&format!(" at {}:", b.addr)) && !held.contains(", "), "one holder, on b: {held}");
    let second = common::named("written on host b");
    std::fs::write(mnt_b.join("b"), &second).unwrap();
    let synced = std::fs::File::open(mnt_b.join("b")).unwrap();
    synced.sync_all().unwrap();

    // B dies. Its watch outlives it for a while, so break-lock cannot
    // tell it from a live holder: refused, until told to fence it.
    served_b.signal(libc::SIGKILL);
    drop(served_b);
    let refused = a.run(&[os("break-lock"), os(&name)]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(text(&refused).contains("still watches the image"), "{}", text(&refused));
    assert!(text(&refused).contains(&format!(" at {}:", b.addr)), "{}", text(&refused));
    let fenced = a.run(&[os("break-lock"), os(&name), os("--fence-live")]);
    assert!(fenced.status.success(), "{}", text(&fenced));
    assert!(text(&fenced).contains("blocklisted"), "{}", text(&fenced));
    assert_eq!(holders(&image), "nobody");

    // A takes it over again; everything B synced is there, fsck clean.
    let served_a = a.serve(&args_a, &mnt_a);
    assert_eq!(std::fs::read(mnt_a.join("a")).unwrap(), first);
    assert_eq!(std::fs::read(mnt_a.join("b")).unwrap(), second, "host b's synced file after its death");
    assert!(holders(&image).contains(&format!(" at {}:", a.addr)));
    assert!(served_a.stop().success());
    let fsck = keelfsd().args(["fsck", &name]).output().unwrap();
    assert_eq!(fsck.status.code(), Some(0), "{}", text(&fsck));
}

/// A read-only export holds a shared lock for as long as it serves (issue
/// 36): readers share the image, a writer is refused naming them, a clean
/// stop lets go, and a killed reader's lock stays until `break-lock
/// --fence-live` fences and breaks it (without it, break-lock refuses: a
/// reader watches nothing, so its death cannot be told).
#[test]
fn a_read_only_export_keeps_writers_out_until_it_stops_or_is_fenced() {
    let (image, name) = formatted("readers", 256 << 20);
    let dir = Scratch::new("rbd-readers");
    let (m1, m2) = (dir.path("m1"), dir.path("m2"));
    let reader = |mnt: &Path| {
        let args = [os("--device"), os(&name), os("--read-only"), os("--fuse-mount")];
        let mut args = args.to_vec();
        args.push(mnt.as_os_str());
        Served::start(&args, &[mnt])
    };
    let first = reader(&m1);
    let second = reader(&m2);
    assert!(is_mounted(&m2), "a second reader shares the image");
    let held = holders(&image);
    assert_eq!(held.matches("reader client.").count(), 2, "{held}");
    let out = keelfsd().args(["serve", "--device", &name, "--socket"]).arg(dir.path("w.sock")).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("is locked by reader client."), "{}", text(&out));
    assert!(second.stop().success());
    assert_eq!(holders(&image).matches("reader client.").count(), 1, "a clean stop lets go");

    // A killed reader's lock outlives it.
    first.signal(libc::SIGKILL);
    drop(first);
    assert_eq!(holders(&image).matches("reader client.").count(), 1);
    let refused = keelfsd().args(["break-lock", &name]).output().unwrap();
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(text(&refused).contains("--fence-live"), "{}", text(&refused));
    let broken = keelfsd().args(["break-lock", &name, "--fence-live"]).output().unwrap();
    assert!(broken.status.success(), "{}", text(&broken));
    assert!(text(&broken).contains("reader client."), "{}", text(&broken));
    assert_eq!(holders(&image), "nobody");
    let mnt = dir.path("w");
    let served = Served::start(&[os("--device"), os(&name), os("--fuse-mount"), mnt.as_os_str()], &[&mnt]);
    std::fs::write(mnt.join("f"), b"written once the readers were gone").unwrap();
    assert!(served.stop().success());
}

/// A forbidden system call kills a sandboxed RBD daemon, librados and
/// all, and its supervisor says why.
#[test]
fn a_forbidden_call_kills_a_sandboxed_rbd_daemon() {
    let (image, name) = formatted("forbidden", 256 << 20);
    let dir = Scratch::new("rbd-forbidden");
    let mnt = dir.path("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let child = keelfsd()
        .args(["serve", "--device", &name, "--fuse-mount"])
        .arg(&mnt)
        .env("KEELFS_TEST_FORBIDDEN_SYSCALL", "unix-socket")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = text(&out);
    assert_eq!(out.status.code(), Some(128 + libc::SIGSYS), "{said}");
    assert!(said.contains("making a unix socket") && said.contains("SIGSYS"), "{said}");
    assert!(!said.contains("the forbidden socket call returned"), "it returned instead of dying: {said}");
    assert!(!is_mounted(&mnt), "the supervisor took the dead server's mount down");

    // The dead server's lock stays until it is fenced.
    let broken = keelfsd().args(["break-lock", &name, "--fence-live"]).output().unwrap();
    assert!(broken.status.success(), "{}", text(&broken));
    assert_eq!(holders(&image), "nobody");
}

/// The hostile requests of `keelfs-bench hostile` (issue 16), each well
/// formed and absurd, to a sandboxed RBD export: each gets an answer,
/// the daemon lives on (a call its filter forbids would have killed it),
/// serves a plain write and read after them, and stops clean.
#[test]
fn hostile_requests_to_a_sandboxed_rbd_export_get_answers() {
    use keelfs_vhost::abi::{init_flags as f, Opcode, Reply};
    use keelfs_vhost::frontend::io_in;
    const HUGE: u64 = 1 << 52;
    let (_image, name) = formatted("hostile", 256 << 20);
    let dir = Scratch::new("rbd-hostile");
    let socket = dir.path("k.sock");
    let mut served = Served::start(&[os("--device"), os(&name), os("--socket"), socket.as_os_str()], &[]);
    let mut fe = common::connect_frontend(&socket);
    fe.init(f::INIT_EXT).unwrap();
    sandboxed_server(served.child.id());
    let (node, fh) = common::create_with(&mut fe, "target", b"before");
    let mut requests: Vec<(u32, u64, Vec<u8>)> = Vec::new();
    for mode in [0x01 | 0x02, 0x01 | 0x10] {
        // fallocate PUNCH_HOLE or ZERO_RANGE (with KEEP_SIZE) of 2^52 bytes
        let mut b = Reply::default();
        b.u64(fh).u64(0).u64(HUGE).u32(mode).u32(0);
        requests.push((Opcode::Fallocate as u32, node, b.bytes));
    }
    requests.push((Opcode::Read as u32, node, io_in(fh, HUGE - 4096, u32::MAX)));
    requests.push((1234, node, Vec::new()));
    let mut readdir = Reply::default();
    readdir.u64(0).u64(0).u32(u32::MAX).u32(0).u64(0).u32(0).u32(0);
    requests.push((Opcode::Readdir as u32, 1, readdir.bytes));
    let mut getxattr = Reply::default();
    getxattr.u32(u32::MAX).u32(0).raw(&common::named("user.absent"));
    requests.push((Opcode::Getxattr as u32, node, getxattr.bytes));
    requests.push((Opcode::Lookup as u32, 1, common::named(&"x".repeat(4000))));
    let mut write = Reply::default();
    write.raw(&io_in(fh, HUGE, 4096)).raw(&[7u8; 4096]);
    requests.push((Opcode::Write as u32, node, write.bytes));
    let mut answers = Vec::new();
    for (opcode, nodeid, body) in &requests {
        // An answer of any kind: a punch past the data is a valid no-op.
        let (err, _) = fe.fuse_raw(1, *opcode, *nodeid, body).unwrap();
        assert!(served.child.try_wait().unwrap().is_none(), "opcode {opcode} killed the daemon");
        answers.push((*opcode, err));
    }
    assert!(answers.contains(&(1234, libc::ENOSYS)), "an unknown opcode is ENOSYS: {answers:?}");
    let (_, past_the_end) = answers.last().unwrap();
    assert_ne!(*past_the_end, 0, "a write past the largest file size is refused: {answers:?}");
    let data = common::named("after the hostile requests");
    let (node, fh) = common::create_with(&mut fe, "after", &data);
    assert_eq!(common::read(&mut fe, (node, fh), data.len() as u32).unwrap(), data);
    drop(fe);
    assert!(served.stop().success());
    let fsck = keelfsd().args(["fsck", &name]).output().unwrap();
    assert_eq!(fsck.status.code(), Some(0), "{}", text(&fsck));
}
