//! Scale-out: the same load on one plain redis-server and on a local Redis Cluster of
//! `--masters` masters, real pacer worker processes against both, to show how the work spreads.
//!
//! Per target, two runs, each with events preloaded on three input streams (on a cluster, one
//! on each of the first three masters) and then `--workers` workers started:
//!
//! 1. outbound: 30 routes whose rate does not bind, spread evenly over the masters by their
//!    tags, every event dispatched to its route's ready stream;
//! 2. inbound: one flow in `--partitions` partitions by `source` (`--sources` of them), a
//!    sliding-log rule that rejects about a third; each partition writes its own forward and
//!    rejected streams (`inbound.partitioned_outputs`), or with `--partitioned-outputs 0` all
//!    write the one forward and one rejected stream on the first master.
//!
//! Each prints events/s end to end (worker start included), the Redis CPU µs per event of each
//! master (`INFO cpu`, the spread as max/mean − 1) and in all, and the workers' CPU µs per
//! event. All processes share this machine's cores, so the cluster's events/s is bound by the
//! machine, not by any one Redis: the per-master CPU says how far each master is from its own
//! core's limit.
//!
//! `cargo bench --bench scale -- [--masters 3] [--workers 3] [--events 150000]
//! [--partitions 12] [--sources 3000] [--partitioned-outputs 1] [--batch 512]` (`--batch` is
//! `worker.batch`, entries read per stream per call; 512 is its default)

mod common;

use common::{arg, cpu_seconds, process_cpu_seconds, xlen};
use pacer::keys::InboundKeys;
use pacer::testkit::{
    create_group, free_port, http_get, wait_until, Cluster, Pacer, RedisServer, TempDir,
};
use std::time::{Duration, Instant};

/// Where a run goes: one plain redis-server, or a cluster.
enum Target {
    Single(RedisServer),
    Cluster(Cluster),
}

impl Target {
    fn label(&self) -> String {
        match self {
            Target::Single(_) => "1 node (standalone)".into(),
            Target::Cluster(c) => format!("cluster of {} masters", c.masters().len()),
        }
    }

    fn redis_yaml(&self) -> String {
        match self {
            Target::Single(r) => format!("{{url: \"{}\"}}", r.url()),
            Target::Cluster(c) => format!("{{url: \"{}\", mode: cluster}}", c.urls()),
        }
    }

    /// The server holding `key`.
    fn server_of(&self, key: &str) -> &RedisServer {
        match self {
            Target::Single(r) => r,
            Target::Cluster(c) => c.server_of(key),
        }
    }

    /// One server per master (the node itself when single).
    fn masters(&self) -> Vec<&RedisServer> {
        match self {
            Target::Single(r) => vec![r],
            Target::Cluster(c) => c
                .masters()
                .iter()
                .map(|&m| c.server_of(&c.name_on(m, "m")))
                .collect(),
        }
    }

    /// A name whose tag lands on master `i` (round robin), distinct per `prefix`.
    fn name(&self, i: usize, prefix: &str) -> String {
        match self {
            Target::Single(_) => format!("{prefix}{i}"),
            Target::Cluster(c) => {
                let masters = c.masters();
                c.name_on(masters[i % masters.len()], &format!("{prefix}{i}-"))
            }
        }
    }
}

/// What one run measured.
struct Run {
    per_second: f64,
    /// Redis CPU µs per event, per master.
    masters_us: Vec<f64>,
    worker_us: f64,
}

/// Preloads `events` on `inputs` (`fields(i)` each, round robin), starts the workers with
/// `body` (the config after `redis:`), and waits until the `outputs` streams hold every event.
fn run(
    target: &Target,
    inputs: &[String],
    events: u64,
    fields: impl Fn(u64) -> Vec<(String, String)>,
    body: &str,
    outputs: &[String],
) -> Run {
    let done = || -> u64 {
        outputs
            .iter()
            .map(|s| xlen(&mut target.server_of(s).con(), s))
            .sum()
    };
    let workers = arg("--workers", 3);
    for stream in inputs {
        let mut con = target.server_of(stream).con();
        create_group(&mut con, stream, "pacer");
    }
    let mut pipes: Vec<redis::Pipeline> = inputs.iter().map(|_| redis::pipe()).collect();
    for i in 0..events {
        let s = i as usize % inputs.len();
        let cmd = pipes[s].cmd("XADD").arg(&inputs[s]).arg("*");
        for (k, v) in fields(i) {
            cmd.arg(k).arg(v);
        }
        cmd.ignore();
        if pipes[s].len() == 1000 {
            let pipe = std::mem::replace(&mut pipes[s], redis::pipe());
            pipe.query::<()>(&mut target.server_of(&inputs[s]).con())
                .unwrap();
        }
    }
    for (pipe, stream) in pipes.iter().zip(inputs).filter(|(p, _)| !p.is_empty()) {
        pipe.query::<()>(&mut target.server_of(stream).con())
            .unwrap();
    }
    let masters = target.masters();
    let cpu0: Vec<f64> = masters.iter().map(|m| cpu_seconds(&mut m.con())).collect();
    let dir = TempDir::new("scale");
    let start = Instant::now();
    let batch = arg("--batch", 512);
    let running: Vec<Pacer> = (0..workers)
        .map(|i| {
            let port = free_port();
            let text = format!(
                "redis: {}\nmetrics: {{listen: \"127.0.0.1:{port}\"}}\nworker: {{batch: {batch}, max_inflight: 100000}}\n{body}",
                target.redis_yaml()
            );
            let cfg = dir.write(&format!("w{i}.yaml"), &text);
            let p = Pacer::run(&common::pacer_bin(), &cfg, &[("RUST_LOG", "warn")]);
            assert!(wait_until(Duration::from_secs(15), || matches!(
                http_get(port, "/readyz"),
                Some((200, _))
            )));
            p
        })
        .collect();
    let finished = wait_until(Duration::from_secs(600), || done() >= events);
    let seconds = start.elapsed().as_secs_f64();
    assert!(finished, "{} of {events} out after 600 s", done());
    let n = events as f64;
    Run {
        per_second: n / seconds,
        masters_us: masters
            .iter()
            .zip(cpu0)
            .map(|(m, c0)| (cpu_seconds(&mut m.con()) - c0) * 1e6 / n)
            .collect(),
        worker_us: process_cpu_seconds(running.iter().map(Pacer::pid)) * 1e6 / n,
    }
}

fn outbound(target: &Target, events: u64) -> Run {
    let routes: Vec<String> = (0..30).map(|r| target.name(r, "r")).collect();
    let inputs: Vec<String> = (0..3).map(|i| target.name(i, "out")).collect();
    let lines: String = routes
        .iter()
        .map(|r| format!("    {r}: {{rate: 1000/ms, burst: 1000000}}\n"))
        .collect();
    let body = format!(
        "outbound:\n  streams: [{}]\n  routes:\n{lines}",
        inputs.join(", ")
    );
    let ready: Vec<String> = routes
        .iter()
        .map(|r| format!("pacer:{{{r}}}:ready"))
        .collect();
    run(
        target,
        &inputs,
        events,
        |i| {
            vec![
                ("route".into(), routes[i as usize % 30].clone()),
                ("to".into(), i.to_string()),
            ]
        },
        &body,
        &ready,
    )
}

fn inbound(target: &Target, events: u64) -> Run {
    let partitions = arg("--partitions", 12);
    let sources = arg("--sources", 3000);
    let inputs: Vec<String> = (0..3).map(|i| target.name(i, "in")).collect();
    let forward = target.name(0, "acc");
    let rejected = format!("{{{forward}}}:rejected");
    let own_outputs = arg("--partitioned-outputs", 1) != 0;
    // Each source offers events / sources; the limit lets two thirds through.
    let limit = (events / sources * 2 / 3).max(1);
    let body = format!(
        "inbound:\n  streams: [{}]\n  forward_stream: \"{forward}\"\n  rejected_stream: \"{rejected}\"\n  partitions: {partitions}\n  partition_by: source\n  partitioned_outputs: {own_outputs}\n  rules:\n    - {{name: per-source, key: [source], algorithm: sliding_log, limits: [{limit}/h]}}\n",
        inputs.join(", ")
    );
    let keys: Vec<InboundKeys> = (0..partitions as usize)
        .map(|k| InboundKeys::partition(&forward, &rejected, k, partitions as usize, own_outputs))
        .collect();
    if let Target::Cluster(c) = target {
        let per_master = c.count_per_master(keys.iter().map(InboundKeys::slot_key));
        println!("  inbound partitions per master: {per_master:?}");
    }
    let mut outputs: Vec<String> = Vec::new();
    for k in &keys {
        for s in [&k.forward, &k.rejected] {
            if !outputs.contains(s) {
                outputs.push(s.clone());
            }
        }
    }
    run(
        target,
        &inputs,
        events,
        |i| {
            vec![
                ("source".into(), format!("s{}", i % sources)),
                ("call".into(), i.to_string()),
            ]
        },
        &body,
        &outputs,
    )
}

fn show(what: &str, events: u64, r: &Run) {
    let total: f64 = r.masters_us.iter().sum();
    let mean = total / r.masters_us.len() as f64;
    let max = r.masters_us.iter().cloned().fold(0.0, f64::max);
    let each: Vec<String> = r.masters_us.iter().map(|u| format!("{u:.2}")).collect();
    println!(
        "  {what:<9} {events} events: {:>7.0} events/s  Redis CPU µs/event per master [{}] (spread {:+.0}%), {total:.2} in all; workers {:.2} µs/event",
        r.per_second,
        each.join(", "),
        (max / mean - 1.0) * 100.0,
        r.worker_us
    );
}

fn main() {
    let events = arg("--events", 150_000);
    let masters = arg("--masters", 3) as usize;
    for target in [
        Target::Single(RedisServer::start()),
        Target::Cluster(Cluster::start(masters, 0)),
    ] {
        println!("{}:", target.label());
        show("outbound", events, &outbound(&target, events));
        show("inbound", events, &inbound(&target, events));
    }
}
