//! A harness for coverage-guided fuzzing of the FUSE dispatcher (issue 16).
//!
//! An input is a sequence of requests in a compact form that always gives a
//! well-formed header (the length, the unique and the opcode are filled in
//! here), so that every mutation AFL++ makes reaches the opcode's parser
//! and the filesystem instead of dying at the header check:
//!
//! | byte | meaning |
//! |---|---|
//! | 0 | opcode: the byte modulo 56 (every known opcode and a few unknown), or 4000 + byte from 200 up |
//! | 1 | node id: 0 the root, 1 to 64 one learnt from an earlier reply, 255 u64::MAX, else the byte itself |
//! | 2, 3 | body length, little-endian, cut to what is left of the input and to 8 KiB |
//! | ... | the body, verbatim |
//!
//! Each input runs against a fresh copy of one formatted filesystem, so a
//! run is deterministic. The session holds its locks in a lock table (as
//! keelfsd's do beside a host mount), so lock requests reach it too; a
//! request still waiting (an F_SETLKW) after [`WAIT_TICKS`] reactor
//! iterations has the session's waits ended, as a stopping queue does, and
//! must then be answered within as many more: a request that never ends
//! is a stall, and panics. Every reply must be well-formed (its length, the
//! request's unique, an errno in range), and after the input the
//! filesystem's block ownership must be consistent: a violation panics,
//! which AFL++ records as a crash.

#![forbid(unsafe_code)]

pub mod image;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use keelfs_base::testing::splitmix64;
use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_fs::{mkfs, MkfsOptions};
use keelfs_fs::{Fs, FsConfig};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{PollMode, Reactor, ReactorConfig};
use keelfs_vhost::abi::{encode_request, Opcode, Reply};
use keelfs_vhost::{Locks, Session, SessionConfig};

const DEVICE_BYTES: u64 = 32 << 20;
/// Requests one input may hold.
const REQUESTS_MAX: usize = 64;
/// A body's length at most.
const BODY_BYTES_MAX: usize = 8 << 10;
/// Node ids learnt from replies.
const NODES_MAX: usize = 64;
/// A reply may carry at most max_write (1 MiB) of data, plus headers.
const REPLY_BYTES_MAX: usize = (1 << 20) + 4096;
/// Reactor iterations a request may take before its session's lock waits
/// are ended, and again after.
pub const WAIT_TICKS: usize = 64;

pub struct Harness {
    reactor: Reactor,
    device: Arc<MappedDevice>,
    image: Vec<u8>,
}

pub(crate) fn channel(device: &Arc<MappedDevice>) -> DeviceChannel {
    DeviceChannel::attach(device.open_queue(QueueConfig::default()).expect("a RAM device queue"))
}

fn init_body() -> Vec<u8> {
    let mut r = Reply::default();
    r.u32(7).u32(38).u32(128 << 10).u32(u32::MAX).u32(0).raw(&[0u8; 44]);
    r.bytes
}

/// Check a reply's shape; its errno and body.
fn check_reply(reply: &[u8], unique: u64, opcode: u32) -> (i32, &[u8]) {
    assert!((16..=REPLY_BYTES_MAX).contains(&reply.len()), "opcode {opcode}: a reply of {} bytes", reply.len());
    let len = u32::from_le_bytes(reply[..4].try_into().expect("4 bytes")) as usize;
    assert_eq!(len, reply.len(), "opcode {opcode}: the header's length");
    let error = i32::from_le_bytes(reply[4..8].try_into().expect("4 bytes"));
    assert!((-4095..=0).contains(&error), "opcode {opcode}: errno {error}");
    assert_eq!(u64::from_le_bytes(reply[8..16].try_into().expect("8 bytes")), unique, "opcode {opcode}: unique");
    (error, &reply[16..])
}

/// Replies whose body starts with a fuse_entry_out: a node id to aim at.
fn names_a_node(opcode: u32) -> bool {
    [Opcode::Lookup, Opcode::Mknod, Opcode::Mkdir, Opcode::Symlink, Opcode::Link, Opcode::Create]
        .iter()
        .any(|&op| op as u32 == opcode)
}

impl Harness {
    /// A formatted filesystem to copy for every input.
    pub fn new() -> Self {
        let mut reactor =
            Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).expect("a reactor");
        let device = Arc::new(MappedDevice::ram(DEVICE_BYTES, 4096).expect("a RAM device"));
        let dev = Arc::clone(&device);
        reactor.block_on(async move {
            mkfs(channel(&dev), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.expect("mkfs");
        });
        let image = device.snapshot();
        Self { reactor, device, image }
    }

    /// Run one input (see the module documentation). Panics on a
    /// malformed reply or inconsistent block ownership.
    pub fn run(&mut self, input: &[u8]) {
        self.device.restore(&self.image);
        let device = Arc::clone(&self.device);
        let input = input.to_vec();
        self.reactor.block_on(async move {
            let fs = Fs::mount(channel(&device), FsConfig::default()).await.expect("the image mounts");
            let config = SessionConfig { locks: Some(Locks::new()), ..SessionConfig::default() };
            let session = Rc::new(Session::new(fs.clone(), config));
            let init = encode_request(Opcode::Init as u32, 1, 0, 0, 0, &init_body());
            let reply = session.handle(&init).await.expect("INIT is answered");
            assert_eq!(check_reply(&reply, 1, Opcode::Init as u32).0, 0);
            run_requests(&session, &input).await;
            if let Err(why) = fs.inspect().check_block_ownership() {
                panic!("after the input, {why}");
            }
            fs.inspect().assert_invariants();
            session.give_back().await;
            drop(session);
            fs.unmount().await.expect("unmount");
        });
    }
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

/// Serve `request` as a transport does, as a task of its own; end the
/// session's lock waits if it is still waiting after [`WAIT_TICKS`].
async fn serve(session: &Rc<Session>, request: Vec<u8>) -> Option<Vec<u8>> {
    let answer: Rc<RefCell<Option<Option<Vec<u8>>>>> = Rc::default();
    let (task_session, out) = (Rc::clone(session), Rc::clone(&answer));
    keelfs_reactor::spawn_local(async move {
        let reply = task_session.handle(&request).await;
        *out.borrow_mut() = Some(reply);
    });
    for tick in 0..2 * WAIT_TICKS {
        if let Some(reply) = answer.borrow_mut().take() {
            return reply;
        }
        if tick == WAIT_TICKS {
            session.end_lock_waits();
        }
        keelfs_reactor::next_tick().await;
    }
    panic!("a request was not answered, even with its lock waits ended");
}

async fn run_requests(session: &Rc<Session>, mut input: &[u8]) {
    let mut nodes: Vec<u64> = Vec::new();
    for unique in 2..2 + REQUESTS_MAX as u64 {
        let [op, node, len_lo, len_hi, rest @ ..] = input else { break };
        let opcode = if *op >= 200 { 4000 + u32::from(*op) } else { u32::from(*op) % 56 };
        let nodeid = match *node {
            0 => 1,
            255 => u64::MAX,
            n @ 1..=64 if !nodes.is_empty() => nodes[(n as usize - 1) % nodes.len()],
            n => u64::from(n),
        };
        let len = (usize::from(*len_lo) | usize::from(*len_hi) << 8).min(rest.len()).min(BODY_BYTES_MAX);
        let (body, left) = rest.split_at(len);
        input = left;
        let request = encode_request(opcode, unique, nodeid, 0, 0, body);
        let Some(reply) = serve(session, request).await else { continue };
        let (error, reply_body) = check_reply(&reply, unique, opcode);
        if error == 0 && names_a_node(opcode) && reply_body.len() >= 8 && nodes.len() < NODES_MAX {
            nodes.push(u64::from_le_bytes(reply_body[..8].try_into().expect("8 bytes")));
        }
    }
}

/// `count` inputs from `seed`: a starting corpus for AFL++ and the fixed
/// cases CI runs. Bodies are short and mostly small numbers, names and
/// zeroes, so that some requests succeed and build a tree to aim at.
pub fn generated_inputs(seed: u64, count: usize) -> Vec<Vec<u8>> {
    let mut s = seed;
    (0..count)
        .map(|_| {
            let mut input = Vec::new();
            for _ in 0..1 + splitmix64(&mut s) % 24 {
                // Lookups, changes, opens, I/O, xattrs, readdir, and the
                // lock requests (18 RELEASE, 25 FLUSH, 31-33 GETLK to
                // SETLKW).
                const OPS: [u8; 24] =
                    [1, 3, 4, 6, 8, 9, 10, 14, 15, 16, 18, 21, 22, 25, 26, 27, 28, 31, 32, 33, 35, 43, 44, 46];
                let op = OPS[(splitmix64(&mut s) % OPS.len() as u64) as usize];
                let node = (splitmix64(&mut s) % 6) as u8;
                let body_len = (splitmix64(&mut s) % 48) as usize;
                let mut body: Vec<u8> = (0..body_len).map(|_| (splitmix64(&mut s) % 4) as u8).collect();
                if splitmix64(&mut s).is_multiple_of(2) {
                    body.extend_from_slice(format!("n{}\0", splitmix64(&mut s) % 8).as_bytes());
                }
                input.extend_from_slice(&[op, node, body.len() as u8, 0]);
                input.extend_from_slice(&body);
            }
            input
        })
        .collect()
}

/// A target's binary under AFL++ (`cargo afl build --features afl`): each
/// input AFL++ gives goes to `harness`. A panic is a crash AFL++ records,
/// and the process ends with it: nothing observes the harness after an
/// unwind, so it is taken as unwind-safe.
#[cfg(feature = "afl")]
pub fn afl_main(harness: impl FnMut(&[u8])) {
    struct Runner<H>(H);
    impl<H> std::panic::RefUnwindSafe for Runner<H> {}
    impl<H: FnMut(&[u8])> Runner<H> {
        // A method, not the field: the closure below then captures the
        // whole runner, which is unwind-safe by the impl above.
        fn run(&mut self, data: &[u8]) {
            (self.0)(data);
        }
    }
    let mut runner = Runner(harness);
    afl::fuzz!(|data: &[u8]| runner.run(data));
}

/// A target's binary without AFL++: `NAME FILE...` runs each input (a
/// crash AFL++ saved, say) through `run`, and `NAME --seeds DIR N` writes
/// the N inputs `seeds` gives to DIR as a starting corpus.
pub fn replay_main(
    name: &str,
    mut run: impl FnMut(&[u8]),
    seeds: impl FnOnce(usize) -> Vec<Vec<u8>>,
) -> std::process::ExitCode {
    use std::process::ExitCode;
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, dir, count] = args.as_slice() {
        if flag == "--seeds" {
            let Ok(count) = count.parse::<usize>() else {
                eprintln!("{name}: --seeds DIR N: N must be a number");
                return ExitCode::from(2);
            };
            for (i, input) in seeds(count).iter().enumerate() {
                if let Err(e) = std::fs::write(std::path::Path::new(dir).join(format!("seed-{i:03}")), input) {
                    eprintln!("{name}: writing seeds to {dir}: {e}");
                    return ExitCode::FAILURE;
                }
            }
            return ExitCode::SUCCESS;
        }
    }
    for path in &args {
        match std::fs::read(path) {
            Ok(input) => {
                run(&input);
                println!("{path}: ok");
            }
            Err(e) => {
                eprintln!("{name}: {path}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
