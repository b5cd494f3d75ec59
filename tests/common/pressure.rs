//! Pressure scenarios shared by `tests/pressure.rs` (short runs, asserted) and
//! `benches/pressure.rs` (long runs, printed): a backlog drained at a route's rate, a worker
//! stalled (SIGSTOP) while events arrive, and what a stall does to waits. Each runs real
//! `pacer run` workers against a real redis-server and reads the outcome back from Redis, the
//! rate judged by the ready entries' ids (Redis's clock).

use super::*;
use pacer::testkit::{free_port, RedisServer, TempDir};
use std::time::{Duration, Instant};

/// The ready stream of route `r`.
pub const READY: &str = "pacer:{r}:ready";

/// A config with one route `r` of `rate`/s, burst 1, the given max_wait, read from `in`.
pub fn one_route(
    redis: &RedisServer,
    dir: &TempDir,
    port: u16,
    rate: u32,
    max_wait: &str,
) -> std::path::PathBuf {
    let body = format!(
        "outbound:\n  streams: [\"in\"]\n  routes:\n    r: {{rate: {rate}/s, burst: 1, max_wait: {max_wait}}}\n"
    );
    let worker = "  batch: 512\n  max_inflight: 200000\n  claim_idle: 90s\n  drain: 1s";
    config(dir, &format!("w{port}.yaml"), redis, port, worker, &body)
}

/// Routes `r0`, `r1`, ... (`routes` of them, each of `rate`/s with burst 1 and `max_wait`) read
/// from `in`, each sent `each` events interleaved, as many producers' would be, before the
/// worker (`worker`'s settings) starts: its config, the routes' ready streams and the entry ids.
pub fn many_routes(
    redis: &RedisServer,
    dir: &TempDir,
    port: u16,
    (routes, rate, max_wait): (usize, &str, &str),
    worker: &str,
    each: usize,
) -> (std::path::PathBuf, Vec<String>, Vec<String>) {
    let names: Vec<String> = (0..routes).map(|i| format!("r{i}")).collect();
    let mut body = String::from("outbound:\n  streams: [\"in\"]\n  routes:\n");
    for r in &names {
        body.push_str(&format!(
            "    {r}: {{rate: {rate}, burst: 1, max_wait: {max_wait}}}\n"
        ));
    }
    let cfg = config(dir, "c.yaml", redis, port, worker, &body);
    let mut ids = Vec::with_capacity(routes * each);
    for n in 0..each {
        let events: Vec<_> = names
            .iter()
            .map(|r| event(&[("route", r), ("n", &n.to_string())]))
            .collect();
        ids.extend(push(redis, "in", &events));
    }
    let ready = names
        .iter()
        .map(|r| format!("pacer:{{{r}}}:ready"))
        .collect();
    (cfg, ready, ids)
}

/// Where an outbound entry may end: the `ready` streams, the rejected and the dead-letter one.
pub fn ends(ready: &[String]) -> Vec<&str> {
    let mut outputs: Vec<&str> = ready.iter().map(String::as_str).collect();
    outputs.extend(["pacer:rejected", "pacer:dead"]);
    outputs
}

/// Waits up to `limit` for every entry of `ids` (of stream `in`) to end in `outputs`, and checks
/// each ended once: where each ended (`assert_each_once`).
pub fn ends_each_once(
    redis: &RedisServer,
    pacer: &pacer::testkit::Pacer,
    ids: &[String],
    outputs: &[&str],
    limit: Duration,
) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut con = redis.con();
    let done = pacer::testkit::wait_until(limit, || entries(&mut con, outputs) >= ids.len());
    assert!(done, "not every entry ended:\n{}", pacer.log_text());
    assert_each_once(redis, ids, outputs, "in")
}

/// Starts a worker on `cfg` and waits up to `limit` until every entry of `ids` has ended once,
/// each on a route (none rejected or dead-lettered), nothing left pending; the worker, for what
/// a test checks next.
pub fn drain_onto_routes(
    redis: &RedisServer,
    cfg: &std::path::Path,
    port: u16,
    ready: &[String],
    ids: &[String],
    limit: Duration,
) -> pacer::testkit::Pacer {
    let pacer = start(cfg, port);
    let at = ends_each_once(redis, &pacer, ids, &ends(ready), limit);
    assert!(
        at.values().all(|s| s[0].starts_with("pacer:{r")),
        "every event fits its wait, so every one goes out"
    );
    pacer
}

/// Pushes `n` events for route `r` to `in`, pipelined.
pub fn push_events(redis: &RedisServer, n: usize, tag: &str) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let events: Vec<_> = chunk
            .iter()
            .map(|i| event(&[("route", "r"), ("n", &format!("{tag}-{i}"))]))
            .collect();
        ids.extend(push(redis, "in", &events));
    }
    ids
}

/// Pushes events for route `r` at `per_second` for `seconds`, in a thread; returns the ids.
pub fn feed(url: String, per_second: u32, seconds: f64) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let client = redis::Client::open(url).unwrap();
        let mut con = client.get_connection().unwrap();
        let start = Instant::now();
        let mut sent = 0usize;
        let mut ids = Vec::new();
        while start.elapsed().as_secs_f64() < seconds {
            let due = (start.elapsed().as_secs_f64() * per_second as f64) as usize;
            let mut pipe = redis::pipe();
            for i in sent..due {
                pipe.cmd("XADD")
                    .arg("in")
                    .arg("*")
                    .arg("route")
                    .arg("r")
                    .arg("n")
                    .arg(i);
            }
            if due > sent {
                let got: Vec<String> = pipe.query(&mut con).unwrap();
                ids.extend(got);
                sent = due;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        ids
    })
}

/// How many entries the streams hold together. Polled while workers run, on one connection,
/// in one round trip: XLEN is O(1), where reading the streams whole (or connecting anew) every
/// 20 ms would load Redis (one thread) and slow the very dispatches being measured. A round
/// trip per stream cost Redis more than its XLEN: polling 302 streams so every 20 ms took Redis
/// about 50 µs per event of the many-routes benchmark, counted there as pacer's.
pub fn entries(con: &mut redis::Connection, streams: &[&str]) -> usize {
    let mut pipe = redis::pipe();
    for s in streams {
        pipe.cmd("XLEN").arg(*s);
    }
    let lens: Vec<usize> = pipe.query(con).unwrap();
    lens.iter().sum()
}

/// Ready entries of `r` per whole second of Redis time, from `from_ms` to `to_ms`.
pub fn per_second(times: &[i64], from_ms: i64, to_ms: i64) -> Vec<usize> {
    let mut out = Vec::new();
    let mut at = from_ms;
    while at + 1000 <= to_ms {
        out.push(
            times
                .iter()
                .filter(|t| **t >= at && **t < at + 1000)
                .count(),
        );
        at += 1000;
    }
    out
}

/// What draining a backlog showed.
#[derive(Debug)]
pub struct Drain {
    pub rate: u32,
    pub workers: usize,
    pub backlog: usize,
    /// Dispatches in each whole second between the first and the last ready entry.
    pub per_second: Vec<usize>,
    /// All of them over the time from the first to the last, per second.
    pub overall: f64,
}

impl Drain {
    /// The worst whole second after the first, as a share of the rate. The first is left out:
    /// the workers start one after another (each waited for until ready), so it holds one
    /// worker's start-up.
    pub fn worst_share(&self) -> f64 {
        self.per_second.iter().skip(1).copied().min().unwrap_or(0) as f64 / self.rate as f64
    }
}

/// A route of `rate`/s, burst 1, with `backlog` events queued before `workers` workers start:
/// how fast the backlog drains. Asserts each entry ends once and the rate holds.
pub fn drain_backlog(bin_env: &[(&str, &str)], rate: u32, backlog: usize, workers: usize) -> Drain {
    let redis = RedisServer::start();
    let dir = TempDir::new("drain");
    pacer::testkit::create_group(&mut redis.con(), "in", "pacer");
    let ids = push_events(&redis, backlog, "b");
    let wait = format!("{}s", backlog as u32 / rate + 30);
    let pacers: Vec<_> = (0..workers)
        .map(|_| {
            let port = free_port();
            let cfg = one_route(&redis, &dir, port, rate, &wait);
            start_wrapped(&[], bin_env, &cfg, port)
        })
        .collect();
    let limit = Duration::from_secs(backlog as u64 / rate as u64 + 60);
    let mut con = redis.con();
    let done = wait_until(limit, || entries(&mut con, &[READY]) >= backlog);
    assert!(
        done,
        "only {} of {backlog} dispatched:\n{}",
        read(&redis, READY).len(),
        pacers[0].log_text()
    );
    assert_each_once(&redis, &ids, &[READY, "pacer:rejected", "pacer:dead"], "in");
    let times = assert_rate(&redis, READY, rate as f64, 1.0);
    let (first, last) = (times[0], *times.last().unwrap());
    Drain {
        rate,
        workers,
        backlog,
        per_second: per_second(&times, first, last),
        overall: (times.len() - 1) as f64 * 1000.0 / (last - first).max(1) as f64,
    }
}

/// What a stalled worker showed.
#[derive(Debug)]
pub struct Stall {
    pub rate: u32,
    pub pause: Duration,
    /// Dispatches in each whole second from when the worker was continued.
    pub after: Vec<usize>,
    /// Entries fed and where they ended (every one once: checked).
    pub fed: usize,
    /// Slots the worker's dispatches had to move (`pacer_replanned_total`).
    pub replanned: f64,
}

/// One worker on a route of `rate`/s, fed at `feed_rate` for `seconds`; after 2 s it is paused
/// (SIGSTOP) for `pause`, then continued. Asserts each entry ends once and the rate holds.
pub fn stall(rate: u32, feed_rate: u32, pause: Duration, seconds: f64) -> Stall {
    let redis = RedisServer::start();
    let dir = TempDir::new("stall");
    let port = free_port();
    let cfg = one_route(&redis, &dir, port, rate, "60s");
    let pacer = start(&cfg, port);
    let feeder = feed(redis.url(), feed_rate, seconds);
    std::thread::sleep(Duration::from_secs(2));
    pacer.signal("STOP");
    std::thread::sleep(pause);
    pacer.signal("CONT");
    let resumed = redis_time_ms(&redis);
    let ids = feeder.join().unwrap();
    let mut con = redis.con();
    let done = wait_until(Duration::from_secs(120), || {
        entries(&mut con, &[READY]) >= ids.len()
    });
    assert!(
        done,
        "only {} of {} dispatched:\n{}",
        read(&redis, READY).len(),
        ids.len(),
        pacer.log_text()
    );
    assert_each_once(&redis, &ids, &[READY, "pacer:rejected", "pacer:dead"], "in");
    let times = assert_rate(&redis, READY, rate as f64, 1.0);
    let last = *times.last().unwrap();
    let (_, text) = pacer::testkit::http_get(port, "/metrics").unwrap();
    Stall {
        rate,
        pause,
        after: per_second(&times, resumed, last),
        fed: ids.len(),
        replanned: pacer::testkit::metric(&text, "pacer_replanned_total"),
    }
}

/// What a stall did to waits on a route with a short max_wait.
#[derive(Debug)]
pub struct Waits {
    /// Longest pacer_wait_ms of a ready entry (from its first decision to its recorded slot).
    pub longest_wait_ms: i64,
    /// Most a ready entry went out after its recorded slot, µs (its id's ms start minus the slot).
    pub latest_us: i64,
    pub dispatched: usize,
    pub rejected: usize,
}

/// A route of `rate`/s with max_wait `max_wait_ms`, fed at its rate for `seconds`, its only
/// worker paused for `pause` after 2 s.
pub fn waits_through_a_stall(rate: u32, max_wait_ms: u64, pause: Duration, seconds: f64) -> Waits {
    let redis = RedisServer::start();
    let dir = TempDir::new("waits");
    let port = free_port();
    let cfg = one_route(&redis, &dir, port, rate, &format!("{max_wait_ms}ms"));
    let pacer = start(&cfg, port);
    let feeder = feed(redis.url(), rate, seconds);
    std::thread::sleep(Duration::from_secs(2));
    pacer.signal("STOP");
    std::thread::sleep(pause);
    pacer.signal("CONT");
    let ids = feeder.join().unwrap();
    let outputs = [READY, "pacer:rejected", "pacer:dead"];
    ends_each_once(&redis, &pacer, &ids, &outputs, Duration::from_secs(60));
    assert_rate(&redis, READY, rate as f64, 1.0);
    let ready = read(&redis, READY);
    let field = |e: &pacer::report::OutputEntry, name: &str| -> i64 {
        e.field(name).unwrap().parse().unwrap()
    };
    Waits {
        longest_wait_ms: ready
            .iter()
            .map(|e| field(e, "pacer_wait_ms"))
            .max()
            .unwrap_or(0),
        latest_us: ready
            .iter()
            .map(|e| e.ms * 1000 - field(e, "pacer_slot_us"))
            .max()
            .unwrap_or(0),
        dispatched: ready.len(),
        rejected: read(&redis, "pacer:rejected").len(),
    }
}
