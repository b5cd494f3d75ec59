//! Nothing lost, nothing doubled (guarantees 2 and 6): real pacer processes killed with
//! `kill -9` or aborted at chosen moments, poison entries, Redis slow, killed and restarted with
//! AOF on, SIGTERM during an outage, and Redis memory over a long run.
//!
//! Over 400 lines: one subject's process-level tests (crashes, poison, outages) sharing one rig.

mod common;

use common::*;
use pacer::testkit::{
    command_stat, free_port, http_get, metric, metric_at, wait_until, Pacer, RedisServer, TempDir,
};
use std::time::{Duration, Instant};

const OUTPUTS: [&str; 4] = [
    "pacer:{a}:ready",
    "pacer:{b}:ready",
    "pacer:rejected",
    "pacer:dead",
];

/// Routes a (fallback b) with room for hundreds of sleeping events.
const TWO_ROUTES: &str = r#"outbound:
  streams: ["in"]
  routes:
    a: {rate: 200/s, burst: 5, max_wait: 2s, fallbacks: [b]}
    b: {rate: 100/s, burst: 1, max_wait: 2s}
"#;

/// Waits up to `within` until the group has finished `in` (nothing pending or unread: an entry
/// pushed but not read yet is not pending either), showing `pacer`'s log if not, then checks that each of `ids` ended in exactly one of the outputs: where each did.
fn drained_each_once(
    redis: &RedisServer,
    ids: &[String],
    pacer: &Pacer,
    within: Duration,
) -> std::collections::BTreeMap<String, Vec<String>> {
    assert!(
        wait_until(within, || unfinished(redis, "in", "pacer") == 0),
        "still pending:\n{}",
        pacer.log_text()
    );
    assert_each_once(redis, ids, &OUTPUTS, "in")
}

fn events(prefix: &str, n: usize) -> Vec<Vec<(String, Vec<u8>)>> {
    (0..n)
        .map(|i| {
            let route = if i % 5 == 4 { "b" } else { "a" };
            event(&[("route", route), ("id", &format!("{prefix}-{i}"))])
        })
        .collect()
}

fn sleeping(port: u16) -> f64 {
    metric_at(port, "pacer_sleeping_events")
}

fn claimed(port: u16) -> f64 {
    metric_at(port, "pacer_claimed_total")
}

/// How far ahead of Redis's clock a route's plan runs (its queue), ms.
fn queued_ms(redis: &RedisServer, route: &str) -> i64 {
    let tat: Option<i64> = redis::cmd("HGET")
        .arg(format!("pacer:{{{route}}}:bucket:{route}"))
        .arg("tat")
        .query(&mut redis.con())
        .unwrap();
    tat.map_or(0, |t| t / 1000 - redis_time_ms(redis))
}

fn not_ready(port: u16) -> bool {
    matches!(http_get(port, "/readyz"), Some((503, _)))
}

/// Runs a worker that aborts at crash `point` (`PACER_CRASH_AT`, see `src/fault.rs`) and waits
/// until it has. Not waited ready for: the entries may be there already and it may die at once.
fn crash_at(cfg: &std::path::Path, point: &str) {
    let mut victim = Pacer::run(bin(), cfg, &[("PACER_CRASH_AT", point)]);
    let name = point.split(':').next().unwrap_or(point);
    assert!(
        victim.wait_for(Duration::from_secs(10)).is_some()
            && victim
                .log_text()
                .contains(&format!("PACER_CRASH_AT reached {name}")),
        "{point} never reached:\n{}",
        victim.log_text()
    );
}

/// Two workers that die in turn: the first once its first schedule call has decided (before it
/// acknowledges or dispatches a sleeper), the second, which claims what the first held, once it
/// has read (before it decides anything). Every entry pending then has been delivered twice.
fn two_dying_deliveries(dir: &TempDir, redis: &RedisServer, worker: &str, body: &str) {
    for (i, point) in ["scheduled:1", "read:1"].iter().enumerate() {
        let cfg = config(dir, &format!("v{i}.yaml"), redis, free_port(), worker, body);
        crash_at(&cfg, point);
    }
}

/// A small deterministic generator for kill timings (the test must be repeatable).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// Guarantee 2 under `kill -9`: one of three workers is killed in every round, either aborted
/// at a chosen moment (entries read but not decided; decisions recorded and sleeping; dispatched
/// but not acknowledged) or killed from outside while it holds sleeping events. The survivors
/// claim what it held. Every entry ends exactly once, the rate holds, nothing stays pending.
#[test]
fn kill_minus_nine_at_any_moment_loses_and_doubles_nothing() {
    let redis = RedisServer::start();
    let dir = TempDir::new("kill");
    let worker = "  batch: 32\n  drain: 1s\n  claim_idle: 3500ms\n  max_deliveries: 20";
    let mut survivors = Vec::new();
    for i in 0..2 {
        let port = free_port();
        let cfg = config(
            &dir,
            &format!("s{i}.yaml"),
            &redis,
            port,
            worker,
            TWO_ROUTES,
        );
        survivors.push((start(&cfg, port), port));
    }
    // Crash points by name (`PACER_CRASH_AT`), or "kill" for kill -9 from outside.
    let rounds = [
        "read:1",
        "kill",
        "scheduled:1",
        "kill",
        "dispatched:5",
        "kill",
        "read:2",
        "kill",
        "scheduled:3",
        "kill",
        "dispatched:20",
        "kill",
    ];
    let mut rng = Lcg(20261121);
    let mut ids = Vec::new();
    let mut held_at_kill = Vec::new();
    let mut crashed = 0;
    for (r, mode) in rounds.iter().enumerate() {
        let port = free_port();
        let cfg = config(
            &dir,
            &format!("v{r}.yaml"),
            &redis,
            port,
            worker,
            TWO_ROUTES,
        );
        let env: Vec<(&str, &str)> = match *mode {
            "kill" => vec![],
            point => vec![("PACER_CRASH_AT", point)],
        };
        let mut victim = start_wrapped(&[], &env, &cfg, port);
        // Let the routes' queues empty first, so that this round's events sleep rather than
        // being rejected at once.
        wait_until(Duration::from_secs(5), || queued_ms(&redis, "a") < 100);
        ids.extend(push(&redis, "in", &events(&format!("r{r}"), 600)));
        if *mode == "kill" {
            wait_until(Duration::from_secs(3), || sleeping(port) >= 100.0);
            std::thread::sleep(Duration::from_millis(rng.below(400)));
            held_at_kill.push(sleeping(port));
            victim.kill();
        } else {
            let code = victim.wait_for(Duration::from_secs(10));
            victim.kill();
            assert!(
                victim.log_text().contains("PACER_CRASH_AT reached"),
                "round {r}: {mode} was never reached (exit {code:?}):\n{}",
                victim.log_text()
            );
            crashed += 1;
        }
    }

    let total = ids.len();
    let settled = wait_until(Duration::from_secs(90), || {
        placements(&redis, &OUTPUTS).len() == total && pending(&redis, "in", "pacer") == 0
    });
    assert!(
        settled,
        "{} of {total} placed, {} pending",
        placements(&redis, &OUTPUTS).len(),
        pending(&redis, "in", "pacer")
    );
    let at = assert_each_once(&redis, &ids, &OUTPUTS, "in");
    assert_rate(&redis, "pacer:{a}:ready", 200.0, 5.0);
    assert_rate(&redis, "pacer:{b}:ready", 100.0, 1.0);
    // No entry was mistaken for a duplicate or a poison: each was redelivered at most a few
    // times and its recorded decision was finished, not taken again.
    let dead = read(&redis, "pacer:dead");
    assert!(dead.is_empty(), "dead-lettered: {:?}", dead[0].fields);
    // The victims' consumers are deleted once idle and empty (a survivor's may go too, when it
    // has nothing pending: reading recreates it).
    let consumers = || -> usize {
        let v: Vec<redis::Value> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg("in")
            .arg("pacer")
            .query(&mut redis.con())
            .unwrap();
        v.len()
    };
    let joined = consumers();
    assert!(
        wait_until(Duration::from_secs(30), || consumers() <= 2),
        "{} consumers in the group, 2 workers alive",
        consumers()
    );
    eprintln!("consumers: {joined} in the group once settled, at most 2 after reaping");
    let claims: f64 = survivors.iter().map(|(_, port)| claimed(*port)).sum();
    assert!(claims > 0.0, "the survivors claimed nothing");
    assert!(
        held_at_kill.iter().any(|&n| n >= 100.0),
        "no victim held 100 sleeping events when killed: {held_at_kill:?}"
    );
    let dispatched = at.values().filter(|v| v[0].ends_with(":ready")).count();
    eprintln!(
        "kill -9 test: {} kills from outside (sleeping events held: {held_at_kill:?}), {crashed} aborts at crash points, {total} entries: {dispatched} dispatched, {} rejected; {claims} claimed by survivors; none lost, none doubled",
        held_at_kill.len(),
        total - dispatched
    );
    for (mut p, _) in survivors {
        assert!(
            p.wait_for(Duration::from_millis(1)).is_none(),
            "a survivor died"
        );
        p.kill();
    }
}

/// An entry whose every delivery kills its worker ends in the dead-letter stream with reason
/// too_many_deliveries and is acknowledged. Its sleeping decision is voided first; an entry of
/// the same batch that was already dispatched is only acknowledged, not dead-lettered too.
#[test]
fn a_poison_entry_is_dead_lettered_after_max_deliveries_and_nothing_doubles() {
    let redis = RedisServer::start();
    let dir = TempDir::new("poison");
    let worker = "  batch: 8\n  drain: 1s\n  claim_idle: 1600ms\n  max_deliveries: 2";
    let body = r#"outbound:
  streams: ["in"]
  routes:
    a: {rate: 10/s, burst: 1, max_wait: 500ms}
"#;
    let ids = push(
        &redis,
        "in",
        &[
            event(&[("route", "a"), ("id", "now")]),
            event(&[("route", "a"), ("id", "later")]),
            event(&[("id", "no-route")]),
        ],
    );
    // Delivery 1 records the decisions ("now" dispatched at once, "later" sleeping) and dies
    // before acknowledging; delivery 2 is claimed and dies before deciding anything.
    two_dying_deliveries(&dir, &redis, worker, body);
    assert_eq!(read(&redis, "pacer:{a}:ready").len(), 1);
    // Delivery 3 is one too many.
    let port = free_port();
    let cfg = config(&dir, "w.yaml", &redis, port, worker, body);
    let mut pacer = start(&cfg, port);
    let at = drained_each_once(&redis, &ids, &pacer, Duration::from_secs(15));
    assert_eq!(
        at[&ids[0]],
        vec!["pacer:{a}:ready"],
        "dispatched once, kept"
    );
    let dead = read(&redis, "pacer:dead");
    let reason = |id: &str| {
        let e = dead
            .iter()
            .find(|e| e.field("pacer_source_id") == Some(id))
            .expect("dead-lettered");
        (
            e.field("pacer_reason").unwrap().to_string(),
            e.field("pacer_detail").unwrap().to_string(),
        )
    };
    let (why, detail) = reason(&ids[1]);
    assert_eq!(why, "too_many_deliveries");
    assert!(detail.contains("delivered 3 times"), "{detail}");
    // A malformed entry keeps its own reason, however often it came.
    assert_eq!(reason(&ids[2]).0, "malformed");
    // The sleeping decision was voided: nobody can dispatch "later" any more.
    let keys = pacer::keys::RouteKeys::new("a", "pacer:{a}:ready");
    let decision: String = redis::cmd("HGET")
        .arg(keys.decisions("in", &ids[1]))
        .arg(&ids[1])
        .query(&mut redis.con())
        .unwrap();
    assert_eq!(decision, "v0");
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(read(&redis, "pacer:{a}:ready").len(), 1);
    pacer.kill();
}

/// A poison entry whose route's keys were overwritten with another kind of value is still ended:
/// voiding its decision met WRONGTYPE and was retried forever, the entry pending for good. A
/// decision hash of another kind holds no decision to void; an id claim of another kind names
/// no owner, and the sleeping decision beside it is voided all the same, so nothing dispatches it.
#[test]
fn a_poison_entry_whose_route_keys_were_overwritten_is_still_dead_lettered() {
    let redis = RedisServer::start();
    let dir = TempDir::new("poison-clobbered");
    let worker = "  batch: 8\n  drain: 1s\n  claim_idle: 1600ms\n  max_deliveries: 2";
    let body =
        "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 10/s, burst: 1, max_wait: 500ms}\n";
    // The first goes at once; the second sleeps on a decision in a hash of its own span, with
    // an id claim; the third sleeps too, in a later span, with an id claim.
    let mut ids = push(
        &redis,
        "in",
        &[
            event(&[("route", "a")]),
            event(&[("route", "a"), ("id", "k1")]),
        ],
    );
    std::thread::sleep(Duration::from_millis(2 * pacer::keys::DECISION_HASH_MS));
    ids.extend(push(
        &redis,
        "in",
        &[event(&[("route", "a"), ("id", "k2")])],
    ));
    // Delivery 1 decides and dies before any sleeper goes; delivery 2 dies before deciding.
    two_dying_deliveries(&dir, &redis, worker, body);
    let keys = pacer::keys::RouteKeys::new("a", "pacer:{a}:ready");
    let decision = |id: &str| -> Option<String> {
        redis::cmd("HGET")
            .arg(keys.decisions("in", id))
            .arg(id)
            .query(&mut redis.con())
            .unwrap()
    };
    assert!(decision(&ids[1]).unwrap().starts_with('s'));
    assert!(decision(&ids[2]).unwrap().starts_with('s'));
    let mut con = redis.con();
    let _: () = redis::cmd("SET")
        .arg(keys.decisions("in", &ids[1]))
        .arg("not a hash")
        .query(&mut con)
        .unwrap();
    // And k1's id now names another entry: with its decision gone, that still makes the second
    // a duplicate (found by review: the owner was lost with the hash).
    let _: () = redis::cmd("SET")
        .arg(keys.claim("k1"))
        .arg("1-1@elsewhere")
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(keys.claim("k2"))
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(keys.claim("k2"))
        .arg("not")
        .arg("a string")
        .query(&mut con)
        .unwrap();
    // Delivery 3 is one too many for both.
    let port = free_port();
    let cfg = config(&dir, "w.yaml", &redis, port, worker, body);
    let mut pacer = start(&cfg, port);
    let at = drained_each_once(&redis, &ids, &pacer, Duration::from_secs(15));
    assert_eq!(at[&ids[0]], vec!["pacer:{a}:ready"]);
    for id in &ids[1..] {
        assert_eq!(at[id], vec!["pacer:dead"], "{}", pacer.log_text());
    }
    let reasons: Vec<String> = ids[1..]
        .iter()
        .map(|id| {
            let dead = read(&redis, "pacer:dead");
            let e = dead
                .iter()
                .find(|e| e.field("pacer_source_id") == Some(id.as_str()))
                .expect("dead-lettered");
            e.field("pacer_reason").unwrap().to_string()
        })
        .collect();
    assert_eq!(reasons, ["duplicate", "too_many_deliveries"]);
    assert_eq!(decision(&ids[2]).as_deref(), Some("v0"));
    assert!(pacer.log_text().contains("no decision there to void"));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(read(&redis, "pacer:{a}:ready").len(), 1);
    pacer.kill();
}

/// Guarantee 6: Redis slow (DEBUG SLEEP past the command timeout), then killed and restarted
/// with AOF on, in the middle of a run. Workers stay up, say not ready while Redis is gone, back
/// off instead of spinning, reload their scripts, and finish every entry exactly once with the
/// rate held across the outage (the buckets came back from the AOF).
#[test]
fn redis_slow_then_restarted_with_aof_loses_and_doubles_nothing() {
    let mut redis = RedisServer::start_with(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--enable-debug-command",
        "local",
    ]);
    let dir = TempDir::new("restart");
    let worker = "  batch: 32\n  drain: 1s\n  claim_idle: 3500ms";
    let mut workers = Vec::new();
    for i in 0..2 {
        let port = free_port();
        let cfg = config(
            &dir,
            &format!("w{i}.yaml"),
            &redis,
            port,
            worker,
            TWO_ROUTES,
        );
        workers.push((start(&cfg, port), port));
    }
    let mut ids = push(&redis, "in", &events("before", 500));
    std::thread::sleep(Duration::from_millis(500));

    // Slow: Redis stalls for 1.5 s, three times the 500 ms command timeout.
    let url = redis.url();
    let stall = std::thread::spawn(move || {
        let mut con = redis::Client::open(url).unwrap().get_connection().unwrap();
        let _: () = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(1.5)
            .query(&mut con)
            .unwrap();
    });
    let noticed_slow = wait_until(Duration::from_millis(1400), || {
        workers.iter().all(|(_, port)| not_ready(*port))
    });
    stall.join().unwrap();
    assert!(noticed_slow, "/readyz stayed 200 while Redis stalled");

    // Gone: killed (SIGKILL) for 3 s, then restarted on its AOF.
    std::thread::sleep(Duration::from_millis(300));
    redis.kill();
    let down_at = Instant::now();
    assert!(wait_until(Duration::from_secs(5), || workers
        .iter()
        .all(|(_, port)| not_ready(*port))));
    std::thread::sleep(Duration::from_secs(3).saturating_sub(down_at.elapsed()));
    redis.restart();
    ids.extend(push(&redis, "in", &events("after", 300)));

    let total = ids.len();
    let settled = wait_until(Duration::from_secs(60), || {
        placements(&redis, &OUTPUTS).len() == total && pending(&redis, "in", "pacer") == 0
    });
    assert!(
        settled,
        "{} of {total} placed",
        placements(&redis, &OUTPUTS).len()
    );
    assert_each_once(&redis, &ids, &OUTPUTS, "in");
    assert_rate(&redis, "pacer:{a}:ready", 200.0, 5.0);
    assert_rate(&redis, "pacer:{b}:ready", 100.0, 1.0);
    assert!(read(&redis, "pacer:dead").is_empty());
    for (pacer, port) in &mut workers {
        assert!(
            pacer.wait_for(Duration::from_millis(1)).is_none(),
            "a worker exited"
        );
        assert!(wait_until(Duration::from_secs(10), || !not_ready(*port)));
        // Backoff, not a tight loop: failed Redis calls and warnings stay few over the outage.
        let (_, text) = http_get(*port, "/metrics").unwrap();
        let errors = metric(&text, "pacer_redis_errors_total");
        let warnings = pacer.log_text().matches("WARN").count();
        eprintln!("outage of ~3.5 s: {errors} failed Redis calls, {warnings} warnings");
        assert!(
            errors < 200.0,
            "{errors} failed Redis calls: retrying too fast"
        );
        assert!(warnings < 40, "{warnings} warnings:\n{}", pacer.log_text());
    }
}

/// Redis killed in the middle of writing a pacing script to its AOF: the file ends inside the
/// script's MULTI/EXEC, after its ready entry and before the decision that says it was written
/// (a SIGKILL can cut a `write` short). Restarted as the README tells operators to
/// (`redis-check-aof --fix`, which `RedisServer::restart` runs), none of the script comes back;
/// the entry, pending again, is dispatched again, once, and still once after another restart.
/// Restarted on Redis 7.0's own repair (`aof-load-truncated yes`), the ready entry's half of
/// the script stayed in the file and came back at the next restart: the event twice in its
/// ready stream (the shape of the double dispatch a 420 s chaos run found).
#[test]
fn a_script_cut_short_in_the_aof_comes_back_whole_or_not_at_all() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let dir = TempDir::new("cut");
    let port = free_port();
    let cfg = config(
        &dir,
        "w.yaml",
        &redis,
        port,
        "  claim_idle: 3100ms",
        TWO_ROUTES,
    );
    let worker = start(&cfg, port);
    let ids = push(&redis, "in", &[event(&[("route", "a"), ("n", "0")])]);
    assert!(
        wait_until(Duration::from_secs(10), || {
            read(&redis, "pacer:{a}:ready").len() == 1 && pending(&redis, "in", "pacer") == 0
        }),
        "not dispatched:\n{}",
        worker.log_text()
    );
    redis.kill();
    cut_after_ready_entry(redis.dir(), "pacer:{a}:ready");
    let repaired = redis.aof_repairs();
    redis.restart();
    assert_eq!(
        redis.aof_repairs(),
        repaired + 1,
        "the AOF was not repaired"
    );
    assert_eq!(
        read(&redis, "pacer:{a}:ready").len(),
        0,
        "the cut script left its ready entry"
    );
    assert_eq!(
        pending(&redis, "in", "pacer"),
        1,
        "the entry is not pending again"
    );
    drained_each_once(&redis, &ids, &worker, Duration::from_secs(20));
    redis.restart();
    std::thread::sleep(Duration::from_millis(500));
    drained_each_once(&redis, &ids, &worker, Duration::from_secs(5));
    assert_eq!(read(&redis, "pacer:{a}:ready").len(), 1);
}

/// Cuts the AOF in `dir` as a kill in the middle of a `write` can: halfway through the command
/// after the first XADD to `ready` in its last MULTI/EXEC. (A file that ends between two
/// commands of a transaction Redis 7.0 reads right: it drops the transaction. One that ends
/// inside a command it cuts after the last whole one, inside the transaction.)
fn cut_after_ready_entry(dir: &std::path::Path, ready: &str) {
    let aofs = dir.join("appendonlydir");
    let incr = std::fs::read_dir(&aofs)
        .expect("an AOF directory")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.to_string_lossy().ends_with(".incr.aof"))
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .expect("an incremental AOF");
    let bytes = std::fs::read(&incr).expect("reading the AOF");
    // Each command: *<n>\r\n then n times $<len>\r\n<bytes>\r\n.
    let line = |at: usize| -> (usize, usize) {
        let end = at
            + bytes[at..]
                .windows(2)
                .position(|w| w == b"\r\n")
                .expect("a line");
        let n = std::str::from_utf8(&bytes[at + 1..end])
            .unwrap()
            .parse()
            .unwrap();
        (n, end + 2)
    };
    // The first ready entry of the last transaction that writes one.
    let (mut at, mut taken, mut cut) = (0, true, None);
    while at < bytes.len() {
        let (n, mut next) = line(at);
        let mut args = Vec::new();
        for _ in 0..n {
            let (len, start) = line(next);
            args.push(&bytes[start..start + len]);
            next = start + len + 2;
        }
        let command = args
            .first()
            .map(|a| a.to_ascii_uppercase())
            .unwrap_or_default();
        if command == b"MULTI" {
            taken = false;
        } else if command == b"EXEC" {
            taken = true;
        } else if cut == Some(at) {
            cut = Some(at + (next - at) / 2);
        } else if command == b"XADD" && !taken && args[1] == ready.as_bytes() {
            (taken, cut) = (true, Some(next));
        }
        at = next;
    }
    let cut = cut.expect("a transaction with a ready entry");
    std::fs::write(&incr, &bytes[..cut]).expect("cutting the AOF");
}

/// SIGTERM while Redis is down: the worker still exits within `drain`, and what it did not
/// dispatch stays pending, unacknowledged, for another worker to finish once Redis is back.
#[test]
fn sigterm_during_an_outage_exits_within_drain_and_leaves_the_rest_pending() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let dir = TempDir::new("outage");
    let worker = "  batch: 32\n  drain: 1s\n  claim_idle: 3100ms";
    let body = r#"outbound:
  streams: ["in"]
  routes:
    a: {rate: 20/s, burst: 1, max_wait: 2s}
"#;
    let port = free_port();
    let cfg = config(&dir, "a.yaml", &redis, port, worker, body);
    let mut first = start(&cfg, port);
    let ids = push(
        &redis,
        "in",
        &(0..40)
            .map(|i| event(&[("route", "a"), ("n", &i.to_string())]))
            .collect::<Vec<_>>(),
    );
    std::thread::sleep(Duration::from_millis(400));
    redis.kill();
    std::thread::sleep(Duration::from_millis(100));
    let term = Instant::now();
    first.signal("TERM");
    let code = first.wait_for(Duration::from_secs(5));
    let took = term.elapsed();
    assert_eq!(code, Some(0), "exit code; log:\n{}", first.log_text());
    assert!(
        took < Duration::from_millis(1000 + 400),
        "took {took:?} to exit with a 1s drain"
    );
    eprintln!("SIGTERM during the outage: exited in {took:?} (drain 1s)");

    redis.restart();
    let placed = placements(&redis, &OUTPUTS).len();
    assert!(
        placed < ids.len(),
        "everything was placed before the outage"
    );
    assert_eq!(
        pending(&redis, "in", "pacer") as usize,
        ids.len() - placed,
        "every entry not placed is still pending, and no placed one is"
    );
    // Another worker claims what was left and finishes it.
    let port = free_port();
    let cfg = config(&dir, "b.yaml", &redis, port, worker, body);
    let mut second = start(&cfg, port);
    drained_each_once(&redis, &ids, &second, Duration::from_secs(20));
    assert_rate(&redis, "pacer:{a}:ready", 20.0, 1.0);
    second.kill();
}

/// Redis out of memory (`maxmemory` with `noeviction`) refuses every write and answers every
/// read. The worker used to call that an outage and the end of it at every other call: its
/// reads succeed, so `/readyz` flipped between ready and not every second and the log said
/// "failing" and "answers again" for each. Now it is not ready, for that reason, until a write
/// succeeds, and says so once each way; nothing is lost or doubled, and the rate holds.
#[test]
fn redis_out_of_memory_is_said_once_and_holds_readiness_until_writes_are_taken() {
    let redis = RedisServer::start();
    let dir = TempDir::new("oom");
    let port = free_port();
    let cfg = config(&dir, "c.yaml", &redis, port, "  batch: 32", TWO_ROUTES);
    let pacer = start(&cfg, port);
    // Read while stopped and decided once continued, against a full Redis.
    pacer.signal("STOP");
    let ids = push(&redis, "in", &events("oom", 200));
    redis.config_set("maxmemory-policy", "noeviction");
    redis.config_set("maxmemory", "1");
    pacer.signal("CONT");
    let mut answers = Vec::new();
    for _ in 0..25 {
        std::thread::sleep(Duration::from_millis(100));
        answers.push(http_get(port, "/readyz"));
    }
    redis.config_set("maxmemory", "0");
    let ready: Vec<_> = answers
        .iter()
        .filter(|a| !matches!(a, Some((503, _))))
        .collect();
    assert!(
        ready.is_empty(),
        "ready while Redis refused writes: {ready:?}"
    );
    let (_, why) = answers.last().unwrap().clone().unwrap();
    assert!(why.contains("refuses writes"), "{why}");
    drained_each_once(&redis, &ids, &pacer, Duration::from_secs(15));
    assert_rate(&redis, "pacer:{a}:ready", 200.0, 5.0);
    assert!(wait_until(Duration::from_secs(5), || !not_ready(port)));
    let log = pacer.log_text();
    assert_eq!(
        log.matches("Redis refuses pacer's writes").count(),
        1,
        "{log}"
    );
    assert_eq!(log.matches("Redis takes writes again").count(), 1, "{log}");
    assert!(!log.contains("Redis calls are failing"), "{log}");
}

/// Script calls Redis refused or failed (`rejected_calls` + `failed_calls` of FCALL and
/// EVALSHA in `INFO commandstats`).
fn refused_script_calls(redis: &RedisServer) -> u64 {
    let mut con = redis.con();
    ["fcall", "evalsha"]
        .iter()
        .flat_map(|c| ["rejected_calls", "failed_calls"].map(|s| (c, s)))
        .map(|(c, s)| command_stat(&mut con, c, s))
        .sum()
}

/// Redis refusing writes (out of memory) while a worker holds sleeping events on a busy route:
/// their dispatch calls wait for the route's backoff together, where each event falling due
/// used to make a call of its own (2,300-3,000 refused calls a second from one worker on a
/// 1000/s route, found by review). Nothing is lost or doubled, and the rate holds.
#[test]
fn sleeping_events_wait_for_their_routes_backoff_while_redis_refuses_writes() {
    let redis = RedisServer::start();
    let dir = TempDir::new("oom-sleeping");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 1000/s, burst: 1, max_wait: 10s}\n";
    let cfg = config(&dir, "s.yaml", &redis, port, "  batch: 512", body);
    let pacer = start(&cfg, port);
    let batch: Vec<_> = (0..4000)
        .map(|i| event(&[("route", "a"), ("id", &format!("s-{i}"))]))
        .collect();
    let ids = push(&redis, "in", &batch);
    assert!(
        wait_until(Duration::from_secs(10), || sleeping(port) >= 2000.0),
        "{}",
        pacer.log_text()
    );
    redis.config_set("maxmemory-policy", "noeviction");
    let before = refused_script_calls(&redis);
    redis.config_set("maxmemory", "1");
    std::thread::sleep(Duration::from_secs(2));
    let refused = refused_script_calls(&redis) - before;
    let asleep = sleeping(port);
    redis.config_set("maxmemory", "0");
    eprintln!("{refused} script calls refused in 2 s, {asleep} events asleep at its end");
    assert!(
        asleep > 0.0,
        "the OOM came after every event was dispatched"
    );
    // The backoff (50 ms doubling) retries about 5 times in 2 s; a call per event due, about
    // 2,000.
    assert!(refused <= 40, "{refused} script calls refused in 2 s");
    drained_each_once(&redis, &ids, &pacer, Duration::from_secs(20));
    assert_rate(&redis, "pacer:{a}:ready", 1000.0, 1.0);
}

/// Bounded Redis memory over a long run: output streams stay near `max_len`, every marker
/// expires, so the key count stays flat under steady traffic and falls back once it stops.
#[test]
fn redis_key_count_stays_flat_over_a_long_run() {
    let redis = RedisServer::start();
    let dir = TempDir::new("memory");
    let worker = "  batch: 32\n  drain: 1s\n  claim_idle: 1200ms\n  max_deliveries: 1";
    let body = r#"outbound:
  streams: ["in"]
  max_len: 100
  dedupe_ttl: 2s
  routes:
    a: {rate: 100/s, burst: 1, max_wait: 100ms, fallbacks: [b]}
    b: {rate: 50/s, burst: 1, max_wait: 100ms}
"#;
    let port = free_port();
    let cfg = config(&dir, "m.yaml", &redis, port, worker, body);
    let mut pacer = start(&cfg, port);
    let dbsize = || -> i64 { redis::cmd("DBSIZE").query(&mut redis.con()).unwrap() };
    // 200 events/s for 12 s (more than both routes take: some are rejected), sampling DBSIZE.
    let start_at = Instant::now();
    let mut samples = Vec::new();
    let mut pushed = 0;
    while start_at.elapsed() < Duration::from_secs(12) {
        let batch: Vec<_> = (0..20)
            .map(|i| event(&[("route", "a"), ("n", &(pushed + i).to_string())]))
            .collect();
        push(&redis, "in", &batch);
        pushed += 20;
        samples.push((start_at.elapsed(), dbsize()));
        std::thread::sleep(Duration::from_millis(100));
    }
    let max_between = |from: u64, to: u64| {
        samples
            .iter()
            .filter(|(t, _)| *t >= Duration::from_secs(from) && *t < Duration::from_secs(to))
            .map(|(_, n)| *n)
            .max()
            .unwrap()
    };
    let (early, late) = (max_between(3, 6), max_between(6, 12));
    eprintln!("keys: max {early} in seconds 3-6, {late} in seconds 6-12, {pushed} events pushed");
    assert!(
        late as f64 <= early as f64 * 1.25 + 20.0,
        "key count grows: {early} then {late}"
    );
    // One marker per event per route it tried, plus one per rejection, living 2 s.
    assert!(late <= 200 * 3 * 3, "{late} keys");
    for stream in ["pacer:{a}:ready", "pacer:{b}:ready", "pacer:rejected"] {
        let len: i64 = redis::cmd("XLEN")
            .arg(stream)
            .query(&mut redis.con())
            .unwrap();
        assert!(len <= 300, "{stream} holds {len} entries, max_len is 100");
    }
    assert!(wait_until(Duration::from_secs(10), || unfinished(
        &redis, "in", "pacer"
    ) == 0));
    // Traffic stopped: every marker expires; what remains is the streams and the buckets.
    std::thread::sleep(Duration::from_millis(2500));
    let left = keys(&redis);
    assert!(
        left.len() <= 6,
        "keys left after the markers' time to live: {left:?}"
    );
    for key in &left {
        let ttl: i64 = redis::cmd("PTTL").arg(key).query(&mut redis.con()).unwrap();
        let kind: String = redis::cmd("TYPE").arg(key).query(&mut redis.con()).unwrap();
        assert!(kind == "stream" || ttl > 0, "{key} ({kind}) never expires");
    }
    pacer.kill();
}

/// A claimed inbound entry is not charged twice: a worker decides and charges a batch (the
/// accepted ones forwarded in the same script), then dies. On a plain Redis the admission script
/// wrote the rejections too and acknowledged every entry in that same step, so nothing is left
/// pending to redeliver. On a cluster whose input stream is in another slot than the admission's
/// keys, the entries are still pending; the worker that claims them carries out the recorded
/// decisions (charging nothing again) and writes the rejections the dead worker had not, once.
#[test]
fn a_claimed_inbound_entry_is_decided_once_and_charged_once() {
    claimed_inbound_entries_decided_once(RedisServer::start(), true);
}

#[test]
fn a_claimed_inbound_entry_is_decided_once_when_rejections_take_a_second_call() {
    claimed_inbound_entries_decided_once(RedisServer::start_cluster(), false);
}

fn claimed_inbound_entries_decided_once(redis: RedisServer, rejects_in_admission: bool) {
    let dir = TempDir::new("in-kill");
    let worker = "  batch: 32\n  drain: 1s\n  claim_idle: 1500ms";
    let body =
        &inbound_body("{name: per-source, key: [source], algorithm: gcra, limits: [10/min]}");
    let calls = |n: usize, from: usize| -> Vec<_> {
        (from..from + n)
            .map(|i| event(&[("source", "s1"), ("call", &i.to_string())]))
            .collect()
    };
    // 14 attempts against a burst of 10: exactly 10 accepted, 4 rejected, once.
    let mut ids = push(&redis, "pacer:in", &calls(14, 0));
    let cfg = config(&dir, "v.yaml", &redis, free_port(), worker, body);
    crash_at(&cfg, "admitted:1");
    assert_eq!(read(&redis, "pacer:accepted").len(), 10);
    let written_by_admission = if rejects_in_admission { 4 } else { 0 };
    assert_eq!(
        read(&redis, "pacer:in-rejected").len(),
        written_by_admission
    );
    let left_pending = if rejects_in_admission { 0 } else { 14 };
    assert_eq!(pending(&redis, "pacer:in", "pacer"), left_pending);

    let port = free_port();
    let cfg = config(&dir, "w.yaml", &redis, port, worker, body);
    let survivor = start(&cfg, port);
    let outputs = ["pacer:accepted", "pacer:in-rejected", "pacer:dead"];
    assert!(
        wait_until(Duration::from_secs(15), || unfinished(
            &redis, "pacer:in", "pacer"
        ) == 0),
        "{}",
        survivor.log_text()
    );
    assert_each_once(&redis, &ids, &outputs, "pacer:in");
    assert_eq!(read(&redis, "pacer:accepted").len(), 10);
    assert_eq!(read(&redis, "pacer:in-rejected").len(), 4);
    // Charged once: had the claim charged the 10 again, the bucket would be 10 in debt.
    // Instead it holds what 10 charges left: a 6 s interval at 10/min, so one more call
    // is rejected with at most 6 s to wait, not a minute.
    ids.extend(push(&redis, "pacer:in", &calls(1, 14)));
    assert!(wait_until(Duration::from_secs(10), || unfinished(
        &redis, "pacer:in", "pacer"
    ) == 0));
    let rejected = read(&redis, "pacer:in-rejected");
    let retry: i64 = rejected
        .last()
        .unwrap()
        .field("pacer_retry_after_ms")
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry <= 6_000, "retry after {retry} ms: charged twice");
    assert_each_once(&redis, &ids, &outputs, "pacer:in");
}

/// An inbound entry whose workers die before deciding it, again and again, is dead-lettered
/// with too_many_deliveries once it comes more than max_deliveries times, and a void decision is
/// recorded for it, so no late admission can still forward it. A batch-mate that was decided
/// before the first crash keeps its decision.
#[test]
fn a_poison_inbound_entry_is_dead_lettered_and_voided() {
    let redis = RedisServer::start();
    let dir = TempDir::new("in-poison");
    let worker = "  batch: 8\n  drain: 1s\n  claim_idle: 1200ms\n  max_deliveries: 2";
    let body =
        &inbound_body("{name: per-source, key: [source], algorithm: gcra, limits: [10/min]}");
    let decided = push(&redis, "pacer:in", &[event(&[("source", "s1")])]);
    // Decided and forwarded by a worker that then dies before acknowledging.
    let cfg = config(&dir, "v0.yaml", &redis, free_port(), worker, body);
    crash_at(&cfg, "admitted:1");
    let poison = push(&redis, "pacer:in", &[event(&[("source", "s2")])]);
    // Two deliveries of the poison die before any decision (the first also claims the other).
    for i in 1..=2 {
        let cfg = config(
            &dir,
            &format!("v{i}.yaml"),
            &redis,
            free_port(),
            worker,
            body,
        );
        crash_at(&cfg, "read:1");
    }
    let port = free_port();
    let cfg = config(&dir, "w.yaml", &redis, port, worker, body);
    let survivor = start(&cfg, port);
    assert!(
        wait_until(Duration::from_secs(15), || unfinished(
            &redis, "pacer:in", "pacer"
        ) == 0),
        "{}",
        survivor.log_text()
    );
    let ids = [decided[0].clone(), poison[0].clone()];
    let at = assert_each_once(
        &redis,
        &ids,
        &["pacer:accepted", "pacer:in-rejected", "pacer:dead"],
        "pacer:in",
    );
    assert_eq!(at[&ids[0]], vec!["pacer:accepted"]);
    assert_eq!(at[&ids[1]], vec!["pacer:dead"]);
    let dead = read(&redis, "pacer:dead");
    assert_eq!(dead[0].field("pacer_reason"), Some("too_many_deliveries"));
    // The poison's recorded decision is the void: a late admission finds it and forwards nothing.
    let hashes: Vec<String> = redis::cmd("KEYS")
        .arg("pacer:in:*decided*")
        .query(&mut redis.con())
        .unwrap();
    let values: Vec<String> = hashes
        .iter()
        .flat_map(|k| {
            redis::cmd("HVALS")
                .arg(k)
                .query::<Vec<String>>(&mut redis.con())
                .unwrap()
        })
        .collect();
    assert_eq!(values.len(), 2, "{hashes:?}: {values:?}");
    assert!(values.iter().any(|v| v.starts_with('A')), "{values:?}");
    assert!(values.iter().any(|v| v.starts_with('v')), "{values:?}");
}

#[test]
fn a_worker_under_a_live_workers_consumer_name_refuses_to_start_and_a_restart_does_not() {
    use common::pressure::{feed, push_events, READY};
    let redis = RedisServer::start();
    let dir = TempDir::new("same-name");
    let worker = "  batch: 32\n  drain: 1s\n  consumer: same";
    let body =
        "outbound:\n  streams: [\"in\"]\n  routes:\n    r: {rate: 500/s, burst: 1, max_wait: 5s}\n";
    let first_port = free_port();
    let first_cfg = config(&dir, "a.yaml", &redis, first_port, worker, body);
    let mut first = start(&first_cfg, first_port);
    // Redis marks a consumer seen when it delivers it entries: traffic makes the first worker
    // show itself.
    let fed = feed(redis.url(), 100, 3.0);
    std::thread::sleep(Duration::from_millis(300));
    // The same file copied to a second worker: it must not join as the same consumer.
    let second_port = free_port();
    let second_cfg = config(&dir, "b.yaml", &redis, second_port, worker, body);
    let mut second = Pacer::run(bin(), &second_cfg, &[]);
    let code = second.wait_for(Duration::from_secs(15));
    let log = second.log_text();
    assert_eq!(code, Some(1), "the second worker ran on:\n{log}");
    assert!(
        log.contains("consumer name \"same\" is in use") && log.contains("worker.consumer"),
        "{log}"
    );
    let mut ids = fed.join().unwrap();
    assert_eq!(
        first.wait_for(Duration::from_millis(100)),
        None,
        "the first worker is left alone:\n{}",
        first.log_text()
    );
    // A worker put back under the name of one killed a moment ago (a restart) starts, and takes
    // up what its predecessor held: 1,500 events take the route three seconds.
    ids.extend(push_events(&redis, 1500, "same"));
    assert!(wait_until(Duration::from_secs(5), || pending(
        &redis, "in", "pacer"
    ) > 0));
    first.signal("KILL");
    let _ = first.wait_for(Duration::from_secs(5));
    let started = Instant::now();
    let restarted = start(&first_cfg, first_port);
    println!("restarted under the same name in {:?}", started.elapsed());
    assert!(
        wait_until(Duration::from_secs(20), || unfinished(
            &redis, "in", "pacer"
        ) == 0),
        "still pending:\n{}",
        restarted.log_text()
    );
    assert_each_once(&redis, &ids, &[READY, "pacer:rejected", "pacer:dead"], "in");
}

/// A rolling config change that lowers `claim_idle` below the old workers' longest `max_wait`
/// and drops a fallback: the new worker claimed the entries an old one slept on (they were idle
/// longer than its claim_idle), found no route left in its chain and rejected them, while the
/// old one dispatched them on the fallback: 14 of 20 entries ended twice (found by review).
/// A live worker beats (`worker/heartbeat.rs`) and claimers leave its entries alone: each
/// ends once, and the old worker still dispatches what it slept on.
#[test]
fn a_rolling_change_that_lowers_claim_idle_claims_nothing_a_live_worker_sleeps_on() {
    let redis = RedisServer::start();
    let dir = TempDir::new("rolling-claim");
    let (m1, m2) = (free_port(), free_port());
    let old = config(
        &dir,
        "old.yaml",
        &redis,
        m1,
        "  claim_idle: 12s",
        "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 1/s, max_wait: 1s, fallbacks: [b]}\n    b: {rate: 2/s, max_wait: 10s}\n",
    );
    let new = config(
        &dir,
        "new.yaml",
        &redis,
        m2,
        "  claim_idle: 2100ms",
        "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 1/s, max_wait: 1s}\n",
    );
    let w1 = start(&old, m1);
    let events: Vec<_> = (0..16)
        .map(|i| event(&[("route", "a"), ("n", &i.to_string())]))
        .collect();
    let ids = push(&redis, "in", &events);
    // Let the old worker read and decide them all (most sleep on b, up to 8 s), then start the
    // new one beside it, as a rolling update does.
    assert!(wait_until(Duration::from_secs(5), || sleeping(m1) >= 10.0));
    let w2 = start(&new, m2);
    assert!(
        wait_until(Duration::from_secs(20), || {
            lengths(&redis, &OUTPUTS).iter().sum::<usize>() >= ids.len()
                && pending(&redis, "in", "pacer") == 0
        }),
        "{:?}\nold:\n{}\nnew:\n{}",
        lengths(&redis, &OUTPUTS),
        w1.log_text(),
        w2.log_text()
    );
    // Give a second delivery every chance to show.
    std::thread::sleep(Duration::from_secs(2));
    let at = assert_each_once(&redis, &ids, &OUTPUTS, "in");
    let on_b = at.values().filter(|o| o[0] == "pacer:{b}:ready").count();
    assert!(
        on_b >= 8,
        "the old worker dispatched what it slept on: {at:?}"
    );
    assert_eq!(claimed(m2), 0.0, "{}", w2.log_text());
}

/// The claimer's XPENDING … IDLE listings in Redis's slow log (every command is logged at
/// threshold 0), not the start's permission probe (IDLE 0): the consumer each named (its last
/// argument, when it names one).
fn idle_listings(redis: &RedisServer) -> Vec<String> {
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query(&mut redis.con())
        .unwrap();
    let mut out = Vec::new();
    for entry in log {
        let redis::Value::Array(parts) = entry else {
            continue;
        };
        let Some(redis::Value::Array(args)) = parts.get(3) else {
            continue;
        };
        let text: Vec<String> = args
            .iter()
            .map(|a| match a {
                redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                other => format!("{other:?}"),
            })
            .collect();
        if text.len() > 4
            && text[0].eq_ignore_ascii_case("XPENDING")
            && text[3] == "IDLE"
            && text[4] != "0"
        {
            out.push(text.last().cloned().unwrap_or_default());
        }
    }
    out
}

/// The claimer lists the pending entries of silent consumers only. Listing the group's whole
/// pending list walked every entry the live workers hold asleep (up to `max_inflight` each), on
/// every tick, to claim none: Redis's cost grew with what was waiting. Here a live consumer
/// holds 2,000 entries idle past claim_idle: while it beats, no tick lists anything; once it
/// falls silent, its entries alone are listed, claimed, and each ends once.
#[test]
fn the_claimer_lists_only_silent_consumers_entries() {
    let redis = RedisServer::start();
    let dir = TempDir::new("claim-silent");
    let port = free_port();
    let cfg = config(
        &dir,
        "w.yaml",
        &redis,
        port,
        "  claim_idle: 1500ms",
        "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 100000/s, burst: 1000, max_wait: 100ms}\n",
    );
    let events: Vec<_> = (0..2000)
        .map(|i| event(&[("route", "a"), ("n", &i.to_string())]))
        .collect();
    let ids = push(&redis, "in", &events);
    let mut con = redis.con();
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("in")
        .arg("pacer")
        .arg("0")
        .query(&mut con)
        .unwrap();
    // "other" reads them all and holds them, as a live worker holds its sleepers.
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("pacer")
        .arg("other")
        .arg("COUNT")
        .arg(5000)
        .arg("STREAMS")
        .arg("in")
        .arg(">")
        .query(&mut con)
        .unwrap();
    // Past claim_idle before the worker starts: every entry is idle enough to be listed.
    std::thread::sleep(Duration::from_millis(1600));
    for (name, value) in [
        ("slowlog-log-slower-than", "0"),
        ("slowlog-max-len", "100000"),
    ] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut con)
            .unwrap();
    }
    // "other" beats as a live worker does (streams::heartbeat refreshes its idle time).
    let (rt, mut acon) = redis.async_con();
    let mut beat = || {
        rt.block_on(pacer::streams::heartbeat(&mut acon, "in", "pacer", "other"))
            .unwrap()
    };
    beat();
    let w = start(&cfg, port);
    // Five claim ticks (every claim_idle / 2) while "other" beats.
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        beat();
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(pending(&redis, "in", "pacer"), 2000, "{}", w.log_text());
    assert_eq!(
        idle_listings(&redis),
        Vec::<String>::new(),
        "the claimer listed pending entries while every holder was alive"
    );
    // "other" falls silent: its entries are listed, claimed and finished.
    assert!(
        wait_until(Duration::from_secs(15), || unfinished(
            &redis, "in", "pacer"
        ) == 0),
        "{}",
        w.log_text()
    );
    let listed = idle_listings(&redis);
    assert!(!listed.is_empty(), "claimed without listing");
    assert!(
        listed.iter().all(|c| c == "other"),
        "listed another consumer's entries: {listed:?}"
    );
    assert_each_once(&redis, &ids, &["pacer:{a}:ready"], "in");
}

/// An entry pending under a live worker's own name that the worker does not hold is taken up
/// by that worker and ends once; what it does hold past claim_idle (dead letters waiting on a
/// dead-letter stream of the wrong kind) it leaves alone. A failover leaves such an entry: the
/// worker dispatched and acknowledged it on a master about to be demoted, and both writes went
/// with it (a helper's attack left 559-706 after each `SENTINEL FAILOVER`). Made here the way the new
/// master sees it: the entry read under the worker's name by another client, in a transaction
/// no blocked read can come between. Before, nothing took it while the worker lived.
#[test]
fn an_entry_stranded_under_a_live_workers_name_is_taken_up_and_ends_once() {
    let redis = RedisServer::start();
    let dir = TempDir::new("stranded");
    let port = free_port();
    let cfg = config(
        &dir,
        "w.yaml",
        &redis,
        port,
        "  claim_idle: 1500ms\n  consumer: w1",
        "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 100/s, max_wait: 100ms}\n",
    );
    let mut con = redis.con();
    let _: () = redis::cmd("SET")
        .arg("pacer:dead")
        .arg("written by something else")
        .query(&mut con)
        .unwrap();
    let w = start(&cfg, port);
    let bad: Vec<_> = (0..3).map(|_| event(&[("to", "nowhere")])).collect();
    let mut ids = push(&redis, "in", &bad);
    assert!(wait_until(Duration::from_secs(5), || w
        .log_text()
        .contains("a key holds the wrong kind of value")));
    let (stranded,): (String,) = redis::pipe()
        .atomic()
        .cmd("XADD")
        .arg("in")
        .arg("*")
        .arg("route")
        .arg("a")
        .cmd("XREADGROUP")
        .arg("GROUP")
        .arg("pacer")
        .arg("w1")
        .arg("COUNT")
        .arg(1)
        .arg("STREAMS")
        .arg("in")
        .arg(">")
        .ignore()
        .query(&mut con)
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || !read(&redis, "pacer:{a}:ready")
            .is_empty()),
        "the stranded entry {stranded} was never taken up\n{}",
        w.log_text()
    );
    ids.push(stranded.clone());
    // The held ones were never taken up again: each still pending, delivered once.
    let held: Vec<i64> = pending_ids_and_deliveries(&redis)
        .into_iter()
        .map(|(id, deliveries)| {
            assert!(ids[..3].contains(&id), "{id} is pending");
            deliveries
        })
        .collect();
    assert_eq!(held, [1, 1, 1], "{}", w.log_text());
    assert_eq!(claimed(port), 1.0, "{}", w.log_text());
    let _: () = redis::cmd("DEL").arg("pacer:dead").query(&mut con).unwrap();
    assert!(wait_until(Duration::from_secs(5), || unfinished(
        &redis, "in", "pacer"
    ) == 0));
    let at = assert_each_once(&redis, &ids, &["pacer:{a}:ready", "pacer:dead"], "in");
    assert_eq!(at[&stranded], ["pacer:{a}:ready"]);
}

/// The entries pending in `in`'s group, with how often each was delivered.
fn pending_ids_and_deliveries(redis: &RedisServer) -> Vec<(String, i64)> {
    let rows: Vec<(String, String, i64, i64)> = redis::cmd("XPENDING")
        .arg("in")
        .arg("pacer")
        .arg("-")
        .arg("+")
        .arg(100)
        .query(&mut redis.con())
        .unwrap();
    rows.into_iter().map(|(id, _, _, n)| (id, n)).collect()
}

/// Entries a route parks (read while it has no room in the worker, their fields let go:
/// `worker/share.rs`) are still the worker's. Trimmed from the input while parked, they are
/// acknowledged and counted lost when the route takes them back, never dispatched; the worker
/// killed with kill -9 while others are parked, its restart under the same name takes those up
/// from its pending list; every other entry ends once, at its route's rate.
#[test]
fn parked_entries_end_once_through_a_trim_and_kill_minus_nine() {
    let redis = RedisServer::start();
    let dir = TempDir::new("parked");
    let worker =
        "  batch: 20\n  max_inflight: 100\n  drain: 1s\n  claim_idle: 90s\n  consumer: same";
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    slow: {rate: 50/s, burst: 1, max_wait: 60s}\n    fast: {rate: 1000/s, burst: 10, max_wait: 1s}\n";
    let port = free_port();
    let cfg = config(&dir, "c.yaml", &redis, port, worker, body);
    let on = |route: &str, n: usize| -> Vec<_> {
        (0..n)
            .map(|i| event(&[("route", route), ("n", &i.to_string())]))
            .collect()
    };
    let mut ids = push(&redis, "in", &on("slow", 600));
    ids.extend(push(&redis, "in", &on("fast", 100)));
    let mut first = start(&cfg, port);
    assert!(
        wait_until(Duration::from_secs(10), || metric_at(
            port,
            "pacer_parked_events"
        ) > 300.0),
        "the slow route parked nothing:\n{}",
        first.log_text()
    );
    // 30 of the parked ones trimmed (the route reaches its 300th event after 6 s).
    let trimmed: Vec<String> = ids[300..330].to_vec();
    let _: i64 = redis::cmd("XDEL")
        .arg("in")
        .arg(&trimmed)
        .query(&mut redis.con())
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || metric_at(
            port,
            "pacer_input_deleted_total"
        ) >= 30.0),
        "the trimmed entries were never counted lost:\n{}",
        first.log_text()
    );
    assert!(
        metric_at(port, "pacer_parked_events") > 100.0,
        "killed with entries parked"
    );
    first.signal("KILL");
    let _ = first.wait_for(Duration::from_secs(5));
    let restarted = start(&cfg, port);
    let kept: Vec<String> = ids
        .iter()
        .filter(|id| !trimmed.contains(id))
        .cloned()
        .collect();
    let outputs = [
        "pacer:{slow}:ready",
        "pacer:{fast}:ready",
        "pacer:rejected",
        "pacer:dead",
    ];
    assert!(
        wait_until(Duration::from_secs(30), || unfinished(
            &redis, "in", "pacer"
        ) == 0),
        "still pending:\n{}",
        restarted.log_text()
    );
    let at = assert_each_once(&redis, &kept, &outputs, "in");
    assert!(
        at.values().all(|s| s[0].ends_with(":ready")),
        "every event fits its wait: {:?}",
        at.values().filter(|s| !s[0].ends_with(":ready")).count()
    );
    assert_eq!(
        metric_at(port, "pacer_input_deleted_total"),
        0.0,
        "counted once, before"
    );
    assert_rate(&redis, outputs[0], 50.0, 1.0);
}

/// The sum of `field=<n>` over the log lines of `pacer` that say `message`, and how many such
/// lines there were.
fn logged_sum(pacer: &Pacer, message: &str, field: &str) -> (u64, usize) {
    let key = format!("{field}=");
    let lines: Vec<String> = pacer
        .log_text()
        .lines()
        .filter(|l| l.contains(message))
        .map(str::to_string)
        .collect();
    let sum = lines
        .iter()
        .map(|l| {
            let at = l.find(&key).unwrap_or_else(|| panic!("no {key} in {l}")) + key.len();
            let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u64>().unwrap()
        })
        .sum();
    (sum, lines.len())
}

/// A worker that wakes holding an event whose decision has vanished (expired or evicted) while
/// the group still lists the entry as its own decides it anew, on its route, and it ends once:
/// here the decision hashes of a slow route's sleeping events are deleted while they sleep.
/// Each sleeper finds nothing on record at its slot, is checked against the group's pending
/// list (still its own), said to be decided anew (`decided_anew` in
/// `placement::still_held`'s warning, none let go), and given a new slot within its wait: every
/// event is dispatched once, at the route's rate, and nothing stays pending.
#[test]
fn a_worker_whose_sleeping_events_lost_their_decisions_decides_them_anew_and_each_ends_once() {
    let redis = RedisServer::start();
    let dir = TempDir::new("decisions-gone");
    let port = free_port();
    let body =
        "outbound:\n  streams: [\"in\"]\n  routes:\n    slow: {rate: 2/s, burst: 1, max_wait: 5s}\n";
    let worker = "  batch: 16\n  drain: 500ms\n  claim_idle: 60s";
    let cfg = config(&dir, "c.yaml", &redis, port, worker, body);
    let outputs = ["pacer:{slow}:ready", "pacer:rejected", "pacer:dead"];
    let pacer = start(&cfg, port);
    // Slots 0, 0.5 s, ... 3.5 s: the first goes at once, the rest sleep.
    let events: Vec<_> = (0..8)
        .map(|i| event(&[("route", "slow"), ("n", &i.to_string())]))
        .collect();
    let ids = push(&redis, "in", &events);
    assert!(
        wait_until(Duration::from_secs(5), || sleeping(port) >= 6.0),
        "{} sleeping:\n{}",
        sleeping(port),
        pacer.log_text()
    );
    // Every decision record deleted in one step, counting the sleeping ones ("s…") among them:
    // exactly those find their decision gone at their slot (a dispatch before this step left
    // "d…", one after it finds nothing).
    let (hashes, asleep): (i64, i64) = redis::cmd("EVAL")
        .arg(
            "local hashes, asleep = 0, 0
             for _, k in ipairs(redis.call('KEYS', ARGV[1])) do
               for _, v in ipairs(redis.call('HVALS', k)) do
                 if string.sub(v, 1, 1) == 's' then asleep = asleep + 1 end
               end
               redis.call('DEL', k)
               hashes = hashes + 1
             end
             return {hashes, asleep}",
        )
        .arg(0)
        .arg("pacer:{*}:dec:slow:in:*")
        .query(&mut redis.con())
        .unwrap();
    assert!(
        hashes >= 1,
        "no decision hash to delete: {:?}",
        keys(&redis)
    );
    assert!(asleep >= 5, "only {asleep} sleeping decisions deleted");
    assert!(
        wait_until(Duration::from_secs(15), || {
            placements(&redis, &outputs).len() == ids.len() && pending(&redis, "in", "pacer") == 0
        }),
        "{:?} placed, {} pending:\n{}",
        lengths(&redis, &outputs),
        pending(&redis, "in", "pacer"),
        pacer.log_text()
    );
    // Time for a second write to show, should one come.
    std::thread::sleep(Duration::from_millis(1500));
    let at = assert_each_once(&redis, &ids, &outputs, "in");
    assert_eq!(
        lengths(&redis, &outputs),
        [8, 0, 0],
        "every event dispatched on its own route, none rejected: {at:?}"
    );
    let message = "events whose decisions expired while this worker held them";
    let (anew, lines) = logged_sum(&pacer, message, "decided_anew");
    let (let_go, _) = logged_sum(&pacer, message, "let_go");
    assert_eq!(
        (anew, let_go),
        (asleep as u64, 0),
        "each sleeper whose decision was deleted is decided anew, none let go:\n{}",
        pacer.log_text()
    );
    // Decided anew, not dispatched at the slot first given: the route's plan reached past its
    // first 3.5 s.
    let times = assert_rate(&redis, "pacer:{slow}:ready", 2.0, 1.0);
    let span = times.last().unwrap() - times.first().unwrap();
    assert!(
        span > 4_000,
        "dispatched over {span} ms: the deleted slots were kept"
    );
    assert_eq!(claimed(port), 0.0);
    eprintln!(
        "{hashes} decision hashes deleted holding {asleep} sleepers; {anew} decided anew in {lines} batches, all 8 dispatched over {span} ms"
    );
}

/// A read whose reply is lost (Redis delivered the entries to this consumer, the worker's call
/// timed out before the reply came) is carried on from what Redis recorded: the reader reads
/// its own pending entries again (`reader.rs`, "taking up entries this consumer holds
/// pending"), instead of leaving them for a claimer after `claim_idle`. Made here with Redis
/// stalled (`DEBUG SLEEP`, longer than the reader's block time plus `redis.timeout`) right
/// after the entries it delivers to the blocked read: every entry ends once within seconds,
/// with `claim_idle` at 60 s, none claimed.
#[test]
fn a_read_whose_reply_was_lost_is_taken_up_from_the_consumers_pending_list_before_claim_idle() {
    let redis = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let dir = TempDir::new("lost-read");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    fast: {rate: 1000/s, burst: 100, max_wait: 1s}\n";
    let worker = "  batch: 64\n  drain: 500ms\n  claim_idle: 60s";
    let cfg = config(&dir, "c.yaml", &redis, port, worker, body);
    let pacer = start(&cfg, port);
    let consumers_pending = || -> Vec<(String, i64)> {
        let reply: Vec<redis::Value> = redis::cmd("XPENDING")
            .arg("in")
            .arg("pacer")
            .query(&mut redis.con())
            .unwrap();
        match reply.get(3) {
            Some(redis::Value::Array(rows)) => rows
                .iter()
                .map(|r| redis::from_redis_value::<(String, i64)>(r.clone()).unwrap())
                .collect(),
            _ => Vec::new(),
        }
    };
    // Nothing pending to take up at the start: any recovery read below is the lost read's.
    assert_eq!(consumers_pending(), vec![], "{}", pacer.log_text());
    // Past the start's own recovery read: the reader blocked in XREADGROUP for new entries (it
    // blocks again within microseconds of each 500 ms block's end).
    assert!(
        wait_until(Duration::from_secs(5), || a_read_is_blocked(&redis)),
        "no read blocked:\n{}",
        pacer.log_text()
    );
    // The entries go to the blocked read at once, all of them (one transaction: Redis serves
    // a blocked read after EXEC, where after a lone XADD it would take that one entry); the
    // read's reply leaves Redis only after the stall, 2 s later, past the reader's 1 s (500 ms
    // block + 500 ms timeout).
    let mut con = redis.con();
    let mut pipe = redis::pipe();
    pipe.cmd("MULTI").ignore();
    for i in 0..20 {
        pipe.cmd("XADD")
            .arg("in")
            .arg("*")
            .arg("route")
            .arg("fast")
            .arg("n")
            .arg(i)
            .ignore();
    }
    pipe.cmd("EXEC");
    pipe.cmd("DEBUG").arg("SLEEP").arg(2).ignore();
    let pushed = Instant::now();
    let (ids,): (Vec<String>,) = pipe.query(&mut con).unwrap();
    assert_eq!(ids.len(), 20);
    assert!(
        wait_until(Duration::from_secs(10), || {
            lengths(&redis, &["pacer:{fast}:ready"])[0] == ids.len()
                && pending(&redis, "in", "pacer") == 0
        }),
        "{:?} dispatched, {} pending after {:?}:\n{}",
        lengths(&redis, &["pacer:{fast}:ready"]),
        pending(&redis, "in", "pacer"),
        pushed.elapsed(),
        pacer.log_text()
    );
    let took = pushed.elapsed();
    let outputs = ["pacer:{fast}:ready", "pacer:rejected", "pacer:dead"];
    std::thread::sleep(Duration::from_millis(500));
    assert_each_once(&redis, &ids, &outputs, "in");
    assert_eq!(lengths(&redis, &outputs), [20, 0, 0]);
    let (taken_up, lines) = logged_sum(
        &pacer,
        "taking up entries this consumer holds pending",
        "entries",
    );
    // In one recovery read or more (one entry at first, when Redis could not yet count them).
    assert_eq!(
        taken_up,
        20,
        "the lost read's entries are read again from the pending list, each once:\n{}",
        pacer.log_text()
    );
    assert_eq!(claimed(port), 0.0, "{}", pacer.log_text());
    assert!(
        took < Duration::from_secs(10),
        "took {took:?} with claim_idle 60 s"
    );
    eprintln!(
        "a lost read of 20 entries taken up from the pending list in {lines} reads; all ended in {took:?}"
    );
}

/// Redis's memory (`INFO memory`'s used_memory) less what it held before the events came, once
/// the streams are deleted: what pacer keeps per event for `dedupe_ttl`, over `n` events.
fn kept_per_event(redis: &RedisServer, before: i64, streams: &[&str], n: usize) -> f64 {
    let mut con = redis.con();
    for s in streams {
        let _: i64 = redis::cmd("DEL").arg(*s).query(&mut con).unwrap();
    }
    let info: String = redis::cmd("INFO").arg("memory").query(&mut con).unwrap();
    (memory_used(&info) - before) as f64 / n as f64
}

fn memory_used(info: &str) -> i64 {
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory")
}

/// What sizing a Redis for pacer rests on (README, "Redis"): each event's decision is kept
/// `dedupe_ttl` (1 h by default), about 90 bytes once its hash of 100 ms of entries is a hash
/// table (past 128 entries: from about 1,300 events/s), and an event with an `id` keeps a claim
/// key beside it, about 200 bytes more. Measured on 20,000 events of each kind, outbound with
/// and without ids and inbound, in one Redis each.
#[test]
fn what_each_event_keeps_in_redis_for_dedupe_ttl_is_bounded() {
    let n = 20_000;
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    fast: {rate: 1000/ms, burst: 1000}\ninbound:\n  streams: [\"pacer:in\"]\n  rules:\n    - {name: r, key: [source], algorithm: gcra, limits: [1000/ms]}\n";
    let mut kept = Vec::new();
    for kind in ["outbound", "outbound with ids", "inbound"] {
        let redis = RedisServer::start();
        let dir = TempDir::new("kept");
        let port = free_port();
        let cfg = config(&dir, "c.yaml", &redis, port, "  batch: 512", body);
        let pacer = start(&cfg, port);
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query(&mut redis.con())
            .unwrap();
        let before = memory_used(&info);
        let events: Vec<_> = (0..n)
            .map(|i| {
                let i = i.to_string();
                match kind {
                    "outbound" => event(&[("route", "fast"), ("n", &i)]),
                    "outbound with ids" => event(&[("route", "fast"), ("id", &i)]),
                    _ => event(&[("source", &format!("s{}", i.len())), ("n", &i)]),
                }
            })
            .collect();
        let (input, outputs) = if kind == "inbound" {
            ("pacer:in", vec!["pacer:accepted", "pacer:in-rejected"])
        } else {
            ("in", vec!["pacer:{fast}:ready"])
        };
        push(&redis, input, &events);
        assert!(
            wait_until(Duration::from_secs(60), || lengths(&redis, &outputs)
                .iter()
                .sum::<usize>()
                == n
                && pending(&redis, input, "pacer") == 0),
            "{kind}: {:?} of {n}\n{}",
            lengths(&redis, &outputs),
            pacer.log_text()
        );
        drop(pacer);
        let mut streams = outputs.clone();
        streams.push(input);
        kept.push((kind, kept_per_event(&redis, before, &streams, n)));
    }
    println!("bytes kept per event: {kept:?}");
    let bound = |kind: &str| {
        if kind == "outbound with ids" {
            320.0
        } else {
            120.0
        }
    };
    for (kind, bytes) in kept {
        // Each kept something (a decision), and no more than the README's figures say.
        assert!(
            (40.0..=bound(kind)).contains(&bytes),
            "{kind}: {bytes:.0} bytes kept per event"
        );
    }
}

/// DESIGN: a Redis that may lose acknowledged writes on failover is named, never trusted
/// silently. A master with a replica and `wait_replicas: 0` is one: pacer says so once at start.
/// With `wait_replicas: 1`, or on a master with no replica, it says nothing of the kind.
#[test]
fn a_replicated_redis_without_wait_replicas_is_named_at_start() {
    let master = RedisServer::start();
    let mut replica = RedisServer::start();
    let lone = RedisServer::start();
    replica.restart_as_replica_of(master.port);
    assert!(
        wait_until(Duration::from_secs(10), || {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut master.con())
                .unwrap();
            info.contains("connected_slaves:1")
        }),
        "the replica never connected"
    );
    let dir = TempDir::new("replicated");
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    r: {rate: 100/s}\n";
    let named = "replicates pacer's writes to replicas asynchronously";
    for (redis, wait, said) in [(&master, 0, true), (&master, 1, false), (&lone, 0, false)] {
        let port = free_port();
        let name = format!("w{wait}-{}.yaml", redis.port);
        let cfg = config(&dir, &name, redis, port, "  drain: 200ms", body);
        let text = std::fs::read_to_string(&cfg).unwrap();
        let text = text.replace(
            "  timeout: 500ms\n",
            &format!("  timeout: 500ms\n  wait_replicas: {wait}\n"),
        );
        std::fs::write(&cfg, text).unwrap();
        let mut pacer = start(&cfg, port);
        let ids = push(redis, "in", &[event(&[("route", "r")])]);
        assert!(wait_until(Duration::from_secs(10), || placements(
            redis,
            &["pacer:{r}:ready"]
        )
        .contains_key(&ids[0])));
        pacer.signal("TERM");
        pacer.wait_for(Duration::from_secs(10));
        let log = pacer.log_text();
        assert_eq!(
            log.matches(named).count(),
            usize::from(said),
            "wait_replicas {wait} on port {}:\n{log}",
            redis.port
        );
    }
}

/// A Redis that keeps an AOF it would cut wrongly after a crash (`aof-load-truncated yes`, the
/// default: see `a_script_cut_short_in_the_aof_comes_back_whole_or_not_at_all`) is named once at
/// start; one set to refuse a cut AOF (`no`, what the tests run), or without an AOF, is not.
#[test]
fn an_aof_that_redis_would_cut_inside_a_script_is_named_at_start() {
    let dir = TempDir::new("aof-truncated");
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    r: {rate: 100/s}\n";
    let named = "aof-load-truncated yes";
    for (args, said) in [
        (
            &["--appendonly", "yes", "--aof-load-truncated", "yes"][..],
            true,
        ),
        (&["--appendonly", "yes"][..], false),
        (
            &["--appendonly", "no", "--aof-load-truncated", "yes"][..],
            false,
        ),
    ] {
        let redis = RedisServer::start_with(args);
        let port = free_port();
        let cfg = config(
            &dir,
            &format!("w{port}.yaml"),
            &redis,
            port,
            "  drain: 200ms",
            body,
        );
        let mut pacer = start(&cfg, port);
        pacer.signal("TERM");
        pacer.wait_for(Duration::from_secs(10));
        let log = pacer.log_text();
        assert_eq!(
            log.matches(named).count(),
            usize::from(said),
            "redis-server {args:?}:\n{log}"
        );
    }
}
