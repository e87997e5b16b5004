//! Aligned memory for direct I/O.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use super::IoVec;

/// A zero-initialised heap buffer with a chosen alignment, suitable for
/// O_DIRECT. Its address does not change when the value moves.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only allow reads, like &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// # Panics
    /// On a zero length or a non-power-of-two alignment: both are
    /// programming errors, never input.
    pub fn zeroed(len: usize, align: usize) -> Self {
        assert!(len > 0, "AlignedBuf of zero length");
        let layout = Layout::from_size_align(len, align).expect("alignment is a power of two");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        Self { ptr, layout }
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn iovec(&mut self) -> IoVec {
        IoVec { base: self.ptr.as_ptr(), len: self.len() }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live, initialised allocation of layout.size() bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this same layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({:p}, {} bytes)", self.ptr, self.len())
    }
}

/// A fixed set of equal, aligned buffers allocated once, which io_uring can
/// register so that internal I/O skips per-request page pinning.
///
/// Buffers are handed out as [`PoolBuf`]s and must be given back with
/// [`BufferPool::put`]; the pool is bounded and never grows.
pub struct BufferPool {
    region: Arc<AlignedBuf>,
    base: *mut u8,
    buffer_bytes: usize,
    free: Vec<u16>,
}

/// One buffer of a [`BufferPool`], identified by its index.
#[derive(Debug)]
pub struct PoolBuf {
    index: u16,
    ptr: *mut u8,
    len: usize,
    _region: Arc<AlignedBuf>,
}

// SAFETY: the pool hands out disjoint parts of a region it keeps alive, and
// its own state (the free list) moves with it.
unsafe impl Send for BufferPool {}

// SAFETY: a PoolBuf is the sole holder of its slice of the region until it is
// returned to the pool; the Arc keeps the region alive.
unsafe impl Send for PoolBuf {}

impl BufferPool {
    pub const MAX_BUFFERS: usize = u16::MAX as usize;

    pub fn new(count: usize, buffer_bytes: usize, align: usize) -> Self {
        assert!(count > 0 && count <= Self::MAX_BUFFERS);
        assert!(buffer_bytes > 0 && buffer_bytes.is_multiple_of(align));
        let mut memory = AlignedBuf::zeroed(count * buffer_bytes, align);
        // Taken before the buffer is shared so that writes through it carry
        // the allocation's own (mutable) provenance.
        let base = memory.as_mut_ptr();
        let free = (0..count as u16).rev().collect();
        Self { region: Arc::new(memory), base, buffer_bytes, free }
    }

    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// The whole region: its start, its length, and a handle that keeps it
    /// alive (for a backend that maps it for DMA).
    pub fn region(&self) -> (*mut u8, usize, Arc<AlignedBuf>) {
        (self.base, self.region.len(), Arc::clone(&self.region))
    }

    pub fn count(&self) -> usize {
        self.region.len() / self.buffer_bytes
    }

    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// The iovecs io_uring registers, one per buffer, in index order.
    pub fn registration_iovecs(&self) -> Vec<IoVec> {
        (0..self.count()).map(|i| IoVec { base: self.ptr_of(i as u16), len: self.buffer_bytes }).collect()
    }

    fn ptr_of(&self, index: u16) -> *mut u8 {
        // SAFETY: index < count, so the offset stays inside the region.
        unsafe { self.base.add(index as usize * self.buffer_bytes) }
    }

    pub fn take(&mut self) -> Option<PoolBuf> {
        let index = self.free.pop()?;
        Some(PoolBuf { index, ptr: self.ptr_of(index), len: self.buffer_bytes, _region: Arc::clone(&self.region) })
    }

    pub fn put(&mut self, buf: PoolBuf) {
        assert!(Arc::ptr_eq(&buf._region, &self.region), "PoolBuf returned to a pool it did not come from");
        debug_assert!(!self.free.contains(&buf.index));
        self.free.push(buf.index);
    }
}

impl PoolBuf {
    pub fn index(&self) -> u16 {
        self.index
    }
    pub fn iovec(&mut self) -> IoVec {
        IoVec { base: self.ptr, len: self.len }
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: this PoolBuf is the only handle to its part of the region.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
