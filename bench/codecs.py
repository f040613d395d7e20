"""Encode/decode throughput of every codec, in GB/s of BF16 input, beside this machine's measured
memory-copy bandwidth.

    python bench/codecs.py [--prompt-len 8192] [--model smollm2-135m --model qwen2.5-7b]
                           [--repeats 10] [--json bench/results/codecs-cpu.json]

For each model it encodes and decodes one layer's K and V (`[n_kv, S, d_h]` each, BF16, random
normal) with every registered codec: `encode` includes the payload checksum, `decode` its
verification. It also times the bare quantize/dequantize kernels (the PyTorch reference on the CPU,
Triton on CUDA) without checksums. Reported: median seconds over `--repeats` runs after warm-ups,
GB/s = BF16 input bytes / median seconds, and that rate as a fraction of the copy bandwidth
(`copy_` between two preallocated 256 MiB buffers: bytes copied per second, counting each
byte once).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rekv_core.bench.machine import cpu_model  # noqa: E402
from rekv_core.codecs import codec_names, get_codec  # noqa: E402
from rekv_core.codecs.base import EncodedKV  # noqa: E402
from rekv_core.kernels import dequantize_groupwise, quantize_groupwise  # noqa: E402
from rekv_core.model.shapes import DEFAULT_MODEL, get_preset  # noqa: E402
from rekv_core.timing import median_seconds  # noqa: E402

WARMUPS = 3


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    return src.numel() / median_seconds(lambda: dst.copy_(src), repeats, device, WARMUPS) / 1e9


def run(models: list[str], prompt_len: int, repeats: int, device: torch.device) -> dict:
    copy_gbps = copy_bandwidth(device, repeats)
    rows = []
    for model in models:
        shape = get_preset(model)
        kv_shape = (shape.num_kv_heads, prompt_len, shape.head_dim)
        g = torch.Generator().manual_seed(0)
        k = torch.randn(kv_shape, generator=g).to(device=device, dtype=torch.bfloat16)
        v = torch.randn(kv_shape, generator=g).to(device=device, dtype=torch.bfloat16)
        input_bytes = 2 * k.numel() * 2
        for name in codec_names():
            codec = get_codec(name)
            encoded = codec.encode(k, v)
            header = encoded.header_bytes()
            cases = {
                "encode": lambda: codec.encode(k, v),
                "decode": lambda: codec.decode(EncodedKV.from_wire(header, encoded.buffers)),
            }
            if name.startswith("int"):
                bits = int(name[3:])
                codes, scales = quantize_groupwise(k, bits)
                cases["quantize kernel"] = lambda: (quantize_groupwise(k, bits),
                                                    quantize_groupwise(v, bits))
                cases["dequantize kernel"] = lambda: (
                    dequantize_groupwise(codes, scales, bits, kv_shape, torch.bfloat16),
                    dequantize_groupwise(codes, scales, bits, kv_shape, torch.bfloat16))
            for op, fn in cases.items():
                seconds = median_seconds(fn, repeats, device, WARMUPS)
                gbps = input_bytes / seconds / 1e9
                rows.append({"model": model, "prompt_len": prompt_len, "codec": name, "op": op,
                             "input_bytes": input_bytes, "payload_bytes": encoded.payload_bytes,
                             "median_ms": seconds * 1e3, "gbps": gbps,
                             "fraction_of_copy": gbps / copy_gbps})
    return {
        "machine": {"cpu": cpu_model(), "cores": torch.get_num_threads(),
                    "device": str(device) if device.type == "cpu"
                    else torch.cuda.get_device_name(device),
                    "torch": torch.__version__, "python": platform.python_version()},
        "command": " ".join(["python", *sys.argv]),
        "repeats": repeats, "warmups": WARMUPS,
        "copy_gbps": copy_gbps,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="preset (repeatable)")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    result = run(args.model or [DEFAULT_MODEL, "qwen2.5-7b"], args.prompt_len, args.repeats,
                 torch.device(args.device))
    print(f"{result['machine']['cpu']} ({result['machine']['cores']} threads), "
          f"torch {result['machine']['torch']}: copy bandwidth {result['copy_gbps']:.2f} GB/s")
    print(f"{'model':14} {'codec':6} {'op':18} {'MiB in':>8} {'ms':>9} {'GB/s':>7} {'of copy':>8}")
    for r in result["rows"]:
        print(f"{r['model']:14} {r['codec']:6} {r['op']:18} {r['input_bytes'] / 2**20:8.2f} "
              f"{r['median_ms']:9.2f} {r['gbps']:7.2f} {r['fraction_of_copy']:8.1%}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
