#!/usr/bin/env bash
# Build the CPU image with podman where no container registry and no PyTorch index are reachable:
# a base image made from Debian's packages (debootstrap), PyTorch's CPU wheel from a local wheel
# directory, everything else from PyPI. Users with Docker and the public registries build with
# `docker build -f docker/Dockerfile.cpu -t rekv:cpu .` instead (docker/README.md).
#
#   bash docker/build-local.sh [--json FILE]
#
# Environment: TAG (rekv:cpu), SUITE (bookworm: its Python 3.11 matches the local cp311 wheel),
# DEBIAN_MIRROR (http://deb.debian.org/debian), TORCH_WHEELS (/opt/wheels), TORCH_VERSION
# (2.13.0), PYPI_URL (https://pypi.org/simple), HOST_CA (the CA bundle pip trusts in the build:
# /etc/ssl/certs/ca-certificates.crt where it exists), REBUILD_BASE=1 to remake an existing base.
# Needs root, podman, runc and debootstrap (Debian: apt-get install podman runc debootstrap).
# Podman runs with its own containers.conf (no default ulimits, cgroupfs, runc): crun fails on
# these machines on setrlimit and on hybrid cgroups. Prints each stage's seconds and the image's
# size; with --json also writes them to FILE.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TAG=${TAG:-rekv:cpu}
SUITE=${SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_WHEELS=${TORCH_WHEELS:-/opt/wheels}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYPI_URL=${PYPI_URL:-https://pypi.org/simple}
BASE=localhost/rekv-base:$SUITE
JSON=""
if [[ "${1:-}" == "--json" ]]; then JSON=${2:?--json needs a file}; fi

WORK=$(mktemp -d /var/tmp/rekv-build.XXXXXX)
SERVER=""
cleanup() {
    [[ -n "$SERVER" ]] && kill "$SERVER" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

cat > "$WORK/containers.conf" <<'EOF'
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
export CONTAINERS_CONF="$WORK/containers.conf"

now() { date +%s.%N; }
declare -A SECONDS_OF

start=$(now)
if [[ "${REBUILD_BASE:-0}" == 1 ]] || ! podman image exists "$BASE"; then
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
        "$SUITE" "$WORK/rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" \
        || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
    rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
    tar -C "$WORK/rootfs" -c . | podman import - "$BASE" >/dev/null
    rm -rf "$WORK/rootfs"
fi
SECONDS_OF[base]=$(echo "$(now) - $start" | bc)

# PyTorch's CPU wheel, served as a one-package index on loopback for the build (host network).
wheel=$(ls "$TORCH_WHEELS"/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -1)
[[ -n "$wheel" ]] || { echo "no torch-$TORCH_VERSION+cpu wheel in $TORCH_WHEELS" >&2; exit 1; }
mkdir -p "$WORK/index/simple/torch"
ln -s "$wheel" "$WORK/index/simple/torch/"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$WORK/index" >/dev/null 2>&1 &
SERVER=$!

# The host's CA bundle for pip, where the host trusts more than pip's own (a TLS-inspecting proxy).
HOST_CA=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
ca_args=()
if [[ -f "$HOST_CA" ]]; then
    ca_args=(--volume "$HOST_CA:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
fi

start=$(now)
# docker format: OCI images drop HEALTHCHECK
podman build --format docker --network host -f "$ROOT/docker/Dockerfile.cpu" -t "$TAG" \
    "${ca_args[@]}" \
    --build-arg BASE_IMAGE="$BASE" \
    --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-arg TORCH_INDEX_URL="http://127.0.0.1:$port/simple" \
    --build-arg TORCH_EXTRA_INDEX_URL="$PYPI_URL" \
    "$ROOT"
SECONDS_OF[image]=$(echo "$(now) - $start" | bc)

size=$(podman image inspect "$TAG" --format '{{.Size}}')
base_size=$(podman image inspect "$BASE" --format '{{.Size}}')
printf 'base %s: %.0f s, %d MB\nimage %s: %.0f s, %d MB\n' "$BASE" "${SECONDS_OF[base]}" \
    $((base_size / 1000000)) "$TAG" "${SECONDS_OF[image]}" $((size / 1000000))
if [[ -n "$JSON" ]]; then
    printf '{"base": "%s", "base_s": %.1f, "base_bytes": %d, ' \
        "$BASE" "${SECONDS_OF[base]}" "$base_size" >"$JSON"
    printf '"image": "%s", "image_s": %.1f, "image_bytes": %d}\n' \
        "$TAG" "${SECONDS_OF[image]}" "$size" >>"$JSON"
fi
