//! Claiming: every `claim_idle / 2`, the entries other consumers left pending longer than
//! `claim_idle` are claimed from consumers silent that long (a killed, stuck or drained worker;
//! a live one beats every `heartbeat::EVERY`), never from the worker itself, and finished
//! through the same path as a new batch, where a recorded decision is carried on, not taken
//! again. Every few rounds the group's departed consumers are deleted.
//!
//! A tick asks the group for its consumers first and lists the pending entries of the silent
//! ones alone: listing the group's whole pending list walked every entry the live workers hold
//! asleep (a hundred thousand each, at `max_inflight`), on every tick, to find none.
//!
//! The same tick takes up what is stranded under the worker's own name (`held`): entries
//! pending on it, idle past `claim_idle`, that it does not hold. No one else would take them
//! (it is alive), and before, they stayed pending until it restarted.

use super::budget;
use super::context::Context;
use super::placers::Placers;
use super::reader;
use crate::backoff::Backoff;
use crate::error::Result;
use crate::event::Entry;
use crate::streams::{self, IdleEntry};
use crate::telemetry;
use std::collections::HashMap;
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
    let mut strays: Vec<Strays> = ctx.streams.iter().map(|_| Strays::default()).collect();
    for tick in 0u64.. {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if tick % REAP_EVERY_TICKS == 0 {
            reap(&ctx).await;
        }
        for (index, stream) in ctx.streams.iter().enumerate() {
            let mut con = ctx.con.clone();
            let (silent, own) = match holders(&mut con, &ctx, stream, idle).await {
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
                        let weights = budget::weigh(&ctx, &entries);
                        let taken = (index, entries);
                        if !reader::take_on(&ctx, taken, weights, permits, &placers, &shutdown)
                            .await
                        {
                            return;
                        }
                    }
                    match last {
                        Some(last) if more => from = format!("({last}"),
                        _ => break,
                    }
                }
            }
            let strays = &mut strays[index];
            let took = take_up(&ctx, &placers, (stream, index), own, strays, &shutdown).await;
            match took {
                Ok(true) => {
                    failures.succeed();
                }
                Ok(false) => return,
                Err(e) => {
                    failures.fail();
                    if failures.failures() == 1 {
                        warn!(error = %e, %stream, "taking up stranded entries failed");
                    }
                }
            }
        }
    }
}

/// What `take_up` found of one stream on earlier ticks: entries pending under this worker's
/// name that it did not hold, by id, and where its listing goes on.
#[derive(Default)]
struct Strays {
    suspects: HashMap<String, IdleEntry>,
    /// Where the listing goes on, when a tick ended it before the end.
    from: Option<String>,
    /// Whether the last tick found more pending on this worker than it held.
    excess: bool,
}

/// Takes up the entries of `stream` (at `index` in `Context::streams`) pending under this
/// worker's own name for `claim_idle` that it does not hold (`held`): their acknowledgement
/// lost with a failover, say. They are finished like claimed entries: a decision on record is
/// carried on; where the failover took that too, along with the dispatch it recorded, the entry
/// is decided anew. An entry is taken up only when a tick before found it so too, and the
/// worker has not read it since: one read just now may be pending before it is registered.
/// Listed only when Redis counted more pending on this worker (`own`) than it held on two
/// ticks running, so a worker holding a hundred thousand entries asleep does not walk them
/// every tick; a tick lists `CLAIM_ROUNDS` pages at most and the next goes on from there.
/// False on shutdown.
async fn take_up(
    ctx: &Arc<Context>,
    placers: &Arc<Placers>,
    (stream, index): (&Arc<str>, usize),
    own: i64,
    strays: &mut Strays,
    shutdown: &CancellationToken,
) -> Result<bool> {
    let (idle, batch) = (ctx.cfg.worker.claim_idle, ctx.cfg.worker.batch);
    let group = &ctx.cfg.worker.group;
    let mut con = ctx.con.clone();
    let suspects = std::mem::take(&mut strays.suspects).into_values().collect();
    let confirmed = ctx.held.unheld(index, suspects, |e: &IdleEntry| &e.id);
    let mut left = confirmed.as_slice();
    while !left.is_empty() {
        let permits = tokio::select! {
            _ = shutdown.cancelled() => return Ok(false),
            p = ctx.permits.clone().acquire_many_owned(batch as u32) => p.expect("never closed"),
        };
        let page = &left[..left.len().min(batch)];
        let (taken, entries) = take(ctx, &mut con, stream, idle, page.to_vec()).await?;
        left = &left[taken..];
        if entries.is_empty() {
            continue;
        }
        warn!(%stream, count = entries.len(), first = %entries[0].id, "taking up entries pending under this worker's name that it no longer held (a write lost in a failover?)");
        telemetry::claimed(stream, entries.len());
        let weights = budget::weigh(ctx, &entries);
        if !reader::take_on(ctx, (index, entries), weights, permits, placers, shutdown).await {
            return Ok(false);
        }
    }
    // Twice running: the two counts are taken apart (an entry just read is pending before it
    // is registered, one just acknowledged registered until its hold is dropped), and listing
    // a hundred thousand entries asleep past claim_idle on a passing difference costs Redis.
    let excess = own > ctx.held.count(index) as i64;
    let twice = std::mem::replace(&mut strays.excess, excess) && excess;
    if !twice && strays.from.is_none() {
        return Ok(true);
    }
    let mut from = strays.from.take().unwrap_or_else(|| "-".to_string());
    for _ in 0..CLAIM_ROUNDS {
        let page =
            streams::pending_idle(&mut con, stream, group, idle, (&from, batch), &ctx.consumer)
                .await?;
        let last = page.last.clone();
        for e in ctx.held.unheld(index, page.entries, |e| &e.id) {
            strays.suspects.insert(e.id.clone(), e);
        }
        match last {
            Some(last) if page.listed >= batch => from = format!("({last}"),
            _ => return Ok(true),
        }
    }
    strays.from = Some(from);
    Ok(true)
}

/// The consumers of `stream`'s group, other than this worker, that hold entries and have been
/// silent for `idle` or longer; and how many entries Redis counts pending on this worker. Never
/// one that is alive (it beats every `heartbeat::EVERY`): its entries sleep in its hands,
/// however long. claim_idle above the longest max_wait kept them safe within one config, but
/// not across a rolling change that lowered it: the new workers claimed what the old ones slept
/// on, and one entry ended both dispatched and rejected (found by review).
async fn holders<C: redis::aio::ConnectionLike>(
    con: &mut C,
    ctx: &Context,
    stream: &str,
    idle: Duration,
) -> Result<(Vec<String>, i64)> {
    let consumers = streams::consumers(con, stream, &ctx.cfg.worker.group).await?;
    let own = consumers
        .iter()
        .find(|c| c.name == ctx.consumer)
        .map_or(0, |c| c.pending);
    let silent = consumers
        .into_iter()
        .filter(|c| c.pending > 0 && c.idle_ms >= idle.as_millis() as i64 && c.name != ctx.consumer)
        .map(|c| c.name)
        .collect();
    Ok((silent, own))
}

/// Lists up to `count` entries `holder` has held on `stream` longer than `idle`, from `from`,
/// and claims as many of them as fit (`take`) unless `holder` has come back meanwhile; returns
/// whether a page may follow, the last entry listed and taken, and the entries this worker won.
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
    let listed = page.entries;
    if listed.is_empty() {
        return Ok((false, None, Vec::new()));
    }
    // Asked again just before the claim: it may have been only stalled, and be back.
    let (silent, _) = holders(&mut con, ctx, stream, idle).await?;
    if !silent.iter().any(|s| s == holder) {
        return Ok((false, None, Vec::new()));
    }
    let ids: Vec<String> = listed.iter().map(|l| l.id.clone()).collect();
    let (taken, entries) = take(ctx, &mut con, stream, idle, listed).await?;
    let more = page.listed >= count || taken < ids.len();
    Ok((more, ids.get(taken.wrapping_sub(1)).cloned(), entries))
}

/// Claims for this worker the first of `listed` (entries pending longer than `idle`) that fit
/// in `read_bytes` (counted in Redis first, `sizes.lua`: their holder may have been killed for
/// holding them, and taking them all at once would kill this worker too), one at least; returns
/// how many of `listed` that took in, and the entries won. Entries deleted from the stream
/// meanwhile are acknowledged and counted as lost.
async fn take(
    ctx: &Context,
    con: &mut crate::connection::RedisConn,
    stream: &Arc<str>,
    idle: Duration,
    mut listed: Vec<IdleEntry>,
) -> Result<(usize, Vec<Entry>)> {
    let group = &ctx.cfg.worker.group;
    let ids: Vec<&str> = listed.iter().map(|l| l.id.as_str()).collect();
    // One at a time when Redis cannot count them (a user that may not run the script or read
    // the stream): slower, but never the whole page at once, and never none.
    let fit = match (ctx.scripts)
        .fitting(con, stream, &ids, ctx.cfg.worker.read_bytes)
        .await
    {
        Ok(fit) => fit,
        Err(e) => {
            debug!(error = %e, %stream, "counting the entries to claim failed: claiming one");
            1
        }
    };
    listed.truncate(fit.max(1));
    let mut entries = streams::claim(con, stream, group, &ctx.consumer, idle, &listed).await?;
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
                .query_async(con)
                .await?;
            if matches!(&left, redis::Value::Array(a) if a.is_empty()) {
                deleted.push(id.clone());
            }
        }
    }
    lost(ctx, con, stream, &deleted).await?;
    Ok((listed.len(), entries))
}

/// Entries of `stream` pending on this worker that the stream no longer holds (a producer
/// trimmed them): acknowledged, so that no claimer meets them again (a no-op where Redis
/// dropped them), counted and said.
pub(super) async fn lost(
    ctx: &Context,
    con: &mut crate::connection::RedisConn,
    stream: &str,
    deleted: &[String],
) -> Result<()> {
    if deleted.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = deleted.iter().map(String::as_str).collect();
    streams::ack(con, stream, &ctx.cfg.worker.group, &ids).await?;
    telemetry::input_deleted(stream, deleted.len());
    warn!(
        %stream,
        count = deleted.len(),
        first = %deleted[0],
        "pending entries were deleted from the input stream before they were finished (trimmed by a producer?); they are lost to pacer"
    );
    Ok(())
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
