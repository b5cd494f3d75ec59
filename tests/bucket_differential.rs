//! The bucket maths: the Lua in Redis and the Rust in `pacing.rs` give the same answers
//! (differential, against a real redis-server), and the Rust keeps the rolling-window promise
//! (property tests against a brute-force count of every window).

use pacer::pacing::{self, BucketParams, Gate};
use pacer::report::max_in_window;
use pacer::scripts::BUCKET_LIB;
use pacer::testkit::RedisServer;
use proptest::prelude::*;
use std::num::NonZeroU32;

const PROBE: &str = include_str!("lua/bucket_probe.lua");
/// Redis time in µs around now: the magnitude the scripts really see.
const EPOCH_US: i64 = 1_790_000_000_000_000;

#[derive(Debug, Clone)]
enum Op {
    Plan { tat: i64, now: i64, cost: i64 },
    Gate { dtat: i64, t: i64, cost: i64 },
    Clock { now: i64, last: i64 },
}

fn rust(op: &Op, p: &BucketParams) -> (i64, i64) {
    match *op {
        Op::Plan { tat, now, cost } => {
            let planned = pacing::plan(tat, now, cost, p);
            (planned.slot_us, planned.tat_us)
        }
        Op::Gate { dtat, t, cost } => match pacing::gate(dtat, t, cost, p) {
            Gate::Pass { dtat_us } => (1, dtat_us),
            Gate::NotBefore { at_us } => (0, at_us),
        },
        Op::Clock { now, last } => pacing::dispatch_clock(now, last),
    }
}

fn args(op: &Op) -> [String; 4] {
    let s = |v: i64| v.to_string();
    match *op {
        Op::Plan { tat, now, cost } => ["plan".into(), s(tat), s(now), s(cost)],
        Op::Gate { dtat, t, cost } => ["gate".into(), s(dtat), s(t), s(cost)],
        Op::Clock { now, last } => ["clock".into(), s(now), s(last), "0".into()],
    }
}

fn time() -> impl Strategy<Value = i64> {
    // Zero (an empty bucket) or around now, with µs detail.
    prop_oneof![
        Just(0i64),
        (0i64..10_000_000_000).prop_map(|d| EPOCH_US + d)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (time(), time(), 1i64..1_000).prop_map(|(tat, now, cost)| Op::Plan { tat, now, cost }),
        (time(), time(), 1i64..1_000).prop_map(|(dtat, t, cost)| Op::Gate { dtat, t, cost }),
        (time(), time()).prop_map(|(now, last)| Op::Clock { now, last }),
    ]
}

fn params() -> impl Strategy<Value = BucketParams> {
    // Every rate pacer accepts (interval 1 µs to one per hour) and bursts up to 10 000.
    (1i64..3_600_000_000, 1u32..10_000).prop_map(|(interval_us, burst)| BucketParams {
        interval_us,
        tolerance_us: (i64::from(burst) - 1) * interval_us,
    })
}

#[test]
fn lua_and_rust_agree() {
    let redis = RedisServer::start();
    let con = std::cell::RefCell::new(redis.con());
    let script = redis::Script::new(&format!("{BUCKET_LIB}{PROBE}"));
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(300));
    runner
        .run(
            &(params(), proptest::collection::vec(op(), 1..40)),
            |(p, ops)| {
                let mut call = script.prepare_invoke();
                call.arg(p.interval_us).arg(p.tolerance_us);
                for op in &ops {
                    for a in args(op) {
                        call.arg(a);
                    }
                }
                let lua: Vec<i64> = call.invoke(&mut *con.borrow_mut()).expect("probe script");
                let expected: Vec<i64> = ops
                    .iter()
                    .flat_map(|op| {
                        let (a, b) = rust(op, &p);
                        [a, b]
                    })
                    .collect();
                prop_assert_eq!(lua, expected, "params {:?} ops {:?}", p, ops);
                Ok(())
            },
        )
        .unwrap();
}

/// Feeds dispatch attempts (µs, increasing) through the gate as the scripts do; returns the
/// accepted ready-entry milliseconds.
fn gated(attempts: &[(i64, i64)], p: &BucketParams) -> Vec<i64> {
    let (mut dtat, mut last) = (0, 0);
    let mut ids = Vec::new();
    for &(now, cost) in attempts {
        let (t, tq) = pacing::dispatch_clock(now, last);
        if let Gate::Pass { dtat_us } = pacing::gate(dtat, tq, cost, p) {
            dtat = dtat_us;
            last = t;
            ids.push(tq / 1000);
        }
    }
    ids
}

/// The promise: no rolling window of `w_ms` holds more than rate × W + burst entries.
fn check_windows(ids: &[i64], p: &BucketParams) -> Result<(), TestCaseError> {
    let burst = p.tolerance_us / p.interval_us + 1;
    for w_ms in [1, 2, 3, 5, 10, 17, 50, 100, 333, 1000, 2500, 10_000] {
        let limit = (w_ms * 1000) as f64 / p.interval_us as f64 + burst as f64;
        let seen = max_in_window(ids, w_ms) as f64;
        prop_assert!(
            seen <= limit,
            "{} entries in {} ms, limit {}",
            seen,
            w_ms,
            limit
        );
    }
    Ok(())
}

fn attempts() -> impl Strategy<Value = Vec<(i64, i64)>> {
    proptest::collection::vec((0i64..40_000, 1i64..4), 1..400).prop_map(|gaps| {
        let mut t = EPOCH_US;
        gaps.into_iter()
            .map(|(gap, cost)| {
                t += gap;
                (t, cost)
            })
            .collect()
    })
}

fn small_params() -> impl Strategy<Value = BucketParams> {
    (1u64..2_000, 1u32..8).prop_map(|(per_s, burst)| {
        BucketParams::new(
            format!("{per_s}/s").parse().unwrap(),
            NonZeroU32::new(burst).unwrap(),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Whatever times workers try to dispatch at (late, bunched, early), what the gate lets
    /// through keeps the rate in every window.
    #[test]
    fn the_gate_keeps_every_rolling_window(p in small_params(), a in attempts()) {
        check_windows(&gated(&a, &p), &p)?;
    }

    /// Slots planned back to back pass the gate when dispatched on time: the plan never asks
    /// for more than the gate allows.
    #[test]
    fn planned_slots_pass_the_gate(p in small_params(), arrivals in attempts()) {
        let mut tat = 0;
        let mut slots = Vec::new();
        for &(now, cost) in &arrivals {
            let planned = pacing::plan(tat, now, cost, &p);
            tat = planned.tat_us;
            // Sleeping events wake at the first millisecond their slot can be written in.
            slots.push((pacing::ceil_ms(planned.slot_us), cost));
        }
        slots.sort();
        prop_assert_eq!(gated(&slots, &p).len(), slots.len());
    }
}

/// Why the gate exists: slots planned 1/rate apart but dispatched with ordinary jitter break the
/// window promise; the same attempts through the gate keep it.
#[test]
fn planning_alone_breaks_the_rate_when_dispatch_is_late() {
    let p = BucketParams::new("10/s".parse().unwrap(), NonZeroU32::new(1).unwrap());
    let mut tat = 0;
    let mut late = Vec::new();
    for i in 0..50 {
        let planned = pacing::plan(tat, EPOCH_US, 1, &p);
        tat = planned.tat_us;
        // Every third slot goes out 60 ms late, bunching against the next one.
        let delay = if i % 3 == 0 { 60_000 } else { 0 };
        late.push((planned.slot_us + delay, 1));
    }
    late.sort();
    let ungated: Vec<i64> = late.iter().map(|(t, _)| t / 1000).collect();
    assert!(
        check_windows(&ungated, &p).is_err(),
        "late slots without a gate should bunch"
    );
    assert!(check_windows(&gated(&late, &p), &p).is_ok());
}
