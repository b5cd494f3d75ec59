#!/usr/bin/env bash
# What one idle worker with many routes costs Redis and itself (README "Thousands of routes").
#
#   scripts/idle-cost.sh [ROUTES] [SECONDS] [PACER]   (5000, 20, target/release/pacer)
#
# Starts a redis-server on a free loopback port and one pacer worker with ROUTES routes of
# 100/s (every other one with the one before it as its fallback) and no events, lets it settle
# for 5 s, then prints over SECONDS: Redis's CPU and the worker's, as % of a core (`INFO cpu`,
# /proc/<pid>/stat), the commands Redis ran with their time (`INFO commandstats`), and the same
# for a redis-server nobody calls (what Redis costs by itself). Build first:
# `cargo build --release`. Everything it starts is stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

routes=${1:-5000}
seconds=${2:-20}
pacer=${3:-target/release/pacer}
for tool in redis-server redis-cli python3; do
  command -v "$tool" >/dev/null || { echo "idle-cost: $tool is missing" >&2; exit 1; }
done
[ -x "$pacer" ] || { echo "idle-cost: no $pacer (cargo build --release)" >&2; exit 1; }

work=$(mktemp -d /tmp/idle-cost.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Starts a redis-server in $work/$1; sets $port and $rpid.
start_redis() {
  mkdir -p "$work/$1"
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --dir "$work/$1" --save '' --appendonly no \
    --logfile "$work/$1/redis.log" &
  rpid=$!
  pids+=("$rpid")
  for _ in $(seq 100); do
    redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && return 0
    sleep 0.1
  done
  echo "idle-cost: redis-server did not start" >&2
  exit 1
}

redis_cpu() {
  redis-cli -p "$1" INFO cpu | awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { printf "%.4f", s }'
}
process_cpu() {
  # utime + stime, in clock ticks: fields 14 and 15 after the command's closing parenthesis.
  sed 's/.*) //' "/proc/$1/stat" | awk -v hz="$(getconf CLK_TCK)" '{ printf "%.4f", ($12 + $13) / hz }'
}
percent() {
  awk -v a="$1" -v b="$2" -v s="$seconds" 'BEGIN { printf "%.3f%%", (b - a) / s * 100 }'
}

# Redis alone, nobody calling it.
start_redis alone
r0=$(redis_cpu "$port")
sleep "$seconds"
r1=$(redis_cpu "$port")
echo "a redis-server nobody calls, ${seconds} s: $(percent "$r0" "$r1") of a core"

start_redis worker
{
  echo "redis: {url: \"redis://127.0.0.1:$port\"}"
  echo "metrics: {listen: \"127.0.0.1:$(free_port)\"}"
  echo "outbound:"
  echo "  streams: [in]"
  echo "  routes:"
  for ((r = 0; r < routes; r++)); do
    if ((r % 2 == 1)); then
      echo "    r$r: {rate: 100/s, fallbacks: [r$((r - 1))]}"
    else
      echo "    r$r: {rate: 100/s}"
    fi
  done
} >"$work/config.yaml"
RUST_LOG=warn "$pacer" run --config "$work/config.yaml" >"$work/pacer.log" 2>&1 &
wpid=$!
pids+=("$wpid")
for _ in $(seq 100); do
  redis-cli -p "$port" XINFO GROUPS in 2>/dev/null | grep -q name && break
  sleep 0.1
done
sleep 5
redis-cli -p "$port" CONFIG RESETSTAT >/dev/null
r0=$(redis_cpu "$port")
w0=$(process_cpu "$wpid")
sleep "$seconds"
r1=$(redis_cpu "$port")
w1=$(process_cpu "$wpid")
echo "one idle worker, $routes routes, ${seconds} s: Redis $(percent "$r0" "$r1") of a core, the worker $(percent "$w0" "$w1")"
echo "commands Redis ran (calls, µs):"
redis-cli -p "$port" INFO commandstats |
  awk -F'[:=,]' '/^cmdstat_/ { sub("cmdstat_", "", $1); printf "  %-18s %8d %8d\n", $1, $3, $5; c += $3; u += $5 }
                 END { printf "  %-18s %8d %8d\n", "all", c, u }'
