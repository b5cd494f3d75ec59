//! The worker: one process's share of the consumer group. It reads the input streams, decides
//! each entry (an outbound event is placed on a route and sleeps until its slot; an inbound one is
//! admitted or rejected at once), and acknowledges an entry only once it has ended in exactly one
//! place (a ready stream, the forward, rejected or dead-letter stream).
//!
//! Decide, record, sleep, dispatch: `schedule.lua` records each decision in a marker before the
//! worker sleeps, so a redelivered entry resumes its decision instead of taking a second slot.
//! Every Redis step is idempotent (markers), so any failed step is simply retried with backoff.
//!
//! This file holds start-up and shutdown. The rooms, by what each decides:
//! - `context`: what every task shares (config, connection, scripts, health, clocks) and the
//!   retry loop around any Redis step;
//! - `reader`: reading batches, and the path every batch takes (parse, admit, place, finish);
//!   `budget`: how many entries a read asks for, and how many permits an entry holds, so
//!   that large entries are read few at a time and held within `max_inflight_bytes`;
//! - `claim`: claiming what other consumers left pending, taking up what this worker's own
//!   name holds pending but the worker no longer does (`held`: which entries it holds), and
//!   deleting departed consumers;
//! - `placement`: which route an outbound event goes to and when, and resuming a decision an
//!   earlier delivery recorded; `placers`: one placement task per route, so that one route's
//!   trouble never holds up another's;
//! - `poison`: ending entries delivered too often;
//! - `share`: how the routes share the worker's places, so that one route's backlog never
//!   holds up another's events (what a route may not take now, its placement task parks);
//! - `dispatcher` (timers in `dispatcher/timers`): holding events until their slots and
//!   dispatching them;
//! - `outputs`: rejections, dead letters and acknowledgements;
//! - `inbound`: the inbound flow;
//! - `prepare`: the groups, scripts and checks set up in Redis (again when Redis lost them);
//! - `monitor`: stream gauges and readiness;
//! - `waker`: the sub-millisecond timer thread.

mod budget;
mod claim;
mod context;
mod dispatcher;
mod heartbeat;
mod held;
mod inbound;
mod monitor;
mod outputs;
mod parked;
mod placement;
mod placers;
mod poison;
mod prepare;
mod reader;
mod share;
mod waker;

use crate::clock::{RedisClock, SystemClock};
use crate::config::Config;
use crate::connection::RedisConn;
use crate::error::Result;
use crate::health::Health;
use crate::keys::OutputKeys;
use crate::scripts::{ScriptRules, Scripts, LOG_ENTRIES_PER_READ};
use crate::telemetry;
use context::Context;
use placers::Placers;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// A worker process.
pub struct Worker {
    ctx: Arc<Context>,
    /// One connection per input stream's reader: each blocks in XREADGROUP.
    reader_cons: Vec<RedisConn>,
}

impl Worker {
    /// Prepares a worker; connects lazily, so a Redis that is down at start is waited for.
    pub fn new(cfg: Config, health: Arc<Health>) -> Result<Self> {
        let timeout = cfg.redis.timeout;
        let con = RedisConn::new(&cfg.redis, timeout)?;
        let streams = inbound::input_streams(&cfg);
        // Blocking reads get their own connections: a read blocked in Redis must not hold up the
        // scheduling and dispatch calls queued behind it.
        let reader_cons = streams
            .iter()
            .map(|_| RedisConn::new(&cfg.redis, reader::READ_BLOCK + timeout))
            .collect::<Result<Vec<_>, _>>()?;
        let consumer = if cfg.worker.consumer.is_empty() {
            default_consumer()
        } else {
            cfg.worker.consumer.clone()
        };
        let permits = Arc::new(Semaphore::new(cfg.worker.max_inflight));
        // Kept from long queues: what the readers and the claimer ask for at once (and what the
        // readers' large entries weigh beyond that: `Shares::read_weighed`). A lone route with
        // no inbound flow beside it keeps nothing from itself.
        let others = cfg.outbound.order.len() > 1 || cfg.inbound.is_some();
        let reserve = if others {
            cfg.worker.batch * (streams.len() + 1)
        } else {
            0
        };
        let shares = share::Shares::new(
            (0..cfg.outbound.order.len())
                .map(|i| cfg.outbound.route_at(i).bucket.interval_us)
                .collect(),
            permits.clone(),
            cfg.worker.max_inflight,
            reserve,
            streams.len(),
        );
        // WAITs block their connection: they get one of their own, waited on for as long.
        let waits = (cfg.redis.wait_replicas > 0)
            .then(|| RedisConn::new(&cfg.redis, timeout + cfg.redis.wait_timeout))
            .transpose()?;
        let ctx = Context {
            waits,
            consumer,
            scripts: Scripts::default(),
            con,
            health,
            clock: RedisClock::default(),
            time: Arc::new(SystemClock),
            held: held::Held::new(streams.len(), permits.clone()),
            streams,
            rejected: OutputKeys::new(&cfg.outbound.flow.rejected_stream),
            dead: OutputKeys::new(&cfg.outbound.flow.dead_letter_stream),
            marker_ttl_ms: cfg.outbound.flow.dedupe_ttl.as_millis() as u64,
            permits,
            shares,
            cluster: AtomicBool::new(false),
            policy_seen: Default::default(),
            broken_routes: Default::default(),
            wrong_kind: Default::default(),
            route_metrics: cfg
                .outbound
                .order
                .iter()
                .map(|name| telemetry::RouteMetrics::new(name))
                .collect(),
            inbound_rules: cfg
                .inbound
                .as_ref()
                .map(|i| ScriptRules::new(&i.rules, LOG_ENTRIES_PER_READ)),
            inbound_lanes: Default::default(),
            cfg,
        };
        Ok(Worker {
            ctx: Arc::new(ctx),
            reader_cons,
        })
    }

    pub fn consumer(&self) -> &str {
        &self.ctx.consumer
    }

    /// Runs until `shutdown` is cancelled, then drains: events due within `worker.drain` are
    /// dispatched, the rest stay pending in the group for another worker. Redis trouble is
    /// waited out (retries, not-ready); only a Redis that refuses pacer outright at start (its
    /// credentials, its TLS setup) is an error, since no retry can help.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let ctx = self.ctx;
        let rules = ctx.cfg.inbound.as_ref().map_or(0, |i| i.rules.len());
        let handle = tokio::runtime::Handle::current();
        let threads = handle.metrics().num_workers();
        let runtime = match handle.runtime_flavor() {
            tokio::runtime::RuntimeFlavor::CurrentThread => "current_thread",
            _ => "multi_thread",
        };
        info!(consumer = %ctx.consumer, routes = ctx.cfg.outbound.routes.len(), inbound_rules = rules, threads, runtime = %runtime, redis = %ctx.con.target(), "worker starting");
        for caution in ctx.cfg.cautions() {
            warn!("{caution}");
        }
        // Before `prepare`, which makes the worker ready: a worker refused its name never says
        // it is ready.
        prepare::check_name_free(&ctx, &shutdown).await?;
        if !prepare::prepare(&ctx, &shutdown).await? {
            return Ok(());
        }
        prepare::check_permissions(&ctx).await?;
        let hard_stop = CancellationToken::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let placers = Placers::start(&ctx, tx, &shutdown);
        let lanes = inbound::Lanes::start(&ctx, &shutdown);
        if ctx.inbound_lanes.set(lanes).is_err() {
            unreachable!("a worker runs once");
        }
        let dispatcher = tokio::spawn(dispatcher::run(
            ctx.clone(),
            rx,
            placers.clone(),
            shutdown.clone(),
            hard_stop.clone(),
        ));
        let monitor = tokio::spawn(monitor::run(ctx.clone(), hard_stop.clone()));
        // Until the drain is over: the worker holds its sleeping entries until then.
        let heartbeat = tokio::spawn(heartbeat::run(ctx.clone(), hard_stop.clone()));
        let claimer = tokio::spawn(claim::run(ctx.clone(), placers.clone(), shutdown.clone()));
        let work = async {
            let readers = (self.reader_cons.into_iter().enumerate())
                .map(|(index, con)| reader::run(&ctx, index, con, &placers, &shutdown));
            futures_util::future::join_all(readers).await;
            let _ = claimer.await;
            // The placement tasks end on shutdown; with them the dispatcher's inbox closes.
            drop(placers);
            let _ = dispatcher.await;
        };
        // The dispatcher finishes what falls due within the drain. Whatever still runs when the
        // drain is over (a call to a Redis that is down, say) is dropped where it stands: every
        // step is idempotent and nothing unfinished was acknowledged, so another worker claims
        // it. The process exits within `drain` of SIGTERM, Redis or not.
        let deadline = async {
            shutdown.cancelled().await;
            tokio::time::sleep(ctx.cfg.worker.drain).await;
        };
        tokio::select! {
            _ = work => {}
            _ = deadline => warn!("drain time is over; leaving the remaining events pending"),
        }
        hard_stop.cancel();
        let _ = monitor.await;
        let _ = heartbeat.await;
        info!("worker stopped");
        Ok(())
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
