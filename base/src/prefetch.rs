//! A hint that brings a cache line toward this core ahead of its use.
//!
//! The checksum table's entry for a random 4 KiB read is a cache miss
//! (and often a TLB miss) of several hundred cycles; asked for when the
//! device read is issued, it has arrived by the time the read completes
//! and the entry is checked.

/// Ask the CPU to bring the cache line that holds `value` into this
/// core's caches. A hint only: nothing waits for it, and where the CPU
/// has no such instruction it does nothing.
#[inline]
pub fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and changes no memory (the address
    // comes from a reference anyway); SSE, which has the instruction, is
    // part of every x86_64 CPU.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    /// A hint changes nothing it points at. Its real check is Miri's
    /// (scripts/miri.sh runs this crate): the unsafe block, given
    /// references into a Vec, must be sound.
    #[test]
    fn a_prefetch_changes_nothing() {
        let lines = vec![[7u64; 8]; 4];
        for line in &lines {
            super::prefetch(line);
        }
        assert!(lines.iter().all(|l| l == &[7; 8]));
    }
}
