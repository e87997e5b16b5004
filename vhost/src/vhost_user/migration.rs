//! Moving a guest's session between two keelfsd processes: QEMU's
//! internal virtio-fs migration (vhost-user DEVICE_STATE), and the image
//! handed over between them.
//!
//! At switch-over QEMU stops every ring (GET_VRING_BASE, which waits for
//! the requests in flight), then asks for the state (SET_DEVICE_STATE_FD,
//! SAVE). The owning reactor encodes the session ([`SessionState`]) and
//! *detaches* the image: commit, checkpoint and unlock, so that the
//! destination can take it. The destination's reactor, given the state
//! (LOAD, before guest memory or rings exist), *attaches* the image: lock
//! (waiting for the source to let go), mount keeping the orphans, restore
//! the session after checking it against the image, and free the orphans
//! nobody holds. CHECK_DEVICE_STATE answers with the outcome.
//!
//! If the migration fails after the save, the source's guest resumes: its
//! first request attaches the image again and restores the saved session.
//! A server started detached (`keelfsd serve --incoming`) attaches on its
//! first request when no state arrives.
//!
//! The pipe I/O runs on a thread of its own: QEMU reads or writes the
//! other end only after SET_DEVICE_STATE_FD is answered.

use std::cell::RefCell;
use std::fs::File;
use std::future::Future;
use std::io::{self, Read, Write};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::mpsc::{self, SyncSender};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use keelfs_fs::Fs;

use super::{Doorbell, SESSIONS};
use crate::fuse::dispatch::{Session, SessionConfig};
use crate::fuse::state::{SessionState, StateError, STATE_BYTES_MAX};
use crate::fuse::stats::OpStats;

/// A future on the owning reactor.
pub type LocalFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// How a server takes and gives up its image, for an export whose
/// session may move to another process. The daemon implements it (the
/// lock, the device and the mount are its business); it runs on the
/// owning reactor.
pub trait ImageAccess {
    /// Lock the image (waiting a while for a previous holder to let go)
    /// and mount it with [`keelfs_fs::FsConfig::keep_orphans`] set.
    fn attach(&self) -> LocalFuture<'_, Result<Fs, TransferError>>;
    /// Commit, checkpoint and unlock: the image is another's to take.
    /// The lock is released even when the unmount fails.
    fn detach(&self, fs: Fs) -> LocalFuture<'_, Result<(), TransferError>>;
    /// Whether the image may be given up now, asked before the session
    /// is saved, so that a refusal leaves the export attached and
    /// serving: the daemon refuses while it still reads the image for
    /// something else (a snapshot served beside it), which the image's
    /// next holder could change under it. Once this answers yes, the
    /// image counts as given up until [`ImageAccess::attach`] succeeds.
    fn may_give_up(&self) -> Result<(), TransferError> {
        Ok(())
    }
}

/// Why a session could not move: its image not taken or given up, its
/// state not saved, sent, received or restored.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The daemon's [`ImageAccess`] failed (the lock, the device, the
    /// mount, or the unmount's commit and checkpoint); its reason.
    #[error("{0}")]
    Image(String),
    #[error("this export cannot take its image back")]
    NoImageAccess,
    #[error("this export cannot migrate: its image is shared with a host mount")]
    SharedImage,
    #[error("no session to save: the image is not attached")]
    NotAttached,
    #[error("the image is being taken")]
    Attaching,
    /// The saved state is malformed or no longer fits the image.
    #[error(transparent)]
    State(#[from] StateError),
    #[error("the export's reactor is gone")]
    ReactorGone,
    #[error("the export's reactor did not answer in time")]
    NoAnswer,
    #[error("no device state transfer was started")]
    NotStarted,
    #[error("the transfer thread panicked")]
    Panicked,
    #[error("only the owning reactor holds the session")]
    NotOwner,
    /// QEMU saves only with every ring stopped, and each stop waits for
    /// its requests: a save with requests in flight is refused.
    #[error("requests are in flight: the rings were not stopped")]
    InFlight,
    #[error("writing the session state: {0}")]
    Write(io::Error),
    #[error("reading the session state: {0}")]
    Read(io::Error),
}

/// The longest the owning reactor may take to save a session (encode it,
/// commit and checkpoint the image) or to load one (wait for the lock,
/// mount, restore).
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(120);

enum AttachState {
    Attached {
        fs: Fs,
        session: Rc<Session>,
    },
    /// No image: given up at a migration's save (`saved` is the session,
    /// to take back if the guest resumes here), or never taken.
    Detached {
        saved: Option<SessionState>,
    },
    /// Being taken; requests wait.
    Attaching,
}

/// The image and the session of one server, on its owning reactor.
pub(super) struct Attachment {
    id: u64,
    config: SessionConfig,
    op_stats: Rc<OpStats>,
    image: Option<Rc<dyn ImageAccess>>,
    state: RefCell<AttachState>,
    waiters: RefCell<Vec<Waker>>,
    /// The server is stopping to keep its session for a restart: the
    /// frontend's leaving does not give it back.
    keeping: std::cell::Cell<bool>,
    /// A session arrived by LOAD and no request has used it yet.
    loaded_unused: std::cell::Cell<bool>,
    /// The export's span: the parent of the events of moves, which run as
    /// tasks of their own.
    span: tracing::Span,
}

impl Attachment {
    /// With `fs` mounted already, or none (taken when needed); `restore`
    /// is a session kept across a restart, restored when the image is
    /// taken (refused with a warning if it does not fit the image).
    pub(super) fn new(
        id: u64,
        fs: Option<Fs>,
        config: SessionConfig,
        op_stats: Rc<OpStats>,
        image: Option<Rc<dyn ImageAccess>>,
        restore: Option<SessionState>,
    ) -> Rc<Self> {
        assert!(fs.is_some() || image.is_some(), "a server with no image needs a way to take one");
        let this = Rc::new(Self {
            id,
            config,
            op_stats,
            image,
            state: RefCell::new(AttachState::Detached { saved: None }),
            waiters: RefCell::default(),
            keeping: std::cell::Cell::new(false),
            loaded_unused: std::cell::Cell::new(false),
            span: tracing::Span::current(),
        });
        let Some(fs) = fs else {
            *this.state.borrow_mut() = AttachState::Detached { saved: restore };
            return this;
        };
        let session = this.session_on(&fs, restore.as_ref()).unwrap_or_else(|e| this.fresh_after(&fs, &e));
        this.install_freeing_orphans(fs, session);
        this
    }

    fn fresh_session(&self, fs: &Fs) -> Rc<Session> {
        Rc::new(Session::with_stats(fs.clone(), self.config.clone(), self.op_stats.clone()))
    }

    /// `saved` restored on `fs`, or a fresh session if there is none.
    fn session_on(&self, fs: &Fs, saved: Option<&SessionState>) -> Result<Rc<Session>, StateError> {
        match saved {
            Some(state) => Session::restore(fs.clone(), self.config.clone(), self.op_stats.clone(), state).map(Rc::new),
            None => Ok(self.fresh_session(fs)),
        }
    }

    /// A fresh session where a saved one did not fit.
    fn fresh_after(&self, fs: &Fs, refused: &StateError) -> Rc<Session> {
        tracing::warn!(parent: &self.span, "the saved session is not restored: {refused}");
        self.fresh_session(fs)
    }

    /// Install a filesystem mounted with its orphans kept, once `session`
    /// holds what it holds: the orphans nobody holds are freed.
    fn install_freeing_orphans(&self, fs: Fs, session: Rc<Session>) {
        if let Err(e) = fs.handover().free_unheld_orphans() {
            tracing::warn!(parent: &self.span, "freeing orphans: {e}");
        }
        self.install(fs, session);
    }

    fn install(&self, fs: Fs, session: Rc<Session>) {
        SESSIONS.with(|s| s.borrow_mut().insert(self.id, session.clone()));
        *self.state.borrow_mut() = AttachState::Attached { fs, session };
        self.wake_all();
    }

    fn set_detached(&self, saved: Option<SessionState>) {
        SESSIONS.with(|s| s.borrow_mut().remove(&self.id));
        *self.state.borrow_mut() = AttachState::Detached { saved };
        self.wake_all();
    }

    fn wake_all(&self) {
        for waker in self.waiters.borrow_mut().drain(..) {
            waker.wake();
        }
    }

    /// The export's span.
    pub(super) fn span(&self) -> tracing::Span {
        self.span.clone()
    }

    /// The session, if the image is attached now.
    pub(super) fn session(&self) -> Option<Rc<Session>> {
        match &*self.state.borrow() {
            AttachState::Attached { session, .. } => Some(session.clone()),
            _ => None,
        }
    }

    /// The mounted filesystem, if attached.
    pub(super) fn fs(&self) -> Option<Fs> {
        match &*self.state.borrow() {
            AttachState::Attached { fs, .. } => Some(fs.clone()),
            _ => None,
        }
    }

    /// The session, attaching the image first if need be; None if that
    /// failed (the request then fails, and the next one tries again).
    pub(super) async fn attached(self: &Rc<Self>) -> Option<Rc<Session>> {
        let previous = std::mem::replace(&mut *self.state.borrow_mut(), AttachState::Attaching);
        let saved = match previous {
            AttachState::Attached { ref session, .. } => {
                let session = session.clone();
                *self.state.borrow_mut() = previous;
                return Some(session);
            }
            AttachState::Attaching => {
                self.wait_while_attaching().await;
                return self.session();
            }
            AttachState::Detached { saved } => saved,
        };
        let attach = tracing::Instrument::instrument(self.attach(saved.as_ref(), true), self.span.clone());
        if let Err(e) = attach.await {
            tracing::warn!(parent: &self.span, "cannot take the image: {e}");
            self.set_detached(saved);
        }
        self.session()
    }

    async fn wait_while_attaching(&self) {
        std::future::poll_fn(|cx| {
            if matches!(*self.state.borrow(), AttachState::Attaching) {
                self.waiters.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await
    }

    /// Take the image and restore `saved` (or start a fresh session). A
    /// saved session that no longer fits the image fails the attach for a
    /// migration (`fresh_if_unfit` false: CHECK_DEVICE_STATE says so), or
    /// gives way to a fresh one for a guest's request: its old handles then
    /// fail with EBADF, and the guest is served rather than stuck.
    async fn attach(&self, saved: Option<&SessionState>, fresh_if_unfit: bool) -> Result<(), TransferError> {
        let image = self.image.as_ref().ok_or(TransferError::NoImageAccess)?;
        let fs = image.attach().await?;
        let session = match self.session_on(&fs, saved) {
            Ok(session) => session,
            Err(e) if fresh_if_unfit => self.fresh_after(&fs, &e),
            Err(e) => {
                if let Err(d) = image.detach(fs).await {
                    tracing::warn!(parent: &self.span, "giving the image back after a refused session: {d}");
                }
                return Err(e.into());
            }
        };
        self.install_freeing_orphans(fs, session);
        Ok(())
    }

    /// Save the session and give the image up (SET_DEVICE_STATE_FD, SAVE):
    /// the encoded state, for the destination.
    pub(super) async fn save_and_detach(&self) -> Result<Vec<u8>, TransferError> {
        let image = self.image.clone().ok_or(TransferError::SharedImage)?;
        if matches!(*self.state.borrow(), AttachState::Attached { .. }) {
            image.may_give_up()?;
        }
        let previous = std::mem::replace(&mut *self.state.borrow_mut(), AttachState::Attaching);
        let (fs, session) = match previous {
            AttachState::Attached { fs, session } => (fs, session),
            // Saved already, by an earlier attempt that failed after it.
            AttachState::Detached { saved: Some(state) } => {
                let bytes = state.encode();
                self.set_detached(Some(state));
                return Ok(bytes);
            }
            AttachState::Detached { saved: None } => {
                self.set_detached(None);
                return Err(TransferError::NotAttached);
            }
            AttachState::Attaching => return Err(TransferError::Attaching),
        };
        let state = session.save_state();
        // Not given back: the handles and lookups go with the state, and
        // the orphans they hold must survive into the checkpoint.
        drop(session);
        let detached = image.detach(fs).await;
        let bytes = state.encode();
        tracing::info!(
            parent: &self.span,
            lookups = state.lookups.len(),
            handles = state.handles.len(),
            bytes = bytes.len(),
            "session saved; image released"
        );
        self.set_detached(Some(state));
        detached.map(|()| bytes)
    }

    /// Take a migrated session (SET_DEVICE_STATE_FD, LOAD).
    pub(super) async fn load(&self, state: SessionState) -> Result<(), TransferError> {
        let previous = std::mem::replace(&mut *self.state.borrow_mut(), AttachState::Attaching);
        match previous {
            AttachState::Attached { fs, session } => {
                // The image is here already: replace whatever this
                // frontend's session held with the migrated one.
                session.give_back().await;
                drop(session);
                match self.session_on(&fs, Some(&state)) {
                    Ok(restored) => {
                        self.install(fs, restored);
                        self.loaded_unused.set(true);
                        Ok(())
                    }
                    Err(e) => {
                        let fresh = self.fresh_session(&fs);
                        self.install(fs, fresh);
                        Err(e.into())
                    }
                }
            }
            AttachState::Detached { saved } => {
                let result = self.attach(Some(&state), false).await;
                match &result {
                    Ok(()) => self.loaded_unused.set(true),
                    Err(_) => self.set_detached(saved),
                }
                result
            }
            // Left as it was: another attach is under way.
            AttachState::Attaching => Err(TransferError::Attaching),
        }
    }

    /// A request was served: a loaded session is in use.
    pub(super) fn note_request(&self) {
        self.loaded_unused.set(false);
    }

    /// The frontend left: its session's references go back, unless the
    /// session left with a migration. A destination whose QEMU left before
    /// the guest ran here (the migration failed after the load) gives the
    /// image back, so that the source can take it again and resume.
    pub(super) async fn frontend_left(&self) {
        let previous = std::mem::replace(&mut *self.state.borrow_mut(), AttachState::Attaching);
        let departed = match previous {
            AttachState::Attached { .. } if self.keeping.get() => {
                *self.state.borrow_mut() = previous;
                None
            }
            AttachState::Attached { fs, .. } if self.loaded_unused.replace(false) => {
                // Not given back: the source's saved session holds the
                // same references, orphans included.
                self.set_detached(None);
                Some(Err(fs))
            }
            AttachState::Attached { fs, session } => {
                let fresh = self.fresh_session(&fs);
                self.install(fs, fresh);
                Some(Ok(session))
            }
            AttachState::Detached { .. } => {
                self.set_detached(None);
                None
            }
            // Left as it was: an attach is under way.
            AttachState::Attaching => None,
        };
        match departed {
            Some(Ok(session)) => session.give_back().await,
            Some(Err(fs)) => {
                tracing::info!(parent: &self.span, "the frontend left before using the migrated session; image released");
                if let Some(image) = &self.image {
                    if let Err(e) = image.detach(fs).await {
                        tracing::warn!(parent: &self.span, "giving the image back: {e}");
                    }
                }
            }
            None => {}
        }
    }

    /// The server is about to stop and keep its session
    /// ([`Self::release`] with `keep_session`).
    pub(super) fn keep_session_at_stop(&self) {
        self.keeping.set(true);
    }

    /// At shutdown: give the image up, and the session's references back,
    /// unless `keep_session` (a daemon restart is to restore it): then the
    /// session stays held in the image (its orphans are checkpointed) and
    /// is returned, if its client had started it.
    pub(super) async fn release(&self, keep_session: bool) -> Result<Option<SessionState>, TransferError> {
        let previous = std::mem::replace(&mut *self.state.borrow_mut(), AttachState::Detached { saved: None });
        SESSIONS.with(|s| s.borrow_mut().remove(&self.id));
        let AttachState::Attached { fs, session } = previous else { return Ok(None) };
        let kept = keep_session.then(|| session.save_state()).filter(|state| state.initialized);
        if kept.is_none() {
            session.give_back().await;
        }
        drop(session);
        match &self.image {
            Some(image) => image.detach(fs).await.map(|()| kept),
            None => Ok(kept),
        }
    }
}

/// The result of a state transfer, awaited by CHECK_DEVICE_STATE.
pub(super) type Transfer = std::thread::JoinHandle<Result<(), TransferError>>;

/// Ask the owning reactor and wait for its answer.
fn ask<T: Send + 'static>(
    owner: &Doorbell,
    make: impl FnOnce(SyncSender<Result<T, TransferError>>) -> super::Control,
) -> Result<T, TransferError> {
    let (done, answered) = mpsc::sync_channel(1);
    if !owner.send(make(done)) {
        return Err(TransferError::ReactorGone);
    }
    answered.recv_timeout(TRANSFER_TIMEOUT).map_err(|_| TransferError::NoAnswer)?
}

/// SAVE: the reactor saves and detaches; this thread writes the pipe.
pub(super) fn start_save(owner: Doorbell, mut pipe: File) -> io::Result<Transfer> {
    let span = tracing::Span::current();
    std::thread::Builder::new().name("vhost-user-save".into()).spawn(move || {
        let _span = span.entered();
        let started = Instant::now();
        let bytes = ask(&owner, |done| super::Control::SaveState { done })?;
        pipe.write_all(&bytes).map_err(TransferError::Write)?;
        tracing::info!(bytes = bytes.len(), ms = started.elapsed().as_millis() as u64, "device state sent");
        Ok(())
    })
}

/// LOAD: this thread reads and decodes the state (refusing it before the
/// image is touched if it is malformed), then the reactor takes it.
pub(super) fn start_load(owner: Doorbell, pipe: File) -> io::Result<Transfer> {
    let span = tracing::Span::current();
    std::thread::Builder::new().name("vhost-user-load".into()).spawn(move || {
        let _span = span.entered();
        let started = Instant::now();
        let bytes = read_bounded(pipe).map_err(TransferError::Read)?;
        let state = SessionState::decode(&bytes)?;
        let state = Box::new(state);
        ask(&owner, |done| super::Control::LoadState { state, done })?;
        tracing::info!(bytes = bytes.len(), ms = started.elapsed().as_millis() as u64, "device state loaded");
        Ok(())
    })
}

/// Everything up to EOF, refusing more than [`STATE_BYTES_MAX`] without
/// holding it.
fn read_bounded(pipe: File) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    pipe.take(STATE_BYTES_MAX as u64 + 1).read_to_end(&mut bytes)?;
    if bytes.len() > STATE_BYTES_MAX {
        return Err(io::Error::new(io::ErrorKind::InvalidData, StateError::TooLong(bytes.len())));
    }
    Ok(bytes)
}
