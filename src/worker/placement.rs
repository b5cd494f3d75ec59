//! Placement: which route an outbound event goes to and when. A route's share of what was read
//! is offered to `schedule.lua` in one call (`place_on`, run by the route's own task in
//! `placers`); an event is dispatched at once, given a slot to sleep until, or passed on to its
//! next route (its fallbacks, in order), and rejected when no route can take it within its wait
//! (`route_onward`). A decision an earlier delivery recorded is carried on (`next_step`), never
//! taken twice.

use super::context::Context;
use super::dispatcher::Sleeper;
use super::outputs::{count_dispatch, Finished, Rejection};
use crate::config::Route;
use crate::error::Error;
use crate::event::{OutboundEvent, Reason, Refused};
use crate::marker::Marker;
use crate::pacing;
use crate::scripts::{EventRef, ScheduleItem, ScheduleReply, Scheduled};
use crate::telemetry;
use crate::worker::held::Hold;
use std::collections::BTreeMap;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// An event on its way to a route.
pub(crate) struct Placing {
    pub(crate) event: OutboundEvent,
    /// Index in the event's route chain (its own route, then its fallbacks) of the next to try.
    next: usize,
    /// Shortest wait any route offered (for `pacer_retry_after_ms`), µs.
    best_wait_us: Option<i64>,
    /// An unreadable decision on record that this one may replace.
    expect: Option<String>,
    /// Its decision vanished while this worker held it: it may be decided anew only if the
    /// group still says this worker holds it (see `still_held`).
    pub(crate) check_held: bool,
    /// Redis µs by which it must go (its first decision's time plus its wait), once a route
    /// that slotted it could not meet the slot: its fallbacks get only what is left.
    deadline_us: Option<i64>,
    /// Redis µs of that first decision: its wait on a fallback counts from then (the ready
    /// entry's `pacer_wait_ms`), not from its decision there.
    since_us: Option<i64>,
    pub(crate) permit: Hold,
}

impl Placing {
    pub(crate) fn new(event: OutboundEvent, permit: Hold) -> Self {
        Placing {
            event,
            next: 0,
            best_wait_us: None,
            expect: None,
            check_held: false,
            deadline_us: None,
            since_us: None,
            permit,
        }
    }

    /// The same event, to be decided anew on `route` (its decision there is gone).
    fn again_on(event: OutboundEvent, ctx: &Context, route: usize, permit: Hold) -> Self {
        let next = position(ctx, &event, route);
        Placing {
            next,
            ..Placing::new(event, permit)
        }
    }

    /// The same event, whose decision on `route` vanished while it slept here (expired or
    /// evicted): decided anew there only if this worker still holds the entry.
    pub(crate) fn decision_gone(
        event: OutboundEvent,
        ctx: &Context,
        route: usize,
        permit: Hold,
    ) -> Self {
        Placing {
            check_held: true,
            ..Placing::again_on(event, ctx, route, permit)
        }
    }

    /// The same event after `route`, where it slept, gave it up at dispatch (its wait there
    /// would be `wait_us`; it had to go by `deadline_us`, Redis µs, without the lateness
    /// tolerance; it was first decided at `since_us`): on to the route after it, with only what
    /// is left of its wait. Given its whole wait again, a late event waited up to twice its
    /// `max_wait`.
    pub(crate) fn after(
        event: OutboundEvent,
        ctx: &Context,
        route: usize,
        (wait_us, deadline_us, since_us): (i64, i64, i64),
        permit: Hold,
    ) -> Self {
        let mut p = Placing::again_on(event, ctx, route, permit);
        p.offered(wait_us);
        p.next += 1;
        p.deadline_us = Some(deadline_us);
        p.since_us = Some(since_us);
        p
    }

    /// Whether it is on its first try: nothing decided for it on any route yet, by this
    /// delivery or an earlier one (an entry delivered before may carry a decision on record,
    /// whose slot must not wait).
    pub(crate) fn is_fresh(&self) -> bool {
        self.event.deliveries <= 1
            && self.next == 0
            && self.best_wait_us.is_none()
            && self.expect.is_none()
            && !self.check_held
            && self.deadline_us.is_none()
    }

    fn offered(&mut self, wait_us: i64) {
        self.best_wait_us = Some(self.best_wait_us.map_or(wait_us, |b| b.min(wait_us)));
    }
}

/// Where `route` is in the event's route chain.
fn position(ctx: &Context, event: &OutboundEvent, route: usize) -> usize {
    ctx.cfg
        .outbound
        .chain(event.route)
        .iter()
        .position(|r| r.index == route)
        .unwrap_or(0)
}

/// What one route's call decided: the events that sleep until their slots, those passed on to
/// their next route, and the rest.
#[derive(Default)]
pub(crate) struct Placed {
    pub(crate) sleepers: Vec<Sleeper>,
    /// Passed over here: on to the next route of their chain.
    pub(crate) onward: Vec<Placing>,
    pub(crate) finished: Finished,
}

/// Splits events by the route each tries next; an event out of routes is rejected into `done`
/// with the shortest wait any route offered.
pub(crate) fn route_onward(
    ctx: &Context,
    events: Vec<Placing>,
    done: &mut Finished,
) -> BTreeMap<usize, Vec<Placing>> {
    let mut by_route: BTreeMap<usize, Vec<Placing>> = BTreeMap::new();
    for p in events {
        let chain = ctx.cfg.outbound.chain(p.event.route);
        match chain.get(p.next) {
            Some(route) => by_route.entry(route.index).or_default().push(p),
            None => reject_full(p, done),
        }
    }
    by_route
}

/// Keeps the events of `group` whose entries this worker still holds. An event whose decision
/// vanished while it slept may have been finished by another worker: a worker stalled past
/// `claim_idle` loses its entries to a claimer, and once `dedupe_ttl` has passed the claimer's
/// markers are gone too, so only the group's pending list still tells. Deciding such an event
/// anew would place, reject or dead-letter it a second time. `None` if `stop` came first.
pub(crate) async fn still_held(
    ctx: &Context,
    group: Vec<Placing>,
    stop: &CancellationToken,
) -> Option<Vec<Placing>> {
    // One XPENDING per such event, all at once: the multiplexed connection pipelines them, so
    // a worker waking with thousands of them pays about one round trip, not thousands.
    let checks = group.iter().map(|p| async move {
        if !p.check_held {
            return Some(true);
        }
        ctx.retry("pending", stop, || {
            let mut con = ctx.con.clone();
            async move {
                crate::streams::held_by(
                    &mut con,
                    &p.event.stream,
                    &ctx.cfg.worker.group,
                    p.event.id(),
                    &ctx.consumer,
                )
                .await
            }
        })
        .await
    });
    let held = futures_util::future::join_all(checks).await;
    let (mut kept, mut again, mut gone) = (Vec::with_capacity(group.len()), 0, 0);
    for (mut p, held) in group.into_iter().zip(held) {
        match (p.check_held, held?) {
            (false, _) => kept.push(p),
            (true, true) => {
                again += 1;
                p.check_held = false;
                kept.push(p);
            }
            (true, false) => gone += 1,
        }
    }
    // One line per batch, not per event: a worker frozen for an hour may wake with thousands.
    if again + gone > 0 {
        warn!(
            decided_anew = again,
            let_go = gone,
            "events whose decisions expired while this worker held them: those still its own are decided anew, those another worker claimed or finished are let go"
        );
    }
    Some(kept)
}

/// Offers `group` to `route` in one `schedule` call, retried with backoff until Redis answers;
/// `None` if `stop` came first (the entries stay pending for another worker). A route whose
/// call fails with an error retrying cannot fix (one of its keys holds the wrong kind of
/// value: something else wrote it) dead-letters the group, saying why, rather than hold its
/// events, and in time the worker's every permit, until someone fixes the key.
pub(crate) async fn place_on(
    ctx: &Context,
    route: &Route,
    group: Vec<Placing>,
    stop: &CancellationToken,
) -> Option<Placed> {
    let (group, reply) = schedule_on(ctx, route, group, stop).await;
    let mut reply = match reply? {
        Ok(reply) => reply,
        Err(e) => return Some(broken(ctx, route, group, &e).await),
    };
    mended(ctx, route);
    let mut placed = Placed::default();
    ctx.clock.observe(reply.end_us, ctx.time.now());
    telemetry::route_queue(&route.name, reply.tat_us - reply.now_us);
    ctx.shares.queue(route.index, reply.tat_us - reply.now_us);
    let acked = ctx.acks_in_script(&route.keys.ready);
    let items = std::mem::take(&mut reply.items);
    for (p, outcome) in group.into_iter().zip(items) {
        let stream_acked = acked(&p.event.stream);
        decided(ctx, route, p, outcome, &reply, stream_acked, &mut placed);
    }
    Some(placed)
}

/// Carries out what `schedule` decided for one event.
fn decided(
    ctx: &Context,
    route: &Route,
    mut p: Placing,
    outcome: Scheduled,
    reply: &ScheduleReply,
    acked: bool,
    placed: &mut Placed,
) {
    // As `schedule.lua` takes it: what is left by the event's deadline, if it has one.
    let max_wait = p.deadline_us.map_or(max_wait_us(route, &p.event), |d| {
        max_wait_us(route, &p.event).min(d - reply.now_us)
    });
    match outcome {
        Scheduled::Dispatched { .. } => {
            let metrics = &ctx.route_metrics[route.index];
            metrics.scheduled_wait(0);
            metrics.lateness(0);
            count_dispatch(ctx, &p.event, route);
            if !acked {
                placed.finished.ack_event(&p.event);
            }
        }
        Scheduled::Sleep { slot_us } => {
            ctx.route_metrics[route.index].scheduled_wait(slot_us - reply.now_us);
            // As `schedule.lua` records it: its wait, give or take the lateness tolerance.
            let deadline = reply.now_us + max_wait + pacing::LATE_US;
            let seat = ctx.shares.seat(route.index, p.permit.places());
            placed.sleepers.push(Sleeper::new(
                p.event,
                p.permit,
                seat,
                slot_us,
                deadline,
                p.since_us.unwrap_or(reply.now_us),
            ));
        }
        Scheduled::TooLong { wait_us } => {
            p.offered(wait_us);
            p.next += 1;
            p.expect = None;
            placed.onward.push(p);
        }
        Scheduled::Duplicate(owner) => {
            let detail = format!(
                "event id {:?} was already taken by entry {owner}",
                p.event.event_id.as_deref().unwrap_or_default()
            );
            // Counted once, by `outputs::finish`, when its dead letter is written.
            placed.finished.dead.push((
                p.event.entry(),
                Refused {
                    reason: Reason::Duplicate,
                    detail,
                },
            ));
        }
        Scheduled::Expired(age_us) => {
            let detail = format!(
                "read {} ms after it was added, more than route {}'s max_age",
                age_us / 1000,
                route.name
            );
            placed.finished.rejected.push(Rejection {
                event: p.event,
                reason: Reason::Expired,
                detail,
                retry_after_ms: 0,
            });
        }
        Scheduled::Stale(age_us) => {
            let stale = Refused::stale(age_us, "outbound.dedupe_ttl");
            placed.finished.dead.push((p.event.entry(), stale));
        }
        Scheduled::Decided(value) => match next_step(&value) {
            Step::Acknowledge => {
                debug!(entry = %p.event.id(), route = %route.name, "already dispatched by an earlier delivery");
                if !acked {
                    placed.finished.ack_event(&p.event);
                }
            }
            Step::NextRoute { wait_us } => {
                p.offered(wait_us);
                p.next += 1;
                p.expect = None;
                placed.onward.push(p);
            }
            Step::Voided => {
                // A poison check voided it while this delivery was on its way: the entry is
                // being dead-lettered (write-once, so writing it here too cannot double it).
                let detail = format!(
                    "delivered more than worker.max_deliveries ({}) times",
                    ctx.cfg.worker.max_deliveries
                );
                placed.finished.dead.push((
                    p.event.entry(),
                    Refused {
                        reason: Reason::TooManyDeliveries,
                        detail,
                    },
                ));
            }
            Step::Sleep {
                slot_us,
                deadline_us,
            } => {
                // Its slot stands (the dispatch call judges whether it can still be met).
                let seat = ctx.shares.seat(route.index, p.permit.places());
                placed.sleepers.push(Sleeper::new(
                    p.event,
                    p.permit,
                    seat,
                    slot_us,
                    deadline_us,
                    (deadline_us - max_wait - pacing::LATE_US).min(slot_us),
                ));
            }
            Step::Redecide => {
                warn!(entry = %p.event.id(), route = %route.name, decision = value, "unreadable decision on record; deciding anew");
                p.expect = Some(value);
                placed.onward.push(p);
            }
        },
    }
}

/// No route could take the event within its wait: reject it with the shortest wait offered.
fn reject_full(p: Placing, done: &mut Finished) {
    let wait_us = p.best_wait_us.unwrap_or(0).max(0);
    // Rounded up, as retry_after is: rounded down, a wait of 1000.4 ms read "1000 ms" against
    // a max_wait of 1s, as if it fitted.
    let retry_after_ms = (wait_us as u64).div_ceil(1000) as i64;
    // "Before its deadline", not "within max_wait": a wait counts from the event's first
    // decision, so one held up since (a stalled worker, a failover that wiped its dispatch) is
    // passed over for a wait of a millisecond, which read as if 1 ms were too long.
    let detail = format!(
        "no route could take it before its deadline (max_wait from its first decision); the shortest wait offered was {retry_after_ms} ms"
    );
    done.rejected.push(Rejection {
        event: p.event,
        reason: Reason::QueueFull,
        detail,
        retry_after_ms,
    });
}

/// The group dead-lettered as `route_broken`: its route's call failed with `e`, which retrying
/// cannot fix (nothing was written: every script reads all its keys before it writes).
async fn broken(ctx: &Context, route: &Route, group: Vec<Placing>, e: &Error) -> Placed {
    if newly_broken(ctx, route) {
        warn!(route = %route.name, error = %e, "a route's key holds the wrong kind of value: its events are dead-lettered as route_broken until it is fixed");
    }
    debug!(route = %route.name, events = group.len(), "dead-lettered as route_broken");
    let events: Vec<&OutboundEvent> = group.iter().map(|p| &p.event).collect();
    let refused = route_broken(ctx, route, &events, &e.to_string()).await;
    let mut placed = Placed::default();
    for p in group {
        placed
            .finished
            .dead
            .push((p.event.entry(), refused.clone()));
    }
    placed
}

/// Marks `route` broken; whether it was not before (so that it is said once).
pub(crate) fn newly_broken(ctx: &Context, route: &Route) -> bool {
    ctx.broken_routes
        .lock()
        .expect("broken routes")
        .insert(route.index)
}

/// A call on `route` succeeded: if it was broken, it is mended (said once).
pub(crate) fn mended(ctx: &Context, route: &Route) {
    let mut broken = ctx.broken_routes.lock().expect("broken routes");
    if !broken.is_empty() && broken.remove(&route.index) {
        info!(route = %route.name, "the route's calls succeed again: its events are placed again");
    }
}

/// Why `events` of `route` are dead-lettered when the route's call for them failed with `e`, an
/// error retrying cannot fix: naming the key at fault when one still is.
pub(crate) async fn route_broken(
    ctx: &Context,
    route: &Route,
    events: &[&OutboundEvent],
    e: &str,
) -> Refused {
    let name = &route.name;
    let detail = match wrong_key(ctx, route, events).await {
        Some((key, holds, kept)) => format!(
            "route {name}'s calls fail with an error retrying cannot fix ({e}): key {key} holds a {holds} where pacer keeps a {kept}; delete or fix it, then replay the event"
        ),
        None => format!(
            "route {name}'s calls fail with an error retrying cannot fix ({e}); delete or fix the key, then replay the event"
        ),
    };
    Refused {
        reason: Reason::RouteBroken,
        detail,
    }
}

/// The first key a call on `route` for `events` touches that holds another kind of value than
/// pacer keeps there: (key, what it holds, what pacer keeps). Redis's WRONGTYPE does not say
/// which key, and it may be the route's, a decision record's or an id claim's. (Not an input
/// stream's: one replaced while its entries were out has nothing left to acknowledge, and the
/// scripts skip it, lib.lua `check_groups`.) None when no key is wrong (any more), or Redis
/// does not answer.
async fn wrong_key(
    ctx: &Context,
    route: &Route,
    events: &[&OutboundEvent],
) -> Option<(String, String, &'static str)> {
    let mut keys = vec![
        (route.keys.bucket.clone(), "hash"),
        (route.keys.ready.clone(), "stream"),
    ];
    for ev in events {
        keys.push((route.keys.decisions(&ev.stream, ev.id()), "hash"));
        if let Some(id) = &ev.event_id {
            keys.push((route.keys.claim(id), "string"));
        }
    }
    let mut seen = std::collections::HashSet::new();
    keys.retain(|(k, _)| seen.insert(k.clone()));
    // One at a time: a rare path, and keys of several slots (input streams) in a cluster.
    for (key, kept) in keys {
        let mut con = ctx.con.clone();
        let holds: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut con)
            .await
            .ok()?;
        if holds != "none" && holds != kept {
            return Some((key, holds, kept));
        }
    }
    None
}

async fn schedule_on(
    ctx: &Context,
    route: &Route,
    group: Vec<Placing>,
    stop: &CancellationToken,
) -> (Vec<Placing>, Option<crate::error::Result<ScheduleReply>>) {
    let reply = {
        let pairs: Vec<Vec<(&[u8], &[u8])>> = group
            .iter()
            .map(|p| p.event.carried.iter().collect())
            .collect();
        let items: Vec<ScheduleItem<'_>> = group
            .iter()
            .zip(&pairs)
            .map(|(p, fields)| ScheduleItem {
                event: EventRef::of(&p.event, fields),
                claim: p.event.event_id.as_deref(),
                expect: p.expect.as_deref(),
                max_wait_us: max_wait_us(route, &p.event),
                deadline_us: p.deadline_us.unwrap_or(0),
                since_us: p.since_us.unwrap_or(0),
            })
            .collect();
        let acks = ctx.acks_in_script(&route.keys.ready);
        let call = ctx.route_call(route, &acks);
        let ages = (
            ctx.marker_ttl_ms as i64 * 1000,
            route.max_age.map_or(0, |a| a.as_micros() as i64),
            route.max_wait.as_micros() as i64,
        );
        // Nothing sleeps on a decision its replicas have not confirmed: unconfirmed, the call
        // is made again, and gives back the decisions it recorded (or records them anew on a
        // promoted replica that lacks them).
        ctx.retry_unless("schedule", stop, Error::is_wrong_type, || {
            let mut con = ctx.con.clone();
            let (items, call) = (&items, &call);
            async move {
                let reply = ctx.scripts.schedule(&mut con, call, ages, items).await?;
                ctx.replicated(call.keys.ready.as_str()).await?;
                Ok(reply)
            }
        })
        .await
    };
    (group, reply)
}

/// What to do with an event whose earlier delivery left a decision on a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Dispatched by an earlier delivery: only acknowledge.
    Acknowledge,
    /// Passed over here already: try the next route.
    NextRoute { wait_us: i64 },
    /// Voided by a poison check: dead-letter it.
    Voided,
    /// The slot stands: sleep until it (the dispatch judges whether it can still be met).
    Sleep { slot_us: i64, deadline_us: i64 },
    /// Unreadable: decide anew, replacing exactly this value (compare-and-set).
    Redecide,
}

/// Reads the decision an earlier delivery left on a route.
pub(crate) fn next_step(decision: &str) -> Step {
    match Marker::parse(decision) {
        Some(Marker::Dispatched(_)) => Step::Acknowledge,
        Some(Marker::Skipped(wait_us)) => Step::NextRoute { wait_us },
        Some(Marker::Voided) => Step::Voided,
        Some(Marker::Slot {
            slot_us,
            deadline_us,
        }) => Step::Sleep {
            slot_us,
            deadline_us,
        },
        None => Step::Redecide,
    }
}

/// The longest an event accepts to wait on `route`: the route's `max_wait`, or less if the
/// event asks for less.
pub(crate) fn max_wait_us(route: &Route, event: &OutboundEvent) -> i64 {
    let cap = route.max_wait;
    let wait = event.max_wait.map_or(cap, |w| w.min(cap));
    wait.as_micros() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_decisions_are_carried_on() {
        assert_eq!(next_step("d5"), Step::Acknowledge);
        assert_eq!(next_step("x700"), Step::NextRoute { wait_us: 700 });
        assert_eq!(next_step("v0"), Step::Voided);
    }

    #[test]
    fn a_slot_is_slept_on_with_its_deadline() {
        assert_eq!(
            next_step("s10000000:11000000"),
            Step::Sleep {
                slot_us: 10_000_000,
                deadline_us: 11_000_000
            }
        );
    }

    #[test]
    fn an_unreadable_decision_is_decided_anew() {
        for junk in ["garbage", "s5", "d5|1-0@in"] {
            assert_eq!(next_step(junk), Step::Redecide, "{junk}");
        }
    }
}
