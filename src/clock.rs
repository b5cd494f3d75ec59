//! Time, as a worker sees it: the `Clock` it reads instants from (the system's, or a fake one
//! that tests move by hand), and where Redis's clock stands on that clock (`RedisClock`).
//!
//! Every decision uses Redis time (`TIME` inside the scripts); a worker only needs to know when,
//! by its own `Instant`, a Redis time comes, so that it wakes at a slot. Each script reply says
//! what time Redis had while the reply was on its way, so `received − redis_now` overestimates
//! the offset by that reply's travel and processing time. Keeping the smallest such sample (as
//! NTP does) gives the tightest estimate, and one estimate serves every wake-up: remapping from
//! each reply would make every re-sleep later than the one before.
//!
//! The worker's wall clock is never read: a host whose clock is off by minutes paces the same.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where a worker's instants come from. Production reads the system's monotonic clock; tests
/// hand in a [`FakeClock`] and move it, so that timer and dispatch decisions are checked on
/// exact times rather than on how fast the machine runs.
pub trait Clock: Send + Sync {
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that stands still until told to move (for tests).
#[derive(Debug)]
pub struct FakeClock(Mutex<Instant>);

impl FakeClock {
    pub fn new(start: Instant) -> Self {
        FakeClock(Mutex::new(start))
    }

    pub fn advance(&self, by: Duration) {
        *self.0.lock().expect("fake clock lock") += by;
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Instant {
        *self.0.lock().expect("fake clock lock")
    }
}

/// How fast the estimate may drift upwards without a better sample (µs per second): room for
/// the two clocks' rates to differ, far above real oscillator drift.
const CREEP_PER_SECOND_US: i64 = 100;
/// Samples this far above the estimate (µs) say Redis's clock may have stepped back...
const STEP_US: i64 = 20_000;
/// ...and when every sample says so for this long (µs of local time), it did: the estimate
/// jumps to the smallest of them. A single slow reply never lasts that long.
const STEP_HOLD_US: i64 = 500_000;

pub struct RedisClock {
    base: Instant,
    state: Mutex<Option<Estimate>>,
}

#[derive(Debug, Clone, Copy)]
struct Estimate {
    /// Local µs since `base` minus Redis µs.
    offset: i64,
    /// Local µs of the last sample.
    last: i64,
    /// Since when (local µs) every sample has been more than `STEP_US` above the estimate, and
    /// the smallest of them.
    above: Option<(i64, i64)>,
}

impl Default for RedisClock {
    fn default() -> Self {
        RedisClock::new(Instant::now())
    }
}

impl RedisClock {
    /// A clock with no sample yet, counting local time from `base`.
    pub fn new(base: Instant) -> Self {
        RedisClock {
            base,
            state: Mutex::new(None),
        }
    }

    /// Records that Redis's clock read `redis_now_us` some time before `received`.
    ///
    /// A smaller sample is taken at once (Redis's clock stepped forward, or a faster reply); a
    /// larger one only creeps in, unless every sample has been far larger for a while: then
    /// Redis's clock stepped back, and keeping the old estimate would wake every event early.
    pub fn observe(&self, redis_now_us: i64, received: Instant) {
        let local_us = received.saturating_duration_since(self.base).as_micros() as i64;
        let sample = local_us - redis_now_us;
        let mut state = self.state.lock().expect("clock lock");
        *state = Some(match *state {
            None => Estimate {
                offset: sample,
                last: local_us,
                above: None,
            },
            Some(e) => {
                let creep = (local_us - e.last).max(0) * CREEP_PER_SECOND_US / 1_000_000;
                let offset = sample.min(e.offset + creep);
                let above = if sample > offset + STEP_US {
                    Some(
                        e.above
                            .map_or((local_us, sample), |(since, min)| (since, min.min(sample))),
                    )
                } else {
                    None
                };
                match above {
                    Some((since, min)) if local_us - since >= STEP_HOLD_US => Estimate {
                        offset: min,
                        last: local_us,
                        above: None,
                    },
                    _ => Estimate {
                        offset,
                        last: local_us,
                        above,
                    },
                }
            }
        });
    }

    /// The local instant at which Redis's clock reads `redis_us` (never before `base`).
    pub fn local(&self, redis_us: i64) -> Instant {
        let offset = self
            .state
            .lock()
            .expect("clock lock")
            .map_or(0, |e| e.offset);
        let local_us = (redis_us + offset).max(0);
        self.base + Duration::from_micros(local_us as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_tightest_sample() {
        let clock = RedisClock::default();
        let t0 = clock.base + Duration::from_millis(10);
        // Redis read 1_000_000 µs 300 µs before t0, then a faster reply shows 100 µs.
        clock.observe(1_000_000 - 300, t0);
        clock.observe(1_000_000 - 100 + 50, t0 + Duration::from_micros(50));
        let at = clock.local(1_000_000 + 5_000);
        let expected = t0 + Duration::from_micros(5_000 + 100);
        let diff = at.max(expected) - at.min(expected);
        assert!(diff <= Duration::from_micros(2), "{diff:?}");
    }

    #[test]
    fn a_clock_stepped_back_is_followed_after_half_a_second_a_slow_reply_is_not() {
        let clock = RedisClock::default();
        let t0 = clock.base + Duration::from_millis(10);
        clock.observe(10_000_000, t0);
        let before = clock.local(12_000_000);
        // One slow reply (80 ms), then normal ones: nothing moves.
        clock.observe(10_000_000, t0 + Duration::from_millis(80));
        clock.observe(10_100_000, t0 + Duration::from_millis(100));
        assert!(clock.local(12_000_000) - before <= Duration::from_micros(20));
        // Redis's clock steps back 2 s: every reply now says so. After half a second of them the
        // estimate follows, so that a slot 2 s ahead on Redis's clock is 2 s ahead here too.
        for ms in (200..=800).step_by(50) {
            clock.observe(
                10_000_000 + (ms - 2_000) * 1000,
                t0 + Duration::from_millis(ms as u64),
            );
        }
        let now = t0 + Duration::from_millis(800);
        let redis_now = 10_000_000 + (800 - 2_000) * 1000;
        let at = clock.local(redis_now + 2_000_000);
        let diff = at.max(now + Duration::from_secs(2)) - at.min(now + Duration::from_secs(2));
        assert!(diff <= Duration::from_millis(1), "{diff:?}");
    }

    #[test]
    fn a_worse_sample_moves_it_only_slowly() {
        let clock = RedisClock::default();
        let t0 = clock.base + Duration::from_millis(10);
        clock.observe(1_000_000, t0);
        let before = clock.local(2_000_000);
        clock.observe(1_000_000 + 1_000, t0 + Duration::from_millis(50));
        let after = clock.local(2_000_000);
        assert!(after - before <= Duration::from_micros(10));
    }
}
