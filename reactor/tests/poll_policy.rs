//! The adaptive idle policy in virtual time: a simulated reactor thread
//! whose clock, CPU time, run queue and work arrivals are all inputs. A
//! reactor that spins on a core another thread also wants runs at half
//! speed, which is what the policy must notice. Work either arrives on a
//! schedule of its own (an open load) or one request at a time from a
//! driver that waits for each (a closed load, as a vCPU's), where what the
//! reactor does changes how fast the next one comes.

use std::time::{Duration, Instant};

use keelfs_reactor::policy::{CpuSample, IdleAction, IdlePolicy, PolicyConfig, Regime, SwitchReason};

const US: Duration = Duration::from_micros(1);
const SPIN_BUDGET: Duration = Duration::from_millis(1);
const CPUS: u32 = 2;

/// Where the work comes from.
#[derive(Clone, Copy, Debug)]
enum Driver {
    /// A request every `Machine::gap`, whatever the reactor does.
    Open,
    /// One request at a time from a thread on the reactor's core (a
    /// running vCPU): the next comes `Machine::gap` of the thread's own
    /// work after the last was served. A sleeping reactor costs it `kick`
    /// to notify; when `gap_shares_core`, that work runs at half speed
    /// beside a reactor that spins through it (a vCPU that computes),
    /// and otherwise the thread only polls for the completion.
    Closed { kick: Duration, gap_shares_core: bool },
}

/// The machine around the simulated reactor.
#[derive(Clone, Copy)]
struct Machine {
    /// Work arrives this often.
    gap: Duration,
    driver: Driver,
    /// Another always-runnable thread shares the reactor's core. A thread
    /// just woken runs first (the scheduler owes it time), but one that
    /// keeps running past a slice gets half the core.
    hog_on_core: bool,
    /// Runnable threads besides the reactor; None: no run queue signal.
    others_runnable: Option<u32>,
    /// Whether CPU pressure (PSI) is known.
    psi: bool,
    /// The share of the reactor's running time that some other thread
    /// (QEMU's thread that injects interrupts, a kernel worker) waits for
    /// the core the reactor holds. A hog on its core always waits.
    waiter_share: f64,
    /// The share of all time that the load's own threads wait for a CPU
    /// (more of them runnable than CPUs), whatever the reactor does.
    load_pressure: f64,
}

/// What a run of the simulation saw.
#[derive(Debug, Default)]
struct Outcome {
    /// Wall time spent spinning without work.
    spun: Duration,
    /// Wall time spent in the `Spin` regime.
    in_spin: Duration,
    elapsed: Duration,
    switches: u64,
    requests: u64,
    /// Sum of waits from a request's arrival to the iteration serving it.
    wait: Duration,
}

struct Sim {
    policy: IdlePolicy,
    now: Instant,
    cpu: Duration,
    next_arrival: Instant,
    /// Time that some thread waited for a CPU: the PSI "some" total.
    stalled: Duration,
    /// When the reactor last woke: it has run without a break since.
    running_since: Instant,
    /// Requests served since the start, as the frontends count them.
    requests: u64,
}

/// The scheduler's slice (EEVDF's base slice): a thread that runs longer
/// than this without sleeping shares its core with a runnable neighbour.
const SLICE: Duration = Duration::from_micros(750);

impl Sim {
    fn new() -> Self {
        Self::with_config(PolicyConfig::new(SPIN_BUDGET, CPUS))
    }

    fn with_config(config: PolicyConfig) -> Self {
        let now = Instant::now();
        let policy = IdlePolicy::new(config, now);
        Self {
            policy,
            now,
            cpu: Duration::ZERO,
            next_arrival: now,
            stalled: Duration::ZERO,
            running_since: now,
            requests: 0,
        }
    }

    /// A reactor that always spins: contention never counts.
    fn always_spinning() -> Self {
        let mut config = PolicyConfig::new(SPIN_BUDGET, CPUS);
        (config.off_cpu_ppm_max, config.pressure_ppm_max) = (1_000_000, 1_000_000);
        Self::with_config(config)
    }

    /// A reactor that sleeps whenever it is idle (as `poll_mode =
    /// "interrupt"`): a spin budget of nothing.
    fn always_sleeping() -> Self {
        Self::with_config(PolicyConfig::new(Duration::ZERO, CPUS))
    }

    /// When the request after one served at `now` arrives.
    fn next_after_serving(&self, machine: &Machine, regime: Regime) -> Instant {
        match machine.driver {
            Driver::Open => self.next_arrival + machine.gap,
            Driver::Closed { kick, gap_shares_core } => {
                let spinning = regime == Regime::Spin;
                let own_work = if gap_shares_core && spinning { machine.gap * 2 } else { machine.gap };
                let notify = if spinning { Duration::ZERO } else { kick };
                self.now + own_work + notify
            }
        }
    }

    /// Run the reactor loop for `span` of virtual time on `machine`.
    fn run(&mut self, machine: Machine, span: Duration) -> Outcome {
        let mut out = Outcome::default();
        let (start, switches_before) = (self.now, self.policy.switches());
        while self.now - start < span {
            let iteration_start = self.now;
            let regime = self.policy.regime();
            let busy = self.now >= self.next_arrival;
            if busy {
                out.requests += 1;
                self.requests += 1;
                out.wait += self.now - self.next_arrival;
            }
            let work = if busy { 5 * US } else { 2 * US };
            self.cpu += work;
            let shared = machine.hog_on_core && self.now - self.running_since > SLICE;
            let wall = if shared { work * 2 } else { work };
            let waiting = if machine.hog_on_core { 1.0 } else { machine.waiter_share };
            let pressure = machine.load_pressure + waiting * (1.0 - machine.load_pressure);
            self.stalled += wall.mul_f64(pressure);
            self.now += wall;
            if busy {
                self.next_arrival = self.next_after_serving(&machine, regime);
            }
            let action = self.policy.after_tick(self.now, busy);
            if !busy && action == IdleAction::Spin {
                out.spun += self.now - iteration_start;
            }
            if !busy && action == IdleAction::Sleep {
                // A woken thread waits longer for a core a hog holds.
                let latency = if machine.hog_on_core { 30 * US } else { 5 * US };
                let wake = self.next_arrival.max(self.now) + latency;
                self.policy.after_sleep(wake - self.now);
                self.stalled += (wake - self.now).mul_f64(machine.load_pressure);
                self.now = wake;
                self.running_since = wake;
            }
            if regime == Regime::Spin {
                out.in_spin += self.now - iteration_start;
            }
            if self.policy.window_due(self.now) {
                let runnable = machine.others_runnable.map(|others| others + 1);
                let stalled = machine.psi.then_some(self.stalled);
                let served = self.requests;
                self.policy.end_window(self.now, CpuSample { thread_cpu: self.cpu, runnable, stalled, served });
            }
        }
        out.elapsed = self.now - start;
        out.switches = self.policy.switches() - switches_before;
        out
    }
}

fn share(part: Duration, whole: Duration) -> f64 {
    part.as_secs_f64() / whole.as_secs_f64()
}

/// The policy kept the reactor asleep but for its probes, which found
/// sleeping to serve as much, and spent at most `max_share` of the run in
/// `Spin`.
fn assert_asleep_but_for_probes(sim: &Sim, out: &Outcome, max_share: f64) {
    let reason = sim.policy.reason();
    assert!(
        matches!(
            (sim.policy.regime(), reason),
            (Regime::Sleep, SwitchReason::Contended) | (Regime::Spin, SwitchReason::Probe)
        ),
        "{reason:?} {out:?}"
    );
    let comparison = sim.policy.last_comparison().expect("a probe compared the regimes");
    assert!(!comparison.spin_won, "{comparison:?}");
    assert!(share(out.in_spin, out.elapsed) <= max_share, "{out:?}");
}

const DEDICATED: Machine = Machine {
    gap: Duration::from_micros(20),
    driver: Driver::Open,
    hog_on_core: false,
    others_runnable: Some(1),
    psi: true,
    waiter_share: 0.0,
    load_pressure: 0.0,
};

#[test]
fn a_core_of_its_own_with_steady_work_keeps_spinning() {
    let mut sim = Sim::new();
    let out = sim.run(DEDICATED, Duration::from_secs(1));
    assert_eq!(out.switches, 0, "{out:?}");
    assert_eq!(sim.policy.regime(), Regime::Spin);
    assert!(out.requests > 40_000, "{out:?}");
    // Spinning catches each request within an idle iteration.
    assert!(out.wait / out.requests as u32 <= 2 * US, "{out:?}");
}

#[test]
fn a_hog_on_the_core_sends_the_reactor_to_sleep_and_back_off_keeps_it_there() {
    let mut sim = Sim::new();
    let hog = Machine { hog_on_core: true, others_runnable: Some(2), ..DEDICATED };
    let out = sim.run(hog, Duration::from_secs(2));
    // It left Spin within two windows. Work came on its own schedule, so
    // each probe found sleeping to serve as much, and the holds between
    // probes grow fourfold: 50 ms, 200 ms, 800 ms, then 2 s.
    assert_asleep_but_for_probes(&sim, &out, 0.10);
    assert!(out.switches <= 10, "{out:?}");
    let later = sim.run(hog, Duration::from_secs(8));
    assert_asleep_but_for_probes(&sim, &later, 0.03);
    assert!(later.switches <= 8, "{later:?}");
    assert!(share(later.spun, later.elapsed) < 0.02, "{later:?}");
}

#[test]
fn without_a_run_queue_signal_contention_is_tried_ever_less_often() {
    let mut sim = Sim::new();
    let hog = Machine { hog_on_core: true, others_runnable: None, psi: false, ..DEDICATED };
    let first = sim.run(hog, Duration::from_secs(1));
    let later = sim.run(hog, Duration::from_secs(4));
    // Each return to Spin is found contended within a window, and the hold
    // doubles up to two seconds: a handful of tries, not one per window.
    assert!(first.switches >= 2, "it tried spinning again: {first:?}");
    assert!(later.switches <= 6, "{later:?}");
    assert!(share(later.in_spin, later.elapsed) < 0.02, "{later:?}");
    assert!(share(first.in_spin + later.in_spin, first.elapsed + later.elapsed) < 0.05, "{first:?} {later:?}");
}

#[test]
fn sparse_work_is_not_worth_a_spin() {
    let mut sim = Sim::new();
    let sparse = Machine { gap: Duration::from_millis(3), ..DEDICATED };
    let out = sim.run(sparse, Duration::from_secs(1));
    assert_eq!(sim.policy.regime(), Regime::Sleep, "{out:?}");
    assert_eq!(sim.policy.reason(), SwitchReason::SpinsMissed);
    // Every sleep is long, so it never judges spinning worth it again.
    assert_eq!(out.switches, 1, "{out:?}");
    assert!(share(out.spun, out.elapsed) < 0.05, "{out:?}");
}

#[test]
fn busy_vcpus_keep_it_asleep_and_their_halt_lets_it_spin_again() {
    let mut sim = Sim::new();
    let busy_vcpus = Machine { others_runnable: Some(CPUS), hog_on_core: true, ..DEDICATED };
    let contended = sim.run(busy_vcpus, Duration::from_millis(300));
    assert_asleep_but_for_probes(&sim, &contended, 0.25);
    // The vCPUs halt while their requests are in flight: the core is free
    // and work keeps arriving within the spin budget.
    let halted = sim.run(DEDICATED, Duration::from_secs(1));
    assert_eq!(sim.policy.regime(), Regime::Spin, "{halted:?}");
    assert_eq!(sim.policy.reason(), SwitchReason::CoreFree);
    assert!(halted.switches <= 3, "{halted:?}");
    // Back once the hold that the lost probe began has passed (contention
    // at 20 ms, a hold of 100 ms, the probe, then a hold of 400 ms to about
    // 560 ms, 260 ms after the halt) and two windows. Holds that grow are
    // the price of probing rarely: after longer contention this waits up
    // to 2 s.
    assert!(halted.in_spin >= halted.elapsed - Duration::from_millis(300), "{halted:?}");
}

#[test]
fn an_idle_reactor_spends_almost_nothing_spinning() {
    let mut sim = Sim::new();
    let idle = Machine { gap: Duration::from_secs(3_600), ..DEDICATED };
    // The first arrival is due at once; afterwards nothing comes.
    let out = sim.run(idle, Duration::from_secs(2));
    assert!(out.spun <= 2 * SPIN_BUDGET, "{out:?}");
    assert_eq!(out.requests, 1);
}

#[test]
fn a_thread_that_waits_for_the_spinners_core_sends_it_to_sleep() {
    // A TCG guest: one vCPU runs, so the run queue shows a spare core and
    // no thread takes the reactor's own core, but QEMU's thread that
    // injects completions waits for a CPU while the reactor spins.
    let mut sim = Sim::new();
    let tcg = Machine { waiter_share: 0.3, ..DEDICATED };
    let out = sim.run(tcg, Duration::from_secs(5));
    assert!(sim.policy.last_window().pressure_ppm.is_some());
    // Asleep between requests, the reactor still holds the core while it
    // serves them, and the waiter's pressure keeps it from spinning again
    // but for its probes, which find that spinning serves no more.
    assert_asleep_but_for_probes(&sim, &out, 0.06);
    assert!(out.switches <= 12, "{out:?}");
}

#[test]
fn without_psi_the_same_waiter_goes_unseen() {
    // The signal the previous test relies on, shown to be the one that
    // decides: without PSI the policy cannot see the waiting thread.
    let mut sim = Sim::new();
    let blind = Machine { waiter_share: 0.3, psi: false, ..DEDICATED };
    let out = sim.run(blind, Duration::from_secs(1));
    assert_eq!(sim.policy.regime(), Regime::Spin, "{out:?}");
    assert_eq!(out.switches, 0, "{out:?}");
}

#[test]
fn pressure_the_load_makes_itself_does_not_stop_the_spinning() {
    // More load threads than CPUs: they wait for a CPU whether or not the
    // reactor spins, and spinning adds little to it. The policy leaves Spin
    // on the pressure, sees it stay while asleep, and spins again.
    let mut sim = Sim::new();
    let oversubscribed = Machine { others_runnable: Some(3), load_pressure: 0.5, waiter_share: 0.05, ..DEDICATED };
    let out = sim.run(oversubscribed, Duration::from_secs(2));
    assert_eq!(sim.policy.regime(), Regime::Spin, "{out:?}");
    assert_eq!(sim.policy.reason(), SwitchReason::PressureNotOurs);
    assert_eq!(out.switches, 2, "{out:?}");
    // Back after the first hold (100 ms) and two windows.
    assert!(out.in_spin >= out.elapsed - Duration::from_millis(140), "{out:?}");
    // Were the spinning to double the pressure, it would be its own.
    let mut sim = Sim::new();
    let doubled = Machine { waiter_share: 0.5, load_pressure: 0.25, ..oversubscribed };
    let out = sim.run(doubled, Duration::from_secs(2));
    assert_asleep_but_for_probes(&sim, &out, 0.10);
}

/// A busy driver on the reactor's core, one request at a time: the
/// thread that holds the core the reactor spins on only polls for the
/// completion, so the contention costs the load nothing.
const POLLING_VCPU: Machine = Machine {
    driver: Driver::Closed { kick: Duration::from_micros(3), gap_shares_core: false },
    hog_on_core: true,
    others_runnable: Some(2),
    ..DEDICATED
};

#[test]
fn a_driver_that_waits_on_the_reactor_keeps_it_spinning_though_contended() {
    let span = Duration::from_secs(5);
    let mut sim = Sim::new();
    let out = sim.run(POLLING_VCPU, span);
    assert_eq!(sim.policy.regime(), Regime::Spin, "{out:?}");
    assert_eq!(sim.policy.reason(), SwitchReason::SpinServedMore);
    let comparison = sim.policy.last_comparison().expect("compared");
    assert!(comparison.spin_won, "{comparison:?}");
    assert!(comparison.spinning.per_second() > comparison.asleep.per_second(), "{comparison:?}");
    // Within 5% of a reactor that always spins, and well above one that
    // always sleeps: the probes of sleeping are short and ever rarer.
    let spinning = Sim::always_spinning().run(POLLING_VCPU, span);
    let sleeping = Sim::always_sleeping().run(POLLING_VCPU, span);
    assert!(out.requests * 100 >= spinning.requests * 95, "{out:?} against {spinning:?}");
    assert!(spinning.requests * 100 >= sleeping.requests * 130, "{spinning:?} against {sleeping:?}");
    assert!(out.switches <= 16, "{out:?}");
}

/// A vCPU that computes between its requests: beside a spinning reactor
/// it runs at half speed, and asks for less.
const COMPUTING_VCPU: Machine = Machine {
    gap: Duration::from_micros(100),
    driver: Driver::Closed { kick: Duration::from_micros(3), gap_shares_core: true },
    ..POLLING_VCPU
};

#[test]
fn a_driver_whose_own_work_the_spinning_slows_keeps_it_asleep() {
    let span = Duration::from_secs(2);
    let mut sim = Sim::new();
    let out = sim.run(COMPUTING_VCPU, span);
    assert_asleep_but_for_probes(&sim, &out, 0.10);
    let sleeping = Sim::always_sleeping().run(COMPUTING_VCPU, span);
    let spinning = Sim::always_spinning().run(COMPUTING_VCPU, span);
    assert!(out.requests * 100 >= sleeping.requests * 95, "{out:?} against {sleeping:?}");
    assert!(sleeping.requests * 100 >= spinning.requests * 130, "{sleeping:?} against {spinning:?}");
}

#[test]
fn a_load_that_stops_waiting_on_the_reactor_loses_its_spinning_at_the_next_probe() {
    let mut sim = Sim::new();
    let polling = sim.run(POLLING_VCPU, Duration::from_secs(2));
    assert_eq!(sim.policy.reason(), SwitchReason::SpinServedMore, "{polling:?}");
    // The vCPU starts computing between requests: the trust runs out, a
    // probe asleep serves more than the spinning before it did, and the
    // reactor stays asleep.
    let span = Duration::from_secs(10);
    let computing = sim.run(COMPUTING_VCPU, span);
    assert_asleep_but_for_probes(&sim, &computing, 0.20);
    let comparison = sim.policy.last_comparison().expect("compared");
    assert!(comparison.asleep.per_second() > comparison.spinning.per_second(), "{comparison:?}");
    // What the trust cost: at most a tenth of an always-sleeping reactor.
    let sleeping = Sim::always_sleeping().run(COMPUTING_VCPU, span);
    assert!(computing.requests * 100 >= sleeping.requests * 90, "{computing:?} against {sleeping:?}");
}
