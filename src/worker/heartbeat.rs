//! The worker's heartbeat: every `EVERY`, on each input stream, it tells the consumer group
//! it is alive (`streams::heartbeat`), so that its consumer's idle time stays short while it
//! holds sleeping entries and reads nothing new. Claimers leave a live consumer's entries alone
//! (`claim`), whatever their own `claim_idle`; a consumer name another live worker uses is
//! seen at start on a quiet stream too (`prepare::check_name_free`); and the reaper never
//! deletes a live consumer. A stopped, frozen or killed worker beats no more, and its entries
//! are claimed once it has been silent for `claim_idle`.

use super::context::Context;
use crate::streams;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// Well under the shortest `claim_idle` anyone sets in practice and under the start-up name
/// watch (1.2 s); one call per stream each time, which Redis answers at once.
pub(super) const EVERY: Duration = Duration::from_millis(500);

pub(super) async fn run(ctx: Arc<Context>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let beats = ctx.streams.iter().map(|stream| {
            let mut con = ctx.con.clone();
            let ctx = &ctx;
            async move {
                let beat =
                    streams::heartbeat(&mut con, stream, &ctx.cfg.worker.group, &ctx.consumer);
                // Bounded: a Redis that does not answer must not stack up beats.
                match tokio::time::timeout(EVERY, beat).await {
                    Ok(Ok(())) | Err(_) => {}
                    Ok(Err(e)) => debug!(%stream, error = %e, "heartbeat failed"),
                }
            }
        });
        futures_util::future::join_all(beats).await;
    }
}
