#!/usr/bin/env bash
# Runs every test pacer has. Installs what the tests need when it is missing (redis-server,
# faketime, openssl: Debian packages), then: formatting, clippy, the Rust tests (unit, property,
# differential, script-level and process-level, each against its own redis-server), and the
# operations checks in deploy/check.sh.
#
# The test binaries run in two lanes at once, each binary one test at a time: on a two-core
# machine two process-level tests at once would measure each other's load, but most of the
# suite's time is waiting (for a claim_idle, a failover, a paused worker), not work. Measured
# here one binary after another, the Rust tests took about 18 minutes of wall time and 6 of
# CPU. The `waiting` lane holds the binaries that spend nearly all of it waiting (each under
# a quarter of a core on average), and the demo and deploy/check.sh, which install packages
# (one apt-get at a time); every other binary runs in the `main` lane.
#   PACER_TEST_LANES=1   one lane: every binary one after another (for timing work)
# Each binary's output goes to a log under target/test-logs/; a failed binary's log is printed
# in full at the end, and the script exits non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v faketime >/dev/null || missing+=(faketime)
# The TLS tests make certificates; installed here rather than by a test, so that no two
# apt-get runs (a test's in one lane, the demo's in the other) meet on dpkg's lock.
command -v openssl >/dev/null || missing+=(openssl)
if ((${#missing[@]})); then
  echo "installing ${missing[*]} with apt-get" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

cargo fmt --check
cargo clippy --all-targets -- -D warnings

# Builds every test binary, and lists them: "  Executable tests/api.rs (target/debug/deps/api-…)".
logs=target/test-logs
rm -rf "$logs"
mkdir -p "$logs"
cargo test --no-run 2>&1 | tee "$logs/build.log"
# The binary the demo and deploy/check.sh run: the same build as the tests' (regex-syntax in
# Cargo.toml), so this links nothing new, and nothing rebuilds it while the lanes run.
cargo build --bin pacer

# Binaries that spend nearly all their time waiting; measured with /usr/bin/time, binary by
# binary (CPU over wall): recovery 20%, connection 14%, outage 7%, sentinel 12%, secrets 10%,
# acl 12%, cli 22%, inbound 14%, outbound 20%, scripts 28%.
WAITING=(recovery connection sentinel outage cli outbound secrets acl inbound scripts examples)

declare -A binary=()
names=()
while IFS=$'\t' read -r source path; do
  case $source in
    "unittests src/lib.rs") name=lib ;;
    "unittests src/main.rs") name=bin ;;
    *) name=$(basename "$source" .rs) ;;
  esac
  binary[$name]=$path
  names+=("$name")
done < <(sed -n 's/^ *Executable \(.*\) (\(.*\))$/\1\t\2/p' "$logs/build.log")

# A build whose output lists no binary (a changed cargo message) would otherwise pass empty.
if ((${#names[@]} < 2)); then
  echo "test.sh: found ${#names[@]} test binaries in cargo's output ($logs/build.log)" >&2
  exit 1
fi

main_lane=()
waiting_lane=()
for name in "${names[@]}"; do
  if [[ ${PACER_TEST_LANES:-2} != 1 && " ${WAITING[*]} " == *" $name "* ]]; then
    waiting_lane+=("$name")
  else
    main_lane+=("$name")
  fi
done

# run NAME COMMAND...: runs one step from the repo's root (as cargo runs tests), its output to
# $logs/NAME.log; prints a line with its summary (libtest's "test result:", deploy/check.sh's
# "ops:") when it ends, and records it if it failed.
run() {
  local name=$1 start=$SECONDS result=ok
  shift
  "$@" >"$logs/$name.log" 2>&1 || {
    result=FAILED
    echo "$name" >>"$logs/failed"
  }
  echo "test.sh: $result $name ($((SECONDS - start)) s): $(grep -E -m1 '^(test result|ops):' "$logs/$name.log" || echo 'no summary line')"
}

# run_lane NAME...: the test binaries one after another, each one test at a time.
run_lane() {
  local name
  for name; do run "$name" "${binary[$name]}" --test-threads=1; done
}

ops() {
  PACER_BIN="$PWD/target/debug/pacer" deploy/check.sh
}

echo "test.sh: main lane: ${main_lane[*]}"
echo "test.sh: waiting lane: ${waiting_lane[*]:-} ops"
if [[ ${PACER_TEST_LANES:-2} == 1 ]]; then
  run_lane "${main_lane[@]}"
  run ops ops
else
  (run_lane "${waiting_lane[@]}" && run ops ops) &
  waiting=$!
  run_lane "${main_lane[@]}"
  wait "$waiting"
fi
# Doc tests (none yet but the text examples rustdoc skips): cargo runs them after the binaries.
run doc cargo test --doc -- --test-threads=1

if [[ -s $logs/failed ]]; then
  while read -r name; do
    echo
    echo "=================== $name: $logs/$name.log ==================="
    cat "$logs/$name.log"
  done <"$logs/failed"
  echo
  echo "test.sh: FAILED: $(tr '\n' ' ' <"$logs/failed")(after $((SECONDS / 60))m $((SECONDS % 60))s)"
  exit 1
fi
echo "test.sh: everything passed in $((SECONDS / 60))m $((SECONDS % 60))s"
