//! Rates as the config writes them (`10/s`, `120/min`, `240/h`, `2/ms`) and the emission
//! interval the buckets run on.
//!
//! Buckets count time in whole microseconds so that Rust and Lua (whose numbers are doubles,
//! exact for integers below 2^53) do the same integer arithmetic. A rate whose interval is not a
//! whole number of microseconds (7/s = 142857.14 µs) is rounded *up*: pacer may run a hair slower
//! than configured, never faster.

use std::fmt;
use std::num::NonZeroU64;
use std::str::FromStr;

/// `count` events per `per_us` microseconds; both non-zero by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    count: NonZeroU64,
    per_us: NonZeroU64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    #[error("expected <count>/<unit> with unit ms, s, min or h (like 10/s), got {0:?}")]
    Syntax(String),
    #[error("the count must be a whole number of at least 1, got {0:?}")]
    Count(String),
    #[error("{0} is faster than one event per microsecond, which pacer cannot pace")]
    TooFast(String),
}

impl Rate {
    pub fn new(count: NonZeroU64, per_us: NonZeroU64) -> Result<Self, RateError> {
        let rate = Rate { count, per_us };
        if count.get() > per_us.get() {
            return Err(RateError::TooFast(rate.to_string()));
        }
        Ok(rate)
    }

    /// Microseconds between two events at this rate, rounded up (see the module doc).
    pub fn interval_us(&self) -> u64 {
        self.per_us.get().div_ceil(self.count.get())
    }

    /// The count of `count/unit`: events allowed per window.
    pub fn count(&self) -> u64 {
        self.count.get()
    }

    /// The window of `count/unit`, in microseconds.
    pub fn per_us(&self) -> u64 {
        self.per_us.get()
    }

    /// Events per second, for display and for `rate × W` bounds.
    pub fn per_second(&self) -> f64 {
        self.count.get() as f64 * 1e6 / self.per_us.get() as f64
    }
}

impl FromStr for Rate {
    type Err = RateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (count, unit) = s
            .trim()
            .split_once('/')
            .ok_or_else(|| RateError::Syntax(s.to_string()))?;
        let per_us: u64 = match unit.trim() {
            "ms" => 1_000,
            "s" | "sec" => 1_000_000,
            "min" | "m" => 60_000_000,
            "h" => 3_600_000_000,
            _ => return Err(RateError::Syntax(s.to_string())),
        };
        let count: u64 = count
            .trim()
            .parse()
            .map_err(|_| RateError::Count(count.trim().to_string()))?;
        let count = NonZeroU64::new(count).ok_or_else(|| RateError::Count("0".into()))?;
        Rate::new(count, NonZeroU64::new(per_us).expect("units are non-zero"))
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.per_us.get() {
            1_000 => "ms",
            1_000_000 => "s",
            60_000_000 => "min",
            3_600_000_000 => "h",
            other => return write!(f, "{}/{}us", self.count, other),
        };
        write!(f, "{}/{}", self.count, unit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!("10/s".parse::<Rate>().unwrap().interval_us(), 100_000);
        assert_eq!("120/min".parse::<Rate>().unwrap().interval_us(), 500_000);
        assert_eq!("240/h".parse::<Rate>().unwrap().interval_us(), 15_000_000);
        assert_eq!("2/ms".parse::<Rate>().unwrap().interval_us(), 500);
    }

    #[test]
    fn rounds_the_interval_up_never_down() {
        let r: Rate = "7/s".parse().unwrap();
        assert_eq!(r.interval_us(), 142_858);
        assert!(1e6 / r.interval_us() as f64 <= r.per_second());
    }

    #[test]
    fn refuses_bad_rates() {
        assert!(matches!("0/s".parse::<Rate>(), Err(RateError::Count(_))));
        assert!(matches!("ten/s".parse::<Rate>(), Err(RateError::Count(_))));
        assert!(matches!(
            "10/day".parse::<Rate>(),
            Err(RateError::Syntax(_))
        ));
        assert!(matches!("10".parse::<Rate>(), Err(RateError::Syntax(_))));
        assert!(matches!(
            "2000/ms".parse::<Rate>(),
            Err(RateError::TooFast(_))
        ));
    }

    #[test]
    fn displays_as_written() {
        assert_eq!("120/min".parse::<Rate>().unwrap().to_string(), "120/min");
    }
}
