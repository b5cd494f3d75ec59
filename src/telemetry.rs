//! What pacer tells its operators: logs (tracing), Prometheus metrics, and health.
//!
//! Every metric name lives here. Labels stay low-cardinality: flows, configured route names,
//! outcomes and Redis operations, never an event id.

use metrics::{counter, gauge, histogram, Counter, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::cell::Cell;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub const EVENTS_TOTAL: &str = "pacer_events_total";
pub const WAIT_SECONDS: &str = "pacer_wait_seconds";
pub const LATENESS_SECONDS: &str = "pacer_lateness_seconds";
pub const SLEEPING_EVENTS: &str = "pacer_sleeping_events";
pub const PARKED_EVENTS: &str = "pacer_parked_events";
pub const ROUTE_QUEUE_SECONDS: &str = "pacer_route_queue_seconds";
pub const REDIS_DURATION_SECONDS: &str = "pacer_redis_command_duration_seconds";
pub const REDIS_TURN_WAIT_SECONDS: &str = "pacer_redis_turn_wait_seconds";
pub const REDIS_ERRORS_TOTAL: &str = "pacer_redis_errors_total";
pub const STREAM_PENDING: &str = "pacer_stream_pending";
pub const STREAM_LAG: &str = "pacer_stream_lag";
pub const OUTPUT_LENGTH: &str = "pacer_output_length";
pub const OUTPUT_MAX_LENGTH: &str = "pacer_output_max_length";
pub const CLAIMED_TOTAL: &str = "pacer_claimed_total";
pub const INBOUND_DECISIONS_TOTAL: &str = "pacer_inbound_decisions_total";
pub const LIMITER_UNAVAILABLE_TOTAL: &str = "pacer_inbound_limiter_unavailable_total";
pub const REPLANNED_TOTAL: &str = "pacer_replanned_total";
pub const INPUT_DELETED_TOTAL: &str = "pacer_input_deleted_total";
pub const KEYS_KEPT: &str = "pacer_redis_keys_kept";
pub const REPLICATION_SHORT_TOTAL: &str = "pacer_replication_short_total";
pub const BUILD_INFO: &str = "pacer_build_info";
pub const API_DECISIONS_TOTAL: &str = "pacer_api_decisions_total";
pub const API_SECONDS: &str = "pacer_api_decision_seconds";
pub const API_REDIS_CALLS_TOTAL: &str = "pacer_api_redis_calls_total";
pub const LEASE_FETCHES_TOTAL: &str = "pacer_lease_fetches_total";
pub const LEASE_TOKENS_TOTAL: &str = "pacer_lease_tokens_total";
pub const LISTENER_CONNECTIONS: &str = "pacer_listener_connections";
pub const LISTENER_CONNECTIONS_MAX: &str = "pacer_listener_connections_max";
pub const LISTENER_FULL_TOTAL: &str = "pacer_listener_full_total";
pub use crate::health::READY;

/// How an outbound event ended, the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Dispatched,
    /// Dispatched on a fallback route: counted as well as `dispatched`, on that fallback (where
    /// it came out, as `pacer report` counts it).
    Rerouted,
    Rejected,
    /// Rejected because it was read older than its route's `max_age`.
    Expired,
    DeadLettered,
    Duplicate,
}

impl Outcome {
    /// Every outcome (for registering each at zero).
    pub const ALL: [Outcome; 6] = [
        Outcome::Dispatched,
        Outcome::Rerouted,
        Outcome::Rejected,
        Outcome::Expired,
        Outcome::DeadLettered,
        Outcome::Duplicate,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Outcome::Dispatched => "dispatched",
            Outcome::Rerouted => "rerouted",
            Outcome::Rejected => "rejected",
            Outcome::Expired => "expired",
            Outcome::DeadLettered => "dead_lettered",
            Outcome::Duplicate => "duplicate",
        }
    }
}

pub fn outbound_event(route: &str, outcome: Outcome) {
    outbound_events(route, outcome).increment(1);
}

/// `pacer_events_total` of the outbound flow for one route and outcome.
fn outbound_events(route: &str, outcome: Outcome) -> Counter {
    counter!(EVENTS_TOTAL, "flow" => "outbound", "route" => route.to_string(), "outcome" => outcome.as_str())
}

/// How an inbound event ended, the `outcome` label of `pacer_events_total{flow="inbound"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboundOutcome {
    Accepted,
    Rejected,
    DeadLettered,
    /// Admission failed and fail_open accepted it unchecked.
    FailedOpen,
    /// Admission failed and fail_closed rejected it.
    FailedClosed,
}

impl InboundOutcome {
    /// Every outcome, in declaration order (so `outcome as usize` indexes it).
    pub const ALL: [InboundOutcome; 5] = [
        InboundOutcome::Accepted,
        InboundOutcome::Rejected,
        InboundOutcome::DeadLettered,
        InboundOutcome::FailedOpen,
        InboundOutcome::FailedClosed,
    ];

    fn as_str(self) -> &'static str {
        match self {
            InboundOutcome::Accepted => "accepted",
            InboundOutcome::Rejected => "rejected",
            InboundOutcome::DeadLettered => "dead_lettered",
            InboundOutcome::FailedOpen => "failed_open",
            InboundOutcome::FailedClosed => "failed_closed",
        }
    }
}

/// `n` inbound events that ended in `outcome` (counted a batch at a time: a labelled counter
/// costs a registry lookup per call). Inbound events carry no route: `route` is `none`, like
/// outbound dead letters.
pub fn inbound_events(outcome: InboundOutcome, n: u64) {
    if n > 0 {
        counter!(EVENTS_TOTAL, "flow" => "inbound", "route" => "none", "outcome" => outcome.as_str())
            .increment(n);
    }
}

/// One rule's verdicts on a batch: `passed` events it accepted and `failed` it rejected;
/// `mode` enforce or shadow (a shadow rule's rejections are the ones it would have made).
pub fn inbound_decisions(rule: &str, shadow: bool, passed: u64, failed: u64) {
    let mode = if shadow { "shadow" } else { "enforce" };
    for (outcome, n) in [("accepted", passed), ("rejected", failed)] {
        if n > 0 {
            counter!(INBOUND_DECISIONS_TOTAL, "rule" => rule.to_string(), "outcome" => outcome, "mode" => mode)
                .increment(n);
        }
    }
}

/// Events decided by `inbound.fail_policy` because admission failed.
pub fn limiter_unavailable(policy: &'static str, n: usize) {
    counter!(LIMITER_UNAVAILABLE_TOTAL, "policy" => policy).increment(n as u64);
}

/// Whether the wait and lateness histograms are kept per route (`metrics.route_histograms`).
static ROUTE_HISTOGRAMS: AtomicBool = AtomicBool::new(true);

/// The route label of the wait and lateness histograms: the route's, or `all` for every route
/// when `metrics.route_histograms` is false.
fn histogram_route(route: &str) -> std::borrow::Cow<'static, str> {
    if ROUTE_HISTOGRAMS.load(Ordering::Relaxed) {
        route.to_string().into()
    } else {
        "all".into()
    }
}

/// One route's series that move with every event it places or dispatches, made once per route:
/// a `histogram!` or `counter!` with a label builds its key (the route's name copied) and looks
/// it up in the registry each time, three times per dispatched event.
pub struct RouteMetrics {
    wait: Histogram,
    lateness: Histogram,
    dispatched: Counter,
    rerouted: Counter,
}

impl RouteMetrics {
    pub fn new(route: &str) -> Self {
        RouteMetrics {
            wait: histogram!(WAIT_SECONDS, "route" => histogram_route(route)),
            lateness: histogram!(LATENESS_SECONDS, "route" => histogram_route(route)),
            dispatched: outbound_events(route, Outcome::Dispatched),
            rerouted: outbound_events(route, Outcome::Rerouted),
        }
    }

    /// How long an event was decided to wait for its slot (0: dispatched at once).
    pub fn scheduled_wait(&self, wait_us: i64) {
        self.wait.record(wait_us.max(0) as f64 / 1e6);
    }

    /// How long after its slot an event's ready entry was written (µs, by Redis's clock as the
    /// dispatch call read it: the entry's id holds only the millisecond).
    pub fn lateness(&self, late_us: i64) {
        self.lateness.record(late_us.max(0) as f64 / 1e6);
    }

    /// An event dispatched on this route; `rerouted` when this route is its fallback (counted
    /// as both, where it came out, as `pacer report` counts it).
    pub fn dispatched(&self, rerouted: bool) {
        self.dispatched.increment(1);
        if rerouted {
            self.rerouted.increment(1);
        }
    }
}

/// A slot that could no longer be met was moved (recorded anew, within the event's deadline).
pub fn replanned(route: &str) {
    counter!(REPLANNED_TOTAL, "route" => route.to_string()).increment(1);
}

/// Entries of an input stream deleted (trimmed by a producer) while they were pending: they are
/// gone, and dropped from the group.
pub fn input_deleted(stream: &str, n: usize) {
    counter!(INPUT_DELETED_TOTAL, "stream" => stream.to_string()).increment(n as u64);
}

/// Calls whose writes `redis.wait_replicas` replicas did not confirm in time (each is made again).
pub fn replication_short() {
    counter!(REPLICATION_SHORT_TOTAL).increment(1);
}

/// Whether Redis keeps pacer's keys, by its `maxmemory-policy`.
pub fn keys_kept(policy: &str, kept: bool) {
    gauge!(KEYS_KEPT, "policy" => policy.to_string()).set(if kept { 1.0 } else { 0.0 });
}

pub fn route_queue(route: &str, ahead_us: i64) {
    gauge!(ROUTE_QUEUE_SECONDS, "route" => route.to_string()).set(ahead_us.max(0) as f64 / 1e6);
}

pub fn sleeping(n: usize) {
    gauge!(SLEEPING_EVENTS).set(n as f64);
}

/// Entries a route has parked: read while it had no room in the worker (`worker::share`).
pub fn parked(route: &str, n: usize) {
    gauge!(PARKED_EVENTS, "route" => route.to_string()).set(n as f64);
}

/// Entries an inbound partition has parked: read while its calls were stuck and it held its
/// part of the worker's places (`worker::inbound`). The same series name as the routes',
/// labelled by partition.
pub fn inbound_parked(partition: usize, n: usize) {
    gauge!(PARKED_EVENTS, "partition" => partition.to_string()).set(n as f64);
}

pub fn stream_state(stream: &str, group: &str, pending: i64, lag: Option<i64>) {
    let labels = [("stream", stream.to_string()), ("group", group.to_string())];
    gauge!(STREAM_PENDING, &labels).set(pending as f64);
    if let Some(lag) = lag {
        gauge!(STREAM_LAG, &labels).set(lag as f64);
    }
}

/// An output stream's length (XLEN), read every 10 s beside the length it is trimmed
/// to (`pacer_output_max_length`, set at start): pacer never trims what a consumer group on
/// the stream has not read, so a stream well past its `max_len` has a reader that stopped or
/// falls behind, and grows in Redis's memory until it catches up.
pub fn output_length(stream: &str, len: i64) {
    gauge!(OUTPUT_LENGTH, "stream" => stream.to_string()).set(len as f64);
}

/// Entries this worker claimed that were left pending longer than `claim_idle`: by silent
/// consumers, or under its own name after it let them go (stranded by a failover, `held`).
pub fn claimed(stream: &str, n: usize) {
    counter!(CLAIMED_TOTAL, "stream" => stream.to_string()).increment(n as u64);
}

tokio::task_local! {
    /// What the calls of the operation `measure` runs have waited for their turns on a node
    /// (`connection::turns`).
    static TURN_WAITED: Cell<Duration>;
}

/// Counts `waited`, one call's wait for its turn on a node, against the operation `measure`
/// runs (none outside one).
pub fn turn_waited(waited: Duration) {
    let _ = TURN_WAITED.try_with(|w| w.set(w.get() + waited));
}

/// Runs `f`: its output, how long it took, and how much of that its calls waited in the
/// worker for their turns on a node (time no Redis spent).
pub async fn measure<T>(f: impl Future<Output = T>) -> (T, Duration, Duration) {
    let start = Instant::now();
    TURN_WAITED
        .scope(Cell::new(Duration::ZERO), async {
            let out = f.await;
            (out, start.elapsed(), TURN_WAITED.with(Cell::get))
        })
        .await
}

/// Runs one Redis operation, timing it and counting its failure under `op`. Its time is told
/// in two: the wait for its turns on the node (in the worker), then the rest (the call out, in
/// Redis and on the wire). Until 2026-11-30 a call's duration held its wait for a turn: under a
/// backlog over thousands of routes its p99 said Redis was slow when the worker queued.
pub async fn timed<T, E, F>(op: &'static str, f: F) -> Result<T, E>
where
    F: Future<Output = Result<T, E>>,
{
    let (result, took, waited) = measure(f).await;
    histogram!(REDIS_DURATION_SECONDS, "op" => op)
        .record(took.saturating_sub(waited).as_secs_f64());
    histogram!(REDIS_TURN_WAIT_SECONDS, "op" => op).record(waited.as_secs_f64());
    if result.is_err() {
        counter!(REDIS_ERRORS_TOTAL, "op" => op).increment(1);
    }
    result
}

/// The synchronous API's metrics per API and rule: how long requests take to be decided (a
/// request's time, from its parsed request to its answer, counts once for each rule it was
/// checked against) and the decisions by outcome. The handles are looked up once, not per
/// request and identity, and registered when made (at zero, so that a rate() of the first
/// minute counts the first request).
pub struct ApiMetrics {
    /// Per rule (config order), per API (HTTP, gRPC) if served.
    by_rule: Vec<[Option<RuleMetrics>; 2]>,
}

struct RuleMetrics {
    seconds: metrics::Histogram,
    allowed: metrics::Counter,
    limited: metrics::Counter,
    /// Checks that charge nothing (a request of cost 0), whatever their answer: counted
    /// apart, so that `allowed` stays what drew on the limit.
    checked: metrics::Counter,
    /// Redis did not decide: let through unchecked (`fail_open`) or answered 503/UNAVAILABLE.
    unanswered: metrics::Counter,
}

impl ApiMetrics {
    pub fn new(inbound: &crate::config::InboundConfig) -> Self {
        let api = inbound.api.as_ref();
        let served = [
            (
                crate::api::Api::Http,
                api.is_some_and(|a| a.listen.is_some()),
            ),
            (
                crate::api::Api::Grpc,
                api.is_some_and(|a| a.grpc_listen.is_some()),
            ),
        ];
        let by_rule = inbound
            .rules
            .iter()
            .map(|r| {
                let mode = if r.shadow { "shadow" } else { "enforce" };
                served.map(|(api, on)| {
                    on.then(|| {
                        let decisions = |outcome| {
                            let c = counter!(API_DECISIONS_TOTAL, "api" => api.as_str(), "rule" => r.name.clone(), "outcome" => outcome, "mode" => mode);
                            c.absolute(0);
                            c
                        };
                        RuleMetrics {
                            seconds: histogram!(API_SECONDS, "api" => api.as_str(), "rule" => r.name.clone()),
                            allowed: decisions("allowed"),
                            limited: decisions("limited"),
                            checked: decisions("checked"),
                            unanswered: decisions(match inbound.fail_policy {
                                crate::config::FailPolicy::FailOpen => "unchecked",
                                crate::config::FailPolicy::FailClosed => "unavailable",
                            }),
                        }
                    })
                })
            })
            .collect();
        ApiMetrics { by_rule }
    }

    fn of(&self, api: crate::api::Api, rule: usize) -> Option<&RuleMetrics> {
        let face = match api {
            crate::api::Api::Http => 0,
            crate::api::Api::Grpc => 1,
        };
        self.by_rule[rule][face].as_ref()
    }

    /// A request (or a gRPC call's descriptors) checked against `rules` (indices, each once),
    /// answered now.
    pub fn record(&self, api: crate::api::Api, rules: &[usize], started: Instant) {
        let seconds = started.elapsed().as_secs_f64();
        for &r in rules {
            if let Some(m) = self.of(api, r) {
                m.seconds.record(seconds);
            }
        }
    }

    /// A request checked against rule `rule` (an index) that Redis did not decide: answered
    /// by `fail_policy` (before, in no metric: a dashboard showed API traffic vanish during an
    /// outage while it was all let through unchecked).
    pub fn unanswered(&self, api: crate::api::Api, rule: usize) {
        if let Some(m) = self.of(api, rule) {
            m.unanswered.increment(1);
        }
    }

    /// One identity checked against rule `rule` (an index) by a request of cost 0, which
    /// charges nothing.
    pub fn checked(&self, api: crate::api::Api, rule: usize) {
        if let Some(m) = self.of(api, rule) {
            m.checked.increment(1);
        }
    }

    /// One identity's check against rule `rule` (an index): passed or not.
    pub fn decided(&self, api: crate::api::Api, rule: usize, passed: bool) {
        if let Some(m) = self.of(api, rule) {
            if passed { &m.allowed } else { &m.limited }.increment(1);
        }
    }
}

/// A call to Redis for the synchronous API: a request decided there, or a lease fetched
/// ahead (the other requests were answered from leases).
pub fn api_redis_call(api: crate::api::Api) {
    counter!(API_REDIS_CALLS_TOTAL, "api" => api.as_str()).increment(1);
}

/// A lease fetched for a rule, ahead of need or by a request that found none: the tokens it
/// brought, and those the leases it replaced wasted.
pub fn lease_fetched(rule: &str, ahead: bool, granted: i64, wasted: i64) {
    counter!(LEASE_FETCHES_TOTAL, "rule" => rule.to_string(), "ahead" => if ahead { "true" } else { "false" }).increment(1);
    counter!(LEASE_TOKENS_TOTAL, "rule" => rule.to_string(), "fate" => "leased")
        .increment(granted.max(0) as u64);
    counter!(LEASE_TOKENS_TOTAL, "rule" => rule.to_string(), "fate" => "wasted")
        .increment(wasted.max(0) as u64);
}

/// One listener's connection metrics (`listener`: `metrics`, `http` or `grpc`): the
/// connections it holds open, its bound (`max_connections`), and how many times a connection
/// had to wait for a place because it was full. A full listener leaves new clients waiting in
/// the kernel's backlog, which they see only as slow connects: these say it on the dashboard.
#[derive(Clone)]
pub struct ListenerMetrics {
    pub open: metrics::Gauge,
    pub full: metrics::Counter,
}

impl ListenerMetrics {
    pub fn new(listener: &'static str, max: usize) -> Self {
        gauge!(LISTENER_CONNECTIONS_MAX, "listener" => listener).set(max as f64);
        let open = gauge!(LISTENER_CONNECTIONS, "listener" => listener);
        open.set(0.0);
        let full = counter!(LISTENER_FULL_TOTAL, "listener" => listener);
        full.absolute(0);
        ListenerMetrics { open, full }
    }
}

/// Registers every counter and gauge this config can produce, at zero, so that dashboards and
/// `absent()`-style alerts see a series from the start rather than "no data" until the first
/// event of each kind.
pub fn register(cfg: &crate::config::Config) {
    ROUTE_HISTOGRAMS.store(cfg.metrics.route_histograms, Ordering::Relaxed);
    let ops = [
        "read",
        "claim",
        "schedule",
        "dispatch",
        "deadletter",
        "reject",
        "ack",
        "info",
        "admit",
        "decide",
        "record",
        "forward",
        "prepare",
        "void",
    ];
    for op in ops {
        counter!(REDIS_ERRORS_TOTAL, "op" => op).absolute(0);
    }
    for route in cfg.outbound.routes.keys() {
        for outcome in Outcome::ALL {
            outbound_events(route, outcome).absolute(0);
        }
        counter!(REPLANNED_TOTAL, "route" => route.clone()).absolute(0);
        gauge!(ROUTE_QUEUE_SECONDS, "route" => route.clone()).set(0.0);
        gauge!(PARKED_EVENTS, "route" => route.clone()).set(0.0);
    }
    for outcome in [Outcome::DeadLettered, Outcome::Duplicate] {
        outbound_events("none", outcome).absolute(0);
    }
    for (stream, max_len) in cfg.output_max_lens() {
        gauge!(OUTPUT_MAX_LENGTH, "stream" => stream.to_string()).set(max_len as f64);
    }
    for (stream, _) in cfg.input_streams() {
        let stream = stream.to_string();
        counter!(CLAIMED_TOTAL, "stream" => stream.clone()).absolute(0);
        counter!(INPUT_DELETED_TOTAL, "stream" => stream.clone()).absolute(0);
        let labels = [
            ("stream", stream.clone()),
            ("group", cfg.worker.group.clone()),
        ];
        gauge!(STREAM_PENDING, &labels).set(0.0);
        gauge!(STREAM_LAG, &labels).set(0.0);
    }
    if let Some(inbound) = &cfg.inbound {
        for outcome in InboundOutcome::ALL {
            counter!(EVENTS_TOTAL, "flow" => "inbound", "route" => "none", "outcome" => outcome.as_str())
                .absolute(0);
        }
        for rule in &inbound.rules {
            let mode = if rule.shadow { "shadow" } else { "enforce" };
            for outcome in ["accepted", "rejected"] {
                counter!(INBOUND_DECISIONS_TOTAL, "rule" => rule.name.clone(), "outcome" => outcome, "mode" => mode)
                    .absolute(0);
            }
        }
        counter!(LIMITER_UNAVAILABLE_TOTAL, "policy" => inbound.fail_policy.as_str()).absolute(0);
        if let Some(api) = &inbound.api {
            let faces = [
                (crate::api::Api::Http, api.listen.is_some()),
                (crate::api::Api::Grpc, api.grpc_listen.is_some()),
            ];
            for (face, _) in faces.iter().filter(|(_, on)| *on) {
                counter!(API_REDIS_CALLS_TOTAL, "api" => face.as_str()).absolute(0);
                // (API_SECONDS and API_DECISIONS_TOTAL are registered by the API's ApiMetrics.)
            }
            for rule in inbound.rules.iter().filter(|r| r.lease.is_some()) {
                for ahead in ["true", "false"] {
                    counter!(LEASE_FETCHES_TOTAL, "rule" => rule.name.clone(), "ahead" => ahead)
                        .absolute(0);
                }
                for fate in ["leased", "wasted"] {
                    counter!(LEASE_TOKENS_TOTAL, "rule" => rule.name.clone(), "fate" => fate)
                        .absolute(0);
                }
            }
        }
    }
    gauge!(SLEEPING_EVENTS).set(0.0);
    counter!(REPLICATION_SHORT_TOTAL).absolute(0);
}

/// Installs the Prometheus recorder, with buckets fit for what each histogram holds.
pub fn install_metrics() -> Result<PrometheusHandle, String> {
    // Lateness is mostly under a millisecond (the id's own rounding included): sub-ms buckets.
    let lateness = [
        0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1, 1.0,
    ];
    let waits = [
        0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
    ];
    let redis = [
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(LATENESS_SECONDS.into()), &lateness)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(WAIT_SECONDS.into()), &waits))
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(REDIS_DURATION_SECONDS.into()), &redis)
        })
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(REDIS_TURN_WAIT_SECONDS.into()), &redis)
        })
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(API_SECONDS.into()), &redis))
        .and_then(|b| b.install_recorder())
        .map_err(|e| e.to_string())?;
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    gauge!(READY).set(0.0);
    Ok(handle)
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info,redis=error`); colour only on a
/// terminal. redis-rs's own warnings are left out by default: pacer says what Redis trouble
/// means once (`Health`), where redis-rs wrote 586 lines in 5 s of one cluster failover.
pub fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal;
    const DEFAULT: &str = "info,redis=error";
    // A RUST_LOG that does not parse (`pacer=loud`) falls back to the default, said on stderr
    // once, rather than log nothing. (A bare word parses: as a target, `verbose` keeps only
    // that target's lines, which is what RUST_LOG means.)
    let filter = match std::env::var("RUST_LOG") {
        Ok(text) if !text.trim().is_empty() => tracing_subscriber::EnvFilter::try_new(&text)
            .unwrap_or_else(|e| {
                eprintln!("pacer: RUST_LOG={text:?} does not parse ({e}); logging at {DEFAULT}");
                tracing_subscriber::EnvFilter::new(DEFAULT)
            }),
        _ => tracing_subscriber::EnvFilter::new(DEFAULT),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        // A log line that cannot be written (stderr piped to `head`, a log shipper gone) is
        // dropped. tracing-subscriber would say so with eprintln!, which panics on a closed
        // stderr: found by review, pacer died (exit 101) or, panicking in its signal task,
        // never acted on SIGTERM.
        .log_internal_errors(false)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
