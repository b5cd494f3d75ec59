//! Chaos: three workers (one with its wall clock 5 s ahead) on the outbound and the inbound flow
//! while events arrive, with faults drawn at random: `kill -9` of a worker (restarted at once),
//! SIGSTOP for 0.5–2 s then SIGCONT, and Redis killed and restarted on its AOF (repaired first,
//! as the README tells operators: `testkit::repair_aof`). Among the events: wide ones (5,000
//! fields), malformed ones, repeated ids and binary values. At the end every
//! input entry has ended in exactly one output once, no rolling window of a route's ready stream
//! holds more than its limit (by Redis's clock), and nothing is pending.
//!
//! The inbound state lies in one partition, or (drawn from the seed, or `PACER_CHAOS_PARTITIONS`)
//! in 4 partitions that each write their own forward and rejected streams. The workers hold
//! 10,000 sleeping events, or (drawn from the seed, or `PACER_CHAOS_MAX_INFLIGHT`) 150, fewer
//! than route a's backlog can hold (400): its events are then parked past its share of a
//! worker's places (`worker/share.rs`) and read again, through every fault. Their bytes are
//! weighed at the default budget, or (drawn from the seed, or `PACER_CHAOS_INFLIGHT_BYTES`) at
//! a byte a place, where an event weighs about a hundred places and reads whose weight is not
//! free park what they cannot weigh (`worker/budget.rs`), outbound and inbound.
//!
//! The suite runs 60 s. Longer, or replaying a run: `PACER_CHAOS_SECONDS=600
//! PACER_CHAOS_SEED=<seed printed by a run> cargo test --release --test chaos -- --nocapture`.

mod common;

use common::chaos::{
    assert_few_poisoned_and_enough_faults, env_u64, inflight_bytes, logs, reasons, seed,
    tick_events, worker_fault, RawEvent, Rng, Worker,
};
use common::*;
use pacer::keys::InboundKeys;
use pacer::testkit::{free_port, metric_at, wait_until, RedisServer, TempDir};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const OUTBOUND: [&str; 4] = [
    "pacer:{a}:ready",
    "pacer:{b}:ready",
    "pacer:rejected",
    "pacer:dead",
];

#[test]
fn chaos_every_entry_ends_once_and_the_rate_holds() {
    let seconds = env_u64("PACER_CHAOS_SECONDS").unwrap_or(60);
    let seed = seed("PACER_CHAOS_SEED");
    let partitions = env_u64("PACER_CHAOS_PARTITIONS").unwrap_or(if seed & 2 == 0 { 1 } else { 4 });
    let max_inflight =
        env_u64("PACER_CHAOS_MAX_INFLIGHT").unwrap_or(if seed & 4 == 0 { 10_000 } else { 150 });
    // A byte a place every other seed (`common::chaos::inflight_bytes`).
    let (weighed, inflight_bytes) =
        inflight_bytes("PACER_CHAOS_INFLIGHT_BYTES", seed & 8 != 0, max_inflight);
    eprintln!(
        "chaos: {seconds} s, seed {seed}, {partitions} inbound partition(s), max_inflight {max_inflight}, max_inflight_bytes {inflight_bytes}"
    );
    let mut rng = Rng(seed);

    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let dir = TempDir::new("chaos");
    let mut inbound =
        inbound_body("{name: per-source, key: [source], algorithm: gcra, limits: [50/s]}");
    if partitions > 1 {
        inbound += &format!(
            "  partitions: {partitions}\n  partition_by: source\n  partitioned_outputs: true\n"
        );
    }
    // The inbound outputs: every partition's forward stream, then every rejected one.
    let parts: Vec<InboundKeys> = (0..partitions as usize)
        .map(|k| {
            let n = partitions as usize;
            InboundKeys::partition("pacer:accepted", "pacer:in-rejected", k, n, true)
        })
        .collect();
    let forwards: Vec<String> = parts.iter().map(|k| k.forward.clone()).collect();
    let rejecteds: Vec<String> = parts.iter().map(|k| k.rejected.clone()).collect();
    let body = format!(
        "outbound:\n  streams: [\"in\"]\n  max_event_fields: 3000\n  routes:\n    a: {{rate: 200/s, burst: 5, max_wait: 2s, fallbacks: [b]}}\n    b: {{rate: 100/s, burst: 1, max_wait: 2s}}\n{inbound}"
    );
    let worker = format!(
        "  batch: 64\n  max_inflight: {max_inflight}{weighed}\n  drain: 1s\n  claim_idle: 3500ms"
    );
    let mut workers: Vec<Worker> = (0..3)
        .map(|i| {
            let port = free_port();
            let cfg = config(&dir, &format!("w{i}.yaml"), &redis, port, &worker, &body);
            let wrapper = if i == 2 {
                // Only the wall clock, as on a host whose clock is off. libfaketime's offset
                // monotonic clock puts every absolute timed wait (a futex's deadline) 5 s late,
                // which made this worker a stalled one in disguise: its sleepers were claimed
                // by the others, over and over, until dead-lettered as poison.
                pacer::testkit::wall_clock_offset("+5s")
            } else {
                Vec::new()
            };
            let pacer = start_wrapped(&wrapper, &[], &cfg, port);
            Worker {
                pacer: Some(pacer),
                cfg,
                port,
                wrapper,
                stopped_until: None,
            }
        })
        .collect();

    let (mut out_ids, mut in_ids) = (Vec::new(), Vec::new());
    let mut faults: BTreeMap<&str, u32> = BTreeMap::new();
    let start = Instant::now();
    let mut tick = 0u64;
    let mut next_fault = Instant::now() + Duration::from_secs(2);
    // The most entries a running worker was seen holding parked.
    let mut most_parked = 0.0_f64;
    while start.elapsed() < Duration::from_secs(seconds) {
        // Mostly for route a (b every fifth), the wide ones 5,000 fields wide.
        let route = |n: u64| if n % 5 == 4 { "b" } else { "a" }.to_string();
        let (out, inb) = tick_events(tick, &mut rng, 5_000, route);
        let out: Vec<RawEvent> = out.into_iter().map(|(_, e)| e).collect();
        out_ids.extend(push(&redis, "in", &out));
        in_ids.extend(push(&redis, "pacer:in", &inb));
        tick += 1;
        if tick.is_multiple_of(10) {
            for w in workers.iter().filter(|w| w.stopped_until.is_none()) {
                most_parked = most_parked.max(metric_at(w.port, "pacer_parked_events"));
            }
        }
        for w in &mut workers {
            w.cont(false);
        }
        if Instant::now() >= next_fault {
            // A worker killed (restarted at once, under its wrapper, skewed clock and all) or
            // stopped, or Redis restarted.
            let fault = rng.below(5);
            if !worker_fault(&mut workers, fault, &mut rng, &mut faults) {
                // No events are pushed while it is down: a producer would be failing too.
                redis.kill();
                std::thread::sleep(Duration::from_millis(500 + rng.below(2_000)));
                redis.restart();
                *faults.entry("Redis killed, restarted on AOF").or_default() += 1;
            }
            next_fault = Instant::now() + Duration::from_millis(1_500 + rng.below(3_000));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for w in &mut workers {
        w.cont(true);
    }

    let total = out_ids.len() + in_ids.len();
    let all: Vec<&str> = OUTBOUND
        .iter()
        .copied()
        .chain(forwards.iter().chain(&rejecteds).map(String::as_str))
        .collect();
    let ended = wait_until(Duration::from_secs(90), || {
        lengths(&redis, &all).iter().sum::<usize>() >= total
            && pending(&redis, "in", "pacer") == 0
            && pending(&redis, "pacer:in", "pacer") == 0
    });
    assert!(
        ended,
        "seed {seed}: not every entry ended ({} pending in, {} pending pacer:in)\n{}",
        pending(&redis, "in", "pacer"),
        pending(&redis, "pacer:in", "pacer"),
        logs(&workers)
    );
    // A doubled write would come after the last one expected: give it time to show.
    std::thread::sleep(Duration::from_secs(1));
    assert_each_once_by_stream(&redis, &[("in", &out_ids), ("pacer:in", &in_ids)], &all);
    assert_rate(&redis, "pacer:{a}:ready", 200.0, 5.0);
    assert_rate(&redis, "pacer:{b}:ready", 100.0, 1.0);

    let dead = read(&redis, "pacer:dead");
    let count = |s: &str| read(&redis, s).len();
    let count_all = |streams: &[String]| streams.iter().map(|s| count(s)).sum::<usize>();
    let reasons = reasons(&dead);
    eprintln!(
        "chaos: seed {seed}, {seconds} s, faults {faults:?}; {} outbound and {} inbound entries, \
         each ended once: a {}, b {}, rejected {}, accepted {}, inbound rejected {}, dead {reasons:?}; \
         most parked on a worker {most_parked}; AOFs cut short by a kill and repaired {}",
        out_ids.len(),
        in_ids.len(),
        count("pacer:{a}:ready"),
        count("pacer:{b}:ready"),
        count("pacer:rejected"),
        count_all(&forwards),
        count_all(&rejecteds),
        redis.aof_repairs(),
    );
    // With fewer places than route a's backlog can hold, it parked (the draw exercised that).
    if max_inflight < 400 {
        assert!(
            most_parked > 0.0,
            "nothing was parked with max_inflight {max_inflight}"
        );
    }
    assert_few_poisoned_and_enough_faults(seed, &reasons, out_ids.len(), &faults, seconds, 6);
}
