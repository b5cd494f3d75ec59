//! Redis stream plumbing for the input side: consumer groups, reads, acknowledgements, claims.
//! Replies are parsed from raw values so that field names and values stay bytes, in order.

use crate::error::{Error, Result};
use crate::event::{Entry, Fields};
use redis::aio::ConnectionLike;
use redis::Value;
use std::sync::Arc;
use std::time::Duration;

/// Creates the group on the stream (and the stream) unless it exists. New groups start at the
/// stream's beginning: events pushed before pacer first ran are paced, not skipped.
pub async fn ensure_group<C: ConnectionLike>(con: &mut C, stream: &str, group: &str) -> Result<()> {
    let created: redis::RedisResult<Value> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(con)
        .await;
    match created {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A stream id past any entry's: a read of a consumer's own pending entries after it returns
/// nothing. (Not the greatest id itself: Redis 7.0 answers a read after that one with nil,
/// without refreshing the consumer.)
const PAST_ANY_ID: &str = "18446744073709551615-0";

/// Tells `group` on `stream` that `consumer` is alive, without reading or touching any entry: a
/// read of its own pending entries after the greatest id returns none and refreshes its idle
/// time, which (on Redis 7.0) a read of new entries that finds none does not.
pub async fn heartbeat<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
) -> Result<()> {
    let _: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(1)
        .arg("STREAMS")
        .arg(stream)
        .arg(PAST_ANY_ID)
        .query_async(con)
        .await?;
    Ok(())
}

/// Whether Redis is a cluster: then one script may only touch keys of one slot (`keys::slot`).
pub async fn is_cluster<C: ConnectionLike>(con: &mut C) -> Result<bool> {
    let info: String = redis::cmd("INFO").arg("cluster").query_async(con).await?;
    Ok(info.contains("cluster_enabled:1"))
}

/// How many masters serve slots in the cluster this node belongs to (`cluster_size`).
pub async fn cluster_masters<C: ConnectionLike>(con: &mut C) -> Result<u64> {
    let info: String = redis::cmd("CLUSTER").arg("INFO").query_async(con).await?;
    Ok(info
        .lines()
        .find_map(|l| l.strip_prefix("cluster_size:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0))
}

/// Reads up to `count` entries across `streams` for `consumer`, blocking up to `block`: new ones
/// when `from` is `">"`, or else the consumer's own pending entries after the id `from` (which
/// Redis returns at once).
pub async fn read_group<C: ConnectionLike>(
    con: &mut C,
    group: &str,
    consumer: &str,
    streams: &[Arc<str>],
    from: &str,
    count: usize,
    block: Duration,
) -> Result<Vec<Entry>> {
    let mut cmd = redis::cmd("XREADGROUP");
    cmd.arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count)
        .arg("BLOCK")
        .arg(block.as_millis() as u64)
        .arg("STREAMS");
    for s in streams {
        cmd.arg(s.as_ref());
    }
    for _ in streams {
        cmd.arg(from);
    }
    let reply: Value = cmd.query_async(con).await?;
    let mut out = Vec::new();
    let per_stream = match reply {
        Value::Nil => return Ok(out),
        Value::Array(a) => a,
        Value::Map(m) => m
            .into_iter()
            .map(|(k, v)| Value::Array(vec![k, v]))
            .collect(),
        other => return Err(Error::reply("read", format!("{other:?}"))),
    };
    for item in per_stream {
        let Value::Array(mut pair) = item else {
            return Err(Error::reply("read", "expected [stream, entries]"));
        };
        if pair.len() != 2 {
            return Err(Error::reply("read", "expected [stream, entries]"));
        }
        let entries = pair.pop().expect("two items");
        let name = bytes(pair.pop().expect("two items"), "read")?;
        let stream: Arc<str> = streams
            .iter()
            .find(|s| s.as_bytes() == name.as_slice())
            .cloned()
            .unwrap_or_else(|| String::from_utf8_lossy(&name).into());
        parse_entries(entries, &stream, 1, &mut out)?;
    }
    Ok(out)
}

/// The entries `ids` of `stream` read again by id (`XRANGE id id` each, one round trip), with
/// `deliveries` each: None for one the stream no longer holds (trimmed or deleted).
pub async fn entries_by_id<C: ConnectionLike>(
    con: &mut C,
    stream: &Arc<str>,
    ids: &[(String, u64)],
) -> Result<Vec<Option<Entry>>> {
    let mut pipe = redis::pipe();
    for (id, _) in ids {
        pipe.cmd("XRANGE").arg(stream.as_ref()).arg(id).arg(id);
    }
    let replies: Vec<Value> = pipe.query_async(con).await?;
    if replies.len() != ids.len() {
        return Err(Error::reply("read", "one reply per XRANGE"));
    }
    let mut out = Vec::with_capacity(ids.len());
    for (reply, (id, deliveries)) in replies.into_iter().zip(ids) {
        let mut found = Vec::new();
        parse_entries(reply, stream, *deliveries, &mut found)?;
        out.push(found.into_iter().find(|e| e.id == *id));
    }
    Ok(out)
}

/// Parses `[[id, [f, v, ...]], ...]`. An entry deleted while pending comes back with no fields
/// (`nil`); it is kept, fieldless, so that it is dead-lettered and acknowledged, not stuck.
pub fn parse_entries(
    v: Value,
    stream: &Arc<str>,
    deliveries: u64,
    out: &mut Vec<Entry>,
) -> Result<()> {
    let Value::Array(entries) = v else {
        return Err(Error::reply("read", "expected a list of entries"));
    };
    for e in entries {
        let Value::Array(mut parts) = e else {
            return Err(Error::reply("read", "expected [id, fields]"));
        };
        if parts.len() != 2 {
            return Err(Error::reply("read", "expected [id, fields]"));
        }
        let raw = parts.pop().expect("two items");
        let id =
            String::from_utf8_lossy(&bytes(parts.pop().expect("two items"), "read")?).into_owned();
        let mut fields: Fields = Vec::new();
        match raw {
            Value::Nil => {}
            Value::Array(flat) => {
                let mut it = flat.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    fields.push((bytes(k, "read")?, bytes(v, "read")?));
                }
            }
            Value::Map(m) => {
                for (k, v) in m {
                    fields.push((bytes(k, "read")?, bytes(v, "read")?));
                }
            }
            other => return Err(Error::reply("read", format!("fields: {other:?}"))),
        }
        out.push(Entry {
            stream: stream.clone(),
            id,
            fields,
            deliveries,
        });
    }
    Ok(())
}

fn bytes(v: Value, op: &'static str) -> Result<Vec<u8>> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        Value::Int(i) => Ok(i.to_string().into_bytes()),
        other => Err(Error::reply(
            op,
            format!("expected a string, got {other:?}"),
        )),
    }
}

/// One page of `pending_idle`.
#[derive(Debug, Default)]
pub struct IdlePage {
    /// How many entries the page listed.
    pub listed: usize,
    /// The last entry listed: the next page starts after it.
    pub last: Option<String>,
    /// The entries listed.
    pub entries: Vec<IdleEntry>,
}

/// A pending entry listed for claiming: its id, and how often it was delivered.
#[derive(Debug, Clone)]
pub struct IdleEntry {
    pub id: String,
    pub deliveries: u64,
}

/// Up to `count` entries that `holder` has held pending in `group` on `stream` for longer than
/// `min_idle`, oldest first from `from` (`-`, or `(<id>` to start after one), with how often
/// each has been delivered (`XPENDING … IDLE … <holder>`). Redis walks that consumer's own
/// list, not the group's: what live workers hold asleep costs nothing here.
pub async fn pending_idle<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    group: &str,
    min_idle: Duration,
    (from, count): (&str, usize),
    holder: &str,
) -> Result<IdlePage> {
    let reply: Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("IDLE")
        .arg(min_idle.as_millis() as u64)
        .arg(from)
        .arg("+")
        .arg(count)
        .arg(holder)
        .query_async(con)
        .await?;
    let Value::Array(rows) = reply else {
        return Err(Error::reply("pending", "expected a list"));
    };
    let shape = || Error::reply("pending", "expected [id, consumer, idle, deliveries]");
    let mut page = IdlePage {
        listed: rows.len(),
        ..IdlePage::default()
    };
    for row in rows {
        let Value::Array(cols) = row else {
            return Err(shape());
        };
        let mut cols = cols.into_iter();
        let (Some(id), Some(_holder), Some(_idle), Some(Value::Int(deliveries))) =
            (cols.next(), cols.next(), cols.next(), cols.next())
        else {
            return Err(shape());
        };
        let id = String::from_utf8_lossy(&bytes(id, "pending")?).into_owned();
        page.entries.push(IdleEntry {
            id: id.clone(),
            deliveries: deliveries.max(0) as u64,
        });
        page.last = Some(id);
    }
    Ok(page)
}

/// Whether entry `id` of `stream` is still pending in `group` with `consumer` (`XPENDING` over
/// that one id): false once it was acknowledged, claimed by another consumer or trimmed.
pub async fn held_by<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    group: &str,
    id: &str,
    consumer: &str,
) -> Result<bool> {
    let reply: Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg(id)
        .arg(id)
        .arg(1)
        .arg(consumer)
        .query_async(con)
        .await?;
    match reply {
        Value::Array(rows) => Ok(!rows.is_empty()),
        _ => Err(Error::reply("pending", "expected a list")),
    }
}

/// Claims `ids` for `consumer` if they are still idle longer than `min_idle` (another worker may
/// have claimed them since they were listed). Each comes back with `deliveries` + 1, the count
/// XCLAIM leaves; entries trimmed from the stream meanwhile are dropped from the group by Redis.
pub async fn claim<C: ConnectionLike>(
    con: &mut C,
    stream: &Arc<str>,
    group: &str,
    consumer: &str,
    min_idle: Duration,
    idle: &[IdleEntry],
) -> Result<Vec<Entry>> {
    let mut cmd = redis::cmd("XCLAIM");
    cmd.arg(stream.as_ref())
        .arg(group)
        .arg(consumer)
        .arg(min_idle.as_millis() as u64);
    for e in idle {
        cmd.arg(&e.id);
    }
    let reply: Value = cmd.query_async(con).await?;
    let mut out = Vec::new();
    parse_entries(reply, stream, 0, &mut out)?;
    for entry in &mut out {
        entry.deliveries = idle
            .iter()
            .find(|e| e.id == entry.id)
            .map_or(1, |e| e.deliveries + 1);
    }
    Ok(out)
}

/// Acknowledges entries of one stream.
pub async fn ack<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    group: &str,
    ids: &[&str],
) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let mut cmd = redis::cmd("XACK");
    cmd.arg(stream).arg(group).arg(ids);
    let _: i64 = cmd.query_async(con).await?;
    Ok(())
}

/// The records of an `XINFO GROUPS` / `XINFO CONSUMERS` reply, each as its field names and
/// values (RESP2 sends flat arrays, RESP3 maps).
fn info_records(reply: Value) -> Vec<Vec<(String, Value)>> {
    let Value::Array(records) = reply else {
        return Vec::new();
    };
    let name = |k: Value| match k {
        Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        Value::SimpleString(s) => s,
        _ => String::new(),
    };
    records
        .into_iter()
        .filter_map(|r| match r {
            Value::Array(flat) => {
                let mut it = flat.into_iter();
                let mut pairs = Vec::new();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    pairs.push((name(k), v));
                }
                Some(pairs)
            }
            Value::Map(m) => Some(m.into_iter().map(|(k, v)| (name(k), v)).collect()),
            _ => None,
        })
        .collect()
}

fn info_int(record: &[(String, Value)], field: &str) -> Option<i64> {
    record.iter().find_map(|(k, v)| match v {
        Value::Int(i) if k == field => Some(*i),
        _ => None,
    })
}

fn info_text(record: &[(String, Value)], field: &str) -> Option<String> {
    record.iter().find_map(|(k, v)| match v {
        Value::BulkString(b) if k == field => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) if k == field => Some(s.clone()),
        _ => None,
    })
}

/// Pending entries and lag of a group on a stream (`XINFO GROUPS`); lag is absent when Redis
/// cannot tell it.
pub async fn group_info<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    group: &str,
) -> Result<Option<(i64, Option<i64>)>> {
    let reply: Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(con)
        .await?;
    Ok(group_of(reply, group))
}

/// `group`'s pending entries and lag in an `XINFO GROUPS` reply.
fn group_of(reply: Value, group: &str) -> Option<(i64, Option<i64>)> {
    groups_of(reply)
        .into_iter()
        .find(|g| g.name == group)
        .map(|g| (g.pending, g.lag))
}

/// One consumer group of a stream, as `XINFO GROUPS` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GroupInfo {
    pub name: String,
    /// Entries delivered to its consumers and not acknowledged.
    pub pending: i64,
    /// Entries not yet delivered to it (absent when Redis cannot tell).
    pub lag: Option<i64>,
}

/// Every consumer group of `stream` (`XINFO GROUPS`).
pub async fn groups<C: ConnectionLike>(con: &mut C, stream: &str) -> Result<Vec<GroupInfo>> {
    let reply: Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(con)
        .await?;
    Ok(groups_of(reply))
}

fn groups_of(reply: Value) -> Vec<GroupInfo> {
    info_records(reply)
        .into_iter()
        .map(|g| GroupInfo {
            name: info_text(&g, "name").unwrap_or_default(),
            pending: info_int(&g, "pending").unwrap_or(0),
            lag: info_int(&g, "lag"),
        })
        .collect()
}

/// The length past which pacer trims an output stream of `max_len` (as `lib.lua` `trim`: it
/// waits for 1% more, 100 at least): a stream longer than this is held by a consumer group.
pub fn trimmed_past(max_len: u64) -> u64 {
    max_len + (max_len / 100).max(100)
}

/// One consumer of a group, as `XINFO CONSUMERS` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ConsumerInfo {
    pub name: String,
    pub pending: i64,
    /// Milliseconds since Redis last delivered the consumer entries (a read that got some, or a
    /// claim): on Redis 7.0 a blocking read that finds nothing does not count, so an idle live
    /// worker's grows.
    pub idle_ms: i64,
}

/// The consumers of `group` on `stream`.
pub async fn consumers<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    group: &str,
) -> Result<Vec<ConsumerInfo>> {
    let reply: Value = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(stream)
        .arg(group)
        .query_async(con)
        .await?;
    Ok(consumers_of(reply))
}

fn consumers_of(reply: Value) -> Vec<ConsumerInfo> {
    info_records(reply)
        .into_iter()
        .map(|c| ConsumerInfo {
            name: info_text(&c, "name").unwrap_or_default(),
            pending: info_int(&c, "pending").unwrap_or(0),
            idle_ms: info_int(&c, "idle").unwrap_or(0),
        })
        .collect()
}

/// The id of the oldest entry an `XPENDING` summary shows, if any.
fn oldest_of(reply: &Value) -> Option<String> {
    match reply {
        Value::Array(parts) => match parts.get(1) {
            Some(Value::BulkString(id)) => Some(String::from_utf8_lossy(id).into_owned()),
            _ => None,
        },
        _ => None,
    }
}

/// A group on a stream at one moment: its pending entries and lag, the oldest pending id, and
/// its consumers.
pub struct GroupSnapshot {
    pub pending: i64,
    pub lag: Option<i64>,
    pub oldest_pending: Option<String>,
    pub consumers: Vec<ConsumerInfo>,
}

/// `group` on `stream` (None: no such stream or group), read in one pipeline, which Redis runs
/// in one go: read one after another, the group's pending count and its consumers' were read
/// moments apart while a worker acknowledged hundreds a second, and `pacer inspect` showed a
/// group of one consumer with 194 pending and its consumer with 25.
pub async fn group_snapshot<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    group: &str,
) -> Result<Option<GroupSnapshot>> {
    let mut pipe = redis::pipe();
    pipe.cmd("XINFO").arg("GROUPS").arg(stream);
    pipe.cmd("XPENDING").arg(stream).arg(group);
    pipe.cmd("XINFO").arg("CONSUMERS").arg(stream).arg(group);
    let mut replies = pipe
        .ignore_errors()
        .query_async::<Vec<redis::RedisResult<Value>>>(con)
        .await?
        .into_iter();
    let mut next = || replies.next().unwrap_or(Ok(Value::Nil));
    // A missing stream or group is a state, not an error.
    let missing = |e: &redis::RedisError| {
        e.code() == Some("NOGROUP") || e.to_string().contains("no such key")
    };
    let (groups, pending, consumers) = match (next(), next(), next()) {
        (Ok(g), Ok(p), Ok(c)) => (g, p, c),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) if missing(&e) => return Ok(None),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return Err(e.into()),
    };
    Ok(
        group_of(groups, group).map(|(pending_count, lag)| GroupSnapshot {
            pending: pending_count,
            lag,
            oldest_pending: oldest_of(&pending),
            consumers: consumers_of(consumers),
        }),
    )
}
