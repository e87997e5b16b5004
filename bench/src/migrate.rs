//! `keelfs-bench migrate`: what moving a guest's session costs. A
//! frontend looks up `--inodes` files and opens `--handles` of them on the
//! source daemon, then does what QEMU does at a migration's switch-over:
//! stops the rings and saves the back-end's state (SET_DEVICE_STATE_FD
//! SAVE, CHECK_DEVICE_STATE), and loads it into the destination daemon
//! before its rings exist. The two times are what the back-ends add to
//! QEMU's downtime; the state's size is what travels in the migration
//! stream. Any vhost-user-fs back-end with DEVICE_STATE can be measured:
//! keelfsd (two daemons on one image, the second `--incoming`) or
//! virtiofsd (two on one shared directory).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use keelfs_vhost::abi::{init_flags as f, Opcode, Reply};
use keelfs_vhost::frontend::{io_in, FrontendConfig, FsFrontend};
use serde_json::json;

use crate::hostile::named;
use crate::vhost::check;

#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// The source daemon's vhost-user-fs socket.
    #[arg(long)]
    source: PathBuf,
    /// The destination daemon's socket.
    #[arg(long)]
    dest: PathBuf,
    /// Files looked up (each a node id with a lookup reference).
    #[arg(long, default_value_t = 100_000)]
    inodes: u64,
    /// Of those, files held open.
    #[arg(long, default_value_t = 1_000)]
    handles: u64,
    /// How long dirty logging runs before the switch-over, as QEMU's
    /// pre-copy phase: a back-end may prepare its state meanwhile
    /// (virtiofsd collects its inodes' paths when logging starts).
    #[arg(long, default_value_t = 2000)]
    precopy_ms: u64,
    /// A label for the JSON line (the system under test).
    #[arg(long, default_value = "")]
    label: String,
    #[arg(long)]
    json: bool,
}

/// What the source's guest holds: node ids, and open (node id, handle).
struct Held {
    nodes: Vec<u64>,
    open: Vec<(u64, u64)>,
}

/// A directory of `inodes` files, each looked up once (MKNOD answers with
/// an entry), and `handles` of them open.
fn hold_session(fe: &mut FsFrontend, inodes: u64, handles: u64) -> anyhow::Result<Held> {
    fe.init(f::ASYNC_READ | f::MAX_PAGES | f::INIT_EXT | f::DO_READDIRPLUS)?;
    let mut mkdir = Reply::default();
    mkdir.u32(0o755).u32(0).raw(&named(format!("session-{}", std::process::id()).as_bytes()));
    let (err, reply) = fe.fuse(1, Opcode::Mkdir, 1, &mkdir.bytes)?;
    check(err, "mkdir")?;
    let dir = u64::from_le_bytes(reply[..8].try_into()?);
    let mut nodes = Vec::with_capacity(inodes as usize);
    for i in 0..inodes {
        let mut body = Reply::default();
        body.u32(0o100644).u32(0).u32(0).u32(0).raw(&named(format!("f{i}").as_bytes()));
        let (err, reply) = fe.fuse(1, Opcode::Mknod, dir, &body.bytes)?;
        check(err, "mknod")?;
        nodes.push(u64::from_le_bytes(reply[..8].try_into()?));
    }
    let mut open = Vec::with_capacity(handles as usize);
    for &node in nodes.iter().take(handles as usize) {
        let mut body = Reply::default();
        body.u32(libc::O_RDWR as u32).u32(0);
        let (err, reply) = fe.fuse(1, Opcode::Open, node, &body.bytes)?;
        check(err, "open")?;
        open.push((node, u64::from_le_bytes(reply[..8].try_into()?)));
    }
    Ok(Held { nodes, open })
}

pub fn run(args: &MigrateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.handles <= args.inodes, "--handles must not exceed --inodes");
    let config = FrontendConfig::default();
    let mut fe = FsFrontend::connect(&args.source, config.clone()).context("connecting to the source")?;
    let Held { nodes, open } = hold_session(&mut fe, args.inodes, args.handles)?;
    // Migration starts: LOG_ALL, then pre-copy while the guest runs.
    let _log = fe.start_dirty_log().context("starting the dirty log")?;
    std::thread::sleep(std::time::Duration::from_millis(args.precopy_ms));

    let started = Instant::now();
    let state = fe.save_state().context("saving the source's state")?;
    let save = started.elapsed();
    let started = Instant::now();
    let mut dest = FsFrontend::connect_with_state(&args.dest, config, &state).context("loading the state")?;
    let load = started.elapsed();
    drop(fe);

    // The session works on the destination: the last node id, and a write
    // and a read through a handle opened on the source.
    let last = *nodes.last().context("at least one inode")?;
    check(dest.fuse(1, Opcode::Getattr, last, &[0u8; 16])?.0, "getattr on the destination")?;
    if let Some(&(node, fh)) = open.last() {
        let mut write = Reply::default();
        write.raw(&io_in(fh, 0, 5)).raw(b"moved");
        check(dest.fuse(1, Opcode::Write, node, &write.bytes)?.0, "write through a moved handle")?;
        let mut read = Reply::default();
        read.raw(&io_in(fh, 0, 5));
        let (err, data) = dest.fuse(1, Opcode::Read, node, &read.bytes)?;
        check(err, "read through a moved handle")?;
        anyhow::ensure!(data == b"moved", "a moved handle read back {data:?}");
    }
    let ms = |d: std::time::Duration| (d.as_secs_f64() * 1e5).round() / 100.0;
    let line = json!({
        "bench": "migrate", "label": args.label, "lookups": nodes.len(), "handles": open.len(),
        "state_bytes": state.len(), "save_ms": ms(save), "load_ms": ms(load),
        "downtime_added_ms": ms(save + load),
    });
    if args.json {
        println!("{line}");
    } else {
        println!("{}", serde_json::to_string_pretty(&line)?);
    }
    Ok(())
}
