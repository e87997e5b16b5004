//! `keelfs-bench vhost --workload trace --trace FILE`: replay the FUSE
//! requests a real workload made (recorded by `keelfsd serve
//! --trace-requests` on a host mount) against any vhost-user-fs daemon,
//! one request at a time in the order their replies were recorded (which
//! keeps every request after the reply that introduced its node ids).
//!
//! Node ids, file handles and directory offsets are the recording
//! daemon's: each is mapped to what the daemon under test answered for
//! the same request. A request that succeeded in the recording and fails
//! here, where it would have introduced an id, ends the replay; other
//! differences in outcome (an xattr the other daemon does not serve) are
//! counted as `divergent`. The recorded workload must leave the tree as
//! it found it (untar, then remove), so that `--passes N` can repeat it.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{bail, Context};
use keelfs_vhost::abi::{encode_request, init_flags as f, Opcode, ENTRY_OUT_BYTES, IN_HEADER_BYTES, OUT_HEADER_BYTES};
use keelfs_vhost::frontend::QueueDriver;
use keelfs_vhost::{parse_trace, Exchange};
use serde_json::json;

use crate::hist::Histogram;
use crate::vhost::{connect, CpuCounters, VhostArgs};
use crate::vhost_meta::dir_entries;

/// FUSE_GETATTR_FH, and FATTR_FH in fuse_setattr_in.valid.
const GETATTR_FH: u32 = 1;
const FATTR_FH: u32 = 1 << 6;
/// The largest WRITE a host mount sends (max_write 1 MiB) with headers.
const SLOT_BYTES: u64 = (1 << 20) + 8192;

/// The recording daemon's ids, mapped to the daemon under test's.
#[derive(Default)]
struct Ids {
    nodes: HashMap<u64, u64>,
    handles: HashMap<u64, u64>,
    /// (recorded handle, recorded offset) of a directory read's end.
    offsets: HashMap<(u64, u64), u64>,
}

impl Ids {
    fn new() -> Self {
        let mut ids = Self::default();
        ids.nodes.insert(1, 1); // the root is 1 on both
        ids
    }

    fn node(&self, old: u64) -> anyhow::Result<u64> {
        match old {
            0 => Ok(0),
            _ => self.nodes.get(&old).copied().with_context(|| format!("node {old} was never introduced")),
        }
    }

    fn handle(&self, old: u64) -> anyhow::Result<u64> {
        self.handles.get(&old).copied().with_context(|| format!("handle {old} was never opened"))
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4).map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at + 8).map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
}

fn put_u64(b: &mut [u8], at: usize, v: u64) -> anyhow::Result<()> {
    b.get_mut(at..at + 8).context("a request body too short for its fields")?.copy_from_slice(&v.to_le_bytes());
    Ok(())
}

/// The request body with the recording's ids replaced by the replay's.
fn rewrite(opcode: Opcode, body: &[u8], ids: &Ids, downgrade_setxattr: bool) -> anyhow::Result<Vec<u8>> {
    use Opcode::*;
    let mut b = body.to_vec();
    let fh_at_0 = |b: &mut Vec<u8>| -> anyhow::Result<()> {
        let old = u64_at(b, 0).context("a body without its handle")?;
        put_u64(b, 0, ids.handle(old)?)
    };
    match opcode {
        Write => {
            // The trace keeps no data: write the size it names.
            fh_at_0(&mut b)?;
            let size = u32_at(&b, 16).context("a WRITE without its size")? as usize;
            b.truncate(40);
            b.extend((0..size).map(|i| b"keelfs trace\n"[i % 13]));
        }
        Read | Release | Releasedir | Flush | Fsync | Fsyncdir | Lseek | Fallocate => fh_at_0(&mut b)?,
        Readdir | Readdirplus => {
            let (fh, off) = (u64_at(&b, 0).context("short")?, u64_at(&b, 8).context("short")?);
            fh_at_0(&mut b)?;
            let new_off = if off == 0 { 0 } else { *ids.offsets.get(&(fh, off)).context("an offset never replied")? };
            put_u64(&mut b, 8, new_off)?;
        }
        Getattr if u32_at(&b, 0).is_some_and(|flags| flags & GETATTR_FH != 0) => {
            let old = u64_at(&b, 8).context("short")?;
            put_u64(&mut b, 8, ids.handle(old)?)?;
        }
        Setattr if u32_at(&b, 0).is_some_and(|valid| valid & FATTR_FH != 0) => {
            let old = u64_at(&b, 8).context("short")?;
            put_u64(&mut b, 8, ids.handle(old)?)?;
        }
        Rename | Rename2 | Link => {
            let old = u64_at(&b, 0).context("short")?;
            put_u64(&mut b, 0, ids.node(old)?)?;
        }
        Setxattr if downgrade_setxattr => {
            // The extended fuse_setxattr_in (16 bytes) to the old (8).
            b.drain(8..16.min(b.len()));
        }
        CopyFileRange | Ioctl | Poll | Getlk | Setlk | Setlkw | Bmap => {
            bail!("{opcode:?} is in the trace, and its replay is not implemented")
        }
        _ => {}
    }
    Ok(b)
}

/// Learn the ids a reply introduced: the recorded reply's, mapped to the
/// replay's. `request` is the recorded request body (the recording's ids).
fn learn(opcode: Opcode, request: &[u8], recorded: &[u8], got: &[u8], ids: &mut Ids) -> anyhow::Result<()> {
    use Opcode::*;
    match opcode {
        Lookup | Mkdir | Mknod | Symlink | Link | Create | Tmpfile => {
            let (old, new) = (u64_at(recorded, 0).unwrap_or(0), u64_at(got, 0).unwrap_or(0));
            if old != 0 && new != 0 {
                ids.nodes.insert(old, new);
            }
            if matches!(opcode, Create | Tmpfile) {
                let fh = |r: &[u8]| u64_at(r, ENTRY_OUT_BYTES).context("a CREATE reply without its handle");
                ids.handles.insert(fh(recorded)?, fh(got)?);
            }
        }
        Open | Opendir => {
            ids.handles.insert(u64_at(recorded, 0).context("short")?, u64_at(got, 0).context("short")?);
        }
        Readdir | Readdirplus => {
            let plus = opcode == Readdirplus;
            let entries = |reply| dir_entries(reply, plus).collect::<anyhow::Result<Vec<_>>>();
            let (old, new) = (entries(recorded)?, entries(got)?);
            if plus {
                let new_by_name: HashMap<&[u8], u64> = new.iter().map(|&(n, _, name)| (name, n)).collect();
                for (old_node, _, name) in old.iter().filter(|(n, _, _)| *n != 0) {
                    if let Some(&new_node) = new_by_name.get(name).filter(|&&n| n != 0) {
                        ids.nodes.insert(*old_node, new_node);
                    }
                }
            }
            if let (Some(o), Some(n)) = (old.last(), new.last()) {
                ids.offsets.insert((u64_at(request, 0).unwrap_or(0), o.1), n.1);
            }
        }
        Release | Releasedir => {
            ids.handles.remove(&u64_at(request, 0).unwrap_or(0));
        }
        _ => {}
    }
    Ok(())
}

/// What a replay did.
struct Replayed {
    requests: u64,
    /// Requests whose outcome differed from the recording's, by opcode,
    /// and the errno each gave here (0 for success).
    divergent: std::collections::BTreeMap<String, u64>,
    latency: Histogram,
}

struct Replayer {
    q: QueueDriver,
    hiprio: QueueDriver,
    downgrade_setxattr: bool,
    out: Replayed,
}

impl Replayer {
    /// A FORGET or BATCH_FORGET, ids mapped, on the hiprio queue.
    fn forget(&mut self, header: &[u8], body: &[u8], ids: &Ids) -> anyhow::Result<()> {
        let opcode = u32_at(header, 4).expect("a header");
        let nodeid = ids.node(u64_at(header, 16).expect("a header"))?;
        let mut body = body.to_vec();
        if opcode == Opcode::BatchForget as u32 {
            let count = u32_at(&body, 0).context("short")? as usize;
            for i in 0..count {
                let at = 8 + 16 * i;
                let old = u64_at(&body, at).context("a BATCH_FORGET shorter than its count")?;
                put_u64(&mut body, at, ids.node(old)?)?;
            }
        }
        let unique = self.hiprio.next_unique();
        let request = encode_request(opcode, unique, nodeid, 0, 0, &body);
        let head = self.hiprio.submit(&request, OUT_HEADER_BYTES as u32)?;
        self.hiprio.wait_for(head, std::time::Duration::from_secs(30))?;
        Ok(())
    }

    fn one(&mut self, index: usize, ex: &Exchange, ids: &mut Ids) -> anyhow::Result<()> {
        let header = &ex.request[..IN_HEADER_BYTES];
        let raw_opcode = u32_at(header, 4).expect("a header");
        let Some(opcode) = Opcode::from_u32(raw_opcode) else { bail!("exchange {index}: opcode {raw_opcode}") };
        let extensions = usize::from(u16::from_le_bytes([header[36], header[37]])) * 8;
        let end = ex.request.len().checked_sub(extensions).filter(|&e| e >= IN_HEADER_BYTES);
        let body = &ex.request[IN_HEADER_BYTES..end.context("extensions longer than the request")?];
        match opcode {
            Opcode::Init | Opcode::Destroy | Opcode::Interrupt => return Ok(()),
            Opcode::Forget | Opcode::BatchForget => return self.forget(header, body, ids),
            _ => {}
        }
        let nodeid = ids.node(u64_at(header, 16).expect("a header"))?;
        let rewritten =
            rewrite(opcode, body, ids, self.downgrade_setxattr).with_context(|| format!("exchange {index}"))?;
        let started = Instant::now();
        let (err, got) = self.q.fuse(opcode, nodeid, &rewritten)?;
        self.out.latency.record(started.elapsed().as_nanos() as u64);
        self.out.requests += 1;
        let recorded_err = ex.reply.get(4..8).map_or(0, |e| -i32::from_le_bytes(e.try_into().expect("4 bytes")));
        let recorded = ex.reply.get(OUT_HEADER_BYTES..).unwrap_or(&[]);
        let (recorded_err, err) =
            (missing_as_enoent(opcode, recorded_err, recorded), missing_as_enoent(opcode, err, &got));
        if err != recorded_err {
            let introduces = matches!(
                opcode,
                Opcode::Lookup | Opcode::Mkdir | Opcode::Create | Opcode::Open | Opcode::Opendir | Opcode::Mknod
            );
            if recorded_err == 0 && introduces {
                bail!("exchange {index}: {opcode:?} failed with errno {err}, where the recording's succeeded");
            }
            // A SETATTR's outcome depends on what it sets: name that too.
            let what = match opcode {
                Opcode::Setattr => format!("Setattr({:#x})", u32_at(body, 0).unwrap_or(0)),
                _ => format!("{opcode:?}"),
            };
            *self.out.divergent.entry(format!("{what} {recorded_err}->{err}")).or_default() += 1;
            return Ok(());
        }
        if err == 0 {
            learn(opcode, body, recorded, &got, ids).with_context(|| format!("exchange {index}"))?;
        }
        Ok(())
    }
}

/// A LOOKUP's negative entry (node id 0, which keelfsd gives so that the
/// client keeps the miss) is the same outcome as another daemon's ENOENT.
fn missing_as_enoent(opcode: Opcode, err: i32, reply: &[u8]) -> i32 {
    if opcode == Opcode::Lookup && err == 0 && u64_at(reply, 0) == Some(0) {
        libc::ENOENT
    } else {
        err
    }
}

/// The flags the recording's INIT reply granted.
fn recorded_flags(trace: &[Exchange]) -> anyhow::Result<u64> {
    let init = trace
        .iter()
        .find(|e| u32_at(&e.request, 4) == Some(Opcode::Init as u32))
        .context("the trace has no INIT: record from the start of a mount")?;
    let body = init.reply.get(OUT_HEADER_BYTES..).context("INIT without a reply")?;
    let low = u64::from(u32_at(body, 12).context("a short INIT reply")?);
    let high = u64::from(u32_at(body, 32).unwrap_or(0));
    Ok(low | high << 32)
}

pub fn run(args: &VhostArgs) -> anyhow::Result<()> {
    let path = args.trace.as_ref().context("--workload trace needs --trace FILE")?;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let trace = parse_trace(&bytes).with_context(|| format!("{}", path.display()))?;
    if args.threads != 1 {
        bail!("--workload trace replays one request at a time: --threads 1");
    }
    let wanted = recorded_flags(&trace)?
        & (f::ASYNC_READ | f::BIG_WRITES | f::MAX_PAGES | f::PARALLEL_DIROPS | f::INIT_EXT | f::SETXATTR_EXT);
    let mut fe = connect(&args.socket, 1, 4, SLOT_BYTES)?;
    let granted = fe.init(wanted)?;
    let downgrade_setxattr = wanted & f::SETXATTR_EXT != 0 && granted & f::SETXATTR_EXT == 0;
    let (hiprio, q) = (fe.take_queue(0), fe.take_queue(1));
    let out = Replayed { requests: 0, divergent: Default::default(), latency: Histogram::new() };
    let mut replayer = Replayer { q, hiprio, downgrade_setxattr, out };
    let passes = args.passes.max(1);
    let cpu = CpuCounters::read(args)?;
    let started = Instant::now();
    for pass in 0..passes {
        let mut ids = Ids::new();
        for (index, ex) in trace.iter().enumerate() {
            replayer.one(index, ex, &mut ids).with_context(|| format!("pass {pass}"))?;
        }
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let cpu = CpuCounters::read(args)?.since(&cpu);
    let out = replayer.out;
    // An operation is one replayed request: a pass is too coarse a unit
    // for ops/s and CPU per op (a few passes a second).
    let mut line = crate::vhost::result_line(args, out.requests, secs, &out.latency);
    line["trace"] = json!(path.file_name().map(|n| n.to_string_lossy().into_owned()));
    line["passes"] = json!(passes);
    line["passes_s"] = json!((passes as f64 / secs * 1000.0).round() / 1000.0);
    line["ops"] = json!(out.requests);
    line["fuse_requests"] = json!(out.requests);
    line["requests_per_pass"] = json!(out.requests / passes);
    line["divergent"] = json!(out.divergent.values().sum::<u64>());
    line["divergent_by_outcome"] = json!(out.divergent);
    cpu.charge(&mut line, out.requests, secs);
    crate::vhost::print_line(args, &line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vhost_meta::direntplus;

    /// Ids learnt from replies are what later requests are rewritten with,
    /// and a READDIRPLUS maps its entries by name (the two daemons may list
    /// them in other orders) and its end offset for the next read.
    #[test]
    fn replies_teach_ids_that_rewrite_later_requests() {
        let mut ids = Ids::new();
        let entry = |n: u64| [n.to_le_bytes().to_vec(), vec![0; ENTRY_OUT_BYTES - 8]].concat();
        learn(Opcode::Lookup, b"d\0", &entry(50), &entry(7000), &mut ids).unwrap();
        let create = |n: u64, fh: u64| [entry(n), fh.to_le_bytes().to_vec(), vec![0; 8]].concat();
        learn(Opcode::Create, b"", &create(51, 3), &create(7001, 90), &mut ids).unwrap();
        assert_eq!((ids.node(50).unwrap(), ids.node(51).unwrap(), ids.handle(3).unwrap()), (7000, 7001, 90));
        assert!(ids.node(52).is_err(), "a node never introduced is an error, not a guess");

        let mut write = vec![0u8; 40];
        write[..8].copy_from_slice(&3u64.to_le_bytes());
        assert_eq!(u64_at(&rewrite(Opcode::Write, &write, &ids, false).unwrap(), 0), Some(90));
        let mut rename = 50u64.to_le_bytes().to_vec();
        rename.extend(b"a\0b\0");
        assert_eq!(u64_at(&rewrite(Opcode::Rename, &rename, &ids, false).unwrap(), 0), Some(7000));

        let recorded = [direntplus(60, 3, b"x"), direntplus(61, 4, b"y")].concat();
        let got = [direntplus(8001, 100, b"y"), direntplus(8000, 200, b"x")].concat();
        let mut read = vec![0u8; 40];
        read[..8].copy_from_slice(&3u64.to_le_bytes());
        learn(Opcode::Readdirplus, &read, &recorded, &got, &mut ids).unwrap();
        assert_eq!((ids.node(60).unwrap(), ids.node(61).unwrap()), (8000, 8001));
        read[8..16].copy_from_slice(&4u64.to_le_bytes());
        assert_eq!(u64_at(&rewrite(Opcode::Readdirplus, &read, &ids, false).unwrap(), 8), Some(200));
        assert!(rewrite(Opcode::Ioctl, &write, &ids, false).is_err(), "unreplayable opcodes are refused");
    }
}
