#!/usr/bin/env bash
# device_venv.sh - build, on the CPU, a virtual environment that holds only what the lent GPU
# machine (nvidia-h200) holds, then install the carried wheels into it with the device's own
# install script, so that a missing package shows here and not in device minutes.
#
# Usage: bench/gpu/device_venv.sh [VENV] [WHEELS]   defaults .venv-device and .gpu-wheels
# Env:   PYTHON  the interpreter the venv is made from (default python3)
#
# What goes in: the packages rekv's steps could use there as /work/.library/device/KINDS.md lists
# the machine's image, pinned where it gives a version this index has (numpy 2.5.2 it has not),
# the rest at the lock's versions (requirements/cpu.lock), nothing else. torch is this machine's
# CPU wheel (2.13.0; the device has 2.11.0+cu130, whose CPU build PyPI does not carry) and Python is this machine's (the device runs 3.12). Not in the
# device image and so not here: cryptography, gguf (carried), opentelemetry,
# grpcio-health-checking and grpcio-reflection (carried), grpcio-tools.
# Then: bench/gpu/install_wheels.sh WHEELS with this venv's python, as the device run does; its
# smoke check imports every module the GPU steps import (bench/gpu/import_check.py).
# Fetches the wheels first (bench/gpu/fetch_wheels.sh: PyPI) where WHEELS lacks them. Writes
# VENV/.ready last, holding a hash of the three scripts, the lock and tools/lock.py: a venv without
# it, or built by other versions of them, is rebuilt from scratch.
set -euo pipefail

VENV=${1:-.venv-device}
WHEELS=${2:-.gpu-wheels}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

DEVICE_PACKAGES=(
    torch==2.13.0 triton==3.6.0 numpy transformers==5.17.0 tokenizers==0.23.2
    safetensors==0.8.0 accelerate==1.15.0 grpcio protobuf uvloop prometheus-client jinja2 rich
    pyyaml psutil requests tqdm setuptools wheel pytest pytest-timeout hypothesis
    "cuda-bindings>=13,<14" cuda-core nvidia-ml-py
)

# the venv is reused while this script, the install script and the wheel list are unchanged
STAMP=$(cat "$ROOT/bench/gpu/device_venv.sh" "$ROOT/bench/gpu/install_wheels.sh" \
        "$ROOT/bench/gpu/fetch_wheels.sh" "$ROOT/requirements/cpu.lock" "$ROOT/tools/lock.py" \
        | sha256sum | cut -d' ' -f1)
if [[ -f $VENV/.ready && $(cat "$VENV/.ready") == "$STAMP" ]]; then
    echo "device_venv.sh: $VENV is ready"
    exit 0
fi
bash "$ROOT/bench/gpu/fetch_wheels.sh" "$WHEELS"  # downloads nothing when they are there
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# What DEVICE_PACKAGES leaves unpinned takes the lock's version (less torch and triton, the
# packages pinned above to the device's, huggingface-hub, which the device's transformers 5.17
# needs below 2.0, and cuda-bindings: 12.x in the lock, ucxx-cu12's; 13.x on the device).
python3 "$ROOT/tools/lock.py" constraints --torch "torch==2.13.0+device" \
    --without transformers,tokenizers,safetensors,accelerate,huggingface-hub,cuda-bindings \
    "$ROOT/requirements/cpu.lock" \
    > "$VENV/constraints.txt"
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" --upgrade pip
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" "${DEVICE_PACKAGES[@]}"
PYTHON="$VENV/bin/python" bash "$ROOT/bench/gpu/install_wheels.sh" "$WHEELS"
echo "$STAMP" > "$VENV/.ready"
echo "device_venv.sh: $VENV ready"
