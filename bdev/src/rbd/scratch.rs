//! RBD images for tests, on the one-node cluster of
//! `scripts/ceph-dev.sh`. A test that needs RBD brings the cluster up
//! (idempotent) and fails, never skips, when it cannot.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Once};

use super::{RbdAddress, RbdDevice, RbdOptions};

/// The pool `ceph-dev.sh up` makes.
pub const DEV_POOL: &str = "keelfs";

/// Bring the dev cluster up once per test process (`scripts/ceph-dev.sh
/// up` is idempotent and serialises concurrent callers).
///
/// # Panics
/// When the script fails: the tests need the cluster.
pub fn dev_cluster_up() {
    static UP: Once = Once::new();
    UP.call_once(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/ceph-dev.sh");
        let out = std::process::Command::new(script)
            .arg("up")
            .output()
            .unwrap_or_else(|e| panic!("running {script} up: {e}"));
        assert!(
            out.status.success(),
            "{script} up failed ({}); the RBD tests need the dev cluster (run scripts/setup.sh first):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    });
}

/// A fresh image of its own for one test, removed when dropped.
pub struct ScratchImage {
    pub address: RbdAddress,
}

impl ScratchImage {
    /// Create `keelfs/t-TAG-PID-N` of `bytes`.
    ///
    /// # Panics
    /// When the cluster is not up or refuses.
    pub fn new(tag: &str, bytes: u64) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        dev_cluster_up();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let image = format!("t-{tag}-{}-{n}", std::process::id());
        let address = RbdAddress { pool: DEV_POOL.into(), image, conf: None, client: None };
        let _ = RbdDevice::remove(&address);
        RbdDevice::create_or_grow(&address, bytes).unwrap_or_else(|e| panic!("creating {address}: {e}"));
        Self { address }
    }

    /// Open it writable, taking its lock.
    pub fn open(&self) -> Arc<RbdDevice> {
        let opened = RbdDevice::open(&self.address, RbdOptions::default());
        Arc::new(opened.unwrap_or_else(|e| panic!("opening {}: {e}", self.address)))
    }

    /// Its name, as keelfsd takes it.
    pub fn name(&self) -> String {
        self.address.to_string()
    }
}

impl Drop for ScratchImage {
    fn drop(&mut self) {
        // Best effort: a device still open elsewhere keeps it (and a
        // leftover image costs only the space its writes took).
        let _ = RbdDevice::remove(&self.address);
    }
}
