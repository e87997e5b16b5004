//! io_uring backend: a regular file or block device opened with O_DIRECT.
//!
//! Each queue is its own ring with the device registered as fixed file 0.
//! Request state lives in a preallocated slot array indexed by the CQE's
//! user_data, so completion needs no lookup structure and no allocation.
//! Submissions are batched: `submit` only fills SQEs, `poll` makes the one
//! system call for the batch and reaps completions.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};

use super::{
    validate_request, BdevError, BlockDevice, BufferPool, Completion, Geometry, IoKind, IoQueue, IoRequest,
    QueueConfig, Token, MAX_IOVECS_PER_REQUEST, MAX_REQUEST_BYTES,
};

/// Transient errors are retried this many times before the request fails.
const RETRIES_MAX: u16 = 64;

#[derive(Clone, Copy, Debug, Default)]
pub struct UringOptions {
    /// Use a kernel submission thread that sleeps after this many idle
    /// milliseconds.
    pub sqpoll_idle_ms: Option<u32>,
    /// Open the file or block device read-only: queues refuse writes, and
    /// the kernel would too.
    pub read_only: bool,
}

pub struct UringDevice {
    file: Arc<File>,
    name: String,
    geometry: Geometry,
    options: UringOptions,
    discard: DiscardMethod,
}

/// How a queue tells the backing store that a range holds nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DiscardMethod {
    /// A regular file: punch a hole (fallocate PUNCH_HOLE | KEEP_SIZE), so
    /// the host filesystem gets the space back and the range reads zeros.
    PunchHole,
    /// A block device that discards: BLOCK_URING_CMD_DISCARD (Linux 6.12).
    /// fallocate on a block device zeroes instead, which is not the point.
    UringCmd,
    None,
}

/// BLOCK_URING_CMD_DISCARD, `_IO(0x12, 0)` (include/uapi/linux/blkdev.h);
/// Debian's 6.1 headers and the libc crate do not have it.
const BLOCK_URING_CMD_DISCARD: u32 = 0x1200;

impl UringDevice {
    pub fn open(path: &Path, options: UringOptions) -> Result<Self, BdevError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!options.read_only)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| BdevError::from_io("open with O_DIRECT", &e))?;
        Self::from_file(file, path.display().to_string(), options)
    }

    /// A device on a file or block device already open (O_DIRECT, for
    /// writing unless `options` say read-only), named `name`: for a
    /// process that opens it relative to a directory descriptor.
    pub fn from_file(file: File, name: String, options: UringOptions) -> Result<Self, BdevError> {
        let geometry = probe_geometry(&file, Path::new(&name))?;
        let discard = probe_discard(&file, options.read_only);
        Ok(Self { file: Arc::new(file), name, geometry, options, discard })
    }

    /// The open file, for a privileged process that opens devices for a
    /// sandboxed one and hands it the descriptor ([`Self::from_parts`]).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// A device [`Self::open`]ed by another process: `file` is its open
    /// file (O_DIRECT, as `options` say), `geometry` and `discards`
    /// (its [`BlockDevice::supports_discard`]) what that open probed. A
    /// sandboxed process can do neither itself: probing takes ioctls and
    /// sysfs.
    pub fn from_parts(file: File, name: String, geometry: Geometry, options: UringOptions, discards: bool) -> Self {
        let discard = match file.metadata() {
            Ok(m) if discards && !options.read_only && m.file_type().is_file() => DiscardMethod::PunchHole,
            Ok(m) if discards && !options.read_only && m.file_type().is_block_device() => DiscardMethod::UringCmd,
            _ => DiscardMethod::None,
        };
        Self { file: Arc::new(file), name, geometry, options, discard }
    }
}

/// How (and whether) the device can discard. A block device says so in
/// sysfs (discard_max_bytes 0: it cannot); whether the kernel knows the
/// io_uring command shows at the first one, which then answers
/// Unsupported.
fn probe_discard(file: &File, read_only: bool) -> DiscardMethod {
    let Ok(meta) = file.metadata() else { return DiscardMethod::None };
    if read_only {
        DiscardMethod::None
    } else if meta.file_type().is_file() {
        DiscardMethod::PunchHole
    } else if meta.file_type().is_block_device() && block_device_discards(&meta) {
        DiscardMethod::UringCmd
    } else {
        DiscardMethod::None
    }
}

fn block_device_discards(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    let rdev = meta.rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    for rel in ["queue/discard_max_bytes", "../queue/discard_max_bytes"] {
        if let Ok(s) = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/{rel}")) {
            return s.trim().parse::<u64>().is_ok_and(|n| n > 0);
        }
    }
    false
}

fn probe_geometry(file: &File, path: &Path) -> Result<Geometry, BdevError> {
    let meta = file.metadata().map_err(|e| BdevError::from_io("stat", &e))?;
    let fd = file.as_raw_fd();
    let (capacity, block, mem_align, volatile) = if meta.file_type().is_block_device() {
        let mut size: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 to the pointer we pass.
        if unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut size as *mut u64) } != 0 {
            return Err(BdevError::last_os("ioctl BLKGETSIZE64"));
        }
        let mut sector: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int to the pointer we pass.
        if unsafe { libc::ioctl(fd, BLKSSZGET, &mut sector as *mut libc::c_int) } != 0 {
            return Err(BdevError::last_os("ioctl BLKSSZGET"));
        }
        let sector = sector.max(512) as u32;
        (size, sector, sector, block_device_has_volatile_cache(&meta))
    } else if meta.file_type().is_file() {
        let (mem, off) = statx_dio_alignment(fd).unwrap_or((4096, 4096));
        // A file's data sits in a host filesystem whose own metadata and
        // the disk's cache both need fdatasync: treat it as volatile.
        (meta.len(), off.max(512), mem.max(512), true)
    } else {
        return Err(BdevError::Unsupported("device path is neither a regular file nor a block device"));
    };
    let capacity = capacity - capacity % u64::from(block);
    if capacity == 0 {
        let _ = path;
        return Err(BdevError::Unsupported("device has zero capacity"));
    }
    Ok(Geometry {
        capacity_bytes: capacity,
        logical_block_size: block,
        memory_alignment: mem_align,
        volatile_write_cache: volatile,
        max_iovecs_per_request: MAX_IOVECS_PER_REQUEST,
        max_request_bytes: MAX_REQUEST_BYTES,
    })
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;

fn block_device_has_volatile_cache(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    let rdev = meta.rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    for rel in ["queue/write_cache", "../queue/write_cache"] {
        if let Ok(s) = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/{rel}")) {
            return s.trim() == "write back";
        }
    }
    true
}

/// The DIO memory and offset alignment a regular file's filesystem reports.
fn statx_dio_alignment(fd: RawFd) -> Option<(u32, u32)> {
    // SAFETY: statx is plain old data, valid when zeroed.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the empty path with AT_EMPTY_PATH names fd itself; stx is a
    // valid out-pointer.
    let rc = unsafe { libc::statx(fd, c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
        return None;
    }
    Some((stx.stx_dio_mem_align, stx.stx_dio_offset_align))
}

impl BlockDevice for UringDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn geometry(&self) -> Geometry {
        self.geometry
    }
    fn open_queue(&self, config: QueueConfig) -> Result<Box<dyn IoQueue>, BdevError> {
        Ok(Box::new(UringQueue::new(Arc::clone(&self.file), self.geometry, self.options, self.discard, config)?))
    }

    fn read_only(&self) -> bool {
        self.options.read_only
    }

    fn supports_discard(&self) -> bool {
        self.discard != DiscardMethod::None
    }
}

#[derive(Default)]
struct Slot {
    token: Token,
    kind: Option<IoKind>,
    offset: u64,
    /// The request's segments; advanced in place after a short transfer.
    iov: Vec<libc::iovec>,
    iov_first: usize,
    total: u64,
    done: u64,
    pool_index: Option<u16>,
    retries: u16,
}

pub struct UringQueue {
    ring: IoUring,
    _file: Arc<File>,
    geometry: Geometry,
    depth: u32,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// Requests accepted whose completion has not been handed out.
    in_flight: usize,
    /// Slots whose SQE did not fit in the submission ring.
    unqueued: VecDeque<u32>,
    sq_dirty: bool,
    reaped: Vec<(u64, i32)>,
    ready: VecDeque<Completion>,
    eventfd: Option<OwnedFd>,
    pool_ranges: Vec<(usize, usize)>,
    enter_errors: u64,
    read_only: bool,
    discard: DiscardMethod,
}

// SAFETY: the raw pointers inside the slots' iovecs refer to caller memory
// whose validity the `submit` contract guarantees regardless of thread; the
// queue itself is used by one thread at a time (&mut self).
unsafe impl Send for UringQueue {}

/// The only operations a queue's ring runs. io_uring operations are not
/// system calls, so the daemon's seccomp filter cannot see them; the ring
/// itself must refuse anything else (a forged SQE from a memory-safety bug,
/// say, that would open files or sockets).
/// Fallocate and UringCmd16 are discards (a hole punched in a file, a
/// block device's discard command) and count as writes.
const RING_OPCODES: [u8; 9] = [
    opcode::Read::CODE,
    opcode::Write::CODE,
    opcode::Readv::CODE,
    opcode::Writev::CODE,
    opcode::ReadFixed::CODE,
    opcode::WriteFixed::CODE,
    opcode::Fsync::CODE,
    opcode::Fallocate::CODE,
    opcode::UringCmd16::CODE,
];

/// Restrict `ring` (created disabled) to [`RING_OPCODES`] on the one
/// registered file (no writes or discards on a read-only device), and to
/// registering buffers, then enable it.
fn restrict(ring: &IoUring, read_only: bool) -> Result<(), BdevError> {
    use io_uring::register::Restriction;
    let writes = [
        opcode::Write::CODE,
        opcode::Writev::CODE,
        opcode::WriteFixed::CODE,
        opcode::Fallocate::CODE,
        opcode::UringCmd16::CODE,
    ];
    let allowed = RING_OPCODES.iter().filter(|op| !(read_only && writes.contains(op)));
    let mut restrictions: Vec<Restriction> = allowed.map(|&op| Restriction::sqe_op(op)).collect();
    // Every SQE names the device by its registered index; nothing else.
    restrictions.push(Restriction::sqe_flags_required(squeue::Flags::FIXED_FILE.bits()));
    restrictions.push(Restriction::sqe_flags_allowed(squeue::Flags::FIXED_FILE.bits()));
    restrictions.push(Restriction::register_op(IORING_REGISTER_BUFFERS));
    ring.submitter()
        .register_restrictions(&mut restrictions)
        .map_err(|e| BdevError::from_io("io_uring register_restrictions", &e))?;
    ring.submitter().register_enable_rings().map_err(|e| BdevError::from_io("io_uring register_enable_rings", &e))
}

/// IORING_REGISTER_BUFFERS (include/uapi/linux/io_uring.h); the io-uring
/// crate does not export its register opcodes.
const IORING_REGISTER_BUFFERS: u8 = 0;

impl UringQueue {
    fn new(
        file: Arc<File>,
        geometry: Geometry,
        options: UringOptions,
        discard: DiscardMethod,
        config: QueueConfig,
    ) -> Result<Self, BdevError> {
        assert!(config.depth > 0, "queue depth must be positive");
        let entries = config.depth.next_power_of_two().max(8);
        let mut builder = IoUring::builder();
        builder.setup_cqsize(entries * 2);
        match options.sqpoll_idle_ms {
            Some(idle) => {
                builder.setup_sqpoll(idle);
            }
            // Completions are posted when this thread next enters the kernel
            // rather than by interrupting it (an IPI per completion cost 4x
            // in IOPS here): a polling caller enters anyway, and the TASKRUN
            // flag tells it when there is work to collect. The kernel
            // refuses this with SQPOLL.
            None => {
                builder.setup_coop_taskrun().setup_taskrun_flag();
            }
        }
        // Created disabled, so that it can be restricted before any use.
        builder.setup_r_disabled();
        let ring = builder.build(entries).map_err(|e| BdevError::from_io("io_uring_setup", &e))?;
        ring.submitter()
            .register_files(&[file.as_raw_fd()])
            .map_err(|e| BdevError::from_io("io_uring register_files", &e))?;
        let eventfd = if config.completion_eventfd {
            // SAFETY: eventfd has no memory arguments.
            let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(BdevError::last_os("eventfd"));
            }
            // SAFETY: fd was just created and is owned by nobody else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            ring.submitter()
                .register_eventfd(fd.as_raw_fd())
                .map_err(|e| BdevError::from_io("io_uring register_eventfd", &e))?;
            Some(fd)
        } else {
            None
        };
        restrict(&ring, options.read_only)?;
        let depth = config.depth;
        let slots = (0..depth)
            .map(|_| Slot { iov: Vec::with_capacity(MAX_IOVECS_PER_REQUEST as usize), ..Slot::default() })
            .collect();
        Ok(Self {
            ring,
            _file: file,
            geometry,
            depth,
            slots,
            free_slots: (0..depth).rev().collect(),
            in_flight: 0,
            unqueued: VecDeque::with_capacity(depth as usize),
            sq_dirty: false,
            reaped: Vec::with_capacity(entries as usize * 2),
            ready: VecDeque::with_capacity(depth as usize),
            eventfd,
            pool_ranges: Vec::new(),
            enter_errors: 0,
            read_only: options.read_only,
            discard,
        })
    }

    fn check_pool_index(&self, req: &IoRequest<'_>) -> Result<(), BdevError> {
        let Some(index) = req.pool_index else { return Ok(()) };
        let covered = self.pool_ranges.get(index as usize).is_some_and(|&(base, len)| {
            req.iovecs.len() == 1 && {
                let v = req.iovecs[0];
                let start = v.base as usize;
                start >= base && start + v.len <= base + len
            }
        });
        if covered {
            Ok(())
        } else {
            Err(BdevError::BadPoolIndex { index })
        }
    }

    fn build_sqe(&self, slot_id: u32) -> squeue::Entry {
        let slot = &self.slots[slot_id as usize];
        let fd = types::Fixed(0);
        let iov = &slot.iov[slot.iov_first..];
        let entry = match (slot.kind, slot.pool_index, iov.len()) {
            (Some(IoKind::Flush), _, _) => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build(),
            (Some(IoKind::Read), Some(index), 1) => {
                opcode::ReadFixed::new(fd, iov[0].iov_base.cast(), iov[0].iov_len as u32, index)
                    .offset(slot.offset)
                    .build()
            }
            (Some(IoKind::Write), Some(index), 1) => {
                opcode::WriteFixed::new(fd, iov[0].iov_base.cast(), iov[0].iov_len as u32, index)
                    .offset(slot.offset)
                    .build()
            }
            (Some(IoKind::Read), _, 1) => {
                opcode::Read::new(fd, iov[0].iov_base.cast(), iov[0].iov_len as u32).offset(slot.offset).build()
            }
            (Some(IoKind::Write), _, 1) => {
                opcode::Write::new(fd, iov[0].iov_base.cast(), iov[0].iov_len as u32).offset(slot.offset).build()
            }
            (Some(IoKind::Read), _, n) => opcode::Readv::new(fd, iov.as_ptr(), n as u32).offset(slot.offset).build(),
            (Some(IoKind::Write), _, n) => opcode::Writev::new(fd, iov.as_ptr(), n as u32).offset(slot.offset).build(),
            (Some(IoKind::Discard { bytes }), _, _) => self.discard_sqe(slot.offset, bytes),
            (None, _, _) => unreachable!("SQE built for a free slot"),
        };
        entry.user_data(u64::from(slot_id))
    }

    fn discard_sqe(&self, offset: u64, bytes: u64) -> squeue::Entry {
        let fd = types::Fixed(0);
        match self.discard {
            DiscardMethod::PunchHole => opcode::Fallocate::new(fd, bytes)
                .offset(offset)
                .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
            DiscardMethod::UringCmd => {
                // The kernel takes the start from sqe->addr and the length
                // from sqe->addr3, which the first 8 command bytes overlay.
                let mut cmd = [0u8; 16];
                cmd[..8].copy_from_slice(&bytes.to_le_bytes());
                opcode::UringCmd16::new(fd, BLOCK_URING_CMD_DISCARD).addr(Some(offset)).cmd(cmd).build()
            }
            DiscardMethod::None => unreachable!("submit refuses discard without a method"),
        }
    }

    /// Put the slot's SQE in the ring, or remember it if the ring is full.
    fn enqueue(&mut self, slot_id: u32) {
        let sqe = self.build_sqe(slot_id);
        // SAFETY: the SQE points at the slot's iovec array (which lives as
        // long as the queue and is not touched until the CQE) and at caller
        // memory covered by the submit contract.
        let pushed = unsafe { self.ring.submission().push(&sqe) }.is_ok();
        if pushed {
            self.sq_dirty = true;
        } else {
            self.unqueued.push_back(slot_id);
        }
    }

    fn push_unqueued(&mut self) {
        while let Some(&slot_id) = self.unqueued.front() {
            let sqe = self.build_sqe(slot_id);
            // SAFETY: as in `enqueue`.
            if unsafe { self.ring.submission().push(&sqe) }.is_err() {
                return;
            }
            self.unqueued.pop_front();
            self.sq_dirty = true;
        }
    }

    fn finish(&mut self, slot_id: u32, result: Result<u32, BdevError>) {
        let slot = &mut self.slots[slot_id as usize];
        let token = slot.token;
        slot.kind = None;
        slot.iov.clear();
        self.free_slots.push(slot_id);
        self.ready.push_back(Completion { token, result });
    }

    fn complete_cqe(&mut self, slot_id: u32, res: i32) {
        let slot = &mut self.slots[slot_id as usize];
        debug_assert!(slot.kind.is_some(), "CQE for a free slot");
        if res < 0 {
            let errno = -res;
            if (errno == libc::EAGAIN || errno == libc::EINTR) && slot.retries < RETRIES_MAX {
                slot.retries += 1;
                self.enqueue(slot_id);
            } else if matches!(slot.kind, Some(IoKind::Discard { .. }))
                && matches!(errno, libc::EINVAL | libc::EOPNOTSUPP | libc::ENOTTY)
            {
                // A kernel before the discard command, or a host filesystem
                // that cannot punch holes.
                self.finish(slot_id, Err(BdevError::Unsupported("the device refused to discard")));
            } else {
                self.finish(slot_id, Err(BdevError::Io(errno)));
            }
            return;
        }
        if matches!(slot.kind, Some(IoKind::Flush | IoKind::Discard { .. })) {
            self.finish(slot_id, Ok(0));
            return;
        }
        let n = res as u64;
        if n == 0 {
            let err = BdevError::ShortTransfer { done: slot.done, len: slot.total };
            self.finish(slot_id, Err(err));
            return;
        }
        slot.done += n;
        if slot.done >= slot.total {
            let total = slot.total as u32;
            self.finish(slot_id, Ok(total));
            return;
        }
        // A short transfer: skip what was done and send the rest.
        slot.offset += n;
        let mut left = n as usize;
        while left > 0 {
            let v = &mut slot.iov[slot.iov_first];
            if left >= v.iov_len {
                left -= v.iov_len;
                slot.iov_first += 1;
            } else {
                // SAFETY: left < iov_len, so the pointer stays in the segment.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(left) }.cast();
                v.iov_len -= left;
                left = 0;
            }
        }
        self.enqueue(slot_id);
    }

    fn reap(&mut self) {
        self.reaped.clear();
        for cqe in self.ring.completion() {
            self.reaped.push((cqe.user_data(), cqe.result()));
        }
        for i in 0..self.reaped.len() {
            let (user_data, res) = self.reaped[i];
            self.complete_cqe(user_data as u32, res);
        }
    }

    fn kick(&mut self) {
        self.push_unqueued();
        let sq = self.ring.submission();
        let must_enter = sq.cq_overflow() || sq.taskrun();
        drop(sq);
        if !self.sq_dirty && !must_enter {
            return;
        }
        match self.ring.submit() {
            Ok(_) => self.sq_dirty = false,
            // EBUSY/EAGAIN: the kernel is short of resources or the CQ is
            // backed up. Anything else is equally left in the ring: reap what
            // completed and try again on the next poll, never abandoning
            // memory the kernel may still touch.
            Err(_) => self.enter_errors += 1,
        }
    }
}

impl IoQueue for UringQueue {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), BdevError> {
        let total = validate_request(&self.geometry, req)?;
        let discard = matches!(req.kind, IoKind::Discard { .. });
        if self.read_only && (req.kind == IoKind::Write || discard) {
            return Err(BdevError::ReadOnly);
        }
        if discard && self.discard == DiscardMethod::None {
            return Err(BdevError::Unsupported("this device does not discard"));
        }
        self.check_pool_index(req)?;
        if self.in_flight >= self.depth as usize {
            return Err(BdevError::QueueFull);
        }
        let slot_id = self.free_slots.pop().expect("a free slot exists while in_flight < depth");
        let slot = &mut self.slots[slot_id as usize];
        slot.token = req.token;
        slot.kind = Some(req.kind);
        slot.offset = req.offset_bytes;
        slot.iov.clear();
        slot.iov.extend(req.iovecs.iter().map(|v| libc::iovec { iov_base: v.base.cast(), iov_len: v.len }));
        slot.iov_first = 0;
        slot.total = total;
        slot.done = 0;
        slot.pool_index = req.pool_index;
        slot.retries = 0;
        self.in_flight += 1;
        self.enqueue(slot_id);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.kick();
        self.reap();
        // Resubmissions of short transfers go out in the same poll.
        if self.sq_dirty {
            self.kick();
        }
        let n = max.min(self.ready.len());
        out.extend(self.ready.drain(..n));
        self.in_flight -= n;
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn completion_eventfd(&self) -> Option<RawFd> {
        self.eventfd.as_ref().map(|fd| fd.as_raw_fd())
    }

    fn register_pool(&mut self, pool: &BufferPool) -> Result<(), BdevError> {
        let iovecs: Vec<libc::iovec> = pool
            .registration_iovecs()
            .iter()
            .map(|v| libc::iovec { iov_base: v.base.cast(), iov_len: v.len })
            .collect();
        // SAFETY: the pool's memory lives as long as its region Arc; the
        // caller keeps the pool alive for the queue's lifetime, and the
        // kernel pins the pages at registration.
        unsafe { self.ring.submitter().register_buffers(&iovecs) }
            .map_err(|e| BdevError::from_io("io_uring register_buffers", &e))?;
        self.pool_ranges = iovecs.iter().map(|v| (v.iov_base as usize, v.iov_len)).collect();
        Ok(())
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        // The kernel may still be writing into caller memory: wait for every
        // request that reached the ring before the ring goes away.
        let mut stuck_rounds = 0;
        while self.free_slots.len() < self.depth as usize && stuck_rounds < 10_000 {
            self.push_unqueued();
            if self.ring.submit_and_wait(1).is_err() {
                stuck_rounds += 1;
            }
            self.reap();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Submit `sqe` on the queue's ring and return its result.
    fn run(queue: &mut UringQueue, sqe: squeue::Entry) -> i32 {
        // SAFETY: the SQE points at nothing that outlives this call (the
        // test SQEs carry no buffers the kernel could use after it).
        unsafe { queue.ring.submission().push(&sqe).expect("room in the ring") };
        queue.ring.submit_and_wait(1).expect("io_uring_enter");
        queue.ring.completion().next().expect("one completion").result()
    }

    #[test]
    fn the_ring_refuses_operations_keelfs_does_not_use() {
        let path = std::env::temp_dir().join(format!("keelfs-uring-restrict-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let dev = UringDevice::open(&path, UringOptions::default()).unwrap();
        let config = QueueConfig { depth: 8, completion_eventfd: false };
        let mut queue = UringQueue::new(Arc::clone(&dev.file), dev.geometry, dev.options, dev.discard, config).unwrap();
        let name = c"/etc/hostname";
        let open = opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), name.as_ptr()).build();
        assert_eq!(run(&mut queue, open), -libc::EACCES, "OPENAT must be refused");
        let nop = opcode::Nop::new().build().flags(squeue::Flags::FIXED_FILE);
        assert_eq!(run(&mut queue, nop), -libc::EACCES, "NOP is not on the list either");
        // An allowed opcode that does not name the registered file.
        let fsync = opcode::Fsync::new(types::Fd(dev.file.as_raw_fd())).build();
        assert_eq!(run(&mut queue, fsync), -libc::EACCES, "an unregistered descriptor must be refused");
        let fsync = opcode::Fsync::new(types::Fixed(0)).build();
        assert_eq!(run(&mut queue, fsync), 0, "what keelfs does still works");
        std::fs::remove_file(&path).unwrap();
    }
}
