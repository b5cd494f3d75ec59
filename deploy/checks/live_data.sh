# deploy/checks/live_data.sh — what the live stack (live.sh) shows: every contract metric on
# /metrics, the synchronous admission load answered (and counted) as the API promises, the
# dashboard's variables and every panel query returning data through Prometheus's HTTP API,
# and every alert rule evaluating cleanly.
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
        pacer_redis_errors_total pacer_stream_pending pacer_stream_lag pacer_output_length \
        pacer_output_max_length pacer_ready pacer_build_info; do
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
    note "all 13 contract metrics exposed"
}

metric_sum() { # metric_sum NAME [LABEL="VALUE"...]: the sum of NAME's samples with those labels
    local name=$1
    shift
    awk -v name="$name" -v want="$*" '
        index($0, name "{") == 1 || index($0, name " ") == 1 {
            n = split(want, w, " ")
            for (i = 1; i <= n; i++) if (index($0, w[i]) == 0) next
            s += $NF
        }
        END { printf "%d\n", s }' "$WORK/metrics.txt"
}

# The synchronous admission load (live.sh, admit_batch) was answered as the API promises. Its
# series are registered at zero, so the panels alone would show data without any request.
live_api() {
    local codes ok limited bad http grpc redis allowed refused fetches leased wasted
    codes=$(sort "$WORK/admit-codes.txt" | uniq -c | awk '{ printf "%s%s x%s", sep, $2, $1; sep = ", " }')
    ok=$(grep -cx 200 "$WORK/admit-codes.txt" || true)
    limited=$(grep -cx 429 "$WORK/admit-codes.txt" || true)
    bad=$(grep -cvx -e 200 -e 429 "$WORK/admit-codes.txt" || true)
    # Each request counts once per rule it was checked against; every one of them checks api.
    http=$(metric_sum pacer_api_decision_seconds_count 'api="http"' 'rule="api"')
    grpc=$(metric_sum pacer_api_decision_seconds_count 'api="grpc"' 'rule="api"')
    redis=$(metric_sum pacer_api_redis_calls_total 'api="http"')
    allowed=$(metric_sum pacer_api_decisions_total 'api="http"' 'rule="api"' 'outcome="allowed"')
    refused=$(metric_sum pacer_api_decisions_total 'api="http"' 'rule="api"' 'outcome="limited"')
    fetches=$(metric_sum pacer_lease_fetches_total 'rule="api"')
    leased=$(metric_sum pacer_lease_tokens_total 'rule="api"' 'fate="leased"')
    wasted=$(metric_sum pacer_lease_tokens_total 'rule="api"' 'fate="wasted"')
    note "POST /v1/admit: $codes; $http answered, $redis of them in Redis; rule api: $allowed allowed, $refused limited"
    note "leases (rule api): $fetches fetches, $leased tokens leased, $wasted wasted; gRPC ShouldRateLimit: $grpc answered"
    local fail=0
    [ "$ok" -gt 0 ] && [ "$limited" -gt 0 ] || { echo "POST /v1/admit: expected both 200 and 429 answers"; fail=1; }
    [ "$bad" -eq 0 ] || { echo "POST /v1/admit: $bad answers other than 200 or 429"; fail=1; }
    [ "$http" -eq $((ok + limited)) ] || { echo "pacer_api_decision_seconds_count{api=\"http\",rule=\"api\"} $http, but $((ok + limited)) answers"; fail=1; }
    [ "$redis" -lt "$http" ] || { echo "every HTTP request reached Redis: no lease answered one"; fail=1; }
    [ "$allowed" -gt 0 ] && [ "$refused" -gt 0 ] || { echo "rule api: expected allowed and limited decisions"; fail=1; }
    [ "$fetches" -gt 0 ] && [ "$leased" -gt 0 ] && [ "$wasted" -gt 0 ] ||
        { echo "rule api: expected lease fetches, leased and wasted tokens"; fail=1; }
    [ "$grpc" -gt 0 ] || { echo "no gRPC ShouldRateLimit call was answered"; fail=1; }
    if [ "$fail" -ne 0 ]; then
        grep -E '^pacer_(api|lease)_' "$WORK/metrics.txt" | grep -v _bucket
        grep -iE 'admit|grpc|lease|api' "$WORK/pacer.log" | tail -n 20 || true
    fi
    return "$fail"
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
    step "synchronous admission: 200 and 429, leases, Envoy gRPC" live_api
    step "dashboard variables return values" live_variables
    while IFS=$'\t' read -r id title; do
        step "panel \"$title\" returns data" live_panel "$id"
    done < <(jq -r '.. | objects | select(has("targets") and has("id")) | "\(.id)\t\(.title)"' dashboards/pacer.json)
    step "alert rules evaluate on live data" live_alert_health
}
