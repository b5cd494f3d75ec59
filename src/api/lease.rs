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
//! - **Fetched ahead.** When a lease is down to its last eighth (or last token) and the last
//!   fetch left the identity room for two more as large, the worker fetches the next lease in
//!   the background (with a request of cost 1 whose token joins it), and spends it once the
//!   current one is spent. A steady identity's requests then never wait on Redis; before,
//!   the one that found its lease empty did, and those set the p99 latency with leasing. Each
//!   lease keeps its own end, so no token outlives its ttl; at the limit nothing is fetched
//!   ahead (the workers take turns, below).
//! - **Short.** A lease ends after its ttl (and a fixed window's lease with its window), so no
//!   worker sits on tokens others need; what that may admit over a limit is bounded in
//!   `config::Lease`.
//! - **Refusals are cached too.** When Redis refuses a request on a leased identity, the worker
//!   refuses that identity locally for a while (at least the retry time Redis gave), and a
//!   worker whose last fetch was granted less than it asked (the identity is at its limit)
//!   waits once it is spent. An identity over its limit then costs a few Redis calls per
//!   bucket's worth of tokens, not one per request.
//! - **At the limit, workers take turns.** A fetch brings what the identity's bucket gathered
//!   since the last fetch by any worker, and a gcra bucket gathers no more than its burst. When
//!   a fetch comes back short, or leaves less room than it asked, or is refused, Redis books the
//!   worker a fetch turn (`lua/admission.lua`, `book_turn`): three quarters of the bucket's fill
//!   time (`Lease::turn_gap`) after the last turn booked on that identity. The workers sharing
//!   an identity at its limit so fetch one at a time, in the order they booked: the identity
//!   costs one call per gap however many workers share it (it cost about 1.3 per gap per
//!   worker when each polled on its own), each fetch finds what gathered in a gap, and each
//!   worker gets its share. A batch granted in full that still had to wait for its turn grows.
//! - **Where no turn is booked** (`decide.lua` running as a script, which keeps nothing between
//!   calls), a worker whose fetch came back short waits, between fetches, a random point in the
//!   second half of the lease's span or of the time the bucket takes to gather what a fetch may
//!   take, whichever is shorter (`State::short_wait`): alone, it passes the full rate even on a
//!   small burst. The random draw keeps the workers' fetches from locking into one order, where
//!   the one whose turn came right after another's would get little.

use crate::admission::Room;
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

/// The tokens of one fetch, spendable until `until`.
#[derive(Debug, Clone, Copy)]
struct Batch {
    /// Which fetch brought them (`State::made`; 0: none), so that tokens given back go to the
    /// batch they came from and nowhere else.
    id: u64,
    tokens: i64,
    until: Instant,
    /// `until` on Redis's clock (µs), at or after it: what `take_part` tells Redis.
    until_us: i64,
    fetched: Instant,
}

impl Batch {
    fn none(now: Instant) -> Self {
        Batch {
            id: 0,
            tokens: 0,
            until: now,
            until_us: 0,
            fetched: now,
        }
    }

    /// The tokens that may still be spent at `now`.
    fn live(&self, now: Instant) -> i64 {
        if now < self.until {
            self.tokens
        } else {
            0
        }
    }
}

#[derive(Debug)]
struct State {
    /// The lease being spent.
    cur: Batch,
    /// A lease fetched ahead (`Slot::fetch_ahead`), spent once `cur` is spent or ends; each
    /// keeps its own end, so no token outlives the ttl of the fetch that brought it.
    next: Batch,
    /// Tokens the next fetch asks for.
    size: i64,
    /// Requests of at least this cost are refused locally until then (Redis refused one:
    /// a larger one would wait at least as long, a smaller one may pass sooner).
    blocked: Option<(Instant, i64)>,
    /// The last fetch was granted less than it asked, or Redis booked its worker a fetch turn:
    /// the identity is at its limit, so when this lease runs out its worker waits until then
    /// rather than fetch again.
    short_until: Option<Instant>,
    /// The last fetch was granted all it asked and yet had to wait for a turn: a larger batch
    /// would have found tokens.
    full_at_turn: bool,
    /// A fetch ahead is in flight.
    ahead: bool,
    /// The last fetch left the identity room for two more as large: a fetch ahead, which
    /// takes tokens before they are needed, takes none another worker will soon need.
    roomy: bool,
    /// Tokens of leases that ended unspent, not yet counted as wasted.
    wasted: i64,
    /// The identity's room in Redis after the last fetch, its limit, and when it is whole
    /// again (None: no fetch yet, or no bound): with what the leases hold, the room a request
    /// answered here reports.
    room: Option<(i64, usize, Instant)>,
    /// Batches stored so far: the last one's id.
    made: u64,
    /// When the last fetch failed (Redis did not answer), and why: requests that were waiting
    /// for the fetch lock meanwhile take that answer rather than each try Redis in turn.
    failed: Option<(Instant, Arc<str>)>,
}

/// Where a request's leased tokens came from: (batch id, tokens) from the lease being spent,
/// then from the one fetched ahead. What `Slot::give_back` returns them to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Taken([(u64, i64); 2]);

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

/// What a fetch asked and got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetch {
    pub asked: i64,
    pub granted: i64,
    /// The request it came with (charged with it).
    pub cost: i64,
    /// The room the identity had left after it (`remaining` `i64::MAX`: no bound).
    pub room: Room,
    /// When its tokens end on Redis's clock (µs): the call's time there plus their span.
    pub until_us: i64,
}

/// What a refill did with the leases it replaced: tokens it wasted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refilled {
    pub wasted: i64,
}

impl State {
    /// How long a worker waits after a fetch at the limit (granted less than it asked) before
    /// it fetches again: a random point in the second half of a scale, the lease's span, or,
    /// for gcra, the time the bucket takes to gather what a fetch may take (`could`, or the
    /// burst if that is less) when that is shorter. A gcra bucket holds no more than its
    /// burst, so a worker alone at the limit that waited longer than that would lose tokens:
    /// with a burst of 5 on 1000/s and a 10 ms span it passed 664 a second.
    ///
    /// The scale is the same for every worker, which keeps their shares fair. Adapting it to
    /// what fetches bring was tried (each worker's own average, so that k workers would wait k
    /// times longer and call less): a worker that fetches more often finds more per fetch (what
    /// gathered since its own last fetch, where the others' interrupt it less), so it waited
    /// less still, and in a simulation three workers' shares in 3 s drifted as far as 23/25/52%.
    fn short_wait(&self, could: i64, span: Duration, lease: &Lease) -> Duration {
        let scale = lease.wait_scale(could, span);
        scale / 2 + scale.mul_f64(fastrand::f64() / 2.0)
    }

    /// The live lease is down to its last eighth (or its last token), and no lease fetched
    /// ahead is held. Late, so that the lease fetched ahead starts its ttl about when it is
    /// needed: fetched at a quarter, 5.8% of the tokens leased in the sync benchmark's open
    /// loop were wasted against 3.8% (13% against 11% beside two CPU hogs), for no better
    /// latency.
    fn low(&self, now: Instant) -> bool {
        now < self.cur.until && self.next.live(now) == 0 && self.cur.live(now) <= self.low_water()
    }

    fn low_water(&self) -> i64 {
        (self.size / 8).max(1)
    }

    /// Once `cur` is spent or has ended, the lease fetched ahead takes its place; what `cur`
    /// left unspent is wasted.
    fn roll(&mut self, now: Instant) {
        if self.next.live(now) > 0 && self.cur.live(now) == 0 {
            if self.cur.tokens > 0 {
                // It ended unspent: the batches are larger than the requests need.
                self.size = (self.size / 2).max(1);
            }
            self.wasted += self.cur.tokens;
            self.cur = self.next;
            self.next = Batch::none(now);
        }
    }

    /// What a fetch, made at `fetched` and spendable until `until`, says about the limit: a
    /// lease at the limit, once spent, waits until `turn` after `fetched` when Redis booked
    /// this worker a fetch turn (`lua/admission.lua`, `book_turn`: the lease came back short,
    /// or left less room than it asked), else, if it came back short, a random `short_wait`.
    fn at_limit(
        &mut self,
        f: Fetch,
        (fetched, until): (Instant, Instant),
        turn: Option<Duration>,
        lease: &Lease,
    ) {
        let Fetch {
            asked,
            granted,
            cost,
            ..
        } = f;
        self.roomy = f.room.remaining >= 2 * asked.max(1);
        self.room = (f.room.remaining != i64::MAX).then(|| {
            let reset = Duration::from_micros(f.room.reset_us.max(0) as u64);
            (f.room.remaining, f.room.limit, fetched + reset)
        });
        self.full_at_turn = turn.is_some() && granted >= asked;
        self.short_until = match turn {
            Some(turn) => Some(fetched + turn),
            None => (granted < asked).then(|| {
                let span = until.saturating_duration_since(fetched);
                fetched + self.short_wait(asked + cost, span, lease)
            }),
        };
    }
}

impl Slot {
    fn new(now: Instant) -> Self {
        Slot {
            state: Mutex::new(State {
                cur: Batch::none(now),
                next: Batch::none(now),
                size: 1,
                blocked: None,
                short_until: None,
                full_at_turn: false,
                ahead: false,
                roomy: false,
                wasted: 0,
                room: None,
                made: 0,
                failed: None,
            }),
            fetch: tokio::sync::Mutex::new(()),
        }
    }

    /// Takes `cost` tokens if the live leases hold them (the older first), and says where
    /// they came from (for `give_back`).
    pub fn take(&self, cost: i64, now: Instant) -> (Take, Taken) {
        let mut s = self.state.lock().expect("lease state");
        if let Some((until, at_least)) = s.blocked {
            if now >= until {
                s.blocked = None;
            } else if cost >= at_least {
                return (Take::Blocked(until - now), Taken::default());
            }
        }
        s.roll(now);
        let (cur, next) = (s.cur.live(now), s.next.live(now));
        if cur + next >= cost {
            let from_cur = cost.min(cur);
            s.cur.tokens -= from_cur;
            s.next.tokens -= cost - from_cur;
            let taken = Taken([(s.cur.id, from_cur), (s.next.id, cost - from_cur)]);
            return (Take::Spent(cur + next - cost), taken);
        }
        if let Some(until) = s.short_until.filter(|&t| now < t) {
            return (Take::Blocked(until - now), Taken::default());
        }
        (Take::Empty, Taken::default())
    }

    /// Takes what the live leases hold, up to `most` (the older first), for a request that
    /// costs more than they hold and so goes to Redis: it pays that part of its cost, and
    /// Redis decides and charges only the rest. Before, the request was decided in Redis for
    /// its whole cost and these tokens, already charged there, were wasted: near the limit
    /// it was refused where the lease and Redis's room together held enough (100/s burst 10,
    /// a request of 1 then one of 8 every 100 ms: 15 of 30 of the 8s allowed).
    /// Also returns when, on Redis's clock, the first of the leases taken from ends: Redis
    /// counts them paid only before then.
    pub fn take_part(&self, most: i64, now: Instant) -> (i64, Taken, i64) {
        let mut s = self.state.lock().expect("lease state");
        let from_cur = s.cur.live(now).min(most).max(0);
        let from_next = s.next.live(now).min(most - from_cur).max(0);
        s.cur.tokens -= from_cur;
        s.next.tokens -= from_next;
        let taken = Taken([(s.cur.id, from_cur), (s.next.id, from_next)]);
        let until_us = [(from_cur, s.cur.until_us), (from_next, s.next.until_us)]
            .into_iter()
            .filter(|&(n, _)| n > 0)
            .map(|(_, until_us)| until_us)
            .min()
            .unwrap_or(0);
        (from_cur + from_next, taken, until_us)
    }

    /// Whether to fetch the next lease now, ahead of need, so that the requests after this one
    /// find tokens rather than wait on Redis: the lease is down to its last eighth (`low`), no
    /// lease fetched ahead is held or in flight, and the identity is far from its limit (the
    /// last fetch left it room for two more as large; at the limit the workers take turns,
    /// and a fetch ahead would only take a turn early). True claims
    /// the fetch: answer with `ahead_fetched`, `ahead_refused` or `ahead_dropped`.
    pub fn fetch_ahead(&self, now: Instant) -> bool {
        let mut s = self.state.lock().expect("lease state");
        let go =
            !s.ahead && s.low(now) && s.roomy && s.short_until.is_none() && s.blocked.is_none();
        s.ahead |= go;
        go
    }

    /// Whether the fetch ahead claimed is still wanted once it holds the fetch lock: a request
    /// that found the lease empty may have fetched meanwhile (on a busy machine the fetch
    /// ahead can start a while after it was claimed), and a second lease on top of that one
    /// would mostly end unspent.
    pub fn ahead_wanted(&self, now: Instant) -> bool {
        self.state.lock().expect("lease state").low(now)
    }

    /// Returns tokens taken for a request Redis then refused on another identity, each to the
    /// batch it came from if that is still live; else they are wasted, as they would have
    /// been. Never to another batch: a token charged in one fixed window and handed to the
    /// next window's lease would be spent there too, one over that window's count (and a gcra
    /// token moved to a later lease would outlive its ttl).
    pub fn give_back(&self, taken: Taken, now: Instant) {
        let mut s = self.state.lock().expect("lease state");
        for (id, n) in taken.0 {
            if n == 0 {
                continue;
            }
            if s.cur.id == id && now < s.cur.until {
                s.cur.tokens += n;
            } else if s.next.id == id && now < s.next.until {
                s.next.tokens += n;
            } else {
                s.wasted += n;
            }
        }
    }

    /// How many tokens the next fetch asks for, adapted to how the last lease went.
    pub fn next_size(&self, lease: &Lease, now: Instant) -> i64 {
        let mut s = self.state.lock().expect("lease state");
        // Spent (down to where a fetch ahead starts) within half its ttl, or before its turn
        // came though granted in full.
        let cur = s.cur;
        let quick = now < cur.until && now.saturating_duration_since(cur.fetched) < lease.ttl / 2;
        // (Its tokens, live or not: one that ended unspent did not run out.)
        if cur.tokens <= s.low_water() && (quick || s.full_at_turn) {
            s.size = (s.size * 2).min(lease.max);
        } else if cur.tokens > 0 && now >= cur.until {
            s.size = (s.size / 2).max(1);
        }
        s.size.clamp(1, lease.max)
    }

    /// Stores a lease fetched on demand: the tokens granted, spendable until `until` (the
    /// request it came with spent its own). The tokens left in the leases it replaces are
    /// wasted (they ended, or were too few).
    pub fn refill(
        &self,
        fetch: Fetch,
        fetched: Instant,
        until: Instant,
        turn: Option<Duration>,
        lease: &Lease,
    ) -> Refilled {
        let mut s = self.state.lock().expect("lease state");
        let wasted = s.wasted + s.cur.tokens + s.next.tokens;
        s.wasted = 0;
        s.made += 1;
        s.cur = Batch {
            id: s.made,
            tokens: fetch.granted,
            until,
            until_us: fetch.until_us,
            fetched,
        };
        s.next = Batch::none(fetched);
        s.at_limit(fetch, (fetched, until), turn, lease);
        Refilled { wasted }
    }

    /// Stores a lease fetched ahead (`fetch_ahead`), as `refill` does, to be spent after the
    /// current one; its request's own `cost` tokens, spent by no one, go into it too.
    pub fn ahead_fetched(
        &self,
        fetch: Fetch,
        fetched: Instant,
        until: Instant,
        turn: Option<Duration>,
        lease: &Lease,
    ) -> Refilled {
        let mut s = self.state.lock().expect("lease state");
        let wasted = s.wasted + s.next.tokens;
        s.wasted = 0;
        s.made += 1;
        s.next = Batch {
            id: s.made,
            tokens: fetch.granted + fetch.cost,
            until,
            until_us: fetch.until_us,
            fetched,
        };
        s.at_limit(fetch, (fetched, until), turn, lease);
        s.ahead = false;
        Refilled { wasted }
    }

    /// Redis refused the fetch ahead sent at `sent`: the identity is at its limit, so once the
    /// current lease is spent its worker waits for what Redis said (the retry time, or the
    /// turn it booked if later).
    pub fn ahead_refused(&self, sent: Instant, retry: Duration, turn: Option<Duration>) {
        let mut s = self.state.lock().expect("lease state");
        s.short_until = Some(sent + retry.max(turn.unwrap_or_default()));
        s.ahead = false;
    }

    /// A fetch under the lock failed at `at` with `error` (Redis did not answer).
    pub fn fetch_failed(&self, at: Instant, error: &str) {
        self.state.lock().expect("lease state").failed = Some((at, error.into()));
    }

    /// Why the last fetch failed, if it failed after `since`: a request that began waiting for
    /// the fetch lock at `since` answers with it. Single flight alone made each waiter, one
    /// after another, spend a whole Redis timeout on a Redis that does not answer: the twelfth
    /// of twelve requests on one identity answered after 23 s (found by review).
    pub fn failed_since(&self, since: Instant) -> Option<Arc<str>> {
        let s = self.state.lock().expect("lease state");
        s.failed
            .as_ref()
            .filter(|(at, _)| *at >= since)
            .map(|(_, e)| e.clone())
    }

    /// The fetch ahead was not made (another fetch was in flight) or failed.
    pub fn ahead_dropped(&self) {
        self.state.lock().expect("lease state").ahead = false;
    }

    /// Redis refused a request of `cost` asking `asked` tokens more, sent at `sent`, and said
    /// when it would pass: requests of that cost or more on the identity are refused locally
    /// until then, or until the fetch turn Redis booked (else as long as a fetch at the limit
    /// would wait) if that is longer (an identity over its limit would otherwise send a call
    /// per gcra interval). Smaller ones are not: they may pass sooner, and a large request
    /// refused must not refuse every small one after it.
    pub fn refused(
        &self,
        (asked, cost): (i64, i64),
        sent: Instant,
        retry: Duration,
        turn: Option<Duration>,
        lease: &Lease,
    ) {
        let mut s = self.state.lock().expect("lease state");
        let wait = turn.unwrap_or_else(|| s.short_wait(asked + cost, lease.ttl, lease));
        s.blocked = Some((sent + retry.max(wait), cost));
    }

    /// The tokens left and the time until the lease that holds the last of them ends.
    pub fn left(&self, now: Instant) -> (i64, Duration) {
        let s = self.state.lock().expect("lease state");
        let (cur, next) = (s.cur.live(now), s.next.live(now));
        let until = if next > 0 { s.next.until } else { s.cur.until };
        (cur + next, until.saturating_duration_since(now))
    }

    /// The identity's room as this worker last knew it, as (remaining, limit, µs until whole):
    /// what its leases hold plus what Redis had left after its last fetch, of the limit Redis
    /// named, whole again when Redis said (None: no fetch has said). Other workers may have
    /// spent some of Redis's part since, and the bucket gathered more; within a lease's ttl
    /// (milliseconds) it is as near as a worker can tell without asking. Before, a request
    /// answered here reported only the lease's tokens (at most `max`, 1% of the limit by
    /// default), and a client pacing itself by `RateLimit`'s `r` slowed down at 1% of its room.
    pub fn room(&self, now: Instant) -> Option<(i64, usize, i64)> {
        let held = self.left(now).0;
        let s = self.state.lock().expect("lease state");
        s.room.map(|(room, limit, whole)| {
            let reset = whole.saturating_duration_since(now).as_micros() as i64;
            (held.saturating_add(room), limit, reset)
        })
    }

    #[cfg(test)]
    fn block(&self, until: Instant) {
        self.state.lock().expect("lease state").blocked = Some((until, 1));
    }

    fn idle(&self, now: Instant) -> bool {
        let s = self.state.lock().expect("lease state");
        now >= s.cur.until
            && now >= s.next.until
            && !s.ahead
            && s.blocked.is_none_or(|(b, _)| now >= b)
    }
}

/// Every lease a worker holds, by limiter key.
#[derive(Debug, Default)]
pub struct Leases {
    slots: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    by_key: HashMap<String, Arc<Slot>>,
    /// Held at which the next sweep comes: twice what the last one kept (at least SWEEP_AT).
    /// Sweeping at a fixed count made every new identity sweep them all once more than that
    /// many were live (a gateway's long tail of addresses on a rule whose leases last long,
    /// or a gRPC call of thousands of descriptors): quadratic. Doubling makes each sweep paid
    /// for by the identities added since the last one.
    sweep_at: usize,
    sweeps: u64,
}

/// Slots kept before idle ones are swept.
const SWEEP_AT: usize = 4096;

impl Leases {
    /// The lease of `key`, created empty on first use. Idle leases are dropped when many are
    /// held, so a worker's memory follows its live identities, not every one it has seen.
    pub fn slot(&self, key: &str, now: Instant) -> Arc<Slot> {
        let mut held = self.slots.lock().expect("leases");
        if let Some(s) = held.by_key.get(key) {
            return s.clone();
        }
        if held.by_key.len() >= held.sweep_at.max(SWEEP_AT) {
            held.by_key
                .retain(|_, s| Arc::strong_count(s) > 1 || !s.idle(now));
            held.sweep_at = 2 * held.by_key.len();
            held.sweeps += 1;
        }
        let s = Arc::new(Slot::new(now));
        held.by_key.insert(key.to_string(), s.clone());
        s
    }

    /// The lease of `key` if this worker holds one (none is created).
    pub fn peek(&self, key: &str) -> Option<Arc<Slot>> {
        self.slots.lock().expect("leases").by_key.get(key).cloned()
    }

    pub fn len(&self) -> usize {
        self.slots.lock().expect("leases").by_key.len()
    }

    /// How many sweeps there have been.
    pub fn sweeps(&self) -> u64 {
        self.slots.lock().expect("leases").sweeps
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fetch of `asked` granted `granted`, with a request of `cost`, leaving the identity
    /// ample room, its tokens ending at 1,000 µs on Redis's clock.
    fn fetch(asked: i64, granted: i64, cost: i64) -> Fetch {
        Fetch {
            asked,
            granted,
            cost,
            room: Room::UNLIMITED,
            until_us: 1_000,
        }
    }

    fn lease() -> Lease {
        Lease {
            ttl: Duration::from_millis(100),
            max: 64,
            bucket: None,
        }
    }

    #[test]
    fn a_lease_is_spent_until_empty_or_expired() {
        let t0 = Instant::now();
        let s = Slot::new(t0);
        assert_eq!(s.take(1, t0).0, Take::Empty);
        s.refill(
            fetch(3, 3, 1),
            t0,
            t0 + Duration::from_millis(100),
            None,
            &lease(),
        );
        assert_eq!(s.take(2, t0).0, Take::Spent(1));
        assert_eq!(s.take(2, t0).0, Take::Empty, "one left, two asked");
        let (spent, taken) = s.take(1, t0);
        assert_eq!(spent, Take::Spent(0));
        s.give_back(taken, t0);
        assert_eq!(s.take(1, t0 + Duration::from_millis(100)).0, Take::Empty);
    }

    /// A token given back goes to the batch it came from while that batch lives, else it is
    /// wasted: never into a later batch (a fixed window's next window, a later gcra lease).
    #[test]
    fn a_token_given_back_goes_to_its_own_batch_or_is_wasted() {
        let t0 = Instant::now();
        let l = lease();
        let ms = Duration::from_millis;
        let s = Slot::new(t0);
        s.refill(fetch(3, 3, 1), t0, t0 + l.ttl, None, &l);
        let (spent, taken) = s.take(1, t0);
        assert_eq!(spent, Take::Spent(2));
        // Its batch ends; a new one is fetched; the refused request's token comes back late.
        s.refill(fetch(3, 3, 1), t0 + l.ttl, t0 + ms(200), None, &l);
        s.give_back(taken, t0 + l.ttl + ms(1));
        assert_eq!(
            s.take(4, t0 + l.ttl + ms(1)).0,
            Take::Empty,
            "not into the new batch"
        );
        assert_eq!(s.take(3, t0 + l.ttl + ms(1)).0, Take::Spent(0));
        let r = s.refill(fetch(1, 1, 1), t0 + ms(150), t0 + ms(250), None, &l);
        assert_eq!(r.wasted, 1, "counted as wasted");

        // The same with a batch fetched ahead: the token is not moved into it.
        let s = Slot::new(t0);
        s.refill(fetch(3, 3, 1), t0, t0 + l.ttl, None, &l);
        s.ahead_fetched(fetch(3, 3, 1), t0 + ms(50), t0 + ms(150), None, &l);
        let (_, taken) = s.take(1, t0);
        s.give_back(taken, t0 + l.ttl);
        assert_eq!(
            s.left(t0 + l.ttl).0,
            4,
            "the batch ahead's own 3 and its request's 1"
        );
        // And while its batch lives, it goes back into it.
        let (_, taken) = s.take(2, t0 + ms(120));
        s.give_back(taken, t0 + ms(120));
        assert_eq!(s.left(t0 + ms(120)).0, 4);
    }

    /// A request costing more than the leases hold takes what they hold, below its cost, from
    /// the older first and only while they live; given back if it is refused.
    #[test]
    fn a_large_request_takes_part_of_its_cost_from_the_leases() {
        let t0 = Instant::now();
        let l = lease();
        let ms = Duration::from_millis;
        let s = Slot::new(t0);
        assert_eq!(s.take_part(7, t0).0, 0, "nothing leased");
        s.refill(fetch(3, 3, 1), t0, t0 + ms(50), None, &l);
        let later = Fetch {
            until_us: 2_000,
            ..fetch(3, 3, 1)
        };
        s.ahead_fetched(later, t0 + ms(10), t0 + ms(100), None, &l);
        // 3 + 4 held; a request of 8 takes 7 of them (never its whole cost: then it would
        // have been spent from the leases), the current batch first; paid until the first of
        // them ends.
        let (paid, taken, until_us) = s.take_part(7, t0 + ms(20));
        assert_eq!((paid, until_us), (7, 1_000));
        assert_eq!(taken, Taken([(1, 3), (2, 4)]));
        assert_eq!(s.left(t0 + ms(20)).0, 0);
        s.give_back(taken, t0 + ms(20));
        assert_eq!(s.left(t0 + ms(20)).0, 7, "refused: all back");
        // Of a smaller request, only what it needs; of an ended batch, nothing.
        assert_eq!(s.take_part(2, t0 + ms(20)).0, 2);
        let (paid, _, until_us) = s.take_part(9, t0 + ms(60));
        assert_eq!((paid, until_us), (4, 2_000), "the current batch has ended");
        assert_eq!(s.take_part(9, t0 + ms(100)).0, 0);
    }

    /// The room an answer from the lease reports: Redis's after the last fetch plus what the
    /// leases hold, whole again when Redis said; nothing before a fetch said, or with no bound.
    #[test]
    fn the_room_reported_is_redis_s_after_the_last_fetch_plus_the_leases() {
        let t0 = Instant::now();
        let l = lease();
        let ms = Duration::from_millis;
        let s = Slot::new(t0);
        assert_eq!(s.room(t0), None, "no fetch yet");
        let f = Fetch {
            room: Room {
                remaining: 40,
                limit: 1,
                reset_us: 500_000,
            },
            ..fetch(3, 3, 1)
        };
        s.refill(f, t0, t0 + l.ttl, None, &l);
        assert_eq!(s.room(t0), Some((43, 1, 500_000)));
        assert_eq!(s.take(1, t0 + ms(1)).0, Take::Spent(2));
        assert_eq!(s.room(t0 + ms(1)), Some((42, 1, 499_000)));
        // The lease ended: its tokens are no room.
        assert_eq!(s.room(t0 + l.ttl), Some((40, 1, 400_000)));
        // A fetch on an identity of no bound says nothing.
        s.refill(fetch(3, 3, 1), t0 + l.ttl, t0 + 2 * l.ttl, None, &l);
        assert_eq!(s.room(t0 + l.ttl), None);
    }

    /// A large request refused blocks requests as large locally, not smaller ones: they spend
    /// what the lease holds.
    #[test]
    fn a_refusal_blocks_requests_as_large_not_smaller_ones() {
        let t0 = Instant::now();
        let l = lease();
        let s = Slot::new(t0);
        s.refill(fetch(5, 5, 1), t0, t0 + l.ttl, None, &l);
        s.refused((10, 10), t0, Duration::from_secs(36), None, &l);
        assert!(matches!(s.take(10, t0).0, Take::Blocked(_)));
        assert!(matches!(s.take(11, t0).0, Take::Blocked(_)));
        assert_eq!(s.take(1, t0).0, Take::Spent(4));
        assert_eq!(s.take(4, t0).0, Take::Spent(0));
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
            s.refill(fetch(n, n, 1), now, now + l.ttl, None, &l);
            while let Take::Spent(_) = s.take(1, now).0 {}
            now += Duration::from_millis(10);
        }
        assert_eq!(sizes, [1, 2, 4, 8, 16, 32, 64, 64], "doubles up to max");
        // Now leases expire half unused: the batch halves each time, and the rest is wasted.
        let mut wasted = 0;
        for _ in 0..3 {
            let n = s.next_size(&l, now);
            wasted += s.refill(fetch(n, n, 1), now, now + l.ttl, None, &l).wasted;
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
    fn the_next_lease_is_fetched_ahead_once_and_spent_after_the_current_one() {
        let t0 = Instant::now();
        let l = lease();
        let s = Slot::new(t0);
        let ms = Duration::from_millis;
        // A lease of 16 (batch size 16): no fetch ahead until 2 (an eighth) are left.
        s.state.lock().unwrap().size = 16;
        s.refill(fetch(16, 16, 1), t0, t0 + l.ttl, None, &l);
        for left in (2..16).rev() {
            assert_eq!(s.take(1, t0).0, Take::Spent(left));
            assert_eq!(s.fetch_ahead(t0), left <= 2, "{left} left");
        }
        assert!(!s.fetch_ahead(t0), "claimed once");
        // Its fetch brings 8 and the request's own token, spendable from 5 ms on.
        let wasted = s.ahead_fetched(fetch(8, 8, 1), t0 + ms(5), t0 + ms(5) + l.ttl, None, &l);
        assert_eq!(wasted.wasted, 0);
        assert!(!s.fetch_ahead(t0 + ms(5)), "one ahead is held");
        assert_eq!(
            s.take(3, t0 + ms(5)).0,
            Take::Spent(8),
            "the 2 left, then 1 of 9"
        );
        assert_eq!(s.left(t0 + ms(5)), (8, l.ttl));
        // The current lease ends with tokens: the one ahead takes over, and they are wasted
        // (counted with the next fetch) and the batch halves.
        let cur = s.state.lock().unwrap().cur.id;
        s.give_back(Taken([(cur, 1), (0, 0)]), t0 + ms(5));
        assert_eq!(s.take(1, t0 + l.ttl).0, Take::Spent(7));
        assert_eq!(s.state.lock().unwrap().size, 8);
        let r = s.refill(fetch(8, 8, 1), t0 + ms(200), t0 + ms(300), None, &l);
        assert_eq!(
            r.wasted,
            1 + 7,
            "the one given back, and what the lease ahead left"
        );
    }

    #[test]
    fn no_fetch_ahead_at_the_limit_or_when_the_last_fetch_left_little_room() {
        let t0 = Instant::now();
        let l = lease();
        let spent = |f: Fetch, turn: Option<Duration>| {
            let s = Slot::new(t0);
            s.refill(f, t0, t0 + l.ttl, turn, &l);
            while let Take::Spent(_) = s.take(1, t0).0 {}
            s.fetch_ahead(t0)
        };
        assert!(spent(fetch(1, 1, 1), None), "the control: ample room");
        assert!(!spent(fetch(2, 1, 1), None), "short");
        assert!(
            !spent(fetch(1, 1, 1), Some(Duration::from_millis(5))),
            "a turn booked"
        );
        let tight = Fetch {
            room: Room {
                remaining: 1,
                ..Room::UNLIMITED
            },
            ..fetch(1, 1, 1)
        };
        assert!(!spent(tight, None), "room for less than two more");
        // Refused ahead: once spent, the lease waits for the turn Redis booked.
        let s = Slot::new(t0);
        s.refill(fetch(1, 1, 1), t0, t0 + l.ttl, None, &l);
        assert_eq!(s.take(1, t0).0, Take::Spent(0));
        assert!(s.fetch_ahead(t0));
        s.ahead_refused(t0, Duration::from_millis(1), Some(Duration::from_millis(4)));
        assert_eq!(s.take(1, t0).0, Take::Blocked(Duration::from_millis(4)));
    }

    #[test]
    fn a_lease_that_ended_unspent_never_grows_the_batch() {
        // Even when it had to wait for its turn: it did not run out, it ran over its ttl.
        let t0 = Instant::now();
        let l = lease();
        let s = Slot::new(t0);
        s.state.lock().unwrap().size = 8;
        s.refill(
            fetch(8, 8, 1),
            t0,
            t0 + l.ttl,
            Some(Duration::from_millis(1)),
            &l,
        );
        assert_eq!(s.next_size(&l, t0 + l.ttl), 4);
    }

    #[test]
    fn a_short_lease_once_spent_waits_into_its_span_before_fetching_again() {
        let t0 = Instant::now();
        let s = Slot::new(t0);
        let end = t0 + Duration::from_millis(10);
        s.refill(fetch(8, 2, 1), t0, end, None, &lease());
        assert_eq!(s.take(1, t0).0, Take::Spent(1));
        assert_eq!(s.take(1, t0).0, Take::Spent(0));
        let Take::Blocked(wait) = s.take(1, t0).0 else {
            panic!("a short lease spent must wait")
        };
        assert!(
            (Duration::from_millis(5)..=Duration::from_millis(10)).contains(&wait),
            "{wait:?}"
        );
        assert_eq!(s.take(1, t0 + wait).0, Take::Empty, "then it fetches again");
        // A full grant fetches again as soon as it is spent.
        s.refill(
            fetch(2, 2, 1),
            end,
            end + Duration::from_millis(10),
            None,
            &lease(),
        );
        assert_eq!(s.take(2, end).0, Take::Spent(0));
        assert_eq!(s.take(1, end).0, Take::Empty);
    }

    /// `workers` slots on one simulated gcra bucket (5 tokens per ms, holding `burst`), each
    /// under more demand than the limit, for 3 s in steps of 50 µs, as `decider` drives them:
    /// a request that finds no usable lease asks Redis, which passes it and leases up to what
    /// it asked of what the bucket holds, or refuses it when the bucket is empty. With `turns`,
    /// Redis books each short or refused fetch a turn as `lua/admission.lua`'s `book_turn`
    /// does (a function's library keeps them); without, it books none (a script keeps
    /// nothing). Returns the tokens each slot passed and the calls made.
    fn share_a_bucket(workers: usize, burst: f64, turns: bool) -> (Vec<f64>, u32) {
        let l = Lease {
            ttl: Duration::from_millis(10),
            max: 50,
            bucket: Some((burst as i64, Duration::from_micros(burst as u64 * 200))),
        };
        let t0 = Instant::now();
        let slots: Vec<Slot> = (0..workers).map(|_| Slot::new(t0)).collect();
        let (mut level, mut passed, mut calls) = (burst, vec![0.0; workers], 0);
        let mut last_turn = t0;
        let mut book = |now: Instant| {
            turns.then(|| {
                last_turn = last_turn.max(now) + l.turn_gap();
                last_turn - now
            })
        };
        for step in 0..60_000u64 {
            let now = t0 + Duration::from_micros(step * 50);
            level = (level + 0.25).min(burst);
            let first = step as usize % workers;
            for w in (first..workers).chain(0..first) {
                let s = &slots[w];
                while let Take::Spent(_) = s.take(1, now).0 {
                    passed[w] += 1.0;
                }
                if s.take(1, now).0 != Take::Empty {
                    continue;
                }
                calls += 1;
                let asked = s.next_size(&l, now);
                if level < 1.0 {
                    let retry = Duration::from_micros(((1.0 - level) * 200.0) as u64);
                    s.refused((asked, 1), now, retry, book(now), &l);
                    continue;
                }
                let granted = (asked as f64).min((level - 1.0).floor());
                level -= 1.0 + granted;
                passed[w] += 1.0;
                let turn = if (granted as i64) < asked || level < asked as f64 {
                    book(now)
                } else {
                    None
                };
                s.refill(fetch(asked, granted as i64, 1), now, now + l.ttl, turn, &l);
            }
        }
        (passed, calls)
    }

    #[test]
    fn at_the_limit_workers_pass_the_rate_in_fair_shares_with_a_few_calls_per_fill() {
        // 3 s at 5000/s: 15,000 tokens, and the burst at the start.
        for turns in [false, true] {
            for (workers, burst) in [(1, 50.0), (3, 50.0), (10, 50.0), (1, 5.0), (3, 5.0)] {
                let (passed, calls) = share_a_bucket(workers, burst, turns);
                let total: f64 = passed.iter().sum();
                let what = format!(
                    "{workers} workers, burst {burst}, turns {turns}: {passed:?}, {calls} calls"
                );
                assert!(total <= 15_000.0 + burst, "{what}");
                assert!(total >= 0.95 * 15_000.0, "{what}");
                for p in &passed {
                    let share = p / total;
                    assert!((share - 1.0 / workers as f64).abs() < 0.1, "{what}");
                }
                // Without turns each worker calls about once per 0.75 of the bucket's fill
                // time (3 s / (burst x 200 µs) of them), however many requests it refuses
                // meanwhile; with turns the workers together call that often.
                let fills = 3_000_000.0 / (burst * 200.0);
                let callers = if turns { 1.0 } else { workers as f64 };
                assert!(
                    f64::from(calls) <= 1.5 * callers * fills + 20.0,
                    "{what} ({fills} fill times)"
                );
            }
        }
    }

    #[test]
    fn a_refusal_is_kept_until_its_retry_time() {
        let t0 = Instant::now();
        let s = Slot::new(t0);
        s.block(t0 + Duration::from_millis(50));
        assert_eq!(
            s.take(1, t0 + Duration::from_millis(20)).0,
            Take::Blocked(Duration::from_millis(30))
        );
        assert_eq!(s.take(1, t0 + Duration::from_millis(50)).0, Take::Empty);
    }

    #[test]
    fn idle_leases_are_swept_when_many_are_held() {
        let t0 = Instant::now();
        let leases = Leases::default();
        let live = leases.slot("live", t0);
        live.refill(
            fetch(5, 5, 1),
            t0,
            t0 + Duration::from_secs(60),
            None,
            &lease(),
        );
        for i in 0..SWEEP_AT - 1 {
            leases.slot(&format!("k{i}"), t0);
        }
        leases.slot("one more", t0 + Duration::from_millis(1));
        assert_eq!(leases.len(), 2, "the live lease and the new one");
        drop(live);
    }

    #[test]
    fn many_live_leases_are_swept_rarely() {
        let t0 = Instant::now();
        let leases = Leases::default();
        // 40,000 identities in use at once (each held, as a request in flight holds it):
        // sweeps at 4,096, 8,192, 16,384 and 32,768, not one per identity past 4,096.
        let held: Vec<_> = (0..40_000)
            .map(|i| leases.slot(&format!("k{i}"), t0))
            .collect();
        assert_eq!(leases.sweeps(), 4);
        assert_eq!(leases.len(), 40_000);
        drop(held);
        // Once idle they go at the next sweep (at 65,536), and the one after waits for 4,096.
        let later = t0 + Duration::from_millis(1);
        for i in 0..25_537 {
            leases.slot(&format!("n{i}"), later);
        }
        assert_eq!((leases.sweeps(), leases.len()), (5, 1));
    }
}
