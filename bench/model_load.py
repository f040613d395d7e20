"""What a process start pays to get the embedded model ready, with and without the model cache,
and what its fingerprint costs.

    python bench/model_load.py [--rounds 5] [--dtype bfloat16] \
        [--json bench/results/model-load-cpu.json]

Each sample is a new Python process, as a service start is, that imports torch and rekv, loads
the embedded model's weights (`load_weights`) and its tokenizer (`load_tokenizer`), takes the
model fingerprint the services take at start (`handoff.fingerprint.model_fingerprint`) and
reports each step's seconds; the parent also times the whole process. Cases:

- import: the imports alone, the floor of any start;
- convert: an empty model cache (`REKV_MODEL_CACHE`, a new directory each time): the GGUF file is
  parsed and dequantized, the weights' digest taken, and the entries written (what the first start
  on a machine pays);
- cached: the entries the convert case wrote: every later start, which reads the digest back.

Beside the steps, each loading sample hashes the weights once more (`digest_s`: what the first
start's digest costs, inside its `weights_s`), against the ceiling of copying the same bytes
once in memory on one core, as the hash runs (`copy_s`: into a buffer already touched, so no page
is faulted in).

Each round runs every case once, in order on even rounds and in reverse on odd ones, so drift in
the machine spreads over the cases. Reported: the median of each step and of the whole process,
the cached start over the convert one, and the digest's rate beside the copy rate.
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
# what the figures measure (`provenance`): loading the model, its digest and fingerprint
MEASURES = ("rekv_core/model", "rekv_core/handoff/fingerprint.py", "bench/model_load.py")

CHILD = """
import json, sys, time
started = time.perf_counter()
import torch
from rekv_core.handoff.fingerprint import model_fingerprint
from rekv_core.model import load_weights
from rekv_core.model.digest import weights_digest
from rekv_core.model.tokenizer import load_tokenizer
from rekv_core.model.weights_entry import canonical_tensors
imported = time.perf_counter()
figures = {"import_s": imported - started}
if sys.argv[1] != "import":
    loaded = load_weights("smollm2-135m", getattr(torch, sys.argv[2]))
    weights = time.perf_counter()
    tokenizer = load_tokenizer("smollm2-135m")
    done = time.perf_counter()
    model_fingerprint(loaded, tokenizer)
    printed = time.perf_counter()
    weights_digest(loaded)
    digested = time.perf_counter()
    tensors = list({t.data_ptr(): t for t in canonical_tensors(loaded).values()}.values())
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    into = torch.zeros(sum(f.numel() for f in flat), dtype=torch.uint8)  # touched: no faults
    torch.set_num_threads(1)  # as the hash runs: one core
    copying = time.perf_counter()
    torch.cat(flat, out=into)
    copied = time.perf_counter()
    figures.update(weights_s=weights - imported, tokenizer_s=done - weights,
                   fingerprint_s=printed - done, digest_s=digested - printed,
                   copy_s=copied - copying, bytes=sum(t.nbytes for t in tensors))
print(json.dumps(figures))
"""
STEPS = ("import_s", "weights_s", "tokenizer_s", "fingerprint_s", "digest_s", "copy_s",
         "process_s")
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

    started = provenance(measures=MEASURES)
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
    medians = {case: {key: statistics.median(s.get(key, 0.0) for s in runs) for key in STEPS}
               for case, runs in samples.items()}
    print(f"embedded model ready in a new process, {args.dtype}, median of {args.rounds}:")
    print(f"{'case':<8}" + "".join(f"{step.removesuffix('_s') + ' s':>14}" for step in STEPS))
    for case, m in medians.items():
        print(f"{case:<8}" + "".join(f"{m[step]:>14.3f}" for step in STEPS))
    ratio = medians["convert"]["process_s"] / medians["cached"]["process_s"]
    beyond = (medians["cached"]["process_s"] - medians["import"]["process_s"])
    print(f"cached start: {ratio:.1f}x faster than converting; {beyond:.2f} s beyond the imports")
    nbytes = samples["cached"][0]["bytes"]
    digest_s = statistics.median(s["digest_s"] for c in ("convert", "cached")
                                 for s in samples[c])
    copy_s = statistics.median(s["copy_s"] for c in ("convert", "cached") for s in samples[c])
    print(f"weights digest: {nbytes / 1e6:.0f} MB in {digest_s:.3f} s "
          f"({nbytes / digest_s / 1e9:.2f} GB/s; one in-memory copy "
          f"{nbytes / copy_s / 1e9:.2f} GB/s, {digest_s / copy_s:.1f}x "
          f"its time); a cached start reads it back: fingerprint "
          f"{medians['cached']['fingerprint_s']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": {**machine_info(torch.device("cpu"), getattr(torch, args.dtype),
                                       torch.get_num_threads()), **started},
            "command": "python bench/model_load.py " + " ".join(argv or sys.argv[1:]),
            "rounds": args.rounds, "medians": medians, "samples": samples,
            "convert_over_cached": ratio, "cached_beyond_imports_s": beyond,
            "weights_bytes": nbytes, "digest_s": digest_s, "copy_s": copy_s,
            "digest_over_copy": digest_s / copy_s}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
