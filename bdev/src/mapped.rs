//! Memory-mapped backends: anonymous RAM for tests, and pmem (a file or a
//! devdax device mapped shared) for persistent memory.
//!
//! A write is a copy followed, on pmem, by a cache-line write-back of every
//! line it touched and a store fence, so that a completed write has left the
//! CPU caches. On a DAX mapping (MAP_SYNC accepted) that makes it durable
//! and flush is a no-op; on a page-cache file (such as simulated pmem in
//! /dev/shm) durability still needs msync, which flush performs.
//!
//! Copies happen inside `submit`: memory is never "in flight", so completions
//! are queued locally and handed out by the next `poll`.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

use super::{
    validate_request, BdevError, BlockDevice, Completion, Geometry, IoKind, IoQueue, IoRequest, QueueConfig,
    MAX_IOVECS_PER_REQUEST, MAX_REQUEST_BYTES,
};

const CACHE_LINE_BYTES: usize = 64;

/// The instruction that writes a dirty cache line back to memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushInstruction {
    /// Writes back and may keep the line cached (best).
    Clwb,
    /// Writes back and evicts, weakly ordered.
    ClflushOpt,
    /// Writes back and evicts, serialising (always present on x86-64).
    Clflush,
}

impl FlushInstruction {
    /// The best instruction this CPU has, from CPUID leaf 7.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
            if leaf7.ebx & (1 << 24) != 0 {
                return FlushInstruction::Clwb;
            }
            if leaf7.ebx & (1 << 23) != 0 {
                return FlushInstruction::ClflushOpt;
            }
        }
        FlushInstruction::Clflush
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Persistence {
    /// Anonymous memory: nothing to persist.
    Volatile,
    /// Cache-line flushes on each write; `msync_on_flush` when the mapping is
    /// backed by the page cache rather than DAX.
    Pmem { instruction: FlushInstruction, msync_on_flush: bool },
}

/// A mapping that lives as long as any queue uses it.
struct Mapping {
    base: *mut u8,
    len: usize,
    _file: Option<File>,
}

// SAFETY: the mapping is plain shared memory; concurrent access to the same
// bytes from two queues is the caller's race, as on a real disk.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: base/len came from a successful mmap and nothing else
        // unmaps them.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

pub struct MappedDevice {
    mapping: Arc<Mapping>,
    name: String,
    geometry: Geometry,
    persistence: Persistence,
    /// Mapped without write permission: queues refuse writes (a store
    /// would fault).
    read_only: bool,
}

impl MappedDevice {
    /// Anonymous zeroed memory of `capacity_bytes`.
    pub fn ram(capacity_bytes: u64, logical_block_size: u32) -> Result<Self, BdevError> {
        assert!(logical_block_size.is_power_of_two() && logical_block_size >= 512);
        let len = round_up(capacity_bytes as usize, logical_block_size as usize);
        if len == 0 {
            return Err(BdevError::Unsupported("device has zero capacity"));
        }
        // SAFETY: an anonymous private mapping with no address hint.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(BdevError::last_os("mmap anonymous"));
        }
        let mapping = Arc::new(Mapping { base: base.cast(), len, _file: None });
        Ok(Self {
            mapping,
            name: format!("ram:{len}"),
            geometry: geometry(len as u64, logical_block_size, false),
            persistence: Persistence::Volatile,
            read_only: false,
        })
    }

    /// A pmem region: a regular file (its current length) or a devdax
    /// character device (its sysfs size).
    pub fn pmem(path: &Path, logical_block_size: u32) -> Result<Self, BdevError> {
        Self::pmem_with(path, logical_block_size, false)
    }

    /// [`Self::pmem`], or with `read_only` a mapping without write
    /// permission, of a file opened read-only.
    pub fn pmem_with(path: &Path, logical_block_size: u32, read_only: bool) -> Result<Self, BdevError> {
        assert!(logical_block_size.is_power_of_two() && logical_block_size >= 512);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|e| BdevError::from_io("open pmem", &e))?;
        let meta = file.metadata().map_err(|e| BdevError::from_io("stat pmem", &e))?;
        let len = if meta.file_type().is_char_device() {
            devdax_size(&meta)?
        } else if meta.file_type().is_file() {
            meta.len()
        } else {
            return Err(BdevError::Unsupported("pmem path is neither a regular file nor a devdax device"));
        };
        let len = (len - len % u64::from(logical_block_size)) as usize;
        if len == 0 {
            return Err(BdevError::Unsupported("device has zero capacity"));
        }
        let (base, dax) = map_shared(&file, len, read_only)?;
        // Fault the whole mapping in now when that allocates nothing (DAX,
        // or a file with every block allocated): otherwise the first write
        // to each page takes a page fault, which made appends (always to
        // fresh pages) cost twice what overwrites do.
        use std::os::unix::fs::MetadataExt;
        let fully_allocated = meta.file_type().is_file() && meta.blocks() * 512 >= len as u64;
        if (dax || fully_allocated) && !read_only {
            // SAFETY: base/len is the mapping just made; populating only
            // faults pages in. Failure (an older kernel) costs only speed.
            unsafe { libc::madvise(base.cast(), len, libc::MADV_POPULATE_WRITE) };
        }
        let mapping = Arc::new(Mapping { base, len, _file: Some(file) });
        Ok(Self {
            mapping,
            name: path.display().to_string(),
            geometry: geometry(len as u64, logical_block_size, !dax),
            persistence: Persistence::Pmem { instruction: FlushInstruction::detect(), msync_on_flush: !dax },
            read_only,
        })
    }

    pub fn flush_instruction(&self) -> Option<FlushInstruction> {
        match self.persistence {
            Persistence::Volatile => None,
            Persistence::Pmem { instruction, .. } => Some(instruction),
        }
    }

    /// A copy of the whole device, for tests that snapshot an image.
    pub fn snapshot(&self) -> Vec<u8> {
        // SAFETY: the mapping is readable for len bytes.
        unsafe { std::slice::from_raw_parts(self.mapping.base, self.mapping.len) }.to_vec()
    }

    /// Overwrite the whole device with `image`, for tests that rebuild one.
    pub fn restore(&self, image: &[u8]) {
        assert_eq!(image.len(), self.mapping.len, "image size differs from the device");
        // SAFETY: the mapping is writable for len bytes and image is a
        // distinct allocation of the same length.
        unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), self.mapping.base, image.len()) };
    }
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

fn geometry(capacity: u64, block: u32, volatile: bool) -> Geometry {
    Geometry {
        capacity_bytes: capacity,
        logical_block_size: block,
        memory_alignment: 8,
        volatile_write_cache: volatile,
        max_iovecs_per_request: MAX_IOVECS_PER_REQUEST,
        max_request_bytes: MAX_REQUEST_BYTES,
    }
}

fn devdax_size(meta: &std::fs::Metadata) -> Result<u64, BdevError> {
    use std::os::unix::fs::MetadataExt;
    let rdev = meta.rdev();
    let path = format!("/sys/dev/char/{}:{}/size", libc::major(rdev), libc::minor(rdev));
    let text = std::fs::read_to_string(&path).map_err(|e| BdevError::from_io("read devdax size from sysfs", &e))?;
    text.trim().parse().map_err(|_| BdevError::Unsupported("devdax sysfs size is not a number"))
}

/// Map shared, asking for MAP_SYNC first: the kernel accepts it only for
/// DAX, which tells us whether cache flushes alone make data durable.
fn map_shared(file: &File, len: usize, read_only: bool) -> Result<(*mut u8, bool), BdevError> {
    let prot = if read_only { libc::PROT_READ } else { libc::PROT_READ | libc::PROT_WRITE };
    let fd = file.as_raw_fd();
    // SAFETY: a shared mapping of an open file with no address hint.
    let sync =
        unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC, fd, 0) };
    if sync != libc::MAP_FAILED {
        return Ok((sync.cast(), true));
    }
    // SAFETY: as above, without MAP_SYNC.
    let plain = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
    if plain == libc::MAP_FAILED {
        return Err(BdevError::last_os("mmap pmem"));
    }
    Ok((plain.cast(), false))
}

impl BlockDevice for MappedDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn geometry(&self) -> Geometry {
        self.geometry
    }
    fn open_queue(&self, config: QueueConfig) -> Result<Box<dyn IoQueue>, BdevError> {
        assert!(config.depth > 0, "queue depth must be positive");
        Ok(Box::new(MappedQueue {
            mapping: Arc::clone(&self.mapping),
            geometry: self.geometry,
            persistence: self.persistence,
            read_only: self.read_only,
            depth: config.depth as usize,
            ready: VecDeque::with_capacity(config.depth as usize),
        }))
    }

    fn read_only(&self) -> bool {
        self.read_only
    }
}

struct MappedQueue {
    mapping: Arc<Mapping>,
    geometry: Geometry,
    persistence: Persistence,
    read_only: bool,
    depth: usize,
    ready: VecDeque<Completion>,
}

impl MappedQueue {
    fn flush(&self) -> Result<u32, BdevError> {
        if let Persistence::Pmem { msync_on_flush: true, .. } = self.persistence {
            // SAFETY: the whole mapping, which stays mapped while we hold the Arc.
            if unsafe { libc::msync(self.mapping.base.cast(), self.mapping.len, libc::MS_SYNC) } != 0 {
                return Err(BdevError::Io(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)));
            }
        }
        Ok(0)
    }
}

impl IoQueue for MappedQueue {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), BdevError> {
        let total = validate_request(&self.geometry, req)?;
        if self.ready.len() >= self.depth {
            return Err(BdevError::QueueFull);
        }
        if self.read_only && matches!(req.kind, IoKind::Write | IoKind::Discard { .. }) {
            return Err(BdevError::ReadOnly);
        }
        let result = match req.kind {
            IoKind::Flush if self.read_only => Ok(0),
            IoKind::Flush => self.flush(),
            IoKind::Discard { .. } => return Err(BdevError::Unsupported("the mapped backend does not discard")),
            IoKind::Read | IoKind::Write => {
                let mut offset = req.offset_bytes as usize;
                for v in req.iovecs {
                    // SAFETY: validation put [offset, offset+total) inside the
                    // mapping, which this queue's Arc keeps mapped, and no
                    // other queue's request runs meanwhile (one thread);
                    // the caller's iovec memory, maybe a guest's, is only
                    // reached through volatile access, live until the
                    // completion (submit's contract).
                    let (device, caller) = unsafe { (self.mapping.base.add(offset), v.volatile()) };
                    if req.kind == IoKind::Read {
                        // SAFETY: as above: v.len bytes of the mapping.
                        caller.copy_from(unsafe { std::slice::from_raw_parts(device, v.len) });
                    } else {
                        // SAFETY: as above.
                        caller.copy_to(unsafe { std::slice::from_raw_parts_mut(device, v.len) });
                    }
                    offset += v.len;
                }
                if req.kind == IoKind::Write {
                    if let Persistence::Pmem { instruction, .. } = self.persistence {
                        // SAFETY: the written range lies inside the mapping.
                        unsafe {
                            write_back(self.mapping.base.add(req.offset_bytes as usize), total as usize, instruction)
                        };
                    }
                }
                Ok(total as u32)
            }
        };
        self.ready.push_back(Completion { token: req.token, result });
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<super::Completion>, max: usize) -> usize {
        let n = max.min(self.ready.len());
        out.extend(self.ready.drain(..n));
        n
    }

    fn in_flight(&self) -> usize {
        self.ready.len()
    }
}

/// Write every cache line of [ptr, ptr+len) back to memory, then fence so
/// that the write-backs are ordered before anything that follows.
///
/// # Safety
/// The range must lie inside one live mapping.
unsafe fn write_back(ptr: *mut u8, len: usize, instruction: FlushInstruction) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = ptr as usize & !(CACHE_LINE_BYTES - 1);
        let end = ptr as usize + len;
        let mut line = start;
        while line < end {
            // SAFETY: the caller guarantees the range is mapped; these
            // instructions only write back the line containing `line`.
            unsafe {
                match instruction {
                    FlushInstruction::Clwb => std::arch::asm!("clwb [{0}]", in(reg) line, options(nostack)),
                    FlushInstruction::ClflushOpt => {
                        std::arch::asm!("clflushopt [{0}]", in(reg) line, options(nostack))
                    }
                    FlushInstruction::Clflush => std::arch::asm!("clflush [{0}]", in(reg) line, options(nostack)),
                }
            }
            line += CACHE_LINE_BYTES;
        }
        // SAFETY: sfence has no operands.
        unsafe { std::arch::asm!("sfence", options(nostack)) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ptr, len, instruction);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}
