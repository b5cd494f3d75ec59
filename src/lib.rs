//! pacer: paces outbound events to each route's rate and admits inbound events within each
//! source's limits, with its shared state in Redis so that any number of workers act as one
//! limiter.
//!
//! The binary (`src/main.rs`) only parses the command line and calls into this library.

pub mod admission;
pub mod api;
pub mod backoff;
pub mod clock;
pub mod config;
pub mod connection;
pub mod error;
pub mod event;
pub mod fault;
pub mod health;
pub mod inspect;
pub mod keys;
pub mod marker;
pub mod pacing;
pub mod produce;
pub mod rate;
pub mod report;
pub mod scripts;
pub mod server;
pub mod streams;
pub mod telemetry;
pub mod testkit;
pub mod worker;
