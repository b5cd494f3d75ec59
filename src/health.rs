//! Whether a worker can do its work (`/readyz`), and what it says about Redis trouble in its log.
//!
//! Ready means every one of these holds: Redis answered the last call and took the last write
//! it was given (a Redis out of memory answers reads and refuses writes), the synchronous API's
//! last call (on its own connection) did not fail, the scripts are loaded,
//! every consumer group exists, and Redis keeps pacer's keys (its `maxmemory-policy` evicts
//! nothing, or the operator acknowledged that it may). An outage is logged once when calls start
//! failing and once when they answer again, whatever the number of calls, tasks and events in
//! between: the per-call detail goes to debug.

use crate::error::Error;
use metrics::gauge;
use std::fmt::Display;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// `pacer_ready`: 1 when `/readyz` says ready.
pub const READY: &str = "pacer_ready";

/// How long calls must go on without a failure before an outage counts as over: a backoff's
/// ceiling and some. A call that keeps failing (one cluster shard down, say) while the others
/// succeed used to end and begin an outage on every retry: a warning and an "answers again"
/// every second or two, and /readyz flipping with them (found by review).
pub const SETTLE: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub struct Health {
    /// `SETTLE`, or another span (tests).
    settle: Duration,
    /// When a call last failed (the outage's end waits `settle` past it).
    last_failure: Mutex<Option<Instant>>,
    redis_ok: AtomicBool,
    scripts_loaded: AtomicBool,
    groups_ok: AtomicBool,
    keys_kept: AtomicBool,
    /// The worker's calls failing (None while Redis answers).
    outage: Streak,
    /// Redis answers but refuses pacer's writes (out of memory, failing to persist, short of
    /// replicas): only a write that succeeds ends it, not the reads that go on succeeding.
    refusal: Streak,
    /// Writes held because fewer replicas than `redis.wait_replicas` confirmed them: only a
    /// confirmation ends it (the calls themselves succeed meanwhile, and would end any other
    /// streak with every call).
    replicas: Streak,
    /// The synchronous API's calls failing, on a connection of their own: followed apart from
    /// the worker's, or a broken API connection beside a healthy stream flow would flip
    /// readiness and the log with each call of either.
    api_outage: Streak,
}

/// A run of failures, said once when it begins and once when it ends.
#[derive(Debug, Default)]
struct Streak {
    since: Mutex<Option<Instant>>,
    count: AtomicU64,
}

impl Streak {
    /// One more failure: whether it begins the streak.
    fn add(&self) -> bool {
        self.count.fetch_add(1, Ordering::Relaxed);
        let mut since = self.since.lock().expect("health lock");
        let begins = since.is_none();
        if begins {
            *since = Some(Instant::now());
        }
        begins
    }

    /// Ends the streak, if one is on, saying `message` with how long it lasted and how many
    /// failed calls it held; whether one was on.
    fn end(&self, message: &str) -> bool {
        let Some(since) = self.since.lock().expect("health lock").take() else {
            return false;
        };
        let calls = self.count.swap(0, Ordering::Relaxed);
        info!(after = ?since.elapsed(), failed_calls = calls, "{message}");
        true
    }

    fn on(&self) -> bool {
        self.since.lock().expect("health lock").is_some()
    }
}

impl Default for Health {
    fn default() -> Self {
        Health::with_settle(SETTLE)
    }
}

impl Health {
    /// Health whose outages end `settle` after their last failed call.
    pub fn with_settle(settle: Duration) -> Self {
        Health {
            settle,
            last_failure: Mutex::new(None),
            redis_ok: AtomicBool::new(false),
            scripts_loaded: AtomicBool::new(false),
            groups_ok: AtomicBool::new(false),
            keys_kept: AtomicBool::new(false),
            outage: Streak::default(),
            refusal: Streak::default(),
            replicas: Streak::default(),
            api_outage: Streak::default(),
        }
    }

    /// A Redis call succeeded: an outage is over once none has failed for `settle`.
    pub fn succeeded(&self) {
        if self.redis_ok.load(Ordering::Relaxed) {
            return;
        }
        let last = *self.last_failure.lock().expect("health lock");
        if last.is_some_and(|t| t.elapsed() < self.settle) {
            return;
        }
        if !self.redis_ok.swap(true, Ordering::Relaxed) {
            self.outage.end("Redis answers again; work resumes");
            self.publish();
        }
    }

    /// A Redis call (`op`) failed with `error`.
    pub fn failed(&self, op: &str, error: &dyn Display) {
        *self.last_failure.lock().expect("health lock") = Some(Instant::now());
        if self.outage.add() {
            warn!(op, %error, "Redis calls are failing; retrying with backoff until it answers");
        }
        if self.redis_ok.swap(false, Ordering::Relaxed) {
            self.publish();
        }
    }

    /// A call that writes was refused by a Redis that answers (`error`): said once, and not
    /// ready until a write succeeds. Reads succeeding in between (they go on under OOM) would
    /// otherwise flip readiness and the log with every other call.
    pub fn refused(&self, op: &str, error: &dyn Display) {
        if self.refusal.add() {
            warn!(op, %error, "Redis refuses pacer's writes; retrying with backoff until it takes them");
            self.publish();
        }
    }

    /// A call (`op`) failed with `e`: a write Redis refused (out of memory...) is a refusal,
    /// which only a write that succeeds ends. Replicas lagging behind `wait_replicas` and a key
    /// holding the wrong kind of value are not health's: Redis answers then, and other calls
    /// succeed meanwhile, so health would flip between failing and answering on every call.
    /// Those are counted (`pacer_replication_short_total`, `pacer_redis_errors_total`) and
    /// logged once per streak by the caller instead.
    pub fn call_failed(&self, op: &str, e: &Error) {
        if e.refuses_writes() {
            self.refused(op, e);
        } else if says_redis_is_down(e) {
            self.failed(op, e);
        }
    }

    /// Fewer replicas than `redis.wait_replicas` confirmed a write (`error`): not ready until
    /// enough do. Said once per stall, here, whichever calls meet it (each route's placing and
    /// dispatching, admissions, outputs: until 2026-11-29 each kind of call said it, two lines
    /// or more a stall, `a_frozen_replica_stalls_the_route_counted_and_logged_once_per_stall_losing_nothing`).
    pub fn replicas_short(&self, error: &dyn Display) {
        if self.replicas.add() {
            warn!(%error, "fewer replicas than redis.wait_replicas confirm pacer's writes: holding them (nothing acknowledged or slept on), retrying with backoff until they do");
            self.publish();
        }
    }

    /// Enough replicas confirmed a write.
    pub fn replicas_confirmed(&self) {
        if self
            .replicas
            .end("the replicas confirm pacer's writes again; work resumes")
        {
            self.publish();
        }
    }

    /// A call of the synchronous API succeeded.
    pub fn api_succeeded(&self) {
        if self.api_outage.end("the API's Redis calls answer again") {
            self.publish();
        }
    }

    /// Whether the synchronous API's calls are failing (its connection is probed meanwhile).
    pub fn api_outage_on(&self) -> bool {
        self.api_outage.on()
    }

    /// Whether Redis refuses pacer's writes (until one succeeds).
    pub fn refusing_writes(&self) -> bool {
        self.refusal.on()
    }

    /// A call of the synchronous API failed with `e`: a refused write is the worker's refusal
    /// (Redis's state, whoever met it); any other failure is the API's own, said once per
    /// streak, while its requests get `fail_policy`'s answer.
    pub fn api_failed(&self, e: &Error) {
        if e.refuses_writes() {
            self.refused("decide", e);
        } else if says_redis_is_down(e) && self.api_outage.add() {
            warn!(error = %e, "the API's Redis calls are failing; its requests get fail_policy's answer until Redis answers");
            self.publish();
        }
    }

    /// A call that writes succeeded: Redis answers, and takes writes.
    pub fn wrote(&self) {
        self.succeeded();
        self.writes_taken();
    }

    /// A write succeeded (on whichever connection): Redis takes writes, if it refused them.
    pub fn writes_taken(&self) {
        if self.refusal.end("Redis takes writes again; work resumes") {
            self.publish();
        }
    }

    /// Scripts loaded (after a restart of Redis, until they are loaded again: not ready).
    pub fn set_scripts_loaded(&self, ok: bool) {
        self.scripts_loaded.store(ok, Ordering::Relaxed);
        self.publish();
    }

    /// Every consumer group exists on every input stream.
    pub fn set_groups_ok(&self, ok: bool) {
        if self.groups_ok.swap(ok, Ordering::Relaxed) != ok {
            self.publish();
        }
    }

    /// Redis keeps pacer's keys: it evicts nothing, or the operator acknowledged that it may.
    pub fn set_keys_kept(&self, ok: bool) {
        if self.keys_kept.swap(ok, Ordering::Relaxed) != ok {
            self.publish();
        }
    }

    pub fn ready(&self) -> bool {
        self.why_not().is_none()
    }

    /// What keeps the worker from being ready, if anything (the `/readyz` body).
    pub fn why_not(&self) -> Option<&'static str> {
        if !self.redis_ok.load(Ordering::Relaxed) {
            Some("Redis does not answer")
        } else if self.api_outage.on() {
            Some("Redis does not answer the API's calls")
        } else if self.refusal.on() {
            Some("Redis refuses writes (out of memory, failing to persist, or short of replicas: see the log)")
        } else if self.replicas.on() {
            Some("fewer replicas than redis.wait_replicas confirm pacer's writes (see the log)")
        } else if !self.scripts_loaded.load(Ordering::Relaxed) {
            Some("the scripts are not loaded yet")
        } else if !self.groups_ok.load(Ordering::Relaxed) {
            Some("a consumer group is missing (being created again)")
        } else if !self.keys_kept.load(Ordering::Relaxed) {
            Some("Redis may evict keys (maxmemory-policy is not noeviction; see the log)")
        } else {
            None
        }
    }

    fn publish(&self) {
        gauge!(READY).set(if self.ready() { 1.0 } else { 0.0 });
    }
}

/// Whether a failed call says Redis does not answer: not replicas short of `wait_replicas`, nor
/// a key of the wrong kind (see `Health::call_failed`).
fn says_redis_is_down(e: &Error) -> bool {
    !matches!(e, Error::ReplicasShort { .. }) && !e.is_wrong_type()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_needs_every_part() {
        let h = Health::with_settle(Duration::ZERO);
        assert_eq!(h.why_not(), Some("Redis does not answer"));
        h.succeeded();
        h.set_scripts_loaded(true);
        h.set_groups_ok(true);
        assert!(!h.ready(), "keys kept is unknown yet");
        h.set_keys_kept(true);
        assert!(h.ready());
        h.failed("read", &"connection refused");
        assert!(!h.ready());
        h.succeeded();
        assert!(h.ready());
        h.set_groups_ok(false);
        assert!(h.why_not().unwrap().contains("group"));
    }

    #[test]
    fn an_outage_ends_only_once_calls_go_a_while_without_failing() {
        let h = Health::with_settle(Duration::from_millis(200));
        h.succeeded();
        h.set_scripts_loaded(true);
        h.set_groups_ok(true);
        h.set_keys_kept(true);
        assert!(h.ready());
        // One call keeps failing between others that succeed (a cluster shard down): one
        // outage holding every failure, not one outage per retry.
        for _ in 0..3 {
            h.failed("schedule", &"timed out");
            h.succeeded();
            assert!(!h.ready());
        }
        assert_eq!(h.outage.count.load(Ordering::Relaxed), 3);
        std::thread::sleep(Duration::from_millis(250));
        h.succeeded();
        assert!(h.ready());
        assert_eq!(h.outage.count.load(Ordering::Relaxed), 0, "ended once");
    }

    #[test]
    fn replicas_short_hold_readiness_until_they_confirm_whatever_else_succeeds() {
        let h = Health::with_settle(Duration::ZERO);
        h.succeeded();
        h.set_scripts_loaded(true);
        h.set_groups_ok(true);
        h.set_keys_kept(true);
        h.replicas_short(&"0 of 1 replicas");
        assert!(h.why_not().unwrap().contains("wait_replicas"));
        // The calls succeed meanwhile (their writes are made, only not confirmed).
        h.wrote();
        h.succeeded();
        assert!(
            !h.ready(),
            "was 200 while every write was held (found by review)"
        );
        h.replicas_confirmed();
        assert!(h.ready());
    }

    #[test]
    fn refused_writes_end_with_a_write_not_a_read() {
        let h = Health::with_settle(Duration::ZERO);
        h.succeeded();
        h.set_scripts_loaded(true);
        h.set_groups_ok(true);
        h.set_keys_kept(true);
        h.refused("schedule", &"OOM command not allowed");
        assert!(h.why_not().unwrap().contains("refuses writes"));
        h.succeeded();
        assert!(!h.ready(), "a read does not show that writes are taken");
        h.wrote();
        assert!(h.ready());
    }

    #[test]
    fn the_apis_failures_are_its_own_and_the_workers_calls_do_not_end_them() {
        let h = Health::with_settle(Duration::ZERO);
        h.succeeded();
        h.set_scripts_loaded(true);
        h.set_groups_ok(true);
        h.set_keys_kept(true);
        let dropped = Error::Redis(redis::RedisError::from(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        h.api_failed(&dropped);
        assert_eq!(h.why_not(), Some("Redis does not answer the API's calls"));
        h.succeeded();
        h.wrote();
        assert!(
            !h.ready(),
            "the worker's calls say nothing of the API's connection"
        );
        h.api_failed(&dropped);
        assert_eq!(h.api_outage.count.load(Ordering::Relaxed), 2);
        h.api_succeeded();
        assert!(h.ready());
        assert_eq!(h.api_outage.count.load(Ordering::Relaxed), 0);
        // Redis refusing writes is Redis's state: met by the API, ended by any write taken.
        let oom = Error::Redis(redis::make_extension_error(
            "OOM".into(),
            Some("command not allowed when used memory > 'maxmemory'".into()),
        ));
        h.api_failed(&oom);
        assert!(h.why_not().unwrap().contains("refuses writes"));
        h.api_succeeded();
        assert!(!h.ready(), "a call that wrote nothing does not end it");
        h.writes_taken();
        assert!(h.ready());
    }
}
