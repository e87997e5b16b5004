//! The RBD backend against the dev cluster (scripts/ceph-dev.sh): what the
//! shared backend tests in bdev.rs do not cover. Completions from librbd's
//! threads wake the queue's eventfd, flush and discard work, and the
//! image's exclusive lock keeps a second writer out until it is let go.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use keelfs_bdev::{
    AlignedBuf, BdevError, BlockDevice, BlockingIo, Completion, IoQueue, IoRequest, QueueConfig, RbdAddress, RbdDevice,
    RbdError, RbdOptions, RbdScratchImage,
};

const CAPACITY: u64 = 16 << 20;
/// librbd's object size for images keelfsd creates: a discard of whole
/// objects removes them, so they read back as zeros.
const OBJECT: u64 = 4 << 20;

fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as i32) == 1 }
}

fn drain(q: &mut dyn IoQueue, n: usize) -> Vec<Completion> {
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while done.len() < n {
        assert!(Instant::now() < deadline, "librbd did not complete {n} requests in 30 s");
        if q.poll(&mut done, n) == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    done
}

#[test]
fn completions_from_librbd_threads_wake_the_eventfd() {
    let image = RbdScratchImage::new("wake", CAPACITY);
    let dev = image.open();
    let mut q = dev.open_queue(QueueConfig { depth: 16, completion_eventfd: true }).unwrap();
    let fd = q.completion_eventfd().expect("an eventfd was asked for");
    assert!(!wait_readable(fd, Duration::ZERO), "eventfd readable before any request");
    let mut buf = AlignedBuf::zeroed(65536, 4096);
    buf.fill(0x5A);
    let iov = [buf.iovec()];
    // SAFETY: buf outlives the completion, drained below.
    unsafe { q.submit(&IoRequest::write(7, 4096, &iov)).unwrap() };
    assert!(wait_readable(fd, Duration::from_secs(30)), "no wakeup for a completed write");
    let done = drain(q.as_mut(), 1);
    assert_eq!((done[0].token, done[0].result), (7, Ok(65536)));
    assert_eq!(q.in_flight(), 0);
    let mut back = AlignedBuf::zeroed(65536, 4096);
    let iov = [back.iovec()];
    // SAFETY: as above.
    unsafe { q.submit(&IoRequest::read(8, 4096, &iov)).unwrap() };
    assert_eq!(drain(q.as_mut(), 1)[0].result, Ok(65536));
    assert!(back.iter().all(|&b| b == 0x5A), "read back differs");
}

#[test]
fn flush_completes_and_discard_of_whole_objects_reads_zeros() {
    let image = RbdScratchImage::new("discard", 3 * OBJECT);
    let dev = image.open();
    assert!(dev.supports_discard());
    let mut io = BlockingIo::open(dev.as_ref()).unwrap();
    let mut buf = AlignedBuf::zeroed(1 << 20, 4096);
    buf.fill(0xC3);
    for mib in 0..((3 * OBJECT) >> 20) {
        assert_eq!(io.write_at(mib << 20, &mut buf), Ok(1 << 20));
    }
    let mut q = dev.open_queue(QueueConfig { depth: 4, completion_eventfd: false }).unwrap();
    // SAFETY: flush and discard name no memory.
    unsafe {
        q.submit(&IoRequest::flush(1)).unwrap();
        q.submit(&IoRequest::discard(2, OBJECT, OBJECT)).unwrap();
    }
    let done = drain(q.as_mut(), 2);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    let mut back = AlignedBuf::zeroed(1 << 20, 4096);
    io.read_at(OBJECT, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0), "a discarded object still holds data");
    io.read_at(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0xC3), "discard reached the object before it");
    io.read_at(2 * OBJECT, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0xC3), "discard reached the object after it");
}

#[test]
fn a_second_writer_is_refused_and_told_the_holder_until_the_lock_is_released() {
    let image = RbdScratchImage::new("lock", CAPACITY);
    let first = image.open();
    let me = first.client_name();
    assert!(first.owns_lock().unwrap());
    let second = RbdDevice::open(&image.address, RbdOptions { defer_lock: true, ..RbdOptions::default() }).unwrap();
    match second.take_lock() {
        Err(RbdError::Locked { holder, .. }) => {
            assert!(holder.starts_with(&format!("{me} at ")), "holder named as {holder:?}, expected {me}");
            assert!(!holder.contains("no longer watching"), "a live holder is called dead: {holder}");
        }
        other => panic!("the second writer took the lock: {other:?}"),
    }
    // The open refuses as well, naming the holder.
    let refused = RbdDevice::open(&image.address, RbdOptions::default()).err().expect("second open refused");
    assert!(refused.to_string().contains(&me), "{refused}");
    // Writes through the loser fail; the holder's still work.
    let mut buf = AlignedBuf::zeroed(4096, 4096);
    let lost = BlockingIo::open(&second).unwrap().write_at(0, &mut buf);
    assert!(lost.is_err(), "a client without the lock wrote: {lost:?}");
    assert_eq!(BlockingIo::open(first.as_ref()).unwrap().write_at(0, &mut buf), Ok(4096));
    // A clean handover: let go, and the other takes it.
    first.release_lock().unwrap();
    second.take_lock().unwrap();
    assert!(second.owns_lock().unwrap());
    assert!(!first.owns_lock().unwrap());
    assert_eq!(BlockingIo::open(&second).unwrap().write_at(0, &mut buf), Ok(4096));
    // A read-only open takes no lock and refuses writes.
    let reader = RbdDevice::open(&image.address, RbdOptions { read_only: true, ..RbdOptions::default() }).unwrap();
    assert!(reader.holders().unwrap().starts_with(&second.client_name()));
    let refused = BlockingIo::open(&reader).unwrap().write_at(0, &mut buf);
    assert_eq!(refused, Err(BdevError::ReadOnly));
}

#[test]
fn errors_name_the_missing_image_pool_and_bad_credentials() {
    keelfs_bdev::dev_cluster_up();
    let open = |name: &str| RbdDevice::open(&RbdAddress::parse(name).unwrap(), RbdOptions::default()).err();
    let e = open("rbd:keelfs/no-such-image").expect("a missing image opens");
    assert!(matches!(e, RbdError::NoImage { .. }) && e.to_string().contains("keelfs/no-such-image"), "{e}");
    let e = open("rbd:no-such-pool/x").expect("a missing pool opens");
    assert!(matches!(e, RbdError::NoPool { .. }), "{e}");
    let e = open("rbd:keelfs/x:id=nobody").expect("an unknown client connects");
    assert!(matches!(e, RbdError::Credentials { .. }) && e.to_string().contains("client.nobody"), "{e}");
    let e = open("rbd:keelfs/x@/nonexistent/ceph.conf").expect("a missing conf connects");
    assert!(matches!(e, RbdError::Config { .. }) && e.to_string().contains("/nonexistent/ceph.conf"), "{e}");
}

#[test]
fn an_unreachable_cluster_is_named_within_the_timeout() {
    keelfs_bdev::dev_cluster_up();
    let dir = std::env::temp_dir().join(format!("keelfs-rbd-unreachable-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("ceph.conf");
    // A monitor address nothing listens on (TEST-NET-1 is never routed).
    std::fs::write(&conf, "[global]\nmon_host = 192.0.2.1\nauth_client_required = none\n").unwrap();
    let address = RbdAddress::parse(&format!("rbd:keelfs/x@{}", conf.display())).unwrap();
    // The wait is librados's, bounded by the client_mount_timeout keelfs
    // sets over the conf: the rbd module's unit tests read that back.
    let e = RbdDevice::open(&address, RbdOptions::default()).err().expect("connected to nothing");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(e, RbdError::Unreachable { .. }), "{e}");
    let bound = keelfs_bdev::RBD_CONNECT_TIMEOUT_SECS;
    assert!(
        e.to_string().contains(&format!("cannot reach the Ceph cluster of {} within {bound} s", conf.display())),
        "{e}"
    );
}
