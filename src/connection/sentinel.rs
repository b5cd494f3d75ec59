//! A connection to the master a set of Redis Sentinels names, that follows a failover.
//!
//! redis-rs's `SentinelClient` finds the master (it asks the sentinels, then checks with `ROLE`
//! that the node really is a master) and hands back a client for it; it does not notice when
//! the master changes. So the master's `ConnectionManager` is kept here with the address it was
//! built for, and marked stale when a command fails in a way a failover explains: the connection
//! dropped or was refused, a timeout, or `READONLY` (the node was demoted to a replica). The next
//! command asks the sentinels again and, if the master moved, switches to a connection to the
//! new one; the failed command itself is returned to the caller, whose retry lands on the new
//! master. Asking is rate-limited, and while the sentinels cannot be asked the last connection
//! is kept, so a sentinel outage alone does not stop traffic to a healthy master.
//!
//! A planned failover (`SENTINEL FAILOVER`) gives no such error: the old master keeps
//! answering, as a master, until the sentinels convert it to a replica several seconds later
//! (and writes it took meanwhile are lost then). So a background task also asks the sentinels
//! every `RECHECK_EVERY`, and each connection switches at its next command once they name
//! another master. That task is one per process for one master name and set of sentinels
//! (`Watch`), shared by every connection to it: one per connection (each input stream's reader
//! has its own) made 326 connections in 10 s with 10 streams, each a TLS handshake under TLS,
//! since redis-rs checks the master's ROLE on a connection of its own at every lookup.

use super::renewing::Renewing;
use crate::config::{RedisConfig, SentinelConfig};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    Cmd, ConnectionInfo, ErrorKind, Pipeline, RedisError, RedisResult, ServerErrorKind,
    TlsCertificates, TlsMode, Value,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// The sentinels are asked at most this often while the master is suspect: during a failover
/// every command fails until the replica is promoted, and each need not cost a lookup.
const RESOLVE_EVERY: Duration = Duration::from_millis(200);

/// How often the sentinels are asked anyway (one `SENTINEL MASTERS` on a kept connection and a
/// short connection to the master for `ROLE`), to notice a failover that raised no error.
const RECHECK_EVERY: Duration = Duration::from_secs(1);

/// What `blame` says, naming the settings to fix.
const SENTINELS_REFUSED: &str = "the sentinels refused their credentials: redis.sentinel.username and redis.sentinel.password_file (or PACER_REDIS_SENTINEL_PASSWORD)";
const MASTER_REFUSED: &str = "the sentinels took their credentials, the master they name refused its own: redis.username and redis.password_file (or the URLs' user and password, or PACER_REDIS_PASSWORD)";

#[derive(Clone)]
pub(super) struct SentinelConn {
    shared: Arc<Shared>,
}

struct Shared {
    /// Lookups are serialised: one at a time asks the sentinels, the others wait and use its
    /// answer.
    client: tokio::sync::Mutex<SentinelClient>,
    /// Each sentinel alone, with the sentinels' own credentials: to tell whose credentials a
    /// lookup's authentication error is about (`blame`).
    sentinels: Vec<redis::Client>,
    /// What the process's watcher last heard from the sentinels.
    watch: Arc<Watch>,
    state: Mutex<State>,
    connect_timeout: Duration,
    response_timeout: Duration,
    master_name: String,
}

#[derive(Default)]
struct State {
    current: Option<Master>,
    /// A command failed the way a failover explains: ask the sentinels before the next one.
    stale: bool,
    last_lookup: Option<Instant>,
    /// A failed lookup was logged since the last good one: a failover makes many in a row.
    warned: bool,
    /// The watch's `seq` when this connection last took its master from it or looked one up
    /// itself: only a later change of the watch's is followed (an earlier one may be older
    /// than what this connection found on its own).
    seen: u64,
}

/// The master the sentinels last named to the process's watcher (`watch`), and how many
/// changes of it the watcher has seen.
#[derive(Default)]
struct Watch {
    named: Mutex<(u64, Option<(String, redis::Client)>)>,
}

impl Watch {
    fn seq(&self) -> u64 {
        self.named.lock().expect("not poisoned").0
    }

    /// The master named after `seen`, with the change's number, if there was a change.
    fn named_after(&self, seen: u64) -> Option<(u64, String, redis::Client)> {
        let named = self.named.lock().expect("not poisoned");
        match &named.1 {
            Some((addr, client)) if named.0 > seen => Some((named.0, addr.clone(), client.clone())),
            _ => None,
        }
    }

    fn heard(&self, addr: String, client: redis::Client) {
        let mut named = self.named.lock().expect("not poisoned");
        if named.1.as_ref().is_none_or(|(a, _)| *a != addr) {
            named.0 += 1;
            named.1 = Some((addr, client));
        }
    }
}

/// The process's watches, by master name, sentinels and what the master is reached with.
static WATCHES: Mutex<Option<HashMap<String, Weak<Watch>>>> = Mutex::new(None);

#[derive(Clone)]
struct Master {
    /// `host:port`, to tell a real switch from a lookup naming the same master again.
    addr: String,
    /// Made anew in place when it times out in a row (black-holed): the sentinels naming the
    /// same master again would keep it.
    con: Renewing,
}

impl SentinelConn {
    /// `sentinels` are the URLs' connection infos (the sentinels' own credentials applied);
    /// the master gets `cfg.username`/`cfg.password`, database `db` and the TLS material.
    pub(super) fn new(
        cfg: &RedisConfig,
        sentinels: &[ConnectionInfo],
        db: i64,
        certs: Option<TlsCertificates>,
        response_timeout: Duration,
    ) -> RedisResult<Self> {
        let master_name = &cfg
            .sentinel
            .as_ref()
            .ok_or((
                ErrorKind::InvalidClientConfig,
                "sentinel mode without a master name",
            ))?
            .master_name;
        let client = sentinel_client(cfg, sentinels, db, certs.clone())?;
        let probes = sentinels
            .iter()
            .map(|info| match &certs {
                Some(certs) => redis::Client::build_with_tls(info.clone(), certs.clone()),
                None => redis::Client::open(info.clone()),
            })
            .collect::<RedisResult<Vec<_>>>()?;
        let key = format!(
            "{master_name} {:?} {db} {:?}",
            sentinels
                .iter()
                .map(|i| i.addr().to_string())
                .collect::<Vec<_>>(),
            cfg.username
        );
        let watch = {
            let mut watches = WATCHES.lock().expect("not poisoned");
            let watches = watches.get_or_insert_with(HashMap::new);
            watches.retain(|_, w| w.strong_count() > 0);
            match watches.get(&key).and_then(Weak::upgrade) {
                Some(watch) => watch,
                None => {
                    let watch = Arc::<Watch>::default();
                    // The watcher asks with a client of its own: lookups of connections
                    // would otherwise wait behind its periodic one.
                    let asker = sentinel_client(cfg, sentinels, db, certs)?;
                    if spawn_watcher(Arc::downgrade(&watch), asker, cfg.timeout) {
                        watches.insert(key, Arc::downgrade(&watch));
                    }
                    watch
                }
            }
        };
        let shared = Arc::new(Shared {
            client: tokio::sync::Mutex::new(client),
            sentinels: probes,
            watch,
            state: Mutex::new(State::default()),
            connect_timeout: cfg.timeout,
            response_timeout,
            master_name: master_name.clone(),
        });
        Ok(SentinelConn { shared })
    }

    pub(super) async fn req_command(&self, cmd: &Cmd) -> RedisResult<Value> {
        let con = self.master().await?;
        let result = con.req_command(cmd).await;
        match &result {
            Err(e) => self.suspect(e),
            // Error replies may also come back inside `Ok`, for `query_async` to extract.
            Ok(Value::ServerError(e)) if demoted(e) => self.mark_stale(),
            Ok(_) => {}
        }
        result
    }

    pub(super) async fn req_pipeline(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let con = self.master().await?;
        let result = con.req_pipeline(pipeline, offset, count).await;
        match &result {
            Err(e) => self.suspect(e),
            Ok(values) => {
                // A pipeline's replies carry their own errors: a demoted master answers
                // READONLY inside them.
                if values
                    .iter()
                    .any(|v| matches!(v, Value::ServerError(e) if demoted(e)))
                {
                    self.mark_stale();
                }
            }
        }
        result
    }

    /// The master's connection: the current one, or, when it is suspect (or there is none yet),
    /// whatever the sentinels name now.
    async fn master(&self) -> RedisResult<Renewing> {
        let (current, due) = {
            let mut state = self.shared.state.lock().expect("not poisoned");
            // The process's watcher heard the sentinels name a master since this connection
            // last looked: take it (a planned failover gives no error to notice it by).
            if let Some((seq, addr, found)) = self.shared.watch.named_after(state.seen) {
                state.seen = seq;
                if state.current.as_ref().is_none_or(|m| m.addr != addr) {
                    if let Err(e) = self.adopt(&mut state, addr, found) {
                        debug!(error = %e, "taking the master the watcher heard of failed");
                    }
                }
            }
            let due = state.current.is_none()
                || (state.stale
                    && state
                        .last_lookup
                        .is_none_or(|t| t.elapsed() >= RESOLVE_EVERY));
            (state.current.clone(), due)
        };
        if !due {
            return Ok(current.expect("present when no lookup is due").con);
        }
        match self.lookup().await {
            Ok(master) => Ok(master.con),
            Err(e) => {
                let first = !std::mem::replace(
                    &mut self.shared.state.lock().expect("not poisoned").warned,
                    true,
                );
                // A refused certificate or credentials is said once, by whoever gives up on it
                // ("retrying cannot help"), not as something retried.
                if first && !super::is_fatal(&e) {
                    warn!(error = %e, master_name = %self.shared.master_name, "the sentinels name no reachable master yet; retrying");
                }
                match current {
                    // The sentinels cannot be asked, or name a master that is not up yet: keep
                    // the master we know, which may well be fine.
                    Some(master) => Ok(master.con),
                    None => Err(e),
                }
            }
        }
    }

    /// Asks the sentinels which node is master and switches to it if it moved. A master that
    /// is known and not suspect is taken as is (another command may have looked up while this
    /// one waited for the lock).
    async fn lookup(&self) -> RedisResult<Master> {
        let mut client = self.shared.client.lock().await;
        {
            let mut state = self.shared.state.lock().expect("not poisoned");
            if let Some(master) = &state.current {
                if !state.stale {
                    return Ok(master.clone());
                }
            }
            state.last_lookup = Some(Instant::now());
        }
        // Asking the sentinels and checking the master's role: a few round trips, each bounded
        // by the connection timeout, so a black-holed sentinel cannot stall the caller.
        let found =
            match tokio::time::timeout(self.shared.connect_timeout * 2, client.async_get_client())
                .await
            {
                Ok(Ok(found)) => found,
                Ok(Err(e)) => return Err(self.blame(e).await),
                Err(_) => {
                    return Err(RedisError::from((
                        ErrorKind::Io,
                        "asking the sentinels for the master timed out",
                    )))
                }
            };
        let addr = found.get_connection_info().addr().to_string();
        let mut state = self.shared.state.lock().expect("not poisoned");
        state.stale = false;
        state.warned = false;
        // What the watcher heard until now is no newer than this.
        state.seen = self.shared.watch.seq();
        if let Some(master) = &state.current {
            if master.addr == addr {
                return Ok(master.clone());
            }
        }
        self.adopt(&mut state, addr, found)
    }

    /// An authentication error of a lookup, saying whose credentials were refused. redis-rs's
    /// error does not: "Password authentication failed" came the same from a sentinel refusing
    /// `redis.sentinel`'s password as from the master refusing `redis.password_file`'s, and a
    /// user could not tell which to fix. So each sentinel is logged in to alone: one that takes
    /// the sentinels' credentials means the master refused its own.
    async fn blame(&self, err: RedisError) -> RedisError {
        if super::fatal(&err) != Some(super::Fatal::Auth) {
            return err;
        }
        let mut refused = false;
        for sentinel in &self.shared.sentinels {
            let probe = async {
                let mut con = sentinel.get_multiplexed_async_connection().await?;
                redis::cmd("ROLE").query_async::<Value>(&mut con).await
            };
            match tokio::time::timeout(self.shared.connect_timeout, probe).await {
                Ok(Ok(_)) => {
                    return RedisError::from((
                        ErrorKind::AuthenticationFailed,
                        MASTER_REFUSED,
                        err.to_string(),
                    ))
                }
                Ok(Err(e)) if super::fatal(&e) == Some(super::Fatal::Auth) => refused = true,
                // Unreachable: says nothing about the credentials.
                _ => {}
            }
        }
        if refused {
            RedisError::from((
                ErrorKind::AuthenticationFailed,
                SENTINELS_REFUSED,
                err.to_string(),
            ))
        } else {
            err
        }
    }

    /// Switches this connection to the master at `addr` (`found` reaches it).
    fn adopt(&self, state: &mut State, addr: String, found: redis::Client) -> RedisResult<Master> {
        let con = Renewing::new(
            found,
            super::manager_config(self.shared.connect_timeout, self.shared.response_timeout),
            format!("master {addr} of {}", self.shared.master_name),
        )?;
        match &state.current {
            Some(old) => {
                info!(master_name = %self.shared.master_name, from = %old.addr, to = %addr, "the sentinels name a new master; switching")
            }
            None => {
                info!(master_name = %self.shared.master_name, master = %addr, "the sentinels name the master")
            }
        }
        let master = Master { addr, con };
        state.current = Some(master.clone());
        Ok(master)
    }

    /// Marks the master suspect when `err` is what a failover looks like from a client.
    fn suspect(&self, err: &RedisError) {
        let failover_like = err.is_io_error()
            || err.is_connection_dropped()
            || err.is_connection_refusal()
            || err.is_timeout()
            || matches!(
                err.kind(),
                ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
            )
            || err.code() == Some("READONLY")
            // A script's write refused on a replica: Redis reports it inside the script error.
            || err.to_string().contains("READONLY");
        if failover_like {
            self.mark_stale();
        }
    }

    fn mark_stale(&self) {
        self.shared.state.lock().expect("not poisoned").stale = true;
    }
}

/// A client asking `sentinels` for `cfg`'s master (database `db`, `cfg`'s credentials and TLS).
fn sentinel_client(
    cfg: &RedisConfig,
    sentinels: &[ConnectionInfo],
    db: i64,
    certs: Option<TlsCertificates>,
) -> RedisResult<SentinelClient> {
    let SentinelConfig {
        master_name,
        username: sentinel_user,
        password: sentinel_password,
    } = cfg.sentinel.as_ref().ok_or((
        ErrorKind::InvalidClientConfig,
        "sentinel mode without a master name",
    ))?;
    let mut builder = SentinelClientBuilder::new(
        sentinels.iter().map(|i| i.addr().clone()),
        master_name,
        SentinelServerType::Master,
    )?
    .set_client_to_redis_db(db);
    if let Some(user) = &cfg.username {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(password) = &cfg.password {
        builder = builder.set_client_to_redis_password(password.expose());
    }
    if let Some(user) = sentinel_user {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(password) = sentinel_password {
        builder = builder.set_client_to_sentinel_password(password.expose());
    }
    if let Some(certs) = certs {
        // One TLS setting for every node: the sentinels and the masters they name.
        builder = builder
            .set_client_to_redis_tls_mode(TlsMode::Secure)
            .set_client_to_redis_certificates(certs.clone())
            .set_client_to_sentinel_certificates(certs);
    }
    builder.build()
}

/// An error reply saying this node is no longer (or not yet) a usable master. A script's write
/// refused on a replica carries READONLY inside its message.
fn demoted(e: &redis::ServerError) -> bool {
    matches!(e.code(), "READONLY" | "MASTERDOWN")
        || e.details().is_some_and(|d| d.contains("READONLY"))
}

/// Starts the process's watcher for one master (see the module's notes): every
/// `RECHECK_EVERY` it asks the sentinels with `client` and notes in `watch` the master they
/// name, while any connection holds the watch (the task holds only a weak reference). False
/// without a tokio runtime at hand: then failovers are noticed by their errors alone.
fn spawn_watcher(watch: Weak<Watch>, mut client: SentinelClient, timeout: Duration) -> bool {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    runtime.spawn(async move {
        let mut tick = tokio::time::interval(RECHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if watch.strong_count() == 0 {
                return;
            }
            // Bounded, as a lookup: a black-holed sentinel must not stall the watch.
            match tokio::time::timeout(timeout * 2, client.async_get_client()).await {
                Ok(Ok(found)) => {
                    let Some(watch) = watch.upgrade() else {
                        return;
                    };
                    let addr = found.get_connection_info().addr().to_string();
                    watch.heard(addr, found);
                }
                // A failed check changes nothing: connections keep the master they have, and
                // their own errors mark it suspect.
                Ok(Err(e)) => debug!(error = %e, "periodic sentinel check failed"),
                Err(_) => debug!("periodic sentinel check timed out"),
            }
        }
    });
    true
}
