//! A pacer worker (the real binary) on a Redis Cluster as production runs one: TLS only (plain
//! port 0, client certificates required, bus and replication over TLS), the default user locked,
//! pacer logging in as the README's least-privilege ACL user. First the same config without the
//! client certificate, with a wrong password or with no user is refused, naming why; then both
//! flows run exactly once on routes spread over the three masters, and on through a master
//! killed (-9) and its replica promoted.

mod common;

use common::{
    assert_one_shot_commands_read_everything, event, readme_acl_user, run_until_exit, start, tail,
};
use pacer::testkit::{free_port, wait_until, Cluster, Pacer, TempDir, TlsFiles};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PASSWORD: &str = "acl-test-pw";

/// Which master serves each stream, read once per topology (each lookup is a TLS handshake).
type Owners = BTreeMap<String, u16>;

fn owners_of(cluster: &Cluster, streams: &[String]) -> Owners {
    let topology = cluster.topology();
    streams
        .iter()
        .map(|s| {
            let slot = pacer::connection::key_slot(s);
            let owner = topology
                .iter()
                .find(|n| n.master && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
                .map(|n| n.port)
                .unwrap_or_else(|| panic!("no master serves {s}"));
            (s.clone(), owner)
        })
        .collect()
}

/// (input stream, id): the key every output entry names its source by.
type Source = (String, String);

/// One output entry: its stream, its fields, its id's millisecond.
struct Ended {
    stream: String,
    fields: HashMap<String, String>,
    ms: i64,
}

/// Where each input entry ended, reading every output over TLS on its master.
fn placements(
    cluster: &Cluster,
    owners: &Owners,
    outputs: &[String],
) -> BTreeMap<Source, Vec<Ended>> {
    let mut at: BTreeMap<Source, Vec<Ended>> = BTreeMap::new();
    for stream in outputs {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(stream)
            .arg("-")
            .arg("+")
            .query(&mut cluster.con(owners[stream]))
            .expect("XRANGE");
        for e in reply.ids {
            let fields: HashMap<String, String> = e
                .map
                .iter()
                .map(|(k, v)| (k.clone(), redis::from_redis_value_ref(v).unwrap()))
                .collect();
            let source = (
                fields["pacer_source_stream"].clone(),
                fields["pacer_source_id"].clone(),
            );
            at.entry(source).or_default().push(Ended {
                stream: stream.clone(),
                fields,
                ms: e.id.split('-').next().unwrap().parse().unwrap(),
            });
        }
    }
    at
}

/// Entries of `stream` group `pacer` has not finished: pending, or after its last-delivered id.
fn unfinished(cluster: &Cluster, owners: &Owners, stream: &str) -> usize {
    let mut con = cluster.con(owners[stream]);
    let (pending, ..): (usize, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg(stream)
        .arg("pacer")
        .query(&mut con)
        .expect("XPENDING");
    let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(&mut con)
        .expect("XINFO GROUPS");
    let last: String = redis::from_redis_value(groups[0]["last-delivered-id"].clone()).unwrap();
    let unread: Vec<redis::Value> = redis::cmd("XRANGE")
        .arg(stream)
        .arg(format!("({last}"))
        .arg("+")
        .query(&mut con)
        .unwrap();
    pending + unread.len()
}

/// An event to push, labelled with its route or inbound source: (label, fields).
type Labelled = (String, Vec<(String, Vec<u8>)>);

/// XADDs one event per `(label, fields)` to `stream` over TLS on its master; each event's
/// source with its label (its route, or its inbound source).
fn push(
    cluster: &Cluster,
    owners: &Owners,
    stream: &str,
    events: Vec<Labelled>,
) -> Vec<(Source, String)> {
    let mut pipe = redis::pipe();
    for (_, fields) in &events {
        let cmd = pipe.cmd("XADD").arg(stream).arg("*");
        for (k, v) in fields {
            cmd.arg(k).arg(v.as_slice());
        }
    }
    let ids: Vec<String> = pipe
        .query(&mut cluster.con(owners[stream]))
        .expect("pushing events over TLS");
    ids.into_iter()
        .zip(events)
        .map(|(id, (label, _))| ((stream.to_string(), id), label))
        .collect()
}

/// `n` outbound events to each of `routes`, labelled with their route.
fn to_routes(routes: &[String], n: usize, tag: &str) -> Vec<Labelled> {
    routes
        .iter()
        .flat_map(|r| {
            (0..n).map(move |i| {
                (
                    r.clone(),
                    event(&[("route", r), ("n", &format!("{tag}{i}"))]),
                )
            })
        })
        .collect()
}

/// Five inbound events from each of `sources`, labelled with their source.
fn from_sources(sources: &[&str]) -> Vec<Labelled> {
    sources
        .iter()
        .flat_map(|&s| (0..5).map(move |_| (s.to_string(), event(&[("source", s)]))))
        .collect()
}

/// The streams of the flow, and what the test pushed into it.
struct Flow {
    outputs: Vec<String>,
    inputs: Vec<String>,
    outbound: Vec<(Source, String)>,
    inbound: Vec<(Source, String)>,
}

impl Flow {
    /// What has not ended yet, by route or source (events in no output) and by input stream
    /// (entries unfinished); empty once everything has.
    fn left_over(&self, cluster: &Cluster, owners: &Owners) -> Vec<String> {
        let at = placements(cluster, owners, &self.outputs);
        let mut missing: BTreeMap<&str, usize> = BTreeMap::new();
        for (source, label) in self.outbound.iter().chain(&self.inbound) {
            if !at.contains_key(source) {
                *missing.entry(label).or_default() += 1;
            }
        }
        let mut left: Vec<String> = missing
            .into_iter()
            .map(|(label, n)| format!("{n} events of {label} in no output"))
            .collect();
        for input in &self.inputs {
            let n = unfinished(cluster, owners, input);
            if n > 0 {
                left.push(format!("{n} entries of {input} unfinished"));
            }
        }
        left
    }

    /// Waits (15 s at most) until everything pushed has ended; says what has not, otherwise.
    fn wait_ended(&self, cluster: &Cluster, owners: &Owners, worker: &Pacer, when: &str) {
        let mut left = Vec::new();
        let ended = wait_until(Duration::from_secs(15), || {
            left = self.left_over(cluster, owners);
            left.is_empty()
        });
        assert!(
            ended,
            "{when}: {left:?}; the worker's log, less redis-rs's reconnection lines:\n{}",
            tail(&worker.log_text())
        );
    }
}

/// A worker config on `cluster`: only its `rediss://` seeds, `tls` (a YAML flow mapping), user
/// `user` (none when empty) with `password` in a file.
#[allow(clippy::too_many_arguments)]
fn config(
    dir: &TempDir,
    name: &str,
    cluster: &Cluster,
    tls: &str,
    user: &str,
    password: &str,
    metrics: u16,
    body: &str,
) -> PathBuf {
    let mut credentials = String::new();
    if !user.is_empty() {
        let file = dir.write(&format!("{name}.password"), &format!("{password}\n"));
        credentials = format!("  username: {user}\n  password_file: {}\n", file.display());
    }
    dir.write(
        &format!("{name}.yaml"),
        &format!(
            "redis:\n  url: \"{}\"\n  mode: cluster\n  timeout: 500ms\n  tls: {tls}\n{credentials}metrics:\n  listen: 127.0.0.1:{metrics}\nworker:\n  batch: 64\n  drain: 1s\n  claim_idle: 30s\n{body}",
            cluster.urls()
        ),
    )
}

/// Whether the master on `port` says its replica has everything it wrote.
fn replica_caught_up(cluster: &Cluster, port: u16) -> bool {
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query(&mut cluster.con(port))
        .unwrap_or_default();
    let field = |line_start: &str, key: &str| -> Option<i64> {
        let line = info.lines().find(|l| l.starts_with(line_start))?;
        let at = line.find(key)? + key.len();
        line[at..].split([',', '\r']).next()?.parse().ok()
    };
    match (
        field("master_repl_offset:", "master_repl_offset:"),
        field("slave0:", "offset="),
    ) {
        (Some(master), Some(replica)) => master == replica,
        _ => false,
    }
}

/// The whole rig in one test: starting a TLS cluster of six nodes is most of its cost.
#[test]
fn a_worker_runs_on_a_tls_only_cluster_as_the_readme_acl_user_through_a_failover() {
    let t0 = Instant::now();
    let files = TlsFiles::generate();
    // Without full coverage a dead master's slots stop alone, not the whole cluster's.
    let mut cluster = Cluster::start_tls(3, 1, &files, &["--cluster-require-full-coverage", "no"]);
    eprintln!("TLS cluster up in {:?}", t0.elapsed());
    for port in cluster.ports() {
        let mut con = cluster.con(port);
        // On every node: ACLs are not replicated, and a promoted replica must know the user.
        let mut setuser = redis::cmd("ACL");
        for w in readme_acl_user("acl-setuser", "pacer", PASSWORD) {
            setuser.arg(w);
        }
        let _: () = setuser
            .query(&mut con)
            .expect("the README's ACL SETUSER line");
        // Nothing can go over plain text: no plain port, and the TLS port answers no plain
        // client.
        let plain: (String, String) = redis::cmd("CONFIG")
            .arg("GET")
            .arg("port")
            .query(&mut con)
            .unwrap();
        assert_eq!(plain.1, "0", "node {port} has a plain-text port");
        let answered = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(1))
            .and_then(|mut c| redis::cmd("PING").arg("x").query::<String>(&mut c));
        assert!(answered.is_err(), "node {port} answered plain text");
    }

    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    let victim = masters[2];
    let dir = TempDir::new("cluster-tls");
    // A route and an input stream on each master (names under `pacer*`, which the ACL line
    // covers); inbound reads on the second master and keeps its state and forward stream on
    // the third, the one to be killed.
    let routes: Vec<String> = masters.iter().map(|&m| cluster.name_on(m, "r")).collect();
    let outs: Vec<String> = masters
        .iter()
        .map(|&m| cluster.name_on(m, "pacer:out"))
        .collect();
    let inq = cluster.name_on(masters[1], "pacer:in");
    let accepted = cluster.name_on(victim, "pacer:acc");
    let mut body = format!("outbound:\n  streams: [{}]\n  routes:\n", outs.join(", "));
    for r in &routes {
        body += &format!("    {r}: {{rate: 100/s, burst: 5, max_wait: 10s}}\n");
    }
    body += &format!(
        "inbound:\n  streams: [\"{inq}\"]\n  forward_stream: \"{accepted}\"\n  rejected_stream: \"pacer:in-rejected\"\n  rules:\n    - {{name: per-source, key: [source], algorithm: sliding_log, limits: [3/min]}}\n"
    );
    let ready = |r: &str| format!("pacer:{{{r}}}:ready");
    let in_rejected = "pacer:in-rejected".to_string();
    let mut flow = Flow {
        outputs: routes.iter().map(|r| ready(r)).collect(),
        inputs: outs.iter().chain([&inq]).cloned().collect(),
        outbound: Vec::new(),
        inbound: Vec::new(),
    };
    flow.outputs.extend(
        [
            "pacer:rejected",
            "pacer:dead",
            &accepted,
            &in_rejected,
            "pacer:in-dead",
        ]
        .map(String::from),
    );
    let every_stream: Vec<String> = flow.outputs.iter().chain(&flow.inputs).cloned().collect();
    let s = |p: &Path| p.display().to_string();
    let with_cert = format!(
        "{{ca_file: {}, cert_file: {}, key_file: {}}}",
        s(&files.ca),
        s(&files.client_cert),
        s(&files.client_key)
    );

    // Refused, each exiting 1 and saying why: no client certificate (TLS, and the setting), a
    // wrong password, no user (the default user is locked). Side by side; none is ever ready,
    // none writes anything.
    let no_cert = format!("{{ca_file: {}}}", s(&files.ca));
    let refused = [
        (
            "no-client-cert",
            &no_cert,
            "pacer",
            PASSWORD,
            "TLS with Redis",
        ),
        (
            "wrong-password",
            &with_cert,
            "pacer",
            "not-it",
            "refused pacer's credentials",
        ),
        ("no-user", &with_cert, "", "", "refused pacer's credentials"),
    ];
    let t_refused = Instant::now();
    let runs: Vec<_> = refused
        .into_iter()
        .map(|(name, tls, user, password, says)| {
            let metrics = free_port();
            let cfg = config(&dir, name, &cluster, tls, user, password, metrics, &body);
            (
                name,
                says,
                std::thread::spawn(move || run_until_exit(&cfg, metrics, &[])),
            )
        })
        .collect();
    for (name, says, run) in runs {
        let (code, was_ready, log) = run.join().unwrap();
        assert_eq!(code, Some(1), "{name}: not refused:\n{}", tail(&log));
        assert!(!was_ready, "{name}: ready all the same:\n{}", tail(&log));
        assert!(
            log.contains(says),
            "{name}: does not say {says:?}:\n{}",
            tail(&log)
        );
        if name == "no-client-cert" {
            assert!(
                log.contains("redis.tls.cert_file"),
                "{name}: no setting named:\n{}",
                tail(&log)
            );
        }
        eprintln!("{name}: {}", log.lines().last().unwrap_or_default());
    }
    eprintln!("refused configs exited within {:?}", t_refused.elapsed());
    for port in cluster.ports() {
        let mut con = cluster.con(port);
        let size: i64 = redis::cmd("DBSIZE").query(&mut con).unwrap();
        assert_eq!(size, 0, "a refused worker wrote to node {port}");
        // Their failed logins are logged; from here on the log must stay empty.
        let _: () = redis::cmd("ACL")
            .arg("LOG")
            .arg("RESET")
            .query(&mut con)
            .unwrap();
    }

    // The right config: ready; both flows on every master, each event once.
    let metrics = free_port();
    let cfg = config(
        &dir, "good", &cluster, &with_cert, "pacer", PASSWORD, metrics, &body,
    );
    let mut worker = start(&cfg, metrics);
    let mut owners = owners_of(&cluster, &every_stream);
    for out in &outs {
        flow.outbound.extend(push(
            &cluster,
            &owners,
            out,
            to_routes(&routes, 10, "before"),
        ));
    }
    flow.inbound.extend(push(
        &cluster,
        &owners,
        &inq,
        from_sources(&["s0", "s1", "s2"]),
    ));
    let t1 = Instant::now();
    flow.wait_ended(&cluster, &owners, &worker, "before the kill");
    eprintln!(
        "{} outbound and {} inbound events ended in {:?}",
        flow.outbound.len(),
        flow.inbound.len(),
        t1.elapsed()
    );

    // The third master dies (-9) once its replica has all it wrote. Right after, events for
    // every route (on the first master's input) and inbound ones (whose state was on it).
    assert!(
        wait_until(Duration::from_secs(5), || replica_caught_up(
            &cluster, victim
        )),
        "the victim's replica never caught up"
    );
    cluster.kill(victim);
    let killed = Instant::now();
    let after_kill = push(
        &cluster,
        &owners,
        &outs[0],
        to_routes(&routes, 10, "after-kill"),
    );
    flow.outbound.extend(after_kill.iter().cloned());
    flow.inbound
        .extend(push(&cluster, &owners, &inq, from_sources(&["s3"])));
    let promoted = cluster
        .wait_promoted(victim, Duration::from_secs(15))
        .expect("the victim's replica was not promoted");
    let promoted_in = killed.elapsed();
    owners = owners_of(&cluster, &every_stream);
    assert!(owners.values().all(|&p| p != victim));
    flow.wait_ended(&cluster, &owners, &worker, "events pushed after the kill");
    let followed_in = killed.elapsed();
    // And after the promotion, on the promoted master's input too.
    for out in [&outs[2], &outs[0]] {
        flow.outbound.extend(push(
            &cluster,
            &owners,
            out,
            to_routes(&routes, 10, "after-promotion"),
        ));
    }
    flow.inbound
        .extend(push(&cluster, &owners, &inq, from_sources(&["s4"])));
    flow.wait_ended(
        &cluster,
        &owners,
        &worker,
        "events pushed after the promotion",
    );

    // Each outbound event once, in its own route's ready stream.
    let at = placements(&cluster, &owners, &flow.outputs);
    for (source, route) in &flow.outbound {
        let ended = &at[source];
        assert_eq!(ended.len(), 1, "{source:?} ended {} times", ended.len());
        assert_eq!(
            ended[0].stream,
            ready(route),
            "{source:?}: {:?}",
            ended[0].fields
        );
    }
    // Inbound: of each source's five, the first three forwarded, the last two rejected as
    // rate_limited. s3's were pushed while their state's master was down: those the admission
    // could not reach within limiter_attempts are rejected by inbound.fail_policy (fail_closed,
    // the default) instead; never more than three forwarded.
    for who in ["s0", "s1", "s2", "s3", "s4"] {
        let mut forwarded = 0;
        let mine = flow.inbound.iter().filter(|(_, s)| s == who);
        for (i, (source, _)) in mine.enumerate() {
            let ended = &at[source];
            assert_eq!(ended.len(), 1, "{who} {source:?}: {} times", ended.len());
            let (to, reason) = (&ended[0].stream, ended[0].fields.get("pacer_reason"));
            forwarded += usize::from(*to == accepted);
            let expected = if i < 3 {
                (&accepted, None)
            } else {
                (&in_rejected, Some("rate_limited"))
            };
            if who == "s3" {
                assert!(
                    *to == accepted
                        || matches!(
                            reason.map(String::as_str),
                            Some("limiter_unavailable" | "rate_limited")
                        ),
                    "{who}'s event {i}: {to} {:?}",
                    ended[0].fields
                );
            } else {
                assert_eq!(
                    (to, reason.map(String::as_str)),
                    expected,
                    "{who}'s event {i}"
                );
            }
        }
        assert!(forwarded <= 3, "{who}: {forwarded} forwarded");
    }
    assert_eq!(
        at.len(),
        flow.outbound.len() + flow.inbound.len(),
        "outputs hold events never pushed"
    );

    // While the victim was down the other masters' routes kept dispatching: each of their
    // after-kill events went out before the first of the victim's route.
    let after_kill_ms = |route: &str| -> Vec<i64> {
        after_kill
            .iter()
            .filter(|(_, r)| r == route)
            .map(|(source, _)| at[source][0].ms)
            .collect()
    };
    let victims_first = *after_kill_ms(&routes[2]).iter().min().unwrap();
    for r in &routes[..2] {
        let last = *after_kill_ms(r).iter().max().unwrap();
        assert!(
            last < victims_first,
            "route {r} dispatched its last after-kill event at {last} ms, after the victim's route's first at {victims_first} ms"
        );
        eprintln!(
            "route {r}: its after-kill events out {} ms before the victim's route's first",
            victims_first - last
        );
    }
    eprintln!(
        "killed master {victim}: replica {promoted} promoted after {promoted_in:?}; every event pushed after the kill ended {followed_in:?} after it"
    );

    // Every command ran as the README user: no ACL denial on any live master, its connections
    // on each, no NOPERM and no error in the worker's log.
    for port in cluster.masters() {
        let mut con = cluster.con(port);
        let denied: Vec<redis::Value> = redis::cmd("ACL").arg("LOG").query(&mut con).unwrap();
        assert!(denied.is_empty(), "ACL LOG of {port}: {denied:?}");
        let clients: String = redis::cmd("CLIENT").arg("LIST").query(&mut con).unwrap();
        assert!(
            clients.contains(" user=pacer "),
            "no pacer connection on {port}:\n{clients}"
        );
    }
    let log = worker.log_text();
    for bad in ["NOPERM", "NoPerm", " ERROR ", "panicked"] {
        assert!(
            !log.contains(bad),
            "{bad} in the worker's log:\n{}",
            tail(&log)
        );
    }
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ")).collect();
    eprintln!("the worker's warnings:\n{}", warnings.join("\n"));
    // The one-shot commands, as the same user over TLS, on every master: each reads all.
    assert_one_shot_commands_read_everything(&cfg);
    worker.signal("TERM");
    assert_eq!(
        worker.wait_for(Duration::from_secs(15)),
        Some(0),
        "{}",
        tail(&worker.log_text())
    );
    eprintln!("whole test: {:?}", t0.elapsed());
}
