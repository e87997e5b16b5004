//! The wall clock that files are stamped with.

/// Wall-clock time at the kernel's tick resolution (a few ms), as
/// (seconds, nanoseconds): several times cheaper than the precise clock,
/// and what Linux itself stamps files with unless someone is looking.
pub fn realtime_coarse() -> (i64, u32) {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to the pointer we pass, which
    // points at a live, writable timespec on this stack frame.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    (ts.tv_sec, ts.tv_nsec as u32)
}
