"""CRD schemas and cross-references of a rendered kustomization, for deploy/checks/kubernetes.sh.

    k8s_refs.py RENDERED FLAVOUR SCHEMA_DIR

FLAVOUR is base or the overlay's directory name (keda, cluster-tls, ...). The CRDs
(ServiceMonitor, ScaledObject, TriggerAuthentication) against the JSON schemas in SCHEMA_DIR,
then what ties the objects together: selectors, the mounted config and the port it listens on,
probes, the Service and ServiceMonitor ports, the security context, the Secret keys pacer and
KEDA read (as environment variables, and as the files the config names: passwords, TLS
material, each in a mounted Secret no other user can read), the grace period against
worker.drain; for keda, the ScaledObject's target and triggers against the config's stream and
group. A Secret the render does not hold is taken as managed outside it, and named in the output.
"""
import json, os, re, sys, yaml, base64
from urllib.parse import urlsplit
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

external = {}  # Secret not in the render -> the keys the pod reads from it
def secret_key(name, key, what):
    """The pod reads KEY of Secret NAME: it must be there, if the render holds that Secret."""
    if name not in secrets:
        external.setdefault(name, set()).add(key)
    elif key not in secrets[name].get("data", {}):
        err(f"{what} reads key {key!r} of Secret {name}, which has {sorted(secrets[name].get('data', {}))}")

env = {e["name"]: e for e in c.get("env", [])}
for e in env.values():
    ref = e.get("valueFrom", {}).get("secretKeyRef")
    if ref:
        secret_key(ref.get("name"), ref.get("key"), f"env {e['name']}")
ref = env.get("PACER_REDIS_URL", {}).get("valueFrom", {}).get("secretKeyRef", {})
if flavour in ("base", "keda") or ref:
    # The base (and KEDA over it) keep the URL, with its password, in the Secret.
    sec = secrets.get(ref.get("name"))
    if not sec or ref.get("key") not in sec.get("data", {}):
        err(f"PACER_REDIS_URL comes from no rendered Secret key: {ref}")
    else:
        url = base64.b64decode(sec["data"][ref["key"]]).decode()
        if not url.startswith(("redis://", "rediss://")):
            err("PACER_REDIS_URL in the Secret is not a redis:// URL")
else:
    # The URLs in the ConfigMap, or in a literal PACER_REDIS_URL: no password in them.
    where = "PACER_REDIS_URL" if "PACER_REDIS_URL" in env else "redis.url in the ConfigMap"
    text = env["PACER_REDIS_URL"].get("value", "") if "PACER_REDIS_URL" in env else cfg.get("redis", {}).get("url", "")
    urls = [u.strip() for u in str(text).split(",") if u.strip()]
    if not urls or not all(u.startswith(("redis://", "rediss://")) for u in urls):
        err(f"{where} is not a list of redis:// URLs: {urls}")
    elif any(urlsplit(u).password for u in urls):
        err(f"{where} holds a password: keep it in a Secret")

# Files the config reads (passwords, TLS material): each one a key of a Secret the pod mounts,
# with no access for other users.
red = cfg.get("redis") or {}
files = {
    "redis.password_file": red.get("password_file"),
    "redis.sentinel.password_file": (red.get("sentinel") or {}).get("password_file"),
    **{f"redis.tls.{k}": (red.get("tls") or {}).get(k) for k in ("ca_file", "cert_file", "key_file")},
}
read = []
for what, f in files.items():
    if not f:
        continue
    under = [m for m in c.get("volumeMounts", []) if f.startswith(m["mountPath"].rstrip("/") + "/")]
    m = max(under, key=lambda m: len(m["mountPath"]), default=None)
    s = vol.get(m["name"], {}).get("secret") if m else None
    if not s:
        err(f"{what} {f} is not in a mounted Secret")
        continue
    rel = f[len(m["mountPath"].rstrip("/")) + 1:]
    items = {i["path"]: i["key"] for i in s.get("items", [])}
    if items and rel not in items:
        err(f"{what} {f}: the volume {m['name']} lists no item {rel}")
        continue
    secret_key(s["secretName"], items.get(rel, rel), what)
    if s.get("optional"):
        err(f"{what} {f}: the Secret volume {m['name']} is optional; pacer would start without it")
    if s.get("defaultMode", 0o644) & 0o007:
        err(f"{what} {f}: the Secret volume {m['name']} has defaultMode {oct(s.get('defaultMode', 0o644))}, readable by other users")
    if not m.get("readOnly"):
        err(f"the Secret volume {m['name']} is not mounted readOnly")
    read.append(rel)

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
    err(f"{flavour}: only the keda overlay carries a ScaledObject")

if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"=> schemas: {', '.join(sorted(set(checked)))}; selectors, ports, probes, secrets, grace {grace}s > drain {drain:g}s")
if read:
    print(f"=> files from mounted Secrets: {', '.join(read)}")
for name, keys in sorted(external.items()):
    print(f"=> Secret {name} is not rendered (managed outside): the pod reads {', '.join(sorted(keys))}")
