//! A vhost-user-fs frontend that plays VMM and guest driver at once, for
//! tests and for keelfs-bench's load generator.
//!
//! It owns memfd-backed "guest memory", speaks the vhost-user protocol
//! through the vhost crate's frontend, lays out split virtqueues in that
//! memory, and drives them as a guest's virtio-fs driver would: FUSE
//! requests go into descriptor chains, replies come back through the used
//! ring. Hostile chains can be built descriptor by descriptor.
//!
//! Memory layout, per queue `q` (guest physical addresses):
//! `q * queue_span`: descriptor table, then the available ring, then the
//! used ring, then `slots` request/reply buffer pairs of `slot_bytes` each.
//! Slot `i` always uses descriptors `4i` to `4i + 3` (request header,
//! request data, reply header, reply data); descriptors from `4 * slots`
//! up are free for hand-built chains. Data buffers start one page into
//! their half of the slot, page-aligned, as a guest's O_DIRECT pages are.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::fuse::abi::{encode_request, Opcode, Reply, OUT_HEADER_BYTES};

const VIRTIO_F_VERSION_1: u64 = 1 << 32;
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
const VRING_USED_F_NO_NOTIFY: u16 = 1;

/// Descriptor flags, as the virtio spec numbers them.
pub const DESC_NEXT: u16 = 1;
pub const DESC_WRITE: u16 = 2;
pub const DESC_INDIRECT: u16 = 4;

#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    #[error("vhost-user: {0}")]
    Vhost(#[from] vhost::Error),
    #[error("guest memory: {0}")]
    Memory(String),
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("no reply on queue {queue} within {timeout:?}")]
    Timeout { queue: usize, timeout: Duration },
    #[error("queue {0} has no free request slot")]
    Full(usize),
    #[error("a {0}-byte request does not fit a {1}-byte slot")]
    TooLarge(usize, usize),
    #[error("backend lacks a required feature: {0}")]
    Feature(&'static str),
}

pub type FrontendResult<T> = Result<T, FrontendError>;

#[derive(Clone, Debug)]
pub struct FrontendConfig {
    /// Request queues (the high-priority queue comes on top).
    pub request_queues: usize,
    pub queue_size: u16,
    /// In-flight requests per queue.
    pub slots: u16,
    /// Bytes for a request, and again for its reply, per slot.
    pub slot_bytes: u64,
    /// Offer EVENT_IDX (negotiated only if the backend has it too).
    pub event_idx: bool,
}

impl Default for FrontendConfig {
    fn default() -> Self {
        Self { request_queues: 1, queue_size: 256, slots: 32, slot_bytes: 132 << 10, event_idx: true }
    }
}

/// A descriptor written verbatim, for hand-built (possibly hostile)
/// chains. `next` counts from the first descriptor of the chain.
#[derive(Clone, Copy, Debug)]
pub struct RawDesc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

impl RawDesc {
    /// The 16 bytes of a split-ring descriptor.
    fn encode(&self) -> [u8; 16] {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&self.addr.to_le_bytes());
        raw[8..12].copy_from_slice(&self.len.to_le_bytes());
        raw[12..14].copy_from_slice(&self.flags.to_le_bytes());
        raw[14..].copy_from_slice(&self.next.to_le_bytes());
        raw
    }

    /// Write descriptors as a table at guest address `at`.
    fn write_table(mem: &GuestMemoryMmap, at: u64, descs: &[RawDesc]) -> FrontendResult<()> {
        for (i, d) in descs.iter().enumerate() {
            mem.write_slice(&d.encode(), GuestAddress(at + 16 * i as u64))
                .map_err(|e| FrontendError::Memory(e.to_string()))?;
        }
        Ok(())
    }
}

/// fuse_read_in / fuse_write_in for `size` bytes at `offset` through `fh`.
pub fn io_in(fh: u64, offset: u64, size: u32) -> Vec<u8> {
    let mut b = Reply::default();
    b.u64(fh).u64(offset).u32(size).u32(0).u64(0).u32(0).u32(0);
    b.bytes
}

/// A FUSE_READ or FUSE_WRITE request header as Linux's driver sends it
/// in its own buffer: fuse_in_header plus fuse_*_in. For a write, the
/// header's length also covers the `size` data bytes that follow in
/// separate buffers.
pub fn io_request(opcode: Opcode, unique: u64, nodeid: u64, fh: u64, offset: u64, size: u32) -> Vec<u8> {
    let mut header = encode_request(opcode as u32, unique, nodeid, 0, 0, &io_in(fh, offset, size));
    if opcode == Opcode::Write {
        let total = header.len() as u32 + size;
        header[..4].copy_from_slice(&total.to_le_bytes());
    }
    header
}

/// A used-ring entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Used {
    pub head: u16,
    pub len: u32,
}

struct Ring {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    buffers: u64,
    kick: EventFd,
    call: EventFd,
    free_slots: Vec<u16>,
    next_avail: u16,
    last_used: u16,
}

pub struct FsFrontend {
    frontend: Frontend,
    mem: GuestMemoryMmap,
    _memfd: File,
    config: FrontendConfig,
    drivers: Vec<Option<QueueDriver>>,
    event_idx: bool,
    unique: u64,
    /// The virtio features agreed, for turning LOG_ALL on.
    features: u64,
}

/// One virtqueue as a guest driver runs it. It can move to another
/// thread ([`FsFrontend::take_queue`]); the guest memory stays mapped as
/// long as any driver or the frontend holds it.
pub struct QueueDriver {
    index: usize,
    mem: GuestMemoryMmap,
    ring: Ring,
    event_idx: bool,
    slot_bytes: u64,
    slots: u16,
    unique: u64,
}

fn memfd(bytes: u64) -> io::Result<File> {
    // SAFETY: the name is a NUL-terminated literal and the flags are valid;
    // the call has no other inputs.
    let fd = unsafe { libc::memfd_create(c"keelfs-guest-memory".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create just returned this fd, so nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(bytes)?;
    Ok(file)
}

const fn align(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

/// Features and protocol features, agreed as QEMU agrees them; the virtio
/// features in force are returned.
fn negotiate(frontend: &mut Frontend, config: &FrontendConfig, queues: usize) -> FrontendResult<u64> {
    frontend.set_owner()?;
    let offered = frontend.get_features()?;
    if offered & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
        return Err(FrontendError::Feature("VHOST_USER_F_PROTOCOL_FEATURES"));
    }
    let mut wanted = VIRTIO_F_VERSION_1 | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    if config.event_idx {
        wanted |= VIRTIO_RING_F_EVENT_IDX;
    }
    let features = offered & wanted;
    let protocol = frontend.get_protocol_features()?;
    if queues > 1 && !protocol.contains(VhostUserProtocolFeatures::MQ) {
        return Err(FrontendError::Feature("VHOST_USER_PROTOCOL_F_MQ"));
    }
    frontend.set_protocol_features(
        protocol
            & (VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::DEVICE_STATE
                | VhostUserProtocolFeatures::LOG_SHMFD),
    )?;
    if (frontend.get_queue_num()? as usize) < queues {
        return Err(FrontendError::Feature("enough queues"));
    }
    frontend.set_features(features)?;
    Ok(features)
}

/// The dirty log a frontend shares with the backend while migrating.
pub struct DirtyLog {
    file: File,
    bytes: u64,
}

impl DirtyLog {
    /// The guest pages (address / 4096) logged since the last call, and
    /// the log cleared, as QEMU reads and clears it in each pass.
    pub fn take(&self) -> FrontendResult<Vec<u64>> {
        use std::os::unix::fs::FileExt;
        let mut log = vec![0u8; self.bytes as usize];
        self.file.read_exact_at(&mut log, 0)?;
        self.file.write_all_at(&vec![0u8; log.len()], 0)?;
        let pages = log
            .iter()
            .enumerate()
            .flat_map(|(i, &b)| (0..8).filter(move |bit| b & (1 << bit) != 0).map(move |bit| (i * 8 + bit) as u64));
        Ok(pages.collect())
    }
}

/// SET_DEVICE_STATE_FD with our end of a pipe, as QEMU sends it; a
/// backend that answers with a pipe of its own is not what QEMU 10 expects.
fn hand_state_fd(
    frontend: &Frontend,
    direction: VhostTransferStateDirection,
    fd: std::os::fd::OwnedFd,
) -> FrontendResult<()> {
    let own = frontend.set_device_state_fd(direction, VhostTransferStatePhase::STOPPED, fd)?;
    match own {
        Some(_) => Err(FrontendError::Feature("a state transfer through QEMU's pipe")),
        None => Ok(()),
    }
}

/// SET_DEVICE_STATE_FD (LOAD) with a pipe that a thread fills with
/// `state`, then CHECK_DEVICE_STATE, as QEMU loads a migrated device.
fn load_state(frontend: &Frontend, state: &[u8]) -> FrontendResult<()> {
    let (read, mut write) = std::io::pipe()?;
    hand_state_fd(frontend, VhostTransferStateDirection::LOAD, read.into())?;
    let bytes = state.to_vec();
    // The backend reads as this writes: a state larger than the pipe's
    // buffer would block a writer on this thread.
    let writer = std::thread::spawn(move || write.write_all(&bytes));
    let checked = frontend.check_device_state();
    // A backend that refused early may close its end first: EPIPE.
    let _ = writer.join();
    Ok(checked?)
}

/// Where one queue's rings sit in guest memory.
#[derive(Clone, Copy)]
struct RingLayout {
    /// The queue's first guest address: its descriptor table.
    base: u64,
    /// The three rings' bytes, each page-aligned; the buffers follow.
    rings_bytes: u64,
    /// Where guest address 0 is mapped in this process.
    host_base: u64,
}

/// Lays out queue `index`'s rings and hands them to the backend.
fn start_ring(frontend: &mut Frontend, index: usize, config: &FrontendConfig, at: RingLayout) -> FrontendResult<Ring> {
    let q = u64::from(config.queue_size);
    let desc = at.base;
    let avail = desc + align(16 * q, 4096);
    let used = avail + align(6 + 2 * q, 4096);
    let ring = Ring {
        size: config.queue_size,
        desc,
        avail,
        used,
        buffers: at.base + at.rings_bytes,
        kick: EventFd::new(EFD_NONBLOCK)?,
        call: EventFd::new(EFD_NONBLOCK)?,
        free_slots: (0..config.slots).rev().collect(),
        next_avail: 0,
        last_used: 0,
    };
    frontend.set_vring_num(index, config.queue_size)?;
    frontend.set_vring_addr(
        index,
        &VringConfigData {
            queue_max_size: config.queue_size,
            queue_size: config.queue_size,
            flags: 0,
            desc_table_addr: at.host_base + desc,
            used_ring_addr: at.host_base + used,
            avail_ring_addr: at.host_base + avail,
            log_addr: None,
        },
    )?;
    frontend.set_vring_base(index, 0)?;
    frontend.set_vring_call(index, &ring.call)?;
    frontend.set_vring_kick(index, &ring.kick)?;
    frontend.set_vring_enable(index, true)?;
    Ok(ring)
}

impl FsFrontend {
    /// Connect to a vhost-user-fs backend at `socket` and bring up its
    /// queues, as QEMU does when a guest's driver starts.
    pub fn connect(socket: &Path, config: FrontendConfig) -> FrontendResult<Self> {
        Self::connect_loading(socket, config, None)
    }

    /// [`Self::connect`] as a migration's destination QEMU does: hand the
    /// backend `state` (SET_DEVICE_STATE_FD LOAD, then CHECK_DEVICE_STATE)
    /// before guest memory and rings exist. A refused state is an error.
    pub fn connect_with_state(socket: &Path, config: FrontendConfig, state: &[u8]) -> FrontendResult<Self> {
        Self::connect_loading(socket, config, Some(state))
    }

    fn connect_loading(socket: &Path, config: FrontendConfig, state: Option<&[u8]>) -> FrontendResult<Self> {
        assert!(config.slots > 0 && u32::from(config.slots) * 8 <= u32::from(config.queue_size));
        assert!(config.slot_bytes.is_multiple_of(4096) && config.slot_bytes > 4096);
        assert!(config.queue_size.is_power_of_two());
        let queues = config.request_queues + 1;
        let q = u64::from(config.queue_size);
        let rings_bytes = align(16 * q, 4096) + align(6 + 2 * q, 4096) + align(6 + 8 * q, 4096);
        let queue_span = align(rings_bytes + u64::from(config.slots) * 2 * config.slot_bytes, 1 << 20);
        let mem_bytes = queue_span * queues as u64;

        let file = memfd(mem_bytes)?;
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0),
            mem_bytes as usize,
            Some(FileOffset::new(file.try_clone()?, 0)),
        )])
        .map_err(|e| FrontendError::Memory(e.to_string()))?;
        let host_base = mem.get_host_address(GuestAddress(0)).map_err(|e| FrontendError::Memory(e.to_string()))? as u64;

        let mut frontend = Frontend::connect(socket, queues as u64)?;
        let features = negotiate(&mut frontend, &config, queues)?;
        if let Some(state) = state {
            load_state(&frontend, state)?;
        }
        frontend.set_mem_table(&[VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: mem_bytes,
            userspace_addr: host_base,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        }])?;

        let mut drivers = Vec::with_capacity(queues);
        for index in 0..queues {
            let layout = RingLayout { base: index as u64 * queue_span, rings_bytes, host_base };
            let ring = start_ring(&mut frontend, index, &config, layout)?;
            drivers.push(Some(QueueDriver {
                index,
                mem: mem.clone(),
                ring,
                event_idx: features & VIRTIO_RING_F_EVENT_IDX != 0,
                slot_bytes: config.slot_bytes,
                slots: config.slots,
                unique: (index as u64) << 48,
            }));
        }
        Ok(Self {
            frontend,
            mem,
            _memfd: file,
            config,
            drivers,
            event_idx: features & VIRTIO_RING_F_EVENT_IDX != 0,
            unique: 1 << 60,
            features,
        })
    }

    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// Bytes of guest memory: addresses at or past this are outside it.
    pub fn memory_size(&self) -> u64 {
        self.mem.iter().map(|r| r.len()).sum()
    }

    pub fn event_idx(&self) -> bool {
        self.event_idx
    }

    /// Queues, the high-priority one (index 0) included.
    pub fn queues(&self) -> usize {
        self.drivers.len()
    }

    fn driver(&self, queue: usize) -> &QueueDriver {
        self.drivers[queue].as_ref().unwrap_or_else(|| panic!("queue {queue} was taken by take_queue"))
    }

    fn driver_mut(&mut self, queue: usize) -> &mut QueueDriver {
        self.drivers[queue].as_mut().unwrap_or_else(|| panic!("queue {queue} was taken by take_queue"))
    }

    /// Hand queue `queue` to its own thread (a load generator's worker).
    pub fn take_queue(&mut self, queue: usize) -> QueueDriver {
        self.drivers[queue].take().unwrap_or_else(|| panic!("queue {queue} was already taken"))
    }

    pub fn submit(&mut self, queue: usize, request: &[u8], reply_capacity: u32) -> FrontendResult<u16> {
        self.driver_mut(queue).submit(request, reply_capacity)
    }

    pub fn raw_base(&self) -> u16 {
        4 * self.config.slots
    }

    pub fn jump_avail_index(&mut self, queue: usize, ahead: u16) -> FrontendResult<()> {
        self.driver_mut(queue).jump_avail_index(ahead)
    }

    pub fn submit_split(
        &mut self,
        queue: usize,
        header: &[u8],
        write_data: &[u8],
        read_len: u32,
    ) -> FrontendResult<u16> {
        self.driver_mut(queue).submit_split(header, write_data, read_len)
    }

    pub fn read_data(&self, queue: usize, used: Used, len: usize) -> FrontendResult<Vec<u8>> {
        self.driver(queue).read_data(used, len)
    }

    pub fn poison_next_read(&self, queue: usize, byte: u8, len: usize) -> FrontendResult<()> {
        self.driver(queue).poison_next_read(byte, len)
    }

    pub fn scratch(&self, queue: usize) -> u64 {
        self.driver(queue).scratch()
    }

    /// Where `submit_split` puts the write data of each slot of `queue`:
    /// (guest address, bytes), for a test playing a guest that rewrites
    /// its buffers while the device holds them.
    pub fn write_data_areas(&self, queue: usize) -> Vec<(u64, u64)> {
        let d = self.driver(queue);
        (0..d.slots).map(|slot| (d.slot_addr(slot).0 + 4096, d.slot_bytes - 4096)).collect()
    }

    pub fn submit_raw(&mut self, queue: usize, descs: &[RawDesc]) -> FrontendResult<u16> {
        self.driver_mut(queue).submit_raw(descs)
    }

    pub fn submit_raw_at(&mut self, queue: usize, base: u16, descs: &[RawDesc]) -> FrontendResult<u16> {
        self.driver_mut(queue).submit_raw_at(base, descs)
    }

    /// Write `descs` as an indirect descriptor table at guest address `at`
    /// (their `next` fields index the table); returns the descriptor that
    /// points at it.
    pub fn write_indirect_table(&self, at: u64, descs: &[RawDesc]) -> FrontendResult<RawDesc> {
        RawDesc::write_table(&self.mem, at, descs)?;
        Ok(RawDesc { addr: at, len: 16 * descs.len() as u32, flags: DESC_INDIRECT, next: 0 })
    }

    pub fn submit_head(&mut self, queue: usize, head: u16) -> FrontendResult<()> {
        self.driver_mut(queue).submit_head(head)
    }

    pub fn poll(&mut self, queue: usize) -> FrontendResult<Vec<Used>> {
        self.driver_mut(queue).poll()
    }

    pub fn wait(&mut self, queue: usize, timeout: Duration) -> FrontendResult<Vec<Used>> {
        self.driver_mut(queue).wait(timeout)
    }

    pub fn take_signals(&mut self, queue: usize) -> u64 {
        self.driver_mut(queue).take_signals()
    }

    pub fn reply(&self, queue: usize, used: Used) -> FrontendResult<Vec<u8>> {
        self.driver(queue).reply(used)
    }

    /// A request id for requests built by hand (drivers number their own).
    pub fn next_unique(&mut self) -> u64 {
        self.unique += 1;
        self.unique
    }

    pub fn fuse(&mut self, queue: usize, opcode: Opcode, nodeid: u64, body: &[u8]) -> FrontendResult<(i32, Vec<u8>)> {
        self.driver_mut(queue).fuse(opcode, nodeid, body)
    }

    pub fn fuse_raw(&mut self, queue: usize, opcode: u32, nodeid: u64, body: &[u8]) -> FrontendResult<(i32, Vec<u8>)> {
        self.driver_mut(queue).fuse_raw(opcode, nodeid, body)
    }

    pub fn exchange(&mut self, queue: usize, unique: u64, request: &[u8]) -> FrontendResult<(i32, Vec<u8>)> {
        self.driver_mut(queue).exchange(unique, request)
    }

    pub fn wait_for(&mut self, queue: usize, head: u16, timeout: Duration) -> FrontendResult<Used> {
        self.driver_mut(queue).wait_for(head, timeout)
    }

    /// FUSE_INIT on the first request queue; the flags granted.
    pub fn init(&mut self, flags: u64) -> FrontendResult<u64> {
        self.driver_mut(1).init(flags)
    }

    /// Stop every queue and take the backend's state, as QEMU does at a
    /// migration's switch-over: GET_VRING_BASE on each ring, then
    /// SET_DEVICE_STATE_FD (SAVE) with a pipe, read to its end, and
    /// CHECK_DEVICE_STATE.
    pub fn save_state(&mut self) -> FrontendResult<Vec<u8>> {
        for queue in 0..self.drivers.len() {
            self.frontend.get_vring_base(queue)?;
        }
        let (mut read, write) = std::io::pipe()?;
        hand_state_fd(&self.frontend, VhostTransferStateDirection::SAVE, write.into())?;
        let mut bytes = Vec::new();
        read.read_to_end(&mut bytes)?;
        self.frontend.check_device_state()?;
        Ok(bytes)
    }

    /// Turn dirty logging on as QEMU does when a migration starts: a log
    /// memfd (SET_LOG_BASE, one bit per 4 KiB guest page), then LOG_ALL.
    pub fn start_dirty_log(&mut self) -> FrontendResult<DirtyLog> {
        let pages = self.memory_size().div_ceil(4096);
        let bytes = align(pages.div_ceil(8), 8);
        let file = memfd(bytes)?;
        let region = vhost::VhostUserDirtyLogRegion { mmap_size: bytes, mmap_offset: 0, mmap_handle: file.as_raw_fd() };
        self.frontend.set_log_base(0, Some(region))?;
        self.frontend.set_features(self.features | VhostUserVirtioFeatures::LOG_ALL.bits())?;
        Ok(DirtyLog { file, bytes })
    }

    /// The guest address of the data part of `used`'s reply buffer.
    pub fn reply_data_addr(&self, queue: usize, used: Used) -> u64 {
        self.driver(queue).slot_addr(used.head / 4).1 + 4096
    }

    /// The guest address of queue `queue`'s used ring.
    pub fn used_ring_addr(&self, queue: usize) -> u64 {
        self.driver(queue).ring.used
    }

    /// Start every queue again where it stopped, on the same connection,
    /// as QEMU restarts a migration's source device when the migration
    /// fails after the switch-over began.
    pub fn resume_queues(&mut self) -> FrontendResult<()> {
        let host_base =
            self.mem.get_host_address(GuestAddress(0)).map_err(|e| FrontendError::Memory(e.to_string()))? as u64;
        for index in 0..self.drivers.len() {
            let ring = &self.drivers[index].as_ref().ok_or(FrontendError::Feature("every queue driver at hand"))?.ring;
            self.frontend.set_vring_num(index, ring.size)?;
            self.frontend.set_vring_addr(
                index,
                &VringConfigData {
                    queue_max_size: ring.size,
                    queue_size: ring.size,
                    flags: 0,
                    desc_table_addr: host_base + ring.desc,
                    used_ring_addr: host_base + ring.used,
                    avail_ring_addr: host_base + ring.avail,
                    log_addr: None,
                },
            )?;
            self.frontend.set_vring_base(index, ring.next_avail)?;
            self.frontend.set_vring_call(index, &ring.call)?;
            self.frontend.set_vring_kick(index, &ring.kick)?;
            self.frontend.set_vring_enable(index, true)?;
        }
        Ok(())
    }

    /// Stop a queue as QEMU does at VM reset; returns its next avail index.
    pub fn stop_queue(&mut self, queue: usize) -> FrontendResult<u32> {
        Ok(self.frontend.get_vring_base(queue)?)
    }
}

impl QueueDriver {
    pub fn index(&self) -> usize {
        self.index
    }

    fn slot_addr(&self, slot: u16) -> (u64, u64) {
        let base = self.ring.buffers + u64::from(slot) * 2 * self.slot_bytes;
        (base, base + self.slot_bytes)
    }

    fn write_desc(&self, index: u16, d: RawDesc) -> FrontendResult<()> {
        RawDesc::write_table(&self.mem, self.ring.desc + 16 * u64::from(index), &[d])
    }

    fn mem_err(e: vm_memory::GuestMemoryError) -> FrontendError {
        FrontendError::Memory(e.to_string())
    }

    /// Make `head` available and kick the backend if it wants kicks.
    fn publish(&mut self, head: u16) -> FrontendResult<()> {
        let ring = &self.ring;
        let (size, avail, used, old) = (ring.size, ring.avail, ring.used, ring.next_avail);
        let slot = avail + 4 + 2 * u64::from(old % size);
        self.mem.write_obj(head, GuestAddress(slot)).map_err(Self::mem_err)?;
        let new = old.wrapping_add(1);
        // The entry must be visible before the index that covers it.
        fence(Ordering::Release);
        self.mem.store(new, GuestAddress(avail + 2), Ordering::Release).map_err(Self::mem_err)?;
        self.ring.next_avail = new;
        fence(Ordering::SeqCst);
        let kick = if self.event_idx {
            let avail_event: u16 = self
                .mem
                .load(GuestAddress(used + 4 + 8 * u64::from(size)), Ordering::Acquire)
                .map_err(Self::mem_err)?;
            // virtio's vring_need_event: did we pass the index it waits for?
            new.wrapping_sub(avail_event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            let flags: u16 = self.mem.load(GuestAddress(used), Ordering::Acquire).map_err(Self::mem_err)?;
            flags & VRING_USED_F_NO_NOTIFY == 0
        };
        if kick {
            self.ring.kick.write(1)?;
        }
        Ok(())
    }

    /// Put `request` into a free slot of `queue`, with `reply_capacity`
    /// bytes for the answer, and make it available. Returns the chain head.
    pub fn submit(&mut self, request: &[u8], reply_capacity: u32) -> FrontendResult<u16> {
        let slot_bytes = self.slot_bytes;
        if request.len() as u64 > slot_bytes || u64::from(reply_capacity) > slot_bytes {
            return Err(FrontendError::TooLarge(request.len().max(reply_capacity as usize), slot_bytes as usize));
        }
        let slot = self.ring.free_slots.pop().ok_or(FrontendError::Full(self.index))?;
        let (req_addr, reply_addr) = self.slot_addr(slot);
        self.mem.write_slice(request, GuestAddress(req_addr)).map_err(Self::mem_err)?;
        let head = 4 * slot;
        self.write_desc(head, RawDesc { addr: req_addr, len: request.len() as u32, flags: DESC_NEXT, next: head + 1 })?;
        self.write_desc(head + 1, RawDesc { addr: reply_addr, len: reply_capacity, flags: DESC_WRITE, next: 0 })?;
        self.publish(head)?;
        Ok(head)
    }

    /// First descriptor index free for hand-built chains.
    pub fn raw_base(&self) -> u16 {
        4 * self.slots
    }

    /// A request laid out as Linux's virtio-fs driver lays out I/O: the
    /// header (with its fuse_*_in) in one buffer, write data in its own
    /// page-aligned buffer, a 16-byte reply header, then a page-aligned
    /// buffer of `read_len` bytes for read data.
    pub fn submit_split(&mut self, header: &[u8], write_data: &[u8], read_len: u32) -> FrontendResult<u16> {
        let room = self.slot_bytes - 4096;
        if header.len() > 4096 || write_data.len() as u64 > room || u64::from(read_len) > room {
            return Err(FrontendError::TooLarge(header.len() + write_data.len().max(read_len as usize), room as usize));
        }
        let slot = self.ring.free_slots.pop().ok_or(FrontendError::Full(self.index))?;
        let (req, reply) = self.slot_addr(slot);
        self.mem.write_slice(header, GuestAddress(req)).map_err(Self::mem_err)?;
        self.mem.write_slice(write_data, GuestAddress(req + 4096)).map_err(Self::mem_err)?;
        let head = 4 * slot;
        let mut descs = vec![RawDesc { addr: req, len: header.len() as u32, flags: 0, next: 0 }];
        if !write_data.is_empty() {
            descs.push(RawDesc { addr: req + 4096, len: write_data.len() as u32, flags: 0, next: 0 });
        }
        if read_len > 0 {
            descs.push(RawDesc { addr: reply, len: OUT_HEADER_BYTES as u32, flags: DESC_WRITE, next: 0 });
            descs.push(RawDesc { addr: reply + 4096, len: read_len, flags: DESC_WRITE, next: 0 });
        } else {
            descs.push(RawDesc { addr: reply, len: 4096, flags: DESC_WRITE, next: 0 });
        }
        let last = descs.len() - 1;
        for (i, d) in descs.into_iter().enumerate() {
            let index = head + i as u16;
            let (flags, next) = if i < last { (d.flags | DESC_NEXT, index + 1) } else { (d.flags, 0) };
            self.write_desc(index, RawDesc { flags, next, ..d })?;
        }
        self.publish(head)?;
        Ok(head)
    }

    /// The read data of a finished [`Self::submit_split`]: `len` bytes.
    pub fn read_data(&self, used: Used, len: usize) -> FrontendResult<Vec<u8>> {
        let (_, reply) = self.slot_addr(used.head / 4);
        let mut out = vec![0u8; len];
        self.mem.read_slice(&mut out, GuestAddress(reply + 4096)).map_err(Self::mem_err)?;
        Ok(out)
    }

    /// Fill the read-data buffer of the slot that `submit_split` will use
    /// next, so that a test can see which bytes the backend wrote.
    pub fn poison_next_read(&self, byte: u8, len: usize) -> FrontendResult<()> {
        let slot = *self.ring.free_slots.last().ok_or(FrontendError::Full(self.index))?;
        let (_, reply) = self.slot_addr(slot);
        self.mem.write_slice(&vec![byte; len], GuestAddress(reply + 4096)).map_err(Self::mem_err)
    }

    /// Address of a scratch area of `slot_bytes` that hand-built chains
    /// may point at (the request half of the last slot, which `submit`
    /// hands out last).
    pub fn scratch(&self) -> u64 {
        self.slot_addr(self.slots - 1).0
    }

    /// Write `descs` verbatim from [`Self::raw_base`] on (their `next`
    /// fields relative to it) and make the first available. Wait for it
    /// before building another.
    pub fn submit_raw(&mut self, descs: &[RawDesc]) -> FrontendResult<u16> {
        self.submit_raw_at(self.raw_base(), descs)
    }

    /// [`Self::submit_raw`] from descriptor `base` on, which may be a slot's
    /// (only while that slot is idle).
    pub fn submit_raw_at(&mut self, base: u16, descs: &[RawDesc]) -> FrontendResult<u16> {
        assert!(usize::from(base) + descs.len() <= usize::from(self.ring.size));
        for (i, d) in descs.iter().enumerate() {
            let next = if d.flags & DESC_NEXT != 0 { base.wrapping_add(d.next) } else { d.next };
            self.write_desc(base + i as u16, RawDesc { next, ..*d })?;
        }
        self.publish(base)?;
        Ok(base)
    }

    /// Publish a head index as is, even one that names no descriptor.
    pub fn submit_head(&mut self, head: u16) -> FrontendResult<()> {
        self.publish(head)
    }

    /// A broken driver: move the avail index `ahead` entries past what was
    /// published, with no entries behind it, and kick.
    pub fn jump_avail_index(&mut self, ahead: u16) -> FrontendResult<()> {
        let new = self.ring.next_avail.wrapping_add(ahead);
        fence(Ordering::Release);
        self.mem.store(new, GuestAddress(self.ring.avail + 2), Ordering::Release).map_err(Self::mem_err)?;
        self.ring.next_avail = new;
        self.ring.kick.write(1)?;
        Ok(())
    }

    /// Used entries that arrived since the last call. Slots of finished
    /// `submit`s become free again.
    pub fn poll(&mut self) -> FrontendResult<Vec<Used>> {
        let ring = &self.ring;
        let used_idx: u16 = self.mem.load(GuestAddress(ring.used + 2), Ordering::Acquire).map_err(Self::mem_err)?;
        let mut out = Vec::new();
        let mut next = ring.last_used;
        while next != used_idx {
            let at = ring.used + 4 + 8 * u64::from(next % ring.size);
            let id: u32 = self.mem.read_obj(GuestAddress(at)).map_err(Self::mem_err)?;
            let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).map_err(Self::mem_err)?;
            out.push(Used { head: id as u16, len });
            next = next.wrapping_add(1);
        }
        let (avail, size) = (ring.avail, ring.size);
        self.ring.last_used = used_idx;
        // Ask to be signalled at the very next completion.
        self.mem
            .store(used_idx, GuestAddress(avail + 4 + 2 * u64::from(size)), Ordering::Release)
            .map_err(Self::mem_err)?;
        for used in &out {
            if used.head < self.raw_base() && used.head % 4 == 0 {
                self.ring.free_slots.push(used.head / 4);
            }
        }
        Ok(out)
    }

    /// Wait until at least one used entry arrives.
    pub fn wait(&mut self, timeout: Duration) -> FrontendResult<Vec<Used>> {
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            let used = self.poll()?;
            if !used.is_empty() {
                let _ = self.ring.call.read();
                return Ok(used);
            }
            if Instant::now() >= deadline {
                return Err(FrontendError::Timeout { queue: self.index, timeout });
            }
            spins += 1;
            if spins < 200 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Wait until at least one used entry arrives, asleep on the call
    /// eventfd as a guest's vCPU halts while its I/O is in flight (a
    /// polling driver takes a core from the backend it measures).
    pub fn wait_signalled(&mut self, timeout: Duration) -> FrontendResult<Vec<Used>> {
        let deadline = Instant::now() + timeout;
        loop {
            // poll() also asks to be signalled at the next completion.
            let used = self.poll()?;
            if !used.is_empty() {
                return Ok(used);
            }
            // A completion published before that request reached the
            // backend may not signal: look once more before sleeping.
            fence(Ordering::SeqCst);
            let used_idx: u16 =
                self.mem.load(GuestAddress(self.ring.used + 2), Ordering::Acquire).map_err(Self::mem_err)?;
            if used_idx != self.ring.last_used {
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FrontendError::Timeout { queue: self.index, timeout });
            }
            let mut pollfd = libc::pollfd { fd: self.ring.call.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd, for the duration of the call.
            unsafe { libc::poll(&mut pollfd, 1, ms) };
            let _ = self.ring.call.read();
        }
    }

    /// How many times the backend signalled `queue` since the last look.
    pub fn take_signals(&mut self) -> u64 {
        self.ring.call.read().unwrap_or(0)
    }

    /// The reply bytes of a finished `submit` (head and used length).
    pub fn reply(&self, used: Used) -> FrontendResult<Vec<u8>> {
        let (_, reply_addr) = self.slot_addr(used.head / 4);
        let len = (used.len as u64).min(self.slot_bytes) as usize;
        let mut out = vec![0u8; len];
        self.mem.read_slice(&mut out, GuestAddress(reply_addr)).map_err(Self::mem_err)?;
        Ok(out)
    }

    pub fn next_unique(&mut self) -> u64 {
        self.unique += 1;
        self.unique
    }

    /// One FUSE request, synchronously: (error, reply body). `error` is the
    /// positive errno, 0 on success.
    pub fn fuse(&mut self, opcode: Opcode, nodeid: u64, body: &[u8]) -> FrontendResult<(i32, Vec<u8>)> {
        self.fuse_raw(opcode as u32, nodeid, body)
    }

    /// [`Self::fuse`] with any opcode number, unknown ones included.
    pub fn fuse_raw(&mut self, opcode: u32, nodeid: u64, body: &[u8]) -> FrontendResult<(i32, Vec<u8>)> {
        let unique = self.next_unique();
        let request = encode_request(opcode, unique, nodeid, 0, 0, body);
        self.exchange(unique, &request)
    }

    /// Send a request already encoded (with `unique` in its header) and
    /// wait for its reply: (positive errno or 0, reply body).
    pub fn exchange(&mut self, unique: u64, request: &[u8]) -> FrontendResult<(i32, Vec<u8>)> {
        let capacity = self.slot_bytes as u32;
        let head = self.submit(request, capacity)?;
        let used = self.wait_for(head, Duration::from_secs(30))?;
        let reply = self.reply(used)?;
        if reply.len() < OUT_HEADER_BYTES {
            return Err(FrontendError::Memory(format!("short reply: {} bytes", reply.len())));
        }
        let error = -i32::from_le_bytes(reply[4..8].try_into().expect("4 bytes"));
        let echoed = u64::from_le_bytes(reply[8..16].try_into().expect("8 bytes"));
        if echoed != unique {
            return Err(FrontendError::Memory(format!("reply for request {echoed}, expected {unique}")));
        }
        Ok((error, reply[OUT_HEADER_BYTES..].to_vec()))
    }

    /// Wait for the chain headed by `head`, setting aside nothing: other
    /// completions that arrive meanwhile are dropped, so use this only
    /// with one request in flight.
    pub fn wait_for(&mut self, head: u16, timeout: Duration) -> FrontendResult<Used> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(used) = self.wait(left)?.into_iter().find(|u| u.head == head) {
                return Ok(used);
            }
        }
    }

    /// FUSE_INIT as Linux 6.12 sends it; returns the flags the backend
    /// granted.
    pub fn init(&mut self, flags: u64) -> FrontendResult<u64> {
        let mut body = Reply::default();
        body.u32(7).u32(38).u32(128 << 10).u32(flags as u32).u32((flags >> 32) as u32).raw(&[0u8; 44]);
        let (error, reply) = self.fuse(Opcode::Init, 0, &body.bytes)?;
        if error != 0 || reply.len() < 28 {
            return Err(FrontendError::Memory(format!("FUSE_INIT failed: errno {error}")));
        }
        let low = u32::from_le_bytes(reply[12..16].try_into().expect("4 bytes"));
        let high = if reply.len() >= 36 { u32::from_le_bytes(reply[32..36].try_into().expect("4 bytes")) } else { 0 };
        Ok(u64::from(low) | (u64::from(high) << 32))
    }
}
