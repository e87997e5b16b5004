//! An export's image as something its vhost-user server can give up and
//! take back: how a guest's session moves between two keelfsd processes
//! on one host (live migration, or an upgrade by local migration). The
//! source gives the image up at switch-over (commit, checkpoint, unlock);
//! the destination, started with `--incoming`, takes it (waiting for the
//! lock) when the session arrives.

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keelfs_bdev::BlockDevice;
use keelfs_fs::Fs;
use keelfs_reactor as reactor;
use keelfs_vhost::{ImageAccess, LocalFuture, TransferError};

use crate::config::Export;
use crate::control::ExportTable;
use crate::lock::ImageLock;

/// How long taking the image waits for the previous server to let go of
/// its lock. The source unlocks before it sends the state, so the wait is
/// normally nil; a source that still holds it after this is not leaving.
const LOCK_WAIT: Duration = Duration::from_secs(30);
/// How often the lock is tried meanwhile.
const LOCK_RETRY: Duration = Duration::from_millis(20);

/// Whether an export's session can move: served over vhost-user only (a
/// host mount's session cannot follow the guest) and writable (the
/// handover commits and checkpoints).
pub fn migratable(export: &Export) -> bool {
    export.socket.is_some() && export.fuse_mount.is_none() && !export.read_only
}

/// The image of one export, on the reactor that serves it.
pub struct ExportImage {
    export: Export,
    dev: Arc<dyn BlockDevice>,
    reactor_id: usize,
    commit_interval: Duration,
    /// None for NVMe, which VFIO gives to one process at a time anyway.
    lock: Option<ImageLock>,
    locked: Cell<bool>,
    /// Where the daemon lists its exports: whether the image may go, and
    /// whether it is here.
    table: Arc<ExportTable>,
}

impl ExportImage {
    /// `lock` is the image's lock file, held (`locked`) or not yet.
    pub fn new(
        export: Export,
        dev: Arc<dyn BlockDevice>,
        reactor_id: usize,
        commit_interval: Duration,
        (lock, locked): (Option<ImageLock>, bool),
        table: &Arc<ExportTable>,
    ) -> Self {
        let table = Arc::clone(table);
        Self { export, dev, reactor_id, commit_interval, lock, locked: Cell::new(locked), table }
    }

    async fn take_lock(&self) -> Result<(), String> {
        let Some(lock) = &self.lock else { return Ok(()) };
        if self.locked.get() {
            return Ok(());
        }
        let deadline = Instant::now() + LOCK_WAIT;
        if let ImageLock::Rbd(dev) = lock {
            let dev = Arc::clone(dev);
            off_reactor(move || take_rbd_lock_by(&dev, deadline)).await?;
            self.locked.set(true);
            return Ok(());
        }
        if let ImageLock::RbdReader(dev, held) = lock {
            // A reader's shared lock is refused while a writer holds the
            // image: no waiting for one.
            let dev = Arc::clone(dev);
            let taken = off_reactor(move || dev.take_reader_lock().map_err(|e| e.to_string())).await?;
            *held.lock().unwrap_or_else(|e| e.into_inner()) = Some(taken);
            self.locked.set(true);
            return Ok(());
        }
        loop {
            match lock.try_lock() {
                Ok(true) => {
                    self.locked.set(true);
                    return Ok(());
                }
                Ok(false) if Instant::now() < deadline => reactor::sleep(LOCK_RETRY).await,
                Ok(false) => {
                    return Err(format!(
                        "{} is still locked by another server after {} s",
                        self.export.device.display(),
                        LOCK_WAIT.as_secs()
                    ))
                }
                Err(e) => return Err(format!("locking {}: {e}", self.export.device.display())),
            }
        }
    }

    async fn let_go(&self) {
        let Some(lock) = &self.lock else { return };
        if !self.locked.replace(false) {
            return;
        }
        let unlocked = match lock {
            ImageLock::Rbd(dev) => {
                let dev = Arc::clone(dev);
                off_reactor(move || dev.release_lock().map_err(|e| e.to_string())).await
            }
            ImageLock::RbdReader(_, held) => {
                let taken = held.lock().unwrap_or_else(|e| e.into_inner()).take();
                off_reactor(move || {
                    drop(taken);
                    Ok(())
                })
                .await
            }
            ImageLock::File(_) => lock.unlock().map_err(|e| e.to_string()),
        };
        if let Err(e) = unlocked {
            tracing::warn!("unlocking {}: {e}", self.export.device.display());
        }
    }
}

/// Run `job` on a thread of its own and wait for it without blocking the
/// reactor: an RBD lock call waits on the cluster, for seconds when the
/// holder is dead but its watch lingers, and the reactor serves other
/// exports meanwhile.
async fn off_reactor<T: Send + 'static>(job: impl FnOnce() -> Result<T, String> + Send + 'static) -> Result<T, String> {
    const POLL: Duration = Duration::from_millis(2);
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new().name("keelfs-lock".into()).spawn(move || {
        let _ = tx.send(job());
    });
    spawned.map_err(|e| format!("starting a thread for the image's lock: {e}"))?;
    loop {
        match rx.try_recv() {
            Ok(result) => return result,
            Err(std::sync::mpsc::TryRecvError::Empty) => reactor::sleep(POLL).await,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return Err("the image's lock thread died".into()),
        }
    }
}

/// Take an RBD image's lock, trying every [`LOCK_RETRY`] while another
/// client holds it, until `deadline`. A lock taken only after the deadline
/// (one call can outlast it) is let go again: the caller has given up.
fn take_rbd_lock_by(dev: &keelfs_bdev::RbdDevice, deadline: Instant) -> Result<(), String> {
    let name = keelfs_bdev::BlockDevice::name(dev).to_string();
    loop {
        match dev.try_take_lock() {
            Ok(true) if Instant::now() <= deadline => return Ok(()),
            Ok(true) => {
                let _ = dev.release_lock();
                return Err(format!("{name}: took the lock only after {} s; let it go", LOCK_WAIT.as_secs()));
            }
            Ok(false) if Instant::now() < deadline => std::thread::sleep(LOCK_RETRY),
            Ok(false) => {
                let holders = dev.holders().unwrap_or_else(|e| e.to_string());
                return Err(format!("{name} is still locked by {holders} after {} s", LOCK_WAIT.as_secs()));
            }
            Err(e) => return Err(format!("locking {name}: {e}")),
        }
    }
}

impl ImageAccess for ExportImage {
    fn attach(&self) -> LocalFuture<'_, Result<Fs, TransferError>> {
        Box::pin(async move {
            self.take_lock().await.map_err(TransferError::Image)?;
            let mounted =
                crate::serve::mount(self.reactor_id, &self.export, &self.dev, self.commit_interval, true).await;
            match mounted {
                Ok(fs) => {
                    self.table.set_image_away(&self.export.tag, false);
                    Ok(fs)
                }
                Err(e) => {
                    self.let_go().await;
                    Err(TransferError::Image(format!("{e:#}")))
                }
            }
        })
    }

    fn detach(&self, fs: Fs) -> LocalFuture<'_, Result<(), TransferError>> {
        Box::pin(async move {
            let unmounted =
                fs.unmount().await.map_err(|e| TransferError::Image(format!("committing and checkpointing: {e}")));
            self.let_go().await;
            unmounted
        })
    }

    fn may_give_up(&self) -> Result<(), TransferError> {
        self.table.give_up_image(&self.export.tag).map_err(TransferError::Image)
    }
}

/// Where a clean shutdown keeps an export's session for the next start: a
/// daemon restarted under a frontend that reconnects (QEMU's
/// vhost-user-fs does not yet) finds the guest's node ids and handles
/// valid. It is read once and emptied at start, so that a later crash
/// never restores a session older than the image; a session that no
/// longer fits the image is refused when restored.
pub struct SessionFile {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl SessionFile {
    /// The file an export keeps its session in, if any.
    pub fn path_of(export: &Export) -> Option<std::path::PathBuf> {
        if !migratable(export) {
            return None;
        }
        match &export.session_file {
            Some(path) if path.as_os_str().is_empty() => None,
            Some(path) => Some(path.clone()),
            None => {
                let is_file = std::fs::metadata(&export.device).is_ok_and(|m| m.is_file());
                is_file.then(|| {
                    let mut path = export.device.clone().into_os_string();
                    path.push(".session");
                    path.into()
                })
            }
        }
    }

    /// Open (creating) the file and take what it holds, leaving it empty.
    pub fn open(path: &std::path::Path) -> anyhow::Result<(Self, Option<keelfs_vhost::SessionState>)> {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(|e| anyhow::anyhow!("opening the session file {}: {e}", path.display()))?;
        let mut bytes = Vec::new();
        (&file).take(keelfs_vhost::STATE_BYTES_MAX as u64 + 1).read_to_end(&mut bytes)?;
        if !bytes.is_empty() {
            file.set_len(0)?;
            file.sync_all()?;
        }
        let state = match bytes.len() {
            0 => None,
            _ => match keelfs_vhost::SessionState::decode(&bytes) {
                Ok(state) => Some(state),
                Err(e) => {
                    tracing::warn!("{}: not restored: {e}", path.display());
                    None
                }
            },
        };
        Ok((Self { file, path: path.to_owned() }, state))
    }

    /// Keep `state` for the next start, durably.
    pub fn write(&self, state: &keelfs_vhost::SessionState) -> anyhow::Result<()> {
        use std::os::unix::fs::FileExt;
        let bytes = state.encode();
        let written = self.file.set_len(0).and_then(|()| self.file.write_all_at(&bytes, 0));
        written.and_then(|()| self.file.sync_all()).map_err(|e| anyhow::anyhow!("{}: {e}", self.path.display()))?;
        tracing::info!(
            lookups = state.lookups.len(),
            handles = state.handles.len(),
            "session kept in {} for the next start",
            self.path.display()
        );
        Ok(())
    }
}
