"""The GPU run's steps: their order, their arguments on the device and in the CPU dry run, their
time limits, and each one's estimated seconds on the H200, worked out here on the CPU before any
device time is spent.

    python bench/gpu/step_sizes.py [--json]          the plan, and exit 1 if it does not fit
    python bench/gpu/step_sizes.py shell [--dry-run] what bench/gpu/run.sh evals: its budget,
                                                     ARGS_<step> arrays, LIMIT_<step> seconds

Order: most wanted first, so a run cut short still leaves the figures that matter: the `cuda`
tests, the seed's Table 1 (8K tokens at 18.4 Gb/s, one step per preset), the kernels, the services
over UCX, then the executor, the batched engine, the codecs and the TTFT grid.

Estimates. The two sweeps are counted from their grids: every handoff the bench runs (cases x
(warmups + runs) x link rates, plus the prefill and the compute timing) at an assumed
`PREFILL_TFLOPS` for compute and the link's rate for bytes (`wire_bytes`), each handoff taking
the larger of its wire time and its suffix's recompute, plus `HANDOFF_OVERHEAD_S`; a step's fixed
cost (interpreter, torch and CUDA start, random weights on the device, Triton compiles) is
`START_S`. The other steps run fixed, small shapes: their estimates are guesses of the dry run's
order of magnitude on the device (`GUESSED`). A step's limit is a cap for a step gone wrong, at
least `LIMIT_OVER_ESTIMATE` times its estimate; the plan fits when the estimates, the install
and the summary sum to no more than `SLACK` of `BUDGET_S`, the seconds run.sh gives the run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.executor import prefill_flops  # noqa: E402
from rekv_cli.bench.handoff import BenchConfig, LinkRate  # noqa: E402
from rekv_cli.bench.handoff import cases_for as handoff_cases  # noqa: E402
from rekv_cli.bench.ttft import TtftConfig  # noqa: E402
from rekv_cli.bench.ttft import cases_for as ttft_cases  # noqa: E402
from rekv_core.handoff import Action  # noqa: E402
from rekv_core.handoff.action import wire_bytes  # noqa: E402
from rekv_core.model.shapes import ModelShape, get_preset  # noqa: E402

BUDGET_S = 520  # run.sh's budget (the install included), unless BUDGET_S is set: 600 s a call
SLACK = 0.9  # the plan fits when its estimates take at most this share of the budget
INSTALL_S = 30  # the carried wheels' offline install, before the first step
SUMMARY_S = 20  # run.sh's RESERVE, kept for the summary, which always runs
PREFILL_TFLOPS = 300.0  # assumed: 38% of the H200's measured 790 bf16 TFLOP/s (KINDS.md)
START_S = 25.0  # per step: interpreter, torch + CUDA start, random 7-8B weights, Triton compiles
HANDOFF_OVERHEAD_S = 0.02  # per handoff: threads, seals, allocation
LIMIT_OVER_ESTIMATE = 1.5

SEED_PRESETS = ("qwen2.5-7b", "qwen2.5-3b", "qwen3-8b")
SEED_PROMPT = 8192
SEED_GBPS = "18.4"
DRY_PRESET = "smollm2-135m"  # the dry run's stand-in for every preset

HANDOFF = dict(prompt_len=SEED_PROMPT, links=[SEED_GBPS], quant="int8", joint="int8",
               warmups=1, runs=3)
TTFT = dict(model="qwen2.5-7b", prompt_len=SEED_PROMPT, links=[SEED_GBPS], cuts=[7, 14, 21],
            chunk_tokens=1024, warmups=1, runs=2)


@dataclass(frozen=True)
class Step:
    name: str
    args: list[str]
    estimate_s: float  # on the device, at the device's sizes
    limit_s: int


def compute_s(shape: ModelShape, prompt_len: int, layers: int | None = None) -> float:
    """Seconds to run `layers` (default all) layers of a prompt at `PREFILL_TFLOPS`."""
    share = 1.0 if layers is None else layers / shape.num_layers
    return prefill_flops(shape, prompt_len) * share / (PREFILL_TFLOPS * 1e12)


def _gbps(text: str, shape: ModelShape, prompt_len: int) -> float:
    balanced = (wire_bytes(Action.full_bf16(shape.num_layers), shape, prompt_len).prefix * 8
                / compute_s(shape, prompt_len) / 1e9)
    return LinkRate.parse(text).gbps(balanced)


def handoff_s(action: Action, shape: ModelShape, prompt_len: int, gbps: float) -> float:
    """One handoff: the larger of its bytes on the link and its suffix's recompute."""
    wire = wire_bytes(action, shape, prompt_len).total * 8 / (gbps * 1e9)
    recompute = compute_s(shape, prompt_len, shape.num_layers - action.cut)
    return max(wire, recompute) + HANDOFF_OVERHEAD_S


def handoff_estimate(preset: str) -> float:
    shape, S = get_preset(preset), HANDOFF["prompt_len"]
    config = BenchConfig(quant_codecs=[HANDOFF["quant"]], joint_codecs=[HANDOFF["joint"]],
                         sequential_codecs=[])
    cases = [c for c in handoff_cases(shape.num_layers, config) if c.action.split < S]
    rounds = HANDOFF["warmups"] + HANDOFF["runs"]
    total = START_S + 5 * compute_s(shape, S)  # the prefill, and compute_all's warm-up + 3
    for link in HANDOFF["links"]:
        gbps = _gbps(link, shape, S)
        total += rounds * sum(handoff_s(c.action, shape, S, gbps) for c in cases)
    return total


def ttft_estimate() -> float:
    """Every case runs its prefill (up to its cut, or whole) and then its handoff."""
    shape, S = get_preset(TTFT["model"]), TTFT["prompt_len"]
    config = TtftConfig(cuts=TTFT["cuts"], codecs=["int8"], chunk_tokens=TTFT["chunk_tokens"])
    cases = ttft_cases(shape.num_layers, config)
    rounds = TTFT["warmups"] + TTFT["runs"]
    total = START_S + 5 * compute_s(shape, S)
    for link in TTFT["links"]:
        gbps = _gbps(link, shape, S)
        for case in cases:
            action = case.action or Action.token_only(shape.num_layers)
            total += rounds * (compute_s(shape, S, action.cut) + handoff_s(action, shape, S, gbps))
    return total


GUESSED = {"env": 5.0, "cuda_tests": 40.0, "kernels": 30.0, "services": 45.0, "executor": 35.0,
           "batched": 25.0, "batched_invariant": 20.0, "codecs": 30.0}


def _limit(estimate: float, floor: int) -> int:
    return max(floor, int(estimate * LIMIT_OVER_ESTIMATE + 0.999))


def steps(dry_run: bool = False) -> list[Step]:
    """The run's steps in order; `dry_run`: the same steps at the CPU's tiny sizes (one Table 1
    step, on the small preset `DRY_PRESET`), with the device's estimates and limits."""
    def one(name, args, dry_args, estimate, floor):
        return Step(name, dry_args if dry_run else args, estimate, _limit(estimate, floor))

    plan = [one("env", [], [], GUESSED["env"], 20),
            one("cuda_tests", [], [], GUESSED["cuda_tests"], 60)]
    for preset in (DRY_PRESET,) if dry_run else SEED_PRESETS:
        plan.append(one(
            f"handoff_{preset}",
            ["--model", f"synthetic:{preset}", "--prompt-len", str(HANDOFF["prompt_len"]),
             "--link-gbps", ",".join(HANDOFF["links"]), "--quant-codecs", HANDOFF["quant"],
             "--joint-codecs", HANDOFF["joint"], "--warmups", str(HANDOFF["warmups"]),
             "--runs", str(HANDOFF["runs"])],
            ["--model", f"synthetic:{preset}", "--prompt-len", "64", "--link-gbps", "1,x1",
             "--cuts", "10,20", "--quant-codecs", HANDOFF["quant"], "--joint-codecs",
             HANDOFF["joint"], "--warmups", "0", "--runs", "1"],
            handoff_estimate(SEED_PRESETS[0] if dry_run else preset), 45))
    big = ["--model", "synthetic:qwen2.5-7b", "--contexts", "1024,8192"]
    plan += [
        one("kernels", [], ["--dry-run"], GUESSED["kernels"], 45),
        one("services", [], ["--dry-run"], GUESSED["services"], 60),
        one("executor", [*big, "--prompt-len", "8192"], ["--dry-run"], GUESSED["executor"], 45),
        one("batched", [*big, "--batches", "1,4,16,64"], ["--dry-run"], GUESSED["batched"], 40),
        one("batched_invariant", [*big, "--batches", "1,4,16,64"], ["--dry-run"],
            GUESSED["batched_invariant"], 30),
        one("codecs", ["--prompt-len", "8192", *(a for p in SEED_PRESETS for a in ("--model", p)),
                       "--repeats", "10"],
            ["--prompt-len", "128", "--model", DRY_PRESET, "--repeats", "2", "--real-tokens",
             "128", "--real-windows", "1", "--real-calibration", "1"], GUESSED["codecs"], 45),
        one("ttft", ["--model", f"synthetic:{TTFT['model']}", "--prompt-len",
                     str(TTFT["prompt_len"]), "--link-gbps", ",".join(TTFT["links"]), "--cuts",
                     ",".join(map(str, TTFT["cuts"])), "--chunk-tokens",
                     str(TTFT["chunk_tokens"]), "--warmups", str(TTFT["warmups"]), "--runs",
                     str(TTFT["runs"])],
            ["--model", f"synthetic:{DRY_PRESET}", "--prompt-len", "64", "--link-gbps", "x1",
             "--cuts", "15", "--warmups", "0", "--runs", "1"], ttft_estimate(), 60)]
    return plan


def fits(plan: list[Step]) -> bool:
    return total_s(plan) <= SLACK * BUDGET_S


def total_s(plan: list[Step]) -> float:
    return INSTALL_S + sum(s.estimate_s for s in plan) + SUMMARY_S


def shell_name(step: str) -> str:
    return step.replace(".", "_").replace("-", "_")


def shell(plan: list[Step]) -> str:
    """Bash for run.sh: BUDGET (its env BUDGET_S wins) and RESERVE seconds, STEPS (names in
    order), ARGS_<name> arrays and LIMIT_<name> seconds, with `shell_name`'s spelling of each
    name."""
    lines = [f"BUDGET=${{BUDGET_S:-{BUDGET_S}}}", f"RESERVE={SUMMARY_S}",
             f"STEPS=({' '.join(s.name for s in plan)})"]
    for step in plan:
        lines.append(f"ARGS_{shell_name(step.name)}=({' '.join(map(shlex.quote, step.args))})")
        lines.append(f"LIMIT_{shell_name(step.name)}={step.limit_s}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=("plan", "shell"), default="plan")
    parser.add_argument("--dry-run", action="store_true", help="shell: the CPU dry run's sizes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.what == "shell":
        print(shell(steps(args.dry_run)))
        return 0
    plan = steps()
    ok = fits(plan)
    if args.json:
        print(json.dumps({"budget_s": BUDGET_S, "total_s": round(total_s(plan), 1), "fits": ok,
                          "prefill_tflops": PREFILL_TFLOPS,
                          "steps": [{"name": s.name, "estimate_s": round(s.estimate_s, 1),
                                     "limit_s": s.limit_s, "guessed": s.name in GUESSED,
                                     "args": s.args} for s in plan]}, indent=1))
    else:
        for s in plan:
            print(f"{s.name:24s} ~{s.estimate_s:6.1f} s  (limit {s.limit_s:4d} s"
                  f"{', guessed' if s.name in GUESSED else ''})")
        print(f"{'with install and summary':24s} ~{total_s(plan):6.1f} s of "
              f"{SLACK:g} x {BUDGET_S}: "
              f"{'fits' if ok else 'DOES NOT FIT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
