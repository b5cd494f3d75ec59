# deploy/checks/lib.sh — helpers shared by the concerns; sourced by deploy/check.sh.
# shellcheck shell=bash disable=SC2034 # its settings are read by the concern files

KUBERNETES_VALIDATE_VERSION=1.37.0
# systemd-analyze security exposure, 0 (locked down) .. 10 (wide open).
SYSTEMD_EXPOSURE_MAX=2.0
# Grafana variables when evaluating panel queries outside Grafana.
RATE_INTERVAL=1m
K8S=deploy/kubernetes

note() { echo "=> $*"; }
die() { echo "check.sh: $*" >&2; exit 1; }

# Durations as pacer writes them (250ms, 5s, 1m) to seconds.
duration_s() {
    "$PY" -c '
import re, sys
m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*", sys.argv[1])
if not m:
    sys.exit("not a duration: %r" % sys.argv[1])
print(float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)])' "$1"
}

# worker.drain of a config file (default 5s, as pacer's).
config_drain() {
    "$PY" -c '
import sys, yaml
c = yaml.safe_load(open(sys.argv[1])) or {}
print((c.get("worker") or {}).get("drain") or "5s")' "$1"
}

# Prints one line per dashboard query target: PANEL_ID<TAB>REF<TAB>TITLE<TAB>EXPR with Grafana
# variables replaced (all-values regex, fixed rate interval).
dashboard_queries() {
    "$PY" "$CHECKS/dashboard.py" queries "$ROOT/dashboards/pacer.json" "$RATE_INTERVAL"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
wait_for() { # wait_for SECONDS COMMAND... : polls every 0.2s
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 0.2
    done
}
http_code() { curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1" || true; }
is_http() { [ "$(http_code "$1")" = "$2" ]; }
alive() { kill -0 "$1" 2>/dev/null; }
