//! `pacer check-config` and `pacer run` refuse bad configs, printing every problem with its path.
//! Each fixture under `tests/fixtures/bad/` holds one kind of mistake and, in `# expect:` lines,
//! every message it must produce: no more problems, no fewer.

use std::path::Path;
use std::process::Command;

fn pacer(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pacer"))
        .args(args)
        .env_remove("PACER_CONFIG")
        .env_remove("PACER_REDIS_URL")
        .env_remove("PACER_METRICS_LISTEN")
        .env_remove("PACER_REDIS_MODE")
        .env_remove("PACER_REDIS_PASSWORD")
        .env_remove("PACER_REDIS_SENTINEL_PASSWORD")
        .output()
        .expect("running pacer");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_bad_fixture_is_refused_with_exactly_its_problems() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bad");
    let mut fixtures: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    fixtures.sort();
    assert!(
        fixtures.len() >= 20,
        "expected one fixture per kind of mistake"
    );
    for path in fixtures {
        let text = std::fs::read_to_string(&path).unwrap();
        let expected: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# expect: "))
            .collect();
        assert!(
            !expected.is_empty(),
            "{} has no # expect: line",
            path.display()
        );
        let (code, _, stderr) = pacer(&["check-config", "--config", path.to_str().unwrap()]);
        assert_eq!(code, 2, "{}: exit code\n{stderr}", path.display());
        for e in &expected {
            assert!(
                stderr.contains(e.trim_end()),
                "{}: missing {e:?} in\n{stderr}",
                path.display()
            );
        }
        let problems = stderr.lines().filter(|l| l.starts_with("  ")).count();
        assert_eq!(
            problems,
            expected.len(),
            "{}: problem count in\n{stderr}",
            path.display()
        );
    }
}

#[test]
fn the_documented_example_config_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.yaml");
    let (code, stdout, stderr) = pacer(&["check-config", "--config", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("ok (2 routes"), "{stdout}");
}

#[test]
fn run_refuses_to_start_on_a_bad_config() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bad/every_problem_at_once.yaml");
    let (code, _, stderr) = pacer(&["run", "--config", path.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(stderr.contains("7 problems in the config"), "{stderr}");
}

#[test]
fn pacer_config_names_the_file_and_a_missing_file_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_pacer"))
        .arg("check-config")
        .env("PACER_CONFIG", "/nonexistent/pacer.yaml")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr.contains("/nonexistent/pacer.yaml: cannot read the config file"),
        "{stderr}"
    );
}

/// An endless file (or one that keeps growing) is refused at the config's bound: before,
/// `--config /dev/zero` grew by a gigabyte a second until the OOM killer came.
#[test]
fn an_endless_config_file_is_refused_at_its_bound() {
    let (code, _, stderr) = pacer(&["check-config", "--config", "/dev/zero"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr
            .contains("/dev/zero: cannot read the config file: it holds more than 16777216 bytes"),
        "{stderr}"
    );
}

#[test]
fn a_bad_metrics_listen_override_is_refused_naming_its_source() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.yaml");
    let path = path.to_str().unwrap();
    let check = |flag: Option<&str>, env: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pacer"));
        cmd.args(["check-config", "--config", path])
            .env_remove("PACER_CONFIG")
            .env_remove("PACER_REDIS_URL")
            .env_remove("PACER_METRICS_LISTEN");
        if let Some(f) = flag {
            cmd.args(["--metrics-listen", f]);
        }
        if let Some(e) = env {
            cmd.env("PACER_METRICS_LISTEN", e);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = check(None, Some("localhost-9464"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("metrics.listen (from PACER_METRICS_LISTEN): invalid socket address"),
        "{stderr}"
    );
    let (code, stderr) = check(Some("9464"), None);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("metrics.listen (from --metrics-listen): invalid socket address"),
        "{stderr}"
    );
    // The flag wins over the environment.
    assert_eq!(check(Some("127.0.0.1:9500"), Some("bad")).0, Some(0));
    assert_eq!(check(None, Some("127.0.0.1:9500")).0, Some(0));
}

/// deploy/README.md: the cluster-tls overlay's Secret is generated from placeholders, and
/// "pacer refuses to start on the placeholders". Its config, with the Secret's mount pointed
/// at the placeholder files themselves: `check-config` (and so `run`) refuses each PEM file by
/// its path, before any connection is tried; with real PEM files in their place it loads.
#[test]
fn the_cluster_tls_overlays_placeholder_secrets_are_refused() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let overlay = root.join("deploy/kubernetes/overlays/cluster-tls");
    let config = std::fs::read_to_string(overlay.join("config.yaml")).unwrap();
    let dir = std::env::temp_dir().join(format!("pacer-placeholders-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let with_secrets = |secrets: &Path| {
        let text = config.replace(
            "/run/secrets/pacer-redis/",
            &format!("{}/", secrets.display()),
        );
        assert_ne!(
            text, config,
            "the overlay no longer mounts its Secret there"
        );
        let path = dir.join("config.yaml");
        std::fs::write(&path, text).unwrap();
        pacer(&["check-config", "--config", path.to_str().unwrap()])
    };
    let (code, _, stderr) = with_secrets(&overlay.join("secrets"));
    assert_eq!(code, 2, "{stderr}");
    for problem in [
        "redis.tls.ca_file",
        "redis.tls.cert_file",
        "redis.tls.key_file",
    ] {
        assert!(stderr.contains(problem), "{problem} not refused:\n{stderr}");
    }
    assert!(stderr.contains("holds no PEM certificate"), "{stderr}");
    assert!(stderr.contains("holds no PEM private key"), "{stderr}");

    // The same config with real PEM files where the placeholders were: it loads.
    let real = dir.join("real");
    std::fs::create_dir_all(&real).unwrap();
    pacer::testkit::ensure_openssl_installed();
    let made = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=pacer-test"])
        .arg("-keyout")
        .arg(real.join("tls.key"))
        .arg("-out")
        .arg(real.join("tls.crt"))
        .output()
        .expect("openssl");
    assert!(made.status.success(), "{made:?}");
    std::fs::copy(real.join("tls.crt"), real.join("ca.crt")).unwrap();
    std::fs::write(real.join("password"), "a-real-one").unwrap();
    let (code, _, stderr) = with_secrets(&real);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 0, "real PEM files refused:\n{stderr}");
}
