//! The vhost-user side: the control protocol on vhost-user-backend's
//! threads. It owns nothing of the filesystem; a kick sets a bit and rings
//! the owning reactor's doorbell.

use std::fs::File;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::virtio::GuestRam;
use keelfs_bdev::{BlockDevice, MemoryRegion};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost_user_backend::VhostUserBackend;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use super::migration::{self, Transfer, TransferError};
use super::{
    Connection, Control, Pollers, Vring, QUEUE_SIZE_MAX, STOP_TIMEOUT, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
    VIRTIO_RING_F_INDIRECT_DESC,
};

#[derive(Clone)]
pub(super) struct FsBackend {
    pub(super) queues: usize,
    pub(super) connection: Arc<Connection>,
    pub(super) pollers: Pollers,
    /// The device under the filesystem, told of guest memory so that it can
    /// DMA to it directly (NVMe over VFIO maps it into the IOMMU).
    pub(super) dma: Option<Arc<dyn BlockDevice>>,
    /// The state transfer under way, for CHECK_DEVICE_STATE to await.
    pub(super) transfer: Arc<Mutex<Option<Transfer>>>,
    /// The export's span, for the events of the vhost-user threads.
    pub(super) span: tracing::Span,
}

/// Guest memory regions as the block layer names them.
fn guest_regions(mem: &GuestRam) -> Vec<MemoryRegion> {
    mem.iter()
        .filter_map(|region| {
            let host = region.get_host_address(MemoryRegionAddress(0)).ok()?;
            Some(MemoryRegion { host_address: host as usize, len: region.len(), guest_address: region.start_addr().0 })
        })
        .collect()
}

impl VhostUserBackend for FsBackend {
    type Bitmap = crate::dirty_log::DirtyLog;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.queues
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE_MAX
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
            | VIRTIO_RING_F_INDIRECT_DESC
            | VIRTIO_RING_F_EVENT_IDX
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            // Dirty logging, which live migration needs (see GuestRam).
            | VhostUserVirtioFeatures::LOG_ALL.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::LOG_SHMFD
            | VhostUserProtocolFeatures::DEVICE_STATE
    }

    fn set_device_state_fd(
        &self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        file: File,
    ) -> io::Result<Option<File>> {
        if phase != VhostTransferStatePhase::STOPPED {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "only a stopped device's state moves"));
        }
        let owner = self.pollers.owner().clone();
        let _span = self.span.enter();
        let transfer = match direction {
            VhostTransferStateDirection::SAVE => migration::start_save(owner, file)?,
            VhostTransferStateDirection::LOAD => migration::start_load(owner, file)?,
        };
        let previous = self.transfer.lock().unwrap_or_else(|e| e.into_inner()).replace(transfer);
        if previous.is_some() {
            tracing::warn!("a device state transfer was started before the last one was checked");
        }
        // QEMU's pipe serves: no fd of ours.
        Ok(None)
    }

    fn check_device_state(&self) -> io::Result<()> {
        let transfer = self.transfer.lock().unwrap_or_else(|e| e.into_inner()).take();
        let outcome = match transfer {
            None => Err(TransferError::NotStarted),
            Some(thread) => thread.join().unwrap_or(Err(TransferError::Panicked)),
        };
        // QEMU hears only "failed": the reason is logged here.
        outcome.map_err(|e| {
            tracing::warn!(parent: &self.span, "device state transfer failed: {e}");
            io::Error::other(e)
        })
    }

    fn set_event_idx(&self, _enabled: bool) {
        // The handler sets it on every vring; the reactor asks the vring.
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestRam>) -> io::Result<()> {
        // The atomic is the one the reactor already holds; in-flight
        // requests keep the old table mapped until they finish.
        if let Some(dma) = &self.dma {
            let regions = guest_regions(&mem.memory());
            // Failure is not fatal: requests to unmapped memory are copied.
            if let Err(e) = dma.set_dma_memory(&regions) {
                tracing::warn!("guest memory stays unmapped for DMA (I/O is copied instead): {e}");
            }
        }
        Ok(())
    }

    fn exit_event(&self, _thread: usize) -> Option<(EventConsumer, EventNotifier)> {
        // Without one the epoll worker can never leave, and dropping the
        // connection's handler (which joins it) would hang.
        new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()
    }

    fn stop_vring(&self, index: u32) -> io::Result<()> {
        let index = index as usize;
        if self.pollers.of_queue(index).call(|done| Control::StopQueue { index, done }, STOP_TIMEOUT) {
            Ok(())
        } else {
            Err(io::Error::new(io::ErrorKind::TimedOut, format!("queue {index}: in-flight requests did not finish")))
        }
    }

    fn handle_event(&self, device_event: u16, evset: EventSet, vrings: &[Vring], _thread: usize) -> io::Result<()> {
        let index = usize::from(device_event);
        if evset != EventSet::IN || index >= self.queues {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("unexpected event {device_event}")));
        }
        // One epoll thread serves every queue, so it sees all the vrings.
        debug_assert_eq!(vrings.len(), self.queues);
        // Copied once per connection: a copy per kick was an allocation
        // per request whenever the reactor slept between requests.
        self.connection.vrings.get_or_init(|| vrings.to_vec());
        self.connection.kicks.fetch_or(1 << index, Ordering::AcqRel);
        self.pollers.of_queue(index).ring();
        Ok(())
    }
}
