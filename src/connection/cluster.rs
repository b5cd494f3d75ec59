//! The Redis Cluster side of `RedisConn`: redis-rs's async cluster connection (it follows
//! MOVED, ASK and TRYAGAIN and refreshes the topology after failovers and resharding), plus
//! each master's turns (`super::turns`: at most so many calls out per master, by a slot map of
//! pacer's own) and one thing it does not do well: getting a script back onto the node that
//! lost it.
//!
//! `Script::invoke_async` answers NOSCRIPT with `SCRIPT LOAD`, which redis-rs sends to every
//! master and which fails if any one of them does not answer: a master that hangs (or is being
//! failed over) would stop scripts from being reloaded on all the healthy ones. And while a slot
//! migrates, the node that said NOSCRIPT may be the ASK target, which a load routed by slot does
//! not reach. So every script source that passes through a `SCRIPT LOAD` is remembered, and an
//! `EVALSHA` answered NOSCRIPT is sent again as `EVAL` with that source: routed by its keys like
//! the `EVALSHA` (redirections followed), it runs on exactly the node that answers, and leaves
//! the script cached there.

use super::turns::{self, SlotTurns, Turns};
use redis::aio::ConnectionLike;
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{
    Arg, AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult,
    ServerErrorKind, Value,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::warn;

/// Timeouts within `STUCK_WITHIN` after which the cluster is asked whether slots moved (see
/// `Renewal`).
const STUCK_AFTER: u32 = 2;
const STUCK_WITHIN: Duration = Duration::from_secs(5);
/// The least time between two askings of the cluster whether slots moved.
const RENEW_EVERY: Duration = Duration::from_secs(1);

/// What `ClusterConn::seed_trouble` found wrong with a configured node (`host:port`).
pub(super) enum SeedTrouble {
    /// It runs without cluster support.
    NoCluster(String),
    /// It refused the connection: TLS failed, or it refused the credentials.
    Refused(String, RedisError),
}

#[derive(Clone)]
pub(super) struct ClusterConn {
    renewal: Arc<Renewal>,
    /// Each master's turns, by the slot map pacer reads itself (`super::turns`).
    turns: Arc<SlotTurns>,
    /// Script sources by SHA1, from every `SCRIPT LOAD` sent through any clone.
    scripts: Arc<Mutex<HashMap<String, Arc<[u8]>>>>,
    /// The configured nodes, each reachable on its own (`seed_without_cluster`).
    seeds: Arc<[redis::Client]>,
    /// How long one of them may take to connect and to answer.
    timeout: Duration,
}

/// The cluster connection, made anew when calls keep timing out and the cluster has moved a
/// failed master's slots. redis-rs refreshes its slot map on MOVED, READONLY or a connection it
/// sees close, but answers a timeout by sending again to the same node: a master frozen or cut
/// off without a reset (a network partition) kept its slots' calls there after the cluster had
/// promoted its replica, until it thawed (found by review: two routes sent nothing for 6 s after
/// the promotion). A new connection asks the nodes for the slots again, and finds the promoted
/// replica. Only then: a new connection also waits on the frozen node while it connects, which
/// held up the routes on the healthy masters when it was made on every timeout.
struct Renewal {
    client: ClusterClient,
    config: ClusterConfig,
    current: Mutex<Current>,
    /// The configured nodes, asked whether a failed master's slots moved.
    seeds: Arc<[redis::Client]>,
    timeout: Duration,
}

struct Current {
    con: ClusterConnection,
    /// Counts the connections made: a call's timeout counts only against the one it used.
    generation: u64,
    /// Timeouts since `first_timeout` (on this connection).
    timeouts: u32,
    first_timeout: Instant,
    /// When the cluster was last asked whether slots moved.
    checked: Instant,
}

impl Renewal {
    fn con(&self) -> (ClusterConnection, u64) {
        let c = self.current.lock().expect("not poisoned");
        (c.con.clone(), c.generation)
    }

    /// Counts a call's timeout against the connection it used; when they pile up, asks the
    /// cluster (in the background) whether a failed master's slots moved, and if so renews it.
    fn note<T>(self: &Arc<Self>, generation: u64, result: &RedisResult<T>) {
        if !matches!(result, Err(e) if e.is_timeout()) {
            return;
        }
        let mut c = self.current.lock().expect("not poisoned");
        if c.generation != generation {
            return;
        }
        let now = Instant::now();
        if now.duration_since(c.first_timeout) > STUCK_WITHIN || c.timeouts == 0 {
            c.first_timeout = now;
            c.timeouts = 0;
        }
        c.timeouts += 1;
        if c.timeouts < STUCK_AFTER || now.duration_since(c.checked) < RENEW_EVERY {
            return;
        }
        c.checked = now;
        let renewal = self.clone();
        tokio::spawn(async move {
            if !renewal.slots_moved().await {
                return;
            }
            let mut c = renewal.current.lock().expect("not poisoned");
            if c.generation != generation {
                return;
            }
            warn!(
                "cluster calls time out and a failed master's slots have moved: connecting anew to read the slots again"
            );
            c.con = renewal
                .client
                .get_pending_async_connection_with_config(renewal.config.clone());
            c.generation += 1;
            c.timeouts = 0;
        });
    }

    /// Whether the first configured node that answers names a failed master that holds no
    /// slots: its replica was promoted in its place.
    async fn slots_moved(&self) -> bool {
        let mut nodes = redis::cmd("CLUSTER");
        nodes.arg("NODES");
        ask_each_seed(&self.seeds, self.timeout, &nodes, |_, text| {
            Some(failed_master_without_slots(&text))
        })
        .await
        .0
        .unwrap_or(false)
    }
}

/// Asks each of `seeds` in turn `cmd`, on a connection of its own bounded by `timeout`, until
/// `take` makes something of a node's answer; a node that does not answer, or refuses the
/// connection, is skipped. Returns that, and the first refusal met for a reason no retry mends
/// (TLS, credentials: see `super::fatal`) with the node's address.
async fn ask_each_seed<R>(
    seeds: &[redis::Client],
    timeout: Duration,
    cmd: &Cmd,
    mut take: impl FnMut(&redis::Client, String) -> Option<R>,
) -> (Option<R>, Option<(String, RedisError)>) {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    let mut refused = None;
    for seed in seeds {
        let mut con = match seed
            .get_multiplexed_async_connection_with_config(&config)
            .await
        {
            Ok(con) => con,
            Err(e) => {
                if refused.is_none() && super::is_fatal(&e) {
                    refused = Some((seed.get_connection_info().addr().to_string(), e));
                }
                continue;
            }
        };
        let answer: RedisResult<String> = cmd.query_async(&mut con).await;
        if let Some(r) = answer.ok().and_then(|a| take(seed, a)) {
            return (Some(r), refused);
        }
    }
    (None, refused)
}

/// Reads the cluster's slots (`CLUSTER NODES`, from any master) into `slots`.
async fn read_slots(slots: Arc<SlotTurns>, mut con: ClusterConnection) {
    let mut nodes = redis::cmd("CLUSTER");
    nodes.arg("NODES");
    let any = RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary);
    match con.route_command(nodes, any).await {
        Ok(Value::BulkString(text)) => slots.read(&String::from_utf8_lossy(&text)),
        Ok(Value::VerbatimString { text, .. }) => slots.read(&text),
        _ => slots.unread(),
    }
}

/// Whether `CLUSTER NODES` text names a master flagged `fail` (agreed, not `fail?`) that holds
/// no slots: the cluster gave them to its promoted replica. (A failed master whose slots were
/// not moved, having no replica, keeps them listed.)
fn failed_master_without_slots(nodes: &str) -> bool {
    nodes.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let flags: Vec<&str> = fields.get(2).map_or(vec![], |f| f.split(',').collect());
        flags.contains(&"master") && flags.contains(&"fail") && fields.len() <= 8
    })
}

impl ClusterConn {
    pub(super) fn new(
        client: ClusterClient,
        config: ClusterConfig,
        seeds: Vec<redis::Client>,
        timeout: Duration,
    ) -> Self {
        let now = Instant::now();
        let con = client.get_pending_async_connection_with_config(config.clone());
        let seeds: Arc<[redis::Client]> = seeds.into();
        ClusterConn {
            renewal: Arc::new(Renewal {
                client,
                config,
                current: Mutex::new(Current {
                    con,
                    generation: 0,
                    timeouts: 0,
                    first_timeout: now,
                    checked: now - RENEW_EVERY,
                }),
                seeds: seeds.clone(),
                timeout,
            }),
            turns: Arc::default(),
            scripts: Arc::default(),
            seeds,
            timeout,
        }
    }

    /// Reads the slot map for the masters' turns now (the worker's start, before its first
    /// batch: until then its calls would take none).
    pub(super) async fn read_slots(&self) {
        read_slots(self.turns.clone(), self.renewal.con().0).await;
    }

    /// The turns of the master serving `key`'s slot, as last read (none for no key, or before
    /// the first read); starts a read of the slots (in the background) when they are due one.
    fn turns_of(&self, key: Option<&[u8]>) -> Option<Turns> {
        // pacer's keys are text; one that is not takes no turn.
        let slot = crate::keys::slot(std::str::from_utf8(key?).ok()?);
        let (turns, read) = self.turns.of(slot);
        if read {
            let (slots, (con, _)) = (self.turns.clone(), self.renewal.con());
            tokio::spawn(read_slots(slots, con));
        }
        turns
    }

    /// The node id of the master serving `slot`, as last read (None before the first read).
    pub(super) fn master_of(&self, slot: u16) -> Option<Arc<str>> {
        self.turns.master(slot)
    }

    /// Whether the slot map has been read (see `read_slots`).
    pub(super) fn slots_read(&self) -> bool {
        self.turns.is_read()
    }

    /// What is wrong with the configured nodes, each asked on a connection of its own: the
    /// first that runs without cluster support, else the first that refuses pacer for a reason
    /// no retry mends (TLS, credentials). redis-rs's cluster connection reports neither (it
    /// finds no nodes, or its calls time out while it reconnects in the background), so pacer
    /// retried for ever where the same config on one server exits at once (the refusals found
    /// by tests/cluster_tls.rs). A node that does not answer is skipped, as a cluster still
    /// starting may not.
    pub(super) async fn seed_trouble(&self) -> Option<SeedTrouble> {
        let mut info = redis::cmd("INFO");
        info.arg("cluster");
        let found = ask_each_seed(&self.seeds, self.timeout, &info, |seed, text| {
            text.contains("cluster_enabled:0")
                .then(|| seed.get_connection_info().addr().to_string())
        })
        .await;
        match found {
            (Some(node), _) => Some(SeedTrouble::NoCluster(node)),
            (None, Some((node, e))) => Some(SeedTrouble::Refused(node, e)),
            (None, None) => None,
        }
    }

    pub(super) async fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        let args: Vec<&[u8]> = cmd
            .args_iter()
            .filter_map(|a| match a {
                Arg::Simple(a) => Some(a),
                // Only SCAN-style commands hold cursors; neither command handled here does.
                _ => None,
            })
            .collect();
        let name = |i: usize| args.get(i).map(|a| a.to_ascii_uppercase());
        if name(0).as_deref() == Some(b"SCRIPT") && name(1).as_deref() == Some(b"LOAD") {
            if let Some(source) = args.get(2) {
                self.remember(source);
            }
        }
        let turns = self.turns_of(turns::routing_key(&args));
        let _turn = turns::take(turns.as_ref()).await;
        let (mut con, generation) = self.renewal.con();
        let result = con.req_packed_command(cmd).await;
        self.renewal.note(generation, &result);
        // A server's error reply may come back as an `Err` or inside `Ok` (redis-rs leaves some
        // to `query_async` to extract): NOSCRIPT is looked for in both.
        let noscript = match &result {
            Err(e) => e.kind() == ErrorKind::Server(ServerErrorKind::NoScript),
            Ok(Value::ServerError(e)) => e.code() == "NOSCRIPT",
            Ok(_) => false,
        };
        if !noscript || name(0).as_deref() != Some(b"EVALSHA") {
            return result;
        }
        let known = args
            .get(1)
            .and_then(|sha| self.source(&String::from_utf8_lossy(sha)));
        match known {
            Some(source) => {
                let mut eval = redis::cmd("EVAL");
                eval.arg(&*source);
                for a in &args[2..] {
                    eval.arg(*a);
                }
                let result = con.req_packed_command(&eval).await;
                self.renewal.note(generation, &result);
                result
            }
            None => result,
        }
    }

    /// Sends `pipeline` as one to the master serving `key`'s slot. If redis-rs cannot reach that
    /// node it sends the pipeline to another (a replica of the shard, or any node): a pipeline
    /// that starts with a write to `key`'s slot then fails there (MOVED, READONLY) rather than
    /// running its later commands on the wrong node.
    pub(super) async fn pipeline_to_master_of(
        &mut self,
        key: &str,
        pipeline: Pipeline,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let route = Route::with_key(key, SlotAddr::Master);
        let turns = self.turns_of(Some(key.as_bytes()));
        let _turn = turns::take(turns.as_ref()).await;
        let (mut con, generation) = self.renewal.con();
        let result = con
            .route_pipeline(
                pipeline,
                0,
                count,
                SingleNodeRoutingInfo::SpecificNode(route),
            )
            .await;
        self.renewal.note(generation, &result);
        result
    }

    pub(super) fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (mut con, generation) = self.renewal.con();
            let result = con.req_packed_commands(pipeline, offset, count).await;
            self.renewal.note(generation, &result);
            result
        })
    }

    fn remember(&self, source: &[u8]) {
        let sha = redis::Script::new(&String::from_utf8_lossy(source))
            .get_hash()
            .to_string();
        self.scripts
            .lock()
            .expect("not poisoned")
            .entry(sha)
            .or_insert_with(|| source.into());
    }

    fn source(&self, sha: &str) -> Option<Arc<[u8]>> {
        self.scripts
            .lock()
            .expect("not poisoned")
            .get(&sha.to_ascii_lowercase())
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_master_is_promoted_away_only_once_its_slots_are_gone() {
        let promoted = "\
a1 127.0.0.1:7001@17001 master,fail - 0 0 1 disconnected
b2 127.0.0.1:7002@17002 myself,master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7004@17004 master - 0 0 4 connected 0-5460
d4 127.0.0.1:7005@17005 slave,fail b2 0 0 2 disconnected
";
        assert!(failed_master_without_slots(promoted));
        let no_replica = promoted.replace(
            "master,fail - 0 0 1 disconnected",
            "master,fail - 0 0 1 disconnected 0-5460",
        );
        assert!(!failed_master_without_slots(&no_replica));
        let suspected = promoted.replace("master,fail ", "master,fail? ");
        assert!(!failed_master_without_slots(&suspected));
    }
}
