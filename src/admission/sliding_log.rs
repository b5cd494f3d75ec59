//! The sliding log: an exact rolling window.
//!
//! An identity's state is the log of the times of its charged events, oldest first. An event at
//! `now` passes a limit of `count` per `window` when fewer than `count` logged events fall in
//! `(now − window, now]`; it passes the rule when it passes every limit (and `min_spacing`, which
//! the newest entry answers).
//!
//! **Bounded.** Entries older than the rule's horizon are dropped ([`trim`]), and the log keeps
//! only its newest [`Rule::log_cap`] entries (the largest limit). Keeping the newest `cap` is
//! exact: a window is a suffix of the log, so it holds at least `count ≤ cap` entries in the
//! capped log exactly when it does in the full one, and the `count`-th newest entry, which says
//! when the window frees up, is the same in both. Sorted sets that grow with every attempt are a
//! known failure of other limiters; this one never holds more than its largest limit.
//!
//! In Redis the log is one string, the times packed as little-endian doubles oldest first
//! (`lua/admit.lua`; [`unpack`] reads it). A large log (a cap above
//! [`crate::scripts::LOG_ENTRIES_PER_READ`] per command) is read entry by entry and appended to,
//! so entries past the horizon may stay in it until the cap makes a rewrite drop them: older
//! than every window, they change no decision, and the cap bounds the log all the same.

use super::{spacing_check_n, spacing_room, Check, Room, Rule};

/// The log as `admit.lua` stores it: `None` if `bytes` is not a whole number of entries.
pub fn unpack(bytes: &[u8]) -> Option<Vec<i64>> {
    if !bytes.len().is_multiple_of(8) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as i64)
            .collect(),
    )
}

/// Drops entries that can no longer matter at `now`: at or before `now − horizon`.
pub fn trim(log: &mut Vec<i64>, now_us: i64, rule: &Rule) {
    let floor = now_us - rule.horizon_us();
    let old = log.partition_point(|&t| t <= floor);
    log.drain(..old);
}

/// Whether one more event at `now` fits, given a log trimmed at `now`.
pub fn check(log: &[i64], now_us: i64, rule: &Rule) -> Check {
    check_n(log, now_us, rule, 1)
}

/// Whether `cost` more events at `now` fit (a cost above a limit never does: its retry is then
/// that limit's window, as if it were full).
pub fn check_n(log: &[i64], now_us: i64, rule: &Rule, cost: i64) -> Check {
    let mut verdict = spacing_check_n(log.last().copied(), now_us, rule.spacing_us, cost);
    for (i, limit) in rule.limits.iter().enumerate() {
        // A window is a suffix of the sorted log, so it has room for `cost` more exactly when
        // the `(count − cost + 1)`-th newest entry is out of it; and it frees up when that
        // entry leaves it. One look, no search.
        let room = limit.count - cost;
        if room < 0 {
            verdict = verdict.and(Check {
                retry_us: limit.window_us,
                limit: i,
            });
            continue;
        }
        let Some(at) = log.len().checked_sub(room as usize + 1) else {
            continue;
        };
        let nth_newest = log[at];
        if nth_newest > now_us - limit.window_us {
            let this = Check {
                retry_us: nth_newest + limit.window_us - now_us,
                limit: i,
            };
            verdict = verdict.and(this);
        }
    }
    verdict
}

/// Records an event at `now` (not before the newest entry), keeping the newest `cap` entries.
pub fn charge(log: &mut Vec<i64>, now_us: i64, rule: &Rule) {
    charge_n(log, now_us, rule, 1)
}

/// Records `cost` events at `now`, keeping the newest `cap` entries.
pub fn charge_n(log: &mut Vec<i64>, now_us: i64, rule: &Rule, cost: i64) {
    let cap = rule.log_cap() as usize;
    log.extend(std::iter::repeat_n(now_us, (cost.max(0) as usize).min(cap)));
    let cap = rule.log_cap() as usize;
    if log.len() > cap {
        log.drain(..log.len() - cap);
    }
}

/// The room left at `now` in a log trimmed at `now`, for the limit with the least of it.
pub fn room(log: &[i64], now_us: i64, rule: &Rule) -> Room {
    let mut room = Room::UNLIMITED;
    for (i, limit) in rule.limits.iter().enumerate() {
        let first = log.partition_point(|&t| t <= now_us - limit.window_us);
        let held = (log.len() - first) as i64;
        // Full again once the newest entry in the window has left it.
        let reset = log[first..]
            .last()
            .map_or(0, |&t| t + limit.window_us - now_us);
        room = room.tighter(Room::of(limit.count - held, i, reset));
    }
    room.tighter(spacing_room(log.last().copied(), now_us, rule.spacing_us))
}

#[cfg(test)]
mod tests {
    use super::super::{Algorithm, SPACING};
    use super::*;

    fn rule(limits: &[(u64, u64)], spacing_us: i64) -> Rule {
        super::super::tests::rule(Algorithm::SlidingLog, limits, spacing_us)
    }

    fn run(rule: &Rule, times: &[i64]) -> Vec<Check> {
        let mut log = Vec::new();
        times
            .iter()
            .map(|&t| {
                trim(&mut log, t, rule);
                let c = check(&log, t, rule);
                if c.passed() {
                    charge(&mut log, t, rule);
                }
                c
            })
            .collect()
    }

    #[test]
    fn fifty_at_once_take_exactly_the_limit_then_the_window_slides() {
        let r = rule(&[(10, 1_000_000)], 0);
        let times: Vec<i64> = (0..50).map(|i| 5_000_000 + i).collect();
        let checks = run(&r, &times);
        assert_eq!(checks.iter().filter(|c| c.passed()).count(), 10);
        // The 11th waits until the first leaves the window: 1 s after it, less the 10 µs since.
        assert_eq!(checks[10].retry_us, 1_000_000 - 10);
        let mut log: Vec<i64> = times[..10].to_vec();
        trim(&mut log, 5_999_999, &r);
        assert_eq!(log.len(), 10, "nothing has left the window yet");
        // The window is (now − 1 s, now]: the first entry leaves exactly 1 s after it.
        trim(&mut log, 6_000_000, &r);
        assert_eq!(log.len(), 9);
    }

    #[test]
    fn every_limit_holds_and_the_latest_one_binds() {
        let r = rule(&[(2, 1_000), (3, 10_000)], 0);
        let checks = run(&r, &[0, 1, 2, 1_001, 1_002, 2_000]);
        let passed: Vec<bool> = checks.iter().map(Check::passed).collect();
        assert_eq!(passed, vec![true, true, false, true, false, false]);
        // At 1 002 the 2/ms window is full until 1 001 + 1 000, the 3/10ms one until 10 000.
        assert_eq!(
            checks[4],
            Check {
                retry_us: 10_000 - 1_002,
                limit: 1
            }
        );
    }

    #[test]
    fn min_spacing_counts_from_the_newest_entry() {
        let r = rule(&[(100, 1_000_000)], 300);
        let checks = run(&r, &[0, 100, 300, 500, 600]);
        let passed: Vec<bool> = checks.iter().map(Check::passed).collect();
        assert_eq!(passed, vec![true, false, true, false, true]);
        assert_eq!(
            checks[1],
            Check {
                retry_us: 200,
                limit: SPACING
            }
        );
    }

    #[test]
    fn unpacks_what_the_script_packs() {
        let mut bytes = Vec::new();
        for t in [1_700_000_000_123_456_f64, 1_700_000_000_123_457.0] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(
            unpack(&bytes),
            Some(vec![1_700_000_000_123_456, 1_700_000_000_123_457])
        );
        assert_eq!(unpack(&bytes[..12]), None);
    }

    #[test]
    fn the_log_never_holds_more_than_its_largest_limit() {
        let mut r = rule(&[(3, 1_000), (5, 100_000)], 0);
        r.count_rejected = true;
        let mut log = Vec::new();
        for t in 0..1_000 {
            trim(&mut log, t * 7, &r);
            charge(&mut log, t * 7, &r);
            assert!(log.len() <= 5);
        }
    }
}
