//! The `inbound.rules` list: each rule's name, key fields, algorithm, limits and options, read
//! into the admission maths' `Rule` with every problem and its path.

use super::problems::{join, Problems};
use super::raw::{RawLease, RawRule};
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
    /// `lease:` (gcra and fixed_window): synchronous callers spend tokens leased in batches
    /// instead of asking Redis for each decision.
    pub lease: Option<Lease>,
}

/// How a rule's tokens are leased to the synchronous API (`src/api/lease.rs`).
///
/// **What leasing may admit over the limit.** A leased token is charged in Redis when it is
/// leased and spent by its worker within `ttl` (never after). A fixed_window lease also ends
/// with the window it was counted in, so its windows never hold more than their limit. A gcra
/// token charged at t is spent by t + ttl, so any rolling window W admits at most what the
/// bucket passes in W + ttl: `rate × ttl` over its bound (`burst + rate × W`), and never more
/// than the tokens leased out at the window's start. The default ttl, 1% of the rule's
/// shortest window, makes that 1% of the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// How long a worker may spend a lease's tokens.
    pub ttl: Duration,
    /// The most tokens one lease takes (the batch adapts between 1 and this).
    pub max: i64,
    /// For gcra, what an identity's bucket holds at most (its smallest burst, in tokens) and
    /// how long it takes to gather that at the limit's rate: a fetch brings no more than the
    /// bucket gathered since the last one, so a worker at the limit must not wait longer than
    /// that between fetches, or tokens are lost (`src/api/lease.rs`). None for fixed_window,
    /// whose count does not leak away.
    pub bucket: Option<(i64, Duration)>,
}

impl Lease {
    /// How long a worker at the limit may go between fetches of `could` tokens without the
    /// bucket losing any: the lease's `span`, or for gcra the time its bucket takes to gather
    /// `could` (or its whole burst, if that is less), whichever is shorter.
    pub fn wait_scale(&self, could: i64, span: Duration) -> Duration {
        match self.bucket {
            Some((tokens, fill)) => {
                let cap = could.clamp(1, tokens.max(1));
                span.min(fill.mul_f64(cap as f64 / tokens.max(1) as f64))
            }
            None => span,
        }
    }

    /// The gap between fetch turns on an identity at its limit (`lua/admission.lua`,
    /// `book_turn`): three quarters of the wait scale of the largest lease over the ttl, so a
    /// missed turn loses little of what the bucket gathers. A turn is shared by every worker,
    /// so it is sized for what the bucket holds, not for one worker's batch (a worker asking
    /// few tokens would make the turns come often); at the limit the batches grow to `max`.
    pub fn turn_gap(&self) -> Duration {
        self.wait_scale(self.max, self.ttl).mul_f64(0.75)
    }
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

/// Reads `lease:` (`true`, or `{ttl, max}`) where the rule allows it: gcra or fixed_window,
/// enforcing, without min_spacing or count_rejected (a leased token is spent where Redis cannot
/// see it: no spacing between spends, no charge for a local rejection).
fn read_lease(
    p: &mut Problems,
    path: &str,
    v: Option<Value>,
    rule: &Rule,
    shadow: bool,
) -> Option<Lease> {
    let v = match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => return None,
        Some(Value::Bool(true)) => None,
        some => some,
    };
    let raw: RawLease = p.section(path, v);
    p.unknown_keys(path, &raw.unknown, &["ttl", "max"]);
    let why_not = if rule.algorithm == Algorithm::SlidingLog {
        Some("sliding_log is exact and stays unleased: use gcra or fixed_window")
    } else if rule.spacing_us > 0 {
        Some("a rule with min_spacing cannot be leased (leased tokens are spent without Redis)")
    } else if rule.count_rejected {
        Some("a rule with count_rejected cannot be leased (a local rejection charges nothing)")
    } else if shadow {
        Some("a shadow rule cannot be leased")
    } else {
        None
    };
    if let Some(why) = why_not {
        p.push(path, why);
        return None;
    }
    let shortest = rule
        .limits
        .iter()
        .map(|l| l.window_us)
        .min()
        .unwrap_or(1_000_000);
    let smallest = rule.limits.iter().map(|l| l.count).min().unwrap_or(1);
    let default_ttl = Duration::from_micros((shortest as u64 / 100).max(1_000));
    let ttl = p.duration(&join(path, "ttl"), &raw.ttl, default_ttl);
    if ttl.is_zero() || ttl.as_micros() as i64 > shortest {
        p.push(
            join(path, "ttl"),
            "must be more than 0 and at most the rule's shortest window",
        );
    }
    let max = p.integer(
        &join(path, "max"),
        &raw.max,
        (smallest as u64 / 100).max(1),
        1,
        smallest.max(1) as u64,
    ) as i64;
    let bucket = (rule.algorithm == Algorithm::Gcra)
        .then(|| {
            rule.limits
                .iter()
                .map(|l| {
                    let tokens = l.tolerance_us / l.interval_us.max(1) + 1;
                    (
                        tokens,
                        Duration::from_micros((tokens * l.interval_us) as u64),
                    )
                })
                .min()
        })
        .flatten();
    Some(Lease { ttl, max, bucket })
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
            "lease",
        ];
        p.unknown_keys(&path, &raw.unknown, &known);
        let name = p.string(&join(&path, "name"), &raw.name, None);
        // An empty name given is checked like any other (it ran, as rule "", found by review);
        // one missing or not a string is said already.
        if !p.said(&join(&path, "name")) {
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
                let at = join(&path, "min_spacing");
                let d = p.duration(&at, some, Duration::ZERO);
                if d.is_zero() && !p.said(&at) {
                    p.push(at, "must be more than 0 (or left out)");
                } else if d < Duration::from_micros(1) && !p.said(&at) {
                    // Spacing is kept in whole microseconds: 500ns became 0, and the rule
                    // limited nothing.
                    p.push(at, "must be at least 1us (spacing is kept in microseconds)");
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
                } else if d.len() > crate::event::inbound::MAX_IDENTITY_BYTES {
                    // Checked per event otherwise: every event without the field was
                    // dead-lettered, its detail blaming a field it did not have.
                    p.push(
                        join(&path, "default_identity"),
                        format!(
                            "is {} bytes; an identity is at most {}",
                            d.len(),
                            crate::event::inbound::MAX_IDENTITY_BYTES
                        ),
                    );
                }
                Some(d)
            }
        };
        let rule = Rule {
            algorithm,
            limits,
            spacing_us: spacing.as_micros() as i64,
            count_rejected,
        };
        let lease = read_lease(p, &join(&path, "lease"), raw.lease, &rule, shadow);
        rules.push(InboundRule {
            name,
            key,
            rule,
            rates,
            shadow,
            default_identity,
            lease,
        });
    }
    rules
}
