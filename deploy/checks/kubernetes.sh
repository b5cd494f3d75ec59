# deploy/checks/kubernetes.sh — deploy/kubernetes: kustomize renders the base and the KEDA
# overlay; kubernetes-validate --strict on the output (oldest and newest Kubernetes we care
# about); CRDs against deploy/kubernetes/schemas and cross-references (k8s_refs.py).
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

crd_and_refs() { # crd_and_refs RENDERED base|keda
    "$PY" "$CHECKS/k8s_refs.py" "$1" "$2" "$ROOT/$K8S/schemas"
}

kubernetes_checks() {
    local flavour dir
    want kustomize
    for flavour in base keda; do
        dir=$K8S/base
        [ "$flavour" = base ] || dir=$K8S/overlays/keda
        step "kustomize build $dir" render "$dir" "$WORK/$flavour.yaml"
    done
    for flavour in base keda; do
        # A render that failed has been reported; what would check its output is not run.
        [ -n "$SKIP_REASON" ] || [ -s "$WORK/$flavour.yaml" ] || continue
        case $flavour in base) dir=base ;; *) dir="keda overlay" ;; esac
        step "kubernetes-validate --strict ($dir)" k8s_validate "$WORK/$flavour.yaml"
        step "CRD schemas and cross-references ($dir)" crd_and_refs "$WORK/$flavour.yaml" "$flavour"
    done
}
