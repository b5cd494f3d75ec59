//! The config file's shape as serde reads it, before any value is checked.
//!
//! Leaves stay `serde_yaml::Value` and every section keeps the keys it does not know in
//! `unknown`, so reading never stops at the first mistake: validation (`super::validate`) walks the
//! whole file and reports every problem with its path.

use serde::Deserialize;
use serde_yaml::{Mapping, Value};

pub type Leaf = Option<Value>;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawConfig {
    pub redis: Leaf,
    pub worker: Leaf,
    pub metrics: Leaf,
    pub outbound: Leaf,
    pub inbound: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawRedis {
    pub url: Leaf,
    pub mode: Leaf,
    pub timeout: Leaf,
    pub accept_eviction_risk: Leaf,
    pub username: Leaf,
    pub password_file: Leaf,
    pub tls: Leaf,
    pub sentinel: Leaf,
    pub wait_replicas: Leaf,
    pub wait_timeout: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawTls {
    pub ca_file: Leaf,
    pub cert_file: Leaf,
    pub key_file: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawSentinel {
    pub master_name: Leaf,
    pub username: Leaf,
    pub password_file: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawWorker {
    pub group: Leaf,
    pub consumer: Leaf,
    pub batch: Leaf,
    pub read_bytes: Leaf,
    pub max_inflight: Leaf,
    pub max_inflight_bytes: Leaf,
    pub claim_idle: Leaf,
    pub max_deliveries: Leaf,
    pub drain: Leaf,
    pub threads: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawMetrics {
    pub listen: Leaf,
    pub route_histograms: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

/// The keys the `outbound:` and `inbound:` sections share (read alike by `config::flow`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawFlow {
    pub streams: Leaf,
    pub rejected_stream: Leaf,
    pub dead_letter_stream: Leaf,
    pub max_len: Leaf,
    pub dedupe_ttl: Leaf,
    pub max_event_bytes: Leaf,
    pub max_event_fields: Leaf,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawOutbound {
    #[serde(flatten)]
    pub flow: RawFlow,
    pub max_age: Leaf,
    pub routes: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawRoute {
    pub rate: Leaf,
    pub burst: Leaf,
    pub max_wait: Leaf,
    pub max_age: Leaf,
    pub fallbacks: Leaf,
    pub ready_stream: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawInbound {
    #[serde(flatten)]
    pub flow: RawFlow,
    pub forward_stream: Leaf,
    pub fail_policy: Leaf,
    pub limiter_attempts: Leaf,
    pub partitions: Leaf,
    pub partition_by: Leaf,
    pub partitioned_outputs: Leaf,
    pub rules: Leaf,
    pub api: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawRule {
    pub name: Leaf,
    pub key: Leaf,
    pub algorithm: Leaf,
    pub limits: Leaf,
    pub burst: Leaf,
    pub min_spacing: Leaf,
    pub count_rejected: Leaf,
    pub mode: Leaf,
    pub default_identity: Leaf,
    pub lease: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawLease {
    pub ttl: Leaf,
    pub max: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawApi {
    pub listen: Leaf,
    pub grpc_listen: Leaf,
    pub domain: Leaf,
    pub read_timeout: Leaf,
    pub max_connections: Leaf,
    #[serde(flatten)]
    pub unknown: Mapping,
}
