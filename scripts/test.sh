#!/usr/bin/env bash
# Runs every test pacer has. Installs what the tests need when it is missing (redis-server,
# faketime: Debian packages), then: formatting, clippy, the Rust tests (unit, property,
# differential, script-level and process-level, each against its own redis-server), and the
# operations checks in deploy/check.sh when present.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v faketime >/dev/null || missing+=(faketime)
if ((${#missing[@]})); then
  echo "installing ${missing[*]} with apt-get" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

cargo fmt --check
cargo clippy --all-targets -- -D warnings
# One test at a time inside each binary: the process-level tests time real dispatches, and on a
# two-core machine two of them at once would measure each other.
cargo test -- --test-threads=1

if [[ -x deploy/check.sh ]]; then
  cargo build --bin pacer
  PACER_BIN="$PWD/target/debug/pacer" deploy/check.sh
fi
echo "test.sh: everything passed in $((SECONDS / 60))m $((SECONDS % 60))s"
