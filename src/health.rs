//! Whether a worker can do its work (`/readyz`), and what it says about Redis trouble in its log.
//!
//! Ready means every one of these holds: Redis answered the last call and took the last write
//! it was given (a Redis out of memory answers reads and refuses writes), the scripts are loaded,
//! every consumer group exists, and Redis keeps pacer's keys (its `maxmemory-policy` evicts
//! nothing, or the operator acknowledged that it may). An outage is logged once when calls start
//! failing and once when they answer again, whatever the number of calls, tasks and events in
//! between: the per-call detail goes to debug.

use crate::error::Error;
use metrics::gauge;
use std::fmt::Display;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use tracing::{info, warn};

/// `pacer_ready`: 1 when `/readyz` says ready.
pub const READY: &str = "pacer_ready";

#[derive(Debug, Default)]
pub struct Health {
    redis_ok: AtomicBool,
    scripts_loaded: AtomicBool,
    groups_ok: AtomicBool,
    keys_kept: AtomicBool,
    /// When the current outage began (None while Redis answers).
    down_since: Mutex<Option<Instant>>,
    failures: AtomicU64,
    /// Redis answers but refuses pacer's writes (out of memory, failing to persist, short of
    /// replicas): only a write that succeeds ends it, not the reads that go on succeeding.
    refused_since: Mutex<Option<Instant>>,
    refusals: AtomicU64,
}

impl Health {
    /// A Redis call succeeded.
    pub fn succeeded(&self) {
        if !self.redis_ok.swap(true, Ordering::Relaxed) {
            let since = self.down_since.lock().expect("health lock").take();
            let failed = self.failures.swap(0, Ordering::Relaxed);
            if let Some(since) = since {
                info!(
                    after = ?since.elapsed(),
                    failed_calls = failed,
                    "Redis answers again; work resumes"
                );
            }
            self.publish();
        }
    }

    /// A Redis call (`op`) failed with `error`.
    pub fn failed(&self, op: &str, error: &dyn Display) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        let mut since = self.down_since.lock().expect("health lock");
        if since.is_none() {
            *since = Some(Instant::now());
            warn!(op, %error, "Redis calls are failing; retrying with backoff until it answers");
        }
        drop(since);
        if self.redis_ok.swap(false, Ordering::Relaxed) {
            self.publish();
        }
    }

    /// A call that writes was refused by a Redis that answers (`error`): said once, and not
    /// ready until a write succeeds. Reads succeeding in between (they go on under OOM) would
    /// otherwise flip readiness and the log with every other call.
    pub fn refused(&self, op: &str, error: &dyn Display) {
        self.refusals.fetch_add(1, Ordering::Relaxed);
        let mut since = self.refused_since.lock().expect("health lock");
        if since.is_none() {
            *since = Some(Instant::now());
            drop(since);
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
        } else if !matches!(e, Error::ReplicasShort { .. }) && !e.is_wrong_type() {
            self.failed(op, e);
        }
    }

    /// A call that writes succeeded: Redis answers, and takes writes.
    pub fn wrote(&self) {
        self.succeeded();
        let since = self.refused_since.lock().expect("health lock").take();
        if let Some(since) = since {
            let refused = self.refusals.swap(0, Ordering::Relaxed);
            info!(
                after = ?since.elapsed(),
                refused_calls = refused,
                "Redis takes writes again; work resumes"
            );
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
        } else if self.refused_since.lock().expect("health lock").is_some() {
            Some("Redis refuses writes (out of memory, failing to persist, or short of replicas: see the log)")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_needs_every_part() {
        let h = Health::default();
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
    fn refused_writes_end_with_a_write_not_a_read() {
        let h = Health::default();
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
}
