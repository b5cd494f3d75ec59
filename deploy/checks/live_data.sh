# deploy/checks/live_data.sh — what the live stack (live.sh) shows: every contract metric on
# /metrics, the dashboard's variables and every panel query returning data through
# Prometheus's HTTP API, and every alert rule evaluating cleanly.
# shellcheck shell=bash

promq() { # promq QUERY -> JSON of /api/v1/query
    curl -fsS --max-time 5 "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode "query=$1"
}
prom_has() { promq "$1" | jq -e '.data.result | length > 0' >/dev/null; }

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

live_data_checks() {
    local id title
    step "contract metrics on /metrics" live_metric_names
    step "dashboard variables return values" live_variables
    while IFS=$'\t' read -r id title; do
        step "panel \"$title\" returns data" live_panel "$id"
    done < <(jq -r '.. | objects | select(has("targets") and has("id")) | "\(.id)\t\(.title)"' dashboards/pacer.json)
    step "alert rules evaluate on live data" live_alert_health
}
