//! Block I/O as futures on a reactor.
//!
//! A [`DeviceChannel`] owns one core's [`IoQueue`]. Each I/O takes its
//! buffer by value and gives it back on completion, so the memory the
//! device reads or writes is owned by the channel while in flight: dropping
//! the future early cannot free memory under the device. This is the safe
//! face of [`IoQueue::submit`]'s contract.
//!
//! When the device queue is full, requests wait in FIFO order and are
//! submitted as completions free room; exhaustion is never an error.

use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use keelfs_bdev::{AlignedBuf, BdevError, Completion, Geometry, IoKind, IoQueue, IoRequest, IoVec, PoolBuf};

use super::{register_poller, Poller, PollerClass};

/// Completions handled per poll; bounds one iteration's work.
const COMPLETIONS_PER_POLL_MAX: usize = 256;

/// Copy `n` bytes with volatile loads and stores, 16 bytes at a time
/// where both sides are 16-aligned (SSE2 on x86-64, which every x86-64
/// has), else a word at a time where both are 8-aligned: memory another
/// agent may write concurrently (guest pages) is never read or written as
/// if the compiler owned it.
///
/// # Safety
/// `src` must be valid for `n` bytes of reads and `dst` for `n` bytes of
/// writes; the ranges must not overlap.
pub(crate) unsafe fn volatile_copy(src: *const u8, dst: *mut u8, n: usize) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__m128i;
        const WIDE: usize = std::mem::size_of::<__m128i>();
        if (src as usize).is_multiple_of(WIDE) && (dst as usize).is_multiple_of(WIDE) {
            while i + WIDE <= n {
                // SAFETY: i + WIDE <= n, both pointers are 16-aligned at i
                // (i is a multiple of WIDE), and the caller's ranges cover
                // [i, i+16). Any 16 bytes are a valid __m128i.
                unsafe {
                    std::ptr::write_volatile(
                        dst.add(i).cast::<__m128i>(),
                        std::ptr::read_volatile(src.add(i).cast::<__m128i>()),
                    )
                };
                i += WIDE;
            }
        }
    }
    const WORD: usize = std::mem::size_of::<u64>();
    // i is 0 or a multiple of 16: both sides are 8-aligned at i exactly
    // when they are at 0.
    if (src as usize).is_multiple_of(WORD) && (dst as usize).is_multiple_of(WORD) {
        while i + WORD <= n {
            // SAFETY: i + WORD <= n, both pointers are 8-aligned at i (i is
            // a multiple of WORD), and the caller's ranges cover [i, i+8).
            unsafe {
                std::ptr::write_volatile(dst.add(i).cast::<u64>(), std::ptr::read_volatile(src.add(i).cast::<u64>()))
            };
            i += WORD;
        }
    }
    while i < n {
        // SAFETY: i < n, inside both of the caller's ranges.
        unsafe { std::ptr::write_volatile(dst.add(i), std::ptr::read_volatile(src.add(i))) };
        i += 1;
    }
}

/// Lets a boxed buffer be turned back into its concrete type.
pub trait IntoAny: Any {
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<T: Any> IntoAny for T {
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// A buffer's segments: inline up to four, so that describing the usual
/// one- or two-segment buffer allocates nothing.
pub type IoVecs = smallvec::SmallVec<[IoVec; 4]>;

/// Memory a device may read or write while the channel owns it.
///
/// # Safety
/// `iovecs` must describe memory that this value owns or keeps alive, that
/// stays valid and at the same address when the value moves, and that
/// keelfs itself does not otherwise access while the value is inside the
/// channel. It need not be exclusive: guest pages may be written by the
/// guest at any time, as by any DMA-capable device's driver. So keelfs's
/// own CPU access to such memory ([`SharedBuffer`]) is volatile and forms
/// no Rust reference to it; what a racing guest gets is torn data of its
/// own making, never undefined behaviour in keelfs.
pub unsafe trait IoBuffer: IntoAny {
    fn iovecs(&mut self, out: &mut IoVecs);
}

// SAFETY: AlignedBuf owns a heap allocation that does not move with it.
unsafe impl IoBuffer for AlignedBuf {
    fn iovecs(&mut self, out: &mut IoVecs) {
        out.push(self.iovec());
    }
}

// SAFETY: a PoolBuf is the only handle to its part of the pool's region,
// which its Arc keeps alive.
unsafe impl IoBuffer for PoolBuf {
    fn iovecs(&mut self, out: &mut IoVecs) {
        out.push(self.iovec());
    }
}

// SAFETY: each element owns its own allocation, as above.
unsafe impl IoBuffer for Vec<AlignedBuf> {
    fn iovecs(&mut self, out: &mut IoVecs) {
        out.extend(self.iter_mut().map(|b| b.iovec()));
    }
}

/// `len` bytes of an aligned buffer from `start`, as I/O memory: a
/// request read whole into one buffer (its headers, then its data) gives
/// the device its data alone, with no copy. [`Self::into_inner`] gives
/// the whole buffer back, for the next request.
pub struct AlignedWindow {
    buf: AlignedBuf,
    start: usize,
    len: usize,
}

impl AlignedWindow {
    /// The window, or `buf` back when it does not lie inside it.
    pub fn new(buf: AlignedBuf, start: usize, len: usize) -> Result<Self, AlignedBuf> {
        match start.checked_add(len) {
            Some(end) if end <= buf.len() => Ok(Self { buf, start, len }),
            _ => Err(buf),
        }
    }

    /// The window's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    pub fn into_inner(self) -> AlignedBuf {
        self.buf
    }
}

// SAFETY: the window lies inside the AlignedBuf (checked in `new`, and
// the fields are private), which owns a heap allocation that does not
// move with it.
unsafe impl IoBuffer for AlignedWindow {
    fn iovecs(&mut self, out: &mut IoVecs) {
        let base = self.buf.as_mut_ptr().wrapping_add(self.start);
        out.push(IoVec { base, len: self.len });
    }
}

/// The empty buffer of a flush.
pub struct NoBuffer;

// SAFETY: names no memory.
unsafe impl IoBuffer for NoBuffer {
    fn iovecs(&mut self, _out: &mut IoVecs) {}
}

enum OpState {
    Free,
    Waiting,
    InFlight,
    Done(Result<u32, BdevError>),
}

struct Op {
    generation: u32,
    state: OpState,
    kind: IoKind,
    offset: u64,
    buffer: Option<Box<dyn IoBuffer>>,
    pool_index: Option<u16>,
    waker: Option<Waker>,
    /// The future was dropped: free the op when the device is done with it.
    abandoned: bool,
}

struct ChannelState {
    queue: Box<dyn IoQueue>,
    ops: Vec<Op>,
    free_ops: Vec<u32>,
    waiting: VecDeque<u32>,
    completions: Vec<Completion>,
    iovecs: IoVecs,
    stats: ChannelStats,
}

/// What a channel has done, for tests and the stats RPC.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChannelStats {
    pub submitted: u64,
    pub completed: u64,
    pub queue_full_waits: u64,
    pub in_flight_max: u64,
}

fn token_of(index: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(index)
}

impl ChannelState {
    fn alloc_op(
        &mut self,
        kind: IoKind,
        offset: u64,
        buffer: Box<dyn IoBuffer>,
        pool_index: Option<u16>,
    ) -> (u32, u32) {
        let index = match self.free_ops.pop() {
            Some(i) => i,
            None => {
                self.ops.push(Op {
                    generation: 0,
                    state: OpState::Free,
                    kind,
                    offset,
                    buffer: None,
                    pool_index: None,
                    waker: None,
                    abandoned: false,
                });
                (self.ops.len() - 1) as u32
            }
        };
        let op = &mut self.ops[index as usize];
        debug_assert!(matches!(op.state, OpState::Free));
        op.generation = op.generation.wrapping_add(1);
        op.kind = kind;
        op.offset = offset;
        op.buffer = Some(buffer);
        op.pool_index = pool_index;
        op.waker = None;
        op.abandoned = false;
        op.state = OpState::Waiting;
        (index, op.generation)
    }

    fn free_op(&mut self, index: u32) {
        let op = &mut self.ops[index as usize];
        op.state = OpState::Free;
        op.buffer = None;
        op.waker = None;
        self.free_ops.push(index);
    }

    /// Hand the op to the device. Returns false if the device is full.
    fn try_submit(&mut self, index: u32) -> bool {
        let op = &mut self.ops[index as usize];
        self.iovecs.clear();
        if let Some(buffer) = op.buffer.as_mut() {
            buffer.iovecs(&mut self.iovecs);
        }
        let req = IoRequest {
            token: token_of(index, op.generation),
            kind: op.kind,
            offset_bytes: op.offset,
            iovecs: &self.iovecs,
            pool_index: op.pool_index,
        };
        // SAFETY: the op owns the buffer until the completion arrives (it is
        // released only in `complete` or after it), and the IoBuffer
        // contract keeps its memory valid and in place meanwhile, and keelfs
        // from touching it. The memory may still be a guest's, which the
        // guest writes when it likes: the backends reach it only through
        // volatile access (`IoVec::volatile`).
        match unsafe { self.queue.submit(&req) } {
            Ok(()) => {
                op.state = OpState::InFlight;
                self.stats.submitted += 1;
                self.stats.in_flight_max = self.stats.in_flight_max.max(self.queue.in_flight() as u64);
                true
            }
            Err(BdevError::QueueFull) => false,
            Err(e) => {
                op.state = OpState::Done(Err(e));
                if let Some(w) = op.waker.take() {
                    w.wake();
                }
                true
            }
        }
    }

    fn complete(&mut self, c: Completion) {
        let index = (c.token & u64::from(u32::MAX)) as u32;
        let generation = (c.token >> 32) as u32;
        let op = &mut self.ops[index as usize];
        assert_eq!(op.generation, generation, "completion for a recycled op");
        assert!(matches!(op.state, OpState::InFlight), "completion for an op not in flight");
        self.stats.completed += 1;
        if op.abandoned {
            self.free_op(index);
            return;
        }
        op.state = OpState::Done(c.result);
        if let Some(w) = op.waker.take() {
            w.wake();
        }
    }

    fn poll_device(&mut self) -> bool {
        let mut completions = std::mem::take(&mut self.completions);
        completions.clear();
        let n = self.queue.poll(&mut completions, COMPLETIONS_PER_POLL_MAX);
        for c in completions.drain(..) {
            self.complete(c);
        }
        self.completions = completions;
        let mut resubmitted = false;
        while let Some(&index) = self.waiting.front() {
            if !self.try_submit(index) {
                break;
            }
            self.waiting.pop_front();
            resubmitted = true;
        }
        n > 0 || resubmitted
    }
}

/// One reactor's asynchronous path to a block device.
#[derive(Clone)]
pub struct DeviceChannel {
    state: Rc<RefCell<ChannelState>>,
}

struct ChannelPoller {
    state: Rc<RefCell<ChannelState>>,
}

impl Poller for ChannelPoller {
    fn poll(&mut self, _now: Instant) -> bool {
        self.state.borrow_mut().poll_device()
    }
    fn wake_fd(&self) -> Option<RawFd> {
        self.state.borrow().queue.completion_eventfd()
    }
    fn can_sleep(&self) -> bool {
        let s = self.state.borrow();
        s.queue.in_flight() == 0 || s.queue.completion_eventfd().is_some()
    }
}

impl DeviceChannel {
    /// Wrap `queue` and register its poller with the current reactor.
    ///
    /// # Panics
    /// Outside a reactor thread.
    pub fn attach(queue: Box<dyn IoQueue>) -> Self {
        let (channel, poller) = Self::detached(queue);
        register_poller(PollerClass::Device, poller);
        channel
    }

    /// A channel and the poller that drives it, for callers that register
    /// pollers themselves.
    pub fn detached(queue: Box<dyn IoQueue>) -> (Self, Box<dyn Poller>) {
        let state = Rc::new(RefCell::new(ChannelState {
            queue,
            ops: Vec::new(),
            free_ops: Vec::new(),
            waiting: VecDeque::new(),
            completions: Vec::with_capacity(COMPLETIONS_PER_POLL_MAX),
            iovecs: IoVecs::new(),
            stats: ChannelStats::default(),
        }));
        (Self { state: Rc::clone(&state) }, Box::new(ChannelPoller { state }))
    }

    pub fn geometry(&self) -> Geometry {
        self.state.borrow().queue.geometry()
    }

    pub fn stats(&self) -> ChannelStats {
        self.state.borrow().stats
    }

    pub fn in_flight(&self) -> usize {
        self.state.borrow().queue.in_flight()
    }

    pub fn read<B: IoBuffer>(&self, offset: u64, buffer: B) -> IoFuture<B> {
        self.start(IoKind::Read, offset, Box::new(buffer), None)
    }

    pub fn write<B: IoBuffer>(&self, offset: u64, buffer: B) -> IoFuture<B> {
        self.start(IoKind::Write, offset, Box::new(buffer), None)
    }

    /// A read into a registered pool buffer (fixed-buffer I/O on io_uring).
    pub fn read_pooled(&self, offset: u64, buffer: PoolBuf) -> IoFuture<PoolBuf> {
        let index = buffer.index();
        self.start(IoKind::Read, offset, Box::new(buffer), Some(index))
    }

    pub fn write_pooled(&self, offset: u64, buffer: PoolBuf) -> IoFuture<PoolBuf> {
        let index = buffer.index();
        self.start(IoKind::Write, offset, Box::new(buffer), Some(index))
    }

    pub fn flush(&self) -> IoFuture<NoBuffer> {
        self.start(IoKind::Flush, 0, Box::new(NoBuffer), None)
    }

    /// Tell the device `bytes` from `offset` hold nothing worth keeping;
    /// a backend that cannot answers [`keelfs_bdev::BdevError::Unsupported`].
    pub fn discard(&self, offset: u64, bytes: u64) -> IoFuture<NoBuffer> {
        self.start(IoKind::Discard { bytes }, offset, Box::new(NoBuffer), None)
    }

    fn start<B: IoBuffer>(
        &self,
        kind: IoKind,
        offset: u64,
        buffer: Box<dyn IoBuffer>,
        pool: Option<u16>,
    ) -> IoFuture<B> {
        let mut s = self.state.borrow_mut();
        let (index, generation) = s.alloc_op(kind, offset, buffer, pool);
        // Keep FIFO order: nothing overtakes requests already waiting.
        if !s.waiting.is_empty() || !s.try_submit(index) {
            s.waiting.push_back(index);
            s.stats.queue_full_waits += 1;
        }
        IoFuture { state: Rc::clone(&self.state), index, generation, _buffer: PhantomData }
    }
}

/// Resolves to the buffer and the I/O's result.
pub struct IoFuture<B> {
    state: Rc<RefCell<ChannelState>>,
    index: u32,
    generation: u32,
    _buffer: PhantomData<B>,
}

impl<B: IoBuffer> Future for IoFuture<B> {
    type Output = (B, Result<u32, BdevError>);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.state.borrow_mut();
        let op = &mut s.ops[self.index as usize];
        assert_eq!(op.generation, self.generation, "IoFuture polled after completion");
        if !matches!(op.state, OpState::Done(_)) {
            // Re-polled by the same task (the usual case): keep its waker
            // rather than clone it again (an atomic increment each time).
            if !op.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                op.waker = Some(cx.waker().clone());
            }
            return Poll::Pending;
        }
        let OpState::Done(result) = std::mem::replace(&mut op.state, OpState::Free) else { unreachable!() };
        let buffer = op.buffer.take().expect("a finished op still holds its buffer");
        op.generation = op.generation.wrapping_add(1);
        s.free_op(self.index);
        let buffer = *buffer.into_any().downcast::<B>().expect("buffer type matches the future's");
        Poll::Ready((buffer, result))
    }
}

impl<B> Drop for IoFuture<B> {
    fn drop(&mut self) {
        let Ok(mut s) = self.state.try_borrow_mut() else { return };
        let op = &mut s.ops[self.index as usize];
        if op.generation != self.generation {
            return; // already completed and taken
        }
        match op.state {
            OpState::InFlight => op.abandoned = true,
            OpState::Waiting => {
                s.waiting.retain(|&i| i != self.index);
                s.free_op(self.index);
            }
            OpState::Done(_) => s.free_op(self.index),
            OpState::Free => {}
        }
    }
}

/// Wait for every request of a batch (they are already in flight: requests
/// start when created) and report the first failure. Every request is
/// awaited even after a failure, so no buffer is given up early.
pub async fn await_all<B: IoBuffer>(batch: Vec<IoFuture<B>>) -> Result<(), BdevError> {
    let mut failure = None;
    for f in batch {
        if let (_, Err(e)) = f.await {
            failure.get_or_insert(e);
        }
    }
    failure.map_or(Ok(()), Err)
}

/// One caller buffer cut into several device requests without copying:
/// each [`BufferSlice`] names a disjoint sub-range and keeps the buffer
/// alive. The buffer comes back with [`SharedBuffer::into_inner`] once every
/// slice is dropped. CPU access to ranges (zeroing, copying) is refused
/// while a slice covering them is outstanding, so the device and the CPU
/// never touch the same bytes at once.
pub struct SharedBuffer<B: IoBuffer> {
    inner: Rc<SharedInner<B>>,
}

struct SharedInner<B> {
    buffer: RefCell<Option<B>>,
    iovecs: IoVecs,
    len: usize,
    /// Byte ranges handed out as slices and not yet dropped.
    in_flight: RefCell<smallvec::SmallVec<[(usize, usize); 4]>>,
}

pub struct BufferSlice {
    iovecs: IoVecs,
    range: (usize, usize),
    owner: Rc<dyn SliceOwner>,
}

trait SliceOwner {
    fn release(&self, range: (usize, usize));
}

impl<B> SliceOwner for SharedInner<B> {
    fn release(&self, range: (usize, usize)) {
        let mut f = self.in_flight.borrow_mut();
        if let Some(pos) = f.iter().position(|r| *r == range) {
            f.swap_remove(pos);
        }
    }
}

impl Drop for BufferSlice {
    fn drop(&mut self) {
        self.owner.release(self.range);
    }
}

// SAFETY: the iovecs name a sub-range of a buffer whose IoBuffer contract
// keeps its memory fixed and alive; the Rc in `owner` keeps the buffer
// alive; the SharedBuffer hands out only disjoint live slices and refuses
// CPU access to ranges a slice covers.
unsafe impl IoBuffer for BufferSlice {
    fn iovecs(&mut self, out: &mut IoVecs) {
        out.extend_from_slice(&self.iovecs);
    }
}

/// The sub-range was already handed out, or is out of bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("buffer range [{0}, {1}) overlaps an outstanding slice or the end")]
pub struct RangeBusy(pub usize, pub usize);

impl<B: IoBuffer> SharedBuffer<B> {
    pub fn new(mut buffer: B) -> Self {
        let mut iovecs = IoVecs::new();
        buffer.iovecs(&mut iovecs);
        let len = iovecs.iter().map(|v| v.len).sum();
        Self {
            inner: Rc::new(SharedInner {
                buffer: RefCell::new(Some(buffer)),
                iovecs,
                len,
                in_flight: RefCell::new(smallvec::SmallVec::new()),
            }),
        }
    }

    pub fn len(&self) -> usize {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The segments of the whole buffer (for alignment checks).
    pub fn iovecs(&self) -> &[IoVec] {
        &self.inner.iovecs
    }

    fn sub_iovecs(&self, start: usize, len: usize) -> IoVecs {
        let mut out = IoVecs::new();
        let (mut skip, mut left) = (start, len);
        for v in &self.inner.iovecs {
            if left == 0 {
                break;
            }
            if skip >= v.len {
                skip -= v.len;
                continue;
            }
            let take = (v.len - skip).min(left);
            out.push(IoVec { base: v.base.wrapping_add(skip), len: take });
            skip = 0;
            left -= take;
        }
        out
    }

    fn claim(&self, start: usize, len: usize) -> Result<(), RangeBusy> {
        let end = start.checked_add(len).filter(|&e| e <= self.inner.len).ok_or(RangeBusy(start, start + len))?;
        if self.inner.in_flight.borrow().iter().any(|&(s, e)| s < end && start < e) {
            return Err(RangeBusy(start, end));
        }
        Ok(())
    }

    /// A device-request view of [start, start+len).
    pub fn slice(&self, start: usize, len: usize) -> Result<BufferSlice, RangeBusy> {
        self.claim(start, len)?;
        let range = (start, start + len);
        self.inner.in_flight.borrow_mut().push(range);
        let owner: Rc<dyn SliceOwner> = self.inner.clone();
        Ok(BufferSlice { iovecs: self.sub_iovecs(start, len), range, owner })
    }

    fn for_each_segment(&self, start: usize, len: usize, mut f: impl FnMut(*mut u8, usize, usize)) {
        let mut done = 0;
        for v in self.sub_iovecs(start, len) {
            f(v.base, v.len, done);
            done += v.len;
        }
    }

    /// Fill [start, start+len) with zeros.
    pub fn zero(&self, start: usize, len: usize) -> Result<(), RangeBusy> {
        self.claim(start, len)?;
        // SAFETY: the range is inside the buffer (claim checked) and no
        // device request covers it (claim checked); IoBuffer's contract
        // keeps the memory valid. Another agent (a guest) may write it at
        // the same time, so the stores are volatile.
        self.for_each_segment(start, len, |p, n, _| unsafe {
            for i in 0..n {
                std::ptr::write_volatile(p.add(i), 0);
            }
        });
        Ok(())
    }

    /// Copy `data` into the buffer at `start`.
    pub fn copy_in(&self, start: usize, data: &[u8]) -> Result<(), RangeBusy> {
        self.claim(start, data.len())?;
        // SAFETY: as in `zero`; `at + n` stays within `data`, which is
        // ordinary memory of ours.
        self.for_each_segment(start, data.len(), |p, n, at| unsafe { volatile_copy(data.as_ptr().add(at), p, n) });
        Ok(())
    }

    /// Copy [start, start+out.len()) of the buffer into `out`. What a guest
    /// writes meanwhile may be seen in part: the copy is volatile, so that
    /// is a torn read, not undefined behaviour.
    pub fn copy_out(&self, start: usize, out: &mut [u8]) -> Result<(), RangeBusy> {
        self.claim(start, out.len())?;
        // SAFETY: as in `zero`, reading instead of writing.
        self.for_each_segment(start, out.len(), |p, n, at| unsafe { volatile_copy(p, out.as_mut_ptr().add(at), n) });
        Ok(())
    }

    /// The crc32c of [start, start+len) of the buffer, read in place (no
    /// copy). What a guest writes meanwhile may be seen in part, as in
    /// [`Self::copy_out`].
    pub fn crc32c(&self, start: usize, len: usize) -> Result<u32, RangeBusy> {
        self.claim(start, len)?;
        let mut crc = 0;
        self.for_each_segment(start, len, |p, n, _| {
            // SAFETY: as in `copy_out`: the segment is inside the buffer and
            // no device request covers it; the loads are volatile.
            crc = unsafe { crate::volatile_crc::crc32c_append_volatile(crc, p, n) }
        });
        Ok(crc)
    }

    /// The buffer, once no slice is outstanding.
    pub fn into_inner(self) -> Result<B, Self> {
        if !self.inner.in_flight.borrow().is_empty() {
            return Err(self);
        }
        let taken = self.inner.buffer.borrow_mut().take();
        Ok(taken.expect("the buffer is taken only once"))
    }
}

#[cfg(test)]
mod window_tests {
    use super::*;

    /// Every alignment of either side and every length around the wide
    /// and word steps copies exactly the bytes asked, and nothing past.
    #[test]
    fn a_volatile_copy_is_exact_at_every_alignment() {
        let src: Vec<u8> = (0..200u32).map(|i| (i * 7 + 3) as u8).collect();
        // Offsets that make each side 16-, 8- or 1-aligned (the source is
        // malloc's: 16-aligned at 0).
        for src_at in [0, 1, 8, 9, 16] {
            for dst_at in [0, 1, 8, 9, 16] {
                for n in [0, 1, 8, 15, 16, 17, 33, 100] {
                    let mut dst = AlignedBuf::zeroed(256, 64);
                    // SAFETY: both ranges are inside their buffers, which
                    // do not overlap.
                    unsafe { volatile_copy(src.as_ptr().add(src_at), dst.as_mut_ptr().add(dst_at), n) };
                    assert_eq!(&dst[dst_at..dst_at + n], &src[src_at..src_at + n], "{src_at} {dst_at} {n}");
                    assert!(dst[..dst_at].iter().chain(&dst[dst_at + n..]).all(|&b| b == 0), "{src_at} {dst_at} {n}");
                }
            }
        }
    }

    /// The crc of a range read in place is the crate's crc of its bytes,
    /// also across the segments of a buffer in pieces.
    #[test]
    fn a_crc_in_place_spans_segments() {
        let pieces: Vec<AlignedBuf> = (0..3u8)
            .map(|k| {
                let mut b = AlignedBuf::zeroed(4096, 4096);
                b.iter_mut().enumerate().for_each(|(i, x)| *x = (i as u8).wrapping_mul(31) ^ k);
                b
            })
            .collect();
        let bytes: Vec<u8> = pieces.iter().flat_map(|b| b.iter().copied()).collect();
        let shared = SharedBuffer::new(pieces);
        for (start, len) in [(0, 4096), (4000, 200), (4090, 8195), (5, 0)] {
            assert_eq!(shared.crc32c(start, len).unwrap(), crc32c::crc32c(&bytes[start..start + len]), "{start}+{len}");
        }
        assert!(shared.crc32c(12000, 4096).is_err(), "past the end");
    }

    #[test]
    fn an_aligned_window_is_its_part_of_the_buffer_and_nothing_more() {
        let mut buf = AlignedBuf::zeroed(8192, 4096);
        buf[4096..4100].copy_from_slice(b"data");
        let base = buf.as_mut_ptr();
        let buf = AlignedWindow::new(buf, 8000, 193).err().expect("past the end");
        let mut window = AlignedWindow::new(buf, 4096, 4).expect("inside");
        assert_eq!(window.bytes(), b"data");
        let mut iovecs = IoVecs::new();
        window.iovecs(&mut iovecs);
        assert_eq!(iovecs.as_slice(), &[IoVec { base: base.wrapping_add(4096), len: 4 }]);
        assert_eq!(window.into_inner().len(), 8192, "the whole buffer comes back");
        let buf = AlignedBuf::zeroed(4096, 4096);
        assert!(AlignedWindow::new(buf, usize::MAX, 2).is_err(), "an overflowing window");
    }
}
