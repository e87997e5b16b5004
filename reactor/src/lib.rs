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
//! Idle policy ([`PollMode`]): `Busy` never sleeps; `Adaptive` sleeps in
//! epoll after an idle spell; `Interrupt` sleeps whenever an iteration found
//! no work. A sleeping reactor wakes on its own eventfd (signalled by
//! senders and cross-thread wakers), on its pollers' eventfds, or at the
//! next timer deadline.

// Unsafe code lives in two modules: `sys` (system calls) and `io` (handing
// buffers to the device).
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod io;
mod remote;
#[allow(unsafe_code)]
mod sys;

pub use io::{
    await_all, BufferSlice, ChannelStats, DeviceChannel, IntoAny, IoBuffer, IoFuture, IoVecs, NoBuffer, RangeBusy,
    SharedBuffer,
};
pub use remote::{call, call_and_wait, Call, CallError, Unsent};
pub use sys::thread_cpu_time;

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crossbeam::queue::{ArrayQueue, SegQueue};

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
}

impl ReactorStats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// The part of a reactor that other threads touch.
struct Shared {
    id: usize,
    inbox: ArrayQueue<Message>,
    woken: SegQueue<TaskId>,
    sleeping: AtomicBool,
    stop: AtomicBool,
    wake_fd: sys::EventFd,
    stats: ReactorStats,
}

impl Shared {
    /// Pairs with the store-fence-check in `Reactor::sleep`: either the
    /// reactor sees our new work before sleeping, or we see it sleeping and
    /// signal its eventfd.
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
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

type LocalFuture = Pin<Box<dyn Future<Output = ()>>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TaskId {
    slot: u32,
    generation: u32,
}

struct TaskWaker {
    id: TaskId,
    queued: AtomicBool,
    shared: Arc<Shared>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            self.shared.woken.push(self.id);
            self.shared.notify();
        }
    }
}

struct TaskSlot {
    generation: u32,
    future: Option<LocalFuture>,
    waker: Option<Arc<TaskWaker>>,
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
    spawned: RefCell<Vec<LocalFuture>>,
    timers: RefCell<BinaryHeap<Reverse<TimerEntry>>>,
    timer_seq: Cell<u64>,
    new_pollers: RefCell<Vec<(PollerClass, Box<dyn Poller>)>>,
}

thread_local! {
    static CURRENT: RefCell<Option<Rc<Local>>> = const { RefCell::new(None) };
}

fn with_local<R>(f: impl FnOnce(&Local) -> R) -> R {
    CURRENT.with(|c| {
        let local = c.borrow().clone().expect("called outside a reactor thread");
        f(&local)
    })
}

/// Start a task on the current reactor. It is first polled in the next
/// task phase, never inline.
///
/// # Panics
/// Outside a reactor thread (a programming error).
pub fn spawn_local(future: impl Future<Output = ()> + 'static) {
    spawn_local_boxed(Box::pin(future));
}

/// [`spawn_local`] for a future that is boxed already: the task takes the
/// box as it is, with no second allocation.
pub fn spawn_local_boxed(future: Pin<Box<dyn Future<Output = ()>>>) {
    with_local(|l| l.spawned.borrow_mut().push(future));
}

/// Register a poller with the current reactor; it joins at the next tick.
pub fn register_poller(class: PollerClass, poller: Box<dyn Poller>) {
    with_local(|l| l.new_pollers.borrow_mut().push((class, poller)));
}

/// The time the current iteration started.
pub fn now() -> Instant {
    with_local(|l| l.now.get())
}

/// A handle to the reactor running the current thread.
pub fn current() -> ReactorHandle {
    with_local(|l| ReactorHandle { shared: Arc::clone(&l.shared) })
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
pub fn next_tick() -> Sleep {
    // A deadline just past this tick's clock: the next tick's timers fire it.
    sleep_until(now() + Duration::from_nanos(1))
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
    spawn_batch: Vec<LocalFuture>,
    device_pollers: Vec<Box<dyn Poller>>,
    source_pollers: Vec<Box<dyn Poller>>,
    epoll: sys::Epoll,
}

impl Reactor {
    /// Build a reactor on the calling thread, which it then owns.
    ///
    /// # Panics
    /// If the thread already has a reactor.
    pub fn new(config: ReactorConfig) -> std::io::Result<Self> {
        assert!(config.inbox_capacity > 0 && config.messages_per_tick_max > 0 && config.tasks_per_tick_max > 0);
        if let Some(cpu) = config.cpu {
            sys::pin_current_thread(cpu)?;
        }
        let shared = Arc::new(Shared {
            id: config.id,
            inbox: ArrayQueue::new(config.inbox_capacity),
            woken: SegQueue::new(),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            wake_fd: sys::EventFd::new()?,
            stats: ReactorStats::default(),
        });
        let epoll = sys::Epoll::new()?;
        epoll.add(shared.wake_fd.raw(), true)?;
        let local = Rc::new(Local {
            shared,
            now: Cell::new(Instant::now()),
            spawned: RefCell::new(Vec::new()),
            timers: RefCell::new(BinaryHeap::new()),
            timer_seq: Cell::new(0),
            new_pollers: RefCell::new(Vec::new()),
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
        self.adopt_new_pollers();
        let mut busy = false;
        for p in &mut self.device_pollers {
            busy |= p.poll(now);
        }
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
        self.local.spawned.borrow_mut().push(Box::pin(async move {
            *slot.borrow_mut() = Some(future.await);
        }));
        self.run_until(|| out.borrow().is_some());
        let value = out.borrow_mut().take();
        value.expect("block_on's future finished")
    }

    fn run_until(&mut self, mut done: impl FnMut() -> bool) {
        let stats = &Arc::clone(&self.local.shared);
        let mut last_busy = Instant::now();
        let mut now = last_busy;
        while !done() && !stats.stop.load(Ordering::Acquire) {
            let busy = self.tick(now);
            let end = Instant::now();
            let spent = (end - now).as_nanos() as u64;
            ReactorStats::add(&stats.stats.ticks, 1);
            ReactorStats::add(&stats.stats.loop_ns, spent);
            if busy {
                ReactorStats::add(&stats.stats.busy_ticks, 1);
                ReactorStats::add(&stats.stats.busy_ns, spent);
                last_busy = end;
                now = end;
            } else if !done() {
                let slept = match self.config.mode {
                    PollMode::Busy => {
                        std::hint::spin_loop();
                        false
                    }
                    PollMode::Adaptive { idle_before_sleep } => end - last_busy >= idle_before_sleep && self.sleep(end),
                    PollMode::Interrupt => self.sleep(end),
                };
                // One clock read per iteration, except after a sleep.
                now = if slept { Instant::now() } else { end };
            } else {
                now = end;
            }
        }
    }

    /// Wait in epoll until something may have work. Returns whether it
    /// actually waited.
    fn sleep(&mut self, now: Instant) -> bool {
        let all_can_sleep = self.device_pollers.iter().chain(&self.source_pollers).all(|p| p.can_sleep());
        if !all_can_sleep || !self.local.spawned.borrow().is_empty() || !self.local.new_pollers.borrow().is_empty() {
            return false;
        }
        let shared = &self.local.shared;
        shared.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if shared.inbox.is_empty() && shared.woken.is_empty() && !shared.stop.load(Ordering::Acquire) {
            let timeout = self.local.timers.borrow().peek().map(|Reverse(t)| t.deadline.saturating_duration_since(now));
            let asleep = Instant::now();
            self.epoll.wait(timeout);
            ReactorStats::add(&shared.stats.sleeps, 1);
            ReactorStats::add(&shared.stats.sleep_ns, asleep.elapsed().as_nanos() as u64);
            shared.sleeping.store(false, Ordering::SeqCst);
            return true;
        }
        shared.sleeping.store(false, Ordering::SeqCst);
        false
    }

    fn adopt_new_pollers(&mut self) {
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

    fn insert_task(&mut self, future: LocalFuture) {
        let slot = match self.free_tasks.pop() {
            Some(slot) => slot,
            None => {
                self.tasks.push(TaskSlot { generation: 0, future: None, waker: None });
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
                *reused.queued.get_mut() = false;
                Arc::clone(entry.waker.as_ref().expect("reused above"))
            }
            None => {
                let fresh =
                    Arc::new(TaskWaker { id, queued: AtomicBool::new(false), shared: Arc::clone(&self.local.shared) });
                entry.waker = Some(Arc::clone(&fresh));
                fresh
            }
        };
        entry.future = Some(future);
        self.live_tasks += 1;
        Waker::from(waker).wake();
    }

    fn run_tasks(&mut self) -> bool {
        std::mem::swap(&mut *self.local.spawned.borrow_mut(), &mut self.spawn_batch);
        let mut batch = std::mem::take(&mut self.spawn_batch);
        for future in batch.drain(..) {
            self.insert_task(future);
        }
        self.spawn_batch = batch;
        let shared = Arc::clone(&self.local.shared);
        let mut polled = 0;
        while polled < self.config.tasks_per_tick_max {
            let Some(id) = shared.woken.pop() else { break };
            let Some(entry) = self.tasks.get_mut(id.slot as usize) else { continue };
            if entry.generation != id.generation {
                continue; // a wake for a task that already finished
            }
            let (Some(mut future), Some(waker)) = (entry.future.take(), entry.waker.clone()) else { continue };
            waker.queued.store(false, Ordering::Release);
            let std_waker = Waker::from(waker);
            let mut cx = Context::from_waker(&std_waker);
            polled += 1;
            match future.as_mut().poll(&mut cx) {
                Poll::Ready(()) => {
                    // The waker stays in the slot for the next task (this
                    // poll's clone is dropped first, so that it may be
                    // reused); wakes through stale clones carry the old
                    // generation.
                    drop(std_waker);
                    let entry = &mut self.tasks[id.slot as usize];
                    entry.generation = entry.generation.wrapping_add(1);
                    self.free_tasks.push(id.slot);
                    self.live_tasks -= 1;
                }
                Poll::Pending => self.tasks[id.slot as usize].future = Some(future),
            }
        }
        ReactorStats::add(&shared.stats.task_polls, polled as u64);
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
