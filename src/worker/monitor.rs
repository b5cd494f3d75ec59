//! Keeps what the worker reports fresh, every two seconds: the stream gauges (pending entries,
//! lag), each route's queue (refreshed while idle too, from the route's bucket), and readiness:
//! a consumer group gone missing (Redis restarted empty) is created again. Every minute it reads
//! Redis's `maxmemory-policy`: a Redis that may evict pacer's keys can lose the decisions that
//! keep an entry from being dispatched twice, so that is an error unless acknowledged.

use super::context::Context;
use super::prepare;
use crate::error::Result;
use crate::streams;
use crate::telemetry;
use redis::aio::ConnectionLike;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

const EVERY: Duration = Duration::from_secs(2);
/// Ticks between two reads of the eviction policy (a minute).
const POLICY_EVERY_TICKS: u64 = 30;

pub(super) async fn run(ctx: Arc<Context>, stop: CancellationToken) {
    let mut con = ctx.con.clone();
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
        refresh_queues(&ctx, &mut con).await;
        if tick % POLICY_EVERY_TICKS == 0 {
            if let Err(e) = check_eviction(&ctx, &mut con).await {
                ctx.health.failed("info", &e);
            }
        }
    }
}

/// Sets each route's queue gauge from its bucket: how far ahead its next free slot is.
async fn refresh_queues<C: ConnectionLike>(ctx: &Context, con: &mut C) {
    for route in ctx.cfg.outbound.routes.values() {
        let mut pipe = redis::pipe();
        pipe.cmd("TIME")
            .cmd("HGET")
            .arg(&route.keys.bucket)
            .arg("tat");
        let read: redis::RedisResult<((i64, i64), Option<i64>)> = pipe.query_async(con).await;
        if let Ok(((s, us), tat)) = read {
            telemetry::route_queue(&route.name, tat.unwrap_or(0) - (s * 1_000_000 + us));
        }
    }
}

/// Reads Redis's eviction policy and says whether pacer's keys are safe: the log, a gauge, and
/// readiness. Only `noeviction` keeps them; any other policy is accepted only with
/// `redis.accept_eviction_risk`.
pub(super) async fn check_eviction<C: ConnectionLike>(ctx: &Context, con: &mut C) -> Result<()> {
    // On a cluster, INFO goes to every master and comes back per node: every one must keep keys.
    let reply: redis::Value = redis::cmd("INFO").arg("memory").query_async(con).await?;
    let texts: Vec<String> = match reply {
        redis::Value::Map(nodes) => nodes
            .into_iter()
            .filter_map(|(_, v)| redis::from_redis_value::<String>(v).ok())
            .collect(),
        other => vec![redis::from_redis_value::<String>(other)
            .map_err(|e| crate::error::Error::reply("info", e.to_string()))?],
    };
    let policies: Vec<&str> = texts
        .iter()
        .map(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("maxmemory_policy:"))
                .unwrap_or("noeviction")
                .trim()
        })
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
