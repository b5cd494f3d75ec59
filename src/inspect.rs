//! `pacer inspect`: what pacer is doing now, read from Redis alone (any host can run it): per
//! route the slots planned ahead and the wait a new event would get, per input stream its
//! backlog, and the consumers with when each last read; and the output streams held past their
//! `max_len` by a consumer group that has not read them, with their groups.

use crate::config::Config;
use crate::connection::RedisConn;
use crate::error::{unless_wrong_type, Result};
use crate::pacing;
use crate::streams::{self, ConsumerInfo, GroupInfo};
use redis::{FromRedisValue, Value};
use serde::Serialize;
use std::fmt;

/// One route's bucket, now.
#[derive(Debug, Clone, Serialize)]
pub struct RouteState {
    pub route: String,
    pub rate: String,
    pub burst: u32,
    /// Events (of cost 1) given a slot and not yet dispatched: how far the plan runs ahead of the
    /// gate (or of now), in slots. Every worker's sleeping events on the route, seen from Redis.
    pub planned_ahead: i64,
    /// The wait, in ms, a new event of cost 1 would be given on this route now.
    pub wait_ms: i64,
    pub max_wait_ms: i64,
}

/// One input stream and its consumer group, now.
#[derive(Debug, Clone, Serialize)]
pub struct StreamState {
    pub stream: String,
    pub flow: &'static str,
    pub length: i64,
    /// False when the group does not exist (yet): no worker has started on this Redis.
    pub group_exists: bool,
    pub pending: i64,
    /// Entries not yet delivered to any consumer (absent when Redis cannot tell).
    pub lag: Option<i64>,
    /// Age (ms of Redis time) of the oldest entry read and not yet finished.
    pub oldest_pending_ms: Option<i64>,
    pub consumers: Vec<ConsumerInfo>,
}

/// An output stream longer than pacer trims it to: a consumer group on it has not read what
/// pacer keeps for it (its readers stopped or fall behind, or nobody reads it any more).
#[derive(Debug, Clone, Serialize)]
pub struct HeldOutput {
    pub stream: String,
    pub length: i64,
    pub max_len: u64,
    pub groups: Vec<GroupInfo>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Inspection {
    pub group: String,
    /// Redis's clock when this was read, ms since the epoch.
    pub redis_time_ms: i64,
    pub routes: Vec<RouteState>,
    pub streams: Vec<StreamState>,
    /// Output streams held past their `max_len` (`streams::trimmed_past`), with their groups.
    pub outputs_held: Vec<HeldOutput>,
    /// What could not be read, and why (a key of another kind, a bucket field not a number).
    pub problems: Vec<String>,
}

/// How many events of cost 1 the plan `tat` holds ahead of the gate `dtat` (or of `now`, when the
/// gate is behind it), and the wait a new event would get: both in the plan's own terms
/// (`pacing::plan`), so they are what the next `schedule.lua` call would find.
pub fn route_view(tat_us: i64, dtat_us: i64, now_us: i64, p: &pacing::BucketParams) -> (i64, i64) {
    let ahead = (tat_us - dtat_us.max(now_us)).max(0);
    // To the nearest slot: a dispatch charges the gate from the millisecond before it (see
    // `pacing::gate`), which leaves it up to a millisecond short of a whole slot.
    let planned = (ahead + p.interval_us / 2) / p.interval_us;
    // From the later of plan and gate, as `schedule.lua` plans: after late dispatches the gate
    // runs ahead of the plan, and the wait read from the plan alone was too short (found by
    // review).
    let slot = pacing::plan(tat_us.max(dtat_us), now_us, 1, p).slot_us;
    (planned, (slot - now_us).max(0) / 1000)
}

/// The replies to `cmds` (each with the key it reads), in order, a few hundred to a round trip
/// (`RedisConn::keyed`): a round trip per key, one after the other, made 10,000 of them for
/// 5,000 routes once the output streams were read too. A command's own error (a key of another
/// kind) is its reply.
async fn replies(con: &RedisConn, cmds: Vec<(&str, redis::Cmd)>) -> Vec<redis::RedisResult<Value>> {
    (con.keyed(&cmds, None).await.into_iter())
        .map(|k| k.reply)
        .collect()
}

/// Reads the state of every route and input stream of `cfg`.
pub async fn inspect(con: &mut RedisConn, cfg: &Config) -> Result<Inspection> {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(con).await?;
    let now_us = s * 1_000_000 + us;
    let mut routes = Vec::new();
    let mut problems = Vec::new();
    let buckets = cfg.outbound.routes.values().map(|r| {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(&r.keys.bucket).arg("tat").arg("dtat");
        (r.keys.bucket.as_str(), cmd)
    });
    let read = replies(con, buckets.collect()).await;
    for (route, reply) in cfg.outbound.routes.values().zip(read) {
        let key = &route.keys.bucket;
        let read = reply
            .and_then(|v| {
                <(Option<String>, Option<String>)>::from_redis_value(v).map_err(Into::into)
            })
            .map_err(Into::into);
        let Some((tat, dtat)) = unless_wrong_type(read, key, "hash", &mut problems)? else {
            continue;
        };
        let mut number = |field: &str, v: Option<String>| -> i64 {
            let v = v.unwrap_or_default();
            // As the scripts read it (Lua's tonumber, or 0).
            v.parse::<f64>().map(|n| n as i64).unwrap_or_else(|_| {
                if !v.is_empty() {
                    problems.push(format!(
                        "{key} holds {field} = {v:?}, not a number: the scripts take it as 0"
                    ));
                }
                0
            })
        };
        let (tat, dtat) = (number("tat", tat), number("dtat", dtat));
        let (planned_ahead, wait_ms) = route_view(tat, dtat, now_us, &route.bucket);
        routes.push(RouteState {
            route: route.name.clone(),
            rate: route.rate.to_string(),
            burst: route.burst.get(),
            planned_ahead,
            wait_ms,
            max_wait_ms: route.max_wait.as_millis() as i64,
        });
    }
    // Every stream's length, inputs and outputs, the same way.
    let inputs: Vec<(&str, &'static str)> = cfg.input_streams().collect();
    let outputs = cfg.output_max_lens();
    let names: Vec<&str> = (inputs.iter().map(|(s, _)| *s))
        .chain(outputs.iter().map(|(s, _)| *s))
        .collect();
    let xlens = names.iter().map(|&s| {
        let mut cmd = redis::cmd("XLEN");
        cmd.arg(s);
        (s, cmd)
    });
    let read = replies(con, xlens.collect()).await;
    let mut lengths = Vec::with_capacity(names.len());
    for (stream, reply) in names.iter().zip(read) {
        let read = reply.and_then(|v| i64::from_redis_value(v).map_err(Into::into));
        lengths.push(unless_wrong_type(
            read.map_err(Into::into),
            stream,
            "stream",
            &mut problems,
        )?);
    }
    let mut lengths = lengths.into_iter();
    let group = &cfg.worker.group;
    let mut streams = Vec::new();
    for &(stream, flow) in &inputs {
        let Some(length) = lengths.next().expect("a length per stream") else {
            continue;
        };
        // A missing stream or group is a state to show, not an error.
        let info = streams::group_snapshot(con, stream, group).await?;
        let mut state = StreamState {
            stream: stream.to_string(),
            flow,
            length,
            group_exists: info.is_some(),
            pending: 0,
            lag: None,
            oldest_pending_ms: None,
            consumers: Vec::new(),
        };
        if let Some(g) = info {
            state.pending = g.pending;
            state.lag = g.lag;
            state.oldest_pending_ms = g
                .oldest_pending
                .and_then(|id| id.split('-').next()?.parse::<i64>().ok())
                .map(|ms| (now_us / 1000 - ms).max(0));
            state.consumers = g.consumers;
        }
        streams.push(state);
    }
    let mut outputs_held = Vec::new();
    for &(stream, max_len) in &outputs {
        let Some(length) = lengths.next().expect("a length per stream") else {
            continue;
        };
        if length as u64 > streams::trimmed_past(max_len) {
            // Its length is the news; the groups are shown when they can be read (an ACL user
            // without XINFO).
            let groups = streams::groups(con, stream).await.unwrap_or_else(|e| {
                problems.push(format!("the consumer groups of {stream}: {e}"));
                Vec::new()
            });
            outputs_held.push(HeldOutput {
                stream: stream.to_string(),
                length,
                max_len,
                groups,
            });
        }
    }
    Ok(Inspection {
        group: group.clone(),
        redis_time_ms: now_us / 1000,
        routes,
        streams,
        outputs_held,
        problems,
    })
}

fn secs(ms: i64) -> String {
    if ms < 10_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else {
        humantime::format_duration(std::time::Duration::from_secs((ms / 1000) as u64)).to_string()
    }
}

impl fmt::Display for Inspection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<16} {:>8} {:>6} {:>13} {:>14} {:>9}",
            "route", "rate", "burst", "planned ahead", "new event wait", "max_wait"
        )?;
        for r in &self.routes {
            writeln!(
                f,
                "{:<16} {:>8} {:>6} {:>13} {:>14} {:>9}",
                r.route,
                r.rate,
                r.burst,
                r.planned_ahead,
                secs(r.wait_ms),
                secs(r.max_wait_ms)
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "{:<20} {:>8} {:>8} {:>8} {:>8} {:>14}   (group {})",
            "input stream", "flow", "length", "pending", "lag", "oldest pending", self.group
        )?;
        for s in &self.streams {
            if !s.group_exists {
                writeln!(
                    f,
                    "{:<20} {:>8} {:>8}   no consumer group yet (no worker has started here)",
                    s.stream, s.flow, s.length
                )?;
                continue;
            }
            writeln!(
                f,
                "{:<20} {:>8} {:>8} {:>8} {:>8} {:>14}",
                s.stream,
                s.flow,
                s.length,
                s.pending,
                s.lag.map_or("?".into(), |l| l.to_string()),
                s.oldest_pending_ms.map_or("-".into(), secs)
            )?;
            for c in &s.consumers {
                writeln!(
                    f,
                    "  consumer {:<30} pending {:>6}   last delivery {} ago",
                    c.name,
                    c.pending,
                    secs(c.idle_ms)
                )?;
            }
        }
        if !self.outputs_held.is_empty() {
            writeln!(f)?;
            writeln!(
                f,
                "output streams held past max_len (pacer keeps what a group has not read):"
            )?;
        }
        for o in &self.outputs_held {
            writeln!(
                f,
                "{:<28} length {} (max_len {})",
                o.stream, o.length, o.max_len
            )?;
            for g in &o.groups {
                writeln!(
                    f,
                    "  group {:<30} pending {:>8}   lag {:>8}",
                    g.name,
                    g.pending,
                    g.lag.map_or("?".into(), |l| l.to_string())
                )?;
            }
        }
        for p in &self.problems {
            writeln!(f, "cannot read: {p}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::Rate;
    use std::num::NonZeroU32;

    fn params(burst: u32) -> pacing::BucketParams {
        let rate: Rate = "10/s".parse().unwrap();
        pacing::BucketParams::new(rate, NonZeroU32::new(burst).unwrap())
    }

    #[test]
    fn an_idle_route_has_nothing_ahead_and_no_wait() {
        assert_eq!(route_view(0, 0, 5_000_000, &params(1)), (0, 0));
        assert_eq!(
            route_view(4_000_000, 4_000_000, 5_000_000, &params(3)),
            (0, 0)
        );
    }

    #[test]
    fn slots_planned_past_the_gate_are_counted_and_make_the_wait() {
        // Gate at now, plan 5 slots of 100 ms past it: 5 ahead, a new event waits 500 ms.
        assert_eq!(
            route_view(1_500_000, 1_000_000, 1_000_000, &params(1)),
            (5, 500)
        );
        // A burst of 3 lets the new event go 200 ms before the plan's end.
        assert_eq!(
            route_view(1_500_000, 1_000_000, 1_000_000, &params(3)),
            (5, 300)
        );
        // The gate behind now (nothing dispatched lately): counted from now.
        assert_eq!(route_view(1_500_000, 0, 1_200_000, &params(1)), (3, 300));
        // The gate ahead of the plan (dispatches ran late): a new event waits for the gate.
        assert_eq!(
            route_view(1_000_000, 1_800_000, 1_000_000, &params(1)),
            (0, 800)
        );
    }
}
