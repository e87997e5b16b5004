//! Running keelfsd as a child process, shared by the daemon's tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keelfs_vhost::abi::{Opcode, Reply, ENTRY_OUT_BYTES};
use keelfs_vhost::frontend::{io_in, FrontendConfig, FsFrontend};

pub fn keelfsd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_keelfsd"))
}

pub fn is_mounted(dir: &Path) -> bool {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().nth(1) == dir.to_str())
}

/// The fuse module's switch for FUSE over io_uring.
pub const FUSE_URING_PARAMETER: &str = "/sys/module/fuse/parameters/enable_uring";

/// Fail, never skip, a host-mount test on `transport` ("dev" or "uring")
/// that the kernel cannot serve: FUSE over io_uring must be on (as
/// scripts/setup.sh turns it on).
pub fn require_fuse_transport(transport: &str) {
    assert!(transport == "dev" || transport == "uring", "unknown FUSE transport {transport:?}");
    if transport == "uring" {
        let value = std::fs::read_to_string(FUSE_URING_PARAMETER).unwrap_or_else(|e| format!("unreadable ({e})"));
        assert_eq!(
            value.trim(),
            "Y",
            "this test needs FUSE over io_uring, but {FUSE_URING_PARAMETER} is {value:?}: \
             run scripts/setup.sh (as root) or `echo Y > {FUSE_URING_PARAMETER}`"
        );
    }
}

/// `keelfsd stats` of the daemon at `rpc`.
/// For what the host's kernel does after the call that causes it returns
/// (a notification written by a thread of the daemon, a RELEASE sent
/// after close(2)): `holds` is asked up to 2000 times, 5 ms apart.
/// Nothing is asserted of how long it took.
pub fn eventually(what: &str, mut holds: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if holds() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("never: {what}");
}

pub fn stats(rpc: &Path) -> serde_json::Value {
    let out = keelfsd().arg("stats").arg("--rpc").arg(rpc).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A scratch directory under the system temp dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("keelfsd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn mkfs(image: &Path, size: &str) {
    let out = keelfsd().arg("mkfs").arg(image).args(["--size", size]).output().unwrap();
    assert!(out.status.success(), "mkfs: {}", String::from_utf8_lossy(&out.stderr));
}

/// fsck's exit code and its report.
pub fn fsck(image: &Path) -> (i32, String) {
    let out = keelfsd().arg("fsck").arg(image).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).to_string())
}

/// The test frontend connected to keelfsd's vhost-user socket, retried
/// for up to 30 s while the daemon starts.
pub fn connect_frontend(socket: &Path) -> FsFrontend {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match FsFrontend::connect(socket, FrontendConfig::default()) {
            Ok(fe) => return fe,
            Err(e) => assert!(Instant::now() < deadline, "connecting: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn named(name: &str) -> Vec<u8> {
    let mut b = name.as_bytes().to_vec();
    b.push(0);
    b
}

/// CREATE `name` and write `data` through the handle: (node id, fh).
pub fn create_with(fe: &mut FsFrontend, name: &str, data: &[u8]) -> (u64, u64) {
    let mut body = Reply::default();
    body.u32(libc::O_RDWR as u32).u32(0o100644).u32(0).u32(0).raw(&named(name));
    let (err, reply) = fe.fuse(1, Opcode::Create, 1, &body.bytes).unwrap();
    assert_eq!(err, 0, "create {name}");
    let node = u64::from_le_bytes(reply[..8].try_into().unwrap());
    let fh = u64::from_le_bytes(reply[ENTRY_OUT_BYTES..ENTRY_OUT_BYTES + 8].try_into().unwrap());
    let mut write = Reply::default();
    write.raw(&io_in(fh, 0, data.len() as u32)).raw(data);
    assert_eq!(fe.fuse(1, Opcode::Write, node, &write.bytes).unwrap().0, 0);
    (node, fh)
}

pub fn read(fe: &mut FsFrontend, (node, fh): (u64, u64), len: u32) -> Result<Vec<u8>, i32> {
    let mut body = Reply::default();
    body.raw(&io_in(fh, 0, len));
    match fe.fuse(1, Opcode::Read, node, &body.bytes).unwrap() {
        (0, data) => Ok(data),
        (err, _) => Err(err),
    }
}

/// A running `keelfsd serve`, with the host mounts it is expected to make.
pub struct Served {
    pub child: Child,
    pub mounts: Vec<PathBuf>,
}

impl Served {
    /// Start `keelfsd serve ARGS` and wait until every dir in `mounts` is
    /// mounted.
    pub fn start(args: &[&std::ffi::OsStr], mounts: &[&Path]) -> Self {
        Self::start_to(args, mounts, Stdio::inherit())
    }

    /// [`Self::start`], with keelfsd's stderr going to `stderr`.
    pub fn start_to(args: &[&std::ffi::OsStr], mounts: &[&Path], stderr: Stdio) -> Self {
        for m in mounts {
            std::fs::create_dir_all(m).unwrap();
        }
        let child = keelfsd().arg("serve").args(args).stdout(Stdio::null()).stderr(stderr).spawn().unwrap();
        Self::adopt(child, mounts)
    }

    /// A `keelfsd serve` started by the caller; waits for its mounts.
    pub fn adopt(child: Child, mounts: &[&Path]) -> Self {
        for m in mounts {
            std::fs::create_dir_all(m).unwrap();
        }
        let served = Served { child, mounts: mounts.iter().map(|m| m.to_path_buf()).collect() };
        let deadline = Instant::now() + Duration::from_secs(30);
        for m in mounts {
            while !is_mounted(m) {
                assert!(Instant::now() < deadline, "keelfsd did not mount {}", m.display());
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        served
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// SIGTERM, and the exit status; a daemon still running a minute
    /// later fails the test (Drop then kills it).
    pub fn stop(mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "keelfsd still running 60 s after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for m in &self.mounts {
            if is_mounted(m) {
                let _ = Command::new("umount").arg("-l").arg(m).status();
            }
        }
    }
}

/// A qemu-scripts script run to its end with a `--workdir` of its own
/// (removed afterwards): whether it exited 0, its whole output, and its
/// PASS and FAIL lines, printed with the time it took (what a reader of
/// the CI log wants).
pub fn run_qemu_script(name: &str, script: &str, args: &[&str]) -> (bool, String, Vec<String>) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let workdir = std::env::temp_dir().join(format!("keelfs-{name}-{}", std::process::id()));
    let started = Instant::now();
    let out = Command::new("bash")
        .arg(repo.join("qemu-scripts").join(script))
        .arg("--workdir")
        .arg(&workdir)
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&workdir);
    let summary: Vec<String> =
        text.lines().filter(|l| l.contains("PASS") || l.contains("FAIL")).map(str::to_owned).collect();
    eprintln!("{}\n{name}: {:.0} s", summary.join("\n"), started.elapsed().as_secs_f64());
    (out.status.success(), text, summary)
}
