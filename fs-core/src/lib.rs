//! keelfs-core: the filesystem library of keelfs, with the layers under it.
//!
//! Layers, bottom up (each looks only down):
//! - [`bdev`]: block devices driven by a polling caller (io_uring, pmem, RAM,
//!   fault injection). No call blocks on I/O and nothing here knows about
//!   reactors.
//! - [`reactor`]: the per-core, single-threaded polling runtime that drives
//!   block devices, timers, a lock-free inbox and other pollable sources.
//! - [`fs`]: the filesystem: in-memory metadata with a journal and
//!   checkpoints, the page cache, and the data paths.

pub mod bdev;
pub mod fs;
pub mod reactor;
pub mod units;
