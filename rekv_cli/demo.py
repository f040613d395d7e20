"""`rekv demo`: the two services on this machine, called as a router would.

Starts `rekv serve prefill` and `rekv serve decode` as separate processes on 127.0.0.1 with the
embedded model, sends passkey prompts of several lengths through `Decode.Generate` (the planner
chooses the action), then the same prompts with full BF16 transfer forced, prints one row per
prompt with both side by side, stops both services with SIGTERM and exits 0 when both stopped
cleanly and every request succeeded.
"""

from __future__ import annotations

import argparse

from rekv_cli.util import write_json

DEMO_LENGTHS = (0, 12, 60)  # filler repeats: about 50, 340 and 1500 prompt tokens
PASSKEY = 68231


def add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="start both services and send prompts through them",
                          description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--filler", type=lambda t: [int(x) for x in t.split(",") if x],
                      default=list(DEMO_LENGTHS),
                      help="filler repeats of each prompt, comma-separated (default 0,12,60: "
                           "about 50, 340 and 1500 tokens)")
    demo.add_argument("--max-new-tokens", type=int, default=12)
    demo.add_argument("--device", default=None, help="cpu, cuda or cuda:N (env REKV_DEVICE)")
    demo.add_argument("--dtype", default=None, help="auto, float32 or bfloat16 (env REKV_DTYPE)")
    demo.add_argument("--log-dir", default=None, help="where the services' logs go "
                      "(default: a new temporary directory)")
    demo.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    import grpc
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from rekv_core.codecs import BASELINE_CODEC
    from rekv_core.eval.needle import answer_found, passkey_prompt
    from rekv_core.model.shapes import DEFAULT_MODEL, get_preset
    from rekv_cli.client import generate
    from rekv_cli.launcher import ServicePair

    L = get_preset(DEFAULT_MODEL).num_layers
    if args.max_new_tokens < 1:
        raise ValueError(f"max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    console = Console()
    service_args = []
    for flag in ("device", "dtype"):
        if getattr(args, flag):
            service_args += [f"--{flag}", getattr(args, flag)]
    prompts = [passkey_prompt(PASSKEY, repeats) for repeats in args.filler]
    rows = []
    with console.status("starting the prefill and decode services"):
        pair = ServicePair(service_args, service_args, log_dir=args.log_dir)
    console.print(f"prefill {pair.prefill.info['grpc']}, decode {pair.decode.info['grpc']} "
                  f"(UCX {pair.decode.info['ucx']}); logs in {pair.log_dir}")
    failed = 0
    try:
        with (grpc.insecure_channel(pair.decode_address) as channel,
              Progress(console=console) as bar):
            task = bar.add_task("requests", total=2 * len(prompts))
            for cut in (L, L // 2, 0):  # warm both processes' code paths before timing anything
                generate(channel, f"demo-warmup-{cut}", "Warm up.", 2, forced_action=("int8", cut))
            for index, prompt in enumerate(prompts):
                row = {}
                for label, forced in (("planned", None), ("bf16", (BASELINE_CODEC, L))):
                    result = generate(channel, f"demo-{index}-{label}", prompt,
                                      args.max_new_tokens, forced_action=forced)
                    s = result.summary
                    row["prompt_tokens"] = s.prompt_tokens
                    row[label] = {"action": s.action_kind, "codec": s.action.codec,
                                  "cut": s.action.cut,
                                  "bytes": sum((s.bytes.boundary, s.bytes.prefix, s.bytes.scales,
                                                s.bytes.tokens, s.bytes.head)),
                                  "handoff_ms": s.measured_handoff_ms,
                                  "predicted_ms": s.predicted_handoff_ms, "ttft_ms": s.ttft_ms,
                                  "text": result.text, "token_ids": result.token_ids,
                                  "passkey_found": answer_found(result.text, PASSKEY),
                                  "fallback": s.fallback}
                    bar.advance(task)
                row["same_tokens"] = row["planned"]["token_ids"] == row["bf16"]["token_ids"]
                rows.append(row)
    finally:
        codes = pair.stop()
    table = Table(title="rekv demo: planned action vs full BF16 transfer, same prompt")
    for column in ("prompt tokens", "action (b, c)", "KiB", "handoff ms", "TTFT ms", "output",
                   "BF16 KiB", "BF16 handoff ms", "BF16 TTFT ms", "same tokens"):
        table.add_column(column, justify="left" if column in ("action (b, c)", "output")
                         else "right")
    for row in rows:
        p, b = row["planned"], row["bf16"]
        table.add_row(str(row["prompt_tokens"]), f"{p['action']} ({p['codec']}, {p['cut']})",
                      f"{p['bytes'] / 1024:.0f}", f"{p['handoff_ms']:.0f}",
                      f"{p['ttft_ms']:.0f}", " ".join(p["text"].split()[:6]),
                      f"{b['bytes'] / 1024:.0f}", f"{b['handoff_ms']:.0f}", f"{b['ttft_ms']:.0f}",
                      "yes" if row["same_tokens"] else "no")
    Console(width=160).print(table)
    failed = sum(code != 0 for code in codes.values())
    console.print(f"services stopped: prefill exit {codes['prefill']}, decode exit "
                  f"{codes['decode']}")
    write_json(args.json, {"requests": rows, "exit_codes": codes}, indent=1)
    return 1 if failed else 0
