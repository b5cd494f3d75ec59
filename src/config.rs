//! pacer's configuration: the typed values the daemon runs on, read from one YAML file.
//!
//! Reading is two steps: serde into the raw shape (`raw`), then validation into these types,
//! which collects every problem with its path (`problems`) so that `pacer check-config` can print
//! them all at once. Nothing here talks to Redis.

mod inbound;
mod problems;
mod raw;

pub use inbound::{FailPolicy, InboundConfig, InboundRule, SLIDING_LOG_MAX};
pub use problems::{ConfigError, Problem};

use crate::keys::{self, RouteKeys};
use crate::pacing::BucketParams;
use crate::rate::Rate;
use problems::{join, Problems};
use raw::{RawConfig, RawMetrics, RawOutbound, RawRedis, RawRoute, RawWorker};
use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::Path;
use std::time::Duration;

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
pub struct RedisConfig {
    pub url: String,
    /// Longest any one Redis command may take before it counts as failed.
    pub timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub group: String,
    /// This process's consumer name in the group; empty in the file means `hostname-pid`.
    pub consumer: String,
    pub batch: usize,
    pub max_inflight: usize,
    pub claim_idle: Duration,
    pub max_deliveries: u64,
    pub drain: Duration,
}

#[derive(Debug, Clone)]
pub struct MetricsConfig {
    pub listen: SocketAddr,
}

#[derive(Debug, Clone)]
pub struct OutboundConfig {
    pub streams: Vec<String>,
    pub rejected_stream: String,
    pub dead_letter_stream: String,
    /// Output streams are trimmed to about this many entries (`MAXLEN ~`).
    pub max_len: u64,
    /// How long decision and dispatch markers live: the window in which a redelivered entry or a
    /// repeated event id is recognised.
    pub dedupe_ttl: Duration,
    pub max_event_bytes: usize,
    pub routes: BTreeMap<String, Route>,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub rate: Rate,
    pub burst: NonZeroU32,
    pub max_wait: Duration,
    /// Routes tried in order when this one's wait exceeds `max_wait` (one level: a fallback's own
    /// fallbacks are not followed).
    pub fallbacks: Vec<String>,
    pub keys: RouteKeys,
    pub bucket: BucketParams,
}

/// Values that replace the file's (from the environment or the command line).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub redis_url: Option<String>,
}

pub const ROUTE_NAME_MAX: usize = 64;

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
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
        let raw: RawConfig = match serde_yaml::from_str::<Value>(text) {
            Ok(Value::Null) => RawConfig::default(),
            Ok(v @ Value::Mapping(_)) => p.section("(top level)", Some(v)),
            Ok(_) => {
                p.push("(top level)", "expected a map of sections");
                RawConfig::default()
            }
            Err(e) => {
                p.push("(yaml)", e.to_string());
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
        let redis = read_redis(&mut p, raw.redis, overrides);
        let worker = read_worker(&mut p, raw.worker);
        let metrics = read_metrics(&mut p, raw.metrics);
        let outbound = read_outbound(&mut p, raw.outbound);
        check_recovery(&mut p, &worker, &outbound);
        let inbound = inbound::read_inbound(
            &mut p,
            raw.inbound,
            &worker,
            has_outbound.then_some(&outbound),
        );
        p.into_result(|| Config {
            redis,
            worker,
            metrics,
            outbound,
            inbound,
        })
    }
}

fn read_redis(p: &mut Problems, v: Option<Value>, overrides: &Overrides) -> RedisConfig {
    let raw: RawRedis = p.section("redis", v);
    p.unknown_keys("redis", &raw.unknown, &["url", "timeout"]);
    let (url, path) = match &overrides.redis_url {
        Some(url) => (url.clone(), "redis.url (from PACER_REDIS_URL)"),
        None => (
            p.string("redis.url", &raw.url, Some("redis://127.0.0.1:6379")),
            "redis.url",
        ),
    };
    if let Err(e) = redis::Client::open(url.as_str()) {
        p.push(path, format!("not a usable Redis URL: {e}"));
    }
    let timeout = p.duration("redis.timeout", &raw.timeout, Duration::from_secs(1));
    if timeout.is_zero() {
        p.push("redis.timeout", "must be more than 0");
    }
    RedisConfig { url, timeout }
}

fn read_worker(p: &mut Problems, v: Option<Value>) -> WorkerConfig {
    let raw: RawWorker = p.section("worker", v);
    let known = [
        "group",
        "consumer",
        "batch",
        "max_inflight",
        "claim_idle",
        "max_deliveries",
        "drain",
    ];
    p.unknown_keys("worker", &raw.unknown, &known);
    let group = p.string("worker.group", &raw.group, Some("pacer"));
    if group.is_empty() {
        p.push("worker.group", "must not be empty");
    }
    let batch = p.integer("worker.batch", &raw.batch, 64, 1, 10_000) as usize;
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
    WorkerConfig {
        group,
        consumer: p.string("worker.consumer", &raw.consumer, Some("")),
        batch,
        max_inflight,
        claim_idle,
        max_deliveries: p.integer("worker.max_deliveries", &raw.max_deliveries, 5, 1, 1_000),
        drain: p.duration("worker.drain", &raw.drain, Duration::from_secs(5)),
    }
}

/// Claiming and deduplication must fit together: a live worker's sleeping events are not
/// claimed, and a decision outlives every redelivery of its entry.
fn check_recovery(p: &mut Problems, worker: &WorkerConfig, outbound: &OutboundConfig) {
    let Some(longest_wait) = outbound.routes.values().map(|r| r.max_wait).max() else {
        return;
    };
    if worker.claim_idle <= longest_wait + Duration::from_secs(1) {
        p.push(
            "worker.claim_idle",
            format!(
                "must be more than the longest route max_wait ({}) plus 1s, or live workers' sleeping events would be claimed",
                humantime::format_duration(longest_wait)
            ),
        );
    }
    // An entry can be redelivered up to max_deliveries times, each after claim_idle.
    let lifetime = worker.claim_idle * worker.max_deliveries as u32 + longest_wait;
    if !outbound.dedupe_ttl.is_zero() && outbound.dedupe_ttl <= lifetime {
        p.push(
            "outbound.dedupe_ttl",
            format!(
                "must be more than worker.claim_idle x worker.max_deliveries + the longest max_wait ({}), or a redelivered entry could outlive its decision",
                humantime::format_duration(lifetime)
            ),
        );
    }
}

fn read_metrics(p: &mut Problems, v: Option<Value>) -> MetricsConfig {
    let raw: RawMetrics = p.section("metrics", v);
    p.unknown_keys("metrics", &raw.unknown, &["listen"]);
    let listen = match &raw.listen {
        None | Some(Value::Null) => None,
        some => p.parsed("metrics.listen", some, "an address like 127.0.0.1:9464"),
    };
    MetricsConfig {
        listen: listen.unwrap_or_else(|| ([127, 0, 0, 1], 9464).into()),
    }
}

fn read_outbound(p: &mut Problems, v: Option<Value>) -> OutboundConfig {
    let raw: RawOutbound = p.section("outbound", v.clone());
    let known = [
        "streams",
        "rejected_stream",
        "dead_letter_stream",
        "max_len",
        "dedupe_ttl",
        "max_event_bytes",
        "routes",
    ];
    p.unknown_keys("outbound", &raw.unknown, &known);

    let streams = p.string_list("outbound.streams", &raw.streams);
    if v.is_none() {
        // No outbound flow (an inbound-only config): nothing to read or pace; the defaults keep
        // what is shared (the dead-letter writer, reports) working.
        return OutboundConfig {
            streams,
            rejected_stream: "pacer:rejected".into(),
            dead_letter_stream: "pacer:dead".into(),
            max_len: 1_000_000,
            dedupe_ttl: Duration::from_secs(3600),
            max_event_bytes: 65_536,
            routes: BTreeMap::new(),
        };
    }
    if streams.is_empty() {
        p.push("outbound.streams", "needs at least one input stream");
    }
    let rejected_stream = p.string(
        "outbound.rejected_stream",
        &raw.rejected_stream,
        Some("pacer:rejected"),
    );
    let dead_letter_stream = p.string(
        "outbound.dead_letter_stream",
        &raw.dead_letter_stream,
        Some("pacer:dead"),
    );
    let max_len = p.integer(
        "outbound.max_len",
        &raw.max_len,
        1_000_000,
        100,
        u32::MAX as u64,
    );
    let dedupe_ttl = p.duration(
        "outbound.dedupe_ttl",
        &raw.dedupe_ttl,
        Duration::from_secs(3600),
    );
    if dedupe_ttl < Duration::from_secs(1) {
        p.push("outbound.dedupe_ttl", "must be at least 1s");
    }
    let max_event_bytes = p.integer(
        "outbound.max_event_bytes",
        &raw.max_event_bytes,
        65_536,
        64,
        16 << 20,
    ) as usize;
    let routes = read_routes(p, raw.routes);

    // Every stream name, input or output, must have a usable hash tag and appear once: an output
    // that is also an input would feed pacer its own output.
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut named: Vec<(String, String)> = streams
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("outbound.streams[{i}]"), s.clone()))
        .collect();
    named.push(("outbound.rejected_stream".into(), rejected_stream.clone()));
    named.push((
        "outbound.dead_letter_stream".into(),
        dead_letter_stream.clone(),
    ));
    for (name, route) in &routes {
        named.push((
            format!("outbound.routes.{name}.ready_stream"),
            route.keys.ready.clone(),
        ));
    }
    for (path, stream) in named {
        if let Err(e) = keys::check_stream_name(&stream) {
            p.push(&path, e);
        } else if let Some(first) = seen.get(&stream) {
            p.push(
                &path,
                format!("stream {stream:?} is already used by {first}"),
            );
        } else {
            seen.insert(stream, path);
        }
    }

    OutboundConfig {
        streams,
        rejected_stream,
        dead_letter_stream,
        max_len,
        dedupe_ttl,
        max_event_bytes,
        routes,
    }
}

fn read_routes(p: &mut Problems, v: Option<Value>) -> BTreeMap<String, Route> {
    let map = match v {
        Some(Value::Mapping(m)) if !m.is_empty() => m,
        None | Some(Value::Null) | Some(Value::Mapping(_)) => {
            p.push("outbound.routes", "needs at least one route");
            return BTreeMap::new();
        }
        Some(_) => {
            p.push("outbound.routes", "expected a map of route name to route");
            return BTreeMap::new();
        }
    };
    let mut routes = BTreeMap::new();
    let mut all_fallbacks = Vec::new();
    // Names of every route written, valid or not, so a route with a bad rate is not also
    // reported as a missing fallback.
    let names: BTreeSet<String> = map
        .keys()
        .filter_map(|k| k.as_str().map(str::to_string))
        .collect();
    for (key, value) in map {
        let name = match key {
            Value::String(s) => s,
            other => {
                p.push(
                    "outbound.routes",
                    format!("route names are strings, got {other:?}"),
                );
                continue;
            }
        };
        let path = join("outbound.routes", &name);
        if let Err(e) = check_route_name(&name) {
            p.push(&path, e);
        }
        let raw: RawRoute = p.section(&path, Some(value));
        let known = ["rate", "burst", "max_wait", "fallbacks", "ready_stream"];
        p.unknown_keys(&path, &raw.unknown, &known);
        let rate: Option<Rate> = p.parsed(&join(&path, "rate"), &raw.rate, "a rate like 10/s");
        let burst = p.integer(&join(&path, "burst"), &raw.burst, 1, 1, 1_000_000) as u32;
        let burst = NonZeroU32::new(burst).expect("burst is at least 1");
        let max_wait = p.duration(
            &join(&path, "max_wait"),
            &raw.max_wait,
            Duration::from_secs(1),
        );
        let fallbacks = p.string_list(&join(&path, "fallbacks"), &raw.fallbacks);
        let ready = match &raw.ready_stream {
            None | Some(Value::Null) => keys::default_ready_stream(&name),
            some => p.string(&join(&path, "ready_stream"), some, None),
        };
        all_fallbacks.push((path.clone(), name.clone(), fallbacks.clone()));
        if let Some(rate) = rate {
            routes.insert(
                name.clone(),
                Route {
                    keys: RouteKeys::new(&name, &ready),
                    bucket: BucketParams::new(rate, burst),
                    name,
                    rate,
                    burst,
                    max_wait,
                    fallbacks,
                },
            );
        }
    }
    for (path, name, fallbacks) in all_fallbacks {
        let mut seen = BTreeSet::new();
        for (i, fallback) in fallbacks.iter().enumerate() {
            let at = format!("{path}.fallbacks[{i}]");
            if *fallback == name {
                p.push(at, "a route cannot be its own fallback");
            } else if !seen.insert(fallback) {
                p.push(at, format!("{fallback:?} is listed twice"));
            } else if !names.contains(fallback) {
                p.push(at, format!("no route named {fallback:?} is configured"));
            }
        }
    }
    routes
}

/// Route names become key names and metric labels: keep them short and plain.
fn check_route_name(name: &str) -> Result<(), String> {
    let plain = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if name.is_empty() || name.len() > ROUTE_NAME_MAX || !plain {
        return Err(format!(
            "route names are 1 to {ROUTE_NAME_MAX} characters of letters, digits, '-', '_' and '.', got {name:?}"
        ));
    }
    Ok(())
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
    fn reads_a_minimal_config_with_defaults() {
        let c = Config::parse(GOOD, &Overrides::default()).unwrap();
        assert_eq!(c.worker.batch, 64);
        assert_eq!(c.outbound.rejected_stream, "pacer:rejected");
        let a = &c.outbound.routes["carrier-a"];
        assert_eq!(a.keys.ready, "pacer:{carrier-a}:ready");
        assert_eq!(a.bucket.tolerance_us, 100_000);
        assert_eq!(
            c.outbound.routes["carrier-b"].max_wait,
            Duration::from_secs(1)
        );
    }

    #[test]
    fn the_environment_overrides_the_redis_url() {
        let o = Overrides {
            redis_url: Some("redis://10.1.2.3:7000".into()),
        };
        assert_eq!(
            Config::parse(GOOD, &o).unwrap().redis.url,
            "redis://10.1.2.3:7000"
        );
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
        let e = Config::parse(bad, &Overrides::default()).unwrap_err();
        let paths: Vec<&str> = e.problems.iter().map(|p| p.path.as_str()).collect();
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
}
