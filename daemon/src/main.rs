//! keelfsd: the keelfs daemon and its tools.
//!
//! Exit codes: 0 success (fsck: clean); 1 failure (fsck: damage found,
//! listed); 2 usage error, including a device that cannot be opened.

mod device;
mod serve;
mod signals;
mod tools;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use keelfs_core::units::parse_size;

#[derive(Parser)]
#[command(name = "keelfsd", version, about = "keelfs: a userspace filesystem daemon serving VMs over vhost-user-fs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

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
    },
    /// Serve a keelfs filesystem to QEMU guests over vhost-user-fs, and/or
    /// on the host through /dev/fuse. With no flags: the embedded default
    /// image and socket under ./keelfs-data/.
    Serve {
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
        /// The tag guests mount (`mount -t virtiofs TAG /mnt`); QEMU's
        /// vhost-user-fs-pci device carries it, so it only shapes the
        /// printed QEMU arguments.
        #[arg(long, default_value = "keelfs")]
        tag: String,
        /// virtio-fs request queues (QEMU's num-request-queues).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=63))]
        queues: u16,
        /// What clients may cache: none, auto or always (as virtiofsd).
        #[arg(long, value_enum, default_value = "auto")]
        cache: serve::Cache,
    },
    /// Check a keelfs filesystem; exit 0 when clean, 1 when damaged.
    Fsck {
        path: PathBuf,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
        /// Fix the simple cases (link counts, dangling entries, a damaged
        /// superblock copy, free-space counts). Without it nothing is written.
        #[arg(long)]
        repair: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Mkfs { path, size, force, journal_size, allocation_groups } => {
            tools::mkfs(&path, size, force, journal_size, allocation_groups)
        }
        Command::Fsck { path, json, repair } => tools::fsck(&path, json, repair),
        Command::Serve { device, fuse_mount, socket, tag, queues, cache } => {
            serve::serve(serve::ServeArgs { device, fuse_mount, socket, tag, queues: usize::from(queues), cache })
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("keelfsd: {e:#}");
            ExitCode::from(e.downcast_ref::<tools::UsageError>().map_or(1, |_| 2))
        }
    }
}
