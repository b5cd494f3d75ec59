#!/usr/bin/env bash
# Runs pacer for real with the repo's config.yaml: brings up a local Redis (installing
# redis-server with apt-get when missing), builds and starts pacer, pushes a burst of demo
# events, and shows them coming out paced per route. Stops everything it started on exit.
#   PACER_DEMO_EVENTS=300   how many events to push
#   PACER_REDIS_URL=...     use this Redis instead of starting one
set -euo pipefail
cd "$(dirname "$0")/.."
events=${PACER_DEMO_EVENTS:-300}

if ! command -v redis-server >/dev/null; then
  echo "installing redis-server with apt-get" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

if [[ -z "${PACER_REDIS_URL:-}" ]]; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  dir=$(mktemp -d)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" >/dev/null &
  pids+=($!)
  export PACER_REDIS_URL="redis://127.0.0.1:$port"
  until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.1; done
  echo "redis-server on 127.0.0.1:$port (data in $dir, discarded on exit)"
fi

cargo build --release --quiet
pacer=target/release/pacer
$pacer check-config --config config.yaml
RUST_LOG=${RUST_LOG:-info} $pacer run --config config.yaml &
pids+=($!)
until curl -fsS http://127.0.0.1:9464/readyz >/dev/null 2>&1; do sleep 0.1; done
echo "pacer is ready: http://127.0.0.1:9464/metrics"

$pacer produce --config config.yaml --count "$events" --routes carrier-a --bad-every 50
echo "waiting for every event to be dispatched, rerouted, rejected or dead-lettered..."
for _ in $(seq 1 100); do
  pending=$(redis-cli -u "$PACER_REDIS_URL" xpending pacer:out pacer | head -1)
  [[ "$pending" == "0" ]] && break
  sleep 0.1
done
sleep 0.5
echo
$pacer report --config config.yaml
echo
echo "rate x 1 s + burst is the most any 1-second window may hold; 'rerouted' counts events that"
echo "came to a route as a fallback; lateness is ready entry id ms minus pacer_slot_ms."
