//! The synchronous face of inbound admission: `POST /v1/admit` over HTTP ([`http`]) and
//! Envoy's rate-limit service over gRPC ([`envoy`]), deciding on the same rules, keys and Redis
//! state as the stream flow, so that stream events and synchronous calls on one rule and
//! identity draw on the same limits ([`decider`]); with token leases for the rules that opt in
//! ([`lease`]).

pub mod batch;
pub mod decider;
pub mod envoy;
pub mod http;
pub mod lease;

pub use decider::{Answer, Api, Decider, Refusal, Request};

use crate::telemetry::ListenerMetrics;
use std::io::ErrorKind;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How often at most the warning that a listener is full is logged.
const FULL_WARNING_EVERY: Duration = Duration::from_secs(10);

/// A listener that holds at most `max` connections open: at the bound it accepts no more until
/// one closes (the kernel's backlog holds the next, then refuses). Each connection is a file
/// descriptor, and the worker's Redis connections need some too: without a bound, clients
/// that open connections faster than `read_timeout` closes them could take them all.
pub(crate) struct Listener {
    tcp: TcpListener,
    open: Arc<Semaphore>,
    max: usize,
    what: &'static str,
    warned: Option<Instant>,
    metrics: ListenerMetrics,
}

/// A connection with its place among its listener's open ones, given back (and counted out
/// of `pacer_listener_connections`) when it is dropped.
pub(crate) struct Held {
    tcp: TcpStream,
    _place: OwnedSemaphorePermit,
    open: metrics::Gauge,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.open.decrement(1.0);
    }
}

impl Listener {
    /// `what` names it in the logs, `label` in the metrics (`listener="<label>"`).
    pub fn new(tcp: TcpListener, max: usize, what: &'static str, label: &'static str) -> Self {
        Listener {
            tcp,
            open: Arc::new(Semaphore::new(max)),
            max,
            what,
            warned: None,
            metrics: ListenerMetrics::new(label, max),
        }
    }

    /// The next connection, once fewer than `max` are open.
    pub async fn accept(&mut self) -> Held {
        let place = match self.open.clone().try_acquire_owned() {
            Ok(place) => place,
            Err(_) => {
                self.metrics.full.increment(1);
                if self
                    .warned
                    .is_none_or(|at| at.elapsed() >= FULL_WARNING_EVERY)
                {
                    self.warned = Some(Instant::now());
                    let at = self.tcp.local_addr().ok();
                    tracing::warn!(
                        listen = ?at,
                        max_connections = self.max,
                        "{}: max_connections open: accepting again as they close",
                        self.what
                    );
                }
                let open = self.open.clone();
                open.acquire_owned()
                    .await
                    .expect("the semaphore is never closed")
            }
        };
        let tcp = accept(&self.tcp).await;
        self.metrics.open.increment(1.0);
        Held {
            tcp,
            _place: place,
            open: self.metrics.open.clone(),
        }
    }
}

impl Held {
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }
}

impl AsyncRead for Held {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Held {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Held {
    type ConnectInfo = <TcpStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.tcp.connect_info()
    }
}

/// The listener's next connection, with Nagle's algorithm off (answers go out as soon as they
/// are written, not when the client acknowledged the last one). On an error that is not the
/// connection's own (out of file descriptors, say) it waits a second for some to close rather
/// than spin.
async fn accept(listener: &TcpListener) -> TcpStream {
    loop {
        match listener.accept().await {
            Ok((tcp, _)) => {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY not set");
                }
                return tcp;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
                ) => {}
            Err(e) => {
                tracing::warn!(error = %e, "accepting a connection");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
