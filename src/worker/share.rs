//! How a worker shares its places (`worker.max_inflight`) among its routes, so that one route's
//! backlog never holds up another route's events.
//!
//! A sleeping event holds its places until its slot, and the reader reads only while places are
//! free. Before, a route whose backlog could hold more sleeping events than the worker has
//! places (rate × max_wait ≥ max_inflight) took them all, and every other route's events waited
//! unread behind it at its pace: a 100/s route took 100 s to start behind a 2/s route. Now:
//!
//! - a route whose queue is short (its plan less than `SHORT_QUEUE_US` ahead, and its calls
//!   answered within as long) may take any free place: its events give them back soon;
//! - a route whose queue is long may take only places beyond a `reserve` kept for the readers
//!   and for short queues, and of those at most its share: the places beyond the reserve
//!   divided among the routes holding any (max-min fairness: a route alone may take them all, a
//!   second one arriving takes places as the first gives them back, until they hold half each).
//!
//! What a route may not take now it parks (`parked`, as the events are handed to its task): the
//! entry stays pending, its fields are let go, and it is read again once the route has room. So
//! the readers keep reading, and every other route's events go on.
//!
//! A route holds the places of the events asleep on it and of those handed to its task and not
//! yet placed: a route whose calls wait on a frozen master (a cluster's) held every event sent
//! to it meanwhile, and once they had taken every place the routes on the healthy masters
//! stopped too (none of their events dispatched in seconds 2 to 6 of a 6 s freeze, one worker
//! of 300 places, 150 events a second per route).
//!
//! Counted in places, not events: a large event holds several (`budget`).

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Semaphore;

/// A queue this short (how far ahead its plan runs) gives its places back soon enough to take
/// any: the readers wait at most this long for it.
const SHORT_QUEUE_US: i64 = 1_000_000;

/// Entries parked per place: a parked entry keeps about 40 bytes (its id and its slot in
/// `held`), a sleeping one its fields too (several hundred bytes). At the default 10,000
/// places, 160,000 parked: about 6 MiB.
const PARKED_PER_PLACE: usize = 16;

/// The worker's places, and what each route's events hold of them.
pub(crate) struct Shares {
    /// Places held by each route's events (asleep on it, or handed to its task and not yet
    /// placed), by `Route::index`.
    held: Box<[AtomicUsize]>,
    /// Entries each route has parked.
    parked: Box<[AtomicUsize]>,
    /// How far ahead each route's plan ran after its last call, µs.
    queue_us: Box<[AtomicI64]>,
    /// Since when each route's task has been in its current calls (ms after `born`; 0: it
    /// is not): a route whose calls wait on a frozen master gives nothing back either.
    busy_since_ms: Box<[AtomicU64]>,
    born: Instant,
    /// Which routes are counted active (holding places or with entries parked: wanting them),
    /// changed only under the lock, when a route's counts cross zero.
    counted: Mutex<Vec<bool>>,
    /// How many are.
    active: AtomicUsize,
    /// Entries parked, all routes together.
    parked_total: AtomicUsize,
    /// Places held by reads under way (a reader's XREADGROUP waiting for new entries holds its
    /// count): the reserve is for them, so those count toward it, not against the routes.
    reading: AtomicUsize,
    permits: Arc<Semaphore>,
    total: usize,
    reserve: usize,
    /// The most entries parked at once: past it the readers wait, as they did for places.
    max_parked: usize,
}

impl Shares {
    /// `total` places (`permits` hands them out), of which `reserve` (at most half) are kept
    /// from long queues.
    pub(crate) fn new(
        routes: usize,
        permits: Arc<Semaphore>,
        total: usize,
        reserve: usize,
    ) -> Arc<Self> {
        let zeros = || (0..routes).map(|_| AtomicUsize::new(0)).collect();
        Arc::new(Shares {
            held: zeros(),
            parked: zeros(),
            queue_us: (0..routes).map(|_| AtomicI64::new(0)).collect(),
            busy_since_ms: (0..routes).map(|_| AtomicU64::new(0)).collect(),
            born: Instant::now(),
            counted: Mutex::new(vec![false; routes]),
            active: AtomicUsize::new(0),
            parked_total: AtomicUsize::new(0),
            reading: AtomicUsize::new(0),
            permits,
            total,
            reserve: reserve.min(total / 2),
            max_parked: total.saturating_mul(PARKED_PER_PLACE),
        })
    }

    /// A seat for an event asleep on `route` holding `places`: counted until dropped.
    pub(crate) fn seat(self: &Arc<Self>, route: usize, places: u32) -> Seat {
        self.handed(route, places as usize);
        Seat {
            shares: self.clone(),
            route: route as u32,
            places,
        }
    }

    /// Counts `places` held on `route` (handed to its task by `Placers::send`, or asleep: a
    /// `seat`), until `placed`: a route whose calls wait on a frozen master holds what it was
    /// sent meanwhile.
    pub(crate) fn handed(&self, route: usize, places: usize) {
        if places > 0 && self.held[route].fetch_add(places, Ordering::Relaxed) == 0 {
            self.settle(route);
        }
    }

    /// Counts `places` on `route` let go: handed to its task and placed (asleep now under
    /// seats of their own, passed on or finished), or asleep and gone.
    pub(crate) fn placed(&self, route: usize, places: usize) {
        if places > 0 && self.held[route].fetch_sub(places, Ordering::Relaxed) == places {
            self.settle(route);
        }
    }

    /// Counts `route` active or not by its counts now (one of them crossed zero).
    fn settle(&self, route: usize) {
        let mut counted = self.counted.lock().expect("never poisoned");
        let now = self.held[route].load(Ordering::Relaxed) > 0
            || self.parked[route].load(Ordering::Relaxed) > 0;
        if counted[route] != now {
            counted[route] = now;
            if now {
                self.active.fetch_add(1, Ordering::Relaxed);
            } else {
                self.active.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Learns how far ahead `route`'s plan runs (from a schedule call's reply).
    pub(crate) fn queue(&self, route: usize, ahead_us: i64) {
        self.queue_us[route].store(ahead_us, Ordering::Relaxed);
    }

    /// Marks `route`'s task in its calls from now (`busy`) or out of them.
    pub(crate) fn busy(&self, route: usize, busy: bool) {
        let since = if busy {
            // Never 0 (which says "not busy").
            self.born.elapsed().as_millis() as u64 + 1
        } else {
            0
        };
        self.busy_since_ms[route].store(since, Ordering::Relaxed);
    }

    /// Whether `route` gives its places back slowly: its plan runs far ahead, or its task has
    /// been in its calls that long (they wait on a slow or frozen Redis).
    fn long(&self, route: usize) -> bool {
        let since = self.busy_since_ms[route].load(Ordering::Relaxed);
        let busy_ms = (self.born.elapsed().as_millis() as u64 + 1).saturating_sub(since);
        self.queue_us[route].load(Ordering::Relaxed) > SHORT_QUEUE_US
            || (since > 0 && busy_ms as i64 * 1000 > SHORT_QUEUE_US)
    }

    /// How many places the events on `route` (handed to its task, or asleep on it) may hold
    /// now (`room`), counting as free the `own` places that the events asking already hold
    /// (those read: they keep them, or give them back when parked).
    pub(crate) fn room_with(&self, route: usize, own: usize) -> usize {
        let long = self.long(route);
        let counted = self.held[route].load(Ordering::Relaxed) > 0
            || self.parked[route].load(Ordering::Relaxed) > 0;
        let active = self.active.load(Ordering::Relaxed) + usize::from(!counted);
        room(
            Places {
                total: self.total,
                free: self.permits.available_permits() + own,
                reading: self.reading.load(Ordering::Relaxed),
                reserve: self.reserve,
            },
            long,
            self.held[route].load(Ordering::Relaxed),
            active,
        )
    }

    /// Counts `n` entries parked on `route`.
    pub(crate) fn park(&self, route: usize, n: usize) {
        self.parked_total.fetch_add(n, Ordering::Relaxed);
        if n > 0 && self.parked[route].fetch_add(n, Ordering::Relaxed) == 0 {
            self.settle(route);
        }
    }

    /// Counts `n` entries of `route` taken back.
    pub(crate) fn unpark(&self, route: usize, n: usize) {
        self.parked_total.fetch_sub(n, Ordering::Relaxed);
        if n > 0 && self.parked[route].fetch_sub(n, Ordering::Relaxed) == n {
            self.settle(route);
        }
    }

    /// Counts `places` held by a read under way until the guard is dropped (when it returns).
    pub(crate) fn reading(self: &Arc<Self>, places: usize) -> Reading {
        self.reading.fetch_add(places, Ordering::Relaxed);
        Reading {
            shares: self.clone(),
            places,
        }
    }

    /// Entries `route` has parked.
    pub(crate) fn parked_on(&self, route: usize) -> usize {
        self.parked[route].load(Ordering::Relaxed)
    }

    /// Whether as many entries are parked as a worker keeps: then the readers wait.
    pub(crate) fn parked_full(&self) -> bool {
        self.parked_total.load(Ordering::Relaxed) >= self.max_parked
    }
}

/// An event's places on its route (asleep on it, or handed to its task): counted in its route's
/// share until dropped.
pub(crate) struct Seat {
    shares: Arc<Shares>,
    route: u32,
    places: u32,
}

impl Seat {
    pub(crate) fn route(&self) -> usize {
        self.route as usize
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        (self.shares).placed(self.route as usize, self.places as usize);
    }
}

/// A read under way, its places counted toward the reserve until it is dropped.
pub(crate) struct Reading {
    shares: Arc<Shares>,
    places: usize,
}

impl Drop for Reading {
    fn drop(&mut self) {
        (self.shares.reading).fetch_sub(self.places, Ordering::Relaxed);
    }
}

/// The worker's places: all of them, the free ones, those reads under way hold, and those kept
/// from long queues.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Places {
    pub(crate) total: usize,
    pub(crate) free: usize,
    pub(crate) reading: usize,
    pub(crate) reserve: usize,
}

/// How many more places a route holding `held` may give sleeping events, with `active` routes
/// (this one among them) holding places or waiting for them: every free place for a short
/// queue; for a `long` one, what is free beyond the reserve (of which reads under way already
/// hold their part), and no more than what is left of its share (the places beyond the
/// reserve divided among the active routes, one at least). Long queues so never hold the
/// reserve, and one over its share (it took more while alone) adds nothing until it is back
/// within it, while the places it gives back go to the routes below theirs. Never more than is
/// free.
pub(crate) fn room(places: Places, long: bool, held: usize, active: usize) -> usize {
    if !long {
        return places.free;
    }
    let share = (places.total.saturating_sub(places.reserve) / active.max(1)).max(1);
    let beyond = (places.free + places.reading.min(places.reserve)).saturating_sub(places.reserve);
    beyond.min(places.free).min(share.saturating_sub(held))
}

/// A seat on `route` of a worker of its own (for tests of what holds one).
#[cfg(test)]
pub(crate) fn seat_for_test(route: usize) -> Seat {
    let shares = Shares::new(route + 1, Arc::new(Semaphore::new(1)), 1, 0);
    shares.seat(route, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn places(total: usize, free: usize, reserve: usize) -> Places {
        Places {
            total,
            free,
            reading: 0,
            reserve,
        }
    }

    /// A reader waiting for new entries holds its count: that is the reserve at work, so the
    /// long queues still have what is free beyond it (a worker of 20 places, a read of 10
    /// waiting, took nothing back for its parked entries).
    #[test]
    fn a_waiting_read_holds_its_part_of_the_reserve() {
        let waiting = Places {
            total: 20,
            free: 10,
            reading: 10,
            reserve: 10,
        };
        assert_eq!(room(waiting, true, 0, 1), 10);
        // Never more than is free: its reading is not the route's to take.
        let short = Places { free: 3, ..waiting };
        assert_eq!(room(short, true, 0, 1), 3);
        assert_eq!(room(short, false, 0, 1), 3);
    }

    #[test]
    fn a_short_queue_takes_any_free_place() {
        assert_eq!(room(places(100, 7, 20), false, 90, 3), 7);
    }

    #[test]
    fn a_long_queue_alone_takes_every_place_beyond_the_reserve() {
        assert_eq!(room(places(100, 100, 20), true, 0, 1), 80);
        assert_eq!(room(places(100, 30, 20), true, 70, 1), 10);
        assert_eq!(room(places(100, 20, 20), true, 80, 1), 0);
    }

    /// A second long queue (its entries parked: it wants places) takes the places the first
    /// gives back, until they hold half each; the first takes nothing meanwhile.
    #[test]
    fn a_second_long_queue_takes_what_the_first_gives_back_until_both_hold_their_share() {
        let (total, reserve) = (100, 20);
        let mut held = [80usize, 0];
        for _ in 0..200 {
            // The first dispatches one event; then each asks, the first first.
            if held[0] > 0 {
                held[0] -= 1;
            }
            for r in 0..2 {
                let free = total - held[0] - held[1];
                let take = room(places(total, free, reserve), true, held[r], 2);
                held[r] += take.min(1);
            }
            assert!(held[0] + held[1] <= total - reserve, "{held:?}");
        }
        assert_eq!(held, [40, 40]);
    }

    proptest! {
        /// However long queues interleave, taking at most their room each time, together they
        /// never hold the reserve, and none grows past its share once they share.
        #[test]
        fn long_queues_within_their_room_never_hold_the_reserve(
            total in 10usize..2000,
            reserve_pct in 1usize..50,
            picks in proptest::collection::vec((0usize..6, 1usize..40, any::<bool>()), 1..300),
        ) {
            let reserve = total * reserve_pct / 100;
            let mut held = [0usize; 6];
            for (route, want, give_back) in picks {
                if give_back {
                    held[route] = held[route].saturating_sub(want);
                    continue;
                }
                let before = held[route];
                let free = total - held.iter().sum::<usize>();
                let active = held.iter().filter(|h| **h > 0).count() + usize::from(before == 0);
                let r = room(places(total, free, reserve), true, before, active);
                held[route] += want.min(r);
                prop_assert!(held.iter().sum::<usize>() <= total - reserve, "{held:?}");
                let active = held.iter().filter(|h| **h > 0).count();
                let share = ((total - reserve) / active.max(1)).max(1);
                prop_assert!(held[route] <= before.max(share), "{held:?} share {share}");
            }
        }
    }
}
