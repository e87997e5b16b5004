#![allow(dead_code)]

use std::sync::Arc;

use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_fs::{fsck, FsckReport};
use keelfs_fs::{mkfs, MkfsOptions};
use keelfs_fs::{Fs, FsConfig};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{PollMode, Reactor, ReactorConfig};

pub fn busy_reactor() -> Reactor {
    Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).expect("reactor")
}

pub fn ram_device(bytes: u64) -> Arc<dyn BlockDevice> {
    Arc::new(MappedDevice::ram(bytes, 4096).expect("ram device"))
}

/// A fresh RBD image of `bytes` on the dev cluster (scripts/ceph-dev.sh,
/// brought up if it is not), opened, with the guard that removes it: the
/// device must be dropped first.
pub fn rbd_device(tag: &str, bytes: u64) -> (Arc<dyn BlockDevice>, keelfs_bdev::RbdScratchImage) {
    let image = keelfs_bdev::RbdScratchImage::new(tag, bytes);
    (image.open(), image)
}

/// Every byte of `dev`, read 1 MiB at a time.
pub fn read_whole(dev: &dyn BlockDevice) -> Vec<u8> {
    let bytes = dev.geometry().capacity_bytes;
    let mut io = keelfs_bdev::BlockingIo::open(dev).expect("blocking queue");
    let mut buf = keelfs_bdev::AlignedBuf::zeroed(1 << 20, 4096);
    let mut out = Vec::with_capacity(bytes as usize);
    for offset in (0..bytes).step_by(1 << 20) {
        let n = io.read_at(offset, &mut buf).expect("read") as usize;
        out.extend_from_slice(&buf[..n]);
    }
    out
}

/// A channel to `dev` on the current reactor.
pub fn channel(dev: &Arc<dyn BlockDevice>) -> DeviceChannel {
    DeviceChannel::attach(dev.open_queue(QueueConfig { depth: 64, completion_eventfd: false }).expect("queue"))
}

pub async fn format(dev: &Arc<dyn BlockDevice>) {
    mkfs(channel(dev), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.expect("mkfs");
}

pub async fn mount(dev: &Arc<dyn BlockDevice>) -> Fs {
    Fs::mount(channel(dev), FsConfig::default()).await.expect("mount")
}

pub async fn check(dev: &Arc<dyn BlockDevice>) -> FsckReport {
    fsck(channel(dev), |_| {}).await.expect("fsck ran")
}

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use keelfs_bdev::{BdevError, Completion, Geometry, IoKind, IoQueue, IoRequest};

/// Shared controls of a [`GateDevice`].
#[derive(Default)]
pub struct Gate {
    /// While closed, write completions are held back.
    pub closed: AtomicBool,
    /// Writes submitted and not yet completed to the caller, now and at most.
    pub held: AtomicUsize,
    pub held_max: AtomicUsize,
    /// Release held completions newest first (to reorder completions).
    pub lifo: AtomicBool,
    /// Release at most this many per poll once open (0: all).
    pub trickle: AtomicUsize,
    /// Device offsets of writes in submission order.
    pub offsets: Mutex<Vec<u64>>,
    /// While set, discard completions are held back (apart from writes).
    pub hold_discards: AtomicBool,
    /// Discards submitted and not yet completed to the caller.
    pub discards_held: AtomicUsize,
    /// While Some, completions of reads whose range held this device
    /// byte when they were submitted are held back (apart from writes),
    /// and counted here; all are let go once it is None again.
    pub hold_reads_at: Mutex<Option<u64>>,
    pub reads_held: AtomicUsize,
}

/// Wraps a device: when the gate is closed, write completions wait, so a
/// test can see how many writes the filesystem has in flight at once;
/// discards and reads of one place can be held back apart.
pub struct GateDevice {
    pub inner: Arc<dyn BlockDevice>,
    pub gate: Arc<Gate>,
}

impl BlockDevice for GateDevice {
    fn name(&self) -> &str {
        "gate"
    }
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    fn supports_discard(&self) -> bool {
        self.inner.supports_discard()
    }
    fn open_queue(&self, config: QueueConfig) -> Result<Box<dyn IoQueue>, BdevError> {
        let depth = QueueConfig { depth: config.depth.max(256), ..config };
        Ok(Box::new(GateQueue {
            inner: self.inner.open_queue(depth)?,
            gate: self.gate.clone(),
            held: Vec::new(),
            writes: Default::default(),
            discards: Default::default(),
            held_discards: Vec::new(),
            reads: Default::default(),
            held_reads: Vec::new(),
        }))
    }
}

struct GateQueue {
    inner: Box<dyn IoQueue>,
    gate: Arc<Gate>,
    held: Vec<Completion>,
    writes: std::collections::HashSet<u64>,
    discards: std::collections::HashSet<u64>,
    held_discards: Vec<Completion>,
    reads: std::collections::HashSet<u64>,
    held_reads: Vec<Completion>,
}

impl IoQueue for GateQueue {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), BdevError> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.submit(req)? };
        if req.kind == IoKind::Write {
            self.writes.insert(req.token);
            self.gate.offsets.lock().unwrap().push(req.offset_bytes);
            let n = self.gate.held.fetch_add(1, Ordering::SeqCst) + 1;
            self.gate.held_max.fetch_max(n, Ordering::SeqCst);
        }
        if matches!(req.kind, IoKind::Discard { .. }) {
            self.discards.insert(req.token);
            self.gate.discards_held.fetch_add(1, Ordering::SeqCst);
        }
        if req.kind == IoKind::Read {
            let bytes: u64 = req.iovecs.iter().map(|v| v.len as u64).sum();
            let held = *self.gate.hold_reads_at.lock().unwrap();
            if held.is_some_and(|at| (req.offset_bytes..req.offset_bytes + bytes).contains(&at)) {
                self.reads.insert(req.token);
                self.gate.reads_held.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut got = Vec::new();
        self.inner.poll(&mut got, max);
        let before = out.len();
        for c in got {
            if self.writes.contains(&c.token) {
                self.held.push(c);
            } else if self.discards.contains(&c.token) {
                self.held_discards.push(c);
            } else if self.reads.contains(&c.token) {
                self.held_reads.push(c);
            } else {
                out.push(c);
            }
        }
        if !self.gate.hold_discards.load(Ordering::SeqCst) {
            for c in self.held_discards.drain(..) {
                self.discards.remove(&c.token);
                self.gate.discards_held.fetch_sub(1, Ordering::SeqCst);
                out.push(c);
            }
        }
        if self.gate.hold_reads_at.lock().unwrap().is_none() {
            for c in self.held_reads.drain(..) {
                self.reads.remove(&c.token);
                self.gate.reads_held.fetch_sub(1, Ordering::SeqCst);
                out.push(c);
            }
        }
        if !self.gate.closed.load(Ordering::SeqCst) && !self.held.is_empty() {
            let lifo = self.gate.lifo.load(Ordering::SeqCst);
            let trickle = self.gate.trickle.load(Ordering::SeqCst);
            let n = if trickle == 0 { self.held.len() } else { trickle.min(self.held.len()) };
            for _ in 0..n {
                let c = if lifo { self.held.pop().unwrap() } else { self.held.remove(0) };
                self.writes.remove(&c.token);
                self.gate.held.fetch_sub(1, Ordering::SeqCst);
                out.push(c);
            }
        }
        out.len() - before
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len() + self.held_discards.len() + self.held_reads.len()
    }
}

/// Run `test` on a reactor with a freshly formatted and mounted filesystem
/// on a RAM device of `bytes`.
pub fn with_fs(bytes: u64, test: impl AsyncFnOnce(Fs, Arc<dyn BlockDevice>) + 'static) {
    let mut r = busy_reactor();
    let dev = ram_device(bytes);
    r.block_on(async move {
        format(&dev).await;
        let fs = mount(&dev).await;
        test(fs, dev).await;
    });
}
