//! The adaptive idle policy in virtual time: a simulated reactor thread
//! whose clock, CPU time, run queue and work arrivals are all inputs. The
//! model is closed-loop: a reactor that spins on a core another thread
//! also wants runs at half speed, which is what the policy must notice.

use std::time::{Duration, Instant};

use keelfs_reactor::policy::{CpuSample, IdleAction, IdlePolicy, PolicyConfig, Regime, SwitchReason};

const US: Duration = Duration::from_micros(1);
const SPIN_BUDGET: Duration = Duration::from_millis(1);
const CPUS: u32 = 2;

/// The machine around the simulated reactor.
#[derive(Clone, Copy)]
struct Machine {
    /// Work arrives this often.
    gap: Duration,
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
}

/// The scheduler's slice (EEVDF's base slice): a thread that runs longer
/// than this without sleeping shares its core with a runnable neighbour.
const SLICE: Duration = Duration::from_micros(750);

impl Sim {
    fn new() -> Self {
        let now = Instant::now();
        let policy = IdlePolicy::new(PolicyConfig::new(SPIN_BUDGET, CPUS), now);
        Self { policy, now, cpu: Duration::ZERO, next_arrival: now, stalled: Duration::ZERO, running_since: now }
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
                out.wait += self.now - self.next_arrival;
                self.next_arrival = (self.next_arrival + machine.gap).max(self.now);
            }
            let work = if busy { 5 * US } else { 2 * US };
            self.cpu += work;
            let shared = machine.hog_on_core && self.now - self.running_since > SLICE;
            let wall = if shared { work * 2 } else { work };
            let waiting = if machine.hog_on_core { 1.0 } else { machine.waiter_share };
            let pressure = machine.load_pressure + waiting * (1.0 - machine.load_pressure);
            self.stalled += wall.mul_f64(pressure);
            self.now += wall;
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
                self.policy.end_window(self.now, CpuSample { thread_cpu: self.cpu, runnable, stalled });
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

const DEDICATED: Machine = Machine {
    gap: Duration::from_micros(20),
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
    assert_eq!(sim.policy.regime(), Regime::Sleep, "{out:?}");
    assert_eq!(sim.policy.reason(), SwitchReason::Contended);
    // It left Spin within two windows, and a busy run queue kept it out.
    assert_eq!(out.switches, 1, "{out:?}");
    assert!(out.in_spin <= Duration::from_millis(20), "{out:?}");
    assert!(share(out.spun, out.elapsed) < 0.01, "{out:?}");
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
    let contended = sim.run(busy_vcpus, Duration::from_secs(1));
    assert_eq!(sim.policy.regime(), Regime::Sleep, "{contended:?}");
    assert_eq!(contended.switches, 1, "{contended:?}");
    // The vCPUs halt while their requests are in flight: the core is free
    // and work keeps arriving within the spin budget.
    let halted = sim.run(DEDICATED, Duration::from_secs(1));
    assert_eq!(sim.policy.regime(), Regime::Spin, "{halted:?}");
    assert_eq!(sim.policy.reason(), SwitchReason::CoreFree);
    assert_eq!(halted.switches, 1, "{halted:?}");
    // Back within the hold (the first back-off: 100 ms) and two windows.
    assert!(halted.in_spin >= halted.elapsed - Duration::from_millis(130), "{halted:?}");
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
    assert_eq!(sim.policy.regime(), Regime::Sleep, "{out:?}");
    assert_eq!(sim.policy.reason(), SwitchReason::Contended);
    assert!(sim.policy.last_window().pressure_ppm.is_some());
    // Asleep between requests, the reactor still holds the core while it
    // serves them, and the waiter's pressure keeps it from spinning again.
    assert_eq!(out.switches, 1, "{out:?}");
    assert!(out.in_spin <= Duration::from_millis(20), "{out:?}");
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
    assert_eq!(sim.policy.regime(), Regime::Sleep, "{out:?}");
    assert_eq!(out.switches, 1, "{out:?}");
}
