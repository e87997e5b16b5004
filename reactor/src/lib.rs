//! The per-core reactor: a single-threaded loop that owns everything it
//! polls, in the style of SPDK's threads.
//!
//! Each iteration ([`Reactor::tick`]) takes the current time as an argument
//! and, in order:
//! 1. polls its block-device channels for completions;
//! 2. fires expired timers;
//! 3. runs at most `messages_per_tick_max` messages from its inbox, a
//!    bounded lock-free queue that any thread may push to;
//! 4. polls its other sources (virtqueues, NVMe queue pairs, ...);
//! 5. polls at most `tasks_per_tick_max` woken tasks (futures).
//!
//! A sent message never runs inline, not even when a reactor sends to
//! itself. Tasks are plain futures polled by this executor; there is no
//! general-purpose async runtime underneath.
//!
//! Idle policy ([`PollMode`]): `Busy` never sleeps; `Interrupt` sleeps
//! whenever an iteration found no work; `Adaptive` decides for itself
//! ([`policy`]): it spins through short idle spells while its core is its
//! own and spinning catches work, and sleeps at once while another thread
//! wants the core or work comes too seldom. A sleeping reactor wakes on its
//! own eventfd (signalled by senders and cross-thread wakers), on its
//! pollers' eventfds, or at the next timer deadline.
//!
//! Time is an input: each iteration reads the reactor's [`Clock`] once,
//! and pollers, timers, tasks ([`now`]) and the idle policy all decide by
//! that instant. Tests give a [`VirtualClock`] and move it by hand, then
//! [`ReactorHandle::settle`] to see what each instant brought.

// Unsafe code lives in three modules: `sys` (system calls), `io` (handing
// buffers to the device) and `volatile_crc` (the crc of a guest's memory,
// which `io`'s buffers hand it).
#![deny(unsafe_code)]

mod clock;
mod gate;
#[allow(unsafe_code)]
mod io;
pub mod policy;
mod probe;
mod remote;
mod shares;
#[allow(unsafe_code)]
mod sys;
mod task;
#[allow(unsafe_code)]
mod volatile_crc;
/// The atomics of [`gate`]: std's here, loom's in `tests/loom.rs`.
mod sync {
    pub(crate) use std::sync::atomic::{fence, AtomicBool, Ordering};
}

pub use clock::{Clock, VirtualClock};
pub use io::{
    await_all, AlignedWindow, BufferSlice, ChannelStats, DeviceChannel, IntoAny, IoBuffer, IoFuture, IoVecs, NoBuffer,
    RangeBusy, SharedBuffer,
};
pub use policy::{Regime, SwitchReason};
pub use probe::{CpuLoad, CpuLoadProbe};
pub use remote::{call, call_and_wait, oneshot, Call, CallError, Completer, Unsent};
pub use shares::ShareCounters;
use shares::{index_of, FairShares, ShareIndex, ENTERED, NO_SHARE};
pub use sys::thread_cpu_time;
pub use volatile_crc::CrcWay;

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crossbeam::queue::{ArrayQueue, SegQueue};
use policy::{CpuSample, IdleAction, IdlePolicy, PolicyConfig};
use task::{IdleBodies, LocalFuture};

/// When an idle reactor gives up the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollMode {
    Busy,
    Adaptive { idle_before_sleep: Duration },
    Interrupt,
}

impl PollMode {
    pub const ADAPTIVE_DEFAULT: PollMode = PollMode::Adaptive { idle_before_sleep: Duration::from_millis(1) };
}

#[derive(Clone, Debug)]
pub struct ReactorConfig {
    pub id: usize,
    /// Pin the reactor's thread to this CPU.
    pub cpu: Option<usize>,
    pub mode: PollMode,
    pub inbox_capacity: usize,
    pub messages_per_tick_max: usize,
    pub tasks_per_tick_max: usize,
    /// The machine's run queue and CPU pressure, for the adaptive policy,
    /// opened by the caller (before a sandbox). None: the policy judges by
    /// the reactor's own time off the CPU alone.
    pub cpu_load: Option<Arc<CpuLoadProbe>>,
    /// Where `now` comes from: the monotonic clock, or a test's.
    pub clock: Clock,
}

impl Default for ReactorConfig {
    fn default() -> Self {
        Self {
            id: 0,
            cpu: None,
            mode: PollMode::ADAPTIVE_DEFAULT,
            inbox_capacity: 4096,
            messages_per_tick_max: 64,
            tasks_per_tick_max: 256,
            cpu_load: None,
            clock: Clock::Monotonic,
        }
    }
}

/// Work sent to a reactor from any thread. It runs on the reactor's thread,
/// where [`spawn_local`] and the other free functions are available.
pub type Message = Box<dyn FnOnce() + Send>;

#[derive(thiserror::Error)]
pub enum SendError {
    /// The inbox is at capacity; the message is handed back for a retry
    /// after the receiver has drained some.
    #[error("reactor inbox full")]
    Full(Message),
    #[error("reactor stopped")]
    Stopped(Message),
}

impl std::fmt::Debug for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Full(_) => f.write_str("SendError::Full(..)"),
            SendError::Stopped(_) => f.write_str("SendError::Stopped(..)"),
        }
    }
}

/// Counters a reactor publishes; readable from any thread.
#[derive(Default, Debug)]
pub struct ReactorStats {
    pub ticks: AtomicU64,
    pub busy_ticks: AtomicU64,
    /// Time spent in iterations that found work, and in all iterations
    /// (sleep excluded): their ratio is the reactor's busy share.
    pub busy_ns: AtomicU64,
    pub loop_ns: AtomicU64,
    pub sleeps: AtomicU64,
    /// Time spent asleep in epoll: with `loop_ns - busy_ns`, the
    /// reactor's idle time.
    pub sleep_ns: AtomicU64,
    pub messages: AtomicU64,
    pub task_polls: AtomicU64,
    /// What the fair shares between this reactor's frontends did
    /// ([`Share`]): requests refused for want of credit, rounds of
    /// top-ups, and of those the rounds an idle iteration began.
    pub share_refusals: AtomicU64,
    pub share_rounds: AtomicU64,
    pub share_idle_rounds: AtomicU64,
    /// The idle policy's state, as [`ReactorStats::poll_state`] reads it.
    poll: PollCounters,
}

/// What the idle policy publishes at the end of each window.
#[derive(Default, Debug)]
struct PollCounters {
    /// 0: busy, 1: adaptive, 2: interrupt.
    mode: AtomicU64,
    /// 0: spin, 1: sleep.
    regime: AtomicU64,
    reason: AtomicU64,
    switches: AtomicU64,
    off_cpu_ppm: AtomicU64,
    /// u64::MAX: unknown (both).
    others_runnable: AtomicU64,
    pressure_ppm: AtomicU64,
    spin_hits: AtomicU64,
    spin_misses: AtomicU64,
    quick_wakes: AtomicU64,
    served: AtomicU64,
    /// The last comparison: requests per second spinning and asleep, and
    /// its winner (`WINNER_*`).
    spinning_per_s: AtomicU64,
    asleep_per_s: AtomicU64,
    winner: AtomicU64,
}

/// `PollCounters::winner`: no comparison yet, or which regime won it.
const WINNER_NONE: u64 = 0;
const WINNER_SLEEP: u64 = 1;
const WINNER_SPIN: u64 = 2;

/// The idle policy's state and its last window, for stats and `top`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollState {
    pub mode: &'static str,
    /// What an idle iteration does now.
    pub regime: Regime,
    pub reason: SwitchReason,
    pub switches: u64,
    /// The share of the last window (ppm) another thread held the core.
    pub off_cpu_ppm: u32,
    /// Threads runnable on the machine besides the reactor, last window.
    pub others_runnable: Option<u32>,
    /// The share of the last window (ppm) some thread waited for a CPU.
    pub pressure_ppm: Option<u32>,
    /// Since start: idle spins that caught work, spins that gave up, and
    /// sleeps shorter than the spin budget.
    pub spin_hits: u64,
    pub spin_misses: u64,
    pub quick_wakes: u64,
    /// Requests served since start, as the policy counts them.
    pub served: u64,
    /// The last comparison of spinning against sleeping, if any.
    pub comparison: Option<ComparisonState>,
}

/// Requests per second spinning and asleep, and which regime won.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComparisonState {
    pub spinning_per_s: u64,
    pub asleep_per_s: u64,
    pub spin_won: bool,
}

impl ReactorStats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn poll_state(&self) -> PollState {
        let p = &self.poll;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PollState {
            mode: match load(&p.mode) {
                0 => "busy",
                1 => "adaptive",
                _ => "interrupt",
            },
            regime: if load(&p.regime) == 0 { Regime::Spin } else { Regime::Sleep },
            reason: SwitchReason::from_code(load(&p.reason)),
            switches: load(&p.switches),
            off_cpu_ppm: load(&p.off_cpu_ppm).min(1_000_000) as u32,
            others_runnable: u32::try_from(load(&p.others_runnable)).ok(),
            pressure_ppm: u32::try_from(load(&p.pressure_ppm)).ok(),
            spin_hits: load(&p.spin_hits),
            spin_misses: load(&p.spin_misses),
            quick_wakes: load(&p.quick_wakes),
            served: load(&p.served),
            comparison: (load(&p.winner) != WINNER_NONE).then(|| ComparisonState {
                spinning_per_s: load(&p.spinning_per_s),
                asleep_per_s: load(&p.asleep_per_s),
                spin_won: load(&p.winner) == WINNER_SPIN,
            }),
        }
    }

    fn publish_mode(&self, mode: PollMode) {
        let (code, regime) = match mode {
            PollMode::Busy => (0, 0),
            PollMode::Adaptive { .. } => (1, 0),
            PollMode::Interrupt => (2, 1),
        };
        self.poll.mode.store(code, Ordering::Relaxed);
        self.poll.regime.store(regime, Ordering::Relaxed);
        self.poll.others_runnable.store(u64::MAX, Ordering::Relaxed);
        self.poll.pressure_ppm.store(u64::MAX, Ordering::Relaxed);
    }

    fn publish_window(&self, policy: &IdlePolicy) {
        let p = &self.poll;
        let report = policy.last_window();
        let regime = match policy.regime() {
            Regime::Spin => 0,
            Regime::Sleep => 1,
        };
        p.regime.store(regime, Ordering::Relaxed);
        p.reason.store(policy.reason().code(), Ordering::Relaxed);
        p.switches.store(policy.switches(), Ordering::Relaxed);
        p.off_cpu_ppm.store(u64::from(report.off_cpu_ppm), Ordering::Relaxed);
        p.others_runnable.store(report.others_runnable.map_or(u64::MAX, u64::from), Ordering::Relaxed);
        p.pressure_ppm.store(report.pressure_ppm.map_or(u64::MAX, u64::from), Ordering::Relaxed);
        Self::add(&p.spin_hits, u64::from(report.spin_hits));
        Self::add(&p.spin_misses, u64::from(report.spin_misses));
        Self::add(&p.quick_wakes, u64::from(report.quick_wakes));
        Self::add(&p.served, u64::from(report.served));
        if let Some(c) = policy.last_comparison() {
            p.spinning_per_s.store(c.spinning.per_second(), Ordering::Relaxed);
            p.asleep_per_s.store(c.asleep.per_second(), Ordering::Relaxed);
            p.winner.store(if c.spin_won { WINNER_SPIN } else { WINNER_SLEEP }, Ordering::Relaxed);
        }
    }
}

/// The part of a reactor that other threads touch.
struct Shared {
    id: usize,
    inbox: ArrayQueue<Message>,
    woken: SegQueue<TaskId>,
    sleep_gate: gate::SleepGate,
    stop: AtomicBool,
    wake_fd: sys::EventFd,
    stats: ReactorStats,
    /// Times the reactor went to sleep with nothing left to do.
    quiet: AtomicU64,
    /// Iterations that found no work with none queued, counted on a
    /// virtual clock only: what [`ReactorHandle::settle`] waits on.
    idle_ticks: AtomicU64,
    virtual_clock: bool,
}

impl Shared {
    /// Pairs with the [`gate::SleepGate`] handshake in `Reactor::sleep`: either the
    /// reactor sees our new work before sleeping, or we see it sleeping and
    /// signal its eventfd.
    fn notify(&self) {
        if self.sleep_gate.must_signal() {
            self.wake_fd.signal();
        }
    }
}

/// A cloneable, thread-safe way to reach a reactor.
#[derive(Clone)]
pub struct ReactorHandle {
    shared: Arc<Shared>,
}

impl ReactorHandle {
    pub fn id(&self) -> usize {
        self.shared.id
    }

    /// Queue `message` to run on the reactor. Messages from one sender
    /// arrive exactly once and in the order sent.
    pub fn send(&self, message: impl FnOnce() + Send + 'static) -> Result<(), SendError> {
        self.send_boxed(Box::new(message))
    }

    pub fn send_boxed(&self, message: Message) -> Result<(), SendError> {
        if self.shared.stop.load(Ordering::Acquire) {
            return Err(SendError::Stopped(message));
        }
        self.shared.inbox.push(message).map_err(SendError::Full)?;
        self.shared.notify();
        Ok(())
    }

    /// Ask the reactor to leave its loop after the current iteration.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake_fd.signal();
    }

    pub fn stats(&self) -> &ReactorStats {
        &self.shared.stats
    }

    /// Times the reactor has gone to sleep with nothing left to do.
    pub fn quiet_sleeps(&self) -> u64 {
        self.shared.quiet.load(Ordering::Acquire)
    }

    /// Wait until the reactor has done all it can without time moving or
    /// anything new arriving: it has run an iteration since this call,
    /// then one that found no work, with no task, message or timer due.
    /// For tests on a [`VirtualClock`], between advancing it and looking
    /// at what happened. False if the reactor stopped first.
    ///
    /// Work a task awaits from outside the reactor's pollers (another
    /// thread, a device that completes on its own) may still be coming.
    ///
    /// # Panics
    /// On a reactor whose clock is not virtual: only those count their
    /// idle iterations. And if it has not settled within `guard` of real
    /// time: a hang, which a test should report rather than wait on
    /// forever.
    pub fn settle(&self, guard: Duration) -> bool {
        assert!(self.shared.virtual_clock, "settle needs a reactor on a virtual clock");
        // Set on the reactor's thread, in an iteration that starts after
        // this call: the count of idle iterations so far.
        let mark = Arc::new(AtomicU64::new(u64::MAX));
        let seen = Arc::clone(&mark);
        let shared = Arc::clone(&self.shared);
        if self.send(move || seen.store(shared.idle_ticks.load(Ordering::Acquire), Ordering::Release)).is_err() {
            return false;
        }
        let deadline = Instant::now() + guard;
        loop {
            if self.shared.stop.load(Ordering::Acquire) {
                return false;
            }
            let mark = mark.load(Ordering::Acquire);
            if mark != u64::MAX && self.shared.idle_ticks.load(Ordering::Acquire) > mark {
                return true;
            }
            assert!(Instant::now() < deadline, "reactor {} did not settle within {guard:?}", self.id());
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Something a reactor polls each iteration.
pub trait Poller {
    /// Make progress without blocking; report whether there was work.
    fn poll(&mut self, now: Instant) -> bool;
    /// An fd that becomes readable when this source has work, for
    /// sleeping: an eventfd (reset by the reactor) unless
    /// [`Poller::wake_fd_is_eventfd`] says otherwise.
    fn wake_fd(&self) -> Option<RawFd> {
        None
    }
    /// False for an fd the poller reads itself (/dev/fuse, a socket): the
    /// reactor then never reads from it.
    fn wake_fd_is_eventfd(&self) -> bool {
        true
    }
    /// False while the source could make progress without signalling its
    /// wake_fd, so that the reactor must keep polling rather than sleep.
    fn can_sleep(&self) -> bool {
        true
    }
}

/// Where in the iteration a poller runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollerClass {
    /// Block devices: first, so completions free resources early.
    Device,
    /// Everything else: after timers and the inbox.
    Source,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TaskId {
    slot: u32,
    generation: u32,
}

struct TaskWaker {
    id: TaskId,
    mark: gate::WakeMark,
    shared: Arc<Shared>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if self.mark.mark() {
            self.shared.woken.push(self.id);
            self.shared.notify();
        }
    }
}

struct TaskSlot {
    generation: u32,
    future: Option<LocalFuture>,
    waker: Option<Arc<TaskWaker>>,
    /// The fair share its polls are charged to ([`Share`]).
    share: ShareIndex,
}

struct TimerEntry {
    deadline: Instant,
    seq: u64,
    waker: Waker,
}

impl PartialEq for TimerEntry {
    fn eq(&self, other: &Self) -> bool {
        (self.deadline, self.seq) == (other.deadline, other.seq)
    }
}
impl Eq for TimerEntry {}
impl PartialOrd for TimerEntry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for TimerEntry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.deadline, self.seq).cmp(&(other.deadline, other.seq))
    }
}

/// The reactor state reachable from tasks on its thread.
struct Local {
    shared: Arc<Shared>,
    now: Cell<Instant>,
    /// Tasks spawned since the last tick, with the share each was
    /// spawned under.
    spawned: RefCell<Vec<(LocalFuture, ShareIndex)>>,
    /// Fair shares of this reactor's time ([`Share`]), and the one the
    /// code running now works for: what it spawns is charged to it.
    shares: RefCell<FairShares>,
    current_share: Cell<ShareIndex>,
    /// Finished tasks' boxes, for the next task of the same type.
    idle_bodies: RefCell<IdleBodies>,
    timers: RefCell<BinaryHeap<Reverse<TimerEntry>>>,
    timer_seq: Cell<u64>,
    new_pollers: RefCell<Vec<(PollerClass, Box<dyn Poller>)>>,
    /// Requests the frontends on this reactor have served: the adaptive
    /// idle policy compares their rate spinning and asleep.
    served: Cell<u64>,
    /// Iterations started: a [`NextTick`] completes once it has moved.
    ticks: Cell<u64>,
    /// The [`NextTick`]s waiting, woken at the start of the next
    /// iteration; `spare` is the vector swapped in, so that neither is
    /// allocated again per iteration.
    next_tick: RefCell<Vec<Waker>>,
    next_tick_spare: RefCell<Vec<Waker>>,
}

thread_local! {
    static CURRENT: RefCell<Option<Rc<Local>>> = const { RefCell::new(None) };
}

/// Run `f` on this thread's reactor context. It is borrowed, not cloned:
/// the only mutable borrows of `CURRENT` are a reactor's creation and
/// drop, which nothing run here can reach, so calls nest freely.
fn with_local<R>(f: impl FnOnce(&Local) -> R) -> R {
    CURRENT.with(|c| f(c.borrow().as_ref().expect("called outside a reactor thread")))
}

/// Start a task on the current reactor. It is first polled in the next
/// task phase, never inline. A task whose future type ran before takes
/// the box a finished one left, so that a steady stream of like tasks
/// allocates none.
///
/// # Panics
/// Outside a reactor thread (a programming error).
#[inline(always)]
pub fn spawn_local<F: Future<Output = ()> + 'static>(future: F) {
    // Only the box crosses the thread-local's closures: the future is
    // written into it here (reactor/src/task.rs). Inlined into the
    // caller, which saved another copy of the future in a profile.
    let idle = with_local(|l| l.idle_bodies.borrow_mut().take_empty::<F>());
    let mut body = idle.unwrap_or_else(|| Box::pin(None));
    body.set(Some(future));
    let body: LocalFuture = body;
    with_local(|l| l.spawned.borrow_mut().push((body, l.current_share.get())));
}

/// Register a poller with the current reactor; it joins at the next tick.
pub fn register_poller(class: PollerClass, poller: Box<dyn Poller>) {
    with_local(|l| l.new_pollers.borrow_mut().push((class, poller)));
}

/// Count `requests` served by a frontend on the current reactor (a FUSE
/// request answered, whichever transport brought it). Outside a reactor
/// thread (a tool driving a session by hand) it counts nothing.
pub fn note_served(requests: u64) {
    CURRENT.with(|c| {
        if let Some(local) = c.borrow().as_ref() {
            local.served.set(local.served.get().wrapping_add(requests));
        }
    });
}

/// The time the current iteration started.
pub fn now() -> Instant {
    with_local(|l| l.now.get())
}

/// A handle to the reactor running the current thread.
pub fn current() -> ReactorHandle {
    with_local(|l| ReactorHandle { shared: Arc::clone(&l.shared) })
}

/// A fair share of the current reactor's time (reactor/src/shares.rs):
/// one per frontend that admits work, an export's queues, say. Tasks
/// spawned in [`Share::enter`], and the tasks they spawn, are charged to
/// it; [`Share::admits`] says whether it may start more work now. Made
/// and dropped on the reactor's thread.
pub struct Share {
    index: ShareIndex,
    /// The context of the reactor whose thread made it: asked directly,
    /// with no thread-local lookup, twice per request.
    local: Rc<Local>,
}

impl Share {
    /// Join the current reactor's shares.
    ///
    /// # Panics
    /// Outside a reactor thread, or past [`shares::SHARES_MAX`] shares.
    pub fn join() -> Self {
        let local = CURRENT.with(|c| c.borrow().clone()).expect("called outside a reactor thread");
        let index = local.shares.borrow_mut().join();
        Share { index, local }
    }

    /// Whether this share may start a request now. Alone on its reactor,
    /// always; beside another active share, while it has credit. A share
    /// refused keeps its work queued and asks again next tick: it is
    /// topped up when the others have spent theirs or the reactor idles.
    pub fn admits(&self) -> bool {
        self.local.shares.borrow_mut().admit(self.index)
    }

    /// Work as this share until the guard drops: what is spawned meanwhile
    /// is charged to it and keeps it active until done (a request's task).
    /// What those tasks spawn in turn is charged to it too, without
    /// keeping it active. A guard, not a closure: a request's future is
    /// built in the caller's frame and moved once, as without a share.
    pub fn enter(&self) -> Entered<'_> {
        let outer = self.local.current_share.replace(self.index | ENTERED);
        Entered { share: self, outer }
    }
}

/// [`Share::enter`]'s guard: the share the thread worked for before comes
/// back when it drops.
pub struct Entered<'a> {
    share: &'a Share,
    outer: ShareIndex,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.share.local.current_share.set(self.outer);
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.local.shares.borrow_mut().leave(self.index);
    }
}

/// What the current reactor's fair shares have done.
pub fn share_counters() -> ShareCounters {
    with_local(|l| l.shares.borrow().counters())
}

/// Complete once the reactor's clock reaches `deadline`.
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep { deadline }
}

pub fn sleep(duration: Duration) -> Sleep {
    sleep_until(now() + duration)
}

/// Complete in the reactor's next tick, after its pollers (device
/// completions, virtqueues) have run: for long work cut into pieces, which
/// [`yield_now`] would let run many times within one tick while requests
/// wait in their rings.
pub fn next_tick() -> NextTick {
    NextTick { after: with_local(|l| l.ticks.get()) }
}

/// See [`next_tick`]. Counted in iterations, not time: it completes on a
/// virtual clock that stands still too.
pub struct NextTick {
    /// The iteration it was made in.
    after: u64,
}

impl Future for NextTick {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        with_local(|l| {
            if l.ticks.get() > self.after {
                return Poll::Ready(());
            }
            l.next_tick.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        })
    }
}

/// Let the reactor's other woken tasks run before this one continues. A
/// loop whose awaits can all complete at once (cache hits) needs it to
/// stay fair.
pub async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

pub struct Sleep {
    deadline: Instant,
}

impl Future for Sleep {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = self.deadline;
        let ready = with_local(|l| {
            if l.now.get() >= deadline {
                return true;
            }
            let seq = l.timer_seq.get();
            l.timer_seq.set(seq + 1);
            l.timers.borrow_mut().push(Reverse(TimerEntry { deadline, seq, waker: cx.waker().clone() }));
            false
        });
        if ready {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

pub struct Reactor {
    config: ReactorConfig,
    local: Rc<Local>,
    tasks: Vec<TaskSlot>,
    free_tasks: Vec<u32>,
    live_tasks: usize,
    /// Futures spawned since the last tick, swapped with `Local::spawned`
    /// so that neither vector is allocated again per tick.
    spawn_batch: Vec<(LocalFuture, ShareIndex)>,
    device_pollers: Vec<Box<dyn Poller>>,
    source_pollers: Vec<Box<dyn Poller>>,
    epoll: sys::Epoll,
    idle: Idle,
}

/// The idle policy of a running reactor.
enum Idle {
    Busy,
    Interrupt,
    // Boxed: the policy is 256 bytes, the other variants none.
    Adaptive { policy: Box<IdlePolicy>, cpu_load: Option<Arc<CpuLoadProbe>> },
}

impl Idle {
    /// `cpus`: the CPUs the daemon may use, counted before the reactor's
    /// thread is pinned (the run queue it is compared with is the
    /// machine's, not one CPU's).
    fn new(config: &ReactorConfig, cpus: u32, now: Instant) -> Self {
        match config.mode {
            PollMode::Busy => Idle::Busy,
            PollMode::Interrupt => Idle::Interrupt,
            PollMode::Adaptive { idle_before_sleep } => {
                // Never opened here: a sandboxed reactor may not open files.
                let cpu_load = config.cpu_load.clone();
                if cpu_load.is_none() {
                    tracing::debug!("no CPU load probe given: the idle policy judges by time off the CPU alone");
                }
                let policy = Box::new(IdlePolicy::new(PolicyConfig::new(idle_before_sleep, cpus), now));
                Idle::Adaptive { policy, cpu_load }
            }
        }
    }
}

impl Reactor {
    /// Build a reactor on the calling thread, which it then owns.
    ///
    /// # Panics
    /// If the thread already has a reactor.
    pub fn new(config: ReactorConfig) -> std::io::Result<Self> {
        assert!(config.inbox_capacity > 0 && config.messages_per_tick_max > 0 && config.tasks_per_tick_max > 0);
        let cpus = sys::cpus_allowed();
        if let Some(cpu) = config.cpu {
            sys::pin_current_thread(cpu)?;
        }
        let shared = Arc::new(Shared {
            id: config.id,
            inbox: ArrayQueue::new(config.inbox_capacity),
            woken: SegQueue::new(),
            sleep_gate: gate::SleepGate::new(),
            stop: AtomicBool::new(false),
            wake_fd: sys::EventFd::new()?,
            stats: ReactorStats::default(),
            quiet: AtomicU64::new(0),
            idle_ticks: AtomicU64::new(0),
            virtual_clock: config.clock.is_virtual(),
        });
        let epoll = sys::Epoll::new()?;
        epoll.add(shared.wake_fd.raw(), true)?;
        shared.stats.publish_mode(config.mode);
        if let Clock::Virtual(clock) = &config.clock {
            clock.register(&shared);
        }
        let started = config.clock.now();
        let idle = Idle::new(&config, cpus, started);
        let local = Rc::new(Local {
            shared,
            now: Cell::new(started),
            spawned: RefCell::new(Vec::new()),
            shares: RefCell::default(),
            current_share: Cell::new(NO_SHARE),
            idle_bodies: RefCell::new(IdleBodies::default()),
            timers: RefCell::new(BinaryHeap::new()),
            timer_seq: Cell::new(0),
            new_pollers: RefCell::new(Vec::new()),
            served: Cell::new(0),
            ticks: Cell::new(0),
            next_tick: RefCell::new(Vec::new()),
            next_tick_spare: RefCell::new(Vec::new()),
        });
        CURRENT.with(|c| {
            let mut c = c.borrow_mut();
            assert!(c.is_none(), "this thread already runs a reactor");
            *c = Some(Rc::clone(&local));
        });
        Ok(Self {
            config,
            local,
            tasks: Vec::new(),
            free_tasks: Vec::new(),
            live_tasks: 0,
            spawn_batch: Vec::new(),
            device_pollers: Vec::new(),
            source_pollers: Vec::new(),
            epoll,
            idle,
        })
    }

    /// Start a reactor on a new thread, run `init` there, then loop until
    /// stopped.
    pub fn spawn(
        config: ReactorConfig,
        init: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<(ReactorHandle, std::thread::JoinHandle<()>)> {
        let (tx, rx) = std::sync::mpsc::channel();
        let name = format!("reactor-{}", config.id);
        let join = std::thread::Builder::new().name(name).spawn(move || {
            // Every event on this thread, from any layer, names its reactor.
            let _span = tracing::info_span!("reactor", id = config.id).entered();
            let config_cpu = config.cpu;
            let mut reactor = match Reactor::new(config) {
                Ok(r) => r,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let _ = tx.send(Ok(reactor.handle()));
            tracing::debug!(cpu = ?config_cpu, "reactor started");
            init();
            reactor.run();
            tracing::debug!("reactor stopped");
        })?;
        let handle = rx.recv().map_err(|_| std::io::Error::other("reactor thread died during start"))??;
        Ok((handle, join))
    }

    pub fn handle(&self) -> ReactorHandle {
        ReactorHandle { shared: Arc::clone(&self.local.shared) }
    }

    pub fn live_tasks(&self) -> usize {
        self.live_tasks
    }

    /// One iteration of the loop at time `now`. Returns whether any step
    /// found work.
    pub fn tick(&mut self, now: Instant) -> bool {
        self.local.now.set(now);
        self.local.ticks.set(self.local.ticks.get() + 1);
        self.adopt_new_pollers();
        let mut busy = false;
        for p in &mut self.device_pollers {
            busy |= p.poll(now);
        }
        busy |= self.wake_next_tick();
        busy |= self.fire_timers(now);
        busy |= self.run_messages();
        for p in &mut self.source_pollers {
            busy |= p.poll(now);
        }
        busy |= self.run_tasks();
        busy
    }

    /// Loop until [`ReactorHandle::stop`].
    pub fn run(&mut self) {
        self.run_until(|| false);
    }

    /// Run `future` to completion on this reactor, driving everything else
    /// meanwhile. For tools and tests.
    pub fn block_on<T: 'static>(&mut self, future: impl Future<Output = T> + 'static) -> T {
        let out: Rc<RefCell<Option<T>>> = Rc::new(RefCell::new(None));
        let slot = Rc::clone(&out);
        self.local.spawned.borrow_mut().push((
            Box::pin(Some(async move {
                *slot.borrow_mut() = Some(future.await);
            })),
            NO_SHARE,
        ));
        self.run_until(|| out.borrow().is_some());
        let value = out.borrow_mut().take();
        value.expect("block_on's future finished")
    }

    fn run_until(&mut self, mut done: impl FnMut() -> bool) {
        let shared = Arc::clone(&self.local.shared);
        let counts_idle_ticks = self.config.clock.is_virtual();
        let mut now = self.config.clock.now();
        while !done() && !shared.stop.load(Ordering::Acquire) {
            let busy = self.tick(now);
            let end = self.config.clock.now();
            let spent = (end - now).as_nanos() as u64;
            ReactorStats::add(&shared.stats.ticks, 1);
            ReactorStats::add(&shared.stats.loop_ns, spent);
            if busy {
                ReactorStats::add(&shared.stats.busy_ticks, 1);
                ReactorStats::add(&shared.stats.busy_ns, spent);
            } else if counts_idle_ticks && self.nothing_queued() {
                // Only a virtual clock's tests settle: a daemon's idle
                // iterations pay for no count.
                shared.idle_ticks.fetch_add(1, Ordering::AcqRel);
            }
            // Work just finished (`done`) counts as work: no sleep after it.
            now = self.idle(end, busy || done());
        }
    }

    /// After an iteration that ended at `end`: spin or sleep as the idle
    /// policy says, and close the policy's window when one is due. Returns
    /// the time the next iteration starts at (one clock read per
    /// iteration, except after a sleep).
    fn idle(&mut self, end: Instant, busy: bool) -> Instant {
        let action = match &mut self.idle {
            Idle::Busy => IdleAction::Spin,
            Idle::Interrupt => IdleAction::Sleep,
            Idle::Adaptive { policy, .. } => policy.after_tick(end, busy),
        };
        let mut now = end;
        if !busy {
            match action {
                IdleAction::Spin => std::hint::spin_loop(),
                IdleAction::Sleep => {
                    let slept = self.sleep(end);
                    if !slept.is_zero() {
                        now = self.config.clock.now();
                    }
                    if let Idle::Adaptive { policy, .. } = &mut self.idle {
                        policy.after_sleep(slept);
                    }
                }
            }
        }
        if let Idle::Adaptive { policy, cpu_load } = &mut self.idle {
            if policy.window_due(now) {
                let load = cpu_load.as_ref().map(|probe| probe.read()).unwrap_or_default();
                let sample = CpuSample {
                    thread_cpu: sys::thread_cpu_time(),
                    runnable: load.runnable,
                    stalled: load.stalled,
                    served: self.local.served.get(),
                };
                if let Some(regime) = policy.end_window(now, sample) {
                    let report = policy.last_window();
                    tracing::debug!(?regime, reason = policy.reason().name(), ?report, "idle policy switched");
                }
                self.local.shared.stats.publish_window(policy);
            }
        }
        now
    }

    /// No task spawned or waiting for the next iteration, no message or
    /// wake-up in the inbox.
    fn nothing_queued(&self) -> bool {
        let local = &self.local;
        local.spawned.borrow().is_empty()
            && local.new_pollers.borrow().is_empty()
            && local.next_tick.borrow().is_empty()
            && local.shared.inbox.is_empty()
            && local.shared.woken.is_empty()
    }

    /// Wait in epoll until something may have work. Returns how long it
    /// waited: zero when it did not.
    fn sleep(&mut self, now: Instant) -> Duration {
        let all_can_sleep = self.device_pollers.iter().chain(&self.source_pollers).all(|p| p.can_sleep());
        let local = &self.local;
        if !all_can_sleep
            || !local.spawned.borrow().is_empty()
            || !local.new_pollers.borrow().is_empty()
            || !local.next_tick.borrow().is_empty()
        {
            return Duration::ZERO;
        }
        let shared = &local.shared;
        shared.sleep_gate.begin_sleep();
        let mut slept = Duration::ZERO;
        let next_deadline = local.timers.borrow().peek().map(|Reverse(t)| t.deadline);
        // A virtual clock may have been advanced past a deadline since this
        // iteration read it; read after `sleeping` is set, either this sees
        // the advance or the advance sees the reactor asleep and wakes it.
        let clock = &self.config.clock;
        let due = clock.is_virtual() && next_deadline.is_some_and(|deadline| deadline <= clock.now());
        if !due && shared.inbox.is_empty() && shared.woken.is_empty() && !shared.stop.load(Ordering::Acquire) {
            // Real time does not move a virtual clock: only an advance,
            // which wakes the reactor, brings a deadline nearer.
            let timeout = match clock {
                Clock::Monotonic => next_deadline.map(|deadline| deadline.saturating_duration_since(now)),
                Clock::Virtual(_) => None,
            };
            shared.quiet.fetch_add(1, Ordering::AcqRel);
            let asleep = clock.now();
            self.epoll.wait(timeout);
            // At least a nanosecond: a wait happened, however short.
            slept = clock.now().saturating_duration_since(asleep).max(Duration::from_nanos(1));
            ReactorStats::add(&shared.stats.sleeps, 1);
            ReactorStats::add(&shared.stats.sleep_ns, slept.as_nanos() as u64);
        }
        shared.sleep_gate.end_sleep();
        slept
    }

    fn adopt_new_pollers(&mut self) {
        // Every iteration asks; almost none has any (a spinning reactor
        // showed the empty collect at 3% of its samples).
        if self.local.new_pollers.borrow().is_empty() {
            return;
        }
        let new: Vec<_> = self.local.new_pollers.borrow_mut().drain(..).collect();
        for (class, poller) in new {
            if let Some(fd) = poller.wake_fd() {
                // An fd that cannot be watched only costs us sleep: the
                // poller still runs every iteration.
                let _ = self.epoll.add(fd, poller.wake_fd_is_eventfd());
            }
            match class {
                PollerClass::Device => self.device_pollers.push(poller),
                PollerClass::Source => self.source_pollers.push(poller),
            }
        }
    }

    /// Wake every [`NextTick`] made before this iteration.
    fn wake_next_tick(&mut self) -> bool {
        let local = &self.local;
        // Most iterations have none: one check, no swap.
        if local.next_tick.borrow().is_empty() {
            return false;
        }
        let mut waiting = local.next_tick_spare.take();
        debug_assert!(waiting.is_empty());
        std::mem::swap(&mut *local.next_tick.borrow_mut(), &mut waiting);
        let woke = !waiting.is_empty();
        for waker in waiting.drain(..) {
            waker.wake();
        }
        *local.next_tick_spare.borrow_mut() = waiting;
        woke
    }

    fn fire_timers(&mut self, now: Instant) -> bool {
        let mut fired = false;
        loop {
            let mut timers = self.local.timers.borrow_mut();
            match timers.peek() {
                Some(Reverse(t)) if t.deadline <= now => {
                    let Reverse(entry) = timers.pop().expect("peeked");
                    drop(timers);
                    entry.waker.wake();
                    fired = true;
                }
                _ => return fired,
            }
        }
    }

    fn run_messages(&mut self) -> bool {
        let shared = Arc::clone(&self.local.shared);
        let mut ran = 0;
        while ran < self.config.messages_per_tick_max {
            let Some(message) = shared.inbox.pop() else { break };
            message();
            ran += 1;
        }
        ReactorStats::add(&shared.stats.messages, ran as u64);
        ran > 0
    }

    fn insert_task(&mut self, future: LocalFuture, share: ShareIndex) {
        let slot = match self.free_tasks.pop() {
            Some(slot) => slot,
            None => {
                self.tasks.push(TaskSlot { generation: 0, future: None, waker: None, share: NO_SHARE });
                (self.tasks.len() - 1) as u32
            }
        };
        let entry = &mut self.tasks[slot as usize];
        entry.generation = entry.generation.wrapping_add(1);
        let id = TaskId { slot, generation: entry.generation };
        // The slot's last waker is reused when nothing else holds it (a
        // waker kept by a finished task's timer or I/O would otherwise
        // wake the new task under the old id: that one gets a new waker).
        let waker = match entry.waker.as_mut().and_then(Arc::get_mut) {
            Some(reused) => {
                reused.id = id;
                reused.mark.reset();
                Arc::clone(entry.waker.as_ref().expect("reused above"))
            }
            None => {
                let fresh =
                    Arc::new(TaskWaker { id, mark: gate::WakeMark::new(), shared: Arc::clone(&self.local.shared) });
                entry.waker = Some(Arc::clone(&fresh));
                fresh
            }
        };
        entry.future = Some(future);
        entry.share = share;
        if share & ENTERED != 0 {
            self.local.shares.borrow_mut().task_started(index_of(share));
        }
        self.live_tasks += 1;
        Waker::from(waker).wake();
    }

    fn run_tasks(&mut self) -> bool {
        std::mem::swap(&mut *self.local.spawned.borrow_mut(), &mut self.spawn_batch);
        let mut batch = std::mem::take(&mut self.spawn_batch);
        for (future, share) in batch.drain(..) {
            self.insert_task(future, share);
        }
        self.spawn_batch = batch;
        let shared = Arc::clone(&self.local.shared);
        // While shares contend, each poll is metered: one clock read after
        // it, its start being the last poll's end. Alone, none.
        let mut metered_from = self.local.shares.borrow().contended().then(|| self.config.clock.now());
        let mut polled = 0;
        while polled < self.config.tasks_per_tick_max {
            let Some(id) = shared.woken.pop() else { break };
            let Some(entry) = self.tasks.get_mut(id.slot as usize) else { continue };
            if entry.generation != id.generation {
                continue; // a wake for a task that already finished
            }
            let (Some(mut future), Some(waker)) = (entry.future.take(), entry.waker.clone()) else { continue };
            let share = entry.share;
            waker.mark.clear();
            let std_waker = Waker::from(waker);
            let mut cx = Context::from_waker(&std_waker);
            polled += 1;
            // What it spawns is charged to its share (not counted active).
            self.local.current_share.set(index_of(share));
            let poll = future.as_mut().poll_body(&mut cx);
            self.local.current_share.set(NO_SHARE);
            if let Some(from) = metered_from.as_mut() {
                let end = self.config.clock.now();
                if index_of(share) != NO_SHARE {
                    let spent = end.saturating_duration_since(*from).as_nanos() as u64;
                    self.local.shares.borrow_mut().charge(index_of(share), spent);
                }
                *from = end;
            }
            match poll {
                Poll::Ready(()) => {
                    self.local.idle_bodies.borrow_mut().give_back(future);
                    // The waker stays in the slot for the next task (this
                    // poll's clone is dropped first, so that it may be
                    // reused); wakes through stale clones carry the old
                    // generation.
                    drop(std_waker);
                    let entry = &mut self.tasks[id.slot as usize];
                    entry.generation = entry.generation.wrapping_add(1);
                    if entry.share & ENTERED != 0 {
                        self.local.shares.borrow_mut().task_finished(index_of(entry.share));
                    }
                    entry.share = NO_SHARE;
                    self.free_tasks.push(id.slot);
                    self.live_tasks -= 1;
                }
                Poll::Pending => self.tasks[id.slot as usize].future = Some(future),
            }
        }
        ReactorStats::add(&shared.stats.task_polls, polled as u64);
        let mut shares = self.local.shares.borrow_mut();
        if polled == 0 {
            shares.reactor_idle();
        }
        if shares.counters().rounds != shared.stats.share_rounds.load(Ordering::Relaxed) {
            // Refusals and rounds only move while shares contend, and every
            // contention ends in a round: published with the rounds.
            let counters = shares.counters();
            shared.stats.share_refusals.store(counters.refusals, Ordering::Relaxed);
            shared.stats.share_rounds.store(counters.rounds, Ordering::Relaxed);
            shared.stats.share_idle_rounds.store(counters.idle_rounds, Ordering::Relaxed);
        }
        polled > 0
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        self.local.shared.stop.store(true, Ordering::Release);
        // Tasks may hold I/O futures whose drop reaches the reactor's
        // context: drop them while the context still exists.
        self.tasks.clear();
        self.local.spawned.borrow_mut().clear();
        CURRENT.with(|c| c.borrow_mut().take());
    }
}
