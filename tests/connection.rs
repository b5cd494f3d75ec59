//! `RedisConn` against real deployments each test starts itself: a Redis Cluster (scripts,
//! streams and NOSCRIPT on every master; a slot moved under traffic; one-key reads a master to
//! a round trip, through a slot moved after the map was read; graceful, TAKEOVER and
//! hard-kill failovers), a Sentinel-managed master that is killed, TLS with and without client
//! certificates, and ACL users. Every failover is followed by the same `RedisConn`, never a new
//! one. A whole worker (`pacer run`) over TLS too: both flows, and its refusal of a server it
//! cannot verify.
//!
//! Over 400 lines: one subject's process-level tests (Cluster, Sentinel, TLS, ACL) sharing one rig.

mod common;

use common::pending_on;
use pacer::config::{Config, Overrides, RedisConfig, Secret};
use pacer::connection::{fatal, key_slot, ConnectError, Fatal, RedisConn};
use pacer::testkit::{free_port, Cluster, RedisServer, Sentinels, TempDir, TlsFiles};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The `redis:` section `redis` (a YAML flow mapping), read through the real config code.
fn redis_config(redis: &str) -> RedisConfig {
    redis_config_with(redis, &Overrides::default())
}

fn redis_config_with(redis: &str, overrides: &Overrides) -> RedisConfig {
    let yaml = format!(
        "redis: {redis}\noutbound:\n  streams: [\"pacer:out\"]\n  routes:\n    a: {{rate: 10/s}}\n"
    );
    match Config::parse(&yaml, overrides) {
        Ok(c) => c.redis,
        Err(e) => panic!("{e}"),
    }
}

fn conn(cfg: &RedisConfig) -> RedisConn {
    RedisConn::new(cfg, cfg.timeout).expect("a RedisConn")
}

/// Two keys of one slot: adds ARGV[1] to the first, copies the sum into the second.
fn add_script() -> redis::Script {
    redis::Script::new(
        "local v = redis.call('INCRBY', KEYS[1], ARGV[1]) redis.call('SET', KEYS[2], v) return v",
    )
}

async fn add(con: &mut RedisConn, tag: &str, n: i64) -> redis::RedisResult<i64> {
    add_script()
        .key(format!("{{{tag}}}:n"))
        .key(format!("{{{tag}}}:copy"))
        .arg(n)
        .invoke_async(con)
        .await
}

/// Calls `add` every 20 ms until one succeeds; how long that took, and the sum it returned.
async fn until_ok(con: &mut RedisConn, tag: &str, limit: Duration) -> (Duration, i64) {
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < limit {
        match add(con, tag, 1).await {
            Ok(sum) => return (start.elapsed(), sum),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no success within {limit:?}; last error: {last:?}");
}

fn get(cluster: &Cluster, port: u16, key: &str) -> Option<i64> {
    redis::cmd("GET")
        .arg(key)
        .query(&mut cluster.con(port))
        .expect("GET on a node")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_runs_scripts_and_streams_on_every_master_and_reloads_flushed_scripts() {
    let cluster = Cluster::start(3, 1);
    let cfg = redis_config(&format!("{{mode: cluster, url: \"{}\"}}", cluster.urls()));
    let mut con = conn(&cfg);
    con.check().await.expect("the cluster answers");
    let tags = cluster.tag_per_master();
    assert_eq!(tags.len(), 3);

    for (master, tag) in &tags {
        assert_eq!(add(&mut con, tag, 5).await.unwrap(), 5);
        assert_eq!(add(&mut con, tag, 2).await.unwrap(), 7);
        // The script ran on the master that serves the tag: the key is there, nowhere else.
        assert_eq!(get(&cluster, *master, &format!("{{{tag}}}:copy")), Some(7));
        assert_eq!(
            con.node_for_key(&format!("{{{tag}}}:n")).await.unwrap(),
            Some(format!("127.0.0.1:{master}"))
        );
    }

    // Streams in different slots, one stream per call.
    for (master, tag) in &tags {
        let stream = format!("{{{tag}}}:in");
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg("g")
            .arg("$")
            .arg("MKSTREAM")
            .query_async(&mut con)
            .await
            .unwrap();
        let id: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("route")
            .arg(tag)
            .query_async(&mut con)
            .await
            .unwrap();
        let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("c")
            .arg("COUNT")
            .arg(10)
            .arg("STREAMS")
            .arg(&stream)
            .arg(">")
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(read.keys.len(), 1);
        assert_eq!(read.keys[0].ids[0].id, id);
        let acked: i64 = redis::cmd("XACK")
            .arg(&stream)
            .arg("g")
            .arg(&id)
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(acked, 1);
        let len: i64 = redis::cmd("XLEN")
            .arg(&stream)
            .query(&mut cluster.con(*master))
            .unwrap();
        assert_eq!(len, 1, "the stream lives on its slot's master");
    }

    // WAIT on the master that took the write: its replica acknowledges, unless frozen.
    let (master, tag) = &tags[1];
    let key = format!("{{{tag}}}:n");
    assert_eq!(
        con.wait_replicas(&key, 1, Duration::from_millis(500))
            .await
            .unwrap(),
        1
    );
    let replica = cluster.replicas_of(*master)[0];
    cluster.pause(replica);
    add(&mut con, tag, 0).await.unwrap();
    let lagging = con.wait_replicas(&key, 1, Duration::from_millis(300)).await;
    cluster.resume(replica);
    assert_eq!(lagging.unwrap(), 0, "a frozen replica acknowledges nothing");

    // A blocking read longer than redis.timeout needs the reader's own connection.
    let mut reader = RedisConn::new(&cfg, cfg.timeout + Duration::from_millis(1500)).unwrap();
    let stream = format!("{{{}}}:in", tags[0].1);
    let read = |con: &mut RedisConn| {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg("g").arg("c").arg("BLOCK").arg(1200);
        cmd.arg("STREAMS").arg(&stream).arg(">");
        let mut con = con.clone();
        async move { cmd.query_async::<Option<redis::Value>>(&mut con).await }
    };
    assert!(read(&mut con).await.unwrap_err().is_timeout());
    assert_eq!(read(&mut reader).await.unwrap(), None);

    // NOSCRIPT: a master forgets every script; the next call loads it again and runs.
    let (master, tag) = &tags[1];
    let sha = add_script().get_hash().to_string();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut cluster.con(*master))
        .unwrap();
    let exists: Vec<bool> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(&sha)
        .query(&mut cluster.con(*master))
        .unwrap();
    assert_eq!(exists, vec![false]);
    assert_eq!(add(&mut con, tag, 1).await.unwrap(), 8);
    let exists: Vec<bool> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(&sha)
        .query(&mut cluster.con(*master))
        .unwrap();
    assert_eq!(
        exists,
        vec![true],
        "the script was loaded again on {master}"
    );

    // Reloading must not depend on every node answering: with a replica just killed (the
    // cluster has not noticed yet) and another master frozen, a master that lost its scripts
    // still gets the one it needs.
    let (master, tag) = &tags[2];
    let replica = cluster.replicas_of(*master)[0];
    let mut cluster = cluster;
    cluster.kill(replica);
    let frozen = tags[0].0;
    cluster.pause(frozen);
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut cluster.con(*master))
        .unwrap();
    let reloaded = add(&mut con, tag, 1).await;
    cluster.resume(frozen);
    assert_eq!(reloaded.unwrap(), 8);

    // Our slot function agrees with the server's.
    for key in ["pacer:{carrier-a}:ready", "plain", "{t1}:x", "a{}b"] {
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut cluster.con(tags[0].0))
            .unwrap();
        assert_eq!(key_slot(key), slot, "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_calls_keep_succeeding_while_their_slot_moves_to_another_master() {
    let cluster = Arc::new(Cluster::start(3, 0));
    let cfg = redis_config(&format!(
        "{{mode: cluster, url: \"{}\", timeout: 2s}}",
        cluster.urls()
    ));
    let mut con = conn(&cfg);
    let tag = "moving";
    let slot = key_slot(tag);
    let from = cluster.slot_owner(slot);
    let to = *cluster.masters().iter().find(|&&m| m != from).unwrap();
    // Keys to migrate, so the slot is split between the two masters for a while: the script's
    // two keys are then sometimes on different nodes (TRYAGAIN), sometimes moved (ASK).
    for i in 0..40 {
        let _: () = redis::cmd("SET")
            .arg(format!("{{{tag}}}:k{i}"))
            .arg(i)
            .query_async(&mut con)
            .await
            .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let traffic = {
        let (stop, calls, mut con) = (stop.clone(), calls.clone(), con.clone());
        tokio::spawn(async move {
            let script = redis::Script::new(
                "redis.call('INCR', KEYS[1]) return redis.call('INCR', KEYS[2])",
            );
            let mut failures = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let r: redis::RedisResult<i64> = script
                    .key(format!("{{{tag}}}:count"))
                    .key(format!("{{{tag}}}:k{}", i % 40))
                    .invoke_async(&mut con)
                    .await;
                match r {
                    Ok(_) => {
                        calls.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => failures.push(e.to_string()),
                }
                i += 1;
            }
            failures
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = calls.load(Ordering::Relaxed);
    let mover = cluster.clone();
    let started = Instant::now();
    let moved = tokio::task::spawn_blocking(move || {
        mover.move_slot(slot, to, 4, Duration::from_millis(80))
    })
    .await
    .unwrap();
    let took = started.elapsed();
    let during = calls.load(Ordering::Relaxed) - before;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    let failures = traffic.await.unwrap();
    let total = calls.load(Ordering::Relaxed);
    eprintln!(
        "moved {moved} keys of slot {slot} from {from} to {to} in {took:?}; {during} calls during the move, {total} in all"
    );
    assert!(
        failures.is_empty(),
        "calls failed during the move: {failures:?}"
    );
    assert!(moved >= 41, "the slot's keys moved ({moved})");
    // Calls whose keys the move has split back off between TRYAGAIN retries, so how many land
    // during the move varies widely (15 to 349 seen); that some do is what shows the overlap.
    assert!(during >= 5, "traffic ran during the move ({during} calls)");
    // Every successful call counted exactly once, on the slot's new master.
    assert_eq!(cluster.slot_owner(slot), to);
    assert_eq!(
        get(&cluster, to, &format!("{{{tag}}}:count")),
        Some(total as i64)
    );
    assert_eq!(
        con.node_for_key(tag).await.unwrap(),
        Some(format!("127.0.0.1:{to}"))
    );
}

/// The first number of the line `name` in `INFO section` on the node on `port`: a command's
/// calls in `commandstats` (`cmdstat_get`), an error's count in `errorstats`
/// (`errorstat_MOVED`).
fn stat(cluster: &Cluster, port: u16, section: &str, name: &str) -> u64 {
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query(&mut cluster.con(port))
        .unwrap();
    let prefix = format!("{name}:");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split([',', '=']).nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Many one-key reads (the monitor's gauges, `pacer inspect`) go to each master a few hundred
/// to a round trip, each round trip led by a command the same node answers; slot by slot,
/// as a cluster pipeline is routed, 2,000 keys took about 1,800 round trips. A key whose slot
/// moved after pacer read the slot map is answered MOVED by its old master, and read again
/// from the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_reads_go_a_master_to_a_round_trip_and_follow_a_moved_slot() {
    const KEYS: usize = 2000;
    let cluster = Cluster::start(3, 0);
    let cfg = redis_config(&format!("{{mode: cluster, url: \"{}\"}}", cluster.urls()));
    let con = conn(&cfg);
    let keys: Vec<String> = (0..KEYS).map(|i| format!("{{k{i}}}:v")).collect();
    let masters = cluster.masters();
    // Each key's master, by one read of the topology (`owner_of` reads it per key).
    let owners = |cluster: &Cluster| -> Vec<u16> {
        let masters: Vec<_> = (cluster.topology().into_iter())
            .filter(|n| n.master)
            .collect();
        (keys.iter())
            .map(|k| {
                let slot = key_slot(k);
                let m = masters
                    .iter()
                    .find(|n| n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)));
                m.expect("an owner").port
            })
            .collect()
    };
    let owner = owners(&cluster);
    for &m in &masters {
        let mut pipe = redis::pipe();
        for (i, k) in keys.iter().enumerate() {
            if owner[i] == m {
                pipe.cmd("SET").arg(k).arg(i).ignore();
            }
        }
        let _: () = pipe.query(&mut cluster.con(m)).unwrap();
    }
    let cmds: Vec<(&str, redis::Cmd)> = (keys.iter())
        .map(|k| (k.as_str(), redis::cmd("GET").arg(k).clone()))
        .collect();
    // INFO names the node that answers it (and redis-rs routes it by no key).
    let info = redis::cmd("INFO").arg("server").clone();
    // Reads every key on a fresh map's masters: each value right, and read on its owner.
    let read_all = |what: &'static str| {
        let (con, cmds, info, masters) = (&con, &cmds, &info, &masters);
        let (keys, owners, cluster) = (&keys, &owners, &cluster);
        async move {
            for &m in masters {
                let _: () = redis::cmd("CONFIG")
                    .arg("RESETSTAT")
                    .query(&mut cluster.con(m))
                    .unwrap();
            }
            let started = Instant::now();
            let got = con.keyed(cmds, Some(info)).await;
            let took = started.elapsed();
            let owner = owners(cluster);
            for (i, (k, read)) in keys.iter().zip(&got).enumerate() {
                let value: Option<usize> =
                    redis::from_redis_value(read.reply.clone().unwrap()).unwrap();
                let info: String = redis::from_redis_value(read.head.clone().unwrap()).unwrap();
                let port = info.lines().find_map(|l| l.strip_prefix("tcp_port:"));
                assert_eq!(value, Some(i), "{what}: {k}");
                let owner = owner[i].to_string();
                assert_eq!(port, Some(&*owner), "{what}: {k} read on another node");
            }
            let per_master: Vec<usize> = (masters.iter())
                .map(|&m| owner.iter().filter(|&&o| o == m).count())
                .collect();
            let round_trips: u64 = (masters.iter())
                .map(|&m| stat(cluster, m, "commandstats", "cmdstat_info"))
                .sum();
            let least: u64 = per_master.iter().map(|n| n.div_ceil(512) as u64).sum();
            eprintln!(
                "{what}: {KEYS} keys over {per_master:?}: {round_trips} round trips in {took:?}"
            );
            (round_trips, least)
        }
    };
    // A fresh connection (as `pacer inspect` makes) reads the map first: a round trip for
    // each 512 keys of a master.
    let (round_trips, least) = read_all("fresh").await;
    assert_eq!(round_trips, least, "on a fresh connection");
    // Key 0's slot moves after the map was read: pacer's map names its old master for 5 s.
    let slot = key_slot(&keys[0]);
    let from = cluster.slot_owner(slot);
    let to = *masters.iter().find(|&&m| m != from).unwrap();
    assert_eq!(cluster.move_slot(slot, to, 10, Duration::ZERO), 1);
    let (round_trips, least) = read_all("moved").await;
    // Each master's round trips, then the failed one's keys again by the map read anew (the
    // moved key's new master, and its old one): two more, and the failed one as redis-rs sent
    // it again, to the new master and back (at most its 16 retries).
    assert!(
        (least + 2..=least + 2 + 16).contains(&round_trips),
        "{round_trips} round trips for {least} masters' lists"
    );
    assert!(
        stat(&cluster, from, "errorstats", "errorstat_MOVED") >= 1,
        "the moved key was read from the old master's round trip first"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failovers_are_followed_by_the_same_connection() {
    let mut cluster = Cluster::start(3, 1);
    let cfg = redis_config(&format!("{{mode: cluster, url: \"{}\"}}", cluster.urls()));
    let mut con = conn(&cfg);
    let tags = cluster.tag_per_master();
    for (_, tag) in &tags {
        assert_eq!(add(&mut con, tag, 1).await.unwrap(), 1);
    }

    // Graceful: the master hands over to its replica once it has caught up, so nothing is
    // lost and the connection's next write lands on the new master, once.
    let (m0, tag0) = &tags[0];
    let r0 = cluster.replicas_of(*m0)[0];
    tokio::task::block_in_place(|| cluster.failover(r0, false));
    let (took, sum) = until_ok(&mut con, tag0, Duration::from_secs(5)).await;
    eprintln!("graceful CLUSTER FAILOVER {m0} -> {r0}: first success after {took:?}");
    assert_eq!(sum, 2);
    assert_eq!(get(&cluster, r0, &format!("{{{tag0}}}:n")), Some(2));

    // TAKEOVER: the replica promotes itself without asking anyone and without catching up, so
    // a write its master had not yet streamed to it is lost, by Redis's design (CI once saw
    // the first write missing). What the connection must do is send its next write to the
    // new master, once: whatever the new master held, plus one.
    let (m1, tag1) = &tags[1];
    let r1 = cluster.replicas_of(*m1)[0];
    tokio::task::block_in_place(|| cluster.failover(r1, true));
    let held = get(&cluster, r1, &format!("{{{tag1}}}:n")).unwrap_or(0);
    let (took, sum) = until_ok(&mut con, tag1, Duration::from_secs(5)).await;
    eprintln!("CLUSTER FAILOVER TAKEOVER {m1} -> {r1}: first success after {took:?}");
    assert_eq!(sum, held + 1, "one write on top of what {r1} held");
    assert_eq!(get(&cluster, r1, &format!("{{{tag1}}}:n")), Some(sum));

    // A master killed outright: the cluster fails it over on its own (node timeout 1 s), and
    // the connection finds the new master.
    let (m2, tag2) = &tags[2];
    let r2 = cluster.replicas_of(*m2)[0];
    cluster.kill(*m2);
    let (took, sum) = until_ok(&mut con, tag2, Duration::from_secs(5)).await;
    eprintln!("kill -9 of master {m2}: first success after {took:?}");
    assert!(took < Duration::from_secs(5));
    // The write landed on the promoted replica. (Not asked through CLUSTER SLOTS: whichever
    // node answers that may not have heard of the promotion through gossip yet.) Its value
    // is not asserted: an automatic failover, like TAKEOVER, may lose what was not streamed.
    let on_r2 = get(&cluster, r2, &format!("{{{tag2}}}:n"));
    assert_eq!(on_r2, Some(sum), "the write is on the new master");
    // The killed master comes back as a replica of its successor; traffic is unaffected.
    tokio::task::block_in_place(|| cluster.restart(*m2));
    for (_, tag) in &tags {
        add(&mut con, tag, 1)
            .await
            .expect("a call after the restart");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_is_followed_by_the_same_connection() {
    // Two replicas: one for a planned failover, the other for a master killed after it.
    let mut sentinels = tokio::task::block_in_place(|| Sentinels::start_with(2));
    let cfg = redis_config(&format!(
        "{{mode: sentinel, url: \"{}\", sentinel: {{master_name: {}}}}}",
        sentinels.urls(),
        sentinels.master_name
    ));
    let mut con = conn(&cfg);
    let tag = "s";
    assert_eq!(add(&mut con, tag, 1).await.unwrap(), 1);
    let old = sentinels.master_port().unwrap();
    let written: Option<i64> = redis::cmd("GET")
        .arg("{s}:n")
        .query(&mut sentinels.server(old).con())
        .unwrap();
    assert_eq!(written, Some(1), "the write went to the master");
    // Let the replica hold the write before its master dies.
    let _: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(1000)
        .query_async(&mut con)
        .await
        .unwrap();

    // A planned failover: no error tells the client, the old master keeps answering as one
    // for a while; the connection must switch on the sentinels' word alone.
    let promoted = tokio::task::block_in_place(|| sentinels.failover());
    let took = until_lands_on(&mut con, tag, &sentinels, promoted, Duration::from_secs(10)).await;
    eprintln!("SENTINEL FAILOVER {old} -> {promoted}: calls land on it after {took:?}");
    let synced = tokio::task::block_in_place(|| {
        sentinels.wait_replica_of(promoted, Duration::from_secs(10))
    });
    assert!(synced, "a replica follows the new master");

    // The master killed outright.
    let killed = sentinels.kill_master();
    assert_eq!(killed, promoted);
    let started = Instant::now();
    let new =
        tokio::task::block_in_place(|| sentinels.wait_new_master(killed, Duration::from_secs(10)))
            .expect("a sentinel names a new master");
    let took = started.elapsed()
        + until_lands_on(&mut con, tag, &sentinels, new, Duration::from_secs(10)).await;
    eprintln!("master {killed} killed; promoted {new}; calls land on it after {took:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
}

/// Connections to one master through the sentinels share one watcher: a worker has one per
/// input stream's reader besides its own, and each asked the sentinels every second, which
/// checked the master's role on a connection of its own (326 connections in 10 s with 10
/// streams, a TLS handshake each under TLS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_to_one_master_share_one_sentinel_watcher() {
    let sentinels = tokio::task::block_in_place(|| Sentinels::start_with(1));
    let cfg = redis_config(&format!(
        "{{mode: sentinel, url: \"{}\", sentinel: {{master_name: {}}}}}",
        sentinels.urls(),
        sentinels.master_name
    ));
    let master = sentinels.master_port().unwrap();
    let received = || -> i64 {
        let info: String = redis::cmd("INFO")
            .arg("stats")
            .query(&mut sentinels.server(master).con())
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap()
    };
    let mut cons: Vec<RedisConn> = (0..10).map(|_| conn(&cfg)).collect();
    for con in &mut cons {
        let _: () = redis::cmd("PING").query_async(con).await.unwrap();
    }
    let before = received();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let opened = received() - before - 1;
    eprintln!("10 connections through the sentinels: {opened} connections to the master in 4 s");
    // One watcher: a lookup a second, whose role checks open one connection or a few (each
    // sentinel asked at once may name the master): 10 seen; one watcher per connection opened
    // 119.
    assert!(opened <= 25, "{opened} connections to the master in 4 s");
    for con in &mut cons {
        let _: () = redis::cmd("PING").query_async(con).await.unwrap();
    }
}

/// Calls `add` every 20 ms until one succeeds and its result is what the node on `port` holds
/// (the call ran there); how long that took.
async fn until_lands_on(
    con: &mut RedisConn,
    tag: &str,
    sentinels: &Sentinels,
    port: u16,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < limit {
        match add(con, tag, 1).await {
            Ok(v) => {
                let on_port: Option<i64> = redis::cmd("GET")
                    .arg(format!("{{{tag}}}:copy"))
                    .query(&mut sentinels.server(port).con())
                    .unwrap();
                if on_port == Some(v) {
                    return start.elapsed();
                }
                last = Some(format!("{v} written elsewhere"));
            }
            Err(e) => last = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no call landed on {port} within {limit:?}; last: {last:?}");
}

/// The `redis:` section for a TLS server on `port`, with these `tls:` settings.
fn tls_config(port: u16, tls: &str) -> RedisConfig {
    redis_config(&format!(
        "{{url: \"rediss://127.0.0.1:{port}\", timeout: 2s, tls: {tls}}}"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_verifies_the_server_and_presents_the_client_certificate() {
    let files = tokio::task::block_in_place(TlsFiles::generate);
    let open = tokio::task::block_in_place(|| files.start_server(false));
    let mutual = tokio::task::block_in_place(|| files.start_server(true));
    let ca = format!("{{ca_file: {}}}", files.ca.display());
    let with_cert = format!(
        "{{ca_file: {}, cert_file: {}, key_file: {}}}",
        files.ca.display(),
        files.client_cert.display(),
        files.client_key.display()
    );

    // The right CA: works.
    let mut con = conn(&tls_config(open.port, &ca));
    con.check().await.expect("TLS with the right CA");
    assert_eq!(add(&mut con, "tls", 3).await.unwrap(), 3);

    // A CA that did not sign the server's certificate: a TLS error, fatal, that says so.
    let wrong = format!("{{ca_file: {}}}", files.other_ca.display());
    let e = conn(&tls_config(open.port, &wrong))
        .check()
        .await
        .unwrap_err();
    assert!(matches!(e, ConnectError::Tls { .. }), "{e}");
    assert!(e.is_fatal());
    assert!(e.to_string().contains("redis.tls.ca_file"), "{e}");
    eprintln!("wrong CA: {e}");

    // No client certificate where the server requires one.
    let e = conn(&tls_config(mutual.port, &ca))
        .check()
        .await
        .unwrap_err();
    assert!(matches!(e, ConnectError::Tls { .. }), "{e}");
    eprintln!("no client certificate: {e}");
    // A key that is not the certificate's: refused by the config, naming the key file (it
    // passed, and failed only at connect, exit 1 and no YAML path).
    let yaml = format!(
        "redis: {{url: \"rediss://127.0.0.1:{}\", tls: {{ca_file: {}, cert_file: {}, key_file: {}}}}}\noutbound:\n  streams: [\"pacer:out\"]\n  routes:\n    a: {{rate: 10/s}}\n",
        mutual.port,
        files.ca.display(),
        files.client_cert.display(),
        files.server_key.display()
    );
    let e = Config::parse(&yaml, &Overrides::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("redis.tls.key_file") && e.contains("does not go with the certificate"),
        "{e}"
    );
    // With it: works.
    let mut con = conn(&tls_config(mutual.port, &with_cert));
    con.check()
        .await
        .expect("mutual TLS with the client certificate");
    assert_eq!(add(&mut con, "mtls", 4).await.unwrap(), 4);

    // No fall back to plain text either way: rediss:// to a plain server never gets past the
    // handshake (the server waits for a command line, the client for a TLS answer), and
    // redis:// to a TLS port gets no answer.
    let plain = tokio::task::block_in_place(RedisServer::start);
    let mut to_plain = conn(&tls_config(plain.port, &ca));
    let e = to_plain.check().await.unwrap_err();
    assert!(e.to_string().contains("TLS"), "{e}");
    eprintln!("rediss:// to a plain-text server: {e}");
    assert!(add(&mut to_plain, "plain", 1).await.is_err());
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut plain.con()).unwrap();
    assert!(
        keys.is_empty(),
        "nothing was written in plain text: {keys:?}"
    );
    let cfg = redis_config(&format!("{{url: \"redis://127.0.0.1:{}\"}}", open.port));
    let e = conn(&cfg).check().await.unwrap_err();
    assert!(!e.is_fatal(), "{e}");
    let stored: Option<i64> = add(&mut conn(&tls_config(open.port, &ca)), "tls", 0)
        .await
        .ok();
    assert_eq!(stored, Some(3), "the plain-text attempt wrote nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_users_log_in_from_the_url_a_password_file_or_the_environment() {
    let server = tokio::task::block_in_place(RedisServer::start);
    server.add_acl_user("pacer-user", "right-pw");
    let whoami = |mut con: RedisConn| async move {
        redis::cmd("ACL")
            .arg("WHOAMI")
            .query_async::<String>(&mut con)
            .await
    };
    let port = server.port;

    // user:password in the URL.
    let cfg = redis_config(&format!(
        "{{url: \"redis://pacer-user:right-pw@127.0.0.1:{port}\"}}"
    ));
    assert_eq!(whoami(conn(&cfg)).await.unwrap(), "pacer-user");

    // redis.username and redis.password_file.
    let dir = TempDir::new("acl");
    let file = dir.write("password", "right-pw\n");
    let cfg = redis_config(&format!(
        "{{url: \"redis://127.0.0.1:{port}\", username: pacer-user, password_file: {}}}",
        file.display()
    ));
    assert_eq!(format!("{:?}", cfg.password), "Some(***)");
    assert_eq!(whoami(conn(&cfg)).await.unwrap(), "pacer-user");

    // PACER_REDIS_PASSWORD (as main reads it into the overrides) wins over the file.
    let wrong_file = dir.write("wrong", "not-it\n");
    let overrides = Overrides {
        redis_password: Some(Secret::new("right-pw")),
        ..Overrides::default()
    };
    let cfg = redis_config_with(
        &format!(
            "{{url: \"redis://127.0.0.1:{port}\", username: pacer-user, password_file: {}}}",
            wrong_file.display()
        ),
        &overrides,
    );
    assert_eq!(whoami(conn(&cfg)).await.unwrap(), "pacer-user");

    // A wrong password: fatal, classified as auth, from check() and from any command.
    let cfg = redis_config(&format!(
        "{{url: \"redis://pacer-user:wrong@127.0.0.1:{port}\"}}"
    ));
    let e = conn(&cfg).check().await.unwrap_err();
    assert!(matches!(e, ConnectError::Auth { .. }), "{e}");
    assert!(!e.to_string().contains("wrong@"), "{e}");
    let err = whoami(conn(&cfg)).await.unwrap_err();
    assert_eq!(fatal(&err), Some(Fatal::Auth), "{err}");

    // A user without the permission to run scripts: NOPERM is fatal too.
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("pinger")
        .arg("on")
        .arg(">pw")
        .arg("+ping")
        .query(&mut server.con())
        .unwrap();
    let cfg = redis_config(&format!("{{url: \"redis://pinger:pw@127.0.0.1:{port}\"}}"));
    let mut con = conn(&cfg);
    con.check().await.expect("PING is allowed");
    let err = add(&mut con, "acl", 1).await.unwrap_err();
    assert_eq!(fatal(&err), Some(Fatal::Auth), "{err}");

    // No password where one is required: NOAUTH is fatal.
    server.config_set("requirepass", "now-required");
    let cfg = redis_config(&format!("{{url: \"redis://127.0.0.1:{port}\"}}"));
    let err = whoami(conn(&cfg)).await.unwrap_err();
    assert_eq!(fatal(&err), Some(Fatal::Auth), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_down_at_start_is_waited_for() {
    let port = free_port();
    let cfg = redis_config(&format!(
        "{{url: \"redis://127.0.0.1:{port}\", timeout: 500ms}}"
    ));
    // Nothing listens yet: building the connection does not care, calls fail and may be retried.
    let mut con = conn(&cfg);
    let e = con.check().await.unwrap_err();
    assert!(!e.is_fatal(), "{e}");
    let server = tokio::task::block_in_place(|| RedisServer::spawn_on(port, &[]));
    let (took, _) = until_ok(&mut con, "late", Duration::from_secs(10)).await;
    eprintln!("Redis started after the connection: first success after {took:?}");
    drop(server);
}

/// A connection that stops answering without closing (a NAT entry dropped, a proxy holding a
/// dead peer's connection) is replaced after two timeouts in a row. redis-rs's manager retried
/// it until the kernel gave up on the socket (found by review: a worker behind one stayed not
/// ready for over a minute while new connections to the same address worked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_connection_is_replaced() {
    let server = RedisServer::start();
    let proxy = pacer::testkit::BlackHoleProxy::start(server.port);
    let cfg = redis_config(&format!(
        "{{url: \"redis://127.0.0.1:{}\", timeout: 300ms}}",
        proxy.port()
    ));
    let mut con = conn(&cfg);
    con.check().await.expect("through the proxy");
    proxy.black_hole();
    let started = Instant::now();
    let mut failed = 0;
    let mut answered = false;
    // Bounded: twenty tries of at most 300 ms each.
    for _ in 0..20 {
        match con.check().await {
            Ok(()) => {
                answered = true;
                break;
            }
            Err(e) => {
                assert!(!e.is_fatal(), "{e}");
                failed += 1;
            }
        }
    }
    assert!(answered, "still no answer after {failed} calls");
    assert!(
        failed >= 2,
        "the first calls went into the black hole: {failed}"
    );
    eprintln!(
        "answered again after {failed} timed-out calls, {:?}",
        started.elapsed()
    );
}

/// A URL's database the server does not have cannot heal: fatal, so a worker exits at start
/// saying so. It was retried forever as "Redis does not answer" (found by review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_the_server_lacks_is_fatal() {
    let server = RedisServer::start();
    let cfg = redis_config(&format!(
        "{{url: \"redis://127.0.0.1:{}/99\", timeout: 500ms}}",
        server.port
    ));
    let e = conn(&cfg).check().await.unwrap_err();
    assert!(e.is_fatal(), "{e}");
    assert!(e.to_string().contains("DB index is out of range"), "{e}");
}

/// A blocking connection to the TLS-only server on `port`, verifying it against `files.ca` and
/// presenting the client certificate: the test's own traffic goes over TLS too.
fn tls_con(files: &TlsFiles, port: u16) -> redis::Connection {
    let read = |p: &std::path::Path| std::fs::read(p).expect("reading a test certificate");
    let certs = redis::TlsCertificates {
        client_tls: Some(redis::ClientTlsConfig {
            client_cert: read(&files.client_cert),
            client_key: read(&files.client_key),
        }),
        root_cert: Some(read(&files.ca)),
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    redis::Client::build_with_tls(format!("rediss://127.0.0.1:{port}"), certs)
        .expect("a TLS client")
        .get_connection_with_timeout(Duration::from_secs(5))
        .expect("a TLS connection to the test Redis")
}

/// One entry of an output stream: its id, its millisecond, its fields as text.
struct Entry {
    id: String,
    ms: i64,
    fields: std::collections::HashMap<String, String>,
}

/// Every entry of `stream` (XRANGE over `con`), oldest first.
fn entries(con: &mut redis::Connection, stream: &str) -> Vec<Entry> {
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(con)
        .expect("XRANGE");
    reply
        .ids
        .into_iter()
        .map(|e| Entry {
            ms: e.id.split('-').next().unwrap().parse().unwrap(),
            fields: e
                .map
                .iter()
                .map(|(k, v)| (k.clone(), redis::from_redis_value_ref(v).unwrap()))
                .collect(),
            id: e.id,
        })
        .collect()
}

/// XADDs one entry per field list to `stream`; the entry ids.
fn xadd_all(
    con: &mut redis::Connection,
    stream: &str,
    events: &[Vec<(&str, &str)>],
) -> Vec<String> {
    let mut pipe = redis::pipe();
    for fields in events {
        let cmd = pipe.cmd("XADD").arg(stream).arg("*");
        for (k, v) in fields {
            cmd.arg(*k).arg(*v);
        }
    }
    pipe.query(con).expect("pushing events over TLS")
}

/// A `pacer run` config for the TLS server on `port` with these `redis.tls` settings, metrics
/// on `metrics`: two outbound routes and one inbound rule.
fn tls_run_config(
    dir: &TempDir,
    name: &str,
    port: u16,
    metrics: u16,
    tls: &str,
) -> std::path::PathBuf {
    dir.write(
        name,
        &format!(
            r#"redis:
  url: "rediss://127.0.0.1:{port}"
  timeout: 2s
  tls: {tls}
metrics:
  listen: 127.0.0.1:{metrics}
worker:
  drain: 1s
outbound:
  streams: ["pacer:out"]
  routes:
    fast: {{rate: 20/s, burst: 1, max_wait: 10s}}
    slow: {{rate: 5/s, burst: 1, max_wait: 10s}}
inbound:
  streams: ["pacer:in"]
  forward_stream: "pacer:accepted"
  rejected_stream: "pacer:in-rejected"
  rules:
    - {{name: per-source, key: [source], algorithm: sliding_log, limits: [3/min]}}
"#
        ),
    )
}

fn readyz_status(port: u16) -> Option<u16> {
    pacer::testkit::http_get(port, "/readyz").map(|(status, _)| status)
}

/// Runs `pacer run` on `config` and waits up to 20 s for it to exit: its exit code (None if
/// it did not), whether `/readyz` ever said 200 meanwhile, and its log.
fn run_until_exit(config: &std::path::Path, metrics: u16) -> (Option<i32>, bool, String) {
    let mut worker = pacer::testkit::Pacer::run(
        std::path::Path::new(env!("CARGO_BIN_EXE_pacer")),
        config,
        &[],
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut was_ready = false;
    let code = loop {
        if let Some(code) = worker.wait_for(Duration::from_millis(100)) {
            break Some(code);
        }
        was_ready |= readyz_status(metrics) == Some(200);
        if Instant::now() >= deadline {
            break None;
        }
    };
    (code, was_ready, worker.log_text())
}

/// A real worker (`pacer run`) against a TLS-only redis-server that requires client
/// certificates (`rediss://`, `redis.tls` CA, certificate and key), every event pushed and
/// every output read over TLS too: it becomes ready; 40 events on a 20/s route and 10 on a 5/s
/// route (burst 1) are each dispatched exactly once, on their route, no rolling window holding
/// more than rate × W + 1, nothing left pending; of 5 inbound events of one source under a
/// 3/min limit the first 3 are forwarded and the last 2 rejected `rate_limited`; `/readyz` and
/// `pacer_ready` say ready; SIGTERM drains and exits 0.
#[test]
fn a_worker_runs_both_flows_over_tls_with_a_client_certificate() {
    let files = TlsFiles::generate();
    let server = files.start_server(true);
    let port = server.port;
    let dir = TempDir::new("tls-run");
    let s = |p: &std::path::Path| p.display().to_string();
    let mut con = tls_con(&files, port);

    // The right CA and the client certificate.
    let metrics = free_port();
    let right = format!(
        "{{ca_file: {}, cert_file: {}, key_file: {}}}",
        s(&files.ca),
        s(&files.client_cert),
        s(&files.client_key)
    );
    let config = tls_run_config(&dir, "tls.yaml", port, metrics, &right);
    let mut worker = pacer::testkit::Pacer::run(
        std::path::Path::new(env!("CARGO_BIN_EXE_pacer")),
        &config,
        &[],
    );
    let ready = pacer::testkit::wait_until(Duration::from_secs(20), || {
        readyz_status(metrics) == Some(200)
    });
    assert!(ready, "not ready over TLS:\n{}", worker.log_text());

    let routes = [("fast", 40, 20.0), ("slow", 10, 5.0)];
    let mut pushed: Vec<(String, &str)> = Vec::new();
    let events: Vec<Vec<(&str, &str)>> = routes
        .iter()
        .flat_map(|&(route, n, _)| (0..n).map(move |_| vec![("route", route)]))
        .collect();
    let ids = xadd_all(&mut con, "pacer:out", &events);
    for (id, fields) in ids.into_iter().zip(&events) {
        pushed.push((id, fields[0].1));
    }
    let inbound: Vec<Vec<(&str, &str)>> = (0..5).map(|_| vec![("source", "acme")]).collect();
    let in_ids = xadd_all(&mut con, "pacer:in", &inbound);

    let outputs = [
        "pacer:{fast}:ready",
        "pacer:{slow}:ready",
        "pacer:rejected",
        "pacer:dead",
    ];
    let done = pacer::testkit::wait_until(Duration::from_secs(30), || {
        let ended: usize = outputs.iter().map(|s| entries(&mut con, s).len()).sum();
        let decided = entries(&mut con, "pacer:accepted").len()
            + entries(&mut con, "pacer:in-rejected").len();
        ended >= pushed.len()
            && decided >= in_ids.len()
            && pending_on(&mut con, "pacer:out") == 0
            && pending_on(&mut con, "pacer:in") == 0
    });
    assert!(done, "not every event ended:\n{}", worker.log_text());

    // Outbound: each event once, on its own route, at its route's rate.
    let mut ended: std::collections::BTreeMap<String, Vec<&str>> = Default::default();
    for stream in outputs {
        for e in entries(&mut con, stream) {
            ended
                .entry(e.fields["pacer_source_id"].clone())
                .or_default()
                .push(stream);
        }
    }
    for (id, route) in &pushed {
        let ready = format!("pacer:{{{route}}}:ready");
        assert_eq!(
            ended.get(id).map(|v| v.as_slice()),
            Some(&[ready.as_str()][..]),
            "event {id} of {route}"
        );
    }
    assert_eq!(
        ended.len(),
        pushed.len(),
        "outputs hold events never pushed"
    );
    for (route, n, rate) in routes {
        let stream = format!("pacer:{{{route}}}:ready");
        let got = entries(&mut con, &stream);
        assert_eq!(got.len(), n, "{stream}");
        assert!(got.iter().all(|e| e.fields["pacer_route"] == route));
        let times: Vec<i64> = got.iter().map(|e| e.ms).collect();
        for w in [1, 5, 10, 20, 50, 100, 200, 250, 500, 1000, 2000, 5000] {
            let limit = rate * w as f64 / 1000.0 + 1.0;
            let seen = pacer::report::max_in_window(&times, w);
            assert!(
                seen as f64 <= limit,
                "{stream}: {seen} entries in a {w} ms window, limit {limit}"
            );
        }
        let span = times[n - 1] - times[0];
        let least = ((n - 1) as f64 / rate * 1000.0) as i64 - 1;
        assert!(span >= least, "{stream}: {n} entries in {span} ms");
        eprintln!("{route}: {n} entries over {span} ms at {rate}/s");
    }

    // Inbound: the first 3 forwarded, the last 2 rejected by the limit.
    let source_ids = |stream: &str, con: &mut redis::Connection| -> Vec<String> {
        entries(con, stream)
            .iter()
            .map(|e| e.fields["pacer_source_id"].clone())
            .collect()
    };
    assert_eq!(source_ids("pacer:accepted", &mut con), in_ids[..3].to_vec());
    assert_eq!(
        source_ids("pacer:in-rejected", &mut con),
        in_ids[3..].to_vec()
    );
    for e in entries(&mut con, "pacer:in-rejected") {
        assert_eq!(e.fields["pacer_reason"], "rate_limited", "{}", e.id);
    }

    // Ready all along, by /readyz and by the metric; SIGTERM drains and exits 0.
    assert_eq!(readyz_status(metrics), Some(200));
    assert_eq!(pacer::testkit::metric_at(metrics, "pacer_ready "), 1.0);
    worker.signal("TERM");
    let code = worker.wait_for(Duration::from_secs(15));
    assert_eq!(code, Some(0), "{}", worker.log_text());
}

/// A worker that cannot verify its TLS server refuses to start: given a CA that did not sign
/// the server's certificate, or no client certificate where the server requires one, `pacer
/// run` exits 1 within 20 s, never ready, having written nothing, its log saying it is TLS that
/// failed and naming the setting to check (`redis.tls.ca_file`; `redis.tls`), as `pacer
/// inspect` says for the same config.
#[test]
fn a_worker_that_cannot_verify_its_tls_server_exits_naming_tls_and_the_setting() {
    let files = TlsFiles::generate();
    let server = files.start_server(true);
    let port = server.port;
    let dir = TempDir::new("tls-refused");
    let s = |p: &std::path::Path| p.display().to_string();
    let mut con = tls_con(&files, port);

    let client = format!(
        "cert_file: {}, key_file: {}",
        s(&files.client_cert),
        s(&files.client_key)
    );
    let cases = [
        // A CA that did not sign the server's certificate.
        (
            "wrong CA",
            format!("{{ca_file: {}, {client}}}", s(&files.other_ca)),
            "redis.tls.ca_file",
        ),
        // No client certificate where the server requires one.
        (
            "no client certificate",
            format!("{{ca_file: {}}}", s(&files.ca)),
            "redis.tls",
        ),
    ];
    let mut said = Vec::new();
    for (case, tls, setting) in &cases {
        let metrics = free_port();
        let config = tls_run_config(&dir, &format!("{case}.yaml"), port, metrics, tls);
        let (code, was_ready, log) = run_until_exit(&config, metrics);
        eprintln!("{case}, pacer run:\n{log}");
        assert_eq!(code, Some(1), "{case}: {log}");
        assert!(!was_ready, "{case}: ready all the same:\n{log}");
        // The one-shot commands, for the same config, say what failed and what to check.
        let inspect = std::process::Command::new(env!("CARGO_BIN_EXE_pacer"))
            .args(["inspect", "--config"])
            .arg(&config)
            .output()
            .expect("running pacer inspect");
        let inspect = String::from_utf8_lossy(&inspect.stderr).into_owned();
        eprintln!("{case}, pacer inspect: {inspect}");
        assert!(
            inspect.contains("TLS") && inspect.contains(setting),
            "{case}: {inspect}"
        );
        said.push((case, setting, log));
    }
    let size: i64 = redis::cmd("DBSIZE").query(&mut con).unwrap();
    assert_eq!(size, 0, "the refused workers wrote nothing");
    // The worker's own words: that TLS failed, and the setting to check.
    for (case, setting, log) in said {
        assert!(
            log.contains("TLS") && log.contains(setting),
            "{case}: pacer run does not say TLS and {setting}:\n{log}"
        );
    }
}
