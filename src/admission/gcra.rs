//! GCRA: a token bucket kept as one number per limit, the theoretical arrival time (`tat`).
//!
//! In plain words: a limit of `count` per `window` is a bucket that refills one token every
//! `interval = window / count` and holds `burst` tokens (default: `count`). Rather than counting
//! tokens, GCRA remembers when the bucket will next be full again, `tat`; an event at `now`
//! passes when `now ≥ tat − tolerance`, with `tolerance = (burst − 1) × interval`, and then moves
//! `tat` to `max(tat, now) + interval`. A sequence it accepts never has more than
//! `burst + W / interval` events in any window `W`, and it accepts every event that keeps that
//! true: rate and burst hold exactly, to the microsecond. A rejected event learns exactly when it
//! would pass: `tat − tolerance − now`.
//!
//! One string per identity in Redis (`t1:…:tn:last`, the tat per limit and the last accepted
//! time for `min_spacing`), whatever the traffic: O(1) memory. It expires when it would read as an empty bucket anyway.

use super::{spacing_check_n, spacing_room, Check, Room, Rule};

/// One identity's buckets: `tat` per limit (0 for a full bucket) and the last charged event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub tats: Vec<i64>,
    pub last: Option<i64>,
}

impl State {
    pub fn empty(rule: &Rule) -> Self {
        State {
            tats: vec![0; rule.limits.len()],
            last: None,
        }
    }
}

pub fn check(s: &State, now_us: i64, rule: &Rule) -> Check {
    check_n(s, now_us, rule, 1)
}

/// Whether `cost` more events at `now` conform: the bucket's schedule, `cost − 1` intervals on,
/// must be within the tolerance (a cost above the burst never is).
pub fn check_n(s: &State, now_us: i64, rule: &Rule, cost: i64) -> Check {
    let mut verdict = spacing_check_n(s.last, now_us, rule.spacing_us, cost);
    for (i, (limit, &tat)) in rule.limits.iter().zip(&s.tats).enumerate() {
        let earliest = tat.max(now_us) + (cost - 1) * limit.interval_us - limit.tolerance_us;
        if now_us < earliest {
            verdict = verdict.and(Check {
                retry_us: earliest - now_us,
                limit: i,
            });
        }
    }
    verdict
}

/// Charges one event. An accepted one takes a token from each bucket. A rejected attempt
/// (charged only under `count_rejected`) takes one too, but the debt stops at one full bucket
/// (`tat ≤ now + tolerance + interval`): an identity that keeps trying stays limited, and once it
/// stops it gets its first token back one interval after its last attempt.
pub fn charge(s: &mut State, now_us: i64, rule: &Rule, passed: bool) {
    charge_n(s, now_us, rule, passed, 1)
}

/// Charges `cost` events at `now` (a rejected attempt's charge is capped as in [`charge`]).
pub fn charge_n(s: &mut State, now_us: i64, rule: &Rule, passed: bool, cost: i64) {
    for (limit, tat) in rule.limits.iter().zip(s.tats.iter_mut()) {
        let next = (*tat).max(now_us) + cost * limit.interval_us;
        *tat = if passed {
            next
        } else {
            next.min(now_us + limit.tolerance_us + limit.interval_us)
        };
    }
    s.last = Some(now_us);
}

/// Milliseconds this state is worth keeping after `now`: until every bucket is full again and
/// `min_spacing` has passed (at least 1 ms).
pub fn ttl_ms(s: &State, now_us: i64, rule: &Rule) -> i64 {
    let spacing_end = s.last.map_or(0, |l| l + rule.spacing_us);
    let until = s
        .tats
        .iter()
        .copied()
        .chain([spacing_end])
        .max()
        .unwrap_or(0)
        - now_us;
    ((until.max(0) + 999) / 1000).max(1)
}

/// The room left at `now`: how many more events conform at once, for the limit with the
/// least, and when its bucket is full again.
pub fn room(s: &State, now_us: i64, rule: &Rule) -> Room {
    let mut room = Room::UNLIMITED;
    for (i, (limit, &tat)) in rule.limits.iter().zip(&s.tats).enumerate() {
        let ahead = tat.max(now_us) - now_us;
        let left = (limit.tolerance_us - ahead).div_euclid(limit.interval_us) + 1;
        room = room.tighter(Room::of(left, i, ahead));
    }
    room.tighter(spacing_room(s.last, now_us, rule.spacing_us))
}

#[cfg(test)]
mod tests {
    use super::super::{Algorithm, Limit};
    use super::*;

    fn rule(count: u64, window_us: u64, burst: Option<u64>) -> Rule {
        Rule {
            algorithm: Algorithm::Gcra,
            limits: vec![Limit::new(count, window_us, burst, "l")],
            spacing_us: 0,
            count_rejected: false,
        }
    }

    #[test]
    fn a_burst_at_once_then_one_per_interval_with_retry_to_the_microsecond() {
        let r = rule(10, 1_000_000, Some(3));
        let mut s = State::empty(&r);
        let mut passed = 0;
        let mut first_rejection = None;
        for _ in 0..10 {
            let c = check(&s, 1_000_000, &r);
            if c.passed() {
                charge(&mut s, 1_000_000, &r, true);
                passed += 1;
            } else if first_rejection.is_none() {
                first_rejection = Some(c.retry_us);
            }
        }
        assert_eq!(passed, 3);
        // Three tokens gone: tat = 1.3 s, tolerance 0.2 s, so the next passes at 1.1 s.
        assert_eq!(first_rejection, Some(100_000));
        assert!(check(&s, 1_099_999, &r).retry_us == 1);
        assert!(check(&s, 1_100_000, &r).passed());
    }

    #[test]
    fn rejected_attempts_charge_at_most_one_full_bucket() {
        let mut r = rule(1, 1_000_000, None);
        r.count_rejected = true;
        let mut s = State::empty(&r);
        charge(&mut s, 0, &r, true);
        for t in 1..100 {
            charge(&mut s, t * 1_000, &r, false);
        }
        // Last attempt at 99 ms: the token comes back one interval later, not 100 intervals.
        assert_eq!(s.tats[0], 99_000 + 1_000_000);
        assert_eq!(ttl_ms(&s, 99_000, &r), 1_000);
    }
}
