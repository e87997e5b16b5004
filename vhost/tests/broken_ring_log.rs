//! The warning of a ring its driver broke, in its own binary: it installs
//! the process's log subscriber, to see what the device thread logs.

use std::time::Duration;

use keelfs_vhost::abi::init_flags as f;

mod common;
use common::*;

/// A driver can break its ring (the avail index a ring ahead), kick, mend
/// it and break it again as often as it likes: each break is counted, and
/// warned of at most a burst per window.
#[test]
fn a_driver_breaking_its_ring_again_and_again_is_warned_of_a_burst() {
    const BREAKS: u64 = 3 * keelfs_base::LOG_BURST as u64;
    let captured = keelfs_base::testing::CapturedText::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let daemon = Daemon::start(1);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    for _ in 0..BREAKS {
        fe.jump_avail_index(1, 2000).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        fe.jump_avail_index(1, 0u16.wrapping_sub(2000)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    // Mended, the queue serves again.
    let (nodeid, fh) = create(&mut fe, 1, "mended");
    assert_eq!(write(&mut fe, 1, nodeid, fh, 0, b"served"), 0);
    drop(fe);
    let [.., broken, _] = daemon.stop_all();
    let text = captured.text();
    let warned = text.lines().filter(|l| l.contains("more than a ring ahead")).count();
    assert!(broken > u64::from(keelfs_base::LOG_BURST) + 5, "only {broken} of {BREAKS} breaks were seen");
    assert_eq!(warned, keelfs_base::LOG_BURST as usize, "{broken} breaks:\n{text}");
}
