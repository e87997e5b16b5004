//! `keelfs-bench hostile`: a misbehaving vhost-user-fs client, for showing
//! that one export's guest cannot starve another's (issue 16). It keeps
//! `--depth` requests in flight, each well-formed but absurd: ranges of
//! 2^52 bytes to zero or punch, reads of 4 GiB far past the end, unknown
//! opcodes, readdir with a 4 GiB buffer, xattrs of the largest size and
//! long names. Each must get a quick answer (an error, mostly); the run
//! reports how many did. Heavy but legitimate work (metadata churn, large
//! writes) is not misbehaviour: sharing a reactor fairly under it is QoS.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use keelfs_vhost::abi::{encode_request, init_flags as f, Opcode, Reply, OUT_HEADER_BYTES};
use keelfs_vhost::frontend::io_request;
use serde_json::json;

#[derive(Args, Debug)]
pub struct HostileArgs {
    /// The vhost-user-fs socket of the export to misbehave on.
    #[arg(long)]
    socket: PathBuf,
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Requests in flight.
    #[arg(long, default_value_t = 32)]
    depth: u16,
    #[arg(long)]
    json: bool,
}

/// fallocate(2) modes.
const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
const FALLOC_FL_ZERO_RANGE: u32 = 0x10;
/// The largest file size the format allows: what a guest may name.
const HUGE: u64 = 1 << 52;
/// Each reply's room: small, whatever the request asks for.
const REPLY_CAPACITY: u32 = 4096;
/// The client's nap between rounds of requests.
const ROUND_PAUSE: Duration = Duration::from_micros(100);
/// How long one request may take before the run fails: a stall.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// A FUSE name: the bytes, then a NUL.
pub(crate) fn named(name: &[u8]) -> Vec<u8> {
    let mut v = name.to_vec();
    v.push(0);
    v
}

/// The `i`-th hostile request, encoded with `unique`.
fn hostile_request(i: u64, unique: u64, nodeid: u64, fh: u64) -> Vec<u8> {
    let mut b = Reply::default();
    let (opcode, node) = match i % 7 {
        0 => {
            b.u64(fh).u64(0).u64(HUGE).u32(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE).u32(0);
            (Opcode::Fallocate as u32, nodeid)
        }
        1 => {
            b.u64(fh).u64(0).u64(HUGE).u32(FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE).u32(0);
            (Opcode::Fallocate as u32, nodeid)
        }
        2 => return io_request(Opcode::Read, unique, nodeid, fh, HUGE - 4096, u32::MAX),
        3 => (1000 + (i % 4000) as u32, nodeid),
        4 => {
            b.u64(0).u64(0).u32(u32::MAX).u32(0).u64(0).u32(0).u32(0);
            (Opcode::Readdir as u32, 1)
        }
        5 => {
            b.u32(u32::MAX).u32(0).raw(&named(b"user.absent"));
            (Opcode::Getxattr as u32, nodeid)
        }
        _ => {
            b.raw(&named(&[b'x'; 4000]));
            (Opcode::Lookup as u32, 1)
        }
    };
    encode_request(opcode, unique, node, 0, 0, &b.bytes)
}

pub fn run(args: &HostileArgs) -> anyhow::Result<()> {
    let mut fe = crate::vhost::connect(&args.socket, 1, args.depth, 16 << 10)?;
    fe.init(f::ASYNC_READ | f::BIG_WRITES | f::MAX_PAGES | f::INIT_EXT)?;
    let mut q = fe.take_queue(1);
    let (nodeid, fh) = crate::vhost::create(&mut q, "hostile-target", 0)?;
    let mut errors: BTreeMap<i32, u64> = BTreeMap::new();
    let (mut sent, mut answered, mut in_flight) = (0u64, 0u64, 0u16);
    let started = Instant::now();
    let mut last_reply = Instant::now();
    while started.elapsed() < Duration::from_secs(args.seconds) || in_flight > 0 {
        while in_flight < args.depth && started.elapsed() < Duration::from_secs(args.seconds) {
            let unique = q.next_unique();
            q.submit(&hostile_request(sent, unique, nodeid, fh), REPLY_CAPACITY)?;
            sent += 1;
            in_flight += 1;
        }
        // A guest's CPU is its own, not the daemon's: on a small machine a
        // client spinning for replies would take CPU from the daemon and
        // measure that, not the daemon. So the client naps between rounds
        // (its requests stay queued meanwhile, 32 deep by default).
        std::thread::sleep(ROUND_PAUSE);
        for used in q.wait(REPLY_TIMEOUT).context("a hostile request got no reply (a stall)")? {
            let reply = q.reply(used)?;
            let errno = if reply.len() >= OUT_HEADER_BYTES { -i32::from_le_bytes(reply[4..8].try_into()?) } else { -1 };
            *errors.entry(errno).or_default() += 1;
            answered += 1;
            in_flight -= 1;
            last_reply = Instant::now();
        }
        if last_reply.elapsed() > REPLY_TIMEOUT {
            bail!("no reply for {REPLY_TIMEOUT:?}: the export stalled");
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let line = json!({
        "bench": "hostile",
        "seconds": args.seconds,
        "depth": args.depth,
        "requests": sent,
        "answered": answered,
        "requests_per_s": (answered as f64 / secs).round(),
        "replies_by_errno": errors.iter().map(|(e, n)| (e.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
    });
    println!("{}", if args.json { line.to_string() } else { serde_json::to_string_pretty(&line)? });
    Ok(())
}
