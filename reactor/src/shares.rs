//! Fair shares of one reactor's time (issue 36): deficit round robin on
//! what the reactor itself spends on each share's tasks.
//!
//! A share is whatever a frontend admits work for, one per export. The
//! reactor meters the time it spends polling each share's tasks, but only
//! while two or more shares are active: alone, a share is never held, and
//! its polls cost no clock reads. While contended:
//! - a share admits a request while its deficit is positive, and pays an
//!   estimate of the request's cost at once, so a deep queue cannot take
//!   a batch on one positive deficit;
//! - the estimate follows the share's metered cost per admitted request
//!   (its own time, however its requests' costs change);
//! - a share out of credit waits for a round: every share is topped up by
//!   a quantum (never past it, so an idle share banks nothing) when every
//!   active share is out of credit, or when the reactor ran no task in a
//!   tick (work-conserving: nobody waits while the reactor has nothing
//!   to do).
//!
//! So a client flooding one export gets about a quantum of the reactor per
//! round, and a neighbour that needs less than its share is served as it
//! asks. Everything here is counts and nanoseconds given as inputs: no
//! clock, so the tests run in virtual time.

/// An index into [`FairShares`]; [`NO_SHARE`] tags a task of none.
pub(crate) type ShareIndex = u32;
pub(crate) const NO_SHARE: ShareIndex = 0x7fff_ffff;
/// Set on a task's tag when it was spawned by the share's frontend itself
/// (a request): such tasks make the share active. Tasks those spawn in
/// turn are charged to the share but do not keep it active, so that a
/// long-lived task a request happened to start (a timer, a checkpoint)
/// cannot hold its share active for ever and its neighbours waiting.
pub(crate) const ENTERED: u32 = 1 << 31;

/// The share a task tag names (or [`NO_SHARE`]).
pub(crate) fn index_of(tag: u32) -> ShareIndex {
    tag & !ENTERED
}

/// A round's top-up: about this much reactor time per share per round.
pub(crate) const QUANTUM_NS: i64 = 50_000;
/// The first estimate of a request's cost, before any is metered.
const FIRST_ESTIMATE_NS: u64 = 2_000;
/// The largest estimate: a request metered longer (one that ran for
/// milliseconds) costs its share this many rounds, no more.
const ESTIMATE_MAX_NS: u64 = 20 * QUANTUM_NS as u64;
/// Admissions between two updates of a share's estimate.
const ESTIMATE_EVERY: u64 = 16;
/// Shares one reactor holds at most (an export each).
pub(crate) const SHARES_MAX: usize = 4096;

#[derive(Debug, Default)]
struct Entry {
    live: bool,
    deficit_ns: i64,
    /// Its tasks alive now: a share with one is active.
    tasks: u32,
    /// It was refused and has not admitted since: active too.
    waiting: bool,
    /// The round it last admitted in: it is active for the rest of that
    /// round, so that requests which finish within a tick (and leave no
    /// task alive when the next is admitted) still count.
    admitted_round: Option<u64>,
    estimate_ns: u64,
    /// Metered and admitted since the estimate's last update.
    spent_ns: u64,
    admitted: u64,
}

/// What [`FairShares`] has done, for stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShareCounters {
    pub refusals: u64,
    pub rounds: u64,
    /// Rounds started because the reactor had nothing to run.
    pub idle_rounds: u64,
}

#[derive(Debug, Default)]
pub(crate) struct FairShares {
    entries: Vec<Entry>,
    free: Vec<ShareIndex>,
    /// Rounds begun.
    round: u64,
    counters: ShareCounters,
}

impl Entry {
    fn is_active(&self, round: u64) -> bool {
        self.live && (self.tasks > 0 || self.waiting || self.admitted_round == Some(round))
    }
}

impl FairShares {
    /// A new share, with a quantum to start on.
    ///
    /// # Panics
    /// Past [`SHARES_MAX`] shares (an export each: a configuration bounds
    /// them far below).
    pub fn join(&mut self) -> ShareIndex {
        let entry = Entry { live: true, deficit_ns: QUANTUM_NS, estimate_ns: FIRST_ESTIMATE_NS, ..Entry::default() };
        if let Some(index) = self.free.pop() {
            self.entries[index as usize] = entry;
            return index;
        }
        assert!(self.entries.len() < SHARES_MAX, "more than {SHARES_MAX} shares on one reactor");
        self.entries.push(entry);
        (self.entries.len() - 1) as ShareIndex
    }

    /// The share is gone; its tasks still alive finish untracked.
    pub fn leave(&mut self, index: ShareIndex) {
        self.entries[index as usize] = Entry::default();
        self.free.push(index);
    }

    /// Two or more shares active: time is metered and shares enforced.
    /// (A scan: a reactor holds a share per export it serves, a few.)
    pub fn contended(&self) -> bool {
        self.entries.iter().filter(|e| e.is_active(self.round)).nth(1).is_some()
    }

    /// Whether share `index` may start a request now; if so, it pays the
    /// request's estimated cost.
    pub fn admit(&mut self, index: ShareIndex) -> bool {
        if self.entries.len() == self.free.len() + 1 {
            return true; // the reactor's only share: the common case, first
        }
        let round = self.round;
        let others_active = self.entries.iter().enumerate().any(|(i, e)| i != index as usize && e.is_active(round));
        if !others_active {
            // Alone, nothing is metered: start each contention afresh.
            let entry = &mut self.entries[index as usize];
            (entry.deficit_ns, entry.waiting, entry.admitted_round) = (QUANTUM_NS, false, Some(round));
            return true;
        }
        // Rounds until this share has credit, unless another active one
        // has some first: then it waits its turn. Each round adds a
        // quantum and an estimate is at most ESTIMATE_MAX_NS, so this
        // ends within that many quanta.
        for _ in 0..=ESTIMATE_MAX_NS / QUANTUM_NS as u64 + 1 {
            if self.entries[index as usize].deficit_ns > 0 {
                break;
            }
            let round = self.round;
            let others_have_credit = self
                .entries
                .iter()
                .enumerate()
                .any(|(i, e)| i != index as usize && e.is_active(round) && e.deficit_ns > 0);
            if others_have_credit {
                self.counters.refusals += 1;
                self.entries[index as usize].waiting = true;
                return false;
            }
            self.new_round(false);
        }
        let round = self.round;
        let entry = &mut self.entries[index as usize];
        (entry.waiting, entry.admitted_round) = (false, Some(round));
        entry.admitted += 1;
        if entry.admitted >= ESTIMATE_EVERY {
            let metered = entry.spent_ns / entry.admitted;
            entry.estimate_ns = (entry.estimate_ns + metered).div_ceil(2).clamp(1, ESTIMATE_MAX_NS);
            (entry.spent_ns, entry.admitted) = (0, 0);
        }
        entry.deficit_ns -= entry.estimate_ns as i64;
        true
    }

    /// `ns` of the reactor's time went to a task of share `index`.
    pub fn charge(&mut self, index: ShareIndex, ns: u64) {
        if let Some(entry) = self.entries.get_mut(index as usize).filter(|e| e.live) {
            entry.spent_ns = entry.spent_ns.saturating_add(ns);
        }
    }

    pub fn task_started(&mut self, index: ShareIndex) {
        if let Some(entry) = self.entries.get_mut(index as usize).filter(|e| e.live) {
            entry.tasks += 1;
        }
    }

    pub fn task_finished(&mut self, index: ShareIndex) {
        if let Some(entry) = self.entries.get_mut(index as usize).filter(|e| e.live && e.tasks > 0) {
            entry.tasks -= 1;
        }
    }

    /// A tick ran no task: a share waiting for credit gets it now.
    pub fn reactor_idle(&mut self) {
        if self.entries.iter().any(|e| e.live && e.waiting) {
            self.new_round(true);
        }
    }

    pub fn counters(&self) -> ShareCounters {
        self.counters
    }

    fn new_round(&mut self, idle: bool) {
        for entry in self.entries.iter_mut().filter(|e| e.live) {
            entry.deficit_ns = entry.deficit_ns.saturating_add(QUANTUM_NS).min(QUANTUM_NS);
        }
        self.round += 1;
        self.counters.rounds += 1;
        self.counters.idle_rounds += u64::from(idle);
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        for (i, e) in self.entries.iter().enumerate() {
            assert!(e.deficit_ns <= QUANTUM_NS, "share {i} banked past a quantum");
            assert!(e.live || self.free.contains(&(i as ShareIndex)), "a dead share not free");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated reactor: each step runs one task of whichever share's
    /// request is first in line (FIFO, as the reactor's run queue), each
    /// request costing `cost_ns[share]`, and the pollers admit in turn up
    /// to each client's depth. Returns the requests each share finished.
    fn simulate(depths: &[usize], cost_ns: &[u64], steps: usize) -> (Vec<u64>, FairShares) {
        let mut shares = FairShares::default();
        let ids: Vec<ShareIndex> = depths.iter().map(|_| shares.join()).collect();
        let mut in_flight = vec![0usize; depths.len()];
        let mut queue: std::collections::VecDeque<usize> = std::collections::VecDeque::new();
        let mut done = vec![0u64; depths.len()];
        for _ in 0..steps {
            // The pollers: each client keeps its depth in flight.
            for (s, &depth) in depths.iter().enumerate() {
                while in_flight[s] < depth && shares.admit(ids[s]) {
                    in_flight[s] += 1;
                    shares.task_started(ids[s]);
                    queue.push_back(s);
                }
            }
            // The task phase: one request runs to its end.
            match queue.pop_front() {
                Some(s) => {
                    shares.charge(ids[s], cost_ns[s]);
                    shares.task_finished(ids[s]);
                    in_flight[s] -= 1;
                    done[s] += 1;
                }
                None => shares.reactor_idle(),
            }
            shares.check_invariants();
        }
        (done, shares)
    }

    #[test]
    fn a_share_alone_is_never_held() {
        let (done, shares) = simulate(&[32], &[3_000], 10_000);
        assert_eq!(done[0], 10_000);
        assert_eq!(shares.counters().refusals, 0);
    }

    #[test]
    fn a_flood_gets_about_half_beside_a_neighbour_as_deep() {
        let (done, shares) = simulate(&[32, 32], &[3_000, 3_000], 20_000);
        let ratio = done[1] as f64 / done[0] as f64;
        assert!((0.9..1.1).contains(&ratio), "equal shares: {done:?}");
        assert!(shares.counters().refusals > 0 && shares.counters().rounds > 0);
    }

    #[test]
    fn a_shallow_neighbour_is_not_crowded_out_by_a_deep_flood() {
        // Without shares the run queue holds 32 of the flood's requests
        // for the neighbour's 8: it would get a fifth.
        let (done, _) = simulate(&[32, 8], &[3_000, 3_000], 20_000);
        let neighbour = done[1] as f64 / (done[0] + done[1]) as f64;
        assert!(neighbour > 0.45, "the neighbour's part of the reactor: {neighbour:.2} ({done:?})");
    }

    #[test]
    fn shares_are_of_time_not_of_requests() {
        // The flood's requests cost four times the neighbour's: it gets
        // about a quarter of the neighbour's count for the same time.
        let (done, _) = simulate(&[32, 32], &[8_000, 2_000], 40_000);
        let time_ratio = (done[0] * 8_000) as f64 / (done[1] * 2_000) as f64;
        assert!((0.8..1.25).contains(&time_ratio), "equal time: {done:?}");
    }

    #[test]
    fn credit_comes_when_the_reactor_idles() {
        let mut shares = FairShares::default();
        let (flood, quiet) = (shares.join(), shares.join());
        // The quiet share has a task in flight (waiting on its device),
        // keeping it active with credit; the flood spends its own.
        shares.task_started(quiet);
        shares.task_started(flood);
        let mut admitted = 0;
        while shares.admit(flood) {
            shares.charge(flood, 10_000);
            admitted += 1;
            assert!(admitted < 1000, "never refused");
        }
        assert!(!shares.admit(flood), "held while the quiet share has credit");
        shares.reactor_idle();
        assert!(shares.admit(flood), "an idle reactor tops the flood up");
        assert_eq!(shares.counters().idle_rounds, 1);
        shares.check_invariants();
    }

    #[test]
    fn a_share_that_leaves_is_no_longer_active() {
        let mut shares = FairShares::default();
        let (a, b) = (shares.join(), shares.join());
        shares.task_started(a);
        shares.task_started(b);
        assert!(shares.contended());
        shares.leave(b);
        assert!(!shares.contended());
        shares.task_finished(b); // a task of the gone share ends untracked
        shares.check_invariants();
        let c = shares.join();
        assert_eq!(c, b, "its slot is reused");
        shares.check_invariants();
    }
}
