//! The dispatcher: holds events until their slots (`timers`), then hands the due events to
//! `dispatch.lua`, which writes them to their routes' ready streams only if each route's rate
//! holds at that moment on Redis's clock; too early, and the event sleeps again (`decide`).
//!
//! The routes due at one moment go in one call (one per slot in a cluster): Redis runs it at one
//! reading of its clock. Ten routes whose slots fell in the same millisecond, each its own call,
//! queued in Redis one behind the other and landed up to 2 ms late; see the README's Benchmark.
//!
//! Each route has at most `MAX_OUT` calls out at a time, and no route waits for another's: a
//! call runs in its own task and its answer comes back to the timer loop, so a route whose Redis
//! node is slow or gone never delays another slot's dispatches. Events of a route that fall due
//! while its calls are out go in its next call. Two rather than one: on a route of 1000/s with
//! burst 1 every millisecond needs its own dispatch, and with one call out a call that came back
//! late (the worker's thread descheduled, say) left the next millisecond without one; measured,
//! in `cargo bench --bench pressure`, a 1000/s backlog drained at 92–98% of the rate with one
//! and 99.7–99.8% with two, and seconds after a stall fell to 87–94% in some rounds with one,
//! never below 97.8% with two.
//!
//! On shutdown it keeps going until nothing left falls due within `worker.drain`; whatever is
//! still held then is dropped unacknowledged, so it stays pending for another worker.
//!
//! Over 400 lines: the timer loop, the per-route call bookkeeping, and `decide` with its unit
//! tests on fake time (`mod tests`, about a fifth), which read best beside the decisions they
//! test.

mod timers;

pub(crate) use timers::Sleeper;

use super::context::Context;
use super::outputs::{self, count_dispatch, Finished};
use super::placement::{self, Placing};
use super::placers::Placers;
use super::waker::Waker;
use crate::backoff::Backoff;
use crate::event::OutboundEvent;
use crate::marker::Marker;
use crate::scripts::{
    call_len, DispatchItem, DispatchReply, Dispatched, EventRef, RouteDispatch, MAX_CALL_BYTES,
};
use crate::telemetry;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use timers::Timers;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Kept free at the end of the drain for the last dispatch calls to return.
const DRAIN_MARGIN: Duration = Duration::from_millis(200);
/// Most events one dispatch call takes: bounds the time one call holds Redis.
const MAX_CALL: usize = 1024;
/// Most dispatch calls a route has out at once (see the module's comment). They go over one
/// connection, so Redis runs them in the order they were sent.
const MAX_OUT: usize = 2;

/// An event's own fields, borrowed as pairs for a call.
type Pairs<'a> = Vec<(&'a [u8], &'a [u8])>;
/// The routes of one dispatch call (by index), each with its due events in slot order.
type Groups = Vec<(usize, Vec<Sleeper>)>;
/// A dispatch call come back: its routes' events, the answer and when it arrived.
type Answer = (Groups, crate::error::Result<DispatchReply>, Instant);

/// The timer loop's state.
struct State {
    ctx: Arc<Context>,
    placers: Arc<Placers>,
    timers: Timers,
    /// The routes whose dispatch calls fail.
    failing: BTreeMap<usize, Failing>,
    /// Routes with calls out: how many, and the events of theirs that fell due meanwhile.
    out: BTreeMap<usize, Out>,
    answers: mpsc::UnboundedSender<Answer>,
    stop: CancellationToken,
}

pub(crate) async fn run(
    ctx: Arc<Context>,
    mut rx: mpsc::UnboundedReceiver<Sleeper>,
    placers: Arc<Placers>,
    shutdown: CancellationToken,
    hard_stop: CancellationToken,
) {
    let (answers, mut answered) = mpsc::unbounded_channel();
    let mut st = State {
        ctx,
        placers,
        timers: Timers::default(),
        failing: BTreeMap::new(),
        out: BTreeMap::new(),
        answers,
        stop: hard_stop.clone(),
    };
    let mut drain_end: Option<Instant> = None;
    let mut open = true;
    let waker = Waker::start();
    // The wake-up for the earliest deadline, kept across turns while that deadline stands.
    let mut alarm: Option<(Instant, tokio::sync::oneshot::Receiver<()>)> = None;
    loop {
        if drain_end.is_none() && shutdown.is_cancelled() {
            // What falls due within the drain, less a margin for the last calls to return
            // before the worker stops at the drain's end.
            let drain = st.ctx.cfg.worker.drain;
            drain_end = Some(st.ctx.time.now() + drain - (drain / 5).min(DRAIN_MARGIN));
        }
        if let Some(end) = drain_end {
            if !open && st.out.is_empty() && st.timers.next_wake().is_none_or(|w| w > end) {
                break;
            }
        }
        telemetry::sleeping(st.timers.len() + st.waiting());
        let next = st.timers.next_wake();
        if alarm.as_ref().map(|(at, _)| *at) != next {
            alarm = next.map(|at| (at, waker.sleep_until(at)));
        }
        tokio::select! {
            biased;
            _ = hard_stop.cancelled() => break,
            _ = shutdown.cancelled(), if drain_end.is_none() => {}
            answer = answered.recv() => {
                let (groups, reply, received) = answer.expect("the state holds a sender");
                st.answered(groups, reply, received);
            }
            msg = rx.recv(), if open => match msg {
                Some(s) => st.timers.insert(&st.ctx.clock, s),
                None => open = false,
            },
            _ = async { (&mut alarm.as_mut().expect("guarded").1).await }, if alarm.is_some() => {
                alarm = None;
                let due = st.timers.take_due(st.ctx.time.now());
                st.fire(due);
            }
        }
    }
    let left = st.timers.len() + st.waiting();
    if left > 0 {
        warn!(left, "leaving events pending for another worker");
    }
    telemetry::sleeping(0);
}

/// What to do with a sleeper after its dispatch call answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Written to the ready stream in millisecond `id_ms`; `learn` is how late the call ran
    /// after its target, when it may teach the wake-up lead.
    Dispatched { id_ms: i64, learn: Option<i64> },
    /// Not yet: sleep again until Redis time `at_us` (`learn` as above).
    Retry { at_us: i64, learn: Option<i64> },
    /// Its slot could no longer be met and was moved to `slot_us`: sleep until that.
    Moved { slot_us: i64 },
    /// Even its deadline has passed on this route: try its next route, or reject it.
    NextRoute { wait_us: i64 },
    /// An earlier call, whose reply was lost, dispatched it: only acknowledge.
    Acknowledge,
    /// The decision on record is a different slot (an earlier call whose reply was lost moved
    /// it, or a worker that claimed the event decided it): sleep on the one on record. Should
    /// two workers hold it, the decision's compare-and-set lets only one dispatch it.
    Resume { slot_us: i64, deadline_us: i64 },
    /// Its decision is gone (expired or evicted): decide it anew.
    Redecide,
    /// It was voided (the poison check dead-letters it) or its decision is unreadable: let
    /// it go.
    Drop,
}

/// Reads a dispatch call's answer for one sleeper whose call aimed at `target_us` (`retried`:
/// that target was tried before), Redis's clock reading `now_us`.
pub(crate) fn decide(target_us: i64, retried: bool, outcome: &Dispatched, now_us: i64) -> Action {
    match outcome {
        Dispatched::Done { ms } => Action::Dispatched {
            id_ms: *ms,
            learn: (!retried).then_some(now_us - target_us),
        },
        Dispatched::NotBefore { at_us } => Action::Retry {
            at_us: *at_us,
            // Woken too early for its own target: bring later wake-ups back.
            learn: (*at_us == target_us && !retried).then_some(now_us - at_us),
        },
        Dispatched::Moved { slot_us } => Action::Moved { slot_us: *slot_us },
        Dispatched::TooLate { wait_us } => Action::NextRoute { wait_us: *wait_us },
        // A reply lost to a timeout (a stalled worker's, say) leaves the script's decisions in
        // place: each is carried on from the record, never dropped, or the entry would sit
        // pending until claim_idle.
        Dispatched::Superseded(value) => match Marker::parse(value) {
            Some(Marker::Dispatched(_)) => Action::Acknowledge,
            Some(Marker::Slot {
                slot_us,
                deadline_us,
            }) => Action::Resume {
                slot_us,
                deadline_us,
            },
            Some(Marker::Skipped(wait_us)) => Action::NextRoute { wait_us },
            None if value.is_empty() => Action::Redecide,
            Some(Marker::Voided) | None => Action::Drop,
        },
    }
}

/// A route whose last dispatch call failed: its backoff, and when it is tried again.
struct Failing {
    backoff: Backoff,
    retry_at: Instant,
}

/// A route's calls out and the events waiting for one of them to answer.
#[derive(Default)]
struct Out {
    calls: usize,
    waiting: Vec<Sleeper>,
}

impl State {
    /// Events held waiting for a call to answer.
    fn waiting(&self) -> usize {
        self.out.values().map(|o| o.waiting.len()).sum()
    }

    /// Sends the due events: the routes with a call to spare in one call per slot (one in all,
    /// unless Redis is a cluster), each route's events in slot order; a route with `MAX_OUT`
    /// calls out keeps its events waiting for an answer. A route whose last call failed goes
    /// alone until one succeeds: one route's keys broken (a ready stream overwritten with a
    /// string, say) must not fail the calls of the routes due with it.
    ///
    /// A failing route's events that fall due before its retry wait for it: each starting a
    /// call of its own retried a Redis refusing writes (OOM) about as often as the route's rate
    /// (2,300-3,000 refused calls a second from one worker on a 1000/s route, found by review),
    /// where the backoff means one call a retry. (Compared with the time events are taken up to,
    /// the lead included, so that one taken early is not put back where it would be taken again.)
    fn fire(&mut self, due: Vec<Sleeper>) {
        let mut by_route: BTreeMap<usize, Vec<Sleeper>> = BTreeMap::new();
        for s in due {
            by_route.entry(s.route()).or_default().push(s);
        }
        let taken_to = self.ctx.time.now() + self.timers.lead();
        let mut by_call: BTreeMap<(u16, Option<usize>), Groups> = BTreeMap::new();
        for (route, mut group) in by_route {
            if let Some(f) = self.failing.get(&route).filter(|f| f.retry_at > taken_to) {
                let at = f.retry_at;
                for s in group {
                    self.timers.requeue(s, at);
                }
                continue;
            }
            if let Some(o) = self.out.get_mut(&route).filter(|o| o.calls >= MAX_OUT) {
                o.waiting.extend(group);
                continue;
            }
            group.sort_by_key(|s| s.slot_us);
            let ready = &self.ctx.cfg.outbound.route_at(route).keys.ready;
            let alone = self.failing.contains_key(&route).then_some(route);
            by_call
                .entry((self.ctx.call_slot(ready), alone))
                .or_default()
                .push((route, group));
        }
        for groups in by_call.into_values() {
            self.call(groups);
        }
    }

    /// Starts dispatch calls for routes whose keys share a slot, each in its own task (their
    /// answers come back to the loop): as few calls as `MAX_CALL` and `MAX_CALL_BYTES` allow
    /// (no call holds more events or bytes), each route in one.
    fn call(&mut self, groups: Groups) {
        let mut batch: Groups = Vec::new();
        let (mut size, mut bytes) = (0, 0);
        let len = |s: &Sleeper| s.event.carried.packed_len();
        for (route, mut group) in groups {
            let o = self.out.entry(route).or_default();
            let (fits, weight) = call_len(group.iter().map(len), MAX_CALL);
            if group.len() > fits {
                // The rest wait for an answer (they are due, so they go right after).
                o.waiting.extend(group.split_off(fits));
            }
            o.calls += 1;
            if (size + group.len() > MAX_CALL || bytes + weight > MAX_CALL_BYTES)
                && !batch.is_empty()
            {
                self.send(std::mem::take(&mut batch));
                (size, bytes) = (0, 0);
            }
            size += group.len();
            bytes += weight;
            batch.push((route, group));
        }
        if !batch.is_empty() {
            self.send(batch);
        }
    }

    fn send(&self, groups: Groups) {
        let (ctx, answers) = (self.ctx.clone(), self.answers.clone());
        tokio::spawn(async move {
            let reply = dispatch_routes(&ctx, &groups).await;
            let _ = answers.send((groups, reply, ctx.time.now()));
        });
    }

    /// Carries out a call's answer, route by route, then sends what fell due for its routes
    /// meanwhile.
    fn answered(
        &mut self,
        mut groups: Groups,
        reply: crate::error::Result<DispatchReply>,
        received: Instant,
    ) {
        let mut waiting = Vec::new();
        for (route, _) in &groups {
            let o = self
                .out
                .get_mut(route)
                .expect("a route answering has a call out");
            o.calls -= 1;
            waiting.append(&mut o.waiting);
            if o.calls == 0 {
                self.out.remove(route);
            }
        }
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                if e.is_wrong_type() && groups.len() == 1 {
                    waiting = self.broken(&mut groups[0], waiting, &e, received);
                }
                self.ctx.failed("dispatch", &e);
                let mut delays = BTreeMap::new();
                for (index, group) in groups {
                    let failing = self.failing.entry(index).or_insert_with(|| Failing {
                        backoff: Backoff::default(),
                        retry_at: received,
                    });
                    let delay = failing.backoff.fail();
                    failing.retry_at = received + delay;
                    // One line per route per outage, not one per event; a stall of replicas is
                    // said once for all routes (health).
                    if failing.backoff.failures() == 1
                        && !matches!(e, crate::error::Error::ReplicasShort { .. })
                    {
                        let route = &self.ctx.cfg.outbound.route_at(index).name;
                        warn!(error = %e, %route, events = group.len(), "dispatch failed; retrying with backoff");
                    }
                    delays.insert(index, delay);
                    for s in group {
                        self.timers.requeue(s, received + delay);
                    }
                }
                for s in waiting {
                    let delay = delays.get(&s.route()).copied().unwrap_or_default();
                    self.timers.requeue(s, received + delay);
                }
                return;
            }
        };
        self.ctx.health.wrote();
        self.ctx.clock.observe(reply.end_us, received);
        let mut outcomes = reply.items.into_iter();
        let mut lesson = None;
        for (index, group) in groups {
            self.failing.remove(&index);
            placement::mended(&self.ctx, self.ctx.cfg.outbound.route_at(index));
            let mine: Vec<Dispatched> = outcomes.by_ref().take(group.len()).collect();
            let late =
                self.route_answered(index, group, mine, reply.now_us, reply.end_us, received);
            lesson = lesson.max(late);
        }
        // One lesson per call, from the event it was woken for (the earliest target, so the
        // latest landing): its other events were taken early within the lead, and ten events of
        // one late call each teaching the lead threw it to its bound at once.
        if let Some(late) = lesson {
            self.timers.learn(late);
        }
        if !waiting.is_empty() {
            self.fire(waiting);
        }
    }

    /// A route alone in its call (as it is after one failure) whose key holds the wrong kind of
    /// value: retrying helps only once someone fixes the key. Its sleepers (in the call, and
    /// among `waiting`) keep retrying until their deadline, the promise of their wait; those
    /// past it are dead-lettered as route_broken, as `placement` does at once for events not
    /// yet given a slot. Returns the rest of `waiting`.
    fn broken(
        &mut self,
        (index, group): &mut (usize, Vec<Sleeper>),
        waiting: Vec<Sleeper>,
        e: &crate::error::Error,
        received: Instant,
    ) -> Vec<Sleeper> {
        let clock = &self.ctx.clock;
        let past = |s: &Sleeper| clock.local(s.deadline_us) <= received;
        let (mut late, kept): (Vec<Sleeper>, Vec<Sleeper>) =
            std::mem::take(group).into_iter().partition(past);
        *group = kept;
        let (also, waiting): (Vec<Sleeper>, Vec<Sleeper>) = waiting
            .into_iter()
            .partition(|s| s.route() == *index && past(s));
        late.extend(also);
        if late.is_empty() {
            return waiting;
        }
        let route = self.ctx.cfg.outbound.route_at(*index);
        // Said once, as `placement` says it, until a call on the route succeeds again.
        if placement::newly_broken(&self.ctx, route) {
            warn!(route = %route.name, events = late.len(), error = %e, "a route's key holds the wrong kind of value: its events past their deadline are dead-lettered as route_broken");
        }
        let (ctx, stop, e, index) = (self.ctx.clone(), self.stop.clone(), e.to_string(), *index);
        tokio::spawn(async move {
            let route = ctx.cfg.outbound.route_at(index);
            let events: Vec<&OutboundEvent> = late.iter().map(|s| &s.event).collect();
            let refused = placement::route_broken(&ctx, route, &events, &e).await;
            let mut done = Finished::default();
            for s in &late {
                done.dead.push((s.event.entry(), refused.clone()));
            }
            outputs::finish(&ctx, done, &stop).await
        });
        waiting
    }

    /// Carries out one route's part of an answer; returns how late the call ran after its
    /// events' targets, from the latest of them that may teach the lead (`decide`).
    fn route_answered(
        &mut self,
        index: usize,
        group: Vec<Sleeper>,
        outcomes: Vec<Dispatched>,
        now_us: i64,
        end_us: i64,
        received: Instant,
    ) -> Option<i64> {
        let ctx = self.ctx.clone();
        let mut lesson = None;
        let route = ctx.cfg.outbound.route_at(index);
        let mut done = Finished::default();
        let mut onward = Vec::new();
        let mut dispatched = false;
        let acked = ctx.acks_in_script(&route.keys.ready);
        for (mut s, outcome) in group.into_iter().zip(outcomes) {
            match decide(s.target_us, s.retried, &outcome, now_us) {
                Action::Dispatched { id_ms, learn } => {
                    debug!(route = %route.name, slot = s.slot_us, now = now_us, lead = self.timers.lead_us(), "dispatched");
                    lesson = lesson.max(learn);
                    // The call's own time, to the µs; the id's millisecond when the call
                    // had to write past it (ids kept increasing over a clock step back).
                    ctx.route_metrics[index].lateness(now_us.max(id_ms * 1000) - s.slot_us);
                    count_dispatch(&ctx, &s.event, route);
                    dispatched = true;
                    if !acked(&s.event.stream) {
                        done.ack_event(&s.event);
                    }
                }
                Action::Retry { at_us, learn } => {
                    debug!(route = %route.name, slot = s.slot_us, at_us, now = now_us, "not yet");
                    lesson = lesson.max(learn);
                    s.retried = at_us == s.target_us;
                    s.target_us = at_us;
                    self.timers
                        .insert_after_reply(&ctx.clock, s, received, end_us);
                }
                Action::Moved { slot_us } => {
                    debug!(route = %route.name, from = s.slot_us, to = slot_us, "slot moved");
                    telemetry::replanned(&route.name);
                    s.moved(slot_us);
                    self.timers
                        .insert_after_reply(&ctx.clock, s, received, end_us);
                }
                Action::Resume {
                    slot_us,
                    deadline_us,
                } => {
                    debug!(entry = %s.event.id(), route = %route.name, slot = slot_us, "sleeping on the decision on record");
                    s.moved(slot_us);
                    s.deadline_us = deadline_us;
                    self.timers
                        .insert_after_reply(&ctx.clock, s, received, end_us);
                }
                Action::NextRoute { wait_us } => {
                    onward.push(Placing::after(
                        s.event,
                        &ctx,
                        route.index,
                        (
                            wait_us,
                            s.deadline_us - crate::pacing::LATE_US,
                            s.decided_us,
                        ),
                        s.permit,
                    ));
                }
                Action::Acknowledge => {
                    if !acked(&s.event.stream) {
                        done.ack_event(&s.event);
                    }
                }
                Action::Redecide => {
                    // Logged per batch by `placement::still_held`.
                    debug!(entry = %s.event.id(), route = %route.name, "decision gone (expired or evicted)");
                    onward.push(Placing::decision_gone(s.event, &ctx, route.index, s.permit));
                }
                Action::Drop => {
                    debug!(entry = %s.event.id(), "another worker holds this event now")
                }
            }
        }
        if dispatched {
            crate::fault::point("dispatched");
        }
        self.placers.send(&ctx, onward, &mut done);
        if !done.is_empty() {
            // Acknowledging is off the timer loop: the next due event must not wait for an XACK.
            let (ctx, stop) = (ctx.clone(), self.stop.clone());
            tokio::spawn(async move { outputs::finish(&ctx, done, &stop).await });
        }
        lesson
    }
}

async fn dispatch_routes(
    ctx: &Arc<Context>,
    groups: &Groups,
) -> crate::error::Result<DispatchReply> {
    let pairs: Vec<Vec<Pairs<'_>>> = groups
        .iter()
        .map(|(_, group)| {
            group
                .iter()
                .map(|s| s.event.carried.iter().collect())
                .collect()
        })
        .collect();
    let items: Vec<Vec<DispatchItem<'_>>> = groups
        .iter()
        .zip(&pairs)
        .map(|((_, group), pairs)| {
            group
                .iter()
                .zip(pairs)
                .map(|(s, fields)| DispatchItem {
                    event: EventRef::of(&s.event, fields),
                    slot_us: s.slot_us,
                    deadline_us: s.deadline_us,
                    decided_us: s.decided_us,
                })
                .collect()
        })
        .collect();
    // Every route of the call is in one slot: the first's ready stream stands for them all.
    let ready = &ctx.cfg.outbound.route_at(groups[0].0).keys.ready;
    let acks = ctx.acks_in_script(ready);
    let routes: Vec<RouteDispatch<'_>> = groups
        .iter()
        .zip(&items)
        .map(|((index, _), items)| RouteDispatch {
            call: ctx.route_call(ctx.cfg.outbound.route_at(*index), &acks),
            items,
        })
        .collect();
    let mut con = ctx.con.clone();
    let reply = telemetry::timed("dispatch", ctx.scripts.dispatch(&mut con, &routes)).await?;
    // Unconfirmed, the call counts as failed: its events sleep on and the call is made again
    // (the markers make it a no-op where it went through, a redo where a failover lost it).
    ctx.replicated(ready).await?;
    Ok(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dispatch_teaches_the_lead_only_on_a_first_try() {
        let done = Dispatched::Done { ms: 1700 };
        assert_eq!(
            decide(1_699_500, false, &done, 1_699_800),
            Action::Dispatched {
                id_ms: 1700,
                learn: Some(300)
            }
        );
        assert_eq!(
            decide(1_699_500, true, &done, 1_699_800),
            Action::Dispatched {
                id_ms: 1700,
                learn: None
            }
        );
    }

    #[test]
    fn too_early_for_its_own_target_learns_a_later_target_does_not() {
        let own = Dispatched::NotBefore { at_us: 2_000_000 };
        assert_eq!(
            decide(2_000_000, false, &own, 1_999_400),
            Action::Retry {
                at_us: 2_000_000,
                learn: Some(-600)
            }
        );
        let gated = Dispatched::NotBefore { at_us: 2_100_000 };
        assert_eq!(
            decide(2_000_000, false, &gated, 2_000_100),
            Action::Retry {
                at_us: 2_100_000,
                learn: None
            }
        );
    }

    #[test]
    fn a_moved_or_late_slot_sleeps_again_or_leaves_the_route() {
        let moved = Dispatched::Moved { slot_us: 5_000 };
        assert_eq!(
            decide(0, false, &moved, 0),
            Action::Moved { slot_us: 5_000 }
        );
        let late = Dispatched::TooLate { wait_us: 7 };
        assert_eq!(decide(0, false, &late, 0), Action::NextRoute { wait_us: 7 });
    }

    #[test]
    fn a_superseded_decision_is_carried_on_from_the_record() {
        let dispatched = Dispatched::Superseded("d1700".into());
        assert_eq!(decide(0, false, &dispatched, 0), Action::Acknowledge);
        let gone = Dispatched::Superseded(String::new());
        assert_eq!(decide(0, false, &gone, 0), Action::Redecide);
        let moved = Dispatched::Superseded("s900:1000".into());
        assert_eq!(
            decide(0, false, &moved, 0),
            Action::Resume {
                slot_us: 900,
                deadline_us: 1000
            }
        );
        let skipped = Dispatched::Superseded("x5".into());
        assert_eq!(
            decide(0, false, &skipped, 0),
            Action::NextRoute { wait_us: 5 }
        );
        for held in ["v0", "garbage"] {
            let other = Dispatched::Superseded(held.into());
            assert_eq!(decide(0, false, &other, 0), Action::Drop, "{held}");
        }
    }
}
