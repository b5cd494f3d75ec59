//! The library's error type. A rejected or delayed event is an outcome, never an `Err`: these are
//! failures to talk to Redis or to understand what it said.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected reply from Redis to {op}: {detail}")]
    Reply { op: &'static str, detail: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn reply(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Reply {
            op,
            detail: detail.into(),
        }
    }
}
