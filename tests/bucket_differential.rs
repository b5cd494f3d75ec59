//! The bucket maths: the Lua in Redis and the Rust in `pacing.rs` give the same answers
//! (differential, against a real redis-server), and the Rust keeps the rolling-window promise
//! (property tests against a brute-force count of every window).
//!
//! Over 400 lines: one subject, the bucket maths (Lua against Rust, Rust against a brute-force
//! count of every window), whose strategies and checks read together.

use pacer::pacing::{self, BucketParams, Gate, Judged, Judging};
use pacer::report::max_in_window;
use pacer::scripts::PACING_LIB;
use pacer::testkit::RedisServer;
use proptest::prelude::*;
use std::num::NonZeroU32;

const PROBE: &str = include_str!("lua/bucket_probe.lua");
/// Redis time in µs around now: the magnitude the scripts really see.
const EPOCH_US: i64 = 1_790_000_000_000_000;

#[derive(Debug, Clone)]
enum Op {
    Plan {
        tat: i64,
        now: i64,
        cost: i64,
    },
    Gate {
        dtat: i64,
        t: i64,
        cost: i64,
    },
    Clock {
        now: i64,
        last: i64,
    },
    Fits {
        cost: i64,
    },
    Judge {
        dtat: i64,
        tat: i64,
        now: i64,
        slot: i64,
        deadline: i64,
        cost: i64,
    },
}

fn rust(op: &Op, p: &BucketParams) -> Vec<i64> {
    match *op {
        Op::Plan { tat, now, cost } => {
            let planned = pacing::plan(tat, now, cost, p);
            vec![planned.slot_us, planned.tat_us]
        }
        Op::Gate { dtat, t, cost } => match pacing::gate(dtat, t, cost, p) {
            Gate::Pass { dtat_us } => vec![1, dtat_us],
            Gate::NotBefore { at_us } => vec![0, at_us],
        },
        Op::Clock { now, last } => {
            let (t, tq) = pacing::dispatch_clock(now, last);
            vec![t, tq]
        }
        Op::Fits { cost } => vec![i64::from(pacing::fits(cost, p)), 0],
        Op::Judge {
            dtat,
            tat,
            now,
            slot,
            deadline,
            cost,
        } => {
            let clock = pacing::dispatch_clock(now, 0);
            let at = Judging {
                dtat_us: dtat,
                tat_us: tat,
            };
            let (verdict, next) = pacing::judge(at, clock, slot, deadline, cost, p);
            let (code, at) = match verdict {
                Judged::Pass { slot_us } => (1, slot_us),
                Judged::Wait { at_us } => (2, at_us),
                Judged::Replan { at_us } => (3, at_us),
                Judged::TooLate { at_us } => (4, at_us),
            };
            vec![code, at, next.dtat_us, next.tat_us]
        }
    }
}

/// The probe's arguments for one operation: six values each ('judge' is preceded by a 'tat'
/// operation that sets the plan it starts from).
fn args(op: &Op) -> Vec<String> {
    let s = |v: i64| v.to_string();
    let z = || "0".to_string();
    match *op {
        Op::Plan { tat, now, cost } => vec!["plan".into(), s(tat), s(now), s(cost), z(), z()],
        Op::Gate { dtat, t, cost } => vec!["gate".into(), s(dtat), s(t), s(cost), z(), z()],
        Op::Clock { now, last } => vec!["clock".into(), s(now), s(last), z(), z(), z()],
        Op::Fits { cost } => vec!["fits".into(), s(cost), z(), z(), z(), z()],
        Op::Judge {
            dtat,
            tat,
            now,
            slot,
            deadline,
            cost,
        } => vec![
            "tat".into(),
            s(tat),
            z(),
            z(),
            z(),
            z(),
            "judge".into(),
            s(dtat),
            s(now),
            s(slot),
            s(deadline),
            s(cost),
        ],
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
        (0i64..1_000).prop_map(|cost| Op::Fits { cost }),
        (time(), time(), time(), time(), time(), 1i64..1_000).prop_map(
            |(dtat, tat, now, slot, deadline, cost)| Op::Judge {
                dtat,
                tat,
                now,
                slot,
                deadline,
                cost
            }
        ),
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
    let script = redis::Script::new(&format!("{PACING_LIB}{PROBE}"));
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
                let expected: Vec<i64> = ops.iter().flat_map(|op| rust(op, &p)).collect();
                prop_assert_eq!(lua, expected, "params {:?} ops {:?}", p, ops);
                Ok(())
            },
        )
        .unwrap();
}

/// Feeds dispatch attempts (µs, increasing; with their cost) through the gate as the scripts do;
/// returns each accepted ready entry's millisecond and cost. Costs that can never fit are
/// refused before any script, as the worker does.
fn gated(attempts: &[(i64, i64)], p: &BucketParams) -> Vec<(i64, i64)> {
    let (mut dtat, mut last) = (0, 0);
    let mut ids = Vec::new();
    for &(now, cost) in attempts {
        if !pacing::fits(cost, p) {
            continue;
        }
        let (t, tq) = pacing::dispatch_clock(now, last);
        if let Gate::Pass { dtat_us } = pacing::gate(dtat, tq, cost, p) {
            dtat = dtat_us;
            last = t;
            ids.push((tq / 1000, cost));
        }
    }
    ids
}

/// The most cost units whose entries' ms (sorted) fall within any window `[a, a + w_ms)`.
fn max_units_in_window(ids: &[(i64, i64)], w_ms: i64) -> i64 {
    let (mut best, mut sum, mut start) = (0, 0, 0);
    for end in 0..ids.len() {
        sum += ids[end].1;
        while ids[end].0 - ids[start].0 >= w_ms {
            sum -= ids[start].1;
            start += 1;
        }
        best = best.max(sum);
    }
    best
}

/// The promise, in cost units: no rolling window of `w_ms` holds more than rate × W + burst.
fn check_windows(ids: &[(i64, i64)], p: &BucketParams) -> Result<(), TestCaseError> {
    let burst = p.tolerance_us / p.interval_us + 1;
    let times: Vec<i64> = ids.iter().map(|(ms, _)| *ms).collect();
    for w_ms in [1, 2, 3, 5, 10, 17, 50, 100, 333, 1000, 2500, 10_000] {
        let limit = (w_ms * 1000) as f64 / p.interval_us as f64 + burst as f64;
        let units = max_units_in_window(ids, w_ms) as f64;
        prop_assert!(
            units <= limit,
            "{} units in {} ms, limit {}",
            units,
            w_ms,
            limit
        );
        // Every entry costs at least one unit, so entries alone are bounded too.
        prop_assert!(max_in_window(&times, w_ms) as f64 <= limit);
    }
    Ok(())
}

fn attempts() -> impl Strategy<Value = Vec<(i64, i64)>> {
    proptest::collection::vec((0i64..40_000, 1i64..9), 1..400).prop_map(|gaps| {
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
        for &(now, cost) in arrivals.iter().filter(|(_, c)| pacing::fits(*c, &p)) {
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
    let ungated: Vec<(i64, i64)> = late.iter().map(|(t, c)| (t / 1000, *c)).collect();
    assert!(
        check_windows(&ungated, &p).is_err(),
        "late slots without a gate should bunch"
    );
    assert!(check_windows(&gated(&late, &p), &p).is_ok());
}

/// One event in the dispatch simulation: its recorded slot and deadline, its cost, when the
/// dispatcher wakes it next, and how it ended (the ready entry's ms, or None if it left the
/// route too late).
#[derive(Debug, Clone)]
struct Sim {
    slot: i64,
    deadline: i64,
    cost: i64,
    wake: i64,
    done: Option<Option<i64>>,
}

/// Plans `arrivals` (each with a max_wait of `wait_us`), then dispatches them the way the
/// dispatcher and `dispatch.lua` do: wake at a target (late by a drawn jitter), judge the due
/// events in slot order in one call, and act on each verdict. Returns the events and how late
/// the calls were in all (µs).
fn dispatch_all(
    arrivals: &[(i64, i64)],
    jitter: &[i64],
    wait_us: i64,
    p: &BucketParams,
) -> (Vec<Sim>, i64) {
    let mut tat = 0;
    let mut events: Vec<Sim> = Vec::new();
    for &(now, cost) in arrivals.iter().filter(|(_, c)| pacing::fits(*c, p)) {
        let planned = pacing::plan(tat, now, cost, p);
        // Slots are whole milliseconds (the first an entry can be written in), and the wait is
        // judged on that, as `schedule.lua` does.
        let slot = pacing::ceil_ms(planned.slot_us);
        if slot - now > wait_us {
            continue;
        }
        tat = planned.tat_us;
        events.push(Sim {
            slot,
            deadline: now + wait_us + pacing::LATE_US,
            cost,
            wake: slot,
            done: None,
        });
    }
    let (mut dtat, mut last) = (0, 0);
    let mut late = 0;
    for call in 0..100_000 {
        let Some(wake) = events
            .iter()
            .filter(|e| e.done.is_none())
            .map(|e| e.wake)
            .min()
        else {
            break;
        };
        let now = wake + jitter[call % jitter.len()];
        late += now - wake;
        let mut due: Vec<usize> = (0..events.len())
            .filter(|&i| events[i].done.is_none() && events[i].wake <= now)
            .collect();
        due.sort_by_key(|&i| events[i].slot);
        let (t, tq) = pacing::dispatch_clock(now, last);
        let mut judging = Judging {
            dtat_us: dtat,
            tat_us: tat,
        };
        for i in due {
            let e = &mut events[i];
            let (verdict, next) = pacing::judge(judging, (t, tq), e.slot, e.deadline, e.cost, p);
            judging = next;
            tat = next.tat_us;
            match verdict {
                Judged::Pass { slot_us } => {
                    dtat = next.dtat_us;
                    last = t;
                    e.slot = slot_us;
                    e.done = Some(Some(tq / 1000));
                }
                Judged::Wait { at_us } => e.wake = at_us,
                Judged::Replan { at_us } => {
                    e.slot = at_us;
                    e.wake = at_us;
                }
                Judged::TooLate { .. } => e.done = Some(None),
            }
        }
    }
    (events, late)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Dispatching planned events with late wake-ups (some far past their slots, as a stalled
    /// worker's), as the dispatcher and the dispatch script do: every event ends, what goes out
    /// keeps every rolling window in cost units, nothing goes out more than LATE_US (and its id's
    /// rounding) after its recorded slot, and no recorded slot is past its deadline.
    #[test]
    fn judged_dispatch_keeps_the_rate_the_slots_and_the_deadlines(
        p in small_params(),
        a in attempts(),
        jitter in proptest::collection::vec(prop_oneof![4 => 0i64..1_500, 1 => 0i64..300_000], 1..20),
        wait_ms in 1i64..5_000,
    ) {
        let (events, _) = dispatch_all(&a, &jitter, wait_ms * 1000, &p);
        prop_assert!(events.iter().all(|e| e.done.is_some()), "an event never ended");
        let mut ids: Vec<(i64, i64)> = events
            .iter()
            .filter_map(|e| Some((e.done??, e.cost)))
            .collect();
        ids.sort();
        check_windows(&ids, &p)?;
        for e in &events {
            if let Some(Some(ms)) = e.done {
                prop_assert!(e.slot <= e.deadline, "slot {} past deadline {}", e.slot, e.deadline);
                prop_assert!(ms * 1000 - e.slot <= pacing::LATE_US,
                    "sent at {} ms for slot {}", ms, e.slot);
            }
        }
    }
}

/// A route with a backlog whose dispatches go a few milliseconds late now and then (a loaded
/// worker: one call in four 3 ms late) loses no more than that lateness, not an interval per
/// late dispatch: the event the gate then holds back moves by the delay, not to the plan's end,
/// which left its own slot empty (on a 10/s route, 100 ms for each late call: 300 routes of
/// 10/s with backlogs, on a worker late for one dispatch in eight, passed 86–92% of their rate).
/// An event of one unit on a route of 1000/s moves to the plan's end as before: no delay past
/// LATE_US is below its interval.
#[test]
fn a_late_dispatch_costs_a_busy_route_its_delay_not_an_interval() {
    for (rate, n) in [("10/s", 200), ("100/s", 1000), ("1000/s", 4000)] {
        let p = BucketParams::new(rate.parse().unwrap(), NonZeroU32::new(1).unwrap());
        let arrivals = vec![(EPOCH_US, 1); n];
        let (events, late_us) = dispatch_all(&arrivals, &[0, 0, 0, 3_000], 3_600_000_000, &p);
        let ms: Vec<i64> = events
            .iter()
            .map(|e| e.done.flatten().expect("sent"))
            .collect();
        let span_us = (ms.iter().max().unwrap() - ms.iter().min().unwrap()) * 1000;
        let ideal_us = (n as i64 - 1) * p.interval_us;
        assert!(
            span_us <= ideal_us + late_us,
            "{rate}: {n} events took {span_us} µs, {ideal_us} µs at the rate, the calls {late_us} µs late in all"
        );
    }
}
