//! The `outbound:` section: the input streams outbound events arrive on, the shared output
//! streams, and the routes (rate, burst, wait, fallbacks, ready stream). Also what claiming and
//! deduplication need of each other, since both hang on the routes' waits.

use super::flow::{read_flow, Flow};
use super::problems::{join, Problems};
use super::raw::{RawOutbound, RawRoute};
use super::WorkerConfig;
use crate::keys::{self, RouteKeys};
use crate::pacing::BucketParams;
use crate::rate::Rate;
use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::time::Duration;

pub const ROUTE_NAME_MAX: usize = 64;

#[derive(Debug, Clone)]
pub struct OutboundConfig {
    pub flow: Flow,
    pub routes: BTreeMap<String, Route>,
    /// Route names by `Route::index`.
    pub order: Vec<String>,
}

impl OutboundConfig {
    fn new(flow: Flow, routes: BTreeMap<String, Route>) -> Self {
        OutboundConfig {
            flow,
            order: routes.keys().cloned().collect(),
            routes,
        }
    }

    /// The route with this `index`.
    pub fn route_at(&self, index: usize) -> &Route {
        &self.routes[&self.order[index]]
    }

    /// The routes an event of route `index` tries, in order: its own, then its fallbacks.
    pub fn chain(&self, index: usize) -> Vec<&Route> {
        let own = self.route_at(index);
        std::iter::once(own)
            .chain(own.fallbacks.iter().map(|f| &self.routes[f]))
            .collect()
    }
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
    /// An event read when its input entry is older than this is not placed: it is rejected with
    /// reason `expired` (a call that waited a minute in the input stream is no longer worth
    /// placing). None: no limit.
    pub max_age: Option<Duration>,
    /// Its position in `OutboundConfig::order`.
    pub index: usize,
    pub keys: RouteKeys,
    pub bucket: BucketParams,
}

/// Claiming and deduplication must fit together: a live worker's sleeping events are not
/// claimed, and a decision outlives every redelivery of its entry.
pub(super) fn check_recovery(p: &mut Problems, worker: &WorkerConfig, outbound: &OutboundConfig) {
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
    // An entry can be redelivered up to max_deliveries times, each after claim_idle. (Bounded
    // durations and a bounded count keep this from overflowing; saturate all the same.)
    let lifetime = worker
        .claim_idle
        .saturating_mul(worker.max_deliveries as u32)
        .saturating_add(longest_wait);
    let guessed = p.said_any(&["worker.claim_idle", "worker.max_deliveries"]);
    if !outbound.flow.dedupe_ttl.is_zero() && outbound.flow.dedupe_ttl <= lifetime && !guessed {
        p.push(
            "outbound.dedupe_ttl",
            format!(
                "must be more than worker.claim_idle x worker.max_deliveries + the longest max_wait ({}), or a redelivered entry could outlive its decision",
                humantime::format_duration(lifetime)
            ),
        );
    }
}

pub(super) fn read_outbound(p: &mut Problems, v: Option<Value>) -> OutboundConfig {
    let raw: RawOutbound = p.section("outbound", v.clone());
    let known = [
        "streams",
        "rejected_stream",
        "dead_letter_stream",
        "max_len",
        "dedupe_ttl",
        "max_event_bytes",
        "max_event_fields",
        "max_age",
        "routes",
    ];
    p.unknown_keys("outbound", &raw.unknown, &known);

    if v.is_none() {
        // No outbound flow (an inbound-only config): nothing to read or pace; the defaults keep
        // what is shared (the dead-letter writer, reports) working.
        return OutboundConfig::new(Flow::defaults("pacer:rejected"), BTreeMap::new());
    }
    let flow = read_flow(p, "outbound", &raw.flow, "pacer:rejected");
    if flow.dedupe_ttl < Duration::from_secs(1) {
        p.push("outbound.dedupe_ttl", "must be at least 1s");
    }
    let max_age = optional_duration(p, "outbound.max_age", &raw.max_age);
    let routes = read_routes(p, raw.routes, max_age);

    // Every stream name, input or output, must have a usable hash tag and appear once: an output
    // that is also an input would feed pacer its own output.
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut named: Vec<(String, String)> = flow
        .streams
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("outbound.streams[{i}]"), s.clone()))
        .collect();
    named.push((
        "outbound.rejected_stream".into(),
        flow.rejected_stream.clone(),
    ));
    named.push((
        "outbound.dead_letter_stream".into(),
        flow.dead_letter_stream.clone(),
    ));
    for (name, route) in &routes {
        // The stream a bad route name would give its ready entries is that name's problem,
        // said already: not a second one on a key nobody wrote.
        if check_route_name(name).is_err() && route.keys.ready == keys::default_ready_stream(name) {
            continue;
        }
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

    OutboundConfig::new(flow, routes)
}

/// A duration that may be absent (no limit); zero is refused, since it would refuse everything.
fn optional_duration(p: &mut Problems, path: &str, v: &Option<Value>) -> Option<Duration> {
    match v {
        None | Some(Value::Null) => None,
        some => {
            let d = p.duration(path, some, Duration::ZERO);
            if d.is_zero() {
                if !p.said(path) {
                    p.push(path, "must be more than 0 (leave it out for no limit)");
                }
                None
            } else {
                Some(d)
            }
        }
    }
}

fn read_routes(
    p: &mut Problems,
    v: Option<Value>,
    default_max_age: Option<Duration>,
) -> BTreeMap<String, Route> {
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
        let known = [
            "rate",
            "burst",
            "max_wait",
            "max_age",
            "fallbacks",
            "ready_stream",
        ];
        p.unknown_keys(&path, &raw.unknown, &known);
        let rate: Option<Rate> = p.parsed(&join(&path, "rate"), &raw.rate, "a rate like 10/s");
        let burst = p.integer(&join(&path, "burst"), &raw.burst, 1, 1, 1_000_000) as u32;
        let burst = NonZeroU32::new(burst).expect("burst is at least 1");
        let max_wait = p.duration(
            &join(&path, "max_wait"),
            &raw.max_wait,
            Duration::from_secs(1),
        );
        let max_age =
            optional_duration(p, &join(&path, "max_age"), &raw.max_age).or(default_max_age);
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
                    max_age,
                    fallbacks,
                    index: 0,
                },
            );
        }
    }
    // Indexes follow the map's order, which `OutboundConfig::order` lists.
    for (index, route) in routes.values_mut().enumerate() {
        route.index = index;
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
