//! A script that also runs as a Redis Function (`FCALL`), for the calls where what a script
//! does before its first line of work costs more than the work.
//!
//! Redis runs an `EVALSHA`'s whole text on every call: before `decide.lua` decides anything,
//! each call defines the forty-odd helpers of `lib.lua` and the admission files. A Function's
//! library runs once, at `FUNCTION LOAD`; each `FCALL` then runs only the function's body.
//! Counted under callgrind (one request, one gcra check, as a leased fetch sends it): 274k
//! redis-server instructions per `EVALSHA`, 215k per `FCALL`; a paced event dispatched in a call
//! of its own (`dispatch.lua`, `benches/script_cost.rs`), 391k and 343k with the ready stream's
//! bounded read.
//!
//! One difference shows under trouble: Redis refuses a function that may write as a whole when
//! it is over `maxmemory` (or lacks `min-replicas-to-write`), where a script is refused at its
//! first write. A call that would have written nothing (a dispatch told "not yet") then fails
//! too; it is retried with backoff like the calls that would have written, and nothing could be
//! dispatched meanwhile either way.
//!
//! The library wraps the same Lua: the helper files as its body (KEYS and ARGV become two of its
//! locals, set by each call), the script's own file as the function. Its name carries the
//! script's SHA1, as an `EVALSHA` does, so workers of two versions sharing a Redis (a rolling
//! upgrade) each call their own.
//!
//! The script stays the way that always works. A function Redis does not have (a restart
//! without persistence, `FUNCTION FLUSH`, a node added to a cluster) is loaded again and called
//! once more; when that fails too (a user whose ACL lacks `fcall` or `function|load`, a node
//! mid-migration), this call and every call for the next `OFF_FOR` go by `EVALSHA`, so a Redis
//! that cannot keep the function costs one failed try per `OFF_FOR`, not one per call.

use crate::error::Result;
use redis::aio::ConnectionLike;
use redis::{Arg, Cmd, RedisError, Script, Value};
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The script hash's hex digits in a library's name: enough that two versions never share one.
const HASH_CHARS: usize = 16;

/// How long calls go by `EVALSHA` after the function could not be called or loaded.
const OFF_FOR: Duration = Duration::from_secs(10);

pub struct Function {
    script: Script,
    /// The library's name and its one function's (function names are global in Redis).
    name: String,
    /// The `FUNCTION LOAD` source.
    library: String,
    /// Calls go by the script until then.
    off_until: Mutex<Option<Instant>>,
    /// Whether turning off has been logged as a warning.
    warned: AtomicBool,
}

impl Function {
    /// `helpers` (the library files) then `body` (the script's own file): the script is their
    /// concatenation, the function's body is `body`.
    pub fn new(what: &str, helpers: &str, body: &str) -> Self {
        let script = Script::new(&format!("{helpers}{body}"));
        let name = format!("pacer_{what}_{}", &script.get_hash()[..HASH_CHARS]);
        let library = format!(
            "#!lua name={name}\nlocal KEYS, ARGV\n{helpers}\nredis.register_function('{name}', function(keys, args)\nKEYS, ARGV = keys, args\n{body}\nend)\n"
        );
        Function {
            script,
            name,
            library,
            off_until: Mutex::new(None),
            warned: AtomicBool::new(false),
        }
    }

    /// Loads the library into Redis (into every master of a cluster), replacing one of the same
    /// name (the same text).
    pub async fn load<C: ConnectionLike>(&self, con: &mut C) -> Result<()> {
        let loaded = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&self.library)
            .query_async::<Value>(con)
            .await;
        if let Err(e) = loaded {
            self.turn_off(&e);
            return Err(e.into());
        }
        Ok(())
    }

    /// Deletes the libraries other versions of pacer loaded for this function (`pacer_{what}_`
    /// and another script hash) and returns their names. Each version loads its own library and
    /// Redis keeps every one until it is deleted, so without this a long-lived Redis would hold
    /// one more after each upgrade, for good. A worker of a version still running (a rolling
    /// upgrade) finds its library gone at its next call, loads it again and calls once more, as
    /// after a Redis restart: one round trip, once per worker started. Best effort: a user who
    /// may not list or delete functions, or a cluster master that never had the library, leaves
    /// some in place, which costs memory and nothing else.
    pub async fn delete_other_versions<C: ConnectionLike>(&self, con: &mut C) -> Vec<String> {
        let prefix = &self.name[..self.name.len() - HASH_CHARS];
        let listed = redis::cmd("FUNCTION")
            .arg("LIST")
            .arg("LIBRARYNAME")
            .arg(format!("{prefix}*"))
            .query_async::<Value>(con)
            .await;
        let Ok(listed) = listed else {
            return Vec::new();
        };
        let mut deleted = Vec::new();
        for name in library_names(&listed) {
            let hash = name.strip_prefix(prefix).unwrap_or_default();
            let another = hash.len() == HASH_CHARS && hash.bytes().all(|b| b.is_ascii_hexdigit());
            if !another || name == self.name {
                continue;
            }
            let gone = redis::cmd("FUNCTION")
                .arg("DELETE")
                .arg(&name)
                .query_async::<Value>(con)
                .await;
            match gone {
                Ok(_) => deleted.push(name),
                Err(e) => {
                    tracing::debug!(library = %name, error = %e, "another version's library stays")
                }
            }
        }
        deleted
    }

    /// Loads the script into Redis's script cache: what calls fall back on.
    pub async fn load_script<C: ConnectionLike>(&self, con: &mut C) -> Result<()> {
        self.script.prepare_invoke().load_async(con).await?;
        Ok(())
    }

    /// Calls it with `keys` and the arguments `args(full)` makes (a `Cmd` used as a list):
    /// `FCALL`, or `EVALSHA` while the function is off.
    ///
    /// A function's library outlives its calls, so it may keep what a call passed (decide.lua
    /// keeps the rules): it is first called with `args(false)`, which may leave that out, and
    /// answers the status `RESEND` when it needs it, to be called again with `args(true)`. A
    /// script keeps nothing: it always gets `args(true)`.
    pub async fn call<C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &[&str],
        args: impl Fn(bool) -> Cmd,
    ) -> Result<Value> {
        self.run(con, keys, |full| Cow::Owned(args(full))).await
    }

    /// Calls a function that keeps nothing between calls (it never answers `RESEND`) with
    /// `keys` and `args`, which are not copied but into the call itself.
    pub async fn call_plain<C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &[&str],
        args: &Cmd,
    ) -> Result<Value> {
        self.run(con, keys, |_| Cow::Borrowed(args)).await
    }

    async fn run<'a, C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &[&str],
        args: impl Fn(bool) -> Cow<'a, Cmd>,
    ) -> Result<Value> {
        if self.on() {
            match self.fcall_or_resend(con, keys, &args).await {
                Err(e) if unusable(&e) => {
                    if self.load(con).await.is_ok() {
                        match self.fcall_or_resend(con, keys, &args).await {
                            Err(e) if unusable(&e) => self.turn_off(&e),
                            done => return Ok(done?),
                        }
                    }
                }
                done => return Ok(done?),
            }
        }
        let mut inv = self.script.prepare_invoke();
        for k in keys {
            inv.key(*k);
        }
        for a in args(true).args_iter() {
            if let Arg::Simple(a) = a {
                inv.arg(a);
            }
        }
        Ok(inv.invoke_async(con).await?)
    }

    async fn fcall_or_resend<'a, C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &[&str],
        args: &impl Fn(bool) -> Cow<'a, Cmd>,
    ) -> redis::RedisResult<Value> {
        match self.fcall(con, keys, &args(false)).await? {
            Value::SimpleString(s) if s == "RESEND" => self.fcall(con, keys, &args(true)).await,
            done => Ok(done),
        }
    }

    async fn fcall<C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &[&str],
        args: &Cmd,
    ) -> redis::RedisResult<Value> {
        let mut fcall = redis::cmd("FCALL");
        fcall.arg(&self.name).arg(keys.len());
        for k in keys {
            fcall.arg(*k);
        }
        for a in args.args_iter() {
            if let Arg::Simple(a) = a {
                fcall.arg(a);
            }
        }
        fcall.query_async(con).await
    }

    fn on(&self) -> bool {
        let mut off = self.off_until.lock().expect("not poisoned");
        match *off {
            Some(until) if Instant::now() < until => false,
            Some(_) => {
                *off = None;
                true
            }
            None => true,
        }
    }

    fn turn_off(&self, why: &RedisError) {
        *self.off_until.lock().expect("not poisoned") = Some(Instant::now() + OFF_FOR);
        // Said once as a warning (it costs Redis CPU, and an ACL may be missing a grant), then
        // at debug: a Redis that never lets the function run would repeat it every OFF_FOR.
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(function = %self.name, error = %why,
                "runs as a script (EVALSHA) instead of a Redis Function, retried every 10 s; \
                 an ACL user needs +fcall and +function|load");
        } else {
            tracing::debug!(function = %self.name, error = %why, "runs as a script for now");
        }
    }

    /// The library's name (tests look for it in `FUNCTION LIST`).
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The `library_name`s in a `FUNCTION LIST` reply: one entry per library, each a map (RESP3)
/// or a flat list of field and value (RESP2).
fn library_names(listed: &Value) -> Vec<String> {
    let Value::Array(libraries) = listed else {
        return Vec::new();
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    libraries
        .iter()
        .filter_map(|library| {
            let pairs: Vec<(&Value, &Value)> = match library {
                Value::Map(m) => m.iter().map(|(k, v)| (k, v)).collect(),
                Value::Array(a) => a.chunks_exact(2).map(|p| (&p[0], &p[1])).collect(),
                _ => return None,
            };
            pairs
                .into_iter()
                .find(|(k, _)| text(k).as_deref() == Some("library_name"))
                .and_then(|(_, v)| text(v))
        })
        .collect()
}

/// Whether an `FCALL` failed because the function cannot be called here (rather than because of
/// what it did): Redis does not have it, or the user may not call it.
fn unusable(e: &RedisError) -> bool {
    let text = e.to_string();
    e.code() == Some("NOPERM")
        || text.contains("Function not found")
        || text.contains("unknown command")
}
