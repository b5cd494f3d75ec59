#!/usr/bin/env bash
# Runs pacer for real with the repo's config.yaml: brings up a local Redis (installing
# redis-server with apt-get when missing), builds and starts pacer, pushes a burst of demo
# events, and shows them coming out paced per route. Stops everything it started on exit,
# pacer first (it drains), then Redis.
#   PACER_DEMO_EVENTS=300    how many events to push
#   PACER_DEMO_TIMEOUT=60    seconds each wait may take (Redis up, pacer ready, events settled)
#   PACER_REDIS_URL=...      use this Redis instead of starting one
#   PACER_DEMO_PROFILE=dev   build and run pacer's debug build (the test suite's, already
#                            built) instead of a release build
# Every wait has a timeout; when one runs out, or pacer exits early, the demo says which wait
# failed, shows the end of pacer's log and exits non-zero. pacer serves its metrics on a free
# port (PACER_METRICS_LISTEN), so a busy 9464 is no obstacle.
set -euo pipefail
cd "$(dirname "$0")/.."
events=${PACER_DEMO_EVENTS:-300}
limit=${PACER_DEMO_TIMEOUT:-60}

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)
command -v python3 >/dev/null || missing+=(python3)
command -v curl >/dev/null || missing+=(curl)
if ((${#missing[@]})); then
  echo "installing ${missing[*]} with apt-get" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

work=$(mktemp -d)
pacer_pid=
redis_pid=
keep=

# Stops pacer before Redis: a pacer whose Redis vanishes under it logs every failed call
# ("broken pipe") while it drains.
cleanup() {
  if [[ -n $pacer_pid ]] && kill -0 "$pacer_pid" 2>/dev/null; then
    kill -TERM "$pacer_pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pacer_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pacer_pid" 2>/dev/null || true
  fi
  [[ -z $pacer_pid ]] || wait "$pacer_pid" 2>/dev/null || true
  [[ -z $redis_pid ]] || { kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; }
  # pacer's log is in a file; what went wrong in it, shutdown included, still shows.
  if [[ -z $keep && -s $work/pacer.log ]] && grep -qE 'WARN|ERROR' "$work/pacer.log"; then
    echo "pacer logged warnings or errors:" >&2
    grep -E 'WARN|ERROR' "$work/pacer.log" | tail -n 10 >&2
  fi
  if [[ -n $keep ]]; then echo "demo: kept $work (logs)" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {
  echo "demo: $*" >&2
  if [[ -s $work/pacer.log ]]; then
    echo "--- last lines of pacer's log ($work/pacer.log) ---" >&2
    tail -n 20 "$work/pacer.log" >&2
  fi
  keep=1
  exit 1
}

# wait_for WHAT COMMAND...: polls COMMAND every 0.1 s; fails after $limit seconds, or as soon
# as redis-server or pacer (whichever was started) has exited.
wait_for() {
  local what=$1 deadline=$((SECONDS + limit)) code=0
  shift
  until "$@" >/dev/null 2>&1; do
    if [[ -n $redis_pid ]] && ! kill -0 "$redis_pid" 2>/dev/null; then
      wait "$redis_pid" || code=$?
      redis_pid=
      fail "redis-server exited (status $code) while waiting for $what: $(tail -n 3 "$work/redis.log")"
    fi
    if [[ -n $pacer_pid ]] && ! kill -0 "$pacer_pid" 2>/dev/null; then
      wait "$pacer_pid" || code=$?
      pacer_pid=
      fail "pacer exited (status $code) while waiting for $what"
    fi
    ((SECONDS < deadline)) || fail "timed out after ${limit}s waiting for $what"
    sleep 0.1
  done
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

if [[ -z "${PACER_REDIS_URL:-}" ]]; then
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" \
    >"$work/redis.log" 2>&1 &
  redis_pid=$!
  export PACER_REDIS_URL="redis://127.0.0.1:$port"
  wait_for "redis-server on 127.0.0.1:$port" redis-cli -p "$port" ping
  echo "redis-server on 127.0.0.1:$port (data discarded on exit)"
fi

profile=${PACER_DEMO_PROFILE:-release}
cargo build --profile "$profile" --bin pacer --quiet
pacer=target/$([[ $profile == dev ]] && echo debug || echo "$profile")/pacer
PACER_METRICS_LISTEN="127.0.0.1:$(free_port)"
export PACER_METRICS_LISTEN
$pacer check-config --config config.yaml
RUST_LOG=${RUST_LOG:-info} $pacer run --config config.yaml >"$work/pacer.log" 2>&1 &
pacer_pid=$!
wait_for "pacer's /readyz on $PACER_METRICS_LISTEN" curl -fsS --max-time 2 "http://$PACER_METRICS_LISTEN/readyz"
echo "pacer is ready: http://$PACER_METRICS_LISTEN/metrics (log: $work/pacer.log)"

produced_at=$SECONDS
timeout "$limit" $pacer produce --config config.yaml --count "$events" --routes carrier-a --bad-every 50 ||
  fail "pacer produce failed or took over ${limit}s"
echo "what pacer is doing now (pacer inspect):"
timeout "$limit" $pacer inspect --config config.yaml || fail "pacer inspect failed or took over ${limit}s"
echo
echo "waiting for every event to be dispatched, rerouted, rejected or dead-lettered..."
# Settled: the group has read every entry of the input stream (lag 0) and holds none pending.
settled() {
  redis-cli -u "$PACER_REDIS_URL" xinfo groups pacer:out |
    awk 'prev == "pending" { p = $0 } prev == "lag" { l = $0 } { prev = $0 } END { exit !(p == "0" && l == "0") }'
}
wait_for "every event of pacer:out to be settled" settled
echo
# Only this run's entries, should PACER_REDIS_URL point at a Redis an earlier demo wrote to.
since="$((SECONDS - produced_at + 2))s"
timeout "$limit" $pacer report --config config.yaml --since "$since" || fail "pacer report failed or took over ${limit}s"
echo
echo "rate x 1 s + burst is the most any 1-second window may hold; 'rerouted' counts events that"
echo "came to a route as a fallback; lateness is ready entry id ms minus its slot (pacer_slot_us, in ms),"
echo "which is re-planned to when the event went if it missed its slot by over 1 ms: the metric"
echo "pacer_lateness_seconds measures lateness against the decided slot."
