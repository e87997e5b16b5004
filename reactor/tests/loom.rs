//! The reactor's cross-thread handshakes, model-checked by loom.
//!
//! `src/gate.rs` is built here over loom's atomics instead of std's: loom
//! runs each model in every interleaving (and every outcome of the memory
//! model that it tracks) and fails on the first one whose assertion does
//! not hold. The queues beside the handshakes (crossbeam's `ArrayQueue`
//! and `SegQueue`) are modelled by a counter: their own correctness is
//! crossbeam's, checked there.

#![allow(dead_code)]

/// What `src/gate.rs` imports as `crate::sync`.
mod sync {
    pub(crate) use loom::sync::atomic::{fence, AtomicBool, Ordering};
}

#[path = "../src/gate.rs"]
mod gate;

use gate::{SleepGate, WakeMark};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

/// A reactor's side of the sleep handshake, as the models see it: the
/// gate, its inbox (a count of messages) and its eventfd (a count of
/// signals).
#[derive(Clone)]
struct Target {
    gate: Arc<SleepGate>,
    inbox: Arc<AtomicUsize>,
    eventfd: Arc<AtomicUsize>,
}

impl Target {
    fn new() -> Self {
        Target {
            gate: Arc::new(SleepGate::new()),
            inbox: Arc::new(AtomicUsize::new(0)),
            eventfd: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// A thread that queues one message and signals if the reactor may
    /// be asleep, as `Shared::notify` does.
    fn spawn_sender(&self) -> thread::JoinHandle<()> {
        let target = self.clone();
        thread::spawn(move || {
            target.inbox.fetch_add(1, Ordering::Relaxed);
            if target.gate.must_signal() {
                target.eventfd.fetch_add(1, Ordering::Relaxed);
            }
        })
    }
}

/// A sender queues one message and signals if the reactor may be asleep.
/// The reactor looks for work once behind the gate and sleeps if it finds
/// none. In every interleaving, a reactor that sleeps has its eventfd
/// signalled: no message is left waiting for an unrelated event.
#[test]
fn a_reactor_never_sleeps_through_a_message() {
    loom::model(|| {
        let target = Target::new();
        let Target { gate, inbox, eventfd } = target.clone();
        let sender = target.spawn_sender();

        gate.begin_sleep();
        let slept = inbox.load(Ordering::Relaxed) == 0;
        sender.join().unwrap();
        if slept {
            assert_eq!(eventfd.load(Ordering::Relaxed), 1, "the reactor slept through a message");
        }
        gate.end_sleep();
    });
}

/// Two senders, and a reactor that takes what it finds behind the gate
/// and looks again, until a look finds nothing new and it sleeps. A
/// reactor asleep with work untaken must have a signal waiting on its
/// eventfd (one sent in an earlier round counts: the eventfd keeps it
/// until the reactor wakes and reads it).
#[test]
fn two_senders_and_a_reactor_that_looks_twice_lose_no_message() {
    loom::model(|| {
        let target = Target::new();
        let Target { gate, inbox, eventfd } = target.clone();
        let senders: Vec<_> = (0..2).map(|_| target.spawn_sender()).collect();

        let mut taken = 0;
        let mut asleep = false;
        for _ in 0..2 {
            gate.begin_sleep();
            let queued = inbox.load(Ordering::Relaxed);
            if queued == taken {
                asleep = true;
                break;
            }
            taken = queued;
            gate.end_sleep();
        }
        for sender in senders {
            sender.join().unwrap();
        }
        if asleep && taken < 2 {
            assert!(eventfd.load(Ordering::Relaxed) >= 1, "asleep with work untaken, and no signal");
        }
    });
}

/// A task is queued and its reactor is about to poll it, while another
/// thread publishes a result and wakes it. In every interleaving the
/// result is either seen by the poll in progress or the task is queued
/// again: the wake is never folded into a poll that cannot see it.
#[test]
fn a_wake_is_never_folded_into_a_poll_that_misses_it() {
    loom::model(|| {
        let mark = Arc::new(WakeMark::new());
        let result = Arc::new(AtomicUsize::new(0));
        // The task's first entry in the woken queue.
        assert!(mark.mark());
        let requeued = Arc::new(AtomicUsize::new(0));

        let waker = {
            let (mark, result, requeued) = (Arc::clone(&mark), Arc::clone(&result), Arc::clone(&requeued));
            thread::spawn(move || {
                result.store(1, Ordering::Release);
                if mark.mark() {
                    requeued.fetch_add(1, Ordering::Relaxed);
                }
            })
        };

        // The reactor pops the entry, clears the mark and polls.
        mark.clear();
        let seen = result.load(Ordering::Acquire);
        waker.join().unwrap();
        if seen == 0 {
            assert_eq!(requeued.load(Ordering::Relaxed), 1, "a wake was folded into a poll that missed it");
        }
    });
}

/// Many wakes of a queued task add no entry; the first wake after the
/// reactor clears the mark adds exactly one.
#[test]
fn wakes_of_a_queued_task_queue_it_once() {
    loom::model(|| {
        let mark = Arc::new(WakeMark::new());
        let pushes = Arc::new(AtomicUsize::new(0));
        let wakers: Vec<_> = (0..2)
            .map(|_| {
                let (mark, pushes) = (Arc::clone(&mark), Arc::clone(&pushes));
                thread::spawn(move || {
                    if mark.mark() {
                        pushes.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for waker in wakers {
            waker.join().unwrap();
        }
        assert_eq!(pushes.load(Ordering::Relaxed), 1);
    });
}
