//! What the `outbound:` and `inbound:` sections share, read alike: the input streams, the two
//! shared output streams, their trim, the deduplication window and the limits on an event.

use super::problems::Problems;
use super::raw::RawFlow;
use std::time::Duration;

/// The default of `max_event_fields`.
pub const MAX_EVENT_FIELDS_DEFAULT: usize = 1000;
/// The most `max_event_fields` may be: an event passes through a Lua script as two values per
/// field, and Lua's unpack stops at about 8,000 (`lua/lib.lua` MAX_FIELDS is 3,500).
pub const MAX_EVENT_FIELDS: usize = 3000;

/// What a flow (`outbound:` or `inbound:`) has in common with the other.
#[derive(Debug, Clone)]
pub struct Flow {
    /// The input streams it reads.
    pub streams: Vec<String>,
    pub rejected_stream: String,
    pub dead_letter_stream: String,
    /// Output streams are trimmed to about this many entries, never below what a consumer group
    /// on them still needs (`lib.lua` `trim`).
    pub max_len: u64,
    /// How long decisions and markers live: the window in which a redelivered entry or a
    /// repeated event id is recognised, and the age past which an entry with nothing on record
    /// is not decided (it is dead-lettered `expired`).
    pub dedupe_ttl: Duration,
    pub max_event_bytes: usize,
    /// Most fields one event may carry; a wider one is dead-lettered (`malformed`).
    pub max_event_fields: usize,
}

impl Flow {
    /// The settings of a flow the config leaves out.
    pub fn defaults(rejected_stream: &str) -> Self {
        Flow {
            streams: Vec::new(),
            rejected_stream: rejected_stream.into(),
            dead_letter_stream: "pacer:dead".into(),
            max_len: 1_000_000,
            dedupe_ttl: Duration::from_secs(3600),
            max_event_bytes: 65_536,
            max_event_fields: MAX_EVENT_FIELDS_DEFAULT,
        }
    }
}

/// Reads `section`'s shared keys; `rejected_stream` is that flow's default rejected stream.
pub(super) fn read_flow(
    p: &mut Problems,
    section: &str,
    raw: &RawFlow,
    rejected_stream: &str,
) -> Flow {
    let d = Flow::defaults(rejected_stream);
    let path = |key: &str| format!("{section}.{key}");
    let streams = p.string_list(&path("streams"), &raw.streams);
    if streams.is_empty() {
        p.push(path("streams"), "needs at least one input stream");
    }
    Flow {
        streams,
        rejected_stream: p.string(
            &path("rejected_stream"),
            &raw.rejected_stream,
            Some(&d.rejected_stream),
        ),
        dead_letter_stream: p.string(
            &path("dead_letter_stream"),
            &raw.dead_letter_stream,
            Some(&d.dead_letter_stream),
        ),
        max_len: p.integer(
            &path("max_len"),
            &raw.max_len,
            d.max_len,
            100,
            u32::MAX as u64,
        ),
        dedupe_ttl: p.duration(&path("dedupe_ttl"), &raw.dedupe_ttl, d.dedupe_ttl),
        max_event_bytes: p.integer(
            &path("max_event_bytes"),
            &raw.max_event_bytes,
            d.max_event_bytes as u64,
            64,
            16 << 20,
        ) as usize,
        max_event_fields: p.integer(
            &path("max_event_fields"),
            &raw.max_event_fields,
            d.max_event_fields as u64,
            1,
            MAX_EVENT_FIELDS as u64,
        ) as usize,
    }
}
