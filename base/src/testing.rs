//! Helpers for the tests and benchmarks of every layer: scratch files,
//! data patterns and a deterministic random-number generator.

use std::path::PathBuf;

/// A scratch file removed on drop; in /dev/shm when it exists (RAM-backed,
/// O_DIRECT capable), else the temp dir.
pub struct ScratchFile {
    pub path: PathBuf,
}

impl ScratchFile {
    pub fn new(tag: &str, len: u64) -> Self {
        let dir =
            if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let path = dir.join(format!("keelfs-test-{tag}-{}-{}", std::process::id(), unique()));
        let f = std::fs::File::create(&path).expect("create scratch file");
        f.set_len(len).expect("size scratch file");
        Self { path }
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// A byte pattern that differs per (seed, position), so misplaced data shows.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (seed.wrapping_mul(31).wrapping_add(i as u64 / 7) ^ (i as u64 >> 9)) as u8;
    }
}

/// A small, good, seedable generator (Vigna's splitmix64).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A writer that keeps what is written, shared between its clones: a
/// test hands one clone to a log subscriber and reads the text from
/// another.
#[derive(Clone, Default)]
pub struct CapturedText(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl CapturedText {
    /// Everything written so far, as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }
}

impl std::io::Write for CapturedText {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Bytes the host filesystem holds for `path` (st_blocks, in 512-byte
/// units whatever the filesystem's block size): what a hole punched or a
/// discard gives back shows here.
pub fn allocated_bytes(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).expect("stat").blocks() * 512
}

/// A seed no earlier run used, from the standard library's per-process
/// random hash keys (which the OS seeds).
pub fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new().build_hasher().finish()
}

/// The seed of a randomised test: `var` from the environment when it is
/// set, to replay a failure, else a fresh one, so that each run (each CI
/// run) explores cases no run before it did. Printed either way, with the
/// way to replay it.
///
/// # Panics
/// If `var` is set to something that is not a number: a typo must not
/// turn a replay into a fresh run.
pub fn test_seed(var: &str, what: &str) -> u64 {
    let seed = match std::env::var(var) {
        Ok(value) => value.parse().unwrap_or_else(|_| panic!("{var}={value} is not a u64")),
        Err(_) => fresh_seed(),
    };
    eprintln!("{what}: seed {seed} (replay with {var}={seed})");
    seed
}

/// `future`, counting in `polls` the times it is polled: a bound on the
/// work a future does in pieces, for tests that must not assert time.
pub async fn counting_polls<F: std::future::Future>(future: F, polls: &std::cell::Cell<u64>) -> F::Output {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        polls.set(polls.get() + 1);
        future.as_mut().poll(cx)
    })
    .await
}
