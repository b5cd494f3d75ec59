//! The inbound benchmark: real pacer worker processes against a real redis-server it starts
//! itself, once per algorithm and load.
//!
//! For each run: events from `--sources` sources are preloaded on the inbound stream, then N
//! workers started; it prints decisions/s end to end (worker start included), Redis commands per
//! decision (every command, including those scripts run, from `INFO commandstats`) and Redis CPU
//! µs per decision (`INFO cpu`). Two loads per algorithm: limits that never bind (every event
//! accepted and forwarded) and limits that reject 40% (rejections are written by a second call).
//!
//! `cargo bench --bench admit -- [--workers 3] [--events 100000] [--sources 1000]`

mod common;

use common::{
    arg, command_calls, commandstats_line, cpu_seconds, pacer_commands, preload,
    process_cpu_seconds,
};
use pacer::testkit::{free_port, http_get, wait_until, Pacer, RedisServer, TempDir};
use std::path::Path;
use std::time::{Duration, Instant};

fn xlen(con: &mut redis::Connection, stream: &str) -> u64 {
    redis::cmd("XLEN").arg(stream).query(con).unwrap()
}

fn run(bin: &Path, workers: u64, events: u64, sources: u64, algorithm: &str, limit: &str) {
    let redis = RedisServer::start();
    let mut con = redis.con();
    let dir = TempDir::new("bench-admit");
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("in")
        .arg("pacer")
        .arg("0")
        .arg("MKSTREAM")
        .query(&mut con)
        .unwrap();
    preload(&mut con, events, |i| {
        [
            ("source", format!("s{}", i % sources)),
            ("call", i.to_string()),
        ]
    });
    let cpu0 = cpu_seconds(&mut con);
    let start = Instant::now();
    let running: Vec<Pacer> = (0..workers)
        .map(|i| {
            let port = free_port();
            let cfg = dir.write(
                &format!("w{i}.yaml"),
                &format!(
                    "redis: {{url: \"{}\"}}\nmetrics: {{listen: \"127.0.0.1:{port}\"}}\nworker: {{batch: 256, max_inflight: 100000}}\ninbound:\n  streams: [\"in\"]\n  forward_stream: \"fwd\"\n  rejected_stream: \"rej\"\n  rules:\n    - {{name: per-source, key: [source], algorithm: {algorithm}, limits: [{limit}]}}\n",
                    redis.url()
                ),
            );
            let p = Pacer::run(bin, &cfg, &[("RUST_LOG", "warn")]);
            assert!(wait_until(Duration::from_secs(10), || matches!(
                http_get(port, "/readyz"),
                Some((200, _))
            )));
            p
        })
        .collect();
    assert!(wait_until(Duration::from_secs(600), || xlen(
        &mut con, "fwd"
    ) + xlen(
        &mut con, "rej"
    ) >= events));
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds(&mut con) - cpu0;
    let worker_cpu = process_cpu_seconds(running.iter().map(Pacer::pid));
    let calls = command_calls(&mut con);
    let (all, trips) = pacer_commands(&calls);
    let accepted = xlen(&mut con, "fwd");
    let n = events as f64;
    println!(
        "{algorithm:<12} limit {limit:<9} {:>9.0} decisions/s  {:>5.2} commands  {:>6.3} round trips  {:>6.2} µs Redis CPU  {:>6.2} µs worker CPU  per decision  ({accepted} accepted of {events} in {elapsed:.2} s)",
        n / elapsed,
        all as f64 / n,
        trips as f64 / n,
        cpu * 1e6 / n,
        worker_cpu * 1e6 / n,
    );
    println!("    commandstats: {}", commandstats_line(&calls, events));
}

fn main() {
    let bin = Path::new(env!("CARGO_BIN_EXE_pacer"));
    let workers = arg("--workers", 3);
    let events = arg("--events", 100_000);
    let sources = arg("--sources", 1000);
    let per_source = events / sources;
    // A per-minute limit that never binds, and one that rejects 40% of each source's events.
    let open = format!("{}/min", per_source * 10);
    let tight = format!("{}/min", per_source * 6 / 10);
    println!("inbound admission: {workers} workers, {events} events from {sources} sources (worker start included)");
    for algorithm in ["sliding_log", "gcra", "fixed_window"] {
        for limit in [&open, &tight] {
            run(bin, workers, events, sources, algorithm, limit);
        }
    }
}
