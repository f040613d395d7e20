#!/usr/bin/env bash
# prepare.sh - everything a GPU run needs done on the CPU first, in order, stopping at the first
# failure; at the end it prints the device call to make. Needs PyPI (the wheels, the venv).
#
# Usage: bench/gpu/prepare.sh [DRY_OUT]        DRY_OUT defaults to /tmp/gpu-dry
#   1. the wheels the device lacks, slimmed (bench/gpu/fetch_wheels.sh .gpu-wheels)
#   2. a venv holding only the device's packages plus those wheels (bench/gpu/device_venv.sh)
#   3. the whole dry run in that venv (bench/gpu/run.sh DRY_OUT --dry-run)
#   4. the plan's step sizes against the call's budget (bench/gpu/step_sizes.py)
#   5. the tree's manifest, commit and blobs, for the copy there (bench/gpu/tree_manifest.py)
#   6. what the call carries against 64 MiB, 8 kept free (bench/gpu/carry_size.py)
# Commit first: the manifest names HEAD, and a tree that differs from it is recorded as such.
set -euo pipefail

DRY_OUT=${1:-/tmp/gpu-dry}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

bash bench/gpu/fetch_wheels.sh .gpu-wheels
bash bench/gpu/device_venv.sh .venv-device .gpu-wheels
PY=.venv-device/bin/python
PYTHON=$PY bash bench/gpu/run.sh "$DRY_OUT" --dry-run
"$PY" bench/gpu/step_sizes.py
"$PY" bench/gpu/tree_manifest.py write
"$PY" bench/gpu/carry_size.py --carry .gpu-wheels --carry .gpu-manifest.json
cat <<'EOF'

Ready. The device call (one command, timeout_s 580; give_back afterwards unless rerunning):
  carry:   [".gpu-wheels", ".gpu-manifest.json"]
  command: set -o pipefail; bash bench/gpu/run.sh "$OUT" 2>&1 | tee "$OUT/run.log"
Then copy the files back under bench/results/gpu/ and index them in bench/results/README.md.
EOF
