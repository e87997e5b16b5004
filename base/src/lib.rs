//! keelfs-base: the vocabulary every layer of keelfs shares, with no layer
//! of its own. Sizes as people write them, the hashers of the maps on the
//! I/O path (and a prefetch hint for them), and the clock that files are
//! stamped with.
//!
//! It sits under the block layer so that the filesystem can read the clock
//! without reaching into the reactor's system calls.

// One system call and one CPU hint need unsafe; nothing else in this
// crate may.
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod clock;
mod hash;
#[allow(unsafe_code)]
mod prefetch;
mod ratelimit;
mod size;
#[cfg(feature = "test-utils")]
pub mod testing;

pub use clock::realtime_coarse;
pub use hash::{IdHasher, IdMap, IdMapBy, SeededHasher, SeededState};
pub use prefetch::prefetch;
pub use ratelimit::{RateLimit, LOG_BURST, LOG_WINDOW};
pub use size::{parse_size, SizeError};
