//! Keeps what the worker reports fresh, every two seconds: the stream gauges (pending entries,
//! lag), each route's queue (refreshed while idle too, from the route's bucket: every tick
//! while it runs ahead or this worker places on it, every fifth once it is empty), and
//! readiness: a consumer group gone missing (Redis restarted empty) is created again. Every
//! 10 s it reads the output streams' lengths. Every minute it reads
//! Redis's `maxmemory-policy`: a Redis that may evict pacer's keys can lose the decisions that
//! keep an entry from being dispatched twice, so that is an error unless acknowledged.

use super::context::Context;
use super::prepare;
use crate::config::Route;
use crate::connection::RedisConn;
use crate::error::Result;
use crate::streams;
use crate::telemetry;
use redis::aio::ConnectionLike;
use redis::FromRedisValue;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

const EVERY: Duration = Duration::from_secs(2);
/// Ticks between two reads of the eviction policy (a minute).
const POLICY_EVERY_TICKS: u64 = 30;
/// Ticks between two reads of the output streams' lengths (10 s, from the first tick): every
/// worker reads every stream, so with many workers and routes each read costs Redis as much as
/// the route queues' (an XLEN per stream), and a length that matters stays for minutes.
const LENGTHS_EVERY_TICKS: u64 = 5;
/// Ticks between two reads of a route's bucket that its last read found empty (the plan not
/// ahead of Redis's clock) and that this worker has not placed on since (10 s, from the first
/// tick). Every worker reads every route's bucket: read every tick, an idle worker's 5,000
/// routes were 2,500 HGETs a second, more than half the command time it cost Redis and half
/// its own CPU (README "Thousands of routes"), almost all of them for routes with nothing
/// queued, and a fleet multiplies that by its workers. A queue this worker builds shows from
/// its own calls' replies at once and is read every tick from then on; one that other workers
/// build shows here within this many ticks (and on theirs at once: the dashboard takes the
/// largest over workers).
const EMPTY_QUEUE_EVERY_TICKS: u64 = 5;

pub(super) async fn run(ctx: Arc<Context>, stop: CancellationToken) {
    let mut con = ctx.con.clone();
    let mut queues = Queues::new(ctx.cfg.outbound.routes.len());
    for tick in 1u64.. {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
        let mut missing = false;
        for stream in &ctx.streams {
            let info = telemetry::timed(
                "info",
                streams::group_info(&mut con, stream, &ctx.cfg.worker.group),
            )
            .await;
            match info {
                Ok(Some((pending, lag))) => {
                    telemetry::stream_state(stream, &ctx.cfg.worker.group, pending, lag);
                    ctx.health.succeeded();
                }
                Ok(None) => missing = true,
                // (A stream's key of another kind is left out of health; its reader tells it.)
                Err(e) => ctx.failed("info", &e),
            }
        }
        if missing {
            info!("a consumer group is missing (Redis restarted empty?); creating it again");
            ctx.health.set_groups_ok(false);
            if let Err(e) = prepare::prepare(&ctx, &stop).await {
                tracing::error!(error = %e, "creating the consumer group again failed");
            }
        }
        // Bounded, so that a master that does not answer cannot hold up the groups' repair.
        let lengths = tick % LENGTHS_EVERY_TICKS == 1;
        let every_route = tick % EMPTY_QUEUE_EVERY_TICKS == 1;
        let refresh = refresh_queues(&ctx, &con, &mut queues, every_route, lengths);
        let _ = tokio::time::timeout(EVERY, refresh).await;
        if tick % POLICY_EVERY_TICKS == 0 {
            if let Err(e) = check_eviction(&ctx, &mut con).await {
                ctx.health.failed("info", &e);
            }
        }
    }
}

/// Which routes' buckets the monitor reads (`EMPTY_QUEUE_EVERY_TICKS`).
struct Queues {
    /// By route index: the route's `Shares::plan_end` when a read last found its queue empty,
    /// or None (never read, or not empty then).
    empty_at: Vec<Option<i64>>,
}

impl Queues {
    fn new(routes: usize) -> Self {
        Queues {
            empty_at: vec![None; routes],
        }
    }

    /// Whether to read `route`'s bucket on a tick that reads all of them (`every_route`) or
    /// not: unless it was empty when last read and this worker has placed nothing on it since
    /// (its learned plan has not moved).
    fn due(&self, route: usize, plan_end: i64, every_route: bool) -> bool {
        every_route || self.empty_at[route] != Some(plan_end)
    }

    /// Learns `route`'s queue (`ahead_us`) as read when its learned plan was `plan_end`.
    fn read(&mut self, route: usize, plan_end: i64, ahead_us: i64) {
        self.empty_at[route] = (ahead_us <= 0).then_some(plan_end);
    }
}

/// Sets the queue gauge of each route due (`Queues::due`) from its bucket (how far ahead its
/// next free slot is), and with `lengths` each output stream's length gauge.
///
/// The keys are read a few hundred to a round trip, several at once (`RedisConn::keyed`): one
/// round trip per route, one after the other, took a tick of 5,000 routes two seconds and
/// 10,000 calls, and a master that did not answer held the tick (and with it the consumer
/// groups' repair) for a timeout per route of its slots.
async fn refresh_queues(
    ctx: &Context,
    con: &RedisConn,
    queues: &mut Queues,
    every_route: bool,
    lengths: bool,
) {
    // Each route with its learned plan as it stands before the read: a reply learned during
    // the read moves it, so the route is read again next tick.
    let routes: Vec<(&Route, i64)> = ctx
        .cfg
        .outbound
        .routes
        .values()
        .map(|r| (r, ctx.shares.plan_end(r.index)))
        .filter(|(r, plan_end)| queues.due(r.index, *plan_end, every_route))
        .collect();
    let outputs: Vec<&str> = if lengths {
        let max_lens = ctx.cfg.output_max_lens().into_iter();
        max_lens.map(|(s, _)| s).collect()
    } else {
        Vec::new()
    };
    fn read<'a>(name: &str, key: &'a str) -> (&'a str, redis::Cmd) {
        let mut cmd = redis::cmd(name);
        cmd.arg(key);
        (key, cmd)
    }
    let mut cmds = Vec::with_capacity(routes.len() + outputs.len());
    for (route, _) in &routes {
        let (key, mut cmd) = read("HGET", &route.keys.bucket);
        cmd.arg("tat");
        cmds.push((key, cmd));
    }
    cmds.extend(outputs.iter().map(|s| read("XLEN", s)));
    // TIME leads each round trip, so on a cluster each bucket comes with its own node's clock,
    // the one its plan is on.
    let replies = con.keyed(&cmds, Some(&redis::cmd("TIME"))).await;
    let (replies_of_routes, output_lengths) = replies.split_at(routes.len());
    for ((route, plan_end), read) in routes.iter().zip(replies_of_routes) {
        let Ok(Ok((s, us))) = read.head.as_ref().map(<(i64, i64)>::from_redis_value_ref) else {
            continue;
        };
        // (A bucket of another kind is left out; the route's calls say so.)
        let Ok(Ok(tat)) = read.reply.as_ref().map(Option::<i64>::from_redis_value_ref) else {
            continue;
        };
        let ahead_us = tat.unwrap_or(0) - (s * 1_000_000 + us);
        queues.read(route.index, *plan_end, ahead_us);
        telemetry::route_queue(&route.name, ahead_us);
    }
    for (stream, read) in outputs.iter().zip(output_lengths) {
        // (A key of another kind is left out: the worker that writes it says so.)
        if let Ok(Ok(len)) = read.reply.as_ref().map(i64::from_redis_value_ref) {
            telemetry::output_length(stream, len);
        }
    }
}

/// `INFO <section>` as text, one per node: on a cluster INFO goes to every master and comes
/// back per node.
async fn info_per_node<C: ConnectionLike>(con: &mut C, section: &str) -> Result<Vec<String>> {
    let reply: redis::Value = redis::cmd("INFO").arg(section).query_async(con).await?;
    Ok(match reply {
        redis::Value::Map(nodes) => nodes
            .into_iter()
            .filter_map(|(_, v)| redis::from_redis_value::<String>(v).ok())
            .collect(),
        other => vec![redis::from_redis_value::<String>(other)
            .map_err(|e| crate::error::Error::reply("info", e.to_string()))?],
    })
}

/// The value of `name` in one node's INFO text (`name:value` lines), trimmed.
fn info_field<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}

/// With `redis.wait_replicas: 0`, says once per process (as DESIGN asks of a Redis that may
/// lose acknowledged writes on failover: named, never trusted silently) when the Redis pacer
/// writes to replicates to replicas: replication is asynchronous, and a replica promoted
/// before it received pacer's last writes takes them away while their input entries, possibly
/// acknowledged elsewhere, stay acknowledged. A Redis without replicas has no failover to lose
/// writes in; with `wait_replicas` set, each write waits for its replicas.
/// A Redis that will not say (INFO refused) is not named: this is advice, not a condition.
pub(super) async fn check_replication<C: ConnectionLike>(ctx: &Context, con: &mut C) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if ctx.cfg.redis.wait_replicas > 0 || SAID.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    let Ok(texts) = info_per_node(con, "replication").await else {
        return;
    };
    let replicas: u64 = texts
        .iter()
        .filter_map(|t| info_field(t, "connected_slaves").and_then(|n| n.parse::<u64>().ok()))
        .sum();
    if replicas > 0 && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        warn!(
            replicas,
            "Redis replicates pacer's writes to replicas asynchronously and redis.wait_replicas \
             is 0: a failover to a replica that lacks the last writes loses them (ready, \
             rejected and forwarded entries written just before it vanish, their inputs \
             acknowledged). Set redis.wait_replicas to how many replicas must confirm each \
             write, or accept that risk"
        );
    }
}

/// With AOF on and `aof-load-truncated yes` (Redis's default), says once per process what that
/// risks (README "Redis"): a crash of Redis in the middle of an AOF write (`kill -9`, the
/// host's power) can leave the file ending inside a script's MULTI/EXEC, and Redis 7.0, finding
/// it cut short, drops only the last, partial command and applies the rest of that script at
/// its next restart, with whatever follows: ready entries without the decisions that say they
/// were written, so events dispatched twice (the shape of one a chaos run found). With `no`,
/// Redis refuses to start on such a file, and `redis-check-aof --fix` cuts the whole
/// transaction. A Redis that will not say (CONFIG refused to an ACL user) is not named: advice,
/// not a condition.
pub(super) async fn check_aof_repair<C: ConnectionLike>(con: &mut C) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if SAID.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    let Ok(texts) = info_per_node(con, "persistence").await else {
        return;
    };
    if !texts
        .iter()
        .any(|t| info_field(t, "aof_enabled") == Some("1"))
    {
        return;
    }
    let reply: redis::RedisResult<redis::Value> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("aof-load-truncated")
        .query_async(con)
        .await;
    if reply.is_ok_and(|r| says_yes(&r)) && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        warn!(
            "Redis keeps an AOF with aof-load-truncated yes: after a crash of Redis in the middle \
             of an AOF write it may replay half of a pacer script at its next restart, a ready \
             entry without the decision that says it was written (an event dispatched twice). \
             Set aof-load-truncated no, and when Redis then refuses to start on a cut AOF, run \
             redis-check-aof --fix on it (see the README)"
        );
    }
}

/// Whether a CONFIG GET reply (a list or map of name and value, or a map of them per node)
/// holds a value "yes".
fn says_yes(reply: &redis::Value) -> bool {
    use redis::Value;
    match reply {
        Value::BulkString(b) => b == b"yes",
        Value::SimpleString(s) => s == "yes",
        Value::Array(items) => items.iter().any(says_yes),
        Value::Map(pairs) => pairs.iter().any(|(_, v)| says_yes(v)),
        _ => false,
    }
}

/// Reads Redis's eviction policy and says whether pacer's keys are safe: the log, a gauge, and
/// readiness. Only `noeviction` keeps them; any other policy is accepted only with
/// `redis.accept_eviction_risk`.
pub(super) async fn check_eviction<C: ConnectionLike>(ctx: &Context, con: &mut C) -> Result<()> {
    // Every master must keep keys.
    let texts = info_per_node(con, "memory").await?;
    let policies: Vec<&str> = texts
        .iter()
        .map(|t| info_field(t, "maxmemory_policy").unwrap_or("noeviction"))
        .collect();
    let policy = policies
        .iter()
        .find(|p| **p != "noeviction")
        .copied()
        .unwrap_or("noeviction")
        .to_string();
    let safe = policy == "noeviction";
    let accepted = ctx.cfg.redis.accept_eviction_risk;
    // Said when first seen and whenever it changes, not every minute.
    let changed = {
        let mut seen = ctx.policy_seen.lock().expect("policy lock");
        let changed = *seen != policy;
        seen.clone_from(&policy);
        changed
    };
    if !safe && changed {
        error!(
            policy,
            accepted,
            "Redis may evict keys (maxmemory-policy is not noeviction): an evicted decision or \
             id claim lets an entry or a repeated id be dispatched twice. Set maxmemory-policy \
             noeviction{}",
            if accepted {
                "; redis.accept_eviction_risk is set, so pacer runs anyway"
            } else {
                ", or set redis.accept_eviction_risk: true to run anyway; not ready meanwhile"
            }
        );
    }
    telemetry::keys_kept(&policy, safe);
    ctx.health.set_keys_kept(safe || accepted);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_queue_is_read_again_on_every_route_ticks_or_once_this_worker_places_on_it() {
        let mut q = Queues::new(2);
        // Never read: due on any tick.
        assert!(q.due(0, 0, false));
        // Read empty: left out until a tick that reads every route...
        q.read(0, 0, 0);
        assert!(!q.due(0, 0, false));
        assert!(q.due(0, 0, true));
        // ...or this worker learns of a plan for it (a schedule reply moved its plan_end).
        assert!(q.due(0, 7, false));
        // A plan that runs ahead is read every tick, down to empty.
        q.read(0, 7, 1_500_000);
        assert!(q.due(0, 7, false));
        q.read(0, 7, -3);
        assert!(!q.due(0, 7, false));
        // One route's state is its own.
        assert!(q.due(1, 0, false));
    }

    #[test]
    fn an_info_field_is_read_by_its_whole_name() {
        let text =
            "# Persistence\r\naof_enabled_x:7\r\naof_enabled:1\r\nmaxmemory_policy:noeviction\r\n";
        assert_eq!(info_field(text, "aof_enabled"), Some("1"));
        assert_eq!(info_field(text, "maxmemory_policy"), Some("noeviction"));
        assert_eq!(info_field(text, "aof"), None);
        assert_eq!(info_field(text, "connected_slaves"), None);
    }

    #[test]
    fn a_config_reply_says_yes_as_a_list_a_map_or_per_node() {
        use redis::Value;
        let name = || Value::BulkString(b"aof-load-truncated".to_vec());
        let value = |v: &str| Value::BulkString(v.as_bytes().to_vec());
        assert!(says_yes(&Value::Array(vec![name(), value("yes")])));
        assert!(!says_yes(&Value::Array(vec![name(), value("no")])));
        assert!(says_yes(&Value::Map(vec![(name(), value("yes"))])));
        let node = |v: &str| {
            (
                value("127.0.0.1:7000"),
                Value::Map(vec![(name(), value(v))]),
            )
        };
        assert!(says_yes(&Value::Map(vec![node("no"), node("yes")])));
        assert!(!says_yes(&Value::Map(vec![node("no")])));
    }
}
