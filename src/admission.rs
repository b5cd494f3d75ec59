//! Inbound admission: whether one more event of an identity (a source, an IP, a user) fits its
//! rule's limits, as pure functions of (state, now, parameters).
//!
//! Three algorithms, one file each:
//!
//! - [`sliding_log`]: an exact rolling window. The log of an identity's recent events, never
//!   longer than the rule's largest limit; an event passes when every window holds fewer events
//!   than its limit.
//! - [`gcra`]: a token bucket in its GCRA form, one number per limit: rate and burst exact,
//!   O(1) memory per identity.
//! - [`fixed_window`]: a counter per calendar window of each limit. Cheapest, but a burst can
//!   straddle a boundary: up to twice the limit in a rolling window.
//!
//! Each may add `min_spacing`: the least time between two charged events of an identity.
//!
//! **Checking is separate from charging.** An event is decided by checking every limit of every
//! identity of every rule first; only then is anything charged, so a rejected event uses up
//! nothing (unless its rule sets `count_rejected`, see [`Rule::charges`]). [`Engine`] is that
//! composition, in memory: the model `lua/admit.lua` is held to by `tests/admit_differential.rs`.
//! [`decide`] is the same for synchronous requests (any cost, leases, the room left), the model
//! of `lua/decide.lua`.
//!
//! Every time is a whole number of microseconds of Redis's clock (integers below 2^53, exact in
//! Lua's doubles). Nothing here talks to Redis.

pub mod decide;
pub mod fixed_window;
pub mod gcra;
pub mod sliding_log;

pub use decide::{Ask, CheckOutcome, SyncVerdict};

use std::collections::HashMap;

/// Which algorithm a rule runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    SlidingLog,
    Gcra,
    FixedWindow,
}

impl Algorithm {
    pub fn as_str(&self) -> &'static str {
        match self {
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::Gcra => "gcra",
            Algorithm::FixedWindow => "fixed_window",
        }
    }

    /// The short name in key names (so a rule whose algorithm changes starts from fresh keys
    /// rather than reading another algorithm's state).
    pub fn key_part(&self) -> &'static str {
        match self {
            Algorithm::SlidingLog => "log",
            Algorithm::Gcra => "gcra",
            Algorithm::FixedWindow => "fw",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "sliding_log" => Some(Algorithm::SlidingLog),
            "gcra" => Some(Algorithm::Gcra),
            "fixed_window" => Some(Algorithm::FixedWindow),
            _ => None,
        }
    }
}

/// One limit: at most `count` events per `window_us`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    pub window_us: i64,
    pub count: i64,
    /// gcra only: the emission interval `window / count` (rounded up, never faster).
    pub interval_us: i64,
    /// gcra only: `(burst − 1) × interval`, how far ahead of its schedule an identity may run.
    pub tolerance_us: i64,
    /// As written in the config (`10/s`), for the `pacer_limit` field.
    pub label: String,
}

impl Limit {
    /// A limit of `count` per `window_us`; `burst` matters for gcra only (default: `count`).
    pub fn new(count: u64, window_us: u64, burst: Option<u64>, label: &str) -> Self {
        let interval_us = window_us.div_ceil(count) as i64;
        let burst = burst.unwrap_or(count) as i64;
        Limit {
            window_us: window_us as i64,
            count: count as i64,
            interval_us,
            tolerance_us: (burst - 1) * interval_us,
            label: label.to_string(),
        }
    }
}

/// What a rule asks of each of its identities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub algorithm: Algorithm,
    pub limits: Vec<Limit>,
    /// Least time between two charged events of an identity; 0 for none.
    pub spacing_us: i64,
    /// Whether rejected attempts are charged too (see [`Rule::charges`]).
    pub count_rejected: bool,
}

/// A window in the largest unit that divides it: `1h`, `15m`, `10s`, `250ms`, `7us`.
fn compact_window(us: i64) -> String {
    for (unit, name) in [
        (3_600_000_000, "h"),
        (60_000_000, "m"),
        (1_000_000, "s"),
        (1_000, "ms"),
    ] {
        if us % unit == 0 {
            return format!("{}{name}", us / unit);
        }
    }
    format!("{us}us")
}

/// The `limit` index a failed check reports when `min_spacing` binds.
pub const SPACING: usize = usize::MAX;

impl Rule {
    /// The rule's part of its identities' key names: the algorithm's short name and, where the
    /// state holds numbers per limit (gcra, fixed_window), each limit's window (`gcra.1m.1h`).
    /// A state of another shape read as absent: two configs of one rule with different limits
    /// (a rolling deploy) each reset the other's state on every call, and neither limit held
    /// (found by review: 20 admitted against 5/min). With the windows in the name each keeps
    /// its own, and a changed window starts afresh, as a changed algorithm does.
    pub fn key_part(&self) -> String {
        let base = self.algorithm.key_part();
        if self.algorithm == Algorithm::SlidingLog {
            return base.to_string();
        }
        let mut part = base.to_string();
        for l in &self.limits {
            part.push('.');
            part.push_str(&compact_window(l.window_us));
        }
        part
    }

    /// How long an identity's state matters after its last charge: every key of this rule
    /// expires no later than this after its last use.
    ///
    /// - sliding_log and fixed_window: the longest window (or `min_spacing` if longer);
    /// - gcra: the longest `burst × interval` (the time a full debt takes to clear), or
    ///   `min_spacing` if longer.
    pub fn horizon_us(&self) -> i64 {
        let limits = self.limits.iter().map(|l| match self.algorithm {
            Algorithm::Gcra => l.tolerance_us + l.interval_us,
            _ => l.window_us,
        });
        limits.chain([self.spacing_us, 1]).max().unwrap_or(1)
    }

    /// Most entries a sliding log keeps: the largest limit (one, for a spacing-only rule).
    pub fn log_cap(&self) -> i64 {
        self.limits.iter().map(|l| l.count).max().unwrap_or(1)
    }

    /// Whether an event is charged to this rule's identities, given whether the event was
    /// accepted and whether this rule's own checks all passed.
    ///
    /// A rule charges the events it lets through: accepted overall *and* passed by this rule (a
    /// shadow rule that would have rejected an event does not charge it, so its state stays what
    /// enforcing it would give). With `count_rejected`, it charges every attempt it sees,
    /// whatever the outcome: its limits then count attempts, so an identity that keeps trying
    /// while limited stays limited until it slows down.
    pub fn charges(&self, accepted: bool, passed: bool) -> bool {
        (accepted && passed) || self.count_rejected
    }
}

/// The verdict of one identity's check: `retry_us == 0` passes; otherwise the time until it
/// would pass (if nothing else is charged meanwhile) and the limit that binds last (an index
/// into `Rule::limits`, or [`SPACING`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    pub retry_us: i64,
    pub limit: usize,
}

impl Check {
    pub const PASS: Check = Check {
        retry_us: 0,
        limit: 0,
    };

    pub fn passed(&self) -> bool {
        self.retry_us == 0
    }

    /// The later of two verdicts: an event passes when every check does. Ties keep `self`.
    pub fn and(self, other: Check) -> Check {
        if other.retry_us > self.retry_us {
            other
        } else {
            self
        }
    }
}

/// How much room an identity has left under a rule at some instant: the limit with the least
/// (`remaining` events could go at once; 0 when it is full), and in how long it is whole
/// again (µs: the window empty, the bucket full). What a synchronous caller is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub remaining: i64,
    /// An index into `Rule::limits`, or [`SPACING`].
    pub limit: usize,
    pub reset_us: i64,
}

impl Room {
    /// No limit at all (a rule with none, before `min_spacing` is looked at).
    pub const UNLIMITED: Room = Room {
        remaining: i64::MAX,
        limit: SPACING,
        reset_us: 0,
    };

    pub fn of(remaining: i64, limit: usize, reset_us: i64) -> Room {
        Room {
            remaining: remaining.max(0),
            limit,
            reset_us: reset_us.max(0),
        }
    }

    /// The one with less room; ties keep `self`.
    pub fn tighter(self, other: Room) -> Room {
        if other.remaining < self.remaining {
            other
        } else {
            self
        }
    }
}

/// `min_spacing`'s room: one at once when the last charge is far enough back, none until it is.
pub fn spacing_room(last_us: Option<i64>, now_us: i64, spacing_us: i64) -> Room {
    if spacing_us <= 0 {
        return Room::UNLIMITED;
    }
    match spacing_check(last_us, now_us, spacing_us) {
        Check::PASS => Room::of(1, SPACING, 0),
        c => Room::of(0, SPACING, c.retry_us),
    }
}

/// `min_spacing` for a check of `cost` events. A check of 0 (one that charges nothing: an Envoy
/// descriptor's `hits_addend` of 0) asks whether a count is already past its limit, as under
/// `count_rejected`; min_spacing counts nothing, so it never refuses one.
pub fn spacing_check_n(last_us: Option<i64>, now_us: i64, spacing_us: i64, cost: i64) -> Check {
    if cost == 0 {
        return Check::PASS;
    }
    spacing_check(last_us, now_us, spacing_us)
}

/// `min_spacing` against the last charged event of an identity.
pub fn spacing_check(last_us: Option<i64>, now_us: i64, spacing_us: i64) -> Check {
    match last_us {
        Some(last) if spacing_us > 0 && now_us - last < spacing_us => Check {
            retry_us: last + spacing_us - now_us,
            limit: SPACING,
        },
        _ => Check::PASS,
    }
}

/// One identity's state under one rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Log(Vec<i64>),
    Gcra(gcra::State),
    Fixed(fixed_window::State),
}

impl State {
    pub fn empty(rule: &Rule) -> Self {
        match rule.algorithm {
            Algorithm::SlidingLog => State::Log(Vec::new()),
            Algorithm::Gcra => State::Gcra(gcra::State::empty(rule)),
            Algorithm::FixedWindow => State::Fixed(fixed_window::State::empty(rule)),
        }
    }

    /// Drops what no longer matters at `now` (a sliding log's old entries).
    pub fn trim(&mut self, now_us: i64, rule: &Rule) {
        if let State::Log(log) = self {
            sliding_log::trim(log, now_us, rule);
        }
    }

    pub fn check(&self, now_us: i64, rule: &Rule) -> Check {
        self.check_n(now_us, rule, 1)
    }

    /// Whether `cost` more events fit at `now`.
    pub fn check_n(&self, now_us: i64, rule: &Rule, cost: i64) -> Check {
        match self {
            State::Log(log) => sliding_log::check_n(log, now_us, rule, cost),
            State::Gcra(s) => gcra::check_n(s, now_us, rule, cost),
            State::Fixed(s) => fixed_window::check_n(s, now_us, rule, cost),
        }
    }

    /// The room left at `now`.
    pub fn room(&self, now_us: i64, rule: &Rule) -> Room {
        match self {
            State::Log(log) => sliding_log::room(log, now_us, rule),
            State::Gcra(s) => gcra::room(s, now_us, rule),
            State::Fixed(s) => fixed_window::room(s, now_us, rule),
        }
    }

    /// Milliseconds this state is worth keeping after `now`: the time to live `admit.lua` gives
    /// its key when it saves it (a sliding log: the rule's horizon).
    pub fn ttl_ms(&self, now_us: i64, rule: &Rule) -> i64 {
        match self {
            State::Log(_) => ((rule.horizon_us() + 999) / 1000).max(1),
            State::Gcra(s) => gcra::ttl_ms(s, now_us, rule),
            State::Fixed(s) => fixed_window::ttl_ms(s, now_us, rule),
        }
    }

    /// Charges one event; `passed` says whether the rule let it through (a gcra charge for a
    /// rejected attempt is capped, see [`gcra::charge`]).
    pub fn charge(&mut self, now_us: i64, rule: &Rule, passed: bool) {
        self.charge_n(now_us, rule, passed, 1)
    }

    /// Charges `cost` events at `now`.
    pub fn charge_n(&mut self, now_us: i64, rule: &Rule, passed: bool, cost: i64) {
        match self {
            State::Log(log) => sliding_log::charge_n(log, now_us, rule, cost),
            State::Gcra(s) => gcra::charge_n(s, now_us, rule, passed, cost),
            State::Fixed(s) => fixed_window::charge_n(s, now_us, rule, cost),
        }
    }
}

/// A rule as the engine runs it.
#[derive(Debug, Clone)]
pub struct EngineRule {
    pub rule: Rule,
    /// Shadow rules are decided and charged as usual but never reject.
    pub shadow: bool,
}

/// The decision about one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: bool,
    /// For a rejected event: the latest-binding failed check of an enforcing rule, as
    /// (rule index, check index in the event, the check).
    pub binding: Option<(usize, usize, Check)>,
    /// Per rule: whether all of the event's identities passed it.
    pub passed: Vec<bool>,
}

/// Every rule and every identity's state, in memory: the composition the admission script
/// runs in Redis, used by tests as the model.
#[derive(Debug, Clone)]
pub struct Engine {
    pub rules: Vec<EngineRule>,
    pub states: HashMap<(usize, String), State>,
}

impl Engine {
    pub fn new(rules: Vec<EngineRule>) -> Self {
        Engine {
            rules,
            states: HashMap::new(),
        }
    }

    /// Whether `cost` more events of `identity` fit rule `r` at `now` (its state created empty
    /// if new, and trimmed to `now`).
    pub(crate) fn check_at(&mut self, now_us: i64, r: usize, identity: &str, cost: i64) -> Check {
        let rule = &self.rules[r].rule;
        let state = self
            .states
            .entry((r, identity.to_string()))
            .or_insert_with(|| State::empty(rule));
        state.trim(now_us, rule);
        state.check_n(now_us, rule, cost)
    }

    /// After a refused request's charges, the check that binds it, as (rule, check index,
    /// check): a count_rejected rule charged the attempt too, so its check is made again, its
    /// room now coming later than its first answer said (found by review: a client waiting
    /// exactly retry_after was refused every time); the others keep their first answer.
    /// `checks` are (rule, identity, first answer, units it is decided for), None for a check
    /// not made (a leased token spent). `lua/admission.lua`'s `rebind` is the same.
    pub(crate) fn rebind<'a>(
        &mut self,
        now_us: i64,
        checks: impl Iterator<Item = Option<(usize, &'a str, Check, i64)>>,
    ) -> Option<(usize, usize, Check)> {
        let mut best: Option<(usize, usize, Check)> = None;
        for (x, made) in checks.enumerate() {
            let Some((r, identity, first, cost)) = made else {
                continue;
            };
            let rule = &self.rules[r];
            if rule.shadow {
                continue;
            }
            let check = if rule.rule.count_rejected {
                self.check_at(now_us, r, identity, cost)
            } else {
                first
            };
            if !check.passed() && best.is_none_or(|(_, _, b)| check.retry_us > b.retry_us) {
                best = Some((r, x, check));
            }
        }
        best
    }

    /// Decides one event at `now` whose identities are `checks` (rule index, identity), then
    /// charges it: every check first, then the charges.
    pub fn admit(&mut self, now_us: i64, checks: &[(usize, String)]) -> Verdict {
        let mut passed = vec![true; self.rules.len()];
        let mut binding: Option<(usize, usize, Check)> = None;
        let mut results = Vec::with_capacity(checks.len());
        for (i, (r, identity)) in checks.iter().enumerate() {
            let check = self.check_at(now_us, *r, identity, 1);
            let rule = &self.rules[*r];
            if !check.passed() {
                passed[*r] = false;
                if !rule.shadow && binding.is_none_or(|(_, _, b)| check.retry_us > b.retry_us) {
                    binding = Some((*r, i, check));
                }
            }
            results.push(check);
        }
        let accepted = binding.is_none();
        for (r, identity) in checks {
            let rule = &self.rules[*r].rule;
            if rule.charges(accepted, passed[*r]) {
                let state = self
                    .states
                    .get_mut(&(*r, identity.clone()))
                    .expect("loaded");
                state.charge(now_us, rule, accepted && passed[*r]);
            }
        }
        if !accepted {
            let made = checks
                .iter()
                .zip(&results)
                .map(|((r, identity), first)| Some((*r, identity.as_str(), *first, 1)));
            binding = self.rebind(now_us, made).or(binding);
        }
        Verdict {
            accepted,
            binding,
            passed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_part_names_the_windows_where_the_state_is_per_limit() {
        let rule = |algorithm, windows: &[u64]| Rule {
            algorithm,
            limits: windows
                .iter()
                .map(|&w| Limit::new(5, w, None, "l"))
                .collect(),
            spacing_us: 0,
            count_rejected: false,
        };
        let (m, h) = (60_000_000, 3_600_000_000);
        assert_eq!(rule(Algorithm::Gcra, &[m, h]).key_part(), "gcra.1m.1h");
        assert_eq!(
            rule(Algorithm::FixedWindow, &[250_000, 7]).key_part(),
            "fw.250ms.7us"
        );
        assert_eq!(rule(Algorithm::SlidingLog, &[m, h]).key_part(), "log");
        // One more limit, or the same in another order: another key.
        assert_ne!(
            rule(Algorithm::Gcra, &[m]).key_part(),
            rule(Algorithm::Gcra, &[m, h]).key_part()
        );
        assert_ne!(
            rule(Algorithm::Gcra, &[h, m]).key_part(),
            rule(Algorithm::Gcra, &[m, h]).key_part()
        );
    }

    /// A rule of `(count, window_us)` limits (also for the algorithms' own tests).
    pub(crate) fn rule(algorithm: Algorithm, limits: &[(u64, u64)], spacing_us: i64) -> Rule {
        Rule {
            algorithm,
            limits: limits
                .iter()
                .map(|&(n, w)| Limit::new(n, w, None, "l"))
                .collect(),
            spacing_us,
            count_rejected: false,
        }
    }

    #[test]
    fn horizons_bound_each_algorithms_state() {
        let log = rule(
            Algorithm::SlidingLog,
            &[(10, 1_000_000), (120, 60_000_000)],
            0,
        );
        assert_eq!(log.horizon_us(), 60_000_000);
        assert_eq!(log.log_cap(), 120);
        let spaced = rule(Algorithm::FixedWindow, &[(10, 1_000_000)], 5_000_000);
        assert_eq!(spaced.horizon_us(), 5_000_000);
        let mut g = rule(Algorithm::Gcra, &[(10, 1_000_000)], 0);
        assert_eq!(g.horizon_us(), 1_000_000);
        g.limits[0] = Limit::new(10, 1_000_000, Some(30), "l");
        assert_eq!(g.horizon_us(), 3_000_000);
        assert_eq!(rule(Algorithm::SlidingLog, &[], 100).log_cap(), 1);
    }

    #[test]
    fn an_event_is_accepted_only_if_every_identity_has_room_and_rejected_ones_charge_nothing() {
        let r = rule(Algorithm::SlidingLog, &[(2, 1_000_000)], 0);
        let mut e = Engine::new(vec![EngineRule {
            rule: r,
            shadow: false,
        }]);
        let both =
            |ip: &str, user: &str| vec![(0, format!("ip={ip}")), (0, format!("user={user}"))];
        assert!(e.admit(0, &both("a", "u")).accepted);
        assert!(e.admit(1, &both("a", "v")).accepted);
        // ip a is full: rejected, and user w is not charged for it.
        let v = e.admit(2, &both("a", "w"));
        assert!(!v.accepted);
        assert_eq!(v.binding.unwrap().1, 0);
        assert!(e.admit(3, &both("b", "w")).accepted);
        assert!(e.admit(4, &both("c", "w")).accepted);
        assert!(!e.admit(5, &both("d", "w")).accepted);
    }

    #[test]
    fn a_shadow_rule_never_rejects_but_reports_and_keeps_its_own_state() {
        let mut e = Engine::new(vec![EngineRule {
            rule: rule(Algorithm::Gcra, &[(1, 1_000_000)], 0),
            shadow: true,
        }]);
        let id = vec![(0, "s".to_string())];
        assert_eq!(e.admit(0, &id).passed, vec![true]);
        let v = e.admit(10, &id);
        assert!(v.accepted);
        assert_eq!(v.passed, vec![false]);
        // The would-be rejection charged nothing: the next token comes at 1 s, not 2 s.
        assert_eq!(e.admit(1_000_000, &id).passed, vec![true]);
    }

    /// Per algorithm, an engine of one count_rejected rule of 2/s that took two at once, asked
    /// (`ask`: None when it accepts, else its retry_after in µs) at 100 ms and again after each
    /// retry_after it answers: how many times it refused before it accepted (at most 5).
    pub(crate) fn refusals_waiting_retry_after(
        ask: impl Fn(&mut Engine, i64) -> Option<i64>,
    ) -> Vec<(Algorithm, usize)> {
        [
            Algorithm::SlidingLog,
            Algorithm::Gcra,
            Algorithm::FixedWindow,
        ]
        .into_iter()
        .map(|algorithm| {
            let mut r = rule(algorithm, &[(2, 1_000_000)], 0);
            r.count_rejected = true;
            let mut e = Engine::new(vec![EngineRule {
                rule: r,
                shadow: false,
            }]);
            assert_eq!(ask(&mut e, 0), None);
            assert_eq!(ask(&mut e, 1), None);
            let (mut t, mut refused) = (100_000, 0);
            while let Some(retry_us) = ask(&mut e, t) {
                refused += 1;
                if refused == 5 {
                    break;
                }
                t += retry_us;
            }
            (algorithm, refused)
        })
        .collect()
    }

    #[test]
    fn with_count_rejected_a_client_waiting_retry_after_finds_room() {
        // Refused, and charged: each wait of retry_after then finds room (the retry was the
        // room before the charge: a client waiting it was refused every time).
        let id = vec![(0, "s".to_string())];
        for (algorithm, refused) in refusals_waiting_retry_after(|e, t| {
            let v = e.admit(t, &id);
            v.binding.map(|(_, _, check)| check.retry_us)
        }) {
            assert_eq!(refused, 1, "{algorithm:?}");
        }
    }
}
