//! The Lua scripts pacer runs in Redis, and typed calls to them.
//!
//! Each script is a file under `scripts/`, headed by its KEYS / ARGV / return contract, with the
//! shared maths of `scripts/bucket.lua` prepended at build time. They are called by EVALSHA;
//! redis-rs loads a script again when Redis answers NOSCRIPT (after a restart or SCRIPT FLUSH).

use crate::config::InboundRule;
use crate::error::{Error, Result};
use crate::event::Fields;
use crate::keys::{InboundKeys, OutputKeys, RouteKeys};
use crate::pacing::BucketParams;
use redis::aio::ConnectionLike;
use redis::{Script, ScriptInvocation, Value};

macro_rules! with_bucket_lib {
    ($file:literal) => {
        concat!(
            include_str!("../scripts/bucket.lua"),
            include_str!(concat!("../scripts/", $file))
        )
    };
}

pub const BUCKET_LIB: &str = include_str!("../scripts/bucket.lua");
pub const SCHEDULE: &str = with_bucket_lib!("schedule.lua");
pub const DISPATCH: &str = with_bucket_lib!("dispatch.lua");
pub const EMIT: &str = with_bucket_lib!("emit.lua");
pub const VOID: &str = include_str!("../scripts/void.lua");
pub const REAP: &str = include_str!("../scripts/reap.lua");
pub const ADMIT: &str = with_bucket_lib!("admit.lua");

/// The scripts, hashed once per process.
pub struct Scripts {
    schedule: Script,
    dispatch: Script,
    emit: Script,
    void: Script,
    reap: Script,
    admit: Script,
}

impl Default for Scripts {
    fn default() -> Self {
        Scripts {
            schedule: Script::new(SCHEDULE),
            dispatch: Script::new(DISPATCH),
            emit: Script::new(EMIT),
            void: Script::new(VOID),
            reap: Script::new(REAP),
            admit: Script::new(ADMIT),
        }
    }
}

/// One event offered to a route by `schedule`.
pub struct ScheduleItem<'a> {
    pub event_id: &'a str,
    pub owner: &'a str,
    /// The marker value this decision may replace (a claimed event whose slot has passed).
    pub expect: Option<&'a str>,
    pub cost: u64,
    pub max_wait_us: i64,
    pub fields: &'a Fields,
}

/// What `schedule` decided for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheduled {
    Dispatched {
        entry_id: String,
    },
    Sleep {
        slot_us: i64,
    },
    TooLong {
        wait_us: i64,
    },
    /// An earlier delivery decided this event already: the marker's value.
    Decided(String),
}

#[derive(Debug, Clone)]
pub struct ScheduleReply {
    pub now_us: i64,
    /// Redis's clock as the script ended: the reply left Redis just after it.
    pub end_us: i64,
    /// The route's plan after this batch: how far ahead its next free slot is.
    pub tat_us: i64,
    pub items: Vec<Scheduled>,
}

/// One event whose slot has come, offered to `dispatch`.
pub struct DispatchItem<'a> {
    pub event_id: &'a str,
    pub expect: &'a str,
    pub slot_us: i64,
    pub cost: u64,
    pub fields: &'a Fields,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dispatched {
    Done {
        entry_id: String,
    },
    NotBefore {
        at_us: i64,
    },
    /// The marker no longer holds this decision (its value, empty if gone).
    Superseded(String),
}

#[derive(Debug, Clone)]
pub struct DispatchReply {
    pub now_us: i64,
    pub end_us: i64,
    pub items: Vec<Dispatched>,
}

/// One entry written once to a shared output stream by `emit`.
pub struct EmitItem<'a> {
    pub source_stream: &'a str,
    pub source_id: &'a str,
    pub fields: &'a Fields,
}

impl Scripts {
    /// Loads every script into Redis's script cache (readiness means this has happened).
    pub async fn load<C: ConnectionLike>(&self, con: &mut C) -> Result<()> {
        for script in [
            &self.schedule,
            &self.dispatch,
            &self.emit,
            &self.void,
            &self.reap,
            &self.admit,
        ] {
            script.prepare_invoke().load_async(con).await?;
        }
        Ok(())
    }

    pub async fn schedule<C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &RouteKeys,
        bucket: &BucketParams,
        marker_ttl_ms: u64,
        max_len: u64,
        items: &[ScheduleItem<'_>],
    ) -> Result<ScheduleReply> {
        let mut call = self.schedule.prepare_invoke();
        call.key(&keys.bucket).key(&keys.ready);
        call.arg(bucket.interval_us)
            .arg(bucket.tolerance_us)
            .arg(marker_ttl_ms)
            .arg(max_len)
            .arg(items.len());
        for item in items {
            call.key(keys.marker(item.event_id));
            call.arg(item.owner)
                .arg(item.expect.unwrap_or(""))
                .arg(item.cost)
                .arg(item.max_wait_us);
            push_fields(&mut call, item.fields);
        }
        let reply: Value = call.invoke_async(con).await?;
        let mut values = Reply::new("schedule", reply)?;
        let now_us = values.int()?;
        let tat_us = values.int()?;
        let mut out = Vec::with_capacity(items.len());
        for _ in items {
            out.push(match values.int()? {
                1 => Scheduled::Dispatched {
                    entry_id: values.text()?,
                },
                2 => Scheduled::Sleep {
                    slot_us: values.int()?,
                },
                3 => Scheduled::TooLong {
                    wait_us: values.int()?,
                },
                4 => Scheduled::Decided(values.text()?),
                other => return Err(Error::reply("schedule", format!("code {other}"))),
            });
        }
        Ok(ScheduleReply {
            now_us,
            end_us: values.int()?,
            tat_us,
            items: out,
        })
    }

    pub async fn dispatch<C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &RouteKeys,
        bucket: &BucketParams,
        max_len: u64,
        items: &[DispatchItem<'_>],
    ) -> Result<DispatchReply> {
        let mut call = self.dispatch.prepare_invoke();
        call.key(&keys.bucket).key(&keys.ready);
        call.arg(bucket.interval_us)
            .arg(bucket.tolerance_us)
            .arg(max_len)
            .arg(items.len());
        for item in items {
            call.key(keys.marker(item.event_id));
            call.arg(item.expect).arg(item.slot_us).arg(item.cost);
            push_fields(&mut call, item.fields);
        }
        let reply: Value = call.invoke_async(con).await?;
        let mut values = Reply::new("dispatch", reply)?;
        let now_us = values.int()?;
        let mut out = Vec::with_capacity(items.len());
        for _ in items {
            out.push(match values.int()? {
                1 => Dispatched::Done {
                    entry_id: values.text()?,
                },
                0 => Dispatched::NotBefore {
                    at_us: values.int()?,
                },
                2 => Dispatched::Superseded(values.text()?),
                other => return Err(Error::reply("dispatch", format!("code {other}"))),
            });
        }
        Ok(DispatchReply {
            now_us,
            end_us: values.int()?,
            items: out,
        })
    }

    /// Writes each item to `keys.stream` unless an earlier delivery did; returns which were new.
    pub async fn emit<C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &OutputKeys,
        marker_ttl_ms: u64,
        max_len: u64,
        items: &[EmitItem<'_>],
    ) -> Result<Vec<bool>> {
        let mut call = self.emit.prepare_invoke();
        call.key(&keys.stream);
        call.arg(marker_ttl_ms).arg(max_len).arg(items.len());
        for item in items {
            call.key(keys.marker(item.source_stream, item.source_id));
            push_fields(&mut call, item.fields);
        }
        let reply: Value = call.invoke_async(con).await?;
        let mut values = Reply::new("emit", reply)?;
        items.iter().map(|_| Ok(values.int()? == 1)).collect()
    }
}

impl Scripts {
    /// Voids a poison event's undispatched decision on one route; returns the marker's value
    /// before ("" if none), see `scripts/void.lua`.
    pub async fn void<C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &RouteKeys,
        event_id: &str,
        owner: &str,
        marker_ttl_ms: u64,
    ) -> Result<String> {
        let mut call = self.void.prepare_invoke();
        call.key(keys.marker(event_id))
            .arg(owner)
            .arg(marker_ttl_ms);
        Ok(call.invoke_async(con).await?)
    }

    /// Deletes the group's consumers that hold nothing and have been idle `min_idle` or more,
    /// except `me`; returns how many (see `scripts/reap.lua`).
    pub async fn reap<C: ConnectionLike>(
        &self,
        con: &mut C,
        stream: &str,
        group: &str,
        min_idle: std::time::Duration,
        me: &str,
    ) -> Result<i64> {
        let mut call = self.reap.prepare_invoke();
        call.key(stream)
            .arg(group)
            .arg(min_idle.as_millis() as u64)
            .arg(me);
        Ok(call.invoke_async(con).await?)
    }
}

/// Where an `admit` call writes, and how long what it records lasts.
pub struct AdmitTargets<'a> {
    pub keys: &'a InboundKeys,
    /// The rejected stream, when the call writes rejections itself: it may only when the stream
    /// shares the forward stream's slot, or Redis is not a cluster (`streams::same_slot`).
    /// `None`: the caller writes them, in a second call.
    pub rejected: Option<&'a str>,
    pub decision_ttl_ms: u64,
    /// Output streams are trimmed to about this many entries.
    pub max_len: u64,
    /// A sliding log is read entry by entry when its cap (largest limit) is more than this many
    /// entries per command that takes (1 + a limit + min_spacing), else whole.
    /// [`LOG_ENTRIES_PER_READ`] but in tests, which draw both ways (0: always by entry).
    pub log_entries_per_read: i64,
}

/// What one command costs `admit.lua` in log entries read whole: in Lua a string costs by its
/// size (hashed byte by byte), a command by its count, and this is about where they cross on
/// this machine (`scripts/admit.lua` has the figures). A one-limit log is read whole up to
/// a cap of 96 entries, one with three limits and min_spacing up to 240.
pub const LOG_ENTRIES_PER_READ: i64 = 48;

/// One inbound event offered to `admit`.
pub struct AdmitItem<'a> {
    /// `<entry id>@<input stream>`: the entry, its field in the decision hash.
    pub owner: &'a str,
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
}

#[derive(Debug, Clone)]
pub struct AdmitReply {
    /// Redis's clock, the time of every decision in the call.
    pub now_us: i64,
    pub items: Vec<Admitted>,
}

impl Scripts {
    /// Decides, records and forwards (if accepted) a batch of inbound events in one call, and
    /// writes the rejected ones too if `to.rejected` says so; see `scripts/admit.lua`.
    pub async fn admit<C: ConnectionLike>(
        &self,
        con: &mut C,
        to: &AdmitTargets<'_>,
        rules: &[InboundRule],
        items: &[AdmitItem<'_>],
    ) -> Result<AdmitReply> {
        let mut call = self.admit.prepare_invoke();
        call.key(&to.keys.forward);
        if let Some(stream) = to.rejected {
            call.key(stream);
        }
        call.arg(to.decision_ttl_ms)
            .arg(to.max_len)
            .arg(u8::from(to.rejected.is_some()))
            .arg(to.log_entries_per_read)
            .arg(rules.len());
        for r in rules {
            let rule = &r.rule;
            call.arg(&r.name)
                .arg(rule.algorithm.as_str())
                .arg(u8::from(r.shadow))
                .arg(u8::from(rule.count_rejected))
                .arg(rule.spacing_us)
                .arg(spacing_label(rule.spacing_us))
                .arg(rule.horizon_us())
                .arg(rule.log_cap())
                .arg(r.key.len());
            for field in &r.key {
                call.arg(field);
            }
            call.arg(rule.limits.len());
            for l in &rule.limits {
                call.arg(l.window_us)
                    .arg(l.count)
                    .arg(l.interval_us)
                    .arg(l.tolerance_us)
                    .arg(&l.label);
            }
        }
        let checks: usize = rules.iter().map(|r| r.key.len()).sum();
        call.arg(items.len());
        for item in items {
            // The script reads the checks from the rules; a caller that built an event's
            // identities some other way is a bug, not an outcome.
            assert_eq!(
                item.identities.len(),
                checks,
                "identities of {}",
                item.owner
            );
            call.key(item.decisions);
            for key in &item.identities {
                call.key(*key);
            }
            call.arg(item.owner);
            push_fields(&mut call, item.fields);
        }
        let reply: Value = call.invoke_async(con).await?;
        let mut values = Reply::new("admit", reply)?;
        let now_us = values.int()?;
        let mut out = Vec::with_capacity(items.len());
        for _ in items {
            let code = values.int()?;
            let decision = values.text()?;
            let verdicts = values.text()?;
            out.push(match code {
                1 => Admitted::Now {
                    decision,
                    verdicts: verdicts.bytes().map(|b| b == b'1').collect(),
                },
                2 => Admitted::Earlier(decision),
                other => return Err(Error::reply("admit", format!("code {other}"))),
            });
        }
        Ok(AdmitReply { now_us, items: out })
    }
}

/// How a `min_spacing` limit reads in `pacer_limit`.
pub fn spacing_label(spacing_us: i64) -> String {
    let d = std::time::Duration::from_micros(spacing_us.max(0) as u64);
    format!("min_spacing {}", humantime::format_duration(d))
}

fn push_fields(call: &mut ScriptInvocation<'_>, fields: &Fields) {
    call.arg(fields.len());
    for (name, value) in fields {
        call.arg(name.as_slice()).arg(value.as_slice());
    }
}

/// Walks a script's flat array reply.
pub struct Reply {
    op: &'static str,
    values: std::vec::IntoIter<Value>,
}

impl Reply {
    pub fn new(op: &'static str, reply: Value) -> Result<Self> {
        match reply {
            Value::Array(values) => Ok(Reply {
                op,
                values: values.into_iter(),
            }),
            other => Err(Error::reply(
                op,
                format!("expected an array, got {other:?}"),
            )),
        }
    }

    pub fn int(&mut self) -> Result<i64> {
        match self.values.next() {
            Some(Value::Int(i)) => Ok(i),
            Some(Value::BulkString(b)) => std::str::from_utf8(&b)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| Error::reply(self.op, "expected an integer")),
            other => Err(Error::reply(
                self.op,
                format!("expected an integer, got {other:?}"),
            )),
        }
    }

    pub fn text(&mut self) -> Result<String> {
        match self.values.next() {
            Some(Value::BulkString(b)) => Ok(String::from_utf8_lossy(&b).into_owned()),
            Some(Value::SimpleString(s)) => Ok(s),
            Some(Value::Int(i)) => Ok(i.to_string()),
            other => Err(Error::reply(
                self.op,
                format!("expected a string, got {other:?}"),
            )),
        }
    }
}
