//! A property test of hostile events through every flow (issue 12, point 1): events of 0 to
//! 20,000 fields, with empty and binary names and values, on routes that dispatch, reroute and
//! reject, to routes that do not exist, over the field cap, on the inbound flow (accepted and
//! rejected), and read by a worker that dies before deciding them (claimed later). Each case
//! runs a real redis-server and a real pacer and checks that every entry ended in exactly one
//! output, once, with its fields whole where it was placed, and that no window of any route or
//! source holds more than its limit.
//!
//! The suite runs 3 cases; more: `PROPTEST_CASES=20 cargo test --release --test wide`.

mod common;

use common::*;
use pacer::report::max_in_window;
use pacer::testkit::{create_group, free_port, metric_at, wait_until, RedisServer, TempDir};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::collections::BTreeMap;
use std::time::Duration;

type Raw = Vec<(Vec<u8>, Vec<u8>)>;

/// The most `max_event_fields` may be (each field is two script arguments, and Lua's stack
/// bounds how many one call unpacks).
const MAX_FIELDS: usize = 3_000;
const ROUTES: [&str; 4] = ["fast", "slow", "shut", "nosuch"];
const OUTPUTS: [&str; 7] = [
    "pacer:{fast}:ready",
    "pacer:{slow}:ready",
    "pacer:{shut}:ready",
    "pacer:rejected",
    "pacer:dead",
    "pacer:accepted",
    "pacer:in-rejected",
];

/// `fast` never binds; `slow` (20/s) passes what it cannot take within 300 ms to `fast`;
/// `shut` takes one event an hour and has no fallback. Inbound: 5/s per source, burst 2.
fn body() -> String {
    format!(
        "outbound:\n  streams: [\"in\"]\n  max_event_fields: {MAX_FIELDS}\n  max_event_bytes: 1048576\n  routes:\n    fast: {{rate: 100/ms, burst: 1000}}\n    slow: {{rate: 20/s, burst: 1, max_wait: 300ms, fallbacks: [fast]}}\n    shut: {{rate: 1/h, burst: 1, max_wait: 100ms}}\n{}  max_event_fields: {MAX_FIELDS}\n  max_event_bytes: 1048576\n",
        inbound_body("{name: per-source, key: [source], algorithm: gcra, limits: [5/s], burst: 2}")
    )
}

/// Field counts weighted toward the edges: none, a few, around the cap, far beyond it.
fn width() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 0..4usize,
        2 => 4..300usize,
        1 => 300..2_000usize,
        1 => (MAX_FIELDS - 3)..(MAX_FIELDS + 3),
        1 => 15_000..20_001usize,
    ]
}

/// Names and values: empty, binary, or short text. Never `pacer_…` (pacer's own fields) nor
/// the fields pacer reads (`route`, `id`, `cost`, `max_wait_ms`, `source`): those are the head.
fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        proptest::collection::vec(any::<u8>(), 1..6).prop_map(|mut v| {
            v.insert(0, 0xff);
            v
        }),
        "[a-z]{1,4}".prop_map(|s| format!("x{s}").into_bytes()),
    ]
}

/// `width` extra fields, drawn as a few patterns repeated (so 20,000 fields cost little to
/// generate and shrink).
fn extra() -> impl Strategy<Value = Raw> {
    (width(), proptest::collection::vec((bytes(), bytes()), 1..4))
        .prop_map(|(n, pattern)| (0..n).map(|i| pattern[i % pattern.len()].clone()).collect())
}

#[derive(Clone)]
struct Case {
    /// (route index into ROUTES, extra fields)
    outbound: Vec<(usize, Raw)>,
    /// (source, extra fields)
    inbound: Vec<(u8, Raw)>,
    /// How many of the first outbound entries a worker reads and dies holding.
    ghost: usize,
}

/// Each event as its route or source and its field count: the fields themselves would print
/// thousands of lines.
impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let out: Vec<String> = self
            .outbound
            .iter()
            .map(|(r, e)| format!("{}x{}", ROUTES[*r], e.len()))
            .collect();
        let inb: Vec<String> = self
            .inbound
            .iter()
            .map(|(s, e)| format!("s{s}x{}", e.len()))
            .collect();
        write!(f, "outbound {out:?}, inbound {inb:?}, ghost {}", self.ghost)
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec((0..ROUTES.len(), extra()), 10..40),
        proptest::collection::vec((0..3u8, extra()), 5..25),
        1..8usize,
        bytes(),
    )
        .prop_map(|(mut outbound, mut inbound, ghost, b)| {
            // Every case has the edges: 20,000 fields, and one either side of the cap.
            let of = |n: usize| vec![(b.clone(), b.clone()); n];
            let at = outbound.len() / 2;
            outbound.insert(at, (0, of(20_000)));
            outbound.insert(at, (1, of(MAX_FIELDS - 1)));
            outbound.insert(0, (0, of(MAX_FIELDS)));
            inbound.insert(inbound.len() / 2, (0, of(20_000)));
            inbound.push((1, of(MAX_FIELDS - 1)));
            // And every flow: more for `slow` than it takes in 300 ms (rerouted), more for
            // `shut` than its one an hour (rejected), more from one source than its burst.
            outbound.extend((0..10).map(|_| (1, Vec::new())));
            outbound.extend((0..3).map(|_| (2, Vec::new())));
            inbound.extend((0..4).map(|_| (2, Vec::new())));
            Case {
                outbound,
                inbound,
                ghost,
            }
        })
}

fn raw(head: &[(&str, &str)], extra: &Raw) -> Raw {
    let mut e: Raw = head
        .iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect();
    e.extend(extra.iter().cloned());
    e
}

/// The fields of `out` that are not pacer's own, in order.
fn carried(out: &pacer::report::OutputEntry) -> Raw {
    out.fields
        .iter()
        .filter(|(k, _)| !k.starts_with(b"pacer_"))
        .cloned()
        .collect()
}

fn run_case(c: &Case) -> Result<(), TestCaseError> {
    let redis = RedisServer::start();
    let dir = TempDir::new("wide");
    let port = free_port();
    let worker = "  batch: 16\n  claim_idle: 2100ms\n  max_deliveries: 3";
    let cfg = config(&dir, "c.yaml", &redis, port, worker, &body());

    let out_events: Vec<Raw> = c
        .outbound
        .iter()
        .map(|(r, extra)| raw(&[("route", ROUTES[*r])], extra))
        .collect();
    let in_events: Vec<Raw> = c
        .inbound
        .iter()
        .map(|(s, extra)| raw(&[("source", &format!("s{s}"))], extra))
        .collect();

    // A worker that reads the first entries and dies before deciding them: they are claimed.
    create_group(&mut redis.con(), "in", "pacer");
    let out_ids = push(&redis, "in", &out_events);
    if c.ghost > 0 {
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("pacer")
            .arg("ghost")
            .arg("COUNT")
            .arg(c.ghost)
            .arg("STREAMS")
            .arg("in")
            .arg(">")
            .query(&mut redis.con())
            .unwrap();
    }
    let pacer = start(&cfg, port);
    let in_ids = push(&redis, "pacer:in", &in_events);

    let all = out_ids.len() + in_ids.len();
    let ended = wait_until(Duration::from_secs(20), || {
        placements_by_stream(&redis, &OUTPUTS).len() >= all
    });
    prop_assert!(ended, "not every entry ended:\n{}", pacer.log_text());
    std::thread::sleep(Duration::from_millis(300));
    assert_each_once_by_stream(&redis, &[("in", &out_ids), ("pacer:in", &in_ids)], &OUTPUTS);

    // Where each ended, and with what.
    let mut ended_in: BTreeMap<(String, String), (String, pacer::report::OutputEntry)> =
        BTreeMap::new();
    for stream in OUTPUTS {
        for e in read(&redis, stream) {
            let key = (
                e.field("pacer_source_stream").unwrap().to_string(),
                e.field("pacer_source_id").unwrap().to_string(),
            );
            ended_in.insert(key, (stream.to_string(), e));
        }
    }
    for (i, (route, extra)) in c.outbound.iter().enumerate() {
        let (stream, out) = &ended_in[&("in".to_string(), out_ids[i].clone())];
        let reason = out.field("pacer_reason");
        if extra.len() + 1 > MAX_FIELDS {
            prop_assert_eq!(stream.as_str(), "pacer:dead");
            prop_assert_eq!(reason, Some("malformed"));
        } else if ROUTES[*route] == "nosuch" {
            prop_assert_eq!(stream.as_str(), "pacer:dead");
            prop_assert_eq!(reason, Some("unknown_route"));
        } else {
            // Placed or rejected, never dead-lettered, and with every field as pushed.
            prop_assert!(stream != "pacer:dead", "{} dead: {:?}", out_ids[i], reason);
            prop_assert!(carried(out) == out_events[i], "{} lost fields", out_ids[i]);
        }
    }
    for (i, extra) in c.inbound.iter().map(|(_, e)| e).enumerate() {
        let (stream, out) = &ended_in[&("pacer:in".to_string(), in_ids[i].clone())];
        if extra.len() + 1 > MAX_FIELDS {
            prop_assert_eq!(stream.as_str(), "pacer:dead");
        } else {
            prop_assert!(stream != "pacer:dead");
            prop_assert!(carried(out) == in_events[i], "{} lost fields", in_ids[i]);
        }
    }

    // Every flow ran: placed, rerouted, rejected, dead-lettered, accepted, refused, claimed.
    let count = |s: &str| ended_in.values().filter(|(at, _)| at == s).count();
    let rerouted = read(&redis, "pacer:{fast}:ready")
        .iter()
        .filter(|e| e.field("route") == Some("slow"))
        .count();
    let claimed = metric_at(port, "pacer_claimed_total");
    prop_assert!(
        rerouted > 0 && claimed > 0.0,
        "rerouted {rerouted}, claimed {claimed}"
    );
    for s in OUTPUTS {
        prop_assert!(count(s) > 0, "nothing in {s}");
    }
    println!(
        "case of {} + {} entries: {}, {rerouted} rerouted, {claimed} claimed",
        out_ids.len(),
        in_ids.len(),
        OUTPUTS
            .iter()
            .map(|s| format!("{} {s}", count(s)))
            .collect::<Vec<_>>()
            .join(", ")
    );

    // The rate: routes by their ready streams, sources by what was accepted for each.
    assert_rate(&redis, "pacer:{slow}:ready", 20.0, 1.0);
    assert_rate(&redis, "pacer:{shut}:ready", 1.0 / 3600.0, 1.0);
    let mut by_source: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for e in read(&redis, "pacer:accepted") {
        let source = e.field("source").unwrap_or("").to_string();
        by_source.entry(source).or_default().push(e.ms);
    }
    for (source, times) in &by_source {
        for w in [1, 100, 200, 500, 1000, 2000] {
            // 5/s, burst 2; entry ids are whole milliseconds, so a window may reach 1 ms further.
            let limit = 2 + (w + 1) / 200;
            let seen = max_in_window(times, w);
            prop_assert!(
                seen <= limit as usize,
                "{source}: {seen} in {w} ms, limit {limit}"
            );
        }
    }
    Ok(())
}

#[test]
fn hostile_events_through_every_flow_end_once_within_the_rate() {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        // Each case runs real processes: shrinking a failure is worth a few minutes at most.
        max_shrink_iters: 4,
        ..Config::default()
    });
    let widest = std::cell::Cell::new(0usize);
    let result = runner.run(&case(), |c| {
        let w = c
            .outbound
            .iter()
            .map(|(_, e)| e.len())
            .chain(c.inbound.iter().map(|(_, e)| e.len()))
            .max()
            .unwrap_or(0);
        widest.set(widest.get().max(w));
        run_case(&c)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!("{cases} cases passed; widest event {} fields", widest.get());
}
