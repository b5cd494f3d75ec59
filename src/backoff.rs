//! The one backoff every retry loop uses: a delay doubling from a floor to a ceiling, reset by a
//! success. Without the reset a loop that failed through an outage would keep its longest delay
//! after Redis came back, and resume seconds later than it could.

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

    /// Records a failure; returns how long to wait before the next try.
    pub fn fail(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.ceiling);
        self.failures = self.failures.saturating_add(1);
        delay
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
        let delays: Vec<u64> = (0..5).map(|_| b.fail().as_millis() as u64).collect();
        assert_eq!(delays, vec![50, 100, 200, 300, 300]);
        assert_eq!(b.failures(), 5);
        assert_eq!(b.succeed(), 5);
        assert_eq!(b.failures(), 0);
        assert_eq!(b.fail(), Duration::from_millis(50));
    }
}
