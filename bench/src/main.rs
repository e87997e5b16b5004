//! keelfs-bench: keelfs's benchmarks, each run side by side with a peer in
//! the same invocation so that results are ratios, not lone figures.

mod bdev;
mod bdev_check;
mod core;
mod core_io;
mod core_meta;
mod crc;
mod fio;
mod hist;
mod hostile;
mod migrate;
mod posix_meta;
mod procstat;
mod qemu_img;
mod vhost;
mod vhost_meta;
mod vhost_trace;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "keelfs-bench", version, about = "keelfs benchmarks, run side by side with peers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Drive a block-device backend from one thread (optionally against fio's io_uring engine or qemu-img's rbd driver).
    Bdev(bdev::BdevArgs),
    /// Check a block-device backend's correctness (the NVMe driver, or io_uring on a file).
    BdevCheck(bdev_check::BdevCheckArgs),
    /// Drive keelfs-fs in process on one reactor.
    Core(core::CoreArgs),
    /// Drive any vhost-user-fs daemon (keelfsd, virtiofsd) over its socket.
    Vhost(vhost::VhostArgs),
    /// The metadata workloads through system calls on a mounted filesystem (keelfs's host mount, ext4, xfs).
    PosixMeta(posix_meta::PosixMetaArgs),
    /// Misbehave on a vhost-user-fs socket: absurd but well-formed requests, many in flight.
    Hostile(hostile::HostileArgs),
    /// Move a session with many lookups and handles between two daemons, as QEMU's migration does.
    Migrate(migrate::MigrateArgs),
    /// What a crc32c of a 4 KiB block costs one core, against a copy of it and a table crc32c.
    Crc(crc::CrcArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bdev(args) => bdev::run(&args),
        Command::BdevCheck(args) => bdev_check::run(&args),
        Command::Core(args) => core::run(&args),
        Command::Vhost(args) => vhost::run(&args),
        Command::Hostile(args) => hostile::run(&args),
        Command::PosixMeta(args) => posix_meta::run(&args),
        Command::Migrate(args) => migrate::run(&args),
        Command::Crc(args) => crc::run(&args),
    };
    // An expected error (a bad argument, a full device, a daemon that is
    // not there) is one line with its causes, never a backtrace, whatever
    // RUST_BACKTRACE says.
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keelfs-bench: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
