//! The vhost-user-fs device driven over its socket by the test-side
//! frontend (keelfs_vhost::frontend): memfd guest memory, real vhost-user
//! messages, split rings laid out by hand, hostile chains included.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use keelfs_vhost::abi::OUT_HEADER_BYTES;
use keelfs_vhost::abi::{encode_request, init_flags as f, Opcode, Reply, ENTRY_OUT_BYTES};
use keelfs_vhost::frontend::{FrontendConfig, FrontendError, FsFrontend, RawDesc, DESC_NEXT, DESC_WRITE};
use vm_memory::{Bytes, GuestAddress};

mod common;
use common::*;

#[test]
fn requests_over_vhost_user_reach_the_filesystem() {
    let daemon = Daemon::start(1);
    let mut fe = daemon.connect(1);
    assert!(fe.event_idx(), "EVENT_IDX is offered and negotiated");
    let granted = fe.init(f::ASYNC_READ | f::PARALLEL_DIROPS | f::MAX_PAGES | f::INIT_EXT).unwrap();
    assert_ne!(granted & f::PARALLEL_DIROPS, 0);
    assert!(is_missing(&mut fe, 1, "absent"));

    let (nodeid, fh) = create(&mut fe, 1, "hello");
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
    assert_eq!(write(&mut fe, 1, nodeid, fh, 4096, &data), 0);
    assert_eq!(read(&mut fe, 1, nodeid, fh, 4096, data.len() as u32), data);
    assert_eq!(read(&mut fe, 1, nodeid, fh, 0, 4096), vec![0u8; 4096], "the hole before reads as zeros");

    // Many requests in flight at once on one queue, each answered.
    let mut heads = Vec::new();
    for i in 0..24u64 {
        let unique = 1000 + i;
        let req = encode_request(Opcode::Getattr as u32, unique, nodeid, 0, 0, &[0u8; 16]);
        heads.push(fe.submit(1, &req, 4096).unwrap());
    }
    let mut done = Vec::new();
    while done.len() < heads.len() {
        done.extend(fe.wait(1, TIMEOUT).unwrap());
    }
    done.sort_by_key(|u| u.head);
    heads.sort();
    assert_eq!(done.iter().map(|u| u.head).collect::<Vec<_>>(), heads);
    for used in done {
        let reply = fe.reply(1, used).unwrap();
        assert_eq!(i32::from_le_bytes(reply[4..8].try_into().unwrap()), 0, "getattr succeeded");
    }
}

#[test]
fn requests_in_flight_per_queue_stay_under_the_limit() {
    let daemon = Daemon::start_with_options(1, 0, Some(2));
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let mut heads = Vec::new();
    for i in 0..24u64 {
        let req = encode_request(Opcode::Getattr as u32, 1000 + i, 1, 0, 0, &[0u8; 16]);
        heads.push(fe.submit(1, &req, 4096).unwrap());
    }
    // Past the limit requests wait in the ring: all are still answered.
    let mut done = Vec::new();
    while done.len() < heads.len() {
        done.extend(fe.wait(1, TIMEOUT).unwrap());
    }
    for used in done {
        assert_eq!(i32::from_le_bytes(fe.reply(1, used).unwrap()[4..8].try_into().unwrap()), 0);
    }
    drop(fe);
    let [.., in_flight_max] = daemon.stop_all();
    assert!((1..=2).contains(&in_flight_max), "{in_flight_max} requests were in flight at once; the limit is 2");
}

#[test]
fn two_request_queues_serve_one_filesystem() {
    let daemon = Daemon::start(2);
    let mut fe = daemon.connect(2);
    assert_eq!(fe.queues(), 3);
    fe.init(f::INIT_EXT).unwrap();
    let (nodeid, fh) = create(&mut fe, 1, "shared");
    assert_eq!(write(&mut fe, 2, nodeid, fh, 0, b"written through queue 2"), 0);
    assert_eq!(read(&mut fe, 1, nodeid, fh, 0, 64), b"written through queue 2");
    // FORGET on the high-priority queue expects no reply: the chain comes
    // back used with nothing written.
    let mut forget = Reply::default();
    forget.u64(1);
    let req = encode_request(Opcode::Forget as u32, 99, nodeid, 0, 0, &forget.bytes);
    let head = fe.submit(0, &req, 64).unwrap();
    let used = fe.wait_for(0, head, TIMEOUT).unwrap();
    assert_eq!(used.len, 0);
}

#[test]
fn a_helper_reactor_serves_cached_reads_and_sends_the_rest_to_the_owner() {
    // Queue 1 is polled by the filesystem's reactor, queue 2 by a helper.
    let daemon = Daemon::start_with_helpers(2, 1);
    let mut fe = daemon.connect(2);
    fe.init(f::INIT_EXT).unwrap();
    // CREATE and WRITE on the helper's queue go to the owner.
    let (nodeid, fh) = create(&mut fe, 2, "spread");
    let data: Vec<u8> = (0..40_000u32).map(|i| (i * 13 + 5) as u8).collect();
    assert_eq!(write(&mut fe, 2, nodeid, fh, 1000, &data), 0);
    let mut expected = vec![0u8; 41_000];
    expected[1000..].copy_from_slice(&data);
    // Reads of cached pages on the helper: whole, unaligned, short at the
    // end of the file, and past it.
    assert_eq!(read(&mut fe, 2, nodeid, fh, 0, 41_000), expected);
    assert_eq!(read(&mut fe, 2, nodeid, fh, 4095, 3), &expected[4095..4098]);
    assert_eq!(read(&mut fe, 2, nodeid, fh, 40_000, 4096), &expected[40_000..]);
    assert_eq!(read(&mut fe, 2, nodeid, fh, 50_000, 4096), Vec::<u8>::new());
    // A write through the owner's queue is seen at once by the helper.
    assert_eq!(write(&mut fe, 1, nodeid, fh, 2000, b"owner"), 0);
    expected[2000..2005].copy_from_slice(b"owner");
    assert_eq!(read(&mut fe, 2, nodeid, fh, 0, 8192), &expected[..8192]);
    // A handle named with another file's nodeid, and a released handle,
    // get the owner's answers.
    let (other, other_fh) = create(&mut fe, 1, "other");
    let mismatched =
        |fe: &mut FsFrontend, queue| fe.fuse(queue, Opcode::Read, other, &io_body(fh, 0, 10).bytes).unwrap();
    assert_eq!(mismatched(&mut fe, 2), mismatched(&mut fe, 1));
    let mut release = Reply::default();
    release.u64(other_fh).u32(0).u32(0).u64(0);
    assert_eq!(fe.fuse(2, Opcode::Read, other, &io_body(other_fh, 0, 10).bytes).unwrap().0, 0);
    assert_eq!(fe.fuse(1, Opcode::Release, other, &release.bytes).unwrap().0, 0);
    assert_eq!(fe.fuse(2, Opcode::Read, other, &io_body(other_fh, 0, 10).bytes).unwrap().0, libc::EBADF);
    drop(fe);
    let [_, _, from_cache, forwarded, _, _] = daemon.stop_all();
    assert!(from_cache >= 5, "the helper served the cached reads itself ({from_cache})");
    assert!(forwarded >= 4, "the helper sent the other requests to the owner ({forwarded})");
}

/// Chains that each break one rule, around a GETATTR of `req_len` bytes
/// at `scratch`.
fn descriptor_attacks(scratch: u64, req_len: u32, memory_size: u64) -> Vec<(&'static str, Vec<RawDesc>)> {
    let outside = memory_size + 4096;
    vec![
        (
            "request outside guest memory",
            vec![
                RawDesc { addr: outside, len: 64, flags: DESC_NEXT, next: 1 },
                RawDesc { addr: scratch + 4096, len: 4096, flags: DESC_WRITE, next: 0 },
            ],
        ),
        (
            "reply outside guest memory",
            vec![
                RawDesc { addr: scratch, len: req_len, flags: DESC_NEXT, next: 1 },
                RawDesc { addr: outside, len: 4096, flags: DESC_WRITE, next: 0 },
            ],
        ),
        (
            "buffer straddling the end of memory",
            vec![
                RawDesc { addr: scratch, len: req_len, flags: DESC_NEXT, next: 1 },
                RawDesc { addr: memory_size - 8, len: 4096, flags: DESC_WRITE, next: 0 },
            ],
        ),
        (
            "a chain that loops",
            vec![
                RawDesc { addr: scratch, len: req_len, flags: DESC_NEXT, next: 1 },
                RawDesc { addr: scratch + 4096, len: 64, flags: DESC_NEXT | DESC_WRITE, next: 1 },
            ],
        ),
        ("next pointing past the table", vec![RawDesc { addr: scratch, len: req_len, flags: DESC_NEXT, next: 4000 }]),
        ("no room for any reply", vec![RawDesc { addr: scratch, len: req_len, flags: 0, next: 0 }]),
        (
            "a request shorter than a header",
            vec![
                RawDesc { addr: scratch, len: 8, flags: DESC_NEXT, next: 1 },
                RawDesc { addr: scratch + 4096, len: 4096, flags: DESC_WRITE, next: 0 },
            ],
        ),
        (
            "a reply buffer that is too small",
            vec![
                RawDesc { addr: scratch, len: req_len, flags: DESC_NEXT, next: 1 },
                RawDesc { addr: scratch + 4096, len: 8, flags: DESC_WRITE, next: 0 },
            ],
        ),
        (
            "an over-long request",
            vec![
                RawDesc { addr: scratch, len: 2 << 20, flags: DESC_NEXT, next: 1 },
                RawDesc { addr: scratch + 4096, len: 4096, flags: DESC_WRITE, next: 0 },
            ],
        ),
    ]
}

#[test]
fn hostile_requests_get_errors_and_the_daemon_lives_on() {
    let daemon = Daemon::start(2);
    let mut fe = daemon.connect(2);
    fe.init(f::INIT_EXT).unwrap();
    let (nodeid, fh) = create(&mut fe, 1, "victim");
    assert_eq!(write(&mut fe, 1, nodeid, fh, 0, b"intact"), 0);

    // Protocol-level garbage: each earns an errno.
    assert_eq!(fe.fuse_raw(1, 7, 1, &[]).unwrap().0, libc::ENOSYS, "opcode 7 does not exist");
    assert_eq!(fe.fuse_raw(1, 9999, 1, &[]).unwrap().0, libc::ENOSYS, "unknown opcode");
    assert_eq!(fe.fuse(1, Opcode::Getattr, 0xdead_beef, &[0u8; 16]).unwrap().0, libc::ENOENT, "bogus nodeid");
    assert_eq!(write(&mut fe, 1, nodeid, 0xbad_f00d, 0, b"x"), libc::EBADF, "bogus file handle");
    let long = "n".repeat(300);
    assert_eq!(fe.fuse(1, Opcode::Lookup, 1, &named(&long)).unwrap().0, libc::ENAMETOOLONG);
    assert_eq!(fe.fuse(1, Opcode::Lookup, 1, b"no-nul").unwrap().0, libc::EINVAL, "name without NUL");
    assert_eq!(fe.fuse(1, Opcode::Lookup, 1, b"a/b\0").unwrap().0, libc::EINVAL, "name with a slash");
    // A header whose length field disagrees with the chain.
    let unique = fe.next_unique();
    let mut lying = encode_request(Opcode::Getattr as u32, unique, nodeid, 0, 0, &[0u8; 16]);
    lying[..4].copy_from_slice(&4096u32.to_le_bytes());
    assert_ne!(fe.exchange(1, unique, &lying).unwrap().0, 0, "wrong length");
    // A write whose size field claims more data than it carries.
    let mut short = io_body(fh, 0, 1 << 20);
    short.raw(b"tiny");
    assert_ne!(fe.fuse(1, Opcode::Write, nodeid, &short.bytes).unwrap().0, 0);

    // Descriptor-level attacks, one at a time; each chain comes back used
    // with nothing written, and the queue keeps working.
    let scratch = fe.scratch(1);
    let req = encode_request(Opcode::Getattr as u32, 4242, nodeid, 0, 0, &[0u8; 16]);
    fe.memory().write_slice(&req, GuestAddress(scratch)).unwrap();
    let attacks = descriptor_attacks(scratch, req.len() as u32, fe.memory_size());
    for (what, chain) in attacks {
        let head = fe.submit_raw(1, &chain).unwrap();
        match fe.wait_for(1, head, TIMEOUT) {
            Ok(used) => assert!(used.len <= 16, "{what}: at most an error header comes back, got {}", used.len),
            Err(FrontendError::Timeout { .. }) => panic!("{what}: the chain never came back"),
            Err(e) => panic!("{what}: {e}"),
        }
        assert_eq!(read(&mut fe, 1, nodeid, fh, 0, 6), b"intact", "after {what}, the queue still works");
    }

    // A head index past the ring breaks queue 2 for good (the guest's own
    // loss), but the daemon and the other queues carry on.
    fe.submit_head(2, 60_000).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(read(&mut fe, 1, nodeid, fh, 0, 6), b"intact");
}

#[test]
fn a_new_frontend_after_a_disconnect_finds_the_data_and_the_old_references_gone() {
    let daemon = Daemon::start(1);
    let free_at_start;
    {
        let mut fe = daemon.connect(1);
        fe.init(f::INIT_EXT).unwrap();
        free_at_start = statfs_free(&mut fe);
        let (nodeid, fh) = create(&mut fe, 1, "keep");
        assert_eq!(write(&mut fe, 1, nodeid, fh, 0, b"survives a VM restart"), 0);
        // An unlinked file held open by the departing guest.
        let (orphan, orphan_fh) = create(&mut fe, 1, "orphan");
        assert_eq!(write(&mut fe, 1, orphan, orphan_fh, 0, &vec![1u8; 128 << 10]), 0);
        assert_eq!(fe.fuse(1, Opcode::Unlink, 1, &named("orphan")).unwrap().0, 0);
        let mut fsync = Reply::default();
        fsync.u64(orphan_fh).u32(0).u32(0);
        assert_eq!(fe.fuse(1, Opcode::Fsync, orphan, &fsync.bytes).unwrap().0, 0);
        assert!(statfs_free(&mut fe) < free_at_start, "the open orphan holds its blocks");
    } // the frontend disconnects without releasing anything

    let mut fe = connect_retrying(&daemon.socket);
    fe.init(f::INIT_EXT).unwrap();
    let (err, entry) = fe.fuse(1, Opcode::Lookup, 1, &named("keep")).unwrap();
    assert_eq!(err, 0);
    let nodeid = u64::from_le_bytes(entry[..8].try_into().unwrap());
    let mut open = Reply::default();
    open.u32(libc::O_RDONLY as u32).u32(0);
    let (err, reply) = fe.fuse(1, Opcode::Open, nodeid, &open.bytes).unwrap();
    assert_eq!(err, 0);
    let fh = u64::from_le_bytes(reply[..8].try_into().unwrap());
    assert_eq!(read(&mut fe, 1, nodeid, fh, 0, 64), b"survives a VM restart");
    assert!(is_missing(&mut fe, 1, "orphan"));
    // Freed blocks become usable once the free commits.
    let mut free_now = 0;
    let deadline = std::time::Instant::now() + TIMEOUT;
    while std::time::Instant::now() < deadline {
        free_now = statfs_free(&mut fe);
        if free_now + 1 >= free_at_start {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(free_now + 1, free_at_start, "all but the kept file's block came back");
}

#[test]
fn a_queue_stop_waits_for_its_requests() {
    let daemon = Daemon::start(1);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let (nodeid, fh) = create(&mut fe, 1, "busy");
    let mut heads = Vec::new();
    for i in 0..16u64 {
        let mut body = io_body(fh, i * 65536, 65536);
        body.raw(&vec![i as u8; 65536]);
        let unique = fe.next_unique();
        let req = encode_request(Opcode::Write as u32, unique, nodeid, 0, 0, &body.bytes);
        heads.push(fe.submit(1, &req, 4096).unwrap());
    }
    // GET_VRING_BASE returns only once every accepted request is done, so
    // every head is in the used ring by then.
    std::thread::sleep(Duration::from_millis(2));
    let next_avail = fe.stop_queue(1).unwrap();
    let taken = next_avail as usize - 2; // after INIT and CREATE
    assert!(taken <= 16);
    let used = fe.poll(1).unwrap();
    assert_eq!(used.len(), taken, "every write taken from the ring was answered before the stop returned");
    assert!(used.iter().all(|u| u.len == 24), "each got a write reply");
}

fn connect_retrying(socket: &Path) -> FsFrontend {
    connect_retrying_with(socket, 1)
}

#[test]
fn direct_io_moves_data_between_guest_pages_and_the_device() {
    let daemon = Daemon::start(1);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let mut body = Reply::default();
    body.u32((libc::O_RDWR | libc::O_DIRECT) as u32).u32(0o100644).u32(0).u32(0).raw(&named("direct"));
    let (err, reply) = fe.fuse(1, Opcode::Create, 1, &body.bytes).unwrap();
    assert_eq!(err, 0);
    let nodeid = u64::from_le_bytes(reply[..8].try_into().unwrap());
    let fh = u64::from_le_bytes(reply[ENTRY_OUT_BYTES..ENTRY_OUT_BYTES + 8].try_into().unwrap());
    let open_flags = u32::from_le_bytes(reply[ENTRY_OUT_BYTES + 8..ENTRY_OUT_BYTES + 12].try_into().unwrap());
    assert_ne!(open_flags & 1, 0, "an O_DIRECT open gets FOPEN_DIRECT_IO");

    let io = |fe: &mut FsFrontend, opcode: Opcode, offset: u64, data: &[u8], read_len: u32| {
        split_io(fe, (nodeid, fh), opcode, offset, data, read_len)
    };
    // Appends, then overwrites, from page-aligned guest buffers.
    let first: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    let (_, (len, err)) = io(&mut fe, Opcode::Write, 0, &first, 0);
    assert_eq!((len, err), (24, 0));
    let second = vec![0x5au8; 8192];
    assert_eq!(io(&mut fe, Opcode::Write, 8192, &second, 0).1, (24, 0));
    let mut expected = first.clone();
    expected[8192..16384].copy_from_slice(&second);

    fe.poison_next_read(1, 0xee, 65536).unwrap();
    let (used, (len, err)) = io(&mut fe, Opcode::Read, 0, &[], 65536);
    assert_eq!((len, err), (16 + 65536, 0));
    assert_eq!(used.len, 16 + 65536);
    assert_eq!(fe.read_data(1, used, 65536).unwrap(), expected);

    // A read past the end: the reply says how much, and the rest of the
    // guest's buffer holds zeros, not old bytes.
    fe.poison_next_read(1, 0xee, 8192).unwrap();
    let (used, (len, err)) = io(&mut fe, Opcode::Read, 61440, &[], 8192);
    assert_eq!((len, err), (16 + 4096, 0));
    let got = fe.read_data(1, used, 8192).unwrap();
    assert_eq!(&got[..4096], &expected[61440..]);
    assert!(got[4096..].iter().all(|&b| b == 0));

    // Unaligned direct I/O still works (the filesystem copies it).
    assert_eq!(io(&mut fe, Opcode::Write, 100, b"unaligned", 0).1, (24, 0));
    let (used, (len, _)) = io(&mut fe, Opcode::Read, 100, &[], 9);
    assert_eq!(len, 16 + 9);
    assert_eq!(fe.read_data(1, used, 9).unwrap(), b"unaligned");
    drop(fe);
    assert!(daemon.stop().0 >= 6, "the direct requests took the zero-copy path");
}

#[test]
fn a_frontend_that_leaves_with_requests_in_flight_does_not_hurt_the_next() {
    let daemon = Daemon::start(2);
    for round in 0..3 {
        let mut fe = connect_retrying_with(&daemon.socket, 2);
        fe.init(f::INIT_EXT).unwrap();
        let (nodeid, fh) = create(&mut fe, 1, &format!("round{round}"));
        for i in 0..16u64 {
            let mut body = io_body(fh, i * 65536, 65536);
            body.raw(&vec![round as u8; 65536]);
            let unique = fe.next_unique();
            let req = encode_request(Opcode::Write as u32, unique, nodeid, 0, 0, &body.bytes);
            fe.submit(1 + (i as usize % 2), &req, 4096).unwrap();
        }
        // Gone without waiting: the daemon finishes or drops those writes.
    }
    let mut fe = connect_retrying_with(&daemon.socket, 2);
    fe.init(f::INIT_EXT).unwrap();
    for round in 0..3 {
        assert_eq!(fe.fuse(1, Opcode::Lookup, 1, &named(&format!("round{round}"))).unwrap().0, 0);
    }
    let (nodeid, fh) = create(&mut fe, 2, "after");
    assert_eq!(write(&mut fe, 2, nodeid, fh, 0, b"still serving"), 0);
    assert_eq!(read(&mut fe, 1, nodeid, fh, 0, 13), b"still serving");
}

fn connect_retrying_with(socket: &Path, request_queues: usize) -> FsFrontend {
    let deadline = std::time::Instant::now() + TIMEOUT;
    while std::time::Instant::now() < deadline {
        match FsFrontend::connect(socket, FrontendConfig { request_queues, ..FrontendConfig::default() }) {
            Ok(fe) => return fe,
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    panic!("could not reconnect to {}", socket.display());
}

/// Linux's driver puts most requests in indirect tables (INDIRECT_DESC is
/// offered). Heads that collide with table indices once made an earlier
/// loop check drop good chains, which a guest saw as EIO and bad data.
#[test]
fn indirect_descriptor_tables_are_served_whatever_the_head_index() {
    let daemon = Daemon::start(1);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let (nodeid, fh) = create(&mut fe, 1, "indirect");
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
    assert_eq!(write(&mut fe, 1, nodeid, fh, 0, &data), 0);
    let scratch = fe.scratch(1);
    for (round, head) in [0u16, 1, 2, 3, 200].into_iter().enumerate() {
        let unique = 7000 + round as u64;
        let req = encode_request(Opcode::Read as u32, unique, nodeid, 0, 0, &io_body(fh, 0, 8192).bytes);
        fe.memory().write_slice(&req, GuestAddress(scratch)).unwrap();
        let reply_at = scratch + 8192;
        let table = fe
            .write_indirect_table(
                scratch + 4096,
                &[
                    RawDesc { addr: scratch, len: req.len() as u32, flags: DESC_NEXT, next: 1 },
                    RawDesc { addr: reply_at, len: OUT_HEADER_BYTES as u32, flags: DESC_WRITE | DESC_NEXT, next: 2 },
                    RawDesc { addr: reply_at + 4096, len: 8192, flags: DESC_WRITE, next: 0 },
                ],
            )
            .unwrap();
        let head = fe.submit_raw_at(1, head, &[table]).unwrap();
        let used = fe.wait_for(1, head, TIMEOUT).unwrap();
        assert_eq!(used.len, 16 + 8192, "head {head}: the whole read came back");
        let mut got = vec![0u8; 8192];
        fe.memory().read_slice(&mut got, GuestAddress(reply_at + 4096)).unwrap();
        assert_eq!(got, data, "head {head}");
    }
}

#[test]
fn buffered_io_copies_once_between_guest_pages_and_the_cache() {
    let daemon = Daemon::start(1);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let (nodeid, fh) = create(&mut fe, 1, "buffered");
    let io = |fe: &mut FsFrontend, opcode: Opcode, offset: u64, data: &[u8], read_len: u32| {
        split_io(fe, (nodeid, fh), opcode, offset, data, read_len)
    };
    // Unaligned pieces crossing pages, then reads of cached and of partly
    // cached ranges.
    let a: Vec<u8> = (0..10_000u32).map(|i| (i % 241) as u8).collect();
    assert_eq!(io(&mut fe, Opcode::Write, 3000, &a, 0).1, (24, 0));
    let b = vec![0x33u8; 5000];
    assert_eq!(io(&mut fe, Opcode::Write, 9000, &b, 0).1, (24, 0));
    let mut expected = vec![0u8; 14_000];
    expected[3000..13_000].copy_from_slice(&a);
    expected[9000..14_000].copy_from_slice(&b);
    for (offset, len) in [(0u64, 14_000u32), (2999, 3), (4096, 4096), (13_500, 4096)] {
        fe.poison_next_read(1, 0xee, len as usize).unwrap();
        let (used, (reply_len, err)) = io(&mut fe, Opcode::Read, offset, &[], len);
        assert_eq!(err, 0);
        let want = &expected[offset as usize..(offset as usize + len as usize).min(expected.len())];
        assert_eq!(reply_len as usize, 16 + want.len(), "read at {offset}");
        let got = fe.read_data(1, used, len as usize).unwrap();
        assert_eq!(&got[..want.len()], want, "read at {offset}");
        // Only what the reply counts is written: the rest of the guest's
        // buffer is its own (zeroing it was 8% of the reactor's
        // instructions in an open, read and close of small files).
        assert!(got[want.len()..].iter().all(|&b| b == 0xee), "read at {offset} wrote past its data");
    }
    // The same bytes through a request laid out in two buffers (header and
    // data together, reply header and data together).
    assert_eq!(read(&mut fe, 1, nodeid, fh, 0, 14_000), expected);
    drop(fe);
    let (zero_copy, one_copy) = daemon.stop();
    assert_eq!(zero_copy, 0, "no direct handle was used");
    assert!(one_copy >= 6, "the split requests were copied once ({one_copy})");
}

/// A driver that moves the avail index more than a ring ahead breaks its
/// queue: keelfs stops polling that queue (it used to poll it on every
/// reactor iteration for ever, never sleeping) and keeps serving the other.
#[test]
fn an_avail_index_a_ring_ahead_stops_that_queue_not_the_reactor() {
    let daemon = Daemon::start(2);
    let mut fe = daemon.connect(2);
    fe.init(f::INIT_EXT).unwrap();
    fe.jump_avail_index(1, 2000).unwrap();
    let (nodeid, fh) = create(&mut fe, 0, "after-the-break");
    assert_eq!(write(&mut fe, 0, nodeid, fh, 0, b"served"), 0);
    assert_eq!(read(&mut fe, 0, nodeid, fh, 0, 6), b"served");
    // Idle again, the reactor must sleep: a poller stuck on the broken
    // queue would keep it awake.
    let sleeps = || daemon.reactor.stats().sleeps.load(Ordering::Relaxed);
    let deadline = std::time::Instant::now() + TIMEOUT;
    let before = sleeps();
    while sleeps() < before + 10 {
        assert!(std::time::Instant::now() < deadline, "the reactor never sleeps after the broken queue");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(fe);
    let [.., broken, _] = daemon.stop_all();
    assert_eq!(broken, 1, "the broken queue is counted once");
}

#[test]
fn pages_the_device_writes_are_logged_while_migrating() {
    let daemon = Daemon::start(1);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let mut body = Reply::default();
    body.u32((libc::O_RDWR | libc::O_DIRECT) as u32).u32(0o100644).u32(0).u32(0).raw(&named("logged"));
    let (err, reply) = fe.fuse(1, Opcode::Create, 1, &body.bytes).unwrap();
    assert_eq!(err, 0);
    let nodeid = u64::from_le_bytes(reply[..8].try_into().unwrap());
    let fh = u64::from_le_bytes(reply[ENTRY_OUT_BYTES..ENTRY_OUT_BYTES + 8].try_into().unwrap());
    let data = vec![0x3cu8; 65536];
    assert_eq!(split_io(&mut fe, (nodeid, fh), Opcode::Write, 0, &data, 0).1, (24, 0));

    let log = fe.start_dirty_log().unwrap();
    // Before the next request nothing is logged but the used ring's page:
    // the poller writes the ring's avail_event whenever it goes back to
    // waiting for kicks, which it may do at any moment while idle.
    let used_ring_page = fe.used_ring_addr(1) / 4096;
    let idle = log.take().unwrap();
    assert!(idle.iter().all(|&page| page == used_ring_page), "only the used ring is logged while idle: {idle:?}");
    // A direct read: the device writes the guest's pages behind
    // vm-memory's back (io_uring, DMA), so keelfs marks them itself.
    let (used, (len, err)) = split_io(&mut fe, (nodeid, fh), Opcode::Read, 0, &[], 65536);
    assert_eq!((len, err), (16 + 65536, 0));
    let dirty = log.take().unwrap();
    let data_at = fe.reply_data_addr(1, used) / 4096;
    for page in data_at..data_at + 16 {
        assert!(dirty.contains(&page), "data page {page} is logged: {dirty:?}");
    }
    assert!(dirty.contains(&used_ring_page), "the used ring is logged");
    // A device that only read the guest's pages (a write request) dirties
    // the reply and the used ring, and nothing of the data it read is
    // lost if it is marked too.
    assert_eq!(split_io(&mut fe, (nodeid, fh), Opcode::Write, 0, &data, 0).1, (24, 0));
    assert!(log.take().unwrap().contains(&used_ring_page));
    drop(fe);
    assert!(daemon.stop().0 >= 2, "the direct requests took the zero-copy path");
}

#[test]
fn a_device_that_cannot_give_its_image_up_refuses_to_save_and_serves_on() {
    // The common daemon has no ImageAccess, as an export with a host
    // mount: its session cannot follow a guest elsewhere.
    let daemon = Daemon::start(1);
    let mut fe = daemon.connect(1);
    fe.init(f::INIT_EXT).unwrap();
    let (nodeid, fh) = create(&mut fe, 1, "stays");
    assert_eq!(write(&mut fe, 1, nodeid, fh, 0, b"here"), 0);
    assert!(fe.save_state().is_err(), "CHECK_DEVICE_STATE reports the refusal");
    // QEMU fails the migration and restarts the rings: the guest goes on.
    fe.resume_queues().unwrap();
    assert_eq!(read(&mut fe, 1, nodeid, fh, 0, 4), b"here");
}
