# deploy/checks/dockerfile.sh — the Dockerfile against the deployment: Debian suite, exposed
# metrics port, entrypoint, a numeric non-root USER equal to the Kubernetes runAsUser, and COPY
# sources that exist.
# shellcheck shell=bash

dockerfile() {
    local f=Dockerfile uid k8s_uid src
    grep -Eq '^FROM rust:[^ ]*bookworm[^ ]* AS builder' "$f" || grep -Eq '^FROM rust:\$\{RUST_VERSION\}-\$\{DEBIAN_SUITE\} AS builder' "$f"
    grep -Eq '^ARG DEBIAN_SUITE=bookworm$' "$f"
    grep -Eq '^FROM debian:(bookworm|\$\{DEBIAN_SUITE\})-slim$' "$f"
    grep -Eq '^EXPOSE 9464$' "$f"
    grep -Eq '^ENTRYPOINT \["/usr/local/bin/pacer"\]$' "$f"
    uid=$(sed -n 's/^USER \([0-9]*\).*/\1/p' "$f")
    if [ -z "$uid" ] || [ "$uid" -eq 0 ]; then echo "USER must be a numeric non-root uid"; return 1; fi
    k8s_uid=$(sed -n 's/^ *runAsUser: *//p' "$K8S/base/deployment.yaml")
    [ "$uid" = "$k8s_uid" ] || { echo "Dockerfile USER $uid != runAsUser $k8s_uid"; return 1; }
    while read -r src; do
        [ "$src" = . ] || [ -e "$src" ] || { echo "COPY source $src does not exist"; return 1; }
    done < <(sed -n 's/^COPY \([^-][^ ]*\) .*/\1/p' "$f")
    note "multi-stage, USER $uid (= runAsUser), EXPOSE 9464, ENTRYPOINT pacer"
}

dockerfile_checks() {
    step "Dockerfile consistent with the deployment" dockerfile
}
