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

use std::io::ErrorKind;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// The listener's next connection, with Nagle's algorithm off (answers go out as soon as they
/// are written, not when the client acknowledged the last one). On an error that is not the
/// connection's own (out of file descriptors, say) it waits a second for some to close rather
/// than spin.
pub(crate) async fn accept(listener: &TcpListener) -> TcpStream {
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
