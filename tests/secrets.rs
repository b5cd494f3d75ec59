//! A Redis password never reaches pacer's output: `check-config`, `report` and `produce` run
//! with a password in `PACER_REDIS_URL` (and in `PACER_REDIS_PASSWORD`) against a closed port, a
//! Redis that refuses the password, and one that takes it; stdout and stderr (logs at debug)
//! never hold it. A refused password ends the command at once, non-zero, saying so.

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
