//! The benchmark: real pacer worker processes against a real redis-server it starts itself.
//!
//! 1. Throughput, on routes whose rate does not bind: events preloaded on the input stream, then
//!    N workers started; prints events/s end to end, Redis commands per event (all commands,
//!    including those run inside scripts, from `INFO commandstats`) and Redis CPU µs per event
//!    (from `INFO cpu`).
//! 2. Lateness of a paced run: 500 events/s spread over 10 routes, arriving in bursts that the
//!    routes must pace; prints (ready entry id ms − pacer_slot_ms) percentiles.
//!
//! `cargo bench --bench pace -- [--workers 3] [--events 200000] [--paced-seconds 10]`

mod common;

use common::{
    arg, command_calls, commandstats_line, cpu_seconds, pacer_commands, preload,
    process_cpu_seconds,
};
use pacer::report::{quantile, read_all};
use pacer::testkit::{free_port, http_get, wait_until, Pacer, RedisServer, TempDir};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

fn config(
    dir: &TempDir,
    name: &str,
    redis: &RedisServer,
    port: u16,
    routes: &str,
) -> std::path::PathBuf {
    dir.write(
        name,
        &format!(
            "redis: {{url: \"{}\"}}\nmetrics: {{listen: \"127.0.0.1:{port}\"}}\nworker: {{batch: 256, max_inflight: 100000}}\noutbound:\n  streams: [\"in\"]\n  routes:\n{routes}",
            redis.url()
        ),
    )
}

fn start_workers(
    bin: &Path,
    dir: &TempDir,
    redis: &RedisServer,
    n: u64,
    routes: &str,
) -> Vec<Pacer> {
    (0..n)
        .map(|i| {
            let port = free_port();
            let cfg = config(dir, &format!("w{i}.yaml"), redis, port, routes);
            let p = Pacer::run(bin, &cfg, &[("RUST_LOG", "warn")]);
            assert!(wait_until(Duration::from_secs(10), || matches!(
                http_get(port, "/readyz"),
                Some((200, _))
            )));
            p
        })
        .collect()
}

fn ready_total(con: &mut redis::Connection, routes: usize) -> u64 {
    (0..routes)
        .map(|r| {
            redis::cmd("XLEN")
                .arg(format!("pacer:{{r{r}}}:ready"))
                .query::<u64>(con)
                .unwrap()
        })
        .sum()
}

fn throughput(bin: &Path, workers: u64, events: u64) {
    let redis = RedisServer::start();
    let mut con = redis.con();
    let dir = TempDir::new("bench");
    let routes: String = (0..10)
        .map(|r| format!("    r{r}: {{rate: 1000/ms, burst: 1000000}}\n"))
        .collect();
    // The group is created by the first worker; create it now so the preload is not skipped.
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("in")
        .arg("pacer")
        .arg("0")
        .arg("MKSTREAM")
        .query(&mut con)
        .unwrap();
    preload(&mut con, events, |i| {
        [("route", format!("r{}", i % 10)), ("to", i.to_string())]
    });
    let cpu0 = cpu_seconds(&mut con);
    let start = Instant::now();
    let running = start_workers(bin, &dir, &redis, workers, &routes);
    assert!(wait_until(Duration::from_secs(600), || ready_total(
        &mut con, 10
    ) >= events));
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds(&mut con) - cpu0;
    let worker_cpu = process_cpu_seconds(running.iter().map(Pacer::pid));
    let calls = command_calls(&mut con);
    let (all, top) = pacer_commands(&calls);
    println!("throughput: {workers} workers, {events} events, 10 routes whose rate does not bind");
    println!("  events/s end to end        {:>10.0}  ({events} in {elapsed:.2} s, worker start included)", events as f64 / elapsed);
    println!(
        "  Redis commands per event   {:>10.2}  (every command, scripts' own calls included)",
        all as f64 / events as f64
    );
    println!(
        "  client round trips / event {:>10.3}  (EVALSHA, XREADGROUP, XACK, ...)",
        top as f64 / events as f64
    );
    println!(
        "  Redis CPU µs per event     {:>10.2}",
        cpu * 1e6 / events as f64
    );
    println!(
        "  worker CPU µs per event    {:>10.2}  (all workers, start included)",
        worker_cpu * 1e6 / events as f64
    );
    println!("  commandstats: {}", commandstats_line(&calls, events));
}

fn lateness(bin: &Path, workers: u64, seconds: u64) {
    let redis = RedisServer::start();
    let mut con = redis.con();
    let dir = TempDir::new("bench");
    // Each route takes 100/s with burst 1; events arrive 5 per route every 100 ms, so four of
    // every five wait for a slot and go out on the dispatcher's timers.
    let routes: String = (0..10)
        .map(|r| format!("    r{r}: {{rate: 100/s, burst: 1, max_wait: 5s}}\n"))
        .collect();
    let _workers = start_workers(bin, &dir, &redis, workers, &routes);
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
    assert!(wait_until(Duration::from_secs(30), || ready_total(
        &mut con, 10
    ) >= pushed));
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
                late.push(e.ms - e.field("pacer_slot_ms").unwrap().parse::<i64>().unwrap());
            }
        }
        late
    });
    late.sort_unstable();
    let waited = late.len();
    println!("lateness: {workers} workers, {pushed} events at 500/s over 10 routes of 100/s (burst 1), {seconds} s");
    println!(
        "  ready id ms − pacer_slot_ms: p50 {} ms, p99 {} ms, p99.9 {} ms, max {} ms ({waited} entries)",
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
}

fn main() {
    let bin = Path::new(env!("CARGO_BIN_EXE_pacer"));
    let workers = arg("--workers", 3);
    throughput(bin, workers, arg("--events", 200_000));
    lateness(bin, workers, arg("--paced-seconds", 10));
}
