//! What the data paths own, apart from the pages and the extents: the
//! files' byte-range locks, whether data writes stamp mtime and ctime,
//! and the counters of the data that moved.
//!
//! Invariant, asserted in debug builds: a direct write ends only after it
//! began, so the count in flight never goes below zero.

use std::cell::Cell;
use std::future::Future;
use std::rc::Rc;

use crate::ids::Ino;
use crate::sync::{RangeGuard, RangeLocks};
use crate::FsCounters;

/// The data paths' own state.
pub(crate) struct DataState {
    ranges: Rc<RangeLocks>,
    /// False only in a benchmark that measures what mtime/ctime upkeep
    /// costs (`keelfs-bench core --workload byte-writes`).
    file_times: Cell<bool>,
    counters: Cell<DataCounters>,
}

/// The data paths' part of [`FsCounters`], each field the one named alike
/// there.
#[derive(Clone, Copy, Default)]
struct DataCounters {
    data_bytes_written: u64,
    data_bytes_read: u64,
    direct_overwrites: u64,
    direct_extends: u64,
    direct_in_flight: u64,
    direct_in_flight_max: u64,
    writeback_pages: u64,
}

impl Default for DataState {
    fn default() -> Self {
        Self { ranges: Rc::default(), file_times: Cell::new(true), counters: Cell::default() }
    }
}

impl DataState {
    /// Lock [start, end) of `ino`'s bytes, shared or exclusive, until the
    /// guard drops.
    pub fn lock(&self, ino: Ino, start: u64, end: u64, exclusive: bool) -> impl Future<Output = RangeGuard> {
        self.ranges.lock(ino, start, end, exclusive)
    }

    /// Range-lock acquisitions that had to wait: (shared, exclusive).
    /// No range lock held or awaited and no direct write in flight: no
    /// data operation is between its allocation and its mapping record.
    pub fn is_idle(&self) -> bool {
        self.ranges.is_idle() && self.counters.get().direct_in_flight == 0
    }

    pub fn range_lock_waits(&self) -> (u64, u64) {
        self.ranges.waits()
    }

    /// Whether data writes stamp mtime and ctime.
    pub fn file_times(&self) -> bool {
        self.file_times.get()
    }

    pub fn set_file_times(&self, on: bool) {
        self.file_times.set(on);
    }

    fn count(&self, f: impl FnOnce(&mut DataCounters)) {
        let mut c = self.counters.get();
        f(&mut c);
        self.counters.set(c);
    }

    /// File data read, from the device or the cache.
    pub fn count_read(&self, bytes: u64) {
        self.count(|c| c.data_bytes_read += bytes);
    }

    /// File data written to the device.
    pub fn count_written(&self, bytes: u64) {
        self.count(|c| c.data_bytes_written += bytes);
    }

    /// A direct write into written blocks inside the file, of `bytes`.
    pub fn count_direct_overwrite(&self, bytes: u64) {
        self.count(|c| {
            c.direct_overwrites += 1;
            c.data_bytes_written += bytes;
        });
    }

    /// A direct write into holes or past the end, of `bytes`.
    pub fn count_direct_extend(&self, bytes: u64) {
        self.count(|c| {
            c.direct_extends += 1;
            c.data_bytes_written += bytes;
        });
    }

    /// Pages a writeback wrote and mapped.
    pub fn count_written_back(&self, pages: u64) {
        self.count(|c| c.writeback_pages += pages);
    }

    /// A direct write's device I/O starts.
    pub fn direct_begin(&self) {
        self.count(|c| {
            c.direct_in_flight += 1;
            c.direct_in_flight_max = c.direct_in_flight_max.max(c.direct_in_flight);
        });
    }

    /// A direct write's device I/O ended, successfully or not.
    pub fn direct_end(&self) {
        self.count(|c| {
            debug_assert!(c.direct_in_flight > 0, "a direct write ended that never began");
            c.direct_in_flight -= 1;
        });
    }

    /// Copy these counters into the public ones, where nothing else
    /// counts them.
    pub fn report(&self, out: &mut FsCounters) {
        let c = self.counters.get();
        out.data_bytes_written = c.data_bytes_written;
        out.data_bytes_read = c.data_bytes_read;
        out.direct_overwrites = c.direct_overwrites;
        out.direct_extends = c.direct_extends;
        out.direct_in_flight = c.direct_in_flight;
        out.direct_in_flight_max = c.direct_in_flight_max;
        out.writeback_pages = c.writeback_pages;
    }
}
