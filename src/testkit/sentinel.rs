//! Redis Sentinel for tests: one master, one replica (or more) and three sentinels
//! (`redis-server --sentinel`) on free loopback ports, with a short `down-after-milliseconds` and
//! `failover-timeout` so that a killed master is replaced in a few seconds. Everything is killed
//! on drop.
//!
//! `start_tls` makes the same set-up secured: every node (data nodes and sentinels) speaks only
//! TLS and requires a client certificate, their links to each other included, and none has a
//! usable `default` user. The data nodes know `admin` (the test's own, every permission),
//! `replicator` (replication), `sentinel` (what Redis's docs give sentinels on the nodes they
//! monitor) and the caller's users; the sentinels know `admin`, `peer` (for each other) and the
//! caller's. The helpers below reach either set-up (`Access`).

use super::{
    came_up, free_port, log_tail, started_on_a_free_port, wait_until, RedisServer, TempDir,
    TlsFiles,
};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const MASTER_NAME: &str = "pacer-master";

/// How long a node must not answer before a sentinel holds it down. 2 s, not 1: on two loaded
/// cores (the whole suite running) a promoted master was once held down for a second after its
/// promotion and failed over again, to the old master just restarted, which the failover test
/// then read as its promoted node turned replica.
const DOWN_AFTER_MS: u64 = 2000;

/// The secured set-up's own users (name, password): fixed, these are throwaway test nodes.
const ADMIN: (&str, &str) = ("admin", "admin-pw");
const REPLICATOR: (&str, &str) = ("replicator", "replicator-pw");
const SENTINEL_ON_DATA: (&str, &str) = ("sentinel", "sentinel-pw");
const PEER: (&str, &str) = ("peer", "peer-pw");

/// A sentinel's log file, in its own directory.
const SENTINEL_LOG: &str = "sentinel.log";

/// A sentinel process, killed on drop.
struct SentinelProc {
    child: Child,
    port: u16,
    dir: TempDir,
}

impl SentinelProc {
    fn log_tail(&self) -> String {
        log_tail(&self.dir.path().join(SENTINEL_LOG), 8)
    }
}

impl Drop for SentinelProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How the helpers reach a node: plain and open, or TLS with the client certificate as `admin`.
#[derive(Clone, Default)]
struct Access {
    tls: Option<redis::TlsCertificates>,
}

impl Access {
    fn for_tls(files: &TlsFiles) -> Access {
        let read = |p: &std::path::Path| std::fs::read(p).expect("reading a test certificate");
        let _ = rustls::crypto::ring::default_provider().install_default();
        Access {
            tls: Some(redis::TlsCertificates {
                client_tls: Some(redis::ClientTlsConfig {
                    client_cert: read(&files.client_cert),
                    client_key: read(&files.client_key),
                }),
                root_cert: Some(read(&files.ca)),
            }),
        }
    }

    fn con(&self, port: u16) -> redis::RedisResult<redis::Connection> {
        match &self.tls {
            None => redis::Client::open(format!("redis://127.0.0.1:{port}"))?.get_connection(),
            // Bounded: a node killed or frozen must not hang a helper's wait loop.
            Some(certs) => redis::Client::build_with_tls(
                format!("rediss://{}:{}@127.0.0.1:{port}", ADMIN.0, ADMIN.1),
                certs.clone(),
            )?
            .get_connection_with_timeout(Duration::from_secs(2)),
        }
    }

    /// Whether the node on `port` answers a PING.
    fn ping(&self, port: u16) -> bool {
        self.con(port)
            .and_then(|mut con| redis::cmd("PING").query::<String>(&mut con))
            .is_ok()
    }

    fn info(&self, port: u16, section: &str) -> String {
        self.con(port)
            .and_then(|mut con| redis::cmd("INFO").arg(section).query(&mut con))
            .unwrap_or_default()
    }

    /// `SENTINEL MASTER <name>` as a map (empty when the sentinel does not answer yet).
    fn sentinel_master(&self, port: u16) -> std::collections::HashMap<String, String> {
        self.con(port)
            .and_then(|mut con| {
                redis::cmd("SENTINEL")
                    .arg("MASTER")
                    .arg(MASTER_NAME)
                    .query(&mut con)
            })
            .unwrap_or_default()
    }

    fn master_port_of(&self, sentinel_ports: &[u16]) -> Option<u16> {
        sentinel_ports.iter().find_map(|&p| {
            let (_host, port): (String, u16) = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(MASTER_NAME)
                .query(&mut self.con(p).ok()?)
                .ok()?;
            Some(port)
        })
    }
}

/// What `start_tls` adds to a node's and a sentinel's configuration.
struct Secured<'a> {
    tls: &'a TlsFiles,
    data_users: &'a [&'a str],
    sentinel_users: &'a [&'a str],
}

/// Starts a sentinel monitoring the master on `master_port` on a free port, once it answers
/// (`started_on_a_free_port`).
fn start_sentinel(access: &Access, secured: Option<&Secured>, master_port: u16) -> SentinelProc {
    started_on_a_free_port(|| {
        let dir = TempDir::new("sentinel");
        let port = free_port();
        let logfile = format!("logfile {}\n", dir.path().join(SENTINEL_LOG).display());
        let (listen, secured_lines) = match secured {
            None => (format!("port {port}\n{logfile}"), String::new()),
            Some(s) => (logfile, s.sentinel_lines(port)),
        };
        // Sentinel rewrites its config file, so it must be a writable file of its own.
        let conf = dir.write(
            "sentinel.conf",
            &format!(
                "{listen}bind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
                 sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n\
                 sentinel failover-timeout {MASTER_NAME} 3000\n\
                 sentinel parallel-syncs {MASTER_NAME} 1\n{secured_lines}",
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
        let mut sentinel = SentinelProc { child, port, dir };
        let up = came_up(
            || matches!(sentinel.child.try_wait(), Ok(None)),
            || access.ping(port),
        );
        match up {
            Ok(()) => Ok(sentinel),
            Err(why) => Err(format!(
                "a sentinel on port {port} did not start ({why}); its log ends:\n{}",
                sentinel.log_tail()
            )),
        }
    })
}

impl Secured<'_> {
    /// TLS on `port` only, client certificates required; outgoing links (replication) in TLS
    /// with the client certificate, since the server's is for serverAuth only.
    fn tls_lines(&self, port: u16) -> Vec<(String, String)> {
        let mut lines: Vec<(String, String)> = self
            .tls
            .server_args(port, true)
            .chunks(2)
            .map(|kv| (kv[0].trim_start_matches("--").to_string(), kv[1].clone()))
            .collect();
        let s = |p: &std::path::Path| p.display().to_string();
        lines.extend([
            ("tls-replication".into(), "yes".into()),
            ("tls-client-cert-file".into(), s(&self.tls.client_cert)),
            ("tls-client-key-file".into(), s(&self.tls.client_key)),
        ]);
        lines
    }

    /// `redis-server` arguments of a data node on `port`, replicating `replicaof` if any.
    fn data_args(&self, port: u16, replicaof: Option<u16>) -> Vec<String> {
        let mut args: Vec<String> = Vec::new();
        for (k, v) in self.tls_lines(port) {
            args.extend([format!("--{k}"), v]);
        }
        let mut users = vec![
            "default off".to_string(),
            format!("{} on >{} allkeys allchannels +@all", ADMIN.0, ADMIN.1),
            format!(
                "{} on >{} -@all +psync +replconf +ping",
                REPLICATOR.0, REPLICATOR.1
            ),
            format!(
                "{} on >{} allchannels -@all +multi +slaveof +ping +exec +subscribe \
                 +config|rewrite +role +publish +info +client|setname +client|kill +script|kill",
                SENTINEL_ON_DATA.0, SENTINEL_ON_DATA.1
            ),
        ];
        users.extend(self.data_users.iter().map(|u| u.to_string()));
        for user in users {
            args.push("--user".into());
            args.extend(user.split_whitespace().map(str::to_string));
        }
        args.extend(
            [
                "--masteruser",
                REPLICATOR.0,
                "--masterauth",
                REPLICATOR.1,
                // Redis 7 waits 5 s by default for more replicas before a full sync.
                "--repl-diskless-sync-delay",
                "0",
            ]
            .map(String::from),
        );
        if let Some(master) = replicaof {
            args.extend(["--replicaof".into(), format!("127.0.0.1 {master}")]);
        }
        args
    }

    /// Starts a data node on a free port once it answers (`started_on_a_free_port`).
    fn start_data_node(&self, access: &Access, replicaof: Option<u16>) -> RedisServer {
        started_on_a_free_port(|| {
            let port = free_port();
            let mut server = RedisServer::spawn_on(port, &self.data_args(port, replicaof));
            match came_up(|| server.is_running(), || access.ping(port)) {
                Ok(()) => Ok(server),
                Err(why) => Err(format!(
                    "a TLS data node on port {port} did not start ({why}); its log ends:\n{}",
                    server.log_tail()
                )),
            }
        })
    }

    /// sentinel.conf lines for a sentinel on `port`.
    fn sentinel_lines(&self, port: u16) -> String {
        let mut text: String = self
            .tls_lines(port)
            .into_iter()
            .map(|(k, v)| format!("{k} {v}\n"))
            .collect();
        text += &format!(
            "user default off\n\
             user {} on >{} allchannels +@all\n\
             user {} on >{} allchannels +@all\n\
             sentinel auth-user {MASTER_NAME} {}\nsentinel auth-pass {MASTER_NAME} {}\n\
             sentinel sentinel-user {}\nsentinel sentinel-pass {}\n",
            ADMIN.0,
            ADMIN.1,
            PEER.0,
            PEER.1,
            SENTINEL_ON_DATA.0,
            SENTINEL_ON_DATA.1,
            PEER.0,
            PEER.1
        );
        for user in self.sentinel_users {
            text += &format!("user {user}\n");
        }
        text
    }
}

pub struct Sentinels {
    /// The data nodes, master first at start; `kill_master` kills whichever is master then.
    pub servers: Vec<RedisServer>,
    sentinels: Vec<SentinelProc>,
    pub master_name: String,
    access: Access,
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
        Self::start_inner(replicas, None)
    }

    /// Like `start_with`, every node secured (see the module's notes) with `tls`'s
    /// certificates. `data_users` are further ACL users on every data node (ACL is not
    /// replicated: a promoted replica must have them too), `sentinel_users` on every sentinel,
    /// each as an `ACL SETUSER` line's arguments (`pacer on >pw ~pacer* +ping ...`).
    pub fn start_tls(
        replicas: usize,
        tls: &TlsFiles,
        data_users: &[&str],
        sentinel_users: &[&str],
    ) -> Sentinels {
        Self::start_inner(
            replicas,
            Some(&Secured {
                tls,
                data_users,
                sentinel_users,
            }),
        )
    }

    fn start_inner(replicas: usize, secured: Option<&Secured>) -> Sentinels {
        let access = secured.map_or_else(Access::default, |s| Access::for_tls(s.tls));
        let start_node = |replicaof: Option<u16>| match (secured, replicaof) {
            (Some(s), _) => s.start_data_node(&access, replicaof),
            (None, None) => RedisServer::start(),
            (None, Some(master)) => {
                RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.to_string()])
            }
        };
        let master = start_node(None);
        let master_port = master.port;
        let mut servers = vec![master];
        for _ in 0..replicas {
            let replica = start_node(Some(master_port));
            let synced = wait_until(Duration::from_secs(10), || {
                access
                    .info(replica.port, "replication")
                    .contains("master_link_status:up")
            });
            assert!(synced, "a replica did not sync with the master");
            servers.push(replica);
        }
        let sentinels = (0..3)
            .map(|_| start_sentinel(&access, secured, master_port))
            .collect();
        let s = Sentinels {
            servers,
            sentinels,
            master_name: MASTER_NAME.into(),
            access,
        };
        let found = |p: &SentinelProc| {
            let fields = s.access.sentinel_master(p.port);
            (
                fields
                    .get("num-other-sentinels")
                    .cloned()
                    .unwrap_or_default(),
                fields.get("num-slaves").cloned().unwrap_or_default(),
            )
        };
        let ready = wait_until(Duration::from_secs(30), || {
            s.sentinels
                .iter()
                .all(|p| found(p) == ("2".to_string(), replicas.to_string()))
        });
        if !ready {
            // What each one saw, and the end of its log: the next failure says why.
            let seen: Vec<String> = s
                .sentinels
                .iter()
                .map(|p| {
                    let (others, slaves) = found(p);
                    format!(
                        "sentinel on port {}: {others:?} other sentinels, {slaves:?} replicas; \
                         its log ends:\n{}",
                        p.port,
                        p.log_tail()
                    )
                })
                .collect();
            panic!(
                "the sentinels did not find each other and the {replicas} replica(s) in 30 s\n{}",
                seen.join("\n")
            );
        }
        s
    }

    /// The sentinels' URLs, comma-separated: pacer's `redis.url` in sentinel mode (`rediss://`
    /// for a `start_tls` set-up).
    pub fn urls(&self) -> String {
        let scheme = if self.access.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        self.sentinel_ports()
            .iter()
            .map(|p| format!("{scheme}://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|s| s.port).collect()
    }

    /// A connection to the node (data node or sentinel) on `port`: plain, or for a `start_tls`
    /// set-up TLS with the client certificate as the set-up's admin user.
    pub fn con(&self, port: u16) -> redis::Connection {
        self.access
            .con(port)
            .unwrap_or_else(|e| panic!("connecting to the node on port {port}: {e}"))
    }

    /// The master's port as the first sentinel that answers names it.
    pub fn master_port(&self) -> Option<u16> {
        self.access.master_port_of(&self.sentinel_ports())
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
        let _: () = self
            .access
            .con(port)
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
                let info = self.access.info(s.port, "replication");
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
                p != old
                    && self
                        .access
                        .info(self.server(p).port, "replication")
                        .contains("role:master")
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
                let view = self.access.sentinel_master(p);
                view.get("port") == Some(&master.to_string())
                    && view
                        .get("flags")
                        .is_some_and(|f| !f.contains("failover_in_progress"))
            })
        })
    }
}

/// The master's port as the first of the sentinels on `sentinel_ports` that answers names it:
/// for a thread that cannot borrow the `Sentinels` (a producer following failovers). Plain
/// sentinels only.
pub fn master_port_of(sentinel_ports: &[u16]) -> Option<u16> {
    Access::default().master_port_of(sentinel_ports)
}
