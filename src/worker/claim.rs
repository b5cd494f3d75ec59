//! Claiming: every `claim_idle / 2`, the entries other consumers left pending longer than
//! `claim_idle` are claimed from consumers silent that long (a killed, stuck or drained worker;
//! a live one beats every `heartbeat::EVERY`), never from the worker itself, and finished
//! through the same path as a new batch, where a recorded decision is carried on, not taken
//! again. Every few rounds the group's departed consumers are deleted.
//!
//! A tick asks the group for its consumers first and lists the pending entries of the silent
//! ones alone: listing the group's whole pending list walked every entry the live workers hold
//! asleep (a hundred thousand each, at `max_inflight`), on every tick, to find none.

use super::budget;
use super::context::Context;
use super::placers::Placers;
use super::reader;
use crate::backoff::Backoff;
use crate::error::Result;
use crate::event::Entry;
use crate::streams;
use crate::telemetry;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Most claim rounds one tick runs per stream, so that a stream full of entries another worker
/// keeps claiming first cannot hold this loop.
const CLAIM_ROUNDS: usize = 100;

/// Every how many claim ticks the group's departed consumers are deleted.
const REAP_EVERY_TICKS: u64 = 10;

pub(super) async fn run(ctx: Arc<Context>, placers: Arc<Placers>, shutdown: CancellationToken) {
    let idle = ctx.cfg.worker.claim_idle;
    let every = (idle / 2).clamp(Duration::from_millis(50), Duration::from_secs(10));
    let batch = ctx.cfg.worker.batch;
    // Counts failures only to say the first one: the reader and the dispatcher report Redis
    // trouble too, and the next tick tries again anyway.
    let mut failures = Backoff::default();
    for tick in 0u64.. {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if tick % REAP_EVERY_TICKS == 0 {
            reap(&ctx).await;
        }
        for stream in &ctx.streams {
            let mut con = ctx.con.clone();
            let silent = match silent_holders(&mut con, &ctx, stream, idle).await {
                Ok(s) => s,
                Err(e) => {
                    failures.fail();
                    if failures.failures() == 1 {
                        warn!(error = %e, %stream, "listing the group's consumers failed");
                    }
                    continue;
                }
            };
            let mut rounds = CLAIM_ROUNDS;
            for holder in &silent {
                // Each round lists from where the last one ended: entries listed but not
                // claimed (taken by another worker meanwhile) never fill every page.
                let mut from = "-".to_string();
                while rounds > 0 {
                    rounds -= 1;
                    let permits = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        p = ctx.permits.clone().acquire_many_owned(batch as u32) => p.expect("never closed"),
                    };
                    let claimed = claim(&ctx, stream, idle, holder, (&from, batch));
                    let (more, last, entries) = match telemetry::timed("claim", claimed).await {
                        Ok(c) => {
                            failures.succeed();
                            c
                        }
                        Err(e) => {
                            failures.fail();
                            if failures.failures() == 1 {
                                warn!(error = %e, %stream, "claiming pending entries failed");
                            }
                            break;
                        }
                    };
                    if !entries.is_empty() {
                        info!(%stream, count = entries.len(), %holder, "claimed entries left pending by another consumer");
                        telemetry::claimed(stream, entries.len());
                        let sizes: Vec<usize> = entries.iter().map(Entry::size).collect();
                        let Some(held) = budget::hold(&ctx, &sizes, permits, &shutdown).await
                        else {
                            return;
                        };
                        reader::handle(&ctx, entries, held, &placers, &shutdown).await;
                    }
                    match last {
                        Some(last) if more => from = format!("({last}"),
                        _ => break,
                    }
                }
            }
        }
    }
}

/// The consumers of `stream`'s group, other than this worker, that hold entries and have been
/// silent for `idle` or longer. Never one that is alive (it beats every `heartbeat::EVERY`):
/// its entries sleep in its hands, however long. claim_idle above the longest max_wait kept
/// them safe within one config, but not across a rolling change that lowered it: the new
/// workers claimed what the old ones slept on, and one entry ended both dispatched and
/// rejected (found by review).
async fn silent_holders<C: redis::aio::ConnectionLike>(
    con: &mut C,
    ctx: &Context,
    stream: &str,
    idle: Duration,
) -> Result<Vec<String>> {
    Ok(streams::consumers(con, stream, &ctx.cfg.worker.group)
        .await?
        .into_iter()
        .filter(|c| c.pending > 0 && c.idle_ms >= idle.as_millis() as i64 && c.name != ctx.consumer)
        .map(|c| c.name)
        .collect())
}

/// Lists up to `count` entries `holder` has held on `stream` longer than `idle`, from `from`,
/// and claims as many of them as fit in `read_bytes` (counted in Redis first, `sizes.lua`:
/// `holder` may have been killed for holding them, and claiming them all at once would kill
/// this worker too) unless `holder` has come back meanwhile; returns whether a page may follow,
/// the last entry listed and taken, and the entries this worker won.
async fn claim(
    ctx: &Context,
    stream: &Arc<str>,
    idle: Duration,
    holder: &str,
    (from, count): (&str, usize),
) -> Result<(bool, Option<String>, Vec<Entry>)> {
    let mut con = ctx.con.clone();
    let group = &ctx.cfg.worker.group;
    let page = streams::pending_idle(&mut con, stream, group, idle, (from, count), holder).await?;
    let mut listed = page.entries;
    if listed.is_empty() {
        return Ok((false, None, Vec::new()));
    }
    // Asked again just before the claim: it may have been only stalled, and be back.
    let silent = silent_holders(&mut con, ctx, stream, idle).await?;
    if !silent.iter().any(|s| s == holder) {
        return Ok((false, None, Vec::new()));
    }
    let ids: Vec<&str> = listed.iter().map(|l| l.id.as_str()).collect();
    // One at a time when Redis cannot count them (a user that may not run the script or read
    // the stream): slower, but never the whole page at once, and never none.
    let fit = match (ctx.scripts)
        .fitting(&mut con, stream, &ids, ctx.cfg.worker.read_bytes)
        .await
    {
        Ok(fit) => fit,
        Err(e) => {
            debug!(error = %e, %stream, "counting the entries to claim failed: claiming one");
            1
        }
    };
    let more = page.listed >= count || fit < listed.len();
    listed.truncate(fit.max(1));
    let last = listed.last().map(|l| l.id.clone());
    let mut entries = streams::claim(&mut con, stream, group, &ctx.consumer, idle, &listed).await?;
    // An entry deleted from the stream while pending (a producer trimmed it) is gone: Redis 7
    // drops it from the group when claimed (older versions return it without fields). The
    // others listed but not claimed went to another worker meanwhile, or were acknowledged.
    let mut deleted: Vec<String> = Vec::new();
    entries.retain(|e| {
        let gone = e.fields.is_empty();
        if gone {
            deleted.push(e.id.clone());
        }
        !gone
    });
    for id in listed.iter().map(|l| &l.id) {
        if !entries.iter().any(|e| e.id == *id) && !deleted.contains(id) {
            let left: redis::Value = redis::cmd("XRANGE")
                .arg(stream.as_ref())
                .arg(id)
                .arg(id)
                .query_async(&mut con)
                .await?;
            if matches!(&left, redis::Value::Array(a) if a.is_empty()) {
                deleted.push(id.clone());
            }
        }
    }
    if !deleted.is_empty() {
        // Acknowledged so that no claimer meets them again (a no-op where Redis dropped them).
        let ids: Vec<&str> = deleted.iter().map(String::as_str).collect();
        streams::ack(&mut con, stream, group, &ids).await?;
        telemetry::input_deleted(stream, deleted.len());
        warn!(
            %stream,
            count = deleted.len(),
            first = %deleted[0],
            "pending entries were deleted from the input stream before they were finished (trimmed by a producer?); they are lost to pacer"
        );
    }
    Ok((more, last, entries))
}

/// Deletes consumers of departed workers (each run joins under a new name) once they hold
/// nothing and have been idle for twice `claim_idle`: without this the group's consumer list
/// would grow with every restart. Best effort; the next tick tries again.
async fn reap(ctx: &Context) {
    let min_idle = (ctx.cfg.worker.claim_idle.saturating_mul(2)).max(Duration::from_secs(1));
    for stream in &ctx.streams {
        let mut con = ctx.con.clone();
        let reaped = ctx
            .scripts
            .reap(
                &mut con,
                stream,
                &ctx.cfg.worker.group,
                min_idle,
                &ctx.consumer,
            )
            .await;
        match reaped {
            Ok(0) => {}
            Ok(n) => info!(%stream, consumers = n, "deleted departed consumers holding nothing"),
            Err(e) => debug!(%stream, error = %e, "deleting departed consumers failed"),
        }
    }
}
