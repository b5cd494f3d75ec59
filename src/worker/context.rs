//! What every task of one worker process shares, and the one loop that retries a Redis step.

use crate::backoff::Backoff;
use crate::clock::{Clock, RedisClock};
use crate::config::{Config, Route};
use crate::connection::RedisConn;
use crate::error::{Error, Result};
use crate::health::Health;
use crate::keys::{self, OutputKeys};
use crate::scripts::{RouteCall, Scripts, Writing};
use crate::telemetry;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub(crate) struct Context {
    pub(crate) cfg: Config,
    pub(crate) consumer: String,
    pub(crate) scripts: Scripts,
    pub(crate) con: RedisConn,
    /// With `redis.wait_replicas`, the connection its WAITs go on: Redis answers a client's
    /// commands in order, so on `con` every placing, dispatching and admitting call queued
    /// behind a WAIT that blocks (replicas lagging) and could pass `redis.timeout`, which
    /// health then took for Redis being down (found by a test of a frozen replica).
    pub(crate) waits: Option<RedisConn>,
    pub(crate) health: Arc<Health>,
    /// Where Redis's clock stands on `time`.
    pub(crate) clock: RedisClock,
    /// This process's instants (the system clock; a fake one in tests).
    pub(crate) time: Arc<dyn Clock>,
    /// Every input stream: the outbound ones, then the inbound ones.
    pub(crate) streams: Vec<Arc<str>>,
    /// The entries this worker holds, by stream (`held`).
    pub(crate) held: super::held::Held,
    pub(crate) rejected: OutputKeys,
    pub(crate) dead: OutputKeys,
    pub(crate) marker_ttl_ms: u64,
    /// One permit per event this process holds; the reader stops when they run out.
    pub(crate) permits: Arc<Semaphore>,
    /// What each route's sleeping events hold of the permits, and the entries parked until
    /// their routes have room (`share`).
    pub(crate) shares: Arc<super::share::Shares>,
    /// Whether Redis is a cluster (found when preparing): then one script may touch only keys of
    /// one slot, and acknowledging an input entry in the script that writes its output works only
    /// where the input stream shares the output's slot.
    pub(crate) cluster: AtomicBool,
    /// Redis's `maxmemory-policy` as last read (to log it when it changes).
    pub(crate) policy_seen: std::sync::Mutex<String>,
    /// Routes whose last schedule call found a key of the wrong type (by route index): the
    /// warning is logged when a route breaks, not for every batch dead-lettered while it is.
    pub(crate) broken_routes: std::sync::Mutex<std::collections::BTreeSet<usize>>,
    /// Kinds of call (`retry`'s op) waiting on a key of the wrong kind: said when the first
    /// call of a kind starts to wait, and when one succeeds again, not for every held batch.
    pub(crate) wrong_kind: std::sync::Mutex<std::collections::BTreeSet<&'static str>>,
    /// Each route's per-event series, by route index.
    pub(crate) route_metrics: Vec<telemetry::RouteMetrics>,
    /// The inbound rules as `admit.lua` takes them, made once (when there is an inbound flow).
    pub(crate) inbound_rules: Option<crate::scripts::ScriptRules>,
    /// The tasks deciding each inbound partition's entries, started before the first read.
    pub(crate) inbound_lanes: std::sync::OnceLock<super::inbound::Lanes>,
}

impl Context {
    /// With `redis.wait_replicas`, whether that many replicas hold everything `key`'s node held
    /// after the caller's last call (a fresh write to that node, then `WAIT` up to
    /// `wait_timeout`). Redis replicates asynchronously: a master that dies before its replicas
    /// have a write loses it, and an input entry acknowledged (in another slot) after its output
    /// was lost would be lost with it. So a shortfall is an error, never a shrug: the caller
    /// neither acknowledges nor sleeps on what it wrote, and repeats its call with backoff. Every
    /// such call is idempotent (recorded decisions, write-once outputs), and a repeat on a
    /// promoted replica that lacks the first write makes it again. While replicas lag, pacing
    /// stalls (counted in `pacer_replication_short_total`, /readyz false): that is what asking
    /// for replicas means, as `min-replicas-to-write` does in Redis itself.
    pub(crate) async fn replicated(&self, key: &str) -> Result<()> {
        let wanted = self.cfg.redis.wait_replicas;
        if wanted == 0 {
            return Ok(());
        }
        let mut con = self.waits.clone().unwrap_or_else(|| self.con.clone());
        let got = match con
            .wait_replicas(key, wanted, self.cfg.redis.wait_timeout)
            .await
        {
            Ok(got) => got,
            // Its write was taken a moment ago: a WAIT that times out behind others on its
            // connection is replicas not confirming in time, not Redis down (a Redis that is
            // down fails the next call, which says so).
            Err(e) if e.is_timeout() => 0,
            Err(e) => return Err(e.into()),
        };
        if got >= wanted {
            self.health.replicas_confirmed();
            return Ok(());
        }
        telemetry::replication_short();
        let short = Error::ReplicasShort {
            wanted,
            got,
            key: key.to_string(),
        };
        self.health.replicas_short(&short);
        Err(short)
    }

    /// Reports a failed call to health (`Health::call_failed` says which failures count).
    pub(crate) fn failed(&self, op: &str, e: &Error) {
        self.health.call_failed(op, e);
    }

    /// Whether one script may touch both keys: Redis is not a cluster, or they share a slot.
    pub(crate) fn same_slot(&self, a: &str, b: &str) -> bool {
        !self.cluster.load(Ordering::Relaxed) || keys::slot(a) == keys::slot(b)
    }

    /// Which dispatch call a key's route may share: one per slot in a cluster, one for all
    /// routes otherwise.
    pub(crate) fn call_slot(&self, key: &str) -> u16 {
        if self.cluster.load(Ordering::Relaxed) {
            keys::slot(key)
        } else {
            0
        }
    }

    /// Which input streams a script writing `output` (a key) may acknowledge entries of.
    pub(crate) fn acks_in_script(&self, output: &str) -> impl Fn(&str) -> bool + Sync + Send {
        let cluster = self.cluster.load(Ordering::Relaxed);
        let slot = keys::slot(output);
        move |stream: &str| !cluster || keys::slot(stream) == slot
    }

    /// What a pacing call on `route` needs (with `acks` from [`Context::acks_in_script`]).
    pub(crate) fn route_call<'a>(
        &'a self,
        route: &'a Route,
        acks: &'a (dyn Fn(&str) -> bool + Sync),
    ) -> RouteCall<'a> {
        RouteCall {
            name: &route.name,
            keys: &route.keys,
            bucket: &route.bucket,
            out: Writing {
                ttl_ms: self.marker_ttl_ms,
                max_len: self.cfg.outbound.flow.max_len,
                group: &self.cfg.worker.group,
                acks,
            },
        }
    }

    /// Runs `f` until it succeeds, backing off between failures; `None` if `stop` comes first.
    /// Safe because every step pacer takes in Redis is idempotent.
    pub(crate) async fn retry<T, F, Fut>(
        &self,
        op: &'static str,
        stop: &CancellationToken,
        f: F,
    ) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.retry_unless(op, stop, |_| false, f)
            .await
            .and_then(Result::ok)
    }

    /// As `retry`, but an error `hopeless` says retrying cannot fix is returned at once. It is
    /// the call's, not Redis's: it does not count against health (the rest of the worker's
    /// calls go on), and the caller says what became of the call's events.
    pub(crate) async fn retry_unless<T, F, Fut>(
        &self,
        op: &'static str,
        stop: &CancellationToken,
        hopeless: impl Fn(&Error) -> bool,
        mut f: F,
    ) -> Option<Result<T>>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut backoff = Backoff::default();
        // Whether Redis refused this call's writes: its success then shows that Redis takes
        // writes again. (A read, never refused, cannot say so: it goes on succeeding under
        // OOM. Every refused write is retried until it succeeds, so each refusal is ended by
        // the call that met it.)
        let mut refused = false;
        loop {
            match telemetry::timed(op, f()).await {
                Ok(v) => {
                    if refused {
                        self.health.wrote();
                    } else {
                        self.health.succeeded();
                    }
                    let mut waiting = self.wrong_kind.lock().expect("wrong kind");
                    if !waiting.is_empty() && waiting.remove(op) {
                        info!(
                            op,
                            "calls that waited on a key of the wrong kind succeed again"
                        );
                    }
                    return Some(Ok(v));
                }
                Err(e) if hopeless(&e) => return Some(Err(e)),
                Err(e) => {
                    // Health says the outage once; here only the detail, at debug.
                    refused |= e.refuses_writes();
                    self.failed(op, &e);
                    let delay = backoff.fail();
                    if backoff.failures() == 1
                        && e.is_wrong_type()
                        && self.wrong_kind.lock().expect("wrong kind").insert(op)
                    {
                        warn!(op, error = %e, "a key holds the wrong kind of value (an output stream written by something else?): holding what goes there, retrying with backoff until the key is deleted or fixed");
                    }
                    debug!(op, error = %e, failures = backoff.failures(), retry_in = ?delay, "Redis call failed");
                    tokio::select! {
                        _ = stop.cancelled() => return None,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }
}
