//! Coalescing: the synchronous requests a worker has in hand at once go to Redis in one
//! `decide.lua` call (per partition, whose keys share a slot), instead of one call each. A lone
//! request waits for nothing: a batch is whatever queued while the calls before it were in
//! flight, so batches grow with load and a quiet worker sends batches of one.

use crate::admission::{Ask, SyncVerdict};
use crate::config::InboundRule;
use crate::connection::RedisConn;
use crate::error::Error;
use crate::health::Health;
use crate::scripts::{DecideCheck, DecideRequest, ScriptRules, Scripts, LOG_ENTRIES_PER_READ};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Semaphore};

/// One request's checks: (rule index, key field index, limiter key, what is asked).
pub type Checks = Vec<(usize, usize, String, Ask)>;

struct Job {
    partition: usize,
    checks: Checks,
    cost: i64,
    reply: oneshot::Sender<Result<SyncVerdict, String>>,
    queued: Instant,
}

/// Most requests in one call.
const MAX_BATCH: usize = 256;
/// Batches in flight at once per worker: while they are, requests queue into the next one.
/// Measured with `cargo bench --bench sync` (unleased, 8 clients per worker): 4 in flight gave
/// batches of 1.5 and 31 µs of Redis CPU per decision, 2 gave 26 µs and 1 gave 19 µs at a
/// little more throughput; 2 keeps one slow call from holding up every request of the worker.
const IN_FLIGHT: usize = 2;

/// Sends requests to Redis in batches; cheap to clone.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::UnboundedSender<Job>,
}

impl Batcher {
    /// Starts the batching task (it ends when every `Batcher` clone is dropped); its calls'
    /// failures and successes go to `health`, apart from the stream flow's. A request still
    /// queued `deadline` after it came is answered unavailable without being sent: a Redis
    /// that stalls would otherwise be sent every request that came meanwhile, queued without
    /// bound (p50 5.5 s with a 1 s timeout, found by review).
    pub fn start(
        rules: Vec<InboundRule>,
        con: RedisConn,
        deadline: Duration,
        health: Arc<Health>,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(probe(con.clone(), health.clone(), tx.downgrade()));
        tokio::spawn(run(rx, Arc::new(rules), con, deadline, health));
        Batcher { tx }
    }

    /// Decides one request (in partition `partition`) with whatever else is waiting.
    pub async fn decide(
        &self,
        partition: usize,
        checks: Checks,
        cost: i64,
    ) -> Result<SyncVerdict, String> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            partition,
            checks,
            cost,
            reply,
            queued: Instant::now(),
        };
        self.tx.send(job).map_err(|_| "shutting down".to_string())?;
        answer
            .await
            .map_err(|_| "the batch was dropped".to_string())?
    }
}

/// While the API's calls fail, asks Redis every `PROBE_EVERY` on the API's connection whether
/// it answers, and ends the outage when it does; while Redis refuses writes, writes a key that
/// expires on its own, and ends the refusal when that is taken. Only a request's call ended
/// either, and /readyz said 503 until a request came: behind a Kubernetes Service, none comes to
/// a pod that is not ready, so a Redis blip left every replica out for good (found by review).
/// (On a cluster the write lands on one master: the refusal ends when that one takes writes.)
/// Ends with the batcher.
async fn probe(mut con: RedisConn, health: Arc<Health>, batcher: mpsc::WeakUnboundedSender<Job>) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if batcher.upgrade().is_none() {
            return;
        }
        if health.api_outage_on() {
            match redis::cmd("PING").query_async::<()>(&mut con).await {
                Ok(()) => health.api_succeeded(),
                Err(e) => health.api_failed(&e.into()),
            }
        }
        if health.refusing_writes() {
            let wrote: redis::RedisResult<()> = redis::cmd("SET")
                .arg(crate::keys::api_probe())
                .arg(1)
                .arg("PX")
                .arg(PROBE_EVERY.as_millis() as u64 * 10)
                .query_async(&mut con)
                .await;
            match wrote {
                Ok(()) => health.writes_taken(),
                Err(e) => health.api_failed(&e.into()),
            }
        }
    }
}

/// How often `probe` asks.
const PROBE_EVERY: Duration = Duration::from_secs(1);

async fn run(
    mut rx: mpsc::UnboundedReceiver<Job>,
    rules: Arc<Vec<InboundRule>>,
    con: RedisConn,
    deadline: Duration,
    health: Arc<Health>,
) {
    let scripts = Arc::new(Scripts::default());
    let rules = Arc::new(ScriptRules::new(&rules, LOG_ENTRIES_PER_READ));
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = rx.recv().await else {
            return;
        };
        let mut jobs = Vec::new();
        let mut next = Some(first);
        while let Some(job) = next.take() {
            if job.reply.is_closed() {
                // Its caller is gone (the client hung up, or gave up): not charged for an
                // answer no one reads (after a stall, a backlog of them burned the quota).
            } else if job.queued.elapsed() > deadline {
                let _ = job.reply.send(Err(format!(
                    "no Redis call could be made for it within redis.timeout ({deadline:?})"
                )));
            } else {
                jobs.push(job);
            }
            if jobs.len() < MAX_BATCH {
                next = rx.try_recv().ok();
            }
        }
        if jobs.is_empty() {
            continue;
        }
        let (rules, scripts, con) = (rules.clone(), scripts.clone(), con.clone());
        let health = health.clone();
        tokio::spawn(async move {
            let mut by_partition: BTreeMap<usize, Vec<Job>> = BTreeMap::new();
            for j in jobs {
                by_partition.entry(j.partition).or_default().push(j);
            }
            // Partitions lie in different slots, often on different masters: in parallel.
            let calls = by_partition.into_values().map(|jobs| {
                let mut con = con.clone();
                let (scripts, rules, health) = (scripts.clone(), rules.clone(), health.clone());
                async move { call(&scripts, &mut con, &rules, &health, jobs).await }
            });
            futures_util::future::join_all(calls).await;
            drop(permit);
        });
    }
}

async fn call(
    scripts: &Scripts,
    con: &mut RedisConn,
    rules: &ScriptRules,
    health: &Health,
    jobs: Vec<Job>,
) {
    let requests: Vec<DecideRequest<'_>> = jobs
        .iter()
        .map(|j| DecideRequest {
            checks: j
                .checks
                .iter()
                .map(|(rule, field, key, ask)| DecideCheck {
                    rule: *rule,
                    field: *field,
                    key,
                    ask: *ask,
                })
                .collect(),
            cost: j.cost,
        })
        .collect();
    let mut reply = crate::telemetry::timed("decide", scripts.decide(con, rules, &requests)).await;
    // Redis (its `timeout`) or a proxy closes a connection that sat idle; the first call on it
    // then fails, unsent, and the connection is made anew. Asked once more rather than answered
    // 503 (or let through unchecked): a call that did run before its reply was lost charges its
    // requests twice, which can refuse but never admit past a limit.
    if matches!(&reply, Err(Error::Redis(e)) if e.is_connection_dropped()) {
        reply = crate::telemetry::timed("decide", scripts.decide(con, rules, &requests)).await;
    }
    drop(requests);
    match reply {
        Ok((_, verdicts)) => {
            // A Redis out of memory still runs a call that writes nothing (every request
            // refused): only an admission, which charges its limits, shows writes are taken.
            health.api_succeeded();
            if verdicts.iter().any(|v| v.accepted) {
                health.writes_taken();
            }
            for (job, v) in jobs.into_iter().zip(verdicts) {
                let _ = job.reply.send(Ok(v));
            }
        }
        Err(e) => {
            health.api_failed(&e);
            let e = e.to_string();
            for job in jobs {
                let _ = job.reply.send(Err(e.clone()));
            }
        }
    }
}
