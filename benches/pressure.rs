//! Pacing under pressure, measured: the scenarios of `tests/pressure.rs` at full size, several
//! rounds each, printing every round and the median.
//!
//! 1. Backlog drain: a route of R/s with burst 1, 4 × R events queued before the workers start;
//!    the worst whole second after the first, as a share of R, and the overall rate.
//! 2. Stall: one worker on a 1000/s route fed at 1200/s, paused (SIGSTOP) for 1 s and for 5 s;
//!    the worst of seconds 2–4 after it is continued, and the slots it had to move.
//! 3. Waits through a 3 s stall on a 10/s route with max_wait 1 s: the longest recorded wait.
//! 4. Memory: one worker holding 100,000 sleeping events (100-byte payloads, a 10/s route with
//!    max_wait 3 h): its RSS, and its CPU over 10 s while they sleep.
//! 5. Many routes: 300 routes of 10/s sent 200 events each, interleaved on one stream, one
//!    worker of 2,000 places (far fewer than the 60,000 events: most are parked and taken
//!    back): the events per second of all routes together against their 3,000, and how long
//!    the last route took against its 20 s, and Redis's time by command (`INFO commandstats`)
//!    (`--many ROUTES,RATE,EACH,PLACES` for another shape).
//!
//! `cargo bench --bench pressure -- [--rounds 3] [--rates 1000,5000] [--only drain|stall|memory|waits|routes] [--many 300,10,200,2000]`

/// The benchmarks' own helpers (Redis's INFO), beside the tests' (`common`).
#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;

use common::pressure::{drain_backlog, ends, entries, per_second, stall, waits_through_a_stall};
use common::{config, event, push, start};
use pacer::testkit::{
    free_port, http_get, metric, poll_until, rss_and_cpu, wait_until, RedisServer, TempDir,
};
use std::time::Duration;

/// One worker holding `n` sleeping events: its RSS (MiB) and CPU (% of a core) while they sleep.
fn memory(n: usize) -> (f64, f64) {
    let redis = RedisServer::start();
    let dir = TempDir::new("memory");
    let payload = "x".repeat(100);
    for chunk in (0..n).collect::<Vec<_>>().chunks(5000) {
        let events: Vec<_> = chunk
            .iter()
            .map(|i| event(&[("route", "r"), ("n", &i.to_string()), ("payload", &payload)]))
            .collect();
        push(&redis, "in", &events);
    }
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  dedupe_ttl: 48h\n  routes:\n    r: {rate: 10/s, burst: 1, max_wait: 3h}\n";
    let worker = format!("  max_inflight: {n}\n  claim_idle: 4h");
    let cfg = config(&dir, "m.yaml", &redis, port, &worker, body);
    let pacer = start(&cfg, port);
    let held = wait_until(Duration::from_secs(120), || {
        http_get(port, "/metrics")
            .is_some_and(|(_, t)| metric(&t, "pacer_sleeping_events") >= (n - n / 100) as f64)
    });
    assert!(held, "the worker never held {n} sleeping events");
    std::thread::sleep(Duration::from_secs(3));
    let (_, cpu0) = rss_and_cpu(pacer.pid());
    std::thread::sleep(Duration::from_secs(10));
    let (rss, cpu1) = rss_and_cpu(pacer.pid());
    (rss as f64 / 1024.0, (cpu1 - cpu0) / 10.0 * 100.0)
}

/// What many routes with backlogs showed.
struct ManyRoutes {
    /// Ready entries of all routes per whole second of Redis time.
    per_second: Vec<usize>,
    /// Seconds from the first ready entry to the last.
    span: f64,
    /// Share of the gaps between a route's consecutive entries longer than 1.5 intervals: a
    /// slot left empty.
    empty_slots: f64,
    /// Worker CPU, % of a core over the span; Redis CPU µs per event.
    worker_cpu: f64,
    redis_us: f64,
    /// `INFO commandstats` over the run: calls and µs per event by command.
    commands: String,
    /// Dispatch calls and slots moved (`pacer_replanned_total`) per event.
    dispatch_calls: f64,
    moved: f64,
}

/// `routes` routes of `rate`/s (burst 1, max_wait 60 s) sent `each` events apiece, interleaved
/// on one stream, one worker of `places` places.
fn many_routes(routes: usize, rate: u32, each: usize, places: usize) -> ManyRoutes {
    let redis = RedisServer::start();
    let dir = TempDir::new("many-routes");
    let port = free_port();
    let worker = format!("  max_inflight: {places}\n  claim_idle: 120s");
    let shape = (routes, &*format!("{rate}/s"), "60s");
    let (cfg, ready, _) = common::pressure::many_routes(&redis, &dir, port, shape, &worker, each);
    let pacer = start(&cfg, port);
    let (_, cpu0) = rss_and_cpu(pacer.pid());
    let redis_cpu0 = bench::cpu_seconds(&mut redis.con());
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut redis.con())
        .unwrap();
    let outputs = ends(&ready);
    let mut con = redis.con();
    let total = routes * each;
    // Polled five times a second: each poll is Redis's work too, counted in redis_us below.
    let every = Duration::from_millis(200);
    let done = poll_until(Duration::from_secs(300), every, || {
        entries(&mut con, &outputs) >= total
    });
    let (_, cpu1) = rss_and_cpu(pacer.pid());
    let redis_us = (bench::cpu_seconds(&mut redis.con()) - redis_cpu0) * 1e6 / total as f64;
    let calls = bench::command_calls(&mut redis.con());
    let commands = bench::commandstats_line(&calls, total as u64);
    assert!(done, "not every entry ended:\n{}", pacer.log_text());
    let text = http_get(port, "/metrics")
        .map(|(_, t)| t)
        .unwrap_or_default();
    let per_event = |needle: &str| metric(&text, needle) / total as f64;
    let (mut times, mut gaps, mut empty) = (Vec::with_capacity(total), 0, 0);
    let interval_ms = 1000 / rate as i64;
    for stream in &ready {
        let ids: Vec<(String, redis::Value)> = redis::cmd("XRANGE")
            .arg(stream)
            .arg("-")
            .arg("+")
            .query(&mut con)
            .unwrap();
        let ms: Vec<i64> = ids
            .iter()
            .map(|(id, _)| id.split('-').next().unwrap().parse().unwrap())
            .collect();
        gaps += ms.len().saturating_sub(1);
        empty += ms
            .windows(2)
            .filter(|w| (w[1] - w[0]) * 2 > interval_ms * 3)
            .count();
        times.extend(ms);
    }
    assert_eq!(
        times.len(),
        total,
        "every event fits its wait, so every one goes out"
    );
    let (first, last) = (*times.iter().min().unwrap(), *times.iter().max().unwrap());
    let span = (last - first) as f64 / 1000.0;
    ManyRoutes {
        per_second: per_second(&times, first, last),
        span,
        empty_slots: empty as f64 / gaps.max(1) as f64,
        worker_cpu: (cpu1 - cpu0) / span * 100.0,
        redis_us,
        commands,
        dispatch_calls: per_event("pacer_redis_command_duration_seconds_count{op=\"dispatch\"}"),
        moved: per_event("pacer_replanned_total"),
    }
}

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = arg("--rounds", "3").parse().expect("--rounds N");
    let rates: Vec<u32> = arg("--rates", "1000,5000")
        .split(',')
        .map(|r| r.parse().expect("--rates R,R"))
        .collect();
    let only = arg("--only", "all");
    let runs = |part: &str| only == "all" || only == part;
    for &rate in rates.iter().filter(|_| runs("drain")) {
        for workers in [1, 3] {
            let (mut worst, mut overall) = (Vec::new(), Vec::new());
            for round in 1..=rounds {
                let d = drain_backlog(&[], rate, 4 * rate as usize, workers);
                println!(
                    "drain {rate}/s, {workers} worker(s), round {round}: per second {:?}, worst after the first {:.1}%, overall {:.0}/s",
                    d.per_second,
                    d.worst_share() * 100.0,
                    d.overall
                );
                worst.push(d.worst_share() * 100.0);
                overall.push(d.overall);
            }
            println!(
                "drain {rate}/s, {workers} worker(s): median worst second {:.1}% of R, median overall {:.0}/s",
                median(worst),
                median(overall)
            );
        }
    }
    for pause_s in [1u64, 5].into_iter().filter(|_| runs("stall")) {
        let mut worst = Vec::new();
        for round in 1..=rounds {
            let s = stall(
                1000,
                1200,
                Duration::from_secs(pause_s),
                (pause_s + 8) as f64,
            );
            let counted = s.after.iter().skip(2).take(3).copied().min().unwrap_or(0);
            println!(
                "stall {pause_s} s, round {round}: seconds after {:?}, worst of 2–4 {counted}/s, moved {}",
                s.after, s.replanned
            );
            worst.push(counted as f64 / 10.0);
        }
        println!(
            "stall {pause_s} s: median worst of seconds 2–4 after it {:.1}% of R",
            median(worst)
        );
    }
    let (mut rss, mut cpu) = (Vec::new(), Vec::new());
    for round in (1..=rounds).filter(|_| runs("memory")) {
        let (r, c) = memory(100_000);
        println!(
            "memory, round {round}: 100,000 sleeping events, RSS {r:.1} MiB, CPU {c:.1}% of a core"
        );
        rss.push(r);
        cpu.push(c);
    }
    if !rss.is_empty() {
        println!(
            "memory: median RSS {:.1} MiB, median CPU while sleeping {:.1}% of a core",
            median(rss),
            median(cpu)
        );
    }
    let many: Vec<usize> = arg("--many", "300,10,200,2000")
        .split(',')
        .map(|n| n.parse().expect("--many ROUTES,RATE,EACH,PLACES"))
        .collect();
    let (routes, rate, each, places) = (many[0], many[1] as u32, many[2], many[3]);
    let (mut shares, mut spans) = (Vec::new(), Vec::new());
    for round in (1..=rounds).filter(|_| runs("routes")) {
        let m = many_routes(routes, rate, each, places);
        // The whole seconds after the first (the worker's start) and before the last two
        // (routes finishing): what all routes together passed while every one had a backlog.
        let steady: Vec<f64> = m
            .per_second
            .iter()
            .skip(1)
            .take(m.per_second.len().saturating_sub(3))
            .map(|n| *n as f64)
            .collect();
        let all = (routes as u32 * rate) as f64;
        let share = median(steady) / all * 100.0;
        println!(
            "many routes, round {round}: per second {:?}, median {share:.1}% of {all}/s, all out in {:.1} s ({:.1} s at their rates), slots left empty {:.1}%, worker CPU {:.1}% of a core, Redis {:.1} µs per event, {:.3} dispatch calls and {:.3} slots moved per event",
            m.per_second,
            m.span,
            each as f64 / rate as f64,
            m.empty_slots * 100.0, m.worker_cpu, m.redis_us, m.dispatch_calls, m.moved
        );
        println!(
            "many routes, round {round}: Redis by command {}",
            m.commands
        );
        let span = m.span;
        shares.push(share);
        spans.push(span);
    }
    if !shares.is_empty() {
        println!(
            "many routes: median {:.1}% of the routes' rate, all out in {:.1} s",
            median(shares),
            median(spans)
        );
    }
    for round in (1..=rounds).filter(|_| runs("waits")) {
        let w = waits_through_a_stall(10, 1000, Duration::from_secs(3), 7.0);
        println!("waits through a 3 s stall (max_wait 1 s), round {round}: {w:?}");
    }
}
