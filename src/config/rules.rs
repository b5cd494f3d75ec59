//! The `inbound.rules` list: each rule's name, key fields, algorithm, limits and options, read
//! into the admission maths' `Rule` with every problem and its path.

use super::problems::{join, Problems};
use super::raw::RawRule;
use crate::admission::{Algorithm, Limit, Rule};
use crate::rate::Rate;
use serde_yaml::Value;
use std::collections::BTreeSet;
use std::time::Duration;

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

pub(super) fn read_rules(p: &mut Problems, v: Option<Value>) -> Vec<InboundRule> {
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
