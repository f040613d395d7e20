"""The `rekv` command.

    rekv demo     load the embedded model, generate from a few prompts, round-trip their real KV
                  through every codec, and print the codec byte table
    rekv codecs   bytes per layer of every codec and the boundary bytes, for every preset

Every command that prints figures takes `--json FILE` to write them as well.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

MiB = 1 << 20


def _write_json(path: str | None, payload) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def cmd_codecs(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from rekv_core.codecs.sizes import codec_size_rows
    from rekv_core.model.shapes import PRESETS, get_preset

    shapes = [get_preset(name) for name in args.model] if args.model else list(PRESETS.values())
    rows = codec_size_rows(shapes, args.prompt_len)
    table = Table(title=f"Wire bytes per layer at S = {args.prompt_len} tokens (MiB)")
    for column in ("model", "codec", "layer MiB", "layer bytes", "boundary MiB (B_H)"):
        table.add_column(column, justify="left" if column in ("model", "codec") else "right")
    for row in rows:
        table.add_row(row.model, row.codec, f"{row.layer_bytes / MiB:.4g}", str(row.layer_bytes),
                      f"{row.boundary_bytes / MiB:.4g}")
    Console().print(table)
    _write_json(args.json, [row.as_dict() for row in rows])
    return 0


DEMO_PROMPTS = (
    "The capital of France is",
    "Write one sentence about the ocean.",
    "def fibonacci(n):",
)


def cmd_demo(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.table import Table

    from rekv_core.codecs import codec_names, get_codec
    from rekv_core.codecs.sizes import codec_size_rows
    from rekv_core.model import Model, greedy_generate, load_weights, prefill
    from rekv_core.model.tokenizer import GGUFTokenizer
    from rekv_core.model.weights import embedded_gguf_path
    from rekv_core.settings import RuntimeSettings

    console = Console()
    settings = RuntimeSettings.from_env(device=args.device, dtype=args.dtype)
    started = time.perf_counter()
    model = Model(load_weights("smollm2-135m", settings.torch_dtype, settings.device))
    tokenizer = GGUFTokenizer.from_gguf(embedded_gguf_path())
    console.print(f"loaded {model.shape.name} ({model.shape.num_layers} layers, "
                  f"{settings.torch_dtype}, {settings.device}) in "
                  f"{time.perf_counter() - started:.1f} s")

    report = {"model": model.shape.name, "dtype": settings.dtype, "generations": [],
              "codec_roundtrip": [], "codec_sizes": []}
    for prompt in DEMO_PROMPTS:
        ids = tokenizer.encode(prompt)
        t0 = time.perf_counter()
        new = greedy_generate(model, ids, args.max_new_tokens, tokenizer.eos_token_id)
        seconds = time.perf_counter() - t0
        text = tokenizer.decode(new)
        console.print(f"[bold]{prompt!r}[/] ({len(ids)} tokens) -> {text!r} "
                      f"[dim]{len(new)} tokens in {seconds * 1000:.0f} ms[/]")
        report["generations"].append({"prompt": prompt, "prompt_tokens": len(ids),
                                      "output_tokens": new, "output_text": text,
                                      "seconds": seconds})

    # Real KV of a longer prompt through every codec: bytes and worst error per group scale.
    ids = tokenizer.encode(" ".join(DEMO_PROMPTS) * 8)
    kv = prefill(model, ids, boundaries=())
    table = Table(title=f"Codec round trip on real KV ({len(ids)} tokens, all "
                        f"{model.shape.num_layers} layers)")
    for column in ("codec", "bytes", "vs bf16", "max |error|"):
        table.add_column(column, justify="right")
    bf16_bytes = None
    for name in codec_names():
        codec = get_codec(name)
        total, worst = 0, 0.0
        for k, v in zip(kv.keys, kv.values):
            encoded = codec.encode(k, v)
            k2, v2 = codec.decode(encoded)
            total += encoded.payload_bytes
            worst = max(worst, float((k2 - k).abs().max()), float((v2 - v).abs().max()))
        bf16_bytes = bf16_bytes or total
        table.add_row(name, str(total), f"{total / bf16_bytes:.3f}", f"{worst:.3g}")
        report["codec_roundtrip"].append({"codec": name, "prompt_tokens": len(ids),
                                          "bytes": total, "max_abs_error": worst})
    console.print(table)

    sizes = Table(title="Per-layer wire bytes of the embedded model at 8192 tokens")
    for column in ("codec", "layer MiB", "boundary MiB"):
        sizes.add_column(column, justify="right")
    for row in codec_size_rows([model.shape], 8192):
        sizes.add_row(row.codec, f"{row.layer_bytes / MiB:.4g}", f"{row.boundary_bytes / MiB:.4g}")
        report["codec_sizes"].append(row.as_dict())
    console.print(sizes)
    _write_json(args.json, report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rekv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the embedded model and the codecs end to end")
    demo.add_argument("--max-new-tokens", type=int, default=24)
    demo.add_argument("--device", default=None, help="cpu, cuda or cuda:N (env REKV_DEVICE)")
    demo.add_argument("--dtype", default=None, help="auto, float32 or bfloat16 (env REKV_DTYPE)")
    demo.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    demo.set_defaults(func=cmd_demo)

    codecs = sub.add_parser("codecs", help="wire bytes per layer for every codec and preset")
    codecs.add_argument("--prompt-len", type=int, default=8192, help="S, tokens (default 8192)")
    codecs.add_argument("--model", action="append", help="a preset name (repeatable; default all)")
    codecs.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    codecs.set_defaults(func=cmd_codecs)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"rekv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
