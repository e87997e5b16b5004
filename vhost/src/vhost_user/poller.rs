//! The reactor side: queue pollers that pop descriptor chains, serve them
//! (on the owner, or cached reads on a helper) and return them to the
//! used rings in batches.

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::virtio::GuestRam;
use keelfs_fs::{Fh, Ino};
use keelfs_reactor::{self as reactor, Poller, ReactorHandle};
use vhost_user_backend::VringT;
use virtio_queue::DescriptorChain;
use virtio_queue::QueueT;
use vm_memory::GuestAddressSpace;
use vmm_sys_util::eventfd::EventFd;

use super::migration::{Attachment, TransferError};
use super::{session_of, Connection, Control, DeviceStats, HelperStats, POP_BATCH};
use crate::fuse::dispatch::SharedHandle;
use crate::fuse::state::SessionState;
use crate::qos::{Charged, Gate};
use crate::virtio::{charge_of_chain, serve_chain_charged, serve_chain_zero_copy, serve_read_from_cache, ChainOutcome};

type Chain = DescriptorChain<Arc<GuestRam>>;
/// A chain QoS holds, and what it was charged.
type Held = (Chain, Arc<GuestRam>, Option<Charged>);
type Served = (u16, u32, ChainOutcome);

/// Where a served chain goes: its queue's completions and the counters.
pub(super) struct Finish {
    in_flight: Rc<Cell<usize>>,
    completed: Rc<RefCell<Vec<(u16, u32)>>>,
    stats: Rc<DeviceStats>,
}

impl Finish {
    fn finish(self, (head, written, outcome): Served) {
        let stats = &self.stats;
        match outcome {
            ChainOutcome::Replied(_) => stats.replies.set(stats.replies.get() + 1),
            ChainOutcome::Direct(_) => {
                stats.replies.set(stats.replies.get() + 1);
                stats.zero_copy.set(stats.zero_copy.get() + 1);
            }
            ChainOutcome::OneCopy(_) => {
                stats.replies.set(stats.replies.get() + 1);
                stats.one_copy.set(stats.one_copy.get() + 1);
            }
            ChainOutcome::NoReply => stats.no_reply.set(stats.no_reply.get() + 1),
            ChainOutcome::Dropped(why) => {
                stats.dropped.set(stats.dropped.get() + 1);
                stats.last_drop.set(Some(why));
            }
        }
        self.completed.borrow_mut().push((head, written));
        self.in_flight.set(self.in_flight.get() - 1);
    }
}

/// What a queue poller does with the chains it pops, and when its
/// frontend leaves.
pub(super) trait ChainServer: 'static {
    /// Spawn the task that serves `chain` and then calls `finish`, one per
    /// request, on this reactor (`reactor::spawn_local`, which reuses the
    /// box of a finished task of the same type). `charged`: what QoS
    /// charged it, to settle with what is served.
    fn serve(&self, chain: Chain, mem: Arc<GuestRam>, charged: Option<Charged>, finish: Finish);

    /// The frontend left and every request of this poller finished; answer
    /// `waiters` when the poller is ready for the next one.
    fn reset(&mut self, waiters: Vec<SyncSender<()>>);

    /// A queue is stopping, or the frontend left: requests that wait for
    /// a lock are answered now (ENOLCK), since the stop waits for every
    /// request and a lock may be held for ever. Called at the stop
    /// (`first`), then at each poll while the stop waits, for a request
    /// that began to wait after it.
    fn end_lock_waits(&self, first: bool);

    /// Save the session and give the image up (the owner only).
    fn save_state(&mut self, done: SyncSender<Result<Vec<u8>, TransferError>>) {
        let _ = done.send(Err(TransferError::NotOwner));
    }

    /// Take a migrated session (the owner only).
    fn load_state(&mut self, _state: SessionState, done: SyncSender<Result<(), TransferError>>) {
        let _ = done.send(Err(TransferError::NotOwner));
    }
}

/// The owning reactor's side: requests run against the filesystem here.
pub(super) struct OwnerServer {
    pub(super) attachment: Rc<Attachment>,
}

impl ChainServer for OwnerServer {
    fn end_lock_waits(&self, _first: bool) {
        if let Some(session) = self.attachment.session() {
            session.end_lock_waits();
        }
    }

    fn serve(&self, chain: Chain, mem: Arc<GuestRam>, charged: Option<Charged>, finish: Finish) {
        self.attachment.note_request();
        if let Some(session) = self.attachment.session() {
            reactor::spawn_local(
                async move { finish.finish(serve_chain_charged(&session, chain, mem, charged).await) },
            );
            return;
        }
        // The image is elsewhere (given up at a migration that then
        // failed, or not taken yet): take it first.
        let attachment = self.attachment.clone();
        reactor::spawn_local(async move {
            let head = chain.head_index();
            let served = match attachment.attached().await {
                Some(session) => serve_chain_charged(&session, chain, mem, charged).await,
                None => (head, 0, ChainOutcome::Dropped("the image could not be taken")),
            };
            finish.finish(served)
        });
    }

    fn reset(&mut self, waiters: Vec<SyncSender<()>>) {
        // The next frontend gets a fresh session; this one's references go.
        // Only what the departed frontend held: another transport on the
        // same filesystem (the host mount) keeps its handles.
        let attachment = self.attachment.clone();
        reactor::spawn_local(async move {
            attachment.frontend_left().await;
            for waiter in waiters {
                let _ = waiter.send(());
            }
        });
    }

    fn save_state(&mut self, done: SyncSender<Result<Vec<u8>, TransferError>>) {
        let attachment = self.attachment.clone();
        let span = attachment.span();
        reactor::spawn_local(tracing::Instrument::instrument(
            async move {
                let _ = done.send(attachment.save_and_detach().await);
            },
            span,
        ));
    }

    fn load_state(&mut self, state: SessionState, done: SyncSender<Result<(), TransferError>>) {
        let attachment = self.attachment.clone();
        let span = attachment.span();
        reactor::spawn_local(tracing::Instrument::instrument(
            async move {
                let _ = done.send(attachment.load(state).await);
            },
            span,
        ));
    }
}

/// A helper reactor's side: cached reads here, everything else sent to the
/// owner.
pub(super) struct HelperServer {
    pub(super) id: u64,
    pub(super) owner: ReactorHandle,
    /// What the owner said of each handle read here: its cache reader, or
    /// None (not a buffered file handle: always sent to the owner).
    pub(super) handles: Rc<RefCell<keelfs_base::IdMap<Option<SharedHandle>>>>,
    pub(super) stats: Arc<HelperStats>,
}

/// Handles remembered by a helper before the released ones are dropped.
const HELPER_HANDLES_MAX: usize = 4096;

impl HelperServer {
    async fn handle(
        owner: ReactorHandle,
        id: u64,
        handles: Rc<RefCell<keelfs_base::IdMap<Option<SharedHandle>>>>,
        fh: Fh,
        nodeid: Ino,
    ) -> Option<SharedHandle> {
        if let Some(known) = handles.borrow().get(&fh.get()) {
            return known.clone();
        }
        let asked = reactor::call_and_wait(&owner, move || async move {
            session_of(id).and_then(|session| session.shared_reader(fh, nodeid))
        });
        let answer = asked.await.flatten();
        let mut handles = handles.borrow_mut();
        if handles.len() >= HELPER_HANDLES_MAX {
            handles.retain(|_, h| h.as_ref().is_some_and(|h| !h.released.load(Ordering::Relaxed)));
        }
        handles.insert(fh.get(), answer.clone());
        answer
    }
}

impl ChainServer for HelperServer {
    /// The waits run on the owner, where the lock requests are forwarded;
    /// told once, as a message costs more than the owner's own check.
    fn end_lock_waits(&self, first: bool) {
        if !first {
            return;
        }
        let id = self.id;
        let _ = reactor::call(&self.owner, move || async move {
            if let Some(session) = session_of(id) {
                session.end_lock_waits();
            }
        });
    }

    /// Never charged: QoS is refused with helpers.
    fn serve(&self, chain: Chain, mem: Arc<GuestRam>, _charged: Option<Charged>, finish: Finish) {
        let (id, owner, handles, stats) = (self.id, self.owner.clone(), self.handles.clone(), self.stats.clone());
        reactor::spawn_local(async move {
            stats.chains.fetch_add(1, Ordering::Relaxed);
            stats.in_flight.fetch_add(1, Ordering::Relaxed);
            let reader_of = |fh, nodeid| Self::handle(owner.clone(), id, handles, fh, nodeid);
            let served = match serve_read_from_cache(&chain, reader_of).await {
                Some(served) => {
                    stats.from_cache.fetch_add(1, Ordering::Relaxed);
                    served
                }
                None => {
                    stats.forwarded.fetch_add(1, Ordering::Relaxed);
                    let head = chain.head_index();
                    let sent = reactor::call_and_wait(&owner, move || async move {
                        match session_of(id) {
                            Some(session) => serve_chain_zero_copy(&session, chain, mem).await,
                            None => (head, 0, ChainOutcome::Dropped("the export stopped")),
                        }
                    });
                    sent.await.unwrap_or((head, 0, ChainOutcome::Dropped("the owning reactor stopped")))
                }
            };
            stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            finish.finish(served)
        });
    }

    fn reset(&mut self, waiters: Vec<SyncSender<()>>) {
        self.handles.borrow_mut().clear();
        for waiter in waiters {
            let _ = waiter.send(());
        }
    }
}

#[derive(Default)]
pub(super) struct QueueState {
    /// Notifications are off and the ring is checked every iteration.
    pub(super) polling: bool,
    /// The driver moved the avail index more than a ring ahead: nothing on
    /// the queue can be trusted until it is set up again, so it is not
    /// polled (reported once, not on every kick).
    pub(super) broken: bool,
    /// The limit of the warnings of `broken`: a driver can break the ring,
    /// kick, mend it and break it again at will.
    pub(super) broken_logged: keelfs_base::RateLimit,
    pub(super) idle_since: Option<Instant>,
    pub(super) in_flight: Rc<Cell<usize>>,
    /// Finished chains waiting for the used ring: (head, bytes written).
    pub(super) completed: Rc<RefCell<Vec<(u16, u32)>>>,
    /// `completed`'s other half, empty between passes.
    pub(super) spare: Vec<(u16, u32)>,
    pub(super) stop_waiters: Vec<SyncSender<()>>,
    /// Requests popped that the export's QoS holds back (None: no QoS).
    /// They count in `in_flight`, so its cap bounds them.
    pub(super) deferred: Option<Gate<Held>>,
    /// The ring's size when it was last popped (0: not yet).
    pub(super) ring_size: usize,
}

impl QueueState {
    /// Requests this queue may have in flight: the configured cap, and
    /// never more than the ring's size. A ring holds at most that many
    /// distinct chains; virtio-queue does not notice a driver publishing a
    /// head again while it is in flight, so without this bound such a
    /// driver could have chains popped (and held, or spawned) for ever.
    fn in_flight_cap(&self, in_flight_max: usize) -> usize {
        match self.ring_size {
            0 => in_flight_max,
            size => in_flight_max.min(size),
        }
    }

    /// Held back by QoS with no room for more: popping would find nothing
    /// it may take, so the ring is left alone until the timer lets some
    /// through.
    fn throttled(&self, in_flight_max: usize) -> bool {
        self.deferred.as_ref().is_some_and(|d| !d.is_empty())
            && self.in_flight.get() >= self.in_flight_cap(in_flight_max)
    }
}

/// The chains the driver has published and keelfs not yet taken. None
/// when the avail index is unreadable or more than a ring ahead of the
/// next entry keelfs takes: virtio-queue then refuses every pop, and a
/// poller that kept asking would spin for ever.
fn available(queue: &virtio_queue::Queue, mem: &GuestRam) -> Option<u16> {
    let avail = queue.avail_idx(mem, Ordering::Acquire).ok()?;
    Some(avail.0.wrapping_sub(queue.next_avail())).filter(|&n| n <= queue.size())
}

/// Polls the queues in `mine` on one reactor and serves their chains
/// through `server`.
pub(super) struct QueuePoller<S: ChainServer> {
    pub(super) server: S,
    /// Kick bits of the queues this poller owns.
    pub(super) mine: u64,
    pub(super) control: Receiver<Control>,
    pub(super) wake: Arc<EventFd>,
    pub(super) connection: Option<Arc<Connection>>,
    pub(super) queues: Vec<QueueState>,
    pub(super) disconnects: Vec<SyncSender<()>>,
    pub(super) stats: Rc<DeviceStats>,
    /// Requests in flight per queue at most, if less than the ring's size:
    /// past it, the rest wait in the ring until some finish.
    pub(super) in_flight_max: usize,
    /// See [`super::ServeOptions::poll_idle`].
    pub(super) poll_idle: Duration,
    /// The export's span, for events logged from the reactor's loop.
    pub(super) span: tracing::Span,
    /// The export's fair share of this reactor, joined at the first poll
    /// (on the reactor's thread): its requests are charged to it, and it
    /// takes new ones only while it [admits](reactor::Share::admits).
    pub(super) share: Option<reactor::Share>,
}

impl<S: ChainServer> QueuePoller<S> {
    fn owns(&self, index: usize) -> bool {
        self.mine & (1 << index) != 0
    }
    fn handle_control(&mut self, control: Control) {
        match control {
            Control::Connected(connection) => {
                self.stats.connections.set(self.stats.connections.get() + 1);
                self.connection = Some(connection);
            }
            Control::StopQueue { index, done } => match self.queues.get_mut(index) {
                Some(queue) => {
                    queue.polling = false;
                    queue.stop_waiters.push(done);
                    self.server.end_lock_waits(true);
                    // A stopping ring (migration, VM reset) does not wait
                    // for the rate: what QoS holds is served now, and
                    // charged nothing.
                    let held = queue.deferred.as_mut().map(Gate::take_all).unwrap_or_default();
                    for (chain, mem, _) in held {
                        self.start(index, chain, mem, None);
                    }
                }
                None => {
                    let _ = done.send(());
                }
            },
            Control::Disconnected { done } => {
                self.connection = None;
                for queue in &mut self.queues {
                    queue.polling = false;
                    // Requests of a frontend that left are not served.
                    let held = queue.deferred.as_mut().map(Gate::take_all).unwrap_or_default();
                    queue.in_flight.set(queue.in_flight.get() - held.len());
                }
                self.disconnects.push(done);
                self.server.end_lock_waits(true);
            }
            // QEMU saves only with every ring stopped, and each stop waited
            // for its requests: the state never describes half a request.
            Control::SaveState { done } if self.queues.iter().any(|q| q.in_flight.get() > 0) => {
                let _ = done.send(Err(TransferError::InFlight));
            }
            Control::SaveState { done } => self.server.save_state(done),
            Control::LoadState { state, done } => self.server.load_state(*state, done),
        }
    }

    /// Return finished chains to the used ring and signal the guest once
    /// for the batch, if it asked to be told.
    fn complete(&mut self, index: usize) -> bool {
        let queue = &self.queues[index];
        if queue.completed.borrow().is_empty() {
            return false;
        }
        // Swapped with a spare of the same capacity: no allocation per pass.
        let mut finished = std::mem::take(&mut self.queues[index].spare);
        std::mem::swap(&mut *self.queues[index].completed.borrow_mut(), &mut finished);
        let vring = self.connection.as_ref().and_then(|c| c.vrings.get()).and_then(|v| v.get(index));
        // Without a frontend, nobody is told.
        for (head, written) in finished.drain(..) {
            if vring.is_some_and(|vring| vring.add_used(head, written).is_err()) {
                self.stats.dropped.set(self.stats.dropped.get() + 1);
                self.stats.last_drop.set(Some("used ring not writable"));
            }
        }
        self.queues[index].spare = finished;
        let Some(vring) = vring else { return true };
        if vring.needs_notification().unwrap_or(true) {
            self.stats.signals.set(self.stats.signals.get() + 1);
            let _ = vring.signal_used_queue();
        }
        true
    }

    /// Pop up to a batch of chains from queue `index` and start a task for
    /// each.
    fn pop(&mut self, index: usize, now: Instant) -> bool {
        let Some(connection) = self.connection.clone() else { return false };
        let Some(vring) = connection.vrings.get().and_then(|v| v.get(index)) else { return false };
        let mem = connection.mem.memory().into_inner();
        let mut popped = 0;
        let mut refused = false;
        {
            let mut state = vring.get_mut();
            if !state.get_queue().ready() || !state.is_enabled() {
                self.queues[index].polling = false;
                return false;
            }
            let Some(waiting) = available(state.get_queue(), &mem) else {
                self.mark_broken(index);
                return false;
            };
            let waiting = usize::from(waiting);
            self.queues[index].broken = false;
            self.queues[index].ring_size = usize::from(state.get_queue().size());
            let cap = self.queues[index].in_flight_cap(self.in_flight_max);
            while popped < POP_BATCH.min(waiting) && self.queues[index].in_flight.get() < cap {
                // Beside a busier export, this one waits its turn: the
                // chains stay in the ring, polled, until it has credit.
                if !self.share.as_ref().is_none_or(reactor::Share::admits) {
                    refused = true;
                    break;
                }
                let Some(chain) = state.get_queue_mut().pop_descriptor_chain(mem.clone()) else { break };
                popped += 1;
                let in_flight = &self.queues[index].in_flight;
                in_flight.set(in_flight.get() + 1);
                let stats = &self.stats;
                stats.in_flight_max.set(stats.in_flight_max.get().max(in_flight.get()));
                stats.chains.set(stats.chains.get() + 1);
                let (chain, charged) = match &mut self.queues[index].deferred {
                    Some(gate) if !gate.open() => {
                        let charge = charge_of_chain(&chain);
                        let charged = Charged::new(gate.qos().clone(), charge);
                        match gate.offer((chain, mem.clone(), Some(charged)), charge, now) {
                            Some((admitted, _, charged)) => (admitted, charged),
                            None => continue,
                        }
                    }
                    _ => (chain, None),
                };
                self.start(index, chain, mem.clone(), charged);
            }
        }
        let queue = &mut self.queues[index];
        if popped > 0 || refused {
            // A queue held back by its share is not idle: it has work.
            queue.idle_since = None;
            return popped > 0;
        }
        match queue.idle_since {
            None => queue.idle_since = Some(now),
            Some(since) if now.duration_since(since) >= self.poll_idle => {
                // Ask for kicks again; true means something slipped in
                // meanwhile, so keep polling.
                queue.idle_since = None;
                queue.polling = matches!(vring.enable_notification(), Ok(true));
            }
            Some(_) => {}
        }
        false
    }

    /// Start the task that serves `chain`, counted in flight already.
    fn start(&self, index: usize, chain: Chain, mem: Arc<GuestRam>, charged: Option<Charged>) {
        let queue = &self.queues[index];
        let finish = Finish {
            in_flight: queue.in_flight.clone(),
            completed: queue.completed.clone(),
            stats: self.stats.clone(),
        };
        let _entered = self.share.as_ref().map(reactor::Share::enter);
        self.server.serve(chain, mem, charged, finish);
    }

    /// Start the requests QoS held back on queue `index` whose turn came.
    fn release_deferred(&mut self, index: usize, now: Instant) -> bool {
        let Some(mut gate) = self.queues[index].deferred.take() else { return false };
        let ran = gate.drain(now, |(chain, mem, charged)| self.start(index, chain, mem, charged));
        self.queues[index].deferred = Some(gate);
        ran
    }

    /// Stop polling a queue whose driver broke it; count and log it once
    /// per break, the log at most a burst per window of this queue.
    fn mark_broken(&mut self, index: usize) {
        let queue = &mut self.queues[index];
        queue.polling = false;
        if !queue.broken {
            queue.broken = true;
            self.stats.broken_queues.set(self.stats.broken_queues.get() + 1);
            keelfs_base::ratelimited!(
                limit = &queue.broken_logged,
                tracing::warn!(
                    parent: &self.span,
                    queue = index,
                    "the driver moved the avail index more than a ring ahead; queue not served"
                )
            );
        }
    }

    fn finish_disconnects(&mut self) -> bool {
        if self.disconnects.is_empty() {
            return false;
        }
        if self.queues.iter().any(|q| q.in_flight.get() > 0) {
            self.server.end_lock_waits(false);
            return false;
        }
        for queue in &mut self.queues {
            queue.completed.borrow_mut().clear();
            queue.idle_since = None;
            for waiter in queue.stop_waiters.drain(..) {
                let _ = waiter.send(());
            }
        }
        let waiters = std::mem::take(&mut self.disconnects);
        self.server.reset(waiters);
        true
    }
}

impl<S: ChainServer> Poller for QueuePoller<S> {
    fn poll(&mut self, now: Instant) -> bool {
        let mut busy = false;
        self.share.get_or_insert_with(reactor::Share::join);
        while let Ok(control) = self.control.try_recv() {
            self.handle_control(control);
            busy = true;
        }
        if let Some(connection) = &self.connection {
            // Take this poller's kicks only; the others' stay for them.
            let kicks = connection.kicks.fetch_and(!self.mine, Ordering::AcqRel) & self.mine;
            if kicks != 0 && connection.vrings.get().is_some() {
                busy = true;
                let vrings = connection.vrings.get().expect("checked");
                for (index, queue) in self.queues.iter_mut().enumerate() {
                    if kicks & (1 << index) != 0 && queue.stop_waiters.is_empty() {
                        self.stats.kicks.set(self.stats.kicks.get() + 1);
                        if !queue.polling {
                            queue.polling = true;
                            queue.idle_since = None;
                            let _ = vrings[index].disable_notification();
                        }
                    }
                }
            }
        }
        for index in 0..self.queues.len() {
            if !self.owns(index) {
                continue;
            }
            busy |= self.complete(index);
            let queue = &mut self.queues[index];
            if !queue.stop_waiters.is_empty() {
                if queue.in_flight.get() == 0 {
                    for waiter in queue.stop_waiters.drain(..) {
                        let _ = waiter.send(());
                    }
                } else {
                    self.server.end_lock_waits(false);
                }
            }
            busy |= self.release_deferred(index, now);
            if self.queues[index].polling && !self.queues[index].throttled(self.in_flight_max) {
                busy |= self.pop(index, now);
            }
        }
        busy |= self.finish_disconnects();
        busy
    }

    fn wake_fd(&self) -> Option<RawFd> {
        Some(self.wake.as_raw_fd())
    }

    fn can_sleep(&self) -> bool {
        // A throttled queue waits for its QoS timer, which bounds the sleep.
        self.queues.iter().all(|q| (!q.polling || q.throttled(self.in_flight_max)) && q.completed.borrow().is_empty())
    }
}
