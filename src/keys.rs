//! Every Redis key pacer touches is named here, and nowhere else.
//!
//! Redis Cluster puts a key in the slot of its hash tag: the text between the first `{` and the
//! next `}` when that text is non-empty, else the whole key. A Lua script may only touch keys of one
//! slot, so each script call's keys are built around one tag:
//!
//! - a route's keys (its bucket, its decision markers) take the tag of the route's ready stream,
//!   `pacer:{carrier-a}:ready` by default, so the dispatch XADD and its marker are one atomic step;
//! - a shared output stream (rejected, dead letters) gets companion marker keys `{<its tag>}:…`,
//!   which land in the stream's own slot even when the stream's name carries no braces;
//! - every inbound key (each identity's limiter state, each input entry's decision marker) takes
//!   the tag of the inbound forward stream, so one admission call decides a whole batch, records
//!   each decision and forwards the accepted entries atomically (`InboundKeys`).

/// The part of `key` that Redis Cluster hashes.
pub fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{') {
        if let Some(len) = key[open + 1..].find('}') {
            if len > 0 {
                return &key[open + 1..open + 1 + len];
            }
        }
    }
    key
}

/// Why a stream name cannot be used: a `{` that does not open a usable hash tag makes Redis hash
/// the whole name, which companion keys could not follow.
pub fn check_stream_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.contains('{') && hash_tag(name) == name {
        return Err(format!(
            "{name:?} has a '{{' that opens no hash tag; write a tag like pacer:{{x}}:ready or no braces at all"
        ));
    }
    Ok(())
}

/// The default ready stream of a route.
pub fn default_ready_stream(route: &str) -> String {
    format!("pacer:{{{route}}}:ready")
}

/// Keys of one route, all in the slot of its ready stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteKeys {
    pub ready: String,
    /// Hash of the plan and gate state (`tat`, `dtat`, `last`).
    pub bucket: String,
    marker_prefix: String,
}

impl RouteKeys {
    pub fn new(route: &str, ready_stream: &str) -> Self {
        let tag = hash_tag(ready_stream);
        RouteKeys {
            ready: ready_stream.to_string(),
            bucket: format!("pacer:{{{tag}}}:bucket:{route}"),
            marker_prefix: format!("pacer:{{{tag}}}:ev:{route}:"),
        }
    }

    /// The decision marker of one event on this route: the slot it was given, or that it was
    /// dispatched, or that it was passed over for a fallback.
    pub fn marker(&self, event_id: &str) -> String {
        format!("{}{event_id}", self.marker_prefix)
    }
}

/// A shared output stream (rejected or dead letters) and its write-once markers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputKeys {
    pub stream: String,
    marker_prefix: String,
}

impl OutputKeys {
    pub fn new(stream: &str) -> Self {
        OutputKeys {
            stream: stream.to_string(),
            marker_prefix: format!("{{{}}}:pacer:emitted:", hash_tag(stream)),
        }
    }

    /// Marks one input entry as written to this stream, so a redelivery writes it only once.
    pub fn marker(&self, source_stream: &str, source_id: &str) -> String {
        format!("{}{source_stream}:{source_id}", self.marker_prefix)
    }
}

/// The span of entry-id milliseconds whose inbound decisions share a hash.
pub const DECISION_HASH_MS: u64 = 100;

/// Keys of the inbound flow, all in the slot of the forward stream's hash tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundKeys {
    pub forward: String,
    prefix: String,
}

impl InboundKeys {
    pub fn new(forward_stream: &str) -> Self {
        InboundKeys {
            forward: forward_stream.to_string(),
            prefix: format!("pacer:in:{{{}}}:", hash_tag(forward_stream)),
        }
    }

    /// The hash that records the decisions of input entries whose ids fall in one
    /// `DECISION_HASH_MS` span, each under its owner (`<entry id>@<stream>`), so that a
    /// redelivery gets its decision back instead of being charged again.
    ///
    /// A hash per span, not a key per entry: a batch's decisions are then read with one HMGET
    /// and written with one HSET (a key per entry took a command per event, a fifth of a
    /// decision's cost), and a hash of small fields is smaller than as many keys with TTLs.
    /// Each write renews the hash's TTL, so every decision lives at least `dedupe_ttl`. The span
    /// keeps each hash small enough to expire without a pause (a few thousand fields at most,
    /// at tens of thousands of events per second).
    pub fn decisions(&self, source_id: &str) -> String {
        let ms = source_id.split('-').next().unwrap_or(source_id);
        match ms.parse::<u64>() {
            Ok(ms) => format!("{}decided:{}", self.prefix, ms / DECISION_HASH_MS),
            // Not a stream id; still one fixed hash per id.
            Err(_) => format!("{}decided:{ms}", self.prefix),
        }
    }

    /// One identity's limiter state under one rule, like
    /// `pacer:in:{pacer:accepted}:per-source:log:source=carrier-7`. The value is the event's
    /// bytes, percent-encoded where they are not plain printable ASCII or would touch the tag.
    pub fn identity(&self, rule: &str, algorithm: &str, field: &str, value: &[u8]) -> String {
        let mut key = format!("{}{rule}:{algorithm}:{field}=", self.prefix);
        for &b in value {
            if b.is_ascii_graphic() && !matches!(b, b'{' | b'}' | b'%') {
                key.push(b as char);
            } else {
                key.push_str(&format!("%{b:02X}"));
            }
        }
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_tags_follow_redis_rules() {
        assert_eq!(hash_tag("pacer:{carrier-a}:ready"), "carrier-a");
        assert_eq!(hash_tag("pacer:rejected"), "pacer:rejected");
        assert_eq!(hash_tag("a{}b{c}"), "a{}b{c}");
        assert_eq!(hash_tag("{x}{y}"), "x");
    }

    #[test]
    fn route_keys_share_the_ready_streams_tag() {
        let keys = RouteKeys::new("carrier-a", &default_ready_stream("carrier-a"));
        assert_eq!(keys.ready, "pacer:{carrier-a}:ready");
        for key in [&keys.bucket, &keys.marker("42")] {
            assert_eq!(hash_tag(key), "carrier-a", "{key}");
        }
        let custom = RouteKeys::new("b", "out-b");
        assert_eq!(hash_tag(&custom.bucket), "out-b");
    }

    #[test]
    fn output_markers_land_in_the_streams_slot() {
        let keys = OutputKeys::new("pacer:rejected");
        assert_eq!(hash_tag(&keys.marker("pacer:out", "1-0")), "pacer:rejected");
        let tagged = OutputKeys::new("x:{dead}:y");
        assert_eq!(hash_tag(&tagged.marker("s", "1-0")), "dead");
    }

    #[test]
    fn inbound_keys_share_the_forward_streams_tag_whatever_the_identity() {
        let keys = InboundKeys::new("pacer:accepted");
        let id = keys.identity("r", "log", "ip", b"a}{b c\xff%");
        assert_eq!(id, "pacer:in:{pacer:accepted}:r:log:ip=a%7D%7Bb%20c%FF%25");
        for key in [&id, &keys.decisions("1-0")] {
            assert_eq!(hash_tag(key), "pacer:accepted", "{key}");
        }
        assert_eq!(
            hash_tag(&InboundKeys::new("x:{out}").decisions("1-0")),
            "out"
        );
    }

    #[test]
    fn inbound_decisions_share_a_hash_per_span_of_entry_ids() {
        let keys = InboundKeys::new("fwd");
        assert_eq!(
            keys.decisions("1700000000123-5"),
            "pacer:in:{fwd}:decided:17000000001"
        );
        assert_eq!(
            keys.decisions("1700000000199-0"),
            keys.decisions("1700000000100-9")
        );
        assert_ne!(
            keys.decisions("1700000000199-0"),
            keys.decisions("1700000000200-0")
        );
        assert_eq!(keys.decisions("odd"), "pacer:in:{fwd}:decided:odd");
    }

    #[test]
    fn refuses_braces_that_make_no_tag() {
        assert!(check_stream_name("a{}b").is_err());
        assert!(check_stream_name("a{b").is_err());
        assert!(check_stream_name("pacer:{x}:ready").is_ok());
        assert!(check_stream_name("").is_err());
    }
}
