//! The control plane: which exports run where, and the changes the RPC
//! makes to them at runtime (add, remove, and the per-export settings).
//!
//! The table here is touched only when an export starts or stops, never on
//! an I/O path; everything that touches an export's filesystem or server is
//! sent to the export's reactor as a message, as the stats are.

use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use keelfs_reactor::{self as reactor, ReactorHandle};
use serde_json::{json, Value};

use crate::config::{BackendName, Export};
use crate::sandbox::SandboxMode;
use crate::serve::{Event, Opened};
use crate::supervisor::SupervisorLink;

/// Where an export is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    Starting,
    Ready,
    Failed(String),
    /// Asked to stop: draining, committing, closing.
    Stopping,
}

#[derive(Clone, Debug)]
pub struct ExportEntry {
    pub export: Export,
    pub reactor: usize,
    pub state: Lifecycle,
    /// Added by the RPC rather than the config.
    pub runtime: bool,
    /// Bound by the supervisor for a sandboxed server: its index there,
    /// to have it removed.
    pub brokered_socket: Option<usize>,
    /// An `export_add` waits for this entry's start and collects its
    /// failure; once it gave up waiting, a failure removes the entry.
    pub awaited: bool,
    /// The open device, once opened: a snapshot export of the same image
    /// shares it (and its lock) instead of opening the image again.
    pub device: Option<SharedDevice>,
    /// The image is not here: given up to another process by a
    /// migration, or (`serve --incoming`) not taken yet. No snapshot of it
    /// may be served here meanwhile.
    pub image_away: bool,
}

/// An export's open device, as the table holds it.
#[derive(Clone)]
pub struct SharedDevice(pub Arc<dyn keelfs_bdev::BlockDevice>);

impl std::fmt::Debug for SharedDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SharedDevice").field(&self.0.name()).finish()
    }
}

#[derive(Default)]
struct Entries {
    list: Vec<ExportEntry>,
    /// Shutting down: no export may be added any more.
    closed: bool,
    /// Tags `export_remove` stopped whose host mount has not been reported
    /// gone yet: their unmount is not a user's `umount`.
    removed: Vec<String>,
}

/// The exports that are starting, running or stopping. An entry leaves
/// once its export has stopped (or failed and was collected).
#[derive(Default)]
pub struct ExportTable {
    entries: Mutex<Entries>,
    changed: Condvar,
}

impl ExportTable {
    fn lock(&self) -> MutexGuard<'_, Entries> {
        // A panic elsewhere while holding it leaves plain data behind.
        self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn insert(&self, entry: ExportEntry) {
        self.lock().list.push(entry);
        self.changed.notify_all();
    }

    /// Insert `entry` unless the table is closed or a listed export shares
    /// its tag, device, socket or mount point: the check and the insert
    /// are one step, so that two concurrent adds cannot both pass.
    pub fn reserve(&self, entry: ExportEntry) -> Result<(), ControlError> {
        let mut entries = self.lock();
        if entries.closed {
            return Err(ControlError::NotPossible("keelfsd is shutting down".into()));
        }
        if let Some(clash) = entries.list.iter().find_map(|running| clash(&running.export, &entry.export)) {
            return Err(ControlError::Conflict(clash));
        }
        if entry.export.snapshot.is_some() {
            let away = entries.list.iter().find(|e| e.image_away && e.export.device == entry.export.device);
            if let Some(away) = away {
                return Err(ControlError::NotPossible(format!(
                    "export \"{}\" does not hold its image now (it migrated away, or has not arrived yet): no \
                     snapshot of it can be served here",
                    away.export.tag
                )));
            }
        }
        entries.list.push(entry);
        drop(entries);
        self.changed.notify_all();
        Ok(())
    }

    /// No more exports may be added (shutdown has begun).
    pub fn close(&self) {
        self.lock().closed = true;
    }

    pub fn set_state(&self, tag: &str, state: Lifecycle) {
        if let Some(e) = self.lock().list.iter_mut().find(|e| e.export.tag == tag) {
            e.state = state;
        }
        self.changed.notify_all();
    }

    /// Export `tag` failed to start: an `export_add` that waits collects
    /// the failure; otherwise a runtime export leaves the table at once
    /// (a config export's failure ends the daemon's start anyway).
    pub fn fail(&self, tag: &str, why: String) {
        let mut entries = self.lock();
        let orphaned = entries.list.iter().any(|e| e.export.tag == tag && e.runtime && !e.awaited);
        if orphaned {
            entries.list.retain(|e| e.export.tag != tag);
        } else if let Some(e) = entries.list.iter_mut().find(|e| e.export.tag == tag) {
            e.state = Lifecycle::Failed(why);
        }
        drop(entries);
        self.changed.notify_all();
    }

    /// The `export_add` waiting for `tag` gave up: remove it if it has
    /// failed meanwhile, else leave a failure for nobody to collect.
    pub fn stop_awaiting(&self, tag: &str) {
        let mut entries = self.lock();
        entries.list.retain(|e| !(e.export.tag == tag && matches!(e.state, Lifecycle::Failed(_))));
        if let Some(e) = entries.list.iter_mut().find(|e| e.export.tag == tag) {
            e.awaited = false;
        }
    }

    pub fn remove(&self, tag: &str) {
        self.lock().list.retain(|e| e.export.tag != tag);
        self.changed.notify_all();
    }

    /// `export_remove` is stopping `tag`: mark it Stopping, and note that
    /// its host mount's going is the RPC's doing.
    pub fn removing(&self, tag: &str) {
        let mut entries = self.lock();
        let Some(e) = entries.list.iter_mut().find(|e| e.export.tag == tag) else { return };
        e.state = Lifecycle::Stopping;
        if e.export.fuse_mount.is_some() {
            entries.removed.push(tag.to_string());
        }
    }

    /// Whether the host mount of `tag` was unmounted by `export_remove`;
    /// each removal answers yes once.
    pub fn take_removed(&self, tag: &str) -> bool {
        let mut entries = self.lock();
        let found = entries.removed.iter().position(|t| t == tag);
        found.map(|i| entries.removed.swap_remove(i)).is_some()
    }

    pub fn get(&self, tag: &str) -> Option<ExportEntry> {
        self.lock().list.iter().find(|e| e.export.tag == tag).cloned()
    }

    pub fn all(&self) -> Vec<ExportEntry> {
        self.lock().list.clone()
    }

    pub fn set_device(&self, tag: &str, device: SharedDevice) {
        if let Some(e) = self.lock().list.iter_mut().find(|e| e.export.tag == tag) {
            e.device = Some(device);
        }
    }

    /// Export `tag` would give its image up (a migration's switch-over):
    /// refused while an export serves a snapshot of the image here, since
    /// the image's next holder may delete that snapshot and reuse its
    /// blocks under the reader. The check and the mark are one step with
    /// `reserve`'s, so that no snapshot export slips in between.
    pub fn give_up_image(&self, tag: &str) -> Result<(), String> {
        let mut entries = self.lock();
        let Some(device) = entries.list.iter().find(|e| e.export.tag == tag).map(|e| e.export.device.clone()) else {
            return Ok(());
        };
        let reader = entries.list.iter().find(|e| e.export.device == device && e.export.snapshot.is_some());
        if let Some(reader) = reader {
            return Err(format!(
                "export \"{}\" serves a snapshot of this image here: remove it before the image can move",
                reader.export.tag
            ));
        }
        if let Some(e) = entries.list.iter_mut().find(|e| e.export.tag == tag) {
            e.image_away = true;
        }
        Ok(())
    }

    /// Export `tag` holds its image (again), or not yet (`away`).
    pub fn set_image_away(&self, tag: &str, away: bool) {
        if let Some(e) = self.lock().list.iter_mut().find(|e| e.export.tag == tag) {
            e.image_away = away;
        }
    }

    pub fn set_brokered_socket(&self, tag: &str, index: Option<usize>) {
        if let Some(e) = self.lock().list.iter_mut().find(|e| e.export.tag == tag) {
            e.brokered_socket = index;
        }
    }

    /// Exports that still hold a device: not stopped, and not failed.
    pub fn live(&self) -> usize {
        self.lock().list.iter().filter(|e| !matches!(e.state, Lifecycle::Failed(_))).count()
    }

    /// Wait until `done` holds of the entries, or `timeout` passes;
    /// returns whether it held.
    pub fn wait_for(&self, timeout: Duration, mut done: impl FnMut(&[ExportEntry]) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut entries = self.lock();
        loop {
            if done(&entries.list) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            entries = self.changed.wait_timeout(entries, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// Why `new` may not run beside `running`, if it may not.
fn clash(running: &Export, new: &Export) -> Option<String> {
    if running.tag == new.tag {
        Some(format!("an export is already tagged \"{}\"", running.tag))
    } else if running.device == new.device && new.snapshot.is_none() {
        // A snapshot export shares the image with the one that serves it
        // (`Control::add`), or takes a reader's lock on it.
        Some(format!("export \"{}\" already serves {}", running.tag, running.device.display()))
    } else if running.socket.is_some() && running.socket == new.socket {
        Some(format!("export \"{}\" already listens on that socket", running.tag))
    } else if running.fuse_mount.is_some() && running.fuse_mount == new.fuse_mount {
        Some(format!("export \"{}\" is already mounted there", running.tag))
    } else {
        None
    }
}

/// Why a control request failed; each maps to a JSON-RPC error code.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("no export is tagged \"{0}\"")]
    NoSuchExport(String),
    #[error("{0}")]
    Conflict(String),
    #[error("export \"{0}\" is starting or stopping; try again")]
    Busy(String),
    #[error("{0}")]
    NotPossible(String),
    #[error("{0}")]
    Failed(String),
    #[error("the export's reactor did not answer within {0:?}")]
    Timeout(Duration),
}

/// How long an export may take to start (mounting replays the journal).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// What `export_remove` waits by default for a drain and commit.
pub const STOP_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);

/// Work for an export's reactor: built there, run there as a task.
pub type LocalJob = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = anyhow::Result<Value>>>> + Send>;

/// What the RPC thread may do to the running daemon.
pub struct Control {
    pub reactors: Vec<ReactorHandle>,
    pub table: Arc<ExportTable>,
    pub events: Mutex<Sender<Event>>,
    pub commit_interval: Duration,
    pub sandbox: SandboxMode,
    /// The supervisor, which opens exports for a sandboxed server.
    pub link: Option<Arc<SupervisorLink>>,
}

impl Control {
    pub fn list(&self) -> Value {
        let entries = self.table.all();
        let lines: Vec<Value> = entries
            .iter()
            .map(|e| {
                json!({
                    "tag": e.export.tag, "reactor": e.reactor, "device": e.export.device,
                    "socket": e.export.socket, "fuse_mount": e.export.fuse_mount,
                    "read_only": e.export.read_only, "added_at_runtime": e.runtime,
                    "state": match &e.state {
                        Lifecycle::Starting => "starting".to_string(),
                        Lifecycle::Ready => "ready".to_string(),
                        Lifecycle::Failed(why) => format!("failed: {why}"),
                        Lifecycle::Stopping => "stopping".to_string(),
                    },
                })
            })
            .collect();
        Value::Array(lines)
    }

    /// Check `export` against the running ones, open it, start it on
    /// `reactor` (default: the one with the fewest exports) and wait until
    /// it serves.
    pub fn add(&self, export: Export, reactor: Option<usize>) -> Result<Value, ControlError> {
        if export.backend == BackendName::Nvme {
            return Err(ControlError::NotPossible("an NVMe export is opened only at start".into()));
        }
        let requested = reactor;
        let reactor = match reactor {
            Some(r) if r < self.reactors.len() => r,
            Some(r) => return Err(ControlError::Conflict(format!("there is no reactor {r}"))),
            None => self.least_loaded_reactor(),
        };
        // A snapshot of an image served writable here shares its device,
        // on its reactor.
        let source = export.snapshot.as_ref().and_then(|_| self.served_writable(&export.device));
        let reactor = match &source {
            Some(s) if reactor != s.reactor && Some(reactor) == requested => {
                return Err(ControlError::Conflict(format!(
                    "a snapshot of export \"{}\" is served on its reactor, {}",
                    s.export.tag, s.reactor
                )))
            }
            Some(s) => s.reactor,
            None => reactor,
        };
        let tag = export.tag.clone();
        // Listed before it is opened, so that a concurrent add of the same
        // tag, image or socket is refused.
        let entry = ExportEntry {
            export: export.clone(),
            reactor,
            state: Lifecycle::Starting,
            runtime: true,
            brokered_socket: None,
            awaited: true,
            device: None,
            image_away: false,
        };
        self.table.reserve(entry)?;
        let opened = match source.and_then(|s| s.device) {
            Some(device) => self.open_sharing(&export, device),
            None => self.open(&export),
        };
        let (opened, brokered_socket) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                self.table.remove(&tag);
                return Err(e);
            }
        };
        self.table.set_brokered_socket(&tag, brokered_socket);
        self.table.set_device(&tag, SharedDevice(Arc::clone(opened.device())));
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let timing = (self.commit_interval, false);
        let started =
            crate::serve::start_export(&self.reactors, reactor, opened, timing, events, Arc::clone(&self.table));
        if let Err(e) = started {
            self.table.remove(&tag);
            self.forget_socket(brokered_socket);
            return Err(ControlError::Failed(format!("{e:#}")));
        }
        self.await_start(&tag, reactor, brokered_socket)
    }

    /// Wait for export `tag` to serve or fail.
    fn await_start(&self, tag: &str, reactor: usize, brokered_socket: Option<usize>) -> Result<Value, ControlError> {
        let settled = self.table.wait_for(START_TIMEOUT, |entries| {
            entries.iter().find(|e| e.export.tag == tag).is_none_or(|e| e.state != Lifecycle::Starting)
        });
        if !settled {
            self.table.stop_awaiting(tag);
            return Err(ControlError::Timeout(START_TIMEOUT));
        }
        match self.table.get(tag).map(|e| e.state) {
            Some(Lifecycle::Failed(why)) => {
                self.table.remove(tag);
                self.forget_socket(brokered_socket);
                Err(ControlError::Failed(why))
            }
            Some(Lifecycle::Ready) => Ok(json!({"tag": tag, "reactor": reactor})),
            _ => Err(ControlError::Failed("the export stopped while starting".into())),
        }
    }

    /// The running export that serves `device` writable, if any.
    fn served_writable(&self, device: &std::path::Path) -> Option<ExportEntry> {
        let entries = self.table.all();
        entries.into_iter().find(|e| {
            e.export.device == device
                && e.export.snapshot.is_none()
                && !e.export.read_only
                && e.state == Lifecycle::Ready
        })
    }

    /// Open a snapshot export on the device of the export that serves its
    /// image: its host side only. That export's lock covers both; the
    /// snapshot's blocks stay put while it is served, since
    /// `snapshot_delete` refuses a snapshot an export serves.
    fn open_sharing(&self, export: &Export, device: SharedDevice) -> Result<(Opened, Option<usize>), ControlError> {
        let failed = |e: String| ControlError::Failed(e);
        if self.sandbox == SandboxMode::None {
            let opened = crate::serve::open_export_on(export, device.0);
            return opened.map(|o| (o, None)).map_err(|e| failed(format!("{e:#}")));
        }
        // Sandboxed: the supervisor binds the socket alone; the server
        // already holds the device.
        let Some(link) = &self.link else {
            return Err(ControlError::NotPossible("no supervisor to bind the export's socket".into()));
        };
        let socket = match (&export.socket, &export.fuse_mount) {
            (Some(socket), None) => socket.clone(),
            _ => {
                return Err(ControlError::NotPossible(
                    "a sandboxed daemon adds only vhost-user exports at runtime: a snapshot export needs a socket \
                     and no fuse_mount (use sandbox = \"none\" for a host mount)"
                        .into(),
                ))
            }
        };
        let request =
            crate::broker::SocketRequest { socket, socket_mode: export.socket_mode, socket_owner: export.socket_owner };
        let (listener, index) = link.bind_socket(&request).map_err(|e| failed(format!("the supervisor: {e}")))?;
        Ok((crate::serve::open_export_on_listener(export, device.0, listener), Some(index)))
    }

    /// Open the export here, or have the supervisor open it for a
    /// sandboxed server (which can open nothing itself).
    fn open(&self, export: &Export) -> Result<(Opened, Option<usize>), ControlError> {
        let failed = |e: anyhow::Error| ControlError::Failed(format!("{e:#}"));
        if self.sandbox == SandboxMode::None {
            return crate::serve::open_export(export, false, None).map(|o| (o, None)).map_err(failed);
        }
        let Some(link) = &self.link else {
            return Err(ControlError::NotPossible("no supervisor to open the export".into()));
        };
        if export.fuse_mount.is_some() || export.backend != BackendName::Uring || crate::device::is_rbd(&export.device)
        {
            return Err(ControlError::NotPossible(
                "a sandboxed daemon adds only vhost-user exports on io_uring images: it cannot mount, map, attach \
                 devices or reach a Ceph cluster at runtime (use sandbox = \"none\")"
                    .into(),
            ));
        }
        crate::serve::open_export_brokered(export, link).map(|(o, i)| (o, Some(i))).map_err(failed)
    }

    fn forget_socket(&self, brokered: Option<usize>) {
        if let (Some(link), Some(index)) = (&self.link, brokered) {
            if let Err(e) = link.remove_socket(index) {
                tracing::warn!("the supervisor could not remove a socket: {e}");
            }
        }
    }

    fn least_loaded_reactor(&self) -> usize {
        let entries = self.table.all();
        (0..self.reactors.len()).min_by_key(|&r| entries.iter().filter(|e| e.reactor == r).count()).unwrap_or(0)
    }

    /// Stop taking requests, drain the ones in flight, commit, checkpoint
    /// and close; returns once the export has let go of its device.
    pub fn remove(&self, tag: &str, timeout: Duration) -> Result<Value, ControlError> {
        let entry = self.table.get(tag).ok_or_else(|| ControlError::NoSuchExport(tag.into()))?;
        if entry.state != Lifecycle::Ready {
            return Err(ControlError::Busy(tag.into()));
        }
        if entry.export.snapshot.is_none() && !entry.export.read_only {
            let all = self.table.all();
            let sharing = all.iter().find(|e| e.export.device == entry.export.device && e.export.snapshot.is_some());
            if let Some(user) = sharing {
                return Err(ControlError::NotPossible(format!(
                    "export \"{}\" serves a snapshot of this image on its device; remove it first",
                    user.export.tag
                )));
            }
        }
        self.table.removing(tag);
        let asked = tag.to_string();
        if self.reactors[entry.reactor].send(move || crate::serve::request_export_stop(&asked)).is_err() {
            return Err(ControlError::Failed("the export's reactor has stopped".into()));
        }
        if !self.table.wait_for(timeout, |entries| entries.iter().all(|e| e.export.tag != tag)) {
            return Err(ControlError::Timeout(timeout));
        }
        if entry.runtime && self.sandbox == SandboxMode::None {
            if let Some(socket) = &entry.export.socket {
                let _ = keelfs_vhost::clear_stale(socket);
            }
        }
        self.forget_socket(entry.brokered_socket);
        Ok(json!({"tag": tag, "removed": true}))
    }

    /// The exports that serve snapshot `name` of export `tag`'s image.
    pub fn snapshot_users(&self, tag: &str, name: &str) -> Vec<String> {
        let entries = self.table.all();
        let Some(source) = entries.iter().find(|e| e.export.tag == tag) else { return Vec::new() };
        entries
            .iter()
            .filter(|e| e.export.device == source.export.device && e.export.snapshot.as_deref() == Some(name))
            .map(|e| e.export.tag.clone())
            .collect()
    }

    /// Run `job` on the export's reactor (as a task, so that it may await
    /// the filesystem) and wait for its answer.
    pub fn on_export_reactor(&self, tag: &str, timeout: Duration, job: LocalJob) -> Result<Value, ControlError> {
        let entry = self.table.get(tag).ok_or_else(|| ControlError::NoSuchExport(tag.into()))?;
        if entry.state != Lifecycle::Ready {
            return Err(ControlError::Busy(tag.into()));
        }
        let (tx, rx) = mpsc::channel();
        let sent = self.reactors[entry.reactor].send(move || {
            reactor::spawn_local(async move {
                let _ = tx.send(job().await);
            });
        });
        if sent.is_err() {
            return Err(ControlError::Failed("the export's reactor has stopped".into()));
        }
        match rx.recv_timeout(timeout) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(ControlError::Failed(format!("{e:#}"))),
            Err(_) => Err(ControlError::Timeout(timeout)),
        }
    }
}
