//! The Lua scripts called directly against a real redis-server: the rate held at the moment of
//! dispatch, decisions recorded and never taken twice, writes to shared streams made once.

use pacer::config::{Config, Overrides};
use pacer::event::Fields;
use pacer::keys::OutputKeys;
use pacer::scripts::{DispatchItem, Dispatched, EmitItem, ScheduleItem, Scheduled, Scripts};
use pacer::testkit::RedisServer;
use std::time::Duration;

fn route_config(rate: &str, burst: u32) -> pacer::config::Route {
    let yaml = format!("outbound:\n  streams: [in]\n  routes:\n    r: {{rate: {rate}, burst: {burst}, max_wait: 5s}}\n");
    Config::parse(&yaml, &Overrides::default())
        .unwrap()
        .outbound
        .routes["r"]
        .clone()
}

fn fields(i: usize) -> Fields {
    vec![(b"n".to_vec(), i.to_string().into_bytes())]
}

struct Rig {
    _redis: RedisServer,
    con: redis::aio::MultiplexedConnection,
    scripts: Scripts,
    route: pacer::config::Route,
    rt: tokio::runtime::Runtime,
}

impl Rig {
    fn new(rate: &str, burst: u32) -> Self {
        let redis = RedisServer::start();
        let (rt, con) = redis.async_con();
        Rig {
            _redis: redis,
            con,
            scripts: Scripts::default(),
            route: route_config(rate, burst),
            rt,
        }
    }

    fn schedule(&mut self, events: &[(&str, &str)], max_wait_us: i64) -> (i64, Vec<Scheduled>) {
        let f: Vec<Fields> = (0..events.len()).map(fields).collect();
        let items: Vec<ScheduleItem<'_>> = events
            .iter()
            .zip(&f)
            .map(|((id, owner), fields)| ScheduleItem {
                event_id: id,
                owner,
                expect: None,
                cost: 1,
                max_wait_us,
                fields,
            })
            .collect();
        let reply = self
            .rt
            .block_on(self.scripts.schedule(
                &mut self.con,
                &self.route.keys,
                &self.route.bucket,
                600_000,
                1000,
                &items,
            ))
            .unwrap();
        (reply.now_us, reply.items)
    }

    fn dispatch(&mut self, events: &[(&str, String, i64)]) -> Vec<Dispatched> {
        let f: Vec<Fields> = (0..events.len()).map(fields).collect();
        let items: Vec<DispatchItem<'_>> = events
            .iter()
            .zip(&f)
            .map(|((id, expect, slot), fields)| DispatchItem {
                event_id: id,
                expect,
                slot_us: *slot,
                cost: 1,
                fields,
            })
            .collect();
        let reply = self
            .rt
            .block_on(self.scripts.dispatch(
                &mut self.con,
                &self.route.keys,
                &self.route.bucket,
                1000,
                &items,
            ))
            .unwrap();
        reply.items
    }

    fn ready_len(&mut self) -> usize {
        self.rt
            .block_on(
                redis::cmd("XLEN")
                    .arg(&self.route.keys.ready)
                    .query_async(&mut self.con),
            )
            .unwrap()
    }
}

/// Dispatches one event, coming back when told to (never before its slot), until it settles.
fn settle(rig: &mut Rig, id: &str, expect: &str, slot: i64) -> Dispatched {
    for _ in 0..100 {
        let out = rig.dispatch(&[(id, expect.to_string(), slot)]).remove(0);
        match out {
            Dispatched::NotBefore { at_us } => {
                assert!(at_us >= slot, "told to come back before the slot");
                std::thread::sleep(Duration::from_millis(10));
            }
            settled => return settled,
        }
    }
    panic!("{id} never settled");
}

fn slot_of(s: &Scheduled) -> i64 {
    match s {
        Scheduled::Sleep { slot_us } => *slot_us,
        other => panic!("expected a slot, got {other:?}"),
    }
}

/// The trap DESIGN.md names: slots planned 1/rate apart, dispatched late all at once. The
/// dispatch script lets one through and holds the others to the rate on Redis's clock.
#[test]
fn slots_dispatched_late_do_not_bunch() {
    let mut rig = Rig::new("20/s", 1);
    let events: Vec<(String, String)> = (0..5)
        .map(|i| (format!("e{i}"), format!("{i}-0@in")))
        .collect();
    let refs: Vec<(&str, &str)> = events
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let (_, decided) = rig.schedule(&refs, 5_000_000);
    assert!(matches!(decided[0], Scheduled::Dispatched { .. }));
    let slots: Vec<i64> = decided[1..].iter().map(slot_of).collect();
    assert!(slots.windows(2).all(|w| w[1] - w[0] == 50_000), "{slots:?}");
    // Every slot has passed by the time this worker wakes.
    std::thread::sleep(Duration::from_millis(300));
    let late: Vec<(&str, String, i64)> = events[1..]
        .iter()
        .zip(&slots)
        .map(|((id, owner), slot)| (id.as_str(), format!("s{slot}|{owner}"), *slot))
        .collect();
    let out = rig.dispatch(&late);
    let done = out
        .iter()
        .filter(|d| matches!(d, Dispatched::Done { .. }))
        .count();
    assert_eq!(done, 1, "{out:?}");
    for d in &out[1..] {
        assert!(matches!(d, Dispatched::NotBefore { .. }), "{d:?}");
    }
    assert_eq!(rig.ready_len(), 2);
}

#[test]
fn an_event_that_would_wait_too_long_reserves_nothing() {
    let mut rig = Rig::new("10/s", 1);
    rig.schedule(&[("a", "1-0@in"), ("b", "2-0@in")], 5_000_000);
    let (_, out) = rig.schedule(&[("c", "3-0@in"), ("d", "4-0@in")], 150_000);
    // c would wait ~200 ms > 150 ms: refused with that wait, and d gets the same offer.
    let waits: Vec<i64> = out
        .iter()
        .map(|s| match s {
            Scheduled::TooLong { wait_us } => *wait_us,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(waits[0] > 150_000 && waits[0] <= 200_000, "{waits:?}");
    assert!(
        (waits[1] - waits[0]).abs() < 5_000,
        "a refused event must not move the plan: {waits:?}"
    );
}

#[test]
fn a_decision_is_recorded_once_and_dispatch_happens_once() {
    let mut rig = Rig::new("10/s", 1);
    rig.schedule(&[("first", "1-0@in")], 5_000_000);
    let (_, out) = rig.schedule(&[("e", "2-0@in")], 5_000_000);
    let slot = slot_of(&out[0]);
    // A redelivery of the same entry finds its decision instead of taking another slot.
    let (_, again) = rig.schedule(&[("e", "2-0@in")], 5_000_000);
    assert_eq!(again[0], Scheduled::Decided(format!("s{slot}|2-0@in")));
    // Another entry with the same event id is told whose it is (a duplicate).
    let (_, dup) = rig.schedule(&[("e", "9-0@in")], 5_000_000);
    assert!(matches!(&dup[0], Scheduled::Decided(v) if v.ends_with("|2-0@in")));

    let expect = format!("s{slot}|2-0@in");
    let first = settle(&mut rig, "e", &expect, slot);
    assert!(matches!(first, Dispatched::Done { .. }), "{first:?}");
    // Two workers holding the same decision: the second dispatch finds it done.
    let second = settle(&mut rig, "e", &expect, slot);
    assert!(
        matches!(&second, Dispatched::Superseded(v) if v.starts_with('d') && v.ends_with("|2-0@in")),
        "{second:?}: the dispatched marker must keep its owner"
    );
    // A stale decision (another worker re-decided the event) cannot dispatch either.
    let stale = settle(&mut rig, "e", &format!("s{}|2-0@in", slot - 1), slot - 1);
    assert!(matches!(stale, Dispatched::Superseded(_)));
    assert_eq!(rig.ready_len(), 2);
}

#[test]
fn shared_streams_are_written_once_per_input_entry() {
    let mut rig = Rig::new("10/s", 1);
    let keys = OutputKeys::new("pacer:rejected");
    let f = fields(1);
    let items = [EmitItem {
        source_stream: "in",
        source_id: "7-0",
        fields: &f,
    }];
    let con = &mut rig.con;
    let first = rig
        .rt
        .block_on(rig.scripts.emit(con, &keys, 60_000, 1000, &items))
        .unwrap();
    let second = rig
        .rt
        .block_on(rig.scripts.emit(con, &keys, 60_000, 1000, &items))
        .unwrap();
    assert_eq!((first, second), (vec![true], vec![false]));
    let len: usize = rig
        .rt
        .block_on(redis::cmd("XLEN").arg("pacer:rejected").query_async(con))
        .unwrap();
    assert_eq!(len, 1);
}

/// A poison entry's decisions are voided before it is dead-lettered: a sleeping worker can no
/// longer dispatch it, while outcomes already final (dispatched, passed over, another entry's)
/// are left as they are for the caller to honour.
#[test]
fn voiding_a_poison_event_stops_any_later_dispatch_and_keeps_final_outcomes() {
    let mut rig = Rig::new("10/s", 1);
    rig.schedule(&[("first", "1-0@in")], 5_000_000);
    let (_, out) = rig.schedule(&[("sleeping", "2-0@in"), ("gone", "3-0@in")], 5_000_000);
    let slot = slot_of(&out[0]);
    let gone_slot = slot_of(&out[1]);
    let (_, skipped) = rig.schedule(&[("skipped", "4-0@in")], 1);
    assert!(matches!(skipped[0], Scheduled::TooLong { .. }));
    let gone = format!("s{gone_slot}|3-0@in");
    assert!(matches!(
        settle(&mut rig, "gone", &gone, gone_slot),
        Dispatched::Done { .. }
    ));

    let keys = rig.route.keys.clone();
    let mut void = |id: &str, owner: &str| {
        rig.rt
            .block_on(rig.scripts.void(&mut rig.con, &keys, id, owner, 60_000))
            .unwrap()
    };
    // A sleeping decision is voided; a second void sees the void and changes nothing.
    assert_eq!(void("sleeping", "2-0@in"), format!("s{slot}|2-0@in"));
    assert_eq!(void("sleeping", "2-0@in"), "v0|2-0@in");
    // Final outcomes and another entry's decision stay.
    assert!(void("gone", "3-0@in").starts_with('d'));
    assert!(void("skipped", "4-0@in").starts_with('x'));
    let other = void("gone", "9-0@in");
    assert!(other.ends_with("|3-0@in"), "{other}");
    // No decision yet: voided, so a late first decision finds it and takes no slot.
    assert_eq!(void("never", "5-0@in"), "");
    let (_, late) = rig.schedule(&[("never", "5-0@in")], 5_000_000);
    assert_eq!(late[0], Scheduled::Decided("v0|5-0@in".into()));

    // The worker that still sleeps on the voided decision cannot dispatch it.
    let expect = format!("s{slot}|2-0@in");
    let after = settle(&mut rig, "sleeping", &expect, slot);
    assert_eq!(after, Dispatched::Superseded("v0|2-0@in".into()));
    assert_eq!(rig.ready_len(), 2, "only first and gone were dispatched");
}
