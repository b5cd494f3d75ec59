//! Helpers shared by the process-level tests: configs, pushing events, reading outputs.
#![allow(dead_code)]

use pacer::report::{max_in_window, read_all, OutputEntry};
use pacer::testkit::{http_get, wait_until, Pacer, RedisServer, TempDir};
use redis::Commands;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_pacer"))
}

/// Writes a config for `redis` with metrics on `metrics_port`; `body` holds the `outbound:`
/// section and anything else.
pub fn config(
    dir: &TempDir,
    name: &str,
    redis: &RedisServer,
    metrics_port: u16,
    worker: &str,
    body: &str,
) -> PathBuf {
    let text = format!(
        "redis:\n  url: {}\n  timeout: 500ms\nmetrics:\n  listen: 127.0.0.1:{metrics_port}\nworker:\n{worker}\n{body}\n",
        redis.url()
    );
    dir.write(name, &text)
}

/// An `inbound:` section reading `pacer:in`, forwarding to `pacer:accepted` and rejecting to
/// `pacer:in-rejected`, with one rule (a YAML flow mapping).
pub fn inbound_body(rule: &str) -> String {
    format!(
        "inbound:\n  streams: [\"pacer:in\"]\n  forward_stream: \"pacer:accepted\"\n  rejected_stream: \"pacer:in-rejected\"\n  rules:\n    - {rule}\n"
    )
}

/// Starts pacer and waits until `/readyz` says ready.
pub fn start(config: &Path, metrics_port: u16) -> Pacer {
    start_wrapped(&[], &[], config, metrics_port)
}

pub fn start_wrapped(
    wrapper: &[String],
    env: &[(&str, &str)],
    config: &Path,
    metrics_port: u16,
) -> Pacer {
    let mut pacer = Pacer::run_wrapped(wrapper, bin(), config, env);
    let ready = wait_until(Duration::from_secs(15), || {
        matches!(http_get(metrics_port, "/readyz"), Some((200, _)))
    });
    if !ready {
        pacer.kill();
        panic!("pacer did not become ready:\n{}", pacer.log_text());
    }
    pacer
}

/// XADDs each event (a list of field/value pairs; names as text or raw bytes) to `stream`;
/// returns the entry ids.
pub fn push<K: AsRef<[u8]>>(
    redis: &RedisServer,
    stream: &str,
    events: &[Vec<(K, Vec<u8>)>],
) -> Vec<String> {
    let mut con = redis.con();
    let mut pipe = redis::pipe();
    for fields in events {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(stream).arg("*");
        for (k, v) in fields {
            cmd.arg(k.as_ref()).arg(v.as_slice());
        }
        pipe.add_command(cmd);
    }
    pipe.query(&mut con).expect("pushing events")
}

pub fn event(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect()
}

/// How many entries each of `streams` holds (XLEN), in order.
pub fn lengths(redis: &RedisServer, streams: &[&str]) -> Vec<usize> {
    let mut con = redis.con();
    streams
        .iter()
        .map(|s| redis::cmd("XLEN").arg(*s).query::<usize>(&mut con).unwrap())
        .collect()
}

/// Every entry of `stream`.
pub fn read(redis: &RedisServer, stream: &str) -> Vec<OutputEntry> {
    let (rt, mut con) = redis.async_con();
    rt.block_on(read_all(&mut con, stream)).unwrap()
}

/// Whether a client (a worker's reader) waits in a blocking XREADGROUP: entries pushed now go to
/// that read at once, all of them if pushed in one transaction.
pub fn a_read_is_blocked(redis: &RedisServer) -> bool {
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut redis.con())
        .unwrap();
    clients
        .lines()
        .any(|c| c.contains(" flags=b ") && c.contains(" cmd=xreadgroup "))
}

/// Entries of the group still pending on `stream`.
pub fn pending(redis: &RedisServer, stream: &str, group: &str) -> i64 {
    let reply: redis::Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query(&mut redis.con())
        .unwrap();
    match reply {
        redis::Value::Array(v) => match v.first() {
            Some(redis::Value::Int(n)) => *n,
            _ => 0,
        },
        _ => 0,
    }
}

/// Entries of `stream` the group has not finished: pending, or not yet delivered (after its
/// last-delivered-id). Pending alone reads 0 while the workers have not come back to a node
/// (after a failover) to read what was pushed there meanwhile.
pub fn unfinished(redis: &RedisServer, stream: &str, group: &str) -> i64 {
    pending(redis, stream, group).saturating_add(unread(redis, stream, group))
}

/// Entries of `stream` the group has not delivered yet (after its last-delivered-id; all of
/// them, as i64::MAX, while it has no such group).
pub fn unread(redis: &RedisServer, stream: &str, group: &str) -> i64 {
    let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(&mut redis.con())
        .unwrap_or_default();
    let Some(last) = groups
        .iter()
        .find(|g| {
            redis::from_redis_value::<String>(g["name"].clone())
                .ok()
                .as_deref()
                == Some(group)
        })
        .and_then(|g| redis::from_redis_value::<String>(g["last-delivered-id"].clone()).ok())
    else {
        return i64::MAX;
    };
    let unread: Vec<redis::Value> = redis::cmd("XRANGE")
        .arg(stream)
        .arg(format!("({last}"))
        .arg("+")
        .query(&mut redis.con())
        .unwrap();
    unread.len() as i64
}

/// Where each input entry ended: source id -> the output streams that hold it.
pub fn placements(redis: &RedisServer, outputs: &[&str]) -> BTreeMap<String, Vec<String>> {
    let mut at: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for stream in outputs {
        for e in read(redis, stream) {
            let source = e
                .field("pacer_source_id")
                .expect("pacer_source_id")
                .to_string();
            at.entry(source).or_default().push(stream.to_string());
        }
    }
    at
}

/// On a cluster-mode Redis: every one of `n` events ends in some output, every output is used
/// (each path of the flow ran) and no call was refused as CROSSSLOT.
pub fn assert_every_path_runs_on_a_cluster(
    redis: &RedisServer,
    pacer: &Pacer,
    outputs: &[&str],
    n: usize,
) {
    assert!(
        wait_until(Duration::from_secs(15), || placements(redis, outputs).len()
            == n),
        "log:\n{}",
        pacer.log_text()
    );
    for stream in outputs {
        assert!(!read(redis, stream).is_empty(), "{stream} is empty");
    }
    // redis-rs says "CrossSlot", Redis "CROSSSLOT": either is a call across slots.
    let log = pacer.log_text().to_lowercase();
    assert!(!log.contains("crossslot"), "a call across slots:\n{log}");
}

pub fn redis_time_ms(redis: &RedisServer) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut redis.con()).unwrap();
    s * 1000 + us / 1000
}

pub fn keys(redis: &RedisServer) -> Vec<String> {
    redis.con().keys("*").unwrap()
}

/// Checks the promise on one ready stream: no rolling window W holds more than rate × W + burst
/// entries by entry-id time. Returns the entries' times.
pub fn assert_rate(redis: &RedisServer, stream: &str, per_second: f64, burst: f64) -> Vec<i64> {
    let times: Vec<i64> = read(redis, stream).iter().map(|e| e.ms).collect();
    for w in [1, 5, 10, 20, 50, 100, 200, 250, 500, 1000, 2000, 5000] {
        let limit = per_second * w as f64 / 1000.0 + burst;
        let seen = max_in_window(&times, w);
        assert!(
            seen as f64 <= limit,
            "{stream}: {seen} entries in a {w} ms window, limit {limit}"
        );
    }
    times
}

/// Checks that every input entry in `ids` ended in exactly one of `outputs` and nothing is left
/// pending; the placements, for further checks.
pub fn assert_each_once(
    redis: &RedisServer,
    ids: &[String],
    outputs: &[&str],
    input: &str,
) -> BTreeMap<String, Vec<String>> {
    let at = placements(redis, outputs);
    assert_ended_once(&at, ids);
    assert_eq!(pending(redis, input, "pacer"), 0, "entries left pending");
    at
}

/// Checks that each of `pushed` ended in exactly one output (`at`: the outputs each entry
/// ended in) and that the outputs hold nothing else.
pub fn assert_ended_once<K: Ord + std::fmt::Debug>(at: &BTreeMap<K, Vec<String>>, pushed: &[K]) {
    for key in pushed {
        assert_eq!(
            at.get(key).map(Vec::len),
            Some(1),
            "entry {key:?} ended in {:?}",
            at.get(key)
        );
    }
    assert_eq!(
        at.len(),
        pushed.len(),
        "outputs hold entries that were never pushed"
    );
}

/// A sliding log's entries (µs, oldest first), as `admit.lua` stores them; empty if absent.
pub fn log_entries(con: &mut redis::Connection, key: &str) -> Vec<i64> {
    let bytes: Vec<u8> = redis::cmd("GET").arg(key).query(con).unwrap();
    pacer::admission::sliding_log::unpack(&bytes).expect("a packed log")
}

pub mod chaos;
pub mod cluster;
pub mod pressure;

/// Where each input entry ended: (source stream, source id) -> the output streams that hold it.
/// Entries of different input streams may share an id; `pacer_source_stream` tells them apart.
pub fn placements_by_stream(
    redis: &RedisServer,
    outputs: &[&str],
) -> BTreeMap<(String, String), Vec<String>> {
    let mut at: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for stream in outputs {
        for e in read(redis, stream) {
            let source = (
                e.field("pacer_source_stream")
                    .expect("pacer_source_stream")
                    .to_string(),
                e.field("pacer_source_id")
                    .expect("pacer_source_id")
                    .to_string(),
            );
            at.entry(source).or_default().push(stream.to_string());
        }
    }
    at
}

/// The output entries written for input entry `id` of `input`: each one's stream, id and pacer
/// fields, for the message of a test that found it doubled.
fn written_for(redis: &RedisServer, outputs: &[&str], input: &str, id: &str) -> String {
    let mut found = Vec::new();
    for stream in outputs {
        for e in read(redis, stream) {
            if e.field("pacer_source_stream") == Some(input)
                && e.field("pacer_source_id") == Some(id)
            {
                let pacer: Vec<String> = e
                    .fields
                    .iter()
                    .filter(|(k, _)| k.starts_with(b"pacer_"))
                    .map(|(k, v)| {
                        format!(
                            "{}={}",
                            String::from_utf8_lossy(k),
                            String::from_utf8_lossy(v)
                        )
                    })
                    .collect();
                found.push(format!("{stream} {} {}", e.id, pacer.join(" ")));
            }
        }
    }
    found.join("; ")
}

/// Like `assert_each_once`, for entries of several input streams (`(stream, ids)`), whose ids
/// may coincide: each ends in exactly one of `outputs`, once, told apart by the
/// `pacer_source_stream` every output entry carries. Nothing is left pending in the group.
pub fn assert_each_once_by_stream(
    redis: &RedisServer,
    inputs: &[(&str, &[String])],
    outputs: &[&str],
) {
    let at = placements_by_stream(redis, outputs);
    let mut expected = 0;
    for (input, ids) in inputs {
        for id in ids.iter() {
            let ended = at.get(&(input.to_string(), id.clone()));
            assert_eq!(
                ended.map(Vec::len),
                Some(1),
                "{input} entry {id} ended in {ended:?}: {}",
                written_for(redis, outputs, input, id)
            );
        }
        expected += ids.len();
        assert_eq!(
            pending(redis, input, "pacer"),
            0,
            "entries left pending in {input}"
        );
    }
    assert_eq!(
        at.len(),
        expected,
        "outputs hold entries that were never pushed"
    );
}

/// Each consumer of `group` on `stream` by name: (entries pending, idle ms), from `XINFO
/// CONSUMERS`.
pub fn consumer_table(
    con: &mut redis::Connection,
    stream: &str,
    group: &str,
) -> std::collections::BTreeMap<String, (i64, i64)> {
    let rows: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(stream)
        .arg(group)
        .query(con)
        .unwrap();
    rows.iter()
        .map(|row| {
            let field = |name: &str| {
                let at = row
                    .iter()
                    .position(|v| matches!(v, redis::Value::BulkString(b) if b == name.as_bytes()))
                    .unwrap_or_else(|| panic!("no {name} in {row:?}"));
                row[at + 1].clone()
            };
            let redis::Value::BulkString(name) = field("name") else {
                panic!("a name: {row:?}");
            };
            let (redis::Value::Int(pending), redis::Value::Int(idle)) =
                (field("pending"), field("idle"))
            else {
                panic!("counts: {row:?}");
            };
            (String::from_utf8(name).unwrap(), (pending, idle))
        })
        .collect()
}

/// A README `ACL SETUSER <user> ...` line, from the block after `<!-- <marker>`, as the
/// arguments after `ACL` (`SETUSER`, the user, its rules), `<password>` filled in: the tests
/// create the users the README gives from the README itself, so the two cannot drift apart.
pub fn readme_acl_user(marker: &str, user: &str, password: &str) -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let block = readme
        .split(&format!("<!-- {marker}"))
        .nth(1)
        .and_then(|rest| rest.split("```").nth(1))
        .unwrap_or_else(|| panic!("the {marker} block in the README"));
    let words: Vec<String> = block
        .lines()
        .skip(1) // the fence's language tag
        .flat_map(|l| l.split_whitespace())
        .filter(|w| *w != "\\")
        .map(|w| w.replace("<password>", password))
        .collect();
    assert_eq!(words[..3], ["ACL", "SETUSER", user], "{words:?}");
    words[1..].to_vec()
}

/// Runs a worker on `config` with `env` until it exits (at most 20 s): its exit code (None if it
/// did not), whether `/readyz` on `metrics` ever said 200, and its log.
pub fn run_until_exit(
    config: &Path,
    metrics: u16,
    env: &[(&str, &str)],
) -> (Option<i32>, bool, String) {
    let mut worker = Pacer::run(bin(), config, env);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut was_ready = false;
    let code = loop {
        if let Some(code) = worker.wait_for(Duration::from_millis(100)) {
            break Some(code);
        }
        was_ready |= matches!(http_get(metrics, "/readyz"), Some((200, _)));
        if std::time::Instant::now() >= deadline {
            break None;
        }
    };
    (code, was_ready, worker.log_text())
}

/// Every entry of `stream`, read over `con` (any connection: a TLS one, a cluster node's).
pub fn read_on(con: &mut redis::Connection, stream: &str) -> Vec<OutputEntry> {
    let reply: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(con)
        .expect("XRANGE");
    let mut entries = Vec::new();
    pacer::streams::parse_entries(reply, &std::sync::Arc::from(stream), 0, &mut entries)
        .expect("stream entries");
    entries
        .into_iter()
        .map(|e| OutputEntry {
            ms: e.ms(),
            id: e.id,
            fields: e.fields,
        })
        .collect()
}

/// `pacer inspect` and `pacer report` on `config` (its Redis and credentials, not the
/// environment's) exit 0 having read everything: no "cannot read" line.
pub fn assert_one_shot_commands_read_everything(config: &Path) {
    for args in [&["inspect"][..], &["report"][..]] {
        let run = std::process::Command::new(bin())
            .args(args)
            .arg("--config")
            .arg(config)
            .env_remove("PACER_REDIS_URL")
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&run.stdout);
        assert_eq!(run.status.code(), Some(0), "{args:?}: {run:?}");
        assert!(
            !out.contains("cannot read"),
            "{args:?} could not read everything:\n{out}"
        );
    }
}

/// Entries of `stream` the group `pacer` has pending (XPENDING's count), over `con` (any
/// connection: a TLS one, a node's).
pub fn pending_on(con: &mut redis::Connection, stream: &str) -> i64 {
    let (count, ..): (i64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg(stream)
        .arg("pacer")
        .query(con)
        .expect("XPENDING");
    count
}

/// The last 40 lines of a worker's log, leaving out redis-rs's own (a cluster it cannot reach
/// logs several lines every 40 ms).
pub fn tail(log: &str) -> String {
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| !l.contains("redis::cluster_handling") && !l.starts_with("  "))
        .collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// `POST /v1/admit` on the API at `port` for the identity `source`: the status, the JSON
/// answer and how long it took.
pub fn admit_source(port: u16, source: &str) -> (u16, serde_json::Value, Duration) {
    let t0 = std::time::Instant::now();
    let body = format!(r#"{{"fields": {{"source": "{source}"}}}}"#);
    let (status, _, text) =
        pacer::testkit::http_post(port, "/v1/admit", &body).expect("pacer answers");
    let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, json, t0.elapsed())
}
