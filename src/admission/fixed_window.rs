//! The fixed window: a counter per calendar window of each limit (`floor(now / window)`).
//!
//! The cheap option: one small string per identity (`w1:c1:…:last`), a few integer operations per event. Its known
//! weakness is the **boundary burst**: windows are aligned to the clock, not to the traffic, so an
//! identity may spend a whole limit at the end of one window and another at the start of the
//! next: up to `2 × count` events within one rolling `window`. Use `sliding_log` or `gcra` where
//! that matters.

use super::{spacing_check_n, spacing_room, Check, Room, Rule};

/// One identity's counters: per limit (window number, events counted in it), and the last
/// charged event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub windows: Vec<(i64, i64)>,
    pub last: Option<i64>,
}

impl State {
    pub fn empty(rule: &Rule) -> Self {
        State {
            windows: vec![(-1, 0); rule.limits.len()],
            last: None,
        }
    }
}

/// A limit's window now and what it has counted. A window on record newer than the clock's (the
/// clock stepped back) is still the current one: read as empty, it admitted a whole limit again
/// on every step back.
fn current_window((window, count): (i64, i64), now_us: i64, window_us: i64) -> (i64, i64) {
    let current = now_us.div_euclid(window_us);
    if window >= current {
        (window, count)
    } else {
        (current, 0)
    }
}

pub fn check(s: &State, now_us: i64, rule: &Rule) -> Check {
    check_n(s, now_us, rule, 1)
}

/// Whether `cost` more events fit the current windows (a cost above a limit never does).
pub fn check_n(s: &State, now_us: i64, rule: &Rule, cost: i64) -> Check {
    let mut verdict = spacing_check_n(s.last, now_us, rule.spacing_us, cost);
    for (i, (limit, &counted)) in rule.limits.iter().zip(&s.windows).enumerate() {
        let (current, used) = current_window(counted, now_us, limit.window_us);
        if used + cost > limit.count {
            verdict = verdict.and(Check {
                retry_us: (current + 1) * limit.window_us - now_us,
                limit: i,
            });
        }
    }
    verdict
}

pub fn charge(s: &mut State, now_us: i64, rule: &Rule) {
    charge_n(s, now_us, rule, 1)
}

/// Counts `cost` events in the current windows.
pub fn charge_n(s: &mut State, now_us: i64, rule: &Rule, cost: i64) {
    for (limit, w) in rule.limits.iter().zip(s.windows.iter_mut()) {
        let current = now_us.div_euclid(limit.window_us);
        if w.0 < current {
            *w = (current, 0);
        }
        w.1 += cost;
    }
    s.last = Some(now_us);
}

/// Milliseconds this state is worth keeping after `now`: until its current windows end and
/// `min_spacing` has passed (at least 1 ms).
pub fn ttl_ms(s: &State, now_us: i64, rule: &Rule) -> i64 {
    let spacing_end = s.last.map_or(0, |l| l + rule.spacing_us);
    let ends = rule
        .limits
        .iter()
        .zip(&s.windows)
        .map(|(l, &(w, _))| (w + 1) * l.window_us);
    let until = ends.chain([spacing_end]).max().unwrap_or(0) - now_us;
    ((until.max(0) + 999) / 1000).max(1)
}

/// The room left in the current windows, for the limit with the least, and when it ends.
pub fn room(s: &State, now_us: i64, rule: &Rule) -> Room {
    let mut room = Room::UNLIMITED;
    for (i, (limit, &counted)) in rule.limits.iter().zip(&s.windows).enumerate() {
        let (current, used) = current_window(counted, now_us, limit.window_us);
        let end = (current + 1) * limit.window_us - now_us;
        room = room.tighter(Room::of(limit.count - used, i, end));
    }
    room.tighter(spacing_room(s.last, now_us, rule.spacing_us))
}

/// How long a lease of this rule's tokens may be spent: to the end of the earliest current
/// window, so that a token counted in one window is never spent in the next (0, no bound, for
/// a rule of min_spacing alone).
pub fn lease_span(now_us: i64, rule: &Rule) -> i64 {
    rule.limits
        .iter()
        .map(|l| (now_us.div_euclid(l.window_us) + 1) * l.window_us - now_us)
        .min()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::super::{Algorithm, Limit};
    use super::*;

    #[test]
    fn the_boundary_burst_is_twice_the_limit_in_one_rolling_window() {
        let r = Rule {
            algorithm: Algorithm::FixedWindow,
            limits: vec![Limit::new(10, 1_000_000, None, "l")],
            spacing_us: 0,
            count_rejected: false,
        };
        let mut s = State::empty(&r);
        let mut accepted = Vec::new();
        // 20 attempts in the last ms of one window and 20 in the first ms of the next.
        for t in (0..20)
            .map(|i| 1_999_000 + i)
            .chain((0..20).map(|i| 2_000_000 + i))
        {
            let c = check(&s, t, &r);
            if c.passed() {
                charge(&mut s, t, &r);
                accepted.push(t);
            } else {
                assert_eq!(
                    t + c.retry_us,
                    if t < 2_000_000 { 2_000_000 } else { 3_000_000 }
                );
            }
        }
        assert_eq!(accepted.len(), 20, "10 per window, 20 within 21 µs");
        assert_eq!(ttl_ms(&s, 2_000_019, &r), 1_000);
    }

    #[test]
    fn a_window_on_record_ahead_of_a_clock_stepped_back_still_counts() {
        let r = Rule {
            algorithm: Algorithm::FixedWindow,
            limits: vec![Limit::new(3, 60_000_000, None, "l")],
            spacing_us: 0,
            count_rejected: false,
        };
        let mut s = State::empty(&r);
        for t in [200_000_000, 200_000_001, 200_000_002] {
            assert!(check(&s, t, &r).passed());
            charge(&mut s, t, &r);
        }
        // 120 s back: window 1 by the clock, window 3 on record.
        let back = 80_000_000;
        let c = check(&s, back, &r);
        assert!(!c.passed());
        assert_eq!(back + c.retry_us, 240_000_000, "the window on record's end");
        assert_eq!(room(&s, back, &r).remaining, 0);
        // Once the clock is past it, a new window.
        assert!(check(&s, 240_000_000, &r).passed());
    }
}
