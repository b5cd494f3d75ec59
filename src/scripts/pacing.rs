//! The pacing calls: `schedule.lua` (decide a route's share of a batch, dispatching what is due)
//! and `dispatch.lua` (hand due events to the ready stream while the rate holds).

use super::{reply, KeyIndex, Reply, Scripts, Writing};
use crate::error::{Error, Result};
use crate::event::OutboundEvent;
use crate::keys::RouteKeys;
use crate::pacing::BucketParams;
use redis::aio::ConnectionLike;
use redis::Cmd;

/// What both pacing calls need to know about their route and its neighbours.
pub struct RouteCall<'a> {
    /// The route's name (the ready entries' `pacer_route`).
    pub name: &'a str,
    pub keys: &'a RouteKeys,
    pub bucket: &'a BucketParams,
    /// The ready stream's writing: decisions' lifetime, trim, group, acknowledgements.
    pub out: Writing<'a>,
}

/// One input entry's event as a pacing call sees it.
pub struct EventRef<'a> {
    pub stream: &'a str,
    pub entry_id: &'a str,
    pub entry_ms: i64,
    pub cost: u64,
    /// The event's own fields, carried to the ready entry (pacer's own are the script's).
    pub fields: &'a [(&'a [u8], &'a [u8])],
}

impl<'a> EventRef<'a> {
    /// An event with its own fields (`event.carried`, borrowed as pairs).
    pub fn of(event: &'a OutboundEvent, fields: &'a [(&'a [u8], &'a [u8])]) -> Self {
        EventRef {
            stream: &event.stream,
            entry_id: event.id(),
            entry_ms: event.ms(),
            cost: event.cost,
            fields,
        }
    }
}

/// Most bytes of event fields one `schedule` or `dispatch` call carries. At the 64 KiB
/// `max_event_bytes` default the calls' event counts bind first (128 and 1,024 events); at its
/// 16 MiB maximum 128 events would make a 2 GiB call, which Redis (one thread) copies into Lua
/// strings and again into the ready stream while every other call, the due dispatches
/// included, waits.
pub const MAX_CALL_BYTES: usize = 64 << 20;

/// How many of `sizes` (events' bytes, in order) one call takes from the first, and their
/// bytes: at most `most`, and no more than `MAX_CALL_BYTES` in all, but always one.
pub fn call_len(sizes: impl IntoIterator<Item = usize>, most: usize) -> (usize, usize) {
    let (mut n, mut bytes) = (0, 0);
    for size in sizes.into_iter().take(most) {
        if n > 0 && bytes + size > MAX_CALL_BYTES {
            break;
        }
        (n, bytes) = (n + 1, bytes + size);
    }
    (n, bytes)
}

/// One event offered to a route by `schedule`.
pub struct ScheduleItem<'a> {
    pub event: EventRef<'a>,
    /// The producer's `id`, if the event carries one: claimed on the route for its entry.
    pub claim: Option<&'a str>,
    /// The decision this one may replace (an unreadable one on record), else none.
    pub expect: Option<&'a str>,
    pub max_wait_us: i64,
    /// Redis µs by which it must go whatever `max_wait_us` says (0: none): an event passed on
    /// late to a fallback has only what is left of the wait it was first given.
    pub deadline_us: i64,
    /// Redis µs its wait counts from, for its ready entry's `pacer_wait_ms` (0: the call's
    /// time): such an event's first decision, on the route that gave it up.
    pub since_us: i64,
}

/// What `schedule` decided for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheduled {
    /// Dispatched now, in the ready entry of this millisecond.
    Dispatched {
        ms: i64,
    },
    /// Sleep until the slot; it must go by the call's `now_us` plus the event's max_wait plus
    /// `pacing::LATE_US`.
    Sleep {
        slot_us: i64,
    },
    TooLong {
        wait_us: i64,
    },
    /// An earlier delivery decided this entry: its decision on record.
    Decided(String),
    /// The event's id belongs to this other entry.
    Duplicate(String),
    /// Read older than the route's max_age (µs of age): not placed.
    Expired(i64),
    /// Older than dedupe_ttl with no decision on record (µs of age): not decided.
    Stale(i64),
}

#[derive(Debug, Clone)]
pub struct ScheduleReply {
    /// The route's time the call decided at (Redis's clock, or the route's last dispatch if
    /// later, after Redis's clock stepped back).
    pub now_us: i64,
    /// Redis's clock as the script ended: the reply left Redis just after it.
    pub end_us: i64,
    /// The route's plan after this batch: how far ahead its next free slot is.
    pub tat_us: i64,
    pub items: Vec<Scheduled>,
}

/// One event whose slot has come, offered to `dispatch` (it was decided with the decision
/// `s<slot>:<deadline>`).
pub struct DispatchItem<'a> {
    pub event: EventRef<'a>,
    pub slot_us: i64,
    pub deadline_us: i64,
    /// When it was first decided on this route (its wait is counted from then).
    pub decided_us: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dispatched {
    /// Written, in the ready entry of this millisecond.
    Done { ms: i64 },
    /// Not yet; the slot stands.
    NotBefore { at_us: i64 },
    /// Its slot could no longer be met: moved (and recorded) to this one.
    Moved { slot_us: i64 },
    /// Not even a later slot fits its deadline: passed over on this route.
    TooLate { wait_us: i64 },
    /// The decision on record is no longer the one it was made with ("" if none).
    Superseded(String),
}

/// One route's due events in a `dispatch` call.
pub struct RouteDispatch<'a> {
    pub call: RouteCall<'a>,
    /// In slot order.
    pub items: &'a [DispatchItem<'a>],
}

#[derive(Debug, Clone)]
pub struct DispatchReply {
    pub now_us: i64,
    pub end_us: i64,
    pub items: Vec<Dispatched>,
}

/// The decision hashes of a call's events, each with its input stream (acknowledged in the
/// call, or not) and the events it holds.
#[derive(Default)]
struct Hashes {
    keys: KeyIndex,
    streams: KeyIndex,
    /// Per hash (by index − 1): its input stream's index (0: not acknowledged here) and name.
    of: Vec<(usize, String)>,
    /// Per event: its hash's index.
    at: Vec<usize>,
}

impl Hashes {
    fn new<'e>(call: &RouteCall<'_>, events: impl Iterator<Item = &'e EventRef<'e>>) -> Self {
        let mut h = Hashes::default();
        h.add(call, events);
        h
    }

    /// Adds a route's events: their hashes (indexed after those already added) and streams.
    fn add<'e>(&mut self, call: &RouteCall<'_>, events: impl Iterator<Item = &'e EventRef<'e>>) {
        for e in events {
            let hash = self.keys.index(call.keys.decisions(e.stream, e.entry_id));
            if hash > self.of.len() {
                let stream = call.out.ack_index(&mut self.streams, e.stream);
                self.of.push((stream, e.stream.to_string()));
            }
            self.at.push(hash);
        }
    }

    /// The decision hashes, then the input streams acknowledged in the call.
    fn push_keys<'k>(&'k self, keys: &mut Vec<&'k str>) {
        let all = self.keys.keys().iter().chain(self.streams.keys());
        keys.extend(all.map(String::as_str));
    }
}

fn push_pairs(args: &mut Cmd, fields: &[(&[u8], &[u8])]) {
    args.arg(fields.len());
    for (name, value) in fields {
        args.arg(*name).arg(*value);
    }
}

impl Scripts {
    /// Decides `items` on one route; see `lua/schedule.lua`. `stale_us`: an entry this old with
    /// no decision on record is not decided; `max_age_us` (0: none): an entry this old is not
    /// placed; `max_wait_us`: the events' wait unless an item says otherwise. The reply's items
    /// are in the order of `items`.
    pub async fn schedule<C: ConnectionLike>(
        &self,
        con: &mut C,
        call: &RouteCall<'_>,
        (stale_us, max_age_us, max_wait_us): (i64, i64, i64),
        items: &[ScheduleItem<'_>],
    ) -> Result<ScheduleReply> {
        let hashes = Hashes::new(call, items.iter().map(|i| &i.event));
        let mut claims = KeyIndex::default();
        let claim_at: Vec<usize> = items
            .iter()
            .map(|i| i.claim.map_or(0, |id| claims.index(call.keys.claim(id))))
            .collect();
        // The script takes the events grouped by hash, in order within each.
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&i| hashes.at[i]);
        let mut counts = vec![0usize; hashes.of.len()];
        for &h in &hashes.at {
            counts[h - 1] += 1;
        }
        let oldest = items.iter().map(|i| i.event.entry_ms).min().unwrap_or(0);
        let mut keys = vec![call.keys.bucket.as_str(), call.keys.ready.as_str()];
        hashes.push_keys(&mut keys);
        keys.extend(claims.keys().iter().map(String::as_str));
        let mut args = Cmd::new();
        args.arg(call.bucket.interval_us)
            .arg(call.bucket.tolerance_us);
        call.out.push_args(&mut args);
        args.arg(stale_us)
            .arg(max_age_us)
            .arg(call.name)
            .arg(max_wait_us)
            .arg(oldest)
            .arg(hashes.keys.len())
            .arg(hashes.streams.len())
            .arg(claims.len())
            .arg(items.len());
        for ((stream, name), count) in hashes.of.iter().zip(&counts) {
            args.arg(*count).arg(*stream).arg(name);
        }
        for &i in &order {
            let item = &items[i];
            args.arg(item.event.entry_id);
            let fields = item.event.fields;
            let plain = item.event.cost == 1
                && item.max_wait_us == max_wait_us
                && claim_at[i] == 0
                && item.deadline_us == 0
                && item.since_us == 0
                && item.expect.is_none();
            // Its spec: the field count alone, or with its exceptions (schedule.lua's header).
            if plain {
                args.arg(fields.len());
            } else {
                args.arg(format!(
                    "{},{},{},{},{},{},{}",
                    fields.len(),
                    item.event.cost,
                    item.max_wait_us.max(0),
                    claim_at[i],
                    item.deadline_us.max(0),
                    item.since_us.max(0),
                    item.expect.unwrap_or("")
                ));
            }
            for (name, value) in fields {
                args.arg(*name).arg(*value);
            }
        }
        let reply = self.schedule.call_plain(con, &keys, &args).await?;
        let mut values = Reply::new("schedule", reply)?;
        let now_us = values.int()?;
        let tat_us = values.int()?;
        let mut out: Vec<Option<Scheduled>> = vec![None; items.len()];
        // Events dispatched now come with no value: their ready entry is in now's millisecond.
        let now_ms = now_us.div_euclid(1000);
        for &i in &order {
            out[i] = Some(match values.int()? {
                reply::DISPATCHED => Scheduled::Dispatched { ms: now_ms },
                reply::SLEEP => Scheduled::Sleep {
                    slot_us: values.int()?,
                },
                reply::TOO_LONG => Scheduled::TooLong {
                    wait_us: values.int()?,
                },
                reply::DECIDED => Scheduled::Decided(values.text()?),
                reply::DUPLICATE => Scheduled::Duplicate(values.text()?),
                reply::EXPIRED => Scheduled::Expired(values.int()?),
                reply::STALE => Scheduled::Stale(values.int()?),
                other => return Err(Error::reply("schedule", format!("code {other}"))),
            });
        }
        Ok(ScheduleReply {
            now_us,
            end_us: values.int()?,
            tat_us,
            items: out
                .into_iter()
                .map(|o| o.expect("every item answered"))
                .collect(),
        })
    }

    /// Dispatches due events of one or more routes in one call (their keys in one slot): each
    /// route's `items` in slot order; see `lua/dispatch.lua`. The reply's items are the routes'
    /// items, route after route.
    pub async fn dispatch<C: ConnectionLike>(
        &self,
        con: &mut C,
        routes: &[RouteDispatch<'_>],
    ) -> Result<DispatchReply> {
        let Some(first) = routes.first() else {
            return Err(Error::reply("dispatch", "no route to dispatch"));
        };
        let mut hashes = Hashes::default();
        for r in routes {
            hashes.add(&r.call, r.items.iter().map(|i| &i.event));
        }
        let mut keys = Vec::with_capacity(2 * routes.len() + hashes.keys.len());
        for r in routes {
            keys.push(r.call.keys.bucket.as_str());
            keys.push(r.call.keys.ready.as_str());
        }
        hashes.push_keys(&mut keys);
        let mut args = Cmd::new();
        // One worker's calls: every route writes with the same ttl, trim and group.
        first.call.out.push_args(&mut args);
        args.arg(routes.len())
            .arg(hashes.keys.len())
            .arg(hashes.streams.len());
        for r in routes {
            args.arg(r.call.bucket.interval_us)
                .arg(r.call.bucket.tolerance_us)
                .arg(r.call.name)
                .arg(r.items.len());
        }
        for (stream, name) in &hashes.of {
            args.arg(*stream).arg(name);
        }
        let items = routes.iter().flat_map(|r| r.items.iter());
        for (item, hash) in items.zip(&hashes.at) {
            args.arg(*hash)
                .arg(item.event.entry_id)
                .arg(item.slot_us)
                .arg(item.deadline_us)
                .arg(item.decided_us)
                .arg(item.event.cost);
            push_pairs(&mut args, item.event.fields);
        }
        let reply = self.dispatch.call_plain(con, &keys, &args).await?;
        let mut values = Reply::new("dispatch", reply)?;
        let now_us = values.int()?;
        let n: usize = routes.iter().map(|r| r.items.len()).sum();
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(match values.int()? {
                reply::DISPATCHED => Dispatched::Done { ms: values.int()? },
                reply::NOT_BEFORE => Dispatched::NotBefore {
                    at_us: values.int()?,
                },
                reply::SLEEP => Dispatched::Moved {
                    slot_us: values.int()?,
                },
                reply::TOO_LONG => Dispatched::TooLate {
                    wait_us: values.int()?,
                },
                reply::SUPERSEDED => Dispatched::Superseded(values.text()?),
                other => return Err(Error::reply("dispatch", format!("code {other}"))),
            });
        }
        Ok(DispatchReply {
            now_us,
            end_us: values.int()?,
            items: out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_takes_at_most_its_count_and_its_bytes_but_always_one() {
        let mb = 1 << 20;
        assert_eq!(
            call_len([10; 200], 128),
            (128, 1280),
            "small events: the count binds"
        );
        assert_eq!(
            call_len([16 * mb; 10], 128),
            (4, 64 * mb),
            "16 MiB events: four fill 64 MiB"
        );
        assert_eq!(
            call_len([100 * mb, 1], 128),
            (1, 100 * mb),
            "one over the bytes still goes alone"
        );
        assert_eq!(
            call_len([1, 100 * mb], 128),
            (1, 1),
            "the large one waits for the next call"
        );
        assert_eq!(call_len(std::iter::empty(), 128), (0, 0));
    }
}
