//! The `inbound:` section: the streams inbound events arrive on and go to, and the admission
//! rules that decide them. Read like the rest of the config: every problem, with its path.

use super::problems::{join, Problems};
use super::raw::{RawInbound, RawRule};
use super::{OutboundConfig, WorkerConfig};
use crate::admission::{Algorithm, Limit, Rule};
use crate::keys::{self, InboundKeys};
use crate::rate::Rate;
use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet};
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
    pub streams: Vec<String>,
    /// Accepted events go here (often an outbound input stream).
    pub forward_stream: String,
    pub rejected_stream: String,
    pub dead_letter_stream: String,
    /// Output streams are trimmed to about this many entries (`MAXLEN ~`).
    pub max_len: u64,
    /// How long each input entry's decision is remembered: a redelivery within it gets the same
    /// decision back and is not charged again.
    pub dedupe_ttl: Duration,
    pub max_event_bytes: usize,
    pub fail_policy: FailPolicy,
    /// Admission calls tried (with backoff) before `fail_policy` decides instead.
    pub limiter_attempts: u32,
    pub rules: Vec<InboundRule>,
    pub keys: InboundKeys,
}

#[derive(Debug, Clone)]
pub struct InboundRule {
    pub name: String,
    /// Event fields naming who is limited; each is one identity, and all must pass.
    pub key: Vec<String>,
    pub rule: Rule,
    /// The limits as written, one per `rule.limits`.
    pub rates: Vec<Rate>,
    /// `mode: shadow`: decided, charged and counted, never rejecting.
    pub shadow: bool,
    /// The identity of an event that lacks a key field; without it such an event is
    /// dead-lettered (`missing_key`).
    pub default_identity: Option<String>,
}

/// Names that become key names and metric labels.
pub const NAME_MAX: usize = 64;
/// The largest count a sliding log may keep per identity (its memory is O(count)).
pub const SLIDING_LOG_MAX: u64 = 10_000;

fn check_name(what: &str, name: &str) -> Result<(), String> {
    let plain = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if name.is_empty() || name.len() > NAME_MAX || !plain {
        return Err(format!(
            "{what} are 1 to {NAME_MAX} characters of letters, digits, '-', '_' and '.', got {name:?}"
        ));
    }
    Ok(())
}

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
        "fail_policy",
        "limiter_attempts",
        "rules",
    ];
    p.unknown_keys("inbound", &raw.unknown, &known);
    let streams = p.string_list("inbound.streams", &raw.streams);
    if streams.is_empty() {
        p.push("inbound.streams", "needs at least one input stream");
    }
    let forward_stream = p.string(
        "inbound.forward_stream",
        &raw.forward_stream,
        Some("pacer:accepted"),
    );
    let rejected_stream = p.string(
        "inbound.rejected_stream",
        &raw.rejected_stream,
        Some("pacer:in-rejected"),
    );
    let dead_letter_stream = p.string(
        "inbound.dead_letter_stream",
        &raw.dead_letter_stream,
        Some("pacer:dead"),
    );
    let max_len = p.integer(
        "inbound.max_len",
        &raw.max_len,
        1_000_000,
        100,
        u32::MAX as u64,
    );
    let dedupe_ttl = p.duration(
        "inbound.dedupe_ttl",
        &raw.dedupe_ttl,
        Duration::from_secs(3600),
    );
    // An entry can be redelivered up to max_deliveries times, each after claim_idle.
    let lifetime = worker.claim_idle * worker.max_deliveries as u32;
    if dedupe_ttl <= lifetime {
        p.push(
            "inbound.dedupe_ttl",
            format!(
                "must be more than worker.claim_idle x worker.max_deliveries ({}), or a redelivered entry could outlive its decision and be charged twice",
                humantime::format_duration(lifetime)
            ),
        );
    }
    let max_event_bytes = p.integer(
        "inbound.max_event_bytes",
        &raw.max_event_bytes,
        65_536,
        64,
        16 << 20,
    ) as usize;
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

    // Stream names: usable tags, and no loop (an output that pacer reads again).
    let mut inputs: BTreeMap<String, String> = BTreeMap::new();
    if let Some(out) = outbound {
        for (i, s) in out.streams.iter().enumerate() {
            inputs.insert(s.clone(), format!("outbound.streams[{i}]"));
        }
    }
    let mut outbound_outputs: BTreeMap<String, String> = BTreeMap::new();
    if let Some(out) = outbound {
        outbound_outputs.insert(
            out.rejected_stream.clone(),
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
    for (i, s) in streams.iter().enumerate() {
        named.push((format!("inbound.streams[{i}]"), s.clone()));
    }
    named.push(("inbound.forward_stream".to_string(), forward_stream.clone()));
    named.push((
        "inbound.rejected_stream".to_string(),
        rejected_stream.clone(),
    ));
    named.push((
        "inbound.dead_letter_stream".to_string(),
        dead_letter_stream.clone(),
    ));
    for (path, stream) in &named {
        if let Err(e) = keys::check_stream_name(stream) {
            p.push(path, e);
        } else if !stream.contains('{') && stream.contains('}') {
            p.push(
                path,
                format!("{stream:?} has a '}}' but no hash tag; companion keys could not share its slot"),
            );
        }
    }
    for (i, s) in streams.iter().enumerate() {
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
        ("inbound.rejected_stream", &rejected_stream),
        ("inbound.dead_letter_stream", &dead_letter_stream),
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
    if rejected_stream == dead_letter_stream {
        p.push(
            "inbound.dead_letter_stream",
            format!("stream {dead_letter_stream:?} is already used by inbound.rejected_stream"),
        );
    }

    Some(InboundConfig {
        keys: InboundKeys::new(&forward_stream),
        streams,
        forward_stream,
        rejected_stream,
        dead_letter_stream,
        max_len,
        dedupe_ttl,
        max_event_bytes,
        fail_policy,
        limiter_attempts,
        rules,
    })
}

fn read_rules(p: &mut Problems, v: Option<Value>) -> Vec<InboundRule> {
    let items = match v {
        Some(Value::Sequence(items)) if !items.is_empty() => items,
        None | Some(Value::Null) | Some(Value::Sequence(_)) => {
            p.push("inbound.rules", "needs at least one rule");
            return Vec::new();
        }
        Some(_) => {
            p.push("inbound.rules", "expected a list of rules");
            return Vec::new();
        }
    };
    let mut rules = Vec::new();
    let mut names = BTreeSet::new();
    for (i, item) in items.into_iter().enumerate() {
        let path = format!("inbound.rules[{i}]");
        let raw: RawRule = p.section(&path, Some(item));
        let known = [
            "name",
            "key",
            "algorithm",
            "limits",
            "burst",
            "min_spacing",
            "count_rejected",
            "mode",
            "default_identity",
        ];
        p.unknown_keys(&path, &raw.unknown, &known);
        let name = p.string(&join(&path, "name"), &raw.name, None);
        if !name.is_empty() {
            if let Err(e) = check_name("rule names", &name) {
                p.push(join(&path, "name"), e);
            } else if !names.insert(name.clone()) {
                p.push(
                    join(&path, "name"),
                    format!("rule {name:?} is defined twice"),
                );
            }
        }
        let key = p.string_list(&join(&path, "key"), &raw.key);
        let mut seen = BTreeSet::new();
        for (j, field) in key.iter().enumerate() {
            let at = format!("{path}.key[{j}]");
            if let Err(e) = check_name("key fields", field) {
                p.push(at, e);
            } else if field.starts_with("pacer_") {
                p.push(at, "pacer_ fields are pacer's own, not an identity");
            } else if !seen.insert(field) {
                p.push(at, format!("{field:?} is listed twice"));
            }
        }
        let no_key = match &raw.key {
            None | Some(Value::Null) => true,
            Some(Value::Sequence(s)) => s.is_empty(),
            Some(_) => false,
        };
        if no_key {
            p.push(
                join(&path, "key"),
                "needs at least one event field naming who is limited, like [source]",
            );
        }
        let algorithm = match &raw.algorithm {
            None | Some(Value::Null) => Some(Algorithm::SlidingLog),
            Some(Value::String(s)) => Algorithm::parse(s),
            Some(_) => None,
        };
        if algorithm.is_none() {
            p.push(
                join(&path, "algorithm"),
                "expected sliding_log, gcra or fixed_window",
            );
        }
        let algorithm = algorithm.unwrap_or(Algorithm::SlidingLog);
        let burst = match &raw.burst {
            None | Some(Value::Null) => None,
            some if algorithm == Algorithm::Gcra => {
                Some(p.integer(&join(&path, "burst"), some, 1, 1, 1_000_000))
            }
            Some(_) => {
                p.push(
                    join(&path, "burst"),
                    format!("applies to algorithm gcra only, not {}", algorithm.as_str()),
                );
                None
            }
        };
        let spacing = match &raw.min_spacing {
            None | Some(Value::Null) => Duration::ZERO,
            some => {
                let d = p.duration(&join(&path, "min_spacing"), some, Duration::ZERO);
                if d.is_zero() {
                    p.push(
                        join(&path, "min_spacing"),
                        "must be more than 0 (or left out)",
                    );
                }
                d
            }
        };
        let mut rates = Vec::new();
        let mut limits = Vec::new();
        let limit_values = match &raw.limits {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Sequence(items)) => items.clone(),
            Some(_) => {
                p.push(
                    join(&path, "limits"),
                    "expected a list of rates like [10/s, 120/min]",
                );
                Vec::new()
            }
        };
        let written = limit_values.len();
        for (j, value) in limit_values.into_iter().enumerate() {
            let at = format!("{path}.limits[{j}]");
            let Some(rate) = p.parsed::<Rate>(&at, &Some(value), "a rate like 10/s") else {
                continue;
            };
            if algorithm == Algorithm::SlidingLog && rate.count() > SLIDING_LOG_MAX {
                p.push(
                    &at,
                    format!(
                        "a sliding log keeps one entry per event: at most {SLIDING_LOG_MAX} per window (use gcra for more)"
                    ),
                );
                continue;
            }
            limits.push(Limit::new(
                rate.count(),
                rate.per_us(),
                burst,
                &rate.to_string(),
            ));
            rates.push(rate);
        }
        if written == 0 && spacing.is_zero() {
            p.push(
                join(&path, "limits"),
                "needs at least one rate (or a min_spacing)",
            );
        }
        let count_rejected = p.boolean(&join(&path, "count_rejected"), &raw.count_rejected, false);
        let shadow = match &raw.mode {
            None | Some(Value::Null) => false,
            Some(Value::String(s)) if s == "enforce" => false,
            Some(Value::String(s)) if s == "shadow" => true,
            Some(_) => {
                p.push(join(&path, "mode"), "expected enforce or shadow");
                false
            }
        };
        let default_identity = match &raw.default_identity {
            None | Some(Value::Null) => None,
            some => {
                let d = p.string(&join(&path, "default_identity"), some, None);
                if d.is_empty() {
                    p.push(join(&path, "default_identity"), "must not be empty");
                }
                Some(d)
            }
        };
        rules.push(InboundRule {
            name,
            key,
            rule: Rule {
                algorithm,
                limits,
                spacing_us: spacing.as_micros() as i64,
                count_rejected,
            },
            rates,
            shadow,
            default_identity,
        });
    }
    rules
}
