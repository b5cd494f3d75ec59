//! The producer and consumer examples in `examples/` (Python with redis-py, Node with ioredis,
//! redis-cli), each run as its own processes against a real redis-server and a real pacer
//! started with the repo's `config.yaml`, then checked in Redis: every outbound event sent once,
//! rejected or dead-lettered, every inbound event accepted or rejected, what every group
//! acknowledged trimmed away and nothing else, nothing left pending.
//!
//! Installs what a runtime lacks (apt-get for python3, python3-venv, nodejs, npm; redis-py in a
//! venv under `target/`; ioredis with `npm ci` in `examples/node`) and says so. A runtime that
//! cannot be had fails the test: these run in CI.
//!
//! Also: a consumer `kill -9`ed while it holds unacknowledged entries (Python and Node: another
//! consumer claims them, or it takes them back restarted under its name), trim.lua on a stream
//! whose groups hold pending and undelivered entries, and `scripts/demo.sh` run whole.
//!
//! Over 1,000 lines: one test per example program and language, sharing one rig; then the
//! crash, trim.lua and demo tests.

mod common;

use common::{pending, start_wrapped};
use pacer::testkit::{ensure_redis_installed, free_port, RedisServer, TempDir};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Seconds a consumer waits with nothing to read before it exits: well above the longest gap
/// between two dispatches here (carrier-b's 200 ms), and above a slow process start.
const EXIT_WHEN_IDLE: &str = "3";

// ---- Runtimes ------------------------------------------------------------------------------

/// Whether `program args` runs and exits 0.
fn runs(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs a setup command, its output to stderr; panics with `what` if it fails.
fn setup(cmd: &mut Command, what: &str) {
    // Straight to stderr, not eprintln!, which the test harness captures: what a test installs
    // on the machine should show in every run's output.
    let _ = writeln!(std::io::stderr(), "examples: {what}");
    let ok = cmd
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "could not {what}: {cmd:?} failed");
}

/// apt-get installs `packages` (one install at a time in the process: see testkit), saying so.
fn apt_install(packages: &[&str]) {
    let _ = writeln!(
        std::io::stderr(),
        "examples: install {} with apt-get",
        packages.join(" ")
    );
    pacer::testkit::apt_install(packages);
}

/// The Python of a venv under `target/` holding redis-py from `examples/python/requirements.txt`,
/// made (and python3 installed) when missing.
fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("examples-venv");
            let python = venv.join("bin/python3");
            let py = python.to_str().unwrap();
            if runs(py, &["-c", "import redis"]) {
                return python;
            }
            if !runs("python3", &["--version"]) {
                apt_install(&["python3", "python3-venv"]);
            }
            // Debian's python3 makes venvs only with python3-venv (ensurepip) installed.
            if !runs("python3", &["-m", "venv", venv.to_str().unwrap()]) {
                apt_install(&["python3-venv"]);
                setup(
                    Command::new("python3")
                        .args(["-m", "venv", "--clear"])
                        .arg(&venv),
                    &format!("make a venv in {}", venv.display()),
                );
            }
            setup(
                Command::new(&python)
                    .args(["-m", "pip", "install", "-q", "-r"])
                    .arg(repo().join("examples/python/requirements.txt")),
                &format!(
                    "install redis-py (examples/python/requirements.txt) into {}",
                    venv.display()
                ),
            );
            assert!(
                runs(py, &["-c", "import redis"]),
                "redis-py did not install"
            );
            python
        })
        .clone()
}

/// `node`, with ioredis installed in `examples/node` from its package-lock.json (and nodejs
/// and npm installed) when missing.
fn node() -> PathBuf {
    static NODE: OnceLock<PathBuf> = OnceLock::new();
    NODE.get_or_init(|| {
        if !runs("node", &["--version"]) {
            apt_install(&["nodejs"]);
        }
        // Debian's nodejs comes without npm; NodeSource's carries it and conflicts with
        // Debian's npm package, so npm is installed only if still missing.
        if !runs("npm", &["--version"]) {
            apt_install(&["npm"]);
        }
        let dir = repo().join("examples/node");
        if !dir.join("node_modules/ioredis").is_dir() {
            setup(
                Command::new("npm")
                    .args(["ci", "--no-audit", "--no-fund"])
                    .current_dir(&dir),
                "install ioredis: npm ci in examples/node",
            );
        }
        PathBuf::from("node")
    })
    .clone()
}

/// `bash`, with redis-cli (Debian's redis-tools, which redis-server brings) present.
fn bash() -> PathBuf {
    ensure_redis_installed();
    if !runs("redis-cli", &["--version"]) {
        apt_install(&["redis-tools"]);
    }
    assert!(runs("bash", &["--version"]), "bash is missing");
    PathBuf::from("bash")
}

// ---- Running the examples ------------------------------------------------------------------

/// One language's examples: `<dir>/produce.<ext>` and `<dir>/consume.<ext>`, run by `program`.
struct Lang {
    program: PathBuf,
    dir: &'static str,
    ext: &'static str,
}

/// A running example, killed if the test gives up on it.
struct Example {
    child: Child,
    what: String,
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Example {
    /// Waits for it to exit 0 (within `limit`) and returns its stdout.
    fn finish(mut self, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "{} still runs after {limit:?}",
                self.what
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut out = String::new();
        let mut err = String::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert!(
            status.success(),
            "{} failed ({status}):\n{out}\n{err}",
            self.what
        );
        if !err.trim().is_empty() {
            eprintln!("{} wrote on stderr:\n{err}", self.what);
        }
        out
    }
}

impl Lang {
    fn start(&self, redis: &RedisServer, script: &str, args: &[&str]) -> Example {
        self.spawn(redis, script, args, EXIT_WHEN_IDLE)
    }

    /// Starts `script` with `EXIT_WHEN_IDLE=exit_when_idle` ("0": run until killed).
    fn spawn(
        &self,
        redis: &RedisServer,
        script: &str,
        args: &[&str],
        exit_when_idle: &str,
    ) -> Example {
        let path = repo()
            .join("examples")
            .join(self.dir)
            .join(format!("{script}.{}", self.ext));
        let child = Command::new(&self.program)
            .arg(&path)
            .args(args)
            .env("PACER_REDIS_URL", redis.url())
            .env("EXIT_WHEN_IDLE", exit_when_idle)
            // Python's default: stdout to a pipe is block-buffered, whatever this shell says.
            .env_remove("PYTHONUNBUFFERED")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", path.display()));
        Example {
            child,
            what: format!("{} {}", path.display(), args.join(" ")),
        }
    }
}

/// What a consumer printed: one `(kind, input entry id, line)` per entry it handled, kind
/// being `sent`, `rejected` or `dead`.
fn handled(out: &str) -> Vec<(String, String, String)> {
    out.lines()
        .map(|line| {
            let mut words = line.split(' ');
            let kind = words.next().unwrap_or_default().to_string();
            let id = words.next().unwrap_or_default().to_string();
            (kind, id, line.to_string())
        })
        .collect()
}

/// The value of `name=<value>` in a consumer's line.
fn value<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split(' ')
        .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
}

fn xlen(redis: &RedisServer, stream: &str) -> u64 {
    redis::cmd("XLEN")
        .arg(stream)
        .query(&mut redis.con())
        .unwrap()
}

/// The ids of every entry in `stream`.
fn ids(redis: &RedisServer, stream: &str) -> Vec<String> {
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(&mut redis.con())
        .unwrap();
    reply.ids.into_iter().map(|e| e.id).collect()
}

const READY_A: &str = "pacer:{carrier-a}:ready";
const READY_B: &str = "pacer:{carrier-b}:ready";

/// Starts Redis and pacer (the repo's config.yaml, metrics on a free port), runs `lang`'s
/// producer, then its consumers on every output stream at once, then checks Redis.
fn run_examples(lang: Lang) {
    let redis = RedisServer::start();
    let dir = TempDir::new("examples");
    let port = free_port();
    let documented = std::fs::read_to_string(repo().join("config.yaml")).unwrap();
    let yaml = documented.replace("127.0.0.1:9464", &format!("127.0.0.1:{port}"));
    assert_ne!(
        yaml, documented,
        "config.yaml no longer listens on 127.0.0.1:9464"
    );
    let config = dir.write("config.yaml", &yaml);
    let url = redis.url();
    let pacer = start_wrapped(&[], &[("PACER_REDIS_URL", &url)], &config, port);

    // A second group on carrier-a's ready stream that reads nothing until the end: trimming
    // must keep every entry for it, however far the senders get.
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(READY_A)
        .arg("audit")
        .arg("0")
        .arg("MKSTREAM")
        .query(&mut redis.con())
        .unwrap();

    let said = lang
        .start(&redis, "produce", &[])
        .finish(Duration::from_secs(60));
    eprintln!("producer: {}", said.trim());
    let outbound = ids(&redis, "pacer:out");
    let inbound = ids(&redis, "pacer:in");
    assert_eq!(
        (outbound.len(), inbound.len()),
        (31, 15),
        "what the producer pushed"
    );

    // Two consumers share each ready stream's group; one reads each other stream.
    let consumers: Vec<(&str, &str, Example)> = [
        (READY_A, "senders", "s1"),
        (READY_A, "senders", "s2"),
        (READY_B, "senders", "s1"),
        (READY_B, "senders", "s2"),
        ("pacer:accepted", "handlers", "h1"),
        ("pacer:rejected", "producer", "p1"),
        ("pacer:in-rejected", "producer", "p1"),
        ("pacer:dead", "ops", "o1"),
    ]
    .into_iter()
    .map(|(stream, group, me)| {
        (
            stream,
            group,
            lang.start(&redis, "consume", &[stream, group, me]),
        )
    })
    .collect();
    let mut by_stream: BTreeMap<&str, Vec<(String, String, String)>> = BTreeMap::new();
    let mut groups = BTreeSet::new();
    for (stream, group, example) in consumers {
        let out = example.finish(Duration::from_secs(120));
        by_stream.entry(stream).or_default().extend(handled(&out));
        groups.insert((stream, group));
    }
    assert_eq!(
        pending(&redis, "pacer:out", "pacer"),
        0,
        "pacer left outbound events pending:\n{}",
        pacer.log_text()
    );
    assert_eq!(
        pending(&redis, "pacer:in", "pacer"),
        0,
        "pacer left inbound events pending"
    );

    let kinds = |stream: &str, kind: &str| -> Vec<(String, String, String)> {
        let all = by_stream.get(stream).cloned().unwrap_or_default();
        for (k, _, line) in &all {
            assert_eq!(k, kind, "{stream}: {line}");
        }
        all
    };
    let sent_a = kinds(READY_A, "sent");
    let sent_b = kinds(READY_B, "sent");
    let rejected = kinds("pacer:rejected", "rejected");
    let dead = kinds("pacer:dead", "dead");
    let accepted = kinds("pacer:accepted", "sent");
    let in_rejected = kinds("pacer:in-rejected", "rejected");
    eprintln!(
        "outbound: {} sent on carrier-a, {} on carrier-b (fallback), {} rejected, {} dead; inbound: {} accepted, {} rejected",
        sent_a.len(),
        sent_b.len(),
        rejected.len(),
        dead.len(),
        accepted.len(),
        in_rejected.len()
    );

    // Every input entry was handled exactly once, by one consumer of one output's group.
    let once = |inputs: &[String], outputs: &[&Vec<(String, String, String)>]| {
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, id, _) in outputs.iter().flat_map(|o| o.iter()) {
            *seen.entry(id.as_str()).or_default() += 1;
        }
        let want: BTreeMap<&str, usize> = inputs.iter().map(|id| (id.as_str(), 1)).collect();
        assert_eq!(seen, want, "input entry -> times a consumer handled it");
    };
    once(&outbound, &[&sent_a, &sent_b, &rejected, &dead]);
    once(&inbound, &[&accepted, &in_rejected]);

    // Each outcome happened, with the fields the examples read.
    assert!(!sent_a.is_empty() && !sent_b.is_empty() && !rejected.is_empty());
    for (route, sent) in [("carrier-a", &sent_a), ("carrier-b", &sent_b)] {
        for (_, _, line) in sent {
            assert_eq!(value(line, "on"), Some(route), "{line}");
            assert_eq!(value(line, "route"), Some("carrier-a"), "{line}");
            assert!(
                value(line, "waited_ms").is_some_and(|v| v.parse::<u64>().is_ok()),
                "{line}"
            );
            assert!(
                value(line, "to").is_some_and(|to| to.starts_with("+1555")),
                "{line}"
            );
        }
    }
    for (_, _, line) in rejected.iter().chain(&in_rejected) {
        assert!(
            value(line, "retry_after_ms").is_some_and(|v| v.parse::<u64>().is_ok()),
            "{line}"
        );
    }
    assert!(rejected
        .iter()
        .all(|(_, _, l)| value(l, "reason") == Some("queue_full")));
    // The producer's retry (its last outbound entry) is the duplicate, not the original.
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].1, outbound[30]);
    assert_eq!(value(&dead[0].2, "reason"), Some("duplicate"));
    // Each source's first call passes (min_spacing 100ms), and at least one of the rest not.
    assert!(accepted.len() >= 3 && !in_rejected.is_empty());
    assert!(in_rejected
        .iter()
        .all(|(_, _, l)| value(l, "reason") == Some("rate_limited")));
    for (_, _, line) in &accepted {
        assert!(
            value(line, "source").is_some_and(|s| s.starts_with("+1444")),
            "{line}"
        );
    }

    // Nothing pending in any group; every stream trimmed to nothing, but carrier-a's ready
    // stream, which the audit group has not read.
    for (stream, group) in &groups {
        assert_eq!(pending(&redis, stream, group), 0, "{stream} {group}");
        let left = if *stream == READY_A {
            sent_a.len() as u64
        } else {
            0
        };
        assert_eq!(xlen(&redis, stream), left, "{stream} after its consumers");
    }

    // The audit group now reads carrier-a: every entry is still there for it, then trimmed.
    let audit = handled(
        &lang
            .start(&redis, "consume", &[READY_A, "audit", "a1"])
            .finish(Duration::from_secs(60)),
    );
    let ids_of = |v: &[(String, String, String)]| -> BTreeSet<String> {
        v.iter().map(|(_, id, _)| id.clone()).collect()
    };
    assert_eq!(ids_of(&audit), ids_of(&sent_a));
    assert_eq!(audit.len(), sent_a.len());
    assert_eq!(pending(&redis, READY_A, "audit"), 0);
    assert_eq!(xlen(&redis, READY_A), 0);

    // examples/README.md: the same script trims pacer's input streams once pacer is done.
    for input in ["pacer:out", "pacer:in"] {
        let out = Command::new("redis-cli")
            .args(["-u", &url, "--eval"])
            .arg(repo().join("examples/trim.lua"))
            .arg(input)
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            if input == "pacer:out" { "31" } else { "15" }
        );
        assert_eq!(xlen(&redis, input), 0);
    }
}

#[test]
fn python_examples() {
    run_examples(Lang {
        program: python(),
        dir: "python",
        ext: "py",
    });
}

#[test]
fn node_examples() {
    run_examples(Lang {
        program: node(),
        dir: "node",
        ext: "js",
    });
}

#[test]
fn shell_examples() {
    run_examples(Lang {
        program: bash(),
        dir: "shell",
        ext: "sh",
    });
}

// ---- A consumer that dies mid-work ---------------------------------------------------------

/// Ready entries fed at once.
const ROUND: usize = 10;

/// XADDs `ROUND` ready entries to carrier-a's ready stream in one transaction (a consumer
/// blocked on the stream gets them all in one reply), shaped as pacer writes them (`pacer_*`
/// fields, then the event's own), each with a `pacer_source_id` of its own; returns
/// `(ready entry id, pacer_source_id)` for each.
fn feed_ready(redis: &RedisServer, round: usize) -> Vec<(String, String)> {
    let mut pipe = redis::pipe();
    pipe.atomic();
    let mut sources = Vec::new();
    for n in round * ROUND..(round + 1) * ROUND {
        let source = format!("1700000000000-{n}");
        pipe.cmd("XADD")
            .arg(READY_A)
            .arg("*")
            .arg("pacer_route")
            .arg("carrier-a")
            .arg("pacer_source_stream")
            .arg("pacer:out")
            .arg("pacer_source_id")
            .arg(&source)
            .arg("pacer_slot_us")
            .arg("1700000000000000")
            .arg("pacer_wait_ms")
            .arg("0")
            .arg("route")
            .arg("carrier-a")
            .arg("id")
            .arg(format!("sms-{n}"))
            .arg("to")
            .arg(format!("+1555{n:07}"))
            .arg("body")
            .arg("your code is 1234");
        sources.push(source);
    }
    let ids: Vec<String> = pipe.query(&mut redis.con()).unwrap();
    ids.into_iter().zip(sources).collect()
}

/// `(pending count, last-delivered-id)` of `group` on `stream`, if it has that group.
fn group_state(redis: &RedisServer, stream: &str, group: &str) -> Option<(i64, String)> {
    let groups: Vec<BTreeMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(&mut redis.con())
        .unwrap_or_default();
    let g = groups
        .iter()
        .find(|g| g.get("name") == Some(&redis::Value::BulkString(group.as_bytes().to_vec())))?;
    let pending: i64 = redis::from_redis_value(g["pending"].clone()).unwrap();
    let last: String = redis::from_redis_value(g["last-delivered-id"].clone()).unwrap();
    Some((pending, last))
}

/// The entries of `group` pending on `stream`, each with its owner.
fn pending_entries(redis: &RedisServer, stream: &str, group: &str) -> BTreeMap<String, String> {
    let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(10_000)
        .query(&mut redis.con())
        .unwrap();
    reply.ids.into_iter().map(|p| (p.id, p.consumer)).collect()
}

/// Whether some client is blocked in XREADGROUP (CLIENT LIST: flag `b`).
fn blocked_in_xreadgroup(redis: &RedisServer) -> bool {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut redis.con())
        .unwrap();
    list.lines().any(|client| {
        let field = |name: &str| {
            client
                .split(' ')
                .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
        };
        field("cmd") == Some("xreadgroup") && field("flags").is_some_and(|f| f.contains('b'))
    })
}

/// Sends `sig` (STOP, CONT) to process `pid`.
fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid} failed");
}

/// Stream ids compare as `(ms, seq)`.
fn id_key(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').expect("a stream id");
    (ms.parse().unwrap(), seq.parse().unwrap())
}

impl Example {
    /// `kill -9`s it and returns what it had written to its stdout by then: its complete lines
    /// only (a line cut off by the kill tells nothing).
    fn kill9(mut self) -> String {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let mut raw = Vec::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_end(&mut raw)
            .unwrap();
        let out = String::from_utf8_lossy(&raw);
        out[..out.rfind('\n').map_or(0, |i| i + 1)].to_string()
    }
}

/// Who takes over from the consumer that died.
#[derive(Clone, Copy, PartialEq)]
enum Successor {
    /// Another consumer of the group: its XAUTOCLAIM takes the dead one's entries once they
    /// have been pending over a minute.
    Another,
    /// The same consumer restarted under its name: its own pending entries come first.
    SameName,
}

/// examples/README.md, "consume", steps 1, 2 and 4: a consumer `kill -9`ed while it holds
/// entries it read and has not acknowledged loses none of them.
///
/// The consumer `s1` of group `senders` on carrier-a's ready stream handles a first round of
/// ready entries (fed by the test, shaped as pacer's). Then, while it waits in
/// `XREADGROUP ... BLOCK`, it is stopped (SIGSTOP) and a second round is added: Redis hands the
/// round to it, pending, and `s1` can neither work nor acknowledge it. It is killed (SIGKILL),
/// a third round is added, and the `successor` finishes the job. Checked, by the
/// `pacer_source_id` each printed line names:
/// - every entry `s1` acknowledged, it had printed (the work comes before the XACK), on the
///   stdout pipe the test reads;
/// - the successor handles exactly what `s1` had not acknowledged (held, or never read), once;
/// - every entry was handled, and only those `s1` held at its death may have been handled
///   twice: the README promises at least once, not exactly once;
/// - nothing is left pending, and the stream is trimmed to nothing.
///
/// With `Successor::Another`, `s2` first runs while `s1`'s entries are fresh and must leave
/// them (XAUTOCLAIM takes entries idle over a minute), and trim.lua (which `s2` runs) must
/// keep them. Their idle time is then set past the minute (`XCLAIM` to `s1` itself with
/// `IDLE 61000 JUSTID`, which changes nothing else) rather than waited for, and `s2` runs
/// again and claims them.
fn consumer_killed_mid_work(lang: Lang, successor: Successor) {
    let redis = RedisServer::start();
    let group = "senders";
    let s1 = lang.spawn(&redis, "consume", &[READY_A, group, "s1"], "0");
    let pid = s1.child.id();
    let caught_up = |last: &str, limit: u64| {
        pacer::testkit::wait_until(Duration::from_secs(limit), || {
            group_state(&redis, READY_A, group) == Some((0, last.to_string()))
        })
    };

    // ready entry id -> pacer_source_id, for everything fed.
    let mut fed: BTreeMap<String, String> = BTreeMap::new();
    // Round 0, before the group exists: the consumer makes it at the stream's start.
    let round = feed_ready(&redis, 0);
    let mut last = round.last().unwrap().0.clone();
    fed.extend(round);
    assert!(caught_up(&last, 30), "{} did not handle round 0", s1.what);

    // Stopped while blocked, so that the next round goes to it. Rarely the stop comes between
    // two of its calls, or its 1 s block runs out first: then it goes on, and again.
    let mut held = BTreeMap::new();
    for attempt in 1..=20 {
        assert!(
            pacer::testkit::wait_until(Duration::from_secs(10), || blocked_in_xreadgroup(&redis)),
            "{} is not waiting in XREADGROUP",
            s1.what
        );
        signal(pid, "STOP");
        let round = feed_ready(&redis, attempt);
        last = round.last().unwrap().0.clone();
        fed.extend(round);
        std::thread::sleep(Duration::from_millis(300));
        held = pending_entries(&redis, READY_A, group);
        if !held.is_empty() {
            break;
        }
        signal(pid, "CONT");
        assert!(
            caught_up(&last, 30),
            "{} did not handle round {attempt}",
            s1.what
        );
    }
    assert!(
        !held.is_empty(),
        "{} was never handed a round while stopped",
        s1.what
    );
    let printed_by_s1 = s1.kill9();
    let (_, last_delivered) = group_state(&redis, READY_A, group).unwrap();
    assert_eq!(
        pending_entries(&redis, READY_A, group),
        held,
        "what s1 held, after its death"
    );
    assert!(held.values().all(|owner| owner == "s1"), "{held:?}");
    let held: BTreeSet<String> = held.into_keys().map(|id| fed[&id].clone()).collect();
    // What s1 acknowledged: every entry it was given, but those it held.
    let acked: BTreeSet<String> = fed
        .iter()
        .filter(|(id, source)| id_key(id) <= id_key(&last_delivered) && !held.contains(*source))
        .map(|(_, source)| source.clone())
        .collect();
    let fed_before = fed.len();
    fed.extend(feed_ready(&redis, 100));
    eprintln!(
        "s1 killed holding {} entries; it had acknowledged {}, {} more fed since",
        held.len(),
        acked.len(),
        fed.len() - fed_before
    );

    let sources = |out: &str| -> Vec<String> {
        handled(out)
            .into_iter()
            .map(|(kind, source, line)| {
                assert_eq!(kind, "sent", "{line}");
                source
            })
            .collect()
    };
    let by_s1 = sources(&printed_by_s1);
    let missing: Vec<&String> = acked.iter().filter(|s| !by_s1.contains(s)).collect();
    assert!(
        missing.is_empty(),
        "{} acknowledged {} entries it had not printed (of {} acknowledged): {missing:?}",
        lang.dir,
        missing.len(),
        acked.len()
    );

    let mut by_successor = Vec::new();
    if successor == Successor::Another {
        // Held for seconds only: s2 leaves them, and takes all the rest.
        let out = lang
            .start(&redis, "consume", &[READY_A, group, "s2"])
            .finish(Duration::from_secs(60));
        let first = sources(&out);
        let want: BTreeSet<String> = fed
            .values()
            .filter(|s| !acked.contains(*s) && !held.contains(*s))
            .cloned()
            .collect();
        assert_eq!(
            first.iter().cloned().collect::<BTreeSet<_>>(),
            want,
            "what s2 handled while s1's entries were fresh"
        );
        let still: BTreeSet<String> = pending_entries(&redis, READY_A, group)
            .into_iter()
            .map(|(id, owner)| {
                assert_eq!(owner, "s1", "{id}");
                fed[&id].clone()
            })
            .collect();
        assert_eq!(still, held, "s1's entries, within their minute");
        // trim.lua (run by s2) kept s1's entries, and everything after the oldest of them.
        let oldest = fed.iter().find(|(_, s)| held.contains(*s)).unwrap().0;
        let left = ids(&redis, READY_A);
        assert_eq!(
            left.first(),
            Some(oldest),
            "the stream starts at s1's oldest"
        );
        by_successor.extend(first);

        let ids_held: Vec<&String> = fed
            .iter()
            .filter(|(_, s)| held.contains(*s))
            .map(|(id, _)| id)
            .collect();
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(READY_A)
            .arg(group)
            .arg("s1")
            .arg(0)
            .arg(&ids_held)
            .arg("IDLE")
            .arg(61_000)
            .arg("JUSTID")
            .query(&mut redis.con())
            .unwrap();
    }
    let me = match successor {
        Successor::Another => "s2",
        Successor::SameName => "s1",
    };
    let out = lang
        .start(&redis, "consume", &[READY_A, group, me])
        .finish(Duration::from_secs(60));
    by_successor.extend(sources(&out));

    let not_acked: BTreeSet<String> = fed
        .values()
        .filter(|s| !acked.contains(*s))
        .cloned()
        .collect();
    let mut times: BTreeMap<String, usize> = BTreeMap::new();
    for s in &by_successor {
        *times.entry(s.clone()).or_default() += 1;
    }
    assert_eq!(
        times.keys().cloned().collect::<BTreeSet<_>>(),
        not_acked,
        "what {me} handled"
    );
    assert!(times.values().all(|&n| n == 1), "{me} twice: {times:?}");
    for s in &by_s1 {
        *times.entry(s.clone()).or_default() += 1;
    }
    let all: BTreeSet<String> = fed.values().cloned().collect();
    assert_eq!(times.keys().cloned().collect::<BTreeSet<_>>(), all);
    for (source, n) in &times {
        let most = if held.contains(source) { 2 } else { 1 };
        assert!(*n <= most, "{source} handled {n} times");
    }
    assert_eq!(pending(&redis, READY_A, group), 0);
    assert_eq!(xlen(&redis, READY_A), 0, "trimmed after the last XACK");
}

#[test]
fn a_python_consumer_killed_mid_work_leaves_its_entries_for_another_to_claim_a_minute_later() {
    consumer_killed_mid_work(
        Lang {
            program: python(),
            dir: "python",
            ext: "py",
        },
        Successor::Another,
    );
}

#[test]
fn a_python_consumer_killed_mid_work_takes_its_entries_back_first_when_restarted_under_its_name() {
    consumer_killed_mid_work(
        Lang {
            program: python(),
            dir: "python",
            ext: "py",
        },
        Successor::SameName,
    );
}

#[test]
fn a_node_consumer_killed_mid_work_leaves_its_entries_for_another_to_claim_a_minute_later() {
    consumer_killed_mid_work(
        Lang {
            program: node(),
            dir: "node",
            ext: "js",
        },
        Successor::Another,
    );
}

#[test]
fn a_node_consumer_killed_mid_work_takes_its_entries_back_first_when_restarted_under_its_name() {
    consumer_killed_mid_work(
        Lang {
            program: node(),
            dir: "node",
            ext: "js",
        },
        Successor::SameName,
    );
}

// ---- trim.lua ------------------------------------------------------------------------------

/// Runs examples/trim.lua on `stream` as the README shows (`redis-cli --eval`); what it returns.
fn trim_lua(redis: &RedisServer, stream: &str) -> String {
    let out = Command::new("redis-cli")
        .args(["-u", &redis.url(), "--eval"])
        .arg(repo().join("examples/trim.lua"))
        .arg(stream)
        .output()
        .unwrap();
    assert!(out.status.success(), "redis-cli --eval trim.lua failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// examples/README.md, "Trimming safely": trim.lua removes what every group has received and
/// acknowledged, up to the oldest entry some group still needs, and keeps every entry a group
/// holds pending (read, not acknowledged) as well as every entry it has not been given yet.
///
/// A stream of ten entries with explicit ids (several in one millisecond, so that "the entry
/// after last-delivered-id" is a sequence number + 1) and two groups: `senders` reads six and
/// acknowledges the 1st, 2nd and 4th; `audit` reads and acknowledges all ten. Each step names
/// what is left and trim.lua's return exactly:
/// - with no group yet, the stream is left alone;
/// - the 1st and 2nd go (below `senders`' oldest pending, the 3rd); the 4th, acknowledged by
///   both groups, stays above it (XTRIM MINID trims a prefix); the pending 3rd, 5th, 6th stay,
///   still claimable with their fields (XAUTOCLAIM);
/// - acknowledging the 3rd frees the 3rd and 4th; the 5th and 6th the 5th and 6th, and the
///   four `senders` has not been given stay;
/// - then `audit` is the lower group: an entry it holds pending keeps itself and everything
///   after, though `senders` is done with them, and once acknowledged, what `audit` has not
///   been given stays.
#[test]
fn trim_lua_keeps_every_entry_a_group_holds_pending_or_has_not_been_given() {
    bash();
    let redis = RedisServer::start();
    let mut con = redis.con();
    let s = "pacer:{carrier-a}:ready";
    let e = [
        "1-1", "1-2", "1-3", "2-0", "2-1", "3-0", "3-1", "3-2", "4-0", "5-0",
    ];
    // Entries under the ids given (field `n` = the id).
    let add = |con: &mut redis::Connection, ids: &[&str]| {
        for id in ids {
            let _: String = redis::cmd("XADD")
                .arg(s)
                .arg(*id)
                .arg("n")
                .arg(*id)
                .query(con)
                .unwrap();
        }
    };
    add(&mut con, &e);
    let left = |want: &[&str]| {
        assert_eq!(ids(&redis, s), want, "what is left");
    };
    assert_eq!(trim_lua(&redis, s), "0", "no group");
    left(&e);

    let read = |con: &mut redis::Connection, group: &str, count: usize| {
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg("c1")
            .arg("COUNT")
            .arg(count)
            .arg("STREAMS")
            .arg(s)
            .arg(">")
            .query(con)
            .unwrap();
    };
    let ack = |con: &mut redis::Connection, group: &str, which: &[&str]| {
        let n: usize = redis::cmd("XACK")
            .arg(s)
            .arg(group)
            .arg(which)
            .query(con)
            .unwrap();
        assert_eq!(n, which.len(), "acknowledged by {group}: {which:?}");
    };
    for group in ["senders", "audit"] {
        pacer::testkit::create_group(&mut con, s, group);
    }
    read(&mut con, "senders", 6);
    ack(&mut con, "senders", &[e[0], e[1], e[3]]);
    read(&mut con, "audit", 10);
    ack(&mut con, "audit", &e);

    assert_eq!(trim_lua(&redis, s), "2");
    left(&e[2..]);
    let held = || -> Vec<String> { pending_entries(&redis, s, "senders").into_keys().collect() };
    assert_eq!(held(), [e[2], e[4], e[5]]);
    // What a crashed consumer held is there for the next to claim, fields and all.
    let claimed: redis::streams::StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
        .arg(s)
        .arg("senders")
        .arg("c2")
        .arg(0)
        .arg("0-0")
        .query(&mut con)
        .unwrap();
    assert!(claimed.deleted_ids.is_empty(), "{:?}", claimed.deleted_ids);
    let fields: Vec<(String, Option<String>)> = claimed
        .claimed
        .iter()
        .map(|entry| (entry.id.clone(), entry.get("n")))
        .collect();
    let want: Vec<(String, Option<String>)> = [e[2], e[4], e[5]]
        .iter()
        .map(|id| (id.to_string(), Some(id.to_string())))
        .collect();
    assert_eq!(fields, want, "claimed by c2");
    assert_eq!(trim_lua(&redis, s), "0", "nothing new acknowledged");
    left(&e[2..]);

    ack(&mut con, "senders", &[e[2]]);
    assert_eq!(trim_lua(&redis, s), "2");
    left(&e[4..]);
    ack(&mut con, "senders", &[e[4], e[5]]);
    assert_eq!(trim_lua(&redis, s), "2");
    left(&e[6..]);
    assert!(held().is_empty());

    // Two more entries: audit takes one and holds it; senders takes everything and acks it.
    add(&mut con, &["6-0", "6-1"]);
    read(&mut con, "audit", 1);
    read(&mut con, "senders", 10);
    ack(&mut con, "senders", &[e[6], e[7], e[8], e[9], "6-0", "6-1"]);
    assert_eq!(trim_lua(&redis, s), "4");
    left(&["6-0", "6-1"]);
    ack(&mut con, "audit", &["6-0"]);
    assert_eq!(trim_lua(&redis, s), "1");
    left(&["6-1"]);
    assert_eq!(
        pending(&redis, s, "senders") + pending(&redis, s, "audit"),
        0
    );
}

// ---- scripts/demo.sh -----------------------------------------------------------------------

/// How long scripts/demo.sh may take in all: its `cargo build` (seconds: the suite's own
/// debug build, see below) and its waits, each bounded by `PACER_DEMO_TIMEOUT`.
const DEMO_LIMIT: Duration = Duration::from_secs(15 * 60);

/// README "## The two commands": `scripts/demo.sh` runs pacer for real (its own redis-server,
/// a release build of pacer with config.yaml, a burst of events to carrier-a) and prints
/// `pacer report` for the run, per route, as the README's sample shows.
///
/// Run on the debug build (`PACER_DEMO_PROFILE=dev`), which `cargo test` has just built: the
/// same code, and the script's `cargo build` step still runs (a no-op here), where a release
/// build from scratch added about 3.5 minutes to a CI run of the suite. The release build
/// itself is what `cargo bench` and the README's run command build.
///
/// Run with 50 events, the 50th naming an unknown route (`--bad-every 50`), so that the report
/// accounts for exactly 50: dispatched on carrier-a or (rerouted) carrier-b, rejected or
/// dead-lettered as `unknown_route=1`; every route's busiest second within `rate x 1 s +
/// burst`; exit 0. Killed (its process group: the script traps TERM and stops what it started)
/// past `DEMO_LIMIT`.
#[test]
fn the_demo_script_runs_pacer_for_real_and_reports_every_event_per_route() {
    use std::os::unix::process::CommandExt;
    let dir = TempDir::new("demo");
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let started = Instant::now();
    let mut demo = Command::new("bash");
    // What cargo sets for a test, not for a shell: CARGO_MANIFEST_DIR, for one, reruns ring's
    // build script (it watches it) and so rebuilds ring, rustls, redis and pacer in release,
    // here and again at the next `cargo build --release` from a shell.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if ["CARGO_PKG_", "CARGO_BIN_EXE_"]
            .iter()
            .any(|p| name.starts_with(p))
            || [
                "CARGO",
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
            ]
            .contains(&name.as_ref())
        {
            demo.env_remove(name.as_ref());
        }
    }
    let mut child = demo
        .arg(repo().join("scripts/demo.sh"))
        .current_dir(repo())
        .env("PACER_DEMO_EVENTS", "50")
        .env("PACER_DEMO_PROFILE", "dev")
        .env("PACER_DEMO_TIMEOUT", "120")
        // Its own redis-server and a free metrics port, whatever this shell says.
        .env_remove("PACER_REDIS_URL")
        .env_remove("PACER_METRICS_LISTEN")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let group = format!("-{}", child.id());
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > DEMO_LIMIT {
            for (sig, grace) in [("-TERM", 20), ("-KILL", 0)] {
                let _ = Command::new("kill").args([sig, "--", &group]).status();
                let _ = pacer::testkit::wait_until(Duration::from_secs(grace), || {
                    child.try_wait().unwrap().is_some()
                });
            }
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = std::fs::read_to_string(&out_path).unwrap();
    let err = std::fs::read_to_string(&err_path).unwrap();
    let took = started.elapsed();
    eprintln!("scripts/demo.sh took {took:.1?}:\n{out}\nstderr:\n{err}");
    let status = status.unwrap_or_else(|| panic!("scripts/demo.sh still ran after {DEMO_LIMIT:?}"));
    assert!(status.success(), "scripts/demo.sh failed ({status})");

    assert!(out.contains("pushed 50 events to pacer:out"), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    let header = lines
        .iter()
        .position(|l| l.starts_with("entries written in the last "))
        .expect("the report's first line");
    let columns: Vec<&str> = lines[header + 1].split_whitespace().collect();
    assert_eq!(
        columns,
        [
            "route",
            "rate",
            "burst",
            "dispatched",
            "rerouted",
            "rejected",
            "max",
            "in",
            "1s/limit",
            "min",
            "gap",
            "ms",
            "late",
            "p50/p99/max"
        ],
        "the report's header"
    );
    // route rate burst dispatched rerouted rejected max/limit min-gap late
    let mut accounted = 0;
    let mut routes = Vec::new();
    for line in &lines[header + 2..header + 4] {
        let w: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(w.len(), 9, "{line}");
        let n = |i: usize| -> u64 { w[i].parse().unwrap_or_else(|_| panic!("{line}")) };
        routes.push(w[0]);
        accounted += n(3) + n(5);
        let (max, limit) = w[6].split_once('/').unwrap();
        let (max, limit): (u64, u64) = (max.parse().unwrap(), limit.parse().unwrap());
        assert!(max <= limit && max > 0, "{line}");
        if w[0] == "carrier-a" {
            assert_eq!(n(4), 0, "carrier-a is nobody's fallback: {line}");
        } else {
            assert_eq!(
                n(4),
                n(3),
                "carrier-b dispatches only carrier-a's events: {line}"
            );
        }
    }
    assert_eq!(routes, ["carrier-a", "carrier-b"]);
    assert_eq!(lines[header + 4], "dead letters: unknown_route=1");
    assert_eq!(accounted + 1, 50, "dispatched + rejected + dead letters");
}
