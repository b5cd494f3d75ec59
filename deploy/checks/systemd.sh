# deploy/checks/systemd.sh — deploy/systemd/pacer.service and the template pacer@.service:
# systemd-analyze verify (in a throw-away root with a stub binary), systemd-analyze security
# under an exposure threshold, and the deployment contract (hardening, secrets file, config
# check first, stop timeout above the drain; the template's per-instance metrics address).
# shellcheck shell=bash

UNITS=(deploy/systemd/pacer.service deploy/systemd/pacer@.service)

# The unit systemd-analyze verify loads for a unit file: a template through one instance.
unit_instance() { # unit_instance FILE
    local name=${1##*/}
    case $name in *@.service) echo "${name%@.service}@9465.service" ;; *) echo "$name" ;; esac
}

systemd_verify() { # systemd_verify UNIT_FILE
    local unit=$1 root out name
    root=$WORK/sdroot-$(basename "$unit" .service)
    name=$(unit_instance "$unit")
    # A throwaway root: the stock units (for sysinit.target and friends), a
    # stub where ExecStart points, and the unit under test.
    mkdir -p "$root/usr/lib/systemd" "$root/etc/systemd/system" "$root/usr/local/bin" "$root/etc/pacer"
    cp -a /lib/systemd/system "$root/usr/lib/systemd/"
    printf '#!/bin/sh\nexit 0\n' >"$root/usr/local/bin/pacer"
    chmod 0755 "$root/usr/local/bin/pacer"
    cp "$unit" "$root/etc/systemd/system/"
    out=$(systemd-analyze verify --root="$root" "$name" 2>&1)
    echo "$out"
    # verify only warns about unknown or unparsable settings: treat any output as failure.
    [ -z "$out" ]
    note "systemd-analyze verify $name: no warnings"
}

systemd_security() { # systemd_security UNIT_FILE
    local unit=$1 out score threshold
    threshold=$("$PY" -c "print(round(float('$SYSTEMD_EXPOSURE_MAX') * 10))")
    out=$(systemd-analyze security --offline=yes --threshold="$threshold" --no-pager "$unit" 2>&1) || {
        echo "$out" | grep -E '^✗|Overall'
        echo "exposure above $SYSTEMD_EXPOSURE_MAX"
        return 1
    }
    score=$(echo "$out" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
    [ -n "$score" ]
    "$PY" -c "import sys; sys.exit(0 if float('$score') <= float('$SYSTEMD_EXPOSURE_MAX') else 1)"
    note "exposure $score (threshold $SYSTEMD_EXPOSURE_MAX): $(echo "$out" | grep -o 'Overall exposure.*' | sed 's/.*: [0-9.]* //')"
}

systemd_contract() { # systemd_contract UNIT_FILE
    local unit=$1 key drain stop cfg=config.yaml keys
    keys=('^ProtectSystem=strict$' '^NoNewPrivileges=yes$' '^PrivateTmp=yes$' '^ProtectHome=yes$'
        '^CapabilityBoundingSet=$' '^RestrictAddressFamilies=' '^SystemCallFilter='
        '^EnvironmentFile=/etc/pacer/pacer.env$' '^Restart=(on-failure|always)$'
        '^ExecStartPre=/usr/local/bin/pacer check-config --config /etc/pacer/config.yaml$'
        '^ExecStart=/usr/local/bin/pacer run --config /etc/pacer/config.yaml( |$)')
    case $unit in
        *@.service) # each instance its own metrics port, and its own optional env file last
            keys+=('^Environment=PACER_METRICS_LISTEN=127\.0\.0\.1:%i$'
                '^EnvironmentFile=-/etc/pacer/pacer-%i\.env$') ;;
    esac
    for key in "${keys[@]}"; do
        grep -Eq "$key" "$unit" || { echo "$unit lacks $key"; return 1; }
    done
    grep -Eq '^(DynamicUser=yes|User=.+)$' "$unit" || { echo "$unit runs as root"; return 1; }
    if [[ $unit == *@.service ]] && [ "$(grep '^EnvironmentFile=' "$unit" | tail -n 1)" != 'EnvironmentFile=-/etc/pacer/pacer-%i.env' ]; then
        echo "$unit: the instance's env file must come last, so that it wins"
        return 1
    fi
    grep -q '^PACER_REDIS_URL=' deploy/systemd/pacer.env.example
    if grep -q '^PACER_METRICS_LISTEN=' deploy/systemd/pacer.env.example; then
        echo "pacer.env.example sets PACER_METRICS_LISTEN: every pacer@ instance would bind it"
        return 1
    fi
    [ -f "$cfg" ] || cfg=deploy/kubernetes/base/config.yaml
    drain=$(duration_s "$(config_drain "$cfg")")
    stop=$(duration_s "$(sed -n 's/^TimeoutStopSec=//p' "$unit")")
    "$PY" -c "import sys; sys.exit(0 if $stop > $drain else 1)" ||
        { echo "TimeoutStopSec ($stop s) must exceed worker.drain ($drain s) of $cfg"; return 1; }
    note "TimeoutStopSec ${stop}s > worker.drain ${drain}s ($cfg)"
}

systemd_checks() {
    local unit
    want systemd-analyze
    for unit in "${UNITS[@]}"; do
        step "systemd-analyze verify $unit" systemd_verify "$unit"
        step "systemd-analyze security $unit <= $SYSTEMD_EXPOSURE_MAX" systemd_security "$unit"
        step "systemd unit $unit keeps the deployment contract" systemd_contract "$unit"
    done
}
