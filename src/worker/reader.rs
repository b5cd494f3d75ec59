//! Reading input batches with the consumer group, and the path every batch takes, read or
//! claimed: inbound entries are admitted, outbound ones parsed, poison settled, the rest handed
//! to their routes' placement tasks (`placers`), then rejections, dead letters and acks.

use super::budget::{self, ReadSize};
use super::context::Context;
use super::held::{self, Hold};
use super::outputs::{self, Finished};
use super::placement::Placing;
use super::placers::Placers;
use super::{inbound, poison};
use crate::backoff::Backoff;
use crate::connection::RedisConn;
use crate::event;
use crate::event::Entry;
use crate::fault;
use crate::streams;
use crate::telemetry;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// How often a reader that stopped for the parked entries looks again.
const PARKED_FULL_WAIT: Duration = Duration::from_millis(50);

/// How long one XREADGROUP blocks: also how long a SIGTERM may wait for the reader to notice.
pub(super) const READ_BLOCK: Duration = Duration::from_millis(500);

/// Reads batches of one input stream (at `index` in `Context::streams`) until shutdown; each batch is taken to its end before the
/// next read. One reader per stream: streams in different cluster slots cannot share one
/// XREADGROUP, and a read of one stream returns at most the entries it holds permits for
/// (`budget`: `batch` at most, fewer when entries are large; a recovery read, as many of its
/// own pending entries as fit in `read_bytes`), so the reader can always take what it read.
pub(super) async fn run(
    ctx: &Arc<Context>,
    index: usize,
    mut con: RedisConn,
    placers: &Placers,
    shutdown: &CancellationToken,
) {
    let mut size = ReadSize::new(ctx.cfg.worker.batch, ctx.cfg.worker.read_bytes);
    let mut backoff = Backoff::default();
    let stream = ctx.streams[index].clone();
    let one = std::slice::from_ref(&stream);
    // The newest entry a read handed over. A read whose reply is lost (a timeout: the worker
    // stalled, or the network dropped it) may still have delivered entries to this consumer;
    // nothing else would see them before `claim_idle`, so the reader then reads its own pending
    // entries after this id before it reads new ones again.
    let mut last_seen: Option<String> = None;
    // At start too: what this consumer name holds pending is a predecessor's under the same name
    // (a restart with a fixed `worker.consumer`, or a container restarted in its pod, whose
    // hostname and pid 1 make the same default name). The claimer never takes a worker's own
    // entries, so nothing else would: a lone worker restarted after kill -9 left 1,287 of them
    // pending for good.
    let mut recover = true;
    // The stream's key holds another kind of value: said once, until a read succeeds again.
    let mut wrong_type = false;
    // Until the first new read: it knows nothing of what it will bring (a worker started on a
    // backlog), so what is there is counted in Redis first. That read alone: an idle reader
    // asking before every read would add a script call every READ_BLOCK for nothing.
    let mut blind = true;
    while !shutdown.is_cancelled() {
        let fresh = !recover;
        let count = if recover {
            recovery_count(ctx, &mut con, &stream, last_seen.as_deref()).await
        } else if blind {
            let group = &ctx.cfg.worker.group;
            let (most, budget) = (size.count(), ctx.cfg.worker.read_bytes);
            (ctx.scripts)
                .fitting_next(&mut con, &stream, group, most, budget)
                .await
                .unwrap_or(1)
        } else {
            size.count()
        };
        // As many entries parked as a worker keeps (`share`): read no more until some are
        // taken back, as when every place is held.
        while ctx.shares.parked_full() {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(PARKED_FULL_WAIT) => {}
            }
        }
        let permits = tokio::select! {
            _ = shutdown.cancelled() => return,
            p = ctx.permits.clone().acquire_many_owned(count as u32) => p.expect("never closed"),
        };
        // Held while the read waits for entries: the places kept for reads (`share`).
        let reading = ctx.shares.reading(count);
        let read = telemetry::timed(
            "read",
            streams::read_group(
                &mut con,
                &ctx.cfg.worker.group,
                &ctx.consumer,
                one,
                if recover {
                    last_seen.as_deref().unwrap_or("0")
                } else {
                    ">"
                },
                count,
                READ_BLOCK,
            ),
        )
        .await;
        drop(reading);
        let (entries, weights) = match read {
            Ok(entries) => {
                ctx.health.succeeded();
                backoff.succeed();
                if std::mem::take(&mut wrong_type) {
                    info!(%stream, "the input stream is read again");
                }
                if recover {
                    if entries.is_empty() {
                        recover = false;
                    } else {
                        info!(%stream, entries = entries.len(), "taking up entries this consumer holds pending (a lost read's, or a predecessor's under this name)");
                    }
                }
                if let Some(newest) = entries.last() {
                    last_seen = Some(newest.id.clone());
                }
                let sizes: Vec<usize> = entries.iter().map(Entry::size).collect();
                size.read(&sizes);
                let weights = budget::weighed(ctx, &sizes);
                if !entries.is_empty() {
                    // Before this read waits for its weight: the places it frees meanwhile are
                    // kept for reads like it, not taken by a long queue.
                    ctx.shares
                        .read_weighed(index, entries.len(), weights.iter().sum());
                }
                blind &= !fresh;
                (entries, weights)
            }
            Err(e) => {
                // The stream deleted under a blocked read: Redis is fine, and the next read says
                // what became of the key (NOGROUP: made again below; or another kind of value).
                let deleted = e.to_string().contains("UNBLOCKED");
                // The key's fault, not Redis's: told here once (health leaves it out, see
                // `Context::failed`). Deleting the key lets the group be made again (NOGROUP).
                if e.is_wrong_type() && !std::mem::replace(&mut wrong_type, true) {
                    warn!(%stream, error = %e, "the input stream's key holds the wrong kind of value: it is not read until the key is deleted or fixed");
                }
                if !deleted {
                    ctx.failed("read", &e);
                }
                let delay = backoff.fail();
                debug!(error = %e, %stream, retry_in = ?delay, "reading the input stream failed");
                let no_group = e.to_string().contains("NOGROUP");
                drop(permits);
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
                // With the group gone, so are its pending entries.
                recover = !no_group;
                if no_group {
                    // Redis lost the group (restarted empty, or the stream was deleted).
                    ctx.health.set_groups_ok(false);
                    if let Err(e) = super::prepare::prepare(ctx, shutdown).await {
                        tracing::error!(error = %e, "creating the consumer group again failed");
                    }
                }
                continue;
            }
        };
        if !take_on(ctx, (index, entries), weights, permits, placers, shutdown).await {
            return;
        }
    }
}

/// How many of the entries this consumer holds pending after `after` the next recovery read
/// takes: as many as fit in `read_bytes`, counted in Redis (`sizes.lua`), since a predecessor
/// under this name may have been killed for holding them; `batch` when it holds none (the read
/// then finds none and recovery ends), one when Redis cannot say.
async fn recovery_count(
    ctx: &Context,
    con: &mut RedisConn,
    stream: &str,
    after: Option<&str>,
) -> usize {
    let worker = &ctx.cfg.worker;
    let from = after.map_or_else(|| "-".to_string(), |id| format!("({id}"));
    let counted: crate::error::Result<usize> = async {
        let page = streams::pending_idle(
            con,
            stream,
            &worker.group,
            Duration::ZERO,
            (&from, worker.batch),
            &ctx.consumer,
        )
        .await?;
        if page.entries.is_empty() {
            return Ok(worker.batch);
        }
        let ids: Vec<&str> = page.entries.iter().map(|e| e.id.as_str()).collect();
        ctx.scripts
            .fitting(con, stream, &ids, worker.read_bytes)
            .await
    }
    .await;
    counted.unwrap_or(1)
}

/// Takes on `entries` of the stream at `index` in `Context::streams`, just read or claimed with
/// `permits` (one each), of `weights` (`budget::weighed`): registered as held at once, before their permits are
/// weighed (which may wait: they are pending on this worker meanwhile), then `handle`d. False
/// on shutdown while weighing.
pub(super) async fn take_on(
    ctx: &Arc<Context>,
    (index, entries): (usize, Vec<Entry>),
    weights: Vec<usize>,
    permits: OwnedSemaphorePermit,
    placers: &Placers,
    shutdown: &CancellationToken,
) -> bool {
    let registered = (ctx.held).register(index, entries.iter().map(|e| e.id.as_str()));
    // Parked rather than waited for (`budget::hold`) only where parking lets something else
    // go on, and only entries nothing was decided for yet (a redelivered one may have a slot on
    // record that must not wait).
    let parkable = ctx.shares.keeps_reserve() && entries.iter().all(|e| e.deliveries <= 1);
    let Some((permits, underweight)) =
        budget::hold(ctx, weights, permits, parkable, shutdown).await
    else {
        return false;
    };
    let mut holds = held::holds(permits, registered);
    for (hold, under) in holds.iter_mut().zip(underweight) {
        if under {
            hold.mark_underweight();
        }
    }
    handle(ctx, entries, holds, placers, shutdown).await;
    true
}

/// Takes one batch of entries (each with its permit) on: outbound events to their routes'
/// placement tasks, everything that ends here (inbound, poison, bad input) finished here.
pub(super) async fn handle(
    ctx: &Arc<Context>,
    entries: Vec<Entry>,
    permits: Vec<Hold>,
    placers: &Placers,
    stop: &CancellationToken,
) {
    if !entries.is_empty() {
        fault::point("read");
    }
    let (entries, permits) = inbound::admit(ctx, entries, permits, stop);
    let mut done = Finished::default();
    let mut placing = Vec::new();
    let mut over = Vec::new();
    let mut held = Vec::new();
    for (entry, permit) in entries.into_iter().zip(permits) {
        let poisoned = entry.deliveries > ctx.cfg.worker.max_deliveries;
        match event::parse_outbound(entry, &ctx.cfg.outbound) {
            Ok(event) if poisoned => {
                over.push(event);
                held.push(permit);
            }
            Ok(event) => placing.push(Placing::new(event, permit)),
            // An entry that cannot be parsed is dead-lettered for that, however often it came.
            Err((entry, refused)) => {
                done.dead.push((entry, refused));
                held.push(permit);
            }
        }
    }
    if !over.is_empty() && !poison::settle(ctx, over, &mut done, stop).await {
        return;
    }
    placers.send(ctx, placing, &mut done);
    if done.is_empty() {
        return;
    }
    // Written beside the reading, not before the next read: an output that cannot be written
    // (its key of another kind) holds only the entries bound for it, with their permits, not
    // every entry after them. (Read once `max_inflight` is held, as sleeping events are.)
    let (ctx, stop) = (ctx.clone(), stop.clone());
    tokio::spawn(async move {
        outputs::finish(&ctx, done, &stop).await;
        drop(held);
    });
}
