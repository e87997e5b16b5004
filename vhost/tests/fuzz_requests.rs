//! Structure-aware fuzzing of the FUSE dispatcher: requests that are
//! well-formed where a parser looks first (a header whose length matches,
//! a known opcode, a body laid out as the opcode's struct) and hostile in
//! their fields (sizes and offsets at the edges, node ids and handles that
//! are stale, foreign or made up, names with slashes, NULs or 5,000
//! bytes). Random bytes almost never get past the header check; these
//! reach the filesystem.
//!
//! Every reply must be well-formed (its length, the request's unique, an
//! errno in range, a bounded size), every request must finish within a
//! bounded number of polls, and after the run the filesystem must
//! unmount and pass fsck.
//!
//! Three fresh seeds run each time, each printed; `scripts/fuzz.sh` runs
//! long, many seeds. `KEELFS_FUZZ_SEED=S KEELFS_FUZZ_CASES=N` replays one, and
//! `KEELFS_FUZZ_TRACE=K` prints each request from case K on.

use std::cell::Cell;
use std::sync::Arc;

use keelfs_base::testing::{counting_polls, fresh_seed, splitmix64};
use keelfs_bdev::{BlockDevice, MappedDevice, QueueConfig};
use keelfs_fs::fsck;
use keelfs_fs::{mkfs, MkfsOptions};
use keelfs_fs::{Fs, FsConfig};
use keelfs_reactor::DeviceChannel;
use keelfs_reactor::{PollMode, Reactor, ReactorConfig};
use keelfs_vhost::abi::{encode_request, Opcode, Reply, ENTRY_OUT_BYTES};
use keelfs_vhost::{Session, SessionConfig};

/// Node ids and handles the generator has seen in replies, to aim at.
const POOL_MAX: usize = 64;
/// A reply may carry at most max_write (1 MiB) of data, plus headers.
const REPLY_BYTES_MAX: usize = (1 << 20) + 4096;
/// The most times one request's future may be polled: long work is cut
/// into pieces between ticks, and a request that goes on yielding without
/// end (the unbounded loops this guards against took hours) fails here.
/// A bound in work, not in wall-clock time.
const REQUEST_POLLS_MAX: u64 = 10_000;

struct Gen {
    seed: u64,
    nodes: Vec<u64>,
    handles: Vec<u64>,
}

impl Gen {
    fn next(&mut self) -> u64 {
        splitmix64(&mut self.seed)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }

    fn u64_field(&mut self) -> u64 {
        match self.below(10) {
            0 => 0,
            1 => self.below(1 << 20),
            2 => (1 << 52) - self.below(2),
            3 => u64::MAX - self.below(2),
            4 => 1 << 63,
            5 => self.below(1 << 16) * 4096,
            _ => self.next(),
        }
    }

    fn u32_field(&mut self) -> u32 {
        match self.below(8) {
            0 => 0,
            1 => 4096,
            2 => 1 << 20,
            3 => (1 << 20) + 1,
            4 => u32::MAX,
            5 => self.below(256) as u32,
            _ => self.next() as u32,
        }
    }

    fn node(&mut self) -> u64 {
        match self.below(8) {
            0 => self.u64_field(),
            1 | 2 => 1,
            _ if self.nodes.is_empty() => 1,
            _ => {
                let i = self.below(self.nodes.len() as u64) as usize;
                self.nodes[i]
            }
        }
    }

    fn handle(&mut self) -> u64 {
        match self.below(6) {
            0 => self.u64_field(),
            _ if self.handles.is_empty() => self.below(8),
            _ => {
                let i = self.below(self.handles.len() as u64) as usize;
                self.handles[i]
            }
        }
    }

    /// A name, NUL-terminated (or, now and then, not).
    fn name(&mut self) -> Vec<u8> {
        let mut n = match self.below(12) {
            0 => b".".to_vec(),
            1 => b"..".to_vec(),
            2 => Vec::new(),
            3 => b"a/b".to_vec(),
            4 => vec![b'n'; 255],
            5 => vec![b'n'; 256],
            6 => vec![b'l'; 5000],
            7 => b"in\0side".to_vec(),
            _ => vec![b'a' + self.below(6) as u8],
        };
        if self.below(20) != 0 {
            n.push(0);
        }
        n
    }

    fn mode(&mut self) -> u32 {
        let kind =
            self.pick(&[libc::S_IFREG, libc::S_IFDIR, libc::S_IFLNK, libc::S_IFIFO, libc::S_IFSOCK, 0, 0o170000]);
        kind | (self.next() as u32 & 0o7777)
    }

    /// One request: (opcode, node id, body).
    // A flat table, one arm per opcode, each that body's layout: split, it
    // would scatter the one place that says what the generator covers.
    #[allow(clippy::too_many_lines)]
    fn request(&mut self) -> (u32, u64, Vec<u8>) {
        let op = if self.below(30) == 0 { self.below(80) as u32 } else { self.pick(&OPCODES) as u32 };
        let mut b = Reply::default();
        match Opcode::from_u32(op) {
            Some(Opcode::Lookup | Opcode::Unlink | Opcode::Rmdir | Opcode::Removexattr) => {
                b.raw(&self.name());
            }
            Some(Opcode::Forget) => {
                b.u64(self.u64_field());
            }
            Some(Opcode::BatchForget) => {
                let count = self.pick(&[0, 1, 3, 1000, u32::MAX]);
                b.u32(count).u32(0);
                for _ in 0..count.min(4) {
                    let (node, n) = (self.node(), self.u64_field());
                    b.u64(node).u64(n);
                }
            }
            Some(Opcode::Setattr) => {
                b.u32(self.next() as u32 & 0x1ff).u32(0).u64(self.handle()).u64(self.u64_field()).u64(0);
                b.u64(self.u64_field()).u64(self.u64_field()).u64(self.u64_field());
                let nsec = self.pick(&[0u32, 999_999_999, 1_000_000_000]);
                b.u32(nsec).u32(0).u32(0).u32(self.mode()).u32(0).u32(self.pick(&[0, 1000, u32::MAX]));
                b.u32(self.pick(&[0, 1000, u32::MAX])).u32(0);
            }
            Some(Opcode::Symlink) => {
                let (name, target) = (self.name(), self.name());
                b.raw(&name).raw(&target);
            }
            Some(Opcode::Mknod) => {
                b.u32(self.mode()).u32(self.u32_field()).u32(0o022).u32(0).raw(&self.name());
            }
            Some(Opcode::Mkdir) => {
                b.u32(self.mode()).u32(0o022).raw(&self.name());
            }
            Some(Opcode::Rename | Opcode::Rename2) => {
                b.u64(self.node());
                if op == Opcode::Rename2 as u32 {
                    b.u32(self.pick(&[0, 1, 2, 4, 7])).u32(0);
                }
                let (from, to) = (self.name(), self.name());
                b.raw(&from).raw(&to);
            }
            Some(Opcode::Link) => {
                b.u64(self.node()).raw(&self.name());
            }
            Some(Opcode::Open | Opcode::Opendir) => {
                b.u32(self.open_flags()).u32(0);
            }
            Some(Opcode::Create) => {
                b.u32(self.open_flags()).u32(self.mode()).u32(0o022).u32(0).raw(&self.name());
            }
            Some(Opcode::Read | Opcode::Readdir | Opcode::Readdirplus) => {
                b.u64(self.handle()).u64(self.u64_field()).u32(self.u32_field()).u32(0).u64(0).u32(0).u32(0);
            }
            Some(Opcode::Write) => {
                let len = self.pick(&[0usize, 1, 4095, 4096, 65536, (1 << 20) + 1]);
                let declared = if self.below(8) == 0 { self.u32_field() } else { len as u32 };
                b.u64(self.handle()).u64(self.u64_field()).u32(declared).u32(0).u64(0).u32(0).u32(0);
                b.raw(&vec![self.next() as u8; len]);
            }
            Some(Opcode::Release | Opcode::Releasedir | Opcode::Flush) => {
                b.u64(self.handle()).raw(&[0u8; 16]);
            }
            Some(Opcode::Fsync | Opcode::Fsyncdir) => {
                b.u64(self.handle()).u32(self.below(2) as u32).u32(0);
            }
            Some(Opcode::Setxattr) => {
                let value = vec![b'v'; self.pick(&[0usize, 1, 4096, 65536, 70000])];
                let declared = if self.below(8) == 0 { self.u32_field() } else { value.len() as u32 };
                let name = self.xattr_name();
                b.u32(declared).u32(self.pick(&[0, 1, 2, 3])).raw(&name).raw(&value);
            }
            Some(Opcode::Getxattr) => {
                let name = self.xattr_name();
                b.u32(self.u32_field()).u32(0).raw(&name);
            }
            Some(Opcode::Listxattr | Opcode::Access) => {
                b.u32(self.u32_field()).u32(0);
            }
            Some(Opcode::Fallocate) => {
                b.u64(self.handle()).u64(self.u64_field()).u64(self.u64_field());
                b.u32(self.pick(&[0, 1, 2, 3, 0x10, 0x11, 0x08, 0xffff])).u32(0);
            }
            Some(Opcode::Lseek) => {
                b.u64(self.handle()).u64(self.u64_field()).u32(self.pick(&[0, 1, 2, 3, 4, 99])).u32(0);
            }
            Some(Opcode::Interrupt) => {
                b.u64(self.next());
            }
            _ => {
                // Opcodes keelfs answers with ENOSYS, and made-up ones:
                // random bytes of a random size.
                let len = self.below(128) as usize;
                let bytes: Vec<u8> = (0..len).map(|_| self.next() as u8).collect();
                b.raw(&bytes);
            }
        }
        let mut body = b.bytes;
        // Now and then a body cut short, or with trailing bytes.
        match self.below(25) {
            0 => body.truncate(self.below(body.len() as u64 + 1) as usize),
            1 => body.extend_from_slice(&[0xa5; 13]),
            _ => {}
        }
        let node = if op == Opcode::Init as u32 { 0 } else { self.node() };
        (op, node, body)
    }

    fn open_flags(&mut self) -> u32 {
        let access = self.pick(&[libc::O_RDONLY, libc::O_WRONLY, libc::O_RDWR, 3]) as u32;
        let extra = self.pick(&[0, libc::O_DIRECT, libc::O_TRUNC, libc::O_APPEND, libc::O_EXCL | libc::O_CREAT]) as u32;
        access | extra
    }

    fn xattr_name(&mut self) -> Vec<u8> {
        let mut n = match self.below(6) {
            0 => b"trusted.x".to_vec(),
            1 => b"security.capability".to_vec(),
            2 => vec![b'x'; 300],
            3 => b"user.".to_vec(),
            _ => format!("user.k{}", self.below(4)).into_bytes(),
        };
        n.push(0);
        n
    }

    /// Remember node ids and handles from a reply worth aiming at again.
    fn learn(&mut self, op: u32, body: &[u8]) {
        let at = |b: &[u8], i: usize| b.get(i..i + 8).map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")));
        let keep = |pool: &mut Vec<u64>, v: u64, seed: u64| {
            if pool.len() < POOL_MAX {
                pool.push(v);
            } else {
                pool[(seed % POOL_MAX as u64) as usize] = v;
            }
        };
        let seed = self.next();
        match Opcode::from_u32(op) {
            Some(Opcode::Lookup | Opcode::Mkdir | Opcode::Mknod | Opcode::Symlink | Opcode::Link) => {
                if let Some(n) = at(body, 0) {
                    keep(&mut self.nodes, n, seed);
                }
            }
            Some(Opcode::Create) => {
                if let (Some(n), Some(fh)) = (at(body, 0), at(body, ENTRY_OUT_BYTES)) {
                    keep(&mut self.nodes, n, seed);
                    keep(&mut self.handles, fh, seed);
                }
            }
            Some(Opcode::Open | Opcode::Opendir) => {
                if let Some(fh) = at(body, 0) {
                    keep(&mut self.handles, fh, seed);
                }
            }
            _ => {}
        }
    }
}

/// Every opcode the protocol defines, keelfs's and the ones it refuses.
const OPCODES: [Opcode; 44] = [
    Opcode::Lookup,
    Opcode::Forget,
    Opcode::Getattr,
    Opcode::Setattr,
    Opcode::Readlink,
    Opcode::Symlink,
    Opcode::Mknod,
    Opcode::Mkdir,
    Opcode::Unlink,
    Opcode::Rmdir,
    Opcode::Rename,
    Opcode::Link,
    Opcode::Open,
    Opcode::Read,
    Opcode::Write,
    Opcode::Statfs,
    Opcode::Release,
    Opcode::Fsync,
    Opcode::Setxattr,
    Opcode::Getxattr,
    Opcode::Listxattr,
    Opcode::Removexattr,
    Opcode::Flush,
    Opcode::Init,
    Opcode::Opendir,
    Opcode::Readdir,
    Opcode::Releasedir,
    Opcode::Fsyncdir,
    Opcode::Getlk,
    Opcode::Access,
    Opcode::Create,
    Opcode::Interrupt,
    Opcode::Bmap,
    Opcode::Destroy,
    Opcode::Ioctl,
    Opcode::BatchForget,
    Opcode::Fallocate,
    Opcode::Readdirplus,
    Opcode::Rename2,
    Opcode::Lseek,
    Opcode::CopyFileRange,
    Opcode::Syncfs,
    Opcode::Tmpfile,
    Opcode::Statx,
];

fn init_body() -> Vec<u8> {
    let mut r = Reply::default();
    r.u32(7).u32(38).u32(128 << 10).u32(u32::MAX).u32(0).raw(&[0u8; 44]);
    r.bytes
}

/// Check one reply's shape; returns its errno and body.
fn check_reply(reply: &[u8], unique: u64, what: &str) -> (i32, Vec<u8>) {
    assert!(reply.len() >= 16, "{what}: a reply of {} bytes", reply.len());
    assert!(reply.len() <= REPLY_BYTES_MAX, "{what}: a reply of {} bytes", reply.len());
    let len = u32::from_le_bytes(reply[..4].try_into().unwrap()) as usize;
    assert_eq!(len, reply.len(), "{what}: the header's length");
    let error = i32::from_le_bytes(reply[4..8].try_into().unwrap());
    assert!((-4095..=0).contains(&error), "{what}: error {error}");
    assert_eq!(u64::from_le_bytes(reply[8..16].try_into().unwrap()), unique, "{what}: unique");
    if error != 0 {
        assert_eq!(reply.len(), 16, "{what}: an error reply carries no body");
    }
    (error, reply[16..].to_vec())
}

/// Run `cases` generated requests from `seed` against one session on a
/// fresh filesystem; then unmount and fsck.
fn run(seed: u64, cases: u64) {
    eprintln!("fuzz: seed {seed}, {cases} requests (replay: KEELFS_FUZZ_SEED={seed} KEELFS_FUZZ_CASES={cases})");
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::Busy, ..ReactorConfig::default() }).unwrap();
    let dev: Arc<dyn BlockDevice> = Arc::new(MappedDevice::ram(256 << 20, 4096).unwrap());
    reactor.block_on(async move {
        let ch = || DeviceChannel::attach(dev.open_queue(QueueConfig::default()).unwrap());
        mkfs(ch(), &MkfsOptions { force: true, ..MkfsOptions::default() }).await.unwrap();
        let fs = Fs::mount(ch(), FsConfig::default()).await.unwrap();
        let session = Session::new(fs.clone(), SessionConfig::default());
        let init = session.handle(&encode_request(Opcode::Init as u32, 1, 0, 0, 0, &init_body())).await.unwrap();
        assert_eq!(check_reply(&init, 1, "INIT").0, 0);
        let mut g = Gen { seed, nodes: Vec::new(), handles: Vec::new() };
        let mut answered = [0u64; 2];
        // KEELFS_FUZZ_TRACE=N prints every request from case N on, and its
        // errno: with a failing seed, the cases before the failure.
        let trace_from = env_u64("KEELFS_FUZZ_TRACE");
        for case in 0..cases {
            let (op, node, body) = g.request();
            let unique = case + 2;
            let uid = g.pick(&[0u32, 0, 1000]);
            let request = encode_request(op, unique, node, uid, uid, &body);
            let what = format!("case {case} (seed {seed}): opcode {op} node {node:#x}, {} body bytes", body.len());
            let polls = Cell::new(0u64);
            let reply = counting_polls(session.handle(&request), &polls).await;
            assert!(polls.get() <= REQUEST_POLLS_MAX, "{what}: polled {} times", polls.get());
            if trace_from.is_some_and(|from| case >= from) {
                let shown = &body[..body.len().min(48)];
                let error = reply.as_ref().map(|r| i32::from_le_bytes(r[4..8].try_into().unwrap()));
                eprintln!("{what}: {shown:02x?} -> {error:?}");
            }
            if let Err(why) = fs.inspect().check_block_ownership() {
                panic!("{what}: after it, {why}");
            }
            fs.inspect().assert_invariants();
            if let Some(reply) = reply {
                let (error, reply_body) = check_reply(&reply, unique, &what);
                answered[usize::from(error == 0)] += 1;
                if error == 0 {
                    g.learn(op, &reply_body);
                }
            }
        }
        eprintln!("fuzz: seed {seed}: {} succeeded, {} refused", answered[1], answered[0]);
        assert!(answered[1] > cases / 20, "too few requests got through to the filesystem: {answered:?}");
        session.give_back().await;
        drop(session);
        fs.unmount().await.unwrap();
        let report = fsck(ch(), |_| {}).await.unwrap();
        assert!(report.is_clean(), "seed {seed}: fsck after the run: {report:?}");
    });
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn hostile_well_formed_requests_get_well_formed_answers_and_leave_a_clean_filesystem() {
    let cases = env_u64("KEELFS_FUZZ_CASES").unwrap_or(4000);
    // Three fresh seeds a run, each printed by `run`; KEELFS_FUZZ_SEED
    // replays one.
    match env_u64("KEELFS_FUZZ_SEED") {
        Some(seed) => run(seed, cases),
        None => (0..3).for_each(|_| run(fresh_seed(), cases)),
    }
}
