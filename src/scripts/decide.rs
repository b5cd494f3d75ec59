//! Synchronous admission in one call per request (`decide.lua`): decide, charge, lease.

use super::admit::push_rules;
use super::{Reply, Scripts};
use crate::admission::{Ask, CheckOutcome, Room, SyncVerdict, SPACING};
use crate::config::InboundRule;
use crate::error::Result;
use redis::aio::ConnectionLike;
use redis::Value;

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

impl Scripts {
    /// Decides one request of `cost` events; returns Redis's clock and the verdict. See
    /// `lua/decide.lua`.
    pub async fn decide<C: ConnectionLike>(
        &self,
        con: &mut C,
        rules: &[InboundRule],
        log_entries_per_read: i64,
        checks: &[DecideCheck<'_>],
        cost: i64,
    ) -> Result<(i64, SyncVerdict)> {
        let mut call = self.decide.prepare_invoke();
        call.arg(log_entries_per_read);
        push_rules(&mut call, rules);
        call.arg(cost).arg(checks.len());
        for c in checks {
            call.key(c.key);
            let ask = match c.ask {
                Ask::Decide => 0,
                Ask::Covered => -1,
                Ask::Lease(n) => n.max(1),
            };
            call.arg(c.rule + 1).arg(c.field + 1).arg(ask);
        }
        let reply: Value = call.invoke_async(con).await?;
        let mut v = Reply::new("decide", reply)?;
        let now_us = v.int()?;
        let accepted = v.int()? == 1;
        let retry_us = v.int()?;
        let binding = v.int()?;
        let lim = v.int()?;
        let mut outcomes = Vec::with_capacity(checks.len());
        for c in checks {
            let passed = v.int()? == 1;
            let remaining = v.int()?;
            let limit = limit_index(v.int()?);
            let reset_us = v.int()?;
            let granted = v.int()?;
            let lease_us = v.int()?;
            outcomes.push(CheckOutcome {
                passed,
                room: (c.ask != Ask::Covered).then_some(Room {
                    remaining: if remaining < 0 { i64::MAX } else { remaining },
                    limit,
                    reset_us,
                }),
                granted,
                lease_us,
            });
        }
        Ok((
            now_us,
            SyncVerdict {
                accepted,
                retry_us,
                binding: (binding > 0).then(|| (binding as usize - 1, limit_index(lim))),
                checks: outcomes,
            },
        ))
    }
}
