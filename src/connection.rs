//! The one Redis connection type pacer uses, whatever the deployment: `RedisConn` speaks to a
//! single server, a Redis Cluster or a Sentinel-managed master, over plain TCP or TLS, as an ACL
//! user or with a password. It is `Clone + Send + Sync` and a `redis::aio::ConnectionLike`, so
//! scripts (`Script::invoke_async`), commands and pipelines run on it unchanged.
//!
//! Everything protocol-level comes from redis-rs: `ConnectionManager` (standalone, and the
//! Sentinel master), the async cluster client (MOVED, ASK, TRYAGAIN, topology refresh) and the
//! `sentinel` module (finding the master). What lives here is choosing among them from the
//! config, following a Sentinel failover (`sentinel`), and telling errors that will not go away
//! by retrying (a refused password, a certificate that does not verify) from the ones that will.
//!
//! Connecting is lazy: `RedisConn::new` never talks to Redis, so a Redis that is down at start
//! is waited for by the caller's retries. `check` asks now, for commands that should fail fast.
//!
//! Over 400 lines: one connection type across standalone, Cluster, Sentinel and TLS, with its unit
//! tests.

mod cluster;
mod keyed;
mod renewing;
mod sentinel;
mod turns;

use crate::config::{RedisConfig, RedisMode, TlsConfig};
use redis::aio::{ConnectionLike, ConnectionManagerConfig};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::{
    ClientTlsConfig, Cmd, ConnectionInfo, ErrorKind, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, ServerErrorKind, TlsCertificates, Value,
};
use std::sync::Arc;
use std::time::Duration;

pub use crate::config::redact;
pub use keyed::Keyed;

/// Why a connection cannot be made or used. `Auth`, `Tls` and `Setup` will not heal by
/// retrying: a daemon should exit on them at start with the message, not loop.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot set up the Redis client for {target}: {detail}")]
    Setup { target: String, detail: String },
    #[error("Redis at {target} refused pacer's credentials: {detail}")]
    Auth { target: String, detail: String },
    #[error("TLS with Redis at {target} failed: {detail}")]
    Tls { target: String, detail: String },
    /// May heal: nothing listens, a timeout, a failover in progress. `error` is not a
    /// `#[source]`: its text is in the message already, and chained it would print twice.
    #[error("Redis at {target} is unavailable: {error}{hint}")]
    Unavailable {
        target: String,
        error: RedisError,
        /// What to check, when the symptom suggests something (empty otherwise).
        hint: &'static str,
    },
}

impl ConnectError {
    /// Sorts a Redis error met while talking to `target` (already redacted).
    pub fn classify(target: &str, err: RedisError) -> Self {
        let target = target.to_string();
        match fatal(&err) {
            Some(Fatal::Auth) => ConnectError::Auth {
                target,
                detail: err.to_string(),
            },
            Some(Fatal::Tls) => ConnectError::Tls {
                target,
                detail: tls_hint(&err),
            },
            Some(Fatal::Setup) => ConnectError::Setup {
                target,
                detail: err.to_string(),
            },
            None => {
                // A TLS client talking to a plain-text port sends its hello and waits for an
                // answer that never comes: from here, only a timeout.
                let hint = if err.is_timeout() && target.contains("rediss://") {
                    " (does the server speak TLS on this port?)"
                } else {
                    ""
                };
                ConnectError::Unavailable {
                    target,
                    error: err,
                    hint,
                }
            }
        }
    }

    /// Whether retrying cannot help (everything but `Unavailable`).
    pub fn is_fatal(&self) -> bool {
        !matches!(self, ConnectError::Unavailable { .. })
    }
}

/// Kinds of Redis errors that retrying will not cure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fatal {
    /// WRONGPASS, NOAUTH, NOPERM, or a refused AUTH/HELLO: the credentials or the ACL user's
    /// permissions are wrong.
    Auth,
    /// The TLS handshake failed: a certificate that does not verify against the CA, a client
    /// certificate the server wants and did not get (or rejects), no shared protocol.
    Tls,
    /// The client could not be built from the config (a bad certificate file, say).
    Setup,
}

/// `Some` when `err` will not go away by retrying (see `Fatal`); `None` for what may be
/// transient (connection refused or reset, timeouts, LOADING, a failover in progress...).
pub fn fatal(err: &RedisError) -> Option<Fatal> {
    match err.kind() {
        ErrorKind::AuthenticationFailed => return Some(Fatal::Auth),
        ErrorKind::Server(ServerErrorKind::NoPerm) => return Some(Fatal::Auth),
        ErrorKind::InvalidClientConfig => return Some(Fatal::Setup),
        _ => {}
    }
    if matches!(err.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM")) {
        return Some(Fatal::Auth);
    }
    // The URL's database does not exist on the server (`/99` where `databases` is 16): retried
    // forever as "Redis does not answer" until found by review.
    let text = err.to_string();
    if text.contains("DB index is out of range") {
        return Some(Fatal::Setup);
    }
    // Only errors of the connection itself: a server's reply (a script's error, say) may say
    // anything.
    let from_server = matches!(err.kind(), ErrorKind::Server(_) | ErrorKind::Extension);
    if !from_server && is_tls_failure(&text) {
        return Some(Fatal::Tls);
    }
    None
}

/// Shorthand for `fatal(err).is_some()`.
pub fn is_fatal(err: &RedisError) -> bool {
    fatal(err).is_some()
}

/// rustls errors reach us as I/O errors whose text is rustls's own (redis-rs keeps the original
/// error behind an `Arc`, out of reach of a downcast), so they are recognised by that text.
fn is_tls_failure(text: &str) -> bool {
    [
        "invalid peer certificate",
        "received fatal alert",
        "peer sent no certificates",
        "peer is incompatible",
        "peer misbehaved",
        "corrupt message",
        "no certificates presented",
        "invalid dns name",
        "InvalidCertificate",
        "AlertReceived",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// The TLS error with what to check, since rustls's words name the symptom, not the setting.
fn tls_hint(err: &RedisError) -> String {
    let text = err.to_string();
    let hint = if text.contains("UnknownIssuer") || text.contains("BadSignature") {
        "the server's certificate does not chain to redis.tls.ca_file (or the system's roots)"
    } else if text.contains("NotValidForName") || text.contains("invalid dns name") {
        "the server's certificate does not name the host in the URL"
    } else if text.contains("Expired") || text.contains("NotValidYet") {
        "a certificate is outside its validity dates"
    } else if text.contains("CertificateRequired") {
        "the server requires a client certificate: set redis.tls.cert_file and redis.tls.key_file"
    } else if text.contains("UnknownCA")
        || text.contains("BadCertificate")
        || text.contains("DecryptError")
    {
        "the server rejected the client certificate (redis.tls.cert_file)"
    } else {
        "check redis.tls, and that the server speaks TLS on this port"
    };
    format!("{text} ({hint})")
}

/// A connection to pacer's Redis, whatever its deployment. Clones share the underlying
/// connections (one multiplexed connection per node), like `ConnectionManager`'s.
#[derive(Clone)]
pub struct RedisConn {
    inner: Inner,
    /// On one node (standalone, Sentinel's master), its turns, shared by the clones (a
    /// cluster connection takes each master's: `turns`).
    turns: Option<turns::Turns>,
    target: Arc<str>,
    mode: RedisMode,
    db: i64,
}

#[derive(Clone)]
enum Inner {
    Standalone(renewing::Renewing),
    Cluster(cluster::ClusterConn),
    Sentinel(sentinel::SentinelConn),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConn")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

/// Retries inside redis-rs stay short: the caller already retries every step with its own
/// backoff, and one call must give up within its timeout.
const CLUSTER_RETRY_MIN_MS: u64 = 10;
const CLUSTER_RETRY_MAX_MS: u64 = 200;

impl RedisConn {
    /// Builds the connection for `cfg` without connecting: the first command connects, and a
    /// dropped connection is made again on a later command. Each command may take up to
    /// `response_timeout` (the blocking stream reader passes its block time plus
    /// `cfg.timeout`); each connection attempt up to `cfg.timeout`. Call it inside a tokio
    /// runtime (redis-rs spawns its connection tasks on it).
    pub fn new(cfg: &RedisConfig, response_timeout: Duration) -> Result<RedisConn, ConnectError> {
        let target = describe(cfg);
        let setup = |detail: String| ConnectError::Setup {
            target: target.clone(),
            detail,
        };
        install_crypto_provider();
        let infos = connection_infos(cfg).map_err(|e| setup(e.to_string()))?;
        let certs = cfg.tls.as_ref().map(certificates);
        // The database the URLs select (the config checked they agree): in sentinel mode it is
        // the master's, the sentinels themselves having none.
        let db = cfg
            .urls
            .first()
            .and_then(|u| u.as_str().into_connection_info().ok())
            .map_or(0, |i| i.redis_settings().db());
        let inner = match cfg.mode {
            RedisMode::Standalone => {
                let info = infos
                    .into_iter()
                    .next()
                    .ok_or_else(|| setup("no URL".into()))?;
                let client = match certs {
                    Some(certs) => redis::Client::build_with_tls(info, certs),
                    None => redis::Client::open(info),
                }
                .map_err(|e| setup(e.to_string()))?;
                let con = renewing::Renewing::new(
                    client,
                    manager_config(cfg.timeout, response_timeout),
                    target.clone(),
                )
                .map_err(|e| setup(e.to_string()))?;
                Inner::Standalone(con)
            }
            RedisMode::Cluster => {
                let seeds = infos
                    .iter()
                    .map(|info| match &certs {
                        Some(certs) => redis::Client::build_with_tls(info.clone(), certs.clone()),
                        None => redis::Client::open(info.clone()),
                    })
                    .collect::<RedisResult<Vec<_>>>()
                    .map_err(|e| setup(e.to_string()))?;
                let mut builder = ClusterClientBuilder::new(infos)
                    .connection_timeout(cfg.timeout)
                    .response_timeout(response_timeout)
                    .min_retry_wait(CLUSTER_RETRY_MIN_MS)
                    .max_retry_wait(CLUSTER_RETRY_MAX_MS)
                    .retry_wait_formula(CLUSTER_RETRY_MIN_MS, 2);
                if let Some(certs) = certs {
                    builder = builder.certs(certs);
                }
                let client = builder.build().map_err(|e| setup(e.to_string()))?;
                // Pending: connects in the background, so a cluster down at start is waited
                // for, and reconnects to the seed nodes when every known node is lost.
                let config = ClusterConfig::new()
                    .set_connection_timeout(cfg.timeout)
                    .set_response_timeout(response_timeout);
                Inner::Cluster(cluster::ClusterConn::new(
                    client,
                    config,
                    seeds,
                    cfg.timeout,
                ))
            }
            RedisMode::Sentinel => Inner::Sentinel(
                sentinel::SentinelConn::new(cfg, &infos, db, certs, response_timeout)
                    .map_err(|e| setup(e.to_string()))?,
            ),
        };
        let turns = (cfg.mode != RedisMode::Cluster).then(turns::turns);
        Ok(RedisConn {
            inner,
            turns,
            target: target.into(),
            mode: cfg.mode,
            db,
        })
    }

    /// What this connects to, redacted, for messages: `cluster redis://u:***@h:1,redis://...`.
    pub fn target(&self) -> &str {
        &self.target
    }

    pub fn mode(&self) -> RedisMode {
        self.mode
    }

    /// Asks Redis now (`PING`; on a cluster, every master): Ok, or why not, sorted into fatal
    /// (credentials, TLS) and `Unavailable`. For commands that should fail fast and clearly
    /// rather than wait; the daemon's loops retry instead, exiting on `is_fatal` errors.
    pub async fn check(&mut self) -> Result<(), ConnectError> {
        let Err(e) = redis::cmd("PING").query_async::<()>(self).await else {
            return Ok(());
        };
        self.check_cluster_seeds().await?;
        Err(ConnectError::classify(&self.target, e))
    }

    /// In cluster mode, reads which master serves each slot, for the masters' turns (see
    /// `turns`): at a worker's start, so that its first calls take them too.
    pub async fn read_slots(&self) {
        if let Inner::Cluster(con) = &self.inner {
            con.read_slots().await;
        }
    }

    /// In cluster mode, an error if a configured node answers that it is no cluster node
    /// (`redis.mode` is wrong) or refuses pacer's connection for a reason no retry mends (TLS,
    /// credentials), naming the node: retrying cannot help.
    pub async fn check_cluster_seeds(&self) -> Result<(), ConnectError> {
        let Inner::Cluster(con) = &self.inner else {
            return Ok(());
        };
        match con.seed_trouble().await {
            None => Ok(()),
            Some(cluster::SeedTrouble::NoCluster(node)) => Err(ConnectError::Setup {
                target: self.target.to_string(),
                detail: format!(
                    "{node} runs without cluster support: set redis.mode: standalone (or sentinel), or point redis.url at the cluster's nodes"
                ),
            }),
            Some(cluster::SeedTrouble::Refused(node, e)) => Err(ConnectError::classify(
                &format!("{} (node {node})", self.target),
                e,
            )),
        }
    }

    /// How many replicas hold everything `key`'s node held a moment ago (up to `replicas`,
    /// waiting up to `timeout`): a write to `keys::replication_mark(key)`, then `WAIT replicas
    /// timeout` on the same node (on a cluster, the master serving `key`'s slot: redis-rs would
    /// ask every master and keep the smallest answer). WAIT alone counts only the writes made
    /// on this connection (clones share it), and a connection made anew after a reconnection or
    /// a failover has made none; the mark's write makes it count every earlier write to the
    /// node. Redis answers a client's commands in order, so while WAIT blocks, the other
    /// commands sent on the same connection to that node wait behind it: keep `timeout` short.
    pub async fn wait_replicas(
        &mut self,
        key: &str,
        replicas: u32,
        timeout: Duration,
    ) -> RedisResult<u32> {
        // The mark and the WAIT go as one pipeline, so that they run on one node: sent alone,
        // a WAIT whose node is unreachable (killed, say) is sent by redis-rs to another node,
        // whose replicas say nothing about the writes in question. The mark expires on its
        // own: one small key per slot that pacer waits on, never more.
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(crate::keys::replication_mark(key))
            .arg(1)
            .arg("PX")
            .arg(60_000)
            .cmd("WAIT")
            .arg(replicas)
            // Whole milliseconds, rounded up: WAIT's 0 blocks forever.
            .arg(timeout.as_micros().div_ceil(1000).max(1) as u64);
        let replies = match &mut self.inner {
            Inner::Cluster(con) => con.pipeline_to_master_of(key, pipe, 2).await?,
            _ => pipe.query_async(self).await?,
        };
        let mut replies = replies.into_iter().map(Value::extract_error);
        match (replies.next(), replies.next()) {
            (Some(set), Some(wait)) => {
                set?;
                redis::from_redis_value(wait?).map_err(Into::into)
            }
            _ => Err(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "expected two replies to SET and WAIT",
            ))),
        }
    }

    /// The address (`host:port`) of the master serving `key`'s slot on a cluster (asked with
    /// `CLUSTER SLOTS` of any node), or None when this is not a cluster.
    pub async fn node_for_key(&mut self, key: &str) -> RedisResult<Option<String>> {
        if self.mode != RedisMode::Cluster {
            return Ok(None);
        }
        let slot = key_slot(key);
        let slots: Value = redis::cmd("CLUSTER").arg("SLOTS").query_async(self).await?;
        Ok(slot_owner(&slots, slot))
    }
}

/// The Redis Cluster slot of `key` (one computation, in `keys`).
pub use crate::keys::slot as key_slot;

/// The master (`host:port`) of `slot` in a `CLUSTER SLOTS` reply: entries of
/// `[start, end, [host, port, id, ...], replicas...]`.
fn slot_owner(reply: &Value, slot: u16) -> Option<String> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    let int = |v: &Value| match v {
        Value::Int(n) => Some(*n),
        _ => None,
    };
    ranges.iter().find_map(|range| {
        let Value::Array(parts) = range else {
            return None;
        };
        let (start, end) = (int(parts.first()?)?, int(parts.get(1)?)?);
        if !(start..=end).contains(&(slot as i64)) {
            return None;
        }
        let Value::Array(node) = parts.get(2)? else {
            return None;
        };
        let host = match node.first()? {
            Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            Value::SimpleString(s) => s.clone(),
            _ => return None,
        };
        Some(format!("{host}:{}", int(node.get(1)?)?))
    })
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let _turn = turns::take(self.turns.as_ref()).await;
            match &mut self.inner {
                Inner::Standalone(con) => con.req_command(cmd).await,
                Inner::Cluster(con) => con.req_command(cmd).await,
                Inner::Sentinel(con) => con.req_command(cmd).await,
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let _turn = turns::take(self.turns.as_ref()).await;
            match &mut self.inner {
                Inner::Standalone(con) => con.req_pipeline(pipeline, offset, count).await,
                Inner::Cluster(con) => con.req_packed_commands(pipeline, offset, count).await,
                Inner::Sentinel(con) => con.req_pipeline(pipeline, offset, count).await,
            }
        })
    }

    fn get_db(&self) -> i64 {
        self.db
    }
}

/// `mode url,url` with passwords hidden.
fn describe(cfg: &RedisConfig) -> String {
    match &cfg.sentinel {
        Some(s) => format!(
            "sentinel {} (master {:?})",
            cfg.url.redacted(),
            s.master_name
        ),
        None => format!("{} {}", cfg.mode, cfg.url.redacted()),
    }
}

/// Each URL as redis-rs reads it, with the credentials the config settled on (which may come
/// from `redis.username`, a password file or the environment rather than the URL).
fn connection_infos(cfg: &RedisConfig) -> RedisResult<Vec<ConnectionInfo>> {
    cfg.urls
        .iter()
        .map(|url| {
            let info = url.as_str().into_connection_info()?;
            let mut settings = info.redis_settings().clone();
            if cfg.mode == RedisMode::Sentinel {
                // The URLs name the sentinels; the data nodes' credentials and database travel
                // separately (see `sentinel`), the sentinels' own credentials come from
                // `redis.sentinel`, and a sentinel has no database to SELECT.
                settings = redis::RedisConnectionInfo::default();
                if let Some(s) = &cfg.sentinel {
                    if let Some(user) = &s.username {
                        settings = settings.set_username(user);
                    }
                    if let Some(password) = &s.password {
                        settings = settings.set_password(password.expose());
                    }
                }
            } else {
                if let Some(user) = &cfg.username {
                    settings = settings.set_username(user);
                }
                if let Some(password) = &cfg.password {
                    settings = settings.set_password(password.expose());
                }
            }
            Ok(info.set_redis_settings(settings))
        })
        .collect()
}

fn certificates(tls: &TlsConfig) -> TlsCertificates {
    TlsCertificates {
        client_tls: tls.client.as_ref().map(|c| ClientTlsConfig {
            client_cert: c.cert.pem.clone(),
            client_key: c.key.pem.clone(),
        }),
        root_cert: tls.ca.as_ref().map(|ca| ca.pem.clone()),
    }
}

fn manager_config(connect: Duration, response: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect))
        .set_response_timeout(Some(response))
        .set_number_of_retries(1)
        .set_max_delay(crate::backoff::CEILING)
}

/// rustls needs one crypto provider per process; redis-rs leaves the choice to us. ring is the
/// one compiled in (see Cargo.toml); installing it explicitly keeps that true even if another
/// crate someday enables a second provider.
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_slots_match_redis() {
        // Values from CLUSTER KEYSLOT.
        assert_eq!(key_slot("foo"), 12182);
        assert_eq!(key_slot("{user1000}.following"), 3443);
        assert_eq!(key_slot("pacer:{carrier-a}:ready"), key_slot("carrier-a"));
        assert_eq!(key_slot(""), 0);
    }

    #[test]
    fn fatal_errors_are_told_from_transient_ones() {
        let wrongpass = RedisError::from((
            ErrorKind::AuthenticationFailed,
            "Password authentication failed",
        ));
        assert_eq!(fatal(&wrongpass), Some(Fatal::Auth));
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(fatal(&refused), None);
        let tls = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "invalid peer certificate: UnknownIssuer",
        ));
        assert_eq!(fatal(&tls), Some(Fatal::Tls));
        let e = ConnectError::classify("standalone redis://h:1", tls);
        assert!(e.to_string().contains("redis.tls.ca_file"), "{e}");
        // A server's reply is never taken for a TLS failure, whatever its words.
        let reply = redis::make_extension_error(
            "ERR".into(),
            Some("user_script:1: received fatal alert".into()),
        );
        assert_eq!(fatal(&reply), None);
        let wrongpass = redis::make_extension_error("WRONGPASS".into(), None);
        assert_eq!(fatal(&wrongpass), Some(Fatal::Auth));
    }
}
