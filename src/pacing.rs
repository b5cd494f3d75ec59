//! The leaky bucket that paces a route, as pure functions of (state, now, parameters).
//!
//! A route's bucket is GCRA (the "virtual scheduling" form of a leaky bucket) kept twice:
//!
//! - **plan** (`tat`): when a worker asks for a slot, the event gets
//!   `slot = max(now, tat - tolerance)` and the plan moves on by `cost × interval`. This is what
//!   tells a worker how long an event must wait, and so whether to reroute it.
//! - **gate** (`dtat`): at the moment of dispatch the same rule runs again on the *actual*
//!   dispatch time. Planning alone is not enough: a worker that wakes late dispatches its slot
//!   against the next one, and two slots planned `interval` apart leave Redis 0 ms apart. The gate
//!   refuses a dispatch that would break the rate and names the earliest moment it would pass.
//!
//! Every time is in microseconds of Redis's clock. A dispatched sequence that passes the gate
//! holds, in any rolling window `W`, at most `W / interval + burst` entries: after an accepted
//! dispatch at `t`, the next `n` accepted ones are at or after `t + n × interval − tolerance`.
//!
//! `lua/gcra.lua` is the same maths in Lua; `tests/bucket_differential.rs` holds the two to
//! the same answers and checks this file against a brute-force rolling-window count.

use crate::rate::Rate;
use std::num::NonZeroU32;

/// The fixed parameters of one route's bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketParams {
    /// Microseconds one unit of cost occupies (1 / rate, rounded up).
    pub interval_us: i64,
    /// How far ahead of the plan an event may go: `(burst − 1) × interval`, so that `burst`
    /// events pass back to back on an idle route.
    pub tolerance_us: i64,
}

impl BucketParams {
    pub fn new(rate: Rate, burst: NonZeroU32) -> Self {
        let interval_us = rate.interval_us() as i64;
        BucketParams {
            interval_us,
            tolerance_us: (i64::from(burst.get()) - 1) * interval_us,
        }
    }

    /// Events a rolling window of `window_us` may hold: `window / interval + burst`.
    pub fn window_limit(&self, window_us: i64) -> i64 {
        window_us / self.interval_us + self.tolerance_us / self.interval_us + 1
    }
}

/// The slot planned for one event and the plan's next state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub slot_us: i64,
    pub tat_us: i64,
}

/// Plans an event of `cost` units arriving at `now` against a plan at `tat`.
///
/// The event needs room for all its units at once (GCRA with a weight): it goes when the bucket
/// holds `cost` units, and pushes the following ones back by `cost × interval`. So an event of
/// cost `c ≤ burst` on an idle route goes at once and the next unit one `interval` later, and no
/// window ever holds more than `rate × W + burst` units. An event costing more than the burst can
/// never fit; callers refuse it first ([`fits`]).
pub fn plan(tat_us: i64, now_us: i64, cost: i64, p: &BucketParams) -> Planned {
    Planned {
        slot_us: now_us.max(tat_us - p.tolerance_us + (cost - 1) * p.interval_us),
        tat_us: tat_us.max(now_us) + cost * p.interval_us,
    }
}

/// Whether an event of `cost` units can ever pass a bucket with these parameters: its cost is at
/// most the burst.
pub fn fits(cost: i64, p: &BucketParams) -> bool {
    cost >= 1 && (cost - 1) * p.interval_us <= p.tolerance_us
}

/// The time a dispatch happens at (never before the route's last one) and the time the gate
/// judges it by: the millisecond of the ready entry's id, in µs. The rate is promised on entry
/// ids, so judging by them is exact for that promise, and a dispatch a fraction of a millisecond
/// late does not hold back the next one.
pub fn dispatch_clock(now_us: i64, last_us: i64) -> (i64, i64) {
    let t = now_us.max(last_us);
    (t, t.div_euclid(1000) * 1000)
}

/// What the gate says about a dispatch at `t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Dispatch now; the gate's next state.
    Pass { dtat_us: i64 },
    /// Dispatching now would break the rate; try again at this time.
    NotBefore { at_us: i64 },
}

/// The first whole millisecond (in µs) at or after `x`: the earliest a slot can be written in.
pub fn ceil_ms(x_us: i64) -> i64 {
    -(-x_us).div_euclid(1000) * 1000
}

/// Checks a dispatch of `cost` units judged at `tq` (a whole millisecond, see
/// [`dispatch_clock`]) against the gate at `dtat`: it passes when the gate has room for all its
/// units (see [`plan`]).
///
/// The dispatch is charged at `tq − 1000 µs` (but not below the gate): the start of the
/// millisecond before the entry's own. Why that keeps the bound: the gate passes an entry at
/// `tq` once `tq ≥ dtat − tolerance`, and every pass moves `dtat` to at least its charge plus its
/// cost in intervals; so the units of entries `i..=j` in dispatch order satisfy
/// `(S − 1) × interval ≤ tq_j − (tq_i − 1000) + tolerance`. Entries whose ids fall in one window
/// of `W` whole milliseconds have `tq_j − tq_i ≤ W − 1000`, hence `S ≤ W / interval + burst`,
/// and `interval ≥ 1 / rate` (rounded up). Charging earlier than `tq − 1000` could let one more
/// in; charging later (it was `tq − 999`) holds one µs more than needed, and that µs cost a
/// whole millisecond: an entry written in the millisecond after its slot pushed the next one on
/// its route past its own slot's millisecond, and the one after that, for as long as the route
/// stayed busy (a late dispatch call made five events late, not one). Charging at `tq` itself
/// would be just as safe but would make a slot that falls inside a millisecond drift the next
/// one by up to a millisecond.
pub fn gate(dtat_us: i64, tq_us: i64, cost: i64, p: &BucketParams) -> Gate {
    // Room for all `cost` units: the same weighted rule as `plan`.
    let earliest = dtat_us - p.tolerance_us + (cost - 1) * p.interval_us;
    if tq_us < earliest {
        Gate::NotBefore {
            at_us: ceil_ms(earliest),
        }
    } else {
        Gate::Pass {
            dtat_us: dtat_us.max(tq_us - 1000) + cost * p.interval_us,
        }
    }
}

/// How late the gate may make an event before its slot is moved rather than kept: up to this,
/// the event sleeps until the gate lets it through and its slot stands; past it, the slot can no
/// longer be met and is re-planned (recorded anew), so that an event never goes out later than
/// its recorded slot by more than this plus the wake-up's own precision.
pub const LATE_US: i64 = 1_000;

/// What the gate says about one event whose slot has come, at dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judged {
    /// Dispatch now, with this slot: its own, or (woken more than [`LATE_US`] after it, a slot
    /// that could no longer be met) the time it goes, recorded as its new slot.
    Pass { slot_us: i64 },
    /// Not yet; sleep until `at_us`, the slot stands (woken early, or the gate's delay is within
    /// [`LATE_US`]).
    Wait { at_us: i64 },
    /// The slot can no longer be met: the event moves to `at_us`, still within its deadline.
    Replan { at_us: i64 },
    /// Not even the next time the gate allows is within the event's deadline: it leaves the
    /// route.
    TooLate { at_us: i64 },
}

/// What judging one event leaves for the rest of its call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Judging {
    /// The gate as the call's next event finds it.
    pub dtat_us: i64,
    /// The plan as the call's next event (and the route, once the call ends) finds it.
    pub tat_us: i64,
}

/// An event leaving the route gives its reservation at `slot_us` back if it is still the plan's
/// last (any later one would have pushed the plan at least an interval further); otherwise it
/// stays a gap.
fn give_back(at: Judging, slot_us: i64, cost: i64, p: &BucketParams) -> Judging {
    if at.tat_us - slot_us <= p.tolerance_us + cost * p.interval_us {
        Judging {
            tat_us: at.tat_us - cost * p.interval_us,
            ..at
        }
    } else {
        at
    }
}

/// Judges one due event of a dispatch call: slot `slot_us`, latest allowed time `deadline_us`,
/// the call's dispatch clock `(t, tq)` (see [`dispatch_clock`]) and the gate and plan `at` as
/// left by the events before it in the call. An event goes no later than [`LATE_US`] after its
/// recorded slot: one that cannot is moved (within its deadline) or leaves the route.
///
/// A moved event takes a new slot *from the plan*, at its end (or when the gate next allows, if
/// the plan is idle), never a slot another event holds: on a saturated route, moving it to the
/// gate's next millisecond would book that millisecond twice, the event holding it would be
/// moved in turn, and the moves would cascade (measured: six moves per event and a backlog that
/// stopped draining). Its own millisecond goes to the events behind it. Unless the gate holds
/// it back by less than its own interval: then the plan's end would cost the route more than
/// the delay, and it moves to when the gate allows (below).
///
/// Returns the verdict and what the next event finds: the gate really charged for a pass, and
/// for an event told to come back within its slot, charged as if it went at that time, so that
/// the events refused in one call queue one behind the other instead of all coming back at once.
pub fn judge(
    at: Judging,
    (t_us, tq_us): (i64, i64),
    slot_us: i64,
    deadline_us: i64,
    cost: i64,
    p: &BucketParams,
) -> (Judged, Judging) {
    if t_us < slot_us {
        // Woken early: nothing is owed to the gate yet.
        return (Judged::Wait { at_us: slot_us }, at);
    }
    // Woken too late for its slot (a stalled worker): it can only go as a new slot, now or when
    // the gate allows, and only within its deadline.
    let missed = t_us > slot_us + LATE_US;
    if missed && t_us > deadline_us {
        // When a retry could go: the plan's next slot, and never now. `t` itself offered a
        // wait of 0, and a queue_full rejection said retry_after 0 ms (found hunting flaky
        // tests: any worker waking over 1 ms late at the end of max_wait).
        let next = plan(at.tat_us, t_us, cost, p).slot_us.max(t_us + 1);
        return (
            Judged::TooLate {
                at_us: ceil_ms(next),
            },
            give_back(at, slot_us, cost, p),
        );
    }
    let g = match gate(at.dtat_us, tq_us, cost, p) {
        Gate::Pass { dtat_us } => {
            let slot_us = if missed { t_us } else { slot_us };
            return (Judged::Pass { slot_us }, Judging { dtat_us, ..at });
        }
        Gate::NotBefore { at_us } => at_us,
    };
    if !missed && g <= slot_us + LATE_US {
        let dtat_us = match gate(at.dtat_us, g, cost, p) {
            Gate::Pass { dtat_us } => dtat_us,
            Gate::NotBefore { .. } => unreachable!("the gate passes at the time it named"),
        };
        return (Judged::Wait { at_us: g }, Judging { dtat_us, ..at });
    }
    // Held back by less than a move to the plan's end would cost the route (the interval its
    // units take, left empty at its old slot): it moves to when the gate allows instead, and
    // the events behind it each move as little, one at a time, until the plan's slack takes
    // the delay up. On a 10/s route, every dispatch over a millisecond late cost 100 ms: 300
    // routes of 10/s with backlogs, on a loaded worker whose dispatches were that late for
    // one in eight, passed 86–92% of their rate. Events of one unit on routes of 1000/s or
    // more never come here (no delay past LATE_US is below their interval), where moves to
    // the next millisecond cascaded (see above).
    if g - slot_us < cost * p.interval_us && g <= deadline_us {
        let dtat_us = match gate(at.dtat_us, g, cost, p) {
            Gate::Pass { dtat_us } => dtat_us,
            Gate::NotBefore { .. } => unreachable!("the gate passes at the time it named"),
        };
        let tat_us = at.tat_us.max(g + cost * p.interval_us);
        return (Judged::Replan { at_us: g }, Judging { dtat_us, tat_us });
    }
    let planned = plan(at.tat_us, g, cost, p);
    let new_slot = ceil_ms(planned.slot_us);
    if new_slot > deadline_us {
        return (
            Judged::TooLate { at_us: new_slot },
            give_back(at, slot_us, cost, p),
        );
    }
    let moved = Judging {
        tat_us: planned.tat_us,
        ..at
    };
    (Judged::Replan { at_us: new_slot }, moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(rate: &str, burst: u32) -> BucketParams {
        BucketParams::new(rate.parse().unwrap(), NonZeroU32::new(burst).unwrap())
    }

    #[test]
    fn an_idle_route_takes_a_burst_then_paces() {
        let p = params("10/s", 3);
        let mut tat = 0;
        let slots: Vec<i64> = (0..5)
            .map(|_| {
                let planned = plan(tat, 1_000_000, 1, &p);
                tat = planned.tat_us;
                planned.slot_us
            })
            .collect();
        assert_eq!(
            slots,
            vec![1_000_000, 1_000_000, 1_000_000, 1_100_000, 1_200_000]
        );
    }

    #[test]
    fn cost_needs_room_for_every_unit_and_pushes_the_following_events_back() {
        let p = params("10/s", 3);
        // An idle route has room for 3 units: a cost-3 event goes at once...
        let first = plan(0, 1_000_000, 3, &p);
        assert_eq!(first.slot_us, 1_000_000);
        // ...and the next unit one interval later, as three unit events would have left it.
        assert_eq!(plan(first.tat_us, 1_000_000, 1, &p).slot_us, 1_100_000);
        // After one unit, a cost-3 event waits until three units are free again.
        let one = plan(0, 1_000_000, 1, &p);
        assert_eq!(plan(one.tat_us, 1_000_000, 3, &p).slot_us, 1_100_000);
        assert!(fits(3, &p));
        assert!(!fits(4, &p));
        assert!(!fits(0, &p));
    }

    #[test]
    fn the_gate_refuses_a_late_slot_bunched_against_the_next() {
        let p = params("10/s", 1);
        // Slots 0 and 100 ms were planned; the first went out 60 ms late.
        let Gate::Pass { dtat_us } = gate(0, 60_000, 1, &p) else {
            panic!("the first dispatch must pass");
        };
        // It is charged at the start of the millisecond before its own (59 ms), so the next
        // may go an interval on: ids 60 and 159, two in any 100 ms window, as 10/s with burst 1
        // allows (rate x W + burst).
        assert_eq!(
            gate(dtat_us, 100_000, 1, &p),
            Gate::NotBefore { at_us: 159_000 }
        );
        assert!(matches!(gate(dtat_us, 159_000, 1, &p), Gate::Pass { .. }));
    }

    #[test]
    fn a_slot_inside_a_millisecond_passes_in_the_next_without_drift() {
        let p = params("6/s", 1); // 166 667 µs
        let mut dtat = 0;
        let mut ids = Vec::new();
        let mut t = 0;
        for _ in 0..20 {
            if ids.len() == 7 {
                break;
            }
            let at = match gate(dtat, t, 1, &p) {
                Gate::Pass { dtat_us } => {
                    ids.push(t / 1000);
                    dtat = dtat_us;
                    continue;
                }
                Gate::NotBefore { at_us } => at_us,
            };
            t = at;
        }
        // 6 × 166 667 µs = 1 000 002 µs: the interval is rounded up, never down.
        assert_eq!(ids, vec![0, 167, 334, 501, 667, 834, 1001]);
        assert_eq!(ceil_ms(166_667), 167_000);
        assert_eq!(ceil_ms(167_000), 167_000);
    }

    fn gate_at(dtat_us: i64) -> Judging {
        Judging { dtat_us, tat_us: 0 }
    }

    #[test]
    fn events_refused_in_one_call_wait_behind_each_other_or_move_to_the_plans_end() {
        let p = params("1000/s", 1);
        // Two events whose slots are 5 ms (a burst-1 route's slots share a millisecond after a
        // move), the call at 5.2 ms, the gate at 5 ms: the first goes, the second comes back at
        // 6 ms with its slot kept (6 ms is within LATE_US of it).
        let clock = dispatch_clock(5_200, 0);
        let far = 1_000_000_000;
        let plan_end = Judging {
            dtat_us: 5_000,
            tat_us: 9_000,
        };
        let (a, at) = judge(plan_end, clock, 5_000, far, 1, &p);
        assert_eq!(a, Judged::Pass { slot_us: 5_000 });
        let (b, at) = judge(at, clock, 5_000, far, 1, &p);
        assert_eq!(b, Judged::Wait { at_us: 6_000 });
        // Charged as if it went in millisecond 6: the gate (6 000) plus one interval.
        assert_eq!(at.dtat_us, 7_000);
        // A third, whose slot (4 ms) the gate can no longer meet within LATE_US, is not put on
        // 7 ms, which the plan gave another event: it takes the plan's next slot, at its end.
        let (c, at) = judge(at, clock, 4_000, far, 1, &p);
        assert_eq!(c, Judged::Replan { at_us: 9_000 });
        assert_eq!(at.tat_us, 10_000);
        assert_eq!(at.dtat_us, 7_000, "a moved event does not hold the gate");
        // On an idle plan it takes the gate's next millisecond.
        let (d, _) = judge(gate_at(8_000), dispatch_clock(7_500, 0), 5_000, far, 1, &p);
        assert_eq!(d, Judged::Replan { at_us: 8_000 });
    }

    #[test]
    fn a_slot_past_its_deadline_leaves_the_route_and_an_early_wake_owes_nothing() {
        let p = params("10/s", 1);
        let clock = dispatch_clock(1_000_000, 0);
        let (v, at) = judge(gate_at(1_300_000), clock, 999_500, 1_200_000, 1, &p);
        assert_eq!(v, Judged::TooLate { at_us: 1_300_000 });
        assert_eq!(at.dtat_us, 1_300_000);
        let (v, at) = judge(gate_at(0), clock, 1_000_500, 2_000_000, 1, &p);
        assert_eq!(v, Judged::Wait { at_us: 1_000_500 });
        assert_eq!(at.dtat_us, 0);
    }

    #[test]
    fn a_worker_waking_long_after_a_slot_moves_it_to_now_or_gives_it_up() {
        let p = params("10/s", 1);
        let clock = dispatch_clock(3_000_000, 0);
        // Three seconds after its slot, the gate open: it goes now, as a new slot.
        let (v, _) = judge(gate_at(0), clock, 0, 5_000_000, 1, &p);
        assert_eq!(v, Judged::Pass { slot_us: 3_000_000 });
        // Past its deadline: it leaves the route whatever the gate says, and gives its
        // reservation back when it is the plan's last.
        let last = Judging {
            dtat_us: 0,
            tat_us: 100_000,
        };
        let (v, at) = judge(last, clock, 0, 1_000_000, 1, &p);
        assert_eq!(v, Judged::TooLate { at_us: 3_001_000 }, "never a wait of 0");
        assert_eq!(at.tat_us, 0);
        // The gate closed until 3.2 s: moved there, within its deadline.
        let (v, _) = judge(gate_at(3_200_000), clock, 0, 5_000_000, 1, &p);
        assert_eq!(v, Judged::Replan { at_us: 3_200_000 });
        // The plan's end past its deadline: it leaves the route, saying when it could have gone.
        let busy = Judging {
            dtat_us: 3_200_000,
            tat_us: 9_000_000,
        };
        let (v, at) = judge(busy, clock, 0, 5_000_000, 1, &p);
        assert_eq!(v, Judged::TooLate { at_us: 9_000_000 });
        assert_eq!(at, busy);
    }

    /// On a 10/s route whose last dispatch went 3 ms late, the next event, due now, is held
    /// back 3 ms by the gate: past LATE_US, so its slot moves, but to the gate's time (3 ms
    /// lost), not the plan's end (its 100 ms left empty). On a 1000/s route a 3 ms delay is
    /// three intervals: the plan's end, as before.
    #[test]
    fn an_event_held_back_by_less_than_its_interval_moves_by_the_delay() {
        let p = params("10/s", 1);
        let late = Judging {
            dtat_us: 1_103_000,
            tat_us: 1_500_000,
        };
        let (v, at) = judge(late, (1_100_000, 1_100_000), 1_100_000, 9_000_000, 1, &p);
        assert_eq!(v, Judged::Replan { at_us: 1_103_000 });
        assert_eq!(
            at.dtat_us, 1_203_000,
            "the call's next event queues behind it"
        );
        assert_eq!(at.tat_us, 1_500_000, "the plan's end does not move");
        // The plan's last: its end moves with it.
        let last = Judging {
            tat_us: 1_200_000,
            ..late
        };
        assert_eq!(
            judge(last, (1_100_000, 1_100_000), 1_100_000, 9_000_000, 1, &p)
                .1
                .tat_us,
            1_203_000
        );
        // Past its deadline even so: the general path, which says it leaves.
        let (v, _) = judge(late, (1_100_000, 1_100_000), 1_100_000, 1_102_000, 1, &p);
        assert!(matches!(v, Judged::TooLate { .. }), "{v:?}");
        let fast = params("1000/s", 1);
        let (v, _) = judge(late, (1_100_000, 1_100_000), 1_100_000, 9_000_000, 1, &fast);
        assert_eq!(v, Judged::Replan { at_us: 1_500_000 });
    }

    #[test]
    fn window_limit_is_rate_times_window_plus_burst() {
        assert_eq!(params("10/s", 1).window_limit(1_000_000), 11);
        assert_eq!(params("10/s", 5).window_limit(1_000_000), 15);
        assert_eq!(params("10/s", 5).window_limit(250_000), 7);
    }
}
