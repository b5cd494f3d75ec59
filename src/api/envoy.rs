//! Envoy's rate-limit service, `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`,
//! the gRPC API Envoy's `ratelimit` HTTP filter (and Istio) calls; the types and service stub
//! are envoy-types' generated ones, served with tonic.
//!
//! **Mapping.** The request's `domain` must be `inbound.api.domain`. Each descriptor is one
//! request to pacer: its entries are the identity fields (`key` a field name, `value` its
//! value); the rules applied are those whose key fields the descriptor all carries (or that
//! have a `default_identity`), or just the rule an entry `pacer_rule: <name>` names (whose
//! fields it must then carry). Its cost is the descriptor's `hits_addend`, else the request's,
//! else 1; a descriptor's own `hits_addend` of 0 is a check that charges nothing
//! (`Request::cost`): `OVER_LIMIT` only where a count is already past its limit (under
//! `count_rejected`), with its limit and room as any status. Descriptors are decided together
//! (`Decider::decide_all`: one Redis call for those that need one), each on its own (an allowed
//! one is charged even when another is over its limit, as in envoyproxy/ratelimit); one that
//! cannot be decided refuses the request and charges none. A descriptor no rule applies to is
//! `OK` with no limit. A request is at most `MAX_REQUEST_BYTES` and `MAX_REQUESTS` descriptors.
//!
//! Each status carries the limit with least room (or that refused): `current_limit` (its name
//! `<rule>.<limit>`, and its count per the largest unit that fits in its window),
//! `limit_remaining`, and `duration_until_reset`.

use super::decider::{Answer, Api, Decider, Refusal, Request, MAX_REQUESTS, MAX_REQUEST_BYTES};
use super::{Held, Listener};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit::Unit, Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tonic::{Request as GrpcRequest, Response, Status};

/// The entry naming one rule for a descriptor.
pub const RULE_ENTRY: &str = "pacer_rule";

pub struct Envoy {
    decider: Arc<Decider>,
    domain: String,
}

impl Envoy {
    pub fn new(decider: Arc<Decider>, domain: &str) -> Self {
        Envoy {
            decider,
            domain: domain.to_string(),
        }
    }
}

/// Calls open at once on one connection: far more than Envoy keeps in flight on one (it opens
/// another connection past what the server allows), where with no bound (tonic's default) one
/// connection could hold any number.
const MAX_STREAMS: u32 = 1024;

/// Serves the service on `listener` until `shutdown` is cancelled. A client has `read_timeout`
/// to open its connection (send a byte: a connection that sends nothing is dropped), to answer
/// the server's HTTP/2 pings, sent after as long without a frame from it (Envoy answers them,
/// so its long-lived connections stay, and one that went silent is closed), and to have a call
/// read and answered (a call whose message never comes ends `CANCELLED`, as HTTP's 408). Else
/// each would hold a file descriptor, or a stream, for good.
pub(crate) async fn serve(
    listener: Listener,
    envoy: Envoy,
    read_timeout: Duration,
    shutdown: CancellationToken,
) {
    let served = tonic::transport::Server::builder()
        .timeout(read_timeout)
        .max_concurrent_streams(Some(MAX_STREAMS))
        .http2_keepalive_interval(Some(read_timeout))
        .http2_keepalive_timeout(Some(read_timeout))
        .add_service(
            RateLimitServiceServer::new(envoy).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .serve_with_incoming_shutdown(
            spoken(listener, read_timeout, shutdown.clone()),
            shutdown.cancelled_owned(),
        )
        .await;
    if let Err(e) = served {
        tracing::warn!(error = %e, "gRPC server stopped");
    }
}

/// The connections accepted on `listener` that sent a byte within `read_timeout`, as they do
/// (each waits on its own, so a silent one holds up no other), until `shutdown`. Nagle's
/// algorithm is off on each (`super::accept`): with several calls on one HTTP/2 connection, a
/// small answer would otherwise wait for the acknowledgement of the last.
fn spoken(
    mut listener: Listener,
    read_timeout: Duration,
    shutdown: CancellationToken,
) -> impl futures_util::Stream<Item = std::io::Result<Held>> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let held = tokio::select! {
                _ = shutdown.cancelled() => return,
                held = listener.accept() => held,
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut byte = [0u8; 1];
                let peeked = tokio::time::timeout(read_timeout, held.tcp().peek(&mut byte)).await;
                if matches!(peeked, Ok(Ok(n)) if n > 0) {
                    let _ = tx.send(Ok(held)).await;
                }
            });
        }
    });
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// The largest unit that fits in `window_us`, and the count per that unit (at least 1).
pub fn unit_of(count: i64, window_us: i64) -> (Unit, u32) {
    const S: i64 = 1_000_000;
    let units = [
        (Unit::Day, 86_400 * S),
        (Unit::Hour, 3_600 * S),
        (Unit::Minute, 60 * S),
        (Unit::Second, S),
    ];
    let (unit, len) = units
        .into_iter()
        .find(|(_, len)| window_us >= *len)
        .unwrap_or((Unit::Second, S));
    let per = (count as i128 * len as i128 / window_us.max(1) as i128).max(1);
    (unit, per.min(u32::MAX as i128) as u32)
}

fn status(a: &Answer) -> DescriptorStatus {
    let code = if a.allowed { Code::Ok } else { Code::OverLimit };
    let Some(l) = &a.limit else {
        return DescriptorStatus {
            code: code as i32,
            ..Default::default()
        };
    };
    let (unit, per) = unit_of(l.count, l.window_us);
    let reset = l.reset_us.max(0);
    DescriptorStatus {
        code: code as i32,
        current_limit: Some(RateLimit {
            name: format!("{}.{}", l.rule, l.label),
            requests_per_unit: per,
            unit: unit as i32,
        }),
        limit_remaining: l.remaining.clamp(0, u32::MAX as i64) as u32,
        duration_until_reset: Some(PbDuration {
            seconds: reset / 1_000_000,
            nanos: ((reset % 1_000_000) * 1_000) as i32,
        }),
        quota: None,
    }
}

#[tonic::async_trait]
impl RateLimitService for Envoy {
    async fn should_rate_limit(
        &self,
        request: GrpcRequest<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        if req.domain != self.domain {
            return Err(Status::invalid_argument(format!(
                "domain {:?} is not pacer's ({:?})",
                req.domain, self.domain
            )));
        }
        if req.descriptors.len() > MAX_REQUESTS {
            return Err(Status::invalid_argument(format!(
                "{} descriptors: at most {MAX_REQUESTS} in one request",
                req.descriptors.len()
            )));
        }
        let mut requests = Vec::with_capacity(req.descriptors.len());
        for d in &req.descriptors {
            let own = d.hits_addend.map(|h| h.value);
            let mut one = Request {
                // Past i64 (`as` would wrap it negative and so to the default of 1) it is
                // refused like any cost above MAX_COST. The descriptor's own 0 is a check
                // that charges nothing (as in envoyproxy/ratelimit); the request's 0 is
                // proto3's "not set", so 1.
                cost: match own {
                    Some(h) => i64::try_from(h).unwrap_or(i64::MAX),
                    None => i64::from(req.hits_addend.max(1)),
                },
                only_matching: true,
                ..Request::default()
            };
            for e in &d.entries {
                if e.key == RULE_ENTRY {
                    one.rules.get_or_insert_with(Vec::new).push(e.value.clone());
                } else {
                    one.fields.push((e.key.clone(), e.value.clone()));
                }
            }
            requests.push(one);
        }
        let answers = match self.decider.decide_all(Api::Grpc, &requests).await {
            Ok(a) => a,
            Err((i, Refusal::Bad(e))) => {
                return Err(Status::invalid_argument(format!("descriptors[{i}]: {e}")))
            }
            Err((_, e @ Refusal::Unavailable(_))) => {
                return Err(Status::unavailable(e.to_string()))
            }
        };
        let over = answers.iter().any(|a| !a.allowed);
        let statuses = answers.iter().map(status).collect();
        Ok(Response::new(RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            ..Default::default()
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_told_per_the_largest_unit_in_its_window() {
        assert_eq!(unit_of(10, 1_000_000), (Unit::Second, 10));
        assert_eq!(unit_of(100, 10_000_000), (Unit::Second, 10));
        assert_eq!(unit_of(120, 60_000_000), (Unit::Minute, 120));
        assert_eq!(unit_of(5, 90_000_000), (Unit::Minute, 3));
        assert_eq!(unit_of(1000, 86_400_000_000), (Unit::Day, 1000));
        assert_eq!(unit_of(3, 100_000), (Unit::Second, 30));
    }
}
