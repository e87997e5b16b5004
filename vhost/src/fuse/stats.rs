//! Per-opcode counters of a FUSE session: requests, errors, bytes and a
//! latency histogram. Kept outside the session so that they outlive
//! reconnects; read on the session's reactor (no atomics, no locks).

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::time::Duration;

use super::abi::Opcode;

/// Log-linear latency buckets: 8 per power of two of nanoseconds, so a
/// quantile is off by at most 1/8 of its value.
const SUB_BUCKETS: u32 = 8;
const BUCKETS: usize = 64 * SUB_BUCKETS as usize;

#[derive(Clone)]
pub struct LatencyHistogram {
    counts: Box<[u64; BUCKETS]>,
    total: u64,
    /// Sum of every latency recorded, in ns (saturating), as a Prometheus
    /// histogram's `_sum` needs.
    sum_ns: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self { counts: Box::new([0; BUCKETS]), total: 0, sum_ns: 0 }
    }
}

fn bucket_of(ns: u64) -> usize {
    if ns < u64::from(SUB_BUCKETS) {
        return ns as usize;
    }
    let power = 63 - ns.leading_zeros(); // ns >= 8, so power >= 3
    let sub = (ns >> (power - 3)) & u64::from(SUB_BUCKETS - 1);
    (power * SUB_BUCKETS + sub as u32) as usize
}

/// The smallest value that falls in `bucket`.
fn bucket_floor(bucket: usize) -> u64 {
    let (power, sub) = (bucket as u32 / SUB_BUCKETS, bucket as u64 % u64::from(SUB_BUCKETS));
    if power < 3 {
        return bucket as u64;
    }
    (1u64 << power) + (sub << (power - 3))
}

impl LatencyHistogram {
    pub fn record(&mut self, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.counts[bucket_of(ns).min(BUCKETS - 1)] += 1;
        self.total += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
    }

    /// The counts folded into power-of-two buckets: `(bound_ns, count)`
    /// pairs, ascending, where `count` latencies were below `bound_ns` and
    /// at least the previous bound (non-cumulative; empty buckets left
    /// out). Exact: every log-linear bucket lies inside one power of two.
    pub fn power_of_two_buckets(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (bucket, &n) in self.counts.iter().enumerate().filter(|(_, &n)| n > 0) {
            let floor = bucket_floor(bucket);
            // The next power of two above the floor; the last bucket's
            // bound saturates.
            let bound = 1u64.checked_shl(64 - floor.leading_zeros()).unwrap_or(u64::MAX);
            match out.last_mut() {
                Some((b, count)) if *b == bound => *count += n,
                _ => out.push((bound, n)),
            }
        }
        out
    }

    /// The `q` quantile (0..=1) in nanoseconds, as its bucket's floor.
    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((self.total as f64 * q).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (bucket, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return bucket_floor(bucket);
            }
        }
        bucket_floor(BUCKETS - 1)
    }
}

#[derive(Clone, Default)]
pub struct OpCounter {
    pub requests: u64,
    pub errors: u64,
    /// Request plus reply bytes, data included.
    pub bytes: u64,
    pub latency: LatencyHistogram,
}

/// A snapshot line: one opcode.
#[derive(Clone, Debug, PartialEq)]
pub struct OpSnapshot {
    pub op: String,
    pub requests: u64,
    pub errors: u64,
    pub bytes: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Sum of the latencies, for a mean or a Prometheus `_sum`.
    pub latency_sum_ns: u64,
    /// See [`LatencyHistogram::power_of_two_buckets`].
    pub latency_buckets: Vec<(u64, u64)>,
}

#[derive(Default)]
pub struct OpStats {
    /// Keyed by opcode; every opcode keelfs does not know shares the one
    /// key [`UNKNOWN_OPCODE`], so a client sending many distinct numbers
    /// cannot grow the table past the known opcodes plus one.
    ops: RefCell<BTreeMap<u32, OpCounter>>,
    /// The transport that carries the requests, where there is a choice
    /// (the host mount: "dev" or "uring").
    transport: Cell<Option<&'static str>>,
    /// Requests that came through io_uring ring entries.
    ring_requests: Cell<u64>,
    /// Notifications sent to the client kernel (FUSE_NOTIFY_INVAL_*).
    notifications: Cell<u64>,
    /// WRITEs served with their data where the transport read it
    /// (the host mount's /dev/fuse buffer), not copied out first.
    in_place_writes: Cell<u64>,
}

/// The key of every opcode that is not a FUSE opcode keelfs knows.
const UNKNOWN_OPCODE: u32 = u32::MAX;

impl OpStats {
    pub fn set_transport(&self, name: &'static str) {
        self.transport.set(Some(name));
    }

    pub fn transport(&self) -> Option<&'static str> {
        self.transport.get()
    }

    pub fn count_ring_request(&self) {
        self.ring_requests.set(self.ring_requests.get() + 1);
    }

    pub fn ring_requests(&self) -> u64 {
        self.ring_requests.get()
    }

    pub fn count_notification(&self) {
        self.notifications.set(self.notifications.get() + 1);
    }

    pub fn notifications(&self) -> u64 {
        self.notifications.get()
    }

    pub fn count_in_place_write(&self) {
        self.in_place_writes.set(self.in_place_writes.get() + 1);
    }

    pub fn in_place_writes(&self) -> u64 {
        self.in_place_writes.get()
    }

    pub fn record(&self, opcode: u32, bytes: usize, failed: bool, latency: Duration) {
        let key = if Opcode::from_u32(opcode).is_some() { opcode } else { UNKNOWN_OPCODE };
        let mut ops = self.ops.borrow_mut();
        let c = ops.entry(key).or_default();
        c.requests += 1;
        c.errors += u64::from(failed);
        c.bytes += bytes as u64;
        c.latency.record(latency);
    }

    pub fn snapshot(&self) -> Vec<OpSnapshot> {
        self.ops
            .borrow()
            .iter()
            .map(|(&code, c)| OpSnapshot {
                op: Opcode::from_u32(code).map_or_else(|| "unknown".to_string(), |o| format!("{o:?}").to_lowercase()),
                requests: c.requests,
                errors: c.errors,
                bytes: c.bytes,
                p50_us: c.latency.quantile_ns(0.5) as f64 / 1000.0,
                p99_us: c.latency.quantile_ns(0.99) as f64 / 1000.0,
                latency_sum_ns: c.latency.sum_ns,
                latency_buckets: c.latency.power_of_two_buckets(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_ordered_and_tight() {
        let mut last = 0;
        for ns in [0u64, 1, 7, 8, 9, 15, 16, 100, 1000, 12_345, 1 << 20, 1 << 40] {
            let b = bucket_of(ns);
            assert!(b >= last, "{ns}");
            last = b;
            let floor = bucket_floor(b);
            assert!(floor <= ns && ns - floor <= ns / 8, "{ns} in bucket floored at {floor}");
        }
    }

    #[test]
    fn unknown_opcodes_share_one_counter() {
        let stats = OpStats::default();
        // Every number a client could send that is not a known opcode.
        let unknown: Vec<u32> =
            (0..200_000u32).map(|i| i.wrapping_mul(2_654_435_761)).filter(|&c| Opcode::from_u32(c).is_none()).collect();
        for &code in &unknown {
            stats.record(code, 0, true, Duration::from_micros(1));
        }
        stats.record(Opcode::Getattr as u32, 0, false, Duration::from_micros(1));
        let snap = stats.snapshot();
        assert_eq!(snap.len(), 2, "one unknown counter and getattr's");
        let other = snap.iter().find(|s| s.op == "unknown").expect("an unknown counter");
        assert_eq!((other.requests, other.errors), (unknown.len() as u64, unknown.len() as u64));
    }

    #[test]
    fn power_of_two_buckets_fold_exactly() {
        let mut h = LatencyHistogram::default();
        let samples = [0u64, 1, 2, 3, 7, 8, 15, 16, 1000, 1023, 1024, 1025, 1 << 40, u64::MAX];
        for &ns in &samples {
            h.record(Duration::from_nanos(ns));
        }
        let buckets = h.power_of_two_buckets();
        assert!(buckets.windows(2).all(|w| w[0].0 < w[1].0), "{buckets:?}");
        assert_eq!(buckets.iter().map(|b| b.1).sum::<u64>(), samples.len() as u64);
        // Each sample counts below its bound and at or above the one before.
        for &ns in &samples {
            let i = buckets.iter().position(|&(bound, _)| ns < bound || bound == u64::MAX).expect("a bucket");
            assert!(i == 0 || ns >= buckets[i - 1].0, "{ns} in {buckets:?}");
        }
        assert_eq!(buckets[0], (1, 1), "0 ns alone below 1");
        assert!(buckets.contains(&(2048, 2)), "1024 and 1025 below 2048: {buckets:?}");
        assert_eq!(h.sum_ns, u64::MAX, "the sum saturates");
    }

    #[test]
    fn quantiles_follow_the_data() {
        let mut h = LatencyHistogram::default();
        for us in 1..=100u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile_ns(0.5);
        let p99 = h.quantile_ns(0.99);
        assert!((44_000..=50_000).contains(&p50), "{p50}");
        assert!((87_000..=99_000).contains(&p99), "{p99}");
    }
}
