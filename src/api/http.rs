//! pacer's HTTP endpoints, on axum: `/metrics` (Prometheus text), `/healthz` (the process
//! answers), `/readyz` (Redis reachable, scripts loaded, groups present), and, when
//! `inbound.api.listen` is set, `POST /v1/admit`.
//!
//! `POST /v1/admit` takes a JSON object:
//!
//! ```json
//! {"fields": {"source": "acme", "ip": "192.0.2.7"}, "cost": 1, "rules": ["per-source"]}
//! ```
//!
//! `fields` names the identities (every key field of the rules applied; numbers are read as
//! their text), `cost` (default 1) is how many events the request counts for (0: a check that
//! charges nothing, `Request::cost`), `rules` (default: every rule) which rules apply. It
//! answers 200 `{"allowed": true, ...}` or 429
//! `{"allowed": false, "retry_after_ms": ...}` with `Retry-After` (whole seconds, rounded up),
//! both with the limit that has the least room left (or that refused) and the IETF
//! `RateLimit-Policy` / `RateLimit` headers (draft-ietf-httpapi-ratelimit-headers); 400 with
//! `{"error": ...}` for a request that cannot be decided as written, 503 when Redis cannot be
//! reached under `fail_policy: fail_closed`.

use super::decider::{
    Answer, Api, Decider, Refusal, Reported, Request, MAX_COST, MAX_REQUEST_BYTES,
};
use super::Listener;
use crate::health::Health;
use axum::body::Bytes;
use axum::extract::{FromRequest, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// `/metrics`, `/healthz` and `/readyz`.
pub fn operations(metrics: PrometheusHandle, health: Arc<Health>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        metrics.render(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let health = health.clone();
                async move {
                    match health.why_not() {
                        None => (StatusCode::OK, "ready\n".to_string()),
                        Some(why) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {why}\n"),
                        ),
                    }
                }
            }),
        )
}

/// `POST /v1/admit`.
pub fn admission(decider: Arc<Decider>) -> Router {
    Router::new()
        .route("/v1/admit", post(admit))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(decider)
}

/// Serves `router` on `listener` until `shutdown` is cancelled, then lets the requests in
/// flight finish. HTTP/1.1, on hyper's connections with a timer: a client has `read_timeout`
/// to send a request's head, counted from when the server starts waiting for one (a new
/// connection's first, or the next on a keep-alive connection, which is so closed once idle
/// that long); `POST /v1/admit` then gives its body as long (`admit`). A client that opens
/// connections and sends nothing, or a byte at a time, would otherwise hold each one (and a
/// file descriptor) for good: `axum::serve` gives hyper no timer, so hyper's own header
/// timeout never runs.
pub(crate) async fn serve(
    mut listener: Listener,
    router: Router,
    read_timeout: Duration,
    shutdown: CancellationToken,
) {
    let router = router.fallback(|| async {
        (
            StatusCode::NOT_FOUND,
            "try /metrics, /healthz, /readyz or POST /v1/admit\n",
        )
    });
    let service = TowerToHyperService::new(router);
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(read_timeout);
    // Each connection's task holds a sender: when all are gone, every connection has closed.
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    loop {
        let held = tokio::select! {
            _ = shutdown.cancelled() => break,
            held = listener.accept() => held,
        };
        let conn = http1.serve_connection(TokioIo::new(held), service.clone());
        let (shutdown, open) = (shutdown.clone(), open.clone());
        tokio::spawn(async move {
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(open);
        });
    }
    drop(open);
    let _ = all_closed.recv().await;
}

async fn admit(State(decider): State<Arc<Decider>>, req: axum::extract::Request) -> Response {
    // A body not in within the read timeout (sent a byte at a time: hyper's header timeout
    // ends with the head) is answered 408; one that could not be read (over MAX_REQUEST_BYTES, cut
    // short), in JSON like the rest. The timer starts only if the body is not already in.
    let limit = decider.read_timeout();
    let body = match tokio::time::timeout(limit, Bytes::from_request(req, &())).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            return error(
                e.status(),
                &format!("{} (at most {MAX_REQUEST_BYTES} bytes)", e.body_text()),
            )
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                &format!("the request's body was not in within {limit:?}"),
            )
        }
    };
    let req = match parse(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    let answer = decider.decide(Api::Http, &req).await;
    match answer {
        Ok(a) => respond(&a),
        Err(Refusal::Bad(e)) => error(StatusCode::BAD_REQUEST, &e),
        Err(e @ Refusal::Unavailable(_)) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(json!({ "error": message }))).into_response()
}

/// A JSON object's members in order, a name given twice kept twice: `serde_json::Value` keeps
/// only the last, which would decide `{"source": "a", "source": "b"}` against `b` without a
/// word. The stream flow dead-letters a key field given twice (`malformed`); here the decider
/// answers 400 for it, and a top-level name given twice is refused below.
struct Members<V>(Vec<(String, V)>);

impl<'de, V: serde::Deserialize<'de>> serde::Deserialize<'de> for Members<V> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<V>(std::marker::PhantomData<V>);
        impl<'de, V: serde::Deserialize<'de>> serde::de::Visitor<'de> for Visit<V> {
            type Value = Members<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// Reads a request body; every problem is named.
pub fn parse(body: &[u8]) -> Result<Request, String> {
    let Ok(Members(members)) = serde_json::from_slice::<Members<Box<RawValue>>>(body) else {
        // Read again for the clearer of the two errors.
        return Err(match serde_json::from_slice::<Value>(body) {
            Err(e) => format!("not JSON: {e}"),
            Ok(_) => "expected a JSON object like {\"fields\": {\"source\": \"acme\"}}".into(),
        });
    };
    let mut problems = Vec::new();
    let mut req = Request {
        cost: 1,
        ..Request::default()
    };
    let mut fields = false;
    let mut seen = std::collections::HashSet::new();
    for (k, raw) in &members {
        if !seen.insert(k.as_str()) {
            problems.push(format!("{k}: given twice"));
            continue;
        }
        // The text passed as JSON once, but its first reading only checked the syntax: a lone
        // surrogate (\ud800) or a number past a double (1e400) fails here, and is named, not
        // read as absent (a cost of 1e400 was taken as the default 1).
        let value = |problems: &mut Vec<String>| match serde_json::from_str::<Value>(raw.get()) {
            Ok(v) => Some(v),
            Err(e) => {
                problems.push(format!("{k}: {}", unreadable(&e)));
                None
            }
        };
        match k.as_str() {
            "fields" => {
                fields = true;
                match serde_json::from_str::<Members<Value>>(raw.get()) {
                    Ok(Members(f)) => read_fields(f, &mut req, &mut problems),
                    Err(e) if raw.get().starts_with('{') => {
                        problems.push(format!("fields: {}", unreadable(&e)))
                    }
                    Err(_) => {
                        problems.push("fields: expected an object of field names to values".into())
                    }
                }
            }
            "cost" => {
                if let Some(v) = value(&mut problems) {
                    read_cost(v, &mut req, &mut problems)
                }
            }
            "rules" => {
                if let Some(v) = value(&mut problems) {
                    read_rules(v, &mut req, &mut problems)
                }
            }
            _ => problems.push(format!("unknown key {k:?} (expected fields, cost, rules)")),
        }
    }
    if !fields {
        problems.push("fields: required (the identity fields, like {\"source\": \"acme\"})".into());
    }
    if problems.is_empty() {
        Ok(req)
    } else {
        Err(named(problems))
    }
}

/// Why a member whose syntax is JSON could not be read, without serde's position (counted from
/// the member's own start, which would mislead).
fn unreadable(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let reason = text.split(" at line ").next().unwrap_or(&text);
    format!("cannot be read ({reason})")
}

/// The most problems an answer names: a 64 KiB body of 9,000 unknown keys was answered with
/// 356 KB naming each.
const PROBLEMS_NAMED: usize = 20;

/// The problems, joined: the first `PROBLEMS_NAMED`, then how many more there were.
fn named(mut problems: Vec<String>) -> String {
    let more = problems.len().saturating_sub(PROBLEMS_NAMED);
    problems.truncate(PROBLEMS_NAMED);
    let mut text = problems.join("; ");
    if more > 0 {
        text += &format!("; and {more} more");
    }
    text
}

/// The identity fields, in order, a name given twice kept twice (the decider refuses a key
/// field given twice, as the stream flow dead-letters it).
fn read_fields(fields: Vec<(String, Value)>, req: &mut Request, problems: &mut Vec<String>) {
    for (name, value) in fields {
        let text = match value {
            Value::String(s) => s,
            // A whole number's text is exact; any other went through a float, where distinct
            // large ids (12345678901234567890123 and ...124) would print alike and share one
            // identity's limit.
            Value::Number(n) if n.is_i64() || n.is_u64() => n.to_string(),
            Value::Number(n) => {
                problems.push(format!(
                    "fields.{name}: {n} is not a whole number within 64 bits; give it as a string"
                ));
                continue;
            }
            other => {
                problems.push(format!(
                    "fields.{name}: expected a string or a number, got {other}"
                ));
                continue;
            }
        };
        req.fields.push((name, text));
    }
}

fn read_cost(cost: Value, req: &mut Request, problems: &mut Vec<String>) {
    match cost {
        Value::Null => {}
        Value::Number(n) if n.as_i64().is_some_and(|c| (0..=MAX_COST).contains(&c)) => {
            req.cost = n.as_i64().unwrap_or(1)
        }
        other => problems.push(format!(
            "cost: expected a whole number from 0 to {MAX_COST}, got {other}"
        )),
    }
}

fn read_rules(rules: Value, req: &mut Request, problems: &mut Vec<String>) {
    match rules {
        Value::Null => {}
        Value::Array(items) if !items.is_empty() => {
            let mut names = Vec::new();
            for (i, item) in items.into_iter().enumerate() {
                match item {
                    Value::String(s) => names.push(s),
                    other => {
                        problems.push(format!("rules[{i}]: expected a rule name, got {other}"))
                    }
                }
            }
            req.rules = Some(names);
        }
        other => problems.push(format!(
            "rules: expected a non-empty list of rule names, got {other}"
        )),
    }
}

/// Whole seconds, rounded up (at least 1 for any wait).
fn ceil_secs(us: i64) -> i64 {
    (us.max(0) + 999_999) / 1_000_000
}

/// The IETF policy (quota, window in whole seconds) for `count` per `window_us`. A window that
/// is not whole seconds (`2/ms`, `3/1500ms`) is said over the whole seconds that hold it, its
/// quota scaled to them and rounded down: `q=2;w=1` for `2/ms` advertised a thousandth of the
/// rate (found by review).
fn policy(count: i64, window_us: i64) -> (i64, i64) {
    let w = ceil_secs(window_us).max(1);
    if window_us == w * 1_000_000 {
        return (count, w);
    }
    let q = count as i128 * (w as i128 * 1_000_000) / window_us.max(1) as i128;
    (q.min(i64::MAX as i128) as i64, w)
}

/// The IETF headers for the limit reported: its policy (quota and window, in seconds) and its
/// room (remaining and seconds until whole).
fn rate_limit_headers(l: &Reported) -> [(&'static str, String); 2] {
    let name = format!("{}.{}", l.rule, l.label).replace(['"', '\\'], "");
    let (q, w) = policy(l.count, l.window_us);
    [
        ("RateLimit-Policy", format!("\"{name}\";q={q};w={w}")),
        (
            "RateLimit",
            format!("\"{name}\";r={};t={}", l.remaining, ceil_secs(l.reset_us)),
        ),
    ]
}

/// The response for an answer.
pub fn respond(a: &Answer) -> Response {
    let mut body = Map::new();
    body.insert("allowed".into(), a.allowed.into());
    if !a.allowed {
        body.insert("retry_after_ms".into(), ((a.retry_us + 999) / 1000).into());
    }
    if let Some(l) = &a.limit {
        body.insert("rule".into(), l.rule.clone().into());
        body.insert("limit".into(), l.label.clone().into());
        body.insert("key".into(), l.field.clone().into());
        body.insert("remaining".into(), l.remaining.into());
        body.insert("reset_ms".into(), ((l.reset_us + 999) / 1000).into());
    }
    if a.unchecked {
        body.insert("unchecked".into(), true.into());
    }
    let status = if a.allowed {
        StatusCode::OK
    } else {
        StatusCode::TOO_MANY_REQUESTS
    };
    let mut resp = (status, axum::Json(Value::Object(body))).into_response();
    let headers = resp.headers_mut();
    if let Some(l) = &a.limit {
        for (name, value) in rate_limit_headers(l) {
            if let Ok(v) = HeaderValue::from_str(&value) {
                headers.insert(name, v);
            }
        }
    }
    if !a.allowed {
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(ceil_secs(a.retry_us).max(1)),
        );
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_is_said_in_whole_seconds_with_its_quota_scaled_to_them() {
        assert_eq!(policy(3, 1_000_000), (3, 1));
        assert_eq!(policy(100, 60_000_000), (100, 60));
        assert_eq!(policy(2, 1_000), (2_000, 1));
        assert_eq!(policy(3, 1_500_000), (4, 2));
        assert_eq!(policy(1, 300_000), (3, 1));
    }

    #[test]
    fn a_request_names_every_problem() {
        let e = parse(br#"{"fields": {"a": true}, "cost": -1, "rules": [1], "x": 1}"#).unwrap_err();
        for part in ["unknown key \"x\"", "fields.a", "cost:", "rules[0]"] {
            assert!(e.contains(part), "{part} in {e}");
        }
        assert!(parse(b"[]").unwrap_err().contains("JSON object"));
        assert!(parse(b"{").unwrap_err().starts_with("not JSON"));
        let r = parse(br#"{"fields": {"source": "acme", "n": 7}, "cost": 3}"#).unwrap();
        assert_eq!(r.cost, 3);
        assert_eq!(r.fields.len(), 2);
        assert!(r.fields.contains(&("n".into(), "7".into())));
        // Past 64 bits, or not whole: refused, not printed through a float (two such ids
        // would print alike and share a limit).
        for n in ["12345678901234567890123", "1.5", "1e3"] {
            let body = format!(r#"{{"fields": {{"source": {n}}}}}"#);
            let e = parse(body.as_bytes()).unwrap_err();
            assert!(e.contains("give it as a string"), "{n}: {e}");
        }
        let big = parse(br#"{"fields": {"source": 18446744073709551615}}"#).unwrap();
        assert_eq!(big.fields[0].1, "18446744073709551615");
    }

    #[test]
    fn a_value_json_can_spell_but_not_hold_is_named_not_dropped() {
        // Each passes a syntax check and fails to read: a lone surrogate, a number past a
        // double. A cost of 1e400 was read as absent (cost 1), a rules list with a lone
        // surrogate as no list (every rule).
        for (body, want) in [
            (
                r#"{"fields": {"source": "\ud800"}}"#,
                "fields: cannot be read (",
            ),
            (
                r#"{"fields": {"source": 1e400}}"#,
                "fields: cannot be read (number out of range",
            ),
            (
                r#"{"fields": {"source": "a"}, "cost": 1e400}"#,
                "cost: cannot be read (number out of range",
            ),
            (
                r#"{"fields": {"source": "a"}, "rules": ["\udc00"]}"#,
                "rules: cannot be read (",
            ),
        ] {
            let e = parse(body.as_bytes()).unwrap_err();
            assert!(e.starts_with(want), "{body}: {e}");
            assert!(!e.contains("line 1"), "{body}: {e}");
        }
    }

    #[test]
    fn a_name_given_twice_is_kept_twice_or_refused() {
        let r = parse(br#"{"fields": {"source": "a", "n": 1, "source": "b"}}"#).unwrap();
        assert_eq!(
            r.fields,
            [("source", "a"), ("n", "1"), ("source", "b")].map(|(k, v)| (k.into(), v.into())),
            "every member, in order, for the decider to refuse a key field given twice"
        );
        let e =
            parse(br#"{"fields": {}, "rules": ["a"], "fields": {}, "rules": ["b"]}"#).unwrap_err();
        assert!(
            e.contains("fields: given twice") && e.contains("rules: given twice"),
            "{e}"
        );
        assert!(parse(br#"{"fields": []}"#)
            .unwrap_err()
            .contains("fields: expected an object"));
        assert!(parse(br#"{"cost": 2}"#)
            .unwrap_err()
            .contains("fields: required"));
    }

    #[test]
    fn a_body_of_thousands_of_bad_members_is_answered_with_the_first_twenty() {
        let body = format!(
            "{{{}}}",
            (0..9000)
                .map(|i| format!("\"k{i}\": 0"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let e = parse(body.as_bytes()).unwrap_err();
        assert!(e.starts_with("unknown key \"k0\""), "{e}");
        assert!(
            e.contains("unknown key \"k19\"") && !e.contains("\"k20\""),
            "{e}"
        );
        // 9,000 unknown keys and the missing fields: 9,001 problems.
        assert!(e.ends_with("; and 8981 more"), "{e}");
        assert!(e.len() < 2000, "{} bytes", e.len());
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(ceil_secs(1), 1);
        assert_eq!(ceil_secs(1_000_000), 1);
        assert_eq!(ceil_secs(1_000_001), 2);
        assert_eq!(ceil_secs(0), 0);
    }
}
