//! `pacer produce`: pushes demo or benchmark events onto an input stream, pipelined.

use crate::error::Result;
use redis::aio::ConnectionLike;

/// Pushes `count` events to `stream`, round-robin over `routes`, in pipelines of 500. Every
/// `bad_every`-th event (if set) names a route that does not exist, to show dead-lettering.
pub async fn produce<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    routes: &[String],
    count: usize,
    bad_every: Option<usize>,
) -> Result<()> {
    let mut pipe = redis::pipe();
    for i in 0..count {
        let route = match bad_every {
            Some(n) if n > 0 && i % n == n - 1 => "no-such-route",
            _ => routes[i % routes.len()].as_str(),
        };
        pipe.cmd("XADD")
            .arg(stream)
            .arg("*")
            .arg("route")
            .arg(route)
            .arg("id")
            .arg(format!("demo-{}-{i}", std::process::id()))
            .arg("to")
            .arg(format!("+3361000{i:04}"))
            .ignore();
        if pipe.len() == 500 || i + 1 == count {
            if let Err(e) = pipe.query_async::<()>(con).await {
                let e = crate::error::Error::from(e);
                // The pipeline's own error lists every command's failure; one line that names
                // the stream says the same.
                if e.is_wrong_type() {
                    return Err(crate::error::Error::reply(
                        "XADD",
                        format!("{stream} holds another kind of value than a stream: delete or fix the key"),
                    ));
                }
                return Err(e);
            }
            pipe = redis::pipe();
        }
    }
    Ok(())
}
