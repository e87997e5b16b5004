//! keelfsd: the keelfs daemon and its tools. The binary (src/main.rs)
//! only calls [`run`]; the daemon is a library so that its tests can build
//! it with the `test-utils` feature (their hooks), which the release binary
//! never has.
//!
//! Exit codes: 0 success (fsck: clean); 1 failure (fsck: damage found,
//! listed); 2 usage error, including a device that cannot be opened.

mod accept;
mod broker;
mod config;
mod control;
mod device;
mod host_writeback;
mod image;
mod lock;
mod logs;
mod metrics;
mod mount_helper;
mod mountinfo;
mod rpc;
mod sandbox;
mod scrub;
mod seccomp;
mod serve;
mod settings;
mod signals;
mod snapshots;
mod supervisor;
mod tools;
mod top;

/// The tests' hooks ([`test_hooks`]), or none: the release binary reads
/// no test hook from its environment.
#[cfg(feature = "test-utils")]
mod test_hooks;
#[cfg(feature = "test-utils")]
use test_hooks as hooks;
#[cfg(not(feature = "test-utils"))]
mod hooks {
    /// A forbidden system call kills the daemon.
    pub fn seccomp_action() -> crate::seccomp::Action {
        crate::seccomp::Action::Kill
    }

    /// Nothing to do once ready.
    pub fn after_ready() {}

    /// Nothing to wait for as the shutdown begins.
    pub fn as_shutdown_begins() {}

    /// The kernel's switch for FUSE over io_uring.
    pub fn fuse_uring_parameter() -> std::path::PathBuf {
        keelfs_vhost::FUSE_URING_PARAMETER.into()
    }
}

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use keelfs_base::parse_size;

#[derive(Parser)]
#[command(name = "keelfsd", version, about = "keelfs: a userspace filesystem daemon serving VMs over vhost-user-fs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once, at start: the size of its largest variant (serve's flags)
// costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Create a keelfs filesystem on a file or block device. A missing file
    /// is created sparse.
    Mkfs {
        /// File or block device to format.
        path: PathBuf,
        /// Size of a file to create (or grow to), e.g. 8G. Default for a new
        /// file: 8G.
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Overwrite an existing keelfs filesystem.
        #[arg(long)]
        force: bool,
        /// Journal size, e.g. 64M (default: 1/64 of the device, 1-64 MiB).
        #[arg(long, value_parser = parse_size)]
        journal_size: Option<u64>,
        /// Allocation groups (default 1; one per reactor is the intent).
        #[arg(long, default_value_t = 1)]
        allocation_groups: u32,
        /// Keep a crc32c of every data block, checked on every read from
        /// the device (a mismatch fails the read with EIO). Overwrites then
        /// go to new blocks (docs/FORMAT.md, "Data checksums").
        #[arg(long)]
        data_checksums: bool,
    },
    /// Serve keelfs filesystems to QEMU guests over vhost-user-fs, and/or on
    /// the host through /dev/fuse. With no config and no flags: the embedded
    /// default image and socket under ./keelfs-data/. Flags override the
    /// config file; those that describe an export apply to its first one.
    /// SIGTERM or SIGINT drains requests, commits, flushes and exits 0; a
    /// second signal, a second or more after the first, exits at once with 1.
    Serve {
        /// TOML config file (see keelfsd.example.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// File or block device holding the filesystem (default:
        /// ./keelfs-data/keelfs.img, created and formatted on first run).
        #[arg(long)]
        device: Option<PathBuf>,
        /// Mount on the host at this directory through /dev/fuse.
        #[arg(long)]
        fuse_mount: Option<PathBuf>,
        /// vhost-user-fs socket for guests (default ./keelfs-data/keelfs.sock
        /// unless --fuse-mount alone is given).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The tag guests mount (`mount -t virtiofs TAG /mnt`; default
        /// keelfs). QEMU's vhost-user-fs-pci device carries it, so here it
        /// names the export and shapes the printed QEMU arguments.
        #[arg(long)]
        tag: Option<String>,
        /// virtio-fs request queues (QEMU's num-request-queues; default 1).
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=63))]
        queues: Option<u16>,
        /// Poll the request queues on every reactor, not only the export's:
        /// reads of cached pages are served there, other requests are sent
        /// to the export's reactor (needs --reactors 2 or more and --queues
        /// 2 or more).
        #[arg(long)]
        spread_queues: bool,
        /// What clients may cache: none, auto (default) or always, as
        /// virtiofsd's --cache.
        #[arg(long, value_enum)]
        cache: Option<serve::Cache>,
        /// Who holds file locks: auto (default: keelfs when a guest and a
        /// host mount share the export), export (keelfs, always) or
        /// client (each client's kernel).
        #[arg(long, value_enum)]
        locks: Option<config::Locks>,
        /// Reactor threads, one per core (default 1, or the config's).
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
        reactors: Option<u16>,
        /// Unix socket for `keelfsd stats`.
        #[arg(long)]
        rpc: Option<PathBuf>,
        /// Check the config and flags, print what would be served, and exit.
        #[arg(long)]
        check: bool,
        /// namespace (default): serve in namespaces of its own, with an
        /// empty root, no capabilities, rlimits and a seccomp allowlist,
        /// once the devices, sockets and mounts are open. none: no sandbox.
        #[arg(long, value_enum)]
        sandbox: Option<sandbox::SandboxMode>,
        /// Serve the first export read-only: its device is opened
        /// read-only, every change fails with EROFS, and a --fuse-mount
        /// mount is read-only (see read_only in the config).
        #[arg(long)]
        read_only: bool,
        /// Serve snapshot NAME of the first export's image instead of its
        /// live state, read-only (implies --read-only; see snapshot in the
        /// config, and the snapshot_* RPCs).
        #[arg(long, value_name = "NAME")]
        snapshot: Option<String>,
        /// Serve the first export without extended attributes (nor POSIX
        /// ACLs, nor security labels): clients are told ENOSYS and stop
        /// asking, as with virtiofsd's default (see xattr in the config).
        #[arg(long)]
        no_xattr: bool,
        /// Record every FUSE request of the first export's --fuse-mount,
        /// with its reply, to FILE: a trace that `keelfs-bench vhost
        /// --workload trace` replays against any vhost-user-fs daemon.
        #[arg(long, value_name = "FILE")]
        trace_requests: Option<std::path::PathBuf>,
        /// Be the destination of a live migration: serve the sockets
        /// without locking or mounting the images, and take each image
        /// (waiting for the source keelfsd to let go of it) when QEMU hands
        /// over the guest's session, or at the guest's first request.
        #[arg(long)]
        incoming: bool,
        /// The --fuse-mount mount's source, as mount(8) lists it (default
        /// keelfs; the mount helper passes the image's path).
        #[arg(long)]
        fuse_source: Option<String>,
        /// The --fuse-mount mount's type: fuse.SUBTYPE or fuse (default
        /// fuse.keelfs).
        #[arg(long)]
        fuse_type: Option<String>,
        /// mount(2) options of the --fuse-mount mount, comma-separated:
        /// dev, suid (both off by default), noexec, noatime, nodiratime,
        /// relatime, strictatime, lazytime, sync, dirsync.
        #[arg(long)]
        fuse_options: Option<String>,
        /// How the --fuse-mount mount's requests travel: auto (default:
        /// FUSE over io_uring where the kernel has it on, else /dev/fuse),
        /// uring (an error without it) or dev (/dev/fuse read/write).
        #[arg(long, value_enum)]
        fuse_transport: Option<config::FuseTransport>,
    },
    /// Print a running daemon's counters as JSON.
    Stats {
        /// The daemon's RPC socket (serve --rpc, or rpc_socket in its config).
        #[arg(long)]
        rpc: PathBuf,
        /// A table for people instead of JSON.
        #[arg(long)]
        table: bool,
    },
    /// A live view of a running daemon: reactors' busy share, and each
    /// export's IOPS, MiB/s, p99 latency and queue depth (q quits).
    Top {
        /// The daemon's RPC socket.
        #[arg(long)]
        rpc: PathBuf,
        /// Refresh interval in milliseconds.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
        interval_ms: u64,
        /// Print one frame (two samples an interval apart) and exit, as
        /// `top -b -n 1` does.
        #[arg(long)]
        once: bool,
    },
    /// Call a JSON-RPC method of a running daemon and print its result
    /// (docs/RPC.md lists them; rpc_get_methods too). Exits 1 on an error
    /// reply, printing its code and message.
    Rpc {
        /// The method, e.g. export_list.
        method: String,
        /// Its parameters as a JSON object, e.g. '{"tag":"vm1"}'.
        params: Option<String>,
        /// The daemon's RPC socket.
        #[arg(long)]
        rpc: PathBuf,
    },
    /// Check a keelfs filesystem; exit 0 when clean, 1 when damaged.
    Fsck {
        path: PathBuf,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
        /// Fix the simple cases (link counts, dangling entries, a damaged
        /// superblock copy, free-space counts, and data checksum table
        /// sectors that fail their crc, rebuilt from the data as it is now).
        /// Without it nothing is written.
        #[arg(long)]
        repair: bool,
        /// Also read every written data block, the files' and then those
        /// snapshots hold, and check it against its checksum (an image
        /// made with --data-checksums).
        #[arg(long)]
        data: bool,
    },
    /// Break the exclusive lock on an RBD image that a keelfsd which died
    /// (or lost its host) still holds, so another can serve the image.
    /// The holder is blocklisted in the cluster first, so it can write no
    /// more even if it was only cut off. librbd also does this by itself
    /// once the holder's watch on the image has expired (about 30 s).
    BreakLock {
        /// The image: rbd:POOL/IMAGE[@CLUSTER_CONF][:id=CLIENT].
        device: PathBuf,
        /// Also fence a holder that still watches the image (it may be
        /// alive): its keelfsd will fail every write after this.
        #[arg(long)]
        fence_live: bool,
    },
}

/// Journal transactions and checkpoints allocate buffers of hundreds of KiB
/// to MiBs, many times a second under load. glibc serves those from fresh
/// mmaps (or trims the heap after them), so every one cost page faults and
/// kernel page clearing (5% of the CPU of small appends). Keep them on the
/// heap and keep the heap.
fn keep_heap_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets allocator parameters; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// keelfsd's command line: parse it, run the command, give its exit code.
pub fn run() -> ExitCode {
    keep_heap_memory();
    let mut args = std::env::args_os();
    let program = args.next().map(PathBuf::from).unwrap_or_default();
    if program.file_name().is_some_and(|n| n == mount_helper::HELPER_NAME) {
        return exit_code(mount_helper::run(&args.collect::<Vec<_>>()));
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Mkfs { path, size, force, journal_size, allocation_groups, data_checksums } => {
            let options = tools::MkfsFlags { force, journal: journal_size, groups: allocation_groups, data_checksums };
            tools::mkfs(&path, size, options)
        }
        Command::Fsck { path, json, repair, data } => tools::fsck(&path, json, repair, data),
        Command::BreakLock { device, fence_live } => tools::break_lock(&device, fence_live),
        Command::Serve {
            config,
            device,
            fuse_mount,
            socket,
            tag,
            queues,
            spread_queues,
            cache,
            locks,
            reactors,
            rpc,
            check,
            sandbox,
            read_only,
            snapshot,
            no_xattr,
            trace_requests,
            incoming,
            fuse_source,
            fuse_type,
            fuse_options,
            fuse_transport,
        } => serve::serve(serve::ServeArgs {
            config,
            device,
            fuse_mount,
            socket,
            tag,
            queues: queues.map(usize::from),
            spread_queues,
            cache,
            locks,
            reactors: reactors.map(usize::from),
            rpc,
            check,
            sandbox,
            read_only,
            snapshot,
            no_xattr,
            trace_requests,
            incoming,
            fuse_source,
            fuse_type,
            fuse_options,
            fuse_transport,
        }),
        Command::Stats { rpc, table } => print_stats(&rpc, table),
        Command::Top { rpc, interval_ms, once } => top::run(&rpc, std::time::Duration::from_millis(interval_ms), once),
        Command::Rpc { method, params, rpc } => call_rpc(&rpc, &method, params.as_deref()),
    };
    exit_code(result)
}

/// `keelfsd stats`: the daemon's counters, as JSON or (`table`) a table.
fn print_stats(rpc: &std::path::Path, table: bool) -> anyhow::Result<ExitCode> {
    let stats = rpc::query(rpc)?;
    let text =
        if table { tools::stats_table(&stats) } else { serde_json::to_string_pretty(&stats).unwrap_or_default() };
    print_out(&text);
    Ok(ExitCode::SUCCESS)
}

/// Print to stdout; a closed pipe (| head) is the reader's choice, not an
/// error.
fn print_out(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{text}");
}

fn call_rpc(socket: &std::path::Path, method: &str, params: Option<&str>) -> anyhow::Result<ExitCode> {
    let params: serde_json::Value = match params {
        Some(text) => {
            serde_json::from_str(text).map_err(|e| tools::UsageError(format!("the parameters are not JSON: {e}")))?
        }
        None => serde_json::json!({}),
    };
    let reply = rpc::call_remote(socket, method, params)?;
    if let Some(error) = reply.get("error") {
        eprintln!("keelfsd rpc {method}: error {}: {}", error["code"], error["message"].as_str().unwrap_or_default());
        return Ok(ExitCode::from(1));
    }
    print_out(&serde_json::to_string_pretty(&reply["result"])?);
    Ok(ExitCode::SUCCESS)
}

fn exit_code(result: anyhow::Result<ExitCode>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("keelfsd: {e:#}");
            ExitCode::from(e.downcast_ref::<tools::UsageError>().map_or(1, |_| 2))
        }
    }
}
