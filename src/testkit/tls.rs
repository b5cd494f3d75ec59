//! TLS for tests: a small CA, a server certificate for 127.0.0.1 and a client certificate made
//! with `openssl` (plus a second CA that signed nothing, to be the wrong one), and a
//! `redis-server` that speaks only TLS on a free loopback port.

use super::{
    came_up, ensure_openssl_installed, free_port, started_on_a_free_port, RedisServer, TempDir,
};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Certificates and keys in one scratch directory, removed on drop.
pub struct TlsFiles {
    _dir: TempDir,
    /// The CA that signed the server and client certificates.
    pub ca: PathBuf,
    /// A CA that signed neither: verifying the server against it must fail.
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TlsFiles {
    /// Generates everything (P-256 keys: quick to make, and both rustls and Redis's OpenSSL
    /// take them). Certificates are valid for two days.
    pub fn generate() -> TlsFiles {
        ensure_openssl_installed();
        let dir = TempDir::new("tls");
        let d = dir.path();
        let p = |name: &str| d.join(name);
        make_ca(d, "ca", "pacer test CA");
        make_ca(d, "other-ca", "pacer wrong CA");
        dir.write(
            "server.ext",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1\n",
        );
        dir.write(
            "client.ext",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
        );
        make_leaf(d, "server", "127.0.0.1");
        make_leaf(d, "client", "pacer-client");
        TlsFiles {
            ca: p("ca.pem"),
            other_ca: p("other-ca.pem"),
            server_cert: p("server.pem"),
            server_key: p("server.key"),
            client_cert: p("client.pem"),
            client_key: p("client.key"),
            _dir: dir,
        }
    }

    /// A `redis-server` with TLS only (`--port 0 --tls-port <free>`), trusting `ca` for client
    /// certificates, which it requires when `require_client_cert`. Returns once it answers a
    /// TLS PING (with the client certificate), on another port if it does not come up
    /// (`started_on_a_free_port`).
    pub fn start_server(&self, require_client_cert: bool) -> RedisServer {
        started_on_a_free_port(|| {
            let port = free_port();
            let mut server =
                RedisServer::spawn_on(port, &self.server_args(port, require_client_cert));
            match came_up(|| server.is_running(), || self.ping(port)) {
                Ok(()) => Ok(server),
                Err(why) => Err(format!(
                    "the TLS redis-server on port {port} did not start ({why}); its log ends:\n{}",
                    server.log_tail()
                )),
            }
        })
    }

    /// The `redis-server` arguments (or sentinel config directives, one pair per line) that
    /// make a node speak only TLS on `port` with this server certificate, trusting `ca` for
    /// client certificates and requiring one when `require_client_cert`. A node that talks to
    /// others (replication, the cluster bus, sentinels) needs `--tls-replication yes` /
    /// `--tls-cluster yes` besides: its outgoing links present the same certificate.
    pub fn server_args(&self, port: u16, require_client_cert: bool) -> Vec<String> {
        let s = |p: &Path| p.display().to_string();
        [
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &s(&self.server_cert),
            "--tls-key-file",
            &s(&self.server_key),
            "--tls-ca-cert-file",
            &s(&self.ca),
            "--tls-auth-clients",
            if require_client_cert { "yes" } else { "no" },
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    }

    /// A blocking TLS PING to 127.0.0.1:`port` with this CA and the client certificate.
    pub fn ping(&self, port: u16) -> bool {
        let read = |p: &Path| std::fs::read(p).expect("reading a test certificate");
        let certs = redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read(&self.client_cert),
                client_key: read(&self.client_key),
            }),
            root_cert: Some(read(&self.ca)),
        };
        let _ = rustls::crypto::ring::default_provider().install_default();
        let Ok(client) = redis::Client::build_with_tls(format!("rediss://127.0.0.1:{port}"), certs)
        else {
            return false;
        };
        client
            .get_connection_with_timeout(Duration::from_secs(1))
            .and_then(|mut con| redis::cmd("PING").query::<String>(&mut con))
            .is_ok()
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running openssl");
    assert!(
        out.status.success(),
        "openssl {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `openssl req` making a P-256 key `<name>.key` for `/CN=<cn>`, writing `out` (`-x509`
/// in `extra` makes it a self-signed certificate rather than a signing request).
fn new_key(dir: &Path, name: &str, cn: &str, out: &str, extra: &[&str]) {
    let (key, subject) = (format!("{name}.key"), format!("/CN={cn}"));
    let mut args = vec![
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &key,
        "-out",
        out,
        "-subj",
        &subject,
    ];
    args.extend_from_slice(extra);
    openssl(dir, &args);
}

/// A self-signed CA: `<name>.pem` and `<name>.key`.
fn make_ca(dir: &Path, name: &str, cn: &str) {
    new_key(
        dir,
        name,
        cn,
        &format!("{name}.pem"),
        &[
            "-x509",
            "-days",
            "2",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// A certificate `<name>.pem` (key `<name>.key`) signed by `ca`, with the extensions in
/// `<name>.ext`.
fn make_leaf(dir: &Path, name: &str, cn: &str) {
    new_key(dir, name, cn, &format!("{name}.csr"), &[]);
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}
