//! The dispatcher's timers: the events held until their slots, in one map ordered by when each
//! should wake, and the lead learnt from how late dispatch calls land. Pure data and arithmetic
//! on instants handed in, so tests run them on fake time.

use crate::clock::RedisClock;
use crate::event::OutboundEvent;
use crate::worker::held::Hold;
use crate::worker::share::Seat;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

/// An event waiting for its slot. It holds what the dispatch needs and nothing more (a worker
/// may hold a hundred thousand): the event with its packed fields, and its decision.
pub(crate) struct Sleeper {
    pub(crate) event: OutboundEvent,
    /// Released when the event is finished or dropped: bounds what one process holds.
    pub(crate) permit: Hold,
    /// The route it sleeps on (its own or a fallback), where its places count in the route's
    /// share (`share`) until it is dropped.
    seat: Seat,
    /// Its recorded slot and the latest it may go (µs of Redis time).
    pub(crate) slot_us: i64,
    pub(crate) deadline_us: i64,
    /// When it was first decided on this route (for the wait it is written with).
    pub(crate) decided_us: i64,
    /// The Redis time to dispatch at: the slot, or a later time the gate named.
    pub(crate) target_us: i64,
    /// Whether this target was tried already (only first tries teach the lead).
    pub(crate) retried: bool,
}

impl Sleeper {
    /// An event decided to go out on the `seat`'s route at `slot_us`, by `deadline_us`; decided
    /// at `decided_us`.
    pub(crate) fn new(
        event: OutboundEvent,
        permit: Hold,
        seat: Seat,
        slot_us: i64,
        deadline_us: i64,
        decided_us: i64,
    ) -> Self {
        Sleeper {
            event,
            permit,
            seat,
            slot_us,
            deadline_us,
            decided_us,
            target_us: slot_us,
            retried: false,
        }
    }

    /// The route it sleeps on (`Route::index`).
    pub(crate) fn route(&self) -> usize {
        self.seat.route()
    }

    /// Moves it to a new slot (the dispatch script recorded it).
    pub(crate) fn moved(&mut self, slot_us: i64) {
        self.slot_us = slot_us;
        self.target_us = slot_us;
        self.retried = false;
    }
}

/// What a reply's own distance to a target is trusted to within: more than a reply's trip.
const TRIP_MARGIN_US: i64 = 1_000;
/// Where the dispatch call should land: this far after the target, inside its millisecond.
const AIM_AFTER_US: i64 = 250;
/// The most a wake-up is brought forward.
const LEAD_MAX_US: i64 = 900;

/// A sleeper in the queue: ordered by when it wakes, then by when it was queued. Boxed, so the
/// heap moves 32 bytes per entry, not the 200 of a sleeper. A B-tree of the sleepers themselves
/// (as before) held them in nodes that keys arriving in order leave about half full: some 450
/// bytes per sleeper, and a worker holding 100,000 asleep stood at 77 MiB. Now 32 + 208.
struct Queued {
    wake: Instant,
    seq: u64,
    sleeper: Box<Sleeper>,
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        (self.wake, self.seq) == (other.wake, other.seq)
    }
}

impl Eq for Queued {}

impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Queued {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.wake, self.seq).cmp(&(other.wake, other.seq))
    }
}

#[derive(Default)]
pub(crate) struct Timers {
    /// Earliest wake first.
    queue: BinaryHeap<Reverse<Queued>>,
    seq: u64,
    /// How much earlier than its target to wake an event, learnt from how long after waking the
    /// dispatch script actually runs (wake-up plus the request's trip to Redis). Landing inside
    /// the target's millisecond matters: on a burst-1 route a dispatch that slips into the next
    /// millisecond holds the following ones back by that millisecond too.
    lead_us: i64,
}

impl Timers {
    /// Queues an event for its target on Redis's clock (the lead is applied when it is due, so
    /// what the lead learns counts for every event already queued).
    pub(crate) fn insert(&mut self, clock: &RedisClock, s: Sleeper) {
        let wake = clock.local(s.target_us);
        self.requeue(s, wake);
    }

    /// Queues an event for a target a dispatch reply named: at its place on Redis's clock, but
    /// never before the reply's own distance to it from when the reply arrived (less a margin
    /// for the reply's trip). After Redis's clock steps, the mapped time can lie far too early
    /// for a while; this keeps the event from waking, being told "not yet", and waking again in
    /// a loop.
    pub(crate) fn insert_after_reply(
        &mut self,
        clock: &RedisClock,
        s: Sleeper,
        received: Instant,
        reply_end_us: i64,
    ) {
        let mapped = clock.local(s.target_us);
        let ahead = (s.target_us - reply_end_us - TRIP_MARGIN_US).max(0) as u64;
        self.requeue(s, mapped.max(received + Duration::from_micros(ahead)));
    }

    /// Queues an event to wake at `wake`.
    pub(crate) fn requeue(&mut self, s: Sleeper, wake: Instant) {
        self.queue.push(Reverse(Queued {
            wake,
            seq: self.seq,
            sleeper: Box::new(s),
        }));
        self.seq += 1;
    }

    pub(crate) fn lead(&self) -> Duration {
        Duration::from_micros(self.lead_us as u64)
    }

    pub(crate) fn lead_us(&self) -> i64 {
        self.lead_us
    }

    /// Learns from a dispatch call that ran `late_us` after its target (negative: early). One
    /// call's error counts for at most the lead's whole range: a call delayed by a descheduled
    /// thread says little about the next, and moving the lead by a quarter of its 3 ms sent the
    /// following calls in early, to be told "not yet" and land late.
    pub(crate) fn learn(&mut self, late_us: i64) {
        let error = (late_us - AIM_AFTER_US).clamp(-LEAD_MAX_US, LEAD_MAX_US);
        self.lead_us = (self.lead_us + error / 4).clamp(0, LEAD_MAX_US);
    }

    /// When the earliest event should be woken (its wake less the lead).
    pub(crate) fn next_wake(&self) -> Option<Instant> {
        self.queue.peek().map(|Reverse(q)| q.wake - self.lead())
    }

    /// Takes every event due by `now` (its wake within the lead of `now`).
    pub(crate) fn take_due(&mut self, now: Instant) -> Vec<Sleeper> {
        let by = now + self.lead();
        let mut due = Vec::new();
        while self.queue.peek().is_some_and(|Reverse(q)| q.wake <= by) {
            if let Some(Reverse(q)) = self.queue.pop() {
                due.push(*q.sleeper);
            }
        }
        // A heap that held a backlog keeps its capacity; give most of it back once it drains.
        if self.queue.capacity() > 1024 && self.queue.len() < self.queue.capacity() / 4 {
            self.queue.shrink_to(self.queue.len() * 2);
        }
        due
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, FakeClock};
    use crate::config::{Config, Overrides};
    use crate::event::{parse_outbound, Entry};

    fn sleeper(n: u64, slot_us: i64) -> Sleeper {
        let cfg = Config::parse(
            "outbound:\n  streams: [in]\n  routes:\n    r: {rate: 10/s}\n",
            &Overrides::default(),
        )
        .unwrap();
        let entry = Entry {
            stream: "in".into(),
            id: format!("{n}-0"),
            fields: vec![(b"route".to_vec(), b"r".to_vec())],
            deliveries: 1,
        };
        let event = parse_outbound(entry, &cfg.outbound).unwrap();
        let permit = crate::worker::held::hold_for_test();
        let seat = crate::worker::share::seat_for_test(0);
        Sleeper::new(event, permit, seat, slot_us, slot_us + 1_000_000, 0)
    }

    /// A Redis clock that reads `redis_us` at `at`.
    fn redis_clock(at: Instant, redis_us: i64) -> RedisClock {
        let clock = RedisClock::new(at);
        clock.observe(redis_us, at);
        clock
    }

    #[test]
    fn events_wake_in_slot_order_at_the_local_time_of_their_slot() {
        let time = FakeClock::new(Instant::now());
        let clock = redis_clock(time.now(), 1_000_000);
        let mut timers = Timers::default();
        timers.insert(&clock, sleeper(1, 1_300_000));
        timers.insert(&clock, sleeper(2, 1_100_000));
        timers.insert(&clock, sleeper(3, 1_200_000));
        assert_eq!(
            timers.next_wake(),
            Some(time.now() + Duration::from_millis(100))
        );
        time.advance(Duration::from_millis(99));
        assert!(timers.take_due(time.now()).is_empty());
        time.advance(Duration::from_millis(101));
        let due: Vec<i64> = timers
            .take_due(time.now())
            .iter()
            .map(|s| s.slot_us)
            .collect();
        assert_eq!(due, vec![1_100_000, 1_200_000]);
        assert_eq!(timers.len(), 1);
    }

    #[test]
    fn the_lead_wakes_events_early_by_what_it_learnt_and_stays_bounded() {
        let time = FakeClock::new(Instant::now());
        let clock = redis_clock(time.now(), 0);
        let mut timers = Timers::default();
        // Calls landing 2 ms late teach a lead, up to its bound.
        for _ in 0..50 {
            timers.learn(2_250);
        }
        assert_eq!(timers.lead_us(), LEAD_MAX_US);
        timers.insert(&clock, sleeper(1, 10_000));
        let due_at = time.now() + Duration::from_micros(10_000 - LEAD_MAX_US as u64);
        assert_eq!(timers.next_wake(), Some(due_at));
        // Calls landing right on the aim leave it be; early ones bring it back.
        let before = timers.lead_us();
        timers.learn(AIM_AFTER_US);
        assert_eq!(timers.lead_us(), before);
        for _ in 0..50 {
            timers.learn(-2_000);
        }
        assert_eq!(timers.lead_us(), 0);
        // One call landing far out moves it by at most a quarter of its range.
        timers.learn(50_000);
        assert_eq!(timers.lead_us(), LEAD_MAX_US / 4);
    }

    #[test]
    fn a_reply_keeps_an_event_from_waking_before_its_distance_to_the_target() {
        let time = FakeClock::new(Instant::now());
        // The mapping says Redis is 2 s behind what it now is (its clock stepped forward).
        let clock = redis_clock(time.now(), 0);
        let mut timers = Timers::default();
        let s = sleeper(1, 2_050_000);
        // The reply says Redis reads 2 000 000 µs: the target is 50 ms away, not 2.05 s.
        timers.insert_after_reply(&clock, s, time.now(), 2_000_000);
        // Mapped, it would wake at 2.05 s; the reply's distance (less the margin) is earlier,
        // so the mapping wins here.
        assert_eq!(
            timers.next_wake(),
            Some(time.now() + Duration::from_millis(2_050))
        );
        // The other way round (Redis's clock stepped back 2 s): mapped, the target looks 2 s
        // in the past; the reply's distance holds the wake-up 49 ms away instead of now.
        let clock = redis_clock(time.now(), 4_000_000);
        let mut timers = Timers::default();
        timers.insert_after_reply(&clock, sleeper(2, 2_050_000), time.now(), 2_000_000);
        assert_eq!(
            timers.next_wake(),
            Some(time.now() + Duration::from_millis(49))
        );
    }

    #[test]
    fn an_event_due_within_the_lead_is_taken() {
        let time = FakeClock::new(Instant::now());
        let clock = redis_clock(time.now(), 0);
        let mut timers = Timers::default();
        timers.learn(AIM_AFTER_US + 4 * 200);
        timers.learn(AIM_AFTER_US + 4 * 200);
        assert_eq!(timers.lead_us(), 400);
        timers.insert(&clock, sleeper(1, 5_000));
        time.advance(Duration::from_micros(4_599));
        assert!(timers.take_due(time.now()).is_empty());
        time.advance(Duration::from_micros(1));
        assert_eq!(timers.take_due(time.now()).len(), 1);
    }
}
