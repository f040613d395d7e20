"""Every Triton kernel against its PyTorch reference, at the sizes a GPU serves, and the rate of
the seal's device MAC.

    python bench/gpu/kernels_check.py [--device cuda] [--dry-run] [--json FILE]

For each K/V shape `[n_kv, S, d_h]` (the presets' layer shapes at 1 to 8,192 tokens; `--dry-run`:
a few small ones, for the CPU under TRITON_INTERPRET=1) and each of INT8 and INT4: the Triton
quantizer's codes and scales equal the reference's byte for byte, and the Triton dequantizer's
output equals the reference's bit for bit, both run on the same device from the same input; the
Triton `wsum64` checksum and `poly61` MAC hash equal the references' on the code buffers and on
the raw BF16 bytes (whole, at an odd offset, with a ragged end); and
each of `int4h`, `spectrum30`, `spectrum50` and `splitzip` encodes to the same buffers and meta,
and decodes to the same K and V, through its Triton kernels as through its reference. The
reference runs on the same device as the kernel (torch ops), so the check is of the kernels, not of
two devices' arithmetic. Exits 1 on the first mismatch class found (after checking everything),
naming each failing case; `--json` writes every case.

The MAC's rate (`mac_rate` in the JSON): for each buffer size (64 MiB to 1 GiB; `--dry-run`: 64
KiB), the median over `RATE_ROUNDS` rounds of `poly61_triton_many` on one buffer (launches and
the host's read of the value included, as the seal pays them) and of a device copy of the same
bytes, alternating, in GB/s of the buffer; the goal is >= 1 TB/s on an H200 (issue 28).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rekv_cli.bench.provenance import provenance  # noqa: E402
from rekv_cli.util import write_json  # noqa: E402
from rekv_core.codecs import (EncodeContext, HadamardInt4Codec, SpectrumCodec,  # noqa: E402
                              SplitZipCodec)
from rekv_core.kernels.checksum_reference import wsum64_reference  # noqa: E402
from rekv_core.kernels.checksum_triton import wsum64_triton  # noqa: E402
from rekv_core.kernels.groupwise_reference import (dequantize_reference,  # noqa: E402
                                                   quantize_reference)
from rekv_core.kernels.groupwise_triton import dequantize_triton, quantize_triton  # noqa: E402
from rekv_core.kernels.polymac_reference import Poly61Key, poly61_reference  # noqa: E402
from rekv_core.kernels.polymac_triton import poly61_triton_many  # noqa: E402
from rekv_core.model.shapes import get_preset  # noqa: E402

# what the figures measure (`provenance`): the Triton kernels against their references,
# and the codecs over them
MEASURES = ("rekv_core/kernels", "rekv_core/codecs", "bench/gpu/kernels_check.py")

PRESETS = ("qwen2.5-7b", "qwen2.5-3b", "qwen3-8b")
LENGTHS = (1, 7, 64, 1000, 2048, 8192)
DRY_SHAPES = ((1, 1, 64), (2, 5, 64), (3, 33, 128))
MAC_KEY = Poly61Key(0x1234_5678_9ABC_DEF)
RATE_MIB, DRY_RATE_MIB = (64, 256, 1024), (1 / 16,)
RATE_ROUNDS = 9
MAC_GOAL_GBPS = 1000.0


def shapes(dry_run: bool) -> list[tuple[int, int, int]]:
    if dry_run:
        return list(DRY_SHAPES)
    found = []
    for preset in PRESETS:
        shape = get_preset(preset)
        found += [(shape.num_kv_heads, s, shape.head_dim) for s in LENGTHS]
    return sorted(set(found))


def check_shape(kv_shape: tuple[int, int, int], device: torch.device, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(kv_shape, generator=generator) * 3).to(device, torch.bfloat16)
    x.view(-1)[:: 97] = 0  # zeros and a zero group exercise the zero-scale path
    x[0, 0, :64] = 0
    cases = []
    for bits in (8, 4):
        codes, scales = quantize_triton(x, bits)
        ref_codes, ref_scales = quantize_reference(x, bits)
        out = dequantize_triton(codes, scales, bits, kv_shape, torch.bfloat16)
        ref_out = dequantize_reference(ref_codes, ref_scales, bits, kv_shape, torch.bfloat16)
        cases.append({
            "shape": list(kv_shape), "bits": bits,
            "codes_equal": bool(torch.equal(codes, ref_codes)),
            "scales_equal": bool(torch.equal(scales.view(torch.int16),
                                              ref_scales.view(torch.int16))),
            "dequantized_equal": bool(torch.equal(out.view(torch.int16),
                                                  ref_out.view(torch.int16))),
            "wsum64_codes_equal": wsum64_triton(codes) == wsum64_reference(codes),
            "poly61_codes_equal": (poly61_triton_many([codes], MAC_KEY)
                                   == [poly61_reference(codes, MAC_KEY)]),
        })
    raw = x.reshape(-1).view(torch.uint8)
    # aligned words, then the byte path: an odd start, a ragged end, both
    for label, part in (("", raw), ("_offset", raw[1:]), ("_tail", raw[:-3]),
                        ("_both", raw[1:-2])):
        if part.numel():
            cases.append({"shape": list(kv_shape), "bits": 16, "slice": label or "whole",
                          f"wsum64_raw{label}_equal":
                          wsum64_triton(part) == wsum64_reference(part),
                          f"poly61_raw{label}_equal": (poly61_triton_many([part], MAC_KEY)
                                                       == [poly61_reference(part, MAC_KEY)])})
    return cases + check_codecs(x, kv_shape, generator)


def check_codecs(x: torch.Tensor, kv_shape: tuple[int, int, int], generator: torch.Generator
                 ) -> list[dict]:
    """Issue 16's codecs, each whole: the Triton backend's encoded buffers and header meta equal
    the reference backend's byte for byte, and so do the decoded K and V."""
    v = (torch.randn(kv_shape, generator=generator) * 0.5).to(x.device, torch.bfloat16)
    importance = torch.rand(kv_shape[1], generator=generator).to(x.device)
    cases = []
    for name, build in (("int4h", lambda backend: HadamardInt4Codec(backend=backend)),
                        ("spectrum30", lambda backend: SpectrumCodec(0.3, backend=backend)),
                        ("spectrum50", lambda backend: SpectrumCodec(0.5, backend=backend)),
                        ("splitzip", lambda backend: SplitZipCodec(backend=backend))):
        encoded, decoded = {}, {}
        for backend in ("triton", "torch"):
            codec = build(backend)
            encoded[backend] = codec.encode(x, v, checksums=False,
                                            context=EncodeContext(importance))
            decoded[backend] = codec.decode(encoded[backend], verify=False)
        kernel, reference = encoded["triton"], encoded["torch"]
        cases.append({
            "shape": list(kv_shape), "codec": name,
            "buffers_equal": list(kernel.buffers) == list(reference.buffers) and all(
                torch.equal(kernel.buffers[b], reference.buffers[b]) for b in kernel.buffers),
            "meta_equal": kernel.meta == reference.meta,
            "decoded_equal": all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                 for a, b in zip(decoded["triton"], decoded["torch"])),
        })
    return cases


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def mac_rate(device: torch.device, dry_run: bool) -> list[dict]:
    """The poly61 kernel's GB/s beside a device copy's, per buffer size (module doc)."""
    rows = []
    for mib in DRY_RATE_MIB if dry_run else RATE_MIB:
        size = int(mib * (1 << 20))
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        cases = {"poly61": lambda: poly61_triton_many([src], MAC_KEY),
                 "copy": lambda: dst.copy_(src)}
        for fn in cases.values():
            fn()  # compiles the kernel, warms the allocator
        seconds = {name: [] for name in cases}
        for round_ in range(RATE_ROUNDS):
            for name in list(cases) if round_ % 2 == 0 else list(cases)[::-1]:
                seconds[name].append(_timed(cases[name], device))
        median = {name: statistics.median(s) for name, s in seconds.items()}
        rows.append({"size_bytes": size, "poly61_s": median["poly61"], "copy_s": median["copy"],
                     "poly61_gbps": size / median["poly61"] / 1e9,
                     "copy_gbps": size / median["copy"] / 1e9,
                     "goal_gbps": MAC_GOAL_GBPS,
                     "met": size / median["poly61"] / 1e9 >= MAC_GOAL_GBPS})
    return rows


def main(argv: list[str] | None = None) -> int:
    code = provenance(measures=MEASURES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true", help="small shapes (CPU interpreter)")
    parser.add_argument("--json", metavar="FILE", help="also write every case as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    cases = []
    for n, kv_shape in enumerate(shapes(args.dry_run)):
        cases += check_shape(kv_shape, device, seed=n)
    failed = [c for c in cases if not all(v for k, v in c.items() if k.endswith("_equal"))]
    for case in failed:
        print(f"MISMATCH {case}")
    print(f"kernels_check: {len(cases) - len(failed)}/{len(cases)} cases equal on {device} "
          f"in {time.perf_counter() - started:.1f} s")

    def result(rates, complete):  # written before the MAC's rates too: a cut-short step keeps it
        return {"meta": code, "device": str(device), "dry_run": args.dry_run, "cases": cases,
                "failed": len(failed), "mac_rate": rates, "complete": complete}

    write_json(args.json, result([], False), indent=1)
    rates = mac_rate(device, args.dry_run)
    for row in rates:
        print(f"poly61 MAC, {row['size_bytes'] >> 10} KiB: {row['poly61_gbps']:,.1f} GB/s, "
              f"device copy {row['copy_gbps']:,.1f} GB/s (goal {MAC_GOAL_GBPS:g})")
    write_json(args.json, result(rates, True), indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
