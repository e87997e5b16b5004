//! Fault injection around any backend, and a write log that rebuilds the
//! device as it could stand after a crash at any point.
//!
//! The wrapper is a test tool: its shared state sits behind a mutex, which is
//! fine off the production path.
//!
//! ## Crash model
//! Writes are logged when they complete, in completion order. A flush is
//! logged when it completes and records how many log entries existed when
//! it was *submitted*: those are the writes it made durable. After a crash
//! at log position `p`, every write covered by the last flush logged before
//! `p` is on the device; each later write before `p` may be present, absent,
//! or torn (a prefix of its sectors written), independently of the others,
//! as on a disk with a volatile, reordering cache. This is the dm-log-writes
//! model.
//!
//! "Completes" means: returned to the caller by [`IoQueue::poll`]. With
//! [`FaultRule::ReorderCompletions`] the wrapper holds each completion of
//! the inner device back for a random number of polls and hands them out
//! out of order, as librbd's threads do; the log follows the order the
//! caller sees, so a caller that submits a flush before a write's
//! completion has come back gets a flush that does not cover that write.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use keelfs_base::testing::splitmix64;

use super::{
    validate_request, BdevError, BlockDevice, Completion, Geometry, IoKind, IoQueue, IoRequest, IoVec, QueueConfig,
    Token,
};

/// A fault to inject. Operations are counted per kind across all queues of
/// the device, from 0, starting when the rule's device is created.
#[derive(Clone, Debug)]
pub enum FaultRule {
    /// Fail the `nth` operation of `kind` with EIO, without performing it.
    FailNth { kind: IoKind, nth: u64 },
    /// Fail every read or write of `kind` that touches [start, end).
    FailRange { kind: IoKind, start: u64, end: u64 },
    /// Fail each operation of `kind` with probability `permille`/1000, drawn
    /// from a generator seeded with `seed`.
    FailRandom { kind: IoKind, permille: u32, seed: u64 },
    /// The `nth` write puts only its first `sectors_kept` logical blocks on
    /// the device, then completes with EIO.
    TearNthWrite { nth: u64, sectors_kept: u32 },
    /// Hold each completion of the inner device (every kind) back for 0 to
    /// `max_polls` polls of its queue, drawn from a generator seeded with
    /// `seed`, and hand out those due at one poll in a shuffled order.
    /// The draws depend only on the seed and the sequence of polls and
    /// completions, so a single-threaded caller over a device that
    /// completes at once (RAM) replays exactly.
    ReorderCompletions { max_polls: u32, seed: u64 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogEntry {
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    /// A completed flush that made entries `[0, covers)` durable.
    Flush {
        covers: usize,
    },
}

/// What happens to one write that no flush covered at the crash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persist {
    Kept,
    Lost,
    /// Only the first `sectors` logical blocks reached the medium.
    Torn {
        sectors: u32,
    },
}

/// Every completed write and flush, in completion order.
#[derive(Clone, Debug, Default)]
pub struct WriteLog {
    sector_bytes: u32,
    entries: Vec<LogEntry>,
}

impl WriteLog {
    pub fn entries(&self) -> &[LogEntry] {
        &self.entries
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The crash positions just after each completed flush.
    pub fn flush_points(&self) -> Vec<usize> {
        let mut points = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if matches!(e, LogEntry::Flush { .. }) {
                points.push(i + 1);
            }
        }
        points
    }

    /// How many leading entries are guaranteed durable after a crash at
    /// position `crash_at` (entries `[0, crash_at)` happened).
    pub fn durable_prefix(&self, crash_at: usize) -> usize {
        self.entries[..crash_at]
            .iter()
            .filter_map(|e| match e {
                LogEntry::Flush { covers } => Some(*covers),
                LogEntry::Write { .. } => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Apply the log to `image` (the device as it stood when recording
    /// began) as the device would stand after a crash at `crash_at`. `fate`
    /// is asked about each write past the durable prefix, by log index.
    pub fn rebuild(&self, image: &mut [u8], crash_at: usize, mut fate: impl FnMut(usize) -> Persist) {
        assert!(crash_at <= self.entries.len(), "crash point {crash_at} beyond the log ({})", self.entries.len());
        let durable = self.durable_prefix(crash_at);
        for (i, entry) in self.entries[..crash_at].iter().enumerate() {
            let LogEntry::Write { offset, data } = entry else { continue };
            let keep_bytes = if i < durable {
                data.len()
            } else {
                match fate(i) {
                    Persist::Kept => data.len(),
                    Persist::Lost => 0,
                    Persist::Torn { sectors } => (sectors as usize * self.sector_bytes as usize).min(data.len()),
                }
            };
            let start = *offset as usize;
            image[start..start + keep_bytes].copy_from_slice(&data[..keep_bytes]);
        }
    }

    /// [`WriteLog::rebuild`] with fates drawn from `seed`: a third kept, a
    /// third lost, a third torn at a random sector.
    pub fn rebuild_seeded(&self, image: &mut [u8], crash_at: usize, seed: u64) {
        let mut rng = seed;
        let sector = self.sector_bytes as usize;
        let entries = &self.entries;
        self.rebuild(image, crash_at, |i| {
            let LogEntry::Write { data, .. } = &entries[i] else { unreachable!("fate asked for a flush") };
            match splitmix64(&mut rng) % 3 {
                0 => Persist::Kept,
                1 => Persist::Lost,
                _ => Persist::Torn { sectors: (splitmix64(&mut rng) % (data.len() / sector) as u64) as u32 },
            }
        });
    }
}

#[derive(Default)]
struct FaultState {
    rules: Vec<(FaultRule, u64)>,
    counts: [u64; 3],
    recording: bool,
    log: WriteLog,
    injected: u64,
}

enum Action {
    Pass,
    Fail,
    Tear { sectors_kept: u32 },
}

fn kind_index(kind: IoKind) -> usize {
    match kind {
        IoKind::Read => 0,
        IoKind::Write => 1,
        IoKind::Flush | IoKind::Discard { .. } => 2,
    }
}

impl FaultState {
    fn decide(&mut self, kind: IoKind, offset: u64, len: u64) -> Action {
        let nth = self.counts[kind_index(kind)];
        self.counts[kind_index(kind)] += 1;
        let mut action = Action::Pass;
        for (rule, rng) in &mut self.rules {
            let hit = match *rule {
                FaultRule::FailNth { kind: k, nth: n } => k == kind && n == nth,
                FaultRule::FailRange { kind: k, start, end } => {
                    k == kind && kind != IoKind::Flush && offset < end && offset + len > start
                }
                FaultRule::FailRandom { kind: k, permille, .. } => {
                    k == kind && splitmix64(rng) % 1000 < u64::from(permille)
                }
                FaultRule::TearNthWrite { nth: n, sectors_kept } => {
                    if kind == IoKind::Write && n == nth {
                        action = Action::Tear { sectors_kept };
                    }
                    false
                }
                FaultRule::ReorderCompletions { .. } => false,
            };
            if hit {
                action = Action::Fail;
            }
        }
        if !matches!(action, Action::Pass) {
            self.injected += 1;
        }
        action
    }

    /// The reordering rule's bound and generator, if one is set.
    fn reorder(&mut self) -> Option<(u32, &mut u64)> {
        self.rules.iter_mut().find_map(|(rule, rng)| match *rule {
            FaultRule::ReorderCompletions { max_polls, .. } => Some((max_polls, rng)),
            _ => None,
        })
    }
}

/// A device that injects faults into, and records writes to, another one.
pub struct FaultDevice {
    inner: Arc<dyn BlockDevice>,
    state: Arc<Mutex<FaultState>>,
    name: String,
}

impl FaultDevice {
    pub fn new(inner: Arc<dyn BlockDevice>) -> Self {
        let name = format!("fault({})", inner.name());
        let state = FaultState {
            log: WriteLog { sector_bytes: inner.geometry().logical_block_size, entries: Vec::new() },
            ..FaultState::default()
        };
        Self { inner, state: Arc::new(Mutex::new(state)), name }
    }

    fn state(&self) -> MutexGuard<'_, FaultState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn add_rule(&self, rule: FaultRule) {
        let seed = match rule {
            FaultRule::FailRandom { seed, .. } | FaultRule::ReorderCompletions { seed, .. } => seed,
            _ => 0,
        };
        self.state().rules.push((rule, seed));
    }

    pub fn clear_rules(&self) {
        self.state().rules.clear();
    }

    /// Start logging writes and flushes (the image at this moment is the
    /// base that [`WriteLog::rebuild`] applies to).
    pub fn start_recording(&self) {
        let mut s = self.state();
        s.recording = true;
        s.log.entries.clear();
    }

    pub fn log(&self) -> WriteLog {
        self.state().log.clone()
    }

    /// Entries logged so far (cheaper than cloning the log).
    pub fn log_len(&self) -> usize {
        self.state().log.len()
    }

    /// How many operations a rule has failed or torn.
    pub fn injected(&self) -> u64 {
        self.state().injected
    }
}

impl BlockDevice for FaultDevice {
    fn name(&self) -> &str {
        &self.name
    }
    /// The inner geometry, except that the write cache is always volatile:
    /// the crash model assumes one, and callers must flush as for one.
    fn geometry(&self) -> Geometry {
        Geometry { volatile_write_cache: true, ..self.inner.geometry() }
    }
    fn open_queue(&self, config: QueueConfig) -> Result<Box<dyn IoQueue>, BdevError> {
        Ok(Box::new(FaultQueue {
            inner: self.inner.open_queue(config)?,
            state: Arc::clone(&self.state),
            local: VecDeque::new(),
            pending: HashMap::new(),
            scratch: Vec::new(),
            held: Vec::new(),
        }))
    }
}

struct Pending {
    kind: IoKind,
    /// The bytes that will reach the medium, when recording.
    data: Option<(u64, Vec<u8>)>,
    flush_covers: usize,
    torn: bool,
}

struct FaultQueue {
    inner: Box<dyn IoQueue>,
    state: Arc<Mutex<FaultState>>,
    /// Completions of failed requests that never reached the device.
    local: VecDeque<Completion>,
    pending: HashMap<Token, Pending>,
    scratch: Vec<Completion>,
    /// Completions of the inner device held back by
    /// [`FaultRule::ReorderCompletions`], with the polls each still waits.
    held: Vec<(u32, Completion)>,
}

/// Copy `len` bytes out of caller memory.
///
/// # Safety
/// The iovecs must be readable for their lengths (the submit contract).
unsafe fn gather(iovecs: &[IoVec], len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut filled = 0;
    for v in iovecs {
        let take = v.len.min(len - filled);
        // SAFETY: forwarded contract. Caller memory may be a guest's: it is
        // read with volatile access only (take <= v.len).
        unsafe { v.volatile() }.copy_to(&mut out[filled..filled + take]);
        filled += take;
        if filled == len {
            break;
        }
    }
    out.truncate(filled);
    out
}

/// The leading `len` bytes of a request's segments.
fn trim_iovecs(iovecs: &[IoVec], mut len: usize) -> Vec<IoVec> {
    let mut out = Vec::new();
    for v in iovecs {
        if len == 0 {
            break;
        }
        let take = v.len.min(len);
        out.push(IoVec { base: v.base, len: take });
        len -= take;
    }
    out
}

impl FaultQueue {
    /// One poll under [`FaultRule::ReorderCompletions`]: age the held
    /// completions, take the inner device's new ones with a drawn delay,
    /// and move up to `max` of those due into `scratch`, shuffled.
    fn hold_and_release(&mut self, max_polls: u32, rng: &mut u64, max: usize) {
        for (wait, _) in &mut self.held {
            *wait = wait.saturating_sub(1);
        }
        let mut fresh = Vec::new();
        self.inner.poll(&mut fresh, usize::MAX);
        for c in fresh {
            let wait = (splitmix64(rng) % (u64::from(max_polls) + 1)) as u32;
            self.held.push((wait, c));
        }
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.held.len() {
            if self.held[i].0 == 0 && due.len() < max {
                due.push(self.held.remove(i).1);
            } else {
                i += 1;
            }
        }
        // Fisher-Yates with the rule's generator.
        for k in (1..due.len()).rev() {
            let j = (splitmix64(rng) % (k as u64 + 1)) as usize;
            due.swap(k, j);
        }
        self.scratch.extend(due);
    }
}

impl IoQueue for FaultQueue {
    fn geometry(&self) -> Geometry {
        Geometry { volatile_write_cache: true, ..self.inner.geometry() }
    }

    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), BdevError> {
        let geometry = self.inner.geometry();
        let total = validate_request(&geometry, req)?;
        if let IoKind::Discard { .. } = req.kind {
            return Err(BdevError::Unsupported("the fault wrapper does not model discard"));
        }
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let action = state.decide(req.kind, req.offset_bytes, total);
        let recording = state.recording;
        let flush_covers = state.log.entries.len();
        drop(state);
        let sector = geometry.logical_block_size as usize;
        let (reach_bytes, torn) = match action {
            Action::Fail => {
                self.local.push_back(Completion { token: req.token, result: Err(BdevError::Io(libc::EIO)) });
                return Ok(());
            }
            Action::Tear { sectors_kept } => ((sectors_kept as usize * sector).min(total as usize), true),
            Action::Pass => (total as usize, false),
        };
        if torn && reach_bytes == 0 {
            self.local.push_back(Completion { token: req.token, result: Err(BdevError::Io(libc::EIO)) });
            return Ok(());
        }
        let data = (recording && req.kind == IoKind::Write)
            // SAFETY: the submit contract makes the iovecs readable now.
            .then(|| (req.offset_bytes, unsafe { gather(req.iovecs, reach_bytes) }));
        let trimmed;
        let mut forwarded = *req;
        if torn {
            trimmed = trim_iovecs(req.iovecs, reach_bytes);
            forwarded.iovecs = &trimmed;
            forwarded.pool_index = None;
        }
        // SAFETY: forwarded contract; trimmed iovecs name a prefix of the
        // caller's memory. Backends copy the iovec array during submit.
        unsafe { self.inner.submit(&forwarded)? };
        self.pending.insert(req.token, Pending { kind: req.kind, data, flush_covers, torn });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let before = out.len();
        let local = max.min(self.local.len());
        out.extend(self.local.drain(..local));
        self.scratch.clear();
        let shared = Arc::clone(&self.state);
        let mut state = shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((max_polls, rng)) = state.reorder() {
            self.hold_and_release(max_polls, rng, max - local);
        } else {
            // Completions held under a rule since cleared go first.
            let n = self.held.len().min(max - local);
            self.scratch.extend(self.held.drain(..n).map(|(_, c)| c));
            self.inner.poll(&mut self.scratch, max - local - n);
        }
        for c in self.scratch.drain(..) {
            let pending = self.pending.remove(&c.token).expect("completion for a request this queue submitted");
            let mut result = c.result;
            if result.is_ok() && state.recording {
                match (pending.kind, pending.data) {
                    (IoKind::Write, Some((offset, data))) => state.log.entries.push(LogEntry::Write { offset, data }),
                    (IoKind::Flush, _) => state.log.entries.push(LogEntry::Flush { covers: pending.flush_covers }),
                    _ => {}
                }
            }
            if pending.torn {
                result = Err(BdevError::Io(libc::EIO));
            }
            out.push(Completion { token: c.token, result });
        }
        out.len() - before
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.local.len() + self.held.len()
    }

    /// None while completions are held: they come out only by polling.
    fn completion_eventfd(&self) -> Option<std::os::fd::RawFd> {
        if self.held.is_empty() {
            self.inner.completion_eventfd()
        } else {
            None
        }
    }

    fn register_pool(&mut self, pool: &super::BufferPool) -> Result<(), BdevError> {
        self.inner.register_pool(pool)
    }
}
