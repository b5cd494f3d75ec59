//! A Redis password never reaches pacer's output: `check-config`, `report` and `produce` run
//! with a password in `PACER_REDIS_URL` (and in `PACER_REDIS_PASSWORD`) against a closed port, a
//! Redis that refuses the password, and one that takes it; stdout and stderr (logs at debug)
//! never hold it. A refused password ends the command at once, non-zero, saying so. A `pacer
//! run` worker, given the password in the URL, a password file or the environment, never
//! prints it either: its log through a Redis outage, its HTTP endpoints, and `inspect`,
//! `check-config` and `report` beside it; nor does one whose password Redis refuses.

use pacer::testkit::{free_port, RedisServer, TempDir};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const USER: &str = "pacer";
/// The password Redis knows for `USER`.
const RIGHT: &str = "s3cretpw-right";
/// Passwords Redis does not know.
const WRONG: &str = "s3cretpw-wrong";
const ELSEWHERE: &str = "s3cretpw-nowhere";

struct Run {
    code: i32,
    output: String,
    took: Duration,
}

fn pacer(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let started = Instant::now();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pacer"));
    cmd.args(args)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "debug")
        .env_remove("PACER_CONFIG")
        .env_remove("PACER_REDIS_URL")
        .env_remove("PACER_REDIS_MODE")
        .env_remove("PACER_REDIS_PASSWORD")
        .env_remove("PACER_REDIS_SENTINEL_PASSWORD");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("running pacer");
    Run {
        code: out.status.code().unwrap_or(-1),
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        took: started.elapsed(),
    }
}

/// Runs check-config, report and produce with `env`; asserts none prints `secret`; returns
/// the three runs.
fn all_commands(config: &Path, env: &[(&str, &str)], secret: &str) -> [Run; 3] {
    let runs = [
        pacer(config, &["check-config"], env),
        pacer(config, &["report"], env),
        pacer(config, &["produce", "--count", "3"], env),
    ];
    for (name, run) in ["check-config", "report", "produce"].iter().zip(&runs) {
        assert!(
            !run.output.contains(secret),
            "pacer {name} printed the password:\n{}",
            run.output
        );
    }
    runs
}

fn config(dir: &TempDir) -> std::path::PathBuf {
    dir.write(
        "pacer.yaml",
        "redis: {url: \"redis://127.0.0.1:6379\", timeout: 500ms}\noutbound:\n  streams: [\"pacer:out\"]\n  routes:\n    carrier-a: {rate: 10/s}\n",
    )
}

#[test]
fn no_command_prints_the_redis_password() {
    let redis = RedisServer::start();
    redis.add_acl_user(USER, RIGHT);
    let dir = TempDir::new("secrets");
    let config = config(&dir);
    let url = |password: &str, port: u16| format!("redis://{USER}:{password}@127.0.0.1:{port}/0");

    // (a) Nothing listens.
    let closed = free_port();
    let [check, report, produce] = all_commands(
        &config,
        &[("PACER_REDIS_URL", &url(ELSEWHERE, closed))],
        ELSEWHERE,
    );
    assert_eq!(check.code, 0, "{}", check.output);
    assert!(
        check
            .output
            .contains(&format!("redis://{USER}:***@127.0.0.1:{closed}/0")),
        "{}",
        check.output
    );
    for run in [&report, &produce] {
        assert_ne!(run.code, 0, "{}", run.output);
        assert!(run.output.contains("unavailable"), "{}", run.output);
    }

    // (b) Redis knows the user, not this password: a clear, quick, non-zero exit.
    let [_, report, produce] = all_commands(
        &config,
        &[("PACER_REDIS_URL", &url(WRONG, redis.port))],
        WRONG,
    );
    for run in [&report, &produce] {
        assert_ne!(run.code, 0, "{}", run.output);
        assert!(
            run.output.contains("refused pacer's credentials"),
            "{}",
            run.output
        );
        assert!(run.took < Duration::from_secs(5), "took {:?}", run.took);
    }
    eprintln!("wrong password: {}", report.output.trim());

    // (c) The right password: everything works, and still nothing prints it.
    let [check, report, produce] = all_commands(
        &config,
        &[("PACER_REDIS_URL", &url(RIGHT, redis.port))],
        RIGHT,
    );
    for run in [&check, &report, &produce] {
        assert_eq!(run.code, 0, "{}", run.output);
    }
    assert!(
        produce.output.contains("pushed 3 events"),
        "{}",
        produce.output
    );

    // The password from PACER_REDIS_PASSWORD, the user in the URL: the same three ways.
    let bare = format!("redis://{USER}@127.0.0.1:{}", redis.port);
    let [_, report, _] = all_commands(
        &config,
        &[("PACER_REDIS_URL", &bare), ("PACER_REDIS_PASSWORD", WRONG)],
        WRONG,
    );
    assert_ne!(report.code, 0, "{}", report.output);
    assert!(
        report.output.contains("refused pacer's credentials"),
        "{}",
        report.output
    );
    let [_, report, produce] = all_commands(
        &config,
        &[("PACER_REDIS_URL", &bare), ("PACER_REDIS_PASSWORD", RIGHT)],
        RIGHT,
    );
    assert_eq!(report.code, 0, "{}", report.output);
    assert_eq!(produce.code, 0, "{}", produce.output);
}

#[test]
fn config_problems_never_quote_a_password() {
    let dir = TempDir::new("secrets-config");
    // A password in the URL and a password file: refused, and the message does not quote it.
    let file = dir.write("password", &format!("{RIGHT}\n"));
    let config = dir.write(
        "pacer.yaml",
        &format!(
            "redis: {{url: \"redis://{USER}:{WRONG}@127.0.0.1:1,redis://{USER}:{ELSEWHERE}@127.0.0.1:2\", password_file: {}}}\noutbound:\n  streams: [\"pacer:out\"]\n  routes:\n    carrier-a: {{rate: 10/s}}\n",
            file.display()
        ),
    );
    let run = pacer(&config, &["check-config"], &[]);
    assert_eq!(run.code, 2, "{}", run.output);
    for secret in [RIGHT, WRONG, ELSEWHERE] {
        assert!(!run.output.contains(secret), "{}", run.output);
    }
    assert!(
        run.output.contains("standalone mode takes one URL"),
        "{}",
        run.output
    );
}

/// A password with characters a URL must percent-encode, so that its raw form (what Redis
/// knows, what the password file and PACER_REDIS_PASSWORD hold) and its encoded form (what the
/// URL holds) differ: either printed is a leak.
const RUN_PW: &str = "kestrel-9Vq@Lm3/Zt";
/// Another, that Redis does not know, for the refused starts.
const RUN_WRONG: &str = "osprey-4Kd@Wx8/Pn";

/// `text` percent-encoded as a URL's user info needs it (everything but the unreserved
/// characters), hex in capitals.
fn url_encoded(text: &str) -> String {
    encoded(text, false)
}

/// `text` percent-encoded, its hex digits small when `small`.
fn encoded(text: &str, small: bool) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ if small => format!("%{b:02x}"),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every form of `password` that would betray it: raw, percent-encoded (capital and small
/// hex), and each half around its `@`, raw and encoded (a message that cut it at the `@`, as
/// a URL parser might).
fn password_forms(password: &str) -> Vec<String> {
    let mut forms = vec![
        password.to_string(),
        encoded(password, false),
        encoded(password, true),
    ];
    let (head, tail) = password.split_once('@').expect("an '@' in the password");
    forms.extend([
        head.to_string(),
        tail.to_string(),
        encoded(tail, false),
        encoded(tail, true),
    ]);
    forms
}

/// The first form of `password` that `text` holds, if any.
fn leaked(text: &str, password: &str) -> Option<String> {
    password_forms(password)
        .into_iter()
        .find(|form| text.contains(form.as_str()))
}

/// Panics naming `what` and the form found if `text` holds any form of any of `passwords`.
fn assert_no_password(what: &str, text: &str, passwords: &[&str]) {
    for password in passwords {
        if let Some(form) = leaked(text, password) {
            panic!("{what} holds the password (as {form:?}):\n{text}");
        }
    }
}

/// One way of giving the worker its password: its name, the `redis:` section's lines, and the
/// environment.
type Way<'a> = (&'a str, String, Vec<(&'a str, &'a str)>);

/// A redis-server whose ACL user `USER` has `password`, given on its command line so that it
/// survives a restart (an `ACL SETUSER` would be lost with it). The default user stays open
/// for the test's own connections.
fn redis_with_user(password: &str) -> RedisServer {
    let secret = format!(">{password}");
    RedisServer::start_with(&["--user", USER, "on", &secret, "~*", "&*", "+@all"])
}

/// A config for `pacer run` with `redis` (a YAML block mapping's lines), metrics on
/// `metrics`, one outbound route.
fn run_config(dir: &TempDir, name: &str, redis: &str, metrics: u16) -> std::path::PathBuf {
    dir.write(
        name,
        &format!(
            "redis:\n{redis}  timeout: 500ms\nmetrics:\n  listen: 127.0.0.1:{metrics}\nworker:\n  drain: 1s\noutbound:\n  streams: [\"pacer:out\"]\n  routes:\n    carrier-a: {{rate: 50/s, burst: 1, max_wait: 5s}}\n"
        ),
    )
}

const READY_STREAM: &str = "pacer:{carrier-a}:ready";

fn xlen(redis: &RedisServer, stream: &str) -> usize {
    redis::cmd("XLEN")
        .arg(stream)
        .query(&mut redis.con())
        .unwrap_or(0)
}

/// Pushes `n` events for carrier-a (as the default user) and waits, up to 30 s, for the
/// ready stream to hold `n` more entries than before.
fn push_and_wait(redis: &RedisServer, worker: &pacer::testkit::Pacer, n: usize) {
    let before = xlen(redis, READY_STREAM);
    let mut pipe = redis::pipe();
    for _ in 0..n {
        pipe.cmd("XADD")
            .arg("pacer:out")
            .arg("*")
            .arg("route")
            .arg("carrier-a");
    }
    let _: Vec<String> = pipe.query(&mut redis.con()).expect("pushing events");
    let done = pacer::testkit::wait_until(Duration::from_secs(30), || {
        xlen(redis, READY_STREAM) >= before + n
    });
    assert!(done, "events not dispatched; log:\n{}", worker.log_text());
    assert_eq!(
        xlen(redis, READY_STREAM),
        before + n,
        "each dispatched once"
    );
}

/// `GET /metrics`, `/readyz` and `/healthz` on `port`: each one's status and body, as one text.
fn endpoints(port: u16) -> String {
    ["/metrics", "/readyz", "/healthz"]
        .iter()
        .map(|path| match pacer::testkit::http_get(port, path) {
            Some((status, body)) => format!("GET {path}: {status}\n{body}\n"),
            None => format!("GET {path}: no answer\n"),
        })
        .collect()
}

fn readyz(port: u16) -> Option<u16> {
    pacer::testkit::http_get(port, "/readyz").map(|(status, _)| status)
}

/// A worker given its password in the URL (percent-encoded), in `password_file`, or in
/// `PACER_REDIS_PASSWORD` (over a password file holding another) runs, dispatches, rides out
/// its Redis killed and restarted (connection errors logged), and drains on SIGTERM; its log
/// (at debug; JSON for one of them), `/metrics`, `/readyz` and `/healthz` (ready, and during
/// the outage), and `inspect`, `inspect --json`, `check-config` and `report` for the same
/// config and environment (`inspect` during the outage too) never hold the password in any
/// form.
#[test]
fn a_running_worker_never_prints_the_redis_password_however_it_is_given() {
    let mut redis = redis_with_user(RUN_PW);
    let port = redis.port;
    let dir = TempDir::new("secrets-run");
    let file = dir.write("password", &format!("{RUN_PW}\n"));
    let wrong_file = dir.write("wrong-password", &format!("{RUN_WRONG}\n"));
    let ways: [Way; 3] = [
        (
            "url",
            format!(
                "  url: \"redis://{USER}:{}@127.0.0.1:{port}/0\"\n",
                url_encoded(RUN_PW)
            ),
            vec![],
        ),
        (
            "password_file",
            format!(
                "  url: \"redis://{USER}@127.0.0.1:{port}/0\"\n  password_file: {}\n",
                file.display()
            ),
            vec![("PACER_LOG_FORMAT", "json")],
        ),
        (
            "PACER_REDIS_PASSWORD",
            format!(
                "  url: \"redis://127.0.0.1:{port}/0\"\n  username: {USER}\n  password_file: {}\n",
                wrong_file.display()
            ),
            vec![("PACER_REDIS_PASSWORD", RUN_PW)],
        ),
    ];
    // The search finds the password where it is: the URL's encoded form in the config, the
    // raw one in the file.
    let url_config = run_config(&dir, "check.yaml", &ways[0].1, free_port());
    let text = std::fs::read_to_string(&url_config).unwrap();
    assert_eq!(leaked(&text, RUN_PW), Some(url_encoded(RUN_PW)));
    assert_eq!(
        leaked(&std::fs::read_to_string(&file).unwrap(), RUN_PW).as_deref(),
        Some(RUN_PW)
    );
    // And the small-hex encoding, or half the password, in a message.
    assert_eq!(
        leaked("redis://pacer:kestrel-9Vq%40Lm3%2fZt@h:1", RUN_PW).as_deref(),
        Some("kestrel-9Vq%40Lm3%2fZt")
    );
    assert_eq!(
        leaked("auth failed for Lm3/Zt", RUN_PW).as_deref(),
        Some("Lm3/Zt")
    );

    for (way, redis_lines, env) in &ways {
        let metrics = free_port();
        let config = run_config(&dir, &format!("{way}.yaml"), redis_lines, metrics);
        let mut env_run = env.clone();
        env_run.push(("RUST_LOG", "debug"));
        let mut worker =
            pacer::testkit::Pacer::run(Path::new(env!("CARGO_BIN_EXE_pacer")), &config, &env_run);
        let ready =
            pacer::testkit::wait_until(Duration::from_secs(20), || readyz(metrics) == Some(200));
        assert!(ready, "{way}: not ready; log:\n{}", worker.log_text());
        push_and_wait(&redis, &worker, 20);
        let mut shown = vec![(format!("{way}: endpoints, ready"), endpoints(metrics))];

        // Its Redis killed: connection errors logged, not ready, endpoints and inspect shown.
        redis.kill();
        let unready =
            pacer::testkit::wait_until(Duration::from_secs(15), || readyz(metrics) == Some(503));
        assert!(unready, "{way}: still ready; log:\n{}", worker.log_text());
        std::thread::sleep(Duration::from_millis(1500));
        shown.push((format!("{way}: endpoints, Redis down"), endpoints(metrics)));
        let down = pacer(&config, &["inspect"], env);
        assert_ne!(down.code, 0, "{}", down.output);
        shown.push((format!("{way}: inspect, Redis down"), down.output));
        redis.restart();
        let back =
            pacer::testkit::wait_until(Duration::from_secs(30), || readyz(metrics) == Some(200));
        assert!(back, "{way}: not ready again; log:\n{}", worker.log_text());
        push_and_wait(&redis, &worker, 20);
        shown.push((format!("{way}: endpoints, ready again"), endpoints(metrics)));

        for args in [
            &["inspect"][..],
            &["inspect", "--json"],
            &["check-config"],
            &["report"],
        ] {
            let run = pacer(&config, args, env);
            assert_eq!(run.code, 0, "{way}: pacer {args:?}:\n{}", run.output);
            shown.push((format!("{way}: pacer {args:?}"), run.output));
        }
        worker.signal("TERM");
        let code = worker.wait_for(Duration::from_secs(15));
        let log = worker.log_text();
        assert_eq!(code, Some(0), "{way}: log:\n{log}");
        // The log says what happened: the outage, in pacer's words.
        assert!(
            log.contains("Redis calls are failing"),
            "{way}: no connection error logged:\n{log}"
        );
        // It names its Redis, through the redaction: the user kept, the password as ***.
        let named = match *way {
            "url" => format!("redis://{USER}:***@127.0.0.1:{port}/0"),
            "password_file" => format!("redis://{USER}@127.0.0.1:{port}/0"),
            _ => format!("redis://127.0.0.1:{port}/0"),
        };
        assert!(
            log.contains(&named),
            "{way}: {named} not in the log:\n{log}"
        );
        shown.push((format!("{way}: the worker's log"), log));
        for (what, text) in &shown {
            assert_no_password(what, text, &[RUN_PW, RUN_WRONG]);
        }
        let outputs: usize = shown.iter().map(|(_, t)| t.len()).sum();
        eprintln!(
            "{way}: {} outputs, {outputs} bytes, no password",
            shown.len()
        );
    }
}

/// A worker whose password Redis refuses, given in the URL (percent-encoded), in
/// `password_file` or in `PACER_REDIS_PASSWORD`, exits 1 within 15 s saying the password was
/// refused, never ready; neither its output nor `check-config`'s nor
/// `inspect`'s holds the password it was given, or the right one.
#[test]
fn a_worker_refused_its_password_exits_without_printing_it() {
    let redis = redis_with_user(RUN_PW);
    let port = redis.port;
    let dir = TempDir::new("secrets-refused");
    let file = dir.write("password", &format!("{RUN_WRONG}\n"));
    let ways: [Way; 3] = [
        (
            "url",
            format!(
                "  url: \"redis://{USER}:{}@127.0.0.1:{port}/0\"\n",
                url_encoded(RUN_WRONG)
            ),
            vec![],
        ),
        (
            "password_file",
            format!(
                "  url: \"redis://{USER}@127.0.0.1:{port}/0\"\n  password_file: {}\n",
                file.display()
            ),
            vec![],
        ),
        (
            "PACER_REDIS_PASSWORD",
            format!("  url: \"redis://{USER}@127.0.0.1:{port}/0\"\n"),
            vec![("PACER_REDIS_PASSWORD", RUN_WRONG)],
        ),
    ];
    for (way, redis_lines, env) in &ways {
        let metrics = free_port();
        let config = run_config(&dir, &format!("{way}.yaml"), redis_lines, metrics);
        let mut env_run = env.clone();
        env_run.push(("RUST_LOG", "debug"));
        let mut worker =
            pacer::testkit::Pacer::run(Path::new(env!("CARGO_BIN_EXE_pacer")), &config, &env_run);
        let mut endpoints_seen = String::new();
        let mut was_ready = false;
        let deadline = Instant::now() + Duration::from_secs(15);
        let code = loop {
            if let Some(code) = worker.wait_for(Duration::from_millis(100)) {
                break Some(code);
            }
            if readyz(metrics) == Some(200) {
                was_ready = true;
            }
            if endpoints_seen.is_empty() && readyz(metrics).is_some() {
                endpoints_seen = endpoints(metrics);
            }
            if Instant::now() >= deadline {
                break None;
            }
        };
        let log = worker.log_text();
        assert_eq!(code, Some(1), "{way}: log:\n{log}");
        assert!(!was_ready, "{way}: ready with a refused password");
        // Said as a refusal: in redis-rs's words (the worker's, today) or pacer's own (the
        // one-shot commands').
        assert!(
            log.contains("Password authentication failed")
                || log.contains("refused pacer's credentials"),
            "{way}: log:\n{log}"
        );
        let inspect = pacer(&config, &["inspect"], env);
        assert_ne!(inspect.code, 0, "{}", inspect.output);
        assert!(
            inspect.output.contains("refused pacer's credentials"),
            "{way}: {}",
            inspect.output
        );
        let check = pacer(&config, &["check-config"], env);
        assert_eq!(check.code, 0, "{}", check.output);
        for (what, text) in [
            ("the worker's log", &log),
            ("its endpoints", &endpoints_seen),
            ("inspect", &inspect.output),
            ("check-config", &check.output),
        ] {
            assert_no_password(&format!("{way}: {what}"), text, &[RUN_PW, RUN_WRONG]);
        }
        eprintln!("{way}: {}", log.lines().last().unwrap_or(""));
    }
}
