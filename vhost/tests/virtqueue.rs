//! FUSE requests served from virtqueue descriptor chains in (mock) guest
//! memory, hostile chains included.

use std::sync::Arc;

use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_fs::{mkfs, MkfsOptions};
use keelfs_fs::{Fs, FsConfig};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{PollMode, Reactor, ReactorConfig};
use keelfs_vhost::abi::{encode_request, Opcode, Reply};
use keelfs_vhost::{serve_chain, serve_queue, ChainOutcome, GuestRam, REQUEST_BYTES_MAX};
use keelfs_vhost::{Session, SessionConfig};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress};

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const REQ: u64 = 0x10_0000;
const REPLY: u64 = 0x20_0000;

fn request(opcode: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
    encode_request(opcode, unique, nodeid, 0, 0, body)
}

fn init_request(unique: u64) -> Vec<u8> {
    let mut b = Reply::default();
    b.u32(7).u32(38).u32(65536).u32(u32::MAX).u32(0).raw(&[0u8; 44]);
    request(Opcode::Init as u32, unique, 0, &b.bytes)
}

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, next))
}

fn with_session(test: impl AsyncFnOnce(Session, GuestRam) + 'static) {
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).unwrap();
    let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(32 << 20, 4096).unwrap());
    let mem = GuestRam::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap();
    reactor.block_on(async move {
        let ch = || DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
        mkfs(ch(), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
        let fs = Fs::mount(ch(), FsConfig::default()).await.unwrap();
        test(Session::new(fs, SessionConfig::default()), mem).await;
    });
}

fn reply_error(mem: &GuestRam, at: u64) -> i32 {
    let mut h = [0u8; 16];
    mem.read_slice(&mut h, GuestAddress(at)).unwrap();
    i32::from_le_bytes(h[4..8].try_into().unwrap())
}

#[test]
fn a_queue_of_requests_is_served_into_the_used_ring() {
    with_session(async |s: Session, mem: GuestRam| {
        let mq = MockSplitQueue::new(&mem, 16);
        let init = init_request(1);
        // A request that fails: GETATTR of a node that does not exist.
        let lookup = request(Opcode::Getattr as u32, 2, 0xdead, &[0u8; 16]);
        mem.write_slice(&init, GuestAddress(REQ)).unwrap();
        mem.write_slice(&lookup, GuestAddress(REQ + 0x1000)).unwrap();
        mq.add_desc_chains(
            &[
                desc(REQ, init.len() as u32, NEXT, 1),
                desc(REPLY, 4096, WRITE, 0),
                desc(REQ + 0x1000, lookup.len() as u32, NEXT, 3),
                desc(REPLY + 0x1000, 4096, WRITE, 0),
            ],
            0,
        )
        .unwrap();
        let mut queue: Queue = mq.create_queue().unwrap();
        let outcomes = serve_queue(&s, &mut queue, &mem).await;
        assert_eq!(outcomes, vec![ChainOutcome::Replied(80), ChainOutcome::Replied(16)]);
        assert_eq!(reply_error(&mem, REPLY), 0, "INIT answered");
        assert_eq!(reply_error(&mem, REPLY + 0x1000), -libc::ENOENT);
        assert_eq!(mq.used().idx().load(), 2, "both chains returned to the guest");
    });
}

#[test]
fn hostile_chains_are_answered_or_dropped_and_serving_goes_on() {
    with_session(async |s: Session, mem: GuestRam| {
        let mq = MockSplitQueue::new(&mem, 16);
        let init = init_request(1);
        mem.write_slice(&init, GuestAddress(REQ)).unwrap();
        let chain = mq.build_desc_chain(&[desc(REQ, init.len() as u32, 0, 0), desc(REPLY, 4096, WRITE, 0)]).unwrap();
        assert_eq!(serve_chain(&s, chain).await.2, ChainOutcome::Replied(80));

        // A descriptor pointing past the end of guest memory.
        let outside = mq.build_desc_chain(&[desc(0xFFFF_0000, 64, 0, 0), desc(REPLY, 4096, WRITE, 0)]).unwrap();
        assert!(matches!(serve_chain(&s, outside).await.2, ChainOutcome::Dropped(_)));
        // A writable descriptor outside guest memory: dropped before the
        // request is served, so the MKDIR it carries makes nothing.
        let mkdir = request(Opcode::Mkdir as u32, 3, 1, b"\xed\x01\0\0\0\0\0\0never\0");
        mem.write_slice(&mkdir, GuestAddress(REQ)).unwrap();
        let bad_reply =
            mq.build_desc_chain(&[desc(REQ, mkdir.len() as u32, 0, 0), desc(0xFFFF_0000, 64, WRITE, 0)]).unwrap();
        assert_eq!(
            serve_chain(&s, bad_reply).await.2,
            ChainOutcome::Dropped("descriptor outside guest memory or malformed chain")
        );
        let lookup = request(Opcode::Lookup as u32, 4, 1, b"never\0");
        mem.write_slice(&lookup, GuestAddress(REQ)).unwrap();
        let look = mq.build_desc_chain(&[desc(REQ, lookup.len() as u32, 0, 0), desc(REPLY, 4096, WRITE, 0)]).unwrap();
        assert!(matches!(serve_chain(&s, look).await.2, ChainOutcome::Replied(_)));
        // Missing: ENOENT, or a negative entry (node id 0) where the
        // session's cache mode keeps names.
        let mut entry = [0u8; 24];
        mem.read_slice(&mut entry, GuestAddress(REPLY)).unwrap();
        let (error, nodeid) = (reply_error(&mem, REPLY), u64::from_le_bytes(entry[16..24].try_into().unwrap()));
        assert!(
            error == -libc::ENOENT || (error == 0 && nodeid == 0),
            "the dropped MKDIR made nothing: {error} {nodeid}"
        );
        // Too short to be a request.
        let short = mq.build_desc_chain(&[desc(REQ, 10, 0, 0), desc(REPLY, 4096, WRITE, 0)]).unwrap();
        assert!(matches!(serve_chain(&s, short).await.2, ChainOutcome::Dropped(_)));
        // A request longer than the protocol allows gets E2BIG.
        let huge = request(Opcode::Getattr as u32, 9, 1, &[0u8; 16]);
        mem.write_slice(&huge, GuestAddress(REQ)).unwrap();
        let long = mq
            .build_desc_chain(&[desc(REQ, (REQUEST_BYTES_MAX + 1) as u32, 0, 0), desc(REPLY, 4096, WRITE, 0)])
            .unwrap();
        assert_eq!(serve_chain(&s, long).await.2, ChainOutcome::Replied(16));
        assert_eq!(reply_error(&mem, REPLY), -libc::E2BIG);
        // No room for the reply: an error header when that fits.
        let getattr = request(Opcode::Getattr as u32, 10, 1, &[0u8; 16]);
        mem.write_slice(&getattr, GuestAddress(REQ)).unwrap();
        let tight = mq.build_desc_chain(&[desc(REQ, getattr.len() as u32, 0, 0), desc(REPLY, 20, WRITE, 0)]).unwrap();
        assert_eq!(serve_chain(&s, tight).await.2, ChainOutcome::Replied(16));
        assert_eq!(reply_error(&mem, REPLY), -libc::EIO);
        let none = mq.build_desc_chain(&[desc(REQ, getattr.len() as u32, 0, 0), desc(REPLY, 8, WRITE, 0)]).unwrap();
        assert!(matches!(serve_chain(&s, none).await.2, ChainOutcome::Dropped(_)));
        // Still serving.
        let ok = mq.build_desc_chain(&[desc(REQ, getattr.len() as u32, 0, 0), desc(REPLY, 4096, WRITE, 0)]).unwrap();
        assert!(matches!(serve_chain(&s, ok).await.2, ChainOutcome::Replied(_)));
        assert_eq!(reply_error(&mem, REPLY), 0);
    });
}

/// Hostile descriptor chains, generated: addresses inside, at the edge of
/// and outside guest memory, lengths from 0 to u32::MAX, every flag
/// combination (indirect included, with a generated table), and next
const FUZZ_QUEUE: u16 = 64;

/// One generated chain of 1 to 8 descriptors over a request of `req_len`
/// bytes at REQ, with an indirect table at TABLE that any may point to.
/// Now and then it is nearly right instead: the request and a reply
/// buffer, with the lengths a little off.
fn hostile_chain(next: &mut impl FnMut() -> u64, req_len: u32, mem: &GuestRam) -> Vec<RawDescriptor> {
    const INDIRECT: u16 = 4;
    const TABLE: u64 = 0x30_0000;
    let mem_end = 8u64 << 20;
    let pick_addr = |n: u64| match n % 7 {
        0 | 1 => REQ,
        2 | 3 => REPLY + (n >> 8) % 0x1000,
        4 => mem_end - (n >> 8) % 64,
        5 => 0xFFFF_FFFF_0000 + (n >> 8) % 0x1000,
        _ => (n >> 8) % mem_end,
    };
    let count = 1 + next() % 8;
    let mut descs = Vec::new();
    for i in 0..count {
        let r = next();
        let addr = pick_addr(r);
        let len = [0, 1, 16, req_len, 4096, (REQUEST_BYTES_MAX + 1) as u32, u32::MAX, (r >> 40) as u32]
            [((r >> 20) % 8) as usize];
        let flags = ((r >> 30) % 8) as u16;
        let to = match (r >> 50) % 5 {
            0 => i as u16 + 1,
            1 => i as u16,
            2 => 0,
            3 => ((r >> 33) % u64::from(FUZZ_QUEUE)) as u16,
            _ => (r >> 33) as u16,
        };
        let addr = if flags & INDIRECT != 0 { TABLE } else { addr };
        let len = if flags & INDIRECT != 0 { 16 * (1 + (r >> 44) as u32 % 8) } else { len };
        descs.push(desc(addr, len, flags, to));
    }
    // An indirect table of generated descriptors, for any that point to it.
    for i in 0..8u64 {
        let r = next();
        let d =
            desc(pick_addr(r), [16u32, 4096, u32::MAX][(r % 3) as usize], ((r >> 4) % 8) as u16, (r >> 8) as u16 % 10);
        mem.write_obj(d, GuestAddress(TABLE + 16 * i)).unwrap();
    }
    if next().is_multiple_of(3) {
        let r = next();
        let req_len = (i64::from(req_len) + [0i64, 0, -1, 1, -8][(r % 5) as usize]) as u32;
        let reply_len = [4096u32, 4096, 16, 20, 8, 1 << 20][((r >> 8) % 6) as usize];
        descs = vec![desc(REQ, req_len, NEXT, 1), desc(REPLY, reply_len, WRITE, 0)];
    }
    descs
}

/// indices that loop, point back or leave the table, over a valid FUSE
/// request most of the time. Every chain must be answered or dropped,
/// never panic or spin, and a good request is served after each round.
/// `KEELFS_FUZZ_SEED` and `KEELFS_FUZZ_CASES` replay or lengthen it.
/// The most times serving one fuzzed ring may be polled.
const QUEUE_POLLS_MAX: u64 = 10_000;

#[test]
fn generated_hostile_chains_never_stop_the_queue() {
    use keelfs_base::testing::splitmix64;
    let seed = keelfs_base::testing::test_seed("KEELFS_FUZZ_SEED", "chain fuzz");
    let rounds: u64 = std::env::var("KEELFS_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1500);
    eprintln!("chain fuzz: {rounds} rounds (KEELFS_FUZZ_CASES={rounds})");
    with_session(async move |s: Session, mem: GuestRam| {
        let mut rng = seed;
        let mut next = move || splitmix64(&mut rng);
        let init = init_request(1);
        mem.write_slice(&init, GuestAddress(REQ)).unwrap();
        let mq = MockSplitQueue::new(&mem, FUZZ_QUEUE);
        let chain = mq.build_desc_chain(&[desc(REQ, init.len() as u32, 0, 0), desc(REPLY, 4096, WRITE, 0)]).unwrap();
        assert_eq!(serve_chain(&s, chain).await.2, ChainOutcome::Replied(80));
        let mut outcomes_seen = [0u64; 3];
        for round in 0..rounds {
            // A fresh ring each round (the mock keeps its indices in memory).
            mem.write_slice(&[0u8; 0x2000], GuestAddress(0)).unwrap();
            let requests = [
                request(Opcode::Getattr as u32, round + 2, 1, &[0u8; 16]),
                request(Opcode::Lookup as u32, round + 2, 1, b"nothing\0"),
                request(Opcode::Statfs as u32, round + 2, 1, &[]),
                request(Opcode::Read as u32, round + 2, 1, &[0u8; 40]),
            ];
            let req = &requests[(next() % requests.len() as u64) as usize];
            mem.write_slice(req, GuestAddress(REQ)).unwrap();
            let descs = hostile_chain(&mut next, req.len() as u32, &mem);
            mq.add_desc_chains(&descs, 0).unwrap();
            let mut queue: Queue = mq.create_queue().unwrap();
            let polls = std::cell::Cell::new(0u64);
            let outcomes = keelfs_base::testing::counting_polls(serve_queue(&s, &mut queue, &mem), &polls).await;
            // A bound in work, not time: serving a ring of hostile chains
            // must not go on yielding without end.
            assert!(polls.get() <= QUEUE_POLLS_MAX, "round {round}: polled {} times", polls.get());
            assert!(
                outcomes.len() <= descs.len(),
                "round {round}: {} outcomes for {} descriptors",
                outcomes.len(),
                descs.len()
            );
            for o in &outcomes {
                let slot = match o {
                    ChainOutcome::Dropped(_) => 0,
                    ChainOutcome::NoReply => 1,
                    _ => 2,
                };
                outcomes_seen[slot] += 1;
            }
        }
        eprintln!(
            "chain fuzz: dropped {}, no reply {}, replied {}",
            outcomes_seen[0], outcomes_seen[1], outcomes_seen[2]
        );
        assert!(outcomes_seen[0] > 0 && outcomes_seen[2] > 0, "both refused and served chains: {outcomes_seen:?}");
        // Still serving.
        mem.write_slice(&[0u8; 0x2000], GuestAddress(0)).unwrap();
        let getattr = request(Opcode::Getattr as u32, 7, 1, &[0u8; 16]);
        mem.write_slice(&getattr, GuestAddress(REQ)).unwrap();
        let mq = MockSplitQueue::new(&mem, FUZZ_QUEUE);
        let ok = mq.build_desc_chain(&[desc(REQ, getattr.len() as u32, 0, 0), desc(REPLY, 4096, WRITE, 0)]).unwrap();
        assert!(matches!(serve_chain(&s, ok).await.2, ChainOutcome::Replied(_)));
        assert_eq!(reply_error(&mem, REPLY), 0);
    });
}
