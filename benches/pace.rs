//! The benchmark: real pacer worker processes against a real redis-server it starts itself.
//!
//! 1. Throughput, on routes whose rate does not bind: events preloaded on the input stream, then
//!    N workers started; prints events/s end to end, Redis commands per event (all commands,
//!    including those run inside scripts, from `INFO commandstats`) and Redis CPU µs per event
//!    (from `INFO cpu`).
//! 2. Lateness of a paced run: 500 events/s spread over 10 routes, arriving in bursts that the
//!    routes must pace; prints (ready entry id ms − pacer_slot_us / 1000) percentiles, and the
//!    same lateness to the µs from the workers' `pacer_lateness_seconds` histograms (Redis's
//!    time in the dispatch call − the slot, in sub-millisecond buckets).
//!
//! `cargo bench --bench pace -- [--workers 3] [--events 200000] [--paced-seconds 10]
//! [--skew-seconds 5] [--wait-replicas 1] [--routes 10] [--batch 256]` (`--skew-seconds` runs
//! the first worker's wall clock that far ahead, under `faketime`, for the lateness run; pacer
//! maps Redis time to its own clock, so it should not show. `--wait-replicas N` starts N
//! replicas of the Redis and sets `redis.wait_replicas: N` for the throughput run: the price of
//! the durable mode; Redis CPU is the master's). `--routes` is the throughput run's number of
//! routes, `--batch` the workers' read batch.

mod common;

use common::{arg, outbound_config, outbound_throughput, start_workers_first_wrapped, xlen};
use pacer::report::{quantile, read_all};
use pacer::testkit::{http_get, wait_until, RedisServer, TempDir};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

fn ready_total(con: &mut redis::Connection, routes: usize) -> u64 {
    (0..routes)
        .map(|r| xlen(con, &format!("pacer:{{r{r}}}:ready")))
        .sum()
}

fn throughput(bin: &Path, workers: u64, events: u64) {
    let m = outbound_throughput(bin, workers, events);
    let routes = arg("--routes", 10);
    println!(
        "throughput: {workers} workers, {events} events, {routes} routes whose rate does not bind"
    );
    println!(
        "  events/s end to end        {:>10.0}  ({events} in {:.2} s, worker start included)",
        m.per_second(),
        m.seconds
    );
    println!(
        "  Redis commands per event   {:>10.2}  (every command, scripts' own calls included)",
        m.commands
    );
    println!(
        "  client round trips / event {:>10.3}  (EVALSHA, XREADGROUP, XACK, ...)",
        m.trips
    );
    println!("  Redis CPU µs per event     {:>10.2}", m.redis_us);
    println!(
        "  worker CPU µs per event    {:>10.2}  (all workers, start included)",
        m.worker_us
    );
    println!("  commandstats: {}", m.detail);
}

fn read_all_blocking(redis: &RedisServer, stream: &str) -> Vec<pacer::report::OutputEntry> {
    let (rt, mut con) = redis.async_con();
    rt.block_on(read_all(&mut con, stream)).unwrap()
}

fn lateness(bin: &Path, workers: u64, seconds: u64, skew_seconds: u64) {
    let redis = RedisServer::start();
    let _replicas = common::replicas_of(&redis, arg("--wait-replicas", 0));
    let mut con = redis.con();
    let dir = TempDir::new("bench");
    // Each route takes 100/s with burst 1; events arrive 5 per route every 100 ms, so four of
    // every five wait for a slot and go out on the dispatcher's timers.
    let routes: String = (0..10)
        .map(|r| format!("    r{r}: {{rate: 100/s, burst: 1, max_wait: 5s}}\n"))
        .collect();
    let wrapper = if skew_seconds > 0 {
        // Only the wall clock, as on a host whose clock is off: libfaketime's offset monotonic
        // clock stalls tokio's timers (seen here: one dispatch, then none).
        pacer::testkit::wall_clock_offset(&format!("+{skew_seconds}s"))
    } else {
        Vec::new()
    };
    let ports = std::cell::RefCell::new(Vec::new());
    let workers_run = start_workers_first_wrapped(
        bin,
        &dir,
        &redis,
        workers,
        &|url, port| {
            ports.borrow_mut().push(port);
            outbound_config(url, port, &routes, 256, 0)
        },
        &wrapper,
    );
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .unwrap();
    let cpu0 = common::cpu_seconds(&mut con);
    let start = Instant::now();
    let mut pushed = 0u64;
    for tick in 0..seconds * 10 {
        let mut pipe = redis::pipe();
        for i in 0..50 {
            pipe.cmd("XADD")
                .arg("in")
                .arg("*")
                .arg("route")
                .arg(format!("r{}", i % 10))
                .ignore();
        }
        pipe.query::<()>(&mut con).unwrap();
        pushed += 50;
        let next = start + Duration::from_millis(100 * (tick + 1));
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    if !wait_until(Duration::from_secs(30), || {
        ready_total(&mut con, 10) >= pushed
    }) {
        for (i, w) in workers_run.iter().enumerate() {
            eprintln!("worker {i}:\n{}", w.log_text());
        }
        let rejected = read_all_blocking(&redis, "pacer:rejected");
        panic!(
            "{} of {pushed} dispatched after 30 s; {} rejected: {:?}",
            ready_total(&mut con, 10),
            rejected.len(),
            rejected
                .iter()
                .take(3)
                .map(|e| (
                    e.field("pacer_reason").map(str::to_string),
                    e.field("pacer_detail").map(str::to_string)
                ))
                .collect::<Vec<_>>()
        );
    }
    let cpu = common::cpu_seconds(&mut con) - cpu0;
    let calls = common::command_calls(&mut con);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut late: Vec<i64> = rt.block_on(async {
        let mut c = redis
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let mut late = Vec::new();
        for r in 0..10 {
            for e in read_all(&mut c, &format!("pacer:{{r{r}}}:ready"))
                .await
                .unwrap()
            {
                late.push(e.ms - e.field("pacer_slot_us").unwrap().parse::<i64>().unwrap() / 1000);
            }
        }
        late
    });
    late.sort_unstable();
    let waited = late.len();
    let skewed = if skew_seconds > 0 {
        format!(", the first worker's clock {skew_seconds} s ahead")
    } else {
        String::new()
    };
    println!("lateness: {workers} workers{skewed}, {pushed} events at 500/s over 10 routes of 100/s (burst 1), {seconds} s");
    println!(
        "  ready id ms − pacer_slot_us / 1000: p50 {} ms, p99 {} ms, p99.9 {} ms, max {} ms ({waited} entries)",
        quantile(&late, 0.5).unwrap(),
        quantile(&late, 0.99).unwrap(),
        quantile(&late, 0.999).unwrap(),
        late.last().unwrap()
    );
    let mut histogram: BTreeMap<i64, usize> = BTreeMap::new();
    for l in &late {
        *histogram.entry(*l).or_default() += 1;
    }
    let h: Vec<String> = histogram
        .iter()
        .map(|(ms, n)| format!("{ms}ms:{n}"))
        .collect();
    println!("  histogram: {}", h.join(" "));
    print_lateness_buckets(&ports.borrow());
    // What pacing costs Redis when the rate binds: most events go out on their own timer, in a
    // dispatch call of few events, so the calls' own cost is most of it.
    let scripts: (u64, u64) = ["evalsha", "fcall"]
        .iter()
        .filter_map(|c| calls.get(*c))
        .fold((0, 0), |(n, us), (cn, cus)| (n + cn, us + cus));
    println!(
        "  Redis CPU µs per event {:.1} (the benchmark's own XADDs included); {} script calls, {:.1} µs each in Redis, {:.1} µs per event",
        cpu * 1e6 / pushed as f64,
        scripts.0,
        scripts.1 as f64 / scripts.0.max(1) as f64,
        scripts.1 as f64 / pushed as f64
    );
    println!(
        "  commandstats: {}",
        common::commandstats_line(&calls, pushed)
    );
}

/// The workers' `pacer_lateness_seconds` histograms, summed over workers and routes: the share
/// of dispatches within each bucket, and the bucket that holds p99 and p99.9.
fn print_lateness_buckets(ports: &[u16]) {
    // le (s) -> dispatches at most that late.
    let mut buckets: BTreeMap<u64, f64> = BTreeMap::new();
    for &port in ports {
        let Some((200, text)) = http_get(port, "/metrics") else {
            println!("  (worker on port {port} gave no metrics)");
            return;
        };
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("pacer_lateness_seconds_bucket{") else {
                continue;
            };
            let le = rest.split("le=\"").nth(1).and_then(|v| v.split('"').next());
            let count = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            if let (Some(le), Some(count)) = (le, count) {
                // In ns, to key the map exactly; +Inf last.
                let ns = le
                    .parse::<f64>()
                    .map_or(u64::MAX, |s| (s * 1e9).round() as u64);
                *buckets.entry(ns).or_default() += count;
            }
        }
    }
    let Some(&total) = buckets.get(&u64::MAX) else {
        println!("  (no lateness histogram)");
        return;
    };
    let label = |ns: u64| {
        if ns == u64::MAX {
            "+Inf".to_string()
        } else {
            format!("{} µs", ns / 1000)
        }
    };
    let within = |q: f64| {
        buckets
            .iter()
            .find(|(_, &n)| n >= q * total)
            .map_or("?".into(), |(&ns, _)| label(ns))
    };
    let shares: Vec<String> = buckets
        .iter()
        .map(|(&ns, &n)| format!("≤{}:{:.2}%", label(ns), 100.0 * n / total))
        .collect();
    println!(
        "  workers' histograms (Redis time of the dispatch call − slot, {total} dispatches): p50 ≤ {}, p99 ≤ {}, p99.9 ≤ {}",
        within(0.5),
        within(0.99),
        within(0.999)
    );
    println!("  cumulative: {}", shares.join(" "));
}

fn main() {
    let bin = &common::pacer_bin();
    let workers = arg("--workers", 3);
    throughput(bin, workers, arg("--events", 200_000));
    // `--paced-seconds 0`: the throughput half alone.
    let paced = arg("--paced-seconds", 10);
    if paced > 0 {
        lateness(bin, workers, paced, arg("--skew-seconds", 0));
    }
}
