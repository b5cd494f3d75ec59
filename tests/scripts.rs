//! The pacing and output scripts called directly against a real redis-server: the rate held at
//! the moment of dispatch, decisions recorded and never taken twice, slots that can no longer be
//! met moved within their deadline, writes to shared streams made once, acknowledgements made in
//! the same step as the output, and arguments checked before anything is written.
//!
//! Over 400 lines: one subject's script-level tests sharing one rig.

mod common;

use common::consumer_table;
use pacer::config::{Config, Overrides};
use pacer::event::Fields;
use pacer::keys::OutputKeys;
use pacer::marker::Marker;
use pacer::pacing::LATE_US;
use pacer::scripts::{
    DispatchItem, Dispatched, EmitCall, EmitItem, EventRef, RouteCall, RouteDispatch, ScheduleItem,
    ScheduleReply, Scheduled, Scripts, Voided, Writing, LIB,
};
use pacer::testkit::RedisServer;
use std::time::Duration;

const GROUP: &str = "pacer";
const TTL_MS: u64 = 600_000;

/// An event due for dispatch: its entry, slot and deadline (decided `s<slot>:<deadline>`).
type Due<'a> = (&'a str, i64, i64);

/// Routes `r` and `q`, alike.
fn route_configs(rate: &str, burst: u32) -> (pacer::config::Route, pacer::config::Route) {
    let route = format!("{{rate: {rate}, burst: {burst}, max_wait: 5s}}");
    let yaml = format!("outbound:\n  streams: [in]\n  routes:\n    r: {route}\n    q: {route}\n");
    let routes = Config::parse(&yaml, &Overrides::default())
        .unwrap()
        .outbound
        .routes;
    (routes["r"].clone(), routes["q"].clone())
}

/// A test event's own fields: (name, value) pairs.
type Own = Vec<(Vec<u8>, Vec<u8>)>;

/// The fields of test event `n`: one of its own (pacer's are the scripts').
fn ready(n: usize) -> Own {
    vec![(b"n".to_vec(), n.to_string().into_bytes())]
}

/// Test event `n` with `n % 4` fields of its own, for calls whose events differ in their count.
fn ready_varied(n: usize) -> Own {
    (0..n % 4)
        .map(|f| {
            (
                format!("f{f}").into_bytes(),
                format!("{n}.{f}").into_bytes(),
            )
        })
        .collect()
}

fn pairs(f: &[(Vec<u8>, Vec<u8>)]) -> Vec<(&[u8], &[u8])> {
    f.iter()
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect()
}

/// An event for the scripts: its input entry (of stream `in`), its id if it carries one, cost,
/// and the Redis µs its wait counts from (0: the call's time).
struct Ev {
    entry: String,
    id: Option<&'static str>,
    cost: u64,
    since_us: i64,
}

fn ev(entry: &str) -> Ev {
    Ev {
        entry: entry.to_string(),
        id: None,
        cost: 1,
        since_us: 0,
    }
}

/// What a test call writes with: TTL_MS, a 1000-entry trim, GROUP, acknowledging per `acks`.
fn writing(acks: &(dyn Fn(&str) -> bool + Sync)) -> Writing<'_> {
    Writing {
        ttl_ms: TTL_MS,
        max_len: 1000,
        group: GROUP,
        acks,
    }
}

fn route_call<'a>(
    route: &'a pacer::config::Route,
    acks: &'a (dyn Fn(&str) -> bool + Sync),
) -> RouteCall<'a> {
    RouteCall {
        name: &route.name,
        keys: &route.keys,
        bucket: &route.bucket,
        out: writing(acks),
    }
}

struct Rig {
    redis: RedisServer,
    con: redis::aio::MultiplexedConnection,
    scripts: Scripts,
    route: pacer::config::Route,
    /// Another route (`q`), for calls on several.
    other: pacer::config::Route,
    rt: tokio::runtime::Runtime,
    /// Whether the scripts acknowledge input entries themselves.
    acks: bool,
}

impl Rig {
    fn new(rate: &str, burst: u32) -> Self {
        let redis = RedisServer::start();
        let (rt, con) = redis.async_con();
        let (route, other) = route_configs(rate, burst);
        Rig {
            redis,
            con,
            scripts: Scripts::default(),
            route,
            other,
            rt,
            acks: false,
        }
    }

    fn schedule_with(
        &mut self,
        events: &[Ev],
        max_wait_us: i64,
        ages: (i64, i64),
    ) -> (i64, Vec<Scheduled>) {
        let route = self.route.clone();
        let reply = self.schedule_on(&route, events, max_wait_us, ages, ready);
        (reply.now_us, reply.items)
    }

    /// Schedules `events` on `route`, event n carrying the fields `fields_of(n)`.
    fn schedule_on(
        &mut self,
        route: &pacer::config::Route,
        events: &[Ev],
        max_wait_us: i64,
        ages: (i64, i64),
        fields_of: fn(usize) -> Own,
    ) -> ScheduleReply {
        let fields: Vec<_> = (0..events.len()).map(fields_of).collect();
        let pairs: Vec<_> = fields.iter().map(|f| pairs(f)).collect();
        let items: Vec<ScheduleItem<'_>> = events
            .iter()
            .zip(&pairs)
            .map(|(e, fields)| ScheduleItem {
                event: EventRef {
                    stream: "in",
                    entry_id: &e.entry,
                    entry_ms: pacer::event::entry_ms(&e.entry),
                    cost: e.cost,
                    fields,
                },
                claim: e.id,
                expect: None,
                max_wait_us,
                deadline_us: 0,
                since_us: e.since_us,
            })
            .collect();
        let acks = self.acks;
        let ack = move |_: &str| acks;
        let call = route_call(route, &ack);
        self.rt
            .block_on(self.scripts.schedule(
                &mut self.con,
                &call,
                (ages.0, ages.1, max_wait_us),
                &items,
            ))
            .unwrap()
    }

    fn schedule(&mut self, events: &[Ev], max_wait_us: i64) -> (i64, Vec<Scheduled>) {
        self.schedule_with(events, max_wait_us, (i64::MAX / 2, 0))
    }

    /// Dispatches (entry, slot, deadline) triples, each with the decision `s<slot>:<deadline>`.
    fn dispatch(&mut self, events: &[(&str, i64, i64)]) -> Vec<Dispatched> {
        let route = self.route.clone();
        self.dispatch_on(&[(&route, events)])
    }

    /// Dispatches on several routes in one call: the answers route after route.
    fn dispatch_on(&mut self, routes: &[(&pacer::config::Route, &[Due<'_>])]) -> Vec<Dispatched> {
        let fields: Vec<Vec<_>> = routes
            .iter()
            .map(|(_, events)| (0..events.len()).map(ready).collect())
            .collect();
        let pairs: Vec<Vec<_>> = fields
            .iter()
            .map(|f| f.iter().map(|f| pairs(f)).collect())
            .collect();
        let items: Vec<Vec<DispatchItem<'_>>> = routes
            .iter()
            .zip(&pairs)
            .map(|((_, events), pairs)| {
                events
                    .iter()
                    .zip(pairs)
                    .map(|((entry, slot, deadline), fields)| DispatchItem {
                        event: EventRef {
                            stream: "in",
                            entry_id: entry,
                            entry_ms: 0,
                            cost: 1,
                            fields,
                        },
                        slot_us: *slot,
                        deadline_us: *deadline,
                        decided_us: 0,
                    })
                    .collect()
            })
            .collect();
        let acks = self.acks;
        let ack = move |_: &str| acks;
        let calls: Vec<RouteDispatch<'_>> = routes
            .iter()
            .zip(&items)
            .map(|((route, _), items)| RouteDispatch {
                call: route_call(route, &ack),
                items,
            })
            .collect();
        self.rt
            .block_on(self.scripts.dispatch(&mut self.con, &calls))
            .unwrap()
            .items
    }

    fn ready_len_of(&mut self, route: &pacer::config::Route) -> usize {
        self.rt
            .block_on(
                redis::cmd("XLEN")
                    .arg(&route.keys.ready)
                    .query_async(&mut self.con),
            )
            .unwrap()
    }

    fn ready_len(&mut self) -> usize {
        let route = self.route.clone();
        self.ready_len_of(&route)
    }

    fn keys(&mut self) -> Vec<String> {
        self.rt
            .block_on(redis::cmd("KEYS").arg("*").query_async(&mut self.con))
            .unwrap()
    }
}

/// Dispatches one event, coming back when told to (never before its slot), until it settles.
fn settle(rig: &mut Rig, entry: &str, slot: i64, deadline: i64) -> Dispatched {
    for _ in 0..100 {
        let out = rig.dispatch(&[(entry, slot, deadline)]).remove(0);
        match out {
            Dispatched::NotBefore { at_us } => {
                assert!(at_us >= slot, "told to come back before the slot");
                std::thread::sleep(Duration::from_millis(10));
            }
            settled => return settled,
        }
    }
    panic!("{entry} never settled");
}

fn slot_of(s: &Scheduled) -> i64 {
    match s {
        Scheduled::Sleep { slot_us } => *slot_us,
        other => panic!("expected a slot, got {other:?}"),
    }
}

/// The routes a worker has due at one moment go in one call: each is judged by its own bucket at
/// one reading of Redis's clock, each event is written to its own route's ready stream, the
/// answers come route after route, and one route's events held back do not hold another's.
#[test]
fn one_call_dispatches_several_routes_each_by_its_own_bucket() {
    let mut rig = Rig::new("10/s", 1);
    let (r, q) = (rig.route.clone(), rig.other.clone());
    let ages = (i64::MAX / 2, 0);
    // On each route the first event goes at once and the others sleep an interval (100 ms) apart.
    let on_r = rig.schedule_on(&r, &[ev("1-0"), ev("2-0")], 5_000_000, ages, ready);
    let on_q = rig.schedule_on(
        &q,
        &[ev("3-0"), ev("4-0"), ev("5-0")],
        5_000_000,
        ages,
        ready,
    );
    let (now, on_r, now_q, on_q) = (on_r.now_us, on_r.items, on_q.now_us, on_q.items);
    assert!(matches!(on_r[0], Scheduled::Dispatched { .. }), "{on_r:?}");
    assert!(matches!(on_q[0], Scheduled::Dispatched { .. }), "{on_q:?}");
    let (r2, q4, q5) = (slot_of(&on_r[1]), slot_of(&on_q[1]), slot_of(&on_q[2]));
    assert_eq!(q5 - q4, 100_000);
    let (dl_r, dl_q) = (now + 5_000_000 + LATE_US, now_q + 5_000_000 + LATE_US);
    let due_r = [("2-0", r2, dl_r)];
    let due_q = [("4-0", q4, dl_q), ("5-0", q5, dl_q)];
    // Too early for all three: each told to come back at its own slot, nothing written.
    let early = rig.dispatch_on(&[(&r, &due_r), (&q, &due_q)]);
    assert_eq!(
        early,
        vec![
            Dispatched::NotBefore { at_us: r2 },
            Dispatched::NotBefore { at_us: q4 },
            Dispatched::NotBefore { at_us: q5 }
        ]
    );
    assert_eq!((rig.ready_len_of(&r), rig.ready_len_of(&q)), (1, 1));
    // Once r's and q's second slots have passed: both go, q's third still waits for its own.
    std::thread::sleep(Duration::from_millis(120));
    let out = rig.dispatch_on(&[(&r, &due_r), (&q, &due_q)]);
    assert!(matches!(out[0], Dispatched::Done { .. }), "{out:?}");
    assert!(matches!(out[1], Dispatched::Done { .. }), "{out:?}");
    assert_eq!(out[2], Dispatched::NotBefore { at_us: q5 }, "{out:?}");
    assert_eq!((rig.ready_len_of(&r), rig.ready_len_of(&q)), (2, 2));
    let written = |rig: &mut Rig, route: &pacer::config::Route| {
        rig.rt
            .block_on(pacer::report::read_all(&mut rig.con, &route.keys.ready))
            .unwrap()
            .iter()
            .map(|e| {
                let field = |f| e.field(f).unwrap_or_default().to_string();
                (field("pacer_route"), field("pacer_source_id"))
            })
            .collect::<Vec<_>>()
    };
    let pair = |route: &str, id: &str| (route.to_string(), id.to_string());
    assert_eq!(
        written(&mut rig, &r),
        vec![pair("r", "1-0"), pair("r", "2-0")]
    );
    assert_eq!(
        written(&mut rig, &q),
        vec![pair("q", "3-0"), pair("q", "4-0")]
    );
    // Each decision is recorded on its own route: asked again, both are superseded.
    let again = rig.dispatch_on(&[(&r, &due_r[..]), (&q, &due_q[..1])]);
    assert!(
        again
            .iter()
            .all(|d| matches!(d, Dispatched::Superseded(v) if v.starts_with('d'))),
        "{again:?}"
    );
}

/// The trap the design names: slots planned 1/rate apart, dispatched late all at once. The
/// dispatch script lets one through, and moves each of the others to its own later slot, one
/// interval apart on Redis's clock (not all to the same time, which would bring them back
/// together and let one through per call).
#[test]
fn slots_dispatched_late_do_not_bunch_and_queue_one_behind_the_other() {
    let mut rig = Rig::new("20/s", 1);
    let entries = ["1-0", "2-0", "3-0", "4-0", "5-0"];
    let events: Vec<Ev> = entries.iter().map(|e| ev(e)).collect();
    let (now, decided) = rig.schedule(&events, 5_000_000);
    assert!(matches!(decided[0], Scheduled::Dispatched { .. }));
    let slots: Vec<i64> = decided[1..].iter().map(slot_of).collect();
    assert!(slots.windows(2).all(|w| w[1] - w[0] == 50_000), "{slots:?}");
    // Every slot has passed by the time this worker wakes.
    std::thread::sleep(Duration::from_millis(300));
    let deadline = now + 5_000_000 + LATE_US;
    let late: Vec<(&str, i64, i64)> = entries[1..]
        .iter()
        .zip(&slots)
        .map(|(e, slot)| (*e, *slot, deadline))
        .collect();
    let out = rig.dispatch(&late);
    assert!(matches!(out[0], Dispatched::Done { .. }), "{out:?}");
    let moved: Vec<i64> = out[1..]
        .iter()
        .map(|d| match d {
            Dispatched::Moved { slot_us } => *slot_us,
            other => panic!("expected a moved slot, got {other:?}"),
        })
        .collect();
    assert!(moved.windows(2).all(|w| w[1] - w[0] == 50_000), "{moved:?}");
    assert_eq!(rig.ready_len(), 2);
    // The moved slots are recorded: a dispatch with the old decision is superseded, one with the
    // new decision goes when its slot comes.
    let stale = rig.dispatch(&[(entries[2], slots[1], deadline)]).remove(0);
    assert!(
        matches!(stale, Dispatched::Superseded(ref v) if v.starts_with('s')),
        "{stale:?}"
    );
    let moved_on = settle(&mut rig, entries[2], moved[0], deadline);
    assert!(matches!(moved_on, Dispatched::Done { .. }), "{moved_on:?}");
}

/// A slot that cannot be met before the event's deadline is given up on this route (a stalled
/// worker woke too late): the event is passed over (its next route, or a rejection), recorded
/// so, never held or sent past its deadline.
#[test]
fn a_slot_past_its_deadline_leaves_the_route() {
    let mut rig = Rig::new("10/s", 1);
    let (now, decided) = rig.schedule(&[ev("1-0"), ev("2-0")], 150_000);
    let slot = slot_of(&decided[1]);
    let deadline = now + 150_000 + LATE_US;
    // The worker wakes 300 ms after the call: past the slot and the deadline.
    std::thread::sleep(Duration::from_millis(300));
    let out = rig.dispatch(&[("2-0", slot, deadline)]).remove(0);
    assert!(matches!(out, Dispatched::TooLate { .. }), "{out:?}");
    let again = rig.dispatch(&[("2-0", slot, deadline)]).remove(0);
    assert!(
        matches!(again, Dispatched::Superseded(ref v) if v.starts_with('x')),
        "passed over and recorded so: {again:?}"
    );
    assert_eq!(rig.ready_len(), 1);
}

/// A stalled worker that wakes past a slot but within the deadline sends the event now, as a
/// new slot (recorded on the entry), never late against the slot it is written with.
#[test]
fn a_slot_missed_within_the_deadline_goes_now_as_a_new_slot() {
    let mut rig = Rig::new("10/s", 1);
    let (now, decided) = rig.schedule(&[ev("1-0"), ev("2-0")], 5_000_000);
    let slot = slot_of(&decided[1]);
    std::thread::sleep(Duration::from_millis(400));
    let out = rig
        .dispatch(&[("2-0", slot, now + 5_000_000 + LATE_US)])
        .remove(0);
    let Dispatched::Done { ms } = out else {
        panic!("{out:?}");
    };
    let ready = rig
        .rt
        .block_on(pacer::report::read_all(&mut rig.con, &rig.route.keys.ready))
        .unwrap();
    let entry = ready.iter().find(|e| e.ms == ms).unwrap();
    let written: i64 = entry.field("pacer_slot_us").unwrap().parse().unwrap();
    // Written with the dispatch's own time: at least the 400 ms slept after the schedule's
    // (less 1 ms for a wall clock slewed meanwhile). The old slot is within 101 ms of the
    // schedule (rounded up to its millisecond), so `slot + 300 ms` could miss by that rounding.
    assert!(
        written >= now + 399_000,
        "written with its old slot {slot} (scheduled at {now}): {written}"
    );
    assert!(
        entry.ms * 1000 - written <= 1_000,
        "late against its own slot"
    );
    let wait: i64 = entry.field("pacer_wait_ms").unwrap().parse().unwrap();
    assert!(wait >= 400, "the wait counts from the decision: {wait}");
}

#[test]
fn an_event_that_would_wait_too_long_reserves_nothing() {
    let mut rig = Rig::new("10/s", 1);
    rig.schedule(&[ev("1-0"), ev("2-0")], 5_000_000);
    let (_, out) = rig.schedule(&[ev("3-0"), ev("4-0")], 150_000);
    // 3-0 would wait ~200 ms > 150 ms: refused with that wait, and 4-0 gets the same offer.
    let waits: Vec<i64> = out
        .iter()
        .map(|s| match s {
            Scheduled::TooLong { wait_us } => *wait_us,
            other => panic!("{other:?}"),
        })
        .collect();
    // (Judged on the slot's first whole millisecond.)
    assert!(waits[0] > 150_000 && waits[0] <= 201_000, "{waits:?}");
    assert!(
        (waits[1] - waits[0]).abs() < 5_000,
        "a refused event must not move the plan: {waits:?}"
    );
}

#[test]
fn a_decision_is_recorded_once_and_dispatch_happens_once() {
    let mut rig = Rig::new("10/s", 1);
    rig.schedule(&[ev("1-0")], 5_000_000);
    let with_id = |entry: &str| Ev {
        id: Some("call-7"),
        ..ev(entry)
    };
    let (now, out) = rig.schedule(&[with_id("2-0")], 5_000_000);
    let slot = slot_of(&out[0]);
    let deadline = now + 5_000_000 + LATE_US;
    let decision = Marker::Slot {
        slot_us: slot,
        deadline_us: deadline,
    }
    .encode();
    // A redelivery of the same entry finds its decision instead of taking another slot.
    let (_, again) = rig.schedule(&[with_id("2-0")], 5_000_000);
    assert_eq!(again[0], Scheduled::Decided(decision));
    // Another entry with the same event id is told whose it is (a duplicate).
    let (_, dup) = rig.schedule(&[with_id("9-0")], 5_000_000);
    assert_eq!(dup[0], Scheduled::Duplicate("2-0@in".into()));
    // Two entries with one id in the same call: the second is the duplicate.
    let (_, pair) = rig.schedule(
        &[
            Ev {
                id: Some("call-8"),
                ..ev("10-0")
            },
            Ev {
                id: Some("call-8"),
                ..ev("11-0")
            },
        ],
        5_000_000,
    );
    assert_eq!(pair[1], Scheduled::Duplicate("10-0@in".into()));

    let first = settle(&mut rig, "2-0", slot, deadline);
    assert!(matches!(first, Dispatched::Done { .. }), "{first:?}");
    // Two workers holding the same decision: the second dispatch finds it done.
    let second = settle(&mut rig, "2-0", slot, deadline);
    assert!(
        matches!(&second, Dispatched::Superseded(v) if v.starts_with('d')),
        "{second:?}"
    );
    // A stale decision (another worker re-decided the event) cannot dispatch either.
    let stale = settle(&mut rig, "2-0", slot - 1, deadline);
    assert!(matches!(stale, Dispatched::Superseded(_)));
    assert_eq!(rig.ready_len(), 2);

    // One entry twice in one call (a worker holding two deliveries of it): decided once, the
    // second finds the first's decision...
    let (now, twice) = rig.schedule(&[ev("12-0"), ev("12-0")], 5_000_000);
    let slot = slot_of(&twice[0]);
    let deadline = now + 5_000_000 + LATE_US;
    let decided = Marker::Slot {
        slot_us: slot,
        deadline_us: deadline,
    }
    .encode();
    assert_eq!(twice[1], Scheduled::Decided(decided), "{twice:?}");
    // ...and dispatched once: the second finds it done.
    let mut both = Vec::new();
    for _ in 0..100 {
        both = rig.dispatch(&[("12-0", slot, deadline), ("12-0", slot, deadline)]);
        if !matches!(both[0], Dispatched::NotBefore { .. }) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(matches!(both[0], Dispatched::Done { .. }), "{both:?}");
    assert!(
        matches!(&both[1], Dispatched::Superseded(v) if v.starts_with('d')),
        "{both:?}"
    );
    assert_eq!(rig.ready_len(), 3);
}

/// An event costing more units than the route's burst could never pass: the script never
/// dispatches it (the worker refuses such events before, as malformed).
#[test]
fn a_cost_above_the_burst_never_passes_and_a_burst_sized_one_passes_once() {
    let mut rig = Rig::new("10/s", 3);
    let (_, out) = rig.schedule(
        &[
            Ev {
                cost: 4,
                ..ev("1-0")
            },
            Ev {
                cost: 3,
                ..ev("2-0")
            },
            ev("3-0"),
        ],
        5_000_000,
    );
    assert!(matches!(out[0], Scheduled::TooLong { .. }), "{out:?}");
    assert!(matches!(out[1], Scheduled::Dispatched { .. }), "{out:?}");
    // The burst is spent: the next unit waits one interval, not three.
    let wait = slot_of(&out[2]);
    assert!(wait > 0);
    assert_eq!(rig.ready_len(), 1);
}

/// Read too old: past the route's max_age it is not placed; past dedupe_ttl with no decision on
/// record it is not decided at all (one may have expired). Neither writes a decision.
#[test]
fn an_entry_read_too_old_is_expired_or_stale_and_records_nothing() {
    let mut rig = Rig::new("10/s", 1);
    let old = format!("{}-0", common_now_ms(&rig) - 10_000);
    let (_, out) = rig.schedule_with(&[ev(&old)], 5_000_000, (60_000_000, 5_000_000));
    assert!(
        matches!(out[0], Scheduled::Expired(age) if age >= 10_000_000),
        "{out:?}"
    );
    let (_, out) = rig.schedule_with(&[ev(&old)], 5_000_000, (5_000_000, 0));
    assert!(
        matches!(out[0], Scheduled::Stale(age) if age >= 10_000_000),
        "{out:?}"
    );
    assert!(
        rig.keys().iter().all(|k| !k.contains(":dec:")),
        "{:?}",
        rig.keys()
    );
    assert_eq!(rig.ready_len(), 0);
}

fn common_now_ms(rig: &Rig) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut rig.redis.con()).unwrap();
    s * 1000 + us / 1000
}

/// A pacing call reads its ready stream's newest entry only past its bucket's last dispatch (an
/// empty range, in the usual case); an entry something else wrote ahead of that is still seen,
/// and the call writes after it instead of failing in the middle of its writes: with the bucket
/// kept, with the bucket lost, and on the dispatch path.
#[test]
fn a_ready_entry_written_ahead_by_something_else_is_written_after() {
    let mut rig = Rig::new("10/s", 1);
    let ready = rig.route.keys.ready.clone();
    let foreign = |rig: &Rig, ms: i64| {
        let _: String = redis::cmd("XADD")
            .arg(&ready)
            .arg(format!("{ms}-0"))
            .arg("foreign")
            .arg("1")
            .query(&mut rig.redis.con())
            .unwrap();
    };
    let dispatched_ms = |s: &Scheduled| match s {
        Scheduled::Dispatched { ms } => *ms,
        other => panic!("{other:?}"),
    };
    // The first event goes at once (the bucket now holds its dispatch); the second sleeps.
    let (now, out) = rig.schedule(&[ev("1-0"), ev("2-0")], 5_000_000);
    dispatched_ms(&out[0]);
    let slot = slot_of(&out[1]);
    // Written ahead of Redis's clock: the sleeper's dispatch goes after it, late but within
    // its deadline.
    let ahead = common_now_ms(&rig) + 2_000;
    foreign(&rig, ahead);
    std::thread::sleep(Duration::from_millis(120));
    let out = rig.dispatch(&[("2-0", slot, now + 5_000_000 + LATE_US)]);
    assert_eq!(out, [Dispatched::Done { ms: ahead }]);
    // The bucket lost, and another entry further ahead: the next event goes after that one.
    let _: () = redis::cmd("DEL")
        .arg(&rig.route.keys.bucket)
        .query(&mut rig.redis.con())
        .unwrap();
    foreign(&rig, ahead + 1_000);
    let (_, out) = rig.schedule(&[ev("3-0")], 5_000_000);
    assert_eq!(dispatched_ms(&out[0]), ahead + 1_000);
    // Ready entries: the two foreign ones and three of pacer's, each after the one before.
    assert_eq!(rig.ready_len(), 5);
}

/// Where the scripts may acknowledge (the input stream shares their slot, or Redis is not a
/// cluster), the input entry is acknowledged in the same step as its ready entry: it can never
/// be both dispatched and pending.
#[test]
fn an_entry_is_acknowledged_in_the_step_that_dispatches_it() {
    let mut rig = Rig::new("10/s", 1);
    rig.acks = true;
    let mut con = rig.redis.con();
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("in")
        .arg(GROUP)
        .arg("0")
        .arg("MKSTREAM")
        .query(&mut con)
        .unwrap();
    let ids: Vec<String> = (0..2)
        .map(|_| {
            redis::cmd("XADD")
                .arg("in")
                .arg("*")
                .arg("route")
                .arg("r")
                .query(&mut con)
                .unwrap()
        })
        .collect();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg("w")
        .arg("STREAMS")
        .arg("in")
        .arg(">")
        .query(&mut con)
        .unwrap();
    let pending = |con: &mut redis::Connection| -> i64 {
        let v: (i64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
            .arg("in")
            .arg(GROUP)
            .query(con)
            .unwrap();
        v.0
    };
    assert_eq!(pending(&mut con), 2);
    let (now, out) = rig.schedule(&[ev(&ids[0]), ev(&ids[1])], 5_000_000);
    assert!(matches!(out[0], Scheduled::Dispatched { .. }));
    assert_eq!(
        pending(&mut con),
        1,
        "the dispatched one is acknowledged, the sleeping one not"
    );
    let slot = slot_of(&out[1]);
    assert!(matches!(
        settle(&mut rig, &ids[1], slot, now + 5_000_000 + LATE_US),
        Dispatched::Done { .. }
    ));
    assert_eq!(pending(&mut con), 0);
}

/// Each ready entry carries pacer's fields and then exactly its own event's, byte for byte,
/// whatever the number of fields of the events around it in the call.
#[test]
fn each_ready_entry_carries_its_own_events_fields() {
    let mut rig = Rig::new("1000/ms", 1_000_000);
    let events: Vec<Ev> = (1..=9).map(|i| ev(&format!("{i}-0"))).collect();
    let route = rig.route.clone();
    let out = rig
        .schedule_on(&route, &events, 1_000_000, (i64::MAX / 2, 0), ready_varied)
        .items;
    assert!(out
        .iter()
        .all(|s| matches!(s, Scheduled::Dispatched { .. })));
    let mut con = rig.redis.con();
    let entries: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(&route.keys.ready)
        .arg("-")
        .arg("+")
        .query(&mut con)
        .unwrap();
    assert_eq!(entries.len(), 9);
    for (n, (_, flat)) in entries.iter().enumerate() {
        let pacer: Vec<&[u8]> = flat[..10].iter().step_by(2).map(|v| v.as_slice()).collect();
        assert_eq!(
            pacer,
            [
                &b"pacer_route"[..],
                b"pacer_source_stream",
                b"pacer_source_id",
                b"pacer_slot_us",
                b"pacer_wait_ms"
            ]
        );
        assert_eq!(flat[5], format!("{}-0", n + 1).into_bytes());
        let own: Own = flat[10..]
            .chunks(2)
            .map(|p| (p[0].clone(), p[1].clone()))
            .collect();
        assert_eq!(own, ready_varied(n), "event {}", n + 1);
    }
}

/// An event passed on to a fallback after it waited on another route (`since_us`, its first
/// decision's time) and dispatched there at once says in its ready entry how long it waited
/// since then; an event decided now says 0 (before, both said 0).
#[test]
fn a_ready_entry_counts_its_wait_from_the_events_first_decision() {
    let mut rig = Rig::new("1000/ms", 1_000_000);
    let now = common_now_ms(&rig) * 1000;
    let events = [
        ev("1-0"),
        Ev {
            since_us: now - 2_345_678,
            ..ev("2-0")
        },
    ];
    let (_, out) = rig.schedule(&events, 1_000_000);
    assert!(
        out.iter()
            .all(|s| matches!(s, Scheduled::Dispatched { .. })),
        "{out:?}"
    );
    let waits: Vec<i64> = read_ready(&rig)
        .iter()
        .map(|flat| String::from_utf8_lossy(&flat[9]).parse().unwrap())
        .collect();
    assert_eq!(waits.len(), 2);
    assert_eq!(waits[0], 0);
    // Decided a few ms after `now` was read.
    assert!((2345..2345 + 500).contains(&waits[1]), "{waits:?}");
}

/// The ready stream's entries (their fields, flat), oldest first.
fn read_ready(rig: &Rig) -> Vec<Vec<Vec<u8>>> {
    let mut con = rig.redis.con();
    let entries: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(&rig.route.keys.ready)
        .arg("-")
        .arg("+")
        .query(&mut con)
        .unwrap();
    entries.into_iter().map(|(_, flat)| flat).collect()
}

/// Bad arguments fail the call before anything is written: no ready entry, no decision, no
/// bucket, even when the bad event comes after good ones.
#[test]
fn a_script_checks_every_argument_before_it_writes() {
    let rig = Rig::new("10/s", 1);
    let mut con = rig.redis.con();
    let script = redis::Script::new(pacer::scripts::SCHEDULE);
    let call = |con: &mut redis::Connection, second_spec: &str| {
        let mut inv = script.prepare_invoke();
        inv.key("b{r}").key("ready{r}").key("dec{r}");
        inv.arg(100_000).arg(0).arg(60_000).arg(1000).arg(GROUP);
        inv.arg(100_000_000_000_000_000i64)
            .arg(0)
            .arg("r")
            .arg(5_000_000)
            .arg(1);
        inv.arg(1).arg(0).arg(0).arg(2);
        inv.arg(2).arg(0).arg("in");
        // A good event, then one whose spec is `second_spec` while it passes one field.
        inv.arg("1-0").arg(1).arg("n").arg("1");
        inv.arg("2-0").arg(second_spec).arg("n").arg("2");
        inv.invoke::<redis::Value>(con)
    };
    for spec in [
        "9",          // more fields than it passes
        "100000",     // more than any event may carry
        "-1",         // no count
        "nan",        // not a count
        "1,0,5,0,0,", // cost 0
        "1,1,5,7,0,", // an id claim it was not given
        "1,1,5,0,",   // an exception missing
        "x",          // neither form
    ] {
        let err = call(&mut con, spec).unwrap_err();
        assert!(err.to_string().contains("bad arguments"), "{spec}: {err}");
    }
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).unwrap();
    assert!(keys.is_empty(), "written before failing: {keys:?}");
    // The same call, well formed, does write.
    call(&mut con, "1").unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).unwrap();
    assert!(keys.iter().any(|k| k == "ready{r}"), "{keys:?}");
}

#[test]
fn shared_streams_are_written_once_per_input_entry() {
    let mut rig = Rig::new("10/s", 1);
    let keys = OutputKeys::new("pacer:rejected");
    let f: Fields = vec![(b"n".to_vec(), b"1".to_vec())];
    let items = [
        EmitItem {
            source_stream: "in",
            source_id: "7-0",
            fields: &f,
        },
        EmitItem {
            source_stream: "in",
            source_id: "8-0",
            fields: &f,
        },
    ];
    let no = |_: &str| false;
    let call = EmitCall {
        keys: &keys,
        out: writing(&no),
    };
    let con = &mut rig.con;
    let first = rig
        .rt
        .block_on(rig.scripts.emit(con, &call, &items[..1]))
        .unwrap();
    let second = rig
        .rt
        .block_on(rig.scripts.emit(con, &call, &items))
        .unwrap();
    assert_eq!((first, second), (vec![true], vec![false, true]));
    // The same entry twice in one call (a worker holding two deliveries of it): written once.
    let twice = [
        EmitItem {
            source_stream: "in",
            source_id: "9-0",
            fields: &f,
        },
        EmitItem {
            source_stream: "in",
            source_id: "9-0",
            fields: &f,
        },
    ];
    let third = rig
        .rt
        .block_on(rig.scripts.emit(con, &call, &twice))
        .unwrap();
    assert_eq!(third, vec![true, false]);
    let len: usize = rig
        .rt
        .block_on(redis::cmd("XLEN").arg("pacer:rejected").query_async(con))
        .unwrap();
    assert_eq!(len, 3);
}

/// Output streams are trimmed to about max_len (1,000 here), but never below what a consumer
/// group on them still needs: its oldest pending entry and what it was not delivered yet. Before,
/// a plain MAXLEN deleted accepted events pacer's own outbound had not read (found by review:
/// 786 of 1,000 forwarded with max_len 100 ended nowhere).
#[test]
fn an_output_stream_is_trimmed_but_never_below_what_a_group_needs() {
    let mut rig = Rig::new("10/s", 1);
    let no = |_: &str| false;
    let f: Fields = vec![(b"n".to_vec(), b"1".to_vec())];
    let rt = &rig.rt;
    let con = &mut rig.con;
    let q = |con: &mut redis::aio::MultiplexedConnection, cmd: &mut redis::Cmd| -> redis::Value {
        rt.block_on(cmd.query_async(con)).unwrap()
    };
    let xlen = |con: &mut redis::aio::MultiplexedConnection, stream: &str| -> usize {
        rt.block_on(redis::cmd("XLEN").arg(stream).query_async(con))
            .unwrap()
    };
    // "free": no group; "held": a group that read 300 and acknowledged 200; "unread": a group
    // that never read.
    q(
        con,
        redis::cmd("XGROUP").arg(&["CREATE", "held", "senders", "0", "MKSTREAM"]),
    );
    q(
        con,
        redis::cmd("XGROUP").arg(&["CREATE", "unread", "senders", "0", "MKSTREAM"]),
    );
    let emit =
        |con: &mut redis::aio::MultiplexedConnection, stream: &str, from: usize, n: usize| {
            let keys = OutputKeys::new(stream);
            let call = EmitCall {
                keys: &keys,
                out: writing(&no),
            };
            let ids: Vec<String> = (from..from + n).map(|i| format!("{}-0", i + 1)).collect();
            let items: Vec<EmitItem> = ids
                .iter()
                .map(|id| EmitItem {
                    source_stream: "in",
                    source_id: id,
                    fields: &f,
                })
                .collect();
            rt.block_on(rig.scripts.emit(con, &call, &items)).unwrap();
        };
    for stream in ["free", "held", "unread"] {
        emit(con, stream, 0, 300);
    }
    let read: Vec<String> = {
        let reply: redis::streams::StreamReadReply = rt
            .block_on(
                redis::cmd("XREADGROUP")
                    .arg(&[
                        "GROUP", "senders", "c", "COUNT", "300", "STREAMS", "held", ">",
                    ])
                    .query_async(con),
            )
            .unwrap();
        reply.keys[0].ids.iter().map(|e| e.id.clone()).collect()
    };
    assert_eq!(read.len(), 300);
    let mut ack = redis::cmd("XACK");
    ack.arg("held").arg("senders");
    for id in &read[..200] {
        ack.arg(id);
    }
    q(con, &mut ack);
    let oldest_pending = read[200].clone();
    for stream in ["free", "held", "unread"] {
        for from in (300..3000).step_by(100) {
            emit(con, stream, from, 100);
        }
    }
    let free = xlen(con, "free");
    assert!((1000..=1200).contains(&free), "free holds {free}");
    assert_eq!(
        xlen(con, "unread"),
        3000,
        "nothing was delivered to its group"
    );
    let held = xlen(con, "held");
    let first: redis::streams::StreamRangeReply = rt
        .block_on(
            redis::cmd("XRANGE")
                .arg(&["held", "-", "+", "COUNT", "1"])
                .query_async(con),
        )
        .unwrap();
    let first = first.ids[0].id.clone();
    let below = |a: &str, b: &str| {
        let p = |id: &str| -> (u64, u64) {
            let (ms, seq) = id.split_once('-').unwrap();
            (ms.parse().unwrap(), seq.parse().unwrap())
        };
        p(a) < p(b)
    };
    assert!(
        !below(&oldest_pending, &first),
        "the oldest pending entry {oldest_pending} was trimmed (first now {first})"
    );
    assert!(
        held >= 2800,
        "held keeps its pending entry and all after: {held}"
    );
    assert!(
        held <= 2900,
        "what the group was done with is trimmed: {held}"
    );
}

/// `streams::trimmed_past` (what `pacer inspect` calls held) is the length `lib.lua` `trim`
/// lets an output stream reach: written one entry a call with no group on it, the stream's
/// longest is exactly that (1,100 for the 1,000 here), never more.
#[test]
fn an_output_stream_grows_to_trimmed_past_its_max_len_and_no_further() {
    let mut rig = Rig::new("10/s", 1);
    let no = |_: &str| false;
    let f: Fields = vec![(b"n".to_vec(), b"1".to_vec())];
    let keys = OutputKeys::new("free");
    let mut longest = 0;
    for i in 1..=1300 {
        let id = format!("{i}-0");
        let item = EmitItem {
            source_stream: "in",
            source_id: &id,
            fields: &f,
        };
        let call = EmitCall {
            keys: &keys,
            out: writing(&no),
        };
        rig.rt
            .block_on(rig.scripts.emit(&mut rig.con, &call, &[item]))
            .unwrap();
        let len: u64 = rig
            .rt
            .block_on(redis::cmd("XLEN").arg("free").query_async(&mut rig.con))
            .unwrap();
        longest = longest.max(len);
    }
    assert_eq!(longest, pacer::streams::trimmed_past(1000));
}

/// A poison entry's decisions are voided before it is dead-lettered: a sleeping worker can no
/// longer dispatch it, while outcomes already final (dispatched, passed over) are left as they
/// are for the caller to honour, and the owner of its id is reported.
#[test]
fn voiding_a_poison_event_stops_any_later_dispatch_and_keeps_final_outcomes() {
    let mut rig = Rig::new("10/s", 1);
    rig.schedule(&[ev("1-0")], 5_000_000);
    let (now, out) = rig.schedule(
        &[
            Ev {
                id: Some("call-2"),
                ..ev("2-0")
            },
            ev("3-0"),
        ],
        5_000_000,
    );
    let deadline = now + 5_000_000 + LATE_US;
    let slot = slot_of(&out[0]);
    let gone_slot = slot_of(&out[1]);
    let (_, skipped) = rig.schedule(&[ev("4-0")], 1);
    assert!(matches!(skipped[0], Scheduled::TooLong { .. }));
    assert!(matches!(
        settle(&mut rig, "3-0", gone_slot, deadline),
        Dispatched::Done { .. }
    ));

    let keys = rig.route.keys.clone();
    let mut void = |entry: &str, id: Option<&str>| -> Voided {
        rig.rt
            .block_on(
                rig.scripts
                    .void(&mut rig.con, &keys, ("in", entry), id, 60_000),
            )
            .unwrap()
    };
    let sleeping = Marker::Slot {
        slot_us: slot,
        deadline_us: deadline,
    }
    .encode();
    // A sleeping decision is voided (its id's owner is reported); a second void sees the void.
    assert_eq!(
        void("2-0", Some("call-2")),
        Voided {
            decision: sleeping,
            owner: "2-0@in".into(),
            overwritten: false,
        }
    );
    assert_eq!(void("2-0", None).decision, "v0");
    // Final outcomes stay.
    assert!(void("3-0", None).decision.starts_with('d'));
    assert!(void("4-0", None).decision.starts_with('x'));
    // No decision yet: voided, so a late first decision finds it and takes no slot.
    assert_eq!(void("5-0", None).decision, "");
    let (_, late) = rig.schedule(&[ev("5-0")], 5_000_000);
    assert_eq!(late[0], Scheduled::Decided("v0".into()));

    // The worker that still sleeps on the voided decision cannot dispatch it.
    let after = settle(&mut rig, "2-0", slot, deadline);
    assert_eq!(after, Dispatched::Superseded("v0".into()));
    assert_eq!(rig.ready_len(), 2, "only 1-0 and 3-0 were dispatched");
}

/// The decision format exists once per language: what `lua/lib.lua` writes and reads is what
/// `src/marker.rs` writes and reads.
#[test]
fn lua_and_rust_share_one_decision_codec() {
    let redis = RedisServer::start();
    let (rt, mut con) = redis.async_con();
    let probe = redis::Script::new(&format!(
        "{LIB}local d = tonumber(ARGV[3]) return {{ decision(ARGV[1], tonumber(ARGV[2]), d), decision_kind(ARGV[4]) }}"
    ));
    for m in [
        Marker::Slot {
            slot_us: 1_790_000_000_123_456,
            deadline_us: 1_790_000_001_123_456,
        },
        Marker::Dispatched(1_790_000_000_123),
        Marker::Skipped(0),
        Marker::Voided,
    ] {
        let encoded = m.encode();
        let (letter, rest) = encoded.split_at(1);
        let (number, deadline) = rest.split_once(':').unwrap_or((rest, ""));
        let (lua_value, lua_kind): (String, String) = rt
            .block_on(
                probe
                    .arg(letter)
                    .arg(number)
                    .arg(deadline)
                    .arg(&encoded)
                    .invoke_async(&mut con),
            )
            .unwrap();
        assert_eq!(lua_value, encoded);
        assert_eq!(lua_kind, letter);
        assert_eq!(Marker::parse(&lua_value), Some(m));
    }
}

/// What `schedule.lua` decides for plain events (one unit, nothing on record, not too old) on a
/// bucket at (tat, dtat) for a call at `t`: `pacing`'s plan, ceil_ms and gate, event after
/// event; with the plan and the gate after the call.
fn plain_model(
    (mut tat, mut dtat): (i64, i64),
    t: i64,
    n: usize,
    wait: i64,
    p: &pacer::pacing::BucketParams,
) -> (Vec<Scheduled>, i64, i64) {
    use pacer::pacing::{ceil_ms, dispatch_clock, gate, plan, Gate};
    let (_, tq) = dispatch_clock(t, t);
    let mut out = Vec::new();
    for _ in 0..n {
        let planned = plan(tat.max(dtat), t, 1, p);
        let mut slot = planned.slot_us;
        if slot > t {
            slot = ceil_ms(slot);
        }
        if slot - t > wait {
            out.push(Scheduled::TooLong { wait_us: slot - t });
        } else if slot > t {
            out.push(Scheduled::Sleep { slot_us: slot });
            tat = planned.tat_us;
        } else {
            match gate(dtat, tq, 1, p) {
                Gate::Pass { dtat_us } => {
                    out.push(Scheduled::Dispatched { ms: tq / 1000 });
                    (tat, dtat) = (planned.tat_us, dtat_us);
                }
                Gate::NotBefore { at_us } if at_us - t <= wait => {
                    out.push(Scheduled::Sleep { slot_us: at_us });
                    tat = planned.tat_us.max(at_us + p.interval_us);
                }
                Gate::NotBefore { at_us } => out.push(Scheduled::TooLong { wait_us: at_us - t }),
            }
        }
    }
    (out, tat, dtat)
}

/// `schedule.lua` takes the usual event (no exceptions, nothing on record, plan and gate open
/// now) down a path of its own with plan and gate inlined, for speed. Whatever path it takes,
/// plain events on buckets in every relation to now (idle, bursting, behind, ahead, the gate
/// ahead of the plan, the route's last dispatch ahead of Redis's clock) are decided as `pacing`
/// decides them, and the bucket ends where it says.
#[test]
fn schedule_decides_plain_events_as_plan_and_gate_say() {
    let mut rig = Rig::new("1000/s", 1);
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |m: i64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((seed >> 33) % m as u64) as i64
    };
    let mut entry = 0;
    let (mut fast, mut other) = (0, 0);
    for case in 0..300 {
        let rate = ["100/s", "1000/s", "7/ms", "333/s"][next(4) as usize];
        let burst = [1, 2, 5, 50][next(4) as usize];
        let (route, _) = route_configs(rate, burst);
        let p = route.bucket;
        let mut con = rig.redis.con();
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query(&mut con).unwrap();
        let now = secs * 1_000_000 + micros;
        let around = |r: i64| now - 60_000 + r;
        let tat = around(next(120_000));
        let dtat = if next(3) == 0 {
            tat
        } else {
            around(next(120_000))
        };
        // Mostly behind Redis's clock; now and then ahead of it (a clock stepped back).
        let last = if next(8) == 0 {
            now + 40_000
        } else {
            now - 50_000
        };
        let _: () = redis::cmd("DEL")
            .arg(&route.keys.bucket)
            .arg(&route.keys.ready)
            .query(&mut con)
            .unwrap();
        let _: () = redis::cmd("HSET")
            .arg(&route.keys.bucket)
            .arg("tat")
            .arg(tat)
            .arg("dtat")
            .arg(dtat)
            .arg("last")
            .arg(last)
            .query(&mut con)
            .unwrap();
        let n = 1 + next(12) as usize;
        let events: Vec<Ev> = (0..n)
            .map(|_| {
                entry += 1;
                ev(&format!("{}-{entry}", now / 1000))
            })
            .collect();
        let wait = [0, 2_000, 20_000, 5_000_000][next(4) as usize];
        let reply = rig.schedule_on(&route, &events, wait, (i64::MAX / 2, 0), ready);
        let t = reply.now_us;
        assert!(t >= now && t >= last, "case {case}: the call's time {t}");
        let (want, want_tat, want_dtat) = plain_model((tat, dtat), t, n, wait, &p);
        let setup = format!(
            "case {case}: {rate} burst {burst}, tat {tat}, dtat {dtat}, t {t}, wait {wait}"
        );
        assert_eq!(reply.items, want, "{setup}");
        assert_eq!(reply.tat_us, want_tat, "{setup}");
        let dtat_after: i64 = redis::cmd("HGET")
            .arg(&route.keys.bucket)
            .arg("dtat")
            .query(&mut con)
            .unwrap();
        assert_eq!(dtat_after, want_dtat, "{setup}");
        let first_dispatched = matches!(want[0], Scheduled::Dispatched { .. });
        if first_dispatched {
            fast += 1;
        } else {
            other += 1;
        }
    }
    // Both paths were taken, many times.
    assert!(
        fast > 50 && other > 50,
        "{fast} calls began on the usual path, {other} not"
    );
}

/// `sizes.lua` counts, in Redis, how many entries from the first fit in a budget of field
/// bytes, of given ids or of what a group would deliver next: at least one (an entry larger
/// than the budget goes alone), a deleted entry as 0 bytes, none for no ids; it reads no entry
/// past the first that does not fit.
#[test]
fn sizes_counts_the_entries_that_fit_in_a_budget_from_the_first() {
    let rig = Rig::new("10/s", 1);
    let mut con = rig.redis.con();
    // Entries of 9, 99 and 999 bytes of fields (a one-letter name), then one deleted.
    let ids: Vec<String> = [8, 98, 998, 8]
        .iter()
        .map(|n| {
            redis::cmd("XADD")
                .arg("s")
                .arg("*")
                .arg("v")
                .arg("x".repeat(*n))
                .query(&mut con)
                .unwrap()
        })
        .collect();
    let _: i64 = redis::cmd("XDEL")
        .arg("s")
        .arg(&ids[3])
        .query(&mut con)
        .unwrap();
    let fitting = |ids: &[&String], budget: usize| -> usize {
        let ids: Vec<&str> = ids.iter().map(|s| s.as_str()).collect();
        let mut con = rig.con.clone();
        rig.rt
            .block_on(rig.scripts.fitting(&mut con, "s", &ids, budget))
            .unwrap()
    };
    let all: Vec<&String> = ids.iter().collect();
    assert_eq!(fitting(&all, 1_107), 4, "a deleted entry weighs nothing");
    assert_eq!(fitting(&all[..3], 1_107), 3);
    assert_eq!(fitting(&all, 1_106), 2);
    assert_eq!(fitting(&all, 108), 2);
    assert_eq!(fitting(&all, 107), 1);
    assert_eq!(fitting(&all, 0), 1, "one at least");
    assert_eq!(
        fitting(&[&ids[2], &ids[0]], 500),
        1,
        "larger than the budget: alone"
    );
    assert_eq!(fitting(&[], 500), 0);
    // Stops at the first that does not fit: the 1,000 bytes are never read.
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .unwrap();
    assert_eq!(fitting(&all, 50), 1);
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut con)
        .unwrap();
    assert!(stats.contains("cmdstat_xrange:calls=2,"), "{stats}");
    // What a group would deliver next: here the 99 and 999 bytes after its first entry.
    let _: () = redis::cmd("XGROUP")
        .arg(&["CREATE", "s", "g", ids[0].as_str()])
        .query(&mut con)
        .unwrap();
    let next = |group: &str, most: usize, budget: usize| -> usize {
        let mut con = rig.con.clone();
        rig.rt
            .block_on(rig.scripts.fitting_next(&mut con, "s", group, most, budget))
            .unwrap()
    };
    assert_eq!(next("g", 10, 1_000), 1);
    assert_eq!(next("g", 10, 98), 1, "one at least");
    assert_eq!(
        next("g", 10, 1_098),
        10,
        "both fit, and nothing after: the whole count"
    );
    assert_eq!(next("g", 1, 1_098), 1);
    assert_eq!(
        next("nobody", 7, 0),
        7,
        "no such group: the read will say so"
    );
}

/// `reap.lua` deletes exactly the consumers that hold no pending entry and have been idle at
/// least the given time, never the caller's own: one idle long but holding entries stays with
/// its entries, one idle long holding nothing goes, one that has just read stays, and the
/// caller stays however idle. A threshold longer than anyone's idle deletes nothing; a zero
/// threshold leaves only the holder and the caller.
#[test]
fn reaping_deletes_only_consumers_idle_past_the_threshold_that_hold_nothing() {
    let rig = Rig::new("10/s", 1);
    let mut con = rig.redis.con();
    let _: () = redis::cmd("XGROUP")
        .arg(&["CREATE", "s", "g", "0", "MKSTREAM"])
        .query(&mut con)
        .unwrap();
    let ids: Vec<String> = (0..3)
        .map(|n| {
            redis::cmd("XADD")
                .arg("s")
                .arg("*")
                .arg("n")
                .arg(n)
                .query(&mut con)
                .unwrap()
        })
        .collect();
    // A read of the consumer's own pending entries: creates it (or refreshes its idle time)
    // and takes nothing new.
    let touch = |con: &mut redis::Connection, consumer: &str| {
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg(&["GROUP", "g", consumer, "STREAMS", "s", "0"])
            .query(con)
            .unwrap();
    };
    // `holder` reads two entries and keeps them pending; `gone` and `me` hold nothing.
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg(&["GROUP", "g", "holder", "COUNT", "2", "STREAMS", "s", ">"])
        .query(&mut con)
        .unwrap();
    touch(&mut con, "gone");
    touch(&mut con, "me");
    std::thread::sleep(Duration::from_millis(1_300));
    // `fresh` holds nothing either, but has just read.
    touch(&mut con, "fresh");
    let before = consumer_table(&mut con, "s", "g");
    let names: Vec<&str> = before.keys().map(String::as_str).collect();
    assert_eq!(names, ["fresh", "gone", "holder", "me"]);
    assert_eq!(before["holder"].0, 2);
    for old in ["gone", "holder", "me"] {
        assert!(before[old].1 >= 1_000, "{old} idle: {before:?}");
    }
    assert!(before["fresh"].1 < 1_000, "fresh idle: {before:?}");

    let reap = |min_idle_ms: u64| -> i64 {
        let mut con = rig.con.clone();
        rig.rt
            .block_on(rig.scripts.reap(
                &mut con,
                "s",
                "g",
                Duration::from_millis(min_idle_ms),
                "me",
            ))
            .unwrap()
    };
    let names = |con: &mut redis::Connection| -> Vec<String> {
        consumer_table(con, "s", "g").into_keys().collect()
    };
    // Nobody has been idle a minute: nothing goes.
    assert_eq!(reap(60_000), 0);
    assert_eq!(names(&mut con), ["fresh", "gone", "holder", "me"]);
    // Idle a second or more: of those, only the one holding nothing that is not the caller.
    assert_eq!(reap(1_000), 1);
    let after = consumer_table(&mut con, "s", "g");
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        ["fresh", "holder", "me"],
        "{after:?}"
    );
    assert_eq!(after["holder"].0, 2, "{after:?}");
    assert_eq!(reap(1_000), 0, "a second call finds no one more");
    // No threshold: the one that just read goes too; the holder and the caller stay.
    assert_eq!(reap(0), 1);
    assert_eq!(names(&mut con), ["holder", "me"]);
    // The holder's entries are still pending on it, and the third was never delivered.
    let pending: Vec<(String, String, i64, i64)> = redis::cmd("XPENDING")
        .arg(&["s", "g", "-", "+", "10"])
        .query(&mut con)
        .unwrap();
    let held: Vec<(&str, &str)> = pending
        .iter()
        .map(|(id, consumer, _, _)| (id.as_str(), consumer.as_str()))
        .collect();
    assert_eq!(
        held,
        [(ids[0].as_str(), "holder"), (ids[1].as_str(), "holder")]
    );
    let group: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
        .arg(&["GROUPS", "s"])
        .query(&mut con)
        .unwrap();
    assert!(
        group[0].contains(&redis::Value::BulkString(ids[1].clone().into_bytes())),
        "last delivered: {group:?}"
    );
}

/// `record.lua` (the inbound fail policy's step): a decision goes where none is recorded, one
/// already there stands and is returned, each hash written lives `ttl` from the call, and a
/// call whose owners do not match its keys writes nothing. As a script the README's ACL user
/// may run it; the MULTI it replaced was refused to that user for good.
#[test]
fn recording_a_decision_keeps_one_already_there_and_renews_each_hash() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut con = rt
        .block_on(server.client().get_multiplexed_async_connection())
        .unwrap();
    let mut sync = server.con();
    let scripts = Scripts::default();
    let (a, b) = ("{p}decided:1", "{p}decided:2");
    let _: () = redis::cmd("HSET")
        .arg(a)
        .arg("1-1@in")
        .arg("A")
        .query(&mut sync)
        .unwrap();
    let targets: Vec<(String, String)> = [(a, "1-1@in"), (a, "1-2@in"), (b, "2-1@in")]
        .iter()
        .map(|(h, o)| (h.to_string(), o.to_string()))
        .collect();
    let stands = rt
        .block_on(scripts.record(&mut con, &targets, "c", 60_000))
        .unwrap();
    assert_eq!(stands, ["A", "c", "c"]);
    for (hash, owner, want) in [(a, "1-1@in", "A"), (a, "1-2@in", "c"), (b, "2-1@in", "c")] {
        let got: String = redis::cmd("HGET")
            .arg(hash)
            .arg(owner)
            .query(&mut sync)
            .unwrap();
        assert_eq!(got, want, "{hash} {owner}");
        let ttl: i64 = redis::cmd("PTTL").arg(hash).query(&mut sync).unwrap();
        assert!(ttl > 50_000 && ttl <= 60_000, "{hash}: {ttl} ms");
    }
    // Again, another decision: what stands is returned, nothing overwritten.
    let again = rt
        .block_on(scripts.record(&mut con, &targets, "o", 60_000))
        .unwrap();
    assert_eq!(again, ["A", "c", "c"]);

    // An owner short: refused before anything is written.
    let script = redis::Script::new(pacer::scripts::RECORD);
    let mut call = script.prepare_invoke();
    call.key("{p}decided:3").arg(60_000).arg("c");
    let e = rt
        .block_on(call.invoke_async::<redis::Value>(&mut con))
        .unwrap_err();
    assert!(e.to_string().contains("one owner per key"), "{e}");
    let exists: i64 = redis::cmd("EXISTS")
        .arg("{p}decided:3")
        .query(&mut sync)
        .unwrap();
    assert_eq!(exists, 0);
}

/// lib.lua `hset`: a record hash that one call writes 16 records or more to is made a hash
/// table first (a listpack's scans of what it holds were a sixth of what schedule.lua cost on
/// a hash filling up); a smaller call leaves it a listpack (40 bytes a record, not 98). Either
/// way every record reads back: a redelivery is told its decision.
#[test]
fn a_record_hash_filled_by_a_large_call_is_a_hash_table_and_by_a_small_one_a_listpack() {
    let mut rig = Rig::new("1000/ms", 1000);
    // Ids 100 ms apart: two decision hashes.
    let large: Vec<Ev> = (0..16).map(|i| ev(&format!("1000-{i}"))).collect();
    let small: Vec<Ev> = (0..15).map(|i| ev(&format!("1100-{i}"))).collect();
    for events in [&large, &small] {
        let (_, first) = rig.schedule(events, 5_000_000);
        assert!(
            first
                .iter()
                .all(|d| matches!(d, Scheduled::Dispatched { .. })),
            "{first:?}"
        );
    }
    let mut con = rig.redis.con();
    for (entry, encoding, records) in [("1000-0", "hashtable", 16), ("1100-0", "listpack", 15)] {
        let hash = rig.route.keys.decisions("in", entry);
        let got: String = redis::cmd("OBJECT")
            .arg("ENCODING")
            .arg(&hash)
            .query(&mut con)
            .unwrap();
        assert_eq!(got, encoding, "{hash}");
        assert_eq!(
            pacer::testkit::records_in(&mut con, &hash),
            records,
            "{hash}"
        );
    }
    for events in [&large, &small] {
        let (_, again) = rig.schedule(events, 5_000_000);
        assert!(
            again.iter().all(|d| matches!(d, Scheduled::Decided(_))),
            "{again:?}"
        );
    }
}
