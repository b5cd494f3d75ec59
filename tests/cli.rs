//! The commands a user meets first, against a live pacer and a real redis-server: `inspect`
//! (table and JSON), `report --since`, `produce` refusing unknown routes, `--help`, the daemon's
//! log as text and as JSON, and the README's table of the fields pacer writes checked against
//! every kind of output.

mod common;

use common::*;
use pacer::report::OutputEntry;
use pacer::testkit::{
    command_calls, free_port, http_get, metric_at, wait_until, RedisServer, TempDir,
};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const WORKER: &str = "  batch: 32\n  drain: 1s\n  claim_idle: 30s\n  consumer: cli-worker";

fn pacer(config: &Path, args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .arg("--config")
        .arg(config)
        .env_remove("PACER_REDIS_URL")
        .env_remove("PACER_CONFIG")
        .output()
        .expect("running pacer")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn inspect_json(config: &Path) -> serde_json::Value {
    let out = pacer(config, &["inspect", "--json"]);
    let state: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("inspect --json prints JSON");
    // 0 when it read everything, 3 when it names what it could not.
    let in_part = state["problems"].as_array().is_some_and(|p| !p.is_empty());
    let code = if in_part { 3 } else { 0 };
    assert_eq!(out.status.code(), Some(code), "inspect: {out:?}");
    state
}

#[test]
fn inspect_shows_the_plan_the_backlog_and_the_consumers_of_a_live_pacer() {
    let redis = RedisServer::start();
    let dir = TempDir::new("inspect");
    let port = free_port();
    let body = r#"outbound:
  streams: ["in"]
  routes:
    slow: {rate: 5/s, burst: 1, max_wait: 20s}
"#;
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, body);

    // Before any worker: the stream is there, its group is not, and inspect says so.
    push(&redis, "in", &[event(&[("route", "slow")])]);
    let before = inspect_json(&cfg);
    assert_eq!(before["streams"][0]["group_exists"], false, "{before}");
    assert_eq!(before["routes"][0]["planned_ahead"], 0, "{before}");
    assert_eq!(before["routes"][0]["wait_ms"], 0, "{before}");
    let table = stdout(&pacer(&cfg, &["inspect"]));
    assert!(table.contains("no consumer group yet"), "{table}");

    let pacer_process = start(&cfg, port);
    let events: Vec<_> = (0..39).map(|_| event(&[("route", "slow")])).collect();
    push(&redis, "in", &events);
    // 40 events at 5/s: 8 s of slots. Once all are read, most sleep.
    assert!(wait_until(Duration::from_secs(10), || {
        let state = inspect_json(&cfg);
        state["streams"][0]["lag"] == 0 && state["streams"][0]["pending"].as_i64() > Some(20)
    }));
    let state = inspect_json(&cfg);
    let route = &state["routes"][0];
    assert_eq!(route["route"], "slow");
    assert_eq!(route["rate"], "5/s");
    assert_eq!(route["max_wait_ms"], 20_000);
    let ahead = route["planned_ahead"].as_i64().unwrap();
    let wait = route["wait_ms"].as_i64().unwrap();
    let stream = &state["streams"][0];
    let pending = stream["pending"].as_i64().unwrap();
    // What Redis says is planned matches what the group holds (each planned event is pending),
    // and a new event would wait behind all of it: 200 ms per slot.
    assert!(
        ahead > 20 && (ahead - pending).abs() <= 2,
        "planned {ahead}, pending {pending}: {state}"
    );
    assert!((wait - ahead * 200).abs() <= 400, "wait {wait}: {state}");
    assert_eq!(stream["length"], 40, "{state}");
    assert!(
        stream["oldest_pending_ms"].as_i64().unwrap() >= 0,
        "{state}"
    );
    let consumers = stream["consumers"].as_array().unwrap();
    let me = consumers
        .iter()
        .find(|c| c["name"] == "cli-worker")
        .unwrap_or_else(|| panic!("the worker among the consumers: {state}"));
    assert_eq!(me["pending"].as_i64(), Some(pending), "{state}");
    assert!(me["idle_ms"].as_i64().unwrap() < 5_000, "{state}");

    let table = stdout(&pacer(&cfg, &["inspect"]));
    eprintln!("{table}");
    for expected in ["slow", "5/s", "planned ahead", "in", "consumer cli-worker"] {
        assert!(table.contains(expected), "{expected:?} in:\n{table}");
    }
    // Its log went to a file, not a terminal: no colour codes in it.
    let log = pacer_process.log_text();
    assert!(log.contains("INFO"), "{log}");
    assert!(!log.contains('\u{1b}'), "ANSI codes in a log file:\n{log}");
}

/// `pacer_route_queue_seconds{route}` from a worker's /metrics.
fn queue_gauge(port: u16, route: &str) -> Option<f64> {
    gauge(port, "pacer_route_queue_seconds", "route", route)
}

/// The value of the series `name{label="value"}` on worker `port`'s /metrics.
fn gauge(port: u16, name: &str, label: &str, value: &str) -> Option<f64> {
    let (_, text) = http_get(port, "/metrics")?;
    let prefix = format!("{name}{{{label}=\"{value}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

/// `worker.threads` sets the runtime's worker threads, as tokio itself counts them; without it
/// the runtime takes its default (here from TOKIO_WORKER_THREADS, as on any machine). One
/// thread, set or by default, is a current-thread runtime (`runtime` in main.rs says why).
#[test]
fn worker_threads_sets_the_runtimes_threads() {
    let redis = RedisServer::start();
    let dir = TempDir::new("threads");
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    r: {rate: 10/s}\n";
    for (threads, env, expect, flavor) in [
        ("  threads: 1", None, 1, "current_thread"),
        ("  threads: 3", None, 3, "multi_thread"),
        ("  threads: 0", Some("2"), 2, "multi_thread"),
        ("  threads: 0", Some("1"), 1, "current_thread"),
    ] {
        let port = free_port();
        let worker = format!("{WORKER}\n{threads}");
        let cfg = config(
            &dir,
            &format!("t{expect}{flavor}.yaml"),
            &redis,
            port,
            &worker,
            body,
        );
        let env: Vec<(&str, &str)> = env
            .map(|n| ("TOKIO_WORKER_THREADS", n))
            .into_iter()
            .collect();
        let pacer = start_wrapped(&[], &env, &cfg, port);
        assert!(
            pacer
                .log_text()
                .contains(&format!("threads={expect} runtime={flavor} ")),
            "{threads} {env:?}: {}",
            pacer.log_text()
        );
    }
}

#[test]
fn the_queue_gauge_goes_back_to_zero_once_the_route_is_idle() {
    let redis = RedisServer::start();
    let dir = TempDir::new("gauge");
    let port = free_port();
    let body = r#"outbound:
  streams: ["in"]
  routes:
    slow: {rate: 10/s, burst: 1, max_wait: 5s}
"#;
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, body);
    let _pacer = start(&cfg, port);
    let events: Vec<_> = (0..20).map(|_| event(&[("route", "slow")])).collect();
    push(&redis, "in", &events);
    // 20 events at 10/s: the next free slot is up to 2 s ahead while they drain.
    assert!(
        wait_until(Duration::from_secs(2), || queue_gauge(port, "slow")
            .is_some_and(|q| q > 0.5)),
        "the gauge showed the queue: {:?}",
        queue_gauge(port, "slow")
    );
    let ready = "pacer:{slow}:ready";
    assert!(wait_until(Duration::from_secs(6), || read(&redis, ready)
        .len()
        == 20));
    // No event touches the route any more; the monitor still brings the gauge down.
    assert!(
        wait_until(Duration::from_secs(5), || queue_gauge(port, "slow")
            == Some(0.0)),
        "the gauge after the route went idle: {:?}",
        queue_gauge(port, "slow")
    );
}

/// The queue gauges of thousands of routes are read a few hundred routes to a round trip (one
/// round trip per route took a tick of 5,000 routes two seconds), and still say each route's
/// own queue: one whose plan runs ahead every tick (2 s) as it drains, an empty one every fifth
/// (until 2026-12-01 every worker read every route's bucket every tick, most of them empty).
#[test]
fn thousands_of_routes_queue_gauges_are_read_in_a_few_round_trips() {
    let redis = RedisServer::start();
    let dir = TempDir::new("gauges");
    let port = free_port();
    let routes = 3000;
    let mut body = String::from("outbound:\n  streams: [\"in\"]\n  routes:\n");
    for r in 0..routes {
        body.push_str(&format!("    r{r}: {{rate: 10/s}}\n"));
    }
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, &body);
    let _pacer = start(&cfg, port);
    // A plan 60 s ahead on the last route's bucket, as another worker's backlog would leave
    // it: this worker never placed on it, so it shows on a tick that reads every route.
    let mut con = redis.con();
    let (s, _): (i64, i64) = redis::cmd("TIME").query(&mut con).unwrap();
    let _: () = redis::cmd("HSET")
        .arg("pacer:{r2999}:bucket:r2999")
        .arg("tat")
        .arg((s + 60) * 1_000_000)
        .query(&mut con)
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(16), || queue_gauge(port, "r2999")
            .is_some_and(|q| q > 40.0)),
        "the gauge of r2999: {:?}",
        queue_gauge(port, "r2999")
    );
    assert_eq!(queue_gauge(port, "r0"), Some(0.0));
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut con)
        .unwrap();
    // It showed on a tick that read every route; the next such tick is five ticks (10 s and
    // their work) later, so the next 12 s hold exactly one, whatever the ticks' drift. Over
    // them r2999, running ahead, is read on each tick, so its gauge takes a new value each
    // time; read only with the rest, it would take at most one.
    let mut seen = Vec::new();
    let until = Instant::now() + Duration::from_secs(12);
    while Instant::now() < until {
        if let Some(q) = queue_gauge(port, "r2999") {
            if seen.last() != Some(&q) {
                seen.push(q);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(seen.len() >= 4, "r2999's gauge over six ticks: {seen:?}");
    let (time, hget, xlen) = (
        command_calls(&mut con, "time"),
        command_calls(&mut con, "hget"),
        command_calls(&mut con, "xlen"),
    );
    // Every bucket once, on the tick that reads every route, and r2999's on each of the
    // others: not every bucket every tick (18,000 HGETs).
    assert!(
        (routes..=routes + 8).contains(&hget),
        "{hget} HGETs of {routes} buckets in six ticks"
    );
    // In a few round trips, with one TIME each: 512 buckets to one.
    assert!(time <= 40, "{time} round trips for six ticks");
    // The output streams' lengths on that tick too (every fifth, 10 s): every ready stream,
    // the rejected and the dead-letter stream, once each.
    let outputs = routes + 2;
    assert_eq!(xlen, outputs, "XLENs of {outputs} streams in six ticks");
}

/// A ready stream whose readers fell behind is not trimmed past what they have not read, and
/// grows in Redis's memory: `pacer_output_length` says so beside `pacer_output_max_length`
/// (the `PacerOutputNotTrimmed` alert compares the two), `inspect` names the group that holds
/// it, and both fall back once the group catches up.
#[test]
fn an_output_stream_held_past_max_len_by_its_readers_shows_in_its_length_gauge() {
    let redis = RedisServer::start();
    let dir = TempDir::new("output-length");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  max_len: 100\n  routes:\n    fast: {rate: 1000/s, burst: 10}\n";
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, body);
    let ready = "pacer:{fast}:ready";
    // The senders' group, made before any event and never reading.
    let mut con = redis.con();
    let _: () = redis::cmd("XGROUP")
        .arg(&["CREATE", ready, "senders", "$", "MKSTREAM"])
        .query(&mut con)
        .unwrap();
    let _pacer = start(&cfg, port);
    let events: Vec<_> = (0..400).map(|_| event(&[("route", "fast")])).collect();
    push(&redis, "in", &events);
    push(&redis, "in", &[event(&[("route", "nowhere")])]);
    let gauge = |name: &str, stream: &str| gauge(port, name, "stream", stream);
    let max = "pacer_output_max_length";
    assert_eq!(gauge(max, ready), Some(100.0));
    assert_eq!(gauge(max, "pacer:dead"), Some(100.0));
    // The lengths are read every 10 s.
    assert!(
        wait_until(Duration::from_secs(25), || {
            gauge("pacer_output_length", ready) == Some(400.0)
                && gauge("pacer_output_length", "pacer:dead") == Some(1.0)
        }),
        "ready {:?} (XLEN {:?}), dead {:?}",
        gauge("pacer_output_length", ready),
        lengths(&redis, &[ready, "pacer:dead"]),
        gauge("pacer_output_length", "pacer:dead")
    );
    // `inspect` names the stream and the group that holds it.
    let state = inspect_json(&cfg);
    let held = &state["outputs_held"];
    assert_eq!(held.as_array().map(Vec::len), Some(1), "{state}");
    assert_eq!(held[0]["stream"], ready, "{state}");
    assert_eq!(held[0]["length"], 400, "{state}");
    assert_eq!(held[0]["max_len"], 100, "{state}");
    assert_eq!(
        held[0]["groups"],
        serde_json::json!([{"name": "senders", "pending": 0, "lag": 400}]),
        "{state}"
    );
    let table = stdout(&pacer(&cfg, &["inspect"]));
    let line = |start: &str| {
        table
            .lines()
            .find(|l| l.starts_with(start))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
    };
    assert_eq!(
        line("pacer:{fast}:ready").as_deref(),
        Some("pacer:{fast}:ready length 400 (max_len 100)"),
        "{table}"
    );
    assert_eq!(
        line("  group senders").as_deref(),
        Some("group senders pending 0 lag 400"),
        "{table}"
    );
    // The senders catch up: the next writes trim the stream, and the gauge follows.
    let read: redis::Value = redis::cmd("XREADGROUP")
        .arg(&[
            "GROUP", "senders", "s1", "COUNT", "1000", "STREAMS", ready, ">",
        ])
        .query(&mut con)
        .unwrap();
    let ids: Vec<String> = read_ids(read);
    assert_eq!(ids.len(), 400);
    let _: i64 = redis::cmd("XACK")
        .arg(ready)
        .arg("senders")
        .arg(&ids)
        .query(&mut con)
        .unwrap();
    let more: Vec<_> = (0..10).map(|_| event(&[("route", "fast")])).collect();
    push(&redis, "in", &more);
    assert!(
        wait_until(Duration::from_secs(25), || {
            let len = lengths(&redis, &[ready])[0];
            len < 400 && gauge("pacer_output_length", ready) == Some(len as f64)
        }),
        "ready {:?} (XLEN {:?})",
        gauge("pacer_output_length", ready),
        lengths(&redis, &[ready])
    );
    let state = inspect_json(&cfg);
    assert_eq!(state["outputs_held"], serde_json::json!([]), "{state}");
}

/// The entry ids of an XREADGROUP reply of one stream.
fn read_ids(reply: redis::Value) -> Vec<String> {
    let streams: Vec<(String, Vec<(String, redis::Value)>)> =
        redis::FromRedisValue::from_redis_value(reply).unwrap();
    streams
        .into_iter()
        .flat_map(|(_, entries)| entries.into_iter().map(|(id, _)| id))
        .collect()
}

/// `metrics.route_histograms: false` keeps the wait and lateness histograms for all routes
/// together (`route="all"`), and the per-route counters as they are.
#[test]
fn route_histograms_off_keeps_one_histogram_for_all_routes() {
    let redis = RedisServer::start();
    let dir = TempDir::new("histograms");
    let port = free_port();
    let text = format!(
        "redis:\n  url: {}\nmetrics:\n  listen: 127.0.0.1:{port}\n  route_histograms: false\nworker:\n{WORKER}\noutbound:\n  streams: [\"in\"]\n  routes:\n    a: {{rate: 1000/s}}\n    b: {{rate: 1000/s}}\n",
        redis.url()
    );
    let cfg = dir.write("c.yaml", &text);
    let _pacer = start(&cfg, port);
    let events: Vec<_> = (0..20)
        .map(|i| event(&[("route", if i % 2 == 0 { "a" } else { "b" })]))
        .collect();
    push(&redis, "in", &events);
    let lateness_all = "pacer_lateness_seconds_count{route=\"all\"}";
    assert!(
        wait_until(Duration::from_secs(5), || metric_at(port, lateness_all)
            == 20.0),
        "{}",
        http_get(port, "/metrics")
            .map(|(_, t)| t)
            .unwrap_or_default()
    );
    let text = http_get(port, "/metrics").unwrap().1;
    assert!(
        !text.contains("pacer_lateness_seconds_bucket{route=\"a\""),
        "{text}"
    );
    assert!(
        !text.contains("pacer_wait_seconds_bucket{route=\"b\""),
        "{text}"
    );
    for route in ["a", "b"] {
        let dispatched = format!(
            "pacer_events_total{{flow=\"outbound\",route=\"{route}\",outcome=\"dispatched\"}}"
        );
        assert_eq!(metric_at(port, &dispatched), 10.0, "{text}");
    }
}

#[test]
fn report_since_counts_only_what_was_written_within_it() {
    let redis = RedisServer::start();
    let dir = TempDir::new("since");
    let port = free_port();
    let body = r#"outbound:
  streams: ["in"]
  routes:
    fast: {rate: 1000/s, burst: 10}
"#;
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, body);
    let _pacer = start(&cfg, port);
    let ready = "pacer:{fast}:ready";
    let batch = |n: usize| -> Vec<_> { (0..n).map(|_| event(&[("route", "fast")])).collect() };
    push(&redis, "in", &batch(30));
    assert!(wait_until(Duration::from_secs(10), || read(&redis, ready)
        .len()
        == 30));
    std::thread::sleep(Duration::from_millis(2500));
    push(&redis, "in", &batch(7));
    assert!(wait_until(Duration::from_secs(10), || read(&redis, ready)
        .len()
        == 37));

    let all = stdout(&pacer(&cfg, &["report"]));
    let recent = stdout(&pacer(&cfg, &["report", "--since", "1500ms"]));
    let dispatched = |report: &str| -> i64 {
        let row = report
            .lines()
            .find(|l| l.starts_with("fast "))
            .unwrap_or_else(|| panic!("a row for fast in:\n{report}"));
        row.split_whitespace().nth(3).unwrap().parse().unwrap()
    };
    assert_eq!(dispatched(&all), 37, "{all}");
    assert_eq!(dispatched(&recent), 7, "{recent}");
    assert!(
        all.starts_with("every entry the output streams hold"),
        "{all}"
    );
    assert!(
        recent.starts_with("entries written in the last 1s 500ms"),
        "{recent}"
    );
}

/// An inbound-only config: `report` counts its flow (forwarded, rejected by rule, dead letters
/// by reason) and reads none of the outbound defaults' streams. It printed the outbound
/// defaults' dead letters (another config's) and nothing of its own (found by review).
#[test]
fn report_counts_the_inbound_flow_and_only_configured_streams() {
    let redis = RedisServer::start();
    let dir = TempDir::new("report-in");
    let port = free_port();
    let body = "inbound:\n  streams: [\"pacer:in\"]\n  forward_stream: \"pacer:accepted\"\n  rejected_stream: \"pacer:in-rejected\"\n  dead_letter_stream: \"in:dead\"\n  rules:\n    - {name: per-source, key: [source], limits: [1/min]}\n";
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, body);
    let _pacer = start(&cfg, port);
    // Another flow's dead letter on the outbound default: not this config's.
    push(
        &redis,
        "pacer:dead",
        &[event(&[("pacer_reason", "unknown_route")])],
    );
    let events = [
        event(&[("source", "a"), ("n", "1")]),
        event(&[("source", "a"), ("n", "2")]),
        event(&[("n", "3")]),
    ];
    push(&redis, "pacer:in", &events);
    assert!(wait_until(Duration::from_secs(10), || lengths(
        &redis,
        &["pacer:accepted", "pacer:in-rejected", "in:dead"]
    ) == [1, 1, 1]));
    let out = pacer(&cfg, &["report"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains(
            "inbound: forwarded 1, rejected 1 (by rule: per-source=1), dead letters: missing_key=1"
        ),
        "{text}"
    );
    assert!(!text.contains("unknown_route"), "{text}");
}

/// `report` reads streams of large entries in pages that stay within `worker.read_bytes`: it
/// asked for 10,000 entries a page, which at 1 MiB events is a 10 GiB reply, built whole in
/// Redis's output buffer. Here Redis closes a normal client's connection past 8 MiB of output
/// (as a production Redis may be set to), and 10 MiB of rejected entries, 24 MiB of ready
/// entries and 12 MiB of dead letters are reported whole, pages of 4 MiB each.
#[test]
fn report_reads_streams_of_large_entries_in_pages_within_read_bytes() {
    let redis = RedisServer::start_with(&["--client-output-buffer-limit", "normal 8mb 8mb 0"]);
    let dir = TempDir::new("report-large");
    let port = free_port();
    let worker = format!("{WORKER}\n  read_bytes: {}", 4 << 20);
    let body = "outbound:\n  streams: [\"in\"]\n  max_event_bytes: 1048576\n  routes:\n    fast: {rate: 1000/s, burst: 10}\n";
    let cfg = config(&dir, "c.yaml", &redis, port, &worker, body);
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut redis.con()).unwrap();
    let slot = (s * 1_000_000 + us).to_string();
    let large = |pairs: &[(&str, &str)], bytes: usize| {
        let mut e = event(pairs);
        e.push(("body".to_string(), vec![b'x'; bytes]));
        e
    };
    let mut ready = Vec::new();
    for i in 0..24 {
        let id = format!("1-{i}");
        let head = [
            ("pacer_route", "fast"),
            ("pacer_source_stream", "in"),
            ("pacer_source_id", id.as_str()),
            ("pacer_slot_us", slot.as_str()),
            ("pacer_wait_ms", "0"),
            ("route", "fast"),
        ];
        ready.push(large(&head, 1_000_000));
    }
    push(&redis, "pacer:{fast}:ready", &ready);
    let rejected = [("pacer_route", "fast"), ("pacer_reason", "too_long")];
    push(
        &redis,
        "pacer:rejected",
        &vec![large(&rejected, 1_000_000); 10],
    );
    let dead = [("pacer_reason", "malformed")];
    push(&redis, "pacer:dead", &vec![large(&dead, 60_000); 200]);

    let out = pacer(&cfg, &["report"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{out:?}");
    let row: Vec<&str> = text
        .lines()
        .find(|l| l.starts_with("fast "))
        .unwrap_or_else(|| panic!("a row for fast in:\n{text}"))
        .split_whitespace()
        .collect();
    // route, rate, burst, dispatched, rerouted, rejected.
    assert_eq!(row[3..6], ["24", "0", "10"], "{text}");
    assert!(text.contains("dead letters: malformed=200"), "{text}");
}

/// Keys written by something else: `inspect` and `report` show what they can read and name
/// each key they cannot, instead of failing on the first (they printed only Redis's WRONGTYPE,
/// three times over).
#[test]
fn inspect_and_report_name_the_keys_they_cannot_read_and_show_the_rest() {
    let redis = RedisServer::start();
    let dir = TempDir::new("unreadable");
    let body =
        "outbound:\n  streams: [in, other]\n  routes:\n    a: {rate: 10/s}\n    b: {rate: 10/s}\n";
    let cfg = config(&dir, "c.yaml", &redis, free_port(), WORKER, body);
    let mut con = redis.con();
    for (key, value) in [
        ("in", "x"),
        ("pacer:{a}:bucket:a", "x"),
        ("pacer:rejected", "x"),
        ("pacer:dead", "x"),
    ] {
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query(&mut con)
            .unwrap();
    }
    let _: () = redis::cmd("HSET")
        .arg("pacer:{b}:bucket:b")
        .arg("tat")
        .arg("soon")
        .query(&mut con)
        .unwrap();
    push(&redis, "other", &[event(&[("route", "b")])]);
    push(&redis, "pacer:{b}:ready", &[event(&[("route", "b")])]);

    let state = inspect_json(&cfg);
    let names = |list: &serde_json::Value, field: &str| -> Vec<String> {
        let rows = list.as_array().unwrap();
        rows.iter()
            .map(|r| r[field].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(&state["routes"], "route"), ["b"], "{state}");
    assert_eq!(names(&state["streams"], "stream"), ["other"], "{state}");
    assert_eq!(state["streams"][0]["length"], 1, "{state}");
    let problems: Vec<&str> = state["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert_eq!(
        problems,
        [
            "pacer:{a}:bucket:a holds another kind of value than the hash pacer keeps there: left out (delete or fix the key)",
            "pacer:{b}:bucket:b holds tat = \"soon\", not a number: the scripts take it as 0",
            "in holds another kind of value than the stream pacer keeps there: left out (delete or fix the key)",
            // The outputs, read for their lengths (held past max_len or not).
            "pacer:dead holds another kind of value than the stream pacer keeps there: left out (delete or fix the key)",
            "pacer:rejected holds another kind of value than the stream pacer keeps there: left out (delete or fix the key)",
        ]
    );
    // Shown in part: exit 3, not 0 (a script can tell), nor 1 (nothing failed).
    let table = pacer(&cfg, &["inspect"]);
    assert_eq!(table.status.code(), Some(3), "{table:?}");
    assert!(
        stdout(&table).contains("cannot read: in holds another kind of value"),
        "{}",
        stdout(&table)
    );

    let out = pacer(&cfg, &["report"]);
    let report = stdout(&out);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        report
            .lines()
            .any(|l| l.starts_with("b ") && l.split_whitespace().nth(3) == Some("1")),
        "{report}"
    );
    assert!(
        report.contains("cannot read: pacer:rejected holds another kind of value than the stream"),
        "{report}"
    );
    // Unknown, not none (it said "dead letters: none" of a stream it could not read).
    assert!(
        report.contains("dead letters: unknown") && report.contains("cannot read: pacer:dead"),
        "{report}"
    );
}

#[test]
fn produce_refuses_an_unknown_route_and_help_names_the_environment() {
    let redis = RedisServer::start();
    let dir = TempDir::new("produce");
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    a: {rate: 10/s}\n";
    let cfg = config(&dir, "c.yaml", &redis, free_port(), WORKER, body);
    let out = pacer(&cfg, &["produce", "--routes", "a,nosuch"]);
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no such route in the config: nosuch"), "{err}");
    assert_eq!(read(&redis, "in").len(), 0, "nothing pushed");

    let ok = pacer(&cfg, &["produce", "--routes", "a", "--count", "3"]);
    assert!(ok.status.success(), "{ok:?}");
    assert_eq!(read(&redis, "in").len(), 3);
    // Names as a shell list writes them ('a, a'), and a PACER_METRICS_LISTEN that is run's
    // business, not produce's: both were refused.
    let spaced = Command::new(bin())
        .args(["produce", "--routes", "a, a", "--count", "2", "--config"])
        .arg(&cfg)
        .env_remove("PACER_REDIS_URL")
        .env_remove("PACER_CONFIG")
        .env("PACER_METRICS_LISTEN", "not an address")
        .output()
        .unwrap();
    assert!(spaced.status.success(), "{spaced:?}");
    assert_eq!(read(&redis, "in").len(), 5);
    // An input stream's key of another kind: one line naming it (it printed every command's
    // failure of the pipeline).
    let _: () = redis::cmd("SET")
        .arg("taken")
        .arg("x")
        .query(&mut redis.con())
        .unwrap();
    let taken = config(
        &dir,
        "t.yaml",
        &redis,
        free_port(),
        WORKER,
        "outbound:\n  streams: [\"taken\"]\n  routes:\n    a: {rate: 10/s}\n",
    );
    let out = pacer(&taken, &["produce", "--count", "3"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("taken holds another kind of value") && err.lines().count() == 1,
        "{err}"
    );

    let help = Command::new(bin()).arg("--help").output().unwrap();
    let help = stdout(&help);
    for var in [
        "PACER_CONFIG",
        "PACER_REDIS_URL",
        "PACER_REDIS_MODE",
        "PACER_REDIS_PASSWORD",
        "PACER_REDIS_SENTINEL_PASSWORD",
        "PACER_METRICS_LISTEN",
        "PACER_LOG_FORMAT",
        "RUST_LOG",
    ] {
        assert!(help.contains(var), "{var} in --help:\n{help}");
    }
    let produce_help = stdout(
        &Command::new(bin())
            .args(["produce", "--help"])
            .output()
            .unwrap(),
    );
    assert!(
        produce_help.contains("How many events to push"),
        "{produce_help}"
    );
}

/// The README's table of what pacer writes: per output, the fields always written and those
/// written only when they apply.
fn documented_fields() -> BTreeMap<String, (BTreeSet<String>, BTreeSet<String>)> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let table = readme
        .split("<!-- output-fields")
        .nth(1)
        .expect("the output-fields table in the README");
    let names = |cell: &str| -> BTreeSet<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .filter(|n| n.starts_with("pacer_"))
            .map(str::to_string)
            .collect()
    };
    let mut rows = BTreeMap::new();
    for line in table.lines().skip(1) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || cells[1] == "Output" || cells[1].starts_with("---") {
            continue;
        }
        rows.insert(cells[1].to_string(), (names(cells[2]), names(cells[3])));
    }
    rows
}

fn pacer_fields(e: &OutputEntry) -> BTreeSet<String> {
    e.fields
        .iter()
        .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
        .filter(|k| k.starts_with("pacer_"))
        .collect()
}

#[test]
fn every_output_carries_the_fields_the_readme_lists() {
    let documented = documented_fields();
    assert_eq!(documented.len(), 5, "{documented:?}");
    let redis = RedisServer::start();
    let dir = TempDir::new("fields");
    let port = free_port();
    let body = format!(
        r#"outbound:
  streams: ["in"]
  routes:
    fast: {{rate: 1000/s, burst: 10}}
    slow: {{rate: 1/s, burst: 1, max_wait: 1s, fallbacks: [fast]}}
    lone: {{rate: 1/s, burst: 1, max_wait: 1s}}
{}"#,
        inbound_body("{name: per-source, key: [source], algorithm: sliding_log, limits: [2/s]}")
    );
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, &body);
    let _pacer = start(&cfg, port);

    let mut outbound = vec![
        event(&[("route", "fast"), ("pacer_reason", "forged")]),
        event(&[("to", "no route")]),
        event(&[("route", "ghost")]),
    ];
    // slow takes one and reroutes the rest to fast; lone takes one and rejects the rest.
    outbound.extend((0..4).map(|_| event(&[("route", "slow")])));
    outbound.extend((0..4).map(|_| event(&[("route", "lone")])));
    // A wide event: its dead letter is cut and says so.
    let wide: Vec<(String, Vec<u8>)> = (0..400)
        .map(|i| (format!("f{i}"), b"v".to_vec()))
        .chain([("route".to_string(), b"ghost".to_vec())])
        .collect();
    outbound.push(wide);
    push(&redis, "in", &outbound);
    let mut inbound: Vec<_> = (0..5).map(|_| event(&[("source", "s1")])).collect();
    inbound.push(event(&[("other", "no key")]));
    push(&redis, "pacer:in", &inbound);

    let kinds = [
        (
            "ready stream (outbound)",
            vec![
                "pacer:{fast}:ready",
                "pacer:{slow}:ready",
                "pacer:{lone}:ready",
            ],
        ),
        ("rejected (outbound)", vec!["pacer:rejected"]),
        ("forward (inbound)", vec!["pacer:accepted"]),
        ("rejected (inbound)", vec!["pacer:in-rejected"]),
        ("dead letter (both flows)", vec!["pacer:dead"]),
    ];
    let total = |streams: &[&str]| streams.iter().map(|s| read(&redis, s).len()).sum::<usize>();
    let all: Vec<&str> = kinds.iter().flat_map(|(_, s)| s.iter().copied()).collect();
    assert!(
        wait_until(Duration::from_secs(15), || total(&all)
            == outbound.len() + inbound.len()),
        "every entry ended: {} of {}",
        total(&all),
        outbound.len() + inbound.len()
    );
    let mut optional_seen = BTreeSet::new();
    for (kind, streams) in &kinds {
        let (always, optional) = &documented[*kind];
        let entries: Vec<OutputEntry> = streams.iter().flat_map(|s| read(&redis, s)).collect();
        assert!(!entries.is_empty(), "no {kind} entry was written");
        for e in &entries {
            let have = pacer_fields(e);
            let missing: Vec<_> = always.difference(&have).collect();
            let undocumented: Vec<_> = have
                .iter()
                .filter(|f| !always.contains(*f) && !optional.contains(*f))
                .collect();
            assert!(
                missing.is_empty() && undocumented.is_empty(),
                "{kind} entry {}: missing {missing:?}, not in the README {undocumented:?}",
                e.id
            );
            optional_seen.extend(have.intersection(optional).cloned());
        }
        // No field is written twice (a producer's own pacer_reason is not carried).
        for e in &entries {
            let names: Vec<_> = e.fields.iter().map(|(k, _)| k.clone()).collect();
            let unique: BTreeSet<_> = names.iter().collect();
            assert_eq!(
                names.len(),
                unique.len(),
                "{kind} entry {} repeats a field",
                e.id
            );
        }
    }
    // The optional fields this run can produce were seen: the cut dead letter, and the rule of an
    // inbound rejection.
    for field in ["pacer_truncated", "pacer_rule", "pacer_limit", "pacer_key"] {
        assert!(optional_seen.contains(field), "{field} was never written");
    }
}

/// stderr closed under pacer (its log piped to `head`, a log shipper gone): the lines are lost,
/// the work and SIGTERM are not. A failed log write used to panic (tracing-subscriber reports
/// it with eprintln!): exit 101 at the first line, or a signal task dead before it cancelled.
#[test]
fn a_closed_stderr_costs_neither_the_work_nor_sigterm() {
    let mut redis = RedisServer::start();
    let dir = TempDir::new("closed-stderr");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    r: {rate: 1000/s, burst: 100}\n";
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, body);
    let mut child = Command::new(bin())
        .args(["run", "--config"])
        .arg(&cfg)
        .env_remove("PACER_REDIS_URL")
        .env_remove("PACER_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running pacer");
    // Nobody reads its stderr any more: every log line now fails with EPIPE.
    drop(child.stderr.take());
    assert!(
        wait_until(Duration::from_secs(15), || matches!(
            http_get(port, "/readyz"),
            Some((200, _))
        )),
        "not ready: {:?}",
        child.try_wait()
    );
    let events: Vec<_> = (0..20)
        .map(|i| event(&[("route", "r"), ("n", &i.to_string())]))
        .collect();
    push(&redis, "in", &events);
    assert!(wait_until(Duration::from_secs(10), || lengths(
        &redis,
        &["pacer:{r}:ready"]
    ) == [20]));
    // Redis gone: warnings to write, into the closed pipe.
    redis.kill();
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        child.try_wait().unwrap().is_none(),
        "pacer exited: {:?}",
        child.try_wait()
    );
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut status = None;
    while std::time::Instant::now() < deadline && status.is_none() {
        status = child.try_wait().unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    if status.is_none() {
        let _ = child.kill();
    }
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "SIGTERM drains and exits 0"
    );
}

/// Ctrl-C (SIGINT) is a shutdown like SIGTERM: the worker drains (what falls due within
/// `drain` goes out), exits 0 and leaves the events still asleep pending for another worker.
#[test]
fn sigint_drains_exits_0_and_leaves_the_sleeping_events_pending() {
    let redis = RedisServer::start();
    let dir = TempDir::new("sigint");
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    slow: {rate: 5/s, burst: 1, max_wait: 10s}\n";
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, body);
    let mut pacer = start(&cfg, port);
    let n = 20;
    let events: Vec<_> = (0..n)
        .map(|i| event(&[("route", "slow"), ("i", &i.to_string())]))
        .collect();
    push(&redis, "in", &events);
    // Every entry read (asleep, pending) and one out: a signal before the reader's second read
    // left 5 never read, neither out nor pending (one fresh-clone run).
    assert!(wait_until(Duration::from_secs(10), || unread(
        &redis, "in", "pacer"
    ) == 0
        && !read(&redis, "pacer:{slow}:ready").is_empty()));
    pacer.signal("INT");
    assert_eq!(
        pacer.wait_for(Duration::from_secs(10)),
        Some(0),
        "exit code; log:\n{}",
        pacer.log_text()
    );
    let log = pacer.log_text();
    assert!(log.contains("SIGINT: draining"), "{log}");
    // 20 at 5/s take 4 s: a drain of 1 s leaves about half asleep, pending, not dispatched.
    let ready = read(&redis, "pacer:{slow}:ready").len();
    assert!(
        ready < n,
        "all {ready} dispatched: the drain did not stop it"
    );
    assert_eq!(pending(&redis, "in", "pacer") as usize, n - ready);
}

/// What a daemon run wrote: its stderr and its stdout, and how it exited.
struct DaemonRun {
    stderr: String,
    stdout: String,
    code: Option<i32>,
}

/// Runs `pacer <before_run…> run --config …` on a fresh Redis with `env` (RUST_LOG=info and no
/// ambient PACER_* variable unless given) and its stdout and stderr in files of their own: a
/// route `fine` that dispatches and a route `broken` whose bucket another program overwrote (its
/// event is dead-lettered as route_broken, said in a WARN line). Once the three events for
/// `fine` are dispatched and the one for `broken` dead-lettered, SIGTERM, and the exit is
/// waited for (bounded).
fn run_daemon_to_sigterm(label: &str, before_run: &[&str], env: &[(&str, &str)]) -> DaemonRun {
    let redis = RedisServer::start();
    let _: () = redis::cmd("SET")
        .arg("pacer:{broken}:bucket:broken")
        .arg("written by something else")
        .query(&mut redis.con())
        .unwrap();
    let dir = TempDir::new(label);
    let port = free_port();
    let body = "outbound:\n  streams: [\"in\"]\n  routes:\n    fine: {rate: 1000/s, burst: 10}\n    broken: {rate: 1000/s, burst: 10}\n";
    let cfg = config(&dir, "c.yaml", &redis, port, WORKER, body);
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut cmd = Command::new(bin());
    cmd.args(before_run).arg("run").arg("--config").arg(&cfg);
    for var in [
        "PACER_REDIS_URL",
        "PACER_CONFIG",
        "PACER_LOG_FORMAT",
        "PACER_METRICS_LISTEN",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("RUST_LOG", "info");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("running pacer");
    let stderr = || std::fs::read_to_string(&err_path).unwrap_or_default();
    let ready = wait_until(Duration::from_secs(15), || {
        matches!(http_get(port, "/readyz"), Some((200, _)))
    });
    if !ready {
        let _ = child.kill();
        let _ = child.wait();
        panic!("pacer did not become ready:\n{}", stderr());
    }
    let mut events: Vec<_> = (0..3)
        .map(|i| event(&[("route", "fine"), ("n", &i.to_string())]))
        .collect();
    events.push(event(&[("route", "broken")]));
    push(&redis, "in", &events);
    let done = wait_until(Duration::from_secs(10), || {
        lengths(&redis, &["pacer:{fine}:ready", "pacer:dead"]) == [3, 1]
    });
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut status = None;
    while std::time::Instant::now() < deadline && status.is_none() {
        status = child.try_wait().unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    if status.is_none() {
        let _ = child.kill();
    }
    // Reaped already when it exited; else after the kill.
    let _ = child.wait();
    assert!(
        done,
        "the events did not end: {:?}\n{}",
        lengths(&redis, &["pacer:{fine}:ready", "pacer:dead"]),
        stderr()
    );
    DaemonRun {
        stderr: stderr(),
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        code: status.and_then(|s| s.code()),
    }
}

/// The message route_broken's dead-lettering says once, at WARN.
const BROKEN_ROUTE_WARNING: &str = "a route's key holds the wrong kind of value: its events are dead-lettered as route_broken until it is fixed";

/// `--log-format json` and `PACER_LOG_FORMAT=json` (README, "Running it"): every line the
/// daemon writes to stderr, from its start through work and a warning to SIGTERM's drain, is
/// one JSON object in tracing-subscriber's shape (`timestamp`, `level`, `target`, and `fields`
/// holding `message`), and a line's structured fields are JSON fields of their own, numbers as
/// numbers, not text squashed into the message. Nothing is written to stdout.
#[test]
fn json_log_format_writes_every_stderr_line_as_a_json_object_with_its_fields() {
    for (label, before_run, env) in [
        ("log-json-flag", &["--log-format", "json"][..], &[][..]),
        ("log-json-env", &[][..], &[("PACER_LOG_FORMAT", "json")][..]),
    ] {
        let run = run_daemon_to_sigterm(label, before_run, env);
        assert_eq!(
            run.code,
            Some(0),
            "{label}: SIGTERM exits 0\n{}",
            run.stderr
        );
        assert_eq!(run.stdout, "", "{label}: the daemon's stdout");
        let lines: Vec<serde_json::Map<String, serde_json::Value>> = run
            .stderr
            .lines()
            .map(|line| match serde_json::from_str(line) {
                Ok(serde_json::Value::Object(o)) => o,
                other => panic!(
                    "{label}: a stderr line that is not a JSON object ({other:?}): {line:?}\n{}",
                    run.stderr
                ),
            })
            .collect();
        assert!(lines.len() >= 4, "{label}: {}", run.stderr);
        for l in &lines {
            let level = l.get("level").and_then(|v| v.as_str());
            assert!(
                matches!(level, Some("TRACE" | "DEBUG" | "INFO" | "WARN" | "ERROR")),
                "{label}: level of {l:?}"
            );
            assert!(
                l.get("timestamp").is_some_and(|v| v.is_string()),
                "{label}: {l:?}"
            );
            assert!(
                l.get("target").is_some_and(|v| v.is_string()),
                "{label}: {l:?}"
            );
            assert!(
                l.get("fields")
                    .and_then(|f| f.get("message"))
                    .is_some_and(|m| m.is_string()),
                "{label}: no fields.message in {l:?}"
            );
        }
        let message = |l: &serde_json::Map<String, serde_json::Value>| -> String {
            l["fields"]["message"].as_str().unwrap().to_string()
        };
        let find = |text: &str| {
            lines
                .iter()
                .find(|l| message(l) == text)
                .unwrap_or_else(|| panic!("{label}: no line {text:?} in\n{}", run.stderr))
        };
        // The route_broken warning: its route and error are fields beside the message.
        let warning = find(BROKEN_ROUTE_WARNING);
        assert_eq!(warning["level"], "WARN", "{label}: {warning:?}");
        let fields = warning["fields"].as_object().unwrap();
        assert_eq!(
            fields.get("route"),
            Some(&"broken".into()),
            "{label}: {warning:?}"
        );
        let error = fields.get("error").and_then(|e| e.as_str()).unwrap_or("");
        assert!(error.contains("WRONGTYPE"), "{label}: {warning:?}");
        assert!(
            !message(warning).contains("route=") && !message(warning).contains("WRONGTYPE"),
            "{label}: fields squashed into the message: {warning:?}"
        );
        // The start: an integer field is a JSON number.
        let start = find("worker starting");
        assert_eq!(start["level"], "INFO", "{label}: {start:?}");
        assert_eq!(
            start["fields"]["consumer"], "cli-worker",
            "{label}: {start:?}"
        );
        assert_eq!(start["fields"]["routes"], 2, "{label}: {start:?}");
        assert_eq!(start["fields"]["inbound_rules"], 0, "{label}: {start:?}");
        // SIGTERM's drain, in the same format to the end.
        find("SIGTERM: draining");
        assert_eq!(
            message(lines.last().unwrap()),
            "worker stopped",
            "{label}: {}",
            run.stderr
        );
    }
}

/// Without `--log-format` or `PACER_LOG_FORMAT` the log is text: no line is JSON, a line's
/// level stands in it, and its fields are written `name=value` after the message.
#[test]
fn the_default_log_format_is_text_with_fields_as_name_value() {
    let run = run_daemon_to_sigterm("log-text", &[], &[]);
    assert_eq!(run.code, Some(0), "SIGTERM exits 0\n{}", run.stderr);
    assert_eq!(run.stdout, "", "the daemon's stdout");
    assert!(run.stderr.lines().count() >= 4, "{}", run.stderr);
    for line in run.stderr.lines() {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_err() && !line.starts_with('{'),
            "a JSON line in the text log: {line:?}"
        );
    }
    let warning = run
        .stderr
        .lines()
        .find(|l| l.contains(BROKEN_ROUTE_WARNING))
        .unwrap_or_else(|| panic!("no route_broken warning in\n{}", run.stderr));
    assert!(
        warning.contains(" WARN ")
            && warning.contains("route=broken")
            && warning.contains("error="),
        "{warning}"
    );
    let start = run
        .stderr
        .lines()
        .find(|l| l.contains("worker starting"))
        .unwrap_or_else(|| panic!("no start line in\n{}", run.stderr));
    assert!(
        start.contains(" INFO ") && start.contains("consumer=cli-worker routes=2 "),
        "{start}"
    );
    assert!(
        run.stderr
            .lines()
            .last()
            .unwrap()
            .ends_with("worker stopped"),
        "{}",
        run.stderr
    );
}
