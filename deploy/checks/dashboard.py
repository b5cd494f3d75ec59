"""Checks on dashboards/pacer.json, for deploy/checks/dashboard.sh and live_data.sh.

    dashboard.py check FILE             importable: structure, datasource variable, unique ids,
                                        layout, and a panel for every metric of the contract
    dashboard.py queries FILE INTERVAL  one line per query target: PANEL_ID, REF, TITLE, EXPR
                                        (tab-separated), Grafana variables replaced by an
                                        all-values regex and the rate interval by INTERVAL
"""
import json
import re
import sys


def panels(ps):
    for p in ps:
        yield p
        yield from panels(p.get("panels", []))


def queries(path, interval):
    dash = json.load(open(path))
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

    for p in panels(dash["panels"]):
        for t in p.get("targets", []):
            print(f'{p["id"]}\t{t["refId"]}\t{p["title"]}\t{subst(t["expr"])}')


def check(path):
    d = json.load(open(path))
    errors = []
    err = errors.append
    for key in ("title", "uid", "panels", "templating", "schemaVersion"):
        if key not in d:
            err(f"dashboard has no {key}")
    if "id" in d and d["id"] is not None:
        err("dashboard carries a database id; exports for import must not")
    tvars = {v["name"]: v for v in d["templating"]["list"]}
    ds = tvars.get("DS_PROMETHEUS")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        err("no datasource variable DS_PROMETHEUS of type datasource/prometheus")
    ids, exprs = set(), []
    for p in panels(d["panels"]):
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
            exprs.append(t.get("expr", ""))
    for v in tvars.values():
        if v.get("type") == "query" and v.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
            err(f"variable {v['name']} does not query ${{DS_PROMETHEUS}}")
    text = "\n".join(exprs)
    # The panels the issue asks for, by the metric each must read.
    for metric in ["pacer_events_total", "pacer_route_queue_seconds", "pacer_lateness_seconds_bucket",
                   "pacer_wait_seconds_bucket", "pacer_redis_command_duration_seconds_bucket",
                   "pacer_redis_errors_total", "pacer_stream_pending", "pacer_stream_lag",
                   "pacer_output_length", "pacer_output_max_length",
                   "pacer_sleeping_events", "pacer_ready", "pacer_build_info",
                   # inbound.api: synchronous admission and its token leases
                   "pacer_api_decisions_total", "pacer_api_decision_seconds_bucket",
                   "pacer_api_decision_seconds_count", "pacer_api_redis_calls_total",
                   "pacer_lease_fetches_total", "pacer_lease_tokens_total",
                   # every listener's connections against its bound
                   "pacer_listener_connections", "pacer_listener_connections_max",
                   "pacer_listener_full_total"]:
        if metric not in text:
            err(f"no panel reads {metric}")
    for needle in ['outcome="rejected"', 'outcome="rerouted"', "histogram_quantile(0.5",
                   "histogram_quantile(0.99", "sum by (outcome)"]:
        if needle not in text:
            err(f"no panel query contains {needle}")
    if errors:
        print("\n".join(errors))
        sys.exit(1)
    shown = sum(1 for p in panels(d["panels"]) if p.get("type") != "row")
    print(f"=> {shown} panels, {len(exprs)} queries, variables: {', '.join(tvars)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["check"] and len(sys.argv) == 3:
        check(sys.argv[2])
    elif sys.argv[1:2] == ["queries"] and len(sys.argv) == 4:
        queries(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
