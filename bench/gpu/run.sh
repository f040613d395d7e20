#!/usr/bin/env bash
# bench/gpu/run.sh OUT_DIR [--dry-run]: every figure issue 31 asks of a GPU machine, in one call.
#
# Before the device call, here (bench/gpu/prepare.sh does all of it and says what to send):
#     bash bench/gpu/fetch_wheels.sh .gpu-wheels            # UCX stack etc., slimmed
#     python bench/gpu/tree_manifest.py write               # .gpu-manifest.json: commit + blobs
#     python bench/gpu/carry_size.py --carry .gpu-wheels --carry .gpu-manifest.json
# On the lent GPU machine (carry .gpu-wheels and .gpu-manifest.json; one call of under 9 min):
#     bash bench/gpu/run.sh "$OUT"
# On the CPU, the same steps at tiny sizes (what CI runs, so GPU minutes are never lost to a typo;
# bench/gpu/device_venv.sh builds a venv holding only the device's packages to run it in):
#     bash bench/gpu/run.sh /tmp/gpu-dry --dry-run
#
# On the device the script first verifies the copied tree against .gpu-manifest.json (no .git
# travels) and exports REKV_COMMIT and REKV_TREE_CLEAN, which every result's meta records; then
# installs the carried wheels (a failed install fails the run, and REKV_DEVICE_RUN=1 makes every
# test that needs a carried package fail instead of skipping).
#
# Steps, their order, arguments and limits: bench/gpu/step_sizes.py (each sized there from an
# estimate of its device seconds). Each runs under min(its limit, what is left of the budget);
# its output goes to OUT_DIR/<step>.log, its exit status to OUT_DIR/steps.jsonl, and the
# benches rewrite their JSON after every point, so a step cut short keeps what it finished. A
# failing step does not stop the later ones; the script exits non-zero if any step failed:
#   env        versions, device, commit, clean tree             -> env.json
#   cuda_tests pytest -m cuda (the stream-race and graph tests) -> cuda_tests.xml
#   handoff_*  the seed's Table 1 setting, one step per preset  -> handoff-<preset>.json
#   kernels    Triton kernels vs their references, large sizes -> kernels.json
#   services   both services on the device over UCX            -> services/services_e2e.json
#   executor   prefill TFLOP/s and decode step vs ceilings      -> executor.json
#   batched    the engine's batched step, batch 1-64 at 1K, 8K  -> batched.json
#   batched_invariant  the same, each row its lone kernels       -> batched-invariant.json
#   codecs     encode/decode GB/s incl. checksums vs copy rate  -> codecs.json
#   ttft       TTFT (a)-(e) and the pipelined way, qwen2.5-7b    -> ttft.json
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
FAILED=0

step() {  # step NAME LIMIT_S COMMAND...: run under min(LIMIT_S, what is left of BUDGET)
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
    DEVICE=cpu DTYPE=float32 SUMMARY=(--dry-run)
else
    DEVICE=cuda DTYPE=bfloat16 SUMMARY=()
    export REKV_DEVICE_RUN=1
    if [[ ! -d .git ]]; then  # a copy: the manifest says which commit, and if it equals it
        if verdict=$("$PYTHON" bench/gpu/tree_manifest.py verify .gpu-manifest.json); then
            eval "$verdict"
        else
            echo "no readable .gpu-manifest.json: the commit is unknown"; REKV_TREE_CLEAN=0
        fi
        export REKV_COMMIT REKV_TREE_CLEAN
        echo "tree: commit ${REKV_COMMIT:-unknown}, clean=$REKV_TREE_CLEAN"
    fi
    if [[ -d .gpu-wheels ]]; then
        bash bench/gpu/install_wheels.sh .gpu-wheels >"$OUT/install.log" 2>&1 \
            || { echo "install failed:"; tail -n 20 "$OUT/install.log"; FAILED=1; }
    else
        echo "no .gpu-wheels carried: nothing installed" | tee "$OUT/install.log"; FAILED=1
    fi
fi
SIZES=(bench/gpu/step_sizes.py shell)
((DRY)) && SIZES+=(--dry-run)
plan=$("$PYTHON" "${SIZES[@]}") || { echo "bench/gpu/step_sizes.py failed: no steps run"; exit 1; }
eval "$plan"  # BUDGET (s, the install included), RESERVE (for the summary), STEPS, ARGS_, LIMIT_

run_step() {  # run_step NAME: the step's command, with its ARGS_ and LIMIT_ from step_sizes.py
    local name=$1 var=${1//[.-]/_}
    local -n args="ARGS_$var"
    local limit="LIMIT_$var"
    case $name in
    env) step env "${!limit}" "$PYTHON" bench/gpu/env_info.py --json "$OUT/env.json" ;;
    cuda_tests)  # only the modules that hold cuda-marked tests: the others need nothing a GPU adds
        step cuda_tests "${!limit}" "$PYTHON" -m pytest -q -m cuda \
            $(grep -rl --include="test_*.py" "mark.cuda" tests) -p no:cacheprovider \
            --junitxml "$OUT/cuda_tests.xml" ;;
    handoff_*)
        step "$name" "${!limit}" "$PYTHON" -m rekv_cli bench handoff --device "$DEVICE" \
            --dtype "$DTYPE" "${args[@]}" --sequential-codecs "" \
            --json "$OUT/handoff-${name#handoff_}.json" ;;
    kernels) step kernels "${!limit}" "$PYTHON" bench/gpu/kernels_check.py --device "$DEVICE" \
        "${args[@]}" --json "$OUT/kernels.json" ;;
    services) step services "${!limit}" "$PYTHON" bench/gpu/services_e2e.py --device "$DEVICE" \
        "${args[@]}" --out "$OUT/services" ;;
    executor) step executor "${!limit}" "$PYTHON" bench/executor.py --device "$DEVICE" \
        "${args[@]}" --json "$OUT/executor.json" ;;
    batched) step batched "${!limit}" "$PYTHON" bench/batched_decode.py --device "$DEVICE" \
        "${args[@]}" --json "$OUT/batched.json" ;;
    batched_invariant) step batched_invariant "${!limit}" "$PYTHON" bench/batched_decode.py \
        --device "$DEVICE" "${args[@]}" --invariant --json "$OUT/batched-invariant.json" ;;
    codecs) step codecs "${!limit}" "$PYTHON" bench/codecs.py --device "$DEVICE" "${args[@]}" \
        --json "$OUT/codecs.json" ;;
    ttft) step ttft "${!limit}" "$PYTHON" -m rekv_cli bench ttft --device "$DEVICE" \
        --dtype "$DTYPE" "${args[@]}" --json "$OUT/ttft.json" ;;
    *) echo "run.sh: no command for step $name"; FAILED=1 ;;
    esac
}

for name in "${STEPS[@]}"; do run_step "$name"; done
step summary 30 "$PYTHON" bench/gpu/summarize.py "$OUT" "${SUMMARY[@]}"
echo "bench/gpu/run.sh: results in $OUT (failed steps: $(grep -c '"rc": [1-9]' "$OUT/steps.jsonl"))"
exit $FAILED
