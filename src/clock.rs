//! Where Redis's clock stands on this process's monotonic clock.
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

/// How fast the estimate may drift upwards without a better sample (µs per second): room for
/// the two clocks' rates to differ, far above real oscillator drift.
const CREEP_PER_SECOND_US: i64 = 100;

pub struct RedisClock {
    base: Instant,
    /// (local µs since `base` minus Redis µs, local µs of the last sample); None before any.
    state: Mutex<Option<(i64, i64)>>,
}

impl Default for RedisClock {
    fn default() -> Self {
        RedisClock {
            base: Instant::now(),
            state: Mutex::new(None),
        }
    }
}

impl RedisClock {
    /// Records that Redis's clock read `redis_now_us` some time before `received`.
    pub fn observe(&self, redis_now_us: i64, received: Instant) {
        let local_us = received.saturating_duration_since(self.base).as_micros() as i64;
        let sample = local_us - redis_now_us;
        let mut state = self.state.lock().expect("clock lock");
        *state = Some(match *state {
            None => (sample, local_us),
            Some((offset, last)) => {
                let creep = (local_us - last).max(0) * CREEP_PER_SECOND_US / 1_000_000;
                (sample.min(offset + creep), local_us)
            }
        });
    }

    /// The local instant at which Redis's clock reads `redis_us` (never before `base`).
    pub fn local(&self, redis_us: i64) -> Instant {
        let offset = self.state.lock().expect("clock lock").map_or(0, |(o, _)| o);
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
