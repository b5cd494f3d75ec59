//! Support for tests and the benchmark: a real `redis-server` on a free loopback port (installed
//! with apt-get when missing), pacer processes, scratch directories. Not used by the daemon.
//!
//! Production-shaped Redis lives in the submodules: a Redis Cluster with replicas (`cluster`),
//! a master, a replica and three sentinels (`sentinel`), certificates and a TLS-only server
//! (`tls`), and a wall clock a test can step (`clock_shift`).
//!
//! Over 400 lines: the process-level kit (redis-server, pacer processes, ports, temporary
//! directories), many small helpers.

mod clock_shift;
mod cluster;
mod proxy;
mod sentinel;
mod tls;

pub use clock_shift::ClockShift;
pub use cluster::{Cluster, ClusterNode, NodeInfo};
pub use proxy::BlackHoleProxy;
pub use sentinel::{master_port_of, Sentinels};
pub use tls::TlsFiles;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

/// A scratch directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "pacer-{label}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("creating a scratch directory");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `text` to `name` inside the directory.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("writing a scratch file");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How many times the Redis behind `con` has run `command` (lowercase, as `INFO
/// commandstats` names it: `fcall`, `evalsha`), refused calls not counted.
pub fn command_calls(con: &mut impl redis::ConnectionLike, command: &str) -> u64 {
    command_stat(con, command, "calls")
}

/// One counter of `command`'s line in `INFO commandstats` (`calls`, `rejected_calls`,
/// `failed_calls`), 0 when Redis has none.
pub fn command_stat(con: &mut impl redis::ConnectionLike, command: &str, stat: &str) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(con)
        .expect("INFO commandstats");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:")))
        .and_then(|l| {
            l.split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{stat}="))?.parse().ok())
        })
        .unwrap_or(0)
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding a free port")
        .port()
}

/// Runs `start` (which starts a server on a port of its choosing and returns it, or why it did
/// not come up) up to three times, panicking with the last reason: a port found free may be
/// taken by another socket (an outgoing connection's ephemeral port) before the server binds
/// it, and the server then exits at once. Every server the tests start goes through here.
pub(crate) fn started_on_a_free_port<T>(mut start: impl FnMut() -> Result<T, String>) -> T {
    let mut why = String::new();
    for _ in 0..3 {
        match start() {
            Ok(server) => return server,
            Err(e) => why = e,
        }
    }
    panic!("{why}");
}

/// Waits up to 10 s for a process just started to `answer`, and stops waiting as soon as it
/// is not `running`: why not, if it did not come up.
pub(crate) fn came_up(
    mut running: impl FnMut() -> bool,
    mut answers: impl FnMut() -> bool,
) -> Result<(), &'static str> {
    let mut exited = false;
    let up = wait_until(Duration::from_secs(10), || {
        exited = !running();
        exited || answers()
    });
    match (up, exited) {
        (_, true) => Err("it exited"),
        (true, false) => Ok(()),
        (false, false) => Err("no answer in 10 s"),
    }
}

/// The last `lines` lines of the log file at `path` (empty when there is none).
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    let log = std::fs::read_to_string(path).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(lines).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// Installs `redis-server` (and `redis-cli`, which cluster set-up uses) with apt-get if either is
/// not on the PATH (once per process). Sentinels run as `redis-server --sentinel`, so the
/// redis-sentinel package is not needed.
pub fn ensure_redis_installed() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        ensure_tools(&[
            ("redis-server", "redis-server"),
            ("redis-cli", "redis-tools"),
        ])
    });
}

/// Installs `openssl` (certificates for the TLS tests) with apt-get if it is missing.
pub fn ensure_openssl_installed() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| ensure_tools(&[("openssl", "openssl")]));
}

/// A wrapper (for `Pacer::run_wrapped`) that runs pacer with its wall clock off by `offset`
/// (libfaketime's syntax: `+5s`, `-45s`), its monotonic clock true: what is "off" on a host.
/// A monotonic offset would put every absolute timed wait (a futex's deadline) that far late.
///
/// `env` with libfaketime preloaded, not the `faketime` wrapper: the wrapper names a semaphore
/// and a shared-memory file in /dev/shm after its own pid, removed only when it exits cleanly.
/// The tests kill -9 their pacers, so runs leaked pairs, and a later wrapper that drew a recycled
/// pid failed `sem_open: File exists` and never started pacer (a CI failure). The preloaded
/// library makes the same pair but goes on without it when the name is taken, and `env` execs
/// pacer in its own place, so the pair carries pacer's pid and `Pacer::kill` removes it.
pub fn wall_clock_offset(offset: &str) -> Vec<String> {
    vec![
        "env".into(),
        format!("LD_PRELOAD={}", libfaketime().display()),
        format!("FAKETIME={offset}"),
        "FAKETIME_DONT_FAKE_MONOTONIC=1".into(),
    ]
}

/// Where libfaketime is (Debian's multiarch directory), installing the `faketime` package, which
/// brings it, when it is missing.
fn libfaketime() -> PathBuf {
    let find = || {
        ["/usr/lib", "/usr/local/lib", "/usr/lib64"]
            .iter()
            .flat_map(|root| {
                let nested = std::fs::read_dir(root)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path().join("faketime/libfaketime.so.1"));
                std::iter::once(Path::new(root).join("faketime/libfaketime.so.1")).chain(nested)
            })
            .find(|p| p.exists())
    };
    if let Some(found) = find() {
        return found;
    }
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| apt_install(&["faketime"]));
    find().expect("libfaketime.so.1 not found after installing the faketime package")
}

/// apt-get installs the package of each (command, package) whose command is not on the PATH.
fn ensure_tools(tools: &[(&str, &str)]) {
    let missing: Vec<&str> = tools
        .iter()
        .filter(|(cmd, _)| Command::new(cmd).arg("--version").output().is_err())
        .map(|(_, package)| *package)
        .collect();
    if missing.is_empty() {
        return;
    }
    eprintln!("{} missing: installing with apt-get", missing.join(" "));
    apt_install(&missing);
}

/// apt-get installs `packages`, output to stderr; panics if it fails. One install at a time in
/// the process: tests run in parallel threads, and two dpkg runs at once fail on its lock.
pub fn apt_install(packages: &[&str]) {
    static APT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = APT.lock().unwrap_or_else(|e| e.into_inner());
    let packages = packages.join(" ");
    let ok = Command::new("sh")
        .arg("-c")
        .arg(format!("(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {packages}) >&2"))
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "could not install {packages}; install it (apt-get install {packages}) and retry"
    );
}

/// A `redis-server` child process on a free port, killed on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    dir: TempDir,
    extra: Vec<String>,
    /// Environment for the process (a clock shift's LD_PRELOAD), kept for restarts.
    env: Vec<(String, String)>,
    /// How many of its restarts found its AOF cut short by a kill and repaired it.
    aof_repairs: usize,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts with extra `redis-server` arguments (like `--appendonly yes`).
    pub fn start_with(extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        Self::started(|port| Self::spawn_on(port, &extra))
    }

    /// Starts on `port` without waiting for it to answer a plain-text PING: for servers that
    /// only speak TLS (`--port 0 --tls-port <port>`); the caller waits its own way.
    pub fn spawn_on(port: u16, extra: &[String]) -> Self {
        Self::spawn_with_env(port, extra, Vec::new())
    }

    /// Starts with its wall clock under `shift`'s control (see [`ClockShift`]).
    pub fn start_shifted(shift: &ClockShift) -> Self {
        Self::started(|port| Self::spawn_with_env(port, &[], shift.env()))
    }

    fn spawn_with_env(port: u16, extra: &[String], env: Vec<(String, String)>) -> Self {
        ensure_redis_installed();
        let dir = TempDir::new("redis");
        let child = spawn_redis(port, dir.path(), extra, &env);
        RedisServer {
            child,
            port,
            dir,
            extra: extra.to_vec(),
            env,
            aof_repairs: 0,
        }
    }

    /// How many of its restarts found its AOF cut short by a kill and repaired it first
    /// (`repair_aof`).
    pub fn aof_repairs(&self) -> usize {
        self.aof_repairs
    }

    /// The end of its log (the last 20 lines).
    pub fn log_tail(&self) -> String {
        log_tail(&self.dir.path().join(LOG), 20)
    }

    /// The server's directory (its config files, `nodes.conf` for a cluster node).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Freezes the process (SIGSTOP): it keeps its connections but answers nothing, like a
    /// replica that lags far behind or a stalled master. `resume` undoes it.
    pub fn pause(&self) {
        signal_pid(self.pid(), "STOP");
    }

    pub fn resume(&self) {
        signal_pid(self.pid(), "CONT");
    }

    /// An ACL user `name` with `password` and every permission (`ACL SETUSER`).
    pub fn add_acl_user(&self, name: &str, password: &str) {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(name)
            .arg("reset")
            .arg("on")
            .arg(format!(">{password}"))
            .arg("~*")
            .arg("&*")
            .arg("+@all")
            .query(&mut self.con())
            .expect("ACL SETUSER");
    }

    /// A single-node Redis Cluster owning every slot: it refuses, like any cluster, a script
    /// call whose keys span slots (CROSSSLOT).
    pub fn start_cluster() -> Self {
        let redis = Self::start_with(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ]);
        let _: () = redis::cmd("CLUSTER")
            .arg("ADDSLOTSRANGE")
            .arg(0)
            .arg(16383)
            .query(&mut redis.con())
            .expect("assigning every slot");
        let ok = wait_until(Duration::from_secs(10), || {
            redis::cmd("CLUSTER")
                .arg("INFO")
                .query::<String>(&mut redis.con())
                .is_ok_and(|info| info.contains("cluster_state:ok"))
        });
        assert!(ok, "the cluster never reached cluster_state:ok");
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("a redis client")
    }

    /// A current-thread runtime and an async connection on it, for calling pacer's async
    /// functions (the scripts) from a plain test.
    pub fn async_con(&self) -> (tokio::runtime::Runtime, redis::aio::MultiplexedConnection) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        // Not redis-rs's default 500 ms per reply: a test reads whole streams of huge events
        // (10,000 entries a page), which took longer on a loaded machine and failed the test.
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_secs(30)))
            .set_connection_timeout(Some(Duration::from_secs(5)));
        let con = rt
            .block_on(
                self.client()
                    .get_multiplexed_async_connection_with_config(&config),
            )
            .expect("connecting to the test Redis");
        (rt, con)
    }

    /// A blocking connection, for simple checks.
    pub fn con(&self) -> redis::Connection {
        self.client()
            .get_connection()
            .expect("connecting to the test redis")
    }

    /// `CONFIG SET name value` on the running server.
    pub fn config_set(&self, name: &str, value: &str) {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut self.con())
            .expect("CONFIG SET");
    }

    /// Kills the server (SIGKILL): its data is lost unless persistence is on.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port and directory (AOF, if on, is replayed, once
    /// repaired as the README tells operators to: [`repair_aof`]).
    pub fn restart(&mut self) {
        self.respawn();
        self.wait_ready();
    }

    /// Starts the server again as a replica of the server on `master_port`, as a master comes
    /// back after a failover where its config says so (Sentinel rewrites it) or its
    /// orchestrator does. Restarted as a master instead, it waits for the sentinels to notice
    /// and convert it: 15.6 s once, on a busy machine.
    pub fn restart_as_replica_of(&mut self, master_port: u16) {
        self.extra.retain(|a| !a.starts_with("--replicaof"));
        self.extra.push("--replicaof".into());
        self.extra.push(format!("127.0.0.1 {master_port}"));
        self.restart();
    }

    /// Starts the server again after `kill`, without waiting for it (a cluster node answers
    /// PING before it has rejoined; the cluster helpers wait for that).
    pub fn respawn(&mut self) {
        self.kill();
        self.aof_repairs += repair_aof(self.dir.path()) as usize;
        self.child = spawn_redis(self.port, self.dir.path(), &self.extra, &self.env);
    }

    fn wait_ready(&mut self) {
        if let Err(e) = self.try_ready() {
            panic!("{e}");
        }
    }

    /// Spawns a server with `spawn` on a free port, and again on another if it does not start
    /// (`started_on_a_free_port`).
    fn started(spawn: impl Fn(u16) -> Self) -> Self {
        started_on_a_free_port(|| {
            let mut server = spawn(free_port());
            server.try_ready().map(|()| server)
        })
    }

    /// Waits up to 10 s until this server answers on its port: this process, not another
    /// that holds the port (a test would then talk to someone else's Redis), and failing at
    /// once, with the end of its log, if it exits.
    fn try_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let me = format!("process_id:{}\r", self.child.id());
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "redis-server on port {} exited ({status}); the end of its log:\n{}",
                    self.port,
                    self.log_tail()
                ));
            }
            if let Ok(mut con) = self.client().get_connection() {
                if let Ok(info) = redis::cmd("INFO").arg("server").query::<String>(&mut con) {
                    if !info.contains(&me) {
                        return Err(format!(
                            "another redis-server answers on port {}",
                            self.port
                        ));
                    }
                    // INFO answers while the dataset loads; PING waits for it.
                    if redis::cmd("PING").query::<String>(&mut con).is_ok() {
                        return Ok(());
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "redis-server did not start on port {}; the end of its log:\n{}",
                    self.port,
                    self.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The log file's name in a server's directory.
const LOG: &str = "redis.log";

/// Repairs the AOF in `dir` (the default `appendonlydir`, if any) before a killed server is
/// started on it again, as the README tells operators to. A SIGKILL in the middle of Redis's
/// write of a script's MULTI/EXEC leaves half of it in the file; Redis 7.0's own repair
/// (`aof-load-truncated yes`) drops only the last, partial command and leaves the rest of the
/// transaction there, applied at the next restart with whatever follows it: a script's ready
/// entries without the decisions that say they were written, so an event dispatched twice (the
/// shape of the one a 420 s chaos run found; valkey-io/valkey#4342 fixed this in Valkey).
/// `redis-check-aof --fix` cuts the whole unfinished transaction. The servers start with
/// `aof-load-truncated no` (`spawn_redis`), so an AOF this did not repair would stop them, not
/// be cut wrongly.
/// Returns whether it repaired anything.
fn repair_aof(dir: &Path) -> bool {
    let manifest = dir.join("appendonlydir").join("appendonly.aof.manifest");
    if !manifest.exists() {
        return false;
    }
    let valid = Command::new("redis-check-aof")
        .arg(&manifest)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("running redis-check-aof")
        .success();
    if valid {
        return false;
    }
    // It asks before it cuts.
    let mut fix = Command::new("redis-check-aof")
        .arg("--fix")
        .arg(&manifest)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running redis-check-aof --fix");
    {
        use std::io::Write;
        let _ = fix.stdin.take().expect("its stdin").write_all(b"y\n");
    }
    let out = fix.wait_with_output().expect("redis-check-aof --fix");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "redis-check-aof --fix could not repair {}: {said}",
        manifest.display()
    );
    let what = said
        .lines()
        .filter(|l| l.contains("EOF") || l.contains("shrink"))
        .collect::<Vec<_>>()
        .join("; ");
    eprintln!(
        "testkit: a killed Redis left its AOF cut short; redis-check-aof --fix repaired it ({what})"
    );
    true
}

fn spawn_redis(port: u16, dir: &Path, extra: &[String], env: &[(String, String)]) -> Child {
    Command::new("redis-server")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        // With AOF on, a file cut short stops the server rather than being cut where Redis 7.0
        // cuts it (`repair_aof`).
        .args(["--appendonly", "no", "--aof-load-truncated", "no", "--dir"])
        .arg(dir)
        // Its log, for the message of a server that does not start (a port taken, say).
        .arg("--logfile")
        .arg(dir.join(LOG))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting redis-server")
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL ends a paused (SIGSTOPped) server too.
        self.kill();
    }
}

fn signal_pid(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status();
}

/// A `pacer` child process, killed on drop.
pub struct Pacer {
    child: Child,
    pub log: PathBuf,
}

impl Pacer {
    /// Runs `bin run --config config` with `env`; logs go to `<config>.<n>.log`.
    pub fn run(bin: &Path, config: &Path, env: &[(&str, &str)]) -> Self {
        Self::run_wrapped(&[], bin, config, env)
    }

    /// The same, under a wrapper command (like `wall_clock_offset`'s).
    pub fn run_wrapped(
        wrapper: &[String],
        bin: &Path,
        config: &Path,
        env: &[(&str, &str)],
    ) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let log = config.with_extension(format!("{}.log", N.fetch_add(1, Ordering::Relaxed)));
        let out = std::fs::File::create(&log).expect("creating a log file");
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        cmd.arg("run").arg("--config").arg(config);
        // Its own process group, so that signals and kills reach pacer itself even under a
        // wrapper that runs pacer as its child (killing the wrapper alone would orphan it).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd.env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .stdout(out.try_clone().expect("log file"))
            .stderr(out)
            .spawn()
            .expect("starting pacer");
        Pacer { child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `sig` to the process and everything in its process group.
    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg("--")
            .arg(format!("-{}", self.pid()))
            .stderr(Stdio::null())
            .status();
    }

    /// Waits for the process to exit, up to `limit`; its exit code, or None if it did not.
    pub fn wait_for(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status.code().unwrap_or(-1));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn kill(&mut self) {
        // The group, even if its leader has exited: a wrapper's child may outlive it.
        self.signal("KILL");
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A preloaded libfaketime (`wall_clock_offset`) names a semaphore and a shared-memory
        // file after its pid and removes them only on a clean exit; a kill -9 leaves them.
        let pid = self.pid();
        let _ = std::fs::remove_file(format!("/dev/shm/sem.faketime_sem_{pid}"));
        let _ = std::fs::remove_file(format!("/dev/shm/faketime_shm_{pid}"));
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Pacer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Creates consumer group `group` on `stream` (made if missing) at its start, so that workers
/// started later read what is pushed before them from the first entry.
pub fn create_group(con: &mut redis::Connection, stream: &str, group: &str) {
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg("0")
        .arg("MKSTREAM")
        .query(con)
        .unwrap();
}

/// How many records (decisions, write-once marks) the record hash `key` holds: its fields but
/// [`crate::keys::WIDE_FIELD`], which records nothing.
pub fn records_in(con: &mut redis::Connection, key: &str) -> i64 {
    let (len, wide): (i64, i64) = redis::pipe()
        .cmd("HLEN")
        .arg(key)
        .cmd("HEXISTS")
        .arg(key)
        .arg(crate::keys::WIDE_FIELD)
        .query(con)
        .unwrap();
    len - wide
}

/// Polls `check` every 20 ms until it returns true or `limit` passes; whether it did.
pub fn wait_until(limit: Duration, check: impl FnMut() -> bool) -> bool {
    poll_until(limit, Duration::from_millis(20), check)
}

/// As `wait_until`, polling every `every` (a benchmark whose polls would count as Redis's work).
pub fn poll_until(limit: Duration, every: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// `GET path` on 127.0.0.1:`port`: the status code and body, or None if nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}

/// An HTTP status, its headers (names in lower case) and body.
pub type HttpReply = (u16, Vec<(String, String)>, String);

/// `POST path` with a JSON `body` on 127.0.0.1:`port`: the status, the headers (names in
/// lower case) and the body, or None if nothing answers.
pub fn http_post(port: u16, path: &str, body: &str) -> Option<HttpReply> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Some((status, headers, body.to_string()))
}

/// `metric` of what pacer's `/metrics` on `port` serves now; 0 when it does not answer (a
/// stopped or starting process).
pub fn metric_at(port: u16, needle: &str) -> f64 {
    http_get(port, "/metrics").map_or(0.0, |(_, text)| metric(&text, needle))
}

/// The most resident memory process `pid` has held (KiB, VmHWM); 0 once it is gone.
pub fn peak_rss(pid: u32) -> u64 {
    status_kib(pid, "VmHWM")
}

/// A KiB figure of /proc/`pid`/status (`VmRSS`, `VmHWM`); 0 once the process is gone.
fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Process `pid`'s resident memory (KiB) and CPU time so far (user + system, seconds), from
/// /proc; zeros once it is gone.
pub fn rss_and_cpu(pid: u32) -> (u64, f64) {
    let rss = status_kib(pid, "VmRSS");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name, which is in parentheses and may hold spaces; utime
    // and stime are the 12th and 13th of them, in clock ticks (100 a second on Linux).
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (rss, (ticks(11) + ticks(12)) / 100.0)
}

/// The value of a metric line (`name{labels} value`) whose name and labels contain `needle`,
/// summed over matching lines.
pub fn metric(text: &str, needle: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
