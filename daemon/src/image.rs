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
use keelfs_vhost::{ImageAccess, LocalFuture};

use crate::config::Export;
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
}

impl ExportImage {
    /// `lock` is the image's lock file, held (`locked`) or not yet.
    pub fn new(
        export: Export,
        dev: Arc<dyn BlockDevice>,
        reactor_id: usize,
        commit_interval: Duration,
        lock: Option<ImageLock>,
        locked: bool,
    ) -> Self {
        Self { export, dev, reactor_id, commit_interval, lock, locked: Cell::new(locked) }
    }

    async fn take_lock(&self) -> Result<(), String> {
        let Some(lock) = &self.lock else { return Ok(()) };
        if self.locked.get() {
            return Ok(());
        }
        let deadline = Instant::now() + LOCK_WAIT;
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

    fn let_go(&self) {
        if let Some(lock) = &self.lock {
            if self.locked.replace(false) {
                if let Err(e) = lock.unlock() {
                    tracing::warn!("unlocking {}: {e}", self.export.device.display());
                }
            }
        }
    }
}

impl ImageAccess for ExportImage {
    fn attach(&self) -> LocalFuture<'_, Result<Fs, String>> {
        Box::pin(async move {
            self.take_lock().await?;
            let mounted =
                crate::serve::mount(self.reactor_id, &self.export, &self.dev, self.commit_interval, true).await;
            mounted.map_err(|e| {
                self.let_go();
                format!("{e:#}")
            })
        })
    }

    fn detach(&self, fs: Fs) -> LocalFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let unmounted = fs.unmount().await.map_err(|e| format!("committing and checkpointing: {e}"));
            self.let_go();
            unmounted
        })
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
