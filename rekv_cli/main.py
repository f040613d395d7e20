"""The `rekv` command.

    rekv demo     start the prefill and decode services with the embedded model and send
                  prompts of several lengths through them, as a router would
    rekv serve prefill|decode
                  run one service (settings: `rekv serve decode --help`)
    rekv codecs   bytes per layer of every codec and the boundary bytes, for every preset
    rekv bench handoff
                  time every handoff action over the throttled in-process link
    rekv profile  measure per-layer costs on this machine (a profile file)
    rekv gate     evaluate actions against BF16 on a text corpus (a policy file)
    rekv regate   judge a policy's lossy codecs again by greedy generation agreement
    rekv plan     the action the planner would choose for a prompt length and link rate
    rekv health   exit 0 if a running service's gRPC health check says SERVING

Every command that prints figures takes `--json FILE` to write them as well.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rekv_cli.bench.cli import add_bench_parser
from rekv_cli.demo import add_demo_parser
from rekv_cli.health import add_health_parser
from rekv_cli.plan import add_plan_parsers
from rekv_cli.util import write_json
from rekv_core.units import MiB


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
    write_json(args.json, [row.as_dict() for row in rows])
    return 0


def cmd_serve(argv: list[str]) -> int:
    roles = ("prefill", "decode")
    if not argv or argv[0] not in roles:
        print(f"usage: rekv serve {{{','.join(roles)}}} [--help] [settings]", file=sys.stderr)
        return 2
    try:
        if argv[0] == "prefill":
            from services.prefill.server import main as serve_main
        else:
            from services.decode.server import main as serve_main
        return serve_main(argv[1:])
    except ValueError as exc:
        print(f"rekv serve {argv[0]}: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rekv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    add_demo_parser(sub)

    codecs = sub.add_parser("codecs", help="wire bytes per layer for every codec and preset")
    codecs.add_argument("--prompt-len", type=int, default=8192, help="S, tokens (default 8192)")
    codecs.add_argument("--model", action="append", help="a preset name (repeatable; default all)")
    codecs.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    codecs.set_defaults(func=cmd_codecs)

    add_bench_parser(sub)
    add_plan_parsers(sub)
    add_health_parser(sub)

    serve = sub.add_parser("serve", help="run the prefill or the decode service",
                           add_help=False)
    serve.add_argument("role", choices=("prefill", "decode"))
    serve.set_defaults(func=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return cmd_serve(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"rekv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
