//! The `redis:` section: where the shared state lives (one server, a Redis Cluster, or a master
//! found through Sentinel), how pacer authenticates (ACL user, password from the URL, a file or
//! the environment) and whether it speaks TLS. Read like the rest of the config, every problem
//! with its path; the password files and certificates are read here, so `check-config` finds an
//! unreadable one.
//!
//! Secrets never print: `RedisUrl` and `Secret` show `***` for any password, and `redact` is the
//! one way a URL gets into a message. Connecting lives in `crate::connection`, not here.
//!
//! Over 400 lines: the redis: section's every rule, about half of it a unit test per rule.

use super::files;
use super::problems::{join, Problems};
use super::raw::{RawRedis, RawSentinel, RawTls};
use super::Overrides;
use redis::{ConnectionAddr, IntoConnectionInfo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_yaml::Value;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

/// How pacer finds its Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisMode {
    /// One server (or a proxy): one URL.
    Standalone,
    /// A Redis Cluster: the URLs are seed nodes; the rest of the topology is discovered.
    Cluster,
    /// A master found through Redis Sentinel: the URLs are the sentinels.
    Sentinel,
}

impl RedisMode {
    pub fn as_str(&self) -> &'static str {
        match self {
            RedisMode::Standalone => "standalone",
            RedisMode::Cluster => "cluster",
            RedisMode::Sentinel => "sentinel",
        }
    }
}

impl fmt::Display for RedisMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RedisMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "standalone" => Ok(RedisMode::Standalone),
            "cluster" => Ok(RedisMode::Cluster),
            "sentinel" => Ok(RedisMode::Sentinel),
            other => Err(format!(
                "expected standalone, cluster or sentinel, got {other:?}"
            )),
        }
    }
}

/// A password (or key) held so that it cannot be printed by accident: Debug and Display show
/// `***`. `expose` is the one way to the text, for handing it to redis-rs.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(text: impl Into<String>) -> Self {
        Secret(text.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// Redis URL text as written (one URL, or several separated by commas). Debug and Display print
/// it through `redact`; `as_str` gives the text itself, password included, for redis-rs only.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl(String);

impl RedisUrl {
    pub fn new(text: impl Into<String>) -> Self {
        RedisUrl(text.into())
    }

    /// The URL with its password, if any: hand it to redis-rs, never to a message.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn redacted(&self) -> String {
        redact(&self.0)
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// `url` (or a comma-separated list of URLs) fit for a log line or an error: the user name is
/// kept, a password becomes `***`, in the user-info part and in `pass=`/`password=` query
/// parameters (unix-socket URLs). Works on text that does not parse as a URL too, since a
/// malformed URL is exactly what an error message names.
pub fn redact(url: &str) -> String {
    url.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    // The user info runs to the last '@' of the authority. A password may itself hold '@', '/',
    // '?' or '#' when not percent-encoded, so the last '@' anywhere is taken: at worst that hides
    // more than the password, never less.
    let (authority, tail) = match rest.rfind('@') {
        Some(at) => {
            let (user_info, host) = rest.split_at(at);
            let shown = match user_info.split_once(':') {
                Some((user, _password)) => format!("{user}:***"),
                None => user_info.to_string(),
            };
            (shown, host)
        }
        None => (String::new(), rest),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _))
                        if k.eq_ignore_ascii_case("pass") || k.eq_ignore_ascii_case("password") =>
                    {
                        format!("{k}=***")
                    }
                    _ => pair.to_string(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_string(),
    };
    format!("{scheme}{authority}{tail}")
}

/// The typed `redis:` section.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub mode: RedisMode,
    /// The URL text as written (or from `PACER_REDIS_URL`): several comma-separated URLs for a
    /// cluster's seed nodes or the sentinels. Prints redacted.
    pub url: RedisUrl,
    /// `url` split, one entry per node (checked: same scheme, same credentials).
    pub urls: Vec<RedisUrl>,
    /// Longest any one Redis command may take before it counts as failed.
    pub timeout: Duration,
    /// The ACL user for the data nodes: `redis.username`, else the URL's user.
    pub username: Option<String>,
    /// The password for the data nodes: `PACER_REDIS_PASSWORD`, else `redis.password_file`,
    /// else the URL's.
    pub password: Option<Secret>,
    /// Present exactly when the URLs are `rediss://`.
    pub tls: Option<TlsConfig>,
    /// Present exactly in sentinel mode.
    pub sentinel: Option<SentinelConfig>,
    /// Replicas that must hold a write before it is acknowledged (`WAIT`); 0: do not wait.
    pub wait_replicas: u32,
    /// How long one `WAIT` may block.
    pub wait_timeout: Duration,
    /// Run even if Redis's `maxmemory-policy` may evict keys (which can let an entry or a
    /// repeated id be dispatched twice); without it such a Redis makes pacer not ready.
    pub accept_eviction_risk: bool,
}

/// TLS material, read when the config is.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// CA certificates (PEM) the servers' certificates must chain to; without it, the system's
    /// roots.
    pub ca: Option<PemFile>,
    /// Client certificate and key for servers that require one (`tls-auth-clients yes`).
    pub client: Option<ClientCert>,
}

#[derive(Clone)]
pub struct ClientCert {
    pub cert: PemFile,
    pub key: PemFile,
}

impl fmt::Debug for ClientCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientCert")
            .field("cert", &self.cert.path)
            .field("key", &self.key.path)
            .finish()
    }
}

/// A PEM file and its contents. Debug shows the path only: a key file's contents are a secret.
#[derive(Clone)]
pub struct PemFile {
    pub path: PathBuf,
    pub pem: Vec<u8>,
}

impl fmt::Debug for PemFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.path)
    }
}

#[derive(Debug, Clone)]
pub struct SentinelConfig {
    /// The name the sentinels monitor the master under (`sentinel monitor <name> ...`).
    pub master_name: String,
    /// Credentials for the sentinels themselves, when they require any (`requirepass` or an
    /// ACL user on the sentinels, distinct from the data nodes').
    pub username: Option<String>,
    pub password: Option<Secret>,
}

pub(super) const KNOWN: &[&str] = &[
    "url",
    "mode",
    "timeout",
    "username",
    "password_file",
    "tls",
    "sentinel",
    "wait_replicas",
    "wait_timeout",
    "accept_eviction_risk",
];

/// What one URL says, for the checks across URLs.
struct Parsed {
    tls: Option<bool>,
    unix: bool,
    username: Option<String>,
    password: Option<String>,
    db: i64,
}

pub(super) fn read_redis(p: &mut Problems, v: Option<Value>, overrides: &Overrides) -> RedisConfig {
    let raw: RawRedis = p.section("redis", v);
    p.unknown_keys("redis", &raw.unknown, KNOWN);

    let mode = match &overrides.redis_mode {
        Some(m) => m.parse().unwrap_or_else(|e: String| {
            p.push("redis.mode (from PACER_REDIS_MODE)", e);
            RedisMode::Standalone
        }),
        None => match &raw.mode {
            None | Some(Value::Null) => RedisMode::Standalone,
            some => p
                .parsed("redis.mode", some, "standalone, cluster or sentinel")
                .unwrap_or(RedisMode::Standalone),
        },
    };

    let (text, url_path) = match &overrides.redis_url {
        Some(url) => (url.clone(), "redis.url (from PACER_REDIS_URL)"),
        None => (
            p.string("redis.url", &raw.url, Some("redis://127.0.0.1:6379")),
            "redis.url",
        ),
    };
    let urls: Vec<RedisUrl> = text
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(RedisUrl::new)
        .collect();
    let parsed = read_urls(p, url_path, mode, &urls);

    const TIMEOUT_MIN: Duration = Duration::from_millis(10);
    let timeout = p.duration("redis.timeout", &raw.timeout, Duration::from_secs(1));
    // Below a few milliseconds no call can be answered in time (a batch's script alone takes
    // about one): 2ns passed and the worker never became ready, its log blaming the ACL for
    // the timed-out function load (found by review).
    if timeout < TIMEOUT_MIN && !p.said("redis.timeout") {
        p.push(
            "redis.timeout",
            format!(
                "must be at least {}, got {}",
                humantime::format_duration(TIMEOUT_MIN),
                humantime::format_duration(timeout)
            ),
        );
    }

    let (username, password) = read_credentials(p, &raw, overrides, url_path, &parsed);
    let uses_tls = parsed.first().and_then(|u| u.tls).unwrap_or(false);
    let tls = read_tls(p, raw.tls, uses_tls);
    let sentinel = read_sentinel(p, raw.sentinel, mode, overrides);

    let wait_replicas = p.integer("redis.wait_replicas", &raw.wait_replicas, 0, 0, 100) as u32;
    let written = !matches!(raw.wait_timeout, None | Some(Value::Null));
    let wait_timeout = p.duration("redis.wait_timeout", &raw.wait_timeout, timeout / 2);
    if wait_timeout < Duration::from_millis(1) && written && !p.said("redis.wait_timeout") {
        // WAIT counts whole milliseconds, and its timeout 0 blocks forever: never what a paced
        // write wants (900us passed, and became WAIT 1 0 on the shared connection). Unwritten,
        // the WAIT call rounds a default under 1 ms up.
        p.push(
            "redis.wait_timeout",
            "must be at least 1ms (WAIT counts whole milliseconds; 0 would block forever)",
        );
    } else if wait_timeout >= timeout && !timeout.is_zero() {
        p.push(
            "redis.wait_timeout",
            format!(
                "must be less than redis.timeout ({}), or the WAIT call itself times out",
                humantime::format_duration(timeout)
            ),
        );
    }

    RedisConfig {
        mode,
        url: RedisUrl::new(text),
        urls,
        timeout,
        username,
        password,
        tls,
        sentinel,
        wait_replicas,
        wait_timeout,
        accept_eviction_risk: p.boolean(
            "redis.accept_eviction_risk",
            &raw.accept_eviction_risk,
            false,
        ),
    }
}

/// Parses each URL and checks them against the mode and each other. Problems never quote a URL
/// unredacted.
fn read_urls(p: &mut Problems, path: &str, mode: RedisMode, urls: &[RedisUrl]) -> Vec<Parsed> {
    if urls.is_empty() {
        p.push(path, "needs at least one URL");
        return Vec::new();
    }
    if mode == RedisMode::Standalone && urls.len() > 1 {
        p.push(
            path,
            format!(
                "standalone mode takes one URL, got {}: set redis.mode to cluster (seed nodes) or sentinel (the sentinels)",
                urls.len()
            ),
        );
    }
    let many = urls.len() > 1;
    let mut parsed = Vec::new();
    for (i, url) in urls.iter().enumerate() {
        let which = if many {
            format!(" (URL {} of {})", i + 1, urls.len())
        } else {
            String::new()
        };
        let info = match url.as_str().into_connection_info() {
            Ok(info) => info,
            Err(e) => {
                // A host:port without its scheme is the usual slip; redis-rs says only that it
                // did not parse.
                let hint = if url.as_str().contains("://") {
                    ""
                } else {
                    " (write it as redis://host:port, or rediss:// for TLS)"
                };
                p.push(path, format!("not a usable Redis URL{which}: {e}{hint}"));
                continue;
            }
        };
        let (tls, insecure, unix) = match info.addr() {
            ConnectionAddr::Tcp(..) => (Some(false), false, false),
            ConnectionAddr::TcpTls { insecure, .. } => (Some(true), *insecure, false),
            ConnectionAddr::Unix(_) => (None, false, true),
            _ => (None, false, false),
        };
        if insecure {
            p.push(
                path,
                format!("#insecure would turn certificate checks off{which}; give redis.tls.ca_file instead"),
            );
        }
        if unix && mode != RedisMode::Standalone {
            p.push(
                path,
                format!("a unix socket{which} cannot be a {mode} node: give host:port URLs"),
            );
        }
        let settings = info.redis_settings();
        if mode == RedisMode::Cluster && settings.db() != 0 {
            p.push(
                path,
                format!(
                    "a Redis Cluster has only database 0, the URL{which} selects {}",
                    settings.db()
                ),
            );
        }
        parsed.push(Parsed {
            tls,
            unix,
            username: settings.username().map(str::to_string),
            password: settings.password().map(str::to_string),
            db: settings.db(),
        });
    }
    let tcp: Vec<&Parsed> = parsed.iter().filter(|u| !u.unix).collect();
    if tcp.iter().any(|u| u.tls == Some(true)) && tcp.iter().any(|u| u.tls == Some(false)) {
        p.push(
            path,
            "mixes rediss:// and redis:// URLs: use TLS for every node or for none",
        );
    }
    if let Some(first) = parsed.first() {
        let same = parsed.iter().all(|u| {
            u.username == first.username && u.password == first.password && u.db == first.db
        });
        if !same {
            p.push(
                path,
                "the URLs carry different users, passwords or databases: pacer uses one set for every node",
            );
        }
    }
    parsed
}

fn read_credentials(
    p: &mut Problems,
    raw: &RawRedis,
    overrides: &Overrides,
    url_path: &str,
    parsed: &[Parsed],
) -> (Option<String>, Option<Secret>) {
    let url_user = parsed.first().and_then(|u| u.username.clone());
    let url_password = parsed.first().and_then(|u| u.password.clone());
    let username = match &raw.username {
        None | Some(Value::Null) => url_user,
        some => {
            let name = p.string("redis.username", some, None);
            if name.is_empty() {
                p.push("redis.username", "must not be empty");
            }
            if let Some(in_url) = url_user.filter(|u| *u != name) {
                p.push(
                    "redis.username",
                    format!("{name:?} differs from the user in {url_path} ({in_url:?}): name it in one place"),
                );
            }
            Some(name)
        }
    };
    let from_file = match &raw.password_file {
        None | Some(Value::Null) => None,
        some => {
            let path = p.string("redis.password_file", some, None);
            if url_password.is_some() {
                // Two passwords written down: whichever won, the other would be silently unused.
                p.push(
                    "redis.password_file",
                    format!("{url_path} already holds a password: give it in one place"),
                );
                None
            } else if overrides.redis_password.is_some() {
                // PACER_REDIS_PASSWORD wins; the file need not exist where the env is used.
                None
            } else {
                read_password_file(p, "redis.password_file", &path)
            }
        }
    };
    let password = overrides
        .redis_password
        .clone()
        .or(from_file)
        .or(url_password.map(Secret::new));
    (username, password)
}

/// Reads a password file: the first line, without its line end. Empty is a problem, not "no
/// password": a file that was meant to hold one and does not must not turn auth off.
fn read_password_file(p: &mut Problems, path: &str, file: &str) -> Option<Secret> {
    match files::read_text(Path::new(file), files::SECRET_MAX) {
        Ok(text) => {
            let line = text.lines().next().unwrap_or("");
            if line.is_empty() {
                p.push(
                    path,
                    format!("{file} holds no password (its first line is empty)"),
                );
                None
            } else {
                Some(Secret::new(line))
            }
        }
        Err(e) => {
            p.push(path, format!("cannot read {file}: {e}"));
            None
        }
    }
}

fn read_tls(p: &mut Problems, v: Option<Value>, uses_tls: bool) -> Option<TlsConfig> {
    let given = matches!(&v, Some(v) if !v.is_null());
    let raw: RawTls = p.section("redis.tls", v);
    p.unknown_keys(
        "redis.tls",
        &raw.unknown,
        &["ca_file", "cert_file", "key_file"],
    );
    if !uses_tls {
        if given {
            // Certificates with a redis:// URL would be ignored and the traffic sent in plain
            // text: refuse rather than let that pass unnoticed.
            p.push(
                "redis.tls",
                "TLS settings need rediss:// URLs; with redis:// pacer would connect in plain text",
            );
        }
        return None;
    }
    let ca = optional_path(p, "redis.tls.ca_file", &raw.ca_file)
        .and_then(|path| read_pem(p, "redis.tls.ca_file", path, Pem::Certificates));
    let cert_path = optional_path(p, "redis.tls.cert_file", &raw.cert_file);
    let key_path = optional_path(p, "redis.tls.key_file", &raw.key_file);
    let client = match (cert_path, key_path) {
        (None, None) => None,
        (Some(_), None) => {
            p.push(
                "redis.tls.key_file",
                "is required with redis.tls.cert_file: a client certificate needs its key",
            );
            None
        }
        (None, Some(_)) => {
            p.push(
                "redis.tls.cert_file",
                "is required with redis.tls.key_file: a client key needs its certificate",
            );
            None
        }
        (Some(cert), Some(key)) => {
            let cert = read_pem(p, "redis.tls.cert_file", cert, Pem::Certificates);
            let key = read_pem(p, "redis.tls.key_file", key, Pem::Key);
            match (cert, key) {
                (Some(cert), Some(key)) => {
                    if let Err(e) = key_matches(&cert, &key) {
                        p.push("redis.tls.key_file", e);
                    }
                    Some(ClientCert { cert, key })
                }
                _ => None,
            }
        }
    };
    Some(TlsConfig { ca, client })
}

/// Whether the client key belongs to the certificate's public key, as rustls checks when the
/// connection is made: a mismatch passed the config check and failed only then, exit 1 and no
/// YAML path (found by review).
fn key_matches(cert: &PemFile, key_file: &PemFile) -> Result<(), String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert.pem)
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let key = PrivateKeyDer::from_pem_slice(&key_file.pem).map_err(|e| e.to_string())?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(certs, key)
        .map(|_| ())
        .map_err(|e| {
            format!(
                "{} does not go with the certificate in redis.tls.cert_file ({e})",
                key_file.path.display()
            )
        })
}

fn optional_path(p: &mut Problems, path: &str, v: &Option<Value>) -> Option<PathBuf> {
    match v {
        None | Some(Value::Null) => None,
        some => {
            let s = p.string(path, some, None);
            if s.is_empty() {
                p.push(path, "must not be empty");
                None
            } else {
                Some(PathBuf::from(s))
            }
        }
    }
}

enum Pem {
    Certificates,
    Key,
}

/// Reads a PEM file and checks it holds what it should, so a wrong file is a config problem
/// and not a TLS failure at the first connection.
fn read_pem(p: &mut Problems, path: &str, file: PathBuf, what: Pem) -> Option<PemFile> {
    let pem = match files::read(&file, files::PEM_MAX) {
        Ok(pem) => pem,
        Err(e) => {
            p.push(path, format!("cannot read {}: {e}", file.display()));
            return None;
        }
    };
    let ok = match what {
        Pem::Certificates => {
            let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(&pem).collect();
            match certs {
                Ok(certs) if !certs.is_empty() => Ok(()),
                Ok(_) => Err("holds no PEM certificate".to_string()),
                Err(e) => Err(format!("is not a PEM certificate file: {e}")),
            }
        }
        Pem::Key => PrivateKeyDer::from_pem_slice(&pem)
            .map(|_| ())
            .map_err(|e| format!("holds no PEM private key: {e}")),
    };
    match ok {
        Ok(()) => Some(PemFile { path: file, pem }),
        Err(e) => {
            p.push(path, format!("{} {e}", file.display()));
            None
        }
    }
}

fn read_sentinel(
    p: &mut Problems,
    v: Option<Value>,
    mode: RedisMode,
    overrides: &Overrides,
) -> Option<SentinelConfig> {
    let given = matches!(&v, Some(v) if !v.is_null());
    let raw: RawSentinel = p.section("redis.sentinel", v);
    p.unknown_keys(
        "redis.sentinel",
        &raw.unknown,
        &["master_name", "username", "password_file"],
    );
    if mode != RedisMode::Sentinel {
        if given {
            p.push(
                "redis.sentinel",
                format!("is only used with redis.mode: sentinel (the mode is {mode})"),
            );
        }
        return None;
    }
    let master_name = match &raw.master_name {
        None | Some(Value::Null) => {
            p.push(
                "redis.sentinel.master_name",
                "is required with redis.mode: sentinel (the name the sentinels monitor)",
            );
            String::new()
        }
        some => {
            let name = p.string("redis.sentinel.master_name", some, None);
            if name.is_empty() {
                p.push("redis.sentinel.master_name", "must not be empty");
            }
            name
        }
    };
    let username = match &raw.username {
        None | Some(Value::Null) => None,
        some => Some(p.string("redis.sentinel.username", some, None)),
    };
    let from_file = match &raw.password_file {
        None | Some(Value::Null) => None,
        some => {
            let path = p.string(&join("redis.sentinel", "password_file"), some, None);
            if overrides.redis_sentinel_password.is_some() {
                None
            } else {
                read_password_file(p, "redis.sentinel.password_file", &path)
            }
        }
    };
    Some(SentinelConfig {
        master_name,
        username,
        password: overrides.redis_sentinel_password.clone().or(from_file),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_keeps_the_user_and_hides_the_password() {
        assert_eq!(
            redact("redis://:s3cretpw@127.0.0.1:6398/0"),
            "redis://:***@127.0.0.1:6398/0"
        );
        assert_eq!(
            redact("rediss://alice:pw@h:1,rediss://alice:pw@g:2"),
            "rediss://alice:***@h:1,rediss://alice:***@g:2"
        );
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact("redis://alice@h"), "redis://alice@h");
        // Not percent-encoded: '@' and '/' inside the password.
        assert_eq!(redact("redis://u:p@s/s@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(
            redact("redis+unix:///run/redis.sock?db=1&pass=pw&user=u"),
            "redis+unix:///run/redis.sock?db=1&pass=***&user=u"
        );
        assert_eq!(redact("not a url:pw@x"), "not a url:***@x");
        // Unencoded '?' in a password: more is hidden, nothing leaks.
        assert_eq!(redact("redis://:pa?ss@h:1"), "redis://:***@h:1");
    }

    #[test]
    fn a_config_prints_no_password() {
        let yaml = "redis: {mode: cluster, url: \"redis://u:hunter2@h:1,redis://u:hunter2@h:2\"}\noutbound:\n  streams: [x]\n  routes:\n    a: {rate: 1/s}\n";
        let overrides = Overrides {
            redis_password: Some(Secret::new("from-env")),
            ..Overrides::default()
        };
        let cfg = crate::config::Config::parse(yaml, &overrides).unwrap();
        let shown = format!("{cfg:?} {overrides:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("from-env"),
            "{shown}"
        );
        assert_eq!(
            cfg.redis.password.as_ref().map(Secret::expose),
            Some("from-env")
        );
        assert_eq!(cfg.redis.username.as_deref(), Some("u"));
        assert_eq!(cfg.redis.urls.len(), 2);
    }

    #[test]
    fn secrets_and_urls_print_redacted() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s} {s:?}"), "*** ***");
        let u = RedisUrl::new("redis://bob:hunter2@h:1");
        assert_eq!(
            format!("{u} {u:?}"),
            "redis://bob:***@h:1 \"redis://bob:***@h:1\""
        );
        assert_eq!(u.as_str(), "redis://bob:hunter2@h:1");
    }
}
