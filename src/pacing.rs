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
//! `scripts/bucket.lua` is the same maths in Lua; `tests/bucket_differential.rs` holds the two to
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
/// The cost is paid *after* the event: it goes at its slot and pushes the following ones back by
/// `cost × interval`. Every event therefore moves the plan by at least one interval, which is what
/// bounds the count of entries in a window whatever the costs.
pub fn plan(tat_us: i64, now_us: i64, cost: i64, p: &BucketParams) -> Planned {
    Planned {
        slot_us: now_us.max(tat_us - p.tolerance_us),
        tat_us: tat_us.max(now_us) + cost * p.interval_us,
    }
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
/// [`dispatch_clock`]) against the gate at `dtat`.
///
/// An entry written in millisecond `m` stands for the earliest instant it could have had in that
/// millisecond (`tq − 999 µs`), but not below the gate. Those instants keep exact GCRA, and an
/// entry's id lies at most 999 µs after its instant, so every window of whole milliseconds on the
/// ids holds at most `W / interval + burst` entries; and a slot that falls inside a millisecond
/// costs no drift.
pub fn gate(dtat_us: i64, tq_us: i64, cost: i64, p: &BucketParams) -> Gate {
    let earliest = dtat_us - p.tolerance_us;
    if tq_us < earliest {
        Gate::NotBefore {
            at_us: ceil_ms(earliest),
        }
    } else {
        Gate::Pass {
            dtat_us: dtat_us.max(tq_us - 999) + cost * p.interval_us,
        }
    }
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
    fn cost_pushes_the_following_events_back() {
        let p = params("10/s", 1);
        let first = plan(0, 0, 3, &p);
        assert_eq!(first.slot_us, 0);
        assert_eq!(plan(first.tat_us, 0, 1, &p).slot_us, 300_000);
    }

    #[test]
    fn the_gate_refuses_a_late_slot_bunched_against_the_next() {
        let p = params("10/s", 1);
        // Slots 0 and 100 ms were planned; the first went out 60 ms late.
        let Gate::Pass { dtat_us } = gate(0, 60_000, 1, &p) else {
            panic!("the first dispatch must pass");
        };
        assert_eq!(
            gate(dtat_us, 100_000, 1, &p),
            Gate::NotBefore { at_us: 160_000 }
        );
        assert!(matches!(gate(dtat_us, 160_000, 1, &p), Gate::Pass { .. }));
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

    #[test]
    fn window_limit_is_rate_times_window_plus_burst() {
        assert_eq!(params("10/s", 1).window_limit(1_000_000), 11);
        assert_eq!(params("10/s", 5).window_limit(1_000_000), 15);
        assert_eq!(params("10/s", 5).window_limit(250_000), 7);
    }
}
