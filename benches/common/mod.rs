//! What both benchmarks read from the command line and from Redis's INFO.
#![allow(dead_code)]

use pacer::testkit::{free_port, http_get, wait_until, Pacer, RedisServer, TempDir};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// The pacer binary to run: `PACER_BENCH_BIN` if set (so two builds can be measured side by
/// side on the same day), else the one cargo built with this benchmark.
pub fn pacer_bin() -> std::path::PathBuf {
    std::env::var_os("PACER_BENCH_BIN")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_pacer").into())
}

/// The value after `name` on the command line, or `default`.
pub fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn info(con: &mut redis::Connection, section: &str) -> BTreeMap<String, String> {
    let text: String = redis::cmd("INFO").arg(section).query(con).unwrap();
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

/// Redis CPU time used so far (user + system), seconds.
pub fn cpu_seconds(con: &mut redis::Connection) -> f64 {
    let i = info(con, "cpu");
    i["used_cpu_sys"].parse::<f64>().unwrap() + i["used_cpu_user"].parse::<f64>().unwrap()
}

/// Calls and total µs per command from `INFO commandstats`. A script's own calls are counted
/// under their commands, and their time under both them and the EVALSHA that ran them.
pub fn command_calls(con: &mut redis::Connection) -> BTreeMap<String, (u64, u64)> {
    info(con, "commandstats")
        .into_iter()
        .filter_map(|(k, v)| {
            let name = k.strip_prefix("cmdstat_")?.to_string();
            let field = |f: &str| -> Option<u64> {
                v.split(',').find_map(|kv| kv.strip_prefix(f))?.parse().ok()
            };
            Some((name, (field("calls=")?, field("usec=")?)))
        })
        .collect()
}

/// pacer's commands from `command_calls`, as `name=calls/µs per event` (the benchmark's own
/// left out): where Redis's time goes.
pub fn commandstats_line(calls: &BTreeMap<String, (u64, u64)>, events: u64) -> String {
    calls
        .iter()
        .filter(|(k, _)| !BENCH_OWN.contains(&k.as_str()))
        .map(|(k, (n, usec))| format!("{k}={n}/{:.2}µs", *usec as f64 / events as f64))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Commands the benchmark itself sends, not counted as pacer's.
pub const BENCH_OWN: [&str; 6] = ["info", "config", "xlen", "ping", "client", "hello"];

/// From `command_calls`: every command pacer caused (the benchmark's own left out), and the
/// client round trips among them (calls inside scripts are not round trips).
pub fn pacer_commands(calls: &BTreeMap<String, (u64, u64)>) -> (u64, u64) {
    let all = calls
        .iter()
        .filter(|(k, _)| !BENCH_OWN.contains(&k.as_str()))
        .map(|(_, (n, _))| n)
        .sum();
    let trips = [
        "evalsha",
        "eval",
        "xreadgroup",
        "xack",
        "xinfo",
        "xpending",
        "xclaim",
        "script",
        "xgroup",
    ]
    .iter()
    .filter_map(|k| calls.get(*k).map(|(n, _)| n))
    .sum();
    (all, trips)
}

/// XADDs `events` entries to the stream `in` (fields from `fields(i)`), pipelined a thousand at
/// a time, then resets Redis's command statistics so that only pacer's work is counted.
pub fn preload(
    con: &mut redis::Connection,
    events: u64,
    fields: impl Fn(u64) -> [(&'static str, String); 2],
) {
    let mut pipe = redis::pipe();
    for i in 0..events {
        let cmd = pipe.cmd("XADD").arg("in").arg("*");
        for (name, value) in fields(i) {
            cmd.arg(name).arg(value);
        }
        cmd.ignore();
        if pipe.len() == 1000 {
            pipe.query::<()>(con).unwrap();
            pipe = redis::pipe();
        }
    }
    if !pipe.is_empty() {
        pipe.query::<()>(con).unwrap();
    }
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(con).unwrap();
}

/// Whether `program --version` runs (a benchmark that needs it prints a skip otherwise).
pub fn present(program: &str) -> bool {
    std::process::Command::new(program)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// CPU time (user + system, seconds) the processes `pids` have used so far, from
/// `/proc/<pid>/stat` (fields 14 and 15, in clock ticks of 1/100 s on Linux).
pub fn process_cpu_seconds(pids: impl IntoIterator<Item = u32>) -> f64 {
    pids.into_iter()
        .map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            // The command name (field 2) may hold spaces; the rest follows its closing ')'.
            let rest = &stat[stat.rfind(')').unwrap() + 2..];
            let f: Vec<&str> = rest.split(' ').collect();
            let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
            ticks as f64 / 100.0
        })
        .sum()
}

/// Starts `n` workers whose config is `yaml(redis url, metrics port)`, each once ready.
pub fn start_workers(
    bin: &Path,
    dir: &TempDir,
    redis: &RedisServer,
    n: u64,
    yaml: &dyn Fn(&str, u16) -> String,
) -> Vec<Pacer> {
    start_workers_first_wrapped(bin, dir, redis, n, yaml, &[])
}

/// Like `start_workers`, the first worker run under `wrapper` (`faketime -f +5s`, say).
pub fn start_workers_first_wrapped(
    bin: &Path,
    dir: &TempDir,
    redis: &RedisServer,
    n: u64,
    yaml: &dyn Fn(&str, u16) -> String,
    wrapper: &[String],
) -> Vec<Pacer> {
    (0..n)
        .map(|i| {
            let port = free_port();
            let cfg = dir.write(&format!("w{i}.yaml"), &yaml(&redis.url(), port));
            let wrap = if i == 0 { wrapper } else { &[] };
            let p = Pacer::run_wrapped(wrap, bin, &cfg, &[("RUST_LOG", "warn")]);
            assert!(wait_until(Duration::from_secs(10), || matches!(
                http_get(port, "/readyz"),
                Some((200, _))
            )));
            p
        })
        .collect()
}

/// What one throughput run measured, per event.
pub struct Measured {
    pub events: u64,
    pub seconds: f64,
    /// Every command pacer caused, scripts' own included.
    pub commands: f64,
    /// Client round trips (EVALSHA, XREADGROUP, XACK, ...).
    pub trips: f64,
    pub redis_us: f64,
    pub worker_us: f64,
    /// `commandstats_line`.
    pub detail: String,
}

impl Measured {
    pub fn per_second(&self) -> f64 {
        self.events as f64 / self.seconds
    }
}

/// Creates the group on `in` (before the preload, which the first worker would otherwise skip)
/// and preloads `events` entries; then starts `workers` workers (config from `yaml`) and waits
/// until `done` says every event has come out. Worker start is included in the time.
pub fn measure(
    bin: &Path,
    workers: u64,
    events: u64,
    fields: impl Fn(u64) -> [(&'static str, String); 2],
    yaml: &dyn Fn(&str, u16) -> String,
    mut done: impl FnMut(&mut redis::Connection) -> bool,
) -> Measured {
    let redis = RedisServer::start();
    let mut con = redis.con();
    let _replicas = replicas_of(&redis, arg("--wait-replicas", 0));
    let dir = TempDir::new("bench");
    pacer::testkit::create_group(&mut con, "in", "pacer");
    preload(&mut con, events, fields);
    let cpu0 = cpu_seconds(&mut con);
    let start = Instant::now();
    let running = start_workers(bin, &dir, &redis, workers, yaml);
    assert!(wait_until(Duration::from_secs(600), || done(&mut con)));
    let seconds = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds(&mut con) - cpu0;
    let worker_cpu = process_cpu_seconds(running.iter().map(Pacer::pid));
    let calls = command_calls(&mut con);
    let (all, trips) = pacer_commands(&calls);
    let n = events as f64;
    Measured {
        events,
        seconds,
        commands: all as f64 / n,
        trips: trips as f64 / n,
        redis_us: cpu * 1e6 / n,
        worker_us: worker_cpu * 1e6 / n,
        detail: commandstats_line(&calls, events),
    }
}

/// `n` replicas of `redis` (for `--wait-replicas n`), once each has synced.
pub fn replicas_of(redis: &RedisServer, n: u64) -> Vec<RedisServer> {
    let port = redis.port.to_string();
    let replicas: Vec<RedisServer> = (0..n)
        .map(|_| RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]))
        .collect();
    for r in &replicas {
        let synced = wait_until(Duration::from_secs(20), || {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut r.con())
                .unwrap_or_default();
            info.contains("master_link_status:up")
        });
        assert!(synced, "a replica did not sync");
    }
    replicas
}

pub fn xlen(con: &mut redis::Connection, stream: &str) -> u64 {
    redis::cmd("XLEN").arg(stream).query(con).unwrap()
}

/// The outbound flow's throughput: `events` over `--routes` routes (10 unless told) whose rate
/// never binds, each dispatched to its ready stream at once.
pub fn outbound_throughput(bin: &Path, workers: u64, events: u64) -> Measured {
    let n = arg("--routes", 10);
    let routes: String = (0..n)
        .map(|r| format!("    r{r}: {{rate: 1000/ms, burst: 1000000}}\n"))
        .collect();
    measure(
        bin,
        workers,
        events,
        |i| [("route", format!("r{}", i % n)), ("to", i.to_string())],
        &|url, port| outbound_config(url, port, &routes, 256, 0),
        |con| {
            (0..n)
                .map(|r| xlen(con, &format!("pacer:{{r{r}}}:ready")))
                .sum::<u64>()
                >= events
        },
    )
}

/// A worker config with outbound `routes` (YAML lines under `routes:`) reading `in`, in batches
/// of `--batch`, else `batch`, on `--threads` runtime threads, else `threads` (0: one per core).
pub fn outbound_config(url: &str, port: u16, routes: &str, batch: u64, threads: u64) -> String {
    let batch = arg("--batch", batch);
    let wait = arg("--wait-replicas", 0);
    let threads = arg("--threads", threads);
    format!(
        "redis: {{url: \"{url}\", wait_replicas: {wait}}}\nmetrics: {{listen: \"127.0.0.1:{port}\"}}\nworker: {{batch: {batch}, max_inflight: 100000, threads: {threads}}}\noutbound:\n  streams: [\"in\"]\n  routes:\n{routes}"
    )
}

/// The middle value (the lower middle of an even count).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[(values.len() - 1) / 2]
}
