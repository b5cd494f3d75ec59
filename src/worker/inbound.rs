//! The inbound flow: entries of the inbound streams, read by the same reader and consumer group
//! as the outbound ones (so claiming covers them too), are decided at once.
//!
//! One `admit.lua` call per batch and partition (`inbound.partitions`, one by default) decides
//! every event, records each decision in a marker and writes the accepted ones to the forward
//! stream and the rejected ones to the rejected stream, atomically, where it may (the stream
//! shares the partition's slot, or Redis is not a cluster). Then whatever the call did not write
//! (outputs in other slots or of the wrong kind, dead letters) is written once each (write-once
//! `emit`) and the batch's remaining entries acknowledged, one XACK per input stream, once every
//! partition's part of it is done. Each partition is decided by its own task (`Lanes`), in the
//! order its entries were read, beside the reading: a partition whose node is slow or frozen, or
//! whose output cannot be written, holds only its own entries. A redelivered entry finds
//! its marker: the recorded decision is carried out again, idempotently, and nothing is charged
//! twice.
//!
//! A partition whose calls are stuck (its master frozen or failing over) holds at most its part
//! of the worker's places: what is read for it beyond that is parked, as a route parks
//! (`parked`), and read again, in order, once its calls go through.
//!
//! When admission itself fails `limiter_attempts` times in a row, `fail_policy` decides; that
//! decision is recorded in the same marker (set only if none exists), so a late-running or
//! repeated admission can never decide the entry a second way. Writing outputs and acks still
//! retries with backoff until it succeeds.

use super::context::Context;
use super::outputs;
use super::parked::{read_again, Lot, Parked};
use super::placers::TAKE_BACK_EVERY;
use crate::backoff::Backoff;
use crate::config::{FailPolicy, InboundConfig};
use crate::error::Result;
use crate::event::inbound::{self as ev, Decision, InboundEvent};
use crate::event::{self, Entry, Fields, Reason, Refused};
use crate::keys::{InboundKeys, OutputKeys};
use crate::scripts::{call_len, AdmitItem, AdmitReply, AdmitTargets, Admitted};
use crate::telemetry::{self, InboundOutcome};
use crate::worker::held::Hold;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// One task per partition (`inbound.partitions`) deciding its entries in the order they were
/// read: each partition's admission calls go to its own slot, and a partition whose node is slow
/// or frozen holds up only its own entries, not the reading nor the other partitions. (Until
/// 2026-11-29 the reader waited for each batch's decisions: one frozen master stopped inbound
/// admission on every other, `a_frozen_master_holds_up_no_inbound_partition_on_the_others`.)
/// What paces the reading is the worker's places, as for the outbound flow: each entry holds
/// its place until it is decided and its outputs are written.
pub(crate) struct Lanes {
    lanes: Vec<mpsc::UnboundedSender<Part>>,
    /// What the reader and the lanes' tasks share of each lane.
    states: Arc<LaneStates>,
}

/// A lane whose entries have seen no progress (none finished) for this long while it holds
/// places is stuck, and holds no more than its part of them: a call answers in milliseconds,
/// and in a second of traffic the other partitions' reading would wait behind it. (Until
/// 2026-11-29 a stuck lane held all it was sent: one frozen master's partitions took every
/// place, and every partition waited for the thaw,
/// `a_frozen_masters_partitions_park_what_they_have_no_places_for`.)
const STUCK_AFTER: Duration = Duration::from_millis(250);

/// Each lane's state, by partition.
struct LaneStates {
    lanes: Box<[Lane]>,
    /// The places a stuck lane may hold: its part of those beyond the readers' reserve, as if
    /// each partition and the rest of the worker had one (so all of them stuck leave the rest
    /// a part, and the readers the reserve).
    part: usize,
    born: Instant,
}

/// One partition's lane as the reader sees it.
#[derive(Default)]
struct Lane {
    /// Places held by the entries sent to it and not finished.
    held: AtomicUsize,
    /// When its entries last made progress (ms after `LaneStates::born`).
    progress_ms: AtomicU64,
    /// Entries parked, oldest first (`parked`, as a route's).
    lot: Mutex<Lot>,
    /// While it takes entries back (out of the lot, not yet decided), what it is sent is
    /// parked too, after them: those it cannot take now go back in front.
    taking: AtomicBool,
    /// Told when the reader parks entries in its lot: a batch whose entries of this partition
    /// are all parked sends the lane nothing, and a lane waiting for parts with none parked
    /// would never look at its lot again. (Until 2026-12-01 it was not: a lane whose entries of
    /// a read were all parked as underweight left them pending for good, 155 in a byte-a-place
    /// chaos run; a lane idle while its outputs were stuck could too.)
    parked: tokio::sync::Notify,
}

impl LaneStates {
    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    /// Counts `places` held by entries sent to lane `k`; the first after none starts its clock.
    fn handed(&self, k: usize, places: usize) {
        let lane = &self.lanes[k];
        if lane.held.fetch_add(places, Ordering::Relaxed) == 0 {
            lane.progress_ms.store(self.now_ms(), Ordering::Relaxed);
        }
    }

    /// Counts `places` of lane `k` let go: their entries finished, which is its progress.
    fn done(&self, k: usize, places: usize) {
        let lane = &self.lanes[k];
        lane.held.fetch_sub(places, Ordering::Relaxed);
        lane.progress_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    fn stuck(&self, k: usize) -> bool {
        let lane = &self.lanes[k];
        let since = lane.progress_ms.load(Ordering::Relaxed);
        lane.held.load(Ordering::Relaxed) > 0
            && self.now_ms().saturating_sub(since) > STUCK_AFTER.as_millis() as u64
    }

    /// How lane `k`'s entries of a batch are gathered (`Parking`).
    fn parking(&self, k: usize) -> Parking {
        let lane = &self.lanes[k];
        Parking {
            parking: lane.taking.load(Ordering::Relaxed)
                || !lane.lot.lock().expect("never poisoned").is_empty(),
            stuck: self.stuck(k),
            room: self.part.saturating_sub(lane.held.load(Ordering::Relaxed)),
            parked: Vec::new(),
        }
    }
}

/// One partition's entries of a batch as they are gathered: those delivered too often, the
/// others, and the places of both.
#[derive(Default)]
struct Gathered {
    over: Vec<InboundEvent>,
    fresh: Vec<InboundEvent>,
    holds: Vec<Hold>,
}

/// Input entries to acknowledge: (stream, id).
type Acks = Vec<(Arc<str>, String)>;

impl Gathered {
    fn append(&mut self, other: Gathered) {
        self.over.extend(other.over);
        self.fresh.extend(other.fresh);
        self.holds.extend(other.holds);
    }
}

/// The places `holds` hold.
fn places(holds: &[Hold]) -> usize {
    holds.iter().map(|h| h.places() as usize).sum()
}

/// One batch's entries of one partition, with their places.
struct Part {
    events: Gathered,
    batch: Arc<Batch>,
}

/// Whether `k`'s entries are parked, as a batch's are gathered: decided at the partition's
/// first entry of the batch (entries parked already, or stuck), then per entry by the places
/// it may still take.
struct Parking {
    parking: bool,
    stuck: bool,
    /// Places it may still take while stuck.
    room: usize,
    parked: Vec<Parked>,
}

/// A batch read together is acknowledged together (one XACK per input stream, not one per
/// partition: the entries of every partition share the input streams), once each of its parts
/// is finished. Shutdown first: left pending, to be claimed and found decided.
struct Batch {
    /// Parts not finished yet, and the entries the finished ones left to acknowledge.
    left: std::sync::Mutex<(usize, Acks)>,
}

impl Batch {
    async fn part_done(&self, ctx: &Context, acks: Acks, stop: &CancellationToken) {
        let all = {
            let mut left = self.left.lock().expect("not poisoned");
            left.0 -= 1;
            left.1.extend(acks);
            (left.0 == 0).then(|| std::mem::take(&mut left.1))
        };
        if let Some(all) = all {
            outputs::ack(ctx, all, stop).await;
        }
    }
}

impl Lanes {
    /// Starts a task per partition of the inbound flow (none without one); they end on `stop`.
    pub(crate) fn start(ctx: &Arc<Context>, stop: &CancellationToken) -> Self {
        let n = ctx.cfg.inbound.as_ref().map_or(0, |cfg| cfg.keys.len());
        let states = Arc::new(LaneStates {
            lanes: (0..n).map(|_| Lane::default()).collect(),
            part: (ctx.shares.beyond_reserve() / (n + 1)).max(1),
            born: Instant::now(),
        });
        let lanes = (0..n)
            .map(|k| {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(lane(ctx.clone(), k, rx, states.clone(), stop.clone()));
                tx
            })
            .collect();
        Lanes { lanes, states }
    }
}

/// Parts a lane decides together at most: under load the parts queued behind a call go in the
/// next one (several input streams' readers, or the claimer, feed one lane), in fewer and larger
/// calls rather than one at a time.
const MERGE_PARTS: usize = 8;

/// Decides partition `k`'s parts in the order they came; each round's outputs are written beside
/// the deciding, not before the next round's: an output that cannot be written (its key of
/// another kind) holds only the entries bound for it, with their places.
async fn lane(
    ctx: Arc<Context>,
    k: usize,
    mut parts: mpsc::UnboundedReceiver<Part>,
    states: Arc<LaneStates>,
    stop: CancellationToken,
) {
    let cfg = ctx
        .cfg
        .inbound
        .as_ref()
        .expect("lanes run for an inbound flow");
    let state = &states.lanes[k];
    loop {
        let has_parked = !state.lot.lock().expect("never poisoned").is_empty();
        let first = tokio::select! {
            _ = stop.cancelled() => return,
            part = parts.recv() => match part {
                Some(part) => Some(part),
                None => return,
            },
            // Parked entries are taken back while nothing else comes.
            _ = tokio::time::sleep(TAKE_BACK_EVERY), if has_parked => None,
            _ = state.parked.notified() => None,
        };
        let has_parked = has_parked || !state.lot.lock().expect("never poisoned").is_empty();
        let (mut events, mut batches) = match first {
            Some(first) => (first.events, vec![first.batch]),
            None => (Gathered::default(), Vec::new()),
        };
        while batches.len() < MERGE_PARTS {
            let Ok(part) = parts.try_recv() else { break };
            events.append(part.events);
            batches.push(part.batch);
        }
        let mut dead = Vec::new();
        // Only with nothing more sent: an entry is parked only once the lane has entries
        // parked or is stuck, so those sent came before every parked one.
        if has_parked && parts.is_empty() {
            let room = states
                .part
                .saturating_sub(state.held.load(Ordering::Relaxed));
            let Some(back) = take_back(&ctx, &states, k, room, &stop).await else {
                return;
            };
            let mut taken = Gathered::default();
            for (entry, hold) in back {
                match ev::parse_inbound(entry, cfg) {
                    Ok(e) => taken.fresh.push(e),
                    Err(refused) => dead.push(refused),
                }
                taken.holds.push(hold);
            }
            if !taken.holds.is_empty() {
                states.handed(k, places(&taken.holds));
                events.append(taken);
                // Acknowledged by a batch of their own (their reads' batches are done).
                batches.push(Arc::new(Batch {
                    left: std::sync::Mutex::new((1, Vec::new())),
                }));
            }
        }
        if batches.is_empty() {
            continue;
        }
        let Gathered { over, fresh, holds } = events;
        let keys = &cfg.keys[k];
        let Some(decided) = decide(&ctx, cfg, keys, over, fresh, &mut dead, &stop).await else {
            return;
        };
        // Progress is entries finished (`Lane::done`), not decided: a partition decided in a
        // healthy slot whose outputs wait on a frozen one is stuck too.
        let (ctx, stop, states) = (ctx.clone(), stop.clone(), states.clone());
        tokio::spawn(async move {
            let cfg = ctx.cfg.inbound.as_ref().expect("an inbound flow");
            let acks = finish(&ctx, cfg, &cfg.keys[k], decided, dead, &stop).await;
            let held = places(&holds);
            drop(holds);
            states.done(k, held);
            let Some(acks) = acks else { return };
            // The round's entries are finished whichever batch they came in: the last batch
            // acknowledges them all with its own, the others count this part done.
            let last = batches.pop().expect("a round has a part");
            for batch in batches {
                batch.part_done(&ctx, Vec::new(), &stop).await;
            }
            last.part_done(&ctx, acks, &stop).await;
        });
    }
}

/// Takes the entries of inbound streams out of a batch and hands each partition's to its lane
/// (entries that cannot be decided are dead-lettered beside them); returns the rest (outbound
/// entries, with their permits) untouched, without waiting for any decision.
pub(super) fn admit(
    ctx: &Arc<Context>,
    entries: Vec<Entry>,
    permits: Vec<Hold>,
    stop: &CancellationToken,
) -> (Vec<Entry>, Vec<Hold>) {
    let Some(cfg) = &ctx.cfg.inbound else {
        return (entries, permits);
    };
    let lanes = ctx
        .inbound_lanes
        .get()
        .expect("the worker starts its inbound lanes before it reads");
    let mut rest = (Vec::new(), Vec::new());
    let max = ctx.cfg.worker.max_deliveries;
    let mut undecidable: (Vec<(Entry, Refused)>, Vec<Hold>) = (Vec::new(), Vec::new());
    // Per partition: the entries delivered too often, the others, their places.
    let mut parts: BTreeMap<usize, Gathered> = BTreeMap::new();
    let mut parking: BTreeMap<usize, Parking> = BTreeMap::new();
    for (entry, hold) in entries.into_iter().zip(permits) {
        if !cfg.flow.streams.iter().any(|s| *s == *entry.stream) {
            rest.0.push(entry);
            rest.1.push(hold);
            continue;
        }
        match ev::parse_inbound(entry, cfg) {
            Ok(e) => {
                let k = e.partition;
                let park = parking.entry(k).or_insert_with(|| lanes.states.parking(k));
                // Only entries on their first delivery: nothing is recorded for them yet.
                let places = hold.places() as usize;
                // And an underweight entry (read when its weight was not free: `budget::hold`)
                // whatever the lane's state: it holds a place, not its fields' worth.
                let hold = if e.entry.deliveries <= 1
                    && (park.parking || (park.stuck && places > park.room) || hold.underweight())
                {
                    match Parked::new(ctx, &e.entry.stream, &e.entry.id, hold) {
                        Ok(p) => {
                            // In order: nothing after a parked entry goes before it.
                            park.parking = true;
                            park.parked.push(p);
                            continue;
                        }
                        Err(hold) => hold,
                    }
                } else {
                    hold
                };
                park.room = park.room.saturating_sub(places);
                let part = parts.entry(k).or_default();
                part.holds.push(hold);
                if e.entry.deliveries > max {
                    part.over.push(e);
                } else {
                    part.fresh.push(e);
                }
            }
            // An entry that cannot be decided is dead-lettered for that, however often it came.
            Err(refused) => {
                undecidable.0.push(refused);
                undecidable.1.push(hold);
            }
        }
    }
    let n = parts.len() + usize::from(!undecidable.0.is_empty());
    let batch = Arc::new(Batch {
        left: std::sync::Mutex::new((n, Vec::new())),
    });
    for (k, events) in parts {
        lanes.states.handed(k, places(&events.holds));
        let part = Part {
            events,
            batch: batch.clone(),
        };
        // A lane gone has seen shutdown: the part is dropped, its entries left pending.
        let _ = lanes.lanes[k].send(part);
    }
    // Parked after the parts are sent: a lane takes entries back only once it has decided
    // every part sent before them (they came first).
    for (k, park) in parking {
        if !park.parked.is_empty() {
            let n = park.parked.len();
            let lane = &lanes.states.lanes[k];
            let mut lot = lane.lot.lock().expect("never poisoned");
            lot.extend(park.parked);
            ctx.shares.park_inbound(n, true);
            telemetry::inbound_parked(k, lot.len());
            lane.parked.notify_one();
        }
    }
    if n == 0 {
        return rest;
    }
    if !undecidable.0.is_empty() {
        let (ctx, stop) = (ctx.clone(), stop.clone());
        tokio::spawn(async move {
            let cfg = ctx.cfg.inbound.as_ref().expect("an inbound flow");
            let (dead, holds) = undecidable;
            let acks = finish(&ctx, cfg, &cfg.keys[0], Vec::new(), dead, &stop).await;
            drop(holds);
            if let Some(acks) = acks {
                batch.part_done(&ctx, acks, &stop).await;
            }
        });
    }
    rest
}

/// Takes back the oldest entries lane `k` parked whose places fit in `room` (one at least), at
/// most a read's worth: read again and weighed again (`parked::read_again`); those past the
/// places free now go back in front. None on `stop`.
async fn take_back(
    ctx: &Arc<Context>,
    states: &LaneStates,
    k: usize,
    room: usize,
    stop: &CancellationToken,
) -> Option<Vec<(Entry, Hold)>> {
    let lane = &states.lanes[k];
    let taken = {
        let mut lot = lane.lot.lock().expect("never poisoned");
        lane.taking.store(true, Ordering::Relaxed);
        lot.take_fitting(room.max(1), ctx.cfg.worker.batch)
    };
    let n = taken.len();
    let (found, back) = if n == 0 {
        (Vec::new(), Vec::new())
    } else {
        read_again(ctx, taken, room, stop).await?
    };
    let mut lot = lane.lot.lock().expect("never poisoned");
    let returned = back.len();
    lot.put_front(back);
    // Under the lot's lock: what the reader parks from now goes after what came back.
    lane.taking.store(false, Ordering::Relaxed);
    ctx.shares.park_inbound(n - returned, false);
    telemetry::inbound_parked(k, lot.len());
    Some(found)
}

/// Decides one partition's entries: those delivered too often (`over`) are voided unless a
/// decision was recorded, the others admitted. Entries that cannot be decided go to `dead`.
/// `None` if shutdown came first.
async fn decide(
    ctx: &Context,
    cfg: &InboundConfig,
    keys: &InboundKeys,
    over: Vec<InboundEvent>,
    fresh: Vec<InboundEvent>,
    dead: &mut Vec<(Entry, Refused)>,
    stop: &CancellationToken,
) -> Option<Vec<(InboundEvent, Decision)>> {
    let mut decided: Vec<(InboundEvent, Decision)> = Vec::new();

    // Delivered too often (each delivery's worker died on it): void it unless a decision
    // was recorded, in which case that decision is carried out.
    if !over.is_empty() {
        let prev = record(ctx, cfg, keys, &over, Decision::Voided, stop).await?;
        for (e, prev) in over.into_iter().zip(prev) {
            warn!(entry = %e.entry.id, stream = %e.entry.stream, deliveries = e.entry.deliveries, "poison inbound entry");
            decided.push((e, prev.unwrap_or(Decision::Voided)));
        }
    }

    // Per rule: events it passed, events it failed.
    let mut verdicts_by_rule = vec![(0, 0); cfg.rules.len()];
    let mut rest_fields: Vec<Fields> = fresh.iter().map(ev::forward_fields).collect();
    let mut rest = fresh;
    while !rest.is_empty() {
        // At most MAX_CALL_BYTES of fields a call, as the outbound calls: a batch of 512
        // events at the 16 MiB max_event_bytes would be one call of 8 GiB, holding Redis (one
        // thread) while every other worker's calls wait (found by review).
        let (n, _) = call_len(rest_fields.iter().map(crate::event::packed_len), rest.len());
        let tail = rest.split_off(n);
        let tail_fields = rest_fields.split_off(n);
        let fresh = std::mem::replace(&mut rest, tail);
        let fields = std::mem::replace(&mut rest_fields, tail_fields);
        match admit_batch(ctx, cfg, keys, &fresh, &fields, stop).await? {
            Ok(reply) => {
                for (e, item) in fresh.into_iter().zip(reply.items) {
                    let (value, fresh_verdicts) = match item {
                        Admitted::Now { decision, verdicts } => (decision, Some(verdicts)),
                        Admitted::Earlier(decision) => (decision, None),
                        Admitted::Stale(age_us) => {
                            dead.push((e.entry, Refused::stale(age_us, "inbound.dedupe_ttl")));
                            continue;
                        }
                    };
                    for (count, passed) in verdicts_by_rule
                        .iter_mut()
                        .zip(fresh_verdicts.into_iter().flatten())
                    {
                        if passed {
                            count.0 += 1;
                        } else {
                            count.1 += 1;
                        }
                    }
                    match Decision::parse(&value) {
                        Some(d) => decided.push((e, d)),
                        None => {
                            warn!(entry = %e.entry.id, marker = %value, "unreadable inbound decision");
                            let detail = format!("unreadable recorded decision {value:?}");
                            dead.push((
                                e.entry,
                                Refused {
                                    reason: Reason::Malformed,
                                    detail,
                                },
                            ));
                        }
                    }
                }
            }
            Err(e) => {
                let policy = cfg.fail_policy;
                warn!(error = %e, policy = policy.as_str(), events = fresh.len(), "admission failed; applying inbound.fail_policy");
                telemetry::limiter_unavailable(policy.as_str(), fresh.len());
                let decision = match policy {
                    FailPolicy::FailOpen => Decision::FailedOpen,
                    FailPolicy::FailClosed => Decision::FailedClosed,
                };
                let prev = record(ctx, cfg, keys, &fresh, decision.clone(), stop).await?;
                for (e, prev) in fresh.into_iter().zip(prev) {
                    // A decision already there: the admission did run (its reply was lost).
                    decided.push((e, prev.unwrap_or_else(|| decision.clone())));
                }
            }
        }
    }
    if verdicts_by_rule.iter().any(|&(p, f)| p + f > 0) {
        for (rule, (passed, failed)) in cfg.rules.iter().zip(verdicts_by_rule) {
            telemetry::inbound_decisions(&rule.name, rule.shadow, passed, failed);
        }
    }
    if !decided.is_empty() {
        crate::fault::point("admitted");
    }
    Some(decided)
}

/// One admission call for the batch, tried up to `limiter_attempts` times with backoff.
/// `None` if shutdown came first; `Some(Err)` when every attempt failed.
async fn admit_batch(
    ctx: &Context,
    cfg: &InboundConfig,
    keys: &InboundKeys,
    events: &[InboundEvent],
    fields: &[Fields],
    stop: &CancellationToken,
) -> Option<Result<AdmitReply>> {
    let owners: Vec<String> = events.iter().map(|e| e.entry.owner()).collect();
    let hashes: Vec<String> = events.iter().map(|e| keys.decisions(&e.entry.id)).collect();
    let items: Vec<AdmitItem<'_>> = events
        .iter()
        .zip(&owners)
        .zip(&hashes)
        .zip(fields)
        .map(|(((e, owner), decisions), fields)| AdmitItem {
            owner,
            stream: &e.entry.stream,
            entry_ms: e.entry.ms(),
            decisions,
            identities: e.identities.iter().map(String::as_str).collect(),
            fields,
        })
        .collect();
    let rules = ctx
        .inbound_rules
        .as_ref()
        .expect("a worker with an inbound flow makes its rules");
    let acks = ctx.acks_in_script(keys.slot_key());
    let to = AdmitTargets {
        keys,
        forward: ctx.same_slot(keys.slot_key(), &keys.forward),
        rejected: ctx.same_slot(keys.slot_key(), &keys.rejected),
        decision_ttl_ms: cfg.flow.dedupe_ttl.as_millis() as u64,
        max_len: cfg.flow.max_len,
        group: &ctx.cfg.worker.group,
        acks: &acks,
        stale_us: cfg.flow.dedupe_ttl.as_micros() as i64,
    };
    let mut backoff = Backoff::default();
    // Replicas lagging is not the limiter failing: it never turns into `fail_policy`. The call
    // is repeated (it gives back the decisions it recorded) until they confirm it.
    let mut lagging = Backoff::default();
    loop {
        let mut con = ctx.con.clone();
        let call = ctx.scripts.admit(&mut con, &to, rules, &items);
        match telemetry::timed("admit", call).await {
            Ok(reply) => {
                ctx.health.wrote();
                let Err(e) = ctx.replicated(keys.slot_key()).await else {
                    return Some(Ok(reply));
                };
                // Health says the stall once; here only the detail.
                let delay = lagging.fail();
                debug!(error = %e, attempt = lagging.failures(), "holding admissions the replicas have not confirmed; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            Err(e) => {
                ctx.failed("admit", &e);
                let delay = backoff.fail();
                if backoff.failures() >= cfg.limiter_attempts {
                    return Some(Err(e));
                }
                debug!(error = %e, attempt = backoff.failures(), "admission call failed; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// Records `decision` for each event unless one is recorded already; returns what was
/// there before (`None` where `decision` now stands). Retried until it succeeds; `None` if
/// shutdown came first.
async fn record(
    ctx: &Context,
    cfg: &InboundConfig,
    keys: &InboundKeys,
    events: &[InboundEvent],
    decision: Decision,
    stop: &CancellationToken,
) -> Option<Vec<Option<Decision>>> {
    let targets: Vec<(String, String)> = events
        .iter()
        .map(|e| (keys.decisions(&e.entry.id), e.entry.owner()))
        .collect();
    let ttl_ms = cfg.flow.dedupe_ttl.as_millis() as u64;
    let value = decision.marker();
    // In one script (the hashes share the partition's slot): set where unset, read what
    // stands, renew each hash's time to live.
    let now: Vec<String> = ctx
        .retry("record", stop, || {
            let mut con = ctx.con.clone();
            let targets = &targets;
            async move { ctx.scripts.record(&mut con, targets, value, ttl_ms).await }
        })
        .await?;
    // The same decision standing already (an earlier delivery recorded it too) is this one.
    Some(
        now.into_iter()
            .map(|v| (v != value).then(|| Decision::parse(&v).unwrap_or(Decision::Voided)))
            .collect(),
    )
}

/// Carries out each decision: writes (once each) what the admission script did not, counts;
/// returns the entries left to acknowledge (`None` if shutdown came first).
async fn finish(
    ctx: &Context,
    cfg: &InboundConfig,
    keys: &InboundKeys,
    decided: Vec<(InboundEvent, Decision)>,
    mut dead: Vec<(Entry, Refused)>,
    stop: &CancellationToken,
) -> Option<Vec<(Arc<str>, String)>> {
    let mut acks: Vec<(Arc<str>, String)> = Vec::new();
    // The admission call acknowledged what it wrote where the stream was in its reach.
    let in_call = ctx.acks_in_script(keys.slot_key());
    let ack_unless_done = |acks: &mut Vec<(Arc<str>, String)>, e: &InboundEvent| {
        if !in_call(&e.entry.stream) {
            acks.push((e.entry.stream.clone(), e.entry.id.clone()));
        }
    };
    let mut forward: Vec<(&Entry, Fields)> = Vec::new();
    let mut rejected: Vec<(&Entry, Fields)> = Vec::new();
    // Events per outcome, indexed as InboundOutcome::ALL.
    let mut counts = [0u64; InboundOutcome::ALL.len()];
    let max = ctx.cfg.worker.max_deliveries;
    for (e, d) in &decided {
        match d {
            Decision::Accepted { written: true } => {
                ack_unless_done(&mut acks, e);
                counts[InboundOutcome::Accepted as usize] += 1;
            }
            Decision::Accepted { written: false } => {
                forward.push((&e.entry, ev::forward_fields(e)));
                counts[InboundOutcome::Accepted as usize] += 1;
            }
            Decision::FailedOpen => {
                forward.push((&e.entry, ev::forward_fields(e)));
                counts[InboundOutcome::FailedOpen as usize] += 1;
            }
            // Written by the admission call, in the step that decided it.
            Decision::Rejected { written: true, .. } => {
                ack_unless_done(&mut acks, e);
                counts[InboundOutcome::Rejected as usize] += 1;
            }
            Decision::Rejected { .. } => {
                rejected.push((&e.entry, ev::rejected_fields(e, d)));
                counts[InboundOutcome::Rejected as usize] += 1;
            }
            Decision::FailedClosed => {
                rejected.push((&e.entry, ev::rejected_fields(e, d)));
                counts[InboundOutcome::FailedClosed as usize] += 1;
            }
            Decision::Voided => {
                let detail = format!(
                    "delivered {} times, more than worker.max_deliveries ({max}), before any decision",
                    e.entry.deliveries
                );
                dead.push((
                    e.entry.clone(),
                    Refused {
                        reason: Reason::TooManyDeliveries,
                        detail,
                    },
                ));
            }
        }
    }
    let dead_fields: Vec<(&Entry, Fields)> = dead
        .iter()
        .map(|(e, r)| (e, event::dead_letter_fields(e, r)))
        .collect();
    let writes = [
        ("forward", &keys.forward, &forward),
        ("reject", &keys.rejected, &rejected),
        ("deadletter", &cfg.flow.dead_letter_stream, &dead_fields),
    ];
    for (op, stream, items) in writes {
        let unacked = outputs::emit(
            ctx,
            op,
            &OutputKeys::new(stream),
            (cfg.flow.dedupe_ttl.as_millis() as u64, cfg.flow.max_len),
            items,
            stop,
        )
        .await?;
        acks.extend(unacked);
    }
    for (entry, refused) in &dead {
        debug!(entry = %entry.id, reason = refused.reason.as_str(), detail = %refused.detail, "inbound entry dead-lettered");
    }
    counts[InboundOutcome::DeadLettered as usize] += dead.len() as u64;
    for (outcome, n) in InboundOutcome::ALL.into_iter().zip(counts) {
        telemetry::inbound_events(outcome, n);
    }
    Some(acks)
}

/// Every input stream a worker reads: the outbound ones, then the inbound ones.
pub(super) fn input_streams(cfg: &crate::config::Config) -> Vec<Arc<str>> {
    cfg.input_streams().map(|(s, _)| Arc::from(s)).collect()
}
