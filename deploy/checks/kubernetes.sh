# deploy/checks/kubernetes.sh — deploy/kubernetes: kustomize renders the base and every overlay
# (deploy/kubernetes/overlays/*); kubernetes-validate --strict on the output (oldest and newest
# Kubernetes we care about); CRDs against deploy/kubernetes/schemas and cross-references
# (k8s_refs.py); pacer check-config on each render's config and environment, the files it reads
# from Secrets stood in for (k8s_config.py).
# shellcheck shell=bash

render() { # render DIR OUT
    "${KUSTOMIZE[@]}" "$1" >"$2"
    note "$1: $(grep -c '^kind:' "$2") objects ($(grep '^kind:' "$2" | sed 's/kind: //' | sort | tr '\n' ' '))"
    note "rendered by ${KUSTOMIZE[*]}"
}

k8s_validate() { # k8s_validate RENDERED
    local v
    for v in 1.29.0 "$KUBERNETES_VALIDATE_VERSION"; do
        "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "$1" 2>&1 | tee "$WORK/kv.out"
        # Built-in kinds must validate; CRDs are left to k8s_refs.py.
        if [ -n "$(grep -v "Couldn't find schema for kind \(ServiceMonitor\|ScaledObject\|TriggerAuthentication\)" "$WORK/kv.out" || true)" ]; then
            return 1
        fi
    done
    note "built-in kinds valid (strict) for Kubernetes 1.29 and $KUBERNETES_VALIDATE_VERSION; CRDs checked by deploy/kubernetes/schemas"
}

crd_and_refs() { # crd_and_refs RENDERED FLAVOUR (base, or the overlay's directory name)
    "$PY" "$CHECKS/k8s_refs.py" "$1" "$2" "$ROOT/$K8S/schemas"
}

pod_config() { # pod_config RENDERED FLAVOUR
    local out=$WORK/pod-config-$2 stub=$WORK/k8s-stub-tls
    if [ ! -s "$stub/cert.pem" ]; then
        # One self-signed certificate stands in for the CA and the client certificate.
        mkdir -p "$stub"
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
            -subj /CN=pacer-check -keyout "$stub/key.pem" -out "$stub/cert.pem" 2>&1
    fi
    mkdir -p "$out"
    "$PY" "$CHECKS/k8s_config.py" "$1" "$out" "$stub/cert.pem" "$stub/key.pem" "$PACER_BIN"
}

kubernetes_checks() {
    local dir flavour flavours=() label
    for dir in "$K8S/base" "$K8S"/overlays/*/; do
        dir=${dir%/}
        [ -f "$dir/kustomization.yaml" ] && flavours+=("$dir")
    done
    want kustomize
    for dir in "${flavours[@]}"; do
        step "kustomize build $dir" render "$dir" "$WORK/${dir##*/}.yaml"
    done
    for dir in "${flavours[@]}"; do
        flavour=${dir##*/}
        # A render that failed has been reported; what would check its output is not run.
        [ -n "$SKIP_REASON" ] || [ -s "$WORK/$flavour.yaml" ] || continue
        case $flavour in base) label=base ;; *) label="$flavour overlay" ;; esac
        step "kubernetes-validate --strict ($label)" k8s_validate "$WORK/$flavour.yaml"
        step "CRD schemas and cross-references ($label)" crd_and_refs "$WORK/$flavour.yaml" "$flavour"
    done
    if [ ! -x "$PACER_BIN" ]; then
        skip "pacer check-config on the rendered pods' configs" "PACER_BIN $PACER_BIN does not exist (build it first)"
        return
    fi
    want openssl
    for dir in "${flavours[@]}"; do
        flavour=${dir##*/}
        [ -n "$SKIP_REASON" ] || [ -s "$WORK/$flavour.yaml" ] || continue
        case $flavour in base) label=base ;; *) label="$flavour overlay" ;; esac
        step "pacer check-config on the pod's config ($label)" pod_config "$WORK/$flavour.yaml" "$flavour"
    done
}
