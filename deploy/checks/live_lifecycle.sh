# deploy/checks/live_lifecycle.sh — pacer's process contract, for live.sh: check-config accepts
# the shipped configs and what the systemd template sets per instance, and refuses broken ones
# naming where the value came from; /readyz follows Redis down and up; SIGTERM drains and
# exits 0 within worker.drain.
# shellcheck shell=bash

live_check_configs() {
    local f n=0 listen out
    for f in config.yaml deploy/kubernetes/base/config.yaml; do
        [ -f "$f" ] || continue
        env -u PACER_REDIS_URL -u PACER_CONFIG -u PACER_METRICS_LISTEN "$PACER_BIN" check-config --config "$f"
        n=$((n + 1))
    done
    # A broken config must be refused.
    printf 'worker: {batch: 0}\noutbound: {streams: ["pacer:out"], routes: {a: {rate: 10/day}}}\n' >"$WORK/bad.yaml"
    if env -u PACER_REDIS_URL -u PACER_METRICS_LISTEN "$PACER_BIN" check-config --config "$WORK/bad.yaml"; then
        echo "check-config accepted a broken config"
        return 1
    fi
    # pacer@.service: PACER_METRICS_LISTEN with the instance name for %i. A port is accepted;
    # anything else is refused before the worker starts (ExecStartPre), naming its source.
    listen=$(sed -n 's/^Environment=PACER_METRICS_LISTEN=//p' 'deploy/systemd/pacer@.service')
    [ -n "$listen" ] || { echo "pacer@.service sets no PACER_METRICS_LISTEN"; return 1; }
    env -u PACER_REDIS_URL -u PACER_CONFIG PACER_METRICS_LISTEN="${listen//%i/9465}" \
        "$PACER_BIN" check-config --config config.yaml
    if out=$(env -u PACER_REDIS_URL -u PACER_CONFIG PACER_METRICS_LISTEN="${listen//%i/worker-a}" \
        "$PACER_BIN" check-config --config config.yaml 2>&1); then
        echo "check-config accepted PACER_METRICS_LISTEN=${listen//%i/worker-a}"
        return 1
    fi
    echo "$out"
    grep -q 'metrics.listen (from PACER_METRICS_LISTEN): ' <<<"$out"
    out=$(env -u PACER_REDIS_URL -u PACER_CONFIG -u PACER_METRICS_LISTEN \
        "$PACER_BIN" check-config --config config.yaml --metrics-listen 9465 2>&1) && return 1
    echo "$out"
    grep -q 'metrics.listen (from --metrics-listen): ' <<<"$out"
    note "$n shipped config(s) accepted, a broken one refused"
    note "pacer@9465 accepted (${listen//%i/9465}); a non-port instance and a bad --metrics-listen refused, naming their source"
}

# Down -> 503 and pacer_ready 0 (with /healthz still 200), back -> 200.
live_readyz() {
    local rc=0 down_metrics
    kill "$REDIS_PID"
    wait "$REDIS_PID" 2>/dev/null || true
    if wait_for 20 is_http "http://127.0.0.1:$METRICS_PORT/readyz" 503; then
        down_metrics=$(curl -fsS --max-time 5 "http://127.0.0.1:$METRICS_PORT/metrics" || true)
        echo "=> Redis stopped: /readyz 503, $(grep -E '^pacer_ready' <<<"$down_metrics")"
        grep -Eq '^pacer_ready(\{[^}]*\})? 0$' <<<"$down_metrics" || { echo "pacer_ready not 0"; rc=1; }
        is_http "http://127.0.0.1:$METRICS_PORT/healthz" 200 || { echo "/healthz not 200 while Redis is down"; rc=1; }
    else
        echo "/readyz still $(http_code "http://127.0.0.1:$METRICS_PORT/readyz") 20s after Redis stopped"
        rc=1
    fi
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize no --dir "$WORK/redis" >>"$WORK/redis.log" 2>&1 &
    REDIS_PID=$!
    PIDS+=("$REDIS_PID")
    if wait_for 30 is_http "http://127.0.0.1:$METRICS_PORT/readyz" 200; then
        echo "=> Redis back: /readyz 200"
    else
        echo "/readyz not back to 200 within 30s of Redis returning"
        tail -n 20 "$WORK/pacer.log"
        rc=1
    fi
    alive "$PACER_PID" || { echo "pacer exited while Redis was down"; rc=1; }
    return "$rc"
}

live_sigterm() {
    local rc=0 t0 limit code
    t0=$(date +%s.%N)
    kill -TERM "$PACER_PID"
    limit=$(($(duration_s "$DRAIN" | cut -d. -f1) + 5))
    if wait_for "$limit" bash -c "! kill -0 $PACER_PID"; then
        wait "$PACER_PID"
        code=$?
        echo "=> exited $code after $(python3 -c "import time; print(round(time.time() - $t0, 2))")s (drain $DRAIN)"
        [ "$code" -eq 0 ] || rc=1
    else
        echo "pacer still running ${limit}s after SIGTERM (drain $DRAIN)"
        rc=1
    fi
    tail -n 5 "$WORK/pacer.log"
    return "$rc"
}
