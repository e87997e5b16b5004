//! keelfsd on a Ceph RBD image (the dev cluster of scripts/ceph-dev.sh,
//! which these tests bring up, and fail without):
//! - mkfs creates the image, serve mounts it, fsck checks it live;
//! - a second writer is refused and told who holds the image;
//! - the export moves between two daemons in separate network namespaces
//!   (two "hosts" on this machine) by stop and start, with its data intact
//!   and the lock held by exactly one;
//! - after a daemon is killed, `keelfsd break-lock` fences it and breaks
//!   its lock, and refuses while the holder may still be alive.

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

#[test]
fn mkfs_creates_the_image_serve_mounts_it_and_a_second_writer_is_refused() {
    let image = RbdScratchImage::new("serve", 1 << 30);
    RbdDevice::remove(&image.address).unwrap();
    let name = image.name();
    let out = keelfsd().args(["mkfs", &name, "--size", "1G"]).output().unwrap();
    assert!(out.status.success(), "mkfs: {}", text(&out));
    let dir = Scratch::new("rbd-serve");
    let mnt = dir.path("mnt");
    // No --sandbox: the default gives way to RBD, with a warning.
    let log = dir.path("serve.log");
    let stderr = std::fs::File::create(&log).unwrap();
    let served =
        Served::start_to(&[os("--device"), os(&name), os("--fuse-mount"), mnt.as_os_str()], &[&mnt], stderr.into());
    let data = common::named("on rbd");
    std::fs::write(mnt.join("f"), &data).unwrap();
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("serving without the namespace sandbox"), "{logged}");
    assert!(logged.contains("the reactors sleep between completions"), "{logged}");
    // What of the sandbox a threaded process can keep: no core dumps.
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", served.child.id())).unwrap();
    let core = limits.lines().find(|l| l.starts_with("Max core file size")).unwrap();
    assert_eq!(core.split_whitespace().nth(4), Some("0"), "{core}");

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
    let said = refused(&["--sandbox", "namespace"]);
    assert!(said.contains("use --sandbox none"), "{said}");
    let said = refused(&["--read-only", "--sandbox", "none"]);
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
    let image = RbdScratchImage::new("hosts", 1 << 30);
    let name = image.name();
    let out = keelfsd().args(["mkfs", &name]).output().unwrap();
    assert!(out.status.success(), "mkfs: {}", text(&out));
    let pid = std::process::id();
    let (a, b) = (Host::add(&format!("kfa{pid}"), "10.87.0.31"), Host::add(&format!("kfb{pid}"), "10.87.0.32"));
    let dir = Scratch::new("rbd-hosts");
    let (mnt_a, mnt_b) = (dir.path("a"), dir.path("b"));
    let serve_args = |mnt: &Path| {
        [os("--device"), os(&name), os("--sandbox"), os("none"), os("--fuse-mount"), mnt.as_os_str()]
            .map(|s| s.to_owned())
    };
    let args_a = serve_args(&mnt_a);
    let args_a: Vec<&OsStr> = args_a.iter().map(|s| s.as_os_str()).collect();
    let args_b = serve_args(&mnt_b);
    let args_b: Vec<&OsStr> = args_b.iter().map(|s| s.as_os_str()).collect();

    // Host A serves and writes; B is refused while A holds the image.
    let served_a = a.serve(&args_a, &mnt_a);
    let first = common::named("written on host a");
    std::fs::write(mnt_a.join("a"), &first).unwrap();
    assert!(holders(&image).contains(&format!(" at {}:", a.addr)), "{}", holders(&image));
    let refused = b.run(&[
        os("serve"),
        os("--device"),
        os(&name),
        os("--sandbox"),
        os("none"),
        os("--socket"),
        dir.path("s").as_os_str(),
    ]);
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
    let image = RbdScratchImage::new("readers", 256 << 20);
    let name = image.name();
    let out = keelfsd().args(["mkfs", &name]).output().unwrap();
    assert!(out.status.success(), "mkfs: {}", text(&out));
    let dir = Scratch::new("rbd-readers");
    let (m1, m2) = (dir.path("m1"), dir.path("m2"));
    let reader = |mnt: &Path| {
        let args = [os("--device"), os(&name), os("--read-only"), os("--sandbox"), os("none"), os("--fuse-mount")];
        let mut args = args.to_vec();
        args.push(mnt.as_os_str());
        Served::start(&args, &[mnt])
    };
    let first = reader(&m1);
    let second = reader(&m2);
    assert!(is_mounted(&m2), "a second reader shares the image");
    let held = holders(&image);
    assert_eq!(held.matches("reader client.").count(), 2, "{held}");
    let out = keelfsd()
        .args(["serve", "--device", &name, "--sandbox", "none", "--socket"])
        .arg(dir.path("w.sock"))
        .output()
        .unwrap();
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
    let served = Served::start(
        &[os("--device"), os(&name), os("--sandbox"), os("none"), os("--fuse-mount"), mnt.as_os_str()],
        &[&mnt],
    );
    std::fs::write(mnt.join("f"), b"written once the readers were gone").unwrap();
    assert!(served.stop().success());
}
