//! QoS over vhost-user, in its own binary so that nothing else shares its
//! timing: a limited class is admitted at its rate, the other class on the
//! same queue is not held behind it, and the reactor sleeps meanwhile.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use keelfs_vhost::abi::{init_flags as f, Opcode};
use keelfs_vhost::frontend::{io_request, FrontendConfig, FsFrontend, RawDesc, DESC_NEXT, DESC_WRITE};
use keelfs_vhost::QosLimits;
use vm_memory::{Bytes, GuestAddress};

mod common;
use common::*;

const READ_IOPS: u64 = 100;
/// Reads kept waiting at once: each then waits about 16 / 100 s.
const READS_QUEUED: usize = 16;

fn submit_read(fe: &mut FsFrontend, (nodeid, fh): (u64, u64)) -> u16 {
    let unique = fe.next_unique();
    fe.submit_split(1, &io_request(Opcode::Read, unique, nodeid, fh, 0, 4096), &[], 4096).unwrap()
}

fn submit_write(fe: &mut FsFrontend, (nodeid, fh): (u64, u64)) -> u16 {
    let unique = fe.next_unique();
    fe.submit_split(1, &io_request(Opcode::Write, unique, nodeid, fh, 4096, 4096), &[9u8; 4096], 0).unwrap()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn reads_pass_at_their_limit_and_writes_are_not_held_behind_them() {
    // The default burst, 100 ms (10 reads), is spent in the first
    // moments: the window counted starts later.
    let limits = QosLimits { read_iops: Some(READ_IOPS), ..QosLimits::UNLIMITED };
    let daemon = Daemon::start_with_qos(1, limits);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let file = create(&mut fe, 1, "limited");
    assert_eq!(write(&mut fe, 1, file.0, file.1, 0, &[7u8; 4096]), 0);

    let sleeps = || daemon.reactor.stats().sleeps.load(Ordering::Relaxed);
    let sleeps_before = sleeps();
    let start = Instant::now();
    // What is in the ring, by head: (is a read, submitted at).
    let mut pending: HashMap<u16, (bool, Instant)> = HashMap::new();
    for _ in 0..READS_QUEUED {
        pending.insert(submit_read(&mut fe, file), (true, Instant::now()));
    }
    let (window, end) =
        (start + Duration::from_millis(500)..start + Duration::from_millis(2500), Duration::from_secs(3));
    let (mut reads_in_window, mut read_waits, mut write_waits) = (0u64, Vec::new(), Vec::new());
    let mut next_write = start + Duration::from_millis(200);
    while start.elapsed() < end {
        if Instant::now() >= next_write {
            pending.insert(submit_write(&mut fe, file), (false, Instant::now()));
            next_write += Duration::from_millis(50);
        }
        // Slots are freed as the batch is taken: resubmit after reading
        // it all, or a new read would take the head of one not seen yet.
        let mut finished_reads = 0;
        for used in fe.poll(1).unwrap() {
            let now = Instant::now();
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
            pending.insert(submit_read(&mut fe, file), (true, Instant::now()));
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    let slept = sleeps() - sleeps_before;

    let expected = READ_IOPS * 2; // the window is 2 s
    let (read_wait, write_wait, worst_write) =
        (median(read_waits), median(write_waits.clone()), write_waits.iter().max().copied().unwrap());
    eprintln!(
        "{reads_in_window} reads in 2 s (limit {READ_IOPS}/s); median read wait {read_wait:?}, write wait \
         {write_wait:?} (worst {worst_write:?}) over {} writes; the reactor slept {slept} times",
        write_waits.len()
    );
    assert!(
        (expected * 95 / 100..=expected * 105 / 100).contains(&reads_in_window),
        "{reads_in_window} reads admitted in 2 s at {READ_IOPS}/s"
    );
    assert!(read_wait >= Duration::from_millis(120), "reads queue behind the limit: {read_wait:?}");
    // A read waits 160 ms; a write, not limited, only for the RAM disk.
    assert!(write_waits.len() >= 40, "{} writes finished", write_waits.len());
    assert!(write_wait < Duration::from_millis(20), "writes wait behind held reads: {write_wait:?}");
    // Held requests are woken by a timer, not by polling: the reactor
    // sleeps between admissions (a spinning one never does).
    assert!(slept >= 100, "the reactor slept only {slept} times in 3 s");
    drop(fe);
    daemon.stop_all();
}

/// GET_VRING_BASE waits for every request taken from the ring; the ones
/// QoS holds are served at once rather than at the rate, which could take
/// longer than a VMM waits.
#[test]
fn a_stopping_queue_serves_what_qos_holds_at_once() {
    let limits = QosLimits { read_iops: Some(1), burst_ms: 1000, ..QosLimits::UNLIMITED };
    let daemon = Daemon::start_with_qos(1, limits);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let file = create(&mut fe, 1, "held");
    for _ in 0..8 {
        submit_read(&mut fe, file);
    }
    // One read passes (the burst); the rest wait seven seconds at 1/s.
    let first = fe.wait(1, TIMEOUT).unwrap();
    assert_eq!(first.len(), 1);
    std::thread::sleep(Duration::from_millis(50));
    assert!(fe.poll(1).unwrap().is_empty(), "the others are held");
    let asked = Instant::now();
    let next_avail = fe.stop_queue(1).unwrap();
    assert!(asked.elapsed() < Duration::from_secs(2), "the stop took {:?}", asked.elapsed());
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
    let limits = QosLimits { read_iops: Some(1), burst_ms: 1000, ..QosLimits::UNLIMITED };
    let daemon = Daemon::start_with_qos(1, limits);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let file = create(&mut fe, 1, "left");
    for _ in 0..8 {
        submit_read(&mut fe, file);
    }
    std::thread::sleep(Duration::from_millis(50));
    drop(fe);
    // Seven reads at one a second would take seven seconds to drain.
    let asked = Instant::now();
    let mut fe = loop {
        match FsFrontend::connect(&daemon.socket, keelfs_vhost::frontend::FrontendConfig::default()) {
            Ok(fe) => break fe,
            Err(_) if asked.elapsed() < TIMEOUT => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("no new frontend accepted: {e}"),
        }
    };
    fe.init(f::INIT_EXT).unwrap();
    let (nodeid, fh) = create(&mut fe, 1, "next");
    assert_eq!(write(&mut fe, 1, nodeid, fh, 0, b"served"), 0);
    assert!(asked.elapsed() < Duration::from_secs(3), "the next frontend waited {:?}", asked.elapsed());
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
    let limits = QosLimits { read_iops: Some(1), burst_ms: 1000, ..QosLimits::UNLIMITED };
    let daemon = Daemon::start_with_qos(1, limits);
    let config = FrontendConfig { request_queues: 1, queue_size: RING, slots: RING / 8, ..FrontendConfig::default() };
    let mut fe = FsFrontend::connect(&daemon.socket, config).unwrap();
    fe.init(f::INIT_EXT).unwrap();
    let file = create(&mut fe, 1, "reused");
    submit_read(&mut fe, file); // the burst
    let held = submit_read(&mut fe, file);
    // A few at a time, so that the device could keep up if it took them.
    for _ in 0..100 {
        for _ in 0..4 {
            fe.submit_head(1, held).unwrap();
        }
        std::thread::sleep(Duration::from_millis(2));
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
    let limits = QosLimits { read_bytes_per_sec: Some(RATE), burst_ms: 1000, ..QosLimits::UNLIMITED };
    let daemon = Daemon::start_with_qos(1, limits);
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
    let posted = Instant::now();
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
    std::thread::sleep(Duration::from_millis(50));
    fe.memory().write_slice(&header(96 << 10), GuestAddress(at)).unwrap();
    let used = fe.wait_for(1, head, TIMEOUT).unwrap();
    let took = posted.elapsed();
    assert!(used.len >= 16, "answered");
    // Then 500 ms more for the 64 KiB it was not charged.
    assert!(took >= Duration::from_millis(650), "a rewritten request was served after {took:?}");
    drop(fe);
    daemon.stop_all();
}
