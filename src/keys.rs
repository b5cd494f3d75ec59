//! Every Redis key pacer touches is named here, and nowhere else.
//!
//! Redis Cluster puts a key in the slot of its hash tag: the text between the first `{` and the
//! next `}` when that text is non-empty, else the whole key. A Lua script may only touch keys of one
//! slot, so each script call's keys are built around one tag:
//!
//! - a route's keys (its bucket, its decision hashes, its id claims) take the tag of the route's
//!   ready stream, `pacer:{carrier-a}:ready` by default, so the dispatch XADD and its decision are
//!   one atomic step;
//! - a shared output stream (rejected, dead letters) gets companion write-once hashes
//!   `{<its tag>}:…`, which land in the stream's own slot even when its name carries no braces;
//! - every inbound key (each identity's limiter state, each input entry's decision marker) takes
//!   the tag of the inbound forward stream, so one admission call decides a whole batch, records
//!   each decision and forwards the accepted entries atomically (`InboundKeys`); with
//!   `inbound.partitions`, the tag of the identity's partition instead, so the inbound state
//!   spreads over a cluster's masters (the forward stream is then written once per entry by a
//!   second call where it lies in another slot, unless each partition writes its own copy of it,
//!   `inbound.partitioned_outputs`, named by [`partition_stream`]).

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

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, mod 16384. Computed here
/// so that a worker knows which of its keys share a slot without asking Redis each time
/// (`tests/connection.rs` checks it against CLUSTER KEYSLOT).
pub fn slot(key: &str) -> u16 {
    crc16(hash_tag(key).as_bytes()) % 16384
}

/// CRC16 (XMODEM), the checksum Redis Cluster hashes keys with.
fn crc16(bytes: &[u8]) -> u16 {
    crc16_from(0, bytes)
}

/// CRC16 (XMODEM) of `bytes` continued from the checksum `crc` of what came before them.
fn crc16_from(mut crc: u16, bytes: &[u8]) -> u16 {
    for &b in bytes {
        crc = (crc << 8) ^ CRC16_TABLE[usize::from((crc >> 8) as u8 ^ b)];
    }
    crc
}

/// CRC16 (XMODEM) a byte at a time: `partition_tag` tries many tags for a large `partitions`.
const CRC16_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// The hash tag of inbound partition `k` of `n` of the flow whose forward stream's tag is
/// `forward_tag`: `<forward_tag>/<k>`, or `<forward_tag>/<k>.<j>` for the first `j` that puts
/// it in the k-th n-th of the slot space. Spread evenly over the slots, the partitions spread
/// evenly over masters that own equal ranges of slots (as `redis-cli --cluster create` and
/// `rebalance` leave them): 12 partitions on 3 masters are 4 each, where tags hashed at random
/// fell 4/5/3. About n tags are tried per partition, each a few table lookups.
pub fn partition_tag(forward_tag: &str, k: usize, n: usize) -> String {
    let base = format!("{forward_tag}/{k}");
    let (low, high) = (k * 16384 / n, (k + 1) * 16384 / n);
    let in_range = |crc: u16| (low..high).contains(&usize::from(crc % 16384));
    let crc = crc16(base.as_bytes());
    if in_range(crc) {
        return base;
    }
    // Every range holds at least 16 slots (n <= 1024), so some j < 2^32 lands in it.
    let j = (1u32..)
        .find(|j| in_range(crc16_from(crc, format!(".{j}").as_bytes())))
        .expect("a tag in every range");
    format!("{base}.{j}")
}

/// The inbound partition of an identity value, one of `n`: CRC16 (XMODEM) of its bytes, mod
/// `n`. Stable across versions (a change would move every identity's state), and the same
/// checksum Redis Cluster uses, so a producer can compute it too.
pub fn partition(value: &[u8], n: usize) -> usize {
    if n <= 1 {
        0
    } else {
        usize::from(crc16(value)) % n
    }
}

/// A partition's own copy of `stream`, in the slot of hash tag `tag`: the stream's name with its
/// hash tag replaced by `tag`, or with `:{<tag>}` appended when it has none, like
/// `pacer:accepted:{pacer:accepted/3.7}` or `{in/3.7}:rejected` (for `{in}:rejected`).
pub fn partition_stream(stream: &str, tag: &str) -> String {
    let own = hash_tag(stream);
    if own.len() < stream.len() {
        // A usable tag: `own` sits between the first '{' and the next '}'.
        let open = stream.find('{').expect("a hash tag opens with '{'");
        let close = open + 1 + own.len();
        format!("{}{{{tag}}}{}", &stream[..open], &stream[close + 1..])
    } else {
        format!("{stream}:{{{tag}}}")
    }
}

/// A key in `key`'s slot that `redis.wait_replicas` writes just before each `WAIT`: WAIT counts
/// the replicas holding everything the node had when this connection last wrote, so a fresh
/// write makes it cover every earlier write to that node, whichever connection made it (a call
/// retried after a reconnection or a failover may write nothing itself).
pub fn replication_mark(key: &str) -> String {
    format!("pacer:{{{}}}:replicated", hash_tag(key))
}

/// The key the synchronous API's probe writes while Redis refuses writes (`api::batch`), to
/// see when it takes them again; it expires on its own.
pub fn api_probe() -> &'static str {
    "pacer:{api}:probe"
}

/// Longest stream, group or consumer name a config may give, in bytes. Redis takes 512 MB; a
/// name that long is a mistake, sent with every call (a 50 MB group name was taken).
pub const NAME_MAX: usize = 1024;

/// Why a stream, group or consumer name cannot be used: longer than [`NAME_MAX`], a control
/// character, or whitespace at either end (a name pasted with a space names another key than
/// the producers write to, and pacer would wait on it for good).
pub fn check_name(name: &str) -> Result<(), String> {
    if name.len() > NAME_MAX {
        return Err(format!(
            "must be at most {NAME_MAX} bytes, got {}",
            name.len()
        ));
    }
    if name.chars().any(char::is_control) || name.trim() != name {
        return Err(format!(
            "{name:?} has a control character or whitespace at either end"
        ));
    }
    Ok(())
}

/// Why a stream name cannot be used: a `{` that does not open a usable hash tag makes Redis hash
/// the whole name, which companion keys could not follow; and a `}` with no `{` would close the
/// tag of a companion key early (`pacer:{ready}a}:bucket` hashes on `ready`, not on the stream's
/// slot), so on a cluster every call on both would fail with CROSSSLOT.
pub fn check_stream_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    check_name(name)?;
    if name.contains('{') && hash_tag(name) == name {
        return Err(format!(
            "{name:?} has a '{{' that opens no hash tag; write a tag like pacer:{{x}}:ready or no braces at all"
        ));
    }
    if !name.contains('{') && name.contains('}') {
        return Err(format!(
            "{name:?} has a '}}' but no hash tag; companion keys could not share its slot"
        ));
    }
    Ok(())
}

/// The default ready stream of a route.
pub fn default_ready_stream(route: &str) -> String {
    format!("pacer:{{{route}}}:ready")
}

/// The span of entry-id milliseconds whose records (decisions, write-once marks) share a hash.
///
/// A hash per span, not a key per entry: a batch's records are then read with one HMGET and
/// written with one HSET (a key per entry took a command per event, a large part of an event's
/// cost), and a hash of small fields is smaller than as many keys with TTLs. Each write renews
/// the hash's TTL, so every record lives at least its time to live. The span keeps each hash
/// small enough to expire without a pause (a few thousand fields at most, at tens of thousands
/// of events per second).
pub const DECISION_HASH_MS: u64 = 100;

/// The one field of a record hash that is not a record: `lua/lib.lua`'s `hset` writes it (with
/// a value longer than Redis's `hash-max-listpack-value`) beside a call's 16 records or more, so
/// that Redis makes the hash a hash table before it fills. Not an entry id, so no read by id
/// finds it; a count of a hash's records leaves it out (`testkit::records_in`).
pub const WIDE_FIELD: &str = "~";

/// The span an entry id's records live in: its milliseconds / [`DECISION_HASH_MS`] (an id that
/// is not a stream id gets a hash of its own).
fn span(entry_id: &str) -> String {
    let ms = entry_id.split('-').next().unwrap_or(entry_id);
    match ms.parse::<u64>() {
        Ok(ms) => (ms / DECISION_HASH_MS).to_string(),
        Err(_) => ms.to_string(),
    }
}

/// Keys of one route, all in the slot of its ready stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteKeys {
    pub ready: String,
    /// Hash of the plan and gate state (`tat`, `dtat`, `last`).
    pub bucket: String,
    decisions: String,
    claims: String,
}

impl RouteKeys {
    pub fn new(route: &str, ready_stream: &str) -> Self {
        let tag = hash_tag(ready_stream);
        RouteKeys {
            ready: ready_stream.to_string(),
            bucket: format!("pacer:{{{tag}}}:bucket:{route}"),
            decisions: format!("pacer:{{{tag}}}:dec:{route}:"),
            claims: format!("pacer:{{{tag}}}:id:{route}:"),
        }
    }

    /// The hash recording, for the input entries of `stream` whose ids fall in one span, the
    /// decision each has on this route (field: the entry id; value: `src/marker.rs`).
    pub fn decisions(&self, stream: &str, entry_id: &str) -> String {
        format!("{}{stream}:{}", self.decisions, span(entry_id))
    }

    /// Which input entry owns an event id (a producer's `id`) on this route: a second entry
    /// with the same id is a duplicate.
    pub fn claim(&self, event_id: &str) -> String {
        format!("{}{event_id}", self.claims)
    }
}

/// A shared output stream (rejected or dead letters) and its write-once records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputKeys {
    pub stream: String,
    prefix: String,
}

impl OutputKeys {
    pub fn new(stream: &str) -> Self {
        OutputKeys {
            stream: stream.to_string(),
            prefix: format!("{{{}}}:pacer:emitted:", hash_tag(stream)),
        }
    }

    /// The hash marking which input entries of `source_stream` (in one span of ids) were
    /// written to this stream, so a redelivery writes each only once.
    pub fn written(&self, source_stream: &str, source_id: &str) -> String {
        format!("{}{source_stream}:{}", self.prefix, span(source_id))
    }
}

/// Keys of the inbound flow (or of one of its partitions), all in one slot: the forward
/// stream's, when the flow is one partition; with `inbound.partitions: n`, partition `k`'s own,
/// `pacer:in:{<partition_tag>}:…`, so that n partitions spread over a cluster's
/// masters while each decision stays atomic in one slot. With `inbound.partitioned_outputs`,
/// each partition also writes its own copies of the forward and rejected streams
/// ([`partition_stream`]), in its slot, so that no master writes every partition's outputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundKeys {
    /// Where this partition's accepted events go.
    pub forward: String,
    /// Where this partition's rejected events go.
    pub rejected: String,
    prefix: String,
}

impl InboundKeys {
    pub fn new(forward_stream: &str, rejected_stream: &str) -> Self {
        InboundKeys {
            forward: forward_stream.to_string(),
            rejected: rejected_stream.to_string(),
            prefix: format!("pacer:in:{{{}}}:", hash_tag(forward_stream)),
        }
    }

    /// The keys of partition `k` of `n` (the unpartitioned keys when `n` is 1); with
    /// `own_outputs`, its outputs are its own copies of the two streams.
    pub fn partition(
        forward_stream: &str,
        rejected_stream: &str,
        k: usize,
        n: usize,
        own_outputs: bool,
    ) -> Self {
        if n <= 1 {
            return InboundKeys::new(forward_stream, rejected_stream);
        }
        let tag = partition_tag(hash_tag(forward_stream), k, n);
        let output = |stream: &str| {
            if own_outputs {
                partition_stream(stream, &tag)
            } else {
                stream.to_string()
            }
        };
        InboundKeys {
            forward: output(forward_stream),
            rejected: output(rejected_stream),
            prefix: format!("pacer:in:{{{tag}}}:"),
        }
    }

    /// A key name in these keys' slot (for comparing slots).
    pub fn slot_key(&self) -> &str {
        &self.prefix
    }

    /// The hash that records the decisions of input entries whose ids fall in one span
    /// (`DECISION_HASH_MS`), each under its owner (`<entry id>@<stream>`), so that a redelivery
    /// gets its decision back instead of being charged again.
    pub fn decisions(&self, source_id: &str) -> String {
        format!("{}decided:{}", self.prefix, span(source_id))
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
        let decisions = keys.decisions("pacer:out", "1700000000123-4");
        assert_eq!(
            decisions,
            "pacer:{carrier-a}:dec:carrier-a:pacer:out:17000000001"
        );
        for key in [&keys.bucket, &decisions, &keys.claim("call-42")] {
            assert_eq!(hash_tag(key), "carrier-a", "{key}");
        }
        let custom = RouteKeys::new("b", "out-b");
        assert_eq!(hash_tag(&custom.bucket), "out-b");
    }

    #[test]
    fn output_records_land_in_the_streams_slot() {
        let keys = OutputKeys::new("pacer:rejected");
        assert_eq!(
            hash_tag(&keys.written("pacer:out", "1-0")),
            "pacer:rejected"
        );
        let tagged = OutputKeys::new("x:{dead}:y");
        assert_eq!(hash_tag(&tagged.written("s", "1-0")), "dead");
        assert_eq!(
            keys.written("in", "1700000000199-0"),
            keys.written("in", "1700000000100-9")
        );
    }

    #[test]
    fn inbound_keys_share_the_forward_streams_tag_whatever_the_identity() {
        let keys = InboundKeys::new("pacer:accepted", "pacer:in-rejected");
        let id = keys.identity("r", "log", "ip", b"a}{b c\xff%");
        assert_eq!(id, "pacer:in:{pacer:accepted}:r:log:ip=a%7D%7Bb%20c%FF%25");
        for key in [&id, &keys.decisions("1-0")] {
            assert_eq!(hash_tag(key), "pacer:accepted", "{key}");
        }
        assert_eq!(
            hash_tag(&InboundKeys::new("x:{out}", "r").decisions("1-0")),
            "out"
        );
    }

    #[test]
    fn inbound_partitions_have_a_tag_each_and_one_partition_keeps_the_forward_streams() {
        for own_outputs in [false, true] {
            assert_eq!(
                InboundKeys::partition("pacer:accepted", "rej", 0, 1, own_outputs),
                InboundKeys::new("pacer:accepted", "rej")
            );
        }
        let tags: Vec<String> = (0..4)
            .map(|k| {
                let keys = InboundKeys::partition("x:{fwd}", "rej", k, 4, false);
                let id = keys.identity("r", "log", "source", b"s1");
                assert_eq!(hash_tag(&id), hash_tag(&keys.decisions("1-0")));
                assert_eq!(
                    (keys.forward.as_str(), keys.rejected.as_str()),
                    ("x:{fwd}", "rej")
                );
                hash_tag(keys.slot_key()).to_string()
            })
            .collect();
        for (k, tag) in tags.iter().enumerate() {
            assert_eq!(*tag, partition_tag("fwd", k, 4));
        }
        // With outputs of its own, a partition's streams share its slot.
        let keys = InboundKeys::partition("x:{fwd}:acc", "pacer:in-rejected", 3, 4, true);
        let tag = partition_tag("fwd", 3, 4);
        assert_eq!(keys.forward, format!("x:{{{tag}}}:acc"));
        assert_eq!(keys.rejected, format!("pacer:in-rejected:{{{tag}}}"));
        for stream in [&keys.forward, &keys.rejected] {
            assert_eq!(hash_tag(stream), hash_tag(keys.slot_key()), "{stream}");
            assert_eq!(check_stream_name(stream), Ok(()));
        }
        assert_eq!(partition_stream("a{b}c{d}", "t"), "a{t}c{d}");
        // CRC16/XMODEM of "123456789" is 0x31C3: the published check value.
        assert_eq!(partition(b"123456789", 65536), 0x31C3);
        assert_eq!(partition(b"123456789", 1), 0);
        assert_eq!(partition(b"123456789", 10), 0x31C3 % 10);
    }

    #[test]
    fn partition_tags_spread_evenly_over_the_slots() {
        for n in [2, 3, 7, 12, 100, 1024] {
            for k in 0..n {
                let tag = partition_tag("pacer:accepted", k, n);
                assert!(tag.starts_with(&format!("pacer:accepted/{k}")), "{tag}");
                let slot = usize::from(slot(&format!("{{{tag}}}")));
                assert!(
                    (k * 16384 / n..(k + 1) * 16384 / n).contains(&slot),
                    "partition {k} of {n}: {tag} in slot {slot}"
                );
            }
        }
        // Three masters with equal ranges (as redis-cli --cluster create makes them).
        let mut per_master = [0; 3];
        for k in 0..12 {
            let slot = usize::from(slot(&format!("{{{}}}", partition_tag("x", k, 12))));
            per_master[slot * 3 / 16384] += 1;
        }
        assert_eq!(per_master, [4, 4, 4]);
        // The table-driven checksum is the bitwise one, continued or not.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(crc16_from(crc16(b"1234"), b"56789"), 0x31C3);
    }

    #[test]
    fn inbound_decisions_share_a_hash_per_span_of_entry_ids() {
        let keys = InboundKeys::new("fwd", "rej");
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
    fn slots_are_redis_clusters() {
        // Values CLUSTER KEYSLOT gives.
        assert_eq!(slot("123456789"), 12739);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{foo}:anything"), 12182);
        assert_eq!(slot("pacer:{carrier-a}:ready"), slot("carrier-a"));
    }

    #[test]
    fn refuses_braces_that_make_no_tag() {
        assert!(check_stream_name("a{}b").is_err());
        assert!(check_stream_name("a{b").is_err());
        assert!(check_stream_name("pacer:{x}:ready").is_ok());
        assert!(check_stream_name("").is_err());
        assert!(check_stream_name("ready}a").is_err());
        assert!(
            check_stream_name("a{b}c}").is_ok(),
            "a usable tag, then a stray brace"
        );
    }
}
