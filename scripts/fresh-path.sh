#!/usr/bin/env bash
# Runs a command as if on a fresh Debian machine with Rust, to prove that the test command
# installs what it needs:
#   scripts/fresh-path.sh scripts/test.sh
#   scripts/fresh-path.sh deploy/check.sh kubernetes
#
# PATH becomes one directory of links to the system's commands (/usr/bin, /usr/sbin) minus those
# named in HIDE below that exist now, plus ~/.cargo/bin. /usr/local, pyenv and any other PATH
# entry are dropped: on this image they hold what a fresh machine lacks (docker, terraform,
# another python). The directory carries an apt-get wrapper that, after each install, links
# what it installed: every file of the packages named (so that `apt-get install prometheus`
# brings back promtool, as on a fresh machine, even when the package was already there) and
# any command that appeared. Tools the scripts install elsewhere (the venv and kustomize under
# the ops cache) are found by absolute path. The caches (XDG_CACHE_HOME, npm's) start empty, so
# downloads happen again; FRESH_PATH_KEEP_CACHE=1 keeps yours.
#
# Not hidden: the Debian packages themselves (a hidden command's package stays installed, so
# apt-get installs it in seconds) and ~/.cargo (its registry cache too).
set -euo pipefail

# Commands a fresh Debian with Rust does not have: what this image preinstalls outside Debian,
# and the Debian packages the test command installs itself.
HIDE=(
    kubectl kustomize helm kind minikube docker dockerd docker-compose podman terraform
    node nodejs npm npx corepack yarn go gofmt
    prometheus promtool shellcheck jq curl systemd-analyze
    redis-server redis-cli redis-sentinel redis-benchmark redis-check-aof redis-check-rdb faketime
    python3 python3.11 pip pip3 pip3.11
)
SYSTEM_DIRS=(/usr/sbin /usr/bin)

usage() { sed -n '2,4p' "$0" >&2; exit 2; }

# link DIR: links every system command not hidden (or since revealed) into DIR/bin.
link() {
    local dir=$1 d f name new=()
    local -A skip=() seen=()
    while read -r f; do skip[$f]=1; done <"$dir/hidden"
    while read -r f; do unset "skip[$f]"; done <"$dir/revealed"
    for f in "$dir"/bin/*; do seen[${f##*/}]=1; done
    for d in "${SYSTEM_DIRS[@]}"; do
        for f in "$d"/*; do
            name=${f##*/}
            if [ -n "${seen[$name]:-}" ] || [ -n "${skip[$f]:-}" ] || [ ! -x "$f" ] || [ -d "$f" ]; then
                continue
            fi
            seen[$name]=1
            new+=("$f")
        done
    done
    [ "${#new[@]}" -eq 0 ] || ln -s -t "$dir/bin" "${new[@]}"
}

# relink DIR APT_ARGS...: after apt-get: the commands of the packages named, and of what they
# depend on, become visible, as if apt-get had just installed them.
relink() {
    local dir=$1 arg pkgs=() installing=0
    shift
    for arg; do
        case $arg in
            install) installing=1 ;;
            -*) ;;
            *) [ "$installing" -eq 1 ] && pkgs+=("${arg%%[=:]*}") ;;
        esac
    done
    if [ "${#pkgs[@]}" -gt 0 ]; then
        apt-cache depends --recurse --installed --no-recommends --no-suggests --no-conflicts \
            --no-breaks --no-replaces --no-enhances "${pkgs[@]}" 2>/dev/null |
            sed -n 's/^\([a-z0-9][^ <>]*\)$/\1/p' | sort -u |
            xargs -r dpkg -L 2>/dev/null | grep -E '^/(usr/)?s?bin/[^/]+$' |
            sed -E 's#^/(s?bin)/#/usr/\1/#' >>"$dir/revealed" || true
    fi
    link "$dir"
}

if [ "${1:-}" = --relink ]; then
    shift
    relink "$@"
    exit 0
fi
[ "$#" -gt 0 ] || usage

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/fresh-path.XXXXXX")
trap 'rm -rf "$dir"' EXIT
mkdir "$dir/bin" "$dir/cache"
# apt runs its download and signature methods as the unprivileged _apt user, which must find
# gpgv on this PATH: mktemp's 0700 hid it ("gpgv ... required for verification, but neither
# seems installed"), and apt-get update fell back to stale index files.
chmod 755 "$dir" "$dir/bin"
: >"$dir/revealed"
for name in "${HIDE[@]}"; do
    for d in "${SYSTEM_DIRS[@]}"; do
        [ -e "$d/$name" ] && echo "$d/$name"
    done
done >"$dir/hidden"
cat >"$dir/bin/apt-get" <<EOF
#!/bin/sh
/usr/bin/apt-get "\$@" || exit \$?
exec "$ROOT/scripts/fresh-path.sh" --relink "$dir" "\$@"
EOF
chmod +x "$dir/bin/apt-get"
link "$dir"

fresh_path=$dir/bin
[ -d "$HOME/.cargo/bin" ] && fresh_path=$HOME/.cargo/bin:$fresh_path
echo "fresh-path: PATH=$fresh_path; hidden: $(sed 's#.*/##' "$dir/hidden" | sort -u | tr '\n' ' ')" >&2
if [ -z "${FRESH_PATH_KEEP_CACHE:-}" ]; then
    export XDG_CACHE_HOME=$dir/cache npm_config_cache=$dir/cache/npm
fi
unset PYENV_VERSION PYENV_ROOT PYENV_SHELL VIRTUAL_ENV
# Not exec: the trap removes the directory when the command is done.
PATH=$fresh_path "$@"
