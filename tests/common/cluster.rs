//! What the cluster tests share: reading outputs on whichever master serves them now, and the
//! checks that every entry ended once and every window held its rate.

use super::{assert_ended_once, pending, read, tail};
use pacer::report::{max_in_window, OutputEntry};
use pacer::testkit::{wait_until, Cluster, Pacer};
use std::collections::BTreeMap;
use std::time::Duration;

/// A route's ready stream (pacer's default name).
pub fn ready(route: &str) -> String {
    format!("pacer:{{{route}}}:ready")
}

/// Every entry of `stream`, read on the master serving it now.
pub fn entries(cluster: &Cluster, stream: &str) -> Vec<OutputEntry> {
    read(cluster.server_of(stream), stream)
}

/// Where each input entry ended: (input stream, id) -> the outputs holding it.
pub fn placements(
    cluster: &Cluster,
    outputs: &[String],
) -> BTreeMap<(String, String), Vec<String>> {
    let mut at: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for stream in outputs {
        for e in entries(cluster, stream) {
            let source = (
                e.field("pacer_source_stream").unwrap().to_string(),
                e.field("pacer_source_id").unwrap().to_string(),
            );
            at.entry(source).or_default().push(stream.clone());
        }
    }
    at
}

/// What `pacers` have logged, one after the other.
pub fn logs_of(pacers: &[Pacer]) -> String {
    pacers.iter().map(|p| p.log_text()).collect()
}

/// The config's `routes:` lines for a pair of routes on each master: `a[m]` with `first`'s
/// settings, falling back to the next master's `b`, and `b[m]` with `second`'s, so a fallback
/// always crosses to another slot.
pub fn route_pairs(a: &[String], b: &[String], first: &str, second: &str) -> String {
    (0..a.len())
        .map(|m| {
            let next = &b[(m + 1) % b.len()];
            format!(
                "    {}: {{{first}, fallbacks: [{next}]}}\n    {}: {{{second}}}\n",
                a[m], b[m]
            )
        })
        .collect()
}

/// Waits (90 s at most) until every pushed entry has ended somewhere and nothing is pending in
/// any input stream, then checks that each ended exactly once and nothing else came out, and
/// that the workers (`logs`, read once it is over) logged no panic and no call across slots.
/// Returns where each ended.
pub fn assert_each_once(
    cluster: &Cluster,
    pushed: &[(String, String)],
    outputs: &[String],
    inputs: &[String],
    logs: impl Fn() -> String,
) -> BTreeMap<(String, String), Vec<String>> {
    let ended = wait_until(Duration::from_secs(90), || {
        placements(cluster, outputs).len() >= pushed.len()
            && inputs
                .iter()
                .all(|s| pending(cluster.server_of(s), s, "pacer") == 0)
    });
    // A doubled write would come after the last one expected: give it time to show.
    std::thread::sleep(Duration::from_secs(1));
    let logs = logs();
    let at = placements(cluster, outputs);
    assert!(
        ended,
        "{} of {} entries ended; pending {:?}; logs:\n{}",
        at.len(),
        pushed.len(),
        inputs
            .iter()
            .map(|s| pending(cluster.server_of(s), s, "pacer"))
            .collect::<Vec<_>>(),
        tail(&logs)
    );
    assert_ended_once(&at, pushed);
    // A panic in a task leaves the process up.
    assert!(
        !logs.contains("panicked"),
        "a worker panicked:\n{}",
        tail(&logs)
    );
    // redis-rs says "CrossSlot", Redis "CROSSSLOT".
    assert!(
        !logs.to_lowercase().contains("crossslot"),
        "a call spanned slots"
    );
    at
}

/// No rolling window W of `times` (ms) holds more than rate × W + burst.
pub fn assert_windows(what: &str, times: &[i64], per_second: f64, burst: f64) {
    let mut times = times.to_vec();
    times.sort();
    for w in [1, 10, 50, 100, 250, 500, 1000, 2000] {
        let limit = per_second * w as f64 / 1000.0 + burst;
        let seen = max_in_window(&times, w);
        assert!(
            seen as f64 <= limit,
            "{what}: {seen} in a {w} ms window, limit {limit}"
        );
    }
}
