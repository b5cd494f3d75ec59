//! The least-privilege ACL user the README gives (its `ACL SETUSER` line, read from the README
//! itself so the two cannot drift apart) runs every flow against a real redis-server: dispatch,
//! reroute, rejection, dead letter, inbound admission, claiming after a kill -9, reaping the dead
//! worker's consumer, and the `inspect` and `report` commands. A command missing from the line
//! shows as NOPERM in a log or as an entry that never ends.

mod common;

use common::*;
use pacer::testkit::{command_calls, free_port, http_post, wait_until, RedisServer, TempDir};
use std::process::Command;
use std::time::Duration;

const PASSWORD: &str = "acl-test-pw";

fn consumers(redis: &RedisServer, stream: &str) -> Vec<String> {
    let reply: redis::Value = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(stream)
        .arg("pacer")
        .query(&mut redis.con())
        .unwrap();
    let redis::Value::Array(rows) = reply else {
        return Vec::new();
    };
    rows.into_iter()
        .filter_map(|r| match r {
            redis::Value::Array(f) => match f.get(1) {
                Some(redis::Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

#[test]
fn the_readme_acl_user_runs_every_flow() {
    let redis = RedisServer::start();
    let mut setuser = redis::cmd("ACL");
    for w in readme_acl_user("acl-setuser", "pacer", PASSWORD) {
        setuser.arg(w);
    }
    let _: () = setuser
        .query(&mut redis.con())
        .expect("the README's ACL SETUSER line");
    let dir = TempDir::new("acl");
    let api = free_port();
    let body = format!(
        r#"outbound:
  streams: ["pacer:out"]
  routes:
    primary: {{rate: 20/s, burst: 1, max_wait: 500ms, fallbacks: [spare]}}
    spare: {{rate: 10/s, burst: 1, max_wait: 500ms}}
    slow: {{rate: 2/s, burst: 1, max_wait: 1s}}
    broken: {{rate: 10/s}}
{}  api: {{listen: 127.0.0.1:{api}}}
"#,
        inbound_body("{name: per-source, key: [source], algorithm: sliding_log, limits: [2/s]}")
    );
    let url = format!("redis://pacer:{PASSWORD}@127.0.0.1:{}", redis.port);
    let worker =
        |name: &str| format!("  batch: 32\n  drain: 1s\n  claim_idle: 3s\n  consumer: {name}");
    let write = |file: &str, port: u16, name: &str| {
        let text = format!(
            "redis:\n  url: \"{url}\"\n  timeout: 500ms\nmetrics:\n  listen: 127.0.0.1:{port}\nworker:\n{}\n{body}\n",
            worker(name)
        );
        dir.write(file, &text)
    };
    // A route whose bucket something else wrote: its dead letter names the key (found by TYPE).
    let _: () = redis::cmd("SET")
        .arg("pacer:{broken}:bucket:broken")
        .arg("x")
        .query(&mut redis.con())
        .unwrap();
    let port_a = free_port();
    let cfg_a = write("a.yaml", port_a, "a");
    let mut a = start(&cfg_a, port_a);

    // Outbound: more than primary takes within its max_wait (some go to spare, some are
    // rejected), an unknown route (dead letter); inbound: two accepted, the rest rejected, one
    // without its key (dead letter).
    let mut out: Vec<_> = (0..40).map(|_| event(&[("route", "primary")])).collect();
    out.push(event(&[("route", "ghost")]));
    out.push(event(&[("route", "broken")]));
    let out_ids = push(&redis, "pacer:out", &out);
    let mut inbound: Vec<_> = (0..6).map(|_| event(&[("source", "s1")])).collect();
    inbound.push(event(&[("other", "x")]));
    let in_ids = push(&redis, "pacer:in", &inbound);
    let outputs = [
        "pacer:{primary}:ready",
        "pacer:{spare}:ready",
        "pacer:{slow}:ready",
        "pacer:rejected",
        "pacer:dead",
        "pacer:accepted",
        "pacer:in-rejected",
    ];
    // The two input streams' entries may share ids: told apart by their source stream.
    let all_ended = |stream: &str, ids: &[String]| {
        let at = placements_by_stream(&redis, &outputs);
        ids.iter().all(|id| {
            at.get(&(stream.to_string(), id.clone()))
                .is_some_and(|s| s.len() == 1)
        })
    };
    assert!(
        wait_until(Duration::from_secs(10), || all_ended("pacer:out", &out_ids)
            && all_ended("pacer:in", &in_ids)),
        "every entry ended once: {:?}\n{}",
        placements_by_stream(&redis, &outputs),
        a.log_text()
    );
    let named = read(&redis, "pacer:dead").iter().any(|d| {
        d.field("pacer_detail").is_some_and(|detail| {
            detail.contains(
                "key pacer:{broken}:bucket:broken holds a string where pacer keeps a hash",
            )
        })
    });
    assert!(named, "{:?}", read(&redis, "pacer:dead"));
    // Synchronous admission: decide.lua as a Redis Function, loaded and called as this user.
    // (The pacing calls are Functions too; with every entry ended, the stream flow makes none.)
    let fcalls_before = command_calls(&mut redis.con(), "fcall");
    let answers: Vec<u16> = (0..3)
        .map(|_| {
            http_post(api, "/v1/admit", r#"{"fields": {"source": "sync"}}"#)
                .unwrap()
                .0
        })
        .collect();
    assert_eq!(answers, [200, 200, 429]);
    // Three decisions, the first sending the rules the function asked for: four FCALLs.
    assert_eq!(command_calls(&mut redis.con(), "fcall") - fcalls_before, 4);
    let at = placements_by_stream(&redis, &outputs);
    for (stream, what) in [
        ("pacer:{primary}:ready", "dispatched"),
        ("pacer:{spare}:ready", "rerouted"),
        ("pacer:rejected", "rejected"),
        ("pacer:dead", "dead-lettered"),
        ("pacer:accepted", "accepted"),
        ("pacer:in-rejected", "rejected inbound"),
    ] {
        assert!(
            at.values().any(|s| s.iter().any(|x| x == stream)),
            "nothing {what}: {at:?}"
        );
    }

    // Claiming: a worker killed while it holds sleeping events; another claims and ends them.
    let slow: Vec<_> = (0..4).map(|_| event(&[("route", "slow")])).collect();
    let slow_ids = push(&redis, "pacer:out", &slow);
    assert!(wait_until(Duration::from_secs(5), || {
        pending(&redis, "pacer:out", "pacer") >= 1
    }));
    a.kill();
    let a_log = a.log_text();
    let port_b = free_port();
    let cfg_b = write("b.yaml", port_b, "b");
    let b = start(&cfg_b, port_b);
    assert!(
        wait_until(Duration::from_secs(15), || all_ended(
            "pacer:out",
            &slow_ids
        ) && pending(
            &redis,
            "pacer:out",
            "pacer"
        ) == 0),
        "claimed and ended: {:?}\n{}",
        placements_by_stream(&redis, &outputs),
        b.log_text()
    );
    // Reaping: the dead worker's consumer, idle and holding nothing, is deleted (every tenth
    // claim tick, once idle for twice claim_idle).
    assert!(consumers(&redis, "pacer:out").contains(&"a".to_string()));
    assert!(
        wait_until(Duration::from_secs(30), || !consumers(&redis, "pacer:out")
            .contains(&"a".to_string())),
        "consumer a reaped: {:?}",
        consumers(&redis, "pacer:out")
    );

    // The one-shot commands, as the same user.
    for args in [&["inspect"][..], &["report"][..]] {
        let run = Command::new(bin())
            .args(args)
            .arg("--config")
            .arg(&cfg_b)
            .env_remove("PACER_REDIS_URL")
            .output()
            .unwrap();
        // Everything read but the bucket broken above, which is named (exit 3 for that).
        let out = String::from_utf8_lossy(&run.stdout);
        let unread: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("cannot read:"))
            .collect();
        assert!(
            unread.iter().all(|l| l.contains("pacer:{broken}:bucket")),
            "{args:?}: {run:?}"
        );
        let code = if unread.is_empty() { 0 } else { 3 };
        assert_eq!(run.status.code(), Some(code), "{args:?}: {run:?}");
    }
    for log in [a_log, b.log_text()] {
        assert!(
            !log.contains("NOPERM"),
            "a command the ACL line lacks:\n{log}"
        );
    }
}

/// A user missing a command pacer needs later (XCLAIM, only used once a worker dies) or an
/// output stream's key (here the rejected stream, outside `~pacer*`) is refused at start, with
/// the command named: such a NOPERM surfaced only when first needed, one warning while a dead
/// worker's entries stayed pending for good, or a call retried forever (found by review).
#[test]
fn a_user_without_a_command_or_key_pacer_needs_is_refused_at_start() {
    let redis = RedisServer::start();
    let dir = TempDir::new("acl-short");
    let body = "outbound:\n  streams: [\"pacer:out\"]\n  routes:\n    r: {rate: 10/s}\n";
    for (user, drop_word, rejected, expect) in [
        (
            "noclaim",
            Some("+xclaim"),
            "pacer:rejected",
            "XCLAIM pacer:out",
        ),
        ("nokey", None, "rej", "XTRIM rej"),
    ] {
        let mut setuser = redis::cmd("ACL");
        for w in readme_acl_user("acl-setuser", "pacer", PASSWORD) {
            if Some(w.as_str()) == drop_word {
                continue;
            }
            setuser.arg(if w == "pacer" { user.to_string() } else { w });
        }
        let _: () = setuser.query(&mut redis.con()).unwrap();
        let port = free_port();
        let text = format!(
            "redis:\n  url: \"redis://{user}:{PASSWORD}@127.0.0.1:{}\"\n  timeout: 500ms\nmetrics:\n  listen: 127.0.0.1:{port}\nworker:\n  consumer: {user}\n{body}  rejected_stream: \"{rejected}\"\n",
            redis.port
        );
        let cfg = dir.write(&format!("{user}.yaml"), &text);
        let mut pacer = pacer::testkit::Pacer::run(bin(), &cfg, &[]);
        let code = pacer.wait_for(Duration::from_secs(15));
        let log = pacer.log_text();
        assert_eq!(code, Some(1), "{user}: ran on:\n{log}");
        assert!(
            log.contains(expect) && log.contains("NoPerm"),
            "{user}: {log}"
        );
    }
}
