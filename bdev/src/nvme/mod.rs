//! NVMe backend: a PCI controller driven from userspace through VFIO, as
//! SPDK drives it. No kernel driver and no interrupts: each reactor owns one
//! I/O queue pair and polls its completion queue by phase bit.
//!
//! - [`vfio`]: sysfs checks, the VFIO container/group/device, BAR0;
//! - [`controller`]: reset, enable, the admin queue, identify, queue
//!   creation, shutdown (admin work runs under one mutex, off the I/O path);
//! - [`queue`]: the per-reactor queue pair, PRP lists, bounce buffers,
//!   timeouts and recovery;
//! - [`dma`]: pinned DMA memory and the IOVA scheme, including guest memory
//!   registered by the vhost-user layer.
//!
//! A device is named `nvme:DOMAIN:BUS:DEVICE.FUNCTION[/NSID]`, e.g.
//! `nvme:0000:00:05.0` (namespace 1) or `nvme:0000:00:05.0/2`.

mod controller;
mod dma;
mod queue;
mod spec;
mod vfio;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use self::controller::Controller;
pub use self::dma::GUEST_IOVA_BASE;
use self::dma::{DmaError, DmaRegistry};
pub use self::queue::{NvmeQueue, QueueCounters};
use self::spec::{ControllerInfo, NamespaceInfo};
use self::vfio::VfioPci;
use super::{
    BdevError, BlockDevice, Geometry, IoQueue, MemoryRegion, QueueConfig, MAX_IOVECS_PER_REQUEST, MAX_REQUEST_BYTES,
};

pub const DEVICE_PREFIX: &str = "nvme:";

#[derive(Debug, thiserror::Error)]
pub enum NvmeError {
    #[error("{0}")]
    Setup(String),
    #[error("{0}")]
    Controller(String),
    #[error("DMA memory: {0}")]
    Dma(#[from] DmaError),
    #[error("admin command {opcode:#04x} failed with status type {sct}, code {sc:#04x}")]
    AdminStatus { opcode: u8, sct: u8, sc: u8 },
    #[error("admin command {opcode:#04x} got no completion within {ms} ms")]
    AdminTimeout { opcode: u8, ms: u64 },
    #[error(
        "namespace {nsid} does not exist on {pci} (the controller reports {count}); \
         name another with nvme:{pci}/NSID or create it with the controller's tools"
    )]
    NoNamespace { nsid: u32, count: u32, pci: String },
    #[error("bad NVMe device name {0:?}: use nvme:DOMAIN:BUS:DEVICE.FUNCTION[/NSID], e.g. nvme:0000:00:05.0/1")]
    BadAddress(String),
}

/// Where a controller and namespace live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeAddress {
    pub pci: String,
    pub namespace: u32,
}

impl NvmeAddress {
    /// True when `name` asks for this backend (it starts with `nvme:`).
    pub fn is_nvme_name(name: &str) -> bool {
        name.starts_with(DEVICE_PREFIX)
    }

    pub fn parse(name: &str) -> Result<Self, NvmeError> {
        let bad = || NvmeError::BadAddress(name.to_string());
        let rest = name.strip_prefix(DEVICE_PREFIX).ok_or_else(bad)?;
        let (pci, namespace) = match rest.split_once('/') {
            Some((pci, ns)) => (pci, ns.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(bad)?),
            None => (rest, 1),
        };
        Self::new(pci, namespace).map_err(|_| bad())
    }

    pub fn new(pci: &str, namespace: u32) -> Result<Self, NvmeError> {
        let bad = || NvmeError::BadAddress(format!("{DEVICE_PREFIX}{pci}/{namespace}"));
        let parts: Vec<&str> = pci.split([':', '.']).collect();
        let widths = [4, 2, 2, 1];
        let well_formed = parts.len() == 4
            && parts.iter().zip(widths).all(|(p, w)| p.len() == w && p.chars().all(|c| c.is_ascii_hexdigit()));
        if !well_formed || namespace == 0 {
            return Err(bad());
        }
        Ok(Self { pci: pci.to_ascii_lowercase(), namespace })
    }
}

impl std::fmt::Display for NvmeAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{DEVICE_PREFIX}{}/{}", self.pci, self.namespace)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct NvmeOptions {
    /// I/O queue pairs to ask the controller for (one per reactor is used).
    pub io_queues: u16,
    /// A command older than this resets the controller.
    pub command_timeout: Duration,
}

impl Default for NvmeOptions {
    fn default() -> Self {
        Self { io_queues: 64, command_timeout: Duration::from_secs(30) }
    }
}

/// What every queue pair shares: the controller (behind a mutex that only
/// admin work takes), the DMA registry and the namespace's shape.
pub(crate) struct Shared {
    controller: Mutex<Controller>,
    registry: Arc<DmaRegistry>,
    /// Bumped by each controller reset; queues rebuild when it moves.
    reset_generation: AtomicU64,
    nsid: u32,
    geometry: Geometry,
    max_transfer_bytes: u32,
    queue_limit: u16,
    command_timeout: Duration,
    controller_info: ControllerInfo,
    totals: Mutex<QueueCounters>,
}

impl Shared {
    fn lock_controller(&self) -> MutexGuard<'_, Controller> {
        self.controller.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reset the controller unless another queue already did since
    /// `seen_generation`.
    fn reset_controller(&self, seen_generation: u64) -> Result<(), NvmeError> {
        let mut controller = self.lock_controller();
        if self.reset_generation.load(Ordering::Acquire) != seen_generation {
            return Ok(());
        }
        let result = controller.enable().and_then(|()| controller.set_queue_count(self.queue_limit).map(|_| ()));
        self.reset_generation.fetch_add(1, Ordering::AcqRel);
        result
    }

    fn add_counters(&self, c: &QueueCounters) {
        *self.totals.lock().unwrap_or_else(|e| e.into_inner()) += c;
    }
}

pub struct NvmeDevice {
    shared: Arc<Shared>,
    name: String,
    namespace: NamespaceInfo,
}

impl NvmeDevice {
    /// Take the controller, reset it, identify it and its namespace.
    pub fn open(address: &NvmeAddress, options: NvmeOptions) -> Result<Self, NvmeError> {
        let pci = VfioPci::open(&address.pci)?;
        let registry = Arc::new(DmaRegistry::new(pci.mapper()));
        let mut controller = Controller::start(pci, &address.pci, &registry)?;
        let info = controller.identify_controller()?;
        let namespace = controller.identify_namespace(address.namespace, info.namespaces)?;
        if namespace.block_bytes == 0 || namespace.block_bytes > 4096 {
            return Err(NvmeError::Setup(format!(
                "{address}: logical blocks of {} bytes are not supported (512 to 4096)",
                namespace.block_bytes
            )));
        }
        if namespace.metadata_bytes != 0 {
            return Err(NvmeError::Setup(format!(
                "{address}: the namespace is formatted with {} metadata bytes per block; format it without",
                namespace.metadata_bytes
            )));
        }
        let granted = controller.set_queue_count(options.io_queues.max(1))?;
        let queue_limit = granted.min(controller.max_qid_mapped());
        if queue_limit == 0 {
            return Err(NvmeError::Setup(format!("{address}: the controller granted no I/O queues")));
        }
        // MDTS is a power of two of the minimum page size (4 KiB here).
        let max_transfer = match info.mdts {
            0 => MAX_REQUEST_BYTES,
            m if m >= 8 => MAX_REQUEST_BYTES,
            m => 4096u32 << m,
        };
        // A request may take up to 16 commands; a smaller limit than that
        // shrinks the largest request instead.
        let max_request = MAX_REQUEST_BYTES.min(max_transfer * 16);
        let geometry = Geometry {
            capacity_bytes: namespace.size_blocks * u64::from(namespace.block_bytes),
            logical_block_size: namespace.block_bytes,
            memory_alignment: 4,
            volatile_write_cache: info.volatile_write_cache,
            max_iovecs_per_request: MAX_IOVECS_PER_REQUEST,
            max_request_bytes: max_request,
        };
        let shared = Shared {
            controller: Mutex::new(controller),
            registry,
            reset_generation: AtomicU64::new(0),
            nsid: address.namespace,
            geometry,
            max_transfer_bytes: max_transfer,
            queue_limit,
            command_timeout: options.command_timeout,
            controller_info: info,
            totals: Mutex::new(QueueCounters::default()),
        };
        Ok(Self { shared: Arc::new(shared), name: address.to_string(), namespace })
    }

    pub fn controller_info(&self) -> &ControllerInfo {
        &self.shared.controller_info
    }
    pub fn namespace_info(&self) -> NamespaceInfo {
        self.namespace
    }
    /// The controller's version register, e.g. 0x10400 for 1.4.
    pub fn version(&self) -> u32 {
        self.shared.lock_controller().version
    }
    pub fn queue_limit(&self) -> u16 {
        self.shared.queue_limit
    }
    pub fn max_transfer_bytes(&self) -> u32 {
        self.shared.max_transfer_bytes
    }
    /// Counters of queues already closed.
    pub fn closed_queue_counters(&self) -> QueueCounters {
        *self.shared.totals.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reset the controller now, as a timeout would: every queue fails what
    /// it had in flight and builds its queue pair again at its next poll.
    pub fn reset(&self) -> Result<(), NvmeError> {
        let seen = self.shared.reset_generation.load(Ordering::Acquire);
        self.shared.reset_controller(seen)
    }

    /// Open a queue pair with its concrete type, for callers that want its
    /// counters.
    pub fn open_nvme_queue(&self, config: QueueConfig) -> Result<NvmeQueue, BdevError> {
        NvmeQueue::new(Arc::clone(&self.shared), config)
    }

    /// The DMA mappings now in place (for tests and diagnostics).
    pub fn dma_mappings(&self) -> Vec<dma::Mapping> {
        self.shared.registry.mappings()
    }
}

impl BlockDevice for NvmeDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn geometry(&self) -> Geometry {
        self.shared.geometry
    }
    fn supports_discard(&self) -> bool {
        self.shared.controller_info.dataset_management
    }
    fn open_queue(&self, config: QueueConfig) -> Result<Box<dyn IoQueue>, BdevError> {
        Ok(Box::new(self.open_nvme_queue(config)?))
    }
    fn set_dma_memory(&self, regions: &[MemoryRegion]) -> Result<(), BdevError> {
        // SAFETY: the caller (the vhost-user layer) keeps each guest region
        // mapped until a later call drops it, and accesses guest memory only
        // through raw pointers and volatile copies.
        unsafe { self.shared.registry.set_guest(regions) }.map_err(|e| {
            tracing::error!("mapping guest memory into the IOMMU failed: {e}");
            BdevError::Setup { step: "map guest memory into the IOMMU", errno: libc::EINVAL }
        })?;
        let guest: Vec<dma::Mapping> = self.shared.registry.mappings().into_iter().filter(|m| m.guest).collect();
        if guest.is_empty() {
            tracing::info!("NVMe: no guest memory mapped for DMA");
            return Ok(());
        }
        tracing::info!(
            "NVMe: {} guest memory region(s), {} MiB, mapped for DMA at IOVA {:#x} + guest address",
            guest.len(),
            guest.iter().map(|m| m.len).sum::<u64>() >> 20,
            GUEST_IOVA_BASE
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_bad_ones_say_how_to_write_them() {
        let a = NvmeAddress::parse("nvme:0000:00:05.0").unwrap();
        assert_eq!((a.pci.as_str(), a.namespace), ("0000:00:05.0", 1));
        assert_eq!(NvmeAddress::parse("nvme:0000:3B:00.1/2").unwrap().to_string(), "nvme:0000:3b:00.1/2");
        for bad in
            ["nvme:", "nvme:00:05.0", "nvme:0000:00:05.0/0", "nvme:0000:00:05.0/x", "nvme:zzzz:00:05.0", "/dev/nvme0n1"]
        {
            let e = NvmeAddress::parse(bad).unwrap_err().to_string();
            assert!(e.contains("nvme:DOMAIN:BUS:DEVICE.FUNCTION"), "{bad}: {e}");
        }
        assert!(NvmeAddress::is_nvme_name("nvme:0000:00:05.0"));
        assert!(!NvmeAddress::is_nvme_name("/tmp/nvme:x"));
    }

    #[test]
    fn a_missing_device_is_a_clear_error() {
        let e = VfioPci::open("ffff:ff:1f.7").err().expect("no such device").to_string();
        assert!(e.contains("no PCI device ffff:ff:1f.7") && e.contains("lspci"), "{e}");
    }
}
