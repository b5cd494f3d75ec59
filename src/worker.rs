//! The worker: reads input streams with a consumer group (inbound entries go to `inbound`),
//! claims what dead or stuck consumers left pending, places each outbound event on a route
//! (its own or a fallback), hands the ones that must wait to the dispatcher, and acknowledges an
//! input entry only once it has ended in exactly one place (a ready stream, the rejected stream
//! or the dead-letter stream).
//!
//! Decide, record, sleep, dispatch: `schedule.lua` records each decision in a marker before the
//! worker sleeps, so a redelivered entry resumes its decision instead of taking a second slot.
//! Every Redis step is idempotent (markers), so any failed step is simply retried with backoff.

mod dispatcher;
mod inbound;
mod waker;

use crate::clock::RedisClock;
use crate::config::{Config, Route};
use crate::error::Result;
use crate::event::{self, Entry, Fields, Marker, OutboundEvent, Reason, Refused};
use crate::fault;
use crate::keys::OutputKeys;
use crate::scripts::{EmitItem, ScheduleItem, Scheduled, Scripts};
use crate::streams;
use crate::telemetry::{self, Health, Outcome};
use dispatcher::Sleeper;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// How long one XREADGROUP blocks: also how long a SIGTERM may wait for the reader to notice.
const READ_BLOCK: Duration = Duration::from_millis(500);
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// What every task of one worker process shares.
pub(crate) struct Shared {
    cfg: Config,
    consumer: String,
    scripts: Scripts,
    con: ConnectionManager,
    health: Arc<Health>,
    clock: RedisClock,
    streams: Vec<Arc<str>>,
    rejected: OutputKeys,
    dead: OutputKeys,
    marker_ttl_ms: u64,
    /// One permit per event this process holds; the reader stops when they run out.
    permits: Arc<Semaphore>,
    /// Whether the admission script writes inbound rejections itself (the rejected stream
    /// shares the forward stream's slot, or Redis is not a cluster); found when preparing.
    rejects_in_admission: AtomicBool,
}

/// A worker process's outbound side.
pub struct Worker {
    shared: Arc<Shared>,
    reader_con: ConnectionManager,
}

impl Worker {
    /// Prepares a worker; connects lazily, so a Redis that is down at start is waited for.
    pub fn new(cfg: Config, health: Arc<Health>) -> Result<Self> {
        let client = redis::Client::open(cfg.redis.url.as_str())?;
        let timeout = cfg.redis.timeout;
        let manager_cfg = |response: Duration| {
            ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(response))
                .set_number_of_retries(1)
                .set_max_delay(BACKOFF_MAX)
        };
        let con = ConnectionManager::new_lazy_with_config(client.clone(), manager_cfg(timeout))?;
        // Blocking reads get their own connection: a read blocked in Redis must not hold up the
        // scheduling and dispatch calls queued behind it.
        let reader_con =
            ConnectionManager::new_lazy_with_config(client, manager_cfg(READ_BLOCK + timeout))?;
        let consumer = if cfg.worker.consumer.is_empty() {
            default_consumer()
        } else {
            cfg.worker.consumer.clone()
        };
        let shared = Shared {
            consumer,
            scripts: Scripts::default(),
            con,
            health,
            clock: RedisClock::default(),
            streams: inbound::input_streams(&cfg),
            rejected: OutputKeys::new(&cfg.outbound.rejected_stream),
            dead: OutputKeys::new(&cfg.outbound.dead_letter_stream),
            marker_ttl_ms: cfg.outbound.dedupe_ttl.as_millis() as u64,
            permits: Arc::new(Semaphore::new(cfg.worker.max_inflight)),
            rejects_in_admission: AtomicBool::new(false),
            cfg,
        };
        Ok(Worker {
            shared: Arc::new(shared),
            reader_con,
        })
    }

    pub fn consumer(&self) -> &str {
        &self.shared.consumer
    }

    /// Runs until `shutdown` is cancelled, then drains: events due within `worker.drain` are
    /// dispatched, the rest stay pending in the group for another worker. Never returns an error
    /// for Redis trouble: it waits, retries and reports not-ready instead.
    pub async fn run(self, shutdown: CancellationToken) {
        let shared = self.shared;
        let rules = shared.cfg.inbound.as_ref().map_or(0, |i| i.rules.len());
        info!(consumer = %shared.consumer, routes = shared.cfg.outbound.routes.len(), inbound_rules = rules, "worker starting");
        if !shared.prepare(&shutdown).await {
            return;
        }
        let hard_stop = CancellationToken::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let dispatcher = tokio::spawn(dispatcher::run(
            shared.clone(),
            rx,
            shutdown.clone(),
            hard_stop.clone(),
        ));
        let monitor = tokio::spawn(monitor(shared.clone(), hard_stop.clone()));
        let claimer = tokio::spawn(claim_loop(shared.clone(), tx.clone(), shutdown.clone()));
        let work = async {
            read_loop(&shared, self.reader_con, &tx, &shutdown).await;
            let _ = claimer.await;
            drop(tx);
            let _ = dispatcher.await;
        };
        // The dispatcher finishes what falls due within the drain. Whatever still runs when the
        // drain is over (a call to a Redis that is down, say) is dropped where it stands: every
        // step is idempotent and nothing unfinished was acknowledged, so another worker claims
        // it. The process exits within `drain` of SIGTERM, Redis or not.
        let deadline = async {
            shutdown.cancelled().await;
            tokio::time::sleep(shared.cfg.worker.drain).await;
        };
        tokio::select! {
            _ = work => {}
            _ = deadline => warn!("drain time is over; leaving the remaining events pending"),
        }
        hard_stop.cancel();
        let _ = monitor.await;
        info!("worker stopped");
    }
}

fn default_consumer() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "pacer".into());
    format!("{host}-{}", std::process::id())
}

/// Reads batches until shutdown; each batch is placed before the next read.
async fn read_loop(
    shared: &Arc<Shared>,
    mut con: ConnectionManager,
    tx: &mpsc::UnboundedSender<Sleeper>,
    shutdown: &CancellationToken,
) {
    let batch = shared.cfg.worker.batch;
    let mut backoff = BACKOFF_MIN;
    while !shutdown.is_cancelled() {
        let mut permits = tokio::select! {
            _ = shutdown.cancelled() => return,
            p = shared.permits.clone().acquire_many_owned(batch as u32) => p.expect("never closed"),
        };
        let read = telemetry::timed(
            "read",
            streams::read_group(
                &mut con,
                &shared.cfg.worker.group,
                &shared.consumer,
                &shared.streams,
                batch,
                READ_BLOCK,
            ),
        )
        .await;
        let entries = match read {
            Ok(entries) => {
                shared.health.set_redis_ok(true);
                backoff = BACKOFF_MIN;
                entries
            }
            Err(e) => {
                shared.health.set_redis_ok(false);
                warn!(error = %e, retry_in = ?backoff, "reading input streams failed");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
                if e.to_string().contains("NOGROUP") {
                    shared.prepare(shutdown).await;
                }
                continue;
            }
        };
        if entries.len() > batch {
            // COUNT is per stream: several input streams can return more than one batch.
            let more = (entries.len() - batch) as u32;
            let extra = shared.permits.clone().acquire_many_owned(more).await;
            permits.merge(extra.expect("never closed"));
        }
        let held: Vec<OwnedSemaphorePermit> = entries
            .iter()
            .map(|_| permits.split(1).expect("one permit per entry read"))
            .collect();
        drop(permits);
        shared.handle_entries(entries, held, tx, shutdown).await;
    }
}

/// Most claim rounds one tick runs per stream, so that a stream full of entries another worker
/// keeps claiming first cannot hold this loop.
const CLAIM_ROUNDS: usize = 100;

/// Every how many claim ticks the group's departed consumers are deleted.
const REAP_EVERY_TICKS: u64 = 10;

/// Claims, every `claim_idle / 2`, the entries other consumers left pending longer than
/// `claim_idle` (a killed or stuck worker, or one that drained), and finishes them: a recorded
/// decision is carried on, not taken again (see `resume`).
async fn claim_loop(
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<Sleeper>,
    shutdown: CancellationToken,
) {
    let idle = shared.cfg.worker.claim_idle;
    let every = (idle / 2).clamp(Duration::from_millis(50), Duration::from_secs(10));
    let batch = shared.cfg.worker.batch;
    let mut failures = 0u32;
    for tick in 0u64.. {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if tick % REAP_EVERY_TICKS == 0 {
            shared.reap().await;
        }
        for stream in &shared.streams {
            for _ in 0..CLAIM_ROUNDS {
                let mut permits = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    p = shared.permits.clone().acquire_many_owned(batch as u32) => p.expect("never closed"),
                };
                let claimed = telemetry::timed("claim", shared.claim(stream, idle, batch)).await;
                let (listed, entries) = match claimed {
                    Ok(c) => {
                        failures = 0;
                        c
                    }
                    Err(e) => {
                        // The reader and the dispatcher report Redis trouble too; say it once.
                        failures += 1;
                        if failures == 1 {
                            warn!(error = %e, %stream, "claiming pending entries failed");
                        }
                        break;
                    }
                };
                if !entries.is_empty() {
                    info!(%stream, count = entries.len(), "claimed entries left pending by another consumer");
                    telemetry::claimed(stream, entries.len());
                    let held: Vec<OwnedSemaphorePermit> = entries
                        .iter()
                        .map(|_| permits.split(1).expect("one permit per entry claimed"))
                        .collect();
                    drop(permits);
                    shared.handle_entries(entries, held, &tx, &shutdown).await;
                }
                if listed < batch {
                    break;
                }
            }
        }
    }
}

/// Keeps the stream gauges and readiness fresh.
async fn monitor(shared: Arc<Shared>, stop: CancellationToken) {
    let mut con = shared.con.clone();
    loop {
        for stream in &shared.streams {
            let info = telemetry::timed(
                "info",
                streams::group_info(&mut con, stream, &shared.cfg.worker.group),
            )
            .await;
            match info {
                Ok(Some((pending, lag))) => {
                    telemetry::stream_state(stream, &shared.cfg.worker.group, pending, lag);
                    shared.health.set_redis_ok(true);
                }
                Ok(None) => {}
                Err(_) => shared.health.set_redis_ok(false),
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

/// An event on its way to a route.
struct Placing {
    event: OutboundEvent,
    /// Index in `event.routes` of the route to try next.
    next: usize,
    /// Shortest wait any route offered (for `pacer_retry_after_ms`), µs.
    best_wait_us: Option<i64>,
    /// A stale decision this one may replace (a redelivered event whose slot has long passed).
    expect: Option<String>,
    permit: OwnedSemaphorePermit,
}

/// Where a batch's entries ended.
#[derive(Default)]
struct Finished {
    acks: Vec<(Arc<str>, String)>,
    dead: Vec<(Entry, Refused)>,
    rejected: Vec<(OutboundEvent, i64)>,
}

impl Shared {
    /// Lists up to `count` entries of `stream` idle longer than `idle` and claims them; returns
    /// how many were listed and the entries this worker won.
    async fn claim(
        &self,
        stream: &Arc<str>,
        idle: Duration,
        count: usize,
    ) -> Result<(usize, Vec<Entry>)> {
        let mut con = self.con.clone();
        let group = &self.cfg.worker.group;
        let listed = streams::pending_idle(&mut con, stream, group, idle, count).await?;
        if listed.is_empty() {
            return Ok((0, Vec::new()));
        }
        let entries =
            streams::claim(&mut con, stream, group, &self.consumer, idle, &listed).await?;
        Ok((listed.len(), entries))
    }

    /// Deletes consumers of departed workers (each run joins under a new name) once they hold
    /// nothing and have been idle for twice `claim_idle`: without this the group's consumer list
    /// would grow with every restart. Best effort; the next tick tries again.
    async fn reap(&self) {
        let min_idle = (self.cfg.worker.claim_idle * 2).max(Duration::from_secs(1));
        for stream in &self.streams {
            let mut con = self.con.clone();
            let reaped = self
                .scripts
                .reap(
                    &mut con,
                    stream,
                    &self.cfg.worker.group,
                    min_idle,
                    &self.consumer,
                )
                .await;
            match reaped {
                Ok(0) => {}
                Ok(n) => {
                    info!(%stream, consumers = n, "deleted departed consumers holding nothing")
                }
                Err(e) => debug!(%stream, error = %e, "deleting departed consumers failed"),
            }
        }
    }

    /// Creates the consumer groups and loads the scripts, retrying until Redis answers.
    /// Returns false if shutdown came first.
    async fn prepare(&self, shutdown: &CancellationToken) -> bool {
        let group = self.cfg.worker.group.clone();
        self.retry("prepare", shutdown, || {
            let mut con = self.con.clone();
            let group = group.clone();
            async move {
                for stream in &self.streams {
                    streams::ensure_group(&mut con, stream, &group).await?;
                }
                if let Some(inbound) = &self.cfg.inbound {
                    let here = streams::same_slot(
                        &mut con,
                        &inbound.forward_stream,
                        &inbound.rejected_stream,
                    )
                    .await?;
                    self.rejects_in_admission.store(here, Ordering::Relaxed);
                    info!(
                        in_admission = here,
                        "inbound rejections are written {}",
                        if here {
                            "by the admission call itself"
                        } else {
                            "by a second call (the rejected stream is in another cluster slot)"
                        }
                    );
                }
                self.scripts.load(&mut con).await
            }
        })
        .await
        .map(|_| self.health.set_prepared(true))
        .is_some()
    }

    /// Runs `f` until it succeeds, backing off between failures; `None` if `stop` comes first.
    /// Safe because every step pacer takes in Redis is idempotent.
    async fn retry<T, F, Fut>(
        &self,
        op: &'static str,
        stop: &CancellationToken,
        mut f: F,
    ) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut backoff = BACKOFF_MIN;
        let mut failures = 0u32;
        loop {
            match telemetry::timed(op, f()).await {
                Ok(v) => {
                    self.health.set_redis_ok(true);
                    return Some(v);
                }
                Err(e) => {
                    self.health.set_redis_ok(false);
                    failures += 1;
                    // First failure and then every tenth: an outage must not flood the logs.
                    if failures == 1 || failures % 10 == 0 {
                        warn!(op, error = %e, failures, retry_in = ?backoff, "Redis call failed");
                    }
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Checks, places and finishes one batch of entries (each with its permit).
    async fn handle_entries(
        self: &Arc<Self>,
        entries: Vec<Entry>,
        permits: Vec<OwnedSemaphorePermit>,
        tx: &mpsc::UnboundedSender<Sleeper>,
        stop: &CancellationToken,
    ) {
        if !entries.is_empty() {
            fault::point("read");
        }
        let (entries, permits) = self.admit_inbound(entries, permits, stop).await;
        let mut done = Finished::default();
        let mut placing = Vec::new();
        let mut poison = Vec::new();
        for (entry, permit) in entries.into_iter().zip(permits) {
            let over = entry.deliveries > self.cfg.worker.max_deliveries;
            match event::parse_outbound(entry, &self.cfg.outbound) {
                Ok(event) if over => poison.push(event),
                Ok(event) => placing.push(Placing {
                    event,
                    next: 0,
                    best_wait_us: None,
                    expect: None,
                    permit,
                }),
                // An entry that cannot be parsed is dead-lettered for that, however often it came.
                Err((entry, refused)) => done.dead.push((entry, refused)),
            }
        }
        if !poison.is_empty() && !self.settle_poison(poison, &mut done, stop).await {
            return;
        }
        let placed = !placing.is_empty();
        self.place(placing, &mut done, tx, stop).await;
        if placed {
            fault::point("scheduled");
        }
        self.finish(done, stop).await;
    }

    /// Ends events delivered more than `max_deliveries` times (each delivery's worker died or
    /// stalled on them) without deciding them again. Each route's undispatched decision is voided
    /// first, so that no sleeping worker can still dispatch the event; then an event already
    /// dispatched is only acknowledged, one passed over by every route is rejected as before,
    /// and any other is dead-lettered. False if shutdown came first.
    async fn settle_poison(
        &self,
        poison: Vec<OutboundEvent>,
        done: &mut Finished,
        stop: &CancellationToken,
    ) -> bool {
        let calls = poison.iter().flat_map(|e| {
            e.routes.iter().map(move |route| {
                let keys = &self.cfg.outbound.routes[route].keys;
                self.retry("void", stop, move || {
                    let mut con = self.con.clone();
                    async move {
                        self.scripts
                            .void(&mut con, keys, &e.event_id, &e.owner, self.marker_ttl_ms)
                            .await
                    }
                })
            })
        });
        let olds = futures_util::future::join_all(calls).await;
        let Some(mut olds) = olds.into_iter().collect::<Option<Vec<String>>>() else {
            return false;
        };
        let max = self.cfg.worker.max_deliveries;
        for event in poison {
            let rest = olds.split_off(event.routes.len());
            let markers = std::mem::replace(&mut olds, rest);
            let parsed: Vec<_> = markers.iter().map(|m| event::parse_marker(m)).collect();
            let ours =
                |m: &Option<(Marker, &str)>| m.as_ref().is_some_and(|(_, o)| *o == event.owner);
            let dispatched = parsed
                .iter()
                .any(|m| ours(m) && matches!(m, Some((Marker::Dispatched(_), _))));
            let skipped_wait = parsed
                .iter()
                .map(|m| match m {
                    Some((Marker::Skipped(w), o)) if *o == event.owner => Some(*w),
                    _ => None,
                })
                .collect::<Option<Vec<i64>>>();
            warn!(entry = %event.entry.id, stream = %event.entry.stream, deliveries = event.entry.deliveries, "poison entry");
            if dispatched {
                done.acks
                    .push((event.entry.stream.clone(), event.entry.id.clone()));
            } else if let Some(other) = markers
                .iter()
                .zip(&parsed)
                .find_map(|(m, p)| p.as_ref().filter(|(_, o)| *o != event.owner).map(|_| m))
            {
                let detail = format!("event id {:?} was already taken: {other}", event.event_id);
                done.dead.push((
                    event.entry,
                    Refused {
                        reason: Reason::Duplicate,
                        detail,
                    },
                ));
            } else if let Some(waits) = skipped_wait {
                let best = waits.into_iter().min().unwrap_or(0);
                done.rejected
                    .push((event, (best.max(0) as u64).div_ceil(1000) as i64));
            } else {
                let detail = format!(
                    "delivered {} times, more than worker.max_deliveries ({max})",
                    event.entry.deliveries
                );
                done.dead.push((
                    event.entry,
                    Refused {
                        reason: Reason::TooManyDeliveries,
                        detail,
                    },
                ));
            }
        }
        true
    }

    /// Offers events to their routes, one `schedule` call per route per round, until each is
    /// dispatched, sleeping, or out of routes.
    async fn place(
        self: &Arc<Self>,
        mut pending: Vec<Placing>,
        done: &mut Finished,
        tx: &mpsc::UnboundedSender<Sleeper>,
        stop: &CancellationToken,
    ) {
        while !pending.is_empty() {
            let mut by_route: BTreeMap<String, Vec<Placing>> = BTreeMap::new();
            for p in pending.drain(..) {
                by_route
                    .entry(p.event.routes[p.next].clone())
                    .or_default()
                    .push(p);
            }
            let calls = by_route
                .into_iter()
                .map(|(route, group)| self.schedule_on(route, group, stop));
            for (route, group, reply) in futures_util::future::join_all(calls).await {
                let Some(reply) = reply else {
                    // Shutdown while Redis failed: leave these entries pending.
                    continue;
                };
                self.clock.observe(reply.end_us, Instant::now());
                telemetry::route_queue(&route.name, reply.tat_us - reply.now_us);
                for ((mut p, fields), outcome) in group.into_iter().zip(reply.items) {
                    let rerouted = p.next > 0;
                    match outcome {
                        Scheduled::Dispatched { .. } => {
                            telemetry::scheduled_wait(&route.name, 0);
                            telemetry::lateness(&route.name, 0);
                            self.count_dispatch(&p.event, &route.name, rerouted);
                            done.acks
                                .push((p.event.entry.stream.clone(), p.event.entry.id.clone()));
                        }
                        Scheduled::Sleep { slot_us } => {
                            let wait_us = slot_us - reply.now_us;
                            telemetry::scheduled_wait(&route.name, wait_us);
                            let sleeper = Sleeper::new(
                                p.event,
                                p.permit,
                                &route.name,
                                fields,
                                slot_us,
                                wait_us,
                            );
                            let _ = tx.send(sleeper);
                        }
                        Scheduled::TooLong { wait_us } => {
                            p.best_wait_us =
                                Some(p.best_wait_us.map_or(wait_us, |b| b.min(wait_us)));
                            self.next_route(p, &mut pending, done);
                        }
                        Scheduled::Decided(marker) => {
                            self.resume(
                                p,
                                route,
                                fields,
                                &marker,
                                reply.now_us,
                                &mut pending,
                                done,
                                tx,
                            );
                        }
                    }
                }
            }
        }
    }

    async fn schedule_on(
        &self,
        route: String,
        group: Vec<Placing>,
        stop: &CancellationToken,
    ) -> (
        &Route,
        Vec<(Placing, Fields)>,
        Option<crate::scripts::ScheduleReply>,
    ) {
        let route = &self.cfg.outbound.routes[&route];
        let fields: Vec<Fields> = group
            .iter()
            .map(|p| event::ready_fields(&p.event, &route.name))
            .collect();
        let reply = {
            let items: Vec<ScheduleItem<'_>> = group
                .iter()
                .zip(&fields)
                .map(|(p, fields)| ScheduleItem {
                    event_id: &p.event.event_id,
                    owner: &p.event.owner,
                    expect: p.expect.as_deref(),
                    cost: p.event.cost,
                    max_wait_us: max_wait_us(route, &p.event),
                    fields,
                })
                .collect();
            self.retry("schedule", stop, || {
                let mut con = self.con.clone();
                let items = &items;
                async move {
                    self.scripts
                        .schedule(
                            &mut con,
                            &route.keys,
                            &route.bucket,
                            self.marker_ttl_ms,
                            self.cfg.outbound.max_len,
                            items,
                        )
                        .await
                }
            })
            .await
        };
        // The fields go on with each event: a sleeper dispatches with the same ones.
        (route, group.into_iter().zip(fields).collect(), reply)
    }

    /// A route could not take the event in time: try the next, or reject it.
    fn next_route(&self, mut p: Placing, pending: &mut Vec<Placing>, done: &mut Finished) {
        p.next += 1;
        p.expect = None;
        if p.next < p.event.routes.len() {
            pending.push(p);
        } else {
            let retry_after_ms = (p.best_wait_us.unwrap_or(0).max(0) as u64).div_ceil(1000) as i64;
            done.rejected.push((p.event, retry_after_ms));
        }
    }

    /// An earlier delivery of this event left a decision on `route`: carry it on.
    #[allow(clippy::too_many_arguments)]
    fn resume(
        &self,
        mut p: Placing,
        route: &Route,
        fields: Fields,
        marker: &str,
        now_us: i64,
        pending: &mut Vec<Placing>,
        done: &mut Finished,
        tx: &mpsc::UnboundedSender<Sleeper>,
    ) {
        match event::parse_marker(marker) {
            Some((_, owner)) if owner != p.event.owner => {
                let detail = format!(
                    "event id {:?} was already taken by entry {owner}",
                    p.event.event_id
                );
                telemetry::outbound_event(&p.event.routes[0], Outcome::Duplicate);
                done.dead.push((
                    p.event.entry,
                    Refused {
                        reason: Reason::Duplicate,
                        detail,
                    },
                ));
            }
            Some((Marker::Dispatched(_), _)) => {
                debug!(event = %p.event.event_id, route = %route.name, "already dispatched by an earlier delivery");
                done.acks
                    .push((p.event.entry.stream.clone(), p.event.entry.id.clone()));
            }
            Some((Marker::Skipped(wait_us), _)) => {
                p.best_wait_us = Some(p.best_wait_us.map_or(wait_us, |b| b.min(wait_us)));
                self.next_route(p, pending, done);
            }
            Some((Marker::Voided, _)) => {
                // A poison check voided it while this delivery was on its way: the entry is
                // being dead-lettered (write-once, so writing it here too cannot double it).
                let detail = format!(
                    "delivered more than worker.max_deliveries ({}) times",
                    self.cfg.worker.max_deliveries
                );
                done.dead.push((
                    p.event.entry,
                    Refused {
                        reason: Reason::TooManyDeliveries,
                        detail,
                    },
                ));
            }
            Some((Marker::Slot(slot_us), _)) => {
                // The slot is ours already. If it is still ahead or only just passed, keep it;
                // if it passed longer ago than the route would let an event wait, decide anew.
                if now_us - slot_us > max_wait_us(route, &p.event).max(1_000_000) {
                    p.expect = Some(marker.to_string());
                    pending.push(p);
                } else {
                    let wait_us = (slot_us - now_us).max(0);
                    let mut sleeper =
                        Sleeper::new(p.event, p.permit, &route.name, fields, slot_us, wait_us);
                    sleeper.expect = marker.to_string();
                    let _ = tx.send(sleeper);
                }
            }
            None => {
                warn!(event = %p.event.event_id, marker, "unreadable decision marker; deciding anew");
                p.expect = Some(marker.to_string());
                pending.push(p);
            }
        }
    }

    fn count_dispatch(&self, event: &OutboundEvent, route: &str, rerouted: bool) {
        telemetry::outbound_event(route, Outcome::Dispatched);
        if rerouted {
            telemetry::outbound_event(&event.routes[0], Outcome::Rerouted);
        }
    }

    /// Writes rejections and dead letters (once each), then acknowledges everything finished.
    async fn finish(&self, mut done: Finished, stop: &CancellationToken) {
        let dead: Vec<(&Entry, Fields)> = done
            .dead
            .iter()
            .map(|(e, r)| (e, event::dead_letter_fields(e, r)))
            .collect();
        let limits = (self.marker_ttl_ms, self.cfg.outbound.max_len);
        if self
            .emit("deadletter", &self.dead, limits, &dead, stop)
            .await
        {
            for (entry, refused) in &done.dead {
                let outcome = match refused.reason {
                    Reason::Duplicate => Outcome::Duplicate,
                    _ => Outcome::DeadLettered,
                };
                telemetry::outbound_event("none", outcome);
                debug!(entry = %entry.id, reason = refused.reason.as_str(), detail = %refused.detail, "dead-lettered");
                done.acks.push((entry.stream.clone(), entry.id.clone()));
            }
        }
        let rejected: Vec<(&Entry, Fields)> = done
            .rejected
            .iter()
            .map(|(e, retry)| {
                (
                    &e.entry,
                    event::rejected_fields(e, Reason::QueueFull, *retry),
                )
            })
            .collect();
        if self
            .emit("reject", &self.rejected, limits, &rejected, stop)
            .await
        {
            for (event, _) in &done.rejected {
                telemetry::outbound_event(&event.routes[0], Outcome::Rejected);
                done.acks
                    .push((event.entry.stream.clone(), event.entry.id.clone()));
            }
        }
        self.ack(done.acks, stop).await;
    }

    /// Writes each entry's fields to a shared output stream once (its write-once markers live
    /// `ttl_ms`, the stream is trimmed to about `max_len`); true when done (also when there was
    /// nothing to write), false if shutdown came first.
    async fn emit(
        &self,
        op: &'static str,
        keys: &OutputKeys,
        (ttl_ms, max_len): (u64, u64),
        entries: &[(&Entry, Fields)],
        stop: &CancellationToken,
    ) -> bool {
        if entries.is_empty() {
            return true;
        }
        let items: Vec<EmitItem<'_>> = entries
            .iter()
            .map(|(e, fields)| EmitItem {
                source_stream: &e.stream,
                source_id: &e.id,
                fields,
            })
            .collect();
        self.retry(op, stop, || {
            let mut con = self.con.clone();
            let items = &items;
            async move {
                self.scripts
                    .emit(&mut con, keys, ttl_ms, max_len, items)
                    .await
            }
        })
        .await
        .is_some()
    }

    /// Acknowledges finished entries, one XACK per input stream.
    async fn ack(&self, acks: Vec<(Arc<str>, String)>, stop: &CancellationToken) {
        let mut by_stream: BTreeMap<Arc<str>, Vec<String>> = BTreeMap::new();
        for (stream, id) in acks {
            by_stream.entry(stream).or_default().push(id);
        }
        for (stream, ids) in &by_stream {
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            self.retry("ack", stop, || {
                let mut con = self.con.clone();
                let ids = &ids;
                async move { streams::ack(&mut con, stream, &self.cfg.worker.group, ids).await }
            })
            .await;
        }
    }
}

/// The longest an event accepts to wait on `route`: the route's `max_wait`, or less if the
/// event asks for less.
fn max_wait_us(route: &Route, event: &OutboundEvent) -> i64 {
    let cap = route.max_wait;
    let wait = event.max_wait.map_or(cap, |w| w.min(cap));
    wait.as_micros() as i64
}
