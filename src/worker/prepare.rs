//! What a worker sets up in Redis before it reads: the consumer groups, whether Redis is a
//! cluster, the scripts, the eviction check. Run at start-up, and again by the monitor when Redis
//! lost it (restarted empty).

use super::context::Context;
use super::monitor;
use crate::backoff::Backoff;
use crate::config::RedisMode;
use crate::error::Result;
use crate::keys::InboundKeys;
use crate::streams;
use crate::telemetry;
use std::sync::atomic::Ordering;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

/// Creates the consumer groups, learns whether Redis is a cluster and loads the scripts,
/// retrying until Redis answers. Ok(false) if shutdown came first; an error if Redis refuses
/// pacer in a way no retry can mend (credentials, TLS).
pub(super) async fn prepare(ctx: &Context, shutdown: &CancellationToken) -> Result<bool> {
    let mut backoff = Backoff::default();
    loop {
        match telemetry::timed("prepare", prepare_once(ctx)).await {
            Ok(()) => {
                ctx.health.succeeded();
                ctx.health.set_scripts_loaded(true);
                ctx.health.set_groups_ok(true);
                return Ok(true);
            }
            Err(e) if e.is_fatal() => {
                error!(error = %e, "Redis refuses pacer; retrying cannot help");
                return Err(e);
            }
            Err(e) => {
                ctx.health.failed("prepare", &e);
                let delay = backoff.fail();
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(false),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// One attempt at `prepare`.
async fn prepare_once(ctx: &Context) -> Result<()> {
    let mut con = ctx.con.clone();
    for stream in &ctx.streams {
        streams::ensure_group(&mut con, stream, &ctx.cfg.worker.group).await?;
    }
    let cluster = match ctx.con.mode() {
        RedisMode::Cluster => true,
        RedisMode::Sentinel => false,
        // A node in cluster mode, reached as one server: it still refuses calls across slots.
        RedisMode::Standalone => streams::is_cluster(&mut con).await?,
    };
    ctx.cluster.store(cluster, Ordering::Relaxed);
    if let Some(inbound) = &ctx.cfg.inbound {
        // Where an output shares the admission call's slot, the call writes it in the step that
        // decides it; elsewhere a second, write-once call does.
        let by_call = |stream: fn(&InboundKeys) -> &str| {
            inbound
                .keys
                .iter()
                .filter(|k| ctx.same_slot(k.slot_key(), stream(k)))
                .count()
        };
        info!(
            partitions = inbound.keys.len(),
            forwarded_by_admission = by_call(|k| &k.forward),
            rejected_by_admission = by_call(|k| &k.rejected),
            "inbound partitions whose admission call writes the accepted and rejected events itself"
        );
    }
    ctx.scripts.load(&mut con).await?;
    monitor::check_eviction(ctx, &mut con).await
}
