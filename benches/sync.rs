//! The synchronous admission API under load, with and without leasing, over HTTP and gRPC, and
//! redis-cell on the same redis-server as the anchor (`cargo bench --bench sync -- [--seconds
//! 5] [--conns 8] [--offered 2000] [--threads 1]`, `--threads` each worker's `worker.threads`,
//! 0 for one per core).
//!
//! Three pacer workers share one redis-server; each is driven by `--conns` keep-alive clients
//! (HTTP/1.1 connections, or tasks on one HTTP/2 gRPC channel) asking for 2 hot identities of a
//! gcra rule of 5000/s with burst 50, more than they may have (leased: `lease: true`, a ttl of
//! 10 ms and batches of up to 50, 1% of the limit). Printed per run: decisions/s per
//! worker, client-side p50/p99 latency and the p99 bucket of the workers' own decision
//! histogram (what the client sees beyond it is transport and waiting for a CPU), Redis CPU
//! per decision, the share of decisions that
//! reached Redis, and the most any identity was allowed in a rolling second (client clock)
//! against its bound (burst + rate x 1 s); the workers' own CPU per decision, and from it and
//! Redis's the decisions one core makes per second. First closed loop (each client sends when
//! answered: the most the machine decides), then open loop at `--offered` requests per second
//! per worker, the same with and without leasing (latency below saturation, where a closed loop
//! measures the queue it builds). Then fairness: one identity, three workers, the third
//! started 2 s late: its share of what was allowed in its first second. Then redis-cell's
//! `CL.THROTTLE` with the same clients and identities (its module is built from crates.io into
//! target/; a clear skip if that fails). Everything runs on this machine's 2 cores: the load
//! generator competes with the workers and Redis, as the README says.

mod common;

use common::{arg, cpu_seconds, pacer_bin};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor::Entry, RateLimitDescriptor,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use pacer::testkit::{free_port, http_get, metric, wait_until, Pacer, RedisServer, TempDir};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEYS: usize = 2;
const RATE: i64 = 5000;
const BURST: i64 = 50;

#[derive(Clone, Copy, PartialEq)]
enum Face {
    Http,
    Grpc,
}

/// One request's outcome: the worker it went to, its identity, when it was answered (µs from
/// the start), whether it was allowed, and its round trip (µs).
type Sample = (usize, usize, i64, bool, i64);

struct Workers {
    pacers: Vec<Pacer>,
    /// (metrics, http, grpc) ports.
    ports: Vec<(u16, u16, u16)>,
    _dir: TempDir,
}

fn start_workers(redis: &RedisServer, n: usize, rule: &str) -> Workers {
    let dir = TempDir::new("bench-sync");
    let mut pacers = Vec::new();
    let mut ports = Vec::new();
    // Three workers and the load generator on this machine's two cores: a thread each by
    // default, as three hosts' workers would have their own cores (`worker.threads`).
    let threads = arg("--threads", 1);
    for w in 0..n {
        let (m, h, g) = (free_port(), free_port(), free_port());
        let yaml = format!(
            "redis: {{url: \"{}\"}}\nmetrics: {{listen: 127.0.0.1:{m}}}\nworker: {{threads: {threads}}}\ninbound:\n  streams: [in]\n  forward_stream: fwd\n  api: {{listen: 127.0.0.1:{h}, grpc_listen: 127.0.0.1:{g}}}\n  rules:\n    - {rule}\n",
            redis.url()
        );
        let cfg = dir.write(&format!("w{w}.yaml"), &yaml);
        let p = Pacer::run(&pacer_bin(), &cfg, &[("RUST_LOG", "warn")]);
        let ready = wait_until(Duration::from_secs(10), || {
            matches!(http_get(m, "/readyz"), Some((200, _)))
        });
        assert!(ready, "worker {w} not ready in 10 s:\n{}", p.log_text());
        pacers.push(p);
        ports.push((m, h, g));
    }
    Workers {
        pacers,
        ports,
        _dir: dir,
    }
}

/// The load on one worker: `conns` clients asking for `keys` from `from` until `until`
/// (since `t0`).
struct Load {
    face: Face,
    worker: usize,
    port: u16,
    conns: usize,
    keys: Arc<Vec<String>>,
    t0: Instant,
    from: Duration,
    until: Duration,
    /// Open loop: the worker's requests per second, spread evenly over its clients; none:
    /// closed loop (each client sends its next request as soon as the last is answered).
    offered: Option<f64>,
}

async fn drive(load: Load) -> Vec<Sample> {
    let Load {
        face,
        worker,
        port,
        conns,
        keys,
        t0,
        from,
        until,
        offered,
    } = load;
    tokio::time::sleep(from.saturating_sub(t0.elapsed())).await;
    let mut tasks = Vec::new();
    let grpc = match face {
        Face::Grpc => Some(
            RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
                .await
                .expect("gRPC connects"),
        ),
        Face::Http => None,
    };
    for c in 0..conns {
        let keys = keys.clone();
        let mut grpc = grpc.clone();
        tasks.push(tokio::spawn(async move {
            let mut http = match face {
                Face::Http => {
                    let s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .unwrap();
                    s.set_nodelay(true).unwrap();
                    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
                        .await
                        .unwrap();
                    tokio::spawn(conn);
                    Some(sender)
                }
                Face::Grpc => None,
            };
            let mut out = Vec::new();
            let mut i = c;
            // Each client's share of the offered rate, its first send staggered by its place.
            let gap = offered.map(|r| Duration::from_secs_f64(conns as f64 / r));
            let mut next = Instant::now() + gap.unwrap_or_default() * c as u32 / conns as u32;
            while t0.elapsed() < until {
                i += 1;
                let k = i % keys.len();
                if let Some(gap) = gap {
                    tokio::time::sleep_until(next.into()).await;
                    next += gap;
                }
                let sent = Instant::now();
                let allowed = if let Some(sender) = http.as_mut() {
                    let body = format!("{{\"fields\": {{\"k\": \"{}\"}}}}", keys[k]);
                    let req = hyper::Request::post("/v1/admit")
                        .header("host", "bench")
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(body)))
                        .unwrap();
                    let resp = sender.send_request(req).await.unwrap();
                    let status = resp.status().as_u16();
                    let _ = resp.into_body().collect().await;
                    assert!(status == 200 || status == 429, "status {status}");
                    status == 200
                } else {
                    let client = grpc.as_mut().unwrap();
                    let r = client
                        .should_rate_limit(RateLimitRequest {
                            domain: "pacer".into(),
                            descriptors: vec![RateLimitDescriptor {
                                entries: vec![Entry {
                                    key: "k".into(),
                                    value: keys[k].clone(),
                                }],
                                ..Default::default()
                            }],
                            hits_addend: 0,
                        })
                        .await
                        .unwrap()
                        .into_inner();
                    r.overall_code == Code::Ok as i32
                };
                let rtt = sent.elapsed().as_micros() as i64;
                out.push((worker, k, t0.elapsed().as_micros() as i64, allowed, rtt));
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The most allowed samples of one identity in any rolling second.
fn most_in_a_second(samples: &[Sample]) -> usize {
    let mut best = 0;
    for k in 0..KEYS {
        let mut t: Vec<i64> = samples
            .iter()
            .filter(|s| s.1 == k && s.3)
            .map(|s| s.2)
            .collect();
        t.sort_unstable();
        let mut lo = 0;
        for hi in 0..t.len() {
            while t[hi] - t[lo] >= 1_000_000 {
                lo += 1;
            }
            best = best.max(hi - lo + 1);
        }
    }
    best
}

fn redis_calls(w: &Workers, face: Face) -> f64 {
    let api = if face == Face::Http { "http" } else { "grpc" };
    w.ports
        .iter()
        .map(|(m, _, _)| {
            let text = http_get(*m, "/metrics").map(|r| r.1).unwrap_or_default();
            metric(
                &text,
                &format!("pacer_api_redis_calls_total{{api=\"{api}\"}}"),
            )
        })
        .sum()
}

/// The workers' own view of the decisions' latency (`pacer_api_decision_seconds`, from the
/// request's arrival at pacer's handler to its answer, summed over the workers): the bucket
/// bound, in ms, that holds 99% of them. What the client measures beyond it is the transport
/// and the wait for a CPU.
fn server_p99_ms(w: &Workers, face: Face) -> Option<f64> {
    let api = if face == Face::Http { "http" } else { "grpc" };
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for (m, _, _) in &w.ports {
        let text = http_get(*m, "/metrics").map(|r| r.1).unwrap_or_default();
        // The benchmark's one rule: `{api="..",rule="per-key",le=".."}`.
        let labels = format!("{{api=\"{api}\",rule=\"per-key\",le=\"");
        for line in text.lines() {
            let Some(rest) = line
                .strip_prefix("pacer_api_decision_seconds_bucket")
                .and_then(|l| l.strip_prefix(labels.as_str()))
            else {
                continue;
            };
            let Some((le, count)) = rest.split_once("\"} ") else {
                continue;
            };
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let count: f64 = count.trim().parse().ok()?;
            match buckets.iter_mut().find(|b| b.0 == le) {
                Some(b) => b.1 += count,
                None => buckets.push((le, count)),
            }
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    buckets
        .iter()
        .find(|b| b.1 >= 0.99 * total)
        .map(|b| b.0 * 1000.0)
}

fn rule(leased: bool) -> String {
    let lease = if leased { ", lease: true" } else { "" };
    format!(
        "{{name: per-key, key: [k], algorithm: gcra, limits: [{RATE}/s], burst: {BURST}{lease}}}"
    )
}

/// What one run measured, for the side-by-side lines.
struct Run {
    /// Decisions per second per worker.
    per_worker: f64,
    /// Worker and Redis CPU µs per decision.
    worker_us: f64,
    redis_us: f64,
    p50: i64,
    p99: i64,
}

impl Run {
    /// Decisions one core could make per second: the worker's CPU per decision and its share
    /// of Redis's.
    fn per_core(&self) -> f64 {
        1e6 / (self.worker_us + self.redis_us)
    }
}

fn run(
    face: Face,
    leased: bool,
    seconds: u64,
    conns: usize,
    offered: Option<f64>,
    rt: &tokio::runtime::Runtime,
) -> Run {
    let redis = RedisServer::start();
    let mut con = redis.con();
    let w = start_workers(&redis, 3, &rule(leased));
    let pids: Vec<u32> = w.pacers.iter().map(|p| p.pid()).collect();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .unwrap();
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|k| format!("key{k}")).collect());
    let cpu0 = cpu_seconds(&mut con);
    let worker_cpu0 = common::process_cpu_seconds(pids.clone());
    let calls0 = redis_calls(&w, face);
    let t0 = Instant::now();
    let until = Duration::from_secs(seconds);
    let samples: Vec<Sample> = rt.block_on(async {
        let mut runs = Vec::new();
        for (i, &(_, h, g)) in w.ports.iter().enumerate() {
            let port = if face == Face::Http { h } else { g };
            runs.push(tokio::spawn(drive(Load {
                face,
                worker: i,
                port,
                conns,
                keys: keys.clone(),
                t0,
                from: Duration::ZERO,
                until,
                offered,
            })));
        }
        let mut all = Vec::new();
        for r in runs {
            all.extend(r.await.unwrap());
        }
        all
    });
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(&mut con) - cpu0;
    let worker_cpu = common::process_cpu_seconds(pids) - worker_cpu0;
    let calls = redis_calls(&w, face) - calls0;
    let server_p99 = server_p99_ms(&w, face).map_or("?".to_string(), |ms| format!("{ms}"));
    let commands =
        common::commandstats_line(&common::command_calls(&mut con), samples_len(&samples));
    let n = samples.len() as f64;
    let mut rtts: Vec<i64> = samples.iter().map(|s| s.4).collect();
    rtts.sort_unstable();
    let per_worker: Vec<String> = (0..3)
        .map(|i| {
            let k = samples.iter().filter(|s| s.0 == i).count() as f64 / secs;
            format!("{:.1}k", k / 1000.0)
        })
        .collect();
    let allowed = samples.iter().filter(|s| s.3).count();
    let most = most_in_a_second(&samples);
    let bound = BURST + RATE;
    let measured = Run {
        per_worker: n / secs / 3.0,
        worker_us: worker_cpu * 1e6 / n,
        redis_us: cpu * 1e6 / n,
        p50: percentile(&rtts, 0.5),
        p99: percentile(&rtts, 0.99),
    };
    let load = match offered {
        Some(r) => format!("offered {:.1}k/s per worker", r / 1000.0),
        None => "closed loop".to_string(),
    };
    println!(
        "{:<5} {:<9} {load}: decisions/s per worker {} (total {:.1}k); p50 {} us, p99 {} us (in the workers: p99 <= {} ms); CPU per decision: worker {:.2} us, Redis {:.2} us ({:.1}k decisions/s per core); reached Redis {:.1}%; allowed {:.1}%; most in a rolling second {} against {} ({:+.2}%)",
        if face == Face::Http { "http" } else { "grpc" },
        if leased { "leased" } else { "unleased" },
        per_worker.join(" / "),
        n / secs / 1000.0,
        measured.p50,
        measured.p99,
        server_p99,
        measured.worker_us,
        measured.redis_us,
        measured.per_core() / 1000.0,
        calls * 100.0 / n,
        allowed as f64 * 100.0 / n,
        most,
        bound,
        (most as f64 - bound as f64) * 100.0 / RATE as f64,
    );
    println!("      Redis commands (calls / µs per decision): {commands}");
    measured
}

fn samples_len(samples: &[Sample]) -> u64 {
    samples.len() as u64
}

/// One identity, three workers, the third started `late` after the others: its share of the
/// allowed decisions in its first second.
fn fairness(leased: bool, conns: usize, rt: &tokio::runtime::Runtime) {
    let redis = RedisServer::start();
    let w = start_workers(&redis, 3, &rule(leased));
    let keys = Arc::new(vec!["fair".to_string()]);
    let t0 = Instant::now();
    let late = Duration::from_secs(2);
    let until = Duration::from_secs(3);
    let samples: Vec<Sample> = rt.block_on(async {
        let mut runs = Vec::new();
        for (i, &(_, h, _)) in w.ports.iter().enumerate() {
            let from = if i == 2 { late } else { Duration::ZERO };
            runs.push(tokio::spawn(drive(Load {
                face: Face::Http,
                worker: i,
                port: h,
                conns,
                keys: keys.clone(),
                t0,
                from,
                until,
                offered: None,
            })));
        }
        let mut all = Vec::new();
        for r in runs {
            all.extend(r.await.unwrap());
        }
        all
    });
    let from = late.as_micros() as i64;
    let window: Vec<&Sample> = samples.iter().filter(|s| s.3 && s.2 >= from).collect();
    let mine = window.iter().filter(|s| s.0 == 2).count();
    println!(
        "fairness {:<9} the late worker's share of one identity in its first second: {:.1}% ({} of {}; a fair share is 33.3%)",
        if leased { "leased" } else { "unleased" },
        mine as f64 * 100.0 / window.len().max(1) as f64,
        mine,
        window.len()
    );
}

/// Builds redis-cell (crates.io, 0.2.2) into target/redis-cell; its module's path, or why not.
fn redis_cell() -> Result<PathBuf, String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/redis-cell");
    let so = dir.join("src/target/release/libredis_cell.so");
    if so.exists() {
        return Ok(so);
    }
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    // A throwaway package that depends on it, vendored: the module's own source, to build.
    std::fs::write(
        dir.join("Cargo.toml"),
        "[package]\nname = \"cell-fetch\"\nversion = \"0.0.0\"\nedition = \"2021\"\n[lib]\npath = \"lib.rs\"\n[dependencies]\nredis-cell = \"=0.2.2\"\n[workspace]\n",
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(dir.join("lib.rs"), "").map_err(|e| e.to_string())?;
    let ok = |c: &mut Command| c.status().map(|s| s.success()).unwrap_or(false);
    if !ok(Command::new("cargo")
        .args(["vendor", "-q", "vendor"])
        .current_dir(&dir))
    {
        return Err("cargo vendor redis-cell failed".into());
    }
    let _ = std::fs::remove_dir_all(dir.join("src"));
    let copied = Command::new("cp")
        .args(["-r", "vendor/redis-cell", "src"])
        .current_dir(&dir)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    // Its own workspace, so that cargo does not take pacer's for its root.
    let manifest = dir.join("src/Cargo.toml");
    let text = std::fs::read_to_string(&manifest).map_err(|e| e.to_string())?;
    std::fs::write(&manifest, format!("{text}\n[workspace]\n")).map_err(|e| e.to_string())?;
    if !copied
        || !ok(Command::new("cargo")
            .args(["build", "-q", "--release"])
            .env("RUSTFLAGS", "-Awarnings")
            .current_dir(dir.join("src")))
    {
        return Err("building redis-cell failed".into());
    }
    Ok(so)
}

fn anchor(conns: usize, seconds: u64, rt: &tokio::runtime::Runtime) {
    let so = match redis_cell() {
        Ok(so) => so,
        Err(why) => {
            println!("redis-cell: skipped ({why})");
            return;
        }
    };
    let redis = RedisServer::start_with(&["--loadmodule", so.to_str().unwrap()]);
    let mut con = redis.con();
    let client = redis.client();
    let cpu0 = cpu_seconds(&mut con);
    let t0 = Instant::now();
    let until = Duration::from_secs(seconds);
    let (n, mut rtts) = rt.block_on(async {
        let mux = client.get_multiplexed_async_connection().await.unwrap();
        let mut tasks = Vec::new();
        for c in 0..conns * 3 {
            let mut mux = mux.clone();
            tasks.push(tokio::spawn(async move {
                let mut rtts = Vec::new();
                let mut i = c;
                while t0.elapsed() < until {
                    i += 1;
                    let sent = Instant::now();
                    let _: Vec<i64> = redis::cmd("CL.THROTTLE")
                        .arg(format!("key{}", i % KEYS))
                        .arg(BURST - 1)
                        .arg(RATE)
                        .arg(1)
                        .query_async(&mut mux)
                        .await
                        .unwrap();
                    rtts.push(sent.elapsed().as_micros() as i64);
                }
                rtts
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        (all.len(), all)
    });
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(&mut con) - cpu0;
    rtts.sort_unstable();
    println!(
        "redis-cell CL.THROTTLE, {} clients on one multiplexed connection: {:.1}k calls/s; p50 {} us, p99 {} us; Redis CPU {:.2} us/call; every decision reaches Redis",
        conns * 3,
        n as f64 / secs / 1000.0,
        percentile(&rtts, 0.5),
        percentile(&rtts, 0.99),
        cpu * 1e6 / n as f64
    );
}

fn main() {
    let seconds = arg("--seconds", 5);
    let conns = arg("--conns", 8) as usize;
    // The open-loop runs' load: by default a third of what one worker decides unleased here.
    let offered = arg("--offered", 2000) as f64;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "sync admission: 3 workers, {conns} clients each, {KEYS} identities of gcra {RATE}/s burst {BURST}, {seconds} s per run"
    );
    for face in [Face::Http, Face::Grpc] {
        let unleased = run(face, false, seconds, conns, None, &rt);
        let leased = run(face, true, seconds, conns, None, &rt);
        println!(
            "      leased / unleased: {:.2}x decisions/s per worker, {:.2}x decisions per core",
            leased.per_worker / unleased.per_worker,
            leased.per_core() / unleased.per_core()
        );
    }
    // Latency where it is a latency and not a queue: the same offered load on every worker,
    // below what it decides unleased, each request sent on its schedule.
    for face in [Face::Http, Face::Grpc] {
        for leased in [false, true] {
            run(face, leased, seconds, conns, Some(offered), &rt);
        }
    }
    for leased in [false, true] {
        fairness(leased, conns, &rt);
    }
    anchor(conns, seconds, &rt);
}
