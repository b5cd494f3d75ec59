//! What a worker sets up in Redis before it reads: the consumer groups, whether Redis is a
//! cluster, the scripts, the eviction check. Run at start-up, and again by the monitor when Redis
//! lost it (restarted empty).

use super::context::Context;
use super::monitor;
use super::reader::READ_BLOCK;
use crate::backoff::Backoff;
use crate::config::RedisMode;
use crate::error::{Error, Result};
use crate::keys::InboundKeys;
use crate::streams;
use crate::telemetry;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info};

/// Creates the consumer groups, learns whether Redis is a cluster and loads the scripts,
/// retrying until Redis answers. Ok(false) if shutdown came first; an error if Redis refuses
/// pacer in a way no retry can mend (credentials, TLS).
pub(super) async fn prepare(ctx: &Context, shutdown: &CancellationToken) -> Result<bool> {
    let mut backoff = Backoff::default();
    loop {
        match telemetry::timed("prepare", prepare_once(ctx)).await {
            Ok(()) => {
                ctx.health.succeeded();
                ctx.health.set_scripts_loaded(true);
                ctx.health.set_groups_ok(true);
                return Ok(true);
            }
            Err(e) if e.is_fatal() => {
                // Said as `inspect` says it: what failed (TLS, credentials) and which setting
                // to look at, not the bare error (a test of a worker that cannot verify its
                // server found `redis: invalid peer certificate: UnknownIssuer`, and nothing
                // naming TLS or redis.tls.ca_file).
                let e = match e {
                    Error::Redis(e) => Error::Connect(crate::connection::ConnectError::classify(
                        ctx.con.target(),
                        e,
                    )),
                    other => other,
                };
                error!(error = %e, "pacer cannot start on this Redis; retrying cannot help");
                return Err(e);
            }
            Err(e) => {
                ctx.health.failed("prepare", &e);
                let delay = backoff.fail();
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(false),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// How long a starting worker watches its consumer name when the group saw it moments ago: two
/// of the reader's blocking reads and some, so that a live worker under that name reads within it.
const NAME_WATCH: Duration = Duration::from_millis(2 * READ_BLOCK.as_millis() as u64 + 200);
/// How much younger than expected the name's idle time must be after the watch to count as read
/// again (the two XINFO calls' own time, rounded to Redis's milliseconds).
const NAME_SLACK_MS: i64 = 100;

/// Refuses to start under a consumer name another live worker reads with (a fixed
/// `worker.consumer` copied to several workers): the claimer never takes a consumer's own
/// entries, so the pending entries of either one, once it died, would never be claimed; and each
/// would recover the other's at start. Redis refreshes a consumer's idle time on every read; a
/// live worker reads every `READ_BLOCK` at most while it has room. So a name read moments ago is
/// watched for `NAME_WATCH`: read again meanwhile, another worker has it; not, it was this
/// worker's predecessor (a restart), whose pending entries are this worker's to take up.
///
/// Only at start, and only what the group shows: two workers starting together under a new name,
/// or one so full that it stopped reading, are not seen. A failing XINFO (Redis down at start, no
/// group yet, an ACL user without it) skips the check.
pub(super) async fn check_name_free(ctx: &Context, shutdown: &CancellationToken) -> Result<()> {
    let mut recent = Vec::new();
    for stream in &ctx.streams {
        if let Some(ms) = name_idle(ctx, stream).await {
            if ms < NAME_WATCH.as_millis() as i64 {
                recent.push((stream.clone(), ms));
            }
        }
    }
    if recent.is_empty() {
        return Ok(());
    }
    info!(consumer = %ctx.consumer, watch = ?NAME_WATCH, "this consumer name read moments ago: watching that no other worker reads under it");
    let started = Instant::now();
    tokio::select! {
        _ = shutdown.cancelled() => return Ok(()),
        _ = tokio::time::sleep(NAME_WATCH) => {}
    }
    for (stream, before_ms) in recent {
        let waited_ms = started.elapsed().as_millis() as i64;
        match name_idle(ctx, &stream).await {
            Some(after_ms) if after_ms + NAME_SLACK_MS < before_ms + waited_ms => {
                return Err(Error::ConsumerInUse {
                    consumer: ctx.consumer.clone(),
                    stream: stream.to_string(),
                    before_ms,
                    after_ms,
                    waited_ms,
                });
            }
            _ => {}
        }
    }
    Ok(())
}

/// Most permission probes in flight at once (one per stream; thousands of routes are thousands
/// of ready streams).
const PROBES_AT_ONCE: usize = 64;

/// Refuses to start when the Redis user may not run a command pacer needs later on a key it
/// needs it on: each is tried once, harmlessly (claiming and acknowledging an id no stream
/// holds, trimming an output stream to 2^32 entries). Such a NOPERM used to surface only when
/// the call was first needed: a user without XCLAIM left a dead worker's entries pending for
/// good behind one warning, ready all along; one without an output stream's key was retried
/// forever (found by review). Other errors (a key of another kind, say) are the calls' own
/// business later, not this check's.
pub(super) async fn check_permissions(ctx: &Context) -> Result<()> {
    use futures_util::stream::{self, StreamExt};
    let group = &ctx.cfg.worker.group;
    let mut probes: Vec<redis::Cmd> = Vec::new();
    for stream in &ctx.streams {
        let mut claim = redis::cmd("XCLAIM");
        claim
            .arg(&**stream)
            .arg(group)
            .arg(&ctx.consumer)
            .arg(0)
            .arg("0-1")
            .arg("JUSTID");
        probes.push(claim);
        let mut ack = redis::cmd("XACK");
        ack.arg(&**stream).arg(group).arg("0-1");
        probes.push(ack);
        let mut pending = redis::cmd("XPENDING");
        pending
            .arg(&**stream)
            .arg(group)
            .arg("IDLE")
            .arg(0)
            .arg("-")
            .arg("+")
            .arg(1)
            .arg(&ctx.consumer);
        probes.push(pending);
        let mut groups = redis::cmd("XINFO");
        groups.arg("GROUPS").arg(&**stream);
        probes.push(groups);
    }
    for key in ctx.cfg.output_streams() {
        let mut trim = redis::cmd("XTRIM");
        trim.arg(key).arg("MAXLEN").arg(u32::MAX);
        probes.push(trim);
    }
    let mut results = stream::iter(probes)
        .map(|cmd| {
            let mut con = ctx.con.clone();
            async move {
                let result = cmd.query_async::<redis::Value>(&mut con).await;
                (cmd, result)
            }
        })
        .buffer_unordered(PROBES_AT_ONCE);
    while let Some((cmd, result)) = results.next().await {
        if let Err(e) = result {
            if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
                || e.code() == Some("NOPERM")
            {
                let args: Vec<String> = cmd
                    .args_iter()
                    .take(3)
                    .filter_map(|a| match a {
                        redis::Arg::Simple(b) => Some(String::from_utf8_lossy(b).into_owned()),
                        _ => None,
                    })
                    .collect();
                error!(command = %args.join(" "), error = %e, "the Redis user may not run a command pacer needs on a key it needs it on: grant it (see the README's ACL SETUSER line)");
                return Err(Error::Redis(e));
            }
        }
    }
    Ok(())
}

/// Milliseconds since the group last saw this worker's consumer name read `stream`, if it
/// knows the name.
async fn name_idle(ctx: &Context, stream: &str) -> Option<i64> {
    let mut con = ctx.con.clone();
    match streams::consumers(&mut con, stream, &ctx.cfg.worker.group).await {
        Ok(list) => list
            .into_iter()
            .find(|c| c.name == ctx.consumer)
            .map(|c| c.idle_ms),
        Err(e) => {
            debug!(%stream, error = %e, "reading the group's consumers failed; not checking the consumer name");
            None
        }
    }
}

/// One attempt at `prepare`.
async fn prepare_once(ctx: &Context) -> Result<()> {
    let mut con = ctx.con.clone();
    let cluster = match ctx.con.mode() {
        RedisMode::Cluster => {
            ctx.con.check_cluster_seeds().await?;
            ctx.con.read_slots().await;
            true
        }
        RedisMode::Sentinel => false,
        // A node in cluster mode, reached as one server: it still refuses calls across slots.
        RedisMode::Standalone => {
            let cluster = streams::is_cluster(&mut con).await?;
            // One node of several: the keys on the others answer MOVED for good (found by
            // review: their routes never dispatched, retried forever). A lone node holding
            // every slot works as one server.
            if cluster && streams::cluster_masters(&mut con).await? > 1 {
                return Err(Error::Connect(crate::connection::ConnectError::Setup {
                    target: ctx.con.target().to_string(),
                    detail: "this node is one of a Redis Cluster's several masters: set redis.mode: cluster (and list a few nodes in redis.url)".into(),
                }));
            }
            cluster
        }
    };
    ctx.cluster.store(cluster, Ordering::Relaxed);
    for stream in &ctx.streams {
        match streams::ensure_group(&mut con, stream, &ctx.cfg.worker.group).await {
            // Retried for ever, reported as "Redis does not answer", until found by review.
            Err(e) if e.is_wrong_type() => {
                let kind: String = redis::cmd("TYPE")
                    .arg(stream.as_ref())
                    .query_async(&mut con)
                    .await
                    .unwrap_or_else(|_| "value of another kind".into());
                return Err(Error::NotAStream {
                    key: stream.to_string(),
                    kind,
                });
            }
            other => other?,
        }
    }
    if let Some(inbound) = &ctx.cfg.inbound {
        // Where an output shares the admission call's slot, the call writes it in the step that
        // decides it; elsewhere a second, write-once call does.
        let by_call = |stream: fn(&InboundKeys) -> &str| {
            inbound
                .keys
                .iter()
                .filter(|k| ctx.same_slot(k.slot_key(), stream(k)))
                .count()
        };
        info!(
            partitions = inbound.keys.len(),
            forwarded_by_admission = by_call(|k| &k.forward),
            rejected_by_admission = by_call(|k| &k.rejected),
            "inbound partitions whose admission call writes the accepted and rejected events itself"
        );
    }
    ctx.scripts.load(&mut con).await?;
    monitor::check_replication(ctx, &mut con).await;
    monitor::check_aof_repair(&mut con).await;
    monitor::check_eviction(ctx, &mut con).await
}
