//! `keelfsd serve`: mount the filesystem on a reactor and serve it.
//!
//! Built so far: the host mount through /dev/fuse (`--fuse-mount DIR`).
//! The vhost-user-fs socket for guests is issue 5's next step; until it
//! exists `serve` says so instead of pretending.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{bail, Context};
use keelfs_core::bdev::QueueConfig;
use keelfs_core::fs::{Fs, FsConfig};
use keelfs_core::reactor::io::DeviceChannel;
use keelfs_core::reactor::{PollMode, Reactor, ReactorConfig};
use keelfs_vhost::fuse::dev_fuse::{serve as serve_fuse, FuseMount};
use keelfs_vhost::fuse::dispatch::{CacheMode, Session};

use crate::signals::{block_termination_signals, Shutdown};
use crate::{device, tools};

pub const DEFAULT_DIR: &str = "keelfs-data";

pub struct ServeArgs {
    pub device: Option<PathBuf>,
    pub fuse_mount: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub cache: Cache,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Cache {
    None,
    Auto,
    Always,
}

impl From<Cache> for CacheMode {
    fn from(c: Cache) -> Self {
        match c {
            Cache::None => CacheMode::None,
            Cache::Auto => CacheMode::Auto,
            Cache::Always => CacheMode::Always,
        }
    }
}

/// The embedded default image, created and formatted on first use.
fn default_device() -> anyhow::Result<PathBuf> {
    let dir = Path::new(DEFAULT_DIR);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let image = dir.join("keelfs.img");
    if !image.exists() {
        tools::mkfs(&image, Some(tools::DEFAULT_IMAGE_BYTES), false, None, 1)?;
    }
    Ok(image)
}

pub fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    block_termination_signals().context("blocking SIGTERM/SIGINT")?;
    if args.socket.is_some() || args.fuse_mount.is_none() {
        bail!(tools::UsageError(
            "the vhost-user-fs socket is not built yet (issue 5); serve the filesystem on the host with --fuse-mount DIR"
                .into()
        ));
    }
    let path = match args.device {
        Some(p) => p,
        None => default_device()?,
    };
    let mountpoint = args.fuse_mount.expect("checked above");
    let session_config = CacheMode::from(args.cache).session_config();
    let dev = device::open(&path)?;
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::ADAPTIVE_DEFAULT, ..ReactorConfig::default() })?;
    let queue = dev.open_queue(QueueConfig { depth: 256, completion_eventfd: true })?;
    let result = reactor.block_on(async move {
        let shutdown = Shutdown::install().context("installing the signal handler")?;
        let fs = Fs::mount(DeviceChannel::attach(queue), FsConfig::default())
            .await
            .with_context(|| format!("mounting keelfs on {}", path.display()))?;
        let session = Rc::new(Session::new(fs.clone(), session_config));
        let mount = FuseMount::mount(&mountpoint, "keelfs")
            .with_context(|| format!("mounting {} through /dev/fuse", mountpoint.display()))?;
        serve_fuse(session, mount.clone());
        eprintln!("keelfsd: serving {} at {}", path.display(), mountpoint.display());
        shutdown.wait().await;
        mount.unmount().context("unmounting")?;
        fs.unmount().await.context("committing and checkpointing")?;
        eprintln!("keelfsd: clean shutdown");
        anyhow::Ok(())
    });
    result?;
    Ok(ExitCode::SUCCESS)
}
