//! Synchronous admission in one call per batch of requests (`decide.lua`): decide, charge,
//! lease.

use super::admit::push_rules;
use super::{Reply, Scripts};
use crate::admission::{Ask, CheckOutcome, Room, SyncVerdict, SPACING};
use crate::config::InboundRule;
use crate::error::Result;
use redis::aio::ConnectionLike;
use redis::Arg;

/// One check of a synchronous request: an identity under a rule.
pub struct DecideCheck<'a> {
    /// The rule's index in the rules passed with the call.
    pub rule: usize,
    /// The key field's index in the rule's `key`.
    pub field: usize,
    /// The identity's limiter key (`InboundKeys::identity`, the stream flow's own).
    pub key: &'a str,
    pub ask: Ask,
}

/// Converts a limit index from the script's (1-based, 0 for min_spacing).
fn limit_index(lim: i64) -> usize {
    if lim <= 0 {
        SPACING
    } else {
        lim as usize - 1
    }
}

/// One request of a `decide` batch.
pub struct DecideRequest<'a> {
    pub checks: Vec<DecideCheck<'a>>,
    /// Events it counts for (>= 1).
    pub cost: i64,
}

/// The rules as `decide.lua` takes them, made once for the calls that share them (a worker's,
/// for its life): their arguments, the digest its function keeps them by, and each rule's gap
/// between fetch turns.
pub struct DecideRules {
    args: redis::Cmd,
    digest: String,
    /// Per rule, µs; 0 for a rule without a lease (tests decide such: a gap of 0 books a turn
    /// at now, which reads as none).
    turn_gaps_us: Vec<i64>,
}

impl DecideRules {
    /// `rules` read with `log_entries_per_read` (admit.lua's: when a sliding log is read by
    /// entry).
    pub fn new(rules: &[InboundRule], log_entries_per_read: i64) -> Self {
        let mut args = redis::Cmd::new();
        args.arg(log_entries_per_read);
        push_rules(&mut args, rules);
        DecideRules {
            digest: digest(&args),
            args,
            turn_gaps_us: rules
                .iter()
                .map(|r| {
                    r.lease
                        .as_ref()
                        .map_or(0, |l| l.turn_gap().as_micros() as i64)
                })
                .collect(),
        }
    }
}

impl Scripts {
    /// Decides a batch of requests, in order, in one call (all their keys in one slot);
    /// returns Redis's clock and a verdict per request. See `lua/decide.lua`.
    pub async fn decide<C: ConnectionLike>(
        &self,
        con: &mut C,
        rules: &DecideRules,
        requests: &[DecideRequest<'_>],
    ) -> Result<(i64, Vec<SyncVerdict>)> {
        let keys: Vec<&str> = requests
            .iter()
            .flat_map(|r| r.checks.iter().map(|c| c.key))
            .collect();
        let args = |full: bool| {
            let mut args = redis::Cmd::new();
            args.arg(&rules.digest).arg(u8::from(full));
            if full {
                for a in rules.args.args_iter() {
                    if let Arg::Simple(a) = a {
                        args.arg(a);
                    }
                }
            }
            args.arg(requests.len());
            for r in requests {
                args.arg(r.cost).arg(r.checks.len());
                for c in &r.checks {
                    args.arg(c.rule + 1).arg(c.field + 1);
                    match c.ask {
                        Ask::Decide => args.arg(0),
                        Ask::Covered => args.arg(-1),
                        Ask::Lease(n) => args.arg(n.max(1)).arg(rules.turn_gaps_us[c.rule]),
                    };
                }
            }
            args
        };
        let reply = self.decide.call(con, &keys, args).await?;
        let mut v = Reply::new("decide", reply)?;
        let now_us = v.int()?;
        let mut verdicts = Vec::with_capacity(requests.len());
        for r in requests {
            let accepted = v.int()? == 1;
            let retry_us = v.int()?;
            let binding = v.int()?;
            let lim = v.int()?;
            let mut outcomes = Vec::with_capacity(r.checks.len());
            for c in &r.checks {
                let passed = v.int()? == 1;
                let remaining = v.int()?;
                let limit = limit_index(v.int()?);
                let reset_us = v.int()?;
                let granted = v.int()?;
                let lease_us = v.int()?;
                let turn_us = v.int()?;
                outcomes.push(CheckOutcome {
                    passed,
                    room: (c.ask != Ask::Covered).then_some(Room {
                        remaining: if remaining < 0 { i64::MAX } else { remaining },
                        limit,
                        reset_us,
                    }),
                    granted,
                    lease_us,
                    turn_in_us: if turn_us > 0 { turn_us - now_us } else { 0 },
                });
            }
            verdicts.push(SyncVerdict {
                accepted,
                retry_us,
                binding: (binding > 0).then(|| (binding as usize - 1, limit_index(lim))),
                checks: outcomes,
            });
        }
        Ok((now_us, verdicts))
    }
}

/// The SHA1 of a call's rule arguments, each length-prefixed (so that no two lists read alike):
/// what `decide.lua`'s function keeps them by.
fn digest(rule_args: &redis::Cmd) -> String {
    let mut text = String::new();
    for a in rule_args.args_iter() {
        if let Arg::Simple(a) = a {
            text.push_str(&format!("{}:", a.len()));
            text.push_str(&String::from_utf8_lossy(a));
        }
    }
    redis::Script::new(&text).get_hash().to_string()
}
