//! Redis's clock stepping (issue 14, point 7): 2 s back, then 2 s forward twice, while two
//! workers pace a route fed below its rate. Redis runs with its wall clock under a preloaded
//! shim the test steps (`pacer::testkit::ClockShift`; libfaketime cannot start Debian's
//! redis-server 7.0). The rate holds on the ready entries' ids (Redis's clock), no entry is
//! dispatched more than 2 s after its slot, no worker spins, and each entry ends once.

mod common;

use common::pressure::{feed, one_route, READY};
use common::*;
use pacer::testkit::{free_port, rss_and_cpu, wait_until, ClockShift, RedisServer, TempDir};
use std::time::{Duration, Instant};

/// CPU time (user + system) of process `pid` so far, seconds.
fn cpu_seconds(pid: u32) -> f64 {
    rss_and_cpu(pid).1
}

#[test]
fn redis_clock_steps_keep_the_rate_without_spinning_or_late_dispatches() {
    let shift = ClockShift::build();
    let redis = RedisServer::start_shifted(&shift);
    let dir = TempDir::new("clock-step");
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let port = free_port();
            let cfg = one_route(&redis, &dir, port, 200, "1s");
            start(&cfg, port)
        })
        .collect();
    let cpu_before: Vec<f64> = workers.iter().map(|w| cpu_seconds(w.pid())).collect();
    let seconds = 12.0;
    let started = Instant::now();
    let feeder = feed(redis.url(), 150, seconds);
    // Steps at 3 s (back 2 s), 6 s (forward 2 s, back to true time) and 9 s (forward 2 s more).
    for (at, to_ms) in [(3.0, -2000), (6.0, 0), (9.0, 2000)] {
        let wait = Duration::from_secs_f64(at).saturating_sub(started.elapsed());
        std::thread::sleep(wait);
        shift.set_ms(to_ms);
    }
    let ids = feeder.join().unwrap();
    let ran = started.elapsed().as_secs_f64();
    let cpu: Vec<f64> = workers
        .iter()
        .zip(&cpu_before)
        .map(|(w, before)| cpu_seconds(w.pid()) - before)
        .collect();
    let outputs = [READY, "pacer:rejected", "pacer:dead"];
    let ended = wait_until(Duration::from_secs(20), || {
        placements(&redis, &outputs).len() >= ids.len()
    });
    assert!(ended, "not every entry ended:\n{}", workers[0].log_text());
    assert_each_once(&redis, &ids, &outputs, "in");

    // The rate, exactly, on Redis's clock as the ready ids carry it.
    assert_rate(&redis, READY, 200.0, 1.0);
    // No dispatch more than 2 s after its slot (a step back holds dispatches until Redis's clock
    // is past the last one written: up to the 2 s of the step).
    let ready = read(&redis, READY);
    let late: Vec<i64> = ready
        .iter()
        .map(|e| e.ms - e.field("pacer_slot_us").unwrap().parse::<i64>().unwrap() / 1000)
        .collect();
    let worst = late.iter().copied().max().unwrap_or(0);
    assert!(worst <= 2000, "an entry went {worst} ms after its slot");
    // No busy loop: a worker spinning on a clock it cannot reconcile burns a core.
    for (i, c) in cpu.iter().enumerate() {
        assert!(
            *c < ran * 0.5,
            "worker {i} used {c:.2} s of CPU in {ran:.1} s:\n{}",
            workers[i].log_text()
        );
    }
    // While Redis's clock replays the 2 s it stepped back, dispatches wait for it; events that
    // would wait past max_wait meanwhile are rejected (queue_full), as on a full route.
    let rejected = read(&redis, "pacer:rejected");
    let mut reasons = std::collections::BTreeMap::new();
    for r in &rejected {
        *reasons
            .entry(r.field("pacer_reason").unwrap_or("?").to_string())
            .or_insert(0) += 1;
    }
    println!(
        "clock steps -2 s, +2 s, +2 s over {ran:.1} s: {} entries, {} dispatched, rejected {reasons:?}; latest dispatch {worst} ms after its slot; worker CPU {:.2} s and {:.2} s",
        ids.len(),
        ready.len(),
        cpu[0],
        cpu[1]
    );
}

/// An inbound fixed window across Redis's clock stepped back 120 s: the window on record is
/// newer than the clock's and still counts, so the limit holds. It was read as empty, and
/// admitted a whole limit again (found by review: 6 accepted against 3/min).
#[test]
fn a_fixed_window_holds_its_limit_when_redis_s_clock_steps_back() {
    let shift = ClockShift::build();
    let redis = RedisServer::start_shifted(&shift);
    let dir = TempDir::new("clock-step-in");
    let port = free_port();
    let body = inbound_body("{name: fw, key: [source], algorithm: fixed_window, limits: [3/min]}");
    let worker = "  batch: 16\n  drain: 500ms";
    let cfg = config(&dir, "w.yaml", &redis, port, worker, &body);
    let pacer = start(&cfg, port);
    let events = |tag: &str| -> Vec<_> {
        (0..5)
            .map(|i| event(&[("source", "s"), ("call", &format!("{tag}-{i}"))]))
            .collect()
    };
    let settled = |n: usize| {
        wait_until(Duration::from_secs(10), || {
            lengths(&redis, &["pacer:accepted", "pacer:in-rejected"])
                .iter()
                .sum::<usize>()
                == n
                && pending(&redis, "pacer:in", "pacer") == 0
        })
    };
    push(&redis, "pacer:in", &events("before"));
    assert!(settled(5), "{}", pacer.log_text());
    assert_eq!(lengths(&redis, &["pacer:accepted"]), [3]);
    let before_ms = redis_time_ms(&redis);
    shift.set_ms(-120_000);
    // The shim reads the shift at most every 5 ms: the step is on once TIME shows it.
    assert!(wait_until(Duration::from_secs(2), || redis_time_ms(&redis)
        < before_ms - 100_000));
    push(&redis, "pacer:in", &events("after"));
    assert!(settled(10), "{}", pacer.log_text());
    assert_eq!(
        lengths(&redis, &["pacer:accepted"]),
        [3],
        "3/min across a step back"
    );
    let retry: i64 = read(&redis, "pacer:in-rejected")
        .last()
        .and_then(|r| r.field("pacer_retry_after_ms")?.parse().ok())
        .unwrap();
    assert!(
        retry > 60_000,
        "the window on record ends past the step: {retry} ms"
    );
}
