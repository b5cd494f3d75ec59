//! The listeners beside the worker: `/metrics`, `/healthz` and `/readyz` on `metrics.listen`
//! always, and the synchronous admission API (`src/api`) where `inbound.api` says: `POST
//! /v1/admit` on `inbound.api.listen` (on the metrics listener itself when the two are one
//! address) and Envoy's gRPC service on `inbound.api.grpc_listen`.

use crate::api::{envoy, http, Decider, Listener};
use crate::config::{Config, MAX_CONNECTIONS, READ_TIMEOUT};
use crate::connection::RedisConn;
use crate::health::Health;
use metrics_exporter_prometheus::PrometheusHandle;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Binds `addr` for `what` (`label` in the metrics), to hold at most `max` connections open.
async fn bind(
    addr: SocketAddr,
    (what, label): (&'static str, &'static str),
    max: usize,
) -> Result<Listener, String> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("binding {what} {addr}: {e}"))?;
    let at = listener.local_addr().map_or(addr, |a| a);
    tracing::info!(listen = %at, max_connections = max, "serving {what}");
    Ok(Listener::new(listener, max, what, label))
}

/// Binds every listener the config asks for and serves each until `stop` is cancelled.
pub async fn start(
    cfg: &Config,
    metrics: PrometheusHandle,
    health: Arc<Health>,
    stop: CancellationToken,
) -> Result<Vec<JoinHandle<()>>, String> {
    let mut main = http::operations(metrics, health.clone());
    let (mut main_timeout, mut main_max) = (READ_TIMEOUT, MAX_CONNECTIONS);
    let mut tasks = Vec::new();
    let api = cfg
        .inbound
        .as_ref()
        .and_then(|i| i.api.as_ref().map(|a| (i, a)));
    if let Some((inbound, api)) = api {
        let con = RedisConn::new(&cfg.redis, cfg.redis.timeout).map_err(|e| e.to_string())?;
        let decider = Decider::new(inbound.clone(), con, cfg.redis.timeout, health);
        match api.listen {
            Some(addr) if addr == cfg.metrics.listen => {
                main = main.merge(http::admission(decider.clone()));
                (main_timeout, main_max) = (api.read_timeout, api.max_connections);
            }
            Some(addr) => {
                let what = ("POST /v1/admit (inbound.api.listen)", "http");
                let listener = bind(addr, what, api.max_connections).await?;
                let router = http::admission(decider.clone());
                let served = http::serve(listener, router, api.read_timeout, stop.clone());
                tasks.push(tokio::spawn(served));
            }
            None => {}
        }
        if let Some(addr) = api.grpc_listen {
            let what = ("Envoy's rate-limit gRPC service", "grpc");
            let listener = bind(addr, what, api.max_connections).await?;
            let service = envoy::Envoy::new(decider, &api.domain);
            let served = envoy::serve(listener, service, api.read_timeout, stop.clone());
            tasks.push(tokio::spawn(served));
        }
    }
    let what = ("/metrics, /healthz and /readyz", "metrics");
    let listener = bind(cfg.metrics.listen, what, main_max).await?;
    tasks.push(tokio::spawn(http::serve(
        listener,
        main,
        main_timeout,
        stop,
    )));
    Ok(tasks)
}
