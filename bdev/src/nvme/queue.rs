//! One I/O submission/completion queue pair, owned by one reactor.
//!
//! Everything here is private to the owning thread: the rings, the PRP list
//! pages, the bounce arena and the translation table live in one DMA buffer
//! the queue owns, and no lock or atomic read-modify-write is taken to
//! submit or complete. Per poll the queue does two relaxed loads (the reset
//! generation and the DMA registry's generation) to notice the rare events
//! that other threads cause.
//!
//! Data moves by DMA straight to and from the caller's memory when the
//! registry maps it (guest memory) and its segments fit the PRP rules;
//! otherwise it is bounced through this queue's own arena, one copy.

use std::collections::VecDeque;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::dma::{DmaBuffer, Translation, PAGE_BYTES};
use super::spec::*;
use super::Shared;
use crate::{
    validate_request, AlignedBuf, BdevError, BufferPool, Completion, Geometry, IoKind, IoQueue, IoRequest, IoVec,
    QueueConfig, Token,
};

const BOUNCE_CHUNK_BYTES: usize = 64 << 10;
const BOUNCE_CHUNKS: usize = 128;
const TIMEOUT_CHECK_EVERY_POLLS: u32 = 64;

#[derive(Clone, Copy, Debug, Default)]
pub struct QueueCounters {
    /// Read and write requests whose data moved by DMA to caller memory.
    pub direct: u64,
    /// Requests copied through the bounce arena.
    pub bounced: u64,
    pub commands: u64,
    pub timeouts: u64,
    pub rebuilds: u64,
}

impl std::ops::AddAssign<&QueueCounters> for QueueCounters {
    fn add_assign(&mut self, c: &QueueCounters) {
        self.direct += c.direct;
        self.bounced += c.bounced;
        self.commands += c.commands;
        self.timeouts += c.timeouts;
        self.rebuilds += c.rebuilds;
    }
}

#[derive(Default)]
struct Slot {
    token: Token,
    offset: u64,
    bytes: u32,
    commands_left: u16,
    error: Option<BdevError>,
    /// First chunk and chunk count in the bounce arena.
    bounce: Option<(u32, u32)>,
    /// Where a bounced read's data goes at completion.
    read_into: Vec<IoVec>,
    busy: bool,
}

#[derive(Clone, Copy)]
struct CommandState {
    slot: u16,
    busy: bool,
    submitted: Instant,
}

pub struct NvmeQueue {
    shared: Arc<Shared>,
    qid: u16,
    entries: u16,
    mem: DmaBuffer,
    cq_offset: usize,
    prp_offset: usize,
    bounce_offset: usize,
    sq_doorbell: *mut u32,
    cq_doorbell: *mut u32,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    doorbell_pending: bool,
    slots: Vec<Slot>,
    free_slots: Vec<u16>,
    commands: Vec<CommandState>,
    free_cids: Vec<u16>,
    /// One bit per bounce chunk, set when free.
    bounce_free: u128,
    translation: Translation,
    ready: VecDeque<Completion>,
    accepted: usize,
    reset_generation: u64,
    polls: u32,
    clock: Instant,
    /// The controller is gone; every request fails.
    dead: bool,
    segments: Vec<(u64, usize)>,
    prp: Vec<u64>,
    /// Registered buffer pools, mapped for DMA while this queue lives.
    pools: Vec<(usize, Arc<AlignedBuf>)>,
    pub counters: QueueCounters,
}

// SAFETY: the doorbell pointers and DMA memory belong to this queue alone;
// it moves between threads only as a whole (&mut self everywhere).
unsafe impl Send for NvmeQueue {}

impl NvmeQueue {
    pub(super) fn new(shared: Arc<Shared>, config: QueueConfig) -> Result<Self, BdevError> {
        let depth = config.depth.clamp(1, 4096) as usize;
        let mut controller = shared.lock_controller();
        let entries = (2 * depth).clamp(64, 1024).min(controller.cap.max_queue_entries() as usize) as u16;
        // The largest request must fit in the ring at once, or it would be
        // refused as QueueFull for ever.
        let largest = shared.geometry.max_request_bytes.div_ceil(shared.max_transfer_bytes) as usize;
        if usize::from(entries) <= largest {
            return Err(BdevError::Setup {
                step: "size an NVMe queue (the controller's queues are too short)",
                errno: libc::EINVAL,
            });
        }
        let sq_bytes = usize::from(entries) * 64;
        let cq_offset = sq_bytes.next_multiple_of(PAGE_BYTES as usize);
        let prp_offset = cq_offset + (usize::from(entries) * 16).next_multiple_of(PAGE_BYTES as usize);
        let bounce_offset = prp_offset + usize::from(entries) * PAGE_BYTES as usize;
        let total = bounce_offset + BOUNCE_CHUNKS * BOUNCE_CHUNK_BYTES;
        let mem = DmaBuffer::new(&shared.registry, total)
            .map_err(|_| BdevError::Setup { step: "allocate NVMe queue memory", errno: libc::ENOMEM })?;
        let qid = controller.allocate_qid(shared.queue_limit).ok_or(BdevError::Setup {
            step: "allocate an NVMe I/O queue pair (all granted ones in use)",
            errno: libc::EBUSY,
        })?;
        if let Err(e) = controller.create_io_queue(qid, entries, mem.iova(), mem.iova() + cq_offset as u64) {
            controller.release_qid(qid);
            tracing::error!(queue = qid, "creating an NVMe I/O queue pair failed: {e}");
            return Err(BdevError::Setup { step: "create NVMe I/O queue pair", errno: libc::EIO });
        }
        let (sq_doorbell, cq_doorbell) = controller.doorbells(qid);
        let reset_generation = shared.reset_generation.load(Ordering::Acquire);
        drop(controller);
        let now = Instant::now();
        let mut queue = Self {
            qid,
            entries,
            mem,
            cq_offset,
            prp_offset,
            bounce_offset,
            sq_doorbell,
            cq_doorbell,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            doorbell_pending: false,
            slots: (0..depth).map(|_| Slot::default()).collect(),
            free_slots: (0..depth as u16).rev().collect(),
            commands: vec![CommandState { slot: 0, busy: false, submitted: now }; usize::from(entries) - 1],
            free_cids: (0..entries - 1).rev().collect(),
            bounce_free: u128::MAX,
            translation: Translation::default(),
            ready: VecDeque::with_capacity(depth),
            accepted: 0,
            reset_generation,
            polls: 0,
            clock: now,
            dead: false,
            segments: Vec::with_capacity(crate::MAX_IOVECS_PER_REQUEST as usize),
            prp: Vec::with_capacity(512),
            pools: Vec::new(),
            counters: QueueCounters::default(),
            shared,
        };
        queue.shared.registry.snapshot(&mut queue.translation);
        Ok(queue)
    }

    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Find `count` free consecutive bounce chunks.
    fn take_bounce(&mut self, count: u32) -> Option<u32> {
        let mask = if count >= 128 { u128::MAX } else { (1u128 << count) - 1 };
        let mut start = 0u32;
        while start + count <= BOUNCE_CHUNKS as u32 {
            let window = mask << start;
            if self.bounce_free & window == window {
                self.bounce_free &= !window;
                return Some(start);
            }
            start += 1;
        }
        None
    }

    fn give_bounce(&mut self, start: u32, count: u32) {
        let mask = if count >= 128 { u128::MAX } else { (1u128 << count) - 1 };
        debug_assert_eq!(self.bounce_free & (mask << start), 0, "bounce chunks freed twice");
        self.bounce_free |= mask << start;
    }

    fn bounce_ptr(&self, chunk: u32) -> *mut u8 {
        // SAFETY: chunk < BOUNCE_CHUNKS, inside the queue's buffer.
        unsafe { self.mem.as_ptr().add(self.bounce_offset + chunk as usize * BOUNCE_CHUNK_BYTES) }
    }

    /// The caller's segments as IOVAs, if the device can reach them and
    /// they form a valid PRP chain (only the first may start inside a
    /// page, only the last may end inside one).
    fn direct_segments(&mut self, iovecs: &[IoVec]) -> bool {
        self.segments.clear();
        let last = iovecs.len() - 1;
        for (i, v) in iovecs.iter().enumerate() {
            let Some(iova) = self.translation.translate(v.base as usize, v.len) else { return false };
            let starts_ok = if i == 0 { iova.is_multiple_of(4) } else { iova.is_multiple_of(PAGE_BYTES) };
            let ends_ok = i == last || (iova + v.len as u64).is_multiple_of(PAGE_BYTES);
            if !starts_ok || !ends_ok {
                return false;
            }
            self.segments.push((iova, v.len));
        }
        true
    }

    fn commands_for(&self, kind: IoKind, total: u64) -> usize {
        match kind {
            IoKind::Read | IoKind::Write => total.div_ceil(u64::from(self.shared.max_transfer_bytes)) as usize,
            IoKind::Flush | IoKind::Discard { .. } => 1,
        }
    }

    /// Write one command at the submission tail; the doorbell is rung at
    /// the next poll, once for the batch.
    fn push_command(&mut self, slot: u16, mut command: Command) {
        if self.free_cids.len() == self.commands.len() {
            // The first command after an idle spell: refresh the coarse
            // clock that timeouts are measured with.
            self.clock = Instant::now();
        }
        let cid = self.free_cids.pop().expect("caller checked free command ids");
        command.set_cid(cid);
        self.commands[usize::from(cid)] = CommandState { slot, busy: true, submitted: self.clock };
        // SAFETY: sq_tail < entries, so the entry lies in the SQ area of the
        // queue's buffer, which only the controller reads.
        unsafe {
            let sq = self.mem.as_ptr().cast::<Command>();
            std::ptr::write_volatile(sq.add(usize::from(self.sq_tail)), command);
        }
        tracing::trace!(
            queue = self.qid,
            tail = self.sq_tail,
            cid,
            "submit op {:#x} slba {:#x} nlb {} prp1 {:#x} prp2 {:#x}",
            command.opcode(),
            u64::from(command.cdw10) | (u64::from(command.cdw11) << 32),
            command.cdw12 & 0xffff,
            command.prp1,
            command.prp2
        );
        self.sq_tail = (self.sq_tail + 1) % self.entries;
        self.doorbell_pending = true;
        self.counters.commands += 1;
    }

    /// Fill `command`'s data pointers for bytes [start, start+len) of the
    /// request's segments, using command id `cid`'s PRP list page if needed.
    fn set_prps(&mut self, command: &mut Command, cid_hint: u16, start: usize, len: usize) {
        self.prp.clear();
        let mut skip = start;
        let mut remaining = len;
        for &(iova, seg_len) in &self.segments {
            if skip >= seg_len {
                skip -= seg_len;
                continue;
            }
            let mut addr = iova + skip as u64;
            let mut left = seg_len - skip;
            skip = 0;
            while left > 0 && remaining > 0 {
                self.prp.push(addr);
                let in_page = ((PAGE_BYTES - addr % PAGE_BYTES) as usize).min(left).min(remaining);
                addr += in_page as u64;
                left -= in_page;
                remaining -= in_page;
            }
            if remaining == 0 {
                break;
            }
        }
        debug_assert_eq!(remaining, 0, "segments shorter than the request");
        command.prp1 = self.prp[0];
        match self.prp.len() {
            1 => {}
            2 => command.prp2 = self.prp[1],
            n => {
                assert!(n - 1 <= 512, "a PRP list longer than one page");
                let page = self.prp_offset + usize::from(cid_hint) * PAGE_BYTES as usize;
                // SAFETY: the page belongs to command id `cid_hint`, which is
                // free until this command is pushed; n-1 entries fit in it.
                unsafe {
                    let list = self.mem.as_ptr().add(page).cast::<u64>();
                    for (i, &p) in self.prp[1..].iter().enumerate() {
                        std::ptr::write_volatile(list.add(i), p);
                    }
                }
                command.prp2 = self.mem.iova() + page as u64;
            }
        }
    }

    fn reap(&mut self) {
        let mut reaped = false;
        loop {
            // SAFETY: cq_head < entries, inside the CQ area.
            let slot = unsafe {
                self.mem.as_ptr().add(self.cq_offset).cast::<CompletionEntry>().add(usize::from(self.cq_head))
            };
            // The status word (with the phase tag) first, and the rest only
            // after it: the device may still be writing the entry's other
            // fields when the new phase shows (seen under QEMU, where a
            // whole-entry read returned the old command id).
            // SAFETY: as above; the status field is 2-byte aligned.
            let status = unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*slot).status)) };
            if (status & 1 == 1) != self.phase {
                break;
            }
            fence(Ordering::Acquire);
            // SAFETY: as above.
            let entry = unsafe { std::ptr::read_volatile(slot) };
            tracing::trace!(
                queue = self.qid,
                head = self.cq_head,
                cid = entry.cid,
                "complete status {:#x} sq_head {}",
                entry.status,
                entry.sq_head
            );
            reaped = true;
            self.cq_head += 1;
            if self.cq_head == self.entries {
                self.cq_head = 0;
                self.phase = !self.phase;
            }
            let cid = usize::from(entry.cid);
            if cid >= self.commands.len() || !self.commands[cid].busy {
                tracing::warn!(queue = self.qid, cid, "NVMe completion for an idle command id ignored");
                continue;
            }
            let command = &mut self.commands[cid];
            command.busy = false;
            let slot_id = command.slot;
            self.free_cids.push(entry.cid);
            let capacity = self.shared.geometry.capacity_bytes;
            let slot = &mut self.slots[usize::from(slot_id)];
            if !entry.ok() && slot.error.is_none() {
                let (sct, sc) = entry.status_code();
                slot.error = Some(if (sct, sc) == (0, STATUS_LBA_OUT_OF_RANGE) {
                    BdevError::OutOfRange { offset: slot.offset, len: u64::from(slot.bytes), capacity }
                } else {
                    BdevError::Nvme { sct, sc }
                });
            }
            slot.commands_left -= 1;
            if slot.commands_left == 0 {
                self.finish(slot_id);
            }
        }
        if reaped {
            // SAFETY: the doorbell lies in BAR0, mapped for the device's life.
            unsafe { std::ptr::write_volatile(self.cq_doorbell, u32::from(self.cq_head)) };
        }
    }

    fn finish(&mut self, slot_id: u16) {
        let slot = &mut self.slots[usize::from(slot_id)];
        slot.busy = false;
        let result = match slot.error.take() {
            Some(e) => Err(e),
            None => Ok(slot.bytes),
        };
        let token = slot.token;
        if let Some((start, count)) = slot.bounce.take() {
            if result.is_ok() && !slot.read_into.is_empty() {
                let mut from = self.bounce_ptr(start);
                for v in &self.slots[usize::from(slot_id)].read_into {
                    // SAFETY: the bounce run holds the whole request and the
                    // device has finished with it (its completion is in);
                    // the caller's iovecs are valid until this completion
                    // is handed out (submit's contract), and may be a
                    // guest's: reached by volatile access only.
                    unsafe {
                        v.volatile().copy_from(std::slice::from_raw_parts(from, v.len));
                        from = from.add(v.len);
                    }
                }
            }
            self.give_bounce(start, count);
        }
        self.slots[usize::from(slot_id)].read_into.clear();
        self.free_slots.push(slot_id);
        self.ready.push_back(Completion { token, result });
    }

    /// Fail every request in flight (the controller dropped them).
    fn fail_in_flight(&mut self, error: BdevError) {
        for cid in 0..self.commands.len() {
            if self.commands[cid].busy {
                self.commands[cid].busy = false;
                self.free_cids.push(cid as u16);
            }
        }
        for slot_id in 0..self.slots.len() as u16 {
            let slot = &mut self.slots[usize::from(slot_id)];
            if slot.busy {
                slot.error = Some(error);
                slot.read_into.clear();
                slot.commands_left = 0;
                self.finish(slot_id);
            }
        }
    }

    /// After a controller reset: fail what was in flight and create the
    /// queue pair again on the fresh controller.
    fn rebuild(&mut self, error: BdevError) {
        self.fail_in_flight(error);
        self.counters.rebuilds += 1;
        let mut controller = self.shared.lock_controller();
        self.reset_generation = self.shared.reset_generation.load(Ordering::Acquire);
        self.mem.zero();
        self.sq_tail = 0;
        self.cq_head = 0;
        self.phase = true;
        self.doorbell_pending = false;
        let Some(qid) = controller.allocate_qid(self.shared.queue_limit) else {
            self.dead = true;
            return;
        };
        match controller.create_io_queue(qid, self.entries, self.mem.iova(), self.mem.iova() + self.cq_offset as u64) {
            Ok(()) => {
                self.qid = qid;
                (self.sq_doorbell, self.cq_doorbell) = controller.doorbells(qid);
            }
            Err(e) => {
                tracing::error!(queue = qid, "recreating an NVMe I/O queue failed: {e}");
                controller.release_qid(qid);
                self.dead = true;
            }
        }
    }

    fn check_timeouts(&mut self) {
        self.clock = Instant::now();
        let limit = self.shared.command_timeout;
        let expired = self.commands.iter().any(|c| c.busy && self.clock.duration_since(c.submitted) > limit);
        if !expired {
            return;
        }
        self.counters.timeouts += 1;
        tracing::warn!(
            queue = self.qid,
            "an NVMe command took longer than {} ms; resetting the controller",
            limit.as_millis()
        );
        if let Err(e) = self.shared.reset_controller(self.reset_generation) {
            tracing::error!(queue = self.qid, "NVMe controller reset failed, the device is offline: {e}");
            self.fail_in_flight(BdevError::Io(libc::ETIMEDOUT));
            self.dead = true;
            return;
        }
        self.rebuild(BdevError::Io(libc::ETIMEDOUT));
    }
}

/// The steps of `submit`, each one kind of work.
impl NvmeQueue {
    /// Point the PRP segments at the request's memory, or, when the IOMMU
    /// does not map all of it, at a run of bounce chunks (copying a write's
    /// data in). Returns the bounce run, for the completion to release.
    ///
    /// # Safety
    /// The request's iovecs are valid for `total` bytes, as `submit`'s
    /// caller vouches.
    unsafe fn stage_data(&mut self, req: &IoRequest<'_>, total: u64) -> Result<Option<(u32, u32)>, BdevError> {
        if self.shared.registry.generation() != self.translation.generation {
            self.shared.registry.snapshot(&mut self.translation);
        }
        if self.direct_segments(req.iovecs) {
            self.counters.direct += 1;
            return Ok(None);
        }
        let chunks = (total as usize).div_ceil(BOUNCE_CHUNK_BYTES) as u32;
        let Some(start) = self.take_bounce(chunks) else { return Err(BdevError::QueueFull) };
        if req.kind == IoKind::Write {
            let mut to = self.bounce_ptr(start);
            for v in req.iovecs {
                // SAFETY: the caller vouches for the iovec, maybe a guest's
                // memory, reached by volatile access only; the bounce run
                // holds `total` bytes, the iovecs' sum, and no command uses
                // it yet.
                unsafe {
                    v.volatile().copy_to(std::slice::from_raw_parts_mut(to, v.len));
                    to = to.add(v.len);
                }
            }
        }
        let iova = self.mem.iova() + (self.bounce_offset + start as usize * BOUNCE_CHUNK_BYTES) as u64;
        self.segments.clear();
        self.segments.push((iova, total as usize));
        self.counters.bounced += 1;
        Ok(Some((start, chunks)))
    }

    fn fill_slot(&mut self, slot_id: u16, req: &IoRequest<'_>, bytes: u32, commands: u16, bounce: Option<(u32, u32)>) {
        let slot = &mut self.slots[usize::from(slot_id)];
        slot.token = req.token;
        slot.offset = req.offset_bytes;
        slot.bytes = bytes;
        slot.commands_left = commands;
        slot.error = None;
        slot.bounce = bounce;
        slot.busy = true;
        slot.read_into.clear();
        if bounce.is_some() && req.kind == IoKind::Read {
            slot.read_into.extend_from_slice(req.iovecs);
        }
    }

    /// One Dataset Management command, its single range in the PRP page of
    /// the command id it is about to take.
    fn push_discard(&mut self, slot_id: u16, offset_bytes: u64, bytes: u64) {
        let block = u64::from(self.shared.geometry.logical_block_size);
        let cid_page = *self.free_cids.last().expect("checked by submit");
        let page = self.prp_offset + usize::from(cid_page) * PAGE_BYTES as usize;
        let range =
            [0u32, (bytes / block) as u32, (offset_bytes / block) as u32, ((offset_bytes / block) >> 32) as u32];
        // SAFETY: the page belongs to the command id about to be used; one
        // 16-byte range fits.
        unsafe { std::ptr::copy_nonoverlapping(range.as_ptr(), self.mem.as_ptr().add(page).cast::<u32>(), 4) };
        let command = Command {
            nsid: self.shared.nsid,
            prp1: self.mem.iova() + page as u64,
            cdw10: 0,
            cdw11: DSM_DEALLOCATE,
            ..Command::new(IO_DATASET_MANAGEMENT)
        };
        self.push_command(slot_id, command);
    }

    /// Reads and writes, split at the controller's largest transfer.
    fn push_data(&mut self, slot_id: u16, req: &IoRequest<'_>, total: u64) {
        let block = u64::from(self.shared.geometry.logical_block_size);
        let opcode = if req.kind == IoKind::Read { IO_READ } else { IO_WRITE };
        let max = self.shared.max_transfer_bytes as usize;
        let mut start = 0usize;
        while start < total as usize {
            let len = max.min(total as usize - start);
            let lba = (req.offset_bytes + start as u64) / block;
            let mut command = Command::rw(opcode, self.shared.nsid, lba, (len as u64 / block) as u32);
            let cid_page = *self.free_cids.last().expect("checked by submit");
            self.set_prps(&mut command, cid_page, start, len);
            self.push_command(slot_id, command);
            start += len;
        }
    }
}

impl IoQueue for NvmeQueue {
    fn geometry(&self) -> Geometry {
        self.shared.geometry
    }

    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), BdevError> {
        let total = validate_request(&self.shared.geometry, req)?;
        if !self.dead && self.shared.reset_generation.load(Ordering::Relaxed) != self.reset_generation {
            // A reset happened since this queue last looked: rebuild before
            // taking new work, so that the new request is not failed along
            // with the ones the reset lost.
            self.rebuild(BdevError::Io(libc::EIO));
        }
        if self.dead {
            return Err(BdevError::Io(libc::ENODEV));
        }
        if let IoKind::Discard { .. } = req.kind {
            if !self.shared.controller_info.dataset_management {
                return Err(BdevError::Unsupported("the controller has no Dataset Management (deallocate)"));
            }
        }
        if req.kind == IoKind::Flush && !self.shared.geometry.volatile_write_cache {
            // No volatile cache: every completed write is already durable.
            self.accepted += 1;
            self.ready.push_back(Completion { token: req.token, result: Ok(0) });
            return Ok(());
        }
        let needed = self.commands_for(req.kind, total);
        if self.free_slots.is_empty() || self.free_cids.len() < needed {
            return Err(BdevError::QueueFull);
        }
        let is_data = matches!(req.kind, IoKind::Read | IoKind::Write);
        let bounce = if is_data {
            // SAFETY: the caller of `submit` vouches for the iovecs.
            unsafe { self.stage_data(req, total)? }
        } else {
            None
        };
        let slot_id = self.free_slots.pop().expect("checked above");
        self.fill_slot(slot_id, req, if is_data { total as u32 } else { 0 }, needed as u16, bounce);
        self.accepted += 1;
        match req.kind {
            IoKind::Flush => {
                let nsid = self.shared.nsid;
                self.push_command(slot_id, Command { nsid, ..Command::new(IO_FLUSH) });
            }
            IoKind::Discard { bytes } => self.push_discard(slot_id, req.offset_bytes, bytes),
            IoKind::Read | IoKind::Write => self.push_data(slot_id, req, total),
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        if !self.dead {
            if self.shared.reset_generation.load(Ordering::Relaxed) != self.reset_generation {
                self.rebuild(BdevError::Io(libc::EIO));
            }
            if self.doorbell_pending {
                fence(Ordering::SeqCst);
                // SAFETY: the doorbell lies in BAR0, mapped for the device's
                // life (the queue holds an Arc of it).
                unsafe { std::ptr::write_volatile(self.sq_doorbell, u32::from(self.sq_tail)) };
                self.doorbell_pending = false;
            }
            self.reap();
            if self.free_cids.len() < self.commands.len() {
                self.polls = self.polls.wrapping_add(1);
                if self.polls.is_multiple_of(TIMEOUT_CHECK_EVERY_POLLS) {
                    self.check_timeouts();
                }
            }
        }
        let n = max.min(self.ready.len());
        out.extend(self.ready.drain(..n));
        self.accepted -= n;
        n
    }

    fn in_flight(&self) -> usize {
        self.accepted
    }

    /// Map the pool for DMA so that I/O on its buffers needs no bounce. A
    /// pool whose region is not whole pages stays unmapped (and bounced).
    fn register_pool(&mut self, pool: &BufferPool) -> Result<(), BdevError> {
        let (base, len, region) = pool.region();
        let va = base as usize;
        if !va.is_multiple_of(PAGE_BYTES as usize) || !len.is_multiple_of(PAGE_BYTES as usize) {
            return Ok(());
        }
        // SAFETY: the queue keeps `region` alive until it unmaps it (Drop),
        // and pool buffers are only reached through raw pointers by I/O.
        match unsafe { self.shared.registry.map_internal(va, len as u64) } {
            Ok(_) => {
                self.pools.push((va, region));
                Ok(())
            }
            Err(e) => {
                tracing::warn!(queue = self.qid, "NVMe buffer pool stays unmapped (its I/O is bounced): {e}");
                Ok(())
            }
        }
    }
}

impl Drop for NvmeQueue {
    fn drop(&mut self) {
        let mut controller = self.shared.lock_controller();
        let current = self.shared.reset_generation.load(Ordering::Acquire) == self.reset_generation;
        if !self.dead && current {
            if let Err(e) = controller.delete_io_queue(self.qid) {
                tracing::warn!(queue = self.qid, "deleting an NVMe I/O queue failed: {e}");
            }
            controller.release_qid(self.qid);
        }
        drop(controller);
        let c = &self.counters;
        tracing::info!(
            queue = self.qid,
            "NVMe I/O queue {} closed: {} requests by DMA to caller memory, {} bounced, {} commands, \
             {} timeouts, {} rebuilds",
            self.qid,
            c.direct,
            c.bounced,
            c.commands,
            c.timeouts,
            c.rebuilds
        );
        for (va, _region) in self.pools.drain(..) {
            self.shared.registry.unmap(va);
        }
        self.shared.add_counters(&self.counters);
    }
}
