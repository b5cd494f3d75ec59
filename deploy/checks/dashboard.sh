# deploy/checks/dashboard.sh — dashboards/pacer.json: importable (structure checked by
# dashboard.py) and every panel query parses as PromQL (promtool). live_data.sh runs the same
# queries against a real Prometheus.
# shellcheck shell=bash

dashboard_json() {
    jq -e 'type == "object"' dashboards/pacer.json >/dev/null
    "$PY" "$CHECKS/dashboard.py" check dashboards/pacer.json
}

# promtool parses every panel query: wrapped as recording rules.
dashboard_promql() {
    local rules=$WORK/dashboard-rules.yml n=0 id ref expr
    {
        echo "groups:"
        echo "  - name: dashboard"
        echo "    rules:"
        while IFS=$'\t' read -r id ref _ expr; do
            n=$((n + 1))
            printf '      - record: dashboard:panel_%s_%s\n        expr: %s\n' \
                "$id" "$ref" "$(jq -Rn --arg e "$expr" '$e')"
        done < <(dashboard_queries)
    } >"$rules"
    promtool check rules "$rules"
    note "$n panel queries parse as PromQL"
}

dashboard_checks() {
    step "dashboards/pacer.json is a valid, importable dashboard" dashboard_json
    want promtool
    step "every dashboard query parses (promtool)" dashboard_promql
}
