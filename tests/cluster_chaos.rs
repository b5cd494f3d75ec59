//! Chaos on a Redis Cluster: three masters with a replica each, a route pair and an input stream
//! on every master, inbound state in four partitions, three workers, while events arrive with
//! faults drawn at random: `kill -9` of a worker (restarted at once), SIGSTOP of a worker for
//! 0.5–2 s, a route's or an input stream's slot moved to another master key by key while the
//! traffic flows, a master failed over to its replica (gracefully: `CLUSTER FAILOVER`), and a
//! master frozen for 0.2–0.7 s (below the cluster's node timeout, so nobody takes it over);
//! and with `redis.wait_replicas: 1` (drawn from the seed, or
//! `PACER_CLUSTER_CHAOS_WAIT_REPLICAS=1`), a master killed outright, its replica promoted and
//! the old master restarted as its replica. The workers' places are weighed at a byte a place
//! every other seed (or `PACER_CLUSTER_CHAOS_INFLIGHT_BYTES`), as in `tests/chaos.rs`. Each
//! fault on the cluster comes once first, so that the suite's short run has them all.
//! Among the events: wide ones (2,000 fields), malformed ones, repeated ids and binary values.
//! At the end every input entry has ended in exactly one output once, no rolling window of a
//! route's ready stream holds more than its limit (by the entry ids Redis gave), and nothing is
//! pending.
//!
//! `tests/chaos.rs` does the same on one Redis killed and restarted on its AOF; a cluster's
//! faults are others: slots that move under a worker's calls (MOVED, ASK, TRYAGAIN), a
//! worker's slot map going stale, masters that change, calls that wait on a frozen master.
//!
//! The suite runs 30 s. Longer, or replaying a run: `PACER_CLUSTER_CHAOS_SECONDS=300
//! PACER_CLUSTER_CHAOS_SEED=<seed printed by a run> cargo test --release --test cluster_chaos
//! -- --nocapture`.

mod common;

use common::bin;
use common::chaos::{
    assert_few_poisoned_and_enough_faults, env_u64, inflight_bytes, logs, reasons, seed,
    tick_events, worker_fault, RawEvent, Rng, Worker,
};
use common::cluster::{assert_each_once, assert_windows, entries, ready, route_pairs};
use pacer::keys::InboundKeys;
use pacer::testkit::{free_port, http_get, wait_until, Cluster, Pacer, TempDir};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// XADDs `events` to `stream` on the master serving it now; returns the entry ids.
fn push(cluster: &Cluster, stream: &str, events: &[RawEvent]) -> Vec<String> {
    common::push(cluster.server_of(stream), stream, events)
}

#[test]
fn cluster_chaos_every_entry_ends_once_and_the_rate_holds() {
    let seconds = env_u64("PACER_CLUSTER_CHAOS_SECONDS").unwrap_or(30);
    let seed = seed("PACER_CLUSTER_CHAOS_SEED");
    // Fewer places than a route's backlog can hold, every other seed: events are then parked
    // and read again, through every fault.
    let max_inflight = if seed & 4 == 0 { 10_000 } else { 150 };
    // With `wait_replicas: 1` (every other seed) a master may also be killed outright: its
    // replica takes over and nothing may be lost (without it, writes the replica had not
    // received are lost, as the README says, and no such fault is drawn).
    let wait_replicas = env_u64("PACER_CLUSTER_CHAOS_WAIT_REPLICAS").unwrap_or(seed >> 3 & 1);
    // A byte a place every other seed (`common::chaos::inflight_bytes`).
    let (weighed, inflight_bytes) = inflight_bytes(
        "PACER_CLUSTER_CHAOS_INFLIGHT_BYTES",
        seed >> 4 & 1 == 1,
        max_inflight,
    );
    eprintln!(
        "cluster chaos: {seconds} s, seed {seed}, max_inflight {max_inflight}, max_inflight_bytes {inflight_bytes}, wait_replicas {wait_replicas}"
    );
    let mut rng = Rng(seed);

    let mut cluster = Cluster::start(3, 1);
    let masters = cluster.masters();
    let dir = TempDir::new("cluster-chaos");
    let a: Vec<String> = masters.iter().map(|&m| cluster.name_on(m, "a")).collect();
    let b: Vec<String> = masters.iter().map(|&m| cluster.name_on(m, "b")).collect();
    let inputs: Vec<String> = masters.iter().map(|&m| cluster.name_on(m, "in")).collect();
    let inq = cluster.name_on(masters[0], "inb");
    let accepted = cluster.name_on(masters[1], "acc");
    let rejected = cluster.name_on(masters[2], "rej");
    const PARTITIONS: usize = 4;
    let parts: Vec<InboundKeys> = (0..PARTITIONS)
        .map(|k| InboundKeys::partition(&accepted, &rejected, k, PARTITIONS, true))
        .collect();
    let mut moving: Vec<String> = vec![inq.clone(), "pacer:rejected".into(), "pacer:dead".into()];
    moving.extend(parts.iter().map(|k| k.slot_key().to_string()));
    let routes = route_pairs(
        &a,
        &b,
        "rate: 60/s, burst: 5, max_wait: 1s",
        "rate: 30/s, burst: 1, max_wait: 1s",
    );
    let body = format!(
        "outbound:\n  streams: [{}]\n  max_event_fields: 3000\n  routes:\n{routes}inbound:\n  streams: [{inq}]\n  forward_stream: \"{accepted}\"\n  rejected_stream: \"{rejected}\"\n  partitions: {PARTITIONS}\n  partition_by: source\n  partitioned_outputs: true\n  rules:\n    - {{name: per-source, key: [source], algorithm: gcra, limits: [50/s]}}\n",
        inputs.join(", ")
    );
    let mut workers: Vec<Worker> = (0..3)
        .map(|i| {
            let port = free_port();
            let text = format!(
                "redis:\n  url: {}\n  mode: cluster\n  timeout: 500ms\n  wait_replicas: {wait_replicas}\nmetrics:\n  listen: 127.0.0.1:{port}\nworker:\n  batch: 64\n  max_inflight: {max_inflight}{weighed}\n  drain: 1s\n  claim_idle: 3500ms\n{body}\n",
                cluster.urls()
            );
            let cfg = dir.write(&format!("w{i}.yaml"), &text);
            let pacer = Pacer::run_wrapped(&[], bin(), &cfg, &[]);
            let up = wait_until(Duration::from_secs(15), || {
                matches!(http_get(port, "/readyz"), Some((200, _)))
            });
            assert!(up, "worker {i} not ready:\n{}", pacer.log_text());
            Worker {
                pacer: Some(pacer),
                cfg,
                port,
                wrapper: Vec::new(),
                stopped_until: None,
            }
        })
        .collect();

    let mut pushed: Vec<(String, String)> = Vec::new();
    let mut faults: BTreeMap<&str, u32> = BTreeMap::new();
    // Whose slots moved, and how many keys went with each.
    let mut moved: Vec<String> = Vec::new();
    let start = Instant::now();
    let mut next_fault = Instant::now() + Duration::from_secs(2);
    let mut drawn = 0u64;
    let mut tick = 0u64;
    while start.elapsed() < Duration::from_secs(seconds) {
        // Over the three input streams, mostly for the a routes, the wide ones 2,000 fields
        // wide.
        let route = |n: u64| {
            let m = (n % 3) as usize;
            if n % 5 == 4 { &b[m] } else { &a[m] }.clone()
        };
        let (events, inb) = tick_events(tick, &mut rng, 2_000, route);
        let mut out: Vec<Vec<RawEvent>> = vec![Vec::new(); 3];
        for (n, e) in events {
            out[(n / 3 % 3) as usize].push(e);
        }
        for (stream, events) in inputs.iter().zip(&out) {
            let ids = push(&cluster, stream, events);
            pushed.extend(ids.into_iter().map(|id| (stream.clone(), id)));
        }
        let ids = push(&cluster, &inq, &inb);
        pushed.extend(ids.into_iter().map(|id| (inq.clone(), id)));
        tick += 1;

        for w in &mut workers {
            w.cont(false);
        }
        if Instant::now() >= next_fault {
            // 0–3 on a worker (worker_fault), the rest on the cluster: each of those once
            // first, so that a short run has them all, then any at random.
            let kinds = if wait_replicas > 0 { 8 } else { 7 };
            let fault = if 4 + drawn < kinds {
                4 + drawn
            } else {
                rng.below(kinds)
            };
            drawn += 1;
            let on_a_worker = worker_fault(&mut workers, fault, &mut rng, &mut faults);
            match fault {
                _ if on_a_worker => {}
                4 => {
                    // A route's slot (its bucket, ready stream and records), an input
                    // stream's, a shared output's (with its write-once records) or an inbound
                    // partition's (its identities' state and its outputs), to another master,
                    // 50 keys at a time (a busy route's slot holds thousands of record hashes
                    // after a few minutes: two at a time, a move took most of a minute).
                    let keys: Vec<&String> =
                        a.iter().chain(&b).chain(&inputs).chain(&moving).collect();
                    let key = *rng.pick(&keys);
                    let slot = pacer::connection::key_slot(key);
                    let others: Vec<u16> = cluster
                        .masters()
                        .into_iter()
                        .filter(|&m| m != cluster.slot_owner(slot))
                        .collect();
                    let to = *rng.pick(&others);
                    let keys_moved = cluster.move_slot(slot, to, 50, Duration::from_millis(10));
                    moved.push(format!("{key} ({keys_moved} keys)"));
                    *faults.entry("slot moved").or_default() += 1;
                }
                5 => {
                    let master = *rng.pick(&cluster.masters());
                    let replica = cluster.replicas_of(master)[0];
                    cluster.failover(replica, false);
                    cluster.wait_stable(Duration::from_secs(20));
                    *faults.entry("master failed over").or_default() += 1;
                }
                6 => {
                    // No events are pushed meanwhile: a producer would be waiting on it too.
                    let master = *rng.pick(&cluster.masters());
                    cluster.pause(master);
                    std::thread::sleep(Duration::from_millis(200 + rng.below(500)));
                    cluster.resume(master);
                    *faults.entry("master frozen").or_default() += 1;
                }
                _ => {
                    // kill -9 of a master: its replica takes over once the others see it gone
                    // (the node timeout), and the old master comes back as that replica's
                    // replica. The test's own pushes are on the replica first (a producer
                    // that cares waits for its replicas too).
                    let master = *rng.pick(&cluster.masters());
                    let mut con = cluster.con(master);
                    let synced: i64 = redis::cmd("WAIT").arg(1).arg(2000).query(&mut con).unwrap();
                    assert_eq!(synced, 1, "the test's own pushes were not replicated");
                    cluster.kill(master);
                    let promoted = cluster.wait_promoted(master, Duration::from_secs(20));
                    assert!(promoted.is_some(), "no replica of {master} took over");
                    cluster.restart(master);
                    cluster.wait_stable(Duration::from_secs(20));
                    *faults
                        .entry("master killed, its replica promoted")
                        .or_default() += 1;
                }
            }
            next_fault = Instant::now() + Duration::from_millis(1_500 + rng.below(3_000));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for w in &mut workers {
        w.cont(true);
    }

    let mut outputs: Vec<String> = a.iter().chain(&b).map(|r| ready(r)).collect();
    outputs.extend(["pacer:rejected", "pacer:dead", "pacer:in-dead"].map(String::from));
    outputs.extend(
        parts
            .iter()
            .flat_map(|k| [k.forward.clone(), k.rejected.clone()]),
    );
    let mut all_inputs = inputs.clone();
    all_inputs.push(inq.clone());
    assert_each_once(&cluster, &pushed, &outputs, &all_inputs, || logs(&workers));
    // The rate of every route, by the entry-id times Redis gave its ready stream.
    for (route, rate, burst) in a
        .iter()
        .map(|r| (r, 60.0, 5.0))
        .chain(b.iter().map(|r| (r, 30.0, 1.0)))
    {
        let times: Vec<i64> = entries(&cluster, &ready(route))
            .iter()
            .map(|e| e.ms)
            .collect();
        assert_windows(&format!("seed {seed}: {route}"), &times, rate, burst);
    }
    let count = |s: &str| entries(&cluster, s).len();
    let dead = entries(&cluster, "pacer:dead");
    let reasons = reasons(&dead);
    let dispatched: usize = a.iter().chain(&b).map(|r| count(&ready(r))).sum();
    eprintln!(
        "cluster chaos: seed {seed}, {seconds} s, faults {faults:?}; {} entries, each ended once: \
         dispatched {dispatched}, rejected {}, dead {reasons:?}, inbound dead {}; slots moved: {}",
        pushed.len(),
        count("pacer:rejected"),
        count("pacer:in-dead"),
        moved.join(", "),
    );
    assert_few_poisoned_and_enough_faults(seed, &reasons, pushed.len(), &faults, seconds, 10);
}
