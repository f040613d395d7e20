#!/usr/bin/env bash
# The numerics tests (`pytest -m numerics tests/unit`: tests/conftest.py's NUMERICS) under each
# instruction set that torch's and oneDNN's CPU kernels can be held to below this CPU's own, which
# the plain test run covers: the portable default, AVX2 (oneDNN held to AVX2 too), and, on a CPU
# with AVX-512, AVX-512 without oneDNN's BF16 and AMX paths. Each setting changes which kernels run
# and so every BF16 rounding; a test that holds on one CPU's results alone fails here.
#   bash .ci/test-isa.sh [PYTHON]        (make test-isa; PYTHON defaults to .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-.venv/bin/python}

settings=("ATEN_CPU_CAPABILITY=default" "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2")
if grep -qw avx512f /proc/cpuinfo; then
    settings+=("ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE")
fi
for setting in "${settings[@]}"; do
    echo "== $setting: pytest -m numerics tests/unit"
    # shellcheck disable=SC2086  # the setting is several VAR=value words
    env $setting "$PYTHON" -m pytest -q -p no:cacheprovider -m numerics tests/unit
done
