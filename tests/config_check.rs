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
