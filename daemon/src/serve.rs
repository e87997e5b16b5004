//! `keelfsd serve`: mount the filesystem on a reactor and serve it.
//!
//! Guests attach over a vhost-user-fs socket; the host can mount the same
//! filesystem through /dev/fuse (`--fuse-mount DIR`). Both go through the
//! one FUSE dispatcher, on the reactor that owns the filesystem.

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
use keelfs_vhost::vhost_user::VhostUserServer;

use crate::signals::{block_termination_signals, Shutdown};
use crate::{device, tools};

pub const DEFAULT_DIR: &str = "keelfs-data";

pub struct ServeArgs {
    pub device: Option<PathBuf>,
    pub fuse_mount: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub tag: String,
    pub queues: usize,
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
    let path = match args.device {
        Some(p) => p,
        None => default_device()?,
    };
    // A host mount alone needs no socket; otherwise guests get one.
    let socket = match (args.socket, &args.fuse_mount) {
        (Some(s), _) => Some(s),
        (None, Some(_)) => None,
        (None, None) => {
            std::fs::create_dir_all(DEFAULT_DIR).with_context(|| format!("creating {DEFAULT_DIR}"))?;
            Some(Path::new(DEFAULT_DIR).join("keelfs.sock"))
        }
    };
    if let Some(dir) = socket.as_ref().and_then(|s| s.parent()).filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            bail!(tools::UsageError(format!("socket directory {} does not exist", dir.display())));
        }
    }
    let (tag, queues) = (args.tag, args.queues);
    let session_config = CacheMode::from(args.cache).session_config();
    let dev = device::open(&path)?;
    let mut reactor = Reactor::new(ReactorConfig { mode: PollMode::ADAPTIVE_DEFAULT, ..ReactorConfig::default() })?;
    let queue = dev.open_queue(QueueConfig { depth: 256, completion_eventfd: true })?;
    let result = reactor.block_on(async move {
        let shutdown = Shutdown::install().context("installing the signal handler")?;
        let fs = Fs::mount(DeviceChannel::attach(queue), FsConfig::default())
            .await
            .with_context(|| format!("mounting keelfs on {}", path.display()))?;
        let server = match &socket {
            Some(socket) => {
                let server = VhostUserServer::start(fs.clone(), session_config.clone(), socket, queues)
                    .context("starting the vhost-user-fs device")?;
                eprintln!("keelfsd: serving {} to guests on {}", path.display(), socket.display());
                eprintln!("{}", qemu_arguments(socket, &tag, queues));
                Some(server)
            }
            None => None,
        };
        let mount = match &args.fuse_mount {
            Some(mountpoint) => {
                let mount = FuseMount::mount(mountpoint, "keelfs")
                    .with_context(|| format!("mounting {} through /dev/fuse", mountpoint.display()))?;
                serve_fuse(Rc::new(Session::new(fs.clone(), session_config.clone())), mount.clone());
                eprintln!("keelfsd: serving {} at {}", path.display(), mountpoint.display());
                Some(mount)
            }
            None => None,
        };
        shutdown.wait().await;
        if let Some(server) = server {
            server.stop().await;
        }
        if let Some(mount) = mount {
            mount.unmount().context("unmounting")?;
        }
        fs.unmount().await.context("committing and checkpointing")?;
        eprintln!("keelfsd: clean shutdown");
        anyhow::Ok(())
    });
    result?;
    Ok(ExitCode::SUCCESS)
}

/// What to add to a QEMU command line to attach a guest to `socket`.
fn qemu_arguments(socket: &Path, tag: &str, queues: usize) -> String {
    let socket = std::fs::canonicalize(socket).unwrap_or_else(|_| socket.to_owned());
    format!(
        "keelfsd: attach a VM with these QEMU arguments (guest memory must be shared; size= is the VM's -m):\n  \
         -object memory-backend-memfd,id=mem,size=4G,share=on -numa node,memdev=mem \\\n  \
         -chardev socket,id=keelfs0,path={} \\\n  \
         -device vhost-user-fs-pci,chardev=keelfs0,tag={tag},queue-size=1024,num-request-queues={queues}\n\
         keelfsd: then in the guest: mount -t virtiofs {tag} /mnt",
        socket.display()
    )
}
