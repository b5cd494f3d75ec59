//! The HTTP endpoint beside the worker: `/metrics` (Prometheus text), `/healthz` (the process
//! answers) and `/readyz` (Redis reachable, scripts loaded, groups present).
//!
//! Three fixed GET routes do not need an HTTP framework; each connection gets one response and
//! is closed.

use crate::health::Health;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Serves until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    metrics: PrometheusHandle,
    health: Arc<Health>,
    shutdown: CancellationToken,
) {
    loop {
        let (socket, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let metrics = metrics.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), answer(socket, &metrics, &health))
                .await;
        });
    }
}

async fn answer(
    mut socket: TcpStream,
    metrics: &PrometheusHandle,
    health: &Health,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 2048];
    let mut len = 0;
    // The request line is all we need; stop at the end of the headers or a full buffer.
    while len < buf.len() {
        let n = socket.read(&mut buf[len..]).await?;
        if n == 0 {
            break;
        }
        len += n;
        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let request = String::from_utf8_lossy(&buf[..len]);
    let mut parts = request.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4", metrics.render()),
        ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".to_string()),
        ("GET", "/readyz") => match health.why_not() {
            None => ("200 OK", "text/plain", "ready\n".to_string()),
            Some(why) => (
                "503 Service Unavailable",
                "text/plain",
                format!("not ready: {why}\n"),
            ),
        },
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            "try /metrics, /healthz or /readyz\n".into(),
        ),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".into()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(body.as_bytes()).await?;
    socket.shutdown().await
}
