//! DMA memory and the IOVA scheme.
//!
//! The controller sees memory only through the IOMMU, at I/O virtual
//! addresses (IOVAs) this module chooses. There are two windows, fixed so
//! that they can never collide and so that both fit the 39-bit address width
//! that the smallest common IOMMUs (and QEMU's intel-iommu) offer:
//!
//! - **internal** memory (queues, PRP lists, bounce buffers, identify data)
//!   is bump-allocated in `[1 GiB, 3 GiB)`, below the x86 MSI window at
//!   0xfee0_0000 and clear of IOVA 0, so that a zero PRP is never valid;
//! - **guest** memory, registered by the vhost-user layer, sits at
//!   `64 GiB + guest physical address`. Guest regions never overlap in guest
//!   physical space, so they never overlap here, and a guest of up to
//!   448 GiB fits below 2^39.
//!
//! A [`DmaRegistry`] is the one source of truth: every mapping goes through
//! it, it refuses overlaps in either virtual or IOVA space, and it bumps a
//! generation number that queues compare (one relaxed load per poll) to
//! refresh their private copy of the translation table. Translation itself
//! is a binary search in that private copy: no lock on the I/O path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub const PAGE_BYTES: u64 = 4096;
const HUGE_PAGE_BYTES: usize = 2 << 20;

pub const INTERNAL_IOVA_BASE: u64 = 1 << 30;
pub const INTERNAL_IOVA_END: u64 = 3 << 30;
pub const GUEST_IOVA_BASE: u64 = 1 << 36;
pub const GUEST_IOVA_END: u64 = 1 << 39;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DmaError {
    #[error("IOMMU map of {len} bytes at IOVA {iova:#x} failed: {reason}")]
    Map { iova: u64, len: u64, reason: IommuError },
    #[error(
        "internal IOVA window [{INTERNAL_IOVA_BASE:#x}, {INTERNAL_IOVA_END:#x}) is full ({len} more bytes wanted)"
    )]
    InternalWindowFull { len: u64 },
    #[error(
        "guest region at guest address {gpa:#x} (+{len:#x}) lies outside the guest IOVA window: \
         guests larger than 448 GiB are not supported"
    )]
    GuestOutOfWindow { gpa: u64, len: u64 },
    #[error("mapping [{va:#x}, +{len:#x}) overlaps an existing DMA mapping")]
    Overlap { va: usize, len: u64 },
    #[error("cannot allocate {len} bytes of DMA memory: errno {errno}")]
    Alloc { len: usize, errno: i32 },
    #[error("length {0} is zero or not a multiple of 4 KiB")]
    BadLength(u64),
}

/// Why the IOMMU refused to map or unmap a range.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IommuError {
    /// The VFIO container's ioctl failed; the kernel's reason, as VFIO
    /// words it.
    #[error("VFIO: {0}")]
    Vfio(String),
    /// An unmap of a range that is not mapped.
    #[error("IOVA [{iova:#x}, +{len:#x}) is not mapped")]
    NotMapped { iova: u64, len: u64 },
}

/// What actually programs the IOMMU: VFIO in production, a recorder in tests.
pub trait IommuMapper: Send + Sync {
    /// # Safety
    /// `[va, va+len)` must stay mapped in this process until `unmap` of the
    /// same IOVA range returns; the device may read and write it at any time.
    unsafe fn map(&self, iova: u64, len: u64, va: usize) -> Result<(), IommuError>;
    fn unmap(&self, iova: u64, len: u64) -> Result<(), IommuError>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub va: usize,
    pub len: u64,
    pub iova: u64,
    pub guest: bool,
}

impl Mapping {
    fn va_end(&self) -> usize {
        self.va + self.len as usize
    }
    fn iova_end(&self) -> u64 {
        self.iova + self.len
    }
}

struct RegistryState {
    /// Sorted by `va`.
    mappings: Vec<Mapping>,
    internal_next: u64,
}

pub struct DmaRegistry {
    mapper: Arc<dyn IommuMapper>,
    state: Mutex<RegistryState>,
    generation: AtomicU64,
}

impl DmaRegistry {
    pub fn new(mapper: Arc<dyn IommuMapper>) -> Self {
        Self {
            mapper,
            state: Mutex::new(RegistryState { mappings: Vec::new(), internal_next: INTERNAL_IOVA_BASE }),
            generation: AtomicU64::new(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RegistryState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Map internal memory; returns its IOVA.
    ///
    /// # Safety
    /// As [`IommuMapper::map`]: the memory must outlive the mapping.
    pub unsafe fn map_internal(&self, va: usize, len: u64) -> Result<u64, DmaError> {
        check_len(len)?;
        let mut state = self.lock();
        let iova = state.internal_next;
        if iova + len > INTERNAL_IOVA_END {
            return Err(DmaError::InternalWindowFull { len });
        }
        let mapping = Mapping { va, len, iova, guest: false };
        // SAFETY: forwarded from the caller.
        unsafe { self.insert(&mut state, mapping)? };
        state.internal_next = iova + len;
        Ok(iova)
    }

    /// Map one region of guest memory at `GUEST_IOVA_BASE + gpa`.
    ///
    /// # Safety
    /// As [`IommuMapper::map`].
    pub unsafe fn map_guest(&self, va: usize, len: u64, gpa: u64) -> Result<u64, DmaError> {
        check_len(len)?;
        let iova =
            GUEST_IOVA_BASE.checked_add(gpa).filter(|&i| i.checked_add(len).is_some_and(|e| e <= GUEST_IOVA_END));
        let Some(iova) = iova else {
            return Err(DmaError::GuestOutOfWindow { gpa, len });
        };
        let mut state = self.lock();
        // SAFETY: forwarded from the caller.
        unsafe { self.insert(&mut state, Mapping { va, len, iova, guest: true })? };
        Ok(iova)
    }

    /// # Safety
    /// As [`IommuMapper::map`].
    unsafe fn insert(&self, state: &mut RegistryState, mapping: Mapping) -> Result<(), DmaError> {
        let collides = state.mappings.iter().any(|m| {
            (mapping.va < m.va_end() && m.va < mapping.va_end())
                || (mapping.iova < m.iova_end() && m.iova < mapping.iova_end())
        });
        if collides {
            return Err(DmaError::Overlap { va: mapping.va, len: mapping.len });
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.mapper.map(mapping.iova, mapping.len, mapping.va) }.map_err(|reason| DmaError::Map {
            iova: mapping.iova,
            len: mapping.len,
            reason,
        })?;
        let at = state.mappings.partition_point(|m| m.va < mapping.va);
        state.mappings.insert(at, mapping);
        self.generation.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Remove the mapping that starts at `va`. Returns false if none did.
    pub fn unmap(&self, va: usize) -> bool {
        let mut state = self.lock();
        let Some(at) = state.mappings.iter().position(|m| m.va == va) else { return false };
        let m = state.mappings.remove(at);
        if let Err(reason) = self.mapper.unmap(m.iova, m.len) {
            // The memory stays pinned by the kernel; nothing unsafe follows.
            tracing::warn!("IOMMU unmap of {:#x}+{:#x} failed: {reason}", m.iova, m.len);
        }
        if !m.guest && m.iova_end() == state.internal_next {
            state.internal_next = m.iova;
        }
        self.generation.fetch_add(1, Ordering::Release);
        true
    }

    /// Remove every guest mapping (a frontend left or replaced its table).
    #[cfg(test)]
    pub fn unmap_all_guest(&self) -> usize {
        let guest: Vec<usize> = self.lock().mappings.iter().filter(|m| m.guest).map(|m| m.va).collect();
        guest.iter().filter(|&&va| self.unmap(va)).count()
    }

    /// Make the guest mappings exactly `regions`: unmap those no longer
    /// listed (or changed), map the new ones, keep the rest untouched so that
    /// I/O in flight to them goes on.
    ///
    /// # Safety
    /// As [`IommuMapper::map`], for every region.
    pub unsafe fn set_guest(&self, regions: &[crate::MemoryRegion]) -> Result<(), DmaError> {
        let wanted = |m: &Mapping| {
            regions.iter().any(|r| {
                r.host_address == m.va && r.len == m.len && GUEST_IOVA_BASE.checked_add(r.guest_address) == Some(m.iova)
            })
        };
        let stale: Vec<usize> = self.lock().mappings.iter().filter(|m| m.guest && !wanted(m)).map(|m| m.va).collect();
        for va in stale {
            self.unmap(va);
        }
        let present: Vec<Mapping> = self.lock().mappings.clone();
        for r in regions {
            if present.iter().any(|m| m.guest && m.va == r.host_address && m.len == r.len) {
                continue;
            }
            // SAFETY: forwarded from the caller.
            unsafe { self.map_guest(r.host_address, r.len, r.guest_address)? };
        }
        Ok(())
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn snapshot(&self, into: &mut Translation) {
        let state = self.lock();
        into.generation = self.generation.load(Ordering::Acquire);
        into.mappings.clear();
        into.mappings.extend_from_slice(&state.mappings);
    }

    pub fn mappings(&self) -> Vec<Mapping> {
        self.lock().mappings.clone()
    }
}

fn check_len(len: u64) -> Result<(), DmaError> {
    if len == 0 || !len.is_multiple_of(PAGE_BYTES) {
        return Err(DmaError::BadLength(len));
    }
    Ok(())
}

/// A queue's private copy of the registry's mappings.
#[derive(Default)]
pub struct Translation {
    pub generation: u64,
    mappings: Vec<Mapping>,
}

impl Translation {
    /// The IOVA of `[va, va+len)` if one mapping covers all of it.
    pub fn translate(&self, va: usize, len: usize) -> Option<u64> {
        let at = self.mappings.partition_point(|m| m.va <= va);
        let m = self.mappings.get(at.checked_sub(1)?)?;
        let end = va.checked_add(len)?;
        (end <= m.va_end()).then(|| m.iova + (va - m.va) as u64)
    }
}

/// Pinned, page-aligned, zeroed memory mapped for DMA. Unmapped from the
/// IOMMU before it is freed.
pub struct DmaBuffer {
    ptr: *mut u8,
    len: usize,
    iova: u64,
    registry: Arc<DmaRegistry>,
}

// SAFETY: the buffer is plain memory owned by this value; its users
// coordinate access through the queue that owns it.
unsafe impl Send for DmaBuffer {}
// SAFETY: shared access only hands out raw pointers.
unsafe impl Sync for DmaBuffer {}

impl DmaBuffer {
    /// Allocate `len` bytes (rounded up to a page), from 2 MiB hugepages when
    /// the system has them reserved, and map them in the internal window.
    pub fn new(registry: &Arc<DmaRegistry>, len: usize) -> Result<Self, DmaError> {
        let len = len.next_multiple_of(PAGE_BYTES as usize);
        let (ptr, len) = allocate(len)?;
        // SAFETY: the memory stays mapped until Drop, which unmaps the IOVA
        // range first.
        let iova = match unsafe { registry.map_internal(ptr as usize, len as u64) } {
            Ok(iova) => iova,
            Err(e) => {
                // SAFETY: ptr/len came from mmap above and are not in use.
                unsafe { libc::munmap(ptr.cast(), len) };
                return Err(e);
            }
        };
        Ok(Self { ptr, len, iova, registry: Arc::clone(registry) })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// Zero the whole buffer (a queue being rebuilt after a reset).
    pub fn zero(&mut self) {
        // SAFETY: ptr/len describe memory this value owns.
        unsafe { std::ptr::write_bytes(self.ptr, 0, self.len) };
    }
}

impl Drop for DmaBuffer {
    fn drop(&mut self) {
        self.registry.unmap(self.ptr as usize);
        // SAFETY: the IOMMU no longer maps the memory, and nothing else
        // holds the pointer.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn allocate(len: usize) -> Result<(*mut u8, usize), DmaError> {
    let huge_len = len.next_multiple_of(HUGE_PAGE_BYTES);
    // Small buffers would waste most of a hugepage.
    if len >= HUGE_PAGE_BYTES / 2 {
        // SAFETY: an anonymous mapping with no address hint.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                huge_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            return Ok((p.cast(), huge_len));
        }
    }
    // SAFETY: as above, without hugepages; VFIO pins the pages when mapped.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        return Err(DmaError::Alloc { len, errno });
    }
    Ok((p.cast(), len))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[derive(Default)]
    pub struct RecordingMapper {
        pub live: Mutex<Vec<(u64, u64, usize)>>,
    }

    impl IommuMapper for RecordingMapper {
        unsafe fn map(&self, iova: u64, len: u64, va: usize) -> Result<(), IommuError> {
            let mut live = self.live.lock().unwrap();
            assert!(
                live.iter().all(|&(i, l, _)| iova + len <= i || i + l <= iova),
                "the registry let two IOVA ranges overlap"
            );
            live.push((iova, len, va));
            Ok(())
        }
        fn unmap(&self, iova: u64, len: u64) -> Result<(), IommuError> {
            let mut live = self.live.lock().unwrap();
            let at =
                live.iter().position(|&(i, l, _)| i == iova && l == len).ok_or(IommuError::NotMapped { iova, len })?;
            live.remove(at);
            Ok(())
        }
    }

    fn registry() -> (Arc<RecordingMapper>, Arc<DmaRegistry>) {
        let mapper = Arc::new(RecordingMapper::default());
        let registry = Arc::new(DmaRegistry::new(mapper.clone()));
        (mapper, registry)
    }

    #[test]
    fn internal_and_guest_windows_never_collide() {
        let (mapper, registry) = registry();
        let a = DmaBuffer::new(&registry, 3 * 4096).unwrap();
        let b = DmaBuffer::new(&registry, 8192).unwrap();
        assert!(a.iova() >= INTERNAL_IOVA_BASE && a.iova() + a.len() as u64 <= b.iova());
        // Guest memory at guest physical 0 and above 4 GiB, as QEMU lays out
        // a q35 guest with more than 2 GiB.
        let low = 0x2000_0000_usize;
        let high = 0x7000_0000_0000_usize;
        // SAFETY: the recording mapper touches no memory.
        let g0 = unsafe { registry.map_guest(low, 0x8000_0000, 0) }.unwrap();
        // SAFETY: as above.
        let g1 = unsafe { registry.map_guest(high, 0x4000_0000, 0x1_0000_0000) }.unwrap();
        assert_eq!(g0, GUEST_IOVA_BASE);
        assert_eq!(g1, GUEST_IOVA_BASE + 0x1_0000_0000);
        let live = mapper.live.lock().unwrap().clone();
        assert_eq!(live.len(), 4);
        for &(iova, len, _) in &live {
            let internal = iova >= INTERNAL_IOVA_BASE && iova + len <= INTERNAL_IOVA_END;
            let guest = iova >= GUEST_IOVA_BASE && iova + len <= GUEST_IOVA_END;
            assert!(internal ^ guest, "IOVA {iova:#x} is in neither window, or both");
        }
        // A guest region overlapping one already mapped (in IOVA space) is
        // refused, as is one beyond the window.
        // SAFETY: as above.
        let clash = unsafe { registry.map_guest(0x1000_0000, 0x1000, 0x1000) };
        assert!(matches!(clash, Err(DmaError::Overlap { .. })), "{clash:?}");
        // SAFETY: as above.
        let huge = unsafe { registry.map_guest(0x10_0000_0000, 0x1000, 448 << 30) };
        assert!(matches!(huge, Err(DmaError::GuestOutOfWindow { .. })), "{huge:?}");

        let mut t = Translation::default();
        registry.snapshot(&mut t);
        assert_eq!(t.translate(low + 0x1234, 512), Some(GUEST_IOVA_BASE + 0x1234));
        assert_eq!(t.translate(high + 0x3fff_f000, 4096), Some(GUEST_IOVA_BASE + 0x1_3fff_f000));
        assert_eq!(t.translate(high + 0x3fff_f000, 8192), None, "a range running off a mapping");
        assert_eq!(t.translate(a.as_ptr() as usize + 4096, 4096), Some(a.iova() + 4096));
        assert_eq!(t.translate(0x10, 16), None);

        // Setting the same table again changes nothing; a new table keeps
        // what stays and swaps what changed.
        let region = |va: usize, len: u64, gpa: u64| crate::MemoryRegion { host_address: va, len, guest_address: gpa };
        let same = [region(low, 0x8000_0000, 0), region(high, 0x4000_0000, 0x1_0000_0000)];
        let before = registry.generation();
        // SAFETY: the recording mapper touches no memory.
        unsafe { registry.set_guest(&same) }.unwrap();
        assert_eq!(registry.generation(), before, "an unchanged table remaps nothing");
        let moved = [region(low, 0x8000_0000, 0), region(high + 0x1000_0000, 0x1000_0000, 0x2_0000_0000)];
        // SAFETY: as above.
        unsafe { registry.set_guest(&moved) }.unwrap();
        let guest: Vec<Mapping> = registry.mappings().into_iter().filter(|m| m.guest).collect();
        assert_eq!(guest.len(), 2);
        assert!(guest.iter().any(|m| m.iova == GUEST_IOVA_BASE + 0x2_0000_0000));

        let before = registry.generation();
        assert_eq!(registry.unmap_all_guest(), 2);
        assert!(registry.generation() > before, "queues must notice the change");
        drop(b);
        drop(a);
        assert!(mapper.live.lock().unwrap().is_empty(), "every mapping is undone");
        // The bump allocator gave back b's space, then a's.
        let c = DmaBuffer::new(&registry, 4096).unwrap();
        assert_eq!(c.iova(), INTERNAL_IOVA_BASE);
    }

    #[test]
    fn lengths_must_be_whole_pages() {
        let (_, registry) = registry();
        // SAFETY: the recording mapper touches no memory.
        assert_eq!(unsafe { registry.map_guest(0x1000, 100, 0) }, Err(DmaError::BadLength(100)));
        // SAFETY: as above.
        assert_eq!(unsafe { registry.map_internal(0x1000, 0) }, Err(DmaError::BadLength(0)));
    }
}
