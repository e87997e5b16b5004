//! A fixed-size log-linear latency histogram: 64 linear buckets per power of
//! two, so any percentile is within 1/64 (1.6%) of the true value. It never
//! allocates after construction, so recording costs the same at any rate.

const SUB_BUCKET_BITS: u32 = 6;
const SUB_BUCKETS: u64 = 1 << SUB_BUCKET_BITS;
const BUCKETS: usize = (64 - SUB_BUCKET_BITS as usize + 1) * SUB_BUCKETS as usize;

pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

fn bucket_of(value: u64) -> usize {
    if value < SUB_BUCKETS {
        return value as usize;
    }
    let msb = 63 - value.leading_zeros();
    let shift = msb - SUB_BUCKET_BITS;
    ((shift as u64 + 1) * SUB_BUCKETS + ((value >> shift) - SUB_BUCKETS)) as usize
}

fn lower_bound_of(bucket: usize) -> u64 {
    let b = bucket as u64;
    if b < SUB_BUCKETS {
        return b;
    }
    let shift = b / SUB_BUCKETS - 1;
    (SUB_BUCKETS + b % SUB_BUCKETS) << shift
}

impl Histogram {
    pub fn new() -> Self {
        Self { counts: vec![0; BUCKETS], total: 0 }
    }

    pub fn record(&mut self, value: u64) {
        self.counts[bucket_of(value)] += 1;
        self.total += 1;
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
    }

    /// The value below which `q` (0..=1) of the samples fall.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (bucket, &count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return lower_bound_of(bucket);
            }
        }
        unreachable!("rank is at most the total")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_tight() {
        let mut last = 0;
        for v in (0..1_000_000u64).step_by(7).chain([u64::MAX / 2, u64::MAX]) {
            let b = bucket_of(v);
            assert!(b >= last && b < BUCKETS);
            last = b;
            let lo = lower_bound_of(b);
            assert!(lo <= v && (v - lo) as f64 <= v as f64 / 64.0 + 1.0, "{v} -> {lo}");
        }
    }

    #[test]
    fn quantiles() {
        let mut h = Histogram::new();
        for v in 1..=1000u64 {
            h.record(v * 1000);
        }
        let p50 = h.quantile(0.5);
        let p99 = h.quantile(0.99);
        assert!((490_000..=500_000).contains(&p50), "{p50}");
        assert!((975_000..=990_000).contains(&p99), "{p99}");
    }
}
