//! Taking a PCI NVMe controller from vfio-pci: the sysfs checks that turn
//! the usual mistakes into errors saying how to fix them, the container,
//! group and device, and BAR0 mapped into this process.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vfio_ioctls::{VfioContainer, VfioDevice, VfioError, VfioOps};

use super::dma::{IommuError, IommuMapper};
use super::NvmeError;

const CONFIG_REGION_INDEX: u32 = 7;
const BAR0_REGION_INDEX: u32 = 0;
const REGION_FLAG_MMAP: u32 = 1 << 2;
const PCI_COMMAND_OFFSET: u64 = 4;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// The registers and 512 doorbell pairs at the smallest stride fit here.
const BAR0_MIN_MAP_BYTES: usize = 0x2000;

/// A controller owned through VFIO, with BAR0 mapped.
pub struct VfioPci {
    pub bar0: Bar,
    // Field order is drop order: the device before the container that holds
    // its group.
    device: VfioDevice,
    container: Arc<VfioContainer>,
}

impl VfioPci {
    pub fn open(pci: &str) -> Result<Self, NvmeError> {
        let sysfs = check_sysfs(pci)?;
        let container = Arc::new(VfioContainer::new(None).map_err(|e| explain(pci, e))?);
        let device =
            VfioDevice::new(&sysfs, container.clone() as Arc<dyn VfioOps>, false).map_err(|e| explain(pci, e))?;

        let mut command = [0u8; 2];
        device.region_read(CONFIG_REGION_INDEX, &mut command, PCI_COMMAND_OFFSET);
        let value = u16::from_le_bytes(command) | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
        device.region_write(CONFIG_REGION_INDEX, &value.to_le_bytes(), PCI_COMMAND_OFFSET);

        let flags = device.get_region_flags(BAR0_REGION_INDEX);
        let size = device.get_region_size(BAR0_REGION_INDEX) as usize;
        if flags & REGION_FLAG_MMAP == 0 || size < 0x1008 {
            return Err(NvmeError::Setup(format!(
                "{pci}: BAR0 cannot be mapped (flags {flags:#x}, {size} bytes); is this an NVMe controller?"
            )));
        }
        let offset = device.get_region_offset(BAR0_REGION_INDEX);
        let bar0 = Bar::map(&device, offset, size)
            .map_err(|errno| NvmeError::Setup(format!("{pci}: mmap of BAR0 ({size} bytes) failed: errno {errno}")))?;
        Ok(Self { bar0, device, container })
    }

    pub fn mapper(&self) -> Arc<dyn IommuMapper> {
        Arc::new(ContainerMapper(Arc::clone(&self.container)))
    }

    /// Turn bus mastering off so that a controller we leave cannot DMA.
    pub fn disable_bus_master(&self) {
        let mut command = [0u8; 2];
        self.device.region_read(CONFIG_REGION_INDEX, &mut command, PCI_COMMAND_OFFSET);
        let value = u16::from_le_bytes(command) & !PCI_COMMAND_MASTER;
        self.device.region_write(CONFIG_REGION_INDEX, &value.to_le_bytes(), PCI_COMMAND_OFFSET);
    }
}

struct ContainerMapper(Arc<VfioContainer>);

impl IommuMapper for ContainerMapper {
    unsafe fn map(&self, iova: u64, len: u64, va: usize) -> Result<(), IommuError> {
        // SAFETY: the caller keeps [va, va+len) mapped until unmap, and only
        // accesses it through raw pointers while the device may DMA.
        unsafe { self.0.vfio_dma_map(iova, len as usize, va as *mut u8) }.map_err(|e| IommuError::Vfio(e.to_string()))
    }
    fn unmap(&self, iova: u64, len: u64) -> Result<(), IommuError> {
        self.0.vfio_dma_unmap(iova, len as usize).map_err(|e| IommuError::Vfio(e.to_string()))
    }
}

/// The sysfs checks, in the order a person fixing them would go.
fn check_sysfs(pci: &str) -> Result<PathBuf, NvmeError> {
    let sysfs = Path::new("/sys/bus/pci/devices").join(pci);
    let setup = |msg: String| NvmeError::Setup(msg);
    if !sysfs.exists() {
        return Err(setup(format!("no PCI device {pci}: `lspci -D` lists the addresses (domain:bus:device.function)")));
    }
    if let Ok(class) = std::fs::read_to_string(sysfs.join("class")) {
        let class = u32::from_str_radix(class.trim().trim_start_matches("0x"), 16).unwrap_or(0);
        if class >> 8 != 0x0108 {
            return Err(setup(format!("{pci} is not an NVMe controller (PCI class {class:#08x}, expected 0x0108xx)")));
        }
    }
    match driver_of(&sysfs) {
        Some(driver) if driver == "vfio-pci" => {}
        Some(driver) => {
            return Err(setup(format!(
                "{pci} is bound to the {driver} driver, not vfio-pci: run `scripts/nvme-setup.sh bind {pci}` \
                 (this detaches it from the kernel; unmount anything on it first)"
            )))
        }
        None => {
            return Err(setup(format!(
                "{pci} is bound to no driver: run `scripts/nvme-setup.sh bind {pci}` to bind it to vfio-pci"
            )))
        }
    }
    let group = std::fs::read_link(sysfs.join("iommu_group"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .ok_or_else(|| {
            setup(format!(
                "{pci} has no IOMMU group: enable the IOMMU (intel_iommu=on or amd_iommu=on on the kernel \
                 command line; in a VM, give it a vIOMMU such as QEMU's -device intel-iommu)"
            ))
        })?;
    let members = Path::new("/sys/kernel/iommu_groups").join(&group).join("devices");
    if let Ok(entries) = std::fs::read_dir(&members) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == pci {
                continue;
            }
            if let Some(driver) = driver_of(&entry.path()) {
                if driver != "vfio-pci" && driver != "pcieport" {
                    return Err(setup(format!(
                        "IOMMU group {group} is not viable: {name}, in the same group as {pci}, is bound to \
                         {driver}; bind it to vfio-pci as well (`scripts/nvme-setup.sh bind {name}`)"
                    )));
                }
            }
        }
    }
    let node = Path::new("/dev/vfio").join(&group);
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open(&node) {
        let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
            "run keelfsd as root, or give its user the group file (chown) and a memlock limit large enough to pin its DMA memory"
        } else if e.raw_os_error() == Some(libc::EBUSY) {
            "another process (a VM or another keelfsd) holds the group"
        } else {
            "is vfio-pci loaded?"
        };
        return Err(setup(format!("cannot open {}: {e}: {hint}", node.display())));
    }
    Ok(sysfs)
}

fn driver_of(sysfs: &Path) -> Option<String> {
    let link = std::fs::read_link(sysfs.join("driver")).ok()?;
    Some(link.file_name()?.to_string_lossy().into_owned())
}

fn explain(pci: &str, e: VfioError) -> NvmeError {
    let hint = match &e {
        VfioError::OpenContainer(_) => "load the vfio modules (modprobe vfio-pci)",
        VfioError::GroupViable => "bind every device of its IOMMU group to vfio-pci",
        VfioError::OpenGroup(io, _) if io.kind() == std::io::ErrorKind::PermissionDenied => "run as root",
        VfioError::VfioType1V2 | VfioError::ContainerSetIOMMU(_) => {
            "the kernel offers no type-1 IOMMU for this device; enable the IOMMU"
        }
        _ => "see `dmesg` for the kernel's side",
    };
    NvmeError::Setup(format!("VFIO setup of {pci} failed: {e}: {hint}"))
}

/// BAR0 mapped uncached into this process: the controller's registers and
/// doorbells.
pub struct Bar {
    base: *mut u8,
    len: usize,
}

// SAFETY: MMIO registers accessed only with volatile loads and stores of
// naturally aligned words; callers serialise writes that must not interleave
// (the admin registers are behind the controller's mutex, and each doorbell
// belongs to one queue).
unsafe impl Send for Bar {}
// SAFETY: as above.
unsafe impl Sync for Bar {}

impl Bar {
    fn map(device: &VfioDevice, offset: u64, size: usize) -> Result<Self, i32> {
        use std::os::fd::AsRawFd;
        let fd = device.as_raw_fd();
        for len in [size, BAR0_MIN_MAP_BYTES.min(size)] {
            // SAFETY: a shared mapping of the device file at the region's
            // offset, as VFIO documents; no address hint.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    offset as libc::off_t,
                )
            };
            if p != libc::MAP_FAILED {
                return Ok(Self { base: p.cast(), len });
            }
        }
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }

    fn check(&self, offset: usize, width: usize) {
        assert!(offset.is_multiple_of(width) && offset + width <= self.len, "BAR0 access at {offset:#x} out of range");
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn read32(&self, offset: usize) -> u32 {
        self.check(offset, 4);
        // SAFETY: checked in range and aligned; MMIO wants volatile.
        unsafe { std::ptr::read_volatile(self.base.add(offset).cast::<u32>()) }
    }
    pub fn write32(&self, offset: usize, value: u32) {
        self.check(offset, 4);
        // SAFETY: as read32.
        unsafe { std::ptr::write_volatile(self.base.add(offset).cast::<u32>(), value) }
    }
    pub fn read64(&self, offset: usize) -> u64 {
        u64::from(self.read32(offset)) | (u64::from(self.read32(offset + 4)) << 32)
    }
    /// Two 32-bit stores, low first, which the specification allows for
    /// every 64-bit register.
    pub fn write64(&self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }
    /// The address of a doorbell, for the one queue that rings it.
    pub fn doorbell(&self, offset: usize) -> *mut u32 {
        self.check(offset, 4);
        // SAFETY: in range, as checked.
        unsafe { self.base.add(offset).cast() }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: base/len came from our mmap, and every queue holding a
        // doorbell pointer has been dropped (they own an Arc of the device).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
