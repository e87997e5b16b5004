//! Fair shares of a reactor's time (reactor/src/shares.rs), end to end
//! on a virtual clock: each request's cost is virtual time its task
//! advances the clock by, so what the reactor meters and what each share
//! gets are exact, however loaded the machine.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keelfs_reactor::{self as reactor, Clock, PollMode, Poller, Reactor, ReactorConfig, Share, VirtualClock};

/// A frontend that keeps `depth` requests in flight, each a task that
/// costs `cost` of the reactor's (virtual) time and then yields once,
/// as a request waiting on its device would, before it finishes.
struct Client {
    depth: usize,
    cost: Duration,
    clock: Arc<VirtualClock>,
    in_flight: Rc<Cell<usize>>,
    done: Rc<Cell<u64>>,
    share: Option<Share>,
}

impl Poller for Client {
    fn poll(&mut self, _now: Instant) -> bool {
        let share = self.share.get_or_insert_with(Share::join);
        let mut started = false;
        while self.in_flight.get() < self.depth && share.admits() {
            self.in_flight.set(self.in_flight.get() + 1);
            let (cost, clock, in_flight, done) =
                (self.cost, Arc::clone(&self.clock), Rc::clone(&self.in_flight), Rc::clone(&self.done));
            let _entered = share.enter();
            reactor::spawn_local(async move {
                clock.advance(cost);
                reactor::next_tick().await;
                in_flight.set(in_flight.get() - 1);
                done.set(done.get() + 1);
            });
            started = true;
        }
        started
    }
}

/// Run clients of these depths and costs on one busy reactor until
/// `total` requests have finished; what each finished, and the reactor's
/// share counters.
fn run(clients: &[(usize, Duration)], total: u64) -> (Vec<u64>, reactor::ShareCounters) {
    let clock = VirtualClock::new();
    let config =
        ReactorConfig { mode: PollMode::Busy, clock: Clock::Virtual(Arc::clone(&clock)), ..ReactorConfig::default() };
    let mut r = Reactor::new(config).expect("a reactor");
    let done: Vec<Rc<Cell<u64>>> = clients.iter().map(|_| Rc::default()).collect();
    let counters = {
        let (clients, done, clock) = (clients.to_vec(), done.clone(), Arc::clone(&clock));
        r.block_on(async move {
            for (&(depth, cost), done) in clients.iter().zip(&done) {
                let client = Client {
                    depth,
                    cost,
                    clock: Arc::clone(&clock),
                    in_flight: Rc::default(),
                    done: Rc::clone(done),
                    share: None,
                };
                reactor::register_poller(reactor::PollerClass::Source, Box::new(client));
            }
            while done.iter().map(|d| d.get()).sum::<u64>() < total {
                reactor::next_tick().await;
            }
            reactor::share_counters()
        })
    };
    (done.iter().map(|d| d.get()).collect(), counters)
}

#[test]
fn a_shallow_neighbour_keeps_its_share_beside_a_deep_flood() {
    let cost = Duration::from_micros(3);
    let (done, counters) = run(&[(32, cost), (8, cost)], 20_000);
    let neighbour = done[1] as f64 / (done[0] + done[1]) as f64;
    // First in, first served, the neighbour would get 8 of every 40.
    assert!(neighbour > 0.4, "the neighbour's part of the reactor: {neighbour:.2} ({done:?}, {counters:?})");
    assert!(counters.refusals > 0 && counters.rounds > 0, "{counters:?}");
}

#[test]
fn shares_divide_the_reactors_time_not_its_requests() {
    // The flood's requests cost four times the neighbour's.
    let (done, counters) = run(&[(32, Duration::from_micros(8)), (32, Duration::from_micros(2))], 30_000);
    let time_ratio = (done[0] * 8) as f64 / (done[1] * 2) as f64;
    assert!((0.75..1.33).contains(&time_ratio), "equal time: {done:?} ({counters:?})");
}

#[test]
fn a_client_alone_is_never_held() {
    let (done, counters) = run(&[(32, Duration::from_micros(3))], 10_000);
    assert!(done[0] >= 10_000);
    assert_eq!(counters.refusals, 0, "{counters:?}");
}
