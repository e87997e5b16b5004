//! Controller bring-up, the admin queue, and teardown. Admin commands run
//! synchronously (polled, with a deadline) under the device's mutex; they
//! happen at open, at queue creation and deletion, and in recovery, never on
//! the I/O path.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::dma::{DmaBuffer, DmaRegistry};
use super::spec::*;
use super::vfio::{Bar, VfioPci};
use super::NvmeError;

const ADMIN_ENTRIES: u16 = 32;
const ADMIN_SQ_OFFSET: usize = 0;
const ADMIN_CQ_OFFSET: usize = 4096;
const ADMIN_DATA_OFFSET: usize = 8192;
const ADMIN_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

struct AdminQueue {
    mem: DmaBuffer,
    tail: u16,
    head: u16,
    phase: bool,
    next_cid: u16,
}

pub struct Controller {
    // Drop order: the admin memory is unmapped before VFIO lets go.
    admin: AdminQueue,
    pub cap: Capabilities,
    pub version: u32,
    /// I/O queue ids handed out; index 0 is the admin queue.
    qids_used: Vec<bool>,
    pci: VfioPci,
    pub pci_address: String,
}

impl Controller {
    /// Reset the controller and bring it up with an empty admin queue.
    pub fn start(pci: VfioPci, pci_address: &str, registry: &Arc<DmaRegistry>) -> Result<Self, NvmeError> {
        let cap = Capabilities(pci.bar0.read64(REG_CAP));
        if !cap.supports_nvm_command_set() {
            return Err(NvmeError::Setup(format!("{pci_address}: the controller lacks the NVM command set")));
        }
        if cap.min_page_bytes() > 4096 {
            return Err(NvmeError::Setup(format!(
                "{pci_address}: the controller's smallest page is {} bytes; 4 KiB is required",
                cap.min_page_bytes()
            )));
        }
        let version = pci.bar0.read32(REG_VS);
        let mem = DmaBuffer::new(registry, 3 * 4096)?;
        let mut controller = Self {
            admin: AdminQueue { mem, tail: 0, head: 0, phase: true, next_cid: 0 },
            cap,
            version,
            qids_used: vec![true],
            pci,
            pci_address: pci_address.to_string(),
        };
        controller.enable()?;
        Ok(controller)
    }

    fn bar(&self) -> &Bar {
        &self.pci.bar0
    }

    fn wait_status(&self, what: &str, done: impl Fn(u32) -> bool) -> Result<(), NvmeError> {
        let limit = Duration::from_millis(self.cap.ready_timeout_ms());
        let start = Instant::now();
        loop {
            let csts = self.bar().read32(REG_CSTS);
            if csts == u32::MAX {
                return Err(NvmeError::Controller(format!(
                    "{}: registers read as all ones while waiting for {what}: the device is gone or in reset",
                    self.pci_address
                )));
            }
            if done(csts) {
                return Ok(());
            }
            if start.elapsed() > limit {
                return Err(NvmeError::Controller(format!(
                    "{}: the controller did not {what} within {} ms (CSTS {csts:#x}{}); reset the PCI function \
                     (echo 1 > /sys/bus/pci/devices/{}/reset) or power-cycle it",
                    self.pci_address,
                    limit.as_millis(),
                    if csts & CSTS_CFS != 0 { ", controller fatal status" } else { "" },
                    self.pci_address
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Disable, program the admin queue, enable and wait until ready.
    pub fn enable(&mut self) -> Result<(), NvmeError> {
        let cc = self.bar().read32(REG_CC);
        if cc & CC_EN != 0 {
            self.bar().write32(REG_CC, cc & !CC_EN);
        }
        self.wait_status("stop (CSTS.RDY = 0)", |csts| csts & CSTS_RDY == 0)?;
        let admin = &mut self.admin;
        admin.mem.zero();
        admin.tail = 0;
        admin.head = 0;
        admin.phase = true;
        let base = admin.mem.iova();
        let n = u32::from(ADMIN_ENTRIES) - 1;
        let bar = &self.pci.bar0;
        bar.write32(REG_AQA, (n << 16) | n);
        bar.write64(REG_ASQ, base + ADMIN_SQ_OFFSET as u64);
        bar.write64(REG_ACQ, base + ADMIN_CQ_OFFSET as u64);
        bar.write32(REG_CC, CC_EN | CC_IO_ENTRY_SIZES);
        self.wait_status("become ready (CSTS.RDY = 1)", |csts| csts & CSTS_RDY != 0 && csts & CSTS_CFS == 0)?;
        // Queue ids granted before a reset are gone with it.
        self.qids_used.truncate(1);
        Ok(())
    }

    /// Run one admin command and wait for its completion.
    fn execute(&mut self, mut command: Command) -> Result<CompletionEntry, NvmeError> {
        let stride = self.cap.doorbell_stride();
        let admin = &mut self.admin;
        let cid = admin.next_cid;
        admin.next_cid = admin.next_cid.wrapping_add(1);
        command.set_cid(cid);
        let opcode = command.opcode();
        // SAFETY: tail < ADMIN_ENTRIES, so the entry lies in the SQ page of
        // the admin buffer, which the controller only reads.
        unsafe {
            let sq = admin.mem.as_ptr().add(ADMIN_SQ_OFFSET).cast::<Command>();
            std::ptr::write_volatile(sq.add(usize::from(admin.tail)), command);
        }
        admin.tail = (admin.tail + 1) % ADMIN_ENTRIES;
        fence(Ordering::SeqCst);
        self.pci.bar0.write32(DOORBELL_BASE, u32::from(admin.tail));
        let start = Instant::now();
        loop {
            // SAFETY: head < ADMIN_ENTRIES, inside the CQ page.
            let slot = unsafe {
                admin.mem.as_ptr().add(ADMIN_CQ_OFFSET).cast::<CompletionEntry>().add(usize::from(admin.head))
            };
            // Phase first, then the rest (see queue.rs: entries can be seen
            // half-written).
            // SAFETY: as above.
            let status = unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*slot).status)) };
            if (status & 1 == 1) == admin.phase {
                fence(Ordering::Acquire);
                // SAFETY: as above.
                let entry = unsafe { std::ptr::read_volatile(slot) };
                admin.head = (admin.head + 1) % ADMIN_ENTRIES;
                if admin.head == 0 {
                    admin.phase = !admin.phase;
                }
                self.pci.bar0.write32(DOORBELL_BASE + stride, u32::from(admin.head));
                if entry.cid != cid {
                    return Err(NvmeError::Controller(format!(
                        "admin completion for command {} while waiting for {cid}",
                        entry.cid
                    )));
                }
                if !entry.ok() {
                    let (sct, sc) = entry.status_code();
                    return Err(NvmeError::AdminStatus { opcode, sct, sc });
                }
                return Ok(entry);
            }
            if start.elapsed() > ADMIN_COMMAND_TIMEOUT {
                return Err(NvmeError::AdminTimeout { opcode, ms: ADMIN_COMMAND_TIMEOUT.as_millis() as u64 });
            }
            std::hint::spin_loop();
        }
    }

    fn identify(&mut self, cns: u32, nsid: u32) -> Result<Box<[u8; 4096]>, NvmeError> {
        let data_iova = self.admin.mem.iova() + ADMIN_DATA_OFFSET as u64;
        let command = Command { nsid, prp1: data_iova, cdw10: cns, ..Command::new(ADMIN_IDENTIFY) };
        self.execute(command)?;
        let mut out = Box::new([0u8; 4096]);
        // SAFETY: the data page is inside the admin buffer, and the command
        // that wrote it has completed.
        unsafe {
            std::ptr::copy_nonoverlapping(self.admin.mem.as_ptr().add(ADMIN_DATA_OFFSET), out.as_mut_ptr(), 4096)
        };
        Ok(out)
    }

    pub fn identify_controller(&mut self) -> Result<ControllerInfo, NvmeError> {
        Ok(ControllerInfo::parse(&*self.identify(IDENTIFY_CONTROLLER, 0)?))
    }

    pub fn identify_namespace(&mut self, nsid: u32, count: u32) -> Result<NamespaceInfo, NvmeError> {
        let pci = self.pci_address.clone();
        let missing = || NvmeError::NoNamespace { nsid, count, pci: pci.clone() };
        if nsid == 0 || nsid > count {
            return Err(missing());
        }
        let info = match self.identify(IDENTIFY_NAMESPACE, nsid) {
            Ok(data) => NamespaceInfo::parse(&data),
            Err(NvmeError::AdminStatus { .. }) => return Err(missing()),
            Err(e) => return Err(e),
        };
        if info.size_blocks == 0 {
            return Err(missing());
        }
        Ok(info)
    }

    /// Ask for `wanted` I/O queue pairs; returns how many were granted.
    pub fn set_queue_count(&mut self, wanted: u16) -> Result<u16, NvmeError> {
        let n = u32::from(wanted.max(1)) - 1;
        let command =
            Command { cdw10: FEATURE_NUMBER_OF_QUEUES, cdw11: (n << 16) | n, ..Command::new(ADMIN_SET_FEATURES) };
        let entry = self.execute(command)?;
        let granted = (entry.result & 0xffff).min(entry.result >> 16) + 1;
        Ok(granted.min(u32::from(wanted)) as u16)
    }

    pub fn allocate_qid(&mut self, limit: u16) -> Option<u16> {
        let free = (1..=limit).find(|&q| !self.qids_used.get(usize::from(q)).copied().unwrap_or(false))?;
        if self.qids_used.len() <= usize::from(free) {
            self.qids_used.resize(usize::from(free) + 1, false);
        }
        self.qids_used[usize::from(free)] = true;
        Some(free)
    }

    pub fn release_qid(&mut self, qid: u16) {
        if let Some(used) = self.qids_used.get_mut(usize::from(qid)) {
            *used = false;
        }
    }

    /// Create a completion queue and its submission queue, both `entries`
    /// long, polled (no interrupt vector).
    pub fn create_io_queue(&mut self, qid: u16, entries: u16, sq_iova: u64, cq_iova: u64) -> Result<(), NvmeError> {
        let size = (u32::from(entries) - 1) << 16;
        let physically_contiguous = 1;
        let cq = Command {
            prp1: cq_iova,
            cdw10: size | u32::from(qid),
            cdw11: physically_contiguous,
            ..Command::new(ADMIN_CREATE_CQ)
        };
        self.execute(cq)?;
        let sq = Command {
            prp1: sq_iova,
            cdw10: size | u32::from(qid),
            cdw11: (u32::from(qid) << 16) | physically_contiguous,
            ..Command::new(ADMIN_CREATE_SQ)
        };
        if let Err(e) = self.execute(sq) {
            let _ = self.execute(Command { cdw10: u32::from(qid), ..Command::new(ADMIN_DELETE_CQ) });
            return Err(e);
        }
        Ok(())
    }

    pub fn delete_io_queue(&mut self, qid: u16) -> Result<(), NvmeError> {
        self.execute(Command { cdw10: u32::from(qid), ..Command::new(ADMIN_DELETE_SQ) })?;
        self.execute(Command { cdw10: u32::from(qid), ..Command::new(ADMIN_DELETE_CQ) })?;
        Ok(())
    }

    pub fn doorbells(&self, qid: u16) -> (*mut u32, *mut u32) {
        let stride = self.cap.doorbell_stride();
        let sq = DOORBELL_BASE + 2 * usize::from(qid) * stride;
        (self.pci.bar0.doorbell(sq), self.pci.bar0.doorbell(sq + stride))
    }

    /// The highest queue id whose doorbells lie inside the mapped BAR.
    pub fn max_qid_mapped(&self) -> u16 {
        let stride = self.cap.doorbell_stride();
        let pairs = (self.pci.bar0.len().saturating_sub(DOORBELL_BASE)) / (2 * stride);
        pairs.saturating_sub(1).min(usize::from(u16::MAX)) as u16
    }

    /// Normal shutdown notification, then wait for it to complete.
    fn shutdown(&mut self) -> Result<(), NvmeError> {
        let cc = self.bar().read32(REG_CC);
        self.bar().write32(REG_CC, (cc & !(3 << 14)) | CC_SHN_NORMAL);
        self.wait_status("finish its shutdown", |csts| csts & CSTS_SHST_MASK == CSTS_SHST_COMPLETE)
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!("NVMe controller shutdown: {e}");
        }
        self.pci.disable_bus_master();
    }
}
