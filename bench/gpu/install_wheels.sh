#!/usr/bin/env bash
# install_wheels.sh - on the lent GPU machine (no network), install offline from DIR, the folder
# that bench/gpu/fetch_wheels.sh filled and the device call carried, the CUDA 13 UCX stack and the
# project's dependencies that the machine's image lacks; then install rekv itself without
# dependencies, so that the machine's torch, triton and CUDA libraries are left as they are.
#
# Usage: bench/gpu/install_wheels.sh [DIR]       DIR defaults to .gpu-wheels (relative to the cwd)
# Env:   PYTHON  interpreter to install into (default python3, the one holding torch there)
# E.g. in a device run (carry: [".gpu-wheels"]):
#   bash bench/gpu/install_wheels.sh .gpu-wheels || exit 1; python3 -m rekv_cli ...
#
# Only-if-needed: a package already there in a version that satisfies the pins is kept. grpcio and
# protobuf are upgraded from DIR only if the machine's are older than the generated services/rpc
# code needs (pyproject.toml's floors, GRPC_FLOOR and PROTOBUF_FLOOR below; a test holds them
# equal). The UCX stack and gguf are the lock's versions, as fetch_wheels.sh fetched them. Anything else missing (numpy, cuda-bindings,
# cuda-core, nvidia-ml-py, pyyaml, requests, tqdm, typing-extensions) makes pip fail, by name.
set -euo pipefail

DIR=${1:-.gpu-wheels}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

if [[ ! -d $DIR ]]; then
    echo "install_wheels.sh: no wheel folder '$DIR' here; run bench/gpu/fetch_wheels.sh $DIR on a" \
         "machine with PyPI and carry '$DIR' to this one. Nothing installed." >&2
    exit 2
fi
shopt -s nullglob
wheels=("$DIR"/*.whl)
if (( ${#wheels[@]} == 0 )); then
    echo "install_wheels.sh: '$DIR' holds no wheels; run bench/gpu/fetch_wheels.sh $DIR first." \
         "Nothing installed." >&2
    exit 2
fi

pip_offline=("$PYTHON" -m pip install --no-index --find-links "$DIR" --no-cache-dir
             --disable-pip-version-check --progress-bar off)

GRPC_FLOOR=1.85.4
PROTOBUF_FLOOR=7.35.1
mapfile -t LOCKED < <(python3 "$ROOT/tools/lock.py" pins "$ROOT/requirements/cpu.lock" \
    ucxx-cu12=ucxx-cu13 libucxx-cu12=libucxx-cu13 libucx-cu12=libucx-cu13 \
    rmm-cu12=rmm-cu13 librmm-cu12=librmm-cu13 rapids-logger gguf)
(( ${#LOCKED[@]} == 7 )) || { echo "install_wheels.sh: the lock gave ${#LOCKED[@]} pins" >&2; exit 1; }
"${pip_offline[@]}" "${LOCKED[@]}" \
    "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" \
    "grpcio>=$GRPC_FLOOR" "protobuf>=$PROTOBUF_FLOOR,<8"

# rekv itself: editable (the source tree is what runs), no dependencies, no index, and the
# machine's own setuptools as build backend (no isolated build environment to fetch).
if ! "${pip_offline[@]}" --no-deps --no-build-isolation -e "$ROOT"; then
    # No usable setuptools there: put the repo root on sys.path with a .pth file instead (the same
    # as PYTHONPATH=$ROOT for every run; no `rekv` script then: use `python3 -m rekv_cli`).
    site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$ROOT" > "$site/rekv-src.pth"
    echo "install_wheels.sh: editable install failed; wrote $site/rekv-src.pth -> $ROOT" \
         "(run rekv as: $PYTHON -m rekv_cli)" >&2
fi

# Smoke check: the packages the wheels serve, the generated gRPC code's version guards, then
# every module a GPU step can import (bench/gpu/import_check.py; -P: as installed, not from the
# current folder).
"$PYTHON" -P - <<'PY'
from importlib.metadata import PackageNotFoundError, version as _version
def version(name):
    try:
        return _version(name)
    except PackageNotFoundError:
        return "(no metadata)"
import google.protobuf, grpc, grpc_health.v1.health, grpc_reflection.v1alpha.reflection, gguf
import rmm, ucxx, torch
import rekv_core, services.rpc.rekv.v1.rekv_pb2_grpc  # raises if grpcio/protobuf are too old
names = ["torch", "triton", "numpy", "cuda-bindings", "cuda-core", "grpcio", "protobuf",
         "ucxx-cu13", "libucx-cu13", "rmm-cu13", "gguf", "rekv"]
print("installed:", ", ".join(f"{n} {version(n)}" for n in names))
print("torch sees CUDA:", torch.cuda.is_available())
PY
"$PYTHON" "$ROOT/bench/gpu/import_check.py"
