//! The fault wrapper injects what it is told to, and its write log rebuilds
//! exactly the images a crash could leave.

use std::sync::Arc;

use keelfs_base::testing::{fill_pattern, splitmix64};
use keelfs_bdev::{
    AlignedBuf, BdevError, BlockDevice, BlockingIo, FaultDevice, FaultRule, IoKind, IoRequest, IoVec, LogEntry,
    MappedDevice, Persist, QueueConfig,
};
use proptest::prelude::*;

const CAPACITY: u64 = 1 << 20;
const BLOCK: usize = 4096;

fn setup() -> (Arc<MappedDevice>, FaultDevice, BlockingIo) {
    let ram = Arc::new(MappedDevice::ram(CAPACITY, 512).unwrap());
    let fault = FaultDevice::new(ram.clone());
    let io = BlockingIo::open(&fault).unwrap();
    (ram, fault, io)
}

fn block(seed: u64) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(BLOCK, 4096);
    fill_pattern(&mut b, seed);
    b
}

#[test]
fn nth_operation_fails_without_reaching_the_device() {
    let (ram, fault, mut io) = setup();
    fault.add_rule(FaultRule::FailNth { kind: IoKind::Write, nth: 1 });
    assert_eq!(io.write_at(0, &mut block(1)), Ok(4096));
    assert_eq!(io.write_at(4096, &mut block(2)), Err(BdevError::Io(libc::EIO)));
    assert_eq!(io.write_at(8192, &mut block(3)), Ok(4096));
    let image = ram.snapshot();
    assert!(image[4096..8192].iter().all(|&b| b == 0), "failed write reached the device");
    assert!(image[8192..12288] == block(3)[..]);
    assert_eq!(fault.injected(), 1);
}

#[test]
fn range_and_flush_faults() {
    let (_ram, fault, mut io) = setup();
    fault.add_rule(FaultRule::FailRange { kind: IoKind::Read, start: 8192, end: 8193 });
    fault.add_rule(FaultRule::FailNth { kind: IoKind::Flush, nth: 0 });
    let mut b = AlignedBuf::zeroed(BLOCK, 4096);
    assert_eq!(io.read_at(4096, &mut b), Ok(4096));
    assert_eq!(io.read_at(8192, &mut b), Err(BdevError::Io(libc::EIO)));
    let mut two = AlignedBuf::zeroed(2 * BLOCK, 4096);
    assert_eq!(io.read_at(4096, &mut two), Err(BdevError::Io(libc::EIO)), "overlapping read fails too");
    assert_eq!(io.flush(), Err(BdevError::Io(libc::EIO)));
    assert_eq!(io.flush(), Ok(0));
    fault.clear_rules();
    assert_eq!(io.read_at(8192, &mut b), Ok(4096));
}

#[test]
fn random_faults_follow_their_seed() {
    let run = |seed| {
        let (_ram, fault, mut io) = setup();
        fault.add_rule(FaultRule::FailRandom { kind: IoKind::Write, permille: 300, seed });
        (0..200).map(|i| io.write_at((i % 64) * 4096, &mut block(i)).is_err()).collect::<Vec<_>>()
    };
    let a = run(7);
    assert_eq!(a, run(7), "same seed, same faults");
    let failures = a.iter().filter(|&&f| f).count();
    assert!((30..=90).contains(&failures), "about 30% of 200 writes should fail, got {failures}");
    assert_ne!(a, run(8));
}

#[test]
fn torn_write_keeps_a_sector_prefix_and_reports_eio() {
    let (ram, fault, mut io) = setup();
    assert_eq!(io.write_at(0, &mut block(1)), Ok(4096));
    fault.add_rule(FaultRule::TearNthWrite { nth: 1, sectors_kept: 3 });
    assert_eq!(io.write_at(0, &mut block(2)), Err(BdevError::Io(libc::EIO)));
    let image = ram.snapshot();
    assert!(image[..1536] == block(2)[..1536], "the first 3 sectors are new");
    assert!(image[1536..4096] == block(1)[1536..], "the rest is old");
}

#[test]
fn rebuild_keeps_flushed_writes_and_lets_later_ones_vary() {
    let (ram, fault, mut io) = setup();
    let base = ram.snapshot();
    fault.start_recording();
    io.write_at(0, &mut block(1)).unwrap();
    io.flush().unwrap();
    io.write_at(4096, &mut block(2)).unwrap();
    io.write_at(0, &mut block(3)).unwrap();
    let log = fault.log();
    assert_eq!(log.len(), 4);
    assert_eq!(log.entries()[1], LogEntry::Flush { covers: 1 });
    assert_eq!(log.flush_points(), vec![2]);
    assert_eq!(log.durable_prefix(1), 0, "the write before the flush is not yet durable");
    assert_eq!(log.durable_prefix(4), 1);

    // Everything kept reproduces the live device.
    let mut all = base.clone();
    log.rebuild(&mut all, log.len(), |_| Persist::Kept);
    assert_eq!(all, ram.snapshot());

    // Everything unflushed lost leaves only the flushed write.
    let mut lost = base.clone();
    log.rebuild(&mut lost, log.len(), |_| Persist::Lost);
    assert!(lost[..4096] == block(1)[..] && lost[4096..8192].iter().all(|&b| b == 0));

    // A crash before the flush may lose the first write too.
    let mut early = base.clone();
    log.rebuild(&mut early, 1, |_| Persist::Lost);
    assert_eq!(early, base);

    // A torn overwrite mixes sectors of the flushed and the new data.
    let mut torn = base.clone();
    log.rebuild(&mut torn, 4, |i| if i == 3 { Persist::Torn { sectors: 2 } } else { Persist::Lost });
    assert!(torn[..1024] == block(3)[..1024] && torn[1024..4096] == block(1)[1024..4096]);
}

#[test]
fn writes_that_fail_are_not_logged() {
    let (_ram, fault, mut io) = setup();
    fault.start_recording();
    fault.add_rule(FaultRule::FailNth { kind: IoKind::Write, nth: 0 });
    let _ = io.write_at(0, &mut block(1));
    io.write_at(4096, &mut block(2)).unwrap();
    let log = fault.log();
    assert_eq!(log.len(), 1);
    assert!(matches!(&log.entries()[0], LogEntry::Write { offset: 4096, .. }));
}

/// Under the reordering rule completions come back late and out of
/// order, the same way for the same seed, and the log follows the order
/// the caller saw them in: a flush submitted before a write's completion
/// came back does not cover that write.
#[test]
fn reordered_completions_follow_their_seed_and_the_log_follows_the_caller() {
    let run = |seed| {
        let (_ram, fault, _io) = setup();
        fault.add_rule(FaultRule::ReorderCompletions { max_polls: 8, seed });
        fault.start_recording();
        let mut q = fault.open_queue(QueueConfig::default()).unwrap();
        let mut bufs: Vec<AlignedBuf> = (0..8).map(block).collect();
        let iovs: Vec<[IoVec; 1]> = bufs.iter_mut().map(|b| [b.iovec()]).collect();
        for (i, iov) in iovs.iter().enumerate() {
            // SAFETY: `bufs` is neither moved nor dropped before the loop
            // below has polled every completion.
            unsafe { q.submit(&IoRequest::write(i as u64, i as u64 * 4096, iov)).unwrap() };
        }
        // SAFETY: a flush names no memory.
        unsafe { q.submit(&IoRequest::flush(100)).unwrap() };
        let (mut order, mut polls) = (Vec::new(), 0);
        while order.len() < 9 {
            let mut out = Vec::new();
            q.poll(&mut out, 64);
            polls += 1;
            for c in out {
                assert!(c.result.is_ok());
                order.push(c.token);
            }
        }
        assert_eq!(q.in_flight(), 0);
        (order, polls, fault.log())
    };
    let (order, polls, log) = run(3);
    assert_eq!((order.clone(), polls), (run(3).0, run(3).1), "same seed, same order");
    assert!(polls > 1, "completions were held back");
    let shuffled = (0..16).filter(|&s| run(s).0 != (0..8).chain([100]).collect::<Vec<_>>()).count();
    assert!(shuffled >= 12, "most seeds reorder nine completions ({shuffled} of 16 did)");
    // The log holds the writes in the order they were handed out.
    let logged: Vec<LogEntry> = log.entries().to_vec();
    let expected: Vec<LogEntry> = order
        .iter()
        .map(|&t| match t {
            100 => LogEntry::Flush { covers: 0 },
            t => LogEntry::Write { offset: t * 4096, data: block(t).to_vec() },
        })
        .collect();
    assert_eq!(logged, expected, "a flush submitted before every completion covers none of them");
}

#[derive(Clone, Debug)]
enum Op {
    Write { block: u64, seed: u64 },
    Flush,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..16, any::<u64>()).prop_map(|(block, seed)| Op::Write { block, seed }),
        1 => Just(Op::Flush),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// For every crash point: keeping everything gives the device as it was
    /// at that point; losing everything unflushed gives the device as it was
    /// when the covering flush was submitted; and any seeded mix leaves each
    /// sector equal to one of the values it held since that flush.
    #[test]
    fn every_crash_point_rebuilds_a_possible_image(ops in proptest::collection::vec(op_strategy(), 1..40), seed in any::<u64>()) {
        let (ram, fault, mut io) = setup();
        let base = ram.snapshot();
        fault.start_recording();
        // Images after each log entry, sequential I/O makes them exact.
        let mut after = vec![base.clone()];
        for op in &ops {
            match *op {
                Op::Write { block: b, seed } => { io.write_at(b * BLOCK as u64, &mut block(seed)).unwrap(); }
                Op::Flush => { io.flush().unwrap(); }
            }
            after.push(ram.snapshot());
        }
        let log = fault.log();
        prop_assert_eq!(log.len(), ops.len());
        for crash_at in 0..=log.len() {
            let mut kept = base.clone();
            log.rebuild(&mut kept, crash_at, |_| Persist::Kept);
            prop_assert!(kept == after[crash_at]);
            let durable = log.durable_prefix(crash_at);
            let mut lost = base.clone();
            log.rebuild(&mut lost, crash_at, |_| Persist::Lost);
            prop_assert!(lost == after[durable]);
            let mut mixed = base.clone();
            let mut s = seed ^ crash_at as u64;
            log.rebuild_seeded(&mut mixed, crash_at, splitmix64(&mut s));
            for sector in (0..mixed.len()).step_by(512) {
                let got = &mixed[sector..sector + 512];
                let possible = (durable..=crash_at).any(|k| &after[k][sector..sector + 512] == got);
                prop_assert!(possible, "sector {} holds data it never held", sector);
            }
        }
    }
}
