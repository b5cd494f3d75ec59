//! The Redis Cluster side of `RedisConn`: redis-rs's async cluster connection (it follows
//! MOVED, ASK and TRYAGAIN and refreshes the topology after failovers and resharding), plus one
//! thing it does not do well: getting a script back onto the node that lost it.
//!
//! `Script::invoke_async` answers NOSCRIPT with `SCRIPT LOAD`, which redis-rs sends to every
//! master and which fails if any one of them does not answer: a master that hangs (or is being
//! failed over) would stop scripts from being reloaded on all the healthy ones. And while a slot
//! migrates, the node that said NOSCRIPT may be the ASK target, which a load routed by slot does
//! not reach. So every script source that passes through a `SCRIPT LOAD` is remembered, and an
//! `EVALSHA` answered NOSCRIPT is sent again as `EVAL` with that source: routed by its keys like
//! the `EVALSHA` (redirections followed), it runs on exactly the node that answers, and leaves
//! the script cached there.

use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{
    Arg, AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisFuture, RedisResult,
    ServerErrorKind, Value,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone)]
pub(super) struct ClusterConn {
    con: ClusterConnection,
    /// Script sources by SHA1, from every `SCRIPT LOAD` sent through any clone.
    scripts: Arc<Mutex<HashMap<String, Arc<[u8]>>>>,
    /// The configured nodes, each reachable on its own (`seed_without_cluster`).
    seeds: Arc<[redis::Client]>,
    /// How long one of them may take to connect and to answer.
    timeout: Duration,
}

impl ClusterConn {
    pub(super) fn new(
        con: ClusterConnection,
        seeds: Vec<redis::Client>,
        timeout: Duration,
    ) -> Self {
        ClusterConn {
            con,
            scripts: Arc::default(),
            seeds: seeds.into(),
            timeout,
        }
    }

    /// The first configured node (`host:port`) that says it runs without cluster support, if
    /// one does. redis-rs then only reports that it found no nodes, and pacer retried for ever
    /// (left for a while as a known gap). Each node is asked on a connection of its own; one
    /// that does not answer is skipped, as a cluster still starting may not.
    pub(super) async fn seed_without_cluster(&self) -> Option<String> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        for seed in self.seeds.iter() {
            let Ok(mut con) = seed
                .get_multiplexed_async_connection_with_config(&config)
                .await
            else {
                continue;
            };
            let info: RedisResult<String> = redis::cmd("INFO")
                .arg("cluster")
                .query_async(&mut con)
                .await;
            if info.is_ok_and(|i| i.contains("cluster_enabled:0")) {
                return Some(seed.get_connection_info().addr().to_string());
            }
        }
        None
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
        let result = self.con.req_packed_command(cmd).await;
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
                self.con.req_packed_command(&eval).await
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
        self.con
            .route_pipeline(
                pipeline,
                0,
                count,
                SingleNodeRoutingInfo::SpecificNode(route),
            )
            .await
    }

    pub(super) fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.con.req_packed_commands(pipeline, offset, count)
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
