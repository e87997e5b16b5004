//! QoS over vhost-user, on a daemon whose reactor runs on a virtual
//! clock: time moves only when a test advances it, and the reactor settles
//! (does all that the time allows, then sleeps) before the test looks. So
//! admissions and waits are asserted exactly, on a machine however loaded,
//! and a request that waited on time where it must not would never be
//! served (the frontend's 60 s guard reports it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use keelfs_reactor::VirtualClock;
use keelfs_vhost::abi::{init_flags as f, Opcode};
use keelfs_vhost::frontend::{io_request, FrontendConfig, FsFrontend, RawDesc, DESC_NEXT, DESC_WRITE};
use keelfs_vhost::QosLimits;
use vm_memory::{Bytes, GuestAddress};

mod common;
use common::*;

const READ_IOPS: u64 = 100;
/// Reads kept waiting at once: each then waits 16 / 100 s.
const READS_QUEUED: usize = 16;

fn submit_read(fe: &mut FsFrontend, (nodeid, fh): (u64, u64)) -> u16 {
    let unique = fe.next_unique();
    fe.submit_split(1, &io_request(Opcode::Read, unique, nodeid, fh, 0, 4096), &[], 4096).unwrap()
}

fn submit_write(fe: &mut FsFrontend, (nodeid, fh): (u64, u64)) -> u16 {
    let unique = fe.next_unique();
    fe.submit_split(1, &io_request(Opcode::Write, unique, nodeid, fh, 4096, 4096), &[9u8; 4096], 0).unwrap()
}

/// A daemon limited by `limits` on a clock of its own, at time zero.
fn limited(limits: QosLimits) -> (Daemon, Arc<VirtualClock>) {
    let clock = VirtualClock::new();
    let daemon = Daemon::start_on_clock(1, limits, Arc::clone(&clock));
    (daemon, clock)
}

/// A new frontend, once the daemon accepts one. The retries are paced by
/// real time; `TIMEOUT` is a hang guard.
fn connect_again(daemon: &Daemon) -> FsFrontend {
    let guard = std::time::Instant::now() + TIMEOUT;
    loop {
        match FsFrontend::connect(&daemon.socket, FrontendConfig::default()) {
            Ok(fe) => return fe,
            Err(_) if std::time::Instant::now() < guard => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("no new frontend accepted: {e}"),
        }
    }
}

/// Let the daemon do everything the time and the requests sent allow.
fn settle(daemon: &Daemon) {
    assert!(daemon.reactor.settle(TIMEOUT), "the daemon's reactor stopped");
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// 16 reads kept queued at a limit of 100 a second, and a write every
/// 50 ms on the same queue, over 3 s of the daemon's time in 1 ms steps.
/// Held requests need no polling: the reactor settles (sleeps) between
/// steps while they wait.
#[test]
fn reads_pass_at_their_limit_and_writes_are_not_held_behind_them() {
    let (daemon, clock) = limited(QosLimits { read_iops: Some(READ_IOPS), ..QosLimits::UNLIMITED });
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let file = create(&mut fe, 1, "limited");
    assert_eq!(write(&mut fe, 1, file.0, file.1, 0, &[7u8; 4096]), 0);

    let step = Duration::from_millis(1);
    let (start, window) = (clock.elapsed(), Duration::from_millis(500)..Duration::from_millis(2500));
    // What is in the ring, by head: (is a read, submitted at).
    let mut pending: HashMap<u16, (bool, Duration)> = HashMap::new();
    for _ in 0..READS_QUEUED {
        pending.insert(submit_read(&mut fe, file), (true, Duration::ZERO));
    }
    let (mut reads_in_window, mut read_waits, mut write_waits) = (0u64, Vec::new(), Vec::new());
    for ms in 0..3000u64 {
        let now = clock.elapsed() - start;
        if ms >= 200 && ms % 50 == 0 {
            pending.insert(submit_write(&mut fe, file), (false, now));
        }
        settle(&daemon);
        // Slots are freed as the batch is taken: resubmit after reading
        // it all, or a new read would take the head of one not seen yet.
        let mut finished_reads = 0;
        for used in fe.poll(1).unwrap() {
            let (is_read, submitted) = pending.remove(&used.head).expect("a request of ours");
            assert_eq!(fuse_status(&fe.reply(1, used).unwrap()).1, 0, "served without error");
            if is_read {
                reads_in_window += u64::from(window.contains(&now));
                read_waits.push(now - submitted);
                finished_reads += 1;
            } else {
                write_waits.push(now - submitted);
            }
        }
        for _ in 0..finished_reads {
            pending.insert(submit_read(&mut fe, file), (true, now));
        }
        if finished_reads > 0 {
            settle(&daemon); // taken now, not at the next step
        }
        clock.advance(step);
    }
    let read_wait = median(read_waits.clone());
    eprintln!(
        "{reads_in_window} reads in 2 s (limit {READ_IOPS}/s), median read wait {read_wait:?} over {} reads, {} writes",
        read_waits.len(),
        write_waits.len()
    );
    // One read each 10 ms, on the dot: the burst (10) went in the first
    // instant.
    assert_eq!(reads_in_window, READ_IOPS * 2, "reads admitted in 2 s at {READ_IOPS}/s");
    // Behind 15 others at 10 ms each, then its own turn.
    assert_eq!(read_wait, Duration::from_millis(160), "reads queue behind the limit");
    // Never held: each is served in the instant it was sent.
    assert_eq!(write_waits.len(), 56, "a write each 50 ms from 200 ms");
    assert!(write_waits.iter().all(Duration::is_zero), "writes waited behind held reads: {write_waits:?}");
    drop(fe);
    daemon.stop_all();
}

/// GET_VRING_BASE waits for every request taken from the ring; the ones
/// QoS holds are served at once rather than at the rate, which could take
/// longer than a VMM waits.
#[test]
fn a_stopping_queue_serves_what_qos_holds_at_once() {
    let (daemon, _clock) = limited(QosLimits { read_iops: Some(1), burst_ms: 1000, ..QosLimits::UNLIMITED });
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let file = create(&mut fe, 1, "held");
    for _ in 0..8 {
        submit_read(&mut fe, file);
    }
    // One read passes (the burst); the rest would wait seven seconds at
    // 1/s, on a clock that stands still: never, unless the stop serves
    // them.
    settle(&daemon);
    assert_eq!(fe.poll(1).unwrap().len(), 1, "the burst: one read");
    let next_avail = fe.stop_queue(1).unwrap();
    assert_eq!(next_avail, 2 + 8, "INIT, CREATE and every read were taken");
    let used = fe.poll(1).unwrap();
    assert_eq!(used.len(), 7, "every held read was answered before the stop returned");
    for u in used {
        assert_eq!(fuse_status(&fe.reply(1, u).unwrap()).1, 0);
    }
}

/// A frontend that leaves with requests held has them dropped with its
/// other replies: the reactor does not wait for them (the next frontend
/// would never be accepted) and serves the next one.
#[test]
fn a_frontend_that_leaves_with_requests_held_does_not_hold_up_the_next() {
    let (daemon, _clock) = limited(QosLimits { read_iops: Some(1), burst_ms: 1000, ..QosLimits::UNLIMITED });
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let file = create(&mut fe, 1, "left");
    for _ in 0..8 {
        submit_read(&mut fe, file);
    }
    settle(&daemon);
    assert_eq!(fe.poll(1).unwrap().len(), 1, "the burst: one read");
    drop(fe);
    // Seven reads at one a second would take seven seconds to drain, on
    // a clock that stands still: the next frontend is served only if they
    // are dropped.
    let mut fe = connect_again(&daemon);
    fe.init(f::INIT_EXT).unwrap();
    let (nodeid, fh) = create(&mut fe, 1, "next");
    assert_eq!(write(&mut fe, 1, nodeid, fh, 0, b"served"), 0);
    drop(fe);
    daemon.stop_all();
}

/// A driver may publish a head again while the device still holds it:
/// virtio-queue does not notice, and each publication pops as a new
/// chain. QoS holding them must not let such a driver have more taken
/// than its ring holds (without a configured cap, the held queue used to
/// grow for as long as the driver went on), and the device keeps serving.
#[test]
fn a_driver_reusing_a_held_head_cannot_have_more_than_a_ring_taken() {
    const RING: u16 = 16;
    let (daemon, _clock) = limited(QosLimits { read_iops: Some(1), burst_ms: 1000, ..QosLimits::UNLIMITED });
    let config = FrontendConfig { request_queues: 1, queue_size: RING, slots: RING / 8, ..FrontendConfig::default() };
    let mut fe = FsFrontend::connect(&daemon.socket, config).unwrap();
    fe.init(f::INIT_EXT).unwrap();
    let file = create(&mut fe, 1, "reused");
    submit_read(&mut fe, file); // the burst
    let held = submit_read(&mut fe, file);
    // A few at a time, each batch taken before the next if the device
    // takes them.
    for _ in 0..100 {
        for _ in 0..4 {
            fe.submit_head(1, held).unwrap();
        }
        settle(&daemon);
    }
    // Still serving, on the other queue.
    let (nodeid, fh) = create(&mut fe, 0, "still-served");
    assert_eq!(write(&mut fe, 0, nodeid, fh, 0, b"served"), 0);
    drop(fe);
    let [.., in_flight_max] = daemon.stop_all();
    assert!(in_flight_max <= u64::from(RING), "{in_flight_max} requests taken from a ring of {RING}");
}

/// A guest can rewrite a request after the device took it and charged
/// it, before it is served: it pays for what is served. Here a READ of
/// 32 KiB, held by an empty bucket, is rewritten into one of 96 KiB.
#[test]
fn a_request_rewritten_after_it_was_charged_pays_for_what_is_served() {
    const RATE: u64 = 128 << 10;
    let (daemon, clock) = limited(QosLimits { read_bytes_per_sec: Some(RATE), burst_ms: 1000, ..QosLimits::UNLIMITED });
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let (nodeid, fh) = create(&mut fe, 1, "rewritten");
    // The burst, 1 MiB, spent at once.
    for _ in 0..8 {
        let unique = fe.next_unique();
        fe.submit_split(1, &io_request(Opcode::Read, unique, nodeid, fh, 0, 128 << 10), &[], 128 << 10).unwrap();
    }
    let mut done = 0;
    while done < 8 {
        done += fe.wait(1, TIMEOUT).unwrap().len();
    }
    let at = fe.scratch(1);
    let unique = fe.next_unique();
    let header = |size| io_request(Opcode::Read, unique, nodeid, fh, 0, size);
    fe.memory().write_slice(&header(32 << 10), GuestAddress(at)).unwrap();
    let head = fe
        .submit_raw(
            1,
            &[
                RawDesc { addr: at, len: header(0).len() as u32, flags: DESC_NEXT, next: 1 },
                RawDesc { addr: at + 4096, len: 16, flags: DESC_WRITE | DESC_NEXT, next: 2 },
                RawDesc { addr: at + 8192, len: 96 << 10, flags: DESC_WRITE, next: 0 },
            ],
        )
        .unwrap();
    // Taken and held (for 32 KiB at 128 KiB/s, 250 ms): rewritten now.
    settle(&daemon);
    fe.memory().write_slice(&header(96 << 10), GuestAddress(at)).unwrap();
    // Admitted at 250 ms, as charged; then 500 ms more for the 64 KiB it
    // was not charged.
    let answered_at = |at_ms: u64, fe: &mut FsFrontend| {
        clock.advance(Duration::from_millis(at_ms) - clock.elapsed());
        settle(&daemon);
        fe.poll(1).unwrap()
    };
    for not_yet in [249, 250, 749] {
        assert!(answered_at(not_yet, &mut fe).is_empty(), "answered at {not_yet} ms");
    }
    let used = answered_at(750, &mut fe);
    assert_eq!(used.len(), 1, "answered at 750 ms");
    assert_eq!(used[0].head, head);
    assert!(used[0].len >= 16, "answered");
    drop(fe);
    daemon.stop_all();
}
