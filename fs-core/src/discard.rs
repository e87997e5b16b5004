//! Giving freed space back to the device: continuous discard of the runs
//! each commit frees, and an fstrim over all free space ([`Admin::trim`]).
//!
//! A freed run waiting for its discard stays out of the allocator until
//! the discard completes: a discard racing a write to a reused block could
//! land after it (neither io_uring nor NVMe orders them), and wipe it. ext4
//! `-o discard` holds its blocks back the same way. On disk those blocks
//! are free (the commit that freed them is durable), so a crash loses only
//! the trim: free space is recomputed from the image at mount. That is
//! also why unmount may drop the queue.
//!
//! The queue drains in a task on the filesystem's reactor: a bounded
//! number of discards in flight, paced by a token bucket so that a large
//! delete does not flood the device. A write that finds no room waits for
//! the discards in flight and takes the queued runs back undiscarded
//! ([`Discard::reclaim`]).
//!
//! [`Discard`] owns the queue, the runs in flight and the discard
//! counters. It stores no other part: the allocator comes in as the
//! `&mut FreeSpace` its caller may already hold (or `&Space` for the
//! async methods, which borrow it only between awaits), and `unmounted`
//! as a bool. Invariant, asserted in debug builds: a discard completes only
//! after it was issued (`completed <= issued`).

use std::collections::BTreeMap;

use std::future::Future;
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::blocks::{block_bytes, whole_blocks, DevBlock};
use super::format::BlockRun;
use super::io::Io;
use super::space::{FreeSpace, Space};
use super::{Admin, FsCounters, FsError, FsInner};
use keelfs_bdev::BdevError;
use keelfs_reactor as reactor;
use std::cell::{Cell, RefCell};

/// Continuous discard settings ([`super::FsConfig::discard`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiscardConfig {
    /// Discard the runs each commit frees (off by default: many devices
    /// gain nothing, and a discard costs as much as a small write).
    pub enabled: bool,
    /// Bytes discarded per second at most, in a one-second burst; 0 is
    /// unpaced.
    pub bytes_per_sec: u64,
    /// Runs shorter than this (after merging) are freed without a discard:
    /// most devices ignore discards below their granularity.
    pub min_bytes: u64,
    /// Merge adjacent freed runs into one discard.
    pub merge: bool,
}

impl Default for DiscardConfig {
    fn default() -> Self {
        Self { enabled: false, bytes_per_sec: 256 << 20, min_bytes: 64 << 10, merge: true }
    }
}

/// Discards the continuous task keeps in flight at most.
const IN_FLIGHT_MAX: usize = 2;
/// The largest discard request: 64 MiB of blocks. It bounds what a write
/// that finds no room may wait for, and what one fstrim step holds back.
const PIECE_BLOCKS_MAX: u64 = whole_blocks(64 << 20);
/// An idle task checks this often whether its filesystem is gone.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// How often [`Discard::settle`] and [`Discard::reclaim`] look at the discards in flight.
const SETTLE_POLL: Duration = Duration::from_millis(1);

/// Freed runs out of the allocator until their discard completes, the
/// fstrim guard and the discard counters.
pub(crate) struct Discard {
    state: RefCell<DiscardState>,
    /// Copied at mount: the merge, pacing and minimum-length settings.
    config: DiscardConfig,
    counters: Cell<DiscardCounters>,
}

/// The discards' part of [`FsCounters`], each field the one named alike
/// there.
#[derive(Clone, Copy, Default)]
struct DiscardCounters {
    discards: u64,
    discard_bytes: u64,
    discard_errors: u64,
}

/// Runs out of the allocator for a discard, and the task's wake-up.
#[derive(Default)]
struct DiscardState {
    /// Continuous discard is on: configured, and not refused by the device.
    active: bool,
    /// Freed runs waiting (start -> length), merged if configured.
    queued: BTreeMap<u64, u64>,
    queued_blocks: u64,
    /// Runs whose discard is in flight (the queue's and fstrim's).
    in_flight: Vec<BlockRun>,
    in_flight_blocks: u64,
    /// Discards issued and completed so far: a waiter for those in flight
    /// now waits until `completed` reaches today's `issued`.
    issued: u64,
    completed: u64,
    /// The continuous task's waker, and a wake-up not yet seen.
    waker: Option<Waker>,
    woken: bool,
    /// The token bucket: bytes that may go now, and when it was filled.
    tokens: u64,
    filled: Option<Instant>,
    /// An fstrim is running ([`Trimming`]).
    trimming: bool,
    /// Unmount has begun: an fstrim stops at its next piece.
    stop_trim: bool,
}

impl DiscardState {
    /// Blocks out of the allocator for a discard (free on disk).
    fn blocks(&self) -> u64 {
        self.queued_blocks + self.in_flight_blocks
    }

    fn runs(&self) -> impl Iterator<Item = BlockRun> + '_ {
        let queued = self.queued.iter().map(|(&start, &len)| BlockRun { start, len });
        queued.chain(self.in_flight.iter().copied())
    }

    fn push(&mut self, run: BlockRun, merge: bool) {
        let (mut start, mut len) = (run.start, run.len);
        if merge {
            if let Some((&prev, &prev_len)) = self.queued.range(..start).next_back() {
                if prev + prev_len == start {
                    self.queued.remove(&prev);
                    (start, len) = (prev, len + prev_len);
                }
            }
            if let Some(next_len) = self.queued.remove(&(start + len)) {
                len += next_len;
            }
        }
        self.queued.insert(start, len);
        self.queued_blocks += run.len;
        self.wake();
    }

    fn wake(&mut self) {
        self.woken = true;
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// Move the first queued run, up to `max` blocks of it, in flight.
    fn pop(&mut self, max: u64) -> Option<BlockRun> {
        let (start, len) = self.queued.pop_first()?;
        let take = len.min(max);
        if take < len {
            self.queued.insert(start + take, len - take);
        }
        self.queued_blocks -= take;
        let run = BlockRun { start, len: take };
        self.start(run);
        Some(run)
    }

    fn start(&mut self, run: BlockRun) {
        self.in_flight.push(run);
        self.in_flight_blocks += run.len;
        self.issued += 1;
    }

    fn end(&mut self, run: BlockRun) {
        let at = self.in_flight.iter().position(|r| *r == run).expect("a discard ends that was in flight");
        self.in_flight.swap_remove(at);
        self.in_flight_blocks -= run.len;
        self.completed += 1;
        debug_assert!(self.completed <= self.issued, "a discard completed that was never issued");
        self.wake();
    }
}

impl Discard {
    pub fn new(config: DiscardConfig, read_only: bool) -> Self {
        let state = DiscardState { active: config.enabled && !read_only, ..DiscardState::default() };
        Self { state: RefCell::new(state), config, counters: Cell::default() }
    }

    /// Check the queue's bookkeeping (tests and fuzzers, between
    /// operations): the block counts are the sums of the runs they count,
    /// queued runs do not overlap, and no more discards completed than
    /// were issued. Panics on the first that does not hold.
    pub fn check_invariants(&self) {
        let d = self.state.borrow();
        assert_eq!(d.queued.values().sum::<u64>(), d.queued_blocks, "queued blocks against the queued runs");
        assert_eq!(d.in_flight.iter().map(|r| r.len).sum::<u64>(), d.in_flight_blocks, "blocks in flight");
        for ((&a, &a_len), (&b, _)) in d.queued.iter().zip(d.queued.iter().skip(1)) {
            assert!(a + a_len <= b, "queued runs overlap: {a}+{a_len} and {b}");
        }
        assert!(d.completed <= d.issued, "{} discards completed of {} issued", d.completed, d.issued);
    }

    /// Whether continuous discard is on: configured, and not refused by
    /// the device.
    pub fn is_active(&self) -> bool {
        self.state.borrow().active
    }

    /// Blocks out of the allocator only until their discard completes:
    /// free on disk, and free for the quota and df.
    pub fn blocks(&self) -> u64 {
        self.state.borrow().blocks()
    }

    /// Every run out of the allocator for a discard (for ownership checks).
    pub fn runs(&self) -> Vec<BlockRun> {
        self.state.borrow().runs().collect()
    }

    /// Fill in the discards' counters and the blocks awaiting a discard.
    pub fn report(&self, out: &mut FsCounters) {
        let c = self.counters.get();
        out.discards = c.discards;
        out.discard_bytes = c.discard_bytes;
        out.discard_errors = c.discard_errors;
        out.discard_pending_blocks = self.blocks();
    }

    /// A run a commit (or a checkpoint's end) made free: to the discard
    /// queue if continuous discard is on and the filesystem is not
    /// unmounted, else straight back to the allocator.
    pub fn release_freed(&self, free: &mut FreeSpace, run: BlockRun, unmounted: bool) {
        let mut d = self.state.borrow_mut();
        if d.active && !unmounted {
            d.push(run, self.config.merge);
        } else {
            free.alloc.free(run);
        }
    }

    /// The length of the queue's first run, if there is one and another
    /// discard may go in flight.
    fn next_queued(&self) -> Option<u64> {
        let d = self.state.borrow();
        let (next, room) = (d.queued.first_key_value().map(|(_, &len)| len), d.in_flight.len() < IN_FLIGHT_MAX);
        next.filter(|_| room)
    }

    /// Whether a queued run of `len` blocks is too short to discard.
    fn too_short(&self, len: u64) -> bool {
        len < whole_blocks(self.config.min_bytes)
    }

    /// The queue's first run is too short to be worth a discard: free it.
    fn free_short_run(&self, free: &mut FreeSpace) {
        let mut d = self.state.borrow_mut();
        if let Some((start, len)) = d.queued.pop_first() {
            d.queued_blocks -= len;
            free.alloc.free(BlockRun { start, len });
        }
    }

    /// Pieces no larger than one second's worth, so the bucket can hold one.
    fn piece_blocks_max(&self) -> u64 {
        match self.config.bytes_per_sec {
            0 => PIECE_BLOCKS_MAX,
            rate => (rate / block_bytes(1)).clamp(1, PIECE_BLOCKS_MAX),
        }
    }

    /// Take `bytes` from the token bucket: None once taken (or when
    /// discards are unpaced), else how long until the bucket holds them.
    fn take_tokens(&self, bytes: u64) -> Option<Duration> {
        let rate = self.config.bytes_per_sec;
        if rate == 0 {
            return None;
        }
        let mut d = self.state.borrow_mut();
        let now = reactor::now();
        let elapsed = d.filled.map_or(Duration::from_secs(1), |t| now.saturating_duration_since(t));
        let earned =
            u64::try_from(elapsed.as_nanos().saturating_mul(u128::from(rate)) / 1_000_000_000).unwrap_or(u64::MAX);
        d.tokens = d.tokens.saturating_add(earned).min(rate.max(bytes));
        d.filled = Some(now);
        if d.tokens >= bytes {
            d.tokens -= bytes;
            return None;
        }
        Some(Duration::from_nanos(((bytes - d.tokens) as u128 * 1_000_000_000 / u128::from(rate)) as u64))
    }

    /// Move the first queued run, up to `max` blocks of it, in flight.
    fn pop_piece(&self, max: u64) -> Option<BlockRun> {
        self.state.borrow_mut().pop(max)
    }

    /// Whether the queue was woken since the task last looked; if not,
    /// `waker` is woken by the next push or completion.
    fn woken_or_register(&self, waker: &Waker) -> bool {
        let mut d = self.state.borrow_mut();
        if std::mem::take(&mut d.woken) {
            return true;
        }
        d.waker = Some(waker.clone());
        false
    }

    async fn issue(&self, io: &Io, run: BlockRun) -> Result<u32, BdevError> {
        let (_, result) = io.discard(DevBlock::new(run.start), run.len).await;
        result
    }

    /// A queued run's discard ended: the run goes back to the allocator
    /// whatever the outcome. A device that cannot discard turns continuous
    /// discard off, with one log line, and gets the rest of the queue back.
    fn complete_queued(
        &self,
        free: &mut FreeSpace,
        span: &tracing::Span,
        run: BlockRun,
        result: Result<u32, BdevError>,
    ) {
        self.account(free, run, &result);
        if let Err(e) = result {
            if matches!(e, BdevError::Unsupported(_)) {
                let was_active = std::mem::take(&mut self.state.borrow_mut().active);
                if was_active {
                    tracing::warn!(parent: span, error = %e, "the device does not discard: continuous discard is off");
                }
                self.give_back_queued(free);
            } else {
                tracing::debug!(parent: span, error = %e, start = run.start, blocks = run.len, "discard failed");
            }
        }
    }

    /// Count a finished discard and free its run.
    fn account(&self, free: &mut FreeSpace, run: BlockRun, result: &Result<u32, BdevError>) {
        self.state.borrow_mut().end(run);
        free.alloc.free(run);
        let mut c = self.counters.get();
        match result {
            Ok(_) => {
                c.discards += 1;
                c.discard_bytes += block_bytes(run.len);
            }
            Err(BdevError::Unsupported(_)) => {}
            Err(_) => c.discard_errors += 1,
        }
        self.counters.set(c);
    }

    /// Every queued run back to the allocator, undiscarded.
    fn give_back_queued(&self, free: &mut FreeSpace) -> u64 {
        let queued = {
            let mut d = self.state.borrow_mut();
            d.queued_blocks = 0;
            std::mem::take(&mut d.queued)
        };
        let mut blocks = 0;
        for (start, len) in queued {
            free.alloc.free(BlockRun { start, len });
            blocks += len;
        }
        blocks
    }

    /// Wait until the discards in flight now have ended.
    async fn wait_in_flight(&self) {
        let target = self.state.borrow().issued;
        while self.state.borrow().completed < target {
            reactor::sleep(SETTLE_POLL).await;
        }
    }

    /// For a writer that found no room: the queued runs come back now,
    /// undiscarded, and the discards in flight are waited for. Returns
    /// whether any blocks came back. The caller holds no borrow of the
    /// free space: this borrows it before its await.
    pub async fn reclaim(&self, space: &Space) -> bool {
        let (before, busy) = {
            let d = self.state.borrow();
            (d.blocks(), d.in_flight_blocks > 0)
        };
        self.give_back_queued(&mut space.free_mut());
        if busy {
            self.wait_in_flight().await;
        }
        before > 0
    }

    /// At the start of an unmount (`true`), before its writeback: a
    /// running fstrim takes no further piece, and a new one does nothing.
    /// An unmount that fails before it is done lets them run again
    /// (`false`).
    pub fn stop_trims(&self, stop: bool) {
        self.state.borrow_mut().stop_trim = stop;
    }

    fn trims_stopped(&self) -> bool {
        self.state.borrow().stop_trim
    }

    /// At unmount (with `unmounted` set, so nothing new starts): wait for
    /// the discards in flight, the queue's and an fstrim's piece, so the
    /// device is quiet and every run is back in the allocator once
    /// unmount returns, and drop the queue's trim.
    pub async fn settle(&self, space: &Space, span: &tracing::Span) {
        while self.state.borrow().in_flight_blocks > 0 {
            reactor::sleep(SETTLE_POLL).await;
        }
        let dropped = self.give_back_queued(&mut space.free_mut());
        if dropped > 0 {
            tracing::debug!(parent: span, blocks = dropped, "unmount: queued discards dropped");
        }
        self.state.borrow_mut().wake();
    }

    /// Start the one fstrim, or Busy while another runs.
    fn begin_trim(&self) -> Result<Trimming<'_>, FsError> {
        if std::mem::replace(&mut self.state.borrow_mut().trimming, true) {
            return Err(FsError::Busy);
        }
        Ok(Trimming(self))
    }

    /// An fstrim's piece, claimed from the allocator, goes in flight.
    fn start_trim_piece(&self, piece: BlockRun) {
        self.state.borrow_mut().start(piece);
    }
}

/// Start the task that drains the discard queue (next to the commit
/// timer), if continuous discard is on. It stays here rather than in a
/// tasks module of the root: it paces and wakes through the queue's own
/// state, and moves with the other tasks in step S15.
pub(crate) fn start_discard_task(fs: &Rc<FsInner>) {
    if !fs.discard.is_active() {
        return;
    }
    let weak = Rc::downgrade(fs);
    reactor::spawn_local(async move {
        loop {
            let Some(fs) = weak.upgrade() else { return };
            if fs.unmounted.get() || !fs.discard.is_active() {
                return;
            }
            let Some(len) = fs.discard.next_queued() else {
                drop(fs);
                Idle { weak: weak.clone(), sleep: reactor::sleep(IDLE_CHECK) }.await;
                continue;
            };
            let piece = len.min(fs.discard.piece_blocks_max());
            if fs.discard.too_short(len) {
                fs.discard.free_short_run(&mut fs.space.free_mut());
                continue;
            }
            drop(fs);
            pace(&weak, block_bytes(piece)).await;
            let Some(fs) = weak.upgrade() else { return };
            if fs.unmounted.get() {
                return; // unmount took the queue back while we waited
            }
            let popped = fs.discard.pop_piece(piece);
            if let Some(run) = popped {
                reactor::spawn_local(async move {
                    let result = fs.discard.issue(&fs.io, run).await;
                    fs.discard.complete_queued(&mut fs.space.free_mut(), &fs.span, run, result);
                });
            }
        }
    });
}

/// Wait until the token bucket holds `bytes`, and take them.
async fn pace(weak: &Weak<FsInner>, bytes: u64) {
    loop {
        let wait = {
            let Some(fs) = weak.upgrade() else { return };
            let Some(wait) = fs.discard.take_tokens(bytes) else { return };
            wait
        };
        reactor::sleep(wait).await;
    }
}

/// Resolves when the discard queue is woken, its filesystem is gone, or
/// `sleep` ends.
struct Idle {
    weak: Weak<FsInner>,
    sleep: reactor::Sleep,
}

impl Future for Idle {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(fs) = self.weak.upgrade() else { return Poll::Ready(()) };
        if fs.discard.woken_or_register(cx.waker()) {
            return Poll::Ready(());
        }
        Pin::new(&mut self.sleep).poll(cx)
    }
}

/// The one fstrim running on a filesystem, until dropped: a guest may
/// send one FITRIM per request queue slot at once, and each would hold
/// a piece of free space out of the allocator.
struct Trimming<'a>(&'a Discard);

impl Drop for Trimming<'_> {
    fn drop(&mut self) {
        self.0.state.borrow_mut().trimming = false;
    }
}

/// fstrim's minimum run in blocks: `min_bytes` rounded up to whole blocks,
/// as ext4 rounds FITRIM's minlen (a run shorter than asked is never
/// discarded), and at least one.
fn trim_min_blocks(min_bytes: u64) -> u64 {
    min_bytes.div_ceil(block_bytes(1)).max(1)
}

impl Admin<'_> {
    /// fstrim: discard every free run of at least `min_bytes` (rounded up
    /// to whole blocks), whether or not continuous discard is on. Each
    /// piece (64 MiB at most) is taken from the allocator, discarded and
    /// freed again, one at a time, so requests go on between pieces and a
    /// writer never waits for more than one. Returns the bytes discarded.
    /// A device that cannot discard answers [`FsError::Unsupported`];
    /// while another trim runs, [`FsError::Busy`].
    pub async fn trim(self, min_bytes: u64) -> Result<u64, FsError> {
        if self.inner.config.read_only {
            return Err(FsError::ReadOnly);
        }
        let fs = &self.inner;
        let _alone = fs.discard.begin_trim()?;
        let min_blocks = trim_min_blocks(min_bytes);
        let (mut cursor, mut trimmed) = (0u64, 0u64);
        // The last piece was cut from a longer run: its rest, at the
        // cursor, was judged long enough already, however short it is.
        let mut resume = false;
        while !fs.unmounted.get() && !fs.discard.trims_stopped() {
            // Never the space promised to dirty pages or kept for the
            // checkpoint: writeback and the checkpoint allocate it without
            // asking, and would fail while this piece is out.
            let room = fs.space.device_available_blocks(fs.usage());
            let piece = {
                let mut free = fs.space.free_mut();
                let rest = resume.then(|| free.alloc.next_free_run(cursor, 1)).flatten().filter(|r| r.start == cursor);
                let Some(run) = rest.or_else(|| free.alloc.next_free_run(cursor, min_blocks)) else { break };
                let len = run.len.min(PIECE_BLOCKS_MAX);
                if room < len && room < min_blocks {
                    tracing::debug!(parent: &fs.span, room, "fstrim: no free space that is not reserved");
                    break;
                }
                let piece = BlockRun { start: run.start, len: len.min(room) };
                free.alloc.claim(piece).map_err(|e| FsError::Corrupt(format!("fstrim: {e}")))?;
                resume = piece.len < run.len;
                piece
            };
            fs.discard.start_trim_piece(piece);
            cursor = piece.end();
            let result = fs.discard.issue(&fs.io, piece).await;
            fs.discard.account(&mut fs.space.free_mut(), piece, &result);
            match result {
                Ok(_) => trimmed += block_bytes(piece.len),
                Err(BdevError::Unsupported(_)) => return Err(FsError::Unsupported),
                Err(e) => return Err(FsError::Io(e)),
            }
        }
        tracing::info!(parent: &fs.span, bytes = trimmed, min_bytes, "fstrim done");
        Ok(trimmed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_merges_adjacent_runs_and_pops_pieces() {
        let mut d = DiscardState { active: true, ..DiscardState::default() };
        d.push(BlockRun { start: 10, len: 5 }, true);
        d.push(BlockRun { start: 20, len: 5 }, true);
        d.push(BlockRun { start: 15, len: 5 }, true);
        assert_eq!(d.runs().collect::<Vec<_>>(), vec![BlockRun { start: 10, len: 15 }]);
        assert_eq!(d.pop(4), Some(BlockRun { start: 10, len: 4 }));
        assert_eq!(d.blocks(), 15, "in flight still counts");
        d.end(BlockRun { start: 10, len: 4 });
        assert_eq!((d.blocks(), d.issued, d.completed), (11, 1, 1));
        let mut unmerged = DiscardState::default();
        unmerged.push(BlockRun { start: 0, len: 1 }, false);
        unmerged.push(BlockRun { start: 1, len: 1 }, false);
        assert_eq!(unmerged.runs().count(), 2);
    }

    #[test]
    fn the_trim_minimum_rounds_up_to_whole_blocks() {
        let block = block_bytes(1);
        assert_eq!(trim_min_blocks(0), 1);
        assert_eq!(trim_min_blocks(1), 1);
        assert_eq!(trim_min_blocks(block), 1);
        assert_eq!(trim_min_blocks(block + 1), 2, "a run of one block is shorter than asked");
        assert_eq!(trim_min_blocks(16 * block - 1), 16);
        assert_eq!(trim_min_blocks(u64::MAX), u64::MAX.div_ceil(block));
    }
}
