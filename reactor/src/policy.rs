//! The adaptive idle policy: whether an idle reactor spins or sleeps.
//!
//! Spinning buys latency (no eventfd round trip, no wake-up) with a core.
//! It pays only when the core is effectively the reactor's own and work
//! arrives soon enough to be caught by the spin. It hurts when another
//! thread that the load needs (a running vCPU, a kernel worker, another
//! tenant) wants the same core: then every spin takes that thread's time.
//!
//! The policy has two regimes. In `Spin`, an idle reactor spins for
//! `spin_budget` and then sleeps; in `Sleep`, it sleeps as soon as an
//! iteration finds nothing. It decides once per `window` from:
//! - its own time off the CPU while it wanted to run (elapsed time minus
//!   its CPU time minus its sleeps): the share of a window that another
//!   thread held its core;
//! - the machine's CPU pressure (PSI "some"): the share of a window in
//!   which some thread waited for a CPU. While the reactor spins, that is
//!   time its spinning may have taken from a thread the load needs (a
//!   vCPU, the thread that injects its interrupts, a kernel worker);
//! - the machine's run queue (threads runnable besides itself) against the
//!   CPUs it may use: whether a spinner would have a core to itself;
//! - how idle spells end: spins that caught work within the budget
//!   (`spin_hits`) against spins that gave up (`spin_misses`), and sleeps
//!   that ended within the budget (`quick_wakes`, work that a spin would
//!   have caught without a wake-up) against all sleeps.
//!
//! Leaving `Spin` because of contention holds `Sleep` for a back-off that
//! doubles when spinning turns out contended again soon, so that a
//! contended reactor tries spinning ever less often.
//!
//! Contention is not always a loss. A driver thread that spins on the
//! reactor's core while it waits for a completion (a running vCPU polling
//! its used ring) gives the core nothing useful to do while the reactor
//! sleeps, and a sleeping reactor costs it a notification and a wake-up
//! per request. So a hold that contention began ends in an experiment:
//! the reactor spins for a short probe, deaf to contention, and the
//! requests it serves per second there are compared with those of the
//! hold's last windows, just before. When spinning served clearly more,
//! the load waits on the reactor, and it spins on, deaf to contention for
//! a trust period that doubles each time the comparison is repeated with
//! the same outcome. When it did not, it is the neighbours' time that
//! spinning took: it sleeps again, for a hold that grows fourfold. A side
//! with an idle window does not count. The two sides
//! are adjacent and equally long, so a load that ramps up or changes
//! phase rarely decides it.
//!
//! The policy is pure: time, CPU samples and request counts are inputs,
//! which is how it is tested in virtual time.

use std::time::{Duration, Instant};

/// What an idle iteration does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleAction {
    Spin,
    Sleep,
}

/// The regime the adaptive policy is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Regime {
    Spin,
    Sleep,
}

impl Regime {
    /// As stats and logs name it.
    pub fn name(self) -> &'static str {
        match self {
            Regime::Spin => "spin",
            Regime::Sleep => "sleep",
        }
    }
}

/// Why the policy last changed regime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwitchReason {
    /// The regime it started in.
    Start,
    /// Another thread held the reactor's core for too much of a window.
    Contended,
    /// Idle spells mostly outlasted the spin budget: spinning caught
    /// little work.
    SpinsMissed,
    /// A core was free and work arrived within the spin budget.
    CoreFree,
    /// The CPU pressure that sent it to sleep stayed while it slept: the
    /// load makes it (more runnable threads than CPUs), not the spinning,
    /// and work arrived within the spin budget.
    PressureNotOurs,
    /// Contended, spinning still served clearly more requests per second
    /// than sleeping did: the load waits on the reactor.
    SpinServedMore,
    /// A hold asleep that contention began has ended: spinning for a few
    /// windows, deaf to contention, to compare the two.
    Probe,
}

impl SwitchReason {
    pub fn name(self) -> &'static str {
        match self {
            SwitchReason::Start => "start",
            SwitchReason::Contended => "contended",
            SwitchReason::SpinsMissed => "spins-missed",
            SwitchReason::CoreFree => "core-free",
            SwitchReason::PressureNotOurs => "pressure-not-ours",
            SwitchReason::SpinServedMore => "spin-served-more",
            SwitchReason::Probe => "probe",
        }
    }

    pub(crate) fn code(self) -> u64 {
        self as u64
    }

    pub(crate) fn from_code(code: u64) -> Self {
        match code {
            1 => SwitchReason::Contended,
            2 => SwitchReason::SpinsMissed,
            3 => SwitchReason::CoreFree,
            4 => SwitchReason::PressureNotOurs,
            5 => SwitchReason::SpinServedMore,
            6 => SwitchReason::Probe,
            _ => SwitchReason::Start,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyConfig {
    /// How often the regime is reconsidered.
    pub window: Duration,
    /// How long an idle reactor spins, in `Spin`, before it sleeps.
    pub spin_budget: Duration,
    /// The share of a window (parts per million) another thread may hold
    /// the reactor's core, or some thread may wait for a CPU, while the
    /// reactor spins before spinning counts as contended.
    pub off_cpu_ppm_max: u32,
    pub pressure_ppm_max: u32,
    /// The CPU pressure below which a core counts as free for a spinner.
    pub pressure_ppm_free: u32,
    /// The shortest and longest hold of `Sleep` after contention.
    pub hold_min: Duration,
    pub hold_max: Duration,
    /// CPUs the daemon may run on.
    pub cpus: u32,
}

impl PolicyConfig {
    pub fn new(spin_budget: Duration, cpus: u32) -> Self {
        Self {
            window: Duration::from_millis(10),
            spin_budget,
            off_cpu_ppm_max: 100_000,
            pressure_ppm_max: 100_000,
            pressure_ppm_free: 20_000,
            hold_min: Duration::from_millis(50),
            hold_max: Duration::from_secs(2),
            cpus: cpus.max(1),
        }
    }
}

/// A sample of the reactor thread's CPU use and the machine's run queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuSample {
    /// The reactor thread's CPU time so far.
    pub thread_cpu: Duration,
    /// Threads running or runnable on the machine, this one included;
    /// None when unknown.
    pub runnable: Option<u32>,
    /// Time so far that some thread on the machine waited for a CPU (PSI
    /// "some" total); None when unknown.
    pub stalled: Option<Duration>,
    /// Requests the reactor has served so far (its frontends count them).
    pub served: u64,
}

/// What the last window showed: for stats and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowReport {
    pub off_cpu_ppm: u32,
    /// The share of the window (ppm) that some thread waited for a CPU;
    /// None when unknown.
    pub pressure_ppm: Option<u32>,
    /// Runnable threads besides the reactor; None when unknown.
    pub others_runnable: Option<u32>,
    pub spin_hits: u32,
    pub spin_misses: u32,
    pub sleeps: u32,
    pub quick_wakes: u32,
    /// Requests served in the window.
    pub served: u32,
}

/// Requests served over a span of time: a rate that keeps its weight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    pub requests: u64,
    pub elapsed: Duration,
}

impl Served {
    fn add(self, requests: u64, elapsed: Duration) -> Self {
        Self { requests: self.requests.saturating_add(requests), elapsed: self.elapsed.saturating_add(elapsed) }
    }

    /// Requests per second; zero over no time.
    pub fn per_second(&self) -> u64 {
        let nanos = self.elapsed.as_nanos();
        if nanos == 0 {
            return 0;
        }
        u64::try_from(u128::from(self.requests) * 1_000_000_000 / nanos).unwrap_or(u64::MAX)
    }

    /// Whether this rate beats `other` by more than `margin_ppm`, both
    /// having served enough requests to say.
    fn beats(&self, other: &Served, margin_ppm: u32) -> bool {
        if self.requests < SERVED_TO_COMPARE_MIN || other.requests < SERVED_TO_COMPARE_MIN {
            return false;
        }
        // self.requests / self.elapsed > other.requests / other.elapsed * (1 + margin)
        let lhs = u128::from(self.requests) * other.elapsed.as_nanos() * 1_000_000;
        let rhs = u128::from(other.requests) * self.elapsed.as_nanos() * u128::from(1_000_000 + margin_ppm);
        lhs > rhs
    }
}

/// The last comparison of spinning against sleeping, for stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Comparison {
    pub spinning: Served,
    pub asleep: Served,
    /// Whether spinning won, and the reactor went back to `Spin`.
    pub spin_won: bool,
}

/// Idle spells and sleeps seen within the current window.
#[derive(Clone, Copy, Debug, Default)]
struct WindowCounts {
    slept: Duration,
    spin_hits: u32,
    spin_misses: u32,
    sleeps: u32,
    quick_wakes: u32,
}

/// Windows in a row that must show a free core before `Sleep` gives way
/// to `Spin`: one window can be a lull.
const FREE_WINDOWS_TO_SPIN: u32 = 2;
/// Sleeps in a window below which the window says nothing of whether
/// spinning would catch work.
const SLEEPS_TO_JUDGE_MIN: u32 = 8;
/// Spin misses in a window below which they are not a pattern.
const SPIN_MISSES_TO_JUDGE_MIN: u32 = 4;
/// Spinning that stays uncontended this long resets the back-off.
const CALM_SPIN_RESETS_BACKOFF: Duration = Duration::from_secs(1);
/// Windows on each side of a comparison: a probe spins this long, and
/// the hold's last windows as long are its other side.
const RATE_WINDOWS: usize = 4;
/// Requests each side of a comparison must have served for it to count.
const SERVED_TO_COMPARE_MIN: u64 = 64;
/// Requests every window of a side must have served: a side with a lull
/// in it measured a load that paused or changed phase (a guest between
/// two programs), not the regime.
const SERVED_PER_WINDOW_MIN: u64 = 8;
/// How much more (ppm) spinning must serve than sleeping to win: more
/// than the noise of two spans of tens of milliseconds, so that a load
/// which does not wait on the reactor (the same rate either way) leaves it
/// asleep.
const SPIN_WIN_MARGIN_PPM: u32 = 100_000;
/// How much the hold grows after a probe that sleeping won: each probe
/// spins through contention, so a contended reactor must probe rarely
/// soon (50 ms, 200 ms, 800 ms, then the longest hold).
const LOST_PROBE_HOLD_GROWTH: u32 = 4;
/// The first trust after spinning wins, in shortest holds: each test of
/// it costs a hold in the worse regime, so trusts start well above it.
const TRUST_FIRST_HOLDS: u32 = 4;

pub struct IdlePolicy {
    config: PolicyConfig,
    regime: Regime,
    reason: SwitchReason,
    switches: u64,
    window_start: Instant,
    window_cpu_start: Option<Duration>,
    window_stalled_start: Option<Duration>,
    counts: WindowCounts,
    /// When the current idle spell began (an iteration found nothing).
    idle_since: Option<Instant>,
    hold_until: Instant,
    backoff: Duration,
    spin_since: Instant,
    free_windows: u32,
    report: WindowReport,
    /// The CPU pressure (ppm) of the window that ended the last spell of
    /// spinning, when pressure ended it.
    left_spin_at_pressure: Option<u32>,
    /// The CPU pressure over the windows of the current `Sleep`.
    sleep_pressure_sum: u64,
    sleep_pressure_windows: u32,
    /// The pressure the load makes without the reactor spinning, as last
    /// measured asleep: spinning is judged by what it adds to it.
    pressure_floor: u32,
    window_served_start: Option<u64>,
    /// Requests served in the last windows of the current regime (a ring,
    /// `recent_next` its next slot), and how many windows it has had.
    recent: [Served; RATE_WINDOWS],
    recent_next: usize,
    recent_windows: u32,
    /// While a probe spins: what the hold before it served.
    probe: Option<Served>,
    /// Until when contention does not end spinning, and how long the next
    /// trust lasts: spinning won the last comparison.
    trust_until: Instant,
    trust: Duration,
    comparison: Option<Comparison>,
}

impl IdlePolicy {
    pub fn new(config: PolicyConfig, now: Instant) -> Self {
        assert!(config.window > Duration::ZERO && config.hold_min <= config.hold_max);
        assert!(config.off_cpu_ppm_max <= 1_000_000 && config.cpus > 0);
        assert!(config.pressure_ppm_free <= config.pressure_ppm_max && config.pressure_ppm_max <= 1_000_000);
        Self {
            config,
            regime: Regime::Spin,
            reason: SwitchReason::Start,
            switches: 0,
            window_start: now,
            window_cpu_start: None,
            window_stalled_start: None,
            counts: WindowCounts::default(),
            idle_since: None,
            hold_until: now,
            backoff: config.hold_min,
            spin_since: now,
            free_windows: 0,
            report: WindowReport::default(),
            left_spin_at_pressure: None,
            sleep_pressure_sum: 0,
            sleep_pressure_windows: 0,
            pressure_floor: 0,
            window_served_start: None,
            recent: [Served::default(); RATE_WINDOWS],
            recent_next: 0,
            recent_windows: 0,
            probe: None,
            trust_until: now,
            trust: config.hold_min * TRUST_FIRST_HOLDS,
            comparison: None,
        }
    }

    pub fn regime(&self) -> Regime {
        self.regime
    }

    pub fn reason(&self) -> SwitchReason {
        self.reason
    }

    pub fn switches(&self) -> u64 {
        self.switches
    }

    pub fn last_window(&self) -> WindowReport {
        self.report
    }

    /// The last comparison of spinning against sleeping, if any.
    pub fn last_comparison(&self) -> Option<Comparison> {
        self.comparison
    }

    /// After an iteration at `now` that found work (`busy`) or not: what
    /// the reactor does next if it found none.
    pub fn after_tick(&mut self, now: Instant, busy: bool) -> IdleAction {
        if busy {
            if self.idle_since.take().is_some() {
                self.counts.spin_hits = self.counts.spin_hits.saturating_add(1);
            }
            return IdleAction::Spin;
        }
        if self.regime == Regime::Sleep {
            return IdleAction::Sleep;
        }
        let since = *self.idle_since.get_or_insert(now);
        if now.saturating_duration_since(since) < self.config.spin_budget {
            return IdleAction::Spin;
        }
        IdleAction::Sleep
    }

    /// The reactor slept for `slept` (or tried to: `slept` is zero when
    /// it found work before waiting).
    pub fn after_sleep(&mut self, slept: Duration) {
        if slept.is_zero() {
            return;
        }
        if self.idle_since.take().is_some() && self.regime == Regime::Spin {
            self.counts.spin_misses = self.counts.spin_misses.saturating_add(1);
        }
        self.counts.slept = self.counts.slept.saturating_add(slept);
        self.counts.sleeps = self.counts.sleeps.saturating_add(1);
        if slept < self.config.spin_budget {
            self.counts.quick_wakes = self.counts.quick_wakes.saturating_add(1);
        }
    }

    /// Whether a window has passed and wants a [`CpuSample`].
    pub fn window_due(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.window_start) >= self.config.window
    }

    /// Close the window at `now` with `sample`, and maybe change regime.
    /// Returns the new regime when it changed.
    pub fn end_window(&mut self, now: Instant, sample: CpuSample) -> Option<Regime> {
        let elapsed = now.saturating_duration_since(self.window_start);
        let counts = std::mem::take(&mut self.counts);
        let off_cpu_ppm = match self.window_cpu_start.replace(sample.thread_cpu) {
            Some(cpu_start) => off_cpu_ppm(elapsed, sample.thread_cpu.saturating_sub(cpu_start), counts.slept),
            None => 0,
        };
        let pressure_ppm = match (self.window_stalled_start, sample.stalled) {
            (Some(start), Some(stalled)) => Some(share_ppm(stalled.saturating_sub(start), elapsed)),
            _ => None,
        };
        self.window_stalled_start = sample.stalled;
        self.window_start = now;
        // The first window has no count to start from: it says nothing.
        let served = match self.window_served_start.replace(sample.served) {
            Some(start) => {
                let served = sample.served.wrapping_sub(start);
                self.record_served(served, elapsed);
                served
            }
            None => 0,
        };
        self.report = WindowReport {
            off_cpu_ppm,
            pressure_ppm,
            others_runnable: sample.runnable.map(|r| r.saturating_sub(1)),
            spin_hits: counts.spin_hits,
            spin_misses: counts.spin_misses,
            sleeps: counts.sleeps,
            quick_wakes: counts.quick_wakes,
            served: u32::try_from(served).unwrap_or(u32::MAX),
        };
        let next = match self.regime {
            Regime::Spin => self.judge_spin(now),
            Regime::Sleep => self.judge_sleep(now),
        };
        let (regime, reason) = next?;
        self.reason = reason;
        if regime == self.regime {
            // A probe that spinning won: it spins on, for a new reason.
            return None;
        }
        self.regime = regime;
        self.switches += 1;
        self.idle_since = None;
        self.free_windows = 0;
        (self.recent, self.recent_next, self.recent_windows) = ([Served::default(); RATE_WINDOWS], 0, 0);
        match regime {
            Regime::Spin => self.spin_since = now,
            Regime::Sleep => (self.sleep_pressure_sum, self.sleep_pressure_windows) = (0, 0),
        }
        Some(regime)
    }

    /// Count a window's requests towards the rate of the current regime.
    fn record_served(&mut self, served: u64, elapsed: Duration) {
        self.recent[self.recent_next] = Served { requests: served, elapsed };
        self.recent_next = (self.recent_next + 1) % RATE_WINDOWS;
        self.recent_windows = self.recent_windows.saturating_add(1);
    }

    /// What the last windows of the current regime served.
    fn recent_served(&self) -> Served {
        self.recent.iter().fold(Served::default(), |sum, w| sum.add(w.requests, w.elapsed))
    }

    /// Whether each of the last windows of the current regime had work.
    fn recent_steady(&self) -> bool {
        self.recent_windows >= RATE_WINDOWS as u32 && self.recent.iter().all(|w| w.requests >= SERVED_PER_WINDOW_MIN)
    }

    /// At the end of a probe: whether spinning served clearly more than
    /// the hold asleep before it. Starts a trust when it did.
    fn judge_probe(&mut self, now: Instant, asleep: Served) -> bool {
        let spinning = self.recent_served();
        // A lull in the probe: the load paused, and spinning through it
        // is what sleeping is for.
        let spin_won = self.recent_steady() && spinning.beats(&asleep, SPIN_WIN_MARGIN_PPM);
        self.comparison = Some(Comparison { spinning, asleep, spin_won });
        if spin_won {
            self.trust_until = now + self.trust;
            self.trust = (self.trust * 2).min(self.config.hold_max);
        } else {
            self.trust = self.config.hold_min * TRUST_FIRST_HOLDS;
        }
        spin_won
    }

    /// The end of contention's hold: whether to probe spinning. Only with
    /// enough work in the hold's last windows to compare.
    fn probe_due(&self) -> bool {
        self.reason == SwitchReason::Contended
            && self.recent_steady()
            && self.recent_served().requests >= SERVED_TO_COMPARE_MIN
    }

    fn judge_spin(&mut self, now: Instant) -> Option<(Regime, SwitchReason)> {
        if let Some(asleep) = self.probe {
            if self.recent_windows < RATE_WINDOWS as u32 {
                return None;
            }
            self.probe = None;
            if self.judge_probe(now, asleep) {
                return Some((Regime::Spin, SwitchReason::SpinServedMore));
            }
            // Sleeping served as much: the probe's contention was a cost,
            // and a load that contends stays so for a while. The hold grows
            // fourfold, to its longest within three probes.
            let r = self.report;
            let off_cpu = r.off_cpu_ppm > self.config.off_cpu_ppm_max;
            self.left_spin_at_pressure = if off_cpu { None } else { r.pressure_ppm };
            self.backoff = (self.backoff * LOST_PROBE_HOLD_GROWTH).clamp(self.config.hold_min, self.config.hold_max);
            self.hold_until = now + self.backoff;
            return Some((Regime::Sleep, SwitchReason::Contended));
        }
        let r = self.report;
        // What spinning adds to the load's own pressure is what counts.
        let allowed = self.config.pressure_ppm_max.max(self.pressure_floor + self.config.pressure_ppm_max / 2);
        let pressed = r.pressure_ppm.is_some_and(|ppm| ppm > allowed);
        let off_cpu = r.off_cpu_ppm > self.config.off_cpu_ppm_max;
        // Spinning won the last comparison: contention is the price of
        // serving more, paid until the trust runs out.
        let trusted = now < self.trust_until;
        if (off_cpu || pressed) && !trusted {
            self.left_spin_at_pressure = if off_cpu { None } else { r.pressure_ppm };
            let calm = now.saturating_duration_since(self.spin_since);
            let spin_won_last = self.comparison.is_some_and(|c| c.spin_won);
            self.backoff = if calm >= CALM_SPIN_RESETS_BACKOFF || spin_won_last {
                // A fresh look, or a probe of sleeping between trusts.
                self.config.hold_min
            } else {
                (self.backoff * 2).clamp(self.config.hold_min, self.config.hold_max)
            };
            self.hold_until = now + self.backoff;
            return Some((Regime::Sleep, SwitchReason::Contended));
        }
        if r.spin_misses >= SPIN_MISSES_TO_JUDGE_MIN && r.spin_misses > r.spin_hits {
            self.hold_until = now + self.config.hold_min;
            return Some((Regime::Sleep, SwitchReason::SpinsMissed));
        }
        None
    }

    fn judge_sleep(&mut self, now: Instant) -> Option<(Regime, SwitchReason)> {
        let r = self.report;
        // Unknown run queue: the reactor's own time off the CPU decides.
        let spare_core = match r.others_runnable {
            Some(others) => others < self.config.cpus,
            None => true,
        };
        let calm = match r.pressure_ppm {
            Some(ppm) => ppm <= self.config.pressure_ppm_free,
            None => true,
        };
        let own_core_free = r.off_cpu_ppm <= self.config.off_cpu_ppm_max;
        let core_free = spare_core && calm && own_core_free;
        let asleep_pressure = self.asleep_pressure(r.pressure_ppm);
        // Asleep, the load still makes four fifths of the pressure seen
        // while spinning: the spinning did not make it.
        let not_ours = match (self.left_spin_at_pressure, asleep_pressure) {
            (Some(spinning), Some(asleep)) => own_core_free && u64::from(asleep) * 5 >= u64::from(spinning) * 4,
            _ => false,
        };
        let spin_would_catch = r.sleeps >= SLEEPS_TO_JUDGE_MIN && r.quick_wakes * 2 >= r.sleeps;
        let worth_spinning = (core_free || not_ours) && spin_would_catch;
        self.free_windows = if worth_spinning { self.free_windows + 1 } else { 0 };
        if now < self.hold_until {
            return None;
        }
        if self.free_windows < FREE_WINDOWS_TO_SPIN {
            if !self.probe_due() {
                return None;
            }
            self.probe = Some(self.recent_served());
            return Some((Regime::Spin, SwitchReason::Probe));
        }
        self.pressure_floor = asleep_pressure.unwrap_or(0);
        let reason = if core_free { SwitchReason::CoreFree } else { SwitchReason::PressureNotOurs };
        Some((Regime::Spin, reason))
    }

    /// Fold this window's pressure into the current sleep's mean.
    fn asleep_pressure(&mut self, window: Option<u32>) -> Option<u32> {
        let ppm = window?;
        self.sleep_pressure_sum = self.sleep_pressure_sum.saturating_add(u64::from(ppm));
        self.sleep_pressure_windows = self.sleep_pressure_windows.saturating_add(1);
        let mean = self.sleep_pressure_sum / u64::from(self.sleep_pressure_windows);
        Some(u32::try_from(mean).expect("a mean of ppm values is a ppm value"))
    }
}

/// The share of `elapsed` (ppm) that the thread spent neither on a CPU
/// nor asleep: waiting for a core another thread held.
fn off_cpu_ppm(elapsed: Duration, cpu: Duration, slept: Duration) -> u32 {
    if elapsed.is_zero() {
        return 0;
    }
    share_ppm(elapsed.saturating_sub(cpu).saturating_sub(slept), elapsed)
}

/// `part` of `whole` in parts per million, at most a million.
fn share_ppm(part: Duration, whole: Duration) -> u32 {
    if whole.is_zero() {
        return 0;
    }
    let ppm = part.as_nanos().saturating_mul(1_000_000) / whole.as_nanos();
    ppm.min(1_000_000) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_cpu_share_excludes_sleep_and_cpu() {
        let ms = Duration::from_millis;
        assert_eq!(off_cpu_ppm(ms(10), ms(5), ms(5)), 0);
        assert_eq!(off_cpu_ppm(ms(10), ms(5), ms(0)), 500_000);
        assert_eq!(off_cpu_ppm(ms(10), ms(12), ms(0)), 0, "CPU time past the window is clamped");
        assert_eq!(off_cpu_ppm(Duration::ZERO, ms(1), ms(1)), 0);
    }

    /// Close a window of the policy's length at `*now`: `requests` served
    /// in it, and the reactor off the CPU half of it (contended).
    fn contended_window(p: &mut IdlePolicy, now: &mut Instant, cpu: &mut Duration, served: &mut u64, requests: u64) {
        let window = Duration::from_millis(10);
        *now += window;
        *cpu += window / 2;
        *served += requests;
        p.end_window(*now, CpuSample { thread_cpu: *cpu, runnable: Some(3), stalled: None, served: *served });
    }

    /// Contention, a hold asleep at 100 requests a window, then a probe
    /// whose four windows served `probe`: the regime it ends in.
    fn probe_outcome(probe: [u64; 4]) -> (Regime, Option<Comparison>) {
        let start = Instant::now();
        let mut p = IdlePolicy::new(PolicyConfig::new(Duration::from_millis(1), 2), start);
        let (mut now, mut cpu, mut served) = (start, Duration::ZERO, 0);
        contended_window(&mut p, &mut now, &mut cpu, &mut served, 100);
        contended_window(&mut p, &mut now, &mut cpu, &mut served, 100);
        assert_eq!((p.regime(), p.reason()), (Regime::Sleep, SwitchReason::Contended));
        while p.regime() == Regime::Sleep {
            assert!(now - start < Duration::from_secs(1), "no probe began");
            contended_window(&mut p, &mut now, &mut cpu, &mut served, 100);
        }
        assert_eq!(p.reason(), SwitchReason::Probe);
        for requests in probe {
            contended_window(&mut p, &mut now, &mut cpu, &mut served, requests);
        }
        (p.regime(), p.last_comparison())
    }

    #[test]
    fn a_probe_wins_on_a_steady_load_and_not_across_a_lull() {
        let (regime, comparison) = probe_outcome([300, 300, 300, 300]);
        assert_eq!(regime, Regime::Spin);
        assert!(comparison.is_some_and(|c| c.spin_won), "{comparison:?}");
        // As many requests, all in three windows: the load paused.
        let (regime, comparison) = probe_outcome([400, 400, 400, 0]);
        assert_eq!(regime, Regime::Sleep);
        assert!(comparison.is_some_and(|c| !c.spin_won), "{comparison:?}");
        // Too little gain to count.
        let (regime, _) = probe_outcome([105, 105, 105, 105]);
        assert_eq!(regime, Regime::Sleep);
    }

    #[test]
    fn reason_codes_round_trip() {
        for reason in [
            SwitchReason::Start,
            SwitchReason::Contended,
            SwitchReason::SpinsMissed,
            SwitchReason::CoreFree,
            SwitchReason::PressureNotOurs,
            SwitchReason::SpinServedMore,
            SwitchReason::Probe,
        ] {
            assert_eq!(SwitchReason::from_code(reason.code()), reason);
        }
    }
}
