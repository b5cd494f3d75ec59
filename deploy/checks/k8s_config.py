"""pacer check-config on the config a pod of a rendered kustomization runs with.

    k8s_config.py RENDERED OUTDIR CERT KEY PACER_BIN

Takes the config from the ConfigMap and the container's environment (literal values, and keys of
the Secrets in the render; a key of a Secret managed outside it gets a stub value), and stands in
for the files the config reads from mounted Secrets, which this machine does not have: each path
P becomes OUTDIR/P, holding CERT for redis.tls.ca_file and cert_file, KEY for key_file and a stub
line for a password file. Then runs PACER_BIN check-config on OUTDIR/config.yaml with that
environment alone, and exits with its status. k8s_refs.py checks that those files are keys of
mounted Secrets; this checks that the config and environment together are one pacer accepts.
"""
import base64, os, re, shutil, subprocess, sys, yaml

path, out, cert, key, pacer = sys.argv[1:6]
docs = [d for d in yaml.safe_load_all(open(path)) if d]
cm = next(d for d in docs if d["kind"] == "ConfigMap")
dep = next(d for d in docs if d["kind"] == "Deployment")
secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
c = dep["spec"]["template"]["spec"]["containers"][0]
cfg_key = next(iter(cm["data"]))
text = cm["data"][cfg_key]
red = (yaml.safe_load(text) or {}).get("redis") or {}

stubs = {}  # path in the pod -> what stands in for it
for k in ("ca_file", "cert_file", "key_file"):
    f = (red.get("tls") or {}).get(k)
    if f:
        stubs[f] = key if k == "key_file" else cert
for f in (red.get("password_file"), (red.get("sentinel") or {}).get("password_file")):
    if f:
        stubs[f] = None
for f, src in stubs.items():
    dst = os.path.join(out, f.lstrip("/"))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if src:
        shutil.copyfile(src, dst)
    else:
        with open(dst, "w") as w:
            w.write("stub-password\n")
if stubs:
    # One pass, so that a path which is the start of another is not moved twice.
    alt = "|".join(re.escape(f) for f in sorted(stubs, key=len, reverse=True))
    text = re.sub(alt, lambda m: os.path.join(out, m.group(0).lstrip("/")), text)
config = os.path.join(out, "config.yaml")
with open(config, "w") as w:
    w.write(text)

env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
for e in c.get("env", []):
    if "value" in e:
        env[e["name"]] = e["value"]
        continue
    ref = e.get("valueFrom", {}).get("secretKeyRef")
    if ref:
        data = secrets.get(ref["name"], {}).get("data")
        env[e["name"]] = base64.b64decode(data[ref["key"]]).decode() if data else "stub"
shown = {k: ("***" if "PASSWORD" in k or k == "PACER_REDIS_URL" else v) for k, v in env.items() if k != "PATH"}
print(f"environment: {shown}")
print(f"stand-ins: {', '.join(sorted(stubs)) or 'none'}")
sys.stdout.flush()
run = subprocess.run([pacer, "check-config", "--config", config], env=env)
if run.returncode == 0:
    n = len(stubs)
    print(f"=> check-config accepts the pod's config ({n} Secret file{'s' if n != 1 else ''} stood in for), "
          f"with env {', '.join(sorted(shown)) or 'none'}")
sys.exit(run.returncode)
