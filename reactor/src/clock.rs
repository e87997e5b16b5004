//! Where a reactor's time comes from.
//!
//! A reactor reads its clock once per iteration and hands that instant to
//! everything it runs: pollers get it as an argument, tasks through
//! [`crate::now`], timers fire by it, and the idle policy decides by it.
//! Nothing below the reactor reads the system clock for a decision, so a
//! test can give it a [`VirtualClock`] and move time by hand: a rate
//! limiter, a timer or a timeout is then checked for exact instants on a
//! machine however loaded, rather than for wall-clock rates.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::Shared;

/// The source of a reactor's `now`.
#[derive(Clone, Debug, Default)]
pub enum Clock {
    /// The monotonic clock: what a daemon runs on.
    #[default]
    Monotonic,
    /// Time that moves only when [`VirtualClock::advance`] moves it.
    Virtual(Arc<VirtualClock>),
}

impl Clock {
    pub fn now(&self) -> Instant {
        match self {
            Clock::Monotonic => Instant::now(),
            Clock::Virtual(clock) => clock.now(),
        }
    }

    pub(crate) fn is_virtual(&self) -> bool {
        matches!(self, Clock::Virtual(_))
    }
}

/// A clock for tests: it starts at the instant it was made and stands
/// still until advanced. Every reactor running on it wakes at each
/// advance, to fire the timers that came due.
///
/// A reactor on a virtual clock sleeps (when its idle policy says so)
/// until something wakes it: an advance, a message, a task woken from
/// another thread or one of its pollers' fds. It never sleeps until a
/// timer's deadline, which real time would not bring.
pub struct VirtualClock {
    start: Instant,
    /// Nanoseconds since `start`.
    elapsed_ns: AtomicU64,
    /// The reactors to wake at each advance. A lock: taken only when a
    /// reactor starts and when a test advances time.
    reactors: Mutex<Vec<Weak<Shared>>>,
}

impl std::fmt::Debug for VirtualClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualClock").field("elapsed", &self.elapsed()).finish()
    }
}

impl VirtualClock {
    pub fn new() -> Arc<Self> {
        Arc::new(Self { start: Instant::now(), elapsed_ns: AtomicU64::new(0), reactors: Mutex::new(Vec::new()) })
    }

    pub fn now(&self) -> Instant {
        self.start + self.elapsed()
    }

    /// Time advanced since the clock was made.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.elapsed_ns.load(Ordering::Acquire))
    }

    /// Move time forward by `by`, and wake every reactor on this clock.
    ///
    /// # Panics
    /// If the clock would pass 2^64 ns (about 584 years) from its start.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).expect("an advance shorter than 584 years");
        let before = self.elapsed_ns.fetch_add(by, Ordering::AcqRel);
        assert!(before.checked_add(by).is_some(), "the virtual clock overflowed");
        // Pairs with the store-fence-load in `Reactor::sleep`: either the
        // reactor sees the new time before it sleeps, or it is seen
        // sleeping here and woken.
        fence(Ordering::SeqCst);
        let mut reactors = self.reactors.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        reactors.retain(|reactor| match reactor.upgrade() {
            Some(shared) => {
                shared.notify();
                true
            }
            None => false,
        });
    }

    pub(crate) fn register(&self, shared: &Arc<Shared>) {
        let mut reactors = self.reactors.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        reactors.push(Arc::downgrade(shared));
    }
}
