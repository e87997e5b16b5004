//! Byte buffers for requests and replies, reused on each thread.
//!
//! Every request the copying path serves needs a buffer for the request's
//! bytes and one for its reply. Taking them from a pool kept by the
//! thread (each reactor is one thread) makes that no allocation once the
//! pool holds as many as are in flight (issue 34: the metadata path
//! allocates nothing in steady state).
//!
//! Bounded: at most [`POOLED_MAX`] buffers, each of at most
//! [`POOLED_CAPACITY_MAX`] bytes, so a burst of large replies (READDIR of
//! a guest-sized buffer) leaves no more than 8 MiB behind on a thread.

use std::cell::RefCell;

/// Buffers kept per thread: more than the requests a reactor has in
/// flight on its queues at their default depth.
pub const POOLED_MAX: usize = 128;

/// A buffer larger than this is freed rather than kept.
pub const POOLED_CAPACITY_MAX: usize = 64 << 10;

/// What a new buffer gets at least: a metadata request or reply and most
/// READDIRs fit, so a reused buffer seldom grows.
const FRESH_CAPACITY: usize = 4 << 10;

thread_local! {
    static POOL: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer with room for `capacity` bytes: a kept one if the
/// thread has one, else a new one.
pub fn take(capacity: usize) -> Vec<u8> {
    match POOL.with(|pool| pool.borrow_mut().pop()) {
        Some(mut kept) => {
            debug_assert!(kept.is_empty());
            kept.reserve(capacity);
            kept
        }
        None => Vec::with_capacity(capacity.max(FRESH_CAPACITY)),
    }
}

/// Give `buffer` back for a later [`take`] on this thread, unless the
/// pool is full or the buffer too large to keep.
pub fn give(mut buffer: Vec<u8>) {
    if buffer.capacity() == 0 || buffer.capacity() > POOLED_CAPACITY_MAX {
        return;
    }
    buffer.clear();
    POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        if pool.len() < POOLED_MAX {
            pool.push(buffer);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_buffer_is_taken_again_empty_and_the_pool_stays_bounded() {
        let mut b = take(100);
        b.extend_from_slice(b"stale");
        let at = b.as_ptr();
        give(b);
        let again = take(10);
        assert_eq!(again.as_ptr(), at, "the same allocation");
        assert!(again.is_empty(), "no stale bytes");
        give(again);
        give(Vec::with_capacity(POOLED_CAPACITY_MAX + 1));
        for _ in 0..POOLED_MAX + 10 {
            give(Vec::with_capacity(16));
        }
        let kept = POOL.with(|pool| {
            let pool = pool.borrow();
            assert!(pool.iter().all(|b| b.capacity() <= POOLED_CAPACITY_MAX));
            pool.len()
        });
        assert_eq!(kept, POOLED_MAX);
    }
}
