//! Entries a route parks while it has no room in the worker (`share`): read, then let go of all
//! but their place in the group. A parked entry stays pending under this worker and registered
//! as held (so the heartbeat keeps claimers off it and it is never taken up as stranded), and
//! keeps only its stream, its id and the places it held, about 40 bytes; its fields stay in the
//! input stream, from which it is read again, by id, once its route has room. In order: a route with
//! entries parked parks what it is sent after them too, and takes the oldest back first.
//!
//! Only events on their first try are parked (nothing decided for them anywhere yet): one
//! passed on from another route, or carrying a decision of an earlier delivery, keeps its places.
//!
//! Producers must not trim an input stream below what pacer has pending (README); an entry
//! trimmed while parked is acknowledged and counted lost, as the claimer does with one.

use super::budget;
use super::context::Context;
use super::held::{self, Hold, Registered};
use super::outputs::{self, Finished};
use super::placement::Placing;
use crate::event::{self, Entry};
use crate::streams;
use crate::telemetry;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// One parked entry (delivered once: only events on their first try are parked). Inbound
/// partitions park theirs the same way (`inbound`).
pub(crate) struct Parked {
    /// Its input stream, by index in `Context::streams`.
    stream: u32,
    /// The places it held when read (`budget`), so that no more are read back than have room.
    places: u32,
    /// Its id, `ms-seq`.
    ms: u64,
    seq: u64,
    registered: Registered,
}

/// One route's parked entries, oldest first.
#[derive(Default)]
pub(crate) struct Lot {
    queue: VecDeque<Parked>,
}

impl Lot {
    /// Of `group`, handed to `route`'s task, parks the events on their first try that the
    /// route has no room for now (all of them while it has entries parked: they go after
    /// those); returns the rest, in order.
    pub(crate) fn admit(
        &mut self,
        ctx: &Context,
        route: &crate::config::Route,
        group: Vec<Placing>,
    ) -> Vec<Placing> {
        let own: usize = group.iter().map(|p| p.permit.places() as usize).sum();
        let mut room = if self.queue.is_empty() {
            ctx.shares.room_with(route.index, own)
        } else {
            0
        };
        let light = group.iter().all(|p| !p.permit.underweight());
        if room >= own && light {
            // The usual hand-over: nothing parked, room for all.
            return group;
        }
        let before = self.queue.len();
        let mut kept = Vec::with_capacity(group.len());
        for p in group {
            let places = p.permit.places() as usize;
            // An underweight entry (read when its weight was not free) is parked whatever the
            // room: it holds a place, not its fields' worth.
            if !p.is_fresh() || (places <= room && !p.permit.underweight()) {
                room = room.saturating_sub(places);
                kept.push(p);
                continue;
            }
            // Nothing fits after one that did not: the route takes its events in order.
            room = 0;
            let mut p = p;
            match Parked::new(ctx, &p.event.stream, p.event.id(), p.permit) {
                Ok(parked) => self.queue.push_back(parked),
                Err(permit) => {
                    p.permit = permit;
                    kept.push(p);
                }
            }
        }
        let added = self.queue.len() - before;
        if added > 0 {
            ctx.shares.park(route.index, added);
            telemetry::parked(&route.name, self.queue.len());
        }
        kept
    }

    /// The oldest entries whose places when read fit in `room` (one at least, so that one
    /// heavier than a whole share still goes), at most `most`, taken out (none for no room).
    pub(crate) fn take_fitting(&mut self, room: usize, most: usize) -> Vec<Parked> {
        if room == 0 {
            return Vec::new();
        }
        let (mut places, mut n) = (0, 0);
        for p in self.queue.iter().take(most) {
            if n > 0 && places + p.places as usize > room {
                break;
            }
            places += p.places as usize;
            n += 1;
        }
        self.queue.drain(..n).collect()
    }

    /// Puts `back` in front, in order.
    pub(crate) fn put_front(&mut self, back: Vec<Parked>) {
        for p in back.into_iter().rev() {
            self.queue.push_front(p);
        }
    }

    /// Adds `parked` at the back, in order.
    pub(crate) fn extend(&mut self, parked: Vec<Parked>) {
        self.queue.extend(parked);
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// `take_fitting`, counted off `route`'s parked entries.
    fn take(
        &mut self,
        ctx: &Context,
        route: &crate::config::Route,
        room: usize,
        most: usize,
    ) -> Vec<Parked> {
        let taken = self.take_fitting(room, most);
        if !taken.is_empty() {
            ctx.shares.unpark(route.index, taken.len());
            telemetry::parked(&route.name, self.queue.len());
        }
        taken
    }

    /// `put_front`, counted in `route`'s parked entries again.
    fn put_back(&mut self, ctx: &Context, route: &crate::config::Route, back: Vec<Parked>) {
        ctx.shares.park(route.index, back.len());
        self.put_front(back);
        telemetry::parked(&route.name, self.queue.len());
    }
}

/// Takes back the oldest entries `route` parked in `lot` that it has room for now (at most
/// `most`): read again, with their places taken again as a read's are (by size), ready to be
/// placed; put back in front, as they were, if those places are not free now. Entries trimmed
/// meanwhile are acknowledged and counted lost; one that no longer parses (it did when read)
/// is dead-lettered. The lot is not held across the reads (the readers park into it
/// meanwhile). None on `stop` (what was taken stays pending).
pub(crate) async fn take_back(
    ctx: &Arc<Context>,
    lot: &Mutex<Lot>,
    route: &crate::config::Route,
    most: usize,
    stop: &CancellationToken,
) -> Option<Vec<Placing>> {
    let room = ctx.shares.room_with(route.index, 0);
    let taken = lot
        .lock()
        .expect("never poisoned")
        .take(ctx, route, room, most);
    if taken.is_empty() {
        return Some(Vec::new());
    }
    let (found, back) = read_again(ctx, taken, room, stop).await?;
    if !back.is_empty() {
        lot.lock()
            .expect("never poisoned")
            .put_back(ctx, route, back);
    }
    let mut placing = Vec::with_capacity(found.len());
    let (mut done, mut held) = (Finished::default(), Vec::new());
    for (entry, hold) in found {
        match event::parse_outbound(entry, &ctx.cfg.outbound) {
            Ok(event) => placing.push(Placing::new(event, hold)),
            Err((entry, refused)) => {
                done.dead.push((entry, refused));
                held.push(hold);
            }
        }
    }
    if !done.is_empty() {
        let (ctx, stop) = (ctx.clone(), stop.clone());
        tokio::spawn(async move {
            outputs::finish(&ctx, done, &stop).await;
            drop(held);
        });
    }
    Some(placing)
}

/// Reads `taken` again, by id, and weighs them again as a read's are (`budget`), within
/// `room` places (at least what they held when parked): the entries found, with their places,
/// in order, and those past the room (all of them if the places were taken meanwhile, by a
/// read), for the caller to put back in front. Entries trimmed meanwhile are acknowledged and
/// counted lost. None on `stop` (what was taken stays pending).
pub(crate) async fn read_again(
    ctx: &Arc<Context>,
    taken: Vec<Parked>,
    room: usize,
    stop: &CancellationToken,
) -> Option<(Vec<(Entry, Hold)>, Vec<Parked>)> {
    let places: usize = taken.iter().map(|p| p.places as usize).sum();
    let mut by_stream: BTreeMap<u32, Vec<Parked>> = BTreeMap::new();
    for p in taken {
        by_stream.entry(p.stream).or_default().push(p);
    }
    // Each stream's entries in order, the streams one after the other.
    let mut found: Vec<(Parked, Entry)> = Vec::new();
    for (index, parked) in by_stream {
        let stream = &ctx.streams[index as usize];
        let ids: Vec<(String, u64)> = parked
            .iter()
            .map(|p| (format!("{}-{}", p.ms, p.seq), 1))
            .collect();
        let entries = ctx
            .retry("read", stop, || {
                let mut con = ctx.con.clone();
                let ids = &ids;
                async move { streams::entries_by_id(&mut con, stream, ids).await }
            })
            .await?;
        let mut gone = Vec::new();
        for ((p, (id, _)), entry) in parked.into_iter().zip(ids).zip(entries) {
            match entry {
                Some(entry) => found.push((p, entry)),
                None => gone.push(id),
            }
        }
        ctx.retry("ack", stop, || {
            let mut con = ctx.con.clone();
            let gone = &gone;
            async move { super::claim::lost(ctx, &mut con, stream, gone).await }
        })
        .await?;
    }
    let sizes: Vec<usize> = found.iter().map(|(_, e)| e.size()).collect();
    let permits = budget::try_hold(ctx, &sizes, room.max(places)).unwrap_or_default();
    let back = found.split_off(permits.len());
    let back = back.into_iter().map(|(p, _)| p).collect();
    let (parked, entries): (Vec<Parked>, Vec<Entry>) = found.into_iter().unzip();
    let registered = parked.into_iter().map(|p| p.registered).collect();
    let found = entries
        .into_iter()
        .zip(held::holds(permits, registered))
        .collect();
    Some((found, back))
}

impl Parked {
    /// The entry `id` of `stream`, holding `hold`, let go of all but its place in the group
    /// (its registration, and the places it held, to be weighed again); `hold` back if its
    /// stream or id is not one a read gives (it is then kept as it is).
    pub(crate) fn new(ctx: &Context, stream: &str, id: &str, hold: Hold) -> Result<Parked, Hold> {
        match origin(ctx, stream, id) {
            Some((stream, ms, seq)) => Ok(Parked {
                stream,
                places: hold.places(),
                ms,
                seq,
                registered: hold.into_registered(),
            }),
            None => Err(hold),
        }
    }
}

/// Where the entry `id` of `stream` is parked from: its stream's index and its id's two
/// numbers; None if its stream or id is not one a read gives (it is then placed as it is).
fn origin(ctx: &Context, stream: &str, id: &str) -> Option<(u32, u64, u64)> {
    let index = ctx.streams.iter().position(|s| **s == *stream)?;
    let (ms, seq) = id.split_once('-')?;
    let (ms, seq): (u64, u64) = (ms.parse().ok()?, seq.parse().ok()?);
    // Written back as it was read: no leading zeros or signs to lose.
    (format!("{ms}-{seq}") == id).then_some((index as u32, ms, seq))
}
