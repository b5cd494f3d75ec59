//! The Lua scripts pacer runs in Redis, and typed calls to them: the pacing calls in `pacing`,
//! the write-once outputs and group upkeep in `outputs`, admission in `admit`.
//!
//! Each script is a file under `lua/`, headed by its KEYS / ARGV / return contract, joined at
//! build time after the library files it uses: `lua/lib.lua` (helpers, reply codes, the marker
//! codec) always, `lua/gcra.lua` (the route's bucket) for pacing, `lua/admission.lua` and
//! `lua/admission/*.lua` (the inbound algorithms) for admission. They are called by EVALSHA;
//! redis-rs loads a script again when Redis answers NOSCRIPT (after a restart or SCRIPT FLUSH).
//! The scripts called for every batch or request run as Redis Functions where Redis lets them
//! (`function`): the pacing scripts `schedule.lua` and `dispatch.lua` (a dispatch call often
//! carries one or two events), `admit.lua` and `decide.lua` (one call per leased fetch or
//! unleased request). Their helpers are then defined once, not on every call.

mod admit;
mod decide;
mod function;
mod outputs;
mod pacing;

pub use admit::{
    spacing_label, AdmitItem, AdmitReply, AdmitTargets, Admitted, ScriptRules, LOG_ENTRIES_PER_READ,
};
pub use decide::{DecideCheck, DecideRequest};
pub use function::Function;
pub use outputs::{EmitCall, EmitItem, Voided};
pub use pacing::{
    call_len, DispatchItem, DispatchReply, Dispatched, EventRef, RouteCall, RouteDispatch,
    ScheduleItem, ScheduleReply, Scheduled, MAX_CALL_BYTES,
};

use crate::error::{Error, Result};
use crate::event::Fields;
use redis::aio::ConnectionLike;
use redis::{Script, ScriptInvocation, Value};

/// Joins files of `lua/` into one script, in order.
macro_rules! lua {
    ($($file:literal),+) => {
        concat!($(include_str!(concat!("../lua/", $file))),+)
    };
}

/// The helpers every script starts with (tests run their own probes after it).
pub const LIB: &str = lua!("lib.lua");
/// The helpers and the route's bucket maths, as the pacing scripts start (tests run their own
/// probes after it).
pub const PACING_LIB: &str = lua!("lib.lua", "gcra.lua");
pub const SCHEDULE: &str = lua!("lib.lua", "gcra.lua", "schedule.lua");
pub const DISPATCH: &str = lua!("lib.lua", "gcra.lua", "dispatch.lua");
/// The pacing scripts' own files: they run after PACING_LIB, as scripts or as Redis Functions.
pub const SCHEDULE_BODY: &str = lua!("schedule.lua");
pub const DISPATCH_BODY: &str = lua!("dispatch.lua");
pub const EMIT: &str = lua!("lib.lua", "emit.lua");
pub const VOID: &str = lua!("lib.lua", "void.lua");
pub const RECORD: &str = lua!("lib.lua", "record.lua");
pub const REAP: &str = lua!("reap.lua");
pub const SIZES: &str = lua!("sizes.lua");
/// The helpers and the inbound algorithms, as the admission scripts start.
pub const ADMISSION_LIB: &str = lua!(
    "lib.lua",
    "admission.lua",
    "admission/sliding_log.lua",
    "admission/gcra.lua",
    "admission/fixed_window.lua",
    "admission/states.lua"
);
pub const ADMIT: &str = lua!(
    "lib.lua",
    "admission.lua",
    "admission/sliding_log.lua",
    "admission/gcra.lua",
    "admission/fixed_window.lua",
    "admission/states.lua",
    "admit.lua"
);
/// `decide.lua`'s and `admit.lua`'s own files: they run after ADMISSION_LIB, as scripts or as
/// Redis Functions.
pub const DECIDE_BODY: &str = lua!("decide.lua");
pub const ADMIT_BODY: &str = lua!("admit.lua");

/// The scripts' reply codes, one meaning each (`lua/lib.lua` defines the same).
pub mod reply {
    /// Written to the ready stream now.
    pub const DISPATCHED: i64 = 1;
    /// A slot was reserved: sleep until it.
    pub const SLEEP: i64 = 2;
    /// Would wait longer than max_wait: nothing reserved.
    pub const TOO_LONG: i64 = 3;
    /// An earlier delivery decided this entry: its recorded decision stands.
    pub const DECIDED: i64 = 4;
    /// Not yet: come back at the time given.
    pub const NOT_BEFORE: i64 = 5;
    /// The decision the call was to carry out is no longer the recorded one.
    pub const SUPERSEDED: i64 = 6;
    /// An inbound event decided by this call.
    pub const ADMITTED: i64 = 7;
    /// Its event id belongs to another entry.
    pub const DUPLICATE: i64 = 8;
    /// Its entry was older than max_age when read: not placed.
    pub const EXPIRED: i64 = 9;
    /// Its entry is older than dedupe_ttl and no decision is on record: not decided.
    pub const STALE: i64 = 10;
}

/// Distinct keys of one kind that a call's items name by index (1-based; 0 means none), so
/// that a batch names each hash or stream once however many of its events share it.
#[derive(Default)]
pub(crate) struct KeyIndex {
    keys: Vec<String>,
    at: std::collections::HashMap<String, usize>,
}

impl KeyIndex {
    pub(crate) fn index(&mut self, key: String) -> usize {
        if let Some(&i) = self.at.get(&key) {
            return i;
        }
        self.keys.push(key.clone());
        self.at.insert(key, self.keys.len());
        self.keys.len()
    }

    pub(crate) fn keys(&self) -> &[String] {
        &self.keys
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }
}

/// What every call that writes an output stream and acknowledges input entries shares
/// (`schedule`, `dispatch`, `emit`): the same three arguments, and which input streams it may
/// acknowledge.
pub struct Writing<'a> {
    /// How long the call's records (decisions, id claims, write-once marks) live, ms.
    pub ttl_ms: u64,
    /// The output stream is trimmed to about this many entries.
    pub max_len: u64,
    /// The consumer group of the input streams (for acknowledging).
    pub group: &'a str,
    /// Whether this call may acknowledge entries of an input stream: the stream shares the
    /// call's slot, or Redis is not a cluster.
    pub acks: &'a (dyn Fn(&str) -> bool + Sync),
}

impl Writing<'_> {
    /// `stream`'s index among the streams this call acknowledges, or 0 when it may not.
    pub(crate) fn ack_index(&self, streams: &mut KeyIndex, stream: &str) -> usize {
        if (self.acks)(stream) {
            streams.index(stream.to_string())
        } else {
            0
        }
    }

    /// The arguments every writing script takes in this order: ttl, max_len, group.
    pub(crate) fn push_args(&self, call: &mut impl Args) {
        call.push(self.ttl_ms).push(self.max_len).push(self.group);
    }
}

/// The scripts, hashed once per process.
pub struct Scripts {
    schedule: Function,
    dispatch: Function,
    emit: Script,
    void: Script,
    record: Script,
    reap: Script,
    sizes: Script,
    admit: Function,
    decide: Function,
}

impl Default for Scripts {
    fn default() -> Self {
        Scripts {
            schedule: Function::new("schedule", PACING_LIB, SCHEDULE_BODY),
            dispatch: Function::new("dispatch", PACING_LIB, DISPATCH_BODY),
            emit: Script::new(EMIT),
            void: Script::new(VOID),
            record: Script::new(RECORD),
            reap: Script::new(REAP),
            sizes: Script::new(SIZES),
            admit: Function::new("admit", ADMISSION_LIB, ADMIT_BODY),
            decide: Function::new("decide", ADMISSION_LIB, DECIDE_BODY),
        }
    }
}

impl Scripts {
    /// Loads every script into Redis's script cache (readiness means this has happened).
    pub async fn load<C: ConnectionLike>(&self, con: &mut C) -> Result<()> {
        for script in [
            &self.emit,
            &self.void,
            &self.record,
            &self.reap,
            &self.sizes,
        ] {
            script.prepare_invoke().load_async(con).await?;
        }
        for function in [&self.schedule, &self.dispatch, &self.admit, &self.decide] {
            function.load_script(con).await?;
            // Calls go by the script while the function does not load (an ACL without
            // function|load): a warning, once, says so.
            if function.load(con).await.is_ok() {
                let deleted = function.delete_other_versions(con).await;
                if !deleted.is_empty() {
                    tracing::info!(libraries = ?deleted, "deleted other pacer versions' Redis Function libraries (a worker still running one loads it again)");
                }
            }
        }
        Ok(())
    }
}

/// Where a call's arguments are written: a script's invocation, or a `Cmd` that holds them for
/// a `Function`.
pub(crate) trait Args {
    fn push<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self;
}

impl Args for ScriptInvocation<'_> {
    fn push<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.arg(arg)
    }
}

impl Args for redis::Cmd {
    fn push<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.arg(arg)
    }
}

pub(crate) fn push_fields(call: &mut impl Args, fields: &Fields) {
    call.push(fields.len());
    for (name, value) in fields {
        call.push(name.as_slice()).push(value.as_slice());
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

#[cfg(test)]
mod tests {
    use super::reply;

    /// The reply codes in `lua/lib.lua` are the ones this module reads.
    #[test]
    fn reply_codes_match_the_lua_library() {
        let lib = include_str!("../lua/lib.lua");
        let code = |name: &str| -> i64 {
            let line = lib
                .lines()
                .find(|l| l.starts_with(&format!("local {name} = ")))
                .unwrap_or_else(|| panic!("lua/lib.lua defines no {name}"));
            line.split('=')
                .nth(1)
                .unwrap()
                .split("--")
                .next()
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        for (name, value) in [
            ("DISPATCHED", reply::DISPATCHED),
            ("SLEEP", reply::SLEEP),
            ("TOO_LONG", reply::TOO_LONG),
            ("DECIDED", reply::DECIDED),
            ("NOT_BEFORE", reply::NOT_BEFORE),
            ("SUPERSEDED", reply::SUPERSEDED),
            ("ADMITTED", reply::ADMITTED),
            ("DUPLICATE", reply::DUPLICATE),
            ("EXPIRED", reply::EXPIRED),
            ("STALE", reply::STALE),
        ] {
            assert_eq!(code(name), value, "{name}");
        }
    }

    /// The field `lua/lib.lua`'s `hset` writes beside a large call's records is the one
    /// `keys::WIDE_FIELD` names.
    #[test]
    fn the_wide_field_matches_the_lua_library() {
        let lib = include_str!("../lua/lib.lua");
        let line = lib
            .lines()
            .find(|l| l.starts_with("local WIDE_FROM, WIDE_FIELD, WIDE = "))
            .expect("lua/lib.lua defines WIDE_FIELD");
        let field = line.split(',').nth(3).expect("its value").trim();
        assert_eq!(field, format!("'{}'", crate::keys::WIDE_FIELD), "{line}");
    }
}
