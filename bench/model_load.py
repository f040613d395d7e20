"""What a process start pays to get the embedded model ready, with and without the model cache.

    python bench/model_load.py [--rounds 5] [--dtype bfloat16] \
        [--json bench/results/model-load-cpu.json]

Each sample is a new Python process, as a service start is, that imports torch and rekv, loads
the embedded model's weights (`load_weights`) and its tokenizer (`load_tokenizer`) and reports
each step's seconds; the parent also times the whole process. Cases:

- import: the imports alone, the floor of any start;
- convert: an empty model cache (`REKV_MODEL_CACHE`, a new directory each time): the GGUF file is
  parsed and dequantized, and the entries are written (what the first start on a machine pays);
- cached: the entries the convert case wrote: every later start.

Each round runs every case once, in order on even rounds and in reverse on odd ones, so drift in
the machine spreads over the cases. Reported: the median of each step and of the whole process,
and the cached start over the convert one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import json, sys, time
started = time.perf_counter()
import torch
from rekv_core.model import load_weights
from rekv_core.model.tokenizer import load_tokenizer
imported = time.perf_counter()
if sys.argv[1] != "import":
    load_weights("smollm2-135m", getattr(torch, sys.argv[2]))
    weights = time.perf_counter()
    load_tokenizer("smollm2-135m")
    done = time.perf_counter()
else:
    weights = done = imported
print(json.dumps({"import_s": imported - started, "weights_s": weights - imported,
                  "tokenizer_s": done - weights}))
"""
CASES = ("import", "convert", "cached")


def sample(case: str, dtype: str, cache: Path) -> dict:
    env = {**os.environ, "REKV_MODEL_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, case, dtype], env=env,
                          capture_output=True, text=True, check=True, timeout=600)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return {**figures, "process_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    import torch

    from rekv_cli.bench.machine import machine_info
    from rekv_cli.bench.provenance import provenance

    started = provenance()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("rounds: must be >= 1")
    samples: dict[str, list[dict]] = {case: [] for case in CASES}
    warm = Path(tempfile.mkdtemp(prefix="rekv-model-load-"))
    try:
        sample("cached", args.dtype, warm)  # fills the warm cache; untimed
        for round_ in range(args.rounds):
            for case in (CASES if round_ % 2 == 0 else tuple(reversed(CASES))):
                cold = Path(tempfile.mkdtemp(prefix="rekv-model-load-cold-"))
                try:
                    samples[case].append(sample(case, args.dtype, warm if case == "cached"
                                                else cold))
                finally:
                    shutil.rmtree(cold, ignore_errors=True)
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    medians = {case: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
               for case, runs in samples.items()}
    print(f"embedded model ready in a new process, {args.dtype}, median of {args.rounds}:")
    print(f"{'case':<8} {'import s':>9} {'weights s':>10} {'tokenizer s':>12} {'process s':>10}")
    for case, m in medians.items():
        print(f"{case:<8} {m['import_s']:>9.2f} {m['weights_s']:>10.2f} {m['tokenizer_s']:>12.2f} "
              f"{m['process_s']:>10.2f}")
    ratio = medians["convert"]["process_s"] / medians["cached"]["process_s"]
    beyond = (medians["cached"]["process_s"] - medians["import"]["process_s"])
    print(f"cached start: {ratio:.1f}x faster than converting; {beyond:.2f} s beyond the imports")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": {**machine_info(torch.device("cpu"), getattr(torch, args.dtype),
                                       torch.get_num_threads()), **started},
            "command": "python bench/model_load.py " + " ".join(argv or sys.argv[1:]),
            "rounds": args.rounds, "medians": medians, "samples": samples,
            "convert_over_cached": ratio, "cached_beyond_imports_s": beyond}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
