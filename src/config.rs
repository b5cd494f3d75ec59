//! pacer's configuration: the typed values the daemon runs on, read from one YAML file.
//!
//! Reading is two steps: serde into the raw shape (`raw`), then validation into these types,
//! which collects every problem with its path (`problems`) so that `pacer check-config` can print
//! them all at once. Nothing here talks to Redis.

mod files;
mod flow;
mod inbound;
mod outbound;
mod problems;
mod raw;
mod redis;
mod rules;
mod yaml;

pub use self::redis::{
    redact, ClientCert, PemFile, RedisConfig, RedisMode, RedisUrl, Secret, SentinelConfig,
    TlsConfig,
};
pub use flow::{Flow, MAX_EVENT_FIELDS, MAX_EVENT_FIELDS_DEFAULT};
pub use inbound::{
    ApiConfig, FailPolicy, InboundConfig, InboundRule, Lease, MAX_CONNECTIONS, READ_TIMEOUT,
    SLIDING_LOG_MAX,
};
pub use outbound::{OutboundConfig, Route, ROUTE_NAME_MAX};
pub use problems::{ConfigError, Problem, DURATION_MAX};

use outbound::{check_recovery, read_outbound};
use problems::Problems;
use raw::{RawConfig, RawMetrics, RawWorker};
use serde_yaml::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// Above this many routes, per-route histograms are cautioned about (5,000 served 195,000
/// series, 10.8 MB a scrape: README, "Thousands of routes").
const ROUTES_WITH_HISTOGRAMS: usize = 10_000;

#[derive(Debug, Clone)]
pub struct Config {
    pub redis: RedisConfig,
    pub worker: WorkerConfig,
    pub metrics: MetricsConfig,
    /// Without an `outbound:` section this holds no streams and no routes (and defaults).
    pub outbound: OutboundConfig,
    /// The `inbound:` section, when there is one.
    pub inbound: Option<InboundConfig>,
}

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub group: String,
    /// This process's consumer name in the group; empty in the file means `hostname-pid`.
    pub consumer: String,
    pub batch: usize,
    /// About the most bytes of fields one read or claim brings in (`worker/budget.rs`).
    pub read_bytes: usize,
    pub max_inflight: usize,
    /// About the most bytes of fields the entries it holds may take (`worker/budget.rs`).
    pub max_inflight_bytes: usize,
    pub claim_idle: Duration,
    pub max_deliveries: u64,
    pub drain: Duration,
    /// The runtime's worker threads; 0: one per core this process may use.
    pub threads: usize,
}

#[derive(Debug, Clone)]
pub struct MetricsConfig {
    pub listen: SocketAddr,
    /// Whether `pacer_wait_seconds` and `pacer_lateness_seconds` are kept per route (27 series
    /// a route) or for all routes together (`route="all"`), for fleets of thousands of routes.
    pub route_histograms: bool,
}

/// Values that replace the file's (from the environment or the command line). Debug never
/// prints a secret: the URL prints redacted, passwords as `***`.
#[derive(Clone, Default)]
pub struct Overrides {
    /// `PACER_REDIS_URL`: one URL, or several comma-separated (seed nodes, sentinels).
    pub redis_url: Option<String>,
    /// `metrics.listen`, so that several workers on one host can share a config file.
    pub metrics_listen: Option<Sourced>,
    /// `PACER_REDIS_MODE`: standalone, cluster or sentinel.
    pub redis_mode: Option<String>,
    /// `PACER_REDIS_PASSWORD`: the data nodes' password, so it need not sit in the file.
    pub redis_password: Option<Secret>,
    /// `PACER_REDIS_SENTINEL_PASSWORD`: the sentinels' own password, when they have one.
    pub redis_sentinel_password: Option<Secret>,
}

impl Overrides {
    /// Reads the `PACER_REDIS_*` variables and `PACER_METRICS_LISTEN`; an empty one counts as
    /// unset.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Overrides {
            redis_url: var("PACER_REDIS_URL"),
            metrics_listen: var("PACER_METRICS_LISTEN").map(|value| Sourced {
                value,
                source: "PACER_METRICS_LISTEN",
            }),
            redis_mode: var("PACER_REDIS_MODE"),
            redis_password: var("PACER_REDIS_PASSWORD").map(Secret::new),
            redis_sentinel_password: var("PACER_REDIS_SENTINEL_PASSWORD").map(Secret::new),
        }
    }
}

impl std::fmt::Debug for Overrides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overrides")
            .field("redis_url", &self.redis_url.as_deref().map(redact))
            .field("metrics_listen", &self.metrics_listen)
            .field("redis_mode", &self.redis_mode)
            .field("redis_password", &self.redis_password)
            .field("redis_sentinel_password", &self.redis_sentinel_password)
            .finish()
    }
}

/// An override's value and where it came from (`PACER_METRICS_LISTEN`, `--metrics-listen`), so
/// that a problem with it names its source rather than a file line that does not hold it.
#[derive(Debug, Clone)]
pub struct Sourced {
    pub value: String,
    pub source: &'static str,
}

impl Config {
    /// Every input stream a worker reads, with the flow that reads it: the outbound ones, then
    /// the inbound ones.
    pub fn input_streams(&self) -> impl Iterator<Item = (&str, &'static str)> {
        let inbound = self.inbound.iter().flat_map(|i| &i.flow.streams);
        (self
            .outbound
            .flow
            .streams
            .iter()
            .map(|s| (s.as_str(), "outbound")))
        .chain(inbound.map(|s| (s.as_str(), "inbound")))
    }

    /// Every stream a worker writes: each configured flow's rejected and dead-letter streams,
    /// the routes' ready streams, and the inbound forward and rejected streams of every
    /// partition; each once.
    pub fn output_streams(&self) -> Vec<&str> {
        self.output_max_lens().into_iter().map(|(s, _)| s).collect()
    }

    /// Every stream a worker writes, each once (as `output_streams`), with the length it is trimmed to: its
    /// flow's `max_len`, the larger of the two for a stream both flows write. Trimming never
    /// cuts what a consumer group on the stream has not read (`lib.lua` `trim`), so a stream
    /// well past it has a reader that fell behind.
    pub fn output_max_lens(&self) -> Vec<(&str, u64)> {
        let mut out: Vec<(&str, u64)> = Vec::new();
        if !self.outbound.flow.streams.is_empty() {
            let (flow, kept) = (&self.outbound.flow, self.outbound.flow.max_len);
            out.push((&flow.rejected_stream, kept));
            out.push((&flow.dead_letter_stream, kept));
            out.extend(
                self.outbound
                    .routes
                    .values()
                    .map(|r| (r.keys.ready.as_str(), kept)),
            );
        }
        if let Some(i) = &self.inbound {
            let kept = i.flow.max_len;
            out.push((&i.flow.dead_letter_stream, kept));
            for k in &i.keys {
                out.push((&k.forward, kept));
                out.push((&k.rejected, kept));
            }
        }
        // By stream, the largest length first: the first of each stream is the one kept.
        out.sort_unstable_by(|a, b| a.0.cmp(b.0).then(b.1.cmp(&a.1)));
        out.dedup_by(|later, first| later.0 == first.0);
        out
    }

    /// What the config allows but may not mean: each route whose backlog can hold as many
    /// sleeping events as `worker.max_inflight`. A worker holds every event it sleeps on, one
    /// permit each. Until 2026-11-29 one such backlog took every permit and the other routes'
    /// events waited unread behind it at its pace (a 100/s route took 100 s to start behind a
    /// 2/s route of max_wait 100s, found by review); now the route holds at most its share of
    /// the worker's places and parks the rest of what it reads (`worker::share`), which costs a
    /// second read of each parked entry, and past `16 x max_inflight` parked the worker stops
    /// reading. Said by `check-config` and at start.
    ///
    /// Also a config of many routes with their histograms on: 100,000 routes served 220 MB of
    /// /metrics per scrape (5 s to render) and took a worker to 1.1 GB (found by review).
    pub fn cautions(&self) -> Vec<String> {
        let mut said = Vec::new();
        let routes = self.outbound.routes.len();
        if routes > ROUTES_WITH_HISTOGRAMS && self.metrics.route_histograms {
            said.push(format!(
                "{routes} routes, each with its own lateness and wait histograms: /metrics serves about 40 series a route ({} in all) and each worker holds them; metrics.route_histograms: false keeps one histogram for all routes (13 series a route)",
                routes * 40
            ));
        }
        if self.outbound.flow.streams.is_empty() || routes < 2 {
            return said;
        }
        let permits = self.worker.max_inflight as i64;
        said.extend(self.outbound
            .routes
            .values()
            .filter_map(|r| {
                let wait_us = r.max_wait.as_micros().min(i64::MAX as u128) as i64;
                let sleepers = r.bucket.window_limit(wait_us);
                (sleepers >= permits).then(|| {
                    format!(
                        "route {}: a backlog on it can hold {sleepers} sleeping events (rate x max_wait), and a worker holds at most worker.max_inflight ({permits}): past its share of them the route parks what the worker reads for it (read again once it has room, a second read of each), and past 16 x max_inflight parked the worker stops reading and every other route's events wait behind it; raise max_inflight, lower max_wait, or give the route an input stream and workers of its own",
                        r.name
                    )
                })
            }));
        said
    }

    /// Reads and validates the file at `path`.
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
        let text = files::read_text(path, files::CONFIG_MAX).map_err(|e| ConfigError {
            problems: vec![Problem {
                path: path.display().to_string(),
                message: format!("cannot read the config file: {e}"),
            }],
        })?;
        Config::parse(&text, overrides)
    }

    /// Validates YAML text.
    pub fn parse(text: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
        let mut p = Problems::default();
        let raw: RawConfig = match yaml::parse(text) {
            Ok(Value::Null) => RawConfig::default(),
            Ok(v @ Value::Mapping(_)) => p.section("(top level)", Some(v)),
            Ok(_) => {
                p.push("(top level)", "expected a map of sections");
                RawConfig::default()
            }
            Err(e) => {
                p.push("(yaml)", e);
                return p.into_result(|| unreachable!());
            }
        };
        p.unknown_keys(
            "",
            &raw.unknown,
            &["redis", "worker", "metrics", "outbound", "inbound"],
        );
        if raw.outbound.is_none() && raw.inbound.is_none() {
            p.push(
                "(top level)",
                "needs an outbound section, an inbound section, or both: pacer has nothing to do",
            );
        }
        let has_outbound = raw.outbound.is_some();
        let redis = redis::read_redis(&mut p, raw.redis, overrides);
        let worker = read_worker(&mut p, raw.worker);
        let metrics = read_metrics(&mut p, raw.metrics, overrides);
        let mut outbound = read_outbound(&mut p, raw.outbound);
        check_recovery(&mut p, &worker, &outbound);
        let inbound = inbound::read_inbound(
            &mut p,
            raw.inbound,
            &worker,
            has_outbound.then_some(&outbound),
        );
        // The outbound flow reading the forward stream reads the partitions' copies of it too.
        if let Some(i) = inbound.as_ref().filter(|_| has_outbound) {
            if outbound.flow.streams.contains(&i.forward_stream) {
                for s in i.forward_streams() {
                    if !outbound.flow.streams.contains(&s) {
                        outbound.flow.streams.push(s);
                    }
                }
            }
        }
        p.into_result(|| Config {
            redis,
            worker,
            metrics,
            outbound,
            inbound,
        })
    }
}

fn read_worker(p: &mut Problems, v: Option<Value>) -> WorkerConfig {
    let raw: RawWorker = p.section("worker", v);
    let known = [
        "group",
        "consumer",
        "batch",
        "read_bytes",
        "max_inflight",
        "max_inflight_bytes",
        "claim_idle",
        "max_deliveries",
        "drain",
        "threads",
    ];
    p.unknown_keys("worker", &raw.unknown, &known);
    let group = p.string("worker.group", &raw.group, Some("pacer"));
    let consumer = p.string("worker.consumer", &raw.consumer, Some(""));
    if group.is_empty() {
        p.push("worker.group", "must not be empty");
    }
    for (path, name) in [("worker.group", &group), ("worker.consumer", &consumer)] {
        if let Err(e) = crate::keys::check_name(name) {
            p.push(path, e);
        }
    }
    let batch = p.integer("worker.batch", &raw.batch, 512, 1, 10_000) as usize;
    let max_inflight = p.integer(
        "worker.max_inflight",
        &raw.max_inflight,
        10_000,
        1,
        10_000_000,
    ) as usize;
    if max_inflight < batch {
        p.push(
            "worker.max_inflight",
            format!("must be at least worker.batch ({batch}), got {max_inflight}"),
        );
    }
    let claim_idle = p.duration(
        "worker.claim_idle",
        &raw.claim_idle,
        Duration::from_secs(30),
    );
    if claim_idle < Duration::from_millis(100) {
        p.push("worker.claim_idle", "must be at least 100ms");
    }
    // By default 64 MiB, or 1 KiB a place when that is more: an event of up to 1 KiB then
    // always takes one place, however high max_inflight is set.
    let max_inflight_bytes = p.integer(
        "worker.max_inflight_bytes",
        &raw.max_inflight_bytes,
        (64 << 20).max(max_inflight as u64 * 1024),
        1 << 10,
        1 << 40,
    ) as usize;
    // A place is max_inflight_bytes / max_inflight bytes: below one byte, the budget could not
    // be kept (an entry holds at least a place).
    if max_inflight_bytes < max_inflight {
        p.push(
            "worker.max_inflight_bytes",
            format!(
                "must be at least worker.max_inflight ({max_inflight}), a byte a place, \
                 got {max_inflight_bytes}"
            ),
        );
    }
    WorkerConfig {
        group,
        consumer,
        batch,
        read_bytes: p.integer(
            "worker.read_bytes",
            &raw.read_bytes,
            16 << 20,
            1 << 10,
            1 << 32,
        ) as usize,
        max_inflight,
        max_inflight_bytes,
        claim_idle,
        max_deliveries: p.integer("worker.max_deliveries", &raw.max_deliveries, 5, 1, 1_000),
        drain: p.duration("worker.drain", &raw.drain, Duration::from_secs(5)),
        threads: p.integer("worker.threads", &raw.threads, 0, 0, 1_024) as usize,
    }
}

fn read_metrics(p: &mut Problems, v: Option<Value>, overrides: &Overrides) -> MetricsConfig {
    let raw: RawMetrics = p.section("metrics", v);
    p.unknown_keys("metrics", &raw.unknown, &["listen", "route_histograms"]);
    const WHAT: &str = "an address like 127.0.0.1:9464";
    let listen = match (&overrides.metrics_listen, &raw.listen) {
        (Some(o), _) => p.parsed(
            &format!("metrics.listen (from {})", o.source),
            &Some(Value::String(o.value.clone())),
            WHAT,
        ),
        (None, None | Some(Value::Null)) => None,
        (None, some) => p.parsed("metrics.listen", some, WHAT),
    };
    MetricsConfig {
        listen: listen.unwrap_or_else(|| ([127, 0, 0, 1], 9464).into()),
        route_histograms: p.boolean("metrics.route_histograms", &raw.route_histograms, true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
outbound:
  streams: ["pacer:out"]
  routes:
    carrier-a: {rate: 10/s, burst: 2, max_wait: 2s, fallbacks: [carrier-b]}
    carrier-b: {rate: 5/s}
"#;

    #[test]
    fn a_route_whose_backlog_fills_a_worker_is_cautioned_about() {
        let c = Config::parse(GOOD, &Overrides::default()).unwrap();
        assert!(c.cautions().is_empty(), "{:?}", c.cautions());
        let text = "worker:\n  batch: 50\n  max_inflight: 100\n  claim_idle: 102s\noutbound:\n  streams: [in]\n  routes:\n    slow: {rate: 2/s, max_wait: 100s}\n    fast: {rate: 100/s, max_wait: 500ms}\n";
        let c = Config::parse(text, &Overrides::default()).unwrap();
        let said = c.cautions();
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].starts_with("route slow: a backlog on it can hold 201 sleeping events"),
            "{said:?}"
        );
    }

    #[test]
    fn many_routes_with_their_own_histograms_are_cautioned_about() {
        let many = |n: usize, histograms: bool| {
            let routes: String = (0..n)
                .map(|i| format!("    r{i}: {{rate: 10/s}}\n"))
                .collect();
            let text = format!("metrics: {{route_histograms: {histograms}}}\noutbound:\n  streams: [in]\n  routes:\n{routes}");
            Config::parse(&text, &Overrides::default())
                .unwrap()
                .cautions()
        };
        assert!(many(ROUTES_WITH_HISTOGRAMS, true).is_empty());
        let said = many(ROUTES_WITH_HISTOGRAMS + 1, true);
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].starts_with("10001 routes, each with its own lateness and wait histograms: /metrics serves about 40 series a route (400040 in all)"), "{said:?}");
        assert!(many(ROUTES_WITH_HISTOGRAMS + 1, false).is_empty());
    }

    #[test]
    fn byte_budgets_default_to_16_and_64_mib_and_1_kib_a_place_beyond() {
        let c = Config::parse(GOOD, &Overrides::default()).unwrap();
        let w = &c.worker;
        assert_eq!((w.read_bytes, w.max_inflight_bytes), (16 << 20, 64 << 20));
        let many = format!("worker: {{max_inflight: 1000000}}{GOOD}");
        let c = Config::parse(&many, &Overrides::default()).unwrap();
        assert_eq!(c.worker.max_inflight_bytes, 1_000_000 << 10);
        let set = format!("worker: {{max_inflight: 1000, max_inflight_bytes: 4096}}{GOOD}");
        let c = Config::parse(&set, &Overrides::default()).unwrap();
        assert_eq!(c.worker.max_inflight_bytes, 4096);
        // Less than a byte a place is refused: the slot would round up and hold more.
        let under = format!("worker: {{max_inflight: 10000, max_inflight_bytes: 4096}}{GOOD}");
        let e = Config::parse(&under, &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("worker.max_inflight_bytes: must be at least worker.max_inflight (10000)"),
            "{e}"
        );
    }

    #[test]
    fn each_output_stream_is_kept_at_the_largest_max_len_of_the_flows_writing_it() {
        let text = "outbound:\n  streams: [out]\n  max_len: 100\n  routes:\n    a: {rate: 1/s}\ninbound:\n  streams: [in]\n  forward_stream: out\n  max_len: 500\n  rules:\n    - {name: r, key: [source], limits: [1/s]}\n";
        let c = Config::parse(text, &Overrides::default()).unwrap();
        let kept = c.output_max_lens();
        // The dead-letter stream both flows write (the default name) once, at the inbound's.
        assert_eq!(
            kept,
            [
                ("out", 500),
                ("pacer:dead", 500),
                ("pacer:in-rejected", 500),
                ("pacer:rejected", 100),
                ("pacer:{a}:ready", 100),
            ]
        );
        let streams: Vec<&str> = kept.iter().map(|(s, _)| *s).collect();
        assert_eq!(c.output_streams(), streams);
    }

    #[test]
    fn reads_a_minimal_config_with_defaults() {
        let c = Config::parse(GOOD, &Overrides::default()).unwrap();
        assert_eq!(c.worker.batch, 512);
        assert_eq!(c.outbound.flow.rejected_stream, "pacer:rejected");
        let a = &c.outbound.routes["carrier-a"];
        assert_eq!(a.keys.ready, "pacer:{carrier-a}:ready");
        assert_eq!(a.bucket.tolerance_us, 100_000);
        assert_eq!(
            c.outbound.routes["carrier-b"].max_wait,
            Duration::from_secs(1)
        );
    }

    #[test]
    fn the_outbound_flow_reads_the_partitions_own_copies_of_its_input() {
        let text = format!(
            "{GOOD}inbound:\n  streams: [in]\n  forward_stream: \"pacer:out\"\n  partitions: 3\n  partition_by: source\n  partitioned_outputs: true\n  rules:\n    - {{name: a, key: [source], limits: [10/s]}}\n"
        );
        let c = Config::parse(&text, &Overrides::default()).unwrap();
        assert_eq!(
            c.outbound.flow.streams,
            [
                "pacer:out",
                "pacer:out:{pacer:out/0.2}",
                "pacer:out:{pacer:out/1.4}",
                "pacer:out:{pacer:out/2.3}"
            ]
        );
        let inbound = c.inbound.unwrap();
        assert_eq!(
            inbound.keys[2].rejected,
            "pacer:in-rejected:{pacer:out/2.3}"
        );
    }

    #[test]
    fn the_environment_overrides_the_redis_url() {
        let o = Overrides {
            redis_url: Some("redis://10.1.2.3:7000".into()),
            ..Overrides::default()
        };
        assert_eq!(
            Config::parse(GOOD, &o).unwrap().redis.url.as_str(),
            "redis://10.1.2.3:7000"
        );
    }

    #[test]
    fn an_override_replaces_metrics_listen_and_a_bad_one_names_its_source() {
        let o = |value: &str| Overrides {
            metrics_listen: Some(Sourced {
                value: value.into(),
                source: "PACER_METRICS_LISTEN",
            }),
            ..Overrides::default()
        };
        let with_listen = format!("{GOOD}metrics: {{listen: 127.0.0.1:9464}}\n");
        let c = Config::parse(&with_listen, &o("127.0.0.1:9501")).unwrap();
        assert_eq!(c.metrics.listen, "127.0.0.1:9501".parse().unwrap());
        // The file's own value is not read, so a bad one there is no problem either.
        let bad_file = format!("{GOOD}metrics: {{listen: nowhere}}\n");
        assert!(Config::parse(&bad_file, &o("[::1]:9502")).is_ok());
        let e = Config::parse(GOOD, &o("localhost-9464")).unwrap_err();
        assert_eq!(e.problems.len(), 1, "{e}");
        assert_eq!(
            e.problems[0].path,
            "metrics.listen (from PACER_METRICS_LISTEN)"
        );
    }

    /// The problems `text` is refused with, and their paths in order.
    fn refused(text: &str) -> (ConfigError, Vec<String>) {
        let e = Config::parse(text, &Overrides::default()).unwrap_err();
        let paths = e.problems.iter().map(|p| p.path.clone()).collect();
        (e, paths)
    }

    #[test]
    fn reports_every_problem_with_its_path() {
        let bad = r#"
worker: {batch: 0, drian: 5s}
outbound:
  streams: ["pacer:out"]
  routes:
    carrier-a: {rate: 10/day, fallbacks: [nowhere]}
    carrier-b: {rate: 5/s, max_wait: soon}
"#;
        let (_, paths) = refused(bad);
        assert_eq!(
            paths,
            vec![
                "worker.drian",
                "worker.batch",
                "outbound.routes.carrier-a.rate",
                "outbound.routes.carrier-b.max_wait",
                "outbound.routes.carrier-a.fallbacks[0]",
            ]
        );
    }

    #[test]
    fn a_bad_value_is_one_problem_not_also_the_checks_of_what_stands_in_for_it() {
        let bad = format!(
            "redis: {{timeout: 0s}}\n{GOOD}inbound:\n  streams: [in]\n  forward_stream: fwd\n  rules:\n    - {{name: a, key: [k], limits: [1/s], min_spacing: -1ms}}\n"
        );
        let (e, paths) = refused(&bad);
        // Not also redis.wait_timeout (half the timeout, unwritten) nor min_spacing's zero.
        assert_eq!(
            paths,
            vec!["redis.timeout", "inbound.rules[0].min_spacing"],
            "{e}"
        );
        assert_eq!(
            e.problems[1].message,
            "a duration cannot be negative, got \"-1ms\""
        );
        let (e, paths) = refused(&("redis: {wait_timeout: 0s}\n".to_string() + GOOD));
        assert_eq!(paths, ["redis.wait_timeout"], "{e}");
    }

    #[test]
    fn a_bad_route_name_is_one_problem_not_also_its_ready_stream() {
        let bad = "outbound:\n  streams: [in]\n  routes:\n    \"\": {rate: 1/s}\n    \"a{b\": {rate: 1/s}\n    \"c d\": {rate: 1/s, ready_stream: \"x{\"}\n";
        let (e, paths) = refused(bad);
        // The stream written out for "c d" is still checked.
        assert_eq!(
            paths,
            vec![
                "outbound.routes.",
                "outbound.routes.a{b",
                "outbound.routes.c d",
                "outbound.routes.c d.ready_stream",
            ],
            "{e}"
        );
    }
}
