//! Poison: outbound events delivered more than `max_deliveries` times (each delivery's worker
//! died or stalled on them) are ended without being decided again. Each route's undispatched
//! decision is voided first (`lua/void.lua`), so that no sleeping worker can still dispatch the
//! event; then what was on record before decides the end (`verdict`).

use super::context::Context;
use super::outputs::{Finished, Rejection};
use crate::event::{OutboundEvent, Reason, Refused};
use crate::marker::Marker;
use crate::scripts::Voided;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// How a poison event ends, from what each of its routes had on record before voiding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Dispatched already: only acknowledge.
    Acknowledge,
    /// Its event id belongs to another entry (that owner).
    Duplicate { owner: String },
    /// Every route passed it over: reject it as before, with the shortest wait offered.
    Reject { retry_after_ms: i64 },
    /// Anything else: dead-letter it as delivered too often.
    DeadLetter,
}

/// The end of a poison event owned by `owner`, from `found` (one per route of its chain).
pub(crate) fn verdict(found: &[Voided], owner: &str) -> Verdict {
    let decisions: Vec<Option<Marker>> = found.iter().map(|v| Marker::parse(&v.decision)).collect();
    if decisions
        .iter()
        .any(|d| matches!(d, Some(Marker::Dispatched(_))))
    {
        return Verdict::Acknowledge;
    }
    if let Some(other) = found
        .iter()
        .find(|v| !v.owner.is_empty() && v.owner != owner)
    {
        return Verdict::Duplicate {
            owner: other.owner.clone(),
        };
    }
    let skipped: Option<Vec<i64>> = decisions
        .iter()
        .map(|d| match d {
            Some(Marker::Skipped(wait_us)) => Some(*wait_us),
            _ => None,
        })
        .collect();
    match skipped {
        Some(waits) if !waits.is_empty() => {
            let best = waits.into_iter().min().unwrap_or(0);
            Verdict::Reject {
                retry_after_ms: (best.max(0) as u64).div_ceil(1000) as i64,
            }
        }
        _ => Verdict::DeadLetter,
    }
}

/// Voids and ends `poison`; false if shutdown came first.
pub(crate) async fn settle(
    ctx: &Context,
    poison: Vec<OutboundEvent>,
    done: &mut Finished,
    stop: &CancellationToken,
) -> bool {
    let chains: Vec<Vec<usize>> = poison
        .iter()
        .map(|e| {
            ctx.cfg
                .outbound
                .chain(e.route)
                .iter()
                .map(|r| r.index)
                .collect()
        })
        .collect();
    let calls = poison.iter().zip(&chains).flat_map(|(e, chain)| {
        chain.iter().map(move |&route| async move {
            let keys = &ctx.cfg.outbound.route_at(route).keys;
            // void.lua answers for route keys of another kind itself (it was retried forever on
            // WRONGTYPE, the entry pending for good): no error of its is the key's fault.
            let voided = ctx.retry("void", stop, move || {
                let mut con = ctx.con.clone();
                async move {
                    ctx.scripts
                        .void(
                            &mut con,
                            keys,
                            (&e.stream, e.id()),
                            e.event_id.as_deref(),
                            ctx.marker_ttl_ms,
                        )
                        .await
                }
            });
            let voided = voided.await?;
            if voided.overwritten {
                let route = &ctx.cfg.outbound.route_at(route).name;
                warn!(entry = %e.id(), stream = %e.stream, %route, "the route's decision hash holds another kind of value: no decision there to void");
            }
            Some(voided)
        })
    });
    let found = futures_util::future::join_all(calls).await;
    let Some(mut found) = found.into_iter().collect::<Option<Vec<Voided>>>() else {
        return false;
    };
    let max = ctx.cfg.worker.max_deliveries;
    for (event, chain) in poison.into_iter().zip(chains) {
        let rest = found.split_off(chain.len());
        let mine = std::mem::replace(&mut found, rest);
        warn!(entry = %event.id(), stream = %event.stream, deliveries = event.deliveries, "poison entry");
        match verdict(&mine, &event.owner()) {
            Verdict::Acknowledge => done.ack_event(&event),
            Verdict::Duplicate { owner } => {
                let detail = format!(
                    "event id {:?} was already taken by entry {owner}",
                    event.event_id.as_deref().unwrap_or_default()
                );
                done.dead.push((
                    event.entry(),
                    Refused {
                        reason: Reason::Duplicate,
                        detail,
                    },
                ));
            }
            Verdict::Reject { retry_after_ms } => done.rejected.push(Rejection {
                event,
                reason: Reason::QueueFull,
                detail: "no route could take it within its wait".into(),
                retry_after_ms,
            }),
            Verdict::DeadLetter => {
                let detail = format!(
                    "delivered {} times, more than worker.max_deliveries ({max})",
                    event.deliveries
                );
                done.dead.push((
                    event.entry(),
                    Refused {
                        reason: Reason::TooManyDeliveries,
                        detail,
                    },
                ));
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: &str = "1-0@in";

    fn v(found: &[(&str, &str)]) -> Verdict {
        let found: Vec<Voided> = found
            .iter()
            .map(|(d, o)| Voided {
                decision: d.to_string(),
                owner: o.to_string(),
                overwritten: false,
            })
            .collect();
        verdict(&found, ME)
    }

    #[test]
    fn a_dispatched_event_is_only_acknowledged() {
        assert_eq!(v(&[("x5", ""), ("d7", "")]), Verdict::Acknowledge);
    }

    #[test]
    fn an_id_owned_by_another_entry_makes_it_a_duplicate() {
        assert_eq!(
            v(&[("", "2-0@in")]),
            Verdict::Duplicate {
                owner: "2-0@in".into()
            }
        );
        assert_eq!(v(&[("s9:10", ME)]), Verdict::DeadLetter);
    }

    #[test]
    fn passed_over_everywhere_is_rejected_with_the_shortest_wait() {
        assert_eq!(
            v(&[("x2500", ""), ("x1001", "")]),
            Verdict::Reject { retry_after_ms: 2 }
        );
    }

    #[test]
    fn a_sleeping_or_undecided_event_is_dead_lettered() {
        assert_eq!(v(&[("s9:10", "")]), Verdict::DeadLetter);
        assert_eq!(v(&[("", "")]), Verdict::DeadLetter);
        assert_eq!(v(&[("x5", ""), ("", "")]), Verdict::DeadLetter);
    }
}
