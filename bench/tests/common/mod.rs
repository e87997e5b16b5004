//! keelfsd as a child process, shared by keelfs-bench's tests.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// keelfsd, built beside keelfs-bench by `cargo test --workspace`.
pub fn keelfsd() -> Command {
    let bin = Path::new(env!("CARGO_BIN_EXE_keelfs-bench")).with_file_name("keelfsd");
    assert!(
        bin.exists(),
        "{} is missing: build it (cargo build -p keelfsd) or run cargo test --workspace",
        bin.display()
    );
    Command::new(bin)
}

/// A running keelfsd, killed when dropped.
pub struct Daemon(pub Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Wait for `path` (a daemon's socket) to appear: a liveness bound, not
/// a speed check.
pub fn wait_for(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}
