#!/usr/bin/env bash
# Builds and runs the CPU image on a machine with no image registry and no torch index in reach, for
# integration-tests/test_docker_image.py (which calls it) and for anyone checking the image by hand.
#
#   scripts/docker-cpu-image.sh engine-up STATE_DIR    a Docker engine: the one that answers, or (as root) dockerd
#                                                      started here, installed from Debian's docker.io if missing
#   scripts/docker-cpu-image.sh engine-down STATE_DIR  stops the dockerd that engine-up started (none otherwise)
#   scripts/docker-cpu-image.sh build TAG STATE_DIR    `docker build --target cpu -t TAG`, as below
#   scripts/docker-cpu-image.sh prometheus             prints the path of Debian's prometheus binary, unpacked
#                                                      from its package (never installed as a service)
#
# `build` takes the Dockerfile's base image (python:3.11-slim-bookworm) from the registry where one answers;
# where none does, it makes an equivalent one from Debian's packages (debootstrap of bookworm with python3,
# python3-venv and ca-certificates, a `python` link, this machine's CA bundle), cached as a tarball under
# ${XDG_CACHE_HOME:-~/.cache}/specula/ and imported as specula-base:bookworm-local. torch comes from the
# Dockerfile's TORCH_INDEX_URL (download.pytorch.org) where that answers; where it does not, from a PEP 503
# index served on 127.0.0.1 for the build's length, holding the wheels `pip download` finds for torch and its
# dependencies with this machine's pip configuration (a local wheel directory or mirror), kept in the same cache
# directory. SPECULA_TORCH_INDEX_URL names an index to use instead. The base image used is written to STATE_DIR/base-image, for removal.
#
# The dockerd started here has no bridge and no NAT (--bridge=none --iptables=false --ip-masq=false): builds and
# containers use `--network host`, so every address they touch stays on the host's own interfaces.
# Exit status 3 means "no engine can run here", with the reason on stderr.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

say() { echo "docker-cpu-image: $*" >&2; }

engine_up() {
    local state=$1
    mkdir -p "$state"
    if docker info >/dev/null 2>&1; then
        say "a Docker engine already answers; using it"
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        say "no Docker engine answers and this user is not root: cannot start one"
        return 3
    fi
    if ! command -v dockerd >/dev/null; then
        if ! command -v apt-get >/dev/null; then
            say "no Docker engine answers, dockerd is not installed and there is no apt-get to install it"
            return 3
        fi
        say "installing Debian's docker.io"
        export DEBIAN_FRONTEND=noninteractive
        if ! apt-get install -y -q docker.io >"$state/apt.log" 2>&1; then
            apt-get update -q >>"$state/apt.log" 2>&1 || true
            if ! apt-get install -y -q docker.io >>"$state/apt.log" 2>&1; then
                tail -n 20 "$state/apt.log" >&2
                say "could not install docker.io"
                return 3
            fi
        fi
    fi
    say "starting dockerd (no bridge, no NAT); log in $state/dockerd.log"
    setsid dockerd --bridge=none --iptables=false --ip-masq=false >"$state/dockerd.log" 2>&1 < /dev/null &
    echo $! >"$state/dockerd.pid"
    for _ in $(seq 120); do
        if docker info >/dev/null 2>&1; then
            say "dockerd answers (pid $(cat "$state/dockerd.pid"))"
            return 0
        fi
        if ! kill -0 "$(cat "$state/dockerd.pid")" 2>/dev/null; then
            break
        fi
        sleep 0.5
    done
    tail -n 30 "$state/dockerd.log" >&2
    engine_down "$state"
    say "dockerd did not start"
    return 3
}

engine_down() {
    local state=$1 pid
    [ -f "$state/dockerd.pid" ] || return 0
    pid=$(cat "$state/dockerd.pid")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$state/dockerd.pid"
    say "dockerd stopped"
}

CPU_BASE=$(sed -n 's/^ARG CPU_IMAGE=//p' Dockerfile)  # python:3.11-slim-bookworm
LOCAL_BASE=specula-base:bookworm-local
TORCH_PIN=$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml)

base_image() {
    local state=$1 cache rootfs
    if docker image inspect "$CPU_BASE" >/dev/null 2>&1 || timeout 120 docker pull -q "$CPU_BASE" >/dev/null 2>&1; then
        echo "$CPU_BASE"
        return 0
    fi
    say "the registry does not answer for $CPU_BASE: using a bookworm base made from Debian's packages"
    if docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
        echo "$LOCAL_BASE"
        return 0
    fi
    cache=${XDG_CACHE_HOME:-$HOME/.cache}/specula/docker-base-bookworm.tar
    if [ ! -s "$cache" ]; then
        if ! command -v debootstrap >/dev/null; then
            say "installing debootstrap"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >>"$state/apt.log" 2>&1
        fi
        rootfs=$state/rootfs
        rm -rf "$rootfs"
        say "debootstrap bookworm (about 75 s)"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
            >"$state/debootstrap.log" 2>&1 || { tail -n 20 "$state/debootstrap.log" >&2; return 1; }
        ln -sf python3 "$rootfs/usr/bin/python"
        cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log
        # As Debian's own images: apt keeps no downloaded packages (136 MB of them after the g++ step otherwise).
        cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'CONF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
CONF
        mkdir -p "$(dirname "$cache")"
        tar -C "$rootfs" -cf "$cache.partial" . && mv "$cache.partial" "$cache"
        rm -rf "$rootfs"
    fi
    # pip reads the system bundle (with this machine's CA) instead of its own certifi copy.
    docker import --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'CMD ["python3"]' \
        "$cache" "$LOCAL_BASE" >/dev/null
    echo "$LOCAL_BASE"
}

# A PEP 503 index of torch==$TORCH_PIN (CPU) and its dependencies, from what pip finds here, in the cache
# directory (kept for the next build); prints its directory.
torch_index() {
    local index=${XDG_CACHE_HOME:-$HOME/.cache}/specula/torch-$TORCH_PIN-index wheels name
    wheels=$index/wheels
    if [ -f "$index/complete" ]; then
        echo "$index"
        return 0
    fi
    rm -rf "$index" && mkdir -p "$wheels"
    say "collecting torch==$TORCH_PIN and its dependencies with this machine's pip configuration"
    python3 -m pip download -q --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
        --implementation cp -d "$wheels" "torch==$TORCH_PIN" >"$index.log" 2>&1 \
        || { tail -n 20 "$index.log" >&2; return 1; }
    ls "$wheels"/torch-*+cpu-*.whl >/dev/null 2>&1 || { say "pip found no CPU build of torch==$TORCH_PIN"; return 1; }
    for wheel in "$wheels"/*.whl; do
        name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
        mkdir -p "$index/simple/$name"
        ln "$wheel" "$index/simple/$name/"
    done
    touch "$index/complete"
    echo "$index"
}

build() {
    local tag=$1 state=$2 base index index_url server_pid="" port start
    mkdir -p "$state"
    SECONDS=0
    base=$(base_image "$state")
    echo "$base" >"$state/base-image"
    say "base image $base ready after $SECONDS s"
    index_url=${SPECULA_TORCH_INDEX_URL:-}
    if [ -z "$index_url" ] && ! curl -sfI -m 20 "https://download.pytorch.org/whl/cpu/torch/" >/dev/null 2>&1; then
        say "download.pytorch.org does not answer: serving torch from a local index on 127.0.0.1"
        index=$(torch_index)
        # The index's URL is a build argument, part of the torch layer's cache key: the same port each time where
        # it is free, so that a rebuild reuses that layer.
        port=$(python3 -c '
import socket
s = socket.socket()
try:
    s.bind(("127.0.0.1", 38517))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
        python3 -m http.server -b 127.0.0.1 -d "$index" "$port" >"$state/index.log" 2>&1 &
        server_pid=$!
        index_url=http://127.0.0.1:$port/simple
        for _ in $(seq 50); do curl -sf "$index_url/torch/" >/dev/null && break; sleep 0.1; done
    fi
    say "torch index ready after $SECONDS s"
    start=$SECONDS
    say "docker build --target cpu -t $tag (CPU_IMAGE=$base, TORCH_INDEX_URL=${index_url:-its default})"
    local status=0
    docker build --network host --target cpu -t "$tag" --build-arg "CPU_IMAGE=$base" \
        ${index_url:+--build-arg "TORCH_INDEX_URL=$index_url"} . >"$state/build.log" 2>&1 || status=$?
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
    if [ "$status" != 0 ]; then
        tail -n 40 "$state/build.log" >&2
        say "docker build failed"
        return "$status"
    fi
    say "built $tag: docker build $(( SECONDS - start )) s, $SECONDS s in all"
}

prometheus_binary() {
    local dir=${XDG_CACHE_HOME:-$HOME/.cache}/specula/prometheus
    if [ ! -x "$dir/usr/bin/prometheus" ]; then
        rm -rf "$dir" && mkdir -p "$dir/deb"
        (cd "$dir/deb" && apt-get download prometheus >"$dir/apt.log" 2>&1) || {
            apt-get update -q >>"$dir/apt.log" 2>&1 || true
            (cd "$dir/deb" && apt-get download prometheus >>"$dir/apt.log" 2>&1) || {
                tail -n 20 "$dir/apt.log" >&2; say "could not download Debian's prometheus"; return 1; }
        }
        dpkg-deb -x "$dir"/deb/prometheus_*.deb "$dir" && rm -rf "$dir/deb"
    fi
    echo "$dir/usr/bin/prometheus"
}

command=${1:-}
shift || true
case "$command" in
    engine-up) engine_up "$@" ;;
    engine-down) engine_down "$@" ;;
    build) build "$@" ;;
    prometheus) prometheus_binary ;;
    *) sed -n '2,24p' "$0" >&2; exit 2 ;;
esac
