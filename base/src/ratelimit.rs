//! Rate limits for log lines a client can provoke: a guest that fills its
//! disk or sends garbage must not flood the host's journal. Like the
//! kernel's printk_ratelimited: a burst per window, then a count of what
//! was left out.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines let through per window, and the window.
pub const LOG_BURST: u32 = 10;
pub const LOG_WINDOW: Duration = Duration::from_secs(5);

/// One call site's limit, or one client's at a call site. Taken only on
/// paths that log, never per request that succeeds.
pub struct RateLimit {
    /// The window's start, lines let through in it, and lines left out
    /// since the last one let through.
    state: Mutex<(Option<Instant>, u32, u64)>,
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::new()
    }
}

impl RateLimit {
    pub const fn new() -> Self {
        Self { state: Mutex::new((None, 0, 0)) }
    }

    /// Whether a line may go out now: `Some(left_out)`, the lines
    /// suppressed before it, or None to suppress it.
    pub fn check(&self) -> Option<u64> {
        self.check_at(Instant::now())
    }

    fn check_at(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (start, sent, left_out) = &mut *state;
        if start.is_none_or(|start| now.saturating_duration_since(start) >= LOG_WINDOW) {
            *start = Some(now);
            *sent = 0;
        }
        if *sent >= LOG_BURST {
            *left_out += 1;
            return None;
        }
        *sent += 1;
        Some(std::mem::take(left_out))
    }
}

/// Log with a per-call-site [`RateLimit`]: `ratelimited!(tracing::warn!(...))`,
/// or with one of the caller's: `ratelimited!(limit = &self.limit, tracing::warn!(...))`.
/// A call site shared by many clients (every export's sessions) needs the
/// second, one limit per client: with the first, one client provoking it
/// silences every other's. When lines were left out, a warning saying how
/// many goes first.
#[macro_export]
macro_rules! ratelimited {
    (limit = $limit:expr, $event:expr) => {{
        let limit: &$crate::RateLimit = $limit;
        if let Some(left_out) = limit.check() {
            if left_out > 0 {
                tracing::warn!(suppressed = left_out, "similar messages were suppressed");
            }
            $event;
        }
    }};
    ($event:expr) => {{
        static LIMIT: $crate::RateLimit = $crate::RateLimit::new();
        $crate::ratelimited!(limit = &LIMIT, $event)
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_silence_then_a_count() {
        let limit = RateLimit::new();
        let t0 = Instant::now();
        let let_through = (0..1000).filter(|_| limit.check_at(t0).is_some()).count();
        assert_eq!(let_through, LOG_BURST as usize);
        // The next window lets a line through, and says what was left out.
        assert_eq!(limit.check_at(t0 + LOG_WINDOW), Some(1000 - u64::from(LOG_BURST)));
        assert_eq!(limit.check_at(t0 + LOG_WINDOW), Some(0));
    }
}
