//! A pacer worker (the real binary) behind Redis Sentinel where every node, the sentinels too,
//! speaks only TLS and requires a client certificate, the data nodes admit pacer only as the
//! README's least-privilege ACL user, and the sentinels require a user of their own
//! (`Sentinels::start_tls`). Both flows end each event exactly once, through a kill -9 of the
//! master and the sentinels' promotion of its replica; and a wrong or missing credential stops
//! the worker with a message naming the setting to fix.

mod common;

use common::{
    assert_one_shot_commands_read_everything, inbound_body, pending_on, read_on, readme_acl_user,
    run_until_exit, start,
};
use pacer::report::max_in_window;
use pacer::testkit::{free_port, wait_until, Sentinels, TempDir, TlsFiles};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const PACER_PASSWORD: &str = "pacer-acl-pw";
/// pacer's user on the sentinels: only what redis-rs asks a sentinel (`SENTINEL MASTERS`, and
/// `ROLE` to check it is one).
const SENTINEL_USER: &str = "pacer-sentinel";
const SENTINEL_PASSWORD: &str = "pacer-sentinel-pw";

const READY: &str = "pacer:{r}:ready";
const OUTPUTS: [&str; 6] = [
    READY,
    "pacer:rejected",
    "pacer:dead",
    "pacer:accepted",
    "pacer:in-rejected",
    "pacer:in-dead",
];

/// The secured set-up: one master, one replica, three sentinels; pacer's users on the data
/// nodes and on the sentinels are the README's.
fn secured_sentinels(files: &TlsFiles) -> Sentinels {
    let pacer_user = readme_acl_user("acl-setuser", "pacer", PACER_PASSWORD)[1..].join(" ");
    let sentinel_user =
        readme_acl_user("acl-sentinel-user", SENTINEL_USER, SENTINEL_PASSWORD)[1..].join(" ");
    Sentinels::start_tls(1, files, &[&pacer_user], &[&sentinel_user])
}

/// What a worker's config says about the sentinels' credentials.
enum SentinelAuth {
    /// `username` and `password_file` (right).
    Given,
    /// Only the master name.
    Missing,
}

/// A worker config reaching the sentinels by `rediss://` only, as the README's user on the
/// master (password from a file: `master_password`), metrics on `metrics`.
fn write_config(
    dir: &TempDir,
    name: &str,
    sentinels: &Sentinels,
    files: &TlsFiles,
    metrics: u16,
    master_password: &str,
    auth: SentinelAuth,
) -> std::path::PathBuf {
    let master_pw = dir.write(
        &format!("{name}.master.pw"),
        &format!("{master_password}\n"),
    );
    let sentinel = match auth {
        SentinelAuth::Given => {
            let pw = dir.write(
                &format!("{name}.sentinel.pw"),
                &format!("{SENTINEL_PASSWORD}\n"),
            );
            format!(
                "{{master_name: {}, username: {SENTINEL_USER}, password_file: \"{}\"}}",
                sentinels.master_name,
                pw.display()
            )
        }
        SentinelAuth::Missing => format!("{{master_name: {}}}", sentinels.master_name),
    };
    let body = "outbound:\n  streams: [\"pacer:out\"]\n  routes:\n    r: {rate: 100/s, burst: 1, max_wait: 3s}\n"
        .to_string()
        + &inbound_body("{name: per-source, key: [source], algorithm: sliding_log, limits: [5/s]}");
    let text = format!(
        "redis:\n  mode: sentinel\n  url: \"{urls}\"\n  username: pacer\n  password_file: \"{pw}\"\n  sentinel: {sentinel}\n  tls: {{ca_file: \"{ca}\", cert_file: \"{cert}\", key_file: \"{key}\"}}\n  timeout: 500ms\nmetrics:\n  listen: 127.0.0.1:{metrics}\nworker:\n  batch: 64\n  drain: 1s\n  claim_idle: 5s\n{body}",
        urls = sentinels.urls(),
        pw = master_pw.display(),
        ca = files.ca.display(),
        cert = files.client_cert.display(),
        key = files.client_key.display(),
    );
    assert!(text.contains("rediss://") && !text.contains("redis://"));
    dir.write(&format!("{name}.yaml"), &text)
}

/// XADDs one entry per field list to `stream`; the entry ids.
fn push(con: &mut redis::Connection, stream: &str, events: &[Vec<(&str, String)>]) -> Vec<String> {
    let mut pipe = redis::pipe();
    for fields in events {
        let cmd = pipe.cmd("XADD").arg(stream).arg("*");
        for (k, v) in fields {
            cmd.arg(*k).arg(v);
        }
    }
    pipe.query(con).expect("pushing events")
}

/// (source stream, source id) -> the outputs holding it.
fn placements(con: &mut redis::Connection) -> BTreeMap<(String, String), Vec<&'static str>> {
    let mut at: BTreeMap<(String, String), Vec<&'static str>> = BTreeMap::new();
    for stream in OUTPUTS {
        for e in read_on(con, stream) {
            let field = |name: &str| e.field(name).unwrap_or_default().to_string();
            let key = (field("pacer_source_stream"), field("pacer_source_id"));
            at.entry(key).or_default().push(stream);
        }
    }
    at
}

/// Waits (bounded) until every pushed entry ended somewhere and nothing is pending.
fn settled(sentinels: &Sentinels, port: u16, pushed: &[(&str, String)], limit: Duration) -> bool {
    wait_until(limit, || {
        let mut con = sentinels.con(port);
        let at = placements(&mut con);
        pushed
            .iter()
            .all(|(s, id)| at.contains_key(&(s.to_string(), id.clone())))
            && pending_on(&mut con, "pacer:out") == 0
            && pending_on(&mut con, "pacer:in") == 0
    })
}

/// Each pushed entry ended exactly once, outbound ones on the ready stream, inbound ones
/// accepted or rejected; the outputs hold nothing else. The inbound entries accepted and rejected.
fn assert_each_once(
    con: &mut redis::Connection,
    pushed: &[(&str, String)],
    log: &str,
) -> (usize, usize) {
    let at = placements(con);
    let (mut accepted, mut rejected) = (0, 0);
    for (stream, id) in pushed {
        let ended = at.get(&(stream.to_string(), id.clone()));
        let ok = match (*stream, ended.map(Vec::as_slice)) {
            ("pacer:out", Some([READY])) => true,
            ("pacer:in", Some(["pacer:accepted"])) => {
                accepted += 1;
                true
            }
            ("pacer:in", Some(["pacer:in-rejected"])) => {
                rejected += 1;
                true
            }
            _ => false,
        };
        assert!(ok, "{stream} {id} ended in {ended:?}; log:\n{log}");
    }
    assert_eq!(at.len(), pushed.len(), "outputs hold entries never pushed");
    (accepted, rejected)
}

/// 40 outbound events and 10 inbound ones from each of `sources`, onto the node on `port`.
fn push_batch(
    sentinels: &Sentinels,
    port: u16,
    tag: &str,
    sources: &[&str],
) -> Vec<(&'static str, String)> {
    let mut con = sentinels.con(port);
    let out: Vec<_> = (0..40)
        .map(|i| vec![("route", "r".to_string()), ("n", format!("{tag}{i}"))])
        .collect();
    let inbound: Vec<_> = sources
        .iter()
        .flat_map(|s| (0..10).map(move |i| vec![("source", s.to_string()), ("n", format!("{i}"))]))
        .collect();
    let mut pushed: Vec<(&str, String)> = push(&mut con, "pacer:out", &out)
        .into_iter()
        .map(|id| ("pacer:out", id))
        .collect();
    pushed.extend(
        push(&mut con, "pacer:in", &inbound)
            .into_iter()
            .map(|id| ("pacer:in", id)),
    );
    pushed
}

/// No source had more than its 5/s accepted in any second.
fn assert_inbound_limit(con: &mut redis::Connection) {
    let mut by_source: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for e in read_on(con, "pacer:accepted") {
        let source = e.field("source").unwrap_or_default().to_string();
        by_source.entry(source).or_default().push(e.ms);
    }
    for (source, times) in by_source {
        let seen = max_in_window(&times, 1000);
        assert!(seen <= 5, "{source}: {seen} accepted in a second");
    }
}

fn replication_offset(sentinels: &Sentinels, port: u16, field: &str) -> i64 {
    let text: String = redis::cmd("INFO")
        .arg("replication")
        .query(&mut sentinels.con(port))
        .unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(-1)
}

/// Lines of a worker's log that say something went wrong with credentials, TLS verification or
/// the flows. Not the WARNs of the failover itself (the killed master's dropped connection).
fn bad_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| {
            l.contains(" ERROR ")
                || [
                    "NOPERM",
                    "WRONGPASS",
                    "NOAUTH",
                    "AuthenticationFailed",
                    "certificate",
                    "fatal alert",
                    "panicked",
                ]
                .iter()
                .any(|w| l.contains(w))
        })
        .collect()
}

/// The set-up is what it claims: no node answers plain TCP, TLS without a client certificate,
/// or a client that does not log in (the `default` user is off).
fn assert_locked(sentinels: &Sentinels, files: &TlsFiles, ports: &[u16]) {
    let read = |p: &std::path::Path| std::fs::read(p).unwrap();
    for &port in ports {
        let ping = |client: redis::RedisResult<redis::Client>| {
            client
                .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
                .and_then(|mut con| redis::cmd("PING").query::<String>(&mut con))
        };
        let plain = ping(redis::Client::open(format!("redis://127.0.0.1:{port}")));
        assert!(plain.is_err(), "port {port} answers plain TCP");
        let no_cert = redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(read(&files.ca)),
        };
        let anonymous_cert = redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read(&files.client_cert),
                client_key: read(&files.client_key),
            }),
            root_cert: Some(read(&files.ca)),
        };
        let url = format!("rediss://127.0.0.1:{port}");
        let without_cert = ping(redis::Client::build_with_tls(url.clone(), no_cert));
        assert!(
            without_cert.is_err(),
            "port {port} answers TLS without a client certificate"
        );
        let anonymous = ping(redis::Client::build_with_tls(url, anonymous_cert));
        assert!(
            anonymous
                .as_ref()
                .is_err_and(|e| e.to_string().contains("NOAUTH")),
            "port {port} without a user: {anonymous:?}"
        );
        // And the set-up's admin gets in: the refusals above are not a dead port.
        let _: String = redis::cmd("PING").query(&mut sentinels.con(port)).unwrap();
    }
}

/// Both flows exactly once over TLS + ACL behind TLS + auth sentinels,
/// then through a kill -9 of the master: events pushed to the promoted replica are each ended
/// once within a bounded time, and the worker names the new master from the sentinels.
#[test]
fn a_worker_behind_tls_sentinels_with_acl_users_runs_both_flows_through_a_kill_9_failover() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let began = Instant::now();
    let files = TlsFiles::generate();
    let mut sentinels = secured_sentinels(&files);
    let mut ports: Vec<u16> = sentinels.servers.iter().map(|s| s.port).collect();
    ports.extend(sentinels.sentinel_ports());
    assert_locked(&sentinels, &files, &ports);
    let set_up = began.elapsed();

    let dir = TempDir::new("sentinel-tls");
    let metrics = free_port();
    let config = write_config(
        &dir,
        "w",
        &sentinels,
        &files,
        metrics,
        PACER_PASSWORD,
        SentinelAuth::Given,
    );
    let worker = start(&config, metrics);

    // 1. Both flows on the first master.
    let old = sentinels.master_port().expect("a master");
    let first = push_batch(&sentinels, old, "a", &["s1", "s2"]);
    assert!(
        settled(&sentinels, old, &first, Duration::from_secs(20)),
        "the first batch did not settle; log:\n{}",
        worker.log_text()
    );
    let (accepted, rejected) =
        assert_each_once(&mut sentinels.con(old), &first, &worker.log_text());
    // 10 a source at once against 5/s: some of each (the limit binds, and is not everything).
    assert!(
        accepted > 0 && rejected > 0,
        "{accepted} accepted, {rejected} rejected"
    );
    assert_inbound_limit(&mut sentinels.con(old));

    // The replica holds all of it before the kill (no write is lost to the failover itself:
    // what follows is pacer's doing).
    let target = replication_offset(&sentinels, old, "master_repl_offset:");
    let replica = sentinels
        .servers
        .iter()
        .find(|s| s.port != old)
        .unwrap()
        .port;
    assert!(
        wait_until(Duration::from_secs(10), || replication_offset(
            &sentinels,
            replica,
            "slave_repl_offset:"
        ) >= target),
        "the replica did not catch up"
    );

    // 2. kill -9 the master; the sentinels (over TLS, as their own users) promote the replica.
    let killed_at = Instant::now();
    assert_eq!(sentinels.kill_master(), old);
    let new = sentinels
        .wait_new_master(old, Duration::from_secs(20))
        .expect("the sentinels promote the replica");
    assert_eq!(new, replica);
    let promoted_in = killed_at.elapsed();
    let pushed_at = Instant::now();
    let second = push_batch(&sentinels, new, "b", &["s3"]);
    let ended = settled(&sentinels, new, &second, Duration::from_secs(10));
    let followed_in = pushed_at.elapsed();
    let log = worker.log_text();
    assert!(
        ended,
        "events pushed to the promoted master did not settle within 10 s; log:\n{log}"
    );
    let all: Vec<_> = first.iter().chain(&second).cloned().collect();
    assert_each_once(&mut sentinels.con(new), &all, &log);
    assert_inbound_limit(&mut sentinels.con(new));
    assert!(
        log.contains("the sentinels name a new master; switching")
            && log.contains(&format!("to=127.0.0.1:{new}")),
        "the worker did not say it followed the sentinels to {new}:\n{log}"
    );
    let bad = bad_lines(&log);
    assert!(
        bad.is_empty(),
        "the worker's log has errors:\n{}\nthe whole log:\n{log}",
        bad.join("\n")
    );
    // The one-shot commands, as the same users over TLS, on the promoted master.
    assert_one_shot_commands_read_everything(&config);
    eprintln!(
        "sentinel tls: set-up {set_up:?}, promotion {promoted_in:?} after the kill, the promoted master's events ended {followed_in:?} after their push, {:?} in all",
        began.elapsed()
    );
}

/// The same worker config, save one credential, does not silently work. The
/// right config first (it does work, so the refusals below are the credential's doing); then a
/// wrong sentinel password (`PACER_REDIS_SENTINEL_PASSWORD` over the right file), no sentinel
/// credentials, and a wrong password for the README's user on the master. Each exits at start,
/// never ready, with a message naming the setting to fix: the sentinels' or the master's.
#[test]
fn a_wrong_or_missing_credential_stops_the_worker_naming_the_setting() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let files = TlsFiles::generate();
    let sentinels = secured_sentinels(&files);
    let dir = TempDir::new("sentinel-tls-refused");
    let metrics = free_port();
    let config = |name: &str, master_password: &str, auth| {
        write_config(
            &dir,
            name,
            &sentinels,
            &files,
            metrics,
            master_password,
            auth,
        )
    };

    let right = config("right", PACER_PASSWORD, SentinelAuth::Given);
    let worker = start(&right, metrics);
    drop(worker);

    let cases = [
        (
            "a wrong sentinel password",
            right.clone(),
            vec![("PACER_REDIS_SENTINEL_PASSWORD", "not-the-password")],
            "redis.sentinel",
        ),
        (
            "no sentinel credentials",
            config("no-sentinel-auth", PACER_PASSWORD, SentinelAuth::Missing),
            Vec::new(),
            "redis.sentinel",
        ),
        (
            "a wrong master password",
            config("wrong-master", "not-the-password", SentinelAuth::Given),
            Vec::new(),
            "redis.password_file",
        ),
    ];
    for (case, config, env, setting) in cases {
        let (code, was_ready, log) = run_until_exit(&config, metrics, &env);
        assert!(
            matches!(code, Some(c) if c != 0),
            "{case}: the worker did not exit with an error ({code:?}); log:\n{log}"
        );
        assert!(
            !was_ready,
            "{case}: the worker said it was ready; log:\n{log}"
        );
        let last = log.lines().last().unwrap_or_default();
        assert!(
            last.contains("refused") && last.contains(setting),
            "{case}: the message does not name {setting}:\n{log}"
        );
        // Naming one side only: a user told "the sentinels" must not go fix the master.
        let other = if setting == "redis.sentinel" {
            "redis.password_file"
        } else {
            "redis.sentinel"
        };
        assert!(
            !last.contains(other),
            "{case}: the message also names {other}: {last}"
        );
        // Said once, as final: not first as something retried.
        assert!(
            !log.contains("no reachable master yet; retrying"),
            "{case}: a refusal logged as retried before the worker gave up:\n{log}"
        );
        eprintln!("{case}: {last}");
    }
}
