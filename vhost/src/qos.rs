//! Quality of service per export: IOPS and bandwidth limits on the data
//! requests (FUSE READ and WRITE, and COPY_FILE_RANGE as a write of what
//! it copies) of every transport serving one filesystem, enforced on the
//! export's reactor.
//!
//! Token buckets in integer arithmetic, one per limit: read, write and
//! combined operations, read, write and combined bytes. A request is
//! admitted when every bucket of its class holds its cost, and charged
//! then; otherwise it waits in its transport's FIFO for its class, so
//! that reads never wait behind throttled writes (and the reverse), and
//! requests of one class keep their order. Other requests (metadata,
//! FORGET, FLUSH, FSYNC...) are never charged nor held.
//!
//! A virtio request is charged from guest memory when it is taken, and
//! read from it again when served: a request rewritten between the two
//! pays the difference then, as debt (see [`Charged`]).
//!
//! Waiting needs no polling: the earliest moment a waiting request can be
//! admitted is armed as a reactor timer, which bounds the reactor's sleep,
//! so a queue that is only throttled costs no CPU.
//!
//! Everything here lives on one reactor (`Rc`, `Cell`): no lock, no
//! atomic. A guest chooses the sizes it sends, so every sum saturates.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::{Duration, Instant};

use keelfs_reactor as reactor;

use crate::fuse::abi::{opcode_of, Opcode};
use crate::fuse::request::{copy_range_of, io_size_of, COPY_RANGE_PREFIX_BYTES, IO_SIZE_AT};

/// The largest READ or WRITE the protocol carries (1 MiB): a bytes
/// bucket always holds at least this much, so that any request can pass.
/// A larger one is refused by the request path and charged as this.
pub const IO_BYTES_MAX: u64 = 1 << 20;

/// Bytes of a request [`Charge::of_request`] looks at: a READ's or
/// WRITE's size, or a COPY_FILE_RANGE's offsets and length.
pub(crate) const CHARGE_PREFIX_BYTES: usize =
    if IO_SIZE_AT + 4 > COPY_RANGE_PREFIX_BYTES { IO_SIZE_AT + 4 } else { COPY_RANGE_PREFIX_BYTES };

const NANOS_PER_SEC: i128 = 1_000_000_000;

/// Held requests are let through in batches at least this far apart. One
/// at a time (every 200 µs at 5000 IOPS) would keep an adaptive reactor
/// from ever being idle long enough to sleep; the buckets save up what
/// the wait earns, so the rate is the same.
const RELEASE_INTERVAL_MIN: Duration = Duration::from_millis(2);

/// Limits of one export. `None` or 0: that limit is off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QosLimits {
    pub read_iops: Option<u64>,
    pub write_iops: Option<u64>,
    /// READs and WRITEs together.
    pub iops: Option<u64>,
    pub read_bytes_per_sec: Option<u64>,
    pub write_bytes_per_sec: Option<u64>,
    /// Bytes read and written together.
    pub bytes_per_sec: Option<u64>,
    /// How much unused allowance an idle export may save up and spend at
    /// once, as this many milliseconds of each rate (never less than one
    /// request, or one largest I/O for a bytes limit). Held requests are
    /// let through in batches 2 ms or more apart, by a reactor timer with
    /// millisecond resolution: a burst shorter than that loses what the
    /// wait earns, and the rate achieved falls short.
    pub burst_ms: u32,
}

impl QosLimits {
    pub const BURST_MS_DEFAULT: u32 = 100;
    /// A minute: longer would let an export idle for a while then take the
    /// device for many seconds.
    pub const BURST_MS_MAX: u32 = 60_000;

    /// No limit at all.
    pub const UNLIMITED: Self = Self {
        read_iops: None,
        write_iops: None,
        iops: None,
        read_bytes_per_sec: None,
        write_bytes_per_sec: None,
        bytes_per_sec: None,
        burst_ms: Self::BURST_MS_DEFAULT,
    };

    /// True when no limit is on.
    pub fn is_unlimited(&self) -> bool {
        [
            self.read_iops,
            self.write_iops,
            self.iops,
            self.read_bytes_per_sec,
            self.write_bytes_per_sec,
            self.bytes_per_sec,
        ]
        .iter()
        .all(|l| l.unwrap_or(0) == 0)
    }

    fn check(&self) -> Result<(), QosError> {
        if !(1..=Self::BURST_MS_MAX).contains(&self.burst_ms) {
            return Err(QosError::Burst(self.burst_ms));
        }
        Ok(())
    }
}

impl Default for QosLimits {
    fn default() -> Self {
        Self::UNLIMITED
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QosError {
    #[error("burst_ms must be between 1 and {max}, not {0}", max = QosLimits::BURST_MS_MAX)]
    Burst(u32),
    #[error("started without a QoS limiter (ServeOptions::qos), so it cannot be limited")]
    NoLimiter,
}

/// The two classes of data requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    Read = 0,
    Write = 1,
}

/// What admitting one request costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Charge {
    /// None: not a data request, never held.
    pub(crate) class: Option<Class>,
    pub(crate) bytes: u64,
}

impl Charge {
    pub(crate) const FREE: Self = Self { class: None, bytes: 0 };

    /// The charge of a request from its first bytes (at least
    /// [`CHARGE_PREFIX_BYTES`] of them when there are that many). A READ
    /// or WRITE too short to hold its size is charged as one operation of
    /// no bytes; the request path refuses it.
    ///
    /// A COPY_FILE_RANGE is charged as a WRITE of the bytes the
    /// filesystem copies rather than shares (issue 37): a clone of whole
    /// blocks costs one operation, an unaligned copy its bytes.
    pub(crate) fn of_request(prefix: &[u8]) -> Self {
        let Some(opcode) = opcode_of(prefix) else { return Self::FREE };
        let (class, bytes) = match opcode {
            o if o == Opcode::Read as u32 => (Class::Read, io_size_of(prefix).map_or(0, u64::from)),
            o if o == Opcode::Write as u32 => (Class::Write, io_size_of(prefix).map_or(0, u64::from)),
            o if o == Opcode::CopyFileRange as u32 => {
                let copied =
                    copy_range_of(prefix).map(|(from, to, len)| keelfs_fs::copy_range_copied_bytes(from, to, len));
                (Class::Write, copied.unwrap_or(0))
            }
            _ => return Self::FREE,
        };
        Self { class: Some(class), bytes: bytes.min(IO_BYTES_MAX) }
    }
}

/// One limit: `tokens` are units (operations or bytes) times 10^9, so
/// that a refill of `elapsed_ns × rate` is exact. Below zero when a
/// request served cost more than it was charged when admitted (see
/// [`Charged`]): that debt is paid before anything else passes.
#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    /// Units per second; 0: off.
    rate: u64,
    tokens: i128,
    capacity: i128,
}

/// `cost` units in tokens. At most u64::MAX × 10^9, far inside i128.
fn tokens_of(cost: u64) -> i128 {
    i128::from(cost) * NANOS_PER_SEC
}

impl Bucket {
    /// A bucket for `rate` units per second, full. `least` is the most one
    /// request can cost: the bucket always holds that much.
    fn new(rate: Option<u64>, burst_ms: u32, least: u64) -> Self {
        let rate = rate.unwrap_or(0);
        let burst = i128::from(rate) * i128::from(burst_ms) * 1_000_000;
        let capacity = burst.max(tokens_of(least));
        Self { rate, tokens: capacity, capacity }
    }

    fn on(&self) -> bool {
        self.rate != 0
    }

    fn refill(&mut self, elapsed_ns: u64) {
        // u64 × u64 fits a u128, not always an i128.
        let earned = i128::from(elapsed_ns).saturating_mul(i128::from(self.rate));
        self.tokens = self.tokens.saturating_add(earned).min(self.capacity);
    }

    fn holds(&self, cost: u64) -> bool {
        !self.on() || self.tokens >= tokens_of(cost)
    }

    /// Take `cost`, into debt if the bucket does not hold it.
    fn take(&mut self, cost: u64) {
        if self.on() {
            self.tokens = self.tokens.saturating_sub(tokens_of(cost));
        }
    }

    /// Nanoseconds until the bucket holds `cost`.
    fn wait_ns(&self, cost: u64) -> u64 {
        if self.holds(cost) {
            return 0;
        }
        // Positive, as the bucket does not hold `cost`.
        let missing = tokens_of(cost).saturating_sub(self.tokens).unsigned_abs();
        u64::try_from(missing.div_ceil(u128::from(self.rate))).unwrap_or(u64::MAX)
    }

    /// Take a new limit: the tokens saved stay, up to the new capacity.
    fn retune(&mut self, new: Bucket) {
        let tokens = if self.on() { self.tokens.min(new.capacity) } else { new.capacity };
        *self = Bucket { tokens, ..new };
    }
}

/// The buckets of a [`QosLimits`], indexed by [`Class`] then combined.
#[derive(Debug)]
struct Buckets {
    ops: [Bucket; 3],
    bytes: [Bucket; 3],
    refilled: Instant,
}

impl Buckets {
    fn new(limits: &QosLimits, now: Instant) -> Self {
        let ops = |rate| Bucket::new(rate, limits.burst_ms, 1);
        let bytes = |rate| Bucket::new(rate, limits.burst_ms, IO_BYTES_MAX);
        Self {
            ops: [ops(limits.read_iops), ops(limits.write_iops), ops(limits.iops)],
            bytes: [bytes(limits.read_bytes_per_sec), bytes(limits.write_bytes_per_sec), bytes(limits.bytes_per_sec)],
            refilled: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.refilled);
        let elapsed_ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.refilled = self.refilled.max(now);
        for bucket in self.ops.iter_mut().chain(self.bytes.iter_mut()) {
            bucket.refill(elapsed_ns);
        }
    }

    /// The buckets `class` draws from, each with its cost.
    fn of(&mut self, class: Class, bytes: u64) -> [(&mut Bucket, u64); 4] {
        let [r, w, all] = &mut self.ops;
        let [rb, wb, allb] = &mut self.bytes;
        match class {
            Class::Read => [(r, 1), (all, 1), (rb, bytes), (allb, bytes)],
            Class::Write => [(w, 1), (all, 1), (wb, bytes), (allb, bytes)],
        }
    }

    /// Charge and admit, or leave everything as it was.
    fn admit(&mut self, class: Class, bytes: u64, now: Instant) -> bool {
        self.refill(now);
        let mut buckets = self.of(class, bytes);
        if !buckets.iter().all(|(b, cost)| b.holds(*cost)) {
            return false;
        }
        for (b, cost) in &mut buckets {
            b.take(*cost);
        }
        true
    }

    /// When a request of `class` costing `bytes` can be admitted, if no
    /// other takes the tokens first.
    fn ready_at(&mut self, class: Class, bytes: u64, now: Instant) -> Instant {
        self.refill(now);
        let wait = self.of(class, bytes).iter().map(|(b, cost)| b.wait_ns(*cost)).max().unwrap_or(0);
        now.checked_add(Duration::from_nanos(wait)).unwrap_or(now + Duration::from_secs(3600))
    }

    /// Charge what a request served costs beyond what it was charged,
    /// `charged` (per bucket, see [`Costs`]), which then covers it. The
    /// buckets go into debt if they do not hold it. Returns when that debt
    /// is paid, if there is any.
    fn settle(&mut self, charged: &mut Costs, served: Charge, now: Instant) -> Option<Instant> {
        self.refill(now);
        let served = Costs::of(served);
        let mut wait = None;
        for (i, bucket) in self.ops.iter_mut().chain(self.bytes.iter_mut()).enumerate() {
            let extra = served.0[i].saturating_sub(charged.0[i]);
            if extra == 0 {
                continue;
            }
            charged.0[i] = served.0[i];
            bucket.take(extra);
            wait = wait.max(Some(bucket.wait_ns(0)));
        }
        let wait = wait.filter(|&ns| ns > 0)?;
        Some(now.checked_add(Duration::from_nanos(wait)).unwrap_or(now + Duration::from_secs(3600)))
    }

    fn retune(&mut self, limits: &QosLimits, now: Instant) {
        self.refill(now);
        let new = Self::new(limits, now);
        for (old, new) in self.ops.iter_mut().zip(new.ops).chain(self.bytes.iter_mut().zip(new.bytes)) {
            old.retune(new);
        }
    }
}

/// What a request costs each bucket: ops (read, write, combined) then
/// bytes (read, write, combined), as [`Buckets`] orders them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Costs([u64; 6]);

impl Costs {
    fn of(charge: Charge) -> Self {
        let b = charge.bytes;
        Self(match charge.class {
            None => [0; 6],
            Some(Class::Read) => [1, 0, 1, b, 0, b],
            Some(Class::Write) => [0, 1, 1, 0, b, b],
        })
    }
}

/// What a request was charged when its transport took it, to settle
/// against the request as it is served. A virtio request stays in guest
/// memory, where the guest can rewrite it between the two (a free
/// GETATTR when looked at, a 1 MiB WRITE when served): the limits must
/// hold for what is served.
pub(crate) struct Charged {
    qos: Rc<Qos>,
    costs: Costs,
}

impl Charged {
    pub(crate) fn new(qos: Rc<Qos>, charge: Charge) -> Self {
        Self { qos, costs: Costs::of(charge) }
    }

    /// `request` (its first [`CHARGE_PREFIX_BYTES`] at least, when it has
    /// them) is about to be served: charge what it costs beyond what was
    /// charged so far, and wait until the debt that makes is paid. A
    /// request served as it was taken costs nothing more and never waits.
    /// What was charged in excess stays spent.
    pub(crate) async fn settle(&mut self, request: &[u8]) {
        let now = reactor::now();
        let paid_at = self.qos.buckets.borrow_mut().settle(&mut self.costs, Charge::of_request(request), now);
        if let Some(at) = paid_at {
            self.qos.debts.set(self.qos.debts.get() + 1);
            reactor::sleep_until(at).await;
        }
    }
}

/// Counters of one export's limiter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QosStats {
    /// Requests that had to wait, ever, per class (read, write).
    pub deferred: [u64; 2],
    /// Requests waiting now, per class.
    pub waiting: [u64; 2],
    /// Requests that cost more when served than when they were charged:
    /// their guest rewrote them meanwhile. Each waited to pay the
    /// difference.
    pub debts: u64,
}

/// The limiter of one export, shared by every transport serving it on its
/// reactor (the vhost-user queues and the host mount), and the handle to
/// change its limits at run time.
pub struct Qos {
    limits: Cell<QosLimits>,
    /// No limit is on: requests need not even be looked at.
    unlimited: Cell<bool>,
    buckets: RefCell<Buckets>,
    deferred: [Cell<u64>; 2],
    waiting: [Cell<u64>; 2],
    debts: Cell<u64>,
    /// Bumped at each change of limits: a held request may then pass
    /// sooner than its gate worked out.
    generation: Cell<u64>,
}

impl Qos {
    /// A limiter for the current reactor, its buckets full at the
    /// reactor's time.
    ///
    /// # Panics
    /// Outside a reactor thread.
    pub fn new(limits: QosLimits) -> Result<Rc<Self>, QosError> {
        limits.check()?;
        Ok(Rc::new(Self {
            limits: Cell::new(limits),
            unlimited: Cell::new(limits.is_unlimited()),
            buckets: RefCell::new(Buckets::new(&limits, reactor::now())),
            deferred: Default::default(),
            waiting: Default::default(),
            debts: Cell::new(0),
            generation: Cell::new(0),
        }))
    }

    pub fn limits(&self) -> QosLimits {
        self.limits.get()
    }

    /// Change the limits at once. Tokens saved stay, up to the new burst;
    /// waiting requests keep their order and are admitted at the new
    /// rates from the next poll. What the buckets earned up to the
    /// reactor's time is counted at the old rates.
    pub fn set_limits(&self, limits: QosLimits) -> Result<(), QosError> {
        limits.check()?;
        self.buckets.borrow_mut().retune(&limits, reactor::now());
        self.limits.set(limits);
        self.unlimited.set(limits.is_unlimited());
        self.generation.set(self.generation.get() + 1);
        Ok(())
    }

    pub fn stats(&self) -> QosStats {
        QosStats {
            deferred: [self.deferred[0].get(), self.deferred[1].get()],
            waiting: [self.waiting[0].get(), self.waiting[1].get()],
            debts: self.debts.get(),
        }
    }

    fn admit(&self, class: Class, bytes: u64, now: Instant) -> bool {
        self.buckets.borrow_mut().admit(class, bytes, now)
    }

    /// Admit the export's own background reads (a scrub's `bytes`, at
    /// most `IO_BYTES_MAX`) if the read limits have the tokens now, after
    /// the guest's: never while a guest read waits. Not queued: Err says
    /// when to ask again.
    pub fn admit_background_read(&self, bytes: u64, now: Instant) -> Result<(), Instant> {
        if self.unlimited.get() {
            return Ok(());
        }
        if self.waiting[Class::Read as usize].get() > 0 {
            return Err(now + Duration::from_millis(1));
        }
        let mut buckets = self.buckets.borrow_mut();
        match buckets.admit(Class::Read, bytes.min(IO_BYTES_MAX), now) {
            true => Ok(()),
            false => Err(buckets.ready_at(Class::Read, bytes.min(IO_BYTES_MAX), now)),
        }
    }
}

/// A transport's requests held by a [`Qos`]: one FIFO per class. It holds
/// at most what its transport lets in flight.
pub(crate) struct Gate<T> {
    qos: Rc<Qos>,
    fifos: [VecDeque<(T, u64)>; 2],
    /// The class drained first next time, alternating, so that neither
    /// takes every token of a combined limit.
    first: usize,
    /// No held request can pass before this (at the limits of this
    /// generation): tokens only grow with time, and other gates only
    /// take them. Spares a reactor busy with other work the bucket
    /// arithmetic on every tick.
    not_before: Option<(Instant, u64)>,
}

impl<T> Gate<T> {
    pub(crate) fn new(qos: Rc<Qos>) -> Self {
        Self { qos, fifos: [VecDeque::new(), VecDeque::new()], first: 0, not_before: None }
    }

    /// Nothing is held and no limit is on: a new request passes without
    /// being looked at (every export has a limiter, mostly unlimited).
    pub(crate) fn open(&self) -> bool {
        self.qos.unlimited.get() && self.is_empty()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.fifos.iter().all(VecDeque::is_empty)
    }

    pub(crate) fn qos(&self) -> &Rc<Qos> {
        &self.qos
    }

    /// A new request: returned to run now, or kept (None) until its turn.
    pub(crate) fn offer(&mut self, item: T, charge: Charge, now: Instant) -> Option<T> {
        let Some(class) = charge.class else { return Some(item) };
        let fifo = &mut self.fifos[class as usize];
        if fifo.is_empty() && self.qos.admit(class, charge.bytes, now) {
            return Some(item);
        }
        let first_held = fifo.is_empty();
        fifo.push_back((item, charge.bytes));
        let (deferred, waiting) = (&self.qos.deferred[class as usize], &self.qos.waiting[class as usize]);
        deferred.set(deferred.get() + 1);
        waiting.set(waiting.get() + 1);
        // Behind others of its class it passes after them, whose wake-up
        // is set. First, it needs one, unless the other class's comes
        // sooner (that drain then looks at both).
        if first_held {
            let at = self.qos.buckets.borrow_mut().ready_at(class, charge.bytes, now).max(now + RELEASE_INTERVAL_MIN);
            if self.valid_not_before(now).filter(|&sooner| sooner <= at).is_none() {
                self.wake_at(at);
            }
        }
        None
    }

    /// Run every waiting request whose turn has come, in order per class;
    /// true if any ran.
    pub(crate) fn drain(&mut self, now: Instant, mut run: impl FnMut(T)) -> bool {
        if self.is_empty() {
            return false;
        }
        if self.valid_not_before(now).is_some() {
            return false;
        }
        let mut ran = false;
        for class in [self.first, 1 - self.first] {
            let class_of = if class == 0 { Class::Read } else { Class::Write };
            while let Some(&(_, bytes)) = self.fifos[class].front() {
                if !self.qos.admit(class_of, bytes, now) {
                    break;
                }
                let (item, _) = self.fifos[class].pop_front().expect("a front");
                self.qos.waiting[class].set(self.qos.waiting[class].get() - 1);
                run(item);
                ran = true;
            }
        }
        self.first = 1 - self.first;
        self.arm(now);
        ran
    }

    /// Hand every waiting request over, charged or not: for a queue that
    /// must stop now (its requests are served at once) or whose frontend
    /// left (dropped).
    pub(crate) fn take_all(&mut self) -> Vec<T> {
        let mut all = Vec::new();
        for (class, fifo) in self.fifos.iter_mut().enumerate() {
            let waiting = &self.qos.waiting[class];
            waiting.set(waiting.get() - fifo.len() as u64);
            all.extend(fifo.drain(..).map(|(item, _)| item));
        }
        all
    }

    /// The next drain's time, once the heads of both classes have had
    /// their turn.
    fn arm(&mut self, now: Instant) {
        let mut buckets = self.qos.buckets.borrow_mut();
        let next = [Class::Read, Class::Write]
            .into_iter()
            .filter_map(|class| self.fifos[class as usize].front().map(|&(_, bytes)| (class, bytes)))
            .map(|(class, bytes)| buckets.ready_at(class, bytes, now))
            .min();
        drop(buckets);
        self.not_before = None;
        if let Some(at) = next {
            self.wake_at(at.max(now + RELEASE_INTERVAL_MIN));
        }
    }

    /// When the next drain is due, if it is still ahead and the limits
    /// have not changed since it was worked out.
    fn valid_not_before(&self, now: Instant) -> Option<Instant> {
        let generation = self.qos.generation.get();
        self.not_before.filter(|&(at, seen)| at > now && seen == generation).map(|(at, _)| at)
    }

    /// Drain no sooner than `at`, and have the reactor wake then: a timer
    /// bounds its sleep, and every poller runs in the tick that fires it.
    /// A timer armed before for another time still fires, harmlessly.
    fn wake_at(&mut self, at: Instant) {
        self.not_before = Some((at, self.qos.generation.get()));
        reactor::spawn_local(reactor::sleep_until(at));
    }
}

impl<T> Drop for Gate<T> {
    fn drop(&mut self) {
        drop(self.take_all());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iops(n: u64) -> QosLimits {
        QosLimits { iops: Some(n), ..QosLimits::UNLIMITED }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_bucket_refills_at_its_rate_up_to_its_burst() {
        let t0 = Instant::now();
        let mut b = Buckets::new(&iops(1000), t0);
        // 100 ms of 1000/s saved up at the start: a burst of 100.
        let burst = (0..1000).take_while(|_| b.admit(Class::Read, 4096, t0)).count();
        assert_eq!(burst, 100);
        assert!(!b.admit(Class::Write, 0, t0), "the combined limit holds writes too");
        // 10 ms later, 10 more; never more than the burst however long.
        assert_eq!((0..1000).take_while(|_| b.admit(Class::Read, 0, t0 + ms(10))).count(), 10);
        assert_eq!((0..1000).take_while(|_| b.admit(Class::Read, 0, t0 + ms(60_000))).count(), 100);
    }

    #[test]
    fn waiting_is_computed_exactly_and_a_burst_holds_one_largest_io() {
        let t0 = Instant::now();
        // 1 MiB/s with a 1 ms burst would hold 1 KiB: it holds 1 MiB.
        let limits = QosLimits { read_bytes_per_sec: Some(1 << 20), burst_ms: 1, ..QosLimits::UNLIMITED };
        let mut b = Buckets::new(&limits, t0);
        assert!(b.admit(Class::Read, IO_BYTES_MAX, t0), "a full bucket passes the largest I/O");
        assert!(!b.admit(Class::Read, 4096, t0));
        assert!(b.admit(Class::Write, IO_BYTES_MAX, t0), "a read limit does not hold writes");
        let at = b.ready_at(Class::Read, 4096, t0);
        assert_eq!(at - t0, Duration::from_nanos(3_906_250), "4 KiB at 1 MiB/s");
        assert!(!b.admit(Class::Read, 4096, at - Duration::from_nanos(1)));
        assert!(b.admit(Class::Read, 4096, at));
    }

    #[test]
    fn huge_rates_and_sizes_saturate_rather_than_overflow() {
        let t0 = Instant::now();
        let all = Some(u64::MAX);
        let limits = QosLimits {
            read_iops: all,
            write_iops: Some(1),
            iops: all,
            read_bytes_per_sec: all,
            write_bytes_per_sec: Some(1),
            bytes_per_sec: all,
            burst_ms: QosLimits::BURST_MS_MAX,
        };
        let mut b = Buckets::new(&limits, t0);
        assert!(b.admit(Class::Read, u64::MAX, t0 + Duration::from_secs(1 << 40)));
        assert!(b.admit(Class::Write, IO_BYTES_MAX, t0));
        // One byte a second: the next largest write is twelve days away,
        // and that sum does not overflow.
        let at = b.ready_at(Class::Write, u64::MAX, t0);
        assert!(at > t0 + Duration::from_secs(3600), "{:?}", at - t0);
        // A guest's claimed size is capped at the protocol's largest.
        let mut read = [0u8; CHARGE_PREFIX_BYTES];
        read[4..8].copy_from_slice(&(Opcode::Read as u32).to_le_bytes());
        read[IO_SIZE_AT..IO_SIZE_AT + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Charge::of_request(&read), Charge { class: Some(Class::Read), bytes: IO_BYTES_MAX });
        assert_eq!(Charge::of_request(&read[..20]), Charge { class: Some(Class::Read), bytes: 0 });
        assert_eq!(Charge::of_request(&read[..3]), Charge::FREE, "too short to say: the request path refuses it");
        read[4..8].copy_from_slice(&(Opcode::Getattr as u32).to_le_bytes());
        assert_eq!(Charge::of_request(&read), Charge::FREE, "metadata is never charged");
    }

    /// copy_file_range: (in offset, out offset, length) at their places.
    fn copy_request(from: u64, to: u64, len: u64) -> [u8; CHARGE_PREFIX_BYTES] {
        let mut r = [0u8; CHARGE_PREFIX_BYTES];
        r[4..8].copy_from_slice(&(Opcode::CopyFileRange as u32).to_le_bytes());
        r[48..56].copy_from_slice(&from.to_le_bytes());
        r[72..80].copy_from_slice(&to.to_le_bytes());
        r[80..88].copy_from_slice(&len.to_le_bytes());
        r
    }

    #[test]
    fn a_copy_is_charged_the_bytes_it_copies_not_those_it_shares() {
        let write = |bytes| Charge { class: Some(Class::Write), bytes };
        // 10 GiB over offsets that line up: the whole blocks are shared.
        assert_eq!(Charge::of_request(&copy_request(0, 8192, 10 << 30)), write(0));
        assert_eq!(Charge::of_request(&copy_request(100, 4196, 10 << 30)), write(3996 + (((10 << 30) - 3996) % 4096)));
        // Offsets that do not: copied, as much as one WRITE at most.
        assert_eq!(Charge::of_request(&copy_request(0, 100, 10 << 30)), write(IO_BYTES_MAX));
        assert_eq!(Charge::of_request(&copy_request(0, 100, 5000)), write(5000));
        // Too short to say: one operation, no bytes (the request path
        // refuses it).
        assert_eq!(Charge::of_request(&copy_request(0, 100, 5000)[..60]), write(0));
    }

    #[test]
    fn a_new_limit_keeps_saved_tokens_up_to_its_burst() {
        let t0 = Instant::now();
        let mut b = Buckets::new(&iops(1000), t0);
        b.retune(&iops(100), t0);
        assert_eq!((0..1000).take_while(|_| b.admit(Class::Read, 0, t0)).count(), 10, "clamped to the new burst");
        b.retune(&iops(1000), t0);
        assert!(!b.admit(Class::Read, 0, t0), "raising a limit gives no tokens that were not earned");
        b.retune(&QosLimits::UNLIMITED, t0);
        assert!((0..1000).all(|_| b.admit(Class::Read, 0, t0)));
        b.retune(&iops(10), t0);
        assert_eq!((0..1000).take_while(|_| b.admit(Class::Read, 0, t0)).count(), 1, "a new limit starts full");
    }

    /// Run `test` on a reactor whose clock stands still: its time is
    /// what `reactor::now()` gives and the limiter counts from.
    fn in_reactor(test: impl FnOnce() + 'static) {
        let clock = reactor::Clock::Virtual(reactor::VirtualClock::new());
        let mut r = reactor::Reactor::new(reactor::ReactorConfig { clock, ..Default::default() }).unwrap();
        r.block_on(async move { test() });
    }

    fn read_of(bytes: u64) -> Charge {
        Charge { class: Some(Class::Read), bytes }
    }

    #[test]
    fn held_requests_keep_their_order_per_class_through_a_limit_change() {
        in_reactor(|| {
            let t0 = reactor::now();
            let qos = Qos::new(QosLimits { read_iops: Some(10), burst_ms: 100, ..QosLimits::UNLIMITED }).unwrap();
            let mut gate = Gate::new(Rc::clone(&qos));
            assert_eq!(gate.offer(0, read_of(0), t0), Some(0), "the burst: one request");
            for i in 1..=5 {
                assert_eq!(gate.offer(i, read_of(0), t0), None);
            }
            let write = Charge { class: Some(Class::Write), bytes: 1 << 20 };
            assert_eq!(gate.offer(100, write, t0), Some(100), "writes do not wait behind held reads");
            assert_eq!(gate.offer(200, Charge::FREE, t0), Some(200));
            assert_eq!(qos.stats(), QosStats { deferred: [5, 0], waiting: [5, 0], debts: 0 });
            qos.set_limits(QosLimits { read_iops: Some(20), burst_ms: 100, ..QosLimits::UNLIMITED }).unwrap();
            let mut ran = Vec::new();
            // 20/s: one every 50 ms, in the order they came.
            assert!(!gate.drain(t0 + ms(40), |i| ran.push(i)));
            assert!(gate.drain(t0 + ms(50), |i| ran.push(i)));
            assert!(gate.drain(t0 + ms(150), |i| ran.push(i)));
            assert_eq!(ran, [1, 2, 3]);
            assert_eq!(qos.stats().waiting, [2, 0]);
            drop(gate);
            assert_eq!(
                qos.stats(),
                QosStats { deferred: [5, 0], waiting: [0, 0], debts: 0 },
                "a dropped gate waits no more"
            );
            assert!(qos.set_limits(QosLimits { burst_ms: 0, ..QosLimits::UNLIMITED }).is_err());
        });
    }

    /// 16 requests kept in flight, each taking 50 µs once let through,
    /// on a virtual clock ticking every 10 µs: they pass at the rate, in
    /// batches no closer than RELEASE_INTERVAL_MIN.
    #[test]
    fn held_requests_pass_at_the_rate_with_many_in_flight() {
        in_reactor(|| {
            let t0 = reactor::now();
            let qos = Qos::new(iops(5000)).unwrap();
            let mut gate = Gate::new(Rc::clone(&qos));
            let (service, tick) = (Duration::from_micros(50), Duration::from_micros(10));
            let mut in_flight: Vec<Instant> = Vec::new();
            let (mut now, mut done, mut drains) = (t0, 0u64, 0u64);
            let mut returning = 16;
            while now < t0 + Duration::from_secs(2) {
                let mut started = 0;
                if gate.drain(now, |()| started += 1) {
                    drains += 1;
                }
                for _ in 0..returning {
                    started += usize::from(gate.offer((), read_of(4096), now).is_some());
                }
                in_flight.resize(in_flight.len() + started, now + service);
                now += tick;
                let before = in_flight.len();
                in_flight.retain(|&t| t > now);
                returning = before - in_flight.len();
                done += returning as u64;
            }
            // The 100 ms burst (500), then 5000 a second.
            assert!((10_450..=10_520).contains(&done), "{done} done in 2 s");
            assert!(drains <= 1000, "{drains} drains: batches closer than {RELEASE_INTERVAL_MIN:?}");
            assert_eq!(qos.stats().waiting[0] as usize, 16 - in_flight.len() - returning);
        });
    }

    #[test]
    fn an_unlimited_limiter_is_open_until_limits_are_set() {
        in_reactor(|| {
            let t0 = reactor::now();
            let qos = Qos::new(QosLimits::UNLIMITED).unwrap();
            let mut gate = Gate::new(Rc::clone(&qos));
            assert!(gate.open());
            qos.set_limits(QosLimits { write_iops: Some(1), burst_ms: 1000, ..QosLimits::UNLIMITED }).unwrap();
            assert!(!gate.open(), "limited from now on");
            let write = Charge { class: Some(Class::Write), bytes: 0 };
            assert_eq!(gate.offer(1, write, t0), Some(1), "a new limit starts with its burst");
            assert_eq!(gate.offer(2, write, t0), None);
            qos.set_limits(QosLimits::UNLIMITED).unwrap();
            assert!(!gate.open(), "not while requests are held: they go first");
            let mut ran = Vec::new();
            assert!(gate.drain(t0, |i| ran.push(i)));
            assert_eq!((ran, gate.open()), (vec![2], true));
        });
    }

    #[test]
    fn a_request_served_dearer_than_charged_pays_the_difference_as_debt() {
        let t0 = Instant::now();
        let limits = QosLimits { write_bytes_per_sec: Some(1 << 20), burst_ms: 1, ..QosLimits::UNLIMITED };
        let mut b = Buckets::new(&limits, t0);
        let write = Charge { class: Some(Class::Write), bytes: IO_BYTES_MAX };
        // Free when taken (a GETATTR then), a 1 MiB WRITE when served.
        let mut charged = Costs::of(Charge::FREE);
        assert_eq!(b.settle(&mut charged, write, t0), None, "the full bucket pays at once");
        assert_eq!(charged, Costs::of(write));
        assert_eq!(b.settle(&mut charged, write, t0), None, "what was charged is not charged again");
        let mut charged = Costs::of(Charge { class: Some(Class::Read), bytes: 0 });
        assert_eq!(b.settle(&mut charged, write, t0), Some(t0 + Duration::from_secs(1)), "1 MiB owed at 1 MiB/s");
        // The debt holds every later write until it is paid.
        assert!(!b.admit(Class::Write, 0, t0 + ms(999)));
        assert!(b.admit(Class::Write, 0, t0 + ms(1000)));
        assert!(!b.admit(Class::Write, 4096, t0 + ms(1000)));
        assert_eq!(b.ready_at(Class::Write, 4096, t0 + ms(1000)), t0 + ms(1000) + Duration::from_nanos(3_906_250));
        // Served cheaper than charged: nothing given back, nothing owed.
        let mut charged = Costs::of(write);
        assert_eq!(b.settle(&mut charged, Charge::FREE, t0 + ms(1000)), None);
        assert_eq!(charged, Costs::of(write));
    }

    /// Requests charged as reads of nothing when taken, each served as a
    /// 64 KiB read, 16 in flight on a virtual clock: the rate served
    /// still converges to the limit, the debts holding the gate and the
    /// requests that made them.
    #[test]
    fn requests_served_dearer_than_charged_still_pass_at_the_rate() {
        in_reactor(|| {
            let t0 = reactor::now();
            let limits = QosLimits { read_bytes_per_sec: Some(1 << 20), ..QosLimits::UNLIMITED };
            let qos = Qos::new(limits).unwrap();
            let mut gate = Gate::new(Rc::clone(&qos));
            let served = Charge { class: Some(Class::Read), bytes: 64 << 10 };
            let (service, tick) = (Duration::from_micros(50), Duration::from_micros(10));
            // When each request admitted finishes: after its debt is paid.
            let mut in_flight: Vec<Instant> = Vec::new();
            let (mut now, mut bytes_done) = (t0, 0u64);
            let mut returning = 16;
            while now < t0 + Duration::from_secs(4) {
                let mut started = Vec::new();
                gate.drain(now, |costs: Costs| started.push(costs));
                for _ in 0..returning {
                    started.extend(gate.offer(Costs::of(read_of(0)), read_of(0), now));
                }
                for mut charged in started {
                    let paid_at = qos.buckets.borrow_mut().settle(&mut charged, served, now).unwrap_or(now);
                    in_flight.push(paid_at + service);
                }
                now += tick;
                let before = in_flight.len();
                in_flight.retain(|&t| t > now);
                returning = before - in_flight.len();
                bytes_done += returning as u64 * served.bytes;
            }
            // The burst (one largest I/O), then 1 MiB a second.
            let expected = 5u64 << 20;
            assert!(
                (expected * 97 / 100..=expected * 101 / 100).contains(&bytes_done),
                "{bytes_done} bytes in 4 s at 1 MiB/s"
            );
        });
    }

    #[test]
    fn zero_is_no_limit() {
        assert!(QosLimits::UNLIMITED.is_unlimited());
        assert!(QosLimits { iops: Some(0), ..QosLimits::UNLIMITED }.is_unlimited(), "0 is off");
        assert!(!QosLimits { read_bytes_per_sec: Some(1), ..QosLimits::UNLIMITED }.is_unlimited());
    }
}
