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
//! Over 400 lines: one test per example program and language, sharing one rig.

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
        let path = repo()
            .join("examples")
            .join(self.dir)
            .join(format!("{script}.{}", self.ext));
        let child = Command::new(&self.program)
            .arg(&path)
            .args(args)
            .env("PACER_REDIS_URL", redis.url())
            .env("EXIT_WHEN_IDLE", EXIT_WHEN_IDLE)
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
