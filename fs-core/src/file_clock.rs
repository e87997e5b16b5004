//! The wall clock that file times are stamped with: the system's, or a
//! test's, which moves only when the test moves it. With it a test checks
//! which operations change which times, and relatime's decisions, for
//! exact instants rather than by sleeping past the kernel's tick.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::format::Timespec;

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Where a filesystem's `now` for file times comes from.
#[derive(Clone, Debug, Default)]
pub enum FileClock {
    /// The system's real-time clock.
    #[default]
    System,
    Manual(Arc<ManualClock>),
}

impl FileClock {
    /// Now, to the nanosecond: for times someone is looking at.
    pub fn now(&self) -> Timespec {
        match self {
            FileClock::System => Timespec::now(),
            FileClock::Manual(clock) => clock.now(),
        }
    }

    /// Now, at the kernel tick's resolution (a cheaper clock read), as
    /// Linux stamps files no one is looking at. A manual clock has one
    /// resolution.
    pub fn now_coarse(&self) -> Timespec {
        match self {
            FileClock::System => Timespec::now_coarse(),
            FileClock::Manual(clock) => clock.now(),
        }
    }
}

/// A wall clock for tests: it stands still until set or advanced.
#[derive(Debug)]
pub struct ManualClock {
    /// Nanoseconds since the epoch: enough until the year 2554.
    nanos: AtomicU64,
}

impl ManualClock {
    /// # Panics
    /// Before the epoch, or past what 64 bits of nanoseconds hold.
    pub fn new(start: Timespec) -> Arc<Self> {
        Arc::new(Self { nanos: AtomicU64::new(Self::nanos_of(start)) })
    }

    pub fn now(&self) -> Timespec {
        let nanos = self.nanos.load(Ordering::Acquire);
        let sec = i64::try_from(nanos / NANOS_PER_SEC).expect("under 2^63 s");
        Timespec { sec, nsec: (nanos % NANOS_PER_SEC) as u32 }
    }

    /// # Panics
    /// Past the year 2554.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).expect("an advance shorter than 584 years");
        let before = self.nanos.fetch_add(by, Ordering::AcqRel);
        assert!(before.checked_add(by).is_some(), "the manual clock overflowed");
    }

    fn nanos_of(t: Timespec) -> u64 {
        let (sec, nsec) = (t.sec, t.nsec);
        assert!(nsec < 1_000_000_000, "{nsec} ns is not under a second");
        let sec = u64::try_from(sec).expect("a time after the epoch");
        sec.checked_mul(NANOS_PER_SEC).and_then(|n| n.checked_add(u64::from(nsec))).expect("a time before 2554")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced() {
        let clock = ManualClock::new(Timespec { sec: 1_700_000_000, nsec: 999_999_999 });
        let files = FileClock::Manual(Arc::clone(&clock));
        assert_eq!(files.now(), Timespec { sec: 1_700_000_000, nsec: 999_999_999 });
        assert_eq!(files.now_coarse(), files.now());
        clock.advance(Duration::from_nanos(1));
        assert_eq!(files.now(), Timespec { sec: 1_700_000_001, nsec: 0 });
        clock.advance(Duration::from_millis(1500));
        assert_eq!(files.now(), Timespec { sec: 1_700_000_002, nsec: 500_000_000 });
    }
}
