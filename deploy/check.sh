#!/usr/bin/env bash
# deploy/check.sh — checks pacer's operations side with the real tools.
#
#   deploy/check.sh                      # every concern; PACER_BIN=path/to/pacer picks the binary
#   deploy/check.sh rules systemd        # only these concerns (names below)
#   PACER_OPS_KEEP=1 deploy/check.sh     # keep the temp dir (logs, configs, renders)
#
# One file per concern in deploy/checks/, each defining <concern>_checks:
#   rules.sh       promtool check/test rules, and mutated rules the tests must reject
#   dashboard.sh   dashboards/pacer.json importable, every panel query parses (promtool)
#   systemd.sh     systemd-analyze verify and security, the units' deployment contract
#   kubernetes.sh  kustomize renders, kubernetes-validate --strict, CRD schemas, cross-references
#   dockerfile.sh  the Dockerfile against the deployment (user, port, entrypoint)
#   live.sh        when $PACER_BIN exists (default target/debug/pacer): check-config, then a real
#                  redis-server, pacer and Prometheus under load (live_data.sh: what they show)
# lib.sh holds the shared helpers, tools.sh installs what a concern lacks (apt, PyPI, npm).
# A check whose tool cannot be had on this machine is skipped, with the reason, and counted;
# a skip is not a failure. Prints `ops: N passed, N failed[, N skipped]` last and exits
# non-zero on any failure.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CHECKS=$ROOT/deploy/checks
CONCERNS=(rules dashboard systemd kubernetes dockerfile live)
PACER_BIN=${PACER_BIN:-target/debug/pacer}
case $PACER_BIN in /*) ;; *) PACER_BIN=$ROOT/$PACER_BIN ;; esac

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
SKIP_WHYS=()              # each reason once, in order
declare -A SKIP_NAMES=()  # reason -> the steps it skipped
# Set by `want` (tools.sh) when a concern's tool cannot be had: its steps are then skipped.
SKIP_REASON=

record() { # record NAME RC LOGFILE: RC 0 passed, 77 skipped (last log line says why), else failed
    local name=$1 rc=$2 log=$3 why
    if [ "$rc" -eq 0 ]; then
        PASSED=$((PASSED + 1))
        printf 'ok    %s\n' "$name"
        grep -h '^=> ' "$log" 2>/dev/null | sed 's/^=> /        /' || true
    elif [ "$rc" -eq 77 ]; then
        SKIPPED=$((SKIPPED + 1))
        why=$(tail -n 1 "$log")
        [ -n "${SKIP_NAMES[$why]:-}" ] || SKIP_WHYS+=("$why")
        SKIP_NAMES[$why]+="${SKIP_NAMES[$why]:+, }$name"
        printf 'skip  %s\n        skipped: %s\n' "$name" "$why"
    else
        FAILED=$((FAILED + 1))
        FAILURES+=("$name")
        printf 'FAIL  %s\n' "$name"
        tail -n 60 "$log" | sed 's/^/        /'
    fi
}

newlog() { echo "$WORK/step-$((PASSED + FAILED + SKIPPED + 1)).log"; }

skip() { # skip NAME WHY
    local log
    log=$(newlog)
    echo "$2" >"$log"
    record "$1" 77 "$log"
}

# Runs a check function in a subshell with errexit on, so any failing command
# fails the check (errexit is ignored in functions called from `if`).
step() { # step NAME FUNCTION [ARGS...]
    local name=$1 rc=0 log
    shift
    if [ -n "$SKIP_REASON" ]; then skip "$name" "$SKIP_REASON"; return; fi
    log=$(newlog)
    set +e
    (set -e; "$@") >"$log" 2>&1
    rc=$?
    set -e
    record "$name" "$rc" "$log"
}

# Runs a check function in this shell, errexit off: for checks that start or stop processes
# the cleanup must know of. The function reports failure through its return code.
step_here() { # step_here NAME FUNCTION [ARGS...]
    local name=$1 rc=0 log
    shift
    if [ -n "$SKIP_REASON" ]; then skip "$name" "$SKIP_REASON"; return; fi
    log=$(newlog)
    set +e
    "$@" >"$log" 2>&1
    rc=$?
    set -e
    record "$name" "$rc" "$log"
}

# Helpers, installers, then the functions of each concern (live.sh uses the last two).
for part in lib tools "${CONCERNS[@]}" live_data live_lifecycle; do
    # shellcheck disable=SC1090
    . "$CHECKS/$part.sh"
done

selected=("$@")
[ "${#selected[@]}" -gt 0 ] || selected=("${CONCERNS[@]}")
for concern in "${selected[@]}"; do
    [[ " ${CONCERNS[*]} " == *" $concern "* ]] || die "unknown concern $concern (one of: ${CONCERNS[*]})"
done

echo "pacer ops checks in $ROOT (PACER_BIN=$PACER_BIN)"
base_tools
for concern in "${selected[@]}"; do
    SKIP_REASON=
    "${concern}_checks"
done
SKIP_REASON=

echo
[ "$FAILED" -eq 0 ] || printf 'failed: %s\n' "${FAILURES[@]}"
for why in "${SKIP_WHYS[@]}"; do printf 'skipped: %s\n    because: %s\n' "${SKIP_NAMES[$why]}" "$why"; done
echo "($((SECONDS - START))s)"
# One word before the colon, so CI's reader takes this as the closing count.
if [ "$SKIPPED" -gt 0 ]; then
    echo "ops: $PASSED passed, $FAILED failed, $SKIPPED skipped"
else
    echo "ops: $PASSED passed, $FAILED failed"
fi
[ "$FAILED" -eq 0 ]
