//! Synchronous admission in one call per batch of requests (`decide.lua`): decide, charge,
//! lease.

use super::admit::ScriptRules;
use super::{Reply, Scripts};
use crate::admission::{Ask, CheckOutcome, Room, SyncVerdict, SPACING};
use crate::error::Result;
use redis::aio::ConnectionLike;

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
    /// Events it counts for (>= 1; 0 for a check that charges nothing).
    pub cost: i64,
}

impl Scripts {
    /// Decides a batch of requests, in order, in one call (all their keys in one slot);
    /// returns Redis's clock and a verdict per request. See `lua/decide.lua`.
    pub async fn decide<C: ConnectionLike>(
        &self,
        con: &mut C,
        rules: &ScriptRules,
        requests: &[DecideRequest<'_>],
    ) -> Result<(i64, Vec<SyncVerdict>)> {
        let keys: Vec<&str> = requests
            .iter()
            .flat_map(|r| r.checks.iter().map(|c| c.key))
            .collect();
        let args = |full: bool| {
            let mut args = redis::Cmd::new();
            rules.push(&mut args, full);
            args.arg(requests.len());
            for r in requests {
                args.arg(r.cost).arg(r.checks.len());
                for c in &r.checks {
                    args.arg(c.rule + 1).arg(c.field + 1);
                    match c.ask {
                        Ask::Decide => args.arg(0),
                        Ask::Covered => args.arg(-1),
                        Ask::Lease {
                            more,
                            paid,
                            paid_until_us,
                        } => args
                            .arg(more.max(1))
                            .arg(rules.turn_gaps_us[c.rule])
                            .arg(paid)
                            .arg(paid_until_us),
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
                now_us,
                accepted,
                retry_us,
                binding: (binding > 0).then(|| (binding as usize - 1, limit_index(lim))),
                checks: outcomes,
            });
        }
        Ok((now_us, verdicts))
    }
}
