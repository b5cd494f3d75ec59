//! A `ConnectionManager` made anew when its connection stops answering without closing.
//!
//! redis-rs's `ConnectionManager` reconnects when a command fails in a way that says the
//! connection is gone (dropped, reset, refused). A connection whose peer vanished without a word
//! (a NAT or conntrack entry dropped, a proxy or load balancer holding it, a host gone without a
//! reset) gives only timeouts, and those it retries on the same socket until the kernel gives up
//! on it (about 15 minutes with Linux's defaults). Found by review: a worker behind a black-holed
//! connection stayed not ready for over a minute while new connections to the same address
//! worked. So after `STUCK_AFTER` timeouts in a row on one connection, with no answer between,
//! the manager is replaced by a new one; the old one closes once the last call holding it ends.
//!
//! A Redis that is merely slow (a long script, `DEBUG SLEEP`) gets a new connection too, at most
//! one per `STUCK_AFTER` timeouts: harmless, as every call pacer makes may be sent again.

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Cmd, Pipeline, RedisError, RedisResult, Value};
use std::sync::{Arc, Mutex};
use tracing::{info, warn};

/// Timeouts in a row on one connection, with no answer between, after which it is replaced.
pub(crate) const STUCK_AFTER: u32 = 2;

#[derive(Clone)]
pub(crate) struct Renewing {
    shared: Arc<Shared>,
}

struct Shared {
    client: Client,
    config: ConnectionManagerConfig,
    /// For the log: which Redis this connects to.
    target: String,
    current: Mutex<Current>,
}

struct Current {
    con: ConnectionManager,
    /// Counts the managers made: a call's outcome counts only against the one it used, so that
    /// calls still out on a replaced connection do not count against the new one.
    generation: u64,
    timeouts: u32,
}

impl Renewing {
    /// Builds the first manager without connecting (the first command connects).
    pub(crate) fn new(
        client: Client,
        config: ConnectionManagerConfig,
        target: String,
    ) -> RedisResult<Self> {
        let con = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())?;
        Ok(Renewing {
            shared: Arc::new(Shared {
                client,
                config,
                target,
                current: Mutex::new(Current {
                    con,
                    generation: 0,
                    timeouts: 0,
                }),
            }),
        })
    }

    fn take(&self) -> (ConnectionManager, u64) {
        let c = self.shared.current.lock().expect("not poisoned");
        (c.con.clone(), c.generation)
    }

    pub(crate) async fn req_command(&self, cmd: &Cmd) -> RedisResult<Value> {
        let (mut con, generation) = self.take();
        let result = con.req_packed_command(cmd).await;
        self.observe(generation, result.as_ref().err());
        result
    }

    pub(crate) async fn req_pipeline(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let (mut con, generation) = self.take();
        let result = con.req_packed_commands(pipeline, offset, count).await;
        self.observe(generation, result.as_ref().err());
        result
    }

    /// An answer (an error reply is one) clears the count; a timeout adds to it, and the
    /// `STUCK_AFTER`th makes a new manager.
    fn observe(&self, generation: u64, error: Option<&RedisError>) {
        let timed_out = error.is_some_and(RedisError::is_timeout);
        if error.is_some() && !timed_out {
            // Dropped, refused...: redis-rs reconnects by itself.
            return;
        }
        let mut c = self.shared.current.lock().expect("not poisoned");
        if c.generation != generation {
            return;
        }
        if !timed_out {
            c.timeouts = 0;
            return;
        }
        c.timeouts += 1;
        if c.timeouts < STUCK_AFTER {
            return;
        }
        match ConnectionManager::new_lazy_with_config(
            self.shared.client.clone(),
            self.shared.config.clone(),
        ) {
            Ok(con) => {
                c.con = con;
                c.generation += 1;
                c.timeouts = 0;
                info!(redis = %self.shared.target, timeouts = STUCK_AFTER, "calls on a Redis connection time out in a row: opening a new one (the old one may be black-holed)");
            }
            // Building a lazy manager does not connect; it fails only on a bad client setup,
            // which the first manager would have failed on too. Keep the old one.
            Err(e) => {
                warn!(redis = %self.shared.target, error = %e, "could not open a new Redis connection")
            }
        }
    }
}
