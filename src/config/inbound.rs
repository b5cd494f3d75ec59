//! The `inbound:` section: the streams inbound events arrive on and go to, the fail policy,
//! and the admission rules that decide them (read in `rules`). Read like the rest of the config:
//! every problem, with its path.

use super::flow::{read_flow, Flow};
use super::problems::Problems;
use super::raw::{RawApi, RawInbound};
use super::rules::read_rules;
pub use super::rules::{InboundRule, Lease, SLIDING_LOG_MAX};
use super::{OutboundConfig, WorkerConfig};
use crate::keys::{self, InboundKeys};
use serde_yaml::Value;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

/// What happens to an event when its admission cannot be decided (Redis errors or timeouts,
/// `limiter_attempts` times in a row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailPolicy {
    /// Reject it (`pacer_reason=limiter_unavailable`): no limit is ever exceeded.
    FailClosed,
    /// Accept it unchecked: traffic keeps flowing, limits are not enforced meanwhile.
    FailOpen,
}

impl FailPolicy {
    pub fn as_str(&self) -> &'static str {
        match self {
            FailPolicy::FailClosed => "fail_closed",
            FailPolicy::FailOpen => "fail_open",
        }
    }
}

#[derive(Debug, Clone)]
pub struct InboundConfig {
    /// Its input streams, outputs and limits; a redelivery within `dedupe_ttl` gets its entry's
    /// recorded decision back and is not charged again.
    pub flow: Flow,
    /// Accepted events go here (often an outbound input stream); with partitioned outputs,
    /// to each partition's own copy of it instead (`keys[k].forward`).
    pub forward_stream: String,
    pub fail_policy: FailPolicy,
    /// Admission calls tried (with backoff) before `fail_policy` decides instead.
    pub limiter_attempts: u32,
    pub rules: Vec<InboundRule>,
    /// The field whose value picks an event's partition, when there are several.
    pub partition_by: Option<String>,
    /// The keys of each partition (`inbound.partitions`, one by default): an identity's state
    /// and its events' decisions live in partition `keys::partition(value, n)`, and its
    /// outputs are `keys[k].forward` and `keys[k].rejected`.
    pub keys: Vec<InboundKeys>,
    /// `inbound.api`: the synchronous face of these rules (`src/api`), if configured.
    pub api: Option<ApiConfig>,
}

/// `inbound.api`: where the synchronous admission API listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiConfig {
    /// `POST /v1/admit` over HTTP; it may be `metrics.listen`, then one listener serves both.
    pub listen: Option<SocketAddr>,
    /// Envoy's `envoy.service.ratelimit.v3.RateLimitService` over gRPC.
    pub grpc_listen: Option<SocketAddr>,
    /// The Envoy rate-limit domain answered; a request for another domain is refused.
    pub domain: String,
    /// How long an HTTP client may take to send a request's head (from when one is awaited:
    /// an idle keep-alive connection is closed after it) and to have a request read and
    /// answered (`src/api/http.rs`).
    pub read_timeout: Duration,
    /// The most connections each of its listeners holds open (`src/api.rs`, `Listener`).
    pub max_connections: usize,
}

/// `inbound.api.read_timeout` by default, and the metrics listener's when it serves no API.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// `inbound.api.max_connections` by default, and the metrics listener's when it serves no API:
/// with the HTTP and gRPC listeners full, well within a `LimitNOFILE` of 65536 (deploy/systemd)
/// beside the worker's Redis connections.
pub const MAX_CONNECTIONS: usize = 10_000;

fn read_api(p: &mut Problems, v: Option<Value>) -> Option<ApiConfig> {
    if matches!(v, None | Some(Value::Null)) {
        return None;
    }
    let raw: RawApi = p.section("inbound.api", v);
    p.unknown_keys(
        "inbound.api",
        &raw.unknown,
        &[
            "listen",
            "grpc_listen",
            "domain",
            "read_timeout",
            "max_connections",
        ],
    );
    const WHAT: &str = "an address like 127.0.0.1:8080";
    let mut address = |path: &str, v: &Option<Value>| match v {
        None | Some(Value::Null) => None,
        some => p.parsed::<SocketAddr>(path, some, WHAT),
    };
    let listen = address("inbound.api.listen", &raw.listen);
    let grpc_listen = address("inbound.api.grpc_listen", &raw.grpc_listen);
    if listen.is_none() && grpc_listen.is_none() {
        p.push(
            "inbound.api",
            "needs listen (HTTP), grpc_listen (Envoy's gRPC API) or both",
        );
    }
    if listen.is_some() && listen == grpc_listen {
        p.push(
            "inbound.api.grpc_listen",
            "must differ from inbound.api.listen",
        );
    }
    let domain = p.string("inbound.api.domain", &raw.domain, Some("pacer"));
    if domain.is_empty() {
        p.push("inbound.api.domain", "must not be empty");
    }
    let read_timeout = p.duration("inbound.api.read_timeout", &raw.read_timeout, READ_TIMEOUT);
    if read_timeout.is_zero() {
        p.push("inbound.api.read_timeout", "must be above 0");
    }
    let max_connections = p.integer(
        "inbound.api.max_connections",
        &raw.max_connections,
        MAX_CONNECTIONS as u64,
        1,
        1_000_000,
    ) as usize;
    Some(ApiConfig {
        listen,
        grpc_listen,
        domain,
        read_timeout,
        max_connections,
    })
}

impl InboundConfig {
    /// The streams that hold what the configured `forward_stream` would: itself, and each
    /// partition's own copy of it when the partitions have their own outputs. A reader of the
    /// forward stream (the outbound flow, when it is one of its inputs) reads them all.
    pub fn forward_streams(&self) -> Vec<String> {
        let mut streams = vec![self.forward_stream.clone()];
        for k in &self.keys {
            if !streams.contains(&k.forward) {
                streams.push(k.forward.clone());
            }
        }
        streams
    }
}

/// The most `inbound.partitions`: far more than a cluster has masters.
pub const PARTITIONS_MAX: u64 = 1024;

pub(super) fn read_inbound(
    p: &mut Problems,
    v: Option<Value>,
    worker: &WorkerConfig,
    outbound: Option<&OutboundConfig>,
) -> Option<InboundConfig> {
    v.as_ref()?;
    let raw: RawInbound = p.section("inbound", v);
    let known = [
        "streams",
        "forward_stream",
        "rejected_stream",
        "dead_letter_stream",
        "max_len",
        "dedupe_ttl",
        "max_event_bytes",
        "max_event_fields",
        "fail_policy",
        "limiter_attempts",
        "partitions",
        "partition_by",
        "partitioned_outputs",
        "rules",
        "api",
    ];
    p.unknown_keys("inbound", &raw.unknown, &known);
    let flow = read_flow(p, "inbound", &raw.flow, "pacer:in-rejected");
    let forward_stream = p.string(
        "inbound.forward_stream",
        &raw.forward_stream,
        Some("pacer:accepted"),
    );
    // An entry can be redelivered up to max_deliveries times, each after claim_idle.
    let lifetime = worker
        .claim_idle
        .saturating_mul(worker.max_deliveries as u32);
    let guessed = p.said_any(&["worker.claim_idle", "worker.max_deliveries"]);
    if flow.dedupe_ttl <= lifetime && !guessed {
        p.push(
            "inbound.dedupe_ttl",
            format!(
                "must be more than worker.claim_idle x worker.max_deliveries ({}), or a redelivered entry could outlive its decision and be charged twice",
                humantime::format_duration(lifetime)
            ),
        );
    }
    let fail_policy = match &raw.fail_policy {
        None | Some(Value::Null) => FailPolicy::FailClosed,
        Some(Value::String(s)) if s == "fail_closed" => FailPolicy::FailClosed,
        Some(Value::String(s)) if s == "fail_open" => FailPolicy::FailOpen,
        Some(_) => {
            p.push("inbound.fail_policy", "expected fail_closed or fail_open");
            FailPolicy::FailClosed
        }
    };
    let limiter_attempts =
        p.integer("inbound.limiter_attempts", &raw.limiter_attempts, 3, 1, 20) as u32;
    let rules = read_rules(p, raw.rules);
    let partitions =
        p.integer("inbound.partitions", &raw.partitions, 1, 1, PARTITIONS_MAX) as usize;
    let partition_by = read_partition_by(p, &raw.partition_by, partitions, &rules);
    let partitioned_outputs = p.boolean(
        "inbound.partitioned_outputs",
        &raw.partitioned_outputs,
        false,
    );
    if partitioned_outputs && partitions <= 1 && !p.said("inbound.partitions") {
        p.push(
            "inbound.partitioned_outputs",
            "only means something with inbound.partitions above 1",
        );
    }
    let keys: Vec<InboundKeys> = (0..partitions)
        .map(|k| {
            InboundKeys::partition(
                &forward_stream,
                &flow.rejected_stream,
                k,
                partitions,
                partitioned_outputs,
            )
        })
        .collect();

    // Stream names: usable tags, and no loop (an output that pacer reads again).
    let mut inputs: BTreeMap<String, String> = BTreeMap::new();
    if let Some(out) = outbound {
        for (i, s) in out.flow.streams.iter().enumerate() {
            inputs.insert(s.clone(), format!("outbound.streams[{i}]"));
        }
    }
    let mut outbound_outputs: BTreeMap<String, String> = BTreeMap::new();
    if let Some(out) = outbound {
        outbound_outputs.insert(
            out.flow.rejected_stream.clone(),
            "outbound.rejected_stream".into(),
        );
        for (name, route) in &out.routes {
            outbound_outputs.insert(
                route.keys.ready.clone(),
                format!("outbound.routes.{name}.ready_stream"),
            );
        }
    }
    let mut named = Vec::new();
    for (i, s) in flow.streams.iter().enumerate() {
        named.push((format!("inbound.streams[{i}]"), s.clone()));
    }
    named.push(("inbound.forward_stream".to_string(), forward_stream.clone()));
    named.push((
        "inbound.rejected_stream".to_string(),
        flow.rejected_stream.clone(),
    ));
    named.push((
        "inbound.dead_letter_stream".to_string(),
        flow.dead_letter_stream.clone(),
    ));
    for (path, stream) in &named {
        if let Err(e) = keys::check_stream_name(stream) {
            p.push(path, e);
        }
    }
    for (i, s) in flow.streams.iter().enumerate() {
        let path = format!("inbound.streams[{i}]");
        if let Some(first) = inputs.get(s).or_else(|| outbound_outputs.get(s)) {
            p.push(&path, format!("stream {s:?} is already used by {first}"));
        } else {
            inputs.insert(s.clone(), path);
        }
    }
    // The forward stream may be an outbound input (that is the point), but nothing else pacer
    // reads or writes on its own account.
    let forward_taken = inputs
        .get(&forward_stream)
        .filter(|p| p.starts_with("inbound."))
        .or_else(|| outbound_outputs.get(&forward_stream));
    if let Some(first) = forward_taken {
        p.push(
            "inbound.forward_stream",
            format!("stream {forward_stream:?} is already used by {first}"),
        );
    }
    for (path, stream) in [
        ("inbound.rejected_stream", &flow.rejected_stream),
        ("inbound.dead_letter_stream", &flow.dead_letter_stream),
    ] {
        if let Some(first) = inputs.get(stream) {
            p.push(
                path,
                format!("stream {stream:?} is already used by {first}"),
            );
        } else if *stream == forward_stream {
            p.push(
                path,
                format!("stream {stream:?} is already used by inbound.forward_stream"),
            );
        }
    }
    if flow.rejected_stream == flow.dead_letter_stream {
        p.push(
            "inbound.dead_letter_stream",
            format!(
                "stream {:?} is already used by inbound.rejected_stream",
                flow.dead_letter_stream
            ),
        );
    }

    // A partition's own outputs, named after the configured ones, must not be streams that
    // pacer reads or that something else writes.
    if partitioned_outputs {
        for k in &keys {
            for (path, stream) in [
                ("inbound.forward_stream", &k.forward),
                ("inbound.rejected_stream", &k.rejected),
            ] {
                if let Some(first) = inputs.get(stream).or_else(|| outbound_outputs.get(stream)) {
                    p.push(
                        path,
                        format!("partition stream {stream:?} is already used by {first}"),
                    );
                }
            }
        }
    }

    let api = read_api(p, raw.api);
    Some(InboundConfig {
        keys,
        flow,
        forward_stream,
        fail_policy,
        limiter_attempts,
        rules,
        partition_by,
        api,
    })
}

/// `inbound.partition_by`, which several partitions need. An event's decision is one atomic
/// call in its partition's slot, so every identity it is checked as must live there: each rule
/// must limit by that field alone, with the same `default_identity` (an event lacking the field
/// then lands where an event carrying the default would).
fn read_partition_by(
    p: &mut Problems,
    v: &Option<Value>,
    partitions: usize,
    rules: &[InboundRule],
) -> Option<String> {
    if partitions <= 1 {
        if !matches!(v, None | Some(Value::Null)) && !p.said("inbound.partitions") {
            p.push(
                "inbound.partition_by",
                "only means something with inbound.partitions above 1",
            );
        }
        return None;
    }
    let field = p.string("inbound.partition_by", v, None);
    if field.is_empty() {
        return None;
    }
    let default = rules.first().and_then(|r| r.default_identity.clone());
    for (i, rule) in rules.iter().enumerate() {
        if rule.key != [field.as_str()] {
            p.push(
                format!("inbound.rules[{i}].key"),
                format!(
                    "must be [{field}] with inbound.partition_by: {field}: each decision is atomic in its partition's slot, so a rule cannot limit by a field the partition is not chosen by"
                ),
            );
        } else if rule.default_identity != default {
            p.push(
                format!("inbound.rules[{i}].default_identity"),
                "must be the same in every rule when inbound.partitions is above 1: an event lacking the field must land in one partition",
            );
        }
    }
    Some(field)
}
