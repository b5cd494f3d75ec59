//! Crash points for the recovery tests. `PACER_CRASH_AT=<point>:<n>` makes the process abort,
//! as `kill -9` would (no cleanup, no drain, nothing acknowledged), the n-th time it passes
//! `point`. The points are the moments a crash is hardest to recover from:
//!
//! - `read`: entries are read (pending to this consumer), no decision recorded yet;
//! - `scheduled`: decisions are recorded, the events sleep in this process;
//! - `dispatched`: a dispatch call wrote events to their ready streams; their input entries are
//!   acknowledged in that same call where the input stream shares the route's slot (always on a
//!   Redis that is not a cluster), otherwise not yet;
//! - `admitted`: inbound events are decided and charged (accepted ones forwarded where the
//!   forward stream shares their partition's slot), their other outputs not yet written, their
//!   entries not acknowledged.
//!
//! Unset, a point costs one atomic load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

struct Armed {
    point: String,
    left: AtomicU64,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var("PACER_CRASH_AT").ok()?;
            let (point, n) = spec.split_once(':').unwrap_or((spec.as_str(), "1"));
            Some(Armed {
                point: point.to_string(),
                left: AtomicU64::new(n.parse().unwrap_or(1).max(1)),
            })
        })
        .as_ref()
}

/// Aborts the process if this is the armed point's n-th pass.
pub fn point(name: &str) {
    if let Some(a) = armed() {
        if a.point == name && a.left.fetch_sub(1, Ordering::Relaxed) == 1 {
            eprintln!("pacer: PACER_CRASH_AT reached {name}; aborting");
            std::process::abort();
        }
    }
}
