//! Redis Sentinel for tests: one master, one replica (or more) and three sentinels
//! (`redis-server --sentinel`) on free loopback ports, with a short `down-after-milliseconds` and
//! `failover-timeout` so that a killed master is replaced in a few seconds. Everything is killed
//! on drop.

use super::{free_port, wait_until, RedisServer, TempDir};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const MASTER_NAME: &str = "pacer-master";

/// How long a node must not answer before a sentinel holds it down. 2 s, not 1: on two loaded
/// cores (the whole suite running) a promoted master was once held down for a second after its
/// promotion and failed over again, to the old master just restarted, which the failover test
/// then read as its promoted node turned replica.
const DOWN_AFTER_MS: u64 = 2000;

/// A sentinel process, killed on drop.
struct SentinelProc {
    child: Child,
    port: u16,
    _dir: TempDir,
}

impl Drop for SentinelProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Sentinels {
    /// The data nodes, master first at start; `kill_master` kills whichever is master then.
    pub servers: Vec<RedisServer>,
    sentinels: Vec<SentinelProc>,
    pub master_name: String,
}

impl Sentinels {
    /// One master, one replica, three sentinels: see `start_with`.
    pub fn start() -> Sentinels {
        Self::start_with(1)
    }

    /// Starts the master, `replicas` replicas (in sync before the sentinels start, so they find
    /// them at once), then three sentinels (quorum 2), and waits until every sentinel knows the
    /// replicas and the two other sentinels: a failover needs both.
    pub fn start_with(replicas: usize) -> Sentinels {
        let master = RedisServer::start();
        let master_port = master.port.to_string();
        let mut servers = vec![master];
        for _ in 0..replicas {
            let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &master_port]);
            let synced = wait_until(Duration::from_secs(10), || {
                info(&replica, "replication").contains("master_link_status:up")
            });
            assert!(synced, "a replica did not sync with the master");
            servers.push(replica);
        }
        let sentinels = (0..3)
            .map(|_| {
                let dir = TempDir::new("sentinel");
                let port = free_port();
                // Sentinel rewrites its config file, so it must be a writable file of its own.
                let conf = dir.write(
                    "sentinel.conf",
                    &format!(
                        "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                         sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
                         sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n\
                         sentinel failover-timeout {MASTER_NAME} 3000\n\
                         sentinel parallel-syncs {MASTER_NAME} 1\n",
                        dir = dir.path().display()
                    ),
                );
                let child = Command::new("redis-server")
                    .arg(&conf)
                    .arg("--sentinel")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("starting redis-server --sentinel");
                SentinelProc {
                    child,
                    port,
                    _dir: dir,
                }
            })
            .collect();
        let s = Sentinels {
            servers,
            sentinels,
            master_name: MASTER_NAME.into(),
        };
        let ready = wait_until(Duration::from_secs(20), || {
            s.sentinels.iter().all(|p| {
                let fields = sentinel_master(p.port);
                fields.get("num-other-sentinels").map(String::as_str) == Some("2")
                    && fields.get("num-slaves") == Some(&replicas.to_string())
            })
        });
        assert!(
            ready,
            "the sentinels did not find each other and the replica"
        );
        s
    }

    /// The sentinels' URLs, comma-separated: pacer's `redis.url` in sentinel mode.
    pub fn urls(&self) -> String {
        self.sentinel_ports()
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|s| s.port).collect()
    }

    /// The master's port as the first sentinel that answers names it.
    pub fn master_port(&self) -> Option<u16> {
        master_port_of(&self.sentinel_ports())
    }

    /// The data node on `port`.
    pub fn server(&self, port: u16) -> &RedisServer {
        self.servers
            .iter()
            .find(|s| s.port == port)
            .unwrap_or_else(|| panic!("no data node on port {port}"))
    }

    /// SIGKILLs the current master; returns its port.
    pub fn kill_master(&mut self) -> u16 {
        let port = self.master_port().expect("a master");
        self.servers
            .iter_mut()
            .find(|s| s.port == port)
            .expect("the master is one of ours")
            .kill();
        port
    }

    /// `SENTINEL FAILOVER`: the sentinels promote a replica without the master failing. Returns
    /// the new master's port once a sentinel names it and it says it is one. The old master
    /// keeps running as a master until the sentinels convert it to a replica, several seconds
    /// later.
    pub fn failover(&self) -> u16 {
        let old = self.master_port().expect("a master");
        let port = self.sentinels[0].port;
        let _: () = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .and_then(|c| c.get_connection())
            .and_then(|mut con| {
                redis::cmd("SENTINEL")
                    .arg("FAILOVER")
                    .arg(MASTER_NAME)
                    .query(&mut con)
            })
            .expect("SENTINEL FAILOVER");
        self.wait_new_master(old, Duration::from_secs(10))
            .expect("a new master after SENTINEL FAILOVER")
    }

    /// Waits until some data node replicates from the master on `master` with its link up.
    pub fn wait_replica_of(&self, master: u16, limit: Duration) -> bool {
        wait_until(limit, || {
            self.servers.iter().any(|s| {
                let info = info(s, "replication");
                info.contains(&format!("master_port:{master}\r\n"))
                    && info.contains("master_link_status:up")
            })
        })
    }

    /// Waits until a sentinel names a master other than `old` and that node says it is one;
    /// its port.
    pub fn wait_new_master(&self, old: u16, limit: Duration) -> Option<u16> {
        let mut found = None;
        wait_until(limit, || {
            found = self.master_port().filter(|&p| {
                p != old && info(self.server(p), "replication").contains("role:master")
            });
            found.is_some()
        })
        .then_some(found)
        .flatten()
    }

    /// Waits until every sentinel names `master` and none is still failing over.
    ///
    /// Every sentinel, not the first that answers: one still on the old configuration takes
    /// the promoted node for a replica that claims to be master, and once the old master is
    /// back (a restart without persistence brings it back empty, as a master) it turns the
    /// promoted node into that empty node's replica, wiping its data. So a test restarts an
    /// old master only once this holds.
    pub fn wait_agreed(&self, master: u16, limit: Duration) -> bool {
        wait_until(limit, || {
            self.sentinel_ports().into_iter().all(|p| {
                let view = sentinel_master(p);
                view.get("port") == Some(&master.to_string())
                    && view
                        .get("flags")
                        .is_some_and(|f| !f.contains("failover_in_progress"))
            })
        })
    }
}

/// The master's port as the first of the sentinels on `sentinel_ports` that answers names it:
/// for a thread that cannot borrow the `Sentinels` (a producer following failovers).
pub fn master_port_of(sentinel_ports: &[u16]) -> Option<u16> {
    sentinel_ports.iter().find_map(|p| {
        let mut con = redis::Client::open(format!("redis://127.0.0.1:{p}"))
            .ok()?
            .get_connection()
            .ok()?;
        let (_host, port): (String, u16) = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(MASTER_NAME)
            .query(&mut con)
            .ok()?;
        Some(port)
    })
}

fn info(server: &RedisServer, section: &str) -> String {
    server
        .client()
        .get_connection()
        .and_then(|mut con| redis::cmd("INFO").arg(section).query(&mut con))
        .unwrap_or_default()
}

/// `SENTINEL MASTER <name>` as a map (empty when the sentinel does not answer yet).
fn sentinel_master(port: u16) -> std::collections::HashMap<String, String> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .and_then(|c| c.get_connection())
        .and_then(|mut con| {
            redis::cmd("SENTINEL")
                .arg("MASTER")
                .arg(MASTER_NAME)
                .query(&mut con)
        })
        .unwrap_or_default()
}
