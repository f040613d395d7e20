"""The decode engine's batched step against its memory floor: tokens/s at batch 1..64 (issue 29).

    python bench/batched_decode.py [--model synthetic:qwen2.5-7b] [--device cuda]
                                   [--contexts 1024,8192] [--batches 1,4,16,64] [--steps 16]
                                   [--repeats 3] [--json FILE]
    python bench/batched_decode.py --dry-run   # tiny sizes, any device, seconds

For each context C and batch B: B caches of random values filled to C (as bench/executor.py's
decode rows: a step's cost does not depend on the values), then --repeats times --steps
consecutive batched steps of all B streams from C (the engine's: `engine_step`, on the CPU with
prepacked weights and subnormals flushed, unless --no-pack; on CUDA the bucketed slab with a CUDA
graph per batch bucket; --invariant: each row its lone kernels), each timed alone (device
synchronized), after one untimed warm-up step. Reported: the median step, tokens/s (B / step), and
the floor: one step reads every layer's weights once for the whole batch and each stream's K and V
(`executor.weight_read_bytes` + B × `executor.kv_read_bytes`) at the copy rate measured in the same
run; the ratio to it, and the speed-up over B = 1 against the ideal B×.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.executor import (bandwidth_ceilings, kv_read_bytes, random_cache,  # noqa: E402
                            weight_read_bytes)
from rekv_cli.bench.machine import cpu_model, machine_info  # noqa: E402
from rekv_cli.bench.provenance import provenance  # noqa: E402
from rekv_cli.util import write_json  # noqa: E402
from rekv_core.model import Model, load_weights  # noqa: E402
from rekv_core.engine import engine_step, prepare_engine_thread  # noqa: E402
from rekv_core.model.batched import batched_decode_step  # noqa: E402
from rekv_core.timing import synchronize  # noqa: E402

# what the figures measure (`provenance`): the batched step alone, ceilings from executor.py
MEASURES = ("rekv_core/model", "rekv_core/engine", "rekv_core/kernels", "rekv_core/timing.py",
            "bench/batched_decode.py", "bench/executor.py")

DRY_RUN = {"model": "synthetic:smollm2-135m", "contexts": "64,256", "batches": "1,2,4",
           "steps": 4, "repeats": 2}
DEFAULTS = {"model": "synthetic:qwen2.5-7b", "contexts": "1024,8192", "batches": "1,4,16,64",
            "steps": 16, "repeats": 3}


def time_batch(model: Model, step, context: int, batch: int, steps: int, repeats: int,
               copy_gbps: float) -> dict:
    caches = [random_cache(model, context, steps + 1) for _ in range(batch)]
    vocab, device = model.shape.vocab_size, model.device

    def run(n: int) -> list[float]:
        for cache in caches:
            cache.length = context
        times = []
        for i in range(n):
            tokens = [(i * 7919 + 13 * b) % vocab for b in range(batch)]
            synchronize(device)
            began = time.perf_counter()
            step(model, tokens, caches)
            synchronize(device)
            times.append(time.perf_counter() - began)
        return times

    run(1)  # warm-up
    samples = [t for _ in range(repeats) for t in run(steps)]
    median_ms = statistics.median(samples) * 1e3
    read = weight_read_bytes(model) + batch * kv_read_bytes(model.shape, context,
                                                            model.dtype.itemsize)
    floor_ms = read / (copy_gbps * 1e9) * 1e3
    return {"context": context, "batch": batch, "median_ms": median_ms,
            "min_ms": min(samples) * 1e3, "tokens_per_s": batch * 1e3 / median_ms,
            "read_bytes": read, "floor_ms": floor_ms, "ratio_to_floor": median_ms / floor_ms}


def choose_step(model: Model, args: argparse.Namespace):
    """The engine's step (`engine_step`: on CUDA the bucketed slab with CUDA graphs; with
    --invariant each row its lone kernels, the services' `--batch-invariant`), or with --no-pack
    the plain batched step."""
    if args.no_pack:
        return batched_decode_step
    capacity = max(args.contexts) + args.steps + 1
    return engine_step(model, max(args.batches), capacity, invariant=args.invariant)


def run(args: argparse.Namespace, on_progress: Callable[[dict], None] | None = None) -> dict:
    """The whole bench; `on_progress` gets the result so far (`complete` False) after each
    context's batches, so a run stopped early keeps what it finished."""
    started = provenance(measures=MEASURES)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = Model(load_weights(args.model, dtype, device))
    ceilings = bandwidth_ceilings(device, args.repeats)
    step = choose_step(model, args)
    if not args.no_pack:
        prepare_engine_thread(model)  # as the engine's thread does
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            rows.append(time_batch(model, step, context, batch, args.steps, args.repeats,
                                   ceilings["copy_gbps"]))
        block = rows[-len(args.batches):]
        single = block[0]  # the smallest batch (1 unless left out)
        for r in block:
            r["speedup"] = r["tokens_per_s"] / single["tokens_per_s"]
            r["ideal_speedup"] = r["batch"] / single["batch"]
        if on_progress is not None:
            on_progress(_result(args, started, device, dtype, step, ceilings, rows, False))
    return _result(args, started, device, dtype, step, ceilings, rows, True)


def _result(args, started, device, dtype, step, ceilings, rows, complete: bool) -> dict:
    meta = {**started, "command": " ".join(["python", *sys.argv]), "model": args.model,
            "machine": machine_info(device, dtype, torch.get_num_threads()),
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else cpu_model()),
            "dtype": args.dtype, "steps": args.steps, "repeats": args.repeats,
            "dry_run": args.dry_run, "threads": torch.get_num_threads(),
            "packed_weights": step is not batched_decode_step, "invariant": args.invariant,
            "step": type(step).__name__ if not isinstance(step, functools.partial)
            else step.func.__name__}
    return {"meta": meta, "ceilings": ceilings, "rows": rows, "complete": complete}


def print_table(result: dict) -> None:
    m = result["meta"]
    print(f"{m['model']} on {m['device_name']} ({m['dtype']}), commit "
          f"{(m['commit'] or 'unknown')[:12]}; copy {result['ceilings']['copy_gbps']:.1f} GB/s")
    print(f"{'context':>8} {'batch':>6} {'ms/step':>9} {'tok/s':>9} {'x B=1':>7} {'ideal':>6} "
          f"{'floor ms':>9} {'x floor':>8}")
    for r in result["rows"]:
        print(f"{r['context']:8d} {r['batch']:6d} {r['median_ms']:9.3f} {r['tokens_per_s']:9.1f} "
              f"{r['speedup']:7.2f} {r['ideal_speedup']:6.0f} {r['floor_ms']:9.3f} "
              f"{r['ratio_to_floor']:8.2f}")


def _ints(parser: argparse.ArgumentParser, name: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--{name}: expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"--{name}: need one or more positive integers")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--model", help=f"a load_weights source (default {DEFAULTS['model']})")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="default bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--contexts", help="contexts, comma-separated (default 1024,8192)")
    parser.add_argument("--batches", help="batch sizes, comma-separated (default 1,4,16,64)")
    parser.add_argument("--steps", type=int, help="steps timed per run (default 16)")
    parser.add_argument("--repeats", type=int, help="timed runs (default 3)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--invariant", action="store_true",
                        help="each row through the single-stream kernels (--batch-invariant)")
    parser.add_argument("--no-pack", action="store_true",
                        help="the step without prepacked CPU weights (model.packed)")
    parser.add_argument("--dry-run", action="store_true", help=f"tiny sizes: {DRY_RUN}")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    for key, value in (DRY_RUN if args.dry_run else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.contexts = _ints(parser, "contexts", args.contexts)
    args.batches = sorted(set(_ints(parser, "batches", args.batches)))
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args, on_progress=lambda partial: write_json(args.json, partial))
    print_table(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
