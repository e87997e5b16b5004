//! FUSE requests served from virtqueue descriptor chains in (mock) guest
//! memory, hostile chains included.

use std::sync::Arc;

use keelfs_core::bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_core::fs::mkfs::{mkfs, MkfsOptions};
use keelfs_core::fs::{Fs, FsConfig};
use keelfs_core::reactor::io::DeviceChannel;
use keelfs_core::reactor::{PollMode, Reactor, ReactorConfig};
use keelfs_vhost::fuse::abi::{encode_request, Opcode, Reply};
use keelfs_vhost::fuse::dispatch::{Session, SessionConfig};
use keelfs_vhost::virtio::{serve_chain, serve_queue, ChainOutcome, REQUEST_BYTES_MAX};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

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

fn with_session(test: impl AsyncFnOnce(Session, GuestMemoryMmap) + 'static) {
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).unwrap();
    let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(32 << 20, 4096).unwrap());
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap();
    reactor.block_on(async move {
        let ch = || DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
        mkfs(ch(), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
        let fs = Fs::mount(ch(), FsConfig::default()).await.unwrap();
        test(Session::new(fs, SessionConfig::default()), mem).await;
    });
}

fn reply_error(mem: &GuestMemoryMmap, at: u64) -> i32 {
    let mut h = [0u8; 16];
    mem.read_slice(&mut h, GuestAddress(at)).unwrap();
    i32::from_le_bytes(h[4..8].try_into().unwrap())
}

#[test]
fn a_queue_of_requests_is_served_into_the_used_ring() {
    with_session(async |s: Session, mem: GuestMemoryMmap| {
        let mq = MockSplitQueue::new(&mem, 16);
        let init = init_request(1);
        let lookup = request(Opcode::Lookup as u32, 2, 1, b"missing\0");
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
    with_session(async |s: Session, mem: GuestMemoryMmap| {
        let mq = MockSplitQueue::new(&mem, 16);
        let init = init_request(1);
        mem.write_slice(&init, GuestAddress(REQ)).unwrap();
        let chain = mq.build_desc_chain(&[desc(REQ, init.len() as u32, 0, 0), desc(REPLY, 4096, WRITE, 0)]).unwrap();
        assert_eq!(serve_chain(&s, chain).await.2, ChainOutcome::Replied(80));

        // A descriptor pointing past the end of guest memory.
        let outside = mq.build_desc_chain(&[desc(0xFFFF_0000, 64, 0, 0), desc(REPLY, 4096, WRITE, 0)]).unwrap();
        assert!(matches!(serve_chain(&s, outside).await.2, ChainOutcome::Dropped(_)));
        // A writable descriptor outside guest memory.
        let bad_reply =
            mq.build_desc_chain(&[desc(REQ, init.len() as u32, 0, 0), desc(0xFFFF_0000, 64, WRITE, 0)]).unwrap();
        assert!(matches!(serve_chain(&s, bad_reply).await.2, ChainOutcome::Dropped(_)));
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
