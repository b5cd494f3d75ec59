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
