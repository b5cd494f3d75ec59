//! One placement task per route, so that one route's trouble never holds up another's events:
//! a route whose Redis node is slow, unreachable or migrating keeps retrying its own calls while
//! the others go on. Each task takes what queued up for its route while its last call was out
//! and offers it in one call (up to `MAX_CALL` events), so calls grow with the load and their
//! fixed cost is shared by more events. Events passed over go on to their next route's task;
//! the ones that must wait go to the dispatcher. What the route has no room to hold in the
//! worker (`share`) it parks (`parked`), and takes back as its sleeping events go out.

use super::context::Context;
use super::dispatcher::Sleeper;
use super::outputs::{self, Finished};
use super::parked::{self, Lot};
use super::placement::{self, Placing};
use crate::fault;
use crate::scripts::call_len;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Most events one `schedule` call takes: bounds the time one call holds Redis. Redis runs one
/// script at a time, so a call that holds it for milliseconds delays every dispatch due
/// meanwhile past its millisecond: at 1024 events (about 4 ms of Lua) a worker taking up a
/// backlog after a stall fell to 58–85% of a 1000/s route, at 128 (under 1 ms) it held 99%
/// (tests/pressure.rs). The price is a little more Redis CPU per event.
const MAX_CALL: usize = 128;

/// How often the routes with entries parked are looked over for room to take some back: a
/// 1000/s route sends about ten events a tick, so its parked ones follow without a gap. One
/// task looks for all of them and wakes only those with room: 300 routes with entries parked,
/// each looking every 10 ms itself, took 8–9% of a core (1% without the looks) for the 300
/// events a second they sent. (Waking a route also as soon as its own events gave places back
/// lets it win them from a reader waiting for a read's worth, which then reads at its pace:
/// once, another route's events behind 400 large ones were not out within 5 s.)
pub(crate) const TAKE_BACK_EVERY: Duration = Duration::from_millis(10);

/// The placement tasks' inboxes, one per route (by `Route::index`), and what each route parked.
pub(crate) struct Placers {
    routes: Vec<mpsc::UnboundedSender<Vec<Placing>>>,
    /// Parked as they are handed over (`send`), taken back by the route's task.
    lots: Vec<Mutex<Lot>>,
}

impl Placers {
    /// Starts one task per route; they run until `stop`, handing sleepers to `sleepers`.
    pub(crate) fn start(
        ctx: &Arc<Context>,
        sleepers: mpsc::UnboundedSender<Sleeper>,
        stop: &CancellationToken,
    ) -> Arc<Placers> {
        let (senders, receivers): (Vec<_>, Vec<_>) = ctx
            .cfg
            .outbound
            .order
            .iter()
            .map(|_| mpsc::unbounded_channel())
            .unzip();
        let lots = senders.iter().map(|_| Mutex::default()).collect();
        let placers = Arc::new(Placers {
            routes: senders,
            lots,
        });
        tokio::spawn(look_for_room(ctx.clone(), stop.clone()));
        for (route, rx) in receivers.into_iter().enumerate() {
            tokio::spawn(run(
                ctx.clone(),
                route,
                rx,
                placers.clone(),
                sleepers.clone(),
                stop.clone(),
            ));
        }
        placers
    }

    /// Hands events to the task of the route each tries next, parking those the route has no
    /// room for (`share`); an event out of routes is rejected into `done`. After shutdown the
    /// tasks are gone and events stay pending.
    pub(crate) fn send(&self, ctx: &Context, events: Vec<Placing>, done: &mut Finished) {
        for (index, group) in placement::route_onward(ctx, events, done) {
            let route = ctx.cfg.outbound.route_at(index);
            let sent = group.len();
            let group = (self.lots[index].lock().expect("never poisoned")).admit(ctx, route, group);
            // Sent even when all were parked (then empty): the task, perhaps waiting for its
            // inbox, must know it has entries to take back.
            if sent > 0 {
                ctx.shares.handed(index, places(&group));
                let _ = self.routes[index].send(group);
            }
        }
    }
}

/// The places `group`'s events hold.
fn places(group: &[Placing]) -> usize {
    group.iter().map(|p| p.permit.places() as usize).sum()
}

async fn run(
    ctx: Arc<Context>,
    route: usize,
    mut rx: mpsc::UnboundedReceiver<Vec<Placing>>,
    placers: Arc<Placers>,
    sleepers: mpsc::UnboundedSender<Sleeper>,
    stop: CancellationToken,
) {
    let route = ctx.cfg.outbound.route_at(route);
    let lot = &placers.lots[route.index];
    loop {
        let parked = ctx.shares.parked_on(route.index) > 0;
        let mut group = tokio::select! {
            _ = stop.cancelled() => return,
            g = rx.recv() => match g {
                Some(g) => g,
                None => return,
            },
            // Parked entries are taken back as places are given back (`look_for_room`).
            _ = ctx.shares.room_found(route.index), if parked => Vec::new(),
        };
        while group.len() < MAX_CALL {
            match rx.try_recv() {
                Ok(more) => group.extend(more),
                Err(_) => break,
            }
        }
        if group.iter().any(|p| p.check_held) {
            let handed = places(&group);
            let Some(held) = placement::still_held(&ctx, group, &stop).await else {
                return;
            };
            group = held;
            ctx.shares.placed(route.index, handed - places(&group));
        }
        // A few at a time (`share::take_back_now`), whatever woke the task: events handed
        // over while entries are parked are parked too, and wake it with none.
        if ctx.shares.take_back_due(route.index) {
            let Some(mut back) = parked::take_back(&ctx, lot, route, MAX_CALL, &stop).await else {
                return;
            };
            ctx.shares.handed(route.index, places(&back));
            // After what the inbox handed over: a fresh event is parked only once the route
            // has entries parked or no room (`Lot::admit`), so those in the inbox came before
            // every parked one (found by review: they went after the entries taken back).
            group.append(&mut back);
        }
        // In its calls from here: a route whose calls wait long gives nothing back.
        ctx.shares.busy(route.index, !group.is_empty());
        // A group over MAX_CALL events or MAX_CALL_BYTES (one large read) goes in several
        // calls.
        while !group.is_empty() {
            let sizes = group.iter().map(|p| p.event.carried.packed_len());
            let rest = group.split_off(call_len(sizes, MAX_CALL).0);
            let handed = places(&group);
            let Some(placed) = placement::place_on(&ctx, route, group, &stop).await else {
                // Shutdown while Redis failed: these entries stay pending.
                return;
            };
            // Asleep under seats of their own now, passed on or finished.
            ctx.shares.placed(route.index, handed);
            if rest.is_empty() {
                ctx.shares.busy(route.index, false);
            }
            group = rest;
            if !placed.sleepers.is_empty() {
                fault::point("scheduled");
            }
            for s in placed.sleepers {
                let _ = sleepers.send(s);
            }
            let mut finished = placed.finished;
            placers.send(&ctx, placed.onward, &mut finished);
            if !finished.is_empty() {
                let (ctx, stop) = (ctx.clone(), stop.clone());
                tokio::spawn(async move { outputs::finish(&ctx, finished, &stop).await });
            }
        }
    }
}

/// Every `TAKE_BACK_EVERY` while entries are parked, wakes the tasks of the routes due to take
/// some back (`Shares::take_back_due`), until `stop`.
async fn look_for_room(ctx: Arc<Context>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ctx.shares.any_parked() => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(TAKE_BACK_EVERY) => ctx.shares.wake_those_with_room(),
        }
    }
}
