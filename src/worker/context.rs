//! What every task of one worker process shares, and the one loop that retries a Redis step.

use crate::backoff::Backoff;
use crate::clock::{Clock, RedisClock};
use crate::config::{Config, Route};
use crate::connection::RedisConn;
use crate::error::Result;
use crate::health::Health;
use crate::keys::{self, OutputKeys};
use crate::scripts::{RouteCall, Scripts, Writing};
use crate::telemetry;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::debug;

pub(crate) struct Context {
    pub(crate) cfg: Config,
    pub(crate) consumer: String,
    pub(crate) scripts: Scripts,
    pub(crate) con: RedisConn,
    pub(crate) health: Arc<Health>,
    /// Where Redis's clock stands on `time`.
    pub(crate) clock: RedisClock,
    /// This process's instants (the system clock; a fake one in tests).
    pub(crate) time: Arc<dyn Clock>,
    /// Every input stream: the outbound ones, then the inbound ones.
    pub(crate) streams: Vec<Arc<str>>,
    pub(crate) rejected: OutputKeys,
    pub(crate) dead: OutputKeys,
    pub(crate) marker_ttl_ms: u64,
    /// One permit per event this process holds; the reader stops when they run out.
    pub(crate) permits: Arc<Semaphore>,
    /// Whether the admission script writes inbound rejections itself (the rejected stream
    /// shares the forward stream's slot, or Redis is not a cluster); found when preparing.
    pub(crate) rejects_in_admission: AtomicBool,
    /// Whether Redis is a cluster (found when preparing): then one script may touch only keys of
    /// one slot, and acknowledging an input entry in the script that writes its output works only
    /// where the input stream shares the output's slot.
    pub(crate) cluster: AtomicBool,
    /// Redis's `maxmemory-policy` as last read (to log it when it changes).
    pub(crate) policy_seen: std::sync::Mutex<String>,
}

impl Context {
    /// With `redis.wait_replicas`, waits until that many replicas hold what the last call wrote
    /// on `key`'s node (`WAIT`), before the worker goes on to acknowledge or sleep on it. Redis
    /// replicates asynchronously: a master that dies before its replicas have a write loses it,
    /// and an input entry acknowledged in another slot while its output is lost would be lost.
    /// Tried three times; if the replicas still lag, the worker goes on (counted in
    /// `pacer_replication_short_total`), since holding every entry for a replica that is gone
    /// would stop pacing altogether.
    pub(crate) async fn replicated(&self, key: &str) {
        let wanted = self.cfg.redis.wait_replicas;
        if wanted == 0 {
            return;
        }
        let mut con = self.con.clone();
        for _ in 0..3 {
            match con
                .wait_replicas(key, wanted, self.cfg.redis.wait_timeout)
                .await
            {
                Ok(n) if n >= wanted => return,
                Ok(_) => {}
                Err(e) => {
                    self.health.failed("wait", &e);
                    return;
                }
            }
        }
        telemetry::replication_short();
        debug!(
            key,
            wanted, "replicas did not confirm the last writes in time"
        );
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
        mut f: F,
    ) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut backoff = Backoff::default();
        loop {
            match telemetry::timed(op, f()).await {
                Ok(v) => {
                    self.health.succeeded();
                    return Some(v);
                }
                Err(e) => {
                    // Health says the outage once; here only the detail, at debug.
                    self.health.failed(op, &e);
                    let delay = backoff.fail();
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
