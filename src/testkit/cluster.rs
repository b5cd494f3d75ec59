//! A real Redis Cluster for tests: N masters with R replicas each, on free loopback ports, made
//! with `redis-cli --cluster create` (works offline) and killed on drop. Helpers read the
//! topology from `CLUSTER NODES`, find the node serving a key, kill and restart nodes, fail
//! over (graceful or TAKEOVER), move a slot the way `redis-cli --cluster reshard` does (slowly
//! if asked, so traffic can run during it) and freeze a node to make a replica lag.
//!
//! `start_tls` makes the cluster production-shaped: TLS only (client certificates required, the
//! bus and replication over TLS too) and the default user locked by a password; every helper
//! then speaks TLS and logs in.
//!
//! Over 400 lines: starting, resharding and failing over a real cluster is one sequence of steps.

use super::{came_up, free_port, started_on_a_free_port, wait_until, RedisServer, TlsFiles};
use crate::connection::key_slot;
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Short enough that a killed master is failed over in a couple of seconds, long enough that a
/// busy 2-core machine does not see false failures.
const NODE_TIMEOUT_MS: u32 = 1000;

/// One node of a `Cluster`.
pub struct ClusterNode {
    pub server: RedisServer,
    /// Killed by `Cluster::kill` and not restarted.
    pub down: bool,
}

/// What `CLUSTER NODES` says about one node.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// The master's id, for a replica.
    pub master_id: Option<String>,
    /// Flagged `fail` (or `fail?`) by the node asked.
    pub failed: bool,
    /// Slot ranges served (masters), inclusive.
    pub slots: Vec<(u16, u16)>,
}

pub struct Cluster {
    pub nodes: Vec<ClusterNode>,
    /// How the helpers reach a TLS cluster's nodes; None for plain text.
    tls: Option<redis::TlsCertificates>,
}

impl Cluster {
    /// The password of a TLS cluster's default user (`requirepass`, and `masterauth` for its
    /// replicas): only the helpers use it, so a client must log in as a user of its own.
    pub const TLS_ADMIN_PASSWORD: &'static str = "cluster-admin-pw";

    /// `masters` masters (at least 3: a cluster needs a majority of masters to fail one over)
    /// with `replicas` replicas each; returns once every node says `cluster_state:ok`, agrees on
    /// who serves every slot, and every replica is in sync with its master.
    pub fn start(masters: usize, replicas: usize) -> Cluster {
        Self::start_with(masters, replicas, &[])
    }

    /// The same, with extra `redis-server` arguments for every node (like
    /// `--cluster-require-full-coverage no`).
    pub fn start_with(masters: usize, replicas: usize, extra: &[&str]) -> Cluster {
        let args = node_args(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let nodes: Vec<ClusterNode> = (0..masters * (1 + replicas))
            .map(|_| ClusterNode {
                server: RedisServer::start_with(&args),
                down: false,
            })
            .collect();
        Self::create(nodes, replicas, &[], None)
    }

    /// The same cluster speaking only TLS with `tls`'s server certificate: plain-text port 0,
    /// client certificates required (`--tls-auth-clients yes`), the cluster bus and replication
    /// over TLS, each node presenting the client certificate on its own outgoing links (the
    /// server certificate is for serverAuth only, and peers verify it as a client's). The
    /// default user needs `TLS_ADMIN_PASSWORD`. Every helper of this type speaks TLS to it.
    pub fn start_tls(masters: usize, replicas: usize, tls: &TlsFiles, extra: &[&str]) -> Cluster {
        let s = |p: &std::path::Path| p.display().to_string();
        let read = |p: &std::path::Path| std::fs::read(p).expect("reading a test certificate");
        let certs = redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read(&tls.client_cert),
                client_key: read(&tls.client_key),
            }),
            root_cert: Some(read(&tls.ca)),
        };
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut base = node_args(extra);
        base.extend(
            [
                "--tls-cluster",
                "yes",
                "--tls-replication",
                "yes",
                "--tls-client-cert-file",
                &s(&tls.client_cert),
                "--tls-client-key-file",
                &s(&tls.client_key),
                "--requirepass",
                Self::TLS_ADMIN_PASSWORD,
                "--masterauth",
                Self::TLS_ADMIN_PASSWORD,
            ]
            .map(String::from),
        );
        let nodes: Vec<ClusterNode> = (0..masters * (1 + replicas))
            .map(|_| ClusterNode {
                server: start_tls_node(tls, &base, &certs),
                down: false,
            })
            .collect();
        let cli: Vec<String> = [
            "--tls".into(),
            "--cacert".into(),
            s(&tls.ca),
            "--cert".into(),
            s(&tls.client_cert),
            "--key".into(),
            s(&tls.client_key),
            "-a".into(),
            Self::TLS_ADMIN_PASSWORD.into(),
            "--no-auth-warning".into(),
        ]
        .into();
        Self::create(nodes, replicas, &cli, Some(certs))
    }

    /// `redis-cli --cluster create` over `nodes` (`cli` before it: TLS and the password), then
    /// waits until the cluster is stable.
    fn create(
        nodes: Vec<ClusterNode>,
        replicas: usize,
        cli: &[String],
        tls: Option<redis::TlsCertificates>,
    ) -> Cluster {
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.server.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(cli)
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("running redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Cluster { nodes, tls };
        cluster.wait_stable(Duration::from_secs(20));
        cluster
    }

    /// Every node's port, masters and replicas, down or not.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.server.port).collect()
    }

    /// Seed URLs for pacer: every node, comma-separated (`rediss://` on a TLS cluster, without
    /// credentials).
    pub fn urls(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        self.ports()
            .iter()
            .map(|p| format!("{scheme}://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A blocking connection straight to the node on `port` (no redirections followed); on a
    /// TLS cluster, over TLS as the default user.
    pub fn con(&self, port: u16) -> redis::Connection {
        self.try_con(port)
            .unwrap_or_else(|e| panic!("connecting to cluster node {port}: {e}"))
    }

    /// `con`, or why not. A TLS connection gives up after 2 s (the handshake waits on the node).
    fn try_con(&self, port: u16) -> redis::RedisResult<redis::Connection> {
        match &self.tls {
            None => self.node(port).server.client().get_connection(),
            Some(certs) => tls_con(port, certs),
        }
    }

    fn node(&self, port: u16) -> &ClusterNode {
        self.nodes
            .iter()
            .find(|n| n.server.port == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    fn node_mut(&mut self, port: u16) -> &mut ClusterNode {
        self.nodes
            .iter_mut()
            .find(|n| n.server.port == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| !n.down)
            .map(|n| n.server.port)
            .collect()
    }

    /// `CLUSTER NODES` as the node on `port` sees it.
    pub fn topology_from(&self, port: u16) -> redis::RedisResult<Vec<NodeInfo>> {
        let mut con = self.try_con(port)?;
        let text: String = redis::cmd("CLUSTER").arg("NODES").query(&mut con)?;
        Ok(parse_nodes(&text))
    }

    /// `CLUSTER NODES` from the first live node that answers.
    pub fn topology(&self) -> Vec<NodeInfo> {
        self.live_ports()
            .into_iter()
            .find_map(|p| self.topology_from(p).ok())
            .expect("no live cluster node answers CLUSTER NODES")
    }

    /// Ports of the masters that serve slots.
    pub fn masters(&self) -> Vec<u16> {
        self.topology()
            .into_iter()
            .filter(|n| n.master && !n.slots.is_empty())
            .map(|n| n.port)
            .collect()
    }

    /// Ports of the replicas of the master on `port`, as any live node remembers them (the
    /// master itself may be dead).
    pub fn replicas_of(&self, port: u16) -> Vec<u16> {
        let topology = self.topology();
        let Some(id) = topology
            .iter()
            .find(|n| n.port == port)
            .map(|n| n.id.clone())
        else {
            return Vec::new();
        };
        topology
            .into_iter()
            .filter(|n| n.master_id.as_deref() == Some(id.as_str()))
            .map(|n| n.port)
            .collect()
    }

    /// The port of the master serving `slot`.
    pub fn slot_owner(&self, slot: u16) -> u16 {
        self.topology()
            .into_iter()
            .find(|n| n.master && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .map(|n| n.port)
            .unwrap_or_else(|| panic!("no master serves slot {slot}"))
    }

    /// The port of the master serving `key`.
    pub fn owner_of(&self, key: &str) -> u16 {
        self.slot_owner(key_slot(key))
    }

    /// How many of `keys` each master serves now, in the order of `masters()`.
    pub fn count_per_master<'a>(&self, keys: impl IntoIterator<Item = &'a str>) -> Vec<usize> {
        let masters = self.masters();
        let mut counts = vec![0; masters.len()];
        for key in keys {
            let owner = self.owner_of(key);
            if let Some(i) = masters.iter().position(|&m| m == owner) {
                counts[i] += 1;
            }
        }
        counts
    }

    /// The server of the master serving `key` now, to read or write `key` on it directly (on a
    /// plain cluster: its `con()` speaks plain text; use `con(owner_of(key))` on a TLS one).
    pub fn server_of(&self, key: &str) -> &RedisServer {
        &self.node(self.owner_of(key)).server
    }

    /// A name `<prefix><n>` whose `{hash tag}` (the whole name) lands on the master on `port`.
    pub fn name_on(&self, port: u16, prefix: &str) -> String {
        let slots = self
            .topology()
            .into_iter()
            .find(|n| n.port == port)
            .map(|n| n.slots)
            .unwrap_or_default();
        assert!(!slots.is_empty(), "node {port} serves no slots");
        (0..)
            .map(|i| format!("{prefix}{i}"))
            .find(|name| {
                let slot = key_slot(name);
                slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
            })
            .expect("some name lands on every master")
    }

    /// A hash tag (`t0`, `t1`, ...) whose keys land on each master, in `masters()` order.
    pub fn tag_per_master(&self) -> Vec<(u16, String)> {
        let masters = self.masters();
        let mut found: BTreeMap<u16, String> = BTreeMap::new();
        for i in 0.. {
            let tag = format!("t{i}");
            found.entry(self.owner_of(&tag)).or_insert(tag);
            if found.len() == masters.len() {
                break;
            }
        }
        masters
            .into_iter()
            .map(|m| (m, found[&m].clone()))
            .collect()
    }

    /// SIGKILLs the node on `port` (it stays down until `restart`).
    pub fn kill(&mut self, port: u16) {
        let node = self.node_mut(port);
        node.server.kill();
        node.down = true;
    }

    /// Starts a killed node again with its `nodes.conf`: it rejoins under its old identity (a
    /// failed-over master comes back as a replica of its successor). Waits until it is back.
    pub fn restart(&mut self, port: u16) {
        let node = self.node_mut(port);
        node.server.respawn();
        node.down = false;
        let ok = wait_until(Duration::from_secs(10), || {
            self.cluster_info(port)
                .is_some_and(|i| i.contains("cluster_state:ok"))
        });
        assert!(ok, "node {port} did not rejoin the cluster");
    }

    /// Freezes (SIGSTOP) the node on `port`: a replica stops replicating, a master stops
    /// answering. `resume` thaws it.
    pub fn pause(&self, port: u16) {
        self.node(port).server.pause();
    }

    pub fn resume(&self, port: u16) {
        self.node(port).server.resume();
    }

    /// `CLUSTER FAILOVER` (graceful: the master stops writes until the replica has caught up)
    /// or `CLUSTER FAILOVER TAKEOVER` (no agreement asked, no catch-up) on the replica on
    /// `replica`; returns once every live node names it master of its slots.
    pub fn failover(&self, replica: u16, takeover: bool) {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("FAILOVER");
        if takeover {
            cmd.arg("TAKEOVER");
        }
        let _: () = cmd.query(&mut self.con(replica)).expect("CLUSTER FAILOVER");
        let ok = wait_until(Duration::from_secs(10), || {
            self.masters().contains(&replica) && self.agreed()
        });
        assert!(ok, "replica {replica} was not promoted");
    }

    /// Waits until a replica of the killed master on `old` has taken its slots and every live
    /// node agrees; returns the new master's port.
    pub fn wait_promoted(&self, old: u16, limit: Duration) -> Option<u16> {
        let replicas = self.replicas_of(old);
        let mut promoted = None;
        wait_until(limit, || {
            promoted = self.masters().into_iter().find(|m| replicas.contains(m));
            promoted.is_some() && self.agreed()
        })
        .then_some(promoted)
        .flatten()
    }

    /// Moves `slot` from its master to the master on `to`, the way `redis-cli --cluster
    /// reshard` does: `SETSLOT IMPORTING` on the target, `MIGRATING` on the source, then
    /// `GETKEYSINSLOT` + `MIGRATE` in batches of `batch` keys with `pause` between batches (so a
    /// test can run traffic while the slot is split), then `SETSLOT NODE` on the target, the
    /// source and every other master. Returns the number of keys moved. Plain clusters only
    /// (its MIGRATE sends no password).
    pub fn move_slot(&self, slot: u16, to: u16, batch: usize, pause: Duration) -> usize {
        let from = self.slot_owner(slot);
        assert_ne!(from, to, "slot {slot} is already on {to}");
        let topology = self.topology();
        let id = |port: u16| {
            topology
                .iter()
                .find(|n| n.port == port)
                .map(|n| n.id.clone())
                .expect("a node id")
        };
        let (from_id, to_id) = (id(from), id(to));
        let setslot = |port: u16, state: &str, node: Option<&str>| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SETSLOT").arg(slot).arg(state);
            if let Some(node) = node {
                cmd.arg(node);
            }
            let _: () = cmd.query(&mut self.con(port)).expect("CLUSTER SETSLOT");
        };
        setslot(to, "IMPORTING", Some(&from_id));
        setslot(from, "MIGRATING", Some(&to_id));
        let mut source = self.con(from);
        let mut moved = 0;
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(batch)
                .query(&mut source)
                .expect("CLUSTER GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            let _: () = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query(&mut source)
                .expect("MIGRATE");
            moved += keys.len();
            std::thread::sleep(pause);
        }
        // The target first: once the source says NODE, clients are sent to the target, which
        // must already own the slot.
        setslot(to, "NODE", Some(&to_id));
        setslot(from, "NODE", Some(&to_id));
        for master in self.masters() {
            if master != to && master != from {
                setslot(master, "NODE", Some(&to_id));
            }
        }
        let ok = wait_until(Duration::from_secs(10), || {
            self.slot_owner(slot) == to && self.agreed()
        });
        assert!(ok, "slot {slot} did not settle on {to}");
        moved
    }

    fn cluster_info(&self, port: u16) -> Option<String> {
        let mut con = self.try_con(port).ok()?;
        redis::cmd("CLUSTER").arg("INFO").query(&mut con).ok()
    }

    /// Whether every live node says `cluster_state:ok` and all name the same master for every
    /// slot.
    pub fn agreed(&self) -> bool {
        let mut views = Vec::new();
        for port in self.live_ports() {
            if !self
                .cluster_info(port)
                .is_some_and(|i| i.contains("cluster_state:ok"))
            {
                return false;
            }
            let Ok(topology) = self.topology_from(port) else {
                return false;
            };
            let mut owners: Vec<(u16, u16, u16)> = topology
                .iter()
                .filter(|n| n.master && !n.failed)
                .flat_map(|n| n.slots.iter().map(move |&(a, b)| (a, b, n.port)))
                .collect();
            owners.sort();
            views.push(owners);
        }
        views.windows(2).all(|w| w[0] == w[1])
    }

    /// Waits until `agreed()` and every live replica's link to its master is up.
    pub fn wait_stable(&self, limit: Duration) {
        let ok = wait_until(limit, || {
            self.agreed()
                && self.live_ports().into_iter().all(|p| {
                    let Ok(mut con) = self.try_con(p) else {
                        return false;
                    };
                    let info: String = redis::cmd("INFO")
                        .arg("replication")
                        .query(&mut con)
                        .unwrap_or_default();
                    info.contains("role:master") || info.contains("master_link_status:up")
                })
        });
        assert!(ok, "the cluster did not settle within {limit:?}");
    }
}

/// Every node's arguments: cluster mode, `extra` last.
fn node_args(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        &NODE_TIMEOUT_MS.to_string(),
        // A replica may be promoted however stale its data looks: tests fail over right
        // after start, before the replica has a long history with its master.
        "--cluster-replica-validity-factor",
        "0",
        // Replicas stay with their masters, so tests know who replicates whom.
        "--cluster-allow-replica-migration",
        "no",
    ]
    .map(String::from)
    .into();
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// A blocking TLS connection to 127.0.0.1:`port` with `certs`, as the default user with
/// `Cluster::TLS_ADMIN_PASSWORD`.
fn tls_con(port: u16, certs: &redis::TlsCertificates) -> redis::RedisResult<redis::Connection> {
    let url = format!("rediss://:{}@127.0.0.1:{port}", Cluster::TLS_ADMIN_PASSWORD);
    redis::Client::build_with_tls(url, certs.clone())?
        .get_connection_with_timeout(Duration::from_secs(2))
}

/// A TLS-only cluster node on a free port whose bus port (+10000) is free and valid too
/// (Redis refuses a port above 55535 without `--cluster-port`), once it answers a TLS PING
/// (`started_on_a_free_port`).
fn start_tls_node(tls: &TlsFiles, base: &[String], certs: &redis::TlsCertificates) -> RedisServer {
    started_on_a_free_port(|| {
        let port = (0..100)
            .map(|_| free_port())
            .find(|&p| p <= 55535 && TcpListener::bind(("127.0.0.1", p + 10000)).is_ok())
            .expect("a free port whose bus port is free");
        let mut args = tls.server_args(port, true);
        args.extend_from_slice(base);
        let mut server = RedisServer::spawn_on(port, &args);
        let answers = || {
            tls_con(port, certs)
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok()
        };
        match came_up(|| server.is_running(), answers) {
            Ok(()) => Ok(server),
            Err(why) => Err(format!(
                "TLS cluster node on port {port} did not start ({why}); its log ends:\n{}",
                server.log_tail()
            )),
        }
    })
}

/// Parses `CLUSTER NODES`: `<id> <ip:port@cport[,host]> <flags> <master> <ping> <pong> <epoch>
/// <link> <slot>...`, where a slot is `n` or `a-b` (migration markers `[...]` are skipped).
pub fn parse_nodes(text: &str) -> Vec<NodeInfo> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            let addr = fields[1].split(['@', ',']).next()?;
            let port = addr.rsplit(':').next()?.parse().ok()?;
            let flags = fields[2];
            let slots = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            Some(NodeInfo {
                id: fields[0].to_string(),
                port,
                master: flags.contains("master"),
                master_id: (fields[3] != "-").then(|| fields[3].to_string()),
                failed: flags.contains("fail"),
                slots,
            })
        })
        .collect()
}
