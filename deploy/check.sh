#!/usr/bin/env bash
# deploy/check.sh — checks pacer's operations side with the real tools.
#
#   bash deploy/check.sh            # from anywhere; PACER_BIN=path/to/pacer to pick the binary
#   PACER_OPS_KEEP=1 bash deploy/check.sh   # keep the temp dir (logs, configs, renders)
#
# Static (always):
#   - promtool check rules / test rules on deploy/prometheus, and proof that the
#     alert tests can fail (mutated thresholds must break them);
#   - dashboards/pacer.json: parses, is importable (datasource variable, ids,
#     layout), every panel query parses as PromQL (promtool);
#   - systemd-analyze verify (in a temporary root with a stub binary) and
#     systemd-analyze security with an exposure threshold;
#   - kustomize build of the base and the KEDA overlay, kubernetes-validate
#     --strict on the output, CRDs (ServiceMonitor, ScaledObject,
#     TriggerAuthentication) against the schemas in deploy/kubernetes/schemas,
#     and cross-references (selectors, ports, probes, secrets, grace vs drain);
#   - Dockerfile consistent with the above.
# Live (only when $PACER_BIN exists; default target/debug/pacer):
#   - pacer check-config on the shipped configs;
#   - a real redis-server, a real pacer and a real Prometheus on free loopback
#     ports; a short load of a few hundred events (with rejects, reroutes, dead
#     letters, duplicates and a burst of Redis OOM errors); then every metric
#     named in the contract must be exposed, every dashboard query must return
#     data through Prometheus's HTTP API, every alert rule must evaluate
#     cleanly, /readyz must follow Redis going away and coming back, and
#     SIGTERM must drain and exit 0.
#
# Installs what it lacks (apt: prometheus, systemd, redis-server, redis-tools,
# jq, curl, python3-venv; PyPI: kubernetes-validate in a cached venv). Prints
# `ops: N passed, N failed` last and exits non-zero on any failure.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PACER_BIN=${PACER_BIN:-target/debug/pacer}
case $PACER_BIN in /*) ;; *) PACER_BIN=$ROOT/$PACER_BIN ;; esac
CACHE=${PACER_OPS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pacer-ops}
KUBERNETES_VALIDATE_VERSION=1.37.0
# systemd-analyze security exposure, 0 (locked down) .. 10 (wide open).
SYSTEMD_EXPOSURE_MAX=2.0
# Grafana variables when evaluating panel queries outside Grafana.
RATE_INTERVAL=1m

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pacer-ops.XXXXXX")
PIDS=()
START=$SECONDS

cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ -n "${PACER_OPS_KEEP:-}" ]; then
        echo "kept $WORK (logs, configs, rendered manifests)"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------ reporting
PASSED=0
FAILED=0
SKIPPED=0
FAILURES=()

record() { # record NAME RC LOGFILE
    local name=$1 rc=$2 log=$3
    if [ "$rc" -eq 0 ]; then
        PASSED=$((PASSED + 1))
        printf 'ok    %s\n' "$name"
        grep -h '^=> ' "$log" 2>/dev/null | sed 's/^=> /        /' || true
    elif [ "$rc" -eq 77 ]; then
        SKIPPED=$((SKIPPED + 1))
        printf 'skip  %s: %s\n' "$name" "$(tail -n 1 "$log")"
    else
        FAILED=$((FAILED + 1))
        FAILURES+=("$name")
        printf 'FAIL  %s\n' "$name"
        tail -n 60 "$log" | sed 's/^/        /'
    fi
}

# Runs a check function in a subshell with errexit on, so any failing command
# fails the check (errexit is ignored in functions called from `if`).
step() { # step NAME FUNCTION [ARGS...]
    local name=$1 rc=0 log
    shift
    log=$WORK/step-$((PASSED + FAILED + SKIPPED + 1)).log
    set +e
    (set -e; "$@") >"$log" 2>&1
    rc=$?
    set -e
    record "$name" "$rc" "$log"
}

note() { echo "=> $*"; }
die() { echo "check.sh: $*" >&2; exit 1; }

# ------------------------------------------------------------------ installs
APT_UPDATED=0
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        die "need root (or sudo) to install: $*"
    fi
}
apt_install() { # apt_install PACKAGE...
    if [ "$APT_UPDATED" -eq 0 ]; then
        as_root apt-get update -qq >"$WORK/apt.log" 2>&1 || { cat "$WORK/apt.log"; die "apt-get update failed"; }
        APT_UPDATED=1
    fi
    echo "installing (apt): $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >>"$WORK/apt.log" 2>&1 || { tail -n 30 "$WORK/apt.log"; die "apt-get install $* failed"; }
}
need() { # need COMMAND APT_PACKAGE
    command -v "$1" >/dev/null 2>&1 || apt_install "$2"
    command -v "$1" >/dev/null 2>&1 || die "$1 still missing after installing $2"
}

need promtool prometheus
need prometheus prometheus
need systemd-analyze systemd
need jq jq
need curl curl
need python3 python3
python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv

VENV=$CACHE/venv
if ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -qx "$KUBERNETES_VALIDATE_VERSION"; then
    echo "installing (pip): kubernetes-validate==$KUBERNETES_VALIDATE_VERSION into $VENV"
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" ||
        die "pip install kubernetes-validate failed"
fi
PY=$VENV/bin/python # has PyYAML and jsonschema (kubernetes-validate's dependencies)

# kustomize: kubectl embeds it; a standalone kustomize works too. Debian 12 has
# no kustomize package, so neither can be installed from apt here.
if command -v kubectl >/dev/null 2>&1; then
    KUSTOMIZE=(kubectl kustomize)
elif command -v kustomize >/dev/null 2>&1; then
    KUSTOMIZE=(kustomize build)
else
    die "neither kubectl nor kustomize is installed; install kubectl (it embeds kustomize)"
fi

LIVE=0
[ -x "$PACER_BIN" ] && LIVE=1
if [ "$LIVE" -eq 1 ]; then
    need redis-server redis-server
    need redis-cli redis-tools
fi

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

echo "pacer ops checks in $ROOT (PACER_BIN=$PACER_BIN)"

# ============================================================ prometheus rules
check_rules() {
    promtool check rules deploy/prometheus/alerts.yml
}
test_rules() {
    promtool test rules deploy/prometheus/alerts_test.yml
}
# Each mutation weakens or shifts one alert; the unit tests must catch every one.
rules_tests_can_fail() {
    local dir=$WORK/mutants m i=0 survived=0
    mkdir -p "$dir"
    cp deploy/prometheus/alerts_test.yml "$dir/"
    for m in \
        's/) > 0.05$/) > 0.10/' \
        's/for: 2m$/for: 3m/' \
        's/pacer_stream_lag) > 1000$/pacer_stream_lag) > 100/' \
        's/) > 0.1$/) > 0.3/' \
        's/(rate(pacer_redis_errors_total\[5m\])) > 0$/(rate(pacer_redis_errors_total[5m])) >= 0/' \
        's/sum by (job) (pacer_ready) == 0/sum by (job) (pacer_ready) < 2/'; do
        i=$((i + 1))
        sed "$m" deploy/prometheus/alerts.yml >"$dir/alerts.yml"
        if cmp -s "$dir/alerts.yml" deploy/prometheus/alerts.yml; then
            echo "mutation $i ($m) matched nothing: update this list"
            return 1
        fi
        if promtool test rules "$dir/alerts_test.yml" >/dev/null 2>&1; then
            echo "mutation $i survived: $m"
            survived=$((survived + 1))
        fi
    done
    note "$i mutated rule files, all caught by alerts_test.yml"
    [ "$survived" -eq 0 ]
}
step "promtool check rules deploy/prometheus/alerts.yml" check_rules
step "promtool test rules deploy/prometheus/alerts_test.yml" test_rules
step "alert tests fail on mutated rules" rules_tests_can_fail

# ================================================================ dashboard
# Prints one line per query target: PANEL_ID<TAB>REF<TAB>TITLE<TAB>EXPR with
# Grafana variables replaced (all-values regex, fixed rate interval).
dashboard_queries() {
    "$PY" - "$ROOT/dashboards/pacer.json" "$RATE_INTERVAL" <<'PYEOF'
import json, re, sys
dash = json.load(open(sys.argv[1]))
interval = sys.argv[2]
names = {v["name"] for v in dash["templating"]["list"]}
def subst(expr):
    def repl(m):
        var = m.group(1) or m.group(2)
        if var in ("__rate_interval", "__interval", "__range"):
            return interval
        if var in names:
            return ".*"
        sys.exit(f"unknown Grafana variable ${var} in {expr!r}")
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)
def panels(ps):
    for p in ps:
        yield p
        yield from panels(p.get("panels", []))
for p in panels(dash["panels"]):
    for t in p.get("targets", []):
        print(f'{p["id"]}\t{t["refId"]}\t{p["title"]}\t{subst(t["expr"])}')
PYEOF
}

dashboard_json() {
    jq -e 'type == "object"' dashboards/pacer.json >/dev/null
    "$PY" - dashboards/pacer.json <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
errors = []
def err(msg): errors.append(msg)
for key in ("title", "uid", "panels", "templating", "schemaVersion"):
    if key not in d:
        err(f"dashboard has no {key}")
if "id" in d and d["id"] is not None:
    err("dashboard carries a database id; exports for import must not")
tvars = {v["name"]: v for v in d["templating"]["list"]}
ds = tvars.get("DS_PROMETHEUS")
if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
    err("no datasource variable DS_PROMETHEUS of type datasource/prometheus")
ids, queries = set(), []
def walk(ps):
    for p in ps:
        yield p
        yield from walk(p.get("panels", []))
for p in walk(d["panels"]):
    pid = p.get("id")
    if pid in ids:
        err(f"duplicate panel id {pid}")
    ids.add(pid)
    g = p.get("gridPos", {})
    if not all(k in g for k in "hwxy") or g["x"] + g["w"] > 24:
        err(f"panel {p.get('title')!r}: bad gridPos {g}")
    if p.get("type") == "row":
        continue
    if p.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
        err(f"panel {p.get('title')!r} does not use the ${{DS_PROMETHEUS}} datasource")
    if not p.get("targets"):
        err(f"panel {p.get('title')!r} has no queries")
    refs = [t.get("refId") for t in p["targets"]]
    if len(set(refs)) != len(refs):
        err(f"panel {p.get('title')!r} repeats a refId")
    for t in p["targets"]:
        if t.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
            err(f"panel {p.get('title')!r} target {t.get('refId')} has another datasource")
        if not t.get("expr", "").strip():
            err(f"panel {p.get('title')!r} target {t.get('refId')} has no expr")
        queries.append(t.get("expr", ""))
for v in tvars.values():
    if v.get("type") == "query" and v.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
        err(f"variable {v['name']} does not query ${{DS_PROMETHEUS}}")
text = "\n".join(queries)
# The panels the issue asks for, by the metric each must read.
for metric in ["pacer_events_total", "pacer_route_queue_seconds", "pacer_lateness_seconds_bucket",
               "pacer_wait_seconds_bucket", "pacer_redis_command_duration_seconds_bucket",
               "pacer_redis_errors_total", "pacer_stream_pending", "pacer_stream_lag",
               "pacer_sleeping_events", "pacer_ready", "pacer_build_info"]:
    if metric not in text:
        err(f"no panel reads {metric}")
for needle in ['outcome="rejected"', 'outcome="rerouted"', "histogram_quantile(0.5",
               "histogram_quantile(0.99", "sum by (outcome)"]:
    if needle not in text:
        err(f"no panel query contains {needle}")
if errors:
    print("\n".join(errors))
    sys.exit(1)
shown = sum(1 for p in walk(d["panels"]) if p.get("type") != "row")
print(f"=> {shown} panels, {len(queries)} queries, variables: {', '.join(tvars)}")
PYEOF
}

# promtool parses every panel query: wrapped as recording rules.
dashboard_promql() {
    local rules=$WORK/dashboard-rules.yml n=0 id ref title expr
    {
        echo "groups:"
        echo "  - name: dashboard"
        echo "    rules:"
        while IFS=$'\t' read -r id ref title expr; do
            n=$((n + 1))
            printf '      - record: dashboard:panel_%s_%s\n        expr: %s\n' \
                "$id" "$ref" "$(jq -Rn --arg e "$expr" '$e')"
        done < <(dashboard_queries)
    } >"$rules"
    promtool check rules "$rules"
    note "$n panel queries parse as PromQL"
}
step "dashboards/pacer.json is a valid, importable dashboard" dashboard_json
step "every dashboard query parses (promtool)" dashboard_promql

# ================================================================== systemd
UNIT=deploy/systemd/pacer.service
systemd_verify() {
    local root=$WORK/sdroot out
    # A throwaway root: the stock units (for sysinit.target and friends), a
    # stub where ExecStart points, and the unit under test.
    mkdir -p "$root/usr/lib/systemd" "$root/etc/systemd/system" "$root/usr/local/bin" "$root/etc/pacer"
    cp -a /lib/systemd/system "$root/usr/lib/systemd/"
    printf '#!/bin/sh\nexit 0\n' >"$root/usr/local/bin/pacer"
    chmod 0755 "$root/usr/local/bin/pacer"
    cp "$UNIT" "$root/etc/systemd/system/pacer.service"
    out=$(systemd-analyze verify --root="$root" pacer.service 2>&1)
    echo "$out"
    # verify only warns about unknown or unparsable settings: treat any output as failure.
    [ -z "$out" ]
    note "systemd-analyze verify: no warnings"
}
systemd_security() {
    local out score threshold
    threshold=$("$PY" -c "print(round(float('$SYSTEMD_EXPOSURE_MAX') * 10))")
    out=$(systemd-analyze security --offline=yes --threshold="$threshold" --no-pager "$UNIT" 2>&1) || {
        echo "$out" | grep -E '^✗|Overall'
        echo "exposure above $SYSTEMD_EXPOSURE_MAX"
        return 1
    }
    score=$(echo "$out" | sed -n 's/.*Overall exposure level for pacer.service: \([0-9.]*\).*/\1/p')
    [ -n "$score" ]
    "$PY" -c "import sys; sys.exit(0 if float('$score') <= float('$SYSTEMD_EXPOSURE_MAX') else 1)"
    note "exposure $score (threshold $SYSTEMD_EXPOSURE_MAX): $(echo "$out" | grep -o 'Overall exposure.*' | sed 's/.*: [0-9.]* //')"
}
systemd_contract() {
    local key drain stop cfg=config.yaml
    for key in '^ProtectSystem=strict$' '^NoNewPrivileges=yes$' '^PrivateTmp=yes$' '^ProtectHome=yes$' \
        '^CapabilityBoundingSet=$' '^RestrictAddressFamilies=' '^SystemCallFilter=' \
        '^EnvironmentFile=/etc/pacer/pacer.env$' '^Restart=(on-failure|always)$' \
        '^ExecStart=/usr/local/bin/pacer run --config /etc/pacer/config.yaml( |$)'; do
        grep -Eq "$key" "$UNIT" || { echo "$UNIT lacks $key"; return 1; }
    done
    grep -Eq '^(DynamicUser=yes|User=.+)$' "$UNIT" || { echo "$UNIT runs as root"; return 1; }
    grep -q '^PACER_REDIS_URL=' deploy/systemd/pacer.env.example
    [ -f "$cfg" ] || cfg=deploy/kubernetes/base/config.yaml
    drain=$(duration_s "$(config_drain "$cfg")")
    stop=$(duration_s "$(sed -n 's/^TimeoutStopSec=//p' "$UNIT")")
    "$PY" -c "import sys; sys.exit(0 if $stop > $drain else 1)" ||
        { echo "TimeoutStopSec ($stop s) must exceed worker.drain ($drain s) of $cfg"; return 1; }
    note "TimeoutStopSec ${stop}s > worker.drain ${drain}s ($cfg)"
}
step "systemd-analyze verify $UNIT" systemd_verify
step "systemd-analyze security $UNIT <= $SYSTEMD_EXPOSURE_MAX" systemd_security
step "systemd unit keeps the deployment contract" systemd_contract

# =============================================================== kubernetes
K8S=deploy/kubernetes
render() { # render DIR OUT
    "${KUSTOMIZE[@]}" "$1" >"$2"
    note "$1: $(grep -c '^kind:' "$2") objects ($(grep '^kind:' "$2" | sed 's/kind: //' | sort | tr '\n' ' '))"
}
render_base() { render "$K8S/base" "$WORK/base.yaml"; }
render_keda() { render "$K8S/overlays/keda" "$WORK/keda.yaml"; }
k8s_validate() { # k8s_validate RENDERED
    local v
    # Oldest and newest Kubernetes the schemas cover that we care about.
    for v in 1.29.0 "$KUBERNETES_VALIDATE_VERSION"; do
        "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "$1" 2>&1 | tee "$WORK/kv.out"
        # Built-in kinds must validate; CRDs are left to crd_validate.
        if [ -n "$(grep -v "Couldn't find schema for kind \(ServiceMonitor\|ScaledObject\|TriggerAuthentication\)" "$WORK/kv.out" || true)" ]; then
            return 1
        fi
    done
    note "built-in kinds valid (strict) for Kubernetes 1.29 and $KUBERNETES_VALIDATE_VERSION; CRDs checked by deploy/kubernetes/schemas"
}
crd_and_refs() { # crd_and_refs RENDERED base|keda
    "$PY" - "$1" "$2" "$ROOT/$K8S/schemas" <<'PYEOF'
import json, os, re, sys, yaml, base64
from jsonschema import Draft7Validator

path, flavour, schemas = sys.argv[1], sys.argv[2], sys.argv[3]
docs = [d for d in yaml.safe_load_all(open(path)) if d]
errors = []
def err(msg): errors.append(msg)
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
def one(kind):
    items = by_kind.get(kind, [])
    if len(items) != 1:
        err(f"expected one {kind}, found {len(items)}")
        return {}
    return items[0]

# CRDs against our schemas
schema_of = {"ServiceMonitor": "servicemonitor", "ScaledObject": "scaledobject",
             "TriggerAuthentication": "triggerauthentication"}
checked = []
for d in docs:
    name = schema_of.get(d["kind"])
    if name:
        schema = json.load(open(os.path.join(schemas, name + ".schema.json")))
        for e in Draft7Validator(schema).iter_errors(d):
            err(f"{d['kind']}/{d['metadata']['name']}: {'.'.join(map(str, e.absolute_path))}: {e.message}")
        checked.append(d["kind"])

def selects(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())

dep = one("Deployment")
svc = one("Service")
pdb = one("PodDisruptionBudget")
cm = one("ConfigMap")
smon = one("ServiceMonitor")
secrets = {s["metadata"]["name"]: s for s in by_kind.get("Secret", [])}
pod = dep.get("spec", {}).get("template", {})
pod_labels = pod.get("metadata", {}).get("labels", {})
spec = pod.get("spec", {})
c = (spec.get("containers") or [{}])[0]

if not selects(dep["spec"]["selector"]["matchLabels"], pod_labels):
    err("Deployment selector does not match its pod labels")
if not selects(svc["spec"]["selector"], pod_labels):
    err("Service selector does not match the pods")
if not selects(pdb["spec"]["selector"]["matchLabels"], pod_labels):
    err("PodDisruptionBudget selector does not match the pods")
if not selects(smon["spec"]["selector"]["matchLabels"], svc["metadata"].get("labels", {})):
    err("ServiceMonitor selector does not match the metrics Service")

# config from the ConfigMap the pod mounts
vol = {v["name"]: v for v in spec.get("volumes", [])}
mounted = [vol[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in vol]
cm_names = [v["configMap"]["name"] for v in mounted if "configMap" in v]
if cm["metadata"]["name"] not in cm_names:
    err("the pod does not mount the generated ConfigMap")
mount = next((m for m in c.get("volumeMounts", []) if vol.get(m["name"], {}).get("configMap")), {})
cfg_key = next(iter(cm["data"]))
cfg_path = os.path.join(mount.get("mountPath", "?"), cfg_key)
args = c.get("args", [])
if "--config" not in args or args[args.index("--config") + 1] != cfg_path:
    err(f"container args {args} do not point --config at the mounted {cfg_path}")
cfg = yaml.safe_load(cm["data"][cfg_key])
listen = cfg["metrics"]["listen"]
host, port = listen.rsplit(":", 1)
if host not in ("0.0.0.0", "[::]"):
    err(f"metrics.listen {listen} is not reachable from the kubelet and Prometheus")

def seconds(s):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(s))
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]
drain = seconds(cfg.get("worker", {}).get("drain", "5s"))
grace = spec.get("terminationGracePeriodSeconds", 30)
if not grace > drain:
    err(f"terminationGracePeriodSeconds {grace} is not above worker.drain {drain}s")

ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
if ports.get("metrics") != int(port):
    err(f"container port 'metrics' {ports.get('metrics')} != metrics.listen port {port}")
for probe, want in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
    h = c.get(probe, {}).get("httpGet", {})
    if h.get("path") != want or h.get("port") not in ("metrics", int(port)):
        err(f"{probe} is not GET {want} on the metrics port: {h}")
sp = svc["spec"]["ports"][0]
if sp.get("targetPort") not in ("metrics", int(port)):
    err(f"Service targetPort {sp.get('targetPort')} is not the metrics port")
if smon["spec"]["endpoints"][0].get("port") != sp.get("name"):
    err("ServiceMonitor endpoint port is not the Service's port name")

psc, csc = spec.get("securityContext", {}), c.get("securityContext", {})
if not (psc.get("runAsNonRoot") or csc.get("runAsNonRoot")):
    err("runAsNonRoot is not set")
if not csc.get("readOnlyRootFilesystem"):
    err("readOnlyRootFilesystem is not set")
if csc.get("allowPrivilegeEscalation") is not False:
    err("allowPrivilegeEscalation is not false")
if "ALL" not in csc.get("capabilities", {}).get("drop", []):
    err("capabilities are not all dropped")
res = c.get("resources", {})
if not res.get("requests") or not res.get("limits", {}).get("memory"):
    err("resources need requests and a memory limit")

env = {e["name"]: e for e in c.get("env", [])}
ref = env.get("PACER_REDIS_URL", {}).get("valueFrom", {}).get("secretKeyRef", {})
sec = secrets.get(ref.get("name"))
if not sec or ref.get("key") not in sec.get("data", {}):
    err(f"PACER_REDIS_URL comes from no rendered Secret key: {ref}")
else:
    url = base64.b64decode(sec["data"][ref["key"]]).decode()
    if not url.startswith(("redis://", "rediss://")):
        err("PACER_REDIS_URL in the Secret is not a redis:// URL")

if flavour == "keda":
    so, ta = one("ScaledObject"), one("TriggerAuthentication")
    if "replicas" in dep["spec"]:
        err("the KEDA overlay must leave replicas to KEDA")
    if so["spec"]["scaleTargetRef"]["name"] != dep["metadata"]["name"]:
        err("ScaledObject does not target the Deployment")
    want_stream, want_group = cfg["outbound"]["streams"][0], cfg["worker"]["group"]
    pend = [t for t in so["spec"]["triggers"] if t["type"] == "redis-streams"
            and "pendingEntriesCount" in t["metadata"]]
    if not pend:
        err("no redis-streams trigger on pending entries")
    for t in so["spec"]["triggers"]:
        m = t["metadata"]
        if m.get("stream") != want_stream or m.get("consumerGroup") != want_group:
            err(f"trigger watches {m.get('stream')}/{m.get('consumerGroup')}, config reads {want_stream}/{want_group}")
        if t.get("authenticationRef", {}).get("name") != ta["metadata"]["name"]:
            err("trigger does not use the rendered TriggerAuthentication")
    for r in ta["spec"]["secretTargetRef"]:
        s = secrets.get(r["name"])
        if not s or r["key"] not in s.get("data", {}):
            err(f"TriggerAuthentication refers to missing secret key {r['name']}/{r['key']}")
elif by_kind.get("ScaledObject"):
    err("the base must not carry a ScaledObject")

if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"=> schemas: {', '.join(sorted(set(checked)))}; selectors, ports, probes, secrets, grace {grace}s > drain {drain:g}s")
PYEOF
}
step "kustomize build $K8S/base" render_base
step "kustomize build $K8S/overlays/keda" render_keda
if [ -s "$WORK/base.yaml" ]; then
    step "kubernetes-validate --strict (base)" k8s_validate "$WORK/base.yaml"
    step "CRD schemas and cross-references (base)" crd_and_refs "$WORK/base.yaml" base
fi
if [ -s "$WORK/keda.yaml" ]; then
    step "kubernetes-validate --strict (keda overlay)" k8s_validate "$WORK/keda.yaml"
    step "CRD schemas and cross-references (keda overlay)" crd_and_refs "$WORK/keda.yaml" keda
fi

# =============================================================== Dockerfile
dockerfile() {
    local f=Dockerfile uid k8s_uid
    grep -Eq '^FROM rust:[^ ]*bookworm[^ ]* AS builder' "$f" || grep -Eq '^FROM rust:\$\{RUST_VERSION\}-\$\{DEBIAN_SUITE\} AS builder' "$f"
    grep -Eq '^ARG DEBIAN_SUITE=bookworm$' "$f"
    grep -Eq '^FROM debian:(bookworm|\$\{DEBIAN_SUITE\})-slim$' "$f"
    grep -Eq '^EXPOSE 9464$' "$f"
    grep -Eq '^ENTRYPOINT \["/usr/local/bin/pacer"\]$' "$f"
    uid=$(sed -n 's/^USER \([0-9]*\).*/\1/p' "$f")
    if [ -z "$uid" ] || [ "$uid" -eq 0 ]; then echo "USER must be a numeric non-root uid"; return 1; fi
    k8s_uid=$(sed -n 's/^ *runAsUser: *//p' "$K8S/base/deployment.yaml")
    [ "$uid" = "$k8s_uid" ] || { echo "Dockerfile USER $uid != runAsUser $k8s_uid"; return 1; }
    local src
    while read -r src; do
        [ "$src" = . ] || [ -e "$src" ] || { echo "COPY source $src does not exist"; return 1; }
    done < <(sed -n 's/^COPY \([^-][^ ]*\) .*/\1/p' "$f")
    note "multi-stage, USER $uid (= runAsUser), EXPOSE 9464, ENTRYPOINT pacer"
}
step "Dockerfile consistent with the deployment" dockerfile

# ===================================================================== live
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
# Says so when pacer was stopped by a signal this script did not send.
outside_signal() {
    if grep -q 'SIG\(TERM\|INT\): draining' "$WORK/pacer.log"; then
        echo "note: pacer got SIGTERM/SIGINT from outside this script (another process on the machine, e.g. a pkill)"
    fi
}
promq() { # promq QUERY -> JSON of /api/v1/query
    curl -fsS --max-time 5 "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode "query=$1"
}
prom_has() { promq "$1" | jq -e '.data.result | length > 0' >/dev/null; }

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
}

live_start() {
    REDIS_PORT=$(free_port)
    METRICS_PORT=$(free_port)
    PROM_PORT=$(free_port)
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
  rules:
    - {name: per-source, key: [source], limits: [10/s]}
    - {name: trial, key: [source], algorithm: gcra, limits: [5/s], mode: shadow}
EOF
    if ! env -u PACER_REDIS_URL -u PACER_CONFIG "$PACER_BIN" check-config --config "$WORK/pacer.yaml" >"$WORK/check-config.log" 2>&1; then
        echo "pacer check-config rejects the test config:"
        cat "$WORK/check-config.log"
        return 1
    fi
    env -u PACER_REDIS_URL -u PACER_CONFIG RUST_LOG=info \
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

live_check_configs() {
    local f n=0
    for f in config.yaml deploy/kubernetes/base/config.yaml; do
        [ -f "$f" ] || continue
        env -u PACER_REDIS_URL -u PACER_CONFIG "$PACER_BIN" check-config --config "$f"
        n=$((n + 1))
    done
    # A broken config must be refused.
    printf 'worker: {batch: 0}\noutbound: {streams: ["pacer:out"], routes: {a: {rate: 10/day}}}\n' >"$WORK/bad.yaml"
    if env -u PACER_REDIS_URL "$PACER_BIN" check-config --config "$WORK/bad.yaml"; then
        echo "check-config accepted a broken config"
        return 1
    fi
    note "$n shipped config(s) accepted, a broken one refused"
}

# Every metric of the contract, as exposed on /metrics.
live_metric_names() {
    local m missing=() outcome seen=()
    for m in pacer_events_total pacer_wait_seconds_bucket pacer_lateness_seconds_bucket \
        pacer_sleeping_events pacer_route_queue_seconds pacer_redis_command_duration_seconds_bucket \
        pacer_redis_errors_total pacer_stream_pending pacer_stream_lag pacer_ready pacer_build_info; do
        grep -Eq "^$m(\{| )" "$WORK/metrics.txt" || missing+=("$m")
    done
    for outcome in dispatched rerouted rejected dead_lettered duplicate; do
        grep -Eq "^pacer_events_total\{.*outcome=\"$outcome\"" "$WORK/metrics.txt" && seen+=("$outcome")
    done
    note "outcomes seen: ${seen[*]:-none}"
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "missing from /metrics: ${missing[*]}"
        echo "--- /metrics (pacer_ lines) ---"
        grep '^pacer_' "$WORK/metrics.txt" | grep -v '_bucket' | head -n 60
        return 1
    fi
    grep -Eq '^pacer_ready(\{[^}]*\})? 1$' "$WORK/metrics.txt" || { echo "pacer_ready is not 1"; return 1; }
    note "all 11 contract metrics exposed"
}

live_panel() { # live_panel PANEL_ID: every query of the panel returns a finite sample
    local id=$1 pid ref title expr bad=0 out
    while IFS=$'\t' read -r pid ref title expr; do
        [ "$pid" = "$id" ] || continue
        out=$(promq "$expr") || { echo "query failed: $expr"; bad=1; continue; }
        if echo "$out" | jq -e '.status == "success" and ([.data.result[] | .value[1] | select(. != "NaN" and . != "+Inf" and . != "-Inf")] | length > 0)' >/dev/null; then
            note "$ref: $(echo "$out" | jq -r '[.data.result[] | ((.metric | to_entries | map(.value) | join(",")) as $l | (if $l == "" then "" else $l + "=" end) + (.value[1] | .[0:8]))] | .[0:6] | join("  ")')"
        else
            echo "no data: [$ref] $expr"
            echo "$out" | jq -c '.data.result[0:5]'
            bad=1
        fi
    done < <(dashboard_queries)
    [ "$bad" -eq 0 ]
}

live_variables() {
    local q
    for q in 'label_values(pacer_build_info, job)=job=pacer_build_info' \
        'label_values(pacer_build_info, instance)=instance=pacer_build_info' \
        'label_values(pacer_events_total, route)=route=pacer_events_total'; do
        local label=${q#*=}
        local metric=${label#*=}
        label=${label%%=*}
        curl -fsS --max-time 5 -G "http://127.0.0.1:$PROM_PORT/api/v1/label/$label/values" \
            --data-urlencode "match[]=$metric" | jq -e '.data | length > 0' >/dev/null ||
            { echo "dashboard variable query ${q%%=*} returns nothing"; return 1; }
        note "\$$label: $(curl -fsS -G "http://127.0.0.1:$PROM_PORT/api/v1/label/$label/values" --data-urlencode "match[]=$metric" | jq -r '.data | join(", ")')"
    done
}

live_alert_health() {
    local out
    out=$(curl -fsS --max-time 5 "http://127.0.0.1:$PROM_PORT/api/v1/rules")
    echo "$out" | jq -e '[.data.groups[].rules[]] | length > 0' >/dev/null
    if echo "$out" | jq -e '[.data.groups[].rules[] | select(.health != "ok")] | length > 0' >/dev/null; then
        echo "$out" | jq -r '.data.groups[].rules[] | select(.health != "ok") | "\(.name): \(.health) \(.lastError)"'
        return 1
    fi
    note "$(echo "$out" | jq -r '[.data.groups[].rules[]] | length') rules evaluate cleanly on live data; state: $(echo "$out" | jq -r '[.data.groups[].rules[] | select(.state != "inactive") | "\(.name)=\(.state)"] | join(", ") | if . == "" then "all inactive" else . end')"
}

if [ "$LIVE" -eq 1 ]; then
    step "pacer check-config on the shipped configs" live_check_configs
    log=$WORK/live-start.log
    set +e
    live_start >"$log" 2>&1
    rc=$?
    set -e
    record "live stack: redis-server, pacer, prometheus, load" "$rc" "$log"
    if [ "$rc" -eq 0 ]; then
        step "contract metrics on /metrics" live_metric_names
        step "dashboard variables return values" live_variables
        while IFS=$'\t' read -r id title; do
            step "panel \"$title\" returns data" live_panel "$id"
        done < <(jq -r '.. | objects | select(has("targets") and has("id")) | "\(.id)\t\(.title)"' dashboards/pacer.json)
        step "alert rules evaluate on live data" live_alert_health

        # /readyz follows Redis: down -> 503 and pacer_ready 0, back -> 200.
        log=$WORK/live-ready.log
        {
            rc=0
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
        } >"$log" 2>&1
        record "/readyz follows Redis down and up" "$rc" "$log"

        # SIGTERM drains within worker.drain and exits 0.
        log=$WORK/live-term.log
        {
            rc=0
            t0=$(date +%s.%N)
            kill -TERM "$PACER_PID"
            limit=$(($(duration_s "$DRAIN" | cut -d. -f1) + 5))
            if wait_for "$limit" bash -c "! kill -0 $PACER_PID"; then
                set +e
                wait "$PACER_PID"
                code=$?
                set -e
                echo "=> exited $code after $(python3 -c "import time; print(round(time.time() - $t0, 2))")s (drain $DRAIN)"
                [ "$code" -eq 0 ] || rc=1
            else
                echo "pacer still running ${limit}s after SIGTERM (drain $DRAIN)"
                rc=1
            fi
            tail -n 5 "$WORK/pacer.log"
        } >"$log" 2>&1
        record "SIGTERM drains and exits 0" "$rc" "$log"
    fi
else
    log=$WORK/live-skip.log
    echo "PACER_BIN $PACER_BIN does not exist (build it first); live dashboard test not run" >"$log"
    record "live dashboard test" 77 "$log"
fi

echo
[ "$FAILED" -eq 0 ] || printf 'failed: %s\n' "${FAILURES[@]}"
echo "($((SECONDS - START))s)"
# One word before the colon, so CI's reader takes this as the closing count.
if [ "$SKIPPED" -gt 0 ]; then
    echo "ops: $PASSED passed, $FAILED failed, $SKIPPED skipped"
else
    echo "ops: $PASSED passed, $FAILED failed"
fi
[ "$FAILED" -eq 0 ]
