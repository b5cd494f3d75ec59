//! Outbound events: what a producer's stream entry must hold, how it is checked, and the fields
//! pacer writes when it hands the event on.
//!
//! Field names and values stay raw bytes end to end, so an event with junk bytes is carried or
//! dead-lettered intact rather than mangled. Only the fields pacer reads (`route`, `id`, `cost`,
//! `max_wait_ms`) must be text. Fields named `pacer_…` are pacer's own: an input's are not
//! carried, and pacer writes its own afresh.
//!
//! Over 400 lines: checking an event and building every output's fields, with their unit tests.

pub mod inbound;
pub mod payload;

pub use payload::Payload;

use crate::config::{Flow, OutboundConfig};
use crate::pacing;
use std::sync::Arc;
use std::time::Duration;

/// A stream entry's fields, in order, as bytes.
pub type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// Bytes `fields` take packed (`Payload::packed_len`: each name and value with its 4-byte
/// length), what a call carrying them is measured by (`scripts::call_len`).
pub fn packed_len(fields: &Fields) -> usize {
    fields.iter().map(|(k, v)| k.len() + v.len() + 8).sum()
}

/// Longest `id` accepted: it becomes part of a key name.
pub const MAX_ID_BYTES: usize = 200;
/// Most units one event may cost (and never more than its route's burst).
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
    /// Names the entry in id claims: `<entry id>@<stream>`.
    pub fn owner(&self) -> String {
        owner(&self.stream, &self.id)
    }

    /// Bytes of its field names and values (what `max_event_bytes` and `read_bytes` count).
    pub fn size(&self) -> usize {
        self.fields.iter().map(|(k, v)| k.len() + v.len()).sum()
    }

    /// The milliseconds of its id (when it was added, by Redis's clock); 0 if unreadable.
    pub fn ms(&self) -> i64 {
        entry_ms(&self.id)
    }
}

/// `<entry id>@<stream>`.
pub fn owner(stream: &str, id: &str) -> String {
    format!("{id}@{stream}")
}

/// The milliseconds of an entry id; 0 if unreadable.
pub fn entry_ms(id: &str) -> i64 {
    id.split('-')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0)
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
    /// Too old: read after its route's `max_age` (rejected), or pending longer than
    /// `dedupe_ttl` with no decision on record (dead-lettered: one may have expired).
    Expired,
    /// Inbound: the event lacks a field its rule's `key` names (and the rule has no
    /// `default_identity`).
    MissingKey,
    /// Inbound: over a rule's limit.
    RateLimited,
    /// Inbound: admission could not be decided (Redis errors) and `fail_policy` is fail_closed.
    LimiterUnavailable,
    /// Outbound: its route's calls fail with an error retrying cannot fix (a key of the route
    /// holds the wrong kind of value); the detail names the route and the error.
    RouteBroken,
}

impl Reason {
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::Malformed => "malformed",
            Reason::UnknownRoute => "unknown_route",
            Reason::Duplicate => "duplicate",
            Reason::TooManyDeliveries => "too_many_deliveries",
            Reason::QueueFull => "queue_full",
            Reason::Expired => "expired",
            Reason::MissingKey => "missing_key",
            Reason::RateLimited => "rate_limited",
            Reason::LimiterUnavailable => "limiter_unavailable",
            Reason::RouteBroken => "route_broken",
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

    /// An entry whose id is `age_us` old, past `ttl` (the setting's path), with no decision on
    /// record: one may have expired, so it is not decided again.
    pub(crate) fn stale(age_us: i64, ttl: &str) -> Self {
        Refused {
            reason: Reason::Expired,
            detail: format!(
                "its entry id is {} s old (Redis's clock), more than {ttl}, and no decision is on record: one may have expired, so it is not decided again (an id set by hand, not by XADD's *, is as old as its number says)",
                age_us / 1_000_000
            ),
        }
    }
}

/// A checked outbound event. It keeps what it needs and no more: a worker may hold a hundred
/// thousand of them asleep.
#[derive(Debug, Clone)]
pub struct OutboundEvent {
    /// The input stream that carries it (its entry id is `carried`'s head: `id()`).
    pub stream: Arc<str>,
    pub deliveries: u64,
    /// The producer's idempotency key (`id`), if it gave one; without it the entry is the event.
    pub event_id: Option<Box<str>>,
    /// Its own route (`Route::index`); its fallbacks come from the config.
    pub route: usize,
    pub cost: u64,
    /// The event's own `max_wait_ms`, if it set one (each route's `max_wait` caps it).
    pub max_wait: Option<Duration>,
    /// Its entry id, then every field but pacer's own, packed.
    pub carried: Payload,
}

impl OutboundEvent {
    /// The id of the input entry that carries it.
    pub fn id(&self) -> &str {
        // Made from the entry's id, a `String`.
        std::str::from_utf8(self.carried.head()).unwrap_or_default()
    }

    pub fn owner(&self) -> String {
        owner(&self.stream, self.id())
    }

    pub fn ms(&self) -> i64 {
        entry_ms(self.id())
    }

    /// The entry again, with the fields it carries (for dead letters).
    pub fn entry(&self) -> Entry {
        Entry {
            stream: self.stream.clone(),
            id: self.id().to_string(),
            fields: self.carried.to_fields(),
            deliveries: self.deliveries,
        }
    }

    /// The event's idempotency key as its markers name it: the producer's `id`, else
    /// `<stream>/<entry id>`.
    pub fn key(&self) -> String {
        match &self.event_id {
            Some(id) => id.to_string(),
            None => format!("{}/{}", self.stream, self.id()),
        }
    }
}

/// Checks an entry against the config. Route names come only from the config: an event naming
/// another route is refused here, before any key is built from it.
pub fn parse_outbound(
    entry: Entry,
    cfg: &OutboundConfig,
) -> Result<OutboundEvent, (Entry, Refused)> {
    match check(&entry, cfg) {
        Ok((route, event_id, cost, max_wait)) => {
            let carried = Payload::new(
                entry.id.as_bytes(),
                entry
                    .fields
                    .iter()
                    .filter(|(name, _)| !is_pacer_field(name))
                    .map(|(k, v)| (k.as_slice(), v.as_slice())),
            );
            Ok(OutboundEvent {
                stream: entry.stream,
                deliveries: entry.deliveries,
                event_id: event_id.map(String::into_boxed_str),
                route,
                cost,
                max_wait,
                carried,
            })
        }
        Err(refused) => Err((entry, refused)),
    }
}

type Checked = (usize, Option<String>, u64, Option<Duration>);

/// Checks the entry's size first (a huge or wide entry is refused before anything reads it).
pub(crate) fn check_size(entry: &Entry, flow: &Flow, section: &str) -> Result<(), Refused> {
    let (max_fields, max_bytes) = (flow.max_event_fields, flow.max_event_bytes);
    if entry.fields.is_empty() {
        return Err(Refused::malformed("the entry has no fields"));
    }
    if entry.fields.len() > max_fields {
        return Err(Refused::malformed(format!(
            "the event has {} fields, more than {section}.max_event_fields ({max_fields})",
            entry.fields.len()
        )));
    }
    let size = entry.size();
    if size > max_bytes {
        return Err(Refused::malformed(format!(
            "the event is {size} bytes, more than {section}.max_event_bytes ({max_bytes})"
        )));
    }
    Ok(())
}

fn check(entry: &Entry, cfg: &OutboundConfig) -> Result<Checked, Refused> {
    check_size(entry, &cfg.flow, "outbound")?;
    let route = match text_field(entry, "route")? {
        None => return Err(Refused::malformed("no route field")),
        Some(r) => r,
    };
    let Some(route) = cfg.routes.get(route) else {
        return Err(Refused {
            reason: Reason::UnknownRoute,
            detail: format!("no route named {route:?} is configured"),
        });
    };
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
    if !pacing::fits(cost as i64, &route.bucket) {
        return Err(Refused::malformed(format!(
            "cost {cost} is more than route {}'s burst ({}): it could never pass",
            route.name, route.burst
        )));
    }
    let max_wait = match text_field(entry, "max_wait_ms")? {
        None => None,
        Some(m) => Some(parse_max_wait(m).ok_or_else(|| {
            Refused::malformed(format!(
                "max_wait_ms must be a number of milliseconds, 0 or more, got {m:?}"
            ))
        })?),
    };
    Ok((route.index, id, cost, max_wait))
}

/// `max_wait_ms` as a duration: any number of milliseconds from 0 up, whole or not, however
/// large (each route's `max_wait` caps it, so a huge one means "as long as the route allows").
fn parse_max_wait(text: &str) -> Option<Duration> {
    let ms: f64 = text.trim().parse().ok()?;
    if !ms.is_finite() || ms < 0.0 {
        return None;
    }
    // Past a year it is capped anyway; staying below keeps the conversion exact and in range.
    let cap_ms = crate::config::DURATION_MAX.as_secs_f64() * 1e3;
    Some(Duration::from_secs_f64(ms.min(cap_ms) / 1e3))
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

/// The fields of a rejected entry: what it carried, then why and where it came from.
pub fn rejected_fields(
    event: &OutboundEvent,
    route: &str,
    reason: Reason,
    detail: &str,
    retry_after_ms: i64,
) -> Fields {
    let mut fields = event.carried.to_fields();
    push(&mut fields, "pacer_route", route);
    push(&mut fields, "pacer_reason", reason.as_str());
    push(&mut fields, "pacer_detail", detail);
    push(&mut fields, "pacer_retry_after_ms", retry_after_ms.max(0));
    push(&mut fields, "pacer_source_stream", &event.stream);
    push(&mut fields, "pacer_source_id", event.id());
    fields
}

/// Whether a field is one pacer writes on its outputs (an input's own copy is not carried: a
/// re-injected output would otherwise carry two `pacer_reason`s, say).
pub(crate) fn is_pacer_field(name: &[u8]) -> bool {
    name.starts_with(b"pacer_")
}

/// The most of an entry a dead letter copies: a dead letter is for reading why an entry failed,
/// and an entry refused for its size must not fill the dead-letter stream with a copy of itself.
pub const DEAD_LETTER_COPY_BYTES: usize = 64 * 1024;
/// The most fields a dead letter copies, for the same reason.
pub const DEAD_LETTER_COPY_FIELDS: usize = 256;

/// The fields of a dead letter: the original fields in order (but for pacer's own, which are
/// written afresh), up to [`DEAD_LETTER_COPY_FIELDS`] fields and [`DEAD_LETTER_COPY_BYTES`]
/// bytes (the field that runs over keeps the start of its value); then, if it was cut,
/// `pacer_truncated` saying how much of the original it holds; then why.
pub fn dead_letter_fields(entry: &Entry, refused: &Refused) -> Fields {
    let mut fields = Fields::new();
    let mut bytes = 0;
    let mut cut = false;
    for (name, value) in entry
        .fields
        .iter()
        .filter(|(name, _)| !is_pacer_field(name))
    {
        let size = name.len() + value.len();
        if fields.len() == DEAD_LETTER_COPY_FIELDS {
            cut = true;
            break;
        }
        if bytes + size > DEAD_LETTER_COPY_BYTES {
            // The field that runs over: its name and the start of its value, if the name fits.
            let room = DEAD_LETTER_COPY_BYTES - bytes;
            if name.len() <= room {
                let value = value[..room - name.len()].to_vec();
                bytes += name.len() + value.len();
                fields.push((name.clone(), value));
            }
            cut = true;
            break;
        }
        bytes += size;
        fields.push((name.clone(), value.clone()));
    }
    if cut {
        let total = entry.size();
        let note = format!(
            "copied {} of {} fields, {bytes} of {total} bytes",
            fields.len(),
            entry.fields.len()
        );
        push(&mut fields, "pacer_truncated", note);
    }
    push(&mut fields, "pacer_reason", refused.reason.as_str());
    push(&mut fields, "pacer_detail", &refused.detail);
    push(&mut fields, "pacer_source_stream", &entry.stream);
    push(&mut fields, "pacer_source_id", &entry.id);
    fields
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::{Config, Overrides};

    fn cfg() -> OutboundConfig {
        Config::parse(
            "outbound:\n  streams: [in]\n  max_event_bytes: 200\n  max_event_fields: 5\n  routes:\n    a: {rate: 10/s, burst: 3, max_wait: 2s, fallbacks: [b]}\n    b: {rate: 5/s}\n",
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
        let cfg = cfg();
        let e = parse_outbound(
            entry(&[
                (b"route", b"a"),
                (b"to", b"+3312"),
                (b"pacer_route", b"forged"),
                (b"pacer_anything", b"x"),
                (b"cost", b"2"),
            ]),
            &cfg,
        )
        .unwrap();
        let chain: Vec<&str> = cfg.chain(e.route).iter().map(|r| r.name.as_str()).collect();
        assert_eq!(chain, vec!["a", "b"]);
        assert_eq!(e.key(), "in/1-0");
        assert_eq!(e.cost, 2);
        let names: Vec<&[u8]> = e.carried.iter().map(|(k, _)| k).collect();
        assert_eq!(names, vec![&b"route"[..], b"to", b"cost"]);
    }

    #[test]
    fn refuses_each_kind_of_bad_event_with_a_reason() {
        assert_eq!(refused(&[(b"to", b"x")]).detail, "no route field");
        assert_eq!(refused(&[(b"route", b"zz")]).reason, Reason::UnknownRoute);
        for bad in [&b"0"[..], b"-1", b"1.5"] {
            assert!(refused(&[(b"route", b"a"), (b"cost", bad)])
                .detail
                .contains("cost"));
        }
        // More than the route's burst (3): it could never pass.
        assert!(refused(&[(b"route", b"a"), (b"cost", b"4")])
            .detail
            .contains("burst"));
        assert!(refused(&[(b"route", b"\xff\xfe")]).detail.contains("UTF-8"));
        assert!(refused(&[(b"route", b"a"), (b"route", b"b")])
            .detail
            .contains("twice"));
        for bad in [&b"soon"[..], b"-1", b"NaN", b"inf"] {
            assert!(refused(&[(b"route", b"a"), (b"max_wait_ms", bad)])
                .detail
                .contains("max_wait_ms"));
        }
        assert!(refused(&[(b"route", b"a"), (b"id", b"")])
            .detail
            .contains("id"));
        assert!(refused(&[(b"route", b"a"), (b"blob", &[7u8; 300])])
            .detail
            .contains("bytes"));
        let mut wide: Vec<(&[u8], &[u8])> = vec![(b"", b""); 5];
        wide.push((b"route", b"a"));
        assert!(refused(&wide).detail.contains("max_event_fields"));
        assert!(refused(&[]).detail.contains("no fields"));
    }

    #[test]
    fn max_wait_ms_is_any_amount_and_the_route_caps_it() {
        let cfg = cfg();
        for (text, ms) in [
            ("0", 0.0),
            ("1500", 1500.0),
            ("2.5", 2.5),
            ("1e30", 365.0 * 24.0 * 3600.0 * 1e3),
        ] {
            let e = parse_outbound(
                entry(&[(b"route", b"a"), (b"max_wait_ms", text.as_bytes())]),
                &cfg,
            )
            .unwrap();
            let got = e.max_wait.unwrap().as_secs_f64() * 1e3;
            assert!((got - ms).abs() < 1e-3, "{text}: {got}");
        }
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
    fn a_dead_letter_copies_a_bounded_part_of_a_huge_or_wide_entry() {
        let huge = entry(&[(b"route", b"a"), (b"blob", &vec![b'x'; 10 << 20])]);
        let fields = dead_letter_fields(&huge, &Refused::malformed("too big"));
        let size: usize = fields.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(size < DEAD_LETTER_COPY_BYTES + 1024, "{size}");
        let note = fields
            .iter()
            .find(|(k, _)| k == b"pacer_truncated")
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .unwrap();
        assert!(
            note.contains(&format!("of {} bytes", (10 << 20) + 10)),
            "{note}"
        );
        // The start of the huge value is kept, up to the bound.
        let blob = fields.iter().find(|(k, _)| k == b"blob").unwrap();
        assert_eq!(blob.1.len(), DEAD_LETTER_COPY_BYTES - 10);
        let wide = Entry {
            fields: (0..5000)
                .map(|i| (i.to_string().into_bytes(), vec![]))
                .collect(),
            ..entry(&[])
        };
        let fields = dead_letter_fields(&wide, &Refused::malformed("wide"));
        assert!(fields.len() <= DEAD_LETTER_COPY_FIELDS + 5);
    }
}
