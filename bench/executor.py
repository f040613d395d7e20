"""The executor's prefill and decode-step speed against ceilings measured on the same machine in
the same run (issue 12: prefill at >= 75% of the matmul rate, a decode step within 2x of its
memory floor, on an H200).

    python bench/executor.py [--model synthetic:qwen2.5-7b] [--device cuda] [--dtype bfloat16]
                             [--prompt-len 8192] [--contexts 1024,8192] [--steps 32] [--repeats 5]
                             [--matmul-n 8192] [--threads N] [--json FILE]
    python bench/executor.py --dry-run [--device cpu]   # tiny sizes, any device, seconds

Ceilings, each the median of --repeats timed runs after warm-ups:

- matmul: an N x N by N x N matmul in the run's dtype (N = --matmul-n); TFLOP/s = 2N^3 / time.
- copy: `copy_` between two preallocated buffers (256 MiB on CUDA, 64 MiB on the CPU), bytes per
  second counting each byte once (bench/codecs.py's definition; on CUDA one timed sample is 8
  copies, so synchronizing does not lower a 0.1 ms copy's apparent rate).
- read: `sum` over the same buffer as float32, bytes read per second. A copy moves every byte
  twice (read, write), so a read-only pass may run up to ~2x faster than the copy rate: the floor
  against the copy rate (the issue's) is the lenient one, the floor against the read rate the
  strict one; a ratio below 1 is possible against the first.

Prefill: `run_layers(model, embed(model, ids), start=0)` over all L layers at S = --prompt-len
random ids, median of --repeats after one warm-up (`prefill_flops` has the count); TFLOP/s and
its fraction of the measured matmul rate.

Decode: for each context C in --contexts (clipped so that C + steps <= the model's max_positions),
a KVCache of capacity C + steps whose first C positions hold random values (not a prefill: on a
CPU an 8K prefill would dominate the run; a step's cost does not depend on the values), then
--repeats times, from C, --steps consecutive steps, each timed alone (device synchronized):
`eager` = `decode_step`; `static` = `StaticDecoder(graph=False)`; on CUDA `graph` = the
`StaticDecoder` with a CUDA graph, whose first call (warm-ups + capture + one replay) is reported
apart as capture_ms and excluded from the median. Each mode gets one untimed warm-up step first.
Floor = `decode_read_bytes` / bandwidth: every layer's weights once (counted per layer even when
`synthetic:` layers share one tensor set, as a real checkpoint's would not), the final norm, one
embedding row, the whole LM head, and K and V of C positions in every layer.

Caveat: with `synthetic:` weights all layers share one tensor set, so a small model's layer may
stay in a cache (CPU L2/L3, GPU L2) and beat the floor; the 7B presets' layers (~0.5 GB) do not.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rekv_cli.bench.machine import cpu_model, machine_info  # noqa: E402
from rekv_cli.bench.provenance import provenance  # noqa: E402
from rekv_cli.util import write_json  # noqa: E402
from rekv_core.model import KVCache, Model, ModelShape, decode_step, load_weights  # noqa: E402
from rekv_core.model.executor import embed, run_layers  # noqa: E402
from rekv_core.model.static_decode import StaticDecoder  # noqa: E402
from rekv_core.timing import median_seconds, synchronize  # noqa: E402

# what the figures measure (`provenance`): the executor's prefill and decode step
MEASURES = ("rekv_core/model", "rekv_core/timing.py", "bench/executor.py")

WARMUPS = 2
DRY_RUN = {"model": "synthetic:smollm2-135m", "prompt_len": 256, "contexts": "128,512",
           "steps": 8, "repeats": 3, "matmul_n": 512}
DEFAULTS = {"model": "synthetic:qwen2.5-7b", "prompt_len": 8192, "contexts": "1024,8192",
            "steps": 32, "repeats": 5, "matmul_n": None}  # matmul_n: 8192 on CUDA, 1024 on CPU
LAYER_TENSORS = ("attn_norm", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "mlp_norm", "w_gate_up",
                 "w_down")  # what a layer reads once its projections are fused (`Model`)


# ------------------------------------------------------------------------------ analytic counts

def prefill_flops(shape: ModelShape, seq_len: int) -> int:
    """FLOPs of a prefill of S = `seq_len` positions, multiply-add = 2 FLOPs, per layer:

        QKV   2·S·d·(q + 2·kv)           q = n_h·d_h, kv = n_kv·d_h (one fused GEMM)
        O     2·S·q·d
        MLP   2·S·d·2·ffn + 2·S·ffn·d    (fused gate/up GEMM, then down)
        attn  2·2·S²·n_h·d_h / 2         QKᵀ and PV, causal: half of each is assumed computed

    times L, plus the LM head of the last position, 2·d·vocab. Norms, RoPE, softmax, SiLU and
    biases are left out (O(S·d), negligible next to these)."""
    s, d, q, kv, ffn = (seq_len, shape.hidden_size, shape.q_size, shape.kv_size, shape.ffn_size)
    qkv = 2 * s * d * (q + 2 * kv)
    out = 2 * s * q * d
    mlp = 2 * s * d * 2 * ffn + 2 * s * ffn * d
    attention = 2 * 2 * s * s * shape.num_heads * shape.head_dim // 2
    return shape.num_layers * (qkv + out + mlp + attention) + 2 * d * shape.vocab_size


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def weight_read_bytes(model: Model) -> int:
    """Weight bytes one decode step reads: each layer's fused tensors, counted once per layer
    (layers sharing storage count as distinct), the final norm, one embedding row, the LM head."""
    w = model.weights
    layers = sum(_nbytes(getattr(lw, name)) for lw in w.layers for name in LAYER_TENSORS)
    return layers + _nbytes(w.final_norm) + _nbytes(w.embed[0]) + _nbytes(w.lm_head)


def kv_read_bytes(shape: ModelShape, context: int, elem_bytes: int) -> int:
    """K and V of `context` positions in every layer: 2·L·n_kv·C·d_h·e."""
    return 2 * shape.num_layers * shape.num_kv_heads * context * shape.head_dim * elem_bytes


def decode_read_bytes(model: Model, context: int) -> int:
    elem = torch.empty((), dtype=model.dtype).element_size()
    return weight_read_bytes(model) + kv_read_bytes(model.shape, context, elem)


# ------------------------------------------------------------------------------------- ceilings

def matmul_ceiling(n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, dtype=dtype, device=device)
    seconds = median_seconds(lambda: torch.matmul(a, b, out=out), repeats, device, WARMUPS)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "median_ms": seconds * 1e3,
            "tflops": 2 * n ** 3 / seconds / 1e12}


def bandwidth_ceilings(device: torch.device, repeats: int) -> dict:
    """Copy and read bandwidth, GB/s, over 256 MiB (CUDA) or 64 MiB (CPU) buffers.

    Copy: as bench/codecs.py's `copy_bandwidth` (not imported: that file is a script, and this one
    needs the buffer size and the inner repetitions as parameters)."""
    size = (256 if device.type == "cuda" else 64) << 20
    inner = 8 if device.type == "cuda" else 1
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src).fill_(0)

    def copies():
        for _ in range(inner):
            dst.copy_(src)

    floats = src.view(torch.float32)

    def reads():
        for _ in range(inner):
            floats.sum()

    copy_s = median_seconds(copies, repeats, device, WARMUPS) / inner
    read_s = median_seconds(reads, repeats, device, WARMUPS) / inner
    return {"buffer_bytes": size, "copy_gbps": size / copy_s / 1e9, "copy_ms": copy_s * 1e3,
            "read_gbps": size / read_s / 1e9, "read_ms": read_s * 1e3}


# ------------------------------------------------------------------------------ executor timing

@torch.inference_mode()
def time_prefill(model: Model, seq_len: int, repeats: int, matmul_tflops: float) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.shape.vocab_size, (seq_len,), generator=g)
    seconds = median_seconds(lambda: run_layers(model, embed(model, ids), start=0), repeats,
                             model.device, warmups=1)
    flops = prefill_flops(model.shape, seq_len)
    tflops = flops / seconds / 1e12
    return {"prompt_len": seq_len, "flops": flops, "median_ms": seconds * 1e3, "tflops": tflops,
            "fraction_of_matmul": tflops / matmul_tflops}


def random_cache(model: Model, context: int, steps: int) -> KVCache:
    """A cache of capacity `context + steps` whose first `context` positions hold N(0, 1)."""
    shape = model.shape
    cache = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, context + steps,
                    model.dtype, model.device)
    g = torch.Generator(device=model.device).manual_seed(2)
    for k, v in zip(cache.keys, cache.values):
        k[:, :context].normal_(generator=g)
        v[:, :context].normal_(generator=g)
    cache.length = context
    return cache


def step_samples(step, vocab: int, cache: KVCache, context: int, steps: int, repeats: int,
                 device: torch.device) -> tuple[list[float], float]:
    """Seconds of each of `repeats` x `steps` steps (each run of `steps` starts at `context`),
    and of the first call before them (a warm-up, or a graph's capture), kept out of the list."""

    def timed(token_id: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        step((token_id * 7919 + 13) % vocab)
        synchronize(device)
        return time.perf_counter() - start

    first = timed(0)
    samples = []
    for _ in range(repeats):
        cache.length = context
        samples += [timed(i + 1) for i in range(steps)]
    return samples, first


def decode_step_fn(model: Model, cache: KVCache, mode: str):
    """token id -> logits: eager `decode_step`, or a `StaticDecoder` without or with a graph."""
    if mode == "eager":
        return lambda token_id: decode_step(model, token_id, cache)
    return StaticDecoder(model, cache, graph=mode == "graph").step


def time_decode(model: Model, context: int, steps: int, repeats: int, bandwidth: dict) -> list:
    read_bytes = decode_read_bytes(model, context)
    floor_ms = read_bytes / (bandwidth["copy_gbps"] * 1e9) * 1e3
    strict_ms = read_bytes / (bandwidth["read_gbps"] * 1e9) * 1e3
    rows = []
    for mode in ("eager", "static", "graph"):
        if mode == "graph" and model.device.type != "cuda":
            continue
        cache = random_cache(model, context, steps)
        samples, first = step_samples(decode_step_fn(model, cache, mode), model.shape.vocab_size,
                                      cache, context, steps, repeats, model.device)
        median_ms = statistics.median(samples) * 1e3
        rows.append({"context": context, "mode": mode, "steps": steps, "repeats": repeats,
                     "median_ms": median_ms, "min_ms": min(samples) * 1e3,
                     "tokens_per_s": 1e3 / median_ms, "read_bytes": read_bytes,
                     "floor_ms": floor_ms, "ratio_to_floor": median_ms / floor_ms,
                     "read_floor_ms": strict_ms, "ratio_to_read_floor": median_ms / strict_ms,
                     "capture_ms" if mode == "graph" else "first_step_ms": first * 1e3})
        del cache
    return rows


def clip_contexts(requested: list[int], steps: int, max_positions: int) -> list[int]:
    """Each context clipped to max_positions - steps, duplicates dropped, order kept."""
    limit = max_positions - steps
    if limit < 1:
        raise ValueError(f"steps: {steps} leave no context within max_positions {max_positions}")
    return list(dict.fromkeys(min(c, limit) for c in requested))


# ---------------------------------------------------------------------------------- the report

def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def meta(args: argparse.Namespace, model: Model, device: torch.device, started: dict) -> dict:
    shape = model.shape
    return {**started,
        "machine": machine_info(device, model.dtype, torch.get_num_threads()),
        "torch": torch.__version__, "triton": _version("triton"),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else cpu_model()),
        "command": " ".join(["python", *sys.argv]),
        "model": args.model, "shape": {k: v for k, v in vars(shape).items()
                                       if isinstance(v, (int, float, str, bool))},
        "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len, "steps": args.steps, "repeats": args.repeats,
        "warmups": {"ceilings": WARMUPS, "prefill": 1, "decode": 1}, "dry_run": args.dry_run,
        "threads": torch.get_num_threads(),
    }


def run(args: argparse.Namespace, on_progress: Callable[[dict], None] | None = None) -> dict:
    """The whole bench; `on_progress` gets the result so far (`complete` False) after the prefill
    and after each context, so a run stopped early keeps what it finished."""
    started = provenance(measures=MEASURES)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = Model(load_weights(args.model, dtype, device))
    contexts = clip_contexts(args.contexts, args.steps, model.shape.max_positions)
    ceilings = {"matmul": matmul_ceiling(args.matmul_n, dtype, device, args.repeats),
                **bandwidth_ceilings(device, args.repeats)}
    result = {"meta": meta(args, model, device, started) | {"contexts_requested": args.contexts,
                                                            "contexts": contexts},
              "ceilings": ceilings, "prefill": None, "decode": [], "complete": False}
    result["prefill"] = time_prefill(model, args.prompt_len, args.repeats,
                                     ceilings["matmul"]["tflops"])
    for context in contexts:
        if on_progress is not None:
            on_progress(result)
        result["decode"] += time_decode(model, context, args.steps, args.repeats, ceilings)
    result["complete"] = True
    return result


def print_table(result: dict) -> None:
    m, c, p = result["meta"], result["ceilings"], result["prefill"]
    print(f"{m['model']} on {m['device_name']} ({m['device']}, {m['dtype']}), torch {m['torch']}, "
          f"commit {(m['commit'] or 'unknown')[:12]}")
    mm = c["matmul"]
    print(f"ceilings: matmul N={mm['n']} {mm['tflops']:.2f} TFLOP/s; copy "
          f"{c['copy_gbps']:.1f} GB/s; read {c['read_gbps']:.1f} GB/s "
          f"({c['buffer_bytes'] >> 20} MiB buffers)")
    print(f"prefill S={p['prompt_len']}: {p['median_ms']:.1f} ms, {p['flops'] / 1e12:.3f} TFLOP, "
          f"{p['tflops']:.2f} TFLOP/s = {p['fraction_of_matmul']:.1%} of matmul")
    print(f"{'context':>8} {'mode':7} {'ms/step':>9} {'tok/s':>8} {'MiB read':>9} "
          f"{'floor ms':>9} {'x floor':>8} {'x read':>7} {'first/capture ms':>17}")
    for r in result["decode"]:
        first = r.get("capture_ms", r.get("first_step_ms"))
        print(f"{r['context']:8d} {r['mode']:7} {r['median_ms']:9.3f} {r['tokens_per_s']:8.1f} "
              f"{r['read_bytes'] / 2**20:9.1f} {r['floor_ms']:9.3f} {r['ratio_to_floor']:8.2f} "
              f"{r['ratio_to_read_floor']:7.2f} {first:17.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--model", help=f"a load_weights source (default {DEFAULTS['model']})")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="default bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--prompt-len", type=int, help="prefill length S (default 8192)")
    parser.add_argument("--contexts", help="decode contexts, comma-separated (default 1024,8192)")
    parser.add_argument("--steps", type=int, help="decode steps timed per run (default 32)")
    parser.add_argument("--repeats", type=int, help="timed runs (default 5)")
    parser.add_argument("--matmul-n", type=int, help="matmul size (default 8192 CUDA, 1024 CPU)")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: torch's; 1 beside another busy job)")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"tiny sizes unless given: {DRY_RUN}")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    for key, value in (DRY_RUN if args.dry_run else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.matmul_n = args.matmul_n or (8192 if on_cuda else 1024)
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    try:
        args.contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--contexts: expected comma-separated integers, got {args.contexts!r}")
    for name in ("prompt_len", "steps", "repeats", "matmul_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be positive")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads: must be positive")
    if not args.contexts or min(args.contexts) < 1:
        parser.error("--contexts: need one or more positive lengths")
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
