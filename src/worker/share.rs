//! How a worker shares its places (`worker.max_inflight`) among its routes, so that one route's
//! backlog never holds up another route's events.
//!
//! A sleeping event holds its places until its slot, and the reader reads only while places are
//! free. Before, a route whose backlog could hold more sleeping events than the worker has
//! places (rate × max_wait ≥ max_inflight) took them all, and every other route's events waited
//! unread behind it at its pace: a 100/s route took 100 s to start behind a 2/s route. Now:
//!
//! - every route holds at most its share: the places beyond a reserve kept for the readers
//!   (what they ask for at once, weighed as their last reads weighed: `read_weighed`),
//!   divided among the routes holding any or waiting for them (max-min fairness: a route alone
//!   may take them all, a second one arriving takes places as the first gives them back, until
//!   they hold half each);
//! - a route whose queue is long takes only places beyond the reserve;
//! - a route whose queue is short (its plan less than `SHORT_QUEUE_US` ahead, and its calls
//!   answered within as long) may take free places of the reserve too, as many as keep it
//!   short (what its rate passes in the rest of that time): its events give them back soon.
//!   Taking any free place, a slow route that came back short took up to a call's 128 at once
//!   and held them for 13 s at 10/s, so the places gathered on a few routes while the rest
//!   waited: 300 routes of 10/s, 200 events each, on a worker of 2,000 places, ran at 450–900
//!   events a second instead of 3,000.
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
use tokio::sync::{Notify, Semaphore};

/// A queue this short (how far ahead its plan runs) gives its places back soon enough to take
/// any: the readers wait at most this long for it.
const SHORT_QUEUE_US: i64 = 1_000_000;

/// A route takes its parked entries back this many at a time (or all it has parked, if
/// fewer), unless its plan is about to run out (`RUNS_DRY_US`): each take-back is a read by id
/// and a `schedule` call, most of whose Redis cost is the call's own, not its events'.
pub(crate) const TAKE_BACK_AT_ONCE: usize = 32;

/// A plan this close to its end (its next free slot is within it: the events asleep on the
/// route are about to have gone) takes back whatever it has room for. Several times what a
/// take-back takes (a tick of `placers`, a read by id, a call), so no slot of the route goes
/// empty while it waits for places; a route whose share of the places passes within it
/// (100/s with 10 places) takes back as soon as it has room, as before. At 250 ms, 300 routes
/// of 10/s with about 4 places each were due as soon as one event went, and took one at a time.
const RUNS_DRY_US: i64 = 100_000;

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
    /// Wakes the task that looks for room (`placers`) when entries are parked with none before:
    /// while none are, it has nothing to look for, and a worker at rest wakes for nothing.
    first_parked: Notify,
    /// Wakes a route's task while it has entries parked, when `wake_those_with_room` finds it
    /// room.
    room_found: Box<[Notify]>,
    /// Where each route's plan ended after its last call (µs after `born`): how far ahead it
    /// runs is that less the time now, shorter as its events go out.
    plan_end_us: Box<[AtomicI64]>,
    /// Each route's interval, µs (one event's share of its rate).
    interval_us: Box<[i64]>,
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
    /// Entries the inbound partitions have parked (`worker::inbound`): they count toward
    /// `max_parked` too, but no route takes them back.
    parked_inbound: AtomicUsize,
    /// Places held by reads under way (a reader's XREADGROUP waiting for new entries holds its
    /// count): the reserve is for them, so those count toward it, not against the routes.
    reading: AtomicUsize,
    permits: Arc<Semaphore>,
    total: usize,
    /// Kept from long queues whatever the readers read: what they and the claimer ask for at
    /// once in entries, a place each (0: nothing kept, where one route is all a worker serves).
    reserve: usize,
    /// What each reader's last read weighed beyond a place an entry (`read_weighed`), by
    /// input stream: large entries weigh several places each, and the reserve keeps those too.
    read_extra: Box<[AtomicUsize]>,
    /// The sum of `read_extra`.
    read_extra_total: AtomicUsize,
    /// The most entries parked at once: past it the readers wait, as they did for places.
    max_parked: usize,
}

impl Shares {
    /// `total` places (`permits` hands them out), of which `reserve` and what `readers` readers'
    /// last reads weighed beyond it (at most half in all; nothing, when `reserve` is 0) are kept
    /// from long queues, for routes of `interval_us` each (by `Route::index`).
    pub(crate) fn new(
        interval_us: Vec<i64>,
        permits: Arc<Semaphore>,
        total: usize,
        reserve: usize,
        readers: usize,
    ) -> Arc<Self> {
        let routes = interval_us.len();
        let zeros = || (0..routes).map(|_| AtomicUsize::new(0)).collect();
        Arc::new(Shares {
            held: zeros(),
            parked: zeros(),
            room_found: (0..routes).map(|_| Notify::new()).collect(),
            first_parked: Notify::new(),
            plan_end_us: (0..routes).map(|_| AtomicI64::new(0)).collect(),
            interval_us: interval_us.into_iter().map(|i| i.max(1)).collect(),
            busy_since_ms: (0..routes).map(|_| AtomicU64::new(0)).collect(),
            born: Instant::now(),
            counted: Mutex::new(vec![false; routes]),
            active: AtomicUsize::new(0),
            parked_total: AtomicUsize::new(0),
            parked_inbound: AtomicUsize::new(0),
            reading: AtomicUsize::new(0),
            permits,
            total,
            reserve: reserve.min(total / 2),
            read_extra: (0..readers).map(|_| AtomicUsize::new(0)).collect(),
            read_extra_total: AtomicUsize::new(0),
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

    /// Resolves once `wake_those_with_room` finds `route` room (at once if it did since the
    /// last call: a wake-up is never lost).
    pub(crate) async fn room_found(&self, route: usize) {
        self.room_found[route].notified().await;
    }

    /// Whether any entries are parked; if none, first waits until some are (at once if some
    /// were since the last call: a wake-up is never lost).
    pub(crate) async fn any_parked(&self) {
        if self.parked_total.load(Ordering::Relaxed) == 0 {
            self.first_parked.notified().await;
        }
    }

    /// Wakes each route with entries parked that has room for some now. It reads every route's
    /// count: a few µs a tick for hundreds of routes.
    pub(crate) fn wake_those_with_room(&self) {
        if self.parked_total.load(Ordering::Relaxed) == 0 {
            return;
        }
        for route in 0..self.parked.len() {
            if self.take_back_due(route) {
                self.room_found[route].notify_one();
            }
        }
    }

    /// Whether `route` should take parked entries back now (`take_back_now`).
    pub(crate) fn take_back_due(&self, route: usize) -> bool {
        let parked = self.parked[route].load(Ordering::Relaxed);
        if parked == 0 {
            return false;
        }
        let ahead = self.plan_end_us[route].load(Ordering::Relaxed) - self.now_us();
        take_back_now(self.room_with(route, 0), parked, ahead)
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
        let end = self.now_us().saturating_add(ahead_us.max(0));
        self.plan_end_us[route].store(end, Ordering::Relaxed);
    }

    /// Where `route`'s plan ends as last learned (`queue`), in this worker's µs: it moves with
    /// every schedule reply this worker gets for the route, so the monitor can tell a route
    /// this worker has placed on since it last looked (`monitor`).
    pub(crate) fn plan_end(&self, route: usize) -> i64 {
        self.plan_end_us[route].load(Ordering::Relaxed)
    }

    /// Microseconds since `born`.
    fn now_us(&self) -> i64 {
        self.born.elapsed().as_micros() as i64
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

    /// How many places `route` may take of any free place, the reserve's too, and stay short
    /// (`short`; `room` still holds it to its share): none while its plan runs
    /// `SHORT_QUEUE_US` ahead, or its task has been in its calls that long (they wait on a slow
    /// or frozen Redis, and it gives nothing back meanwhile). Counted in events, one place
    /// each: a large event weighs more places, so such a route takes fewer, never more.
    fn short_room(&self, route: usize) -> usize {
        let since = self.busy_since_ms[route].load(Ordering::Relaxed);
        let busy_ms = (self.born.elapsed().as_millis() as u64 + 1).saturating_sub(since);
        if since > 0 && busy_ms as i64 * 1000 > SHORT_QUEUE_US {
            return 0;
        }
        let ahead = self.plan_end_us[route].load(Ordering::Relaxed) - self.now_us();
        short(ahead, self.interval_us[route])
    }

    /// How many places the events on `route` (handed to its task, or asleep on it) may hold
    /// now (`room`), counting as free the `own` places that the events asking already hold
    /// (those read: they keep them, or give them back when parked).
    pub(crate) fn room_with(&self, route: usize, own: usize) -> usize {
        let short = self.short_room(route);
        let counted = self.held[route].load(Ordering::Relaxed) > 0
            || self.parked[route].load(Ordering::Relaxed) > 0;
        let active = self.active.load(Ordering::Relaxed) + usize::from(!counted);
        room(
            Places {
                total: self.total,
                free: self.permits.available_permits() + own,
                reading: self.reading.load(Ordering::Relaxed),
                reserve: self.reserve(),
            },
            short,
            self.held[route].load(Ordering::Relaxed),
            active,
        )
    }

    /// Counts `n` entries parked on `route`.
    pub(crate) fn park(&self, route: usize, n: usize) {
        if self.parked_total.fetch_add(n, Ordering::Relaxed) == 0 && n > 0 {
            self.first_parked.notify_one();
        }
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

    /// The places beyond the reserve kept for the readers' entries, a place each (what their
    /// weight adds comes and goes with what they read).
    pub(crate) fn beyond_reserve(&self) -> usize {
        self.total - self.reserve
    }

    /// Whether places are kept for the readers (not where one route is all a worker serves).
    pub(crate) fn keeps_reserve(&self) -> bool {
        self.reserve > 0
    }

    /// Learns that the last read of the reader at `reader` weighed `places` for its `entries`
    /// (`budget::hold`): the next read of that kind needs as many free, so the reserve keeps
    /// what they weigh beyond a place each until a read weighs otherwise. A reserve of entries
    /// alone (`batch` places a reader) let a long queue of 60 KB events (144 places each) hold
    /// all but that: each read of 16 of them waited for the route's sleepers to free 2,304
    /// places, read after read at the route's pace, and another route's events behind them in
    /// the stream went out after 250-280 of its dispatches.
    pub(crate) fn read_weighed(&self, reader: usize, entries: usize, places: usize) {
        if self.reserve == 0 {
            return;
        }
        let extra = places.saturating_sub(entries);
        let Some(slot) = self.read_extra.get(reader) else {
            return;
        };
        // Added before the old is taken away: the sum may read high for a moment, never wrap.
        self.read_extra_total.fetch_add(extra, Ordering::Relaxed);
        let old = slot.swap(extra, Ordering::Relaxed);
        self.read_extra_total.fetch_sub(old, Ordering::Relaxed);
    }

    /// The places kept from long queues now: the readers' and the claimer's entries, a place
    /// each, and what the readers' last reads weighed beyond that, at most half of all.
    fn reserve(&self) -> usize {
        if self.reserve == 0 {
            return 0;
        }
        let extra = self.read_extra_total.load(Ordering::Relaxed);
        self.reserve.saturating_add(extra).min(self.total / 2)
    }

    /// Counts `n` entries parked by the inbound partitions (`added`), or taken back.
    pub(crate) fn park_inbound(&self, n: usize, added: bool) {
        if added {
            self.parked_inbound.fetch_add(n, Ordering::Relaxed);
        } else {
            self.parked_inbound.fetch_sub(n, Ordering::Relaxed);
        }
    }

    /// Whether as many entries are parked, by routes and inbound partitions together, as a
    /// worker keeps: then the readers wait.
    pub(crate) fn parked_full(&self) -> bool {
        self.parked_total.load(Ordering::Relaxed) + self.parked_inbound.load(Ordering::Relaxed)
            >= self.max_parked
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

/// Whether a route with `parked` entries parked and `room` places for them, whose plan runs
/// `ahead_us` ahead, takes some back now: when it has room for `TAKE_BACK_AT_ONCE` of them (or
/// all, if fewer), or its plan is within `RUNS_DRY_US` of its end. A slow route gives back a
/// place at a time (10/s: one every 100 ms), and taking each back alone cost Redis a call per
/// event: 300 routes of 10/s with backlogs parked, 162 µs of Redis CPU per event (107 since).
pub(crate) fn take_back_now(room: usize, parked: usize, ahead_us: i64) -> bool {
    room > 0 && (room >= parked.min(TAKE_BACK_AT_ONCE) || ahead_us <= RUNS_DRY_US)
}

/// How many places a route whose plan runs `ahead_us` ahead, at `interval_us` an event, may
/// take and stay short: the events its rate passes in what is left of `SHORT_QUEUE_US`.
pub(crate) fn short(ahead_us: i64, interval_us: i64) -> usize {
    let left = SHORT_QUEUE_US - ahead_us.max(0);
    if left <= 0 {
        return 0;
    }
    ((left + interval_us - 1) / interval_us.max(1)) as usize
}

/// How many more places a route holding `held` may give sleeping events, with `active` routes
/// (this one among them) holding places or waiting for them: no more than what is left of its
/// share (the places beyond the reserve divided among the active routes, one at least), and of
/// what is free, for a long queue only what is beyond the reserve (of which reads under way
/// already hold their part), for a short one as many as keep it short (`short`, 0 for a long
/// queue) of any free place. Long queues so never hold the reserve, and one over its share (it
/// took more while alone) adds nothing until it is back within it, while the places it gives
/// back go to the routes below theirs; short ones may dip into the reserve, but the routes
/// together hold no more than is beyond it. Never more than is free.
///
/// Short queues once took any free place: a slow route that came back short took up to a
/// call's 128 and held them for 13 s at 10/s, and the places gathered on a few routes. Then
/// what kept them short, up to an even part of all the places: a part of the reserve's too,
/// which left the readers nothing, and a reader waiting for its batch of places takes every
/// place given back until it has them, so routes that had given all theirs back waited seconds.
pub(crate) fn room(places: Places, short: usize, held: usize, active: usize) -> usize {
    let share = (places.total.saturating_sub(places.reserve) / active.max(1)).max(1);
    let left = share.saturating_sub(held);
    let beyond = (places.free + places.reading.min(places.reserve)).saturating_sub(places.reserve);
    beyond.max(short).min(places.free).min(left)
}

/// A seat on `route` of a worker of its own (for tests of what holds one).
#[cfg(test)]
pub(crate) fn seat_for_test(route: usize) -> Seat {
    let shares = Shares::new(vec![1; route + 1], Arc::new(Semaphore::new(1)), 1, 0, 0);
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

    #[test]
    fn parked_entries_are_taken_back_a_few_at_a_time_unless_the_plan_runs_dry() {
        let far = RUNS_DRY_US + 1;
        assert!(!take_back_now(0, 100, 0), "no room");
        assert!(!take_back_now(TAKE_BACK_AT_ONCE - 1, 100, far));
        assert!(take_back_now(TAKE_BACK_AT_ONCE, 100, far));
        // All that is parked, when fewer.
        assert!(take_back_now(3, 3, far) && !take_back_now(2, 3, far));
        // A plan about to end takes what it has room for, or one that ended.
        assert!(take_back_now(1, 100, RUNS_DRY_US) && take_back_now(1, 100, -5));
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
        assert_eq!(room(waiting, 0, 0, 1), 10);
        // Never more than is free: its reading is not the route's to take.
        let short = Places { free: 3, ..waiting };
        assert_eq!(room(short, 0, 0, 1), 3);
        assert_eq!(room(short, 100, 0, 1), 3);
    }

    /// The places kept from long queues grow by what a reader's last read weighed beyond a
    /// place an entry, and shrink back when a read weighs a place an entry again; at most half
    /// of all, and nothing where nothing is kept. A long queue's room follows: a route of large
    /// events no longer takes the places a read of its own entries is waiting for.
    #[test]
    fn the_reserve_keeps_what_the_reads_weigh() {
        let permits = Arc::new(Semaphore::new(10_000));
        let shares = Shares::new(vec![1_000; 2], permits.clone(), 10_000, 128, 2);
        // Route 0 a long queue (its plan far ahead), holding nothing yet.
        shares.queue(0, 60_000_000);
        assert_eq!(shares.reserve(), 128);
        assert_eq!(shares.room_with(0, 0), 10_000 - 128);
        // 16 entries of 144 places each read on stream 0.
        shares.read_weighed(0, 16, 16 * 144);
        assert_eq!(shares.reserve(), 128 + 16 * 143);
        assert_eq!(shares.room_with(0, 0), 10_000 - 128 - 16 * 143);
        // Both readers, then more than half: held to half.
        shares.read_weighed(1, 10, 10 * 144);
        assert_eq!(shares.reserve(), 128 + 16 * 143 + 10 * 143);
        shares.read_weighed(1, 10, 10 * 1_000);
        assert_eq!(shares.reserve(), 5_000);
        // Small entries again: back to a place an entry.
        shares.read_weighed(0, 64, 64);
        shares.read_weighed(1, 3, 3);
        assert_eq!(shares.reserve(), 128);
        // A worker that keeps nothing (one route, no inbound) keeps nothing for weights either.
        let lone = Shares::new(vec![1_000], permits, 10_000, 0, 1);
        lone.read_weighed(0, 16, 16 * 144);
        assert_eq!(lone.reserve(), 0);
    }

    /// A short queue takes as many places as its rate passes in what is left of a second (a
    /// 10/s route with nothing ahead takes 10, not every free place), of the reserve's too, but
    /// no more than its share.
    #[test]
    fn a_short_queue_takes_what_keeps_it_short_within_its_share() {
        assert_eq!(short(0, 100_000), 10);
        assert_eq!(short(-3, 100_000), 10);
        assert_eq!(short(850_000, 100_000), 2);
        assert_eq!(short(SHORT_QUEUE_US, 100_000), 0);
        assert_eq!(short(5 * SHORT_QUEUE_US, 100_000), 0);
        assert_eq!(short(0, 1_000), 1_000);
        // A share of 26 (80 / 3).
        assert_eq!(room(places(100, 50, 20), 7, 15, 3), 11);
        assert_eq!(room(places(100, 50, 20), 7, 25, 3), 1);
        assert_eq!(room(places(100, 5, 20), 7, 15, 3), 5);
        assert_eq!(room(places(100, 50, 20), 7, 40, 3), 0);
        // The reserve's places too (none free beyond it), within its share.
        assert_eq!(room(places(100, 20, 20), 5, 0, 3), 5);
        assert_eq!(room(places(100, 20, 20), 50, 0, 3), 20);
        assert_eq!(room(places(100, 20, 20), 50, 10, 3), 16);
        assert_eq!(room(places(100, 20, 20), 0, 0, 3), 0);
    }

    /// Many slow routes with backlogs, each taking back what its room allows every 10 ms (at
    /// most a call's 128) as its events go out, keep their rates together once the places have
    /// spread. With short queues taking any free place, a few routes gathered them: 300 routes
    /// of 10/s on 2,000 places passed 450–900 events a second in a worker, and 744 in this
    /// model (2,000 with short queues taking what keeps them short up to an even part of all
    /// the places).
    #[test]
    fn many_slow_routes_share_the_places_and_each_keeps_its_rate() {
        let (routes, interval, total, reserve) = (300usize, 100_000i64, 2000usize, 1000usize);
        // Per route: its sleeping events' slots, in order (its plan ends at the last).
        let mut asleep: Vec<std::collections::VecDeque<i64>> = vec![Default::default(); routes];
        let (tick, warmup, end) = (10_000i64, 5_000_000i64, 20_000_000i64);
        let (mut out, mut t) = (0usize, 0i64);
        while t < end {
            for q in asleep.iter_mut() {
                while q.front().is_some_and(|s| *s <= t) {
                    q.pop_front();
                    out += usize::from(t >= warmup);
                }
            }
            for r in 0..routes {
                let free = total - asleep.iter().map(|q| q.len()).sum::<usize>();
                let plan = asleep[r].back().copied().unwrap_or(t - interval);
                let short = short(plan - t, interval);
                // Every route has entries parked: all are active.
                let take = room(places(total, free, reserve), short, asleep[r].len(), routes);
                let mut next = (plan + interval).max(t);
                for _ in 0..take.min(128) {
                    asleep[r].push_back(next);
                    next += interval;
                }
            }
            t += tick;
        }
        let per_second = out as f64 / ((end - warmup) as f64 / 1e6);
        let rates = routes as f64 * 1e6 / interval as f64;
        assert!(
            per_second >= 0.95 * rates,
            "{per_second:.0} a second of {rates:.0}"
        );
    }

    #[test]
    fn a_long_queue_alone_takes_every_place_beyond_the_reserve() {
        assert_eq!(room(places(100, 100, 20), 0, 0, 1), 80);
        assert_eq!(room(places(100, 30, 20), 0, 70, 1), 10);
        assert_eq!(room(places(100, 20, 20), 0, 80, 1), 0);
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
                let take = room(places(total, free, reserve), 0, held[r], 2);
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
                let r = room(places(total, free, reserve), 0, before, active);
                held[route] += want.min(r);
                prop_assert!(held.iter().sum::<usize>() <= total - reserve, "{held:?}");
                let active = held.iter().filter(|h| **h > 0).count();
                let share = ((total - reserve) / active.max(1)).max(1);
                prop_assert!(held[route] <= before.max(share), "{held:?} share {share}");
            }
        }
    }
}
