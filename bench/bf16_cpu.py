"""BF16 prefill on this CPU through its native BF16 GEMM and through float32 blocks
(`rekv_core.model.blocks.BF16_VIA_FLOAT32`), beside float32: what the rule costs or saves here.

    python bench/bf16_cpu.py [--model smollm2-135m] [--prompt-len 256,1024] [--repeats 5]
                             [--threads 2] [--json FILE] [--markdown FILE]

Cases, for each S in --prompt-len (random ids): `prefill` of the model in float32; in BF16 with
the block GEMM forced native (`BF16_VIA_FLOAT32 = False`: torch's BF16 kernel, emulated where the
CPU has no BF16 arithmetic); in BF16 with it forced through float32 (`True`). What this CPU would
choose by itself is reported beside (`cpu_has_native_bf16`). One untimed prefill of each case,
then --repeats rounds, each timing every case once in an order shuffled afresh; reported: the
median ms, tokens/s, and each case's median over float32's. The two BF16 cases' logits are
compared too (largest absolute difference): different roundings, not the same bits.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rekv_cli.bench.machine import machine_info  # noqa: E402
from rekv_cli.bench.provenance import provenance  # noqa: E402
from rekv_cli.util import csv_of, write_json  # noqa: E402
from rekv_core.model import Model, blocks, load_weights, prefill  # noqa: E402

MEASURES = ("rekv_core/model", "bench/bf16_cpu.py")
CASES = ("float32", "bf16-native", "bf16-via-float32")


def _models(name: str) -> dict[str, Model]:
    fp32 = Model(load_weights(name, torch.float32))
    bf16 = Model(load_weights(name, torch.bfloat16))
    return {"float32": fp32, "bf16-native": bf16, "bf16-via-float32": bf16}


def _run(case: str, model: Model, ids: list[int]):
    blocks.BF16_VIA_FLOAT32 = case == "bf16-via-float32"
    start = time.perf_counter()
    out = prefill(model, ids)
    return time.perf_counter() - start, out.logits


def measure(models: dict[str, Model], prompt_lens: list[int], repeats: int,
            seed: int = 0, clock_run=_run) -> list[dict]:
    rng = random.Random(seed)
    vocab = models["float32"].shape.vocab_size
    rows = []
    chosen = blocks.BF16_VIA_FLOAT32
    try:
        for seq_len in prompt_lens:
            ids = [rng.randrange(vocab) for _ in range(seq_len)]
            logits = {case: clock_run(case, models[case], ids)[1] for case in CASES}
            samples: dict[str, list[float]] = {case: [] for case in CASES}
            for _ in range(repeats):
                order = list(CASES)
                rng.shuffle(order)
                for case in order:
                    samples[case].append(clock_run(case, models[case], ids)[0])
            base = statistics.median(samples["float32"])
            diff = (logits["bf16-native"].float() - logits["bf16-via-float32"].float()).abs()
            for case in CASES:
                median = statistics.median(samples[case])
                rows.append({"prompt_len": seq_len, "case": case, "median_ms": median * 1e3,
                             "tokens_per_s": seq_len / median, "over_float32": median / base,
                             "samples_ms": [s * 1e3 for s in samples[case]],
                             "bf16_logits_max_abs_diff": float(diff.max())})
    finally:
        blocks.BF16_VIA_FLOAT32 = chosen
    return rows


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = ["# BF16 prefill on the CPU: native GEMM against float32 blocks",
             "",
             f"Commit {meta['commit']} (clean tree: {meta['tree_clean']}), {meta['started']}. "
             f"Command: `{meta['command']}`. Machine: {result['machine'].get('cpu')}, "
             f"{result['threads']} torch thread(s); native BF16 on this CPU: "
             f"{result['cpu_has_native_bf16']} (so the executor's own choice is "
             f"{'native' if result['cpu_has_native_bf16'] else 'via float32'}). Medians of "
             f"{result['repeats']} rounds, cases shuffled in each.",
             "",
             "| S | case | median ms | tokens/s | over float32 |",
             "| --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        lines.append(f"| {row['prompt_len']} | {row['case']} | {row['median_ms']:.0f} | "
                     f"{row['tokens_per_s']:.0f} | {row['over_float32']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-len", type=csv_of(int), default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: must be >= 1")
    if not args.prompt_len or any(s < 1 for s in args.prompt_len):
        parser.error("--prompt-len: lengths >= 1, comma-separated")
    torch.set_num_threads(args.threads)
    meta = provenance(measures=MEASURES)
    meta["command"] = "python bench/bf16_cpu.py " + " ".join(argv if argv is not None
                                                              else sys.argv[1:])
    rows = measure(_models(args.model), args.prompt_len, args.repeats)
    machine = machine_info(torch.device("cpu"), torch.bfloat16, args.threads)
    result = {"meta": meta, "machine": machine, "threads": args.threads,
              "repeats": args.repeats, "model": args.model,
              "cpu_has_native_bf16": blocks.cpu_has_native_bf16(), "rows": rows}
    for row in rows:
        print(f"S={row['prompt_len']:>5} {row['case']:<17} {row['median_ms']:9.1f} ms "
              f"{row['over_float32']:5.2f}x float32")
    write_json(args.json_path, result)
    if args.markdown:
        Path(args.markdown).write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
