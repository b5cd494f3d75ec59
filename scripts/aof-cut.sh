#!/usr/bin/env bash
# How often a kill -9 of Redis cuts its AOF short inside a script, and what the local
# redis-server makes of such a file (README "Redis": why aof-load-truncated no).
#
#   scripts/aof-cut.sh [KILLS]     (140 by default; about a second each)
#
# Each round starts a redis-server (appendfsync always) in a fresh directory, runs scripts
# that each write four stream entries and then one hash field (as pacer's write their outputs,
# then the records that say so), kills it with SIGKILL at a random moment and checks its AOF
# with redis-check-aof. A file cut short is then loaded twice, each time followed by one more
# script and a restart: once by Redis itself (aof-load-truncated yes), once after
# redis-check-aof --fix. Whole scripts only leave 4 entries per field; a half script replayed
# leaves more. Loopback only; every server it starts is stopped.
set -euo pipefail

kills=${1:-140}
script="for i = 1, 4 do redis.call('XADD', 's', '*', 'f', string.rep('x', 50000)) end
redis.call('HSET', 'h', tostring(math.random()) .. redis.call('TIME')[2], 'v')"

for tool in redis-server redis-cli redis-benchmark redis-check-aof; do
  command -v "$tool" >/dev/null || { echo "aof-cut: $tool is missing (apt-get install redis-server)" >&2; exit 1; }
done

work=$(mktemp -d /tmp/aof-cut.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# Starts redis-server on a free loopback port with AOF in $1 (extra arguments after it); sets
# $port and $pid.
start() {
  local dir=$1
  shift
  for _ in 1 2 3 4 5; do
    port=$((20000 + RANDOM % 30000))
    redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save '' --appendonly yes \
      --appendfsync always --logfile "$dir/log" "$@" &
    pid=$!
    pids+=("$pid")
    for _ in $(seq 50); do
      if redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then return 0; fi
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.05
    done
    kill -9 "$pid" 2>/dev/null || true
  done
  return 1
}

stop() {
  redis-cli -p "$port" shutdown >/dev/null 2>&1 || true
  wait "$pid" 2>/dev/null || true
}

# Whether the server on $port holds whole scripts only (4 entries per field).
whole() {
  local entries fields
  entries=$(redis-cli -p "$port" xlen s)
  fields=$(redis-cli -p "$port" hlen h)
  [ "$entries" -eq $((4 * fields)) ]
}

# Loads the AOF in $1 with extra arguments $2..., runs one more script, restarts: whether what
# is left holds whole scripts only ("refused" if Redis would not start).
replayed() {
  local dir=$1
  shift
  if ! start "$dir" "$@"; then
    echo refused
    return
  fi
  redis-cli -p "$port" eval "$script" 0 >/dev/null
  stop
  start "$dir" "$@" || { echo refused; return; }
  if whole; then echo whole; else echo half; fi
  stop
}

cut=0 half=0 fixed_whole=0
for round in $(seq "$kills"); do
  dir="$work/r$round"
  mkdir -p "$dir"
  start "$dir" || { echo "aof-cut: redis-server did not start" >&2; exit 1; }
  redis-benchmark -p "$port" -n 100000000 -c 8 -q eval "$script" 0 >/dev/null 2>&1 &
  load=$!
  sleep "0.$((RANDOM % 9 + 1))"
  kill -9 "$pid"
  wait "$pid" 2>/dev/null || true
  kill "$load" 2>/dev/null || true
  wait "$load" 2>/dev/null || true
  manifest="$dir/appendonlydir/appendonly.aof.manifest"
  if redis-check-aof "$manifest" >/dev/null 2>&1; then
    rm -rf "$dir"
    continue
  fi
  cut=$((cut + 1))
  cp -r "$dir" "$dir.own"
  own=$(replayed "$dir.own" --aof-load-truncated yes)
  [ "$own" = half ] && half=$((half + 1))
  echo y | redis-check-aof --fix "$manifest" >/dev/null 2>&1 || true
  fixed=$(replayed "$dir" --aof-load-truncated no)
  [ "$fixed" = whole ] && fixed_whole=$((fixed_whole + 1))
  echo "round $round: AOF cut short; Redis's own repair: $own; after redis-check-aof --fix: $fixed"
  rm -rf "$dir" "$dir.own"
done
echo "$(redis-server --version | cut -d' ' -f3): $kills kills, $cut AOFs cut short; \
Redis's own repair (aof-load-truncated yes) brought half a script back in $half, \
redis-check-aof --fix left whole scripts in $fixed_whole of $cut"
