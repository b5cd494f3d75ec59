//! Outages longer than `dedupe_ttl` (issue 12, point 3): the markers that keep an entry's fate
//! single expire while the entry may still be pending. An entry found older than `dedupe_ttl`
//! with nothing on record is never decided a second time: it is dead-lettered once, reason
//! `expired`, with its fields. Here the whole fleet is down longer than that (`kill -9`), and,
//! separately, one worker is frozen (SIGSTOP) longer than `claim_idle + dedupe_ttl` while
//! another finishes its events and their markers expire; the frozen one wakes holding them.
//! And within `dedupe_ttl`, the markers are what keeps a group moved back or deleted by hand
//! from placing again what it delivers a second time.

mod common;

use common::*;
use pacer::testkit::{
    command_calls, create_group, free_port, metric_at, wait_until, Pacer, RedisServer, TempDir,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A 4/s route with waits up to 1 s. claim_idle must exceed max_wait + 1 s, dedupe_ttl must
/// exceed claim_idle × max_deliveries + max_wait (5.2 s): the shortest the config allows.
const BODY: &str = r#"outbound:
  streams: ["in"]
  dedupe_ttl: 6s
  routes:
    slow: {rate: 4/s, burst: 1, max_wait: 1s}
"#;
const WORKER: &str = "  batch: 16\n  claim_idle: 2100ms\n  max_deliveries: 2\n  drain: 500ms";
const DEDUPE_TTL: Duration = Duration::from_secs(6);
const OUTPUTS: [&str; 3] = ["pacer:{slow}:ready", "pacer:rejected", "pacer:dead"];

fn events(tag: &str, n: usize) -> Vec<Vec<(String, Vec<u8>)>> {
    (0..n)
        .map(|i| event(&[("route", "slow"), ("n", &format!("{tag}-{i}"))]))
        .collect()
}

fn sleeping(port: u16) -> f64 {
    metric_at(port, "pacer_sleeping_events")
}

/// Waits until every id in `ids` has ended somewhere; then checks each ended once.
fn wait_all_ended(redis: &RedisServer, ids: &[String], limit: Duration) {
    let ended = wait_until(limit, || {
        let at = placements(redis, &OUTPUTS);
        ids.iter().all(|id| at.contains_key(id))
    });
    assert!(
        ended,
        "not every entry ended: {:?}",
        placements(redis, &OUTPUTS)
    );
    // Time for a second write to show, should one come.
    std::thread::sleep(Duration::from_millis(1500));
    assert_each_once(redis, ids, &OUTPUTS, "in");
}

/// Whether every decision marker has expired (the claimer's last ones are written up to a
/// max_wait after it claimed, so this is waited for rather than timed).
fn no_markers(redis: &RedisServer) -> bool {
    keys(redis).iter().all(|k| !k.contains(":dec:"))
}

/// The dead letters with reason `expired`, by source id, with the producer's `n` field.
fn expired(redis: &RedisServer) -> Vec<(String, String)> {
    read(redis, "pacer:dead")
        .iter()
        .filter(|d| d.field("pacer_reason") == Some("expired"))
        .map(|d| {
            (
                d.field("pacer_source_id").unwrap().to_string(),
                d.field("n")
                    .expect("an expired entry keeps its fields")
                    .to_string(),
            )
        })
        .collect()
}

#[test]
fn a_fleet_down_longer_than_dedupe_ttl_decides_nothing_twice() {
    let redis = RedisServer::start();
    let dir = TempDir::new("outage");
    let port = free_port();
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, BODY);

    // A worker that read entries and died before deciding any: they sit pending, undecided.
    create_group(&mut redis.con(), "in", "pacer");
    let ghost = push(&redis, "in", &events("ghost", 4));
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("pacer")
        .arg("ghost")
        .arg("STREAMS")
        .arg("in")
        .arg(">")
        .query(&mut redis.con())
        .unwrap();

    // The fleet: one worker, killed while it holds sleeping events with recorded slots.
    let mut first = start(&cfg, port);
    let before = push(&redis, "in", &events("before", 8));
    assert!(
        wait_until(Duration::from_secs(5), || sleeping(port) >= 2.0),
        "no events sleeping:\n{}",
        first.log_text()
    );
    first.kill();
    let killed = Instant::now();
    let settled_before: Vec<String> = placements(&redis, &OUTPUTS).into_keys().collect();
    // Produced while nothing runs.
    let during = push(&redis, "in", &events("during", 5));

    // Down longer than dedupe_ttl: every marker the fleet wrote has expired.
    std::thread::sleep((DEDUPE_TTL + Duration::from_millis(500)).saturating_sub(killed.elapsed()));
    assert!(
        wait_until(Duration::from_secs(10), || no_markers(&redis)),
        "markers outlived dedupe_ttl: {:?}",
        keys(&redis)
    );

    let down = killed.elapsed();
    let second = start(&cfg, port);
    let after = push(&redis, "in", &events("after", 3));
    let all: Vec<String> = [&ghost, &before, &during, &after]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
    wait_all_ended(&redis, &all, Duration::from_secs(15));

    // What the first worker had not finished (the ghost's entries, its sleepers) and what was
    // produced during the outage are older than dedupe_ttl with nothing on record: dead-lettered
    // once as expired, fields and all. What came after is placed as usual.
    let expired = expired(&redis);
    let expired_ids: Vec<&String> = expired.iter().map(|(id, _)| id).collect();
    for id in ghost.iter().chain(&during) {
        assert!(expired_ids.contains(&id), "{id} not expired: {expired:?}");
    }
    for id in before.iter().filter(|id| !settled_before.contains(id)) {
        assert!(
            expired_ids.contains(&id),
            "{id} held at the kill, not expired"
        );
    }
    for id in &after {
        assert!(!expired_ids.contains(&id), "{id} is new, yet expired");
    }
    let ready = read(&redis, "pacer:{slow}:ready");
    assert!(ready.iter().any(|e| e.field("n") == Some("after-0")));
    assert_rate(&redis, "pacer:{slow}:ready", 4.0, 1.0);
    println!(
        "fleet down {:.1} s: {} expired ({} never decided, {} sleeping at the kill, {} produced meanwhile), {} settled before the kill",
        down.as_secs_f64(),
        expired.len(),
        ghost.len(),
        before.len() - settled_before.len(),
        during.len(),
        settled_before.len()
    );
    drop(second);
}

/// A worker frozen (SIGSTOP) while it holds sleeping events; another claims and finishes them;
/// their markers expire; the frozen worker wakes (SIGCONT) still holding them. Each entry ended
/// once already, and the woken worker must not place, reject or dead-letter any again.
#[test]
fn a_worker_frozen_past_dedupe_ttl_wakes_and_writes_nothing_twice() {
    let redis = RedisServer::start();
    let dir = TempDir::new("frozen");
    let (port_a, port_b) = (free_port(), free_port());
    let cfg_a = config(&dir, "a.yaml", &redis, port_a, WORKER, BODY);
    let cfg_b = config(&dir, "b.yaml", &redis, port_b, WORKER, BODY);

    let frozen = start(&cfg_a, port_a);
    let ids = push(&redis, "in", &events("e", 6));
    assert!(
        wait_until(Duration::from_secs(5), || sleeping(port_a) >= 2.0),
        "no events sleeping:\n{}",
        frozen.log_text()
    );
    let held = sleeping(port_a);
    frozen.signal("STOP");
    let stopped = Instant::now();

    // The other worker claims what the frozen one held after claim_idle and finishes it.
    let other = start(&cfg_b, port_b);
    wait_all_ended(&redis, &ids, Duration::from_secs(15));
    let before: Vec<_> = OUTPUTS
        .iter()
        .map(|s| read(&redis, s).len())
        .collect::<Vec<_>>();

    // Frozen past claim_idle + dedupe_ttl: the claimer's markers are gone too.
    let frozen_for = Duration::from_millis(2100) + DEDUPE_TTL;
    std::thread::sleep(frozen_for.saturating_sub(stopped.elapsed()));
    assert!(
        wait_until(Duration::from_secs(10), || no_markers(&redis)),
        "markers outlived dedupe_ttl: {:?}",
        keys(&redis)
    );
    frozen.signal("CONT");
    // It wakes, finds its slots' decisions gone and must let the events go.
    std::thread::sleep(Duration::from_secs(3));
    let after: Vec<_> = OUTPUTS
        .iter()
        .map(|s| read(&redis, s).len())
        .collect::<Vec<_>>();
    assert_eq!(
        before,
        after,
        "the woken worker wrote again:\n{}",
        frozen.log_text()
    );
    assert_each_once(&redis, &ids, &OUTPUTS, "in");
    println!(
        "frozen {:.1} s holding {held} sleeping events; on waking it wrote nothing",
        stopped.elapsed().as_secs_f64()
    );
    drop(other);
}

/// What a group moved back by hand does: every entry after its new position is delivered again.
fn rewind(redis: &RedisServer, stream: &str, how: &str) {
    let mut con = redis.con();
    match how {
        // Moved back to the stream's start: its pending entries stay, the rest come again.
        "setid" => redis::cmd("XGROUP")
            .arg("SETID")
            .arg(stream)
            .arg("pacer")
            .arg("0")
            .query::<()>(&mut con)
            .unwrap(),
        // Deleted: the worker's next read is told NOGROUP and makes it again at the start.
        "destroy" => {
            let _: i64 = redis::cmd("XGROUP")
                .arg("DESTROY")
                .arg(stream)
                .arg("pacer")
                .query(&mut con)
                .unwrap();
        }
        _ => unreachable!(),
    }
}

/// Each input entry's decision is on record for `dedupe_ttl`, and that record is all that tells
/// a re-delivery from a new entry once a group is moved back by hand (`XGROUP SETID … 0`) or
/// deleted (made again at the stream's start): the re-delivered entries are in the pending list
/// again like new ones. Both are done while events sleep on a paced route, with others already
/// dispatched at once, rejected as too long and forwarded or refused inbound: each ends once,
/// and nothing is left pending.
#[test]
fn a_group_rewound_or_deleted_by_hand_places_nothing_twice() {
    let redis = RedisServer::start();
    let dir = TempDir::new("rewound");
    let port = free_port();
    let inbound =
        inbound_body("{name: per-source, key: [source], algorithm: sliding_log, limits: [3/s]}");
    let body = format!(
        "outbound:\n  streams: [\"in\"]\n  routes:\n    fast: {{rate: 1000/s, burst: 100}}\n    slow: {{rate: 2/s, burst: 1, max_wait: 3s}}\n{inbound}"
    );
    let cfg = config(
        &dir,
        "c.yaml",
        &redis,
        port,
        "  batch: 16\n  drain: 500ms",
        &body,
    );
    let outputs = [
        "pacer:{fast}:ready",
        "pacer:{slow}:ready",
        "pacer:rejected",
        "pacer:dead",
    ];
    let in_outputs = ["pacer:accepted", "pacer:in-rejected"];
    let pacer = start(&cfg, port);

    let (mut out_ids, mut in_ids) = (Vec::new(), Vec::new());
    for (round, how) in ["setid", "destroy"].into_iter().enumerate() {
        // Outbound: 20 at once, 10 on a 2/s route (about 7 within its 3 s wait, the rest too
        // long); inbound: 10 from one source allowed 3 a second.
        let mut out: Vec<_> = (0..20)
            .map(|i| event(&[("route", "fast"), ("n", &format!("{round}-{i}"))]))
            .collect();
        out.extend((0..10).map(|i| event(&[("route", "slow"), ("n", &format!("{round}-s{i}"))])));
        let ids = push(&redis, "in", &out);
        let inb: Vec<_> = (0..10)
            .map(|i| event(&[("source", "s1"), ("n", &format!("{round}-{i}"))]))
            .collect();
        let inb_ids = push(&redis, "pacer:in", &inb);
        assert!(
            wait_until(Duration::from_secs(5), || sleeping(port) >= 2.0
                && placements(&redis, &in_outputs).len()
                    == in_ids.len() + inb_ids.len()),
            "{} sleeping, inbound {:?}:\n{}",
            sleeping(port),
            placements(&redis, &in_outputs),
            pacer.log_text()
        );
        // Moved back while events sleep: every entry of both streams comes again.
        rewind(&redis, "in", how);
        rewind(&redis, "pacer:in", how);
        out_ids.extend(ids);
        in_ids.extend(inb_ids);
        let ended = wait_until(Duration::from_secs(15), || {
            placements(&redis, &outputs).len() == out_ids.len()
                && unfinished(&redis, "in", "pacer") == 0
                && unfinished(&redis, "pacer:in", "pacer") == 0
        });
        assert!(
            ended,
            "after {how}: {} of {} ended, {} unfinished:\n{}",
            placements(&redis, &outputs).len(),
            out_ids.len(),
            unfinished(&redis, "in", "pacer"),
            pacer.log_text()
        );
        // Time for a second write to show, should one come.
        std::thread::sleep(Duration::from_millis(1500));
        assert_each_once(&redis, &out_ids, &outputs, "in");
        assert_each_once(&redis, &in_ids, &in_outputs, "pacer:in");
    }
    let at = placements(&redis, &outputs);
    let count = |stream: &str| at.values().filter(|s| s[0] == stream).count();
    // Each path was taken, so each kind of decision was delivered again.
    assert_eq!(count("pacer:{fast}:ready"), 40, "{at:?}");
    assert!(count("pacer:{slow}:ready") >= 4, "{at:?}");
    assert!(count("pacer:rejected") >= 4, "{at:?}");
    assert_rate(&redis, "pacer:{slow}:ready", 2.0, 1.0);
    // Inbound: each round's ten came at once, more than a second after the last round's.
    assert_eq!(read(&redis, "pacer:accepted").len(), 6);
    println!(
        "moved back twice: {} outbound and {} inbound entries each ended once",
        out_ids.len(),
        in_ids.len()
    );
}

/// Each consumer of group `pacer` on `stream` by name, with its idle time in ms.
fn consumer_idles(con: &mut redis::Connection, stream: &str) -> BTreeMap<String, i64> {
    consumer_table(con, stream, "pacer")
        .into_iter()
        .map(|(name, (_, idle))| (name, idle))
        .collect()
}

/// The heartbeat keeps the reaper from deleting a live consumer: a worker that reads nothing
/// (its stream stays empty, and Redis 7.0 does not refresh a consumer's idle time on an empty
/// read of new entries) stays in the group through many rounds of another worker's reaper, its
/// idle time never near the reaper's threshold, while the consumer of a worker killed with
/// nothing pending is deleted once it has been silent that long, and so is a departed consumer
/// left later. The shortest the config allows: an inbound flow alone (no route's `max_wait` to
/// exceed), `claim_idle` 100 ms, so the reaper runs every 500 ms (10 claim ticks of 50 ms) and
/// deletes consumers idle 1 s (twice `claim_idle`, at least 1 s); a beat every 500 ms.
#[test]
fn a_live_worker_reading_nothing_outlives_the_reaper_and_a_killed_ones_consumer_goes() {
    const STREAM: &str = "pacer:in";
    const MIN_IDLE_MS: i64 = 1_000;
    let redis = RedisServer::start();
    let dir = TempDir::new("reaped");
    let body = inbound_body("{name: per-source, key: [source], algorithm: gcra, limits: [10/s]}");
    let worker = |name: &str| format!("  batch: 16\n  claim_idle: 100ms\n  consumer: {name}");
    let mut workers: BTreeMap<&str, (Pacer, u16)> = BTreeMap::new();
    for name in ["alive", "killed", "reaper"] {
        let port = free_port();
        let cfg = config(
            &dir,
            &format!("{name}.yaml"),
            &redis,
            port,
            &worker(name),
            &body,
        );
        workers.insert(name, (start(&cfg, port), port));
    }
    let mut con = redis.con();
    let mut idles = || consumer_idles(&mut con, STREAM);
    let listed = wait_until(Duration::from_secs(10), || idles().len() == 3);
    assert!(listed, "consumers: {:?}", idles());
    assert_eq!(
        idles().into_keys().collect::<Vec<_>>(),
        ["alive", "killed", "reaper"]
    );
    let deleted = |con: &mut redis::Connection| command_calls(con, "xgroup|delconsumer");
    assert_eq!(deleted(&mut redis.con()), 0);

    // Watches the group until `until` holds; every sample must list `alive`, idle under the
    // reaper's threshold. Returns the highest idle `alive` showed.
    let watch = |until: &mut dyn FnMut(&BTreeMap<String, i64>, Instant) -> bool,
                 limit: Duration,
                 what: &str|
     -> i64 {
        let mut con = redis.con();
        let (started, mut highest) = (Instant::now(), 0);
        loop {
            let now = consumer_idles(&mut con, STREAM);
            let at = Instant::now();
            let alive = *now
                .get("alive")
                .unwrap_or_else(|| panic!("the live worker's consumer was deleted: {now:?}"));
            assert!(
                alive < MIN_IDLE_MS,
                "the live worker idle {alive} ms: {now:?}"
            );
            highest = highest.max(alive);
            if until(&now, at) {
                return highest;
            }
            assert!(started.elapsed() < limit, "{what}: {now:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // kill -9: the killed worker's consumer holds nothing and beats no more. It is deleted once
    // silent MIN_IDLE_MS, at the next reaper round (every 500 ms, on two workers).
    workers.get_mut("killed").unwrap().0.kill();
    let killed = Instant::now();
    let mut last_beat: Option<Instant> = None;
    let mut gone_at = None;
    let mut killed_gone = |now: &BTreeMap<String, i64>, at: Instant| match now.get("killed") {
        Some(&idle) => {
            let beat = at - Duration::from_millis(idle as u64);
            last_beat = Some(last_beat.map_or(beat, |b: Instant| b.max(beat)));
            false
        }
        None => {
            gone_at = Some(at);
            true
        }
    };
    let mut highest = watch(
        &mut killed_gone,
        Duration::from_secs(10),
        "the killed worker's consumer was not deleted",
    );
    let (last_beat, gone_at) = (last_beat.expect("listed after the kill"), gone_at.unwrap());
    let silent = gone_at - last_beat;
    assert!(
        silent >= Duration::from_millis(MIN_IDLE_MS as u64 - 50),
        "deleted after only {silent:?} of silence"
    );
    assert_eq!(deleted(&mut redis.con()), 1);

    // Many more rounds of both live workers' reapers (each 500 ms): the live one stays.
    let watched = Instant::now();
    highest = highest.max(watch(
        &mut |_, at| at - watched >= Duration::from_secs(4),
        Duration::from_secs(10),
        "",
    ));
    // The reapers still run at the end: a departed consumer left now (it holds nothing) goes.
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg(&["GROUP", "pacer", "departed", "STREAMS", STREAM, "0"])
        .query(&mut redis.con())
        .unwrap();
    highest = highest.max(watch(
        &mut |now, _| !now.contains_key("departed"),
        Duration::from_secs(10),
        "the departed consumer was not deleted",
    ));
    let now = consumer_idles(&mut redis.con(), STREAM);
    assert_eq!(now.into_keys().collect::<Vec<_>>(), ["alive", "reaper"]);
    assert_eq!(
        deleted(&mut redis.con()),
        2,
        "only the killed and the departed consumers were ever deleted"
    );
    for name in ["alive", "reaper"] {
        let (pacer, _) = &workers[name];
        assert!(
            !pacer.log_text().contains("panicked"),
            "{name}:\n{}",
            pacer.log_text()
        );
    }
    println!(
        "killed consumer deleted {:.1} s after the kill ({:.1} s silent); the live one idle at most {highest} ms over {:.1} s",
        (gone_at - killed).as_secs_f64(),
        silent.as_secs_f64(),
        killed.elapsed().as_secs_f64()
    );
}
