//! Token leases: a worker reserves a batch of an identity's tokens from Redis (charged there
//! when leased, `lua/decide.lua`) and spends them locally, so that most synchronous decisions
//! never reach Redis (the Rockset article's batches, sized adaptively).
//!
//! - **Single flight.** One fetch per identity at a time: a request that finds the lease empty
//!   takes the identity's fetch lock, looks again (another request may have just refilled it),
//!   and only then asks Redis; the others wait on the lock, then spend what it brought.
//! - **Adaptive.** A lease used up within half its ttl doubles the next one (up to the rule's
//!   `lease.max`); a lease that expires with tokens left halves it (down to 1), and those tokens
//!   are counted as wasted. So a busy identity fetches rarely and a quiet one holds little.
//! - **Short.** A lease ends after its ttl (and a fixed window's lease with its window), so no
//!   worker sits on tokens others need; what that may admit over a limit is bounded in
//!   `config::Lease`.
//! - **Refusals are cached too.** When Redis refuses a request on a leased identity, the worker
//!   refuses that identity locally until the retry time Redis gave, or a lease's ttl if that is
//!   longer, counted from when the call was sent; and a worker whose last fetch was granted
//!   less than it asked (the identity is at its limit) waits, once it is spent, until a random
//!   point in the second half of that lease's span. An identity over its limit then costs about
//!   1.3 Redis calls per ttl per worker, not one per request; and nothing is lost while the
//!   burst holds a ttl's worth of tokens: they wait in the bucket for whoever asks next.

use crate::config::Lease;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One identity's lease on one worker.
#[derive(Debug)]
pub struct Slot {
    state: Mutex<State>,
    /// Held while fetching: the single flight.
    pub fetch: tokio::sync::Mutex<()>,
}

#[derive(Debug)]
struct State {
    tokens: i64,
    until: Instant,
    fetched: Instant,
    /// Tokens the next fetch asks for.
    size: i64,
    /// Refused locally until then.
    blocked_until: Option<Instant>,
    /// The last fetch was granted less than it asked: the identity is at its limit, so when
    /// this lease runs out its worker waits until then rather than fetch again.
    short_until: Option<Instant>,
}

/// What taking tokens from a lease found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Spent; this many are left.
    Spent(i64),
    /// Refused until Redis said it would pass: the time left.
    Blocked(Duration),
    /// No usable lease: fetch one.
    Empty,
}

/// What a refill did with the lease it replaced: tokens it wasted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refilled {
    pub wasted: i64,
}

impl Slot {
    fn new(now: Instant) -> Self {
        Slot {
            state: Mutex::new(State {
                tokens: 0,
                until: now,
                fetched: now,
                size: 1,
                blocked_until: None,
                short_until: None,
            }),
            fetch: tokio::sync::Mutex::new(()),
        }
    }

    /// Takes `cost` tokens if the lease is live and holds them.
    pub fn take(&self, cost: i64, now: Instant) -> Take {
        let mut s = self.state.lock().expect("lease state");
        if let Some(until) = s.blocked_until {
            if now < until {
                return Take::Blocked(until - now);
            }
            s.blocked_until = None;
        }
        if now < s.until && s.tokens >= cost {
            s.tokens -= cost;
            return Take::Spent(s.tokens);
        }
        if let Some(until) = s.short_until.filter(|&t| now < t) {
            return Take::Blocked(until - now);
        }
        Take::Empty
    }

    /// Returns tokens taken for a request Redis then refused on another identity (if the
    /// lease they came from is still live; else they are wasted, as they would have been).
    pub fn give_back(&self, n: i64, now: Instant) {
        let mut s = self.state.lock().expect("lease state");
        if now < s.until {
            s.tokens += n;
        }
    }

    /// How many tokens the next fetch asks for, adapted to how the last lease went.
    pub fn next_size(&self, lease: &Lease, now: Instant) -> i64 {
        let mut s = self.state.lock().expect("lease state");
        let quick = now.saturating_duration_since(s.fetched) < lease.ttl / 2;
        if s.tokens == 0 && now < s.until && quick {
            s.size = (s.size * 2).min(lease.max);
        } else if s.tokens > 0 && now >= s.until {
            s.size = (s.size / 2).max(1);
        }
        s.size.clamp(1, lease.max)
    }

    /// Stores a fetched lease: `granted` of the `asked` tokens, spendable until `until`. The
    /// tokens left in the lease it replaces are wasted (their lease ended, or they were too
    /// few).
    pub fn refill(&self, asked: i64, granted: i64, fetched: Instant, until: Instant) -> Refilled {
        let mut s = self.state.lock().expect("lease state");
        let wasted = s.tokens;
        s.tokens = granted;
        // At its limit, the worker waits until a random point in the second half of the
        // lease's span: an identity at its limit then costs about 1.3 calls per ttl per worker,
        // each bringing what the bucket gathered meanwhile. Waiting half the span took twice the
        // calls (2.4% of the sync benchmark's decisions reached Redis, against about 1%);
        // waiting the whole span locked the workers' fetches into a fixed order, and a worker
        // whose turn came right after another's got what little gathered in between (19.5% of
        // three workers' allowance in one run of three). The draw reshuffles the order each time.
        s.short_until = (granted < asked).then(|| {
            let span = until.saturating_duration_since(fetched);
            fetched + span / 2 + span.mul_f64(fastrand::f64() / 2.0)
        });
        s.fetched = fetched;
        s.until = until;
        Refilled { wasted }
    }

    /// The tokens left and the time until the lease ends.
    pub fn left(&self, now: Instant) -> (i64, Duration) {
        let s = self.state.lock().expect("lease state");
        (s.tokens, s.until.saturating_duration_since(now))
    }

    /// Refuses this identity locally until `until`.
    pub fn block(&self, until: Instant) {
        self.state.lock().expect("lease state").blocked_until = Some(until);
    }

    fn idle(&self, now: Instant) -> bool {
        let s = self.state.lock().expect("lease state");
        now >= s.until && s.blocked_until.is_none_or(|b| now >= b)
    }
}

/// Every lease a worker holds, by limiter key.
#[derive(Debug, Default)]
pub struct Leases {
    slots: Mutex<HashMap<String, Arc<Slot>>>,
}

/// Slots kept before idle ones are swept.
const SWEEP_AT: usize = 4096;

impl Leases {
    /// The lease of `key`, created empty on first use. Idle leases are dropped when many are
    /// held, so a worker's memory follows its live identities, not every one it has seen.
    pub fn slot(&self, key: &str, now: Instant) -> Arc<Slot> {
        let mut slots = self.slots.lock().expect("leases");
        if let Some(s) = slots.get(key) {
            return s.clone();
        }
        if slots.len() >= SWEEP_AT {
            slots.retain(|_, s| Arc::strong_count(s) > 1 || !s.idle(now));
        }
        let s = Arc::new(Slot::new(now));
        slots.insert(key.to_string(), s.clone());
        s
    }

    pub fn len(&self) -> usize {
        self.slots.lock().expect("leases").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease() -> Lease {
        Lease {
            ttl: Duration::from_millis(100),
            max: 64,
        }
    }

    #[test]
    fn a_lease_is_spent_until_empty_or_expired() {
        let t0 = Instant::now();
        let s = Slot::new(t0);
        assert_eq!(s.take(1, t0), Take::Empty);
        s.refill(3, 3, t0, t0 + Duration::from_millis(100));
        assert_eq!(s.take(2, t0), Take::Spent(1));
        assert_eq!(s.take(2, t0), Take::Empty, "one left, two asked");
        assert_eq!(s.take(1, t0), Take::Spent(0));
        s.give_back(1, t0);
        assert_eq!(s.take(1, t0 + Duration::from_millis(100)), Take::Empty);
    }

    #[test]
    fn the_batch_grows_when_used_up_quickly_and_shrinks_when_wasted() {
        let t0 = Instant::now();
        let l = lease();
        let s = Slot::new(t0);
        let mut now = t0;
        let mut sizes = Vec::new();
        for _ in 0..8 {
            let n = s.next_size(&l, now);
            sizes.push(n);
            s.refill(n, n, now, now + l.ttl);
            while let Take::Spent(_) = s.take(1, now) {}
            now += Duration::from_millis(10);
        }
        assert_eq!(sizes, [1, 2, 4, 8, 16, 32, 64, 64], "doubles up to max");
        // Now leases expire half unused: the batch halves each time, and the rest is wasted.
        let mut wasted = 0;
        for _ in 0..3 {
            let n = s.next_size(&l, now);
            wasted += s.refill(n, n, now, now + l.ttl).wasted;
            for _ in 0..n / 2 {
                s.take(1, now);
            }
            now += l.ttl;
        }
        assert_eq!(s.next_size(&l, now), 8);
        assert_eq!(
            wasted,
            32 + 16,
            "the halves left in the two leases replaced"
        );
    }

    #[test]
    fn a_short_lease_once_spent_waits_into_its_span_before_fetching_again() {
        let t0 = Instant::now();
        let s = Slot::new(t0);
        let end = t0 + Duration::from_millis(10);
        s.refill(8, 2, t0, end);
        assert_eq!(s.take(1, t0), Take::Spent(1));
        assert_eq!(s.take(1, t0), Take::Spent(0));
        let Take::Blocked(wait) = s.take(1, t0) else {
            panic!("a short lease spent must wait")
        };
        assert!(
            (Duration::from_millis(5)..=Duration::from_millis(10)).contains(&wait),
            "{wait:?}"
        );
        assert_eq!(s.take(1, t0 + wait), Take::Empty, "then it fetches again");
        // A full grant fetches again as soon as it is spent.
        s.refill(2, 2, end, end + Duration::from_millis(10));
        assert_eq!(s.take(2, end), Take::Spent(0));
        assert_eq!(s.take(1, end), Take::Empty);
    }

    #[test]
    fn a_refusal_is_kept_until_its_retry_time() {
        let t0 = Instant::now();
        let s = Slot::new(t0);
        s.block(t0 + Duration::from_millis(50));
        assert_eq!(
            s.take(1, t0 + Duration::from_millis(20)),
            Take::Blocked(Duration::from_millis(30))
        );
        assert_eq!(s.take(1, t0 + Duration::from_millis(50)), Take::Empty);
    }

    #[test]
    fn idle_leases_are_swept_when_many_are_held() {
        let t0 = Instant::now();
        let leases = Leases::default();
        let live = leases.slot("live", t0);
        live.refill(5, 5, t0, t0 + Duration::from_secs(60));
        for i in 0..SWEEP_AT - 1 {
            leases.slot(&format!("k{i}"), t0);
        }
        leases.slot("one more", t0 + Duration::from_millis(1));
        assert_eq!(leases.len(), 2, "the live lease and the new one");
        drop(live);
    }
}
