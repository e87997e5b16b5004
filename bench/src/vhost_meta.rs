//! The metadata workloads of `keelfs-bench vhost` (issue 34): the FUSE
//! traffic that small-file work makes in a guest, sent over vhost-user-fs
//! to any daemon, as the data workloads are.
//!
//! Each driver thread works in a tree of its own under the root,
//! `meta-T/`, of `--files` files in directories of [`Tree::files_per_dir`]
//! (wide: 1000 files per directory one level down; deep: 16 per directory
//! eight levels down). A thread keeps `--iodepth` operations in flight,
//! each a sequence of requests as one system call of a guest process
//! makes them (a create is CREATE, WRITE, FLUSH and RELEASE; no FLUSH
//! when the open's reply says FOPEN_NOFLUSH, as Linux), like that
//! many processes on one vCPU. Ops per second, the latency of whole
//! operations, and the FUSE requests per operation are reported.
//!
//! Lookups are paid back as the guest's kernel does: every entry a reply
//! gives (LOOKUP, CREATE, MKDIR, READDIRPLUS) is forgotten once the
//! operation is over, in BATCH_FORGETs of [`FORGET_BATCH`] on the hiprio
//! queue, so that neither daemon keeps a growing table of inodes.
//!
//! The workloads are phases over one tree: `create` makes it, `stat`,
//! `open-read-close` and `readdirplus` read it, and `unlink` removes it.
//! `rename` and `mkdir-rmdir` are storms in a directory of their own.
//! create and unlink run until the tree is made or gone; the others until
//! `--seconds` pass, or for `--passes` whole passes over the tree (a cold
//! pass: the first after the daemon starts).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::ValueEnum;
use keelfs_base::testing::splitmix64;
use keelfs_vhost::abi::{encode_request, Opcode, Reply, ENTRY_OUT_BYTES, OUT_HEADER_BYTES};
use keelfs_vhost::frontend::{io_in, io_request, QueueDriver, Used};
use serde_json::json;

use crate::hist::Histogram;
use crate::vhost::{check, connect, CpuCounters, Driver, VhostArgs, Workload};

/// Entries a thread forgets in one BATCH_FORGET.
pub const FORGET_BATCH: usize = 64;
/// Bytes a READDIRPLUS asks for: Linux 6.12 reads a directory a page at
/// a time.
const READDIR_BYTES: u32 = 4096;
/// Bytes read by an open-read-close: the whole of a small file.
const READ_BYTES: u32 = 4096;
/// Each create writes 1 to 4 KiB.
const WRITE_MIN: usize = 1024;
const WRITE_MAX: usize = 4096;
/// The root's node id.
const ROOT: u64 = 1;
/// Levels below the thread's directory in a deep tree.
const DEEP_LEVELS: usize = 8;
/// How long one request may take before the run fails.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Files per thread at most: a tree's names are held in memory.
pub const FILES_MAX: u64 = 10_000_000;

/// The shape of each thread's tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Tree {
    /// 1000 files per directory, each directory right under `meta-T/`.
    Wide,
    /// 16 files per directory, each directory eight levels down.
    Deep,
}

impl Tree {
    pub(crate) fn files_per_dir(self) -> u64 {
        match self {
            Tree::Wide => 1000,
            Tree::Deep => 16,
        }
    }

    /// The names from `meta-T/` down to directory `k`.
    pub(crate) fn dir_path(self, thread: usize, k: u64) -> Vec<String> {
        let mut path = vec![format!("meta-{thread}"), format!("d{k:05}")];
        if self == Tree::Deep {
            path.extend((1..DEEP_LEVELS).map(|l| format!("l{l}")));
        }
        path
    }
}

/// The name of file `i` of a directory: as long as a source file's.
pub(crate) fn file_name(i: u64) -> String {
    format!("file-{i:04}.c")
}

fn cstr(name: &str) -> Vec<u8> {
    let mut v = name.as_bytes().to_vec();
    v.push(0);
    v
}

/// A request of an operation in progress.
enum Req {
    Plain { opcode: Opcode, nodeid: u64, body: Vec<u8>, reply_bytes: u32 },
    Write { nodeid: u64, fh: u64, len: usize },
    Read { nodeid: u64, fh: u64, len: u32 },
}

/// One operation in flight on a slot.
#[derive(Clone, Copy, Default)]
struct Slot {
    /// The file (or directory, for readdirplus) this operation works on.
    item: u64,
    stage: u8,
    /// A node id a reply gave this operation, forgotten when it ends.
    looked_up: u64,
    fh: u64,
    /// The open reply said FOPEN_NOFLUSH: its close sends no FLUSH, as
    /// Linux's does without the writeback cache (which this driver never
    /// asks for at INIT).
    noflush: bool,
    /// READDIRPLUS's next offset.
    offset: u64,
    closing: Closing,
    started: Option<Instant>,
}

/// How far a file's close has come.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
enum Closing {
    #[default]
    Open,
    /// FLUSH sent.
    Flushed,
    /// RELEASE sent: its reply ends the operation.
    Released,
}

/// The hiprio queue, where every thread's forgets go.
pub(crate) struct ForgetQueue(Mutex<QueueDriver>);

impl ForgetQueue {
    fn send(&self, items: &[(u64, u64)]) -> anyhow::Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let mut body = Reply::default();
        body.u32(items.len() as u32).u32(0);
        for &(nodeid, nlookup) in items {
            body.u64(nodeid).u64(nlookup);
        }
        let mut q = self.0.lock().expect("no thread panics holding the forget queue");
        let unique = q.next_unique();
        let request = encode_request(Opcode::BatchForget as u32, unique, 0, 0, 0, &body.bytes);
        // A forget has no reply: the daemon gives the buffer back unused.
        let head = q.submit(&request, OUT_HEADER_BYTES as u32)?;
        q.wait_for(head, REQUEST_TIMEOUT)?;
        Ok(())
    }
}

/// What the tree's setup looked up: the directories' node ids (and the
/// files' for open-read-close), all forgotten at the end.
struct Held {
    dirs: Vec<u64>,
    files: Vec<u64>,
    all: Vec<(u64, u64)>,
}

struct Worker<'a> {
    q: QueueDriver,
    forgets: &'a ForgetQueue,
    args: &'a VhostArgs,
    thread: usize,
    held: Held,
    /// The storms' directory.
    storm_dir: u64,
    slots: Vec<Slot>,
    /// Per slot: which name its rename storm's file has now.
    renamed: Vec<bool>,
    in_flight: HashMap<u16, usize>,
    next_item: u64,
    items: u64,
    /// Operations to start in all (None: until the deadline).
    budget: Option<u64>,
    started_ops: u64,
    no_flush: bool,
    pending_forgets: Vec<(u64, u64)>,
    data: Vec<u8>,
    rng: u64,
    deadline: Instant,
    result: MetaResult,
}

struct MetaResult {
    ops: u64,
    requests: u64,
    entries: u64,
    latency: Histogram,
}

impl Default for MetaResult {
    fn default() -> Self {
        Self { ops: 0, requests: 0, entries: 0, latency: Histogram::new() }
    }
}

impl MetaResult {
    fn merge(&mut self, other: MetaResult) {
        self.ops += other.ops;
        self.requests += other.requests;
        self.entries += other.entries;
        self.latency.merge(&other.latency);
    }
}

/// Look up `name` in `parent` (or make it a directory, if `make`).
fn lookup_or_mkdir(q: &mut QueueDriver, parent: u64, name: &str, make: bool) -> anyhow::Result<u64> {
    if make {
        let mut body = Reply::default();
        body.u32(0o755).u32(0o022).raw(&cstr(name));
        let (err, reply) = q.fuse(Opcode::Mkdir, parent, &body.bytes)?;
        if err == 0 {
            return entry_nodeid(&reply, name);
        }
        if err != libc::EEXIST {
            check(err, &format!("mkdir {name}"))?;
        }
    }
    let (err, reply) = q.fuse(Opcode::Lookup, parent, &cstr(name))?;
    // Missing: ENOENT, or a negative entry (node id 0) for the client to keep.
    let negative = err == 0 && reply.get(..8).is_some_and(|n| n == [0u8; 8]);
    if err == libc::ENOENT || negative {
        bail!("{name} is missing: run --workload create with the same --tree and --files first");
    }
    check(err, &format!("lookup {name}"))?;
    entry_nodeid(&reply, name)
}

fn entry_nodeid(reply: &[u8], what: &str) -> anyhow::Result<u64> {
    let nodeid = reply.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    match nodeid {
        Some(n) if n != 0 && reply.len() >= ENTRY_OUT_BYTES => Ok(n),
        _ => bail!("{what}: a short or empty entry reply"),
    }
}

/// Walk (or make) the thread's tree; with `files`, look up every file.
fn setup_tree(q: &mut QueueDriver, args: &VhostArgs, thread: usize, files: bool) -> anyhow::Result<Held> {
    let make = args.workload == Workload::Create;
    let per_dir = args.tree.files_per_dir();
    let dirs = args.files.div_ceil(per_dir);
    let mut held = Held { dirs: Vec::new(), files: Vec::new(), all: Vec::new() };
    let mut known: HashMap<Vec<String>, u64> = HashMap::new();
    for k in 0..dirs {
        let path = args.tree.dir_path(thread, k);
        let mut parent = ROOT;
        for depth in 1..=path.len() {
            let prefix = path[..depth].to_vec();
            parent = match known.get(&prefix) {
                Some(&n) => n,
                None => {
                    let n = lookup_or_mkdir(q, parent, &prefix[depth - 1], make)?;
                    held.all.push((n, 1));
                    known.insert(prefix, n);
                    n
                }
            };
        }
        held.dirs.push(parent);
    }
    if files {
        for n in 0..args.files {
            let name = file_name(n % per_dir);
            let (err, reply) = q.fuse(Opcode::Lookup, held.dirs[(n / per_dir) as usize], &cstr(&name))?;
            check(err, &format!("lookup {name}"))?;
            let nodeid = entry_nodeid(&reply, &name)?;
            held.files.push(nodeid);
            held.all.push((nodeid, 1));
        }
    }
    Ok(held)
}

/// The storms' directory, `meta-T-storm`, with a file per slot for the
/// rename storm.
fn setup_storm(q: &mut QueueDriver, args: &VhostArgs, thread: usize, held: &mut Held) -> anyhow::Result<u64> {
    let dir = lookup_or_mkdir(q, ROOT, &format!("meta-{thread}-storm"), true)?;
    held.all.push((dir, 1));
    if args.workload == Workload::Rename {
        for s in 0..args.iodepth {
            // Whichever name an earlier run left it under is removed.
            for name in [format!("ren-{s}-a"), format!("ren-{s}-b")] {
                let (err, _) = q.fuse(Opcode::Unlink, dir, &cstr(&name))?;
                if err != libc::ENOENT {
                    check(err, &format!("unlink {name}"))?;
                }
            }
            let mut body = Reply::default();
            body.u32(0o100644).u32(0).u32(0o022).u32(0).raw(&cstr(&format!("ren-{s}-a")));
            let (err, reply) = q.fuse(Opcode::Mknod, dir, &body.bytes)?;
            check(err, "mknod for the rename storm")?;
            held.all.push((entry_nodeid(&reply, "mknod")?, 1));
        }
    }
    Ok(dir)
}

impl<'a> Worker<'a> {
    fn new(mut q: QueueDriver, args: &'a VhostArgs, forgets: &'a ForgetQueue, thread: usize) -> anyhow::Result<Self> {
        let storm = matches!(args.workload, Workload::Rename | Workload::MkdirRmdir);
        let mut held = if storm {
            Held { dirs: Vec::new(), files: Vec::new(), all: Vec::new() }
        } else {
            setup_tree(&mut q, args, thread, args.workload == Workload::OpenReadClose)?
        };
        let storm_dir = if storm { setup_storm(&mut q, args, thread, &mut held)? } else { 0 };
        let items = match args.workload {
            Workload::Readdirplus => held.dirs.len() as u64,
            Workload::Rename | Workload::MkdirRmdir => u64::MAX,
            _ => args.files,
        };
        let budget = match args.workload {
            Workload::Create | Workload::Unlink => Some(args.files),
            _ if args.passes > 0 => Some(items.saturating_mul(args.passes)),
            _ => None,
        };
        Ok(Self {
            q,
            forgets,
            args,
            thread,
            held,
            storm_dir,
            slots: vec![Slot::default(); args.iodepth],
            renamed: vec![false; args.iodepth],
            in_flight: HashMap::new(),
            next_item: 0,
            items,
            budget,
            started_ops: 0,
            no_flush: false,
            pending_forgets: Vec::new(),
            data: vec![0x6b; WRITE_MAX],
            rng: 0x5eed_0000 ^ (thread as u64) << 40,
            deadline: Instant::now() + Duration::from_secs(args.seconds),
            result: MetaResult::default(),
        })
    }

    fn dir_of(&self, item: u64) -> u64 {
        self.held.dirs[(item / self.args.tree.files_per_dir()) as usize]
    }

    fn name_of(&self, item: u64) -> String {
        file_name(item % self.args.tree.files_per_dir())
    }

    /// Whether another operation may start now.
    fn may_start(&self) -> bool {
        match self.budget {
            Some(budget) if self.args.workload.counted() => self.started_ops < budget,
            Some(budget) => self.started_ops < budget && Instant::now() < self.deadline,
            None => Instant::now() < self.deadline,
        }
    }

    fn run(mut self) -> anyhow::Result<MetaResult> {
        self.deadline = Instant::now() + Duration::from_secs(self.args.seconds);
        loop {
            for s in 0..self.slots.len() {
                if self.slots[s].started.is_none() && self.may_start() {
                    self.start(s)?;
                }
            }
            if self.in_flight.is_empty() {
                break;
            }
            let used = match self.args.driver {
                Driver::Busy => self.q.poll()?,
                Driver::Sleep => self.q.wait_signalled(REQUEST_TIMEOUT)?,
            };
            // Every reply is read before anything is sent: a used entry's
            // slot is free again, and the next submission may take it.
            let mut nexts = Vec::with_capacity(used.len());
            for u in used {
                nexts.push(self.complete(u)?);
            }
            for (s, next) in nexts {
                match next {
                    Next::Request(req) => self.submit(s, req)?,
                    Next::Done => self.finish(s)?,
                }
            }
        }
        let pending = std::mem::take(&mut self.pending_forgets);
        self.forgets.send(&pending)?;
        self.result.requests += pending.len().div_ceil(FORGET_BATCH) as u64;
        self.teardown()?;
        Ok(self.result)
    }

    /// After the timed run: forget what the setup looked up, and take the
    /// storm's files and an unlinked tree's directories away.
    fn teardown(&mut self) -> anyhow::Result<()> {
        if self.args.workload == Workload::Rename {
            for s in 0..self.args.iodepth {
                let name = format!("ren-{s}-{}", if self.renamed[s] { 'b' } else { 'a' });
                let (err, _) = self.q.fuse(Opcode::Unlink, self.storm_dir, &cstr(&name))?;
                check(err, &format!("unlink {name}"))?;
            }
        }
        let all = std::mem::take(&mut self.held.all);
        for chunk in all.chunks(FORGET_BATCH) {
            self.forgets.send(chunk)?;
        }
        if self.args.workload == Workload::Unlink {
            self.remove_dirs()?;
        }
        Ok(())
    }

    /// Remove the emptied tree's directories, deepest first.
    fn remove_dirs(&mut self) -> anyhow::Result<()> {
        let dirs = self.args.files.div_ceil(self.args.tree.files_per_dir());
        for k in 0..dirs {
            let path = self.args.tree.dir_path(self.thread, k);
            for depth in (2..=path.len()).rev() {
                let parent = resolve(&mut self.q, &path[..depth - 1])?;
                let (err, _) = self.q.fuse(Opcode::Rmdir, parent.0, &cstr(&path[depth - 1]))?;
                self.forgets.send(&parent.1)?;
                check(err, &format!("rmdir {}", path[..depth].join("/")))?;
            }
        }
        let (err, _) = self.q.fuse(Opcode::Rmdir, ROOT, &cstr(&format!("meta-{}", self.thread)))?;
        check(err, "rmdir the thread's tree")
    }
}

/// The node id of `path` under the root, and the lookups it took.
fn resolve(q: &mut QueueDriver, path: &[String]) -> anyhow::Result<(u64, Vec<(u64, u64)>)> {
    let mut node = ROOT;
    let mut taken = Vec::new();
    for name in path {
        node = lookup_or_mkdir(q, node, name, false)?;
        taken.push((node, 1));
    }
    Ok((node, taken))
}

impl Worker<'_> {
    /// Begin an operation on slot `s`.
    fn start(&mut self, s: usize) -> anyhow::Result<()> {
        let item = match self.args.workload {
            Workload::Rename | Workload::MkdirRmdir => self.next_item,
            _ => self.next_item % self.items.max(1),
        };
        self.next_item += 1;
        self.started_ops += 1;
        self.slots[s] = Slot { item, started: Some(Instant::now()), ..Slot::default() };
        let first = self.first_request(s);
        self.submit(s, first)
    }

    fn first_request(&mut self, s: usize) -> Req {
        let item = self.slots[s].item;
        let plain = |opcode, nodeid, body: Vec<u8>| Req::Plain { opcode, nodeid, body, reply_bytes: 4096 };
        match self.args.workload {
            Workload::Create => {
                let mut body = Reply::default();
                let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL;
                body.u32(flags as u32).u32(0o100644).u32(0o022).u32(0).raw(&cstr(&self.name_of(item)));
                plain(Opcode::Create, self.dir_of(item), body.bytes)
            }
            Workload::Stat => plain(Opcode::Lookup, self.dir_of(item), cstr(&self.name_of(item))),
            Workload::Unlink => plain(Opcode::Unlink, self.dir_of(item), cstr(&self.name_of(item))),
            Workload::OpenReadClose => {
                let nodeid = self.held.files[item as usize];
                plain(Opcode::Open, nodeid, open_in(libc::O_RDONLY))
            }
            Workload::Readdirplus => {
                plain(Opcode::Opendir, self.held.dirs[item as usize], open_in(libc::O_RDONLY | libc::O_DIRECTORY))
            }
            Workload::Rename => {
                let (from, to) = if self.renamed[s] { ('b', 'a') } else { ('a', 'b') };
                let mut body = Reply::default();
                body.u64(self.storm_dir).raw(&cstr(&format!("ren-{s}-{from}"))).raw(&cstr(&format!("ren-{s}-{to}")));
                plain(Opcode::Rename, self.storm_dir, body.bytes)
            }
            Workload::MkdirRmdir => {
                let mut body = Reply::default();
                body.u32(0o755).u32(0o022).raw(&cstr(&format!("mk-{s}")));
                plain(Opcode::Mkdir, self.storm_dir, body.bytes)
            }
            _ => unreachable!("only metadata workloads reach here"),
        }
    }
}

/// fuse_open_in.
fn open_in(flags: i32) -> Vec<u8> {
    let mut b = Reply::default();
    b.u32(flags as u32).u32(0);
    b.bytes
}

/// fuse_release_in (and fuse_flush_in, of the same layout here).
fn release_in(fh: u64) -> Vec<u8> {
    let mut b = Reply::default();
    b.u64(fh).u32(0).u32(0).u64(0);
    b.bytes
}

/// What comes after a reply: another request, or the operation's end.
enum Next {
    Request(Req),
    Done,
}

impl Worker<'_> {
    fn submit(&mut self, s: usize, req: Req) -> anyhow::Result<()> {
        let unique = self.q.next_unique();
        let head = match req {
            Req::Plain { opcode, nodeid, body, reply_bytes } => {
                let request = encode_request(opcode as u32, unique, nodeid, 0, 0, &body);
                self.q.submit(&request, reply_bytes + OUT_HEADER_BYTES as u32)?
            }
            Req::Write { nodeid, fh, len } => {
                let header = io_request(Opcode::Write, unique, nodeid, fh, 0, len as u32);
                self.q.submit_split(&header, &self.data[..len], 0)?
            }
            Req::Read { nodeid, fh, len } => {
                let header = io_request(Opcode::Read, unique, nodeid, fh, 0, len);
                self.q.submit_split(&header, &[], len)?
            }
        };
        self.result.requests += 1;
        let clash = self.in_flight.insert(head, s);
        assert!(clash.is_none(), "a chain head is reused only once its request is done");
        Ok(())
    }

    /// Read the reply in `used`: what its operation does next.
    fn complete(&mut self, used: Used) -> anyhow::Result<(usize, Next)> {
        let Some(s) = self.in_flight.remove(&used.head) else {
            bail!("a reply on chain {} that was not sent", used.head)
        };
        let reply = self.q.reply(used)?;
        if reply.len() < OUT_HEADER_BYTES {
            bail!("a reply shorter than its header ({} bytes)", reply.len());
        }
        let err = -i32::from_le_bytes(reply[4..8].try_into()?);
        Ok((s, self.advance(s, err, &reply[OUT_HEADER_BYTES..])?))
    }

    /// The operation on slot `s` ended: count it, and pay back its lookup.
    fn finish(&mut self, s: usize) -> anyhow::Result<()> {
        let slot = std::mem::take(&mut self.slots[s]);
        let started = slot.started.expect("a finished operation had started");
        if slot.looked_up != 0 {
            self.pending_forgets.push((slot.looked_up, 1));
        }
        if self.args.workload.counted() || Instant::now() <= self.deadline {
            self.result.ops += 1;
            self.result.latency.record(started.elapsed().as_nanos() as u64);
        }
        if self.pending_forgets.len() >= FORGET_BATCH {
            let batch = std::mem::take(&mut self.pending_forgets);
            self.forgets.send(&batch)?;
            self.result.requests += 1;
        }
        Ok(())
    }

    /// The request after the reply (`err`, `body`) to slot `s`'s current one.
    fn advance(&mut self, s: usize, err: i32, body: &[u8]) -> anyhow::Result<Next> {
        let workload = self.args.workload;
        let slot = self.slots[s];
        self.slots[s].stage = slot.stage.saturating_add(1);
        match slot.closing {
            Closing::Flushed if err == libc::ENOSYS => {
                // As Linux does: a daemon without FLUSH is not asked again.
                self.no_flush = true;
                return Ok(self.release(s));
            }
            Closing::Flushed => {
                check(err, &format!("flush after {workload:?} on {}", slot.item))?;
                return Ok(self.release(s));
            }
            Closing::Released => {
                check(err, &format!("release after {workload:?} on {}", slot.item))?;
                return Ok(Next::Done);
            }
            Closing::Open => {}
        }
        check(err, &format!("{workload:?} on {}, step {}", slot.item, slot.stage))?;
        match (workload, slot.stage) {
            (Workload::Create, 0) => {
                let nodeid = entry_nodeid(body, "create")?;
                let open = body.get(ENTRY_OUT_BYTES..ENTRY_OUT_BYTES + 12).context("create: no fuse_open_out")?;
                self.slots[s].looked_up = nodeid;
                self.take_open_out(s, open)?;
                let len = WRITE_MIN + (splitmix64(&mut self.rng) as usize) % (WRITE_MAX - WRITE_MIN + 1);
                Ok(Next::Request(Req::Write { nodeid, fh: self.slots[s].fh, len }))
            }
            (Workload::OpenReadClose, 0) => {
                let open = body.get(..12).context("open: no fuse_open_out")?;
                self.take_open_out(s, open)?;
                let nodeid = self.file_node(s);
                Ok(Next::Request(Req::Read { nodeid, fh: self.slots[s].fh, len: READ_BYTES }))
            }
            (Workload::Create | Workload::OpenReadClose, _) => Ok(self.close(s)),
            (Workload::Stat, 0) => {
                self.slots[s].looked_up = entry_nodeid(body, "lookup")?;
                let mut getattr_in = Reply::default();
                getattr_in.u32(0).u32(0).u64(0);
                let (nodeid, body) = (self.slots[s].looked_up, getattr_in.bytes);
                Ok(Next::Request(Req::Plain { opcode: Opcode::Getattr, nodeid, body, reply_bytes: 256 }))
            }
            (Workload::Readdirplus, _) => self.advance_readdir(s, slot.stage, body),
            (Workload::MkdirRmdir, 0) => {
                self.slots[s].looked_up = entry_nodeid(body, "mkdir")?;
                let (nodeid, body) = (self.storm_dir, cstr(&format!("mk-{s}")));
                Ok(Next::Request(Req::Plain { opcode: Opcode::Rmdir, nodeid, body, reply_bytes: 0 }))
            }
            (Workload::Rename, _) => {
                self.renamed[s] = !self.renamed[s];
                Ok(Next::Done)
            }
            _ => Ok(Next::Done),
        }
    }

    /// The handle and flags of a fuse_open_out (its first 12 bytes).
    fn take_open_out(&mut self, s: usize, open: &[u8]) -> anyhow::Result<()> {
        self.slots[s].fh = u64::from_le_bytes(open[..8].try_into()?);
        let flags = u32::from_le_bytes(open[8..12].try_into()?);
        self.slots[s].noflush = flags & keelfs_vhost::abi::open_flags::NOFLUSH != 0;
        Ok(())
    }

    /// The node of the file an open-read-close or create works on.
    fn file_node(&self, s: usize) -> u64 {
        match self.args.workload {
            Workload::Create => self.slots[s].looked_up,
            _ => self.held.files[self.slots[s].item as usize],
        }
    }

    /// The close of a file: FLUSH (unless the daemon has none), then
    /// RELEASE.
    fn close(&mut self, s: usize) -> Next {
        if self.no_flush || self.slots[s].noflush {
            return self.release(s);
        }
        self.slots[s].closing = Closing::Flushed;
        let (nodeid, body) = (self.file_node(s), release_in(self.slots[s].fh));
        Next::Request(Req::Plain { opcode: Opcode::Flush, nodeid, body, reply_bytes: 0 })
    }

    fn release(&mut self, s: usize) -> Next {
        self.slots[s].closing = Closing::Released;
        let (nodeid, body) = (self.file_node(s), release_in(self.slots[s].fh));
        Next::Request(Req::Plain { opcode: Opcode::Release, nodeid, body, reply_bytes: 0 })
    }

    /// OPENDIR, READDIRPLUS until a reply is empty, RELEASEDIR.
    fn advance_readdir(&mut self, s: usize, stage: u8, body: &[u8]) -> anyhow::Result<Next> {
        let dir = self.held.dirs[self.slots[s].item as usize];
        if stage == 0 {
            let fh = body.get(..8).context("opendir: no fuse_open_out")?;
            self.slots[s].fh = u64::from_le_bytes(fh.try_into()?);
        } else if body.is_empty() {
            self.slots[s].closing = Closing::Released;
            let body = release_in(self.slots[s].fh);
            return Ok(Next::Request(Req::Plain { opcode: Opcode::Releasedir, nodeid: dir, body, reply_bytes: 0 }));
        } else {
            let (entries, next_offset) = parse_direntplus(body, &mut self.pending_forgets)?;
            self.result.entries += entries;
            self.slots[s].offset = next_offset;
        }
        let body = io_in(self.slots[s].fh, self.slots[s].offset, READDIR_BYTES);
        Ok(Next::Request(Req::Plain { opcode: Opcode::Readdirplus, nodeid: dir, body, reply_bytes: READDIR_BYTES }))
    }
}

/// The entries of a READDIRPLUS reply (fuse_direntplus: fuse_entry_out,
/// then fuse_dirent and its name, padded to 8 bytes): how many, other
/// than "." and "..", and the offset after the last. Each entry's lookup
/// goes into `forgets`.
fn parse_direntplus(body: &[u8], forgets: &mut Vec<(u64, u64)>) -> anyhow::Result<(u64, u64)> {
    let (mut entries, mut offset) = (0, 0);
    for entry in dir_entries(body, true) {
        let (nodeid, next, name) = entry?;
        offset = next;
        if name != b"." && name != b".." {
            entries += 1;
            if nodeid != 0 {
                forgets.push((nodeid, 1));
            }
        }
    }
    Ok((entries, offset))
}

/// The entries of a READDIR reply, or with `plus` a READDIRPLUS one:
/// (node id, 0 for READDIR; the offset after the entry; name). An entry
/// cut short is an error, and ends the walk.
pub(crate) fn dir_entries(body: &[u8], plus: bool) -> impl Iterator<Item = anyhow::Result<(u64, u64, &[u8])>> {
    const DIRENT_BYTES: usize = 24;
    let skip = if plus { ENTRY_OUT_BYTES } else { 0 };
    let fixed = skip + DIRENT_BYTES;
    let mut rest = body;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let entry = rest.get(..fixed).context("a truncated directory entry").and_then(|head| {
            let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
            let namelen = u32::from_le_bytes(head[skip + 16..skip + 20].try_into().expect("4 bytes")) as usize;
            let name = rest.get(fixed..fixed + namelen).context("a directory entry's name past the reply")?;
            Ok((if plus { u64_at(0) } else { 0 }, u64_at(skip + 8), name, (fixed + namelen).next_multiple_of(8)))
        });
        match entry {
            Ok((nodeid, offset, name, step)) => {
                rest = &rest[step.min(rest.len())..];
                Some(Ok((nodeid, offset, name)))
            }
            Err(e) => {
                rest = &[];
                Some(Err(e))
            }
        }
    })
}

/// Run a metadata workload: a thread per queue, forgets on the hiprio
/// queue; one JSON line, as the data workloads print.
pub fn run(args: &VhostArgs) -> anyhow::Result<()> {
    if args.files == 0 || args.files > FILES_MAX {
        bail!("--files must be 1 to {FILES_MAX}");
    }
    let queues = args.queues.unwrap_or(args.threads).max(args.threads);
    let mut fe = connect(&args.socket, queues, args.iodepth as u16, 128 << 10)?;
    crate::vhost::init(&mut fe)?;
    let forgets = ForgetQueue(Mutex::new(fe.take_queue(0)));
    let drivers: Vec<QueueDriver> = (1..=args.threads).map(|q| fe.take_queue(q)).collect();
    let workers: Vec<Worker> = drivers
        .into_iter()
        .enumerate()
        .map(|(t, q)| Worker::new(q, args, &forgets, t))
        .collect::<anyhow::Result<_>>()?;
    let cpu = CpuCounters::read(args)?;
    let started = Instant::now();
    let results: Vec<anyhow::Result<MetaResult>> = std::thread::scope(|s| {
        let handles: Vec<_> = workers.into_iter().map(|w| s.spawn(move || w.run())).collect();
        handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
    });
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = CpuCounters::read(args)?.since(&cpu);
    let mut total = MetaResult::default();
    for r in results {
        total.merge(r?);
    }
    let secs =
        if args.workload.counted() || args.passes > 0 { elapsed } else { elapsed.min(args.seconds as f64) }.max(1e-9);
    let mut line = crate::vhost::result_line(args, total.ops, secs, &total.latency);
    line["tree"] = json!(format!("{:?}", args.tree).to_lowercase());
    line["files"] = json!(args.files);
    line["passes"] = json!(args.passes);
    line["ops"] = json!(total.ops);
    line["fuse_requests"] = json!(total.requests);
    line["requests_per_op"] = json!((total.requests as f64 / total.ops.max(1) as f64 * 100.0).round() / 100.0);
    if args.workload == Workload::Readdirplus {
        line["entries_s"] = json!((total.entries as f64 / secs).round());
    }
    cpu.charge(&mut line, total.ops, secs);
    crate::vhost::print_line(args, &line)
}

/// One fuse_direntplus as a daemon would reply it, for the tests of the
/// READDIRPLUS parsers here and in vhost_trace.
#[cfg(test)]
pub(crate) fn direntplus(nodeid: u64, off: u64, name: &[u8]) -> Vec<u8> {
    let mut b = Reply::default();
    b.u64(nodeid).raw(&[0u8; ENTRY_OUT_BYTES - 8]);
    b.u64(nodeid).u64(off).u32(name.len() as u32).u32(8).raw(name);
    while b.bytes.len() % 8 != 0 {
        b.bytes.push(0);
    }
    b.bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direntplus_replies_parse_and_dots_are_not_forgotten() {
        let mut body = direntplus(1, 1, b".");
        body.extend(direntplus(0, 2, b".."));
        body.extend(direntplus(7, 3, b"file-0001.c"));
        body.extend(direntplus(9, 4, b"x"));
        let mut forgets = Vec::new();
        assert_eq!(parse_direntplus(&body, &mut forgets).unwrap(), (2, 4));
        assert_eq!(forgets, vec![(7, 1), (9, 1)]);
        assert!(parse_direntplus(&body[..100], &mut forgets).is_err(), "a truncated entry");
        let mut long = direntplus(3, 5, b"abc");
        long[ENTRY_OUT_BYTES + 16..ENTRY_OUT_BYTES + 20].copy_from_slice(&1000u32.to_le_bytes());
        assert!(parse_direntplus(&long, &mut forgets).is_err(), "a name past the reply");
    }

    #[test]
    fn trees_lay_out_as_documented() {
        assert_eq!(Tree::Wide.dir_path(0, 3), vec!["meta-0", "d00003"]);
        assert_eq!(Tree::Deep.dir_path(1, 0).len(), 1 + DEEP_LEVELS);
        assert_eq!(file_name(7), "file-0007.c");
    }
}
