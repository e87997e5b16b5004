//! Every backend reads back what it wrote, and rejects bad requests with a
//! typed error.

use std::sync::Arc;

use keelfs_base::testing::{fill_pattern, ScratchFile};
use keelfs_bdev::{
    AlignedBuf, BdevError, BlockDevice, BlockingIo, BufferPool, FaultDevice, IoRequest, IoVec, MappedDevice,
    QueueConfig, RbdScratchImage, UringDevice, UringOptions,
};

const CAPACITY: u64 = 16 << 20;

/// What must outlive a backend under test: its scratch file or image.
type Guard = Option<Box<dyn std::any::Any>>;

/// Each backend under test, with the scratch file or image that must
/// outlive it. RBD runs on the dev cluster (scripts/ceph-dev.sh).
fn backends() -> Vec<(&'static str, Arc<dyn BlockDevice>, Guard)> {
    let uring_file = ScratchFile::new("uring", CAPACITY);
    let uring = UringDevice::open(&uring_file.path, UringOptions::default()).expect("open io_uring device");
    let sqpoll_file = ScratchFile::new("sqpoll", CAPACITY);
    let sqpoll =
        UringDevice::open(&sqpoll_file.path, UringOptions { sqpoll_idle_ms: Some(10), ..UringOptions::default() })
            .expect("open sqpoll");
    let pmem_file = ScratchFile::new("pmem", CAPACITY);
    let pmem = MappedDevice::pmem(&pmem_file.path, 4096).expect("map pmem");
    let ram: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(CAPACITY, 4096).expect("map ram"));
    let rbd_image = RbdScratchImage::new("bdev", CAPACITY);
    let rbd = rbd_image.open();
    vec![
        ("uring", Arc::new(uring), Some(Box::new(uring_file))),
        ("uring-sqpoll", Arc::new(sqpoll), Some(Box::new(sqpoll_file))),
        ("pmem", Arc::new(pmem), Some(Box::new(pmem_file))),
        ("rbd", rbd, Some(Box::new(rbd_image))),
        ("ram", Arc::clone(&ram), None),
        ("fault(ram)", Arc::new(FaultDevice::new(ram)), None),
    ]
}

fn pattern_buf(len: usize, seed: u64) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(len, 4096);
    fill_pattern(&mut b, seed);
    b
}

#[test]
fn aligned_io_reads_back_what_was_written() {
    for (name, dev, _file) in backends() {
        let mut io = BlockingIo::open(dev.as_ref()).unwrap();
        for (i, offset) in [0u64, 4096, 1 << 20, CAPACITY - 4096].into_iter().enumerate() {
            let mut w = pattern_buf(4096, i as u64 + 1);
            assert_eq!(io.write_at(offset, &mut w), Ok(4096), "{name}");
            let mut r = AlignedBuf::zeroed(4096, 4096);
            assert_eq!(io.read_at(offset, &mut r), Ok(4096), "{name}");
            assert!(r[..] == w[..], "{name}: data at {offset} differs");
        }
        assert_eq!(io.flush(), Ok(0), "{name}");
    }
}

#[test]
fn vectored_io_reads_back_across_segments() {
    for (name, dev, _file) in backends() {
        let mut io = BlockingIo::open(dev.as_ref()).unwrap();
        let mut segs = [pattern_buf(4096, 7), pattern_buf(8192, 8), pattern_buf(4096, 9)];
        let iov: Vec<IoVec> = segs.iter_mut().map(|b| b.iovec()).collect();
        // SAFETY: segs outlive the call, which waits for completion.
        assert_eq!(unsafe { io.writev_at(64 << 10, &iov) }, Ok(16384), "{name}");
        // Read it back as one contiguous buffer and as differently cut segments.
        let mut whole = AlignedBuf::zeroed(16384, 4096);
        io.read_at(64 << 10, &mut whole).unwrap();
        let expected: Vec<u8> = segs.iter().flat_map(|b| b.iter().copied()).collect();
        assert!(whole[..] == expected[..], "{name}: contiguous read of vectored write differs");
        let mut back = [AlignedBuf::zeroed(12288, 4096), AlignedBuf::zeroed(4096, 4096)];
        let iov: Vec<IoVec> = back.iter_mut().map(|b| b.iovec()).collect();
        // SAFETY: as above.
        assert_eq!(unsafe { io.readv_at(64 << 10, &iov) }, Ok(16384), "{name}");
        let got: Vec<u8> = back.iter().flat_map(|b| b.iter().copied()).collect();
        assert!(got == expected, "{name}: vectored read differs");
    }
}

#[test]
fn one_mebibyte_io_reads_back() {
    for (name, dev, _file) in backends() {
        let mut io = BlockingIo::open(dev.as_ref()).unwrap();
        let mut w = pattern_buf(1 << 20, 42);
        assert_eq!(io.write_at(3 << 20, &mut w), Ok(1 << 20), "{name}");
        let mut r = AlignedBuf::zeroed(1 << 20, 4096);
        assert_eq!(io.read_at(3 << 20, &mut r), Ok(1 << 20), "{name}");
        assert!(r[..] == w[..], "{name}: 1 MiB read differs");
    }
}

#[test]
fn bad_requests_get_typed_errors_not_panics() {
    for (name, dev, _file) in backends() {
        let g = dev.geometry();
        let mut io = BlockingIo::open(dev.as_ref()).unwrap();
        let mut buf = AlignedBuf::zeroed(16384, 4096);
        assert!(
            matches!(io.write_at(100, &mut buf), Err(BdevError::MisalignedOffset { .. })),
            "{name}: misaligned offset"
        );
        assert!(
            matches!(io.read_at(g.capacity_bytes - 4096, &mut buf), Err(BdevError::OutOfRange { .. })),
            "{name}: read past the end"
        );
        assert!(
            matches!(io.write_at(g.capacity_bytes, &mut buf), Err(BdevError::OutOfRange { .. })),
            "{name}: write at the end"
        );
        let odd = [IoVec { base: buf.as_mut_ptr().wrapping_add(1), len: 4096 }];
        // SAFETY: the segment lies inside buf, which outlives the call.
        let r = unsafe { io.writev_at(0, &odd) };
        assert!(matches!(r, Err(BdevError::MisalignedBuffer { .. })), "{name}: misaligned buffer gave {r:?}");
        let short = [IoVec { base: buf.as_mut_ptr(), len: 1000 }];
        // SAFETY: as above.
        let r = unsafe { io.readv_at(0, &short) };
        assert!(matches!(r, Err(BdevError::MisalignedBuffer { .. })), "{name}: odd length gave {r:?}");
        let mut huge = AlignedBuf::zeroed(2 << 20, 4096);
        assert!(matches!(io.read_at(0, &mut huge), Err(BdevError::TooLarge { .. })), "{name}: 2 MiB request");
        // The device still works after all that.
        assert_eq!(io.read_at(0, &mut buf), Ok(16384), "{name}: device unusable after bad requests");
    }
}

#[test]
fn geometry_reports_capacity_and_cache() {
    for (name, dev, _file) in backends() {
        let g = dev.geometry();
        assert_eq!(g.capacity_bytes, CAPACITY, "{name}");
        assert!(g.logical_block_size.is_power_of_two() && g.logical_block_size >= 512, "{name}");
        assert!(g.memory_alignment.is_power_of_two(), "{name}");
    }
    let ram = MappedDevice::ram(CAPACITY, 4096).unwrap();
    assert!(!ram.geometry().volatile_write_cache);
    let file = ScratchFile::new("geom", CAPACITY);
    let uring = UringDevice::open(&file.path, UringOptions::default()).unwrap();
    assert!(uring.geometry().volatile_write_cache, "a host file needs fdatasync");
    let pmem = MappedDevice::pmem(&file.path, 4096).unwrap();
    assert!(pmem.flush_instruction().is_some());
}

#[test]
fn queue_depth_is_enforced_and_all_completions_arrive() {
    for (name, dev, _file) in backends() {
        let mut q = dev.open_queue(QueueConfig { depth: 8, completion_eventfd: false }).unwrap();
        let mut bufs: Vec<AlignedBuf> = (0..9).map(|i| pattern_buf(4096, i)).collect();
        for (i, b) in bufs.iter_mut().enumerate().take(8) {
            let iov = [b.iovec()];
            // SAFETY: bufs outlive the queue's completions, drained below.
            unsafe { q.submit(&IoRequest::write(i as u64, i as u64 * 4096, &iov)).unwrap() };
        }
        let iov = [bufs[8].iovec()];
        // SAFETY: as above.
        let ninth = unsafe { q.submit(&IoRequest::write(8, 8 * 4096, &iov)) };
        assert_eq!(ninth, Err(BdevError::QueueFull), "{name}");
        let mut done = Vec::new();
        while done.len() < 8 {
            q.poll(&mut done, 3);
            assert!(done.len() <= 8);
        }
        assert_eq!(q.in_flight(), 0, "{name}");
        let mut tokens: Vec<u64> = done.iter().map(|c| c.token).collect();
        tokens.sort_unstable();
        assert_eq!(tokens, (0..8).collect::<Vec<_>>(), "{name}: each token exactly once");
        assert!(done.iter().all(|c| c.result == Ok(4096)), "{name}");
    }
}

#[test]
fn uring_fixed_buffers_round_trip_and_bad_index_is_rejected() {
    let file = ScratchFile::new("fixed", CAPACITY);
    let dev = UringDevice::open(&file.path, UringOptions::default()).unwrap();
    let mut pool = BufferPool::new(4, 65536, 4096);
    let mut q = dev.open_queue(QueueConfig::default()).unwrap();
    q.register_pool(&pool).unwrap();
    let mut w = pool.take().unwrap();
    fill_pattern(w.as_mut_slice(), 5);
    let iov = [w.iovec()];
    // SAFETY: w lives until the completion is drained below.
    unsafe { q.submit(&IoRequest::write(1, 0, &iov).with_pool_index(w.index())).unwrap() };
    let mut r = pool.take().unwrap();
    let wrong = [r.iovec()];
    // SAFETY: as above; the request is rejected before reaching the device.
    let bad = unsafe { q.submit(&IoRequest::read(2, 0, &wrong).with_pool_index(w.index())) };
    assert!(matches!(bad, Err(BdevError::BadPoolIndex { .. })));
    let mut done = Vec::new();
    while done.is_empty() {
        q.poll(&mut done, 8);
    }
    assert_eq!(done[0].result, Ok(65536));
    let iov = [r.iovec()];
    // SAFETY: as above.
    unsafe { q.submit(&IoRequest::read(3, 0, &iov).with_pool_index(r.index())).unwrap() };
    done.clear();
    while done.is_empty() {
        q.poll(&mut done, 8);
    }
    assert_eq!(done[0].result, Ok(65536));
    assert_eq!(r.as_slice(), w.as_slice());
    pool.put(w);
    pool.put(r);
    assert_eq!(pool.available(), 4);
}

#[test]
fn pmem_writes_reach_the_file() {
    let file = ScratchFile::new("pmem-persist", CAPACITY);
    let mut w = pattern_buf(8192, 3);
    {
        let dev = MappedDevice::pmem(&file.path, 4096).unwrap();
        let mut io = BlockingIo::open(&dev).unwrap();
        io.write_at(12288, &mut w).unwrap();
        io.flush().unwrap();
    }
    let bytes = std::fs::read(&file.path).unwrap();
    assert!(bytes[12288..12288 + 8192] == w[..], "write not visible in the backing file");
}

#[test]
fn uring_resumes_a_short_transfer_and_reports_where_it_stopped() {
    let file = ScratchFile::new("short", CAPACITY);
    let dev = UringDevice::open(&file.path, UringOptions::default()).unwrap();
    let mut io = BlockingIo::open(&dev).unwrap();
    let mut w = pattern_buf(8192, 11);
    io.write_at(0, &mut w).unwrap();
    // Shrink the file under the device: a read across the new end gets one
    // short transfer, the resumed remainder gets nothing.
    std::fs::OpenOptions::new().write(true).open(&file.path).unwrap().set_len(4096).unwrap();
    let mut r = AlignedBuf::zeroed(8192, 4096);
    assert_eq!(io.read_at(0, &mut r), Err(BdevError::ShortTransfer { done: 4096, len: 8192 }));
    assert!(r[..4096] == w[..4096], "the part before the short transfer was kept");
}

#[test]
fn uring_discard_punches_a_hole_that_reads_back_zeros() {
    let file = ScratchFile::new("uring-discard", CAPACITY);
    let dev = UringDevice::open(&file.path, UringOptions::default()).unwrap();
    assert!(dev.supports_discard(), "a regular file takes hole punches");
    let mut io = BlockingIo::open(&dev).unwrap();
    let mut data = pattern_buf(1 << 20, 11);
    for i in 0..4u64 {
        assert_eq!(io.write_at(i << 20, &mut data), Ok(1 << 20));
    }
    assert_eq!(io.flush(), Ok(0));
    let before = keelfs_base::testing::allocated_bytes(&file.path);
    assert!(before >= 4 << 20, "4 MiB written, {before} bytes allocated");
    // The middle 2 MiB go; the first and last MiB stay.
    assert_eq!(io.discard(1 << 20, 2 << 20), Ok(0));
    let after = keelfs_base::testing::allocated_bytes(&file.path);
    assert!(before - after >= 2 << 20, "allocation went from {before} to {after} bytes");
    let mut r = AlignedBuf::zeroed(1 << 20, 4096);
    for i in 1..3u64 {
        assert_eq!(io.read_at(i << 20, &mut r), Ok(1 << 20));
        assert!(r.iter().all(|&b| b == 0), "discarded MiB {i} reads back zeros");
    }
    for i in [0u64, 3] {
        assert_eq!(io.read_at(i << 20, &mut r), Ok(1 << 20));
        assert!(r[..] == data[..], "MiB {i} kept its data");
    }
    // Bad discards are typed errors, as other requests.
    assert!(matches!(io.discard(CAPACITY - 4096, 8192), Err(BdevError::OutOfRange { .. })));
    assert!(matches!(io.discard(100, 4096), Err(BdevError::MisalignedOffset { .. })));
}

#[test]
fn read_only_uring_refuses_discard() {
    let file = ScratchFile::new("uring-discard-ro", CAPACITY);
    let dev = UringDevice::open(&file.path, UringOptions { read_only: true, ..UringOptions::default() }).unwrap();
    assert!(!dev.supports_discard());
    let mut io = BlockingIo::open(&dev).unwrap();
    assert_eq!(io.discard(0, 4096), Err(BdevError::ReadOnly));
}
