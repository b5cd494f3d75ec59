# deploy/checks/rules.sh — the Prometheus alert rules and their unit tests (promtool), and
# proof that the tests can fail: each mutated copy of the rules must break them.
# shellcheck shell=bash

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
        's/sum by (job) (pacer_ready) == 0/sum by (job) (pacer_ready) < 2/' \
        's/(increase(pacer_listener_full_total\[5m\])) > 0$/(increase(pacer_listener_full_total[5m])) > 10/' \
        's/(increase(pacer_listener_full_total\[5m\])) > 0$/(increase(pacer_listener_full_total[5m])) >= 0/' \
        's/{outcome="dead_lettered"}\[5m\]/{outcome=~"dead_lettered|duplicate"}[5m]/' \
        's/up{job="pacer"} == 0$/up{job="pacer"} <= 1/' \
        '/alert: PacerWorkerDown$/,/for:/s/for: 3m$/for: 1m/' \
        '/alert: PacerWorkerDown$/,/for:/s/for: 3m$/for: 5m/' \
        's/ or absent(up{job="pacer"})$//' \
        's/sum by (job) (up{job="pacer"}) == 0 or //' \
        '/alert: PacerDown$/,/for:/s/for: 1m$/for: 5m/' \
        's/(pacer_output_max_length) \* 1.01 + 100)$/(pacer_output_max_length) * 1.01 + 1100)/' \
        's/(pacer_output_max_length) \* 1.01 + 100)$/(pacer_output_max_length))/' \
        '/alert: PacerOutputNotTrimmed$/,/for:/s/for: 10m$/for: 5m/'; do
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

rules_checks() {
    want promtool
    step "promtool check rules deploy/prometheus/alerts.yml" check_rules
    step "promtool test rules deploy/prometheus/alerts_test.yml" test_rules
    step "alert tests fail on mutated rules" rules_tests_can_fail
}
