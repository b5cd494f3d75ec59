//! Inbound events: the identities an entry is limited as, the fields pacer writes when it
//! forwards or rejects it, and the decision recorded for it.
//!
//! An inbound event needs only the fields its rules name in `key`; each is one identity (raw
//! bytes, so any value works). Everything else is carried through untouched.

use super::{push, Entry, Fields, Reason, Refused};
use crate::config::InboundConfig;

/// Longest identity value accepted (it becomes part of a key name).
pub const MAX_IDENTITY_BYTES: usize = 256;

/// A checked inbound event.
#[derive(Debug, Clone)]
pub struct InboundEvent {
    pub entry: Entry,
    /// The limiter key of every identity the event is checked as: each key field of each rule,
    /// rule by rule, in config order (the order `admit.lua` reads them in, so the rule and field
    /// of each are implied).
    pub identities: Vec<String>,
    /// Its partition (`inbound.partitions`): the index of the keys its identities and
    /// decision are in.
    pub partition: usize,
    /// Every field but the ones pacer writes.
    pub carried: Fields,
}

/// Finds the identities of an entry. Refused: an empty or oversized entry, a key field given
/// twice or too long (`malformed`), a key field missing with no `default_identity`
/// (`missing_key`).
pub fn parse_inbound(entry: Entry, cfg: &InboundConfig) -> Result<InboundEvent, (Entry, Refused)> {
    match identities(&entry, cfg) {
        Ok((partition, identities)) => {
            let carried = entry
                .fields
                .iter()
                .filter(|(name, _)| !super::is_pacer_field(name))
                .cloned()
                .collect();
            Ok(InboundEvent {
                entry,
                identities,
                partition,
                carried,
            })
        }
        Err(refused) => Err((entry, refused)),
    }
}

/// The event's partition and its identities' limiter keys in it.
fn identities(entry: &Entry, cfg: &InboundConfig) -> Result<(usize, Vec<String>), Refused> {
    super::check_size(entry, &cfg.flow, "inbound")?;
    let value = |field: &str| {
        let mut values = entry
            .fields
            .iter()
            .filter(|(k, _)| k.as_slice() == field.as_bytes())
            .map(|(_, v)| v.as_slice());
        let value = values.next();
        if values.next().is_some() {
            return Err(Refused::malformed(format!(
                "the field {field} is given twice"
            )));
        }
        Ok(value)
    };
    let (partition, checks) = resolve(cfg, |_| true, value)?;
    Ok((partition, checks.into_iter().map(|c| c.key).collect()))
}

/// One identity an event or request is checked as: its rule's index in `inbound.rules`, its
/// key field's index in the rule, and its limiter key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub rule: usize,
    pub field: usize,
    pub key: String,
}

/// The partition and the identities of whatever carries the fields `value` finds (a stream
/// entry, a synchronous request), under the rules `applies` picks, in rule and key order.
/// A field absent or empty takes its rule's default identity, or refuses (`missing_key`).
pub fn resolve<'v>(
    cfg: &InboundConfig,
    applies: impl Fn(usize) -> bool,
    value: impl Fn(&str) -> Result<Option<&'v [u8]>, Refused>,
) -> Result<(usize, Vec<Identity>), Refused> {
    let mut found: Vec<(usize, usize, &[u8])> = Vec::new();
    for (r, rule) in cfg.rules.iter().enumerate() {
        if !applies(r) {
            continue;
        }
        for (f, field) in rule.key.iter().enumerate() {
            let value = match (value(field)?.filter(|v| !v.is_empty()), &rule.default_identity) {
                (Some(v), _) => v,
                (None, Some(default)) => default.as_bytes(),
                (None, None) => {
                    return Err(Refused {
                        reason: Reason::MissingKey,
                        detail: format!(
                            "rule {} limits by the field {field}, which the event lacks or leaves empty",
                            rule.name
                        ),
                    })
                }
            };
            if value.len() > MAX_IDENTITY_BYTES {
                return Err(Refused::malformed(format!(
                    "the field {field} is {} bytes, more than {MAX_IDENTITY_BYTES} (it names an identity)",
                    value.len()
                )));
            }
            found.push((r, f, value));
        }
    }
    // With several partitions every rule limits by `partition_by` alone, with one default
    // (config/inbound.rs), so any identity's value is the partition's.
    let partition = match found.first() {
        Some((_, _, value)) => crate::keys::partition(value, cfg.keys.len()),
        None => 0,
    };
    let keys = &cfg.keys[partition];
    let checks = found
        .into_iter()
        .map(|(r, f, value)| {
            let rule = &cfg.rules[r];
            Identity {
                rule: r,
                field: f,
                key: keys.identity(&rule.name, &rule.rule.key_part(), &rule.key[f], value),
            }
        })
        .collect();
    Ok((partition, checks))
}

/// The fields of a forwarded entry (the admission script writes it).
pub fn forward_fields(event: &InboundEvent) -> Fields {
    let mut fields = event.carried.clone();
    push(&mut fields, "pacer_source_stream", &event.entry.stream);
    push(&mut fields, "pacer_source_id", &event.entry.id);
    fields
}

/// The fields of a rejected inbound entry: why, then the forward entry's fields. `admit.lua`
/// writes the same fields in the same order when it writes a rejection itself.
pub fn rejected_fields(event: &InboundEvent, decision: &Decision) -> Fields {
    let mut fields = Fields::new();
    match decision {
        Decision::Rejected {
            retry_us,
            rule,
            limit,
            key,
            ..
        } => {
            push(&mut fields, "pacer_reason", Reason::RateLimited.as_str());
            push(&mut fields, "pacer_rule", rule);
            push(&mut fields, "pacer_limit", limit);
            push(&mut fields, "pacer_key", key);
            push(
                &mut fields,
                "pacer_retry_after_ms",
                (*retry_us.max(&0) as u64).div_ceil(1000),
            );
        }
        _ => {
            push(
                &mut fields,
                "pacer_reason",
                Reason::LimiterUnavailable.as_str(),
            );
            push(
                &mut fields,
                "pacer_detail",
                "admission could not be decided (Redis errors); inbound.fail_policy is fail_closed",
            );
            push(&mut fields, "pacer_retry_after_ms", FAIL_CLOSED_RETRY_MS);
        }
    }
    fields.extend(forward_fields(event));
    fields
}

/// What a fail-closed rejection tells the producer to wait.
pub const FAIL_CLOSED_RETRY_MS: u64 = 1000;

/// The decision recorded for an input entry (its marker's value, see `lua/admit.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// `A`: accepted, and written to the forward stream by the admission script in the step
    /// that decided it; `a` the same, to be written by the worker (the forward stream is in
    /// another slot than the partition's).
    Accepted { written: bool },
    /// `r<retry µs>|<rule>|<limit>|<key field>`: over a limit; `R…` the same, written to the
    /// rejected stream by the admission script in the step that decided it.
    Rejected {
        retry_us: i64,
        rule: String,
        limit: String,
        key: String,
        written: bool,
    },
    /// `o`: admission failed and fail_open let it through (to be written to the forward stream).
    FailedOpen,
    /// `c`: admission failed and fail_closed rejected it.
    FailedClosed,
    /// `v`: delivered more than `worker.max_deliveries` times before any decision: dead-lettered.
    Voided,
}

impl Decision {
    /// The marker value of a decision the worker records itself (the others are the script's).
    pub fn marker(&self) -> &'static str {
        match self {
            Decision::FailedOpen => "o",
            Decision::FailedClosed => "c",
            Decision::Voided => "v",
            Decision::Accepted { .. } => "A",
            Decision::Rejected { .. } => "r",
        }
    }

    pub fn parse(value: &str) -> Option<Decision> {
        let (kind, rest) = value.split_at_checked(1)?;
        match kind {
            "A" | "a" => Some(Decision::Accepted {
                written: kind == "A",
            }),
            "o" => Some(Decision::FailedOpen),
            "c" => Some(Decision::FailedClosed),
            "v" => Some(Decision::Voided),
            "r" | "R" => {
                let mut parts = rest.splitn(4, '|');
                let retry_us = parts.next()?.parse().ok()?;
                Some(Decision::Rejected {
                    retry_us,
                    rule: parts.next()?.to_string(),
                    limit: parts.next()?.to_string(),
                    key: parts.next()?.to_string(),
                    written: kind == "R",
                })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Overrides};

    fn cfg() -> InboundConfig {
        let yaml = r#"
inbound:
  streams: [in]
  max_event_bytes: 400
  rules:
    - {name: per-ip-user, key: [ip, user], limits: [10/s]}
    - {name: per-tenant, key: [tenant], algorithm: gcra, limits: [100/s], default_identity: anonymous}
"#;
        Config::parse(yaml, &Overrides::default())
            .unwrap()
            .inbound
            .unwrap()
    }

    use crate::event::tests::entry;

    #[test]
    fn every_key_field_of_every_rule_is_an_identity() {
        let e = parse_inbound(
            entry(&[
                (b"ip", b"10.0.0.1"),
                (b"user", b"u\xff"),
                (b"pacer_rule", b"x"),
            ]),
            &cfg(),
        )
        .unwrap();
        assert_eq!(
            e.identities,
            vec![
                "pacer:in:{pacer:accepted}:per-ip-user:log:ip=10.0.0.1",
                "pacer:in:{pacer:accepted}:per-ip-user:log:user=u%FF",
                "pacer:in:{pacer:accepted}:per-tenant:gcra.1s:tenant=anonymous",
            ]
        );
        assert_eq!(e.carried.len(), 2, "pacer_ fields are pacer's own");
    }

    #[test]
    fn a_partitioned_flow_puts_each_identity_in_its_values_partition() {
        let yaml = r#"
inbound:
  streams: [in]
  partitions: 8
  partition_by: source
  rules:
    - {name: a, key: [source], limits: [10/s], default_identity: nobody}
    - {name: b, key: [source], algorithm: gcra, limits: [100/s], default_identity: nobody}
"#;
        let cfg = Config::parse(yaml, &Overrides::default())
            .unwrap()
            .inbound
            .unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for source in ["s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9"] {
            let e = parse_inbound(entry(&[(b"source", source.as_bytes())]), &cfg).unwrap();
            let k = crate::keys::partition(source.as_bytes(), 8);
            assert_eq!(e.partition, k);
            seen.insert(k);
            let tag = crate::keys::partition_tag("pacer:accepted", k, 8);
            for id in &e.identities {
                assert_eq!(crate::keys::hash_tag(id), tag, "{id}");
            }
        }
        assert!(seen.len() > 3, "ten sources over 8 partitions: {seen:?}");
        // Binary values, braces included, stay in their partition's slot.
        let odd = parse_inbound(entry(&[(b"source", b"\xff\x00}{x")]), &cfg).unwrap();
        let tag = crate::keys::partition_tag(
            "pacer:accepted",
            crate::keys::partition(b"\xff\x00}{x", 8),
            8,
        );
        assert_eq!(odd.partition, crate::keys::partition(b"\xff\x00}{x", 8));
        for id in &odd.identities {
            assert_eq!(crate::keys::hash_tag(id), tag, "{id}");
        }
        // Lacking the field: the default's partition, where an event naming it lands too.
        let lacking = parse_inbound(entry(&[(b"x", b"1")]), &cfg).unwrap();
        let naming = parse_inbound(entry(&[(b"source", b"nobody")]), &cfg).unwrap();
        assert_eq!(lacking.partition, naming.partition);
        assert_eq!(lacking.identities, naming.identities);
    }

    #[test]
    fn a_missing_key_is_refused_with_the_field_or_takes_the_default() {
        let (_, r) = parse_inbound(entry(&[(b"ip", b"1")]), &cfg()).unwrap_err();
        assert_eq!(r.reason, Reason::MissingKey);
        assert!(r.detail.contains("user"), "{}", r.detail);
        let (_, r) = parse_inbound(entry(&[(b"ip", b"1"), (b"user", b"")]), &cfg()).unwrap_err();
        assert_eq!(r.reason, Reason::MissingKey);
        let (_, r) = parse_inbound(
            entry(&[(b"ip", b"1"), (b"ip", b"2"), (b"user", b"u")]),
            &cfg(),
        )
        .unwrap_err();
        assert!(r.detail.contains("twice"));
        let (_, r) =
            parse_inbound(entry(&[(b"ip", &[b'x'; 300]), (b"user", b"u")]), &cfg()).unwrap_err();
        assert_eq!(r.reason, Reason::Malformed);
        let (_, r) = parse_inbound(entry(&[]), &cfg()).unwrap_err();
        assert_eq!(r.reason, Reason::Malformed);
    }

    #[test]
    fn decisions_read_back_as_written() {
        for (marker, written) in [("r", false), ("R", true)] {
            assert_eq!(
                Decision::parse(&format!("{marker}1500|per-source|10/s|source")),
                Some(Decision::Rejected {
                    retry_us: 1500,
                    rule: "per-source".into(),
                    limit: "10/s".into(),
                    key: "source".into(),
                    written,
                })
            );
        }
        assert_eq!(
            Decision::parse("A"),
            Some(Decision::Accepted { written: true })
        );
        assert_eq!(
            Decision::parse("a"),
            Some(Decision::Accepted { written: false })
        );
        assert_eq!(Decision::parse("c"), Some(Decision::FailedClosed));
        assert_eq!(Decision::parse("r12"), None);
        assert_eq!(Decision::parse(""), None);
    }
}
