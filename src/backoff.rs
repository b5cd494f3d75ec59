//! The one backoff every retry loop uses: a delay doubling from a floor to a ceiling, reset by a
//! success. Without the reset a loop that failed through an outage would keep its longest delay
//! after Redis came back, and resume seconds later than it could.
//!
//! Each delay is drawn between half the step and the whole of it. Loops that fail together
//! (every route's calls timing out at once) must not retry together: with fixed delays, 10,000
//! routes with a backlog retried in step, their calls queued behind each other past the timeout
//! and failed again, and the worker made no progress for 40 s while Redis was mostly idle.

use std::time::Duration;

/// The first delay after a failure.
pub const FLOOR: Duration = Duration::from_millis(50);
/// The longest delay: once Redis answers again, every loop notices within about this long (and
/// a retry a second costs a down Redis nothing it would notice).
pub const CEILING: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct Backoff {
    floor: Duration,
    ceiling: Duration,
    next: Duration,
    failures: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new(FLOOR, CEILING)
    }
}

impl Backoff {
    pub fn new(floor: Duration, ceiling: Duration) -> Self {
        Backoff {
            floor,
            ceiling,
            next: floor,
            failures: 0,
        }
    }

    /// Records a failure; returns how long to wait before the next try: between half the
    /// current step and the step, which doubles up to the ceiling.
    pub fn fail(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(self.ceiling);
        self.failures = self.failures.saturating_add(1);
        step / 2 + step.mul_f64(fastrand::f64() / 2.0)
    }

    /// Records a success; returns how many failures came before it (0: none).
    pub fn succeed(&mut self) -> u32 {
        let failures = self.failures;
        self.next = self.floor;
        self.failures = 0;
        failures
    }

    /// Failures in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_ceiling_and_a_success_starts_over() {
        let mut b = Backoff::new(Duration::from_millis(50), Duration::from_millis(300));
        let steps = [50, 100, 200, 300, 300];
        for (i, step) in steps.into_iter().enumerate() {
            let delay = b.fail().as_micros() as u64;
            assert!(
                (step * 500..=step * 1000).contains(&delay),
                "failure {i}: {delay} µs for a step of {step} ms"
            );
        }
        assert_eq!(b.failures(), 5);
        assert_eq!(b.succeed(), 5);
        assert_eq!(b.failures(), 0);
        assert!(b.fail() <= Duration::from_millis(50));
    }

    #[test]
    fn loops_failing_together_retry_apart() {
        // 1,000 loops failing at the same moment: their retries spread over the step's second
        // half, not all at its end.
        let delays: Vec<Duration> = (0..1000)
            .map(|_| Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).fail())
            .collect();
        let (least, most) = (delays.iter().min().unwrap(), delays.iter().max().unwrap());
        assert!(*least >= Duration::from_millis(50) && *most <= Duration::from_millis(100));
        assert!(
            *most - *least >= Duration::from_millis(40),
            "{least:?}..{most:?}"
        );
        let distinct: std::collections::BTreeSet<_> = delays.iter().collect();
        assert!(distinct.len() > 900, "{} distinct delays", distinct.len());
    }
}
