# deploy/checks/live.sh — pacer for real, when $PACER_BIN exists: check-config on the shipped
# configs (and the overrides the template unit uses), then a real redis-server, pacer and
# Prometheus on free loopback ports under a short load (rejects, reroutes, dead letters,
# duplicates, a burst of Redis OOM errors, synchronous admission over HTTP and gRPC with token
# leases). live_data.sh checks what they show; then /readyz must follow Redis going away and
# coming back, and SIGTERM must drain and exit 0.
# shellcheck shell=bash disable=SC2153 # PACER_BIN, WORK, ... come from deploy/check.sh

# Says so when pacer was stopped by a signal this script did not send.
outside_signal() {
    if grep -q 'SIG\(TERM\|INT\): draining' "$WORK/pacer.log"; then
        echo "note: pacer got SIGTERM/SIGINT from outside this script (another process on the machine, e.g. a pkill)"
    fi
}

# One batch of load: mostly carrier-a (20/s, max_wait 500ms) so it fills,
# reroutes to carrier-b and then rejects; plus dead letters and duplicates.
push_batch() { # push_batch N
    local b=$1 i
    {
        for i in $(seq 1 60); do echo "XADD pacer:out * route carrier-a n $b-$i"; done
        for i in $(seq 1 4); do echo "XADD pacer:out * route carrier-b n $b-$i"; done
        echo "XADD pacer:out * n $b-no-route"
        echo "XADD pacer:out * route nowhere n $b-unknown"
        echo "XADD pacer:out * route carrier-b id dup-$b n first"
        echo "XADD pacer:out * route carrier-b id dup-$b n second"
        # Inbound: one source over its 10/s limit, and one event without its key field.
        for i in $(seq 1 15); do echo "XADD pacer:in * source s1 n $b-$i"; done
        echo "XADD pacer:in * n $b-no-source"
    } | redis-cli -p "$REDIS_PORT" >/dev/null
    admit_batch
}

# Synchronous admission (inbound.api), mostly on the leased rule `api` (gcra 50/s, burst 20):
# a burst past it (answered from leases, then refused locally: allowed and limited without
# Redis), requests on every rule (per-source is not leased, so each reaches Redis; 12 > its
# 10/s), a lone request whose leased token is never spent (wasted when the next batch refills
# it), and one Envoy ShouldRateLimit call. The HTTP status codes go to admit-codes.txt.
admit_batch() {
    local url=http://127.0.0.1:$API_PORT/v1/admit
    {
        # [1-60] is curl's URL globbing: 60 POSTs on one connection (the query is ignored).
        curl -sS --max-time 10 -o /dev/null -w '%{http_code}\n' -d '{"fields":{"source":"api-1"},"rules":["api"]}' "$url?n=[1-60]"
        curl -sS --max-time 10 -o /dev/null -w '%{http_code}\n' -d '{"fields":{"source":"api-2"}}' "$url?n=[1-12]"
        curl -sS --max-time 5 -o /dev/null -w '%{http_code}\n' -d '{"fields":{"source":"api-3"},"rules":["api"]}' "$url"
    } >>"$WORK/admit-codes.txt"
    curl -sS --max-time 5 -o /dev/null --http2-prior-knowledge -H 'content-type: application/grpc' -H 'te: trailers' \
        --data-binary @"$WORK/envoy-request.bin" \
        "http://127.0.0.1:$GRPC_PORT/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
}

live_start() {
    REDIS_PORT=$(free_port)
    METRICS_PORT=$(free_port)
    PROM_PORT=$(free_port)
    API_PORT=$(free_port)
    GRPC_PORT=$(free_port)
    DRAIN=2s
    mkdir -p "$WORK/redis" "$WORK/prom"

    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize no --dir "$WORK/redis" >"$WORK/redis.log" 2>&1 &
    REDIS_PID=$!
    PIDS+=("$REDIS_PID")
    wait_for 10 redis-cli -p "$REDIS_PORT" ping || { echo "redis-server did not start"; cat "$WORK/redis.log"; return 1; }

    cat >"$WORK/pacer.yaml" <<EOF
redis:
  url: redis://127.0.0.1:$REDIS_PORT/0
  timeout: 1s
worker:
  group: pacer
  consumer: check-1
  batch: 64
  max_inflight: 2000
  claim_idle: 5s
  max_deliveries: 3
  drain: $DRAIN
metrics:
  listen: 127.0.0.1:$METRICS_PORT
outbound:
  streams: ["pacer:out"]
  rejected_stream: pacer:rejected
  dead_letter_stream: pacer:dead
  routes:
    carrier-a: {rate: 20/s, burst: 1, max_wait: 500ms, fallbacks: [carrier-b]}
    carrier-b: {rate: 10/s, burst: 1, max_wait: 300ms}
inbound:
  streams: ["pacer:in"]
  forward_stream: pacer:accepted
  rejected_stream: pacer:in-rejected
  api:
    listen: 127.0.0.1:$API_PORT
    grpc_listen: 127.0.0.1:$GRPC_PORT
    domain: pacer
  rules:
    - {name: per-source, key: [source], limits: [10/s]}
    - {name: trial, key: [source], algorithm: gcra, limits: [5/s], mode: shadow}
    # Leased, for the synchronous API. Its burst of 20 passes the 15 stream events a batch
    # sends per source, so the stream flow's outcomes stay per-source's. A 200ms lease
    # outlives a curl burst and has ended by the next batch.
    - {name: api, key: [source], algorithm: gcra, limits: [50/s], burst: 20, lease: {ttl: 200ms, max: 8}}
EOF
    # Envoy's RateLimitRequest{domain: pacer, descriptors: [{entries: [{source: grpc-1}]}]} as
    # a gRPC message (a 0 flag, a 4-byte length, the protobuf), for curl over h2c: a fresh
    # Debian has no grpcurl, nor protoc and Envoy's protos.
    "$PY" -c '
import sys
def ld(field, b):  # a length-delimited protobuf field (these are all under 128 bytes)
    return bytes([field << 3 | 2, len(b)]) + b
msg = ld(1, b"pacer") + ld(2, ld(1, ld(1, b"source") + ld(2, b"grpc-1")))
sys.stdout.buffer.write(b"\0" + len(msg).to_bytes(4, "big") + msg)' >"$WORK/envoy-request.bin"
    if ! env -u PACER_REDIS_URL -u PACER_CONFIG -u PACER_METRICS_LISTEN "$PACER_BIN" check-config --config "$WORK/pacer.yaml" >"$WORK/check-config.log" 2>&1; then
        echo "pacer check-config rejects the test config:"
        cat "$WORK/check-config.log"
        return 1
    fi
    env -u PACER_REDIS_URL -u PACER_CONFIG -u PACER_METRICS_LISTEN RUST_LOG=info \
        "$PACER_BIN" run --config "$WORK/pacer.yaml" >"$WORK/pacer.log" 2>&1 &
    PACER_PID=$!
    PIDS+=("$PACER_PID")
    if ! wait_for 30 is_http "http://127.0.0.1:$METRICS_PORT/readyz" 200; then
        echo "pacer did not become ready on 127.0.0.1:$METRICS_PORT (healthz $(http_code "http://127.0.0.1:$METRICS_PORT/healthz"), readyz $(http_code "http://127.0.0.1:$METRICS_PORT/readyz"))"
        tail -n 30 "$WORK/pacer.log"
        return 1
    fi

    cat >"$WORK/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - $ROOT/deploy/prometheus/alerts.yml
scrape_configs:
  - job_name: pacer
    static_configs:
      - targets: ["127.0.0.1:$METRICS_PORT"]
EOF
    prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/prom" \
        --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >"$WORK/prometheus.log" 2>&1 &
    PROM_PID=$!
    PIDS+=("$PROM_PID")
    if ! wait_for 30 prom_has 'up{job="pacer"} == 1'; then
        echo "Prometheus did not scrape pacer; pacer $(alive "$PACER_PID" && echo running || echo exited)"
        outside_signal
        tail -n 30 "$WORK/prometheus.log"
        return 1
    fi

    # Load in batches a second apart so counters rise between scrapes.
    local b
    for b in 1 2 3 4; do
        push_batch "$b"
        sleep 1
    done
    # A burst of real Redis errors: with maxmemory at 1 byte every write that
    # may grow memory fails with OOM, so pacer's scripts and reads error out.
    # Two bursts, so the error counters exist before the second one raises them.
    redis-cli -p "$REDIS_PORT" config set maxmemory-policy noeviction >/dev/null
    for b in 5 6; do
        push_batch "$b"
        redis-cli -p "$REDIS_PORT" config set maxmemory 1 >/dev/null
        sleep 2
        redis-cli -p "$REDIS_PORT" config set maxmemory 0 >/dev/null
        sleep 1
    done
    for b in 7 8 9; do
        push_batch "$b"
        sleep 1
    done
    alive "$PACER_PID" || { echo "pacer died under load"; outside_signal; tail -n 30 "$WORK/pacer.log"; return 1; }
    # Stream gauges come from a periodic poll: wait for them, then a few scrapes more.
    wait_for 20 prom_has 'pacer_stream_lag' || true
    wait_for 20 prom_has 'pacer_redis_errors_total' || true
    sleep 3
    curl -fsS --max-time 5 "http://127.0.0.1:$METRICS_PORT/metrics" >"$WORK/metrics.txt" ||
        {
            echo "GET /metrics failed; pacer $(alive "$PACER_PID" && echo running || echo exited)"
            outside_signal
            ss -ltnp 2>/dev/null | grep ":$METRICS_PORT " || echo "nothing listens on :$METRICS_PORT"
            tail -n 30 "$WORK/pacer.log"
            return 1
        }
    echo "redis :$REDIS_PORT, pacer :$METRICS_PORT, prometheus :$PROM_PORT; $(redis-cli -p "$REDIS_PORT" xlen pacer:out) events pushed"
}


live_checks() {
    local rc log
    if [ ! -x "$PACER_BIN" ]; then
        skip "live dashboard test" "PACER_BIN $PACER_BIN does not exist (build it first); live dashboard test not run"
        return
    fi
    step "pacer check-config on the shipped configs and the units' overrides" live_check_configs
    want curl redis-server redis-cli prometheus
    if [ -n "$SKIP_REASON" ]; then
        skip "live stack: redis-server, pacer, prometheus, load" "$SKIP_REASON"
        return
    fi
    log=$WORK/live-start.log
    set +e
    live_start >"$log" 2>&1
    rc=$?
    set -e
    record "live stack: redis-server, pacer, prometheus, load" "$rc" "$log"
    [ "$rc" -eq 0 ] || return 0
    live_data_checks
    step_here "/readyz follows Redis down and up" live_readyz
    step_here "SIGTERM drains and exits 0" live_sigterm
}
