//! Outbound events: what a producer's stream entry must hold, how it is checked, and the fields
//! pacer writes when it hands the event on.
//!
//! Field names and values stay raw bytes end to end, so an event with junk bytes is carried or
//! dead-lettered intact rather than mangled. Only the fields pacer reads (`route`, `id`, `cost`,
//! `max_wait_ms`) must be text.

pub mod inbound;

use crate::config::OutboundConfig;
use std::sync::Arc;
use std::time::Duration;

/// A stream entry's fields, in order, as bytes.
pub type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// The fields pacer writes; an input field of the same name is replaced, not duplicated.
pub const PACER_FIELDS: &[&str] = &[
    "pacer_route",
    "pacer_slot_ms",
    "pacer_wait_ms",
    "pacer_source_stream",
    "pacer_source_id",
    "pacer_reason",
    "pacer_detail",
    "pacer_retry_after_ms",
    "pacer_rule",
    "pacer_limit",
    "pacer_key",
];

/// Longest `id` accepted: it becomes part of a key name.
pub const MAX_ID_BYTES: usize = 200;
/// Most units one event may cost.
pub const MAX_COST: u64 = 1_000_000;

/// One entry read from an input stream.
#[derive(Debug, Clone)]
pub struct Entry {
    pub stream: Arc<str>,
    pub id: String,
    pub fields: Fields,
    /// How many times the group has delivered it (1 on a first read).
    pub deliveries: u64,
}

impl Entry {
    /// Names the entry in markers: `<entry id>@<stream>`.
    pub fn owner(&self) -> String {
        format!("{}@{}", self.id, self.stream)
    }
}

/// Why an entry goes to the dead-letter or rejected stream: the `pacer_reason` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    Malformed,
    UnknownRoute,
    /// Another entry already carried this event `id` (a producer's retry).
    Duplicate,
    /// Delivered more than `worker.max_deliveries` times without finishing.
    TooManyDeliveries,
    /// No route could take the event within its wait.
    QueueFull,
    /// Inbound: the event lacks a field its rule's `key` names (and the rule has no
    /// `default_identity`).
    MissingKey,
    /// Inbound: over a rule's limit.
    RateLimited,
    /// Inbound: admission could not be decided (Redis errors) and `fail_policy` is fail_closed.
    LimiterUnavailable,
}

impl Reason {
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::Malformed => "malformed",
            Reason::UnknownRoute => "unknown_route",
            Reason::Duplicate => "duplicate",
            Reason::TooManyDeliveries => "too_many_deliveries",
            Reason::QueueFull => "queue_full",
            Reason::MissingKey => "missing_key",
            Reason::RateLimited => "rate_limited",
            Reason::LimiterUnavailable => "limiter_unavailable",
        }
    }
}

/// An entry that cannot be paced, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub reason: Reason,
    pub detail: String,
}

impl Refused {
    pub(crate) fn malformed(detail: impl Into<String>) -> Self {
        Refused {
            reason: Reason::Malformed,
            detail: detail.into(),
        }
    }
}

/// A checked outbound event.
#[derive(Debug, Clone)]
pub struct OutboundEvent {
    pub entry: Entry,
    /// The idempotency key: the `id` field, else `<stream>/<entry id>` so that entries of two
    /// input streams never collide.
    pub event_id: String,
    pub owner: String,
    /// The routes to try, in order: the event's route, then its fallbacks.
    pub routes: Vec<String>,
    pub cost: u64,
    /// The event's own `max_wait_ms`, if it set one (each route's `max_wait` caps it).
    pub max_wait: Option<Duration>,
    /// Every field but the ones pacer writes.
    pub carried: Fields,
}

/// Checks an entry against the config. Route names come only from the config: an event naming
/// another route is refused here, before any key is built from it.
pub fn parse_outbound(
    entry: Entry,
    cfg: &OutboundConfig,
) -> Result<OutboundEvent, (Entry, Refused)> {
    match check(&entry, cfg) {
        Ok((route, event_id, cost, max_wait)) => {
            let mut routes = vec![route.clone()];
            routes.extend(cfg.routes[&route].fallbacks.iter().cloned());
            let carried = entry
                .fields
                .iter()
                .filter(|(name, _)| !is_pacer_field(name))
                .cloned()
                .collect();
            Ok(OutboundEvent {
                event_id: event_id.unwrap_or_else(|| format!("{}/{}", entry.stream, entry.id)),
                owner: entry.owner(),
                entry,
                routes,
                cost,
                max_wait,
                carried,
            })
        }
        Err(refused) => Err((entry, refused)),
    }
}

type Checked = (String, Option<String>, u64, Option<Duration>);

fn check(entry: &Entry, cfg: &OutboundConfig) -> Result<Checked, Refused> {
    if entry.fields.is_empty() {
        return Err(Refused::malformed("the entry has no fields"));
    }
    let size: usize = entry.fields.iter().map(|(k, v)| k.len() + v.len()).sum();
    if size > cfg.max_event_bytes {
        return Err(Refused::malformed(format!(
            "the event is {size} bytes, more than outbound.max_event_bytes ({})",
            cfg.max_event_bytes
        )));
    }
    let route = match text_field(entry, "route")? {
        None => return Err(Refused::malformed("no route field")),
        Some(r) => r,
    };
    if !cfg.routes.contains_key(route) {
        return Err(Refused {
            reason: Reason::UnknownRoute,
            detail: format!("no route named {route:?} is configured"),
        });
    }
    let id = match text_field(entry, "id")? {
        Some(id)
            if id.is_empty() || id.len() > MAX_ID_BYTES || id.chars().any(char::is_control) =>
        {
            return Err(Refused::malformed(format!(
                "id must be 1 to {MAX_ID_BYTES} bytes of printable text"
            )))
        }
        other => other.map(str::to_string),
    };
    let cost = match text_field(entry, "cost")? {
        None => 1,
        Some(c) => match c.parse::<u64>() {
            Ok(n) if (1..=MAX_COST).contains(&n) => n,
            _ => {
                return Err(Refused::malformed(format!(
                    "cost must be a whole number from 1 to {MAX_COST}, got {c:?}"
                )))
            }
        },
    };
    let max_wait = match text_field(entry, "max_wait_ms")? {
        None => None,
        Some(m) => match m.parse::<u64>() {
            Ok(ms) => Some(Duration::from_millis(ms)),
            Err(_) => {
                return Err(Refused::malformed(format!(
                    "max_wait_ms must be a whole number of milliseconds, got {m:?}"
                )))
            }
        },
    };
    Ok((route.to_string(), id, cost, max_wait))
}

/// The one value of a field pacer reads; a field given twice is ambiguous, and so malformed.
pub(crate) fn text_field<'a>(entry: &'a Entry, name: &str) -> Result<Option<&'a str>, Refused> {
    let mut found = None;
    for (k, v) in &entry.fields {
        if k.as_slice() == name.as_bytes() {
            if found.is_some() {
                return Err(Refused::malformed(format!(
                    "the field {name} is given twice"
                )));
            }
            let text = std::str::from_utf8(v)
                .map_err(|_| Refused::malformed(format!("the field {name} is not UTF-8 text")))?;
            found = Some(text);
        }
    }
    Ok(found)
}

pub(crate) fn push(fields: &mut Fields, name: &str, value: impl ToString) {
    fields.push((name.as_bytes().to_vec(), value.to_string().into_bytes()));
}

/// The fields of a ready entry, less the slot and wait (which the scripts or the dispatcher add).
pub fn ready_fields(event: &OutboundEvent, route: &str) -> Fields {
    let mut fields = event.carried.clone();
    push(&mut fields, "pacer_route", route);
    push(&mut fields, "pacer_source_stream", &event.entry.stream);
    push(&mut fields, "pacer_source_id", &event.entry.id);
    fields
}

/// The fields of a rejected entry.
pub fn rejected_fields(event: &OutboundEvent, reason: Reason, retry_after_ms: i64) -> Fields {
    let mut fields = event.carried.clone();
    push(&mut fields, "pacer_route", &event.routes[0]);
    push(&mut fields, "pacer_reason", reason.as_str());
    push(&mut fields, "pacer_retry_after_ms", retry_after_ms.max(0));
    push(&mut fields, "pacer_source_stream", &event.entry.stream);
    push(&mut fields, "pacer_source_id", &event.entry.id);
    fields
}

/// Whether a field is one pacer writes on its outputs (an input's own copy is not carried:
/// a re-injected output would otherwise carry two `pacer_reason`s, say).
pub(crate) fn is_pacer_field(name: &[u8]) -> bool {
    PACER_FIELDS.iter().any(|p| p.as_bytes() == name)
}

/// The fields of a dead letter: every original field, untouched (but for pacer's own, which are
/// written afresh), then why.
pub fn dead_letter_fields(entry: &Entry, refused: &Refused) -> Fields {
    let mut fields: Fields = entry
        .fields
        .iter()
        .filter(|(name, _)| !is_pacer_field(name))
        .cloned()
        .collect();
    push(&mut fields, "pacer_reason", refused.reason.as_str());
    push(&mut fields, "pacer_detail", &refused.detail);
    push(&mut fields, "pacer_source_stream", &entry.stream);
    push(&mut fields, "pacer_source_id", &entry.id);
    fields
}

/// A decision marker's value, `<kind><number>|<owner>`, as the scripts write it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Marker {
    /// A slot was reserved (µs of Redis time).
    Slot(i64),
    /// Dispatched; the ready entry's milliseconds.
    Dispatched(i64),
    /// Passed over for a fallback; the wait it would have had (µs).
    Skipped(i64),
    /// Voided: the entry was delivered too often and is dead-lettered (`scripts/void.lua`).
    Voided,
}

/// Parses a marker value into the decision and the entry that owns it.
pub fn parse_marker(value: &str) -> Option<(Marker, &str)> {
    let (head, owner) = value.split_once('|')?;
    let (kind, number) = head.split_at_checked(1)?;
    let number: i64 = number.split('-').next()?.parse().ok()?;
    let marker = match kind {
        "s" => Marker::Slot(number),
        "d" => Marker::Dispatched(number),
        "x" => Marker::Skipped(number),
        "v" => Marker::Voided,
        _ => return None,
    };
    Some((marker, owner))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Overrides};

    fn cfg() -> OutboundConfig {
        Config::parse(
            "outbound:\n  streams: [in]\n  max_event_bytes: 200\n  routes:\n    a: {rate: 10/s, fallbacks: [b]}\n    b: {rate: 5/s}\n",
            &Overrides::default(),
        )
        .unwrap()
        .outbound
    }

    /// An entry of stream `in` with these fields, delivered once (also for `event::inbound`).
    pub(crate) fn entry(fields: &[(&[u8], &[u8])]) -> Entry {
        Entry {
            stream: "in".into(),
            id: "1-0".into(),
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_vec(), v.to_vec()))
                .collect(),
            deliveries: 1,
        }
    }

    fn refused(fields: &[(&[u8], &[u8])]) -> Refused {
        parse_outbound(entry(fields), &cfg()).unwrap_err().1
    }

    #[test]
    fn reads_a_good_event_and_carries_its_fields() {
        let e = parse_outbound(
            entry(&[
                (b"route", b"a"),
                (b"to", b"+3312"),
                (b"pacer_route", b"forged"),
                (b"cost", b"2"),
            ]),
            &cfg(),
        )
        .unwrap();
        assert_eq!(e.routes, vec!["a", "b"]);
        assert_eq!(e.event_id, "in/1-0");
        assert_eq!(e.cost, 2);
        let names: Vec<&[u8]> = e.carried.iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(names, vec![&b"route"[..], b"to", b"cost"]);
    }

    #[test]
    fn refuses_each_kind_of_bad_event_with_a_reason() {
        assert_eq!(refused(&[(b"to", b"x")]).detail, "no route field");
        assert_eq!(refused(&[(b"route", b"zz")]).reason, Reason::UnknownRoute);
        assert!(refused(&[(b"route", b"a"), (b"cost", b"0")])
            .detail
            .contains("cost"));
        assert!(refused(&[(b"route", b"a"), (b"cost", b"-1")])
            .detail
            .contains("cost"));
        assert!(refused(&[(b"route", b"a"), (b"cost", b"1.5")])
            .detail
            .contains("cost"));
        assert!(refused(&[(b"route", b"\xff\xfe")]).detail.contains("UTF-8"));
        assert!(refused(&[(b"route", b"a"), (b"route", b"b")])
            .detail
            .contains("twice"));
        assert!(refused(&[(b"route", b"a"), (b"max_wait_ms", b"soon")])
            .detail
            .contains("max_wait_ms"));
        assert!(refused(&[(b"route", b"a"), (b"id", b"")])
            .detail
            .contains("id"));
        assert!(refused(&[(b"route", b"a"), (b"blob", &[7u8; 300])])
            .detail
            .contains("bytes"));
        assert!(refused(&[]).detail.contains("no fields"));
    }

    #[test]
    fn dead_letters_keep_junk_bytes_intact() {
        let e = entry(&[(b"\x00\xff", b"\xfe")]);
        let r = refused(&[(b"\x00\xff", b"\xfe")]);
        let fields = dead_letter_fields(&e, &r);
        assert_eq!(fields[0], (b"\x00\xff".to_vec(), b"\xfe".to_vec()));
        assert!(fields.contains(&(b"pacer_reason".to_vec(), b"malformed".to_vec())));
    }

    #[test]
    fn parses_marker_values() {
        assert_eq!(
            parse_marker("s123|1-0@in"),
            Some((Marker::Slot(123), "1-0@in"))
        );
        assert_eq!(
            parse_marker("d1700-3|1-0@in"),
            Some((Marker::Dispatched(1700), "1-0@in"))
        );
        assert_eq!(parse_marker("x5|o"), Some((Marker::Skipped(5), "o")));
        assert_eq!(parse_marker("v0|o"), Some((Marker::Voided, "o")));
        assert_eq!(parse_marker("junk"), None);
    }
}
