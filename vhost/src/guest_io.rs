//! Direct I/O between guest memory and the device, with no copy in
//! between: the guest's data pages become the iovecs of the device I/O.
//!
//! This is the one module of keelfs-vhost that hands raw guest addresses
//! to the block layer. The same buffers serve buffered I/O as a copy
//! source or sink, so that guest data is copied once, to or from the page
//! cache.

use std::ops::Deref;

use crate::fuse::dispatch::ReadInPlace;
use crate::virtio::GuestRam;
use keelfs_bdev::{IoVec, MAX_IOVECS_PER_REQUEST};
use keelfs_fs::{ReadSink, WriteSource};
use keelfs_reactor::{IoBuffer, IoVecs};
use smallvec::SmallVec;
use vm_memory::bitmap::Bitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

/// Part of a descriptor chain's buffers, as device I/O memory. Holds the
/// guest memory table it was resolved against, so that the mapping
/// outlives the I/O whatever the frontend does to the table meanwhile.
pub struct GuestBuffer<M: Deref<Target = GuestRam>> {
    mem: M,
    /// Guest ranges, for the safe accessors.
    ranges: SmallVec<[(u64, usize); 4]>,
    iovecs: IoVecs,
    len: usize,
}

impl<M: Deref<Target = GuestRam>> GuestBuffer<M> {
    /// The `take` bytes that follow the first `skip` bytes of `buffers`
    /// (guest address, length). None when a piece lies outside guest
    /// memory or across two regions, when the buffers are shorter than
    /// `skip + take`, or when they need more iovecs than one device
    /// request carries; the caller then copies instead.
    pub fn new(mem: M, buffers: &[(u64, u32)], skip: usize, take: usize) -> Option<Self> {
        let (mut skip, mut left) = (skip, take);
        let mut ranges: SmallVec<[(u64, usize); 4]> = SmallVec::new();
        let mut iovecs = IoVecs::new();
        for &(addr, len) in buffers {
            if left == 0 {
                break;
            }
            let len = len as usize;
            if skip >= len {
                skip -= len;
                continue;
            }
            let start = addr.checked_add(skip as u64)?;
            let n = (len - skip).min(left);
            skip = 0;
            let slice = mem.get_slice(GuestAddress(start), n).ok()?;
            let base = slice.ptr_guard_mut().as_ptr();
            left -= n;
            match iovecs.last_mut() {
                // Guest pages that sit next to each other in host memory
                // make one segment.
                Some(last) if last.base.wrapping_add(last.len) == base => last.len += n,
                _ => iovecs.push(IoVec { base, len: n }),
            }
            ranges.push((start, n));
        }
        if left != 0 || iovecs.len() > MAX_IOVECS_PER_REQUEST as usize {
            return None;
        }
        Some(Self { mem, ranges, iovecs, len: take })
    }
}

impl<M: Deref<Target = GuestRam>> GuestBuffer<M> {
    /// The guest ranges covering bytes [at, at + len) of the buffer.
    fn pieces(&self, at: usize, len: usize) -> impl Iterator<Item = (u64, usize, usize)> + '_ {
        let mut base = 0usize;
        self.ranges.iter().filter_map(move |&(addr, n)| {
            let (start, end) = (base, base + n);
            base = end;
            let (from, to) = (at.max(start), (at + len).min(end));
            (from < to).then(|| (addr + (from - start) as u64, from - at, to - from))
        })
    }
}

/// Device reads (io_uring, or NVMe DMA) wrote these pages behind
/// vm-memory's back, so their dirty bits are set here, when the buffer is
/// dropped: after the I/O finished, never before it (a page logged before
/// the write lands could be copied and cleared, then written again,
/// unseen by a migration). A buffer the device only read from is marked
/// too, which costs a migration one page copy and is never wrong.
impl<M: Deref<Target = GuestRam>> Drop for GuestBuffer<M> {
    fn drop(&mut self) {
        for &(addr, len) in &self.ranges {
            if let Some(region) = self.mem.find_region(GuestAddress(addr)) {
                let offset = addr - region.start_addr().0;
                region.bitmap().mark_dirty(offset as usize, len);
            }
        }
    }
}

/// Buffered writes copy straight from the guest's pages into the page
/// cache, through vm-memory's volatile-safe accessors.
impl<M: Deref<Target = GuestRam>> WriteSource for GuestBuffer<M> {
    fn len(&self) -> usize {
        self.len
    }

    fn copy_to(&self, at: usize, dst: &mut [u8]) {
        for (addr, into, n) in self.pieces(at, dst.len()) {
            // The ranges were resolved against this table at construction.
            let _ = self.mem.read_slice(&mut dst[into..into + n], GuestAddress(addr));
        }
    }
}

/// A short read zeroes the rest of the guest's buffer.
impl<M: Deref<Target = GuestRam> + 'static> ReadInPlace for GuestBuffer<M> {
    fn zero_from(&self, from: usize) {
        // A static, not a local array: zeroing 4 KiB of stack on every
        // call was most of this function's cost.
        static ZEROS: [u8; 4096] = [0; 4096];
        let zeros = &ZEROS;
        let mut at = 0usize;
        for &(addr, len) in &self.ranges {
            let (start, end) = (at.max(from), at + len);
            let mut pos = start;
            while pos < end {
                let n = (end - pos).min(zeros.len());
                let _ = self.mem.write_slice(&zeros[..n], GuestAddress(addr + (pos - at) as u64));
                pos += n;
            }
            at = end;
        }
    }
}

/// Buffered reads copy straight from the page cache into the guest's pages.
impl<M: Deref<Target = GuestRam>> ReadSink for GuestBuffer<M> {
    fn copy_from(&self, at: usize, src: &[u8]) {
        for (addr, from, n) in self.pieces(at, src.len()) {
            let _ = self.mem.write_slice(&src[from..from + n], GuestAddress(addr));
        }
    }
}

// SAFETY: every iovec was resolved by vm-memory to lie inside one region
// of the guest memory table that `mem` keeps mapped (an Arc of the table
// on the device path), and guest mappings never move. The guest may touch
// those pages while the I/O runs, as it may with any DMA-capable device;
// keelfs itself never forms Rust references to them, only hands the
// addresses to the kernel (io_uring) or to volatile-safe copies.
unsafe impl<M: Deref<Target = GuestRam> + 'static> IoBuffer for GuestBuffer<M> {
    fn iovecs(&mut self, out: &mut IoVecs) {
        out.extend_from_slice(&self.iovecs);
    }
}
