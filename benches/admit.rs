//! The inbound benchmark: real pacer worker processes against a real redis-server it starts
//! itself, once per algorithm and load, measured beside the outbound flow.
//!
//! For each run: events from `--sources` sources are preloaded on the inbound stream, then N
//! workers started; it prints decisions/s end to end (worker start included), Redis commands per
//! decision (every command, including those scripts run, from `INFO commandstats`), Redis CPU µs
//! per decision (`INFO cpu`) and the workers' CPU µs per decision (`/proc`). Two loads per
//! algorithm: limits that never bind (every event accepted and forwarded) and limits that reject
//! 40% (on this plain redis-server the admission call writes the rejections itself; on a cluster
//! whose rejected stream is in another slot they take a second call).
//!
//! The target is an inbound flow at least as fast as the outbound one, and a shared 2-core
//! machine moves single runs by ±20%: so each round runs the outbound throughput benchmark
//! (`benches/pace.rs`, same events and workers) beside the inbound runs, and the summary gives
//! the median of `--rounds` rounds of each, and each one's ratio to outbound.
//!
//! `cargo bench --bench admit -- [--workers 3] [--events 200000] [--sources 1000] [--rounds 3]`

mod common;

use common::{arg, measure, median, outbound_throughput, xlen, Measured};
use std::path::Path;

fn inbound(
    bin: &Path,
    workers: u64,
    events: u64,
    sources: u64,
    algorithm: &str,
    limit: &str,
) -> Measured {
    let rule =
        format!("{{name: per-source, key: [source], algorithm: {algorithm}, limits: [{limit}]}}");
    measure(
        bin,
        workers,
        events,
        |i| {
            [
                ("source", format!("s{}", i % sources)),
                ("call", i.to_string()),
            ]
        },
        &|url, port| {
            format!(
                "redis: {{url: \"{url}\"}}\nmetrics: {{listen: \"127.0.0.1:{port}\"}}\nworker: {{batch: 256, max_inflight: 100000}}\ninbound:\n  streams: [\"in\"]\n  forward_stream: \"fwd\"\n  rejected_stream: \"rej\"\n  rules:\n    - {rule}\n"
            )
        },
        |con| xlen(con, "fwd") + xlen(con, "rej") >= events,
    )
}

/// A benchmark's label, its inbound algorithm and limit (`None`: the outbound reference), and
/// what each round measured.
type Run<'a> = (String, Option<(&'a str, &'a String)>, Vec<Measured>);

fn show(label: &str, m: &Measured) {
    println!(
        "{label:<40} {:>7.0}/s  {:>5.2} commands  {:>6.3} round trips  {:>6.2} µs Redis CPU  {:>6.2} µs worker CPU  per event",
        m.per_second(),
        m.commands,
        m.trips,
        m.redis_us,
        m.worker_us,
    );
    println!("    commandstats: {}", m.detail);
}

fn main() {
    let bin = &common::pacer_bin();
    let workers = arg("--workers", 3);
    let events = arg("--events", 200_000);
    let sources = arg("--sources", 1000);
    let rounds = arg("--rounds", 3);
    let per_source = events / sources;
    // A per-minute limit that never binds (within what a sliding log may keep), and one that
    // rejects 40% of each source's events.
    let open = format!(
        "{}/min",
        (per_source * 10).min(pacer::config::SLIDING_LOG_MAX)
    );
    let tight = format!("{}/min", per_source * 6 / 10);
    let mut runs: Vec<Run> = vec![("outbound, 10 routes".into(), None, Vec::new())];
    for algorithm in ["sliding_log", "gcra", "fixed_window"] {
        for (load, limit) in [("never binds", &open), ("rejects 40%", &tight)] {
            let label = format!("{algorithm}, {load} ({limit})");
            runs.push((label, Some((algorithm, limit)), Vec::new()));
        }
    }
    println!("{workers} workers, {events} events (inbound: from {sources} sources), {rounds} rounds, worker start included");
    for round in 1..=rounds {
        println!("round {round}");
        for (label, inbound_run, measured) in runs.iter_mut() {
            let m = match inbound_run {
                None => outbound_throughput(bin, workers, events),
                Some((algorithm, limit)) => {
                    inbound(bin, workers, events, sources, algorithm, limit)
                }
            };
            show(label, &m);
            measured.push(m);
        }
    }
    let base = median(runs[0].2.iter().map(Measured::per_second).collect());
    println!("\nmedian of {rounds} rounds:");
    println!(
        "{:<40} {:>9} {:>12} {:>9} {:>13} {:>14}",
        "", "events/s", "vs outbound", "commands", "Redis CPU µs", "worker CPU µs"
    );
    for (label, _, measured) in &runs {
        let rate = median(measured.iter().map(Measured::per_second).collect());
        println!(
            "{label:<40} {rate:>9.0} {:>11.2}x {:>9.2} {:>13.2} {:>14.2}",
            rate / base,
            median(measured.iter().map(|m| m.commands).collect()),
            median(measured.iter().map(|m| m.redis_us).collect()),
            median(measured.iter().map(|m| m.worker_us).collect()),
        );
    }
}
