//! Inbound admission in one call per batch (`admit.lua`): decide, record, and write the
//! accepted and rejected events where the slot allows.

use super::{push_fields, reply, Args, KeyIndex, Reply, Scripts};
use crate::config::InboundRule;
use crate::error::{Error, Result};
use crate::event::Fields;
use crate::keys::InboundKeys;
use redis::aio::ConnectionLike;

/// Where an `admit` call writes, and how long what it records lasts.
pub struct AdmitTargets<'a> {
    /// The keys of the partition the call decides in.
    pub keys: &'a InboundKeys,
    /// Whether the call writes accepted events to `keys.forward` itself: it may only when the
    /// stream shares the partition's slot, or Redis is not a cluster. `false`: the caller
    /// writes them (decision `a`), in a second call.
    pub forward: bool,
    /// Whether the call writes rejected events to `keys.rejected` itself (the same condition).
    /// `false`: the caller writes them, in a second call.
    pub rejected: bool,
    pub decision_ttl_ms: u64,
    /// Output streams are trimmed to about this many entries.
    pub max_len: u64,
    /// The consumer group of the input streams (for acknowledging).
    pub group: &'a str,
    /// Whether the call may acknowledge entries of an input stream (it shares the partition's
    /// slot, or Redis is not a cluster).
    pub acks: &'a (dyn Fn(&str) -> bool + Sync),
    /// An entry this old (µs) with no decision on record is not decided (`Admitted::Stale`).
    pub stale_us: i64,
}

/// What one command costs `admit.lua` in log entries read whole: in Lua a string costs by its
/// size (hashed byte by byte), a command by its count, and this is about where they cross (the
/// README's "Inbound admission" has the measurements). A one-limit log is read whole up to a cap
/// of 96 entries, one with three limits and min_spacing up to 240.
pub const LOG_ENTRIES_PER_READ: i64 = 48;

/// One inbound event offered to `admit`.
pub struct AdmitItem<'a> {
    /// `<entry id>@<input stream>`: the entry, its field in the decision hash.
    pub owner: &'a str,
    /// Its input stream and the milliseconds of its entry id.
    pub stream: &'a str,
    pub entry_ms: i64,
    /// The hash its decision is recorded in (`InboundKeys::decisions`).
    pub decisions: &'a str,
    /// Its identities' limiter keys: one per key field of each rule, rule by rule, in the
    /// order of `inbound.rules` and of each rule's `key` (how `event::inbound` finds them).
    pub identities: Vec<&'a str>,
    /// The forward entry's fields, written if it is accepted.
    pub fields: &'a Fields,
}

/// What `admit` said about one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admitted {
    /// Decided by this call: the recorded decision (see `event::inbound::Decision`) and one
    /// verdict per rule, true when the event passed it.
    Now {
        decision: String,
        verdicts: Vec<bool>,
    },
    /// An earlier delivery decided it: what it recorded.
    Earlier(String),
    /// Older than `stale_us` with no decision on record (its age, µs): not decided.
    Stale(i64),
}

#[derive(Debug, Clone)]
pub struct AdmitReply {
    /// Redis's clock, the time of every decision in the call.
    pub now_us: i64,
    pub items: Vec<Admitted>,
}

impl Scripts {
    /// Decides, records and forwards (if accepted) a batch of inbound events in one call, and
    /// writes the rejected ones too if `to.rejected` says so; see `lua/admit.lua`.
    pub async fn admit<C: ConnectionLike>(
        &self,
        con: &mut C,
        to: &AdmitTargets<'_>,
        rules: &ScriptRules,
        items: &[AdmitItem<'_>],
    ) -> Result<AdmitReply> {
        let mut streams = KeyIndex::default();
        let ack_at: Vec<usize> = items
            .iter()
            .map(|i| {
                if (to.acks)(i.stream) {
                    streams.index(i.stream.to_string())
                } else {
                    0
                }
            })
            .collect();
        let oldest = items.iter().map(|i| i.entry_ms).min().unwrap_or(0);
        let mut keys: Vec<&str> = Vec::new();
        if to.forward {
            keys.push(&to.keys.forward);
        }
        if to.rejected {
            keys.push(&to.keys.rejected);
        }
        keys.extend(streams.keys().iter().map(String::as_str));
        for item in items {
            // The script reads the checks from the rules; a caller that built an event's
            // identities some other way is a bug, not an outcome.
            assert_eq!(
                item.identities.len(),
                rules.checks,
                "identities of {}",
                item.owner
            );
            keys.push(item.decisions);
            keys.extend(item.identities.iter().copied());
        }
        let args = |full: bool| {
            let mut call = redis::Cmd::new();
            call.arg(to.decision_ttl_ms)
                .arg(to.max_len)
                .arg(u8::from(to.forward) | (u8::from(to.rejected) << 1))
                .arg(to.group)
                .arg(streams.len())
                .arg(to.stale_us)
                .arg(oldest);
            rules.push(&mut call, full);
            call.arg(items.len());
            for (item, ack) in items.iter().zip(&ack_at) {
                call.arg(item.owner).arg(*ack);
                push_fields(&mut call, item.fields);
            }
            call
        };
        let reply = self.admit.call(con, &keys, args).await?;
        let mut values = Reply::new("admit", reply)?;
        let now_us = values.int()?;
        let mut out = Vec::with_capacity(items.len());
        for _ in items {
            let code = values.int()?;
            let decision = values.text()?;
            let verdicts = values.text()?;
            out.push(match code {
                reply::ADMITTED => Admitted::Now {
                    decision,
                    verdicts: verdicts.bytes().map(|b| b == b'1').collect(),
                },
                reply::DECIDED => Admitted::Earlier(decision),
                reply::STALE => Admitted::Stale(decision.parse().unwrap_or(0)),
                other => return Err(Error::reply("admit", format!("code {other}"))),
            });
        }
        Ok(AdmitReply { now_us, items: out })
    }
}

/// The rules as `admit.lua` and `decide.lua` take them, made once for the calls that share
/// them (a worker's, for its life): their arguments, the digest a Redis Function's library
/// keeps them by (admission.lua's `rules_by_digest`), the checks an event makes, and each rule's
/// gap between fetch turns.
pub struct ScriptRules {
    args: redis::Cmd,
    digest: String,
    /// Identities an event or request is checked under: every key field of every rule.
    checks: usize,
    /// Per rule, µs; 0 for a rule without a lease (tests decide such: a gap of 0 books a turn
    /// at now, which reads as none).
    pub(crate) turn_gaps_us: Vec<i64>,
}

impl ScriptRules {
    /// `rules` read with `log_entries_per_read` (admit.lua's: when a sliding log is read by
    /// entry).
    pub fn new(rules: &[InboundRule], log_entries_per_read: i64) -> Self {
        let mut args = redis::Cmd::new();
        args.arg(log_entries_per_read);
        push_rules(&mut args, rules);
        ScriptRules {
            digest: digest(&args),
            args,
            checks: rules.iter().map(|r| r.key.len()).sum(),
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

    /// Pushes the digest and whether the rules follow, then (when `full`) the rules.
    pub(crate) fn push(&self, call: &mut redis::Cmd, full: bool) {
        call.arg(&self.digest).arg(u8::from(full));
        if full {
            for a in self.args.args_iter() {
                if let redis::Arg::Simple(a) = a {
                    call.arg(a);
                }
            }
        }
    }
}

/// The SHA1 of a call's rule arguments, each length-prefixed (so that no two lists read alike):
/// what a Function's library keeps them by.
fn digest(rule_args: &redis::Cmd) -> String {
    let mut text = String::new();
    for a in rule_args.args_iter() {
        if let redis::Arg::Simple(a) = a {
            text.push_str(&format!("{}:", a.len()));
            text.push_str(&String::from_utf8_lossy(a));
        }
    }
    redis::Script::new(&text).get_hash().to_string()
}

/// The rules as `lua/admission.lua`'s `read_rules` reads them (`admit` and `decide` share it).
pub(crate) fn push_rules(call: &mut impl Args, rules: &[InboundRule]) {
    call.push(rules.len());
    for r in rules {
        let rule = &r.rule;
        call.push(&r.name)
            .push(rule.algorithm.as_str())
            .push(u8::from(r.shadow))
            .push(u8::from(rule.count_rejected))
            .push(rule.spacing_us)
            .push(spacing_label(rule.spacing_us))
            .push(rule.horizon_us())
            .push(rule.log_cap())
            .push(r.key.len());
        for field in &r.key {
            call.push(field);
        }
        call.push(rule.limits.len());
        for l in &rule.limits {
            call.push(l.window_us)
                .push(l.count)
                .push(l.interval_us)
                .push(l.tolerance_us)
                .push(&l.label);
        }
    }
}

/// How a `min_spacing` limit reads in `pacer_limit`.
pub fn spacing_label(spacing_us: i64) -> String {
    let d = std::time::Duration::from_micros(spacing_us.max(0) as u64);
    format!("min_spacing {}", humantime::format_duration(d))
}
