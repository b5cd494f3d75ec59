//! Synchronous decisions in memory: one request of any cost, decided now against every check,
//! charged, and its leases granted, with the room left reported per check. The model
//! `lua/decide.lua` is held to by `tests/admit_differential.rs`; the stream flow's
//! [`Engine::admit`] is its sibling for events.

use super::{fixed_window, Algorithm, Check, Engine, Room};

/// What a synchronous caller asks of one check (one identity under one rule) besides the
/// decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// Check and charge it.
    Decide,
    /// The caller spent a token it leased: neither checked nor charged.
    Covered,
    /// Check and charge it for the request's cost less `paid`, then, if the request is
    /// accepted, lease up to `more` tokens (charged now; gcra and fixed_window only).
    Lease {
        more: i64,
        /// Tokens of the request the caller spent from what its lease still held (fewer than
        /// the cost): already charged when leased, so neither checked nor charged again. A
        /// request costing more than a lease holds is so refused only when the lease and the
        /// identity's room together lack its cost.
        paid: i64,
        /// Redis's clock (µs) when the leases they came from end: decided at or after it, the
        /// request pays nothing from them (they are wasted), so a token is never spent past
        /// its lease's end however late the call runs (a fixed window's lease ends with its
        /// window; a Redis that stalled a second would otherwise admit with tokens charged
        /// a second before their ttl).
        paid_until_us: i64,
    },
}

impl Ask {
    /// What the check is decided and charged for, of a request of `cost`, at `now_us`.
    pub fn units(self, cost: i64, now_us: i64) -> i64 {
        match self {
            Ask::Lease {
                paid,
                paid_until_us,
                ..
            } if now_us < paid_until_us => cost - paid,
            _ => cost,
        }
    }
}

/// One check's outcome in a synchronous decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckOutcome {
    pub passed: bool,
    /// The room left after the request (and its lease); `None` for a covered check.
    pub room: Option<Room>,
    /// Tokens leased.
    pub granted: i64,
    /// How long they may be spent, µs: a fixed window's time to its end; 0 for no bound but
    /// the caller's lease ttl.
    pub lease_us: i64,
    /// A lease asked for came back short or was refused: µs from the decision until the
    /// caller's next fetch turn on this identity, which `lua/decide.lua` books (0: none). A
    /// pacing hint the script keeps where it runs as a Redis Function, not a limit: the
    /// engine here books none.
    pub turn_in_us: i64,
}

/// A synchronous decision (`lua/decide.lua`; [`Engine::decide`] in memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncVerdict {
    /// Redis's clock when it was decided (µs).
    pub now_us: i64,
    pub accepted: bool,
    /// 0 if accepted; else µs until the binding check would pass.
    pub retry_us: i64,
    /// The binding check (an index into the request's checks) and its limit (an index into
    /// its rule's limits, or [`super::SPACING`]).
    pub binding: Option<(usize, usize)>,
    pub checks: Vec<CheckOutcome>,
}

impl Engine {
    /// Decides one synchronous request of `cost` events at `now` (what `lua/decide.lua` does):
    /// every check first, then the charges, then the leases asked for, then each check's room.
    /// A `cost` of 0 is a check that charges nothing (an Envoy descriptor's `hits_addend` of
    /// 0), refused only where a count is already past its limit (as `count_rejected` leaves
    /// it); its checks ask nothing else ([`Ask::Decide`]).
    pub fn decide(
        &mut self,
        now_us: i64,
        checks: &[(usize, String, Ask)],
        cost: i64,
    ) -> SyncVerdict {
        let mut rule_passed = vec![true; self.rules.len()];
        let mut passed = vec![true; checks.len()];
        let mut best: Option<(usize, Check)> = None;
        let mut first: Vec<Option<Check>> = vec![None; checks.len()];
        for (x, (r, identity, ask)) in checks.iter().enumerate() {
            if *ask == Ask::Covered {
                continue;
            }
            let check = self.check_at(now_us, *r, identity, ask.units(cost, now_us));
            first[x] = Some(check);
            let rule = &self.rules[*r];
            if !check.passed() {
                passed[x] = false;
                rule_passed[*r] = false;
                if !rule.shadow && best.is_none_or(|(_, b)| check.retry_us > b.retry_us) {
                    best = Some((x, check));
                }
            }
        }
        let accepted = best.is_none();
        let mut outcomes = Vec::with_capacity(checks.len());
        for (r, identity, ask) in checks {
            if *ask == Ask::Covered {
                continue;
            }
            let rule = &self.rules[*r].rule;
            let ok = accepted && rule_passed[*r];
            let units = ask.units(cost, now_us);
            // A check of cost 0 charges nothing, not even min_spacing's last event.
            if units > 0 && rule.charges(accepted, rule_passed[*r]) {
                let state = self
                    .states
                    .get_mut(&(*r, identity.clone()))
                    .expect("loaded");
                state.charge_n(now_us, rule, ok, units);
            }
        }
        if !accepted {
            let made = checks
                .iter()
                .zip(&first)
                .map(|((r, identity, ask), first)| {
                    first.map(|c| (*r, identity.as_str(), c, ask.units(cost, now_us)))
                });
            if let Some((_, x, check)) = self.rebind(now_us, made) {
                best = Some((x, check));
            }
        }
        for (x, (r, identity, ask)) in checks.iter().enumerate() {
            if *ask == Ask::Covered {
                outcomes.push(CheckOutcome {
                    passed: true,
                    room: None,
                    granted: 0,
                    lease_us: 0,
                    turn_in_us: 0,
                });
                continue;
            }
            let rule = &self.rules[*r].rule;
            let state = self
                .states
                .get_mut(&(*r, identity.clone()))
                .expect("loaded");
            let (mut granted, mut lease_us) = (0, 0);
            if let (true, Ask::Lease { more, .. }) = (accepted, ask) {
                granted = (*more).min(state.room(now_us, rule).remaining);
                if granted > 0 {
                    state.charge_n(now_us, rule, true, granted);
                }
                if rule.algorithm == Algorithm::FixedWindow {
                    lease_us = fixed_window::lease_span(now_us, rule);
                }
            }
            outcomes.push(CheckOutcome {
                passed: passed[x],
                room: Some(state.room(now_us, rule)),
                granted,
                lease_us,
                turn_in_us: 0,
            });
        }
        SyncVerdict {
            now_us,
            accepted,
            retry_us: best.map_or(0, |(_, c)| c.retry_us),
            binding: best.map(|(x, c)| (x, c.limit)),
            checks: outcomes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{refusals_waiting_retry_after, rule};
    use super::super::EngineRule;
    use super::*;

    #[test]
    fn a_check_of_cost_0_charges_nothing_and_is_refused_only_past_the_limit() {
        // 2 a second, and min_spacing 100 ms; refused attempts counted.
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::Gcra,
            Algorithm::FixedWindow,
        ] {
            let mut r = rule(algorithm, &[(2, 1_000_000)], 100_000);
            r.count_rejected = true;
            let mut e = Engine::new(vec![EngineRule {
                rule: r,
                shadow: false,
            }]);
            let id = vec![(0, "s".to_string(), Ask::Decide)];
            let mut at = |t: i64, cost: i64| {
                let v = e.decide(t, &id, cost);
                (v.accepted, v.checks[0].room.expect("decided").remaining)
            };
            let case = format!("{algorithm:?}");
            assert_eq!(
                at(0, 0),
                (true, 1),
                "{case}: min_spacing's room is one at a time"
            );
            assert_eq!(at(0, 1), (true, 0), "{case}");
            // Within min_spacing: refused to a cost of 1, not to a check of 0, which moves
            // nothing (else the event at 100 ms would be refused).
            assert_eq!(at(50_000, 0), (true, 0), "{case}");
            assert_eq!(at(100_000, 1), (true, 0), "{case}: two of 2, at the limit");
            assert_eq!(
                at(200_000, 0),
                (true, 0),
                "{case}: at the limit, not past it"
            );
            // A third is refused and counted: a fixed window's count is now past the limit,
            // which a check of 0 says. The others are full, never past it: a sliding log keeps
            // only the newest entries its largest count needs (exact for every check of 1 or
            // more), and a refused attempt's gcra debt stops at one full bucket.
            assert!(!at(300_000, 1).0, "{case}");
            let past = algorithm == Algorithm::FixedWindow;
            assert_eq!(at(400_000, 0), (!past, 0), "{case}: past the limit");
        }
    }

    #[test]
    fn with_count_rejected_a_caller_waiting_retry_after_finds_room() {
        let id = vec![(0, "s".to_string(), Ask::Decide)];
        for (algorithm, refused) in refusals_waiting_retry_after(|e, t| {
            let v = e.decide(t, &id, 1);
            (!v.accepted).then_some(v.retry_us)
        }) {
            assert_eq!(refused, 1, "{algorithm:?}");
        }
    }
}
