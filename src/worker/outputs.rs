//! Where finished entries go: rejections and dead letters, each written once to its shared
//! stream (`lua/emit.lua`), then the acknowledgements, which come only once an entry's output
//! exists. Where the input stream shares the output's slot (always, on a Redis that is not a
//! cluster), the script that writes the output acknowledges the entry in the same step, so an
//! entry is never left both written and pending.

use super::context::Context;
use crate::config::Route;
use crate::error::Error;
use crate::event::{self, Entry, Fields, OutboundEvent, Reason, Refused};
use crate::keys::OutputKeys;
use crate::scripts::{EmitCall, EmitItem, Writing};
use crate::streams;
use crate::telemetry::{self, Outcome};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// An outbound event that goes to the rejected stream.
pub(crate) struct Rejection {
    pub(crate) event: OutboundEvent,
    pub(crate) reason: Reason,
    pub(crate) detail: String,
    pub(crate) retry_after_ms: i64,
}

/// Where a batch's entries ended, short of a ready stream.
#[derive(Default)]
pub(crate) struct Finished {
    /// Entries whose output exists (or needs none) and that no script acknowledged.
    pub(crate) acks: Vec<(Arc<str>, String)>,
    pub(crate) dead: Vec<(Entry, Refused)>,
    pub(crate) rejected: Vec<Rejection>,
}

impl Finished {
    pub(crate) fn ack_event(&mut self, event: &OutboundEvent) {
        self.acks
            .push((event.stream.clone(), event.id().to_string()));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.acks.is_empty() && self.dead.is_empty() && self.rejected.is_empty()
    }
}

/// Counts a dispatch on `route` (and, for a fallback, the reroute on the same route: where the
/// event came out, as `pacer report` counts it).
pub(crate) fn count_dispatch(ctx: &Context, event: &OutboundEvent, route: &Route) {
    ctx.route_metrics[route.index].dispatched(route.index != event.route);
}

/// Writes rejections and dead letters (once each), then acknowledges everything finished.
pub(crate) async fn finish(ctx: &Context, mut done: Finished, stop: &CancellationToken) {
    let dead: Vec<(&Entry, Fields)> = done
        .dead
        .iter()
        .map(|(e, r)| (e, event::dead_letter_fields(e, r)))
        .collect();
    let limits = (ctx.marker_ttl_ms, ctx.cfg.outbound.flow.max_len);
    if let Some(unacked) = emit(ctx, "deadletter", &ctx.dead, limits, &dead, stop).await {
        for (entry, refused) in &done.dead {
            let outcome = match refused.reason {
                Reason::Duplicate => Outcome::Duplicate,
                _ => Outcome::DeadLettered,
            };
            telemetry::outbound_event("none", outcome);
            debug!(entry = %entry.id, reason = refused.reason.as_str(), detail = %refused.detail, "dead-lettered");
        }
        done.acks.extend(unacked);
    }
    // Only where they came from, for the write-once records and acks; the fields are built
    // beside them.
    let sources: Vec<Entry> = done
        .rejected
        .iter()
        .map(|r| Entry {
            stream: r.event.stream.clone(),
            id: r.event.id().to_string(),
            fields: Vec::new(),
            deliveries: r.event.deliveries,
        })
        .collect();
    let rejected: Vec<(&Entry, Fields)> = sources
        .iter()
        .zip(&done.rejected)
        .map(|(source, r)| {
            let route = &ctx.cfg.outbound.route_at(r.event.route).name;
            let fields =
                event::rejected_fields(&r.event, route, r.reason, &r.detail, r.retry_after_ms);
            (source, fields)
        })
        .collect();
    if let Some(unacked) = emit(ctx, "reject", &ctx.rejected, limits, &rejected, stop).await {
        for r in &done.rejected {
            let route = &ctx.cfg.outbound.route_at(r.event.route).name;
            let outcome = match r.reason {
                Reason::Expired => Outcome::Expired,
                _ => Outcome::Rejected,
            };
            telemetry::outbound_event(route, outcome);
        }
        done.acks.extend(unacked);
    }
    ack(ctx, done.acks, stop).await;
}

/// Writes each entry's fields to a shared output stream once (its write-once records live
/// `ttl_ms`, the stream is trimmed to about `max_len`), acknowledging in the same call the
/// entries whose stream shares the output's slot. Returns the entries still to acknowledge (an
/// empty list when there was nothing to write), or None if shutdown came first.
pub(crate) async fn emit(
    ctx: &Context,
    op: &'static str,
    keys: &OutputKeys,
    (ttl_ms, max_len): (u64, u64),
    entries: &[(&Entry, Fields)],
    stop: &CancellationToken,
) -> Option<Vec<(Arc<str>, String)>> {
    if entries.is_empty() {
        return Some(Vec::new());
    }
    let items: Vec<EmitItem<'_>> = entries
        .iter()
        .map(|(e, fields)| EmitItem {
            source_stream: &e.stream,
            source_id: &e.id,
            fields,
        })
        .collect();
    let acks = ctx.acks_in_script(&keys.stream);
    let call = EmitCall {
        keys,
        out: Writing {
            ttl_ms,
            max_len,
            group: &ctx.cfg.worker.group,
            acks: &acks,
        },
    };
    // Write-once, so repeated until the replicas confirm it before anything is acknowledged.
    ctx.retry(op, stop, || {
        let mut con = ctx.con.clone();
        let (items, call) = (&items, &call);
        async move {
            ctx.scripts.emit(&mut con, call, items).await?;
            ctx.replicated(&keys.stream).await
        }
    })
    .await?;
    Some(
        entries
            .iter()
            .filter(|(e, _)| !acks(&e.stream))
            .map(|(e, _)| (e.stream.clone(), e.id.clone()))
            .collect(),
    )
}

/// Acknowledges finished entries, one XACK per input stream. A stream whose key now holds another
/// kind of value (replaced while its entries were out) holds nothing to acknowledge: that is
/// not retried, as the scripts skip it too (lib.lua `check_groups`).
pub(crate) async fn ack(ctx: &Context, acks: Vec<(Arc<str>, String)>, stop: &CancellationToken) {
    let mut by_stream: BTreeMap<Arc<str>, Vec<String>> = BTreeMap::new();
    for (stream, id) in acks {
        by_stream.entry(stream).or_default().push(id);
    }
    for (stream, ids) in &by_stream {
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let acked = ctx
            .retry_unless("ack", stop, Error::is_wrong_type, || {
                let mut con = ctx.con.clone();
                let ids = &ids;
                async move { streams::ack(&mut con, stream, &ctx.cfg.worker.group, ids).await }
            })
            .await;
        if let Some(Err(e)) = acked {
            warn!(%stream, entries = ids.len(), error = %e, "an input stream's key holds the wrong kind of value: its finished entries are not acknowledged (they are gone with it)");
        }
    }
}
