//! Reading back what pacer wrote: per-route counts, the most entries any rolling window held,
//! spacing and lateness. Used by `pacer report` (the demo), the benchmark and the tests, so the
//! rate is always judged the same way: by the ready entries' ids, i.e. Redis's clock.

use crate::config::Config;
use crate::error::{unless_wrong_type, Result};
use crate::event::{Fields, DEAD_LETTER_COPY_BYTES};
use crate::streams;
use redis::aio::ConnectionLike;
use redis::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The most entries whose times (ms, sorted) fall within any window `[a, a + window_ms)`.
pub fn max_in_window(sorted_ms: &[i64], window_ms: i64) -> usize {
    let points: Vec<(i64, i64)> = sorted_ms.iter().map(|&ms| (ms, 1)).collect();
    max_weight_in_window(&points, window_ms) as usize
}

/// The most weight in any window of `window_ms`: `points` are (ms, weight), sorted by ms. The
/// cost units a route passed in its busiest second, where the limit counts units, not entries
/// (counted as entries, a route at 93% of its limit with costs up to 5 showed 40%).
pub fn max_weight_in_window(points: &[(i64, i64)], window_ms: i64) -> i64 {
    let (mut best, mut sum, mut start) = (0, 0, 0);
    for end in 0..points.len() {
        sum += points[end].1;
        while points[end].0 - points[start].0 >= window_ms {
            sum -= points[start].1;
            start += 1;
        }
        best = best.max(sum);
    }
    best
}

/// The value at quantile `q` (0..=1) of sorted values, nearest rank.
pub fn quantile(sorted: &[i64], q: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// One output entry: its id's milliseconds and its fields.
#[derive(Debug, Clone)]
pub struct OutputEntry {
    pub id: String,
    pub ms: i64,
    pub fields: Fields,
}

impl OutputEntry {
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(k, _)| k.as_slice() == name.as_bytes())
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }
}

/// The most entries one page of a read asks for, however small they are.
const PAGE_ENTRIES: usize = 10_000;

/// Bytes beside an event's own fields in the entries pacer writes (its `pacer_*` fields: the
/// route, the source stream and id, the slot, the reason and detail), for sizing pages.
const OWN_FIELDS_BYTES: usize = 4096;

/// How many entries each page of a stream's read asks for. A page of 10,000 entries is, at the
/// 16 MiB `max_event_bytes` limit, 160 GiB in one reply: Redis builds a reply whole in the
/// client's output buffer (a normal client's has no limit by default, and what it holds counts
/// against `maxmemory`), so an operator's `pacer report` could take the memory the workers'
/// writes need. Pages are sized so that `budget` bytes hold the largest entry the stream can
/// have: what pacer writes there (`largest`, from the config) or, when another writer's
/// entries are larger, the largest seen so far (learnt from the page that brought it).
#[derive(Debug, Clone, Copy)]
pub struct Pages {
    budget: usize,
    largest: usize,
}

impl Pages {
    /// Pages within `budget` bytes of entries of up to `largest` bytes each.
    pub fn within(budget: usize, largest: usize) -> Self {
        Pages { budget, largest }
    }

    /// Pages of [`PAGE_ENTRIES`], whatever their size (streams known to hold small entries).
    pub fn unbounded() -> Self {
        Pages::within(usize::MAX, 1)
    }

    /// How many entries the next page asks for: one at least.
    pub fn count(&self) -> usize {
        (self.budget / self.largest.max(1)).clamp(1, PAGE_ENTRIES)
    }

    /// Learns from an entry of `size` bytes.
    fn saw(&mut self, size: usize) {
        self.largest = self.largest.max(size);
    }
}

/// Every entry of a stream, oldest first.
pub async fn read_all<C: ConnectionLike>(con: &mut C, stream: &str) -> Result<Vec<OutputEntry>> {
    read_from(con, stream, "-").await
}

/// The entries of a stream from id `start` (`-` for all, or a millisecond) on, oldest first.
pub async fn read_from<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    start: &str,
) -> Result<Vec<OutputEntry>> {
    let mut out = Vec::new();
    scan(con, stream, start, Pages::unbounded(), |e| out.push(e)).await?;
    Ok(out)
}

/// Hands each entry of a stream from id `start` on to `visit`, oldest first, reading `pages`
/// at a time: nothing but the page in hand is held.
pub async fn scan<C: ConnectionLike>(
    con: &mut C,
    stream: &str,
    start: &str,
    mut pages: Pages,
    mut visit: impl FnMut(OutputEntry),
) -> Result<()> {
    let mut start = start.to_string();
    let name: Arc<str> = Arc::from(stream);
    loop {
        let count = pages.count();
        let reply: Value = redis::cmd("XRANGE")
            .arg(stream)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(count)
            .query_async(con)
            .await?;
        let mut entries = Vec::new();
        streams::parse_entries(reply, &name, 0, &mut entries)?;
        let n = entries.len();
        for e in entries {
            pages.saw(e.size());
            start = format!("({}", e.id);
            let ms = e.ms();
            visit(OutputEntry {
                id: e.id,
                ms,
                fields: e.fields,
            });
        }
        if n < count {
            return Ok(());
        }
    }
}

/// What one route's ready stream shows.
#[derive(Debug, Clone, Default)]
pub struct RouteReport {
    pub route: String,
    pub rate: String,
    pub burst: u32,
    pub dispatched: usize,
    /// Ready entries whose event named another route (taken as a fallback).
    pub rerouted_in: usize,
    pub rejected: usize,
    /// Cost units in the busiest second (an event without `cost` counts 1).
    pub max_per_second: i64,
    pub limit_per_second: i64,
    pub min_gap_ms: Option<i64>,
    pub lateness_p50_ms: Option<i64>,
    pub lateness_p99_ms: Option<i64>,
    pub lateness_max_ms: Option<i64>,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    /// What the report covers: the last `Duration` before `until_ms` (Redis time), or, when
    /// None, everything the output streams still hold (they are trimmed to about `max_len`).
    pub since: Option<Duration>,
    pub until_ms: i64,
    pub routes: Vec<RouteReport>,
    /// The outbound flow's dead letters by reason (none read when the config has no outbound).
    pub dead_letters: BTreeMap<String, usize>,
    /// A dead-letter stream could not be read: its counts are unknown, not zero.
    pub dead_letters_unread: bool,
    /// The inbound flow's outcomes, when the config has one.
    pub inbound: Option<InboundReport>,
    /// Output streams that could not be read, and why (a key of another kind).
    pub problems: Vec<String>,
}

/// What the inbound flow's outputs show.
#[derive(Debug, Clone, Default)]
pub struct InboundReport {
    /// Entries on the forward stream(s) that inbound admission wrote (`pacer_source_stream`
    /// one of its input streams): a forward stream may be fed by others too.
    pub forwarded: usize,
    /// Rejected entries by the rule that refused them.
    pub rejected: BTreeMap<String, usize>,
    pub dead_letters: BTreeMap<String, usize>,
}

/// Reads the output streams of `cfg` (only entries written within `since` before now, by
/// Redis's clock, when given) and sums them up. Each stream is read in pages of at most
/// `worker.read_bytes` (what a worker reads at once, sized by [`Pages`]) and only what is
/// counted is kept of each entry: a report of streams of large events holds neither Redis's
/// memory nor its own.
pub async fn report<C: ConnectionLike>(
    con: &mut C,
    cfg: &Config,
    since: Option<Duration>,
) -> Result<Report> {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(con).await?;
    let until_ms = s * 1000 + us / 1000;
    let start = since.map_or("-".to_string(), |d| {
        (until_ms - d.as_millis() as i64).max(0).to_string()
    });
    let mut report = Report {
        since,
        until_ms,
        ..Report::default()
    };
    let budget = cfg.worker.read_bytes;
    let pages = |max_event_bytes: usize| Pages::within(budget, max_event_bytes + OWN_FIELDS_BYTES);
    let outbound_pages = pages(cfg.outbound.flow.max_event_bytes);
    // Each flow's outputs, and only a configured flow's: an inbound-only config reported the
    // outbound defaults' streams, and nothing of its own (found by review).
    let outbound = !cfg.outbound.flow.streams.is_empty();
    // Rejected entries by the route they were refused on.
    let mut rejected: BTreeMap<String, usize> = BTreeMap::new();
    if outbound {
        let stream = cfg.outbound.flow.rejected_stream.as_str();
        let read = scan(con, stream, &start, outbound_pages, |e| {
            if let Some(route) = e.field("pacer_route") {
                *rejected.entry(route.to_string()).or_default() += 1;
            }
        })
        .await;
        unless_wrong_type(read, stream, "stream", &mut report.problems)?;
    }
    for route in cfg.outbound.routes.values() {
        // Per ready entry: its milliseconds and cost units; and how late each went.
        let (mut weights, mut late, mut rerouted_in) = (Vec::new(), Vec::new(), 0);
        let read = scan(con, &route.keys.ready, &start, outbound_pages, |e| {
            let cost = e.field("cost").and_then(|c| c.parse().ok());
            weights.push((e.ms, cost.unwrap_or(1)));
            if let Some(slot_us) = e.field("pacer_slot_us").and_then(|s| s.parse::<i64>().ok()) {
                late.push(e.ms - slot_us / 1000);
            }
            if e.field("route") != Some(&route.name) {
                rerouted_in += 1;
            }
        })
        .await;
        if unless_wrong_type(read, &route.keys.ready, "stream", &mut report.problems)?.is_none() {
            continue;
        }
        late.sort_unstable();
        report.routes.push(RouteReport {
            route: route.name.clone(),
            rate: route.rate.to_string(),
            burst: route.burst.get(),
            dispatched: weights.len(),
            rerouted_in,
            rejected: rejected.get(&route.name).copied().unwrap_or(0),
            max_per_second: max_weight_in_window(&weights, 1000),
            limit_per_second: route.bucket.window_limit(1_000_000),
            min_gap_ms: weights.windows(2).map(|w| w[1].0 - w[0].0).min(),
            lateness_p50_ms: quantile(&late, 0.5),
            lateness_p99_ms: quantile(&late, 0.99),
            lateness_max_ms: late.last().copied(),
        });
    }
    let inbound_streams: Vec<&str> = cfg
        .inbound
        .iter()
        .flat_map(|i| i.flow.streams.iter().map(String::as_str))
        .collect();
    let from_inbound = |e: &OutputEntry| {
        e.field("pacer_source_stream")
            .is_some_and(|s| inbound_streams.contains(&s))
    };
    let mut inbound_report = cfg.inbound.as_ref().map(|_| InboundReport::default());
    if let (Some(i), Some(r)) = (&cfg.inbound, &mut inbound_report) {
        let inbound_pages = pages(i.flow.max_event_bytes);
        let mut forward: Vec<&str> = i.keys.iter().map(|k| k.forward.as_str()).collect();
        let mut rejected: Vec<&str> = i.keys.iter().map(|k| k.rejected.as_str()).collect();
        forward.dedup();
        rejected.dedup();
        for stream in forward {
            let read = scan(con, stream, &start, inbound_pages, |e| {
                r.forwarded += usize::from(from_inbound(&e));
            })
            .await;
            unless_wrong_type(read, stream, "stream", &mut report.problems)?;
        }
        for stream in rejected {
            let read = scan(con, stream, &start, inbound_pages, |e| {
                if from_inbound(&e) {
                    let rule = e.field("pacer_rule").unwrap_or("?").to_string();
                    *r.rejected.entry(rule).or_default() += 1;
                }
            })
            .await;
            unless_wrong_type(read, stream, "stream", &mut report.problems)?;
        }
    }
    // Dead letters by the flow their entry came from (the two flows may share one stream).
    let mut dead_streams: Vec<&str> = Vec::new();
    if outbound {
        dead_streams.push(&cfg.outbound.flow.dead_letter_stream);
    }
    if let Some(i) = &cfg.inbound {
        if !dead_streams.contains(&i.flow.dead_letter_stream.as_str()) {
            dead_streams.push(&i.flow.dead_letter_stream);
        }
    }
    // A dead letter copies at most DEAD_LETTER_COPY_BYTES of the entry it speaks of.
    let dead_pages = pages(DEAD_LETTER_COPY_BYTES);
    for dead in dead_streams {
        let read = scan(con, dead, &start, dead_pages, |e| {
            let reason = e.field("pacer_reason").unwrap_or("?").to_string();
            match &mut inbound_report {
                Some(r) if from_inbound(&e) => *r.dead_letters.entry(reason).or_default() += 1,
                _ if outbound => *report.dead_letters.entry(reason).or_default() += 1,
                _ => {}
            }
        })
        .await;
        if unless_wrong_type(read, dead, "stream", &mut report.problems)?.is_none() {
            // Unknown, not none: said as such (the `cannot read:` line names the stream).
            report.dead_letters_unread = true;
        }
    }
    report.inbound = inbound_report;
    Ok(report)
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |v: Option<i64>| v.map_or("-".to_string(), |v| v.to_string());
        match self.since {
            Some(d) => writeln!(
                f,
                "entries written in the last {} (Redis time, to {} ms)",
                humantime::format_duration(d),
                self.until_ms
            )?,
            None => writeln!(
                f,
                "every entry the output streams hold (trimmed to about max_len; --since scopes it)"
            )?,
        }
        let counts = |m: &BTreeMap<String, usize>| -> String {
            if m.is_empty() {
                "none".into()
            } else {
                m.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        let dead = |m: &BTreeMap<String, usize>| -> String {
            if m.is_empty() && self.dead_letters_unread {
                "unknown (a dead-letter stream cannot be read: below)".into()
            } else {
                counts(m)
            }
        };
        // The outbound flow's table and dead letters, when the config has routes.
        if !self.routes.is_empty() {
            writeln!(
                f,
                "{:<14} {:>8} {:>6} {:>10} {:>9} {:>8} {:>14} {:>10} {:>18}",
                "route",
                "rate",
                "burst",
                "dispatched",
                "rerouted",
                "rejected",
                "max in 1s/limit",
                "min gap ms",
                "late p50/p99/max"
            )?;
            for r in &self.routes {
                writeln!(
                    f,
                    "{:<14} {:>8} {:>6} {:>10} {:>9} {:>8} {:>14} {:>10} {:>18}",
                    r.route,
                    r.rate,
                    r.burst,
                    r.dispatched,
                    r.rerouted_in,
                    r.rejected,
                    format!("{}/{}", r.max_per_second, r.limit_per_second),
                    opt(r.min_gap_ms),
                    format!(
                        "{}/{}/{}",
                        opt(r.lateness_p50_ms),
                        opt(r.lateness_p99_ms),
                        opt(r.lateness_max_ms)
                    ),
                )?;
            }
            writeln!(f, "dead letters: {}", dead(&self.dead_letters))?;
        }
        if let Some(i) = &self.inbound {
            writeln!(
                f,
                "inbound: forwarded {}, rejected {} (by rule: {}), dead letters: {}",
                i.forwarded,
                i.rejected.values().sum::<usize>(),
                counts(&i.rejected),
                dead(&i.dead_letters)
            )?;
        }
        for p in &self.problems {
            writeln!(f, "cannot read: {p}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_busiest_window() {
        assert_eq!(max_in_window(&[], 1000), 0);
        assert_eq!(max_in_window(&[0, 100, 999, 1000, 1001], 1000), 4);
        assert_eq!(max_in_window(&[0, 1000, 2000], 1000), 1);
        assert_eq!(max_in_window(&[5, 5, 5], 1), 3);
        assert_eq!(max_weight_in_window(&[], 1000), 0);
        let costs = [(0, 5), (100, 1), (999, 3), (1000, 4), (1500, 2)];
        assert_eq!(max_weight_in_window(&costs, 1000), 9);
        assert_eq!(
            max_weight_in_window(&[(0, 2), (1000, 2), (2000, 2)], 1000),
            2
        );
    }

    #[test]
    fn pages_hold_the_largest_entry_within_the_budget() {
        // The defaults: 16 MiB a read, 64 KiB events and pacer's own fields.
        assert_eq!(Pages::within(16 << 20, (64 << 10) + 4096).count(), 240);
        assert_eq!(Pages::unbounded().count(), PAGE_ENTRIES);
        assert_eq!(Pages::within(16 << 20, 10).count(), PAGE_ENTRIES);
        // An entry larger than the budget comes alone.
        assert_eq!(Pages::within(1 << 20, 4 << 20).count(), 1);
        // Larger entries than the config allows (another writer's) shrink the next pages.
        let mut pages = Pages::within(1 << 20, 1 << 10);
        assert_eq!(pages.count(), 1024);
        pages.saw(1 << 10);
        assert_eq!(pages.count(), 1024);
        pages.saw(256 << 10);
        assert_eq!(pages.count(), 4);
    }

    #[test]
    fn quantiles_use_nearest_rank() {
        let v: Vec<i64> = (1..=100).collect();
        assert_eq!(quantile(&v, 0.5), Some(50));
        assert_eq!(quantile(&v, 0.99), Some(99));
        assert_eq!(quantile(&v, 1.0), Some(100));
        assert_eq!(quantile(&[], 0.5), None);
    }
}
