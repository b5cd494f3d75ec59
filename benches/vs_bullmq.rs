//! pacer against BullMQ, side by side on one redis-server: the same events, 3 workers each, a
//! rate that does not bind, on one route and on ten.
//!
//! - pacer: events preloaded on the input stream `in`, then `--workers` `pacer run` processes,
//!   routes of rate 1000/ms with a large burst; done when the ready streams hold every event
//!   (as `benches/common::outbound_throughput` does, there on ten routes only).
//! - BullMQ (`benches/bullmq/worker.js`, the version pinned in its package.json): one Queue per
//!   route, jobs with the same fields preloaded with `addBulk`, then `--workers` node processes,
//!   each with one Worker per queue (`--concurrency` jobs at once, a rate limiter that does not
//!   bind), whose processor does nothing: completing a job is BullMQ's counterpart of pacer's
//!   dispatch to a ready stream. Jobs are removed on completion.
//!
//! Each run starts from an empty Redis (FLUSHALL) and preloads its input before the measured
//! window, which closes when the last event is out. Both open the same way: once every worker
//! process has started and is ready, the events are released at once (BullMQ's workers are
//! told to go; pacer's consumer group, created behind the preload, is moved back to its start),
//! so neither system's process start is counted. (Until 2026-11-24 pacer's window included its
//! three workers' start, one after the other: about a fifth of a 20,000-event run.) The window
//! closes at the last event's own time, to the millisecond, by the machine's wall clock: the
//! millisecond of pacer's last ready entry id (Redis's clock, the same machine's), the
//! `Date.now()` of BullMQ's last completed job, each plus 1 ms for the part of its millisecond
//! not seen. (Until late on 2026-11-24 it closed when the benchmark's polling, every 20 ms, saw the
//! last event out: 1–21 ms late, a tenth of some of pacer's 0.12 s windows and a hundredth of
//! BullMQ's.) Within it:
//! events/s, Redis CPU µs per event (`INFO cpu`, user + sys), Redis commands per event and each
//! command's calls and µs (`INFO commandstats`, which counts the calls scripts make, and their
//! time both under them and under the script), and the workers' CPU µs per event. Before the
//! window, the preload's Redis CPU per event is counted too (`enqueue µs/ev`: pacer's XADD,
//! BullMQ's addBulk), for a second ratio over an event's whole life in Redis. Rounds alternate
//! which system goes first; the summary gives the medians and the median of each round's
//! pacer/BullMQ ratio. Nothing is asserted about speed.
//!
//! `cargo bench --bench vs_bullmq -- [--events 20000] [--rounds 3] [--workers 3] [--concurrency 50]
//! [--threads 1]`
//!
//! `--threads` is each pacer worker's `worker.threads`: 1 by default, as config.yaml advises for
//! several pacer processes on one host (three on this machine's two cores), and as each BullMQ
//! worker is one node process. On 2026-11-25, one round each, alternating: 1 thread 200k / 190k
//! events/s on one route, 194k / 198k on ten; the default of one per core (two here, six threads
//! on two cores) 172k / 164k and 172k / 149k, at the same Redis CPU per event.
//!
//! `--concurrency` is each BullMQ Worker's (jobs in flight at once). BullMQ's default is 1, but
//! more lets ioredis pipeline: here 1 cost about 105-130 µs of Redis CPU per job and 10 to 200
//! about 55-80, with more jobs/s. 50 is the default, so that pacer meets BullMQ at its best;
//! pacer's workers read batches of 512, pacer's own default (`--batch` to change it).
//!
//! Without node it prints `skipped: node is not installed` and exits 0. It installs BullMQ with
//! `npm ci` in `benches/bullmq` when its node_modules is missing.
//!
//! Over 400 lines: one benchmark: both systems' runs and their side-by-side summary, which would
//! not read apart.

mod common;

use common::{
    arg, command_calls, cpu_seconds, median, outbound_config, preload, present,
    process_cpu_seconds, start_workers, xlen, BENCH_OWN,
};
use pacer::testkit::{wait_until, Pacer, RedisServer, TempDir};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One system's run: per event, over the measured window.
struct Run {
    per_second: f64,
    seconds: f64,
    redis_us: f64,
    /// Redis CPU µs per event spent putting the events in (XADD; BullMQ's addBulk), before the
    /// window.
    enqueue_us: f64,
    worker_us: f64,
    commands: f64,
    /// Command name -> (calls, µs) per event, the benchmark's own left out.
    per_command: BTreeMap<String, (f64, f64)>,
}

fn bullmq_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/bullmq")
}

/// Installs BullMQ from benches/bullmq/package-lock.json if it is not there yet; the reason to
/// skip the benchmark, if any.
fn bullmq_ready() -> Result<(), &'static str> {
    if !present("node") {
        return Err("node is not installed");
    }
    if bullmq_dir().join("node_modules/bullmq").is_dir() {
        return Ok(());
    }
    if !present("npm") {
        return Err("npm is not installed (needed once, to install BullMQ)");
    }
    eprintln!("installing BullMQ: npm ci in {}", bullmq_dir().display());
    let ok = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund"])
        .current_dir(bullmq_dir())
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "npm ci in benches/bullmq failed");
    Ok(())
}

/// The machine's wall clock in milliseconds, the clock Redis's entry ids and node's `Date.now()`
/// are read on.
fn wall_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_secs_f64()
        * 1000.0
}

/// The measured window in seconds: from `opened` to the end of the millisecond `last` (an
/// event's time, to the millisecond) the last event went out in.
fn closed(opened: f64, last: f64) -> f64 {
    let seconds = (last + 1.0 - opened) / 1000.0;
    assert!(
        seconds > 0.0,
        "the last event went out before the window opened"
    );
    seconds
}

/// The millisecond of the newest entry id in `stream`.
fn newest_ms(con: &mut redis::Connection, stream: &str) -> f64 {
    let newest: Vec<(String, redis::Value)> = redis::cmd("XREVRANGE")
        .arg(stream)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query(con)
        .unwrap();
    newest
        .first()
        .and_then(|(id, _)| id.split('-').next()?.parse().ok())
        .expect("a ready entry")
}

/// An empty Redis with zeroed statistics.
fn reset(con: &mut redis::Connection) {
    let _: () = redis::cmd("FLUSHALL").arg("SYNC").query(con).unwrap();
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(con).unwrap();
}

/// Per-event figures from the window's Redis CPU, worker CPU and command statistics, leaving out
/// `own` (what the benchmark itself sent).
fn figures(
    con: &mut redis::Connection,
    events: u64,
    seconds: f64,
    enqueue_cpu: f64,
    redis_cpu: f64,
    worker_cpu: f64,
    own: &[&str],
) -> Run {
    let n = events as f64;
    let calls = command_calls(con);
    let per_command: BTreeMap<String, (f64, f64)> = calls
        .iter()
        .filter(|(k, _)| !own.contains(&k.as_str()))
        .map(|(k, (c, us))| (k.clone(), (*c as f64 / n, *us as f64 / n)))
        .collect();
    Run {
        per_second: n / seconds,
        seconds,
        redis_us: redis_cpu * 1e6 / n,
        enqueue_us: enqueue_cpu * 1e6 / n,
        worker_us: worker_cpu * 1e6 / n,
        commands: per_command.values().map(|(c, _)| c).sum(),
        per_command,
    }
}

/// pacer on `routes` routes whose rate does not bind. As for BullMQ, the window opens once every
/// worker has started and is ready (connected, its scripts loaded, reading): the events are
/// preloaded behind the consumer group (created at the stream's end), and the window opens by
/// moving the group back to the stream's start (XGROUP SETID) and adding one more event, whose
/// XADD wakes the workers blocked on their reads. That event is counted with the others.
fn pacer_run(bin: &Path, redis: &RedisServer, workers: u64, events: u64, routes: u64) -> Run {
    let mut con = redis.con();
    reset(&mut con);
    let dir = TempDir::new("vs-bullmq");
    let yaml: String = (0..routes)
        .map(|r| format!("    r{r}: {{rate: 1000/ms, burst: 1000000}}\n"))
        .collect();
    let fields = |i: u64| [("route", format!("r{}", i % routes)), ("to", i.to_string())];
    let enqueue0 = cpu_seconds(&mut con);
    preload(&mut con, events, fields);
    let enqueue = cpu_seconds(&mut con) - enqueue0;
    let _: () = redis::cmd("XGROUP")
        .arg(&["CREATE", "in", "pacer", "$"])
        .query(&mut con)
        .unwrap();
    let running = start_workers(bin, &dir, redis, workers, &|url, port| {
        outbound_config(url, port, &yaml, 512, 1)
    });
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .unwrap();
    let cpu0 = cpu_seconds(&mut con);
    let worker_cpu0 = process_cpu_seconds(running.iter().map(Pacer::pid));
    let opened = wall_ms();
    let _: () = redis::cmd("XGROUP")
        .arg(&["SETID", "in", "pacer", "0"])
        .query(&mut con)
        .unwrap();
    let mut waker = redis::cmd("XADD");
    waker.arg("in").arg("*");
    for (name, value) in fields(events) {
        waker.arg(name).arg(value);
    }
    let _: String = waker.query(&mut con).unwrap();
    let events = events + 1;
    let ready = |con: &mut redis::Connection| -> u64 {
        (0..routes)
            .map(|r| xlen(con, &format!("pacer:{{r{r}}}:ready")))
            .sum()
    };
    assert!(wait_until(Duration::from_secs(600), || ready(&mut con) >= events));
    let last = (0..routes)
        .map(|r| newest_ms(&mut con, &format!("pacer:{{r{r}}}:ready")))
        .fold(0.0, f64::max);
    let seconds = closed(opened, last);
    let cpu = cpu_seconds(&mut con) - cpu0;
    let worker_cpu = process_cpu_seconds(running.iter().map(Pacer::pid)) - worker_cpu0;
    // Left out as the other benchmarks do: the XLEN polling, INFO and the connections' setup;
    // and the window's opening (its XADD is one event's, counted).
    let mut own = BENCH_OWN.to_vec();
    own.push("xgroup|setid");
    figures(&mut con, events, seconds, enqueue, cpu, worker_cpu, &own)
}

/// A `node worker.js work` process: whether it said `ready`, the completions it last reported
/// and when the last of them completed (`Date.now()`, ms). Killed on drop.
struct NodeWorker {
    child: Child,
    ready: Arc<AtomicBool>,
    completed: Arc<AtomicU64>,
    last_ms: Arc<AtomicU64>,
}

impl Drop for NodeWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl NodeWorker {
    fn start(url: &str, routes: u64, concurrency: u64) -> Self {
        let mut child = Command::new("node")
            .arg(bullmq_dir().join("worker.js"))
            .args(["work", url, &routes.to_string(), &concurrency.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting node");
        let ready = Arc::new(AtomicBool::new(false));
        let completed = Arc::new(AtomicU64::new(0));
        let last_ms = Arc::new(AtomicU64::new(0));
        let (r, c, l) = (ready.clone(), completed.clone(), last_ms.clone());
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line == "ready" {
                    r.store(true, Ordering::Relaxed);
                } else if let Some(report) = line.strip_prefix("completed ") {
                    let (n, at) = report.split_once(' ').unwrap_or((report, "0"));
                    // The time first: whoever sees the count sees the time that goes with it.
                    l.store(at.parse().unwrap_or(0), Ordering::Relaxed);
                    c.store(n.parse().unwrap_or(0), Ordering::Relaxed);
                }
            }
        });
        NodeWorker {
            child,
            ready,
            completed,
            last_ms,
        }
    }

    fn go(&mut self) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin
            .write_all(b"go\n")
            .and_then(|_| stdin.flush())
            .unwrap();
    }
}

/// BullMQ on `routes` queues whose rate limiter does not bind. The window opens once every
/// worker process has started and connected its Workers (node's start, about 0.3 s of CPU, is
/// left out, as pacer's workers' start is).
fn bullmq_run(
    redis: &RedisServer,
    workers: u64,
    events: u64,
    routes: u64,
    concurrency: u64,
) -> Run {
    let mut con = redis.con();
    reset(&mut con);
    let enqueue0 = cpu_seconds(&mut con);
    let status = Command::new("node")
        .arg(bullmq_dir().join("worker.js"))
        .args([
            "preload",
            &redis.url(),
            &routes.to_string(),
            &events.to_string(),
        ])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "the BullMQ preload failed");
    let enqueue = cpu_seconds(&mut con) - enqueue0;
    let mut running: Vec<NodeWorker> = (0..workers)
        .map(|_| NodeWorker::start(&redis.url(), routes, concurrency))
        .collect();
    assert!(
        wait_until(Duration::from_secs(60), || running
            .iter()
            .all(|w| w.ready.load(Ordering::Relaxed))),
        "BullMQ workers did not start"
    );
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .unwrap();
    let cpu0 = cpu_seconds(&mut con);
    let worker_cpu0 = process_cpu_seconds(running.iter().map(|w| w.child.id()));
    let opened = wall_ms();
    for w in &mut running {
        w.go();
    }
    let done = || {
        running
            .iter()
            .map(|w| w.completed.load(Ordering::Relaxed))
            .sum::<u64>()
            >= events
    };
    assert!(
        wait_until(Duration::from_secs(600), done),
        "BullMQ did not complete every job"
    );
    let last = running
        .iter()
        .map(|w| w.last_ms.load(Ordering::Relaxed) as f64)
        .fold(0.0, f64::max);
    let seconds = closed(opened, last);
    let cpu = cpu_seconds(&mut con) - cpu0;
    let worker_cpu = process_cpu_seconds(running.iter().map(|w| w.child.id())) - worker_cpu0;
    // The benchmark sends nothing but INFO during the window.
    figures(
        &mut con,
        events,
        seconds,
        enqueue,
        cpu,
        worker_cpu,
        &["info", "config"],
    )
}

/// `name=calls/µs` per event, the costliest first.
fn commandstats(run: &Run) -> String {
    let mut v: Vec<_> = run.per_command.iter().collect();
    v.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    v.iter()
        .map(|(k, (c, us))| format!("{k}={c:.2}/{us:.2}µs"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Redis CPU µs over an event's whole life: put in, then worked.
fn end_to_end(r: &Run) -> f64 {
    r.enqueue_us + r.redis_us
}

fn row(name: &str, r: &Run) {
    println!(
        "  {name:<8} {:>10.0} {:>12.1} {:>10.2} {:>12.1} {:>8.2} {:>14.1}",
        r.per_second, r.redis_us, r.commands, r.worker_us, r.seconds, r.enqueue_us
    );
}

fn header() {
    println!(
        "  {:<8} {:>10} {:>12} {:>10} {:>12} {:>8} {:>14}",
        "", "events/s", "Redis µs/ev", "cmds/ev", "worker µs/ev", "seconds", "enqueue µs/ev"
    );
}

fn main() {
    let events = arg("--events", 20_000);
    let rounds = arg("--rounds", 3);
    let workers = arg("--workers", 3);
    let concurrency = arg("--concurrency", 50);
    if let Err(why) = bullmq_ready() {
        println!("skipped: {why}");
        return;
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_pacer"));
    let version = |dir: &str| -> String {
        let text = std::fs::read_to_string(bullmq_dir().join(dir).join("package.json"))
            .unwrap_or_default();
        text.lines()
            .find_map(|l| l.trim().strip_prefix("\"version\": \""))
            .map(|v| v.trim_end_matches(['"', ',']).to_string())
            .unwrap_or_else(|| "?".into())
    };
    let node = Command::new("node").arg("--version").output().unwrap();
    let redis = RedisServer::start();
    // `--wait-replicas N` (pacer's durable mode) needs N replicas to confirm its writes.
    let _replicas = common::replicas_of(&redis, arg("--wait-replicas", 0));
    let server: String = redis::cmd("INFO")
        .arg("server")
        .query::<String>(&mut redis.con())
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:").map(str::to_string))
        .unwrap_or_default();
    println!(
        "pacer vs BullMQ {} (ioredis {}, node {}) on redis-server {}: {events} events, {workers} workers each, BullMQ concurrency {concurrency}, {rounds} rounds",
        version("node_modules/bullmq"),
        version("node_modules/ioredis"),
        String::from_utf8_lossy(&node.stdout).trim(),
        server.trim()
    );

    // (routes, system) -> one Run per round.
    let mut all: BTreeMap<(u64, &str), Vec<Run>> = BTreeMap::new();
    for round in 1..=rounds {
        for routes in [1, 10] {
            let pacer_first = round % 2 == 1;
            let (p, b) = if pacer_first {
                let p = pacer_run(bin, &redis, workers, events, routes);
                (p, bullmq_run(&redis, workers, events, routes, concurrency))
            } else {
                let b = bullmq_run(&redis, workers, events, routes, concurrency);
                (pacer_run(bin, &redis, workers, events, routes), b)
            };
            println!(
                "\nround {round}, {routes} route{} ({} first)",
                if routes == 1 { "" } else { "s" },
                if pacer_first { "pacer" } else { "BullMQ" }
            );
            header();
            row("pacer", &p);
            row("BullMQ", &b);
            println!(
                "  pacer/BullMQ: {:.2}x events/s, {:.2}x Redis CPU per event; {:.2}x with the enqueue",
                p.per_second / b.per_second,
                p.redis_us / b.redis_us,
                end_to_end(&p) / end_to_end(&b)
            );
            println!(
                "  pacer commandstats (calls/µs per event): {}",
                commandstats(&p)
            );
            println!(
                "  BullMQ commandstats (calls/µs per event): {}",
                commandstats(&b)
            );
            all.entry((routes, "pacer")).or_default().push(p);
            all.entry((routes, "BullMQ")).or_default().push(b);
        }
    }

    println!("\nmedians of {rounds} rounds ({events} events, {workers} workers each)");
    for routes in [1, 10] {
        let p = &all[&(routes, "pacer")];
        let b = &all[&(routes, "BullMQ")];
        let med = |runs: &[Run], f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
        let summary = |runs: &[Run]| Run {
            per_second: med(runs, |r| r.per_second),
            seconds: med(runs, |r| r.seconds),
            redis_us: med(runs, |r| r.redis_us),
            enqueue_us: med(runs, |r| r.enqueue_us),
            worker_us: med(runs, |r| r.worker_us),
            commands: med(runs, |r| r.commands),
            per_command: BTreeMap::new(),
        };
        println!("{routes} route{}:", if routes == 1 { "" } else { "s" });
        header();
        row("pacer", &summary(p));
        row("BullMQ", &summary(b));
        let ratio =
            |f: fn(&Run) -> f64| median(p.iter().zip(b).map(|(p, b)| f(p) / f(b)).collect());
        println!(
            "  pacer/BullMQ (median of the rounds' ratios): {:.2}x events/s, {:.2}x Redis CPU per event, {:.2}x commands per event",
            ratio(|r| r.per_second),
            ratio(|r| r.redis_us),
            ratio(|r| r.commands)
        );
        println!(
            "  with the enqueue (Redis CPU from the producer's call to the ready entry or the completed job): {:.2}x per event",
            ratio(end_to_end)
        );
        let rng = |runs: &[Run], f: fn(&Run) -> f64| {
            let v: Vec<f64> = runs.iter().map(f).collect();
            (
                v.iter().cloned().fold(f64::INFINITY, f64::min),
                v.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
            )
        };
        let (pl, ph) = rng(p, |r| r.per_second);
        let (bl, bh) = rng(b, |r| r.per_second);
        let (pcl, pch) = rng(p, |r| r.redis_us);
        let (bcl, bch) = rng(b, |r| r.redis_us);
        println!(
            "  range: pacer {pl:.0}-{ph:.0} events/s at {pcl:.1}-{pch:.1} µs, BullMQ {bl:.0}-{bh:.0} jobs/s at {bcl:.1}-{bch:.1} µs"
        );
    }
}
