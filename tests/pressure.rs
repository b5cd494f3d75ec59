//! Pacing under pressure (issue 14's promises), short runs of the scenarios in
//! `tests/common/pressure.rs` against real workers and a real redis-server: a backlog drains at
//! the route's rate (no collapse), a stalled worker gets back to the rate (no metastable state),
//! and a stall never stretches an event's wait past its max_wait or sends it late against its
//! recorded slot. `cargo bench --bench pressure` runs them longer and prints the figures.

mod common;

use common::pressure::*;
use common::{
    assert_each_once, assert_rate, config, event, lengths, push, read, redis_time_ms, start,
};
use pacer::pacing::LATE_US;
use pacer::testkit::{free_port, wait_until, RedisServer, TempDir};
use std::time::Duration;

/// A backlog of 4 × R events on a route of R/s with burst 1 drains at the route's rate: every
/// whole second of the drain after the first holds at least 60% of R (before, it fell to 4% of
/// R and stayed). `cargo bench --bench pressure` measures the issue's 95% on a release build
/// (99% or more there); the suite runs a debug build with three workers and Redis on two cores,
/// where one second was seen at 88% and, with two busy loops beside it, 70%: it keeps a margin
/// the collapse fails by far.
#[test]
fn a_backlog_drains_at_the_routes_rate() {
    for (rate, workers) in [(1000, 1), (1000, 3)] {
        let d = drain_backlog(&[], rate, 4 * rate as usize, workers);
        eprintln!("backlog drain: {d:?}");
        assert!(
            d.worst_share() >= 0.60,
            "{rate}/s with {workers} workers: seconds held {:?}",
            d.per_second
        );
    }
}

/// A worker stalled for a second on a saturated route (fed at 1.2 × its rate) gets back to the
/// rate instead of settling at a fraction of it (before: 10/s of 1000/s for as long as it ran).
/// Seconds 2 to 4 after it is continued, while it is still fed, each hold at least 60% of the
/// rate. `cargo bench --bench pressure` measures the issue's 95% (every round 97.8% or more
/// there); the suite keeps a margin for a loaded CI machine, which the collapse (1%) fails by far.
#[test]
fn a_stalled_worker_gets_back_to_the_rate() {
    let s = stall(1000, 1200, Duration::from_secs(1), 9.0);
    eprintln!("stall: {s:?}");
    // Continued at 3 s, fed until 9 s: seconds 2, 3 and 4 after it are fed throughout.
    let counted: Vec<usize> = s.after.iter().skip(2).take(3).copied().collect();
    assert_eq!(counted.len(), 3, "{s:?}");
    assert!(
        counted.iter().all(|n| *n as f64 >= 0.60 * s.rate as f64),
        "seconds after the stall: {:?}",
        s.after
    );
}

/// The same stall on a route with a fallback: an event slotted before the stall that misses
/// its slot goes to the fallback with only what is left of its wait, not a whole max_wait
/// again (it went out up to 3.4 s after it was produced, with a max_wait of 1 s, found by
/// review). Events produced before the pause were read and decided within milliseconds, so
/// from their entry id to their ready entry is their wait, give or take that.
#[test]
fn a_stall_never_stretches_a_wait_past_max_wait_through_a_fallback() {
    let redis = RedisServer::start();
    let dir = TempDir::new("waits-fallback");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    r: {rate: 10/s, burst: 1, max_wait: 1s, fallbacks: [f]}\n    f: {rate: 10/s, burst: 1, max_wait: 1s}\n";
    let worker = "  batch: 512\n  max_inflight: 200000\n  claim_idle: 90s\n  drain: 1s";
    let cfg = config(&dir, "c.yaml", &redis, port, worker, body);
    let pacer = start(&cfg, port);
    // Twice the primary's rate, so that both routes hold slotted events when it stops.
    let feeder = feed(redis.url(), 20, 6.0);
    std::thread::sleep(Duration::from_secs(2));
    let paused_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    pacer.signal("STOP");
    std::thread::sleep(Duration::from_millis(2500));
    pacer.signal("CONT");
    let ids = feeder.join().unwrap();
    let outputs = [READY, "pacer:{f}:ready", "pacer:rejected", "pacer:dead"];
    let mut con = redis.con();
    let done = wait_until(Duration::from_secs(60), || {
        entries(&mut con, &outputs) >= ids.len()
    });
    assert!(done, "not every entry ended:\n{}", pacer.log_text());
    assert_each_once(&redis, &ids, &outputs, "in");
    let mut late = Vec::new();
    let mut checked = 0;
    for stream in [READY, "pacer:{f}:ready"] {
        for e in read(&redis, stream) {
            let source: String = e.field("pacer_source_id").unwrap().to_string();
            let produced = pacer::event::entry_ms(&source);
            // Decided before the pause (read within 100 ms of being produced).
            if produced >= paused_ms - 200 {
                continue;
            }
            checked += 1;
            if e.ms - produced > 1000 + LATE_US / 1000 + 100 {
                late.push((stream, source, e.ms - produced));
            }
        }
    }
    assert!(checked > 20, "{checked} checked");
    assert!(late.is_empty(), "went out past their max_wait: {late:?}");
    assert!(
        !read(&redis, "pacer:{f}:ready").is_empty(),
        "the fallback took some"
    );
    assert!(
        !read(&redis, "pacer:rejected").is_empty(),
        "a 2.5 s stall on a 1 s wait must reject some"
    );
}

/// A route of 10/s with max_wait 1 s, fed at its rate, its only worker paused 3 s: no ready
/// entry waited longer than 1 s (give or take LATE_US) or went out later than LATE_US after its
/// recorded slot; what could not make it was rejected, not held.
#[test]
fn a_stall_never_stretches_a_wait_past_max_wait() {
    let w = waits_through_a_stall(10, 1000, Duration::from_secs(3), 7.0);
    eprintln!("waits: {w:?}");
    assert!(w.longest_wait_ms <= 1000 + LATE_US / 1000, "{w:?}");
    // The id is a whole millisecond: up to 999 µs of it is its own rounding down.
    assert!(w.latest_us <= LATE_US, "{w:?}");
    assert!(
        w.rejected > 0,
        "a 3 s stall on a 1 s wait must reject some: {w:?}"
    );
    assert!(w.dispatched > 30, "{w:?}");
}

/// One route's backlog never holds up another route's events. Two slow routes (20/s, max_wait
/// 60 s) are sent 300 events each, one's behind the other's, and 50 events for a fast route are
/// pushed behind them all; one worker holds at most 100 sleeping events. Before, it held 100 of
/// the first slow route's and read nothing more until they went out: the second slow route and
/// the fast route waited unread behind its backlog, the fast one about 15 s (a 100/s route took
/// 100 s to start behind a 2/s route, found by review). Now a route with a long queue holds at
/// most its share of the worker's places once they run short, and parks the rest of what it
/// reads (its fields let go, read again when it has room): the fast events go out within
/// seconds, the second slow route starts at once and gets its share, and every event still goes,
/// once, at its route's rate.
#[test]
fn one_routes_backlog_never_holds_up_another_routes_events() {
    let redis = RedisServer::start();
    let dir = TempDir::new("shares");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 20/s, burst: 1, max_wait: 60s}\n    b: {rate: 20/s, burst: 1, max_wait: 60s}\n    fast: {rate: 1000/s, burst: 10, max_wait: 1s}\n";
    let worker = "  batch: 20\n  max_inflight: 100\n  claim_idle: 90s";
    let cfg = config(&dir, "c.yaml", &redis, port, worker, body);
    let events = |route: &str, n: usize| -> Vec<_> {
        (0..n)
            .map(|i| event(&[("route", route), ("n", &i.to_string())]))
            .collect()
    };
    let mut ids = push(&redis, "in", &events("a", 300));
    ids.extend(push(&redis, "in", &events("b", 300)));
    ids.extend(push(&redis, "in", &events("fast", 50)));
    let started = redis_time_ms(&redis);
    let pacer = start(&cfg, port);
    let ready = ["pacer:{a}:ready", "pacer:{b}:ready", "pacer:{fast}:ready"];
    let fast_out = wait_until(Duration::from_secs(5), || {
        lengths(&redis, &[ready[2]])[0] == 50
    });
    assert!(
        fast_out,
        "the fast route's events waited behind the slow routes' backlogs: out {:?}\n{}",
        lengths(&redis, &ready),
        pacer.log_text()
    );
    let outputs = [ready[0], ready[1], ready[2], "pacer:rejected", "pacer:dead"];
    let mut con = redis.con();
    let done = wait_until(Duration::from_secs(60), || {
        entries(&mut con, &outputs) >= ids.len()
    });
    assert!(done, "not every entry ended:\n{}", pacer.log_text());
    let at = assert_each_once(&redis, &ids, &outputs, "in");
    assert!(
        at.values().all(|s| ready.contains(&s[0].as_str())),
        "every event fits its wait, so every one goes out"
    );
    for stream in &ready[..2] {
        let times = assert_rate(&redis, stream, 20.0, 1.0);
        // Each slow route started within seconds, and so ran at its rate from then on: 300
        // events at 20/s take 15 s.
        assert!(
            times[0] - started < 5000,
            "{stream} started {} ms in",
            times[0] - started
        );
        let span = times[times.len() - 1] - times[0];
        assert!(
            span < 16_000,
            "{stream} took {span} ms for 300 events at 20/s"
        );
    }
}

/// Many slow routes with deep backlogs on one worker whose places cannot hold a second of every
/// route's rate (100 routes of 5/s, 75 events each, 350 places): each keeps its rate, since a
/// route whose queue is short takes only what keeps it short, up to its part of the places.
/// Before, one that came back short took every free place (up to a call's 128 at once: 25 s of
/// its rate), the places gathered on a few routes, and the worker passed about 200 events a
/// second of the 500: routes took up to 39 s for their 75 events instead of 15.
#[test]
fn many_routes_with_backlogs_each_keep_their_rate() {
    let redis = RedisServer::start();
    let dir = TempDir::new("many-routes");
    let port = free_port();
    let worker = "  batch: 128\n  max_inflight: 350\n  claim_idle: 35s";
    let (cfg, ready, ids) = many_routes(&redis, &dir, port, (100, "5/s", "30s"), worker, 75);
    let pacer = start(&cfg, port);
    let outputs = ends(&ready);
    let mut con = redis.con();
    let done = wait_until(Duration::from_secs(90), || {
        entries(&mut con, &outputs) >= ids.len()
    });
    assert!(done, "not every entry ended:\n{}", pacer.log_text());
    let at = assert_each_once(&redis, &ids, &outputs, "in");
    assert!(
        at.values().all(|s| s[0].starts_with("pacer:{r")),
        "every event fits its wait, so every one goes out"
    );
    for stream in &ready {
        let times = assert_rate(&redis, stream, 5.0, 1.0);
        let span = times[times.len() - 1] - times[0];
        assert!(
            span < 20_000,
            "{stream} took {span} ms for 75 events at 5/s (14.8 s at its rate)"
        );
    }
}

/// What a worker parks is bounded: past 16 × `max_inflight` entries parked, its readers wait
/// (as they wait for places) instead of reading a whole backlog into memory. One worker of 20
/// places (320 parked at most) serving two routes of 10/s, one of them sent 1,000 events at
/// once with a `max_age` of 1 s: it holds its share and parks the rest until the bound, and
/// what it takes back has waited too long and is rejected `expired`. The parked gauge stays
/// within 320 and one read (10); every event ends once, the route's at its rate.
#[test]
fn parked_entries_are_bounded_and_the_readers_wait_past_the_bound() {
    let redis = RedisServer::start();
    let dir = TempDir::new("parked-bound");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 10/s, burst: 1, max_wait: 5s, max_age: 1s}\n    b: {rate: 10/s, burst: 1, max_wait: 5s}\n";
    let worker = "  batch: 10\n  max_inflight: 20\n  claim_idle: 30s";
    let cfg = config(&dir, "c.yaml", &redis, port, worker, body);
    let events: Vec<_> = (0..1000)
        .map(|i| event(&[("route", "a"), ("n", &i.to_string())]))
        .collect();
    let ids = push(&redis, "in", &events);
    let pacer = start(&cfg, port);
    let outputs = [
        "pacer:{a}:ready",
        "pacer:{b}:ready",
        "pacer:rejected",
        "pacer:dead",
    ];
    let mut con = redis.con();
    let mut most_parked = 0.0_f64;
    let done = wait_until(Duration::from_secs(40), || {
        most_parked = most_parked.max(pacer::testkit::metric_at(port, "pacer_parked_events"));
        entries(&mut con, &outputs) >= ids.len()
    });
    assert!(done, "not every entry ended:\n{}", pacer.log_text());
    assert_each_once(&redis, &ids, &outputs, "in");
    assert!(
        most_parked > 100.0 && most_parked <= 320.0 + 10.0,
        "at most {most_parked} parked"
    );
    let expired = read(&redis, "pacer:rejected")
        .iter()
        .filter(|e| e.field("pacer_reason") == Some("expired"))
        .count();
    assert!(expired > 500, "{expired} rejected expired");
    assert_rate(&redis, "pacer:{a}:ready", 10.0, 1.0);
}
