"""`rekv demo`: the two services across an emulated cross-node link, one prompt served three ways.

Starts `rekv serve prefill` and `rekv serve decode` as separate processes with the embedded model,
each on its own half of the cores, in two network namespaces joined by a veth pair shaped with
`tc tbf` (as root; otherwise on loopback with the prefill pacing its UCX sends), at the rate where
sending every layer's BF16 KV of the longest prompt takes as long as computing every layer
(measured here at start on one service's cores; --link-gbps sets another). It warms both services
up with untimed requests (every code path, then both schedules on every prompt length), then sends
each passkey prompt through `Decode.Generate` three ways, in a rotating order:

  baseline  full prefill, then every layer's BF16 KV (forced)
  seed      full prefill, then the seed's overlapped handoff; the planner picks (b, c)
  streamed  rekv: the handoff streamed from inside a prefill that stops at the cut, the boundary
            in chunks; the planner picks (b, c) (the services' default)

and prints TTFT from Generate's arrival on the decode worker side by side, with each action, its
bytes, the ratio to the streamed TTFT, whether lossless ways produced the baseline's tokens and
whether the passkey came back. It stops both services with SIGTERM and exits 0 when both stopped
cleanly and every request succeeded. `--json` also records the run's `provenance` (the commit and
whether the tree was clean, read when the demo starts).
"""

from __future__ import annotations

import argparse
import os
import sys

from rekv_cli.bench.provenance import LINK, provenance
from rekv_cli.util import write_json

DEMO_LENGTHS = (0, 12, 30)  # filler repeats: about 50, 340 and 770 prompt tokens
PASSKEY, WARMUP_PASSKEY = 68231, 41957  # same digit count: the same prompt lengths
WAYS = ("baseline", "seed", "streamed")
SEED_SCHEDULE = (False, 0)  # a full prefill, then the handoff
LOSSLESS = ("bf16_transfer", "bf16_recompute", "token_recompute")


def add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="start both services across an emulated link and serve "
                          "prompts three ways", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--filler", type=lambda t: [int(x) for x in t.split(",") if x],
                      default=list(DEMO_LENGTHS),
                      help="filler repeats of each prompt, comma-separated (default 0,12,30: "
                           "about 50, 340 and 770 tokens)")
    demo.add_argument("--max-new-tokens", type=int, default=12)
    demo.add_argument("--link-gbps", type=float, default=None,
                      help="link rate in Gb/s (default: balanced for the longest prompt)")
    demo.add_argument("--loopback", action="store_true",
                      help="skip the namespaces: loopback with paced UCX sends")
    demo.add_argument("--device", default=None, help="cpu, cuda or cuda:N (env REKV_DEVICE)")
    demo.add_argument("--dtype", default=None, help="auto, float32 or bfloat16 (env REKV_DTYPE)")
    demo.add_argument("--log-dir", default=None, help="where the services' logs go "
                      "(default: a new temporary directory)")
    demo.add_argument("--quality", choices=("lossless", "gated"), default=None,
                      help="the requests' quality setting (default: the services', gated): "
                           "lossless answers equal the reference's token for token; gated ones "
                           "may also take a lossy action the quality gate passed, whose greedy "
                           "answer may leave the reference's late in a long answer")
    demo.add_argument("--json", metavar="FILE", help="also write every request's figures as JSON")
    demo.set_defaults(func=cmd_demo)


def way_request(way: str, num_layers: int) -> dict:
    """The forced action and schedule of a way (None: the planner's, the services' default)."""
    if way == "baseline":
        return {"action": ["bf16", num_layers], "schedule": list(SEED_SCHEDULE)}
    if way == "seed":
        return {"action": None, "schedule": list(SEED_SCHEDULE)}
    return {"action": None, "schedule": None}


def code_paths(num_layers: int) -> list[dict]:
    """Forced cases that take every code path the planner may pick under both schedules: full
    BF16, joint int8 at L/2 (after the prefill, streamed in layer order and pipelined), the
    streamed BF16 prefix and the decode side's local prefill (token-only)."""
    L, seed = num_layers, list(SEED_SCHEDULE)
    cases = [(["bf16", L], seed), (["int8", L // 2], seed), (["int8", L // 2], [True, 256]),
             (["int8", L // 2], [True, 256, True]), (["bf16", L], None), (["bf16", 0], None)]
    return [{"action": action, "schedule": schedule} for action, schedule in cases]


def plan_requests(prompts: list[str], warm_prompts: list[str], num_layers: int,
                  max_new_tokens: int, quality: str | None = None
                  ) -> tuple[list[dict], list[dict]]:
    """(warm-ups, timed requests). Warm-ups, untimed, on prompts of the same lengths with another
    key: every code path (`code_paths`, the baseline's first) on the shortest, then both schedules
    (the seed's and the streamed way) on each length, which also lets the decode service measure
    the link. Timed: each prompt three ways, the order rotated per prompt."""
    shortest = min(warm_prompts, key=len)
    warmups = [{"id": f"demo-warmup-path-{n}", "prompt": shortest, "max_new_tokens": 2, **case}
               for n, case in enumerate(code_paths(num_layers))]
    warmups += [{"id": f"demo-warmup-{i}-{way}", "prompt": text, "max_new_tokens": 2,
                 **way_request(way, num_layers)}
                for i, text in enumerate(warm_prompts) for way in ("seed", "streamed")]
    timed = []
    for i, text in enumerate(prompts):
        order = WAYS[i % len(WAYS):] + WAYS[:i % len(WAYS)]
        timed += [{"id": f"demo-{i}-{way}", "prompt": text, "max_new_tokens": max_new_tokens,
                   "prompt_index": i, "way": way, "position": position + 1,
                   "quality": quality, **way_request(way, num_layers)}
                  for position, way in enumerate(order)]
    return warmups, timed


def judge(timed: list[dict], answers: dict[str, dict], filler: list[int]) -> tuple[list, list]:
    """(one row per request, one summary per prompt): the figures with the ratio to the streamed
    TTFT, losslessness, the same tokens as the baseline, and the passkey."""
    from rekv_core.eval.needle import answer_found

    rows, prompts = [], []
    for i, repeats in enumerate(filler):
        mine = {r["way"]: {**{k: r[k] for k in ("prompt_index", "way", "position", "action",
                                                 "schedule")}, "filler": repeats,
                           **answers[r["id"]]}
                for r in timed if r["prompt_index"] == i}
        ok = all("error" not in row for row in mine.values())
        for way in WAYS:
            row = mine[way]
            row["forced_action"], row["forced_schedule"] = row.pop("action"), row.pop("schedule")
            if "error" in row:
                continue
            row["lossless"] = row["action_kind"] in LOSSLESS
            row["passkey_found"] = answer_found(row["text"], PASSKEY)
            row["same_tokens"] = (row["token_ids"] == mine["baseline"]["token_ids"]
                                  if "error" not in mine["baseline"] else None)
            row["ttft_over_streamed"] = (row["ttft_ms"] / mine["streamed"]["ttft_ms"]
                                         if "error" not in mine["streamed"] else None)
        rows += sorted(mine.values(), key=lambda row: row["position"])
        summary = {"prompt_index": i, "filler": repeats,
                   "order": [way for way in sorted(mine, key=lambda w: mine[w]["position"])],
                   "all_succeeded": ok}
        if ok:
            summary |= {"prompt_tokens": mine["baseline"]["prompt_tokens"],
                        "baseline_over_streamed": mine["baseline"]["ttft_over_streamed"],
                        "seed_over_streamed": mine["seed"]["ttft_over_streamed"],
                        "passkey_found": all(r["passkey_found"] for r in mine.values())}
        prompts.append(summary)
    return rows, prompts


def _same_tokens(row: dict) -> str:
    if row["way"] == "baseline":
        return "reference"
    same = {True: "yes", False: "no", None: "?"}[row["same_tokens"]]
    return same if row["lossless"] else f"{same} (lossy)"


def print_table(console, rows: list[dict], prompts: list[dict], rate, kind: str) -> None:
    from rich.table import Table

    table = Table(title=f"rekv demo: TTFT from arrival, each prompt served three ways, over a "
                        f"{rate.gbps:.3g} Gb/s link ({kind})")
    for column in ("prompt tokens", "#", "way", "action (b, c)", "KiB", "TTFT ms",
                   "÷ streamed", "same tokens", "passkey", "output"):
        table.add_column(column, justify="left" if column in ("way", "action (b, c)", "output",
                                                              "same tokens") else "right")
    for row in rows:
        tokens = str(row.get("prompt_tokens", "")) if row["position"] == 1 else ""
        if "error" in row:
            table.add_row(tokens, str(row["position"]), row["way"], "", "", "", "", "", "",
                          f"FAILED: {row['error'][:60]}", end_section=row["position"] == 3)
            continue
        fallback = " fallback" if row["fallback"] else ""
        order = " pipelined" if row.get("pipelined") else ""
        ratio = row["ttft_over_streamed"]
        table.add_row(tokens, str(row["position"]), row["way"],
                      f"{row['action_kind']} ({row['codec']}, {row['cut']}){order}{fallback}",
                      f"{row['bytes'] / 1024:.0f}", f"{row['ttft_ms']:.0f}",
                      "" if ratio is None else f"{ratio:.2f}", _same_tokens(row),
                      "yes" if row["passkey_found"] else "no",
                      " ".join(row["text"].split()[:5]), end_section=row["position"] == 3)
    console.print(table)
    console.print("baseline: full prefill, then every layer's BF16 KV (forced). seed: full "
                  "prefill, then the seed's overlapped handoff. streamed: rekv, the handoff "
                  "streamed from inside a prefill that stops at the cut, the boundary in chunks "
                  "(pipelined: the prefill runs in those token chunks, and the decode worker "
                  "computes its layers on one chunk while the prefill computes the next). "
                  "seed and streamed: the planner picks (b, c); token_recompute: the decode "
                  "worker prefills the prompt itself, no KV crosses the link. #: the order they "
                  "were sent in. ÷ streamed: TTFT over the streamed TTFT.")
    done = [p for p in prompts if p["all_succeeded"]]
    if done:
        console.print("TTFT baseline / streamed: " + ", ".join(
            f"{p['baseline_over_streamed']:.2f}" for p in done) + "; seed / streamed: "
            + ", ".join(f"{p['seed_over_streamed']:.2f}" for p in done) + " (prompts of "
            + ", ".join(str(p["prompt_tokens"]) for p in done) + " tokens)")
    settings = sorted({r["quality"] for r in rows if r.get("quality")})
    console.print(f"quality setting: {', '.join(settings) or 'none answered'}. lossless: only "
                  "actions that reproduce the reference's cache bit for bit, so the answer is "
                  "the reference's token for token; gated (the default): also the lossy actions "
                  "the quality gate passed, whose greedy answer may leave the reference's after "
                  "its first 16 tokens (docs/design.md, The quality gate).")
    differ = [r["id"] for r in rows if r.get("lossless") and r.get("same_tokens") is False]
    if differ:
        console.print(f"[bold red]lossless requests whose tokens differ from the baseline's: "
                      f"{', '.join(differ)}[/]")


def _service_args(args: argparse.Namespace, model: str) -> list[str]:
    return ["--model", model, *(x for flag in ("device", "dtype") if getattr(args, flag)
                                for x in (f"--{flag}", getattr(args, flag)))]


def cmd_demo(args: argparse.Namespace) -> int:
    started = provenance(measures=(*LINK, "rekv_cli/demo.py", "rekv_cli/demo_client.py",
                                   "rekv_cli/demo_link.py"))
    from rich.console import Console

    from rekv_cli.bench.link.sweep import service_layout
    from rekv_cli.demo_link import DemoServices, link_rate, sigterm_as_interrupt
    from rekv_core.eval.needle import passkey_prompt
    from rekv_core.model.shapes import DEFAULT_MODEL, get_preset
    from rekv_core.settings import RuntimeSettings

    if args.max_new_tokens < 1:
        raise ValueError(f"max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if not args.filler:
        raise ValueError("filler: give at least one prompt")
    console = Console(width=170)
    settings = RuntimeSettings.from_env(model=DEFAULT_MODEL, device=args.device, dtype=args.dtype)
    L = get_preset(DEFAULT_MODEL).num_layers
    prompts = [passkey_prompt(PASSKEY, repeats) for repeats in args.filler]
    warm = [passkey_prompt(WARMUP_PASSKEY, repeats) for repeats in args.filler]
    cores, service_args = service_layout(_service_args(args, DEFAULT_MODEL))
    with console.status("measuring this machine's compute to choose the link rate"):
        rate = link_rate(settings, prompts, args.link_gbps, cores[1])
    console.print(f"link rate: {rate.describe()}")
    warmups, timed = plan_requests(prompts, warm, L, args.max_new_tokens, args.quality)
    with sigterm_as_interrupt():
        with console.status("starting the prefill and decode services"):
            services = DemoServices(service_args, args.log_dir, cores, rate.gbps, args.loopback)
        try:
            pair = services.pair
            console.print(f"link: {services.describe()}")
            console.print(f"prefill {pair.prefill.info['grpc']} (cores {cores[0] or 'all'}), "
                          f"decode {pair.decode.info['grpc']} (UCX {pair.decode.info['ucx']}, "
                          f"cores {cores[1] or 'all'}); logs in {pair.log_dir}")
            answers = _send(console, services, warmups, timed, pair.log_dir)
        finally:
            codes = services.stop()
    rows, summaries = judge(timed, answers, args.filler)
    print_table(console, rows, summaries, rate, services.kind)
    failed = sum("error" in answers[r["id"]] for r in warmups + timed)
    console.print(f"services stopped: prefill exit {codes['prefill']}, decode exit "
                  f"{codes['decode']}; {failed} failed requests")
    meta = {**_meta(args, settings, rate, services, cores, service_args), **started}
    write_json(args.json, {"meta": meta,
                           "prompts": summaries, "requests": rows,
                           "warmups": [answers[r["id"]] for r in warmups],
                           "failed_requests": failed, "exit_codes": codes}, indent=1)
    return 1 if failed or any(code != 0 for code in codes.values()) else 0


def _send(console, services, warmups: list[dict], timed: list[dict], log_dir) -> dict[str, dict]:
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"{len(warmups)} untimed warm-up requests", total=len(warmups))

        def advance(answer: dict) -> None:
            bar.advance(task)
            if answer["id"] == warmups[-1]["id"]:
                bar.update(task, description=f"{len(timed)} timed requests", completed=0,
                           total=len(timed))
        answers = services.run_requests(warmups + timed, advance, log_dir / "client.log")
    return {a["id"]: a for a in answers}


def _meta(args, settings, rate, services, cores, service_args) -> dict:
    from dataclasses import asdict

    from rekv_cli.bench.machine import cpu_model

    return {"command": "rekv " + " ".join(sys.argv[1:]), "cpu": cpu_model(),
            "cores": os.cpu_count(), "model": settings.model,
            "device": settings.device, "dtype": settings.dtype,
            "dtype_run": str(settings.torch_dtype).removeprefix("torch."), "filler": args.filler,
            "max_new_tokens": args.max_new_tokens, "passkey": PASSKEY,
            "link": {"kind": services.kind, "gbps": rate.gbps, "chosen": rate.chosen,
                     "description": services.describe(), **asdict(rate)},
            "service_cores": {"prefill": cores[0], "decode": cores[1]},
            "service_args": service_args, "logs": str(services.pair.log_dir)}
