//! The dispatcher: holds events until their slots (tokio timers in one ordered map), then hands
//! each route's due events to `dispatch.lua` in one call, which writes them to the ready stream
//! only if the rate holds at that moment on Redis's clock; too early, and the event sleeps again.
//!
//! On shutdown it keeps going until nothing left falls due within `worker.drain`; whatever is
//! still held then is dropped unacknowledged, so it stays pending for another worker.

use super::waker::Waker;
use super::{Finished, Placing, Shared};
use crate::clock::RedisClock;
use crate::event::{self, Fields, Marker, OutboundEvent};
use crate::scripts::{DispatchItem, DispatchReply, Dispatched};
use crate::telemetry;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// An event waiting for its slot.
pub(crate) struct Sleeper {
    event: OutboundEvent,
    /// Released when the event is finished or dropped: bounds what one process holds.
    _permit: OwnedSemaphorePermit,
    route: String,
    /// The marker value of this decision; dispatch happens only while the marker still says so.
    pub(crate) expect: String,
    slot_us: i64,
    /// The ready entry's fields, slot and wait included.
    fields: Fields,
    /// The Redis time to dispatch at: the slot, or a later time the gate named.
    target_us: i64,
    /// Whether this target was tried already (only first tries teach the lead).
    retried: bool,
    wake: Instant,
    failures: u32,
}

impl Sleeper {
    pub(crate) fn new(
        event: OutboundEvent,
        permit: OwnedSemaphorePermit,
        route: &str,
        mut fields: Fields,
        slot_us: i64,
        wait_us: i64,
    ) -> Self {
        // `fields` are the ready entry's, as built for the scheduling call.
        fields.push((
            b"pacer_slot_ms".to_vec(),
            (slot_us / 1000).to_string().into_bytes(),
        ));
        fields.push((
            b"pacer_wait_ms".to_vec(),
            (wait_us.max(0) / 1000).to_string().into_bytes(),
        ));
        Sleeper {
            expect: format!("s{slot_us}|{}", event.owner),
            event,
            _permit: permit,
            route: route.to_string(),
            slot_us,
            fields,
            target_us: slot_us,
            retried: false,
            wake: Instant::now(),
            failures: 0,
        }
    }
}

type Queue = BTreeMap<(Instant, u64), Sleeper>;

/// Where the dispatch call should land: this far after the target, inside its millisecond.
const AIM_AFTER_US: i64 = 250;
/// Kept free at the end of the drain for the last dispatch calls to return.
const DRAIN_MARGIN: Duration = Duration::from_millis(200);
/// The most a wake-up is brought forward.
const LEAD_MAX_US: i64 = 900;

struct Timers {
    queue: Queue,
    seq: u64,
    /// How much earlier than its target to wake an event, learnt from how long after waking the
    /// dispatch script actually runs (wake-up plus the request's trip to Redis). Landing inside
    /// the target's millisecond matters: on a burst-1 route a dispatch that slips into the next
    /// millisecond holds the following ones back by that millisecond too.
    lead_us: i64,
}

impl Timers {
    /// Queues an event for its target on Redis's clock (the lead is applied when it is due, so
    /// what the lead learns counts for every event already queued).
    fn insert(&mut self, clock: &RedisClock, mut s: Sleeper) {
        s.wake = clock.local(s.target_us);
        self.requeue(s);
    }

    fn lead(&self) -> Duration {
        Duration::from_micros(self.lead_us as u64)
    }

    /// Queues an event at the `wake` it already has.
    fn requeue(&mut self, s: Sleeper) {
        self.queue.insert((s.wake, self.seq), s);
        self.seq += 1;
    }

    /// Learns from a dispatch call that ran `late_us` after its target (negative: early).
    fn learn(&mut self, late_us: i64) {
        let error = late_us - AIM_AFTER_US;
        self.lead_us = (self.lead_us + error / 4).clamp(0, LEAD_MAX_US);
    }

    fn next_wake(&self) -> Option<Instant> {
        self.queue
            .first_key_value()
            .map(|((w, _), _)| *w - self.lead())
    }

    fn take_due(&mut self, now: Instant) -> Vec<Sleeper> {
        let later = self.queue.split_off(&(now + self.lead(), u64::MAX));
        std::mem::replace(&mut self.queue, later)
            .into_values()
            .collect()
    }
}

pub(crate) async fn run(
    shared: Arc<Shared>,
    mut rx: mpsc::UnboundedReceiver<Sleeper>,
    shutdown: CancellationToken,
    hard_stop: CancellationToken,
) {
    let mut timers = Timers {
        queue: Queue::new(),
        seq: 0,
        lead_us: 0,
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
            let drain = shared.cfg.worker.drain;
            drain_end = Some(Instant::now() + drain - (drain / 5).min(DRAIN_MARGIN));
        }
        if let Some(end) = drain_end {
            if !open && timers.next_wake().is_none_or(|w| w > end) {
                break;
            }
        }
        telemetry::sleeping(timers.queue.len());
        let next = timers.next_wake();
        if alarm.as_ref().map(|(at, _)| *at) != next {
            alarm = next.map(|at| (at, waker.sleep_until(at)));
        }
        tokio::select! {
            biased;
            _ = hard_stop.cancelled() => break,
            _ = shutdown.cancelled(), if drain_end.is_none() => {}
            msg = rx.recv(), if open => match msg {
                Some(s) => timers.insert(&shared.clock, s),
                None => open = false,
            },
            _ = async { (&mut alarm.as_mut().expect("guarded").1).await }, if alarm.is_some() => {
                alarm = None;
                let due = timers.take_due(Instant::now());
                fire(&shared, due, &mut timers, &hard_stop).await;
            }
        }
    }
    if !timers.queue.is_empty() {
        warn!(
            left = timers.queue.len(),
            "leaving events pending for another worker"
        );
    }
    telemetry::sleeping(0);
}

/// Dispatches due events, one script call per route, all routes at once.
async fn fire(
    shared: &Arc<Shared>,
    due: Vec<Sleeper>,
    timers: &mut Timers,
    stop: &CancellationToken,
) {
    let mut by_route: BTreeMap<String, Vec<Sleeper>> = BTreeMap::new();
    for s in due {
        by_route.entry(s.route.clone()).or_default().push(s);
    }
    let calls = by_route
        .into_iter()
        .map(|(route, group)| dispatch_route(shared, route, group));
    let mut done = Finished::default();
    let mut again = Vec::new();
    for (group, reply) in futures_util::future::join_all(calls).await {
        let received = Instant::now();
        let reply = match reply {
            Ok(reply) => {
                shared.health.set_redis_ok(true);
                shared.clock.observe(reply.end_us, received);
                reply
            }
            Err(e) => {
                shared.health.set_redis_ok(false);
                // One line per route when its events first fail, not one per event.
                let fresh = group.iter().filter(|s| s.failures == 0).count();
                if fresh > 0 {
                    warn!(error = %e, route = %group[0].route, events = fresh, "dispatch failed; retrying with backoff");
                }
                for mut s in group {
                    s.failures += 1;
                    let backoff = Duration::from_millis(50 << s.failures.min(6));
                    s.wake = received + backoff;
                    timers.requeue(s);
                }
                continue;
            }
        };
        for (mut s, outcome) in group.into_iter().zip(reply.items) {
            match outcome {
                Dispatched::Done { entry_id } => {
                    debug!(route = %s.route, slot = s.slot_us, now = reply.now_us, lead = timers.lead_us, "dispatched");
                    if !s.retried {
                        timers.learn(reply.now_us - s.target_us);
                    }
                    let id_ms: i64 = entry_id
                        .split('-')
                        .next()
                        .and_then(|m| m.parse().ok())
                        .unwrap_or(0);
                    telemetry::lateness(&s.route, id_ms - s.slot_us / 1000);
                    shared.count_dispatch(&s.event, &s.route, s.route != s.event.routes[0]);
                    done.acks
                        .push((s.event.entry.stream.clone(), s.event.entry.id.clone()));
                }
                Dispatched::NotBefore { at_us } => {
                    debug!(route = %s.route, slot = s.slot_us, at_us, now = reply.now_us, "not yet");
                    if at_us == s.target_us && !s.retried {
                        // Woken too early for its own target: bring later wake-ups back.
                        timers.learn(reply.now_us - at_us);
                    }
                    s.retried = at_us == s.target_us;
                    s.target_us = at_us;
                    timers.insert(&shared.clock, s);
                }
                Dispatched::Superseded(value) => match event::parse_marker(&value) {
                    Some((Marker::Dispatched(_), owner)) if owner == s.event.owner => {
                        // Dispatched by an earlier call whose reply was lost.
                        done.acks
                            .push((s.event.entry.stream.clone(), s.event.entry.id.clone()));
                    }
                    None if value.is_empty() => {
                        warn!(event = %s.event.event_id, route = %s.route, "decision marker expired; deciding anew");
                        again.push(Placing {
                            next: s
                                .event
                                .routes
                                .iter()
                                .position(|r| *r == s.route)
                                .unwrap_or(0),
                            event: s.event,
                            best_wait_us: None,
                            expect: None,
                            permit: s._permit,
                        });
                    }
                    _ => {
                        debug!(event = %s.event.event_id, marker = %value, "another worker holds this event now")
                    }
                },
            }
        }
    }
    if !done.acks.is_empty() {
        crate::fault::point("dispatched");
    }
    if !again.is_empty() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        shared.place(again, &mut done, &tx, stop).await;
        drop(tx);
        while let Ok(s) = rx.try_recv() {
            timers.insert(&shared.clock, s);
        }
    }
    // Acknowledging is off the timer loop: the next due event must not wait for an XACK.
    let (shared, stop) = (shared.clone(), stop.clone());
    tokio::spawn(async move { shared.finish(done, &stop).await });
}

async fn dispatch_route(
    shared: &Arc<Shared>,
    route: String,
    group: Vec<Sleeper>,
) -> (Vec<Sleeper>, crate::error::Result<DispatchReply>) {
    let route = &shared.cfg.outbound.routes[&route];
    let items: Vec<DispatchItem<'_>> = group
        .iter()
        .map(|s| DispatchItem {
            event_id: &s.event.event_id,
            expect: &s.expect,
            slot_us: s.slot_us,
            cost: s.event.cost,
            fields: &s.fields,
        })
        .collect();
    let mut con = shared.con.clone();
    let reply = telemetry::timed(
        "dispatch",
        shared.scripts.dispatch(
            &mut con,
            &route.keys,
            &route.bucket,
            shared.cfg.outbound.max_len,
            &items,
        ),
    )
    .await;
    drop(items);
    (group, reply)
}
