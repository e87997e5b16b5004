//! The block-device layer: io_uring files and block devices, pmem and RAM
//! mappings, NVMe through VFIO, and Ceph RBD images through librbd.
//!
//! A [`BlockDevice`] is shared by every core that uses it and hands out one
//! [`IoQueue`] per core. A queue belongs to exactly one thread, so it takes
//! no locks: the caller submits requests tagged with its own [`Token`] and
//! later polls for their [`Completion`]s. No call blocks on I/O.
//!
//! The caller's memory (internal buffers, or guest memory mapped by
//! vm-memory) is described by [`IoVec`]s. Submission is `unsafe` because the
//! queue keeps raw pointers to that memory until the completion comes back;
//! `keelfs_reactor::DeviceChannel` wraps this in a safe API that owns
//! the buffers while they are in flight.

mod blocking;
mod buf;
#[cfg(feature = "test-utils")]
mod fault;
mod mapped;
mod nvme;
mod rbd;
mod uring;

pub use blocking::BlockingIo;
pub use buf::{AlignedBuf, BufferPool, PoolBuf};
#[cfg(feature = "test-utils")]
pub use fault::{FaultDevice, FaultRule, LogEntry, Persist, WriteLog};
pub use mapped::{FlushInstruction, MappedDevice};
pub use nvme::{NvmeAddress, NvmeDevice, NvmeError, NvmeOptions, NvmeQueue};
#[cfg(feature = "test-utils")]
pub use rbd::{dev_cluster_up, ScratchImage as RbdScratchImage};
pub use rbd::{
    RbdAddress, RbdDevice, RbdError, RbdOptions, RbdPrepared, RbdQueue, RbdReaderLock,
    CONNECT_TIMEOUT_SECS as RBD_CONNECT_TIMEOUT_SECS, READER_TAG as RBD_READER_TAG,
};
pub use uring::{UringDevice, UringOptions};

use std::os::fd::RawFd;

/// The caller's tag for a request, returned unchanged in its completion.
/// Tokens of requests in flight on one queue must be distinct.
pub type Token = u64;

/// What a device can do, and what it requires of requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub capacity_bytes: u64,
    /// The unit of atomicity and addressing: offsets and lengths are
    /// multiples of it.
    pub logical_block_size: u32,
    /// Buffer addresses must be multiples of this (O_DIRECT's memory
    /// alignment).
    pub memory_alignment: u32,
    /// True when a completed write may still sit in a volatile cache and
    /// needs a flush to become durable.
    pub volatile_write_cache: bool,
    pub max_iovecs_per_request: u32,
    pub max_request_bytes: u32,
}

/// Limits shared by all backends. 1 MiB matches the FUSE max_write keelfs
/// negotiates, and 256 segments cover it in 4 KiB pages.
pub const MAX_IOVECS_PER_REQUEST: u32 = 256;
pub const MAX_REQUEST_BYTES: u32 = 1 << 20;

/// One segment of caller memory.
///
/// It may be a guest's, which the guest's vCPUs write at any moment: a
/// backend that copies it does so only through [`IoVec::volatile`], never
/// through a Rust slice or reference (the compiler may assume those do not
/// change underneath it) nor a copy of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoVec {
    pub base: *mut u8,
    pub len: usize,
}

// SAFETY: an IoVec is only an address and a length; the unsafe contract of
// `IoQueue::submit` is what governs access to the memory it names.
unsafe impl Send for IoVec {}

impl IoVec {
    /// The segment's memory, for volatile access only (vm-memory's
    /// `VolatileSlice`: reads and writes that assume nothing of what
    /// another thread or a guest does meanwhile).
    ///
    /// # Safety
    /// The memory must stay mapped for `'a`: [`IoQueue::submit`]'s contract
    /// gives that until the request's completion is handed out.
    pub unsafe fn volatile<'a>(&self) -> vm_memory::VolatileSlice<'a> {
        // SAFETY: the caller keeps [base, base+len) mapped for 'a; a
        // VolatileSlice makes no claim that no one else writes it.
        unsafe { vm_memory::VolatileSlice::new(self.base, self.len) }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
    /// Make every write completed before this request durable.
    Flush,
    /// Tell the device `bytes` from the offset hold nothing worth keeping
    /// (NVMe deallocate). Backends without it answer `Unsupported`.
    Discard {
        bytes: u64,
    },
}

#[derive(Clone, Copy, Debug)]
pub struct IoRequest<'a> {
    pub token: Token,
    pub kind: IoKind,
    pub offset_bytes: u64,
    pub iovecs: &'a [IoVec],
    /// Index of a registered [`BufferPool`] buffer holding the single iovec,
    /// which lets io_uring use its fixed-buffer opcodes.
    pub pool_index: Option<u16>,
}

impl<'a> IoRequest<'a> {
    pub fn read(token: Token, offset_bytes: u64, iovecs: &'a [IoVec]) -> Self {
        Self { token, kind: IoKind::Read, offset_bytes, iovecs, pool_index: None }
    }
    pub fn write(token: Token, offset_bytes: u64, iovecs: &'a [IoVec]) -> Self {
        Self { token, kind: IoKind::Write, offset_bytes, iovecs, pool_index: None }
    }
    pub fn flush(token: Token) -> Self {
        Self { token, kind: IoKind::Flush, offset_bytes: 0, iovecs: &[], pool_index: None }
    }
    pub fn discard(token: Token, offset_bytes: u64, bytes: u64) -> Self {
        Self { token, kind: IoKind::Discard { bytes }, offset_bytes, iovecs: &[], pool_index: None }
    }
    pub fn with_pool_index(mut self, index: u16) -> Self {
        self.pool_index = Some(index);
        self
    }
    pub fn total_bytes(&self) -> u64 {
        self.iovecs.iter().map(|v| v.len as u64).sum()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub token: Token,
    /// Bytes transferred (always the whole request on success), or the error.
    pub result: Result<u32, BdevError>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BdevError {
    #[error("offset {offset} is not a multiple of the {block}-byte logical block")]
    MisalignedOffset { offset: u64, block: u32 },
    #[error("buffer segment at {addr:#x}, length {len}, is not aligned to {align} bytes")]
    MisalignedBuffer { addr: usize, len: usize, align: u32 },
    #[error("request [{offset}, +{len}) ends past the device capacity {capacity}")]
    OutOfRange { offset: u64, len: u64, capacity: u64 },
    #[error("request has {count} segments, more than the limit {max}")]
    TooManySegments { count: usize, max: u32 },
    #[error("request of {len} bytes exceeds the limit {max}")]
    TooLarge { len: u64, max: u32 },
    #[error("read or write request with no data")]
    Empty,
    #[error("pool index {index} does not match a registered buffer covering the request")]
    BadPoolIndex { index: u16 },
    #[error("queue full: retry after polling completions")]
    QueueFull,
    #[error("device returned errno {0}")]
    Io(i32),
    #[error("device ended the transfer early at {done} of {len} bytes")]
    ShortTransfer { done: u64, len: u64 },
    #[error("{step} failed: errno {errno}")]
    Setup { step: &'static str, errno: i32 },
    #[error("{0}")]
    Unsupported(&'static str),
    #[error("the device is open read-only")]
    ReadOnly,
    #[error("NVMe command failed: status code type {sct}, status code {sc:#04x}")]
    Nvme { sct: u8, sc: u8 },
}

impl BdevError {
    pub(crate) fn last_os(step: &'static str) -> Self {
        BdevError::Setup { step, errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0) }
    }
    pub(crate) fn from_io(step: &'static str, err: &std::io::Error) -> Self {
        BdevError::Setup { step, errno: err.raw_os_error().unwrap_or(libc::EIO) }
    }
}

/// Per-queue settings chosen by the caller.
#[derive(Clone, Copy, Debug)]
pub struct QueueConfig {
    /// Requests that may be in flight at once; submit returns
    /// [`BdevError::QueueFull`] beyond it.
    pub depth: u32,
    /// Ask for an eventfd that signals completions (see
    /// [`IoQueue::completion_eventfd`]); costs a little per completion.
    pub completion_eventfd: bool,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self { depth: 128, completion_eventfd: false }
    }
}

/// A long-lived region of memory that requests will name, such as one
/// region of a guest's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    pub host_address: usize,
    pub len: u64,
    /// The guest physical address of the region's start.
    pub guest_address: u64,
}

/// A device shared by all cores. Each core opens its own queue.
pub trait BlockDevice: Send + Sync {
    fn name(&self) -> &str;
    fn geometry(&self) -> Geometry;
    fn open_queue(&self, config: QueueConfig) -> Result<Box<dyn IoQueue>, BdevError>;

    /// Make exactly `regions` reachable by the device without a copy (NVMe
    /// maps them into the IOMMU), replacing the previous set; an empty
    /// slice clears it. Backends that need no mapping ignore it. A request
    /// naming memory outside the set still works, through a copy.
    ///
    /// The caller keeps each region mapped until a later call drops it, and
    /// touches registered memory only through raw pointers (a device may
    /// write it at any time during I/O).
    fn set_dma_memory(&self, _regions: &[MemoryRegion]) -> Result<(), BdevError> {
        Ok(())
    }

    /// Whether the device was opened read-only: its queues refuse writes.
    fn read_only(&self) -> bool {
        false
    }

    /// Whether its queues accept [`IoKind::Discard`] as far as the backend
    /// can tell at open; a kernel or controller may still refuse the first
    /// one with [`BdevError::Unsupported`].
    fn supports_discard(&self) -> bool {
        false
    }
}

/// One core's submission and completion path to a device.
pub trait IoQueue: Send {
    fn geometry(&self) -> Geometry;

    /// Queue a request. It may not reach the device until the next
    /// [`IoQueue::poll`], which lets one system call carry a batch.
    ///
    /// # Safety
    /// Every iovec must name memory that stays valid, and is not accessed by
    /// anyone else in a conflicting way, until the completion carrying
    /// `req.token` has been returned by `poll` (or the queue is dropped).
    /// Reads write into it; writes read from it.
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), BdevError>;

    /// Push queued submissions to the device and move up to `max` finished
    /// requests into `out`. Never blocks. Returns how many were added.
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize;

    /// Requests submitted whose completion has not yet been returned.
    fn in_flight(&self) -> usize;

    /// An eventfd that becomes readable when a completion arrives, for a
    /// caller that wants to sleep. `None` means completions only appear
    /// during `submit` or `poll`, so sleeping is safe whenever nothing is in
    /// flight, and polling is needed otherwise.
    fn completion_eventfd(&self) -> Option<RawFd> {
        None
    }

    /// Register a buffer pool for fixed-buffer I/O. Backends without such a
    /// notion accept and ignore it.
    fn register_pool(&mut self, _pool: &BufferPool) -> Result<(), BdevError> {
        Ok(())
    }
}

/// The checks every backend applies before touching a request, so that a bad
/// request is a typed error and never reaches memory or the device.
pub fn validate_request(geometry: &Geometry, req: &IoRequest<'_>) -> Result<u64, BdevError> {
    let block = u64::from(geometry.logical_block_size);
    match req.kind {
        IoKind::Flush => return Ok(0),
        IoKind::Discard { bytes } => {
            if !req.offset_bytes.is_multiple_of(block) {
                return Err(BdevError::MisalignedOffset {
                    offset: req.offset_bytes,
                    block: geometry.logical_block_size,
                });
            }
            if bytes == 0 || !bytes.is_multiple_of(block) || bytes / block > u64::from(u32::MAX) {
                return Err(BdevError::MisalignedBuffer {
                    addr: 0,
                    len: bytes as usize,
                    align: geometry.logical_block_size,
                });
            }
            if req.offset_bytes.checked_add(bytes).is_none_or(|end| end > geometry.capacity_bytes) {
                return Err(BdevError::OutOfRange {
                    offset: req.offset_bytes,
                    len: bytes,
                    capacity: geometry.capacity_bytes,
                });
            }
            return Ok(0);
        }
        IoKind::Read | IoKind::Write => {}
    }
    if req.iovecs.is_empty() {
        return Err(BdevError::Empty);
    }
    if req.iovecs.len() > geometry.max_iovecs_per_request as usize {
        return Err(BdevError::TooManySegments { count: req.iovecs.len(), max: geometry.max_iovecs_per_request });
    }
    if !req.offset_bytes.is_multiple_of(block) {
        return Err(BdevError::MisalignedOffset { offset: req.offset_bytes, block: geometry.logical_block_size });
    }
    let mut total: u64 = 0;
    for v in req.iovecs {
        let addr = v.base as usize;
        if v.len == 0
            || !addr.is_multiple_of(geometry.memory_alignment as usize)
            || !(v.len as u64).is_multiple_of(block)
        {
            return Err(BdevError::MisalignedBuffer {
                addr,
                len: v.len,
                align: geometry.memory_alignment.max(geometry.logical_block_size),
            });
        }
        total += v.len as u64;
    }
    if total > u64::from(geometry.max_request_bytes) {
        return Err(BdevError::TooLarge { len: total, max: geometry.max_request_bytes });
    }
    let end = req.offset_bytes.checked_add(total);
    if end.is_none_or(|end| end > geometry.capacity_bytes) {
        return Err(BdevError::OutOfRange { offset: req.offset_bytes, len: total, capacity: geometry.capacity_bytes });
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> Geometry {
        Geometry {
            capacity_bytes: 1 << 20,
            logical_block_size: 512,
            memory_alignment: 512,
            volatile_write_cache: false,
            max_iovecs_per_request: 4,
            max_request_bytes: 64 << 10,
        }
    }

    #[test]
    fn validation_names_each_violation() {
        let g = geometry();
        let mut buf = AlignedBuf::zeroed(8192, 4096);
        let ok = [IoVec { base: buf.as_mut_ptr(), len: 4096 }];
        assert_eq!(validate_request(&g, &IoRequest::read(1, 0, &ok)), Ok(4096));
        assert_eq!(
            validate_request(&g, &IoRequest::read(1, 100, &ok)),
            Err(BdevError::MisalignedOffset { offset: 100, block: 512 })
        );
        // SAFETY: the pointer stays inside the 8192-byte allocation.
        let odd = [IoVec { base: unsafe { buf.as_mut_ptr().add(1) }, len: 512 }];
        assert!(matches!(validate_request(&g, &IoRequest::write(1, 0, &odd)), Err(BdevError::MisalignedBuffer { .. })));
        let short = [IoVec { base: buf.as_mut_ptr(), len: 100 }];
        assert!(matches!(
            validate_request(&g, &IoRequest::write(1, 0, &short)),
            Err(BdevError::MisalignedBuffer { .. })
        ));
        assert!(matches!(
            validate_request(&g, &IoRequest::read(1, (1 << 20) - 512, &ok)),
            Err(BdevError::OutOfRange { .. })
        ));
        assert!(matches!(
            validate_request(&g, &IoRequest::read(1, u64::MAX - 511, &ok)),
            Err(BdevError::OutOfRange { .. })
        ));
        assert_eq!(validate_request(&g, &IoRequest::read(1, 0, &[])), Err(BdevError::Empty));
        let many = [ok[0]; 5];
        assert!(matches!(validate_request(&g, &IoRequest::read(1, 0, &many)), Err(BdevError::TooManySegments { .. })));
        let mut big = AlignedBuf::zeroed(128 << 10, 4096);
        let huge = [IoVec { base: big.as_mut_ptr(), len: 128 << 10 }];
        assert!(matches!(validate_request(&g, &IoRequest::read(1, 0, &huge)), Err(BdevError::TooLarge { .. })));
        assert_eq!(validate_request(&g, &IoRequest::flush(1)), Ok(0));
    }
}
