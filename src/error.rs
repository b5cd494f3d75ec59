//! The library's error type. A rejected or delayed event is an outcome, never an `Err`: these are
//! failures to talk to Redis or to understand what it said.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not a `source` (no `#[from]`): its text is in the message already, and a chain would print
    /// it again after it (`pacer: redis: X: X: X`, as `pacer inspect` did).
    #[error("redis: {0}")]
    Redis(redis::RedisError),
    #[error("unexpected reply from Redis to {op}: {detail}")]
    Reply { op: &'static str, detail: String },
    /// Redis cannot be used as configured (credentials refused, TLS, a bad address): retrying
    /// would not help.
    #[error(transparent)]
    Connect(#[from] crate::connection::ConnectError),
    /// Another live worker reads the group under this worker's consumer name: the two would
    /// take each other's pending entries for their own, and neither would claim the other's.
    #[error("consumer name {consumer:?} is in use: another worker read {stream} under it while this one watched (idle {before_ms} ms, then {after_ms} ms {waited_ms} ms later); give each worker its own worker.consumer, or leave it empty for hostname-pid")]
    ConsumerInUse {
        consumer: String,
        stream: String,
        before_ms: i64,
        after_ms: i64,
        waited_ms: i64,
    },
    /// A configured input stream's key holds another kind of value (written by something
    /// else): pacer would retry reading it for ever.
    #[error("{key} holds a {kind}, not the stream pacer reads there: delete or rename that key, or configure another stream")]
    NotAStream { key: String, kind: String },
    /// `redis.wait_replicas` not met: fewer replicas than wanted confirmed a write in time.
    #[error("{got} of the {wanted} replicas redis.wait_replicas asks for confirmed the writes on {key}'s node within wait_timeout")]
    ReplicasShort { wanted: u32, got: u32, key: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a read of `key` gave, or `None` and a line in `problems` when the key holds another kind
/// of value than the `kept` pacer keeps there (written by something else): for the commands
/// that show state (`report`, `inspect`), which show the rest rather than nothing.
pub fn unless_wrong_type<T>(
    read: Result<T>,
    key: &str,
    kept: &str,
    problems: &mut Vec<String>,
) -> Result<Option<T>> {
    match read {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_wrong_type() => {
            problems.push(format!(
                "{key} holds another kind of value than the {kept} pacer keeps there: left out (delete or fix the key)"
            ));
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        Error::Redis(e)
    }
}

impl Error {
    /// Whether retrying cannot help: Redis refused pacer's credentials or TLS setup.
    pub fn is_fatal(&self) -> bool {
        match self {
            Error::Redis(e) => crate::connection::is_fatal(e),
            Error::Connect(e) => e.is_fatal(),
            Error::Reply { .. } | Error::ReplicasShort { .. } => false,
            Error::ConsumerInUse { .. } | Error::NotAStream { .. } => true,
        }
    }

    /// Whether Redis refused the call because a key it touches holds the wrong kind of value
    /// (a key pacer uses, written by something else): retrying cannot help until someone
    /// fixes or deletes the key.
    pub fn is_wrong_type(&self) -> bool {
        match self {
            Error::Redis(e) => e.code() == Some("WRONGTYPE") || e.to_string().contains("WRONGTYPE"),
            _ => false,
        }
    }

    /// Whether Redis answered but refused a write: out of memory (`maxmemory` with
    /// `noeviction`), failing to persist (`stop-writes-on-bgsave-error`) or short of replicas
    /// (`min-replicas-to-write`). Its reads go on succeeding meanwhile.
    pub fn refuses_writes(&self) -> bool {
        match self {
            Error::Redis(e) => {
                const CODES: [&str; 3] = ["OOM", "MISCONF", "NOREPLICAS"];
                // A MULTI whose commands Redis refused says their codes inside its own error.
                e.code().is_some_and(|c| CODES.contains(&c)) || {
                    let text = e.to_string();
                    CODES.iter().any(|c| text.contains(&format!("\"{c}\"")))
                }
            }
            _ => false,
        }
    }

    pub fn reply(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Reply {
            op,
            detail: detail.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Error;
    use crate::testkit::{wait_until, RedisServer, TempDir};
    use std::time::Duration;

    /// What a write gets from `con` now: a plain command, a script's write, and a MULTI.
    fn writes(con: &mut redis::Connection) -> [Error; 3] {
        let set = redis::cmd("SET").arg("k").arg("v").query::<()>(con);
        let script = redis::cmd("EVAL")
            .arg("return redis.call('SET', KEYS[1], 'v')")
            .arg(1)
            .arg("k")
            .query::<()>(con);
        let multi = redis::pipe()
            .atomic()
            .cmd("SET")
            .arg("k")
            .arg("v")
            .query::<()>(con);
        [set, script, multi].map(|r| Error::Redis(r.expect_err("the write was taken")))
    }

    fn assert_refused(con: &mut redis::Connection, why: &str) {
        for (how, e) in ["SET", "a script", "MULTI"].iter().zip(writes(con)) {
            assert!(
                e.refuses_writes(),
                "{why}, {how}: {e} not taken for a refusal"
            );
        }
        // Its reads go on: that is why only a write that succeeds ends the refusal.
        let _: Option<String> = redis::cmd("GET").arg("k").query(con).unwrap();
    }

    /// The three ways a Redis that answers refuses writes, each produced by a real
    /// redis-server, through each kind of call pacer makes; and errors that are not refusals.
    #[test]
    fn out_of_memory_misconf_and_noreplicas_are_each_a_refused_write() {
        // `dir` may be set at run time only where protected configs are.
        let redis = RedisServer::start_with(&["--enable-protected-configs", "yes"]);
        let mut con = redis.con();

        redis.config_set("maxmemory", "1");
        assert_refused(&mut con, "OOM");
        redis.config_set("maxmemory", "0");

        redis.config_set("min-replicas-to-write", "1");
        assert_refused(&mut con, "NOREPLICAS");
        redis.config_set("min-replicas-to-write", "0");

        // A save that fails (its directory deleted under it) with stop-writes-on-bgsave-error,
        // which binds only where save points are set.
        redis.config_set("save", "3600 1");
        let dir = TempDir::new("misconf");
        let gone = dir.path().join("gone");
        std::fs::create_dir(&gone).unwrap();
        redis.config_set("dir", gone.to_str().unwrap());
        std::fs::remove_dir(&gone).unwrap();
        let _: String = redis::cmd("BGSAVE").query(&mut con).unwrap();
        let failed = wait_until(Duration::from_secs(10), || {
            let info: String = redis::cmd("INFO")
                .arg("persistence")
                .query(&mut con)
                .unwrap();
            info.contains("rdb_last_bgsave_status:err")
        });
        assert!(failed, "the save did not fail");
        assert_refused(&mut con, "MISCONF");
        redis.config_set("stop-writes-on-bgsave-error", "no");

        // Taken again; and an error of another kind is not a refusal.
        let _: () = redis::cmd("SET").arg("k").arg("v").query(&mut con).unwrap();
        let wrong = redis::cmd("LPUSH").arg("k").arg("x").query::<()>(&mut con);
        let wrong = Error::Redis(wrong.expect_err("LPUSH on a string"));
        assert!(wrong.is_wrong_type() && !wrong.refuses_writes(), "{wrong}");
    }
}
