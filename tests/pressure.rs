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
use pacer::testkit::{free_port, metric_at, wait_until, Pacer, RedisServer, TempDir};
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
    let s = stall_with_a_fallback(Duration::from_millis(2500));
    assert!(s.checked > 20, "{s:?}");
    assert!(s.late.is_empty(), "went out past their max_wait: {s:?}");
    assert!(s.miscounted.is_empty(), "{s:?}");
    assert!(s.on_fallback > 0, "the fallback took some: {s:?}");
    assert!(
        s.rejected > 0,
        "a 2.5 s stall on a 1 s wait must reject some: {s:?}"
    );
}

/// An event that missed its slot in a stall and went on to its fallback with what was left of
/// its wait says in its ready entry's `pacer_wait_ms` how long it waited since its first
/// decision: until 2026-11-30 it said how long since its decision on the fallback (0 for one
/// dispatched there at once). Fifteen events at once on r (10/s, max_wait 1 s): ten take its
/// next second, each to go by 1 s from now, five go to f (100/s) at once. Its worker paused
/// 500 ms misses r's slots in that time; once continued, r's plan is full past their deadlines,
/// so they go to f with the half second left, and out there at once.
#[test]
fn a_fallbacks_ready_entry_counts_the_wait_from_the_first_decision() {
    let redis = RedisServer::start();
    let dir = TempDir::new("wait-fallback");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    r: {rate: 10/s, burst: 1, max_wait: 1s, fallbacks: [f]}\n    f: {rate: 100/s, burst: 1, max_wait: 1s}\n";
    let cfg = config(&dir, "c.yaml", &redis, port, "  drain: 1s", body);
    let pacer = start(&cfg, port);
    let events: Vec<_> = (0..15)
        .map(|i| event(&[("route", "r"), ("to", &i.to_string())]))
        .collect();
    let ids = push(&redis, "in", &events);
    std::thread::sleep(Duration::from_millis(50));
    pacer.signal("STOP");
    std::thread::sleep(Duration::from_millis(500));
    pacer.signal("CONT");
    each_ends_once_on_r_or_f(&redis, &pacer, &ids);
    // (entry, ms from produced to ready, pacer_wait_ms) on f
    let on_f: Vec<(String, i64, i64)> = read(&redis, "pacer:{f}:ready")
        .iter()
        .map(|e| {
            let source = e.field("pacer_source_id").unwrap().to_string();
            let took = e.ms - pacer::event::entry_ms(&source);
            let waited = e.field("pacer_wait_ms").unwrap().parse().unwrap();
            (source, took, waited)
        })
        .collect();
    // Decided within 150 ms of being pushed: from its entry to its ready entry is its wait.
    let miscounted: Vec<_> = on_f
        .iter()
        .filter(|(_, took, waited)| !(took - 150..=took + 1).contains(waited))
        .collect();
    let through_the_stall = on_f.iter().filter(|(_, took, _)| *took >= 300).count();
    eprintln!("on f (entry, ms from produced to ready, pacer_wait_ms): {on_f:?}");
    assert!(
        miscounted.is_empty(),
        "pacer_wait_ms is not the wait since the first decision: {miscounted:?} of {on_f:?}"
    );
    assert!(
        through_the_stall > 0,
        "some went on to f after the stall: {on_f:?}"
    );
}

/// Waits up to a minute for every entry of `ids` to end (on route r or its fallback f, rejected
/// or dead-lettered), and checks each ended once.
fn each_ends_once_on_r_or_f(redis: &RedisServer, pacer: &Pacer, ids: &[String]) {
    let outputs = [READY, "pacer:{f}:ready", "pacer:rejected", "pacer:dead"];
    ends_each_once(redis, pacer, ids, &outputs, Duration::from_secs(60));
}

/// What `stall_with_a_fallback` saw of the entries produced before the pause (decided within
/// milliseconds of being produced: from their entry id to their ready entry is their wait).
#[derive(Debug)]
struct FallbackStall {
    checked: usize,
    /// Went out past max_wait: (stream, entry, ms from produced to ready).
    late: Vec<(&'static str, String, i64)>,
    /// `pacer_wait_ms` not that time, give or take the 150 ms a read may take: (stream,
    /// entry, ms from produced to ready, pacer_wait_ms).
    miscounted: Vec<(&'static str, String, i64, i64)>,
    /// Ready entries on the fallback.
    on_fallback: usize,
    rejected: usize,
}

/// Route r with fallback f (10/s each, max_wait 1 s), fed at 20/s for 6 s, its only worker
/// paused for `pause` 2 s in; waits for every entry to end once.
fn stall_with_a_fallback(pause: Duration) -> FallbackStall {
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
    std::thread::sleep(pause);
    pacer.signal("CONT");
    let ids = feeder.join().unwrap();
    each_ends_once_on_r_or_f(&redis, &pacer, &ids);
    let mut s = FallbackStall {
        checked: 0,
        late: Vec::new(),
        miscounted: Vec::new(),
        on_fallback: read(&redis, "pacer:{f}:ready").len(),
        rejected: read(&redis, "pacer:rejected").len(),
    };
    for stream in [READY, "pacer:{f}:ready"] {
        for e in read(&redis, stream) {
            let source: String = e.field("pacer_source_id").unwrap().to_string();
            let produced = pacer::event::entry_ms(&source);
            // Decided before the pause (read within 100 ms of being produced).
            if produced >= paused_ms - 200 {
                continue;
            }
            s.checked += 1;
            let took = e.ms - produced;
            if took > 1000 + LATE_US / 1000 + 100 {
                s.late.push((stream, source.clone(), took));
            }
            let waited: i64 = e.field("pacer_wait_ms").unwrap().parse().unwrap();
            if !(took - 150..=took + 1).contains(&waited) {
                s.miscounted.push((stream, source, took, waited));
            }
        }
    }
    s
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
    let at = ends_each_once(&redis, &pacer, &ids, &outputs, Duration::from_secs(60));
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
    let _pacer = drain_onto_routes(&redis, &cfg, port, &ready, &ids, Duration::from_secs(90));
    for stream in &ready {
        let times = assert_rate(&redis, stream, 5.0, 1.0);
        let span = times[times.len() - 1] - times[0];
        assert!(
            span < 20_000,
            "{stream} took {span} ms for 75 events at 5/s (14.8 s at its rate)"
        );
    }
}

/// Slow routes whose share of the worker's places is a few take their parked entries back a
/// few at a time, as each route's plan nears its end (`share::take_back_now`), not one a call
/// as each place comes back: that cost a `schedule` call per event (0.98 per event in the
/// benchmark's 300 routes of 10/s, 162 µs of Redis CPU per event; 0.41 and 107 µs since). 30
/// routes of 10/s, 40 events each, about 5 places each: every route still at its rate, with no
/// slot left empty.
#[test]
fn slow_routes_take_their_parked_entries_back_a_few_at_a_time() {
    let redis = RedisServer::start();
    let dir = TempDir::new("take-back");
    let port = free_port();
    // (214 places less a reserve of 2 × 32, over 30 routes.)
    let worker = "  batch: 32\n  max_inflight: 214\n  claim_idle: 30s";
    let (cfg, ready, ids) = many_routes(&redis, &dir, port, (30, "10/s", "20s"), worker, 40);
    let _pacer = drain_onto_routes(&redis, &cfg, port, &ready, &ids, Duration::from_secs(60));
    let mut longest = 0;
    for stream in &ready {
        let times = assert_rate(&redis, stream, 10.0, 1.0);
        longest = longest.max(times[times.len() - 1] - times[0]);
    }
    eprintln!("the longest route took {longest} ms");
    assert!(
        longest < 4_500,
        "a route took {longest} ms for 40 events at 10/s (3.9 s at its rate)"
    );
    let calls = metric_at(
        port,
        "pacer_redis_command_duration_seconds_count{op=\"schedule\"}",
    );
    eprintln!("{calls} schedule calls for {} events", ids.len());
    assert!(
        calls < 0.5 * ids.len() as f64,
        "{calls} schedule calls for {} events",
        ids.len()
    );
}

/// A backlog spread over 2,000 routes, with a Redis timeout of 100 ms: calls no longer time out by the thousand, and
/// every entry ends once. Each route's task makes its own call, and every call's timeout runs
/// from when it is handed to the one multiplexed connection: with 2,000 calls put on it at once,
/// those at the back waited out their timeout behind the others (Redis answering each in about
/// 40 µs), failed, and were retried together (a backlog over 10,000 routes took a worker 20–56 s,
/// up to 40 s of it with no progress). Now a connection to one node has at most 64 calls out
/// (the rest wait in the worker, against no timeout) and failed calls retry apart.
#[test]
fn a_backlog_over_thousands_of_routes_times_no_call_out() {
    let redis = RedisServer::start();
    let dir = TempDir::new("wide-backlog");
    let port = free_port();
    let (cfg, ready, ids) = many_routes(
        &redis,
        &dir,
        port,
        (2000, "1000/s", "2s"),
        "  batch: 512",
        10,
    );
    let text = std::fs::read_to_string(&cfg).unwrap();
    assert!(text.contains("timeout: 500ms"), "{text}");
    std::fs::write(&cfg, text.replacen("timeout: 500ms", "timeout: 100ms", 1)).unwrap();
    let pacer = drain_onto_routes(&redis, &cfg, port, &ready, &ids, Duration::from_secs(60));
    let failed = metric_at(port, "pacer_redis_errors_total");
    // Before the turns, 2,030 and 2,897 failed in two runs. A 100 ms timeout on a busy two-core
    // machine can still lose a call or two to CPU alone (its cluster counterpart lost 44 once
    // in CI), so the bound is a tenth of the old count, not zero.
    assert!(
        failed < 200.0,
        "{failed} calls failed:\n{}",
        pacer.log_text()
    );
    // A batch over 512 routes puts more calls out at once than a node's 64 turns: their waits
    // are counted apart from the calls' own time (`telemetry::timed`), not hidden in it.
    let waited = metric_at(port, "pacer_redis_turn_wait_seconds_sum{op=\"schedule\"}");
    let out = metric_at(
        port,
        "pacer_redis_command_duration_seconds_sum{op=\"schedule\"}",
    );
    assert!(
        waited > 0.0 && out > 0.0,
        "schedule calls waited {waited} s for turns and were out {out} s"
    );
}

/// The outputs of the two-route parking tests.
const PARKING_OUTPUTS: [&str; 4] = [
    "pacer:{a}:ready",
    "pacer:{b}:ready",
    "pacer:rejected",
    "pacer:dead",
];

/// Waits up to `limit` for every entry of `ids` to end, reading the most entries parked at once
/// meanwhile; checks each ended once. Returns that most and where each ended.
fn drained_parking(
    redis: &RedisServer,
    pacer: &Pacer,
    port: u16,
    ids: &[String],
    limit: Duration,
) -> (f64, std::collections::BTreeMap<String, Vec<String>>) {
    let mut con = redis.con();
    let mut most_parked = 0.0_f64;
    let done = wait_until(limit, || {
        most_parked = most_parked.max(pacer::testkit::metric_at(port, "pacer_parked_events"));
        entries(&mut con, &PARKING_OUTPUTS) >= ids.len()
    });
    assert!(done, "not every entry ended:\n{}", pacer.log_text());
    (
        most_parked,
        assert_each_once(redis, ids, &PARKING_OUTPUTS, "in"),
    )
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
    let (most_parked, _) = drained_parking(&redis, &pacer, port, &ids, Duration::from_secs(40));
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

/// An input entry id as its two numbers, so that ids compare as Redis orders them.
fn id_key(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').expect("an entry id");
    (ms.parse().unwrap(), seq.parse().unwrap())
}

/// Two input entry ids: the earlier entry's and the later one's, one way or the other.
type IdPair = (String, String);

/// What `stream`'s ready entries show of the order their route took its events in: how many
/// there are; each pair of entries that went out one after the other with the later input entry
/// first; and each pair of input entries, one after the other in the input, whose first
/// decisions on the route (`pacer_slot_us` less `pacer_wait_ms`, which counts from it, a move
/// included) came the later first, by more than the millisecond `pacer_wait_ms` rounds away.
fn out_of_order(redis: &RedisServer, stream: &str) -> (usize, Vec<IdPair>, Vec<IdPair>) {
    let out: Vec<(String, i64)> = read(redis, stream)
        .iter()
        .map(|e| {
            let slot_us: i64 = e.field("pacer_slot_us").unwrap().parse().unwrap();
            let wait_ms: i64 = e.field("pacer_wait_ms").unwrap().parse().unwrap();
            (
                e.field("pacer_source_id").unwrap().to_string(),
                slot_us - wait_ms * 1000,
            )
        })
        .collect();
    let sent_behind = out
        .windows(2)
        .filter(|w| id_key(&w[0].0) >= id_key(&w[1].0))
        .map(|w| (w[0].0.clone(), w[1].0.clone()))
        .collect();
    let mut by_input = out.clone();
    by_input.sort_by_key(|(id, _)| id_key(id));
    let decided_behind = by_input
        .windows(2)
        .filter(|w| w[0].1 > w[1].1 + 999)
        .map(|w| (w[0].0.clone(), w[1].0.clone()))
        .collect();
    (out.len(), sent_behind, decided_behind)
}

/// Parked entries are taken back oldest first, so a route's events still go out in the order
/// they were read. One worker of 20 places serves two routes of 20/s with max_wait 60 s; route
/// a is sent 200 events and route b 20, one b behind every tenth a, all before the worker starts.
/// The places a may hold run out at once, so it parks most of its backlog (checked: the parked
/// gauge passes 50) and takes it back as its sleeping events go out. Checked twice on each
/// route's ready entries: no input entry was first decided on its route (its slot less its
/// wait, which counts from that decision whatever moved the slot since) after the input entry
/// behind it, by more than the millisecond the wait is rounded to; and the ready entries hold
/// their input ids in increasing order, but for at most 2% (at 20/s a wake-up a few milliseconds
/// late never moves an event behind a later one: the gate passes it at once; one tens of
/// milliseconds late, on a loaded host, may find its slot gone and be moved behind the plan, as
/// one of 200 was in a CI run beside another test binary, 201 slots moved). With the parked
/// entries taken back newest first (tried on a copy), both fail: 187 of route a's 200 went out
/// behind a later one.
#[test]
fn parked_entries_are_taken_back_oldest_first_and_each_route_keeps_its_input_order() {
    let redis = RedisServer::start();
    let dir = TempDir::new("parked-order");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 20/s, burst: 1, max_wait: 60s}\n    b: {rate: 20/s, burst: 1, max_wait: 60s}\n";
    let worker = "  batch: 10\n  max_inflight: 20\n  claim_idle: 90s";
    let cfg = config(&dir, "c.yaml", &redis, port, worker, body);
    let mut events = Vec::new();
    for i in 0..200 {
        events.push(event(&[("route", "a"), ("n", &i.to_string())]));
        if i % 10 == 9 {
            events.push(event(&[("route", "b"), ("n", &i.to_string())]));
        }
    }
    let ids = push(&redis, "in", &events);
    let pacer = start(&cfg, port);
    let (most_parked, at) = drained_parking(&redis, &pacer, port, &ids, Duration::from_secs(60));
    assert!(
        at.values().all(|s| s[0].ends_with(":ready")),
        "every event fits its wait, so every one goes out"
    );
    eprintln!(
        "at most {most_parked} parked, {} slots moved",
        pacer::testkit::metric_at(port, "pacer_replanned_total")
    );
    assert!(most_parked > 50.0, "at most {most_parked} parked");
    for (stream, n) in [(PARKING_OUTPUTS[0], 200), (PARKING_OUTPUTS[1], 20)] {
        let (out, sent_behind, decided_behind) = out_of_order(&redis, stream);
        assert_eq!(out, n, "{stream}");
        assert!(
            decided_behind.is_empty(),
            "{stream}: {} of {out} decided after a later input entry (earlier, later; first 10): {:?}",
            decided_behind.len(),
            &decided_behind[..decided_behind.len().min(10)]
        );
        assert!(
            sent_behind.len() * 50 <= out,
            "{stream}: {} of {out} went out after a later input entry (later, earlier; first 10): {:?}",
            sent_behind.len(),
            &sent_behind[..sent_behind.len().min(10)]
        );
    }
}

/// At most two `dispatch.lua` calls are out at once on a route (`MAX_OUT`), however long their
/// answers take. The worker reaches Redis through a proxy (`SlowWire`) that holds every reply
/// 30 ms, a slow network, and serves a route of 1000/s with burst 1 and a backlog of 2,000: an
/// event falls due every millisecond, so a worker that sent a call for each would have about 30
/// out at once. Redis answers one command at a time and its own logs cannot tell what a client
/// has out, so the proxy reads it off the wire: each `FCALL` of `pacer_dispatch_*`, the routes
/// whose ready streams are among its keys, when it passed towards Redis and when its reply passed
/// back (a connection's replies come in the order of its commands). Both times err towards
/// fewer calls out (the worker sent a little earlier and read a little later), by microseconds
/// against the cap's 30 ms. The most calls of the route out at any moment is exactly two: the
/// cap is reached, and never passed. With `MAX_OUT` at 3 (tried on a copy) the proxy saw three.
#[test]
fn a_route_never_has_more_than_two_dispatch_calls_out_at_once() {
    let redis = RedisServer::start();
    let wire = SlowWire::start(redis.port, Duration::from_millis(30));
    let dir = TempDir::new("dispatch-out");
    let port = free_port();
    // A timeout far beyond the wire's delay: a call given up on would leave the worker free to
    // send another while the proxy still counts the first.
    let text = format!(
        "redis:\n  url: redis://127.0.0.1:{}\n  timeout: 3s\nmetrics:\n  listen: 127.0.0.1:{port}\nworker:\n  batch: 512\n  max_inflight: 200000\n  claim_idle: 90s\n  drain: 1s\noutbound:\n  streams: [\"in\"]\n  routes:\n    r: {{rate: 1000/s, burst: 1, max_wait: 60s}}\n",
        wire.port
    );
    let cfg = dir.write("c.yaml", &text);
    push_events(&redis, 2000, "b");
    let pacer = start(&cfg, port);
    let answered = wait_until(Duration::from_secs(60), || {
        wire.dispatch_calls()
            .iter()
            .filter(|c| c.answered.is_some())
            .count()
            >= 200
    });
    drop(pacer);
    assert!(
        answered,
        "{:?} dispatch calls answered",
        wire.dispatch_calls().len()
    );
    let calls = wire.dispatch_calls();
    assert!(
        calls.iter().all(|c| c.routes == [READY]),
        "a call for another route: {:?}",
        calls.iter().find(|c| c.routes != [READY])
    );
    assert!(lengths(&redis, &[READY])[0] > 0, "nothing dispatched");
    let most = most_out(&calls);
    eprintln!("{} dispatch calls, at most {most} out at once", calls.len());
    assert_eq!(most, 2, "dispatch calls of route r out at once, at most");
}

/// The most calls of `calls` out at one moment: sent and not yet answered (an answer at the
/// moment of a send counts first). A call still unanswered counts as out until the end.
fn most_out(calls: &[WireCall]) -> usize {
    let mut edges: Vec<(std::time::Instant, i32)> = Vec::new();
    for c in calls {
        edges.push((c.sent, 1));
        if let Some(answered) = c.answered {
            edges.push((answered, -1));
        }
    }
    edges.sort();
    let (mut out, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        out += step;
        most = most.max(out);
    }
    most as usize
}

/// One dispatch call seen on the wire: its routes' ready streams, when it passed towards Redis
/// and when its reply passed back (None while it has not).
#[derive(Debug, Clone)]
struct WireCall {
    routes: Vec<String>,
    sent: std::time::Instant,
    answered: Option<std::time::Instant>,
}

/// A TCP proxy on loopback in front of a Redis, holding every reply `delay` before passing it
/// on, that logs the dispatch calls it carries (`WireCall`). It reads the RESP frames on each
/// connection: the commands one way, the replies the other, the n-th reply answering the n-th
/// command (pushes and attributes answer none).
struct SlowWire {
    port: u16,
    calls: std::sync::Arc<std::sync::Mutex<Vec<WireCall>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl SlowWire {
    fn start(target: u16, delay: Duration) -> SlowWire {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{Arc, Mutex};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let calls: Arc<Mutex<Vec<WireCall>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (log, halt) = (calls.clone(), stop.clone());
        std::thread::spawn(move || {
            while !halt.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let server = std::net::TcpStream::connect(("127.0.0.1", target)).unwrap();
                        wire_connection(client, server, delay, log.clone(), halt.clone());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        SlowWire { port, calls, stop }
    }

    fn dispatch_calls(&self) -> Vec<WireCall> {
        self.calls.lock().unwrap().clone()
    }
}

impl Drop for SlowWire {
    fn drop(&mut self) {
        (self.stop).store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Carries one connection both ways until either end closes: commands at once, each logged
/// (its index in `log` if a dispatch call) before it passes; replies `delay` after they came,
/// each answering the oldest command not yet answered, logged before it passes.
fn wire_connection(
    client: std::net::TcpStream,
    server: std::net::TcpStream,
    delay: Duration,
    log: std::sync::Arc<std::sync::Mutex<Vec<WireCall>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use std::io::{Read, Write};
    use std::net::Shutdown;
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;
    // Per command in order: Some(its index in `log`) for a dispatch call.
    let asked: Arc<Mutex<std::collections::VecDeque<Option<usize>>>> = Arc::default();
    let read_timeout = Some(Duration::from_millis(50));
    // Commands: client to server.
    {
        let (mut from, mut to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let (asked, log, stop) = (asked.clone(), log.clone(), stop.clone());
        from.set_read_timeout(read_timeout).unwrap();
        std::thread::spawn(move || {
            let (mut buf, mut chunk) = (Vec::new(), vec![0u8; 64 * 1024]);
            while !stop.load(Ordering::Relaxed) {
                let n = match from.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if is_timeout(&e) => continue,
                    Err(_) => break,
                };
                buf.extend_from_slice(&chunk[..n]);
                let now = Instant::now();
                let mut at = 0;
                while let Some((end, _)) = resp_frame(&buf, at) {
                    let routes = dispatch_routes(&buf[at..end]);
                    let index = routes.map(|routes| {
                        let mut log = log.lock().unwrap();
                        log.push(WireCall {
                            routes,
                            sent: now,
                            answered: None,
                        });
                        log.len() - 1
                    });
                    asked.lock().unwrap().push_back(index);
                    at = end;
                }
                buf.drain(..at);
                if to.write_all(&chunk[..n]).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Write);
        });
    }
    // Replies: server to a delay line to client.
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    {
        let mut from = server.try_clone().unwrap();
        let stop = stop.clone();
        from.set_read_timeout(read_timeout).unwrap();
        std::thread::spawn(move || {
            let mut chunk = vec![0u8; 64 * 1024];
            while !stop.load(Ordering::Relaxed) {
                match from.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx.send((Instant::now(), chunk[..n].to_vec())).is_err() {
                            break;
                        }
                    }
                    Err(e) if is_timeout(&e) => continue,
                    Err(_) => break,
                }
            }
        });
    }
    let mut to = client;
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        for (came, bytes) in rx {
            if let Some(wait) = (came + delay).checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            buf.extend_from_slice(&bytes);
            let now = Instant::now();
            let mut at = 0;
            while let Some((end, answers)) = resp_frame(&buf, at) {
                if answers {
                    let command = asked.lock().unwrap().pop_front();
                    if let Some(Some(index)) = command {
                        log.lock().unwrap()[index].answered = Some(now);
                    }
                }
                at = end;
            }
            buf.drain(..at);
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = server.shutdown(Shutdown::Both);
    });
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The end of the RESP2/RESP3 frame at `at` in `buf`, and whether it answers a command (a push
/// or an attribute does not); None while it is not whole.
fn resp_frame(buf: &[u8], at: usize) -> Option<(usize, bool)> {
    let kind = *buf.get(at)?;
    let eol = at + buf[at..].windows(2).position(|w| w == b"\r\n")?;
    let head = std::str::from_utf8(&buf[at + 1..eol]).unwrap();
    let next = eol + 2;
    match kind {
        b'$' | b'!' | b'=' => {
            let n: i64 = head.parse().unwrap();
            let end = if n < 0 { next } else { next + n as usize + 2 };
            (end <= buf.len()).then_some((end, true))
        }
        b'*' | b'~' | b'>' | b'%' | b'|' => {
            let n: i64 = head.parse().unwrap();
            let items = if matches!(kind, b'%' | b'|') {
                2 * n
            } else {
                n
            };
            let mut end = next;
            for _ in 0..items.max(0) {
                end = resp_frame(buf, end)?.0;
            }
            Some((end, !matches!(kind, b'>' | b'|')))
        }
        _ => Some((next, true)),
    }
}

/// Of a whole command (a RESP array of bulk strings): if it is an `FCALL` of a
/// `pacer_dispatch_*` function, the ready streams among its keys (its routes).
fn dispatch_routes(frame: &[u8]) -> Option<Vec<String>> {
    let mut args: Vec<&[u8]> = Vec::new();
    let mut at = frame.iter().position(|b| *b == b'\n')? + 1;
    while at < frame.len() {
        let eol = at + frame[at..].windows(2).position(|w| w == b"\r\n")?;
        let n: usize = std::str::from_utf8(&frame[at + 1..eol])
            .ok()?
            .parse()
            .ok()?;
        args.push(&frame[eol + 2..eol + 2 + n]);
        at = eol + 2 + n + 2;
    }
    let text = |a: &[u8]| String::from_utf8_lossy(a).into_owned();
    if !args.first()?.eq_ignore_ascii_case(b"FCALL")
        || !args.get(1)?.starts_with(b"pacer_dispatch_")
    {
        return None;
    }
    let keys: usize = text(args.get(2)?).parse().ok()?;
    let routes = args[3..3 + keys]
        .iter()
        .map(|k| text(k))
        .filter(|k| k.ends_with(":ready"))
        .collect();
    Some(routes)
}

/// The reserve kept from long queues (a read's worth for each reader and the claimer) is kept
/// for other routes' events; a worker whose one route is all it serves keeps nothing from it:
/// that route's backlog has every place asleep (20 of 20), and parks nothing.
#[test]
fn a_lone_route_takes_every_place_and_parks_nothing() {
    let redis = RedisServer::start();
    let dir = TempDir::new("lone-route");
    let port = free_port();
    let body =
        "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 5/s, burst: 1, max_wait: 60s}\n";
    let worker = "  batch: 5\n  max_inflight: 20\n  claim_idle: 70s";
    let cfg = config(&dir, "c.yaml", &redis, port, worker, body);
    let events: Vec<_> = (0..60)
        .map(|i| event(&[("route", "a"), ("n", &i.to_string())]))
        .collect();
    push(&redis, "in", &events);
    let pacer = start(&cfg, port);
    let (mut most_asleep, mut most_parked) = (0.0_f64, 0.0_f64);
    let full = wait_until(Duration::from_secs(10), || {
        most_asleep = most_asleep.max(pacer::testkit::metric_at(port, "pacer_sleeping_events"));
        most_parked = most_parked.max(pacer::testkit::metric_at(port, "pacer_parked_events"));
        most_asleep >= 20.0
    });
    assert!(full, "at most {most_asleep} asleep:\n{}", pacer.log_text());
    // A few more looks while the backlog is long.
    for _ in 0..10 {
        most_asleep = most_asleep.max(pacer::testkit::metric_at(port, "pacer_sleeping_events"));
        most_parked = most_parked.max(pacer::testkit::metric_at(port, "pacer_parked_events"));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!((most_asleep, most_parked), (20.0, 0.0));
}
