//! The reactor runtime: ordered exactly-once messaging, idle sleep, timers,
//! and I/O that never stalls other tasks.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use keelfs_base::testing::{fill_pattern, ScratchFile};
use keelfs_bdev::{
    AlignedBuf, BdevError, BlockDevice, Completion, Geometry, IoQueue, IoRequest, MappedDevice, QueueConfig,
    UringDevice, UringOptions,
};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{
    self as reactor, Clock, PollMode, Reactor, ReactorConfig, ReactorHandle, SendError, VirtualClock,
};

fn config(id: usize, mode: PollMode) -> ReactorConfig {
    ReactorConfig { id, mode, ..ReactorConfig::default() }
}

/// Send, retrying while the inbox is full (backpressure, not loss).
fn send_retrying(to: &ReactorHandle, mut message: reactor::Message) {
    loop {
        match to.send_boxed(message) {
            Ok(()) => return,
            Err(SendError::Full(m)) => {
                message = m;
                std::thread::yield_now();
            }
            Err(SendError::Stopped(_)) => panic!("receiver stopped"),
        }
    }
}

#[test]
fn cross_core_messages_arrive_exactly_once_in_order_per_sender() {
    const PER_SENDER: usize = 20_000;
    let seen: Arc<Mutex<Vec<(usize, usize)>>> = Arc::new(Mutex::new(Vec::with_capacity(4 * PER_SENDER)));
    let small_inbox = ReactorConfig { inbox_capacity: 64, ..config(0, PollMode::ADAPTIVE_DEFAULT) };
    let (receiver, receiver_join) = Reactor::spawn(small_inbox, || {}).unwrap();

    // Two senders are other reactors (cross-core), two are plain threads.
    let mut joins = Vec::new();
    let mut sender_reactors = Vec::new();
    for sender in 0..2 {
        let (done_tx, done_rx) = mpsc::channel();
        let (handle, join) = Reactor::spawn(config(sender + 1, PollMode::ADAPTIVE_DEFAULT), || {}).unwrap();
        let to = receiver.clone();
        let seen = Arc::clone(&seen);
        handle
            .send(move || {
                for seq in 0..PER_SENDER {
                    let seen = Arc::clone(&seen);
                    send_retrying(&to, Box::new(move || seen.lock().unwrap().push((sender, seq))));
                }
                done_tx.send(()).unwrap();
            })
            .unwrap();
        sender_reactors.push((handle, join, done_rx));
    }
    for sender in 2..4 {
        let to = receiver.clone();
        let seen = Arc::clone(&seen);
        joins.push(std::thread::spawn(move || {
            for seq in 0..PER_SENDER {
                let seen = Arc::clone(&seen);
                send_retrying(&to, Box::new(move || seen.lock().unwrap().push((sender, seq))));
            }
        }));
    }
    for j in joins {
        j.join().unwrap();
    }
    for (handle, join, done) in sender_reactors {
        done.recv().unwrap();
        handle.stop();
        join.join().unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.lock().unwrap().len() < 4 * PER_SENDER && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(20)); // let any duplicate show up
    receiver.stop();
    receiver_join.join().unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 4 * PER_SENDER, "every message exactly once");
    let mut next = [0usize; 4];
    for &(sender, seq) in seen.iter() {
        assert_eq!(seq, next[sender], "sender {sender} out of order");
        next[sender] += 1;
    }
}

#[test]
fn a_message_never_runs_inline_even_when_sent_to_self() {
    let mut r = Reactor::new(config(0, PollMode::Busy)).unwrap();
    let me = r.handle();
    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    let observed_inline = r.block_on(async move {
        me.send(move || flag.store(true, Ordering::SeqCst)).unwrap();
        let inline = ran.load(Ordering::SeqCst);
        reactor::sleep(Duration::from_millis(1)).await;
        assert!(ran.load(Ordering::SeqCst), "message ran by the next iteration");
        inline
    });
    assert!(!observed_inline);
}

/// A reactor on a virtual clock, and the clock.
fn on_virtual_clock(id: usize, mode: PollMode) -> (ReactorHandle, std::thread::JoinHandle<()>, Arc<VirtualClock>) {
    let clock = VirtualClock::new();
    let config = ReactorConfig { clock: Clock::Virtual(Arc::clone(&clock)), ..config(id, mode) };
    let (handle, join) = Reactor::spawn(config, || {}).unwrap();
    (handle, join, clock)
}

/// Run `job` on the reactor and wait for its answer.
fn ask<T: Send + 'static>(handle: &ReactorHandle, job: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    handle.send(move || tx.send(job()).unwrap()).unwrap();
    rx.recv_timeout(GUARD).expect("the reactor answered")
}

/// A hang guard, not a measurement: nothing here waits on real time.
const GUARD: Duration = Duration::from_secs(60);

#[test]
fn an_idle_adaptive_reactor_sleeps_once_its_spin_budget_has_passed_on_its_clock() {
    let budget = Duration::from_millis(1);
    let (r, join, clock) = on_virtual_clock(0, PollMode::Adaptive { idle_before_sleep: budget });
    // Its clock stands still: an idle spell never reaches the budget, so
    // the policy spins however long the machine takes.
    ask(&r, || ());
    ask(&r, || ());
    assert_eq!(r.stats().sleeps.load(Ordering::Relaxed), 0, "slept before its clock passed the budget");
    assert_eq!(r.quiet_sleeps(), 0);
    // Let it start its idle spell before time moves: a spell that starts
    // after the advance never reaches the budget. The answer came from a
    // busy iteration that may not be counted yet; two more are idle.
    let ticks = || r.stats().ticks.load(Ordering::Relaxed);
    let idle_from = ticks() + 3;
    let deadline = Instant::now() + GUARD;
    while ticks() < idle_from {
        assert!(Instant::now() < deadline, "the reactor stopped iterating");
        std::thread::yield_now();
    }
    clock.advance(budget);
    // Not `settle`: its message would be work, and the idle spell would
    // start again on a clock that stands still.
    let deadline = Instant::now() + GUARD;
    while r.quiet_sleeps() == 0 {
        assert!(Instant::now() < deadline, "not asleep after its budget passed");
        std::thread::sleep(Duration::from_micros(100));
    }
    assert_eq!(r.quiet_sleeps(), 1, "one sleep, however many spins came before");
    r.stop();
    join.join().unwrap();
}

#[test]
fn a_busy_polling_reactor_never_sleeps() {
    let (r, join, clock) = on_virtual_clock(0, PollMode::Busy);
    clock.advance(Duration::from_secs(1));
    ask(&r, || ());
    // A thousand idle iterations, with seconds passed on its clock: a
    // reactor that slept would count a sleep for each.
    let ticks = || r.stats().ticks.load(Ordering::Relaxed);
    let deadline = Instant::now() + GUARD;
    while ticks() < 1000 {
        assert!(Instant::now() < deadline, "the reactor stopped iterating");
        std::thread::yield_now();
    }
    assert_eq!(r.stats().sleeps.load(Ordering::Relaxed), 0, "a busy-polling reactor never sleeps");
    assert_eq!(r.quiet_sleeps(), 0);
    r.stop();
    join.join().unwrap();
}

#[test]
fn sleeping_reactors_wake_for_messages_and_timers() {
    let (r, join, clock) = on_virtual_clock(0, PollMode::Interrupt);
    for _ in 0..50 {
        assert!(r.settle(GUARD));
        ask(&r, || ());
    }
    let fired: Arc<Mutex<Option<Duration>>> = Arc::default();
    let slot = Arc::clone(&fired);
    r.send(move || {
        reactor::spawn_local(async move {
            let start = reactor::now();
            reactor::sleep(Duration::from_millis(30)).await;
            *slot.lock().unwrap() = Some(reactor::now() - start);
        })
    })
    .unwrap();
    assert!(r.settle(GUARD));
    let sleeps = r.stats().sleeps.load(Ordering::Relaxed);
    clock.advance(Duration::from_micros(29_999));
    assert!(r.settle(GUARD));
    assert_eq!(*fired.lock().unwrap(), None, "fired before its deadline");
    assert!(r.stats().sleeps.load(Ordering::Relaxed) > sleeps, "the advance woke the sleeping reactor");
    // The advance alone wakes it: no message, no settle, before the timer
    // fires.
    clock.advance(Duration::from_micros(1));
    let deadline = Instant::now() + GUARD;
    while fired.lock().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the timer did not fire after the advance");
        std::thread::sleep(Duration::from_micros(100));
    }
    assert_eq!(*fired.lock().unwrap(), Some(Duration::from_millis(30)), "fired at its deadline exactly");
    r.stop();
    join.join().unwrap();
}

#[test]
fn next_tick_completes_on_a_clock_that_stands_still() {
    let (r, join, _clock) = on_virtual_clock(0, PollMode::Interrupt);
    let ticks: Arc<Mutex<Vec<u64>>> = Arc::default();
    let seen = Arc::clone(&ticks);
    let handle = r.clone();
    r.send(move || {
        reactor::spawn_local(async move {
            for _ in 0..3 {
                reactor::next_tick().await;
                seen.lock().unwrap().push(handle.stats().ticks.load(Ordering::Relaxed));
            }
        })
    })
    .unwrap();
    assert!(r.settle(GUARD));
    let ticks = ticks.lock().unwrap().clone();
    assert_eq!(ticks.len(), 3, "each next_tick completed with no time passing");
    assert!(ticks.windows(2).all(|w| w[1] > w[0]), "one iteration apart at least: {ticks:?}");
    r.stop();
    join.join().unwrap();
}

/// A device whose completions are held until the test opens the gate.
struct GatedQueue {
    gate: Rc<Cell<bool>>,
    held: Vec<Completion>,
}

// SAFETY: test-only; the queue never leaves the reactor thread.
unsafe impl Send for GatedQueue {}

impl IoQueue for GatedQueue {
    fn geometry(&self) -> Geometry {
        Geometry {
            capacity_bytes: 1 << 20,
            logical_block_size: 512,
            memory_alignment: 512,
            volatile_write_cache: false,
            max_iovecs_per_request: 4,
            max_request_bytes: 1 << 20,
        }
    }
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), BdevError> {
        self.held.push(Completion { token: req.token, result: Ok(req.total_bytes() as u32) });
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        if !self.gate.get() {
            return 0;
        }
        let n = max.min(self.held.len());
        out.extend(self.held.drain(..n));
        n
    }
    fn in_flight(&self) -> usize {
        self.held.len()
    }
}

#[test]
fn a_task_waiting_on_io_never_stalls_the_others() {
    let mut r = Reactor::new(config(0, PollMode::Busy)).unwrap();
    let gate = Rc::new(Cell::new(false));
    let channel = DeviceChannel::attach(Box::new(GatedQueue { gate: Rc::clone(&gate), held: Vec::new() }));
    let progress = Rc::new(Cell::new(0u32));
    let io_done = Rc::new(Cell::new(false));
    {
        let (progress, io_done) = (Rc::clone(&progress), Rc::clone(&io_done));
        reactor::spawn_local(async move {
            let (_buf, result) = channel.read(0, AlignedBuf::zeroed(4096, 4096)).await;
            assert_eq!(result, Ok(4096));
            assert!(progress.get() >= 1000, "I/O finished only after the other task ran");
            io_done.set(true);
        });
    }
    let (p, g, done) = (Rc::clone(&progress), Rc::clone(&gate), Rc::clone(&io_done));
    r.block_on(async move {
        // If the I/O task blocked the thread, this loop would never run and
        // the gate would never open.
        for _ in 0..1000 {
            p.set(p.get() + 1);
            reactor::sleep(Duration::ZERO).await;
            reactor::yield_now().await;
        }
        g.set(true);
        while !done.get() {
            reactor::yield_now().await;
        }
    });
    assert!(io_done.get());
}

#[test]
fn channel_queues_requests_beyond_device_depth_and_completes_them_all() {
    let mut r = Reactor::new(config(0, PollMode::Busy)).unwrap();
    let ram = MappedDevice::ram(1 << 20, 4096).unwrap();
    let channel = DeviceChannel::attach(ram.open_queue(QueueConfig { depth: 4, completion_eventfd: false }).unwrap());
    let done = Rc::new(Cell::new(0usize));
    for i in 0..64u64 {
        let (channel, done) = (channel.clone(), Rc::clone(&done));
        reactor::spawn_local(async move {
            let mut buf = AlignedBuf::zeroed(4096, 4096);
            fill_pattern(&mut buf, i);
            let (buf, result) = channel.write(i * 4096, buf).await;
            assert_eq!(result, Ok(4096));
            let (back, result) = channel.read(i * 4096, AlignedBuf::zeroed(4096, 4096)).await;
            assert_eq!(result, Ok(4096));
            assert!(back[..] == buf[..], "block {i} reads back");
            done.set(done.get() + 1);
        });
    }
    let c2 = channel.clone();
    let d2 = Rc::clone(&done);
    r.block_on(async move {
        while d2.get() < 64 {
            reactor::yield_now().await;
        }
        let (_, flushed) = c2.flush().await;
        assert_eq!(flushed, Ok(0));
    });
    let stats = channel.stats();
    assert_eq!(stats.submitted, 129);
    assert_eq!(stats.completed, 129);
    assert!(stats.queue_full_waits > 0, "the depth-4 queue must have pushed back");
    assert!(stats.in_flight_max <= 4);
}

#[test]
fn bad_io_through_a_channel_is_an_error_result() {
    let mut r = Reactor::new(config(0, PollMode::Busy)).unwrap();
    let ram = MappedDevice::ram(1 << 20, 4096).unwrap();
    let channel = DeviceChannel::attach(ram.open_queue(QueueConfig::default()).unwrap());
    let result = r.block_on(async move { channel.read(1 << 20, AlignedBuf::zeroed(4096, 4096)).await.1 });
    assert!(matches!(result, Err(BdevError::OutOfRange { .. })));
}

#[test]
fn dropping_an_io_future_in_flight_is_safe() {
    let mut r = Reactor::new(config(0, PollMode::Busy)).unwrap();
    let file = ScratchFile::new("drop", 1 << 20);
    let dev = UringDevice::open(&file.path, UringOptions::default()).unwrap();
    let channel = DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
    let c = channel.clone();
    r.block_on(async move {
        for i in 0..32u64 {
            drop(c.write(i * 4096, AlignedBuf::zeroed(4096, 4096)));
        }
        while c.in_flight() > 0 {
            reactor::yield_now().await;
        }
        let (_, result) = c.read(0, AlignedBuf::zeroed(4096, 4096)).await;
        assert_eq!(result, Ok(4096));
    });
    assert_eq!(channel.stats().completed, 33);
}

#[test]
fn interrupt_mode_reactor_sleeps_through_io_and_wakes_on_completion() {
    let file = ScratchFile::new("irq", 8 << 20);
    let dev = Arc::new(UringDevice::open(&file.path, UringOptions::default()).unwrap());
    let (tx, rx) = mpsc::channel();
    let completed = Arc::new(AtomicUsize::new(0));
    let c2 = Arc::clone(&completed);
    let (r, join) = Reactor::spawn(config(0, PollMode::Interrupt), move || {
        let q = dev.open_queue(QueueConfig { depth: 32, completion_eventfd: true }).unwrap();
        let channel = DeviceChannel::attach(q);
        reactor::spawn_local(async move {
            for i in 0..256u64 {
                let mut buf = AlignedBuf::zeroed(4096, 4096);
                fill_pattern(&mut buf, i);
                let (buf, result) = channel.write((i % 2048) * 4096, buf).await;
                assert_eq!(result, Ok(4096));
                let (back, result) = channel.read((i % 2048) * 4096, AlignedBuf::zeroed(4096, 4096)).await;
                assert_eq!(result, Ok(4096));
                assert!(back[..] == buf[..]);
                c2.fetch_add(1, Ordering::Relaxed);
            }
            tx.send(()).unwrap();
        });
    })
    .unwrap();
    rx.recv_timeout(Duration::from_secs(60)).expect("I/O finished on a sleeping reactor");
    assert_eq!(completed.load(Ordering::Relaxed), 256);
    r.stop();
    join.join().unwrap();
}

/// Long enough for the reactor to run every other ready task.
async fn yield_a_few() {
    reactor::sleep(Duration::from_millis(2)).await;
}

/// Task slots and their wakers are reused; a waker kept past its task's
/// end must not wake the task that takes the slot next.
#[test]
fn a_finished_tasks_waker_never_wakes_the_next_task_in_its_slot() {
    let mut r = Reactor::new(config(0, PollMode::Busy)).unwrap();
    r.block_on(async {
        let kept: Rc<std::cell::RefCell<Option<std::task::Waker>>> = Rc::default();
        let keeper = kept.clone();
        reactor::spawn_local(std::future::poll_fn(move |cx| {
            *keeper.borrow_mut() = Some(cx.waker().clone());
            std::task::Poll::Ready(())
        }));
        yield_a_few().await;
        let polls = Rc::new(Cell::new(0u32));
        let (counter, own) = (polls.clone(), Rc::new(std::cell::RefCell::new(None::<std::task::Waker>)));
        let own_waker = own.clone();
        reactor::spawn_local(std::future::poll_fn(move |cx| {
            counter.set(counter.get() + 1);
            *own_waker.borrow_mut() = Some(cx.waker().clone());
            std::task::Poll::<()>::Pending
        }));
        yield_a_few().await;
        assert_eq!(polls.get(), 1, "polled once when spawned");
        kept.borrow_mut().take().expect("the first task kept its waker").wake();
        yield_a_few().await;
        assert_eq!(polls.get(), 1, "the stale waker woke nothing");
        own.borrow_mut().take().expect("the second task's waker").wake();
        yield_a_few().await;
        assert_eq!(polls.get(), 2, "its own waker wakes it");
    });
}
