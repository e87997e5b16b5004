//! README's first command as a newcomer runs it: `keelfsd serve` with no
//! arguments, in an empty directory (issue 32). It must create and format
//! the embedded default image, enter the sandbox, print the QEMU
//! arguments and `ready`, and stop cleanly on a signal; and the same again
//! with the image already there. A daemon started as a non-interactive
//! shell's background job inherits SIGINT ignored, and must still stop on
//! it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::Scratch;

/// A `keelfsd serve` with no arguments, its stderr in a file.
struct FirstRun {
    child: Child,
    log: PathBuf,
}

impl FirstRun {
    /// Start `keelfsd serve` in `dir` through `bash -c SETUP; exec ...`,
    /// so that SETUP (e.g. `trap '' INT`) shapes what keelfsd inherits.
    fn start(dir: &Path, setup: &str, log_name: &str) -> Self {
        let log = dir.join(log_name);
        let stderr = std::fs::File::create(&log).unwrap();
        let child = Command::new("bash")
            .arg("-c")
            .arg(format!("{setup}\nexec \"$0\" serve"))
            .arg(env!("CARGO_BIN_EXE_keelfsd"))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        FirstRun { child, log }
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait for the `ready` line; fail with the log if keelfsd exits or
    /// does not get there in two minutes (a liveness bound, not a speed
    /// check: formatting and starting take well under a second).
    fn wait_ready(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let text = self.text();
            if text.contains("keelfsd: ready") {
                return text;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("keelfsd serve exited ({status}) before it was ready:\n{text}");
            }
            assert!(Instant::now() < deadline, "keelfsd serve not ready:\n{text}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Send `signal` and wait for the exit (a minute at most).
    fn stop_with(&mut self, signal: i32) -> (ExitStatus, String) {
        // SAFETY: kill(2) on our own child's pid, which we have not reaped.
        unsafe { libc::kill(self.child.id() as i32, signal) };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, self.text());
            }
            if Instant::now() > deadline {
                panic!("keelfsd serve still running 60 s after signal {signal}:\n{}", self.text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for FirstRun {
    /// A failed assertion leaves no daemon behind.
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What every start of the embedded default prints: the sandbox, the QEMU
/// arguments for its socket, and how to mount.
fn assert_serving_the_default(dir: &Path, text: &str) {
    let socket = std::fs::canonicalize(dir).unwrap().join("keelfs-data/keelfs.sock");
    assert!(text.contains("sandboxed: namespaces"), "the sandbox is on by default:\n{text}");
    assert!(
        text.contains(&format!("-chardev socket,id=keelfs-fs,path={}", socket.display())),
        "QEMU arguments naming {}:\n{text}",
        socket.display()
    );
    assert!(text.contains("-device vhost-user-fs-pci,chardev=keelfs-fs,tag=keelfs"), "{text}");
    assert!(text.contains("mount -t virtiofs keelfs /mnt"), "{text}");
}

#[test]
fn serve_with_no_arguments_works_the_first_time_and_the_second() {
    let scratch = Scratch::new("first-run");
    let dir = scratch.path("empty");
    std::fs::create_dir(&dir).unwrap();

    let mut first = FirstRun::start(&dir, "", "first.log");
    let text = first.wait_ready();
    assert!(
        text.contains("keelfsd: created and formatted the embedded default image keelfs-data/keelfs.img"),
        "the first run formats the image:\n{text}"
    );
    assert_serving_the_default(&dir, &text);
    let (status, text) = first.stop_with(libc::SIGTERM);
    assert!(status.success(), "SIGTERM: exit {status}:\n{text}");
    assert!(text.contains("keelfsd: clean shutdown"), "{text}");
    assert!(!dir.join("keelfs-data/keelfs.img.new").exists(), "no partial image is left behind");

    let mut second = FirstRun::start(&dir, "", "second.log");
    let text = second.wait_ready();
    assert!(!text.contains("created and formatted"), "the second run keeps the image:\n{text}");
    assert_serving_the_default(&dir, &text);
    let (status, text) = second.stop_with(libc::SIGTERM);
    assert!(status.success(), "SIGTERM: exit {status}:\n{text}");

    let (code, report) = common::fsck(&dir.join("keelfs-data/keelfs.img"));
    assert_eq!(code, 0, "fsck after two clean runs:\n{report}");
}

#[test]
fn sigint_stops_a_daemon_that_inherited_it_ignored() {
    let scratch = Scratch::new("first-run-sigint");
    // `trap '' INT` is what a non-interactive shell gives its background
    // jobs: SIGINT ignored, inherited through exec.
    let mut run = FirstRun::start(&scratch.0, "trap '' INT", "serve.log");
    run.wait_ready();
    // keelfsd took SIGINT back to its default: not ignored any more.
    let status = std::fs::read_to_string(format!("/proc/{}/status", run.child.id())).unwrap();
    let ignored = status.lines().find_map(|l| l.strip_prefix("SigIgn:")).expect("SigIgn line").trim();
    let ignored = u64::from_str_radix(ignored, 16).unwrap();
    assert_eq!(ignored & (1 << (libc::SIGINT - 1)), 0, "SIGINT is still ignored (SigIgn {ignored:x})");
    let (status, text) = run.stop_with(libc::SIGINT);
    assert!(status.success(), "SIGINT: exit {status}:\n{text}");
    assert!(text.contains("keelfsd: clean shutdown"), "{text}");
}
