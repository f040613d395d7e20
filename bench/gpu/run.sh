#!/usr/bin/env bash
# bench/gpu/run.sh OUT_DIR [--dry-run]: everything issue 12 asks of a GPU machine, in one call.
#
# On a lent GPU machine (one call of under 8 minutes; carry ".gpu-wheels", filled beforehand by
# bench/gpu/fetch_wheels.sh, for UCX and the few packages the machine lacks):
#     REKV_COMMIT=<sha> bash bench/gpu/run.sh "$OUT"
# On the CPU, the same steps at tiny sizes (what CI runs, so GPU minutes are never lost to a typo):
#     bash bench/gpu/run.sh /tmp/gpu-dry --dry-run
#
# Steps, most important first; each runs under its own time limit and the remaining budget, its
# output goes to OUT_DIR/<step>.log and its exit status to OUT_DIR/steps.jsonl; a failing step
# does not stop the later ones, and the script exits non-zero if any step failed:
#   env        versions, device, commit                        -> env.json
#   cuda_tests pytest -m cuda (the stream-race and graph tests) -> cuda_tests.xml
#   kernels    Triton kernels vs their references, large sizes -> kernels.json
#   services   both services on the device over UCX            -> services_e2e.json (+ logs)
#   executor   prefill TFLOP/s and decode step vs ceilings      -> executor.json
#   batched    the engine's batched step, batch 1-64 at 1K, 8K  -> batched.json
#   batched_gemm  the same with batched GEMMs in bf16 (what       -> batched-gemm.json
#              batch-invariant rows cost)
#   codecs     encode/decode GB/s incl. checksums vs copy rate  -> codecs.json
#   ttft       TTFT (a)-(e): baseline, seed, streamed, chunked,  -> ttft.json
#              colocated (issue 15), qwen2.5-7b preset at 8K
#   handoff_*  the seed's Table 1 setting per preset            -> handoff-<preset>.json
#   summary    the goals beside their ceilings and the seed     -> summary.md, summary.json
set -uo pipefail

OUT=${1:?usage: bench/gpu/run.sh OUT_DIR [--dry-run]}
DRY=0
[[ ${2:-} == --dry-run ]] && DRY=1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
: > "$OUT/steps.jsonl"
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${BUDGET_S:-460}  # seconds for all steps: the device allows one call of 600
RESERVE=20  # kept for the summary, which always runs
FAILED=0

step() {  # step NAME LIMIT_S COMMAND...: run under min(LIMIT_S, what is left of the budget)
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    local left=$((BUDGET - SECONDS))
    [[ $name != summary ]] && left=$((left - RESERVE))
    ((left < limit)) && limit=$left
    if ((limit < 5)); then
        rc=124
        echo "[$name] skipped: the budget is spent" | tee "$OUT/$name.log"
    else
        timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
        rc=$?
    fi
    ((rc != 0)) && FAILED=1
    printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' \
        "$name" "$rc" $((SECONDS - start)) "$limit" >>"$OUT/steps.jsonl"
    echo "[$name] rc=$rc in $((SECONDS - start)) s"
    tail -n 3 "$OUT/$name.log" | sed "s/^/[$name]   /"
}

if ((DRY)); then
    export TRITON_INTERPRET=1
    DEVICE=cpu DTYPE=float32 PRESETS="smollm2-135m"
    KERNELS=(--dry-run) EXECUTOR=(--dry-run) SERVICES=(--dry-run) SUMMARY=(--dry-run)
    BATCHED=(--dry-run)
    CODECS=(--prompt-len 128 --model smollm2-135m --repeats 2 --real-tokens 128 --real-windows 1
        --real-calibration 1)
    HANDOFF=(--prompt-len 64 --link-gbps 1,x1 --cuts 10,20 --warmups 0 --runs 1)
    TTFT=(--model smollm2-135m --prompt-len 64 --link-gbps x1 --cuts 15 --warmups 0 --runs 1)
else
    if [[ -d .gpu-wheels ]]; then
        bash bench/gpu/install_wheels.sh .gpu-wheels >"$OUT/install.log" 2>&1 \
            || { echo "install failed:"; tail -n 20 "$OUT/install.log"; FAILED=1; }
    fi
    DEVICE=cuda DTYPE=bfloat16 PRESETS="qwen2.5-7b qwen2.5-3b qwen3-8b"
    KERNELS=() EXECUTOR=(--model synthetic:qwen2.5-7b --prompt-len 8192 --contexts 1024,8192)
    SERVICES=() SUMMARY=()
    BATCHED=(--model synthetic:qwen2.5-7b --contexts 1024,8192 --batches 1,4,16,64)
    CODECS=(--prompt-len 8192 --model qwen2.5-7b --model qwen2.5-3b --model qwen3-8b --repeats 10)
    # the seed's Table 1: 8K tokens at 18.4 Gb/s (2.3 GB/s), and this prompt's balanced rate
    HANDOFF=(--prompt-len 8192 --link-gbps 18.4,x1 --warmups 2 --runs 5)
    # issue 15's grid at the seed's setting: the balanced rate, x4, the seed's 18.4 Gb/s, 10 Gb/s
    TTFT=(--model synthetic:qwen2.5-7b --prompt-len 8192 --link-gbps x1,x4,18.4,10 --cuts 7,14,21
          --chunk-tokens 1024 --warmups 1 --runs 3)
fi

step env 30 "$PYTHON" bench/gpu/env_info.py --json "$OUT/env.json"
# only the modules that hold cuda-marked tests: the others need nothing a GPU adds
step cuda_tests 150 "$PYTHON" -m pytest -q -m cuda \
    $(grep -rl --include="test_*.py" "mark.cuda" tests) -p no:cacheprovider \
    --junitxml "$OUT/cuda_tests.xml"
step kernels 90 "$PYTHON" bench/gpu/kernels_check.py --device "$DEVICE" "${KERNELS[@]}" \
    --json "$OUT/kernels.json"
step services 120 "$PYTHON" bench/gpu/services_e2e.py --device "$DEVICE" "${SERVICES[@]}" \
    --out "$OUT/services"
step executor 90 "$PYTHON" bench/executor.py --device "$DEVICE" "${EXECUTOR[@]}" \
    --json "$OUT/executor.json"
step batched 60 "$PYTHON" bench/batched_decode.py --device "$DEVICE" "${BATCHED[@]}" \
    --json "$OUT/batched.json"
step batched_gemm 45 "$PYTHON" bench/batched_decode.py --device "$DEVICE" "${BATCHED[@]}" \
    --gemm --json "$OUT/batched-gemm.json"
step codecs 60 "$PYTHON" bench/codecs.py --device "$DEVICE" "${CODECS[@]}" \
    --json "$OUT/codecs.json"
step ttft 120 "$PYTHON" -m rekv_cli bench ttft --device "$DEVICE" --dtype "$DTYPE" "${TTFT[@]}" \
    --json "$OUT/ttft.json"
for preset in $PRESETS; do
    step "handoff_$preset" 100 "$PYTHON" -m rekv_cli bench handoff --device "$DEVICE" \
        --dtype "$DTYPE" --model "synthetic:$preset" "${HANDOFF[@]}" --joint-codecs int8 \
        --quant-codecs int8,int4 --sequential-codecs "" --json "$OUT/handoff-$preset.json"
done
step summary 30 "$PYTHON" bench/gpu/summarize.py "$OUT" "${SUMMARY[@]}"
echo "bench/gpu/run.sh: results in $OUT (failed steps: $(grep -c '"rc": [1-9]' "$OUT/steps.jsonl"))"
exit $FAILED
