"""Throughput of the two services with the prefill stopping at the cut: requests per second by cut.

    python bench/throughput.py [--prompt-tokens 512] [--requests 16] [--concurrency 4]
        [--max-new-tokens 4] [--dtype bfloat16] [--rounds 2] [--modes cut=30,planner] [--json FILE]
        [--markdown FILE] [--service-arg=--prefill-token-budget=0 ...]

One prefill and one decode service (`ServicePair`), each pinned to a core of its own with one torch
thread (`taskset`, when there are two cores or more), on loopback: the link is not the limit here,
the two pools' compute is. Each mode sends `--requests` requests of the same `--prompt-tokens`
random token ids, `--concurrency` at a time, streamed handoffs with the lossless BF16 codec (in
the order the planner predicts less for, layer or token order; the table counts the pipelined):

- `cut=c` forced: the prefill service computes layers 0..c−1 and the decode service c..L−1, so the
  prefill pool's share of the work is c/L; c = L is the P/D default (the prefill computes every
  layer), c = 0 gives the decode pool everything;
- `planner`: no forced action, the planner chooses from the loads both workers report.

`--service-arg` passes a setting to both services (as `--service-arg=--prefill-token-budget=0`,
the prefill worker without its scheduler); the JSON's `service_arg` records it.

Reported per mode: completed requests per second of the mode's wall time, TTFT p50/p95 (the decode
service's `ttft_ms`), the inter-token latency p50/p99/max the client saw (gaps between token
messages; with `--max-new-tokens` > 1) beside the decode engine's ITL budget (its
`rekv_itl_budget_seconds`), the prefill's compute per request, and for the planner the cuts it
chose.
Modes run in a shuffled order per round after one warm-up request each; the figures are medians
over rounds. The pool that does most of a request's layers bounds the rate at about
1 / (max(c, L − c) · γ), so the rate peaks near c = L/2 and the decode side's extra work stops
paying below it.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from rekv_cli.bench.machine import cpu_model  # noqa: E402
from rekv_cli.bench.provenance import SERVICES, provenance  # noqa: E402
from rekv_cli.client import generate  # noqa: E402
from rekv_cli.launcher import ServicePair  # noqa: E402
from rekv_cli.util import write_json  # noqa: E402
from rekv_core.model.shapes import DEFAULT_MODEL, get_preset  # noqa: E402

# what the figures measure (`provenance`): the two services as processes under concurrent load
MEASURES = (*SERVICES, "bench/throughput.py")

L = get_preset(DEFAULT_MODEL).num_layers


def modes(only: str | None = None) -> list[tuple[str, int | None]]:
    """Every mode, or those named in `only` (comma-separated labels, as `cut=15,planner`)."""
    every = [(f"cut={c}", c) for c in (L, 3 * L // 4, L // 2, L // 4, 0)] + [("planner", None)]
    if only is None:
        return every
    names = only.split(",")
    unknown = set(names) - {label for label, _ in every}
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: "
                         f"{[label for label, _ in every]}")
    return [(label, cut) for label, cut in every if label in names]


def _itl_budget_ms(pair: ServicePair) -> float:
    url = f"http://{pair.decode.info['metrics']}/metrics"
    with urllib.request.urlopen(url) as response:
        text = response.read().decode()
    found = re.search(r"^rekv_itl_budget_seconds (\S+)$", text, re.M)
    return float(found.group(1)) * 1e3 if found else 0.0


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def run_mode(channel, cut: int | None, prompt: list[int], args, label: str) -> dict:
    forced = None if cut is None else ("bf16", cut)
    generate(channel, f"{label}-warmup", prompt, args.max_new_tokens, forced_action=forced,
             stop_at_eos=False)

    def one(index: int):
        return generate(channel, f"{label}-{index}", prompt, args.max_new_tokens,
                        forced_action=forced, stop_at_eos=False)

    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        generations = list(pool.map(one, range(args.requests)))
    wall = time.perf_counter() - started
    summaries = [g.summary for g in generations]
    ttft = sorted(s.ttft_ms for s in summaries)
    gaps = sorted(gap * 1e3 for g in generations for gap in g.token_gaps())
    return {"mode": label, "requests_per_s": len(summaries) / wall, "wall_s": wall,
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p95_ms": _quantile(ttft, 0.95),
            "itl_p50_ms": _quantile(gaps, 0.5), "itl_p99_ms": _quantile(gaps, 0.99),
            "itl_max_ms": gaps[-1] if gaps else 0.0,
            "prefill_ms_per_request": statistics.median(s.timings.prefill_ms for s in summaries),
            "cuts": sorted(s.action.cut for s in summaries),
            "pipelined": sum(s.schedule.pipelined for s in summaries),
            "fallbacks": sum(s.fallback for s in summaries)}


def main(argv: list[str] | None = None) -> int:
    started = provenance(measures=MEASURES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--modes", default=None,
                        help="comma-separated subset, as cut=30,cut=15,planner (default: all)")
    parser.add_argument("--service-arg", action="append", default=[],
                        help="a setting for both services, as "
                        "--service-arg=--prefill-token-budget=0")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--markdown", metavar="FILE")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    pinned = (os.cpu_count() or 1) >= 2
    common = ["--dtype", args.dtype, "--torch-threads", "1", "--max-concurrent",
              str(args.concurrency),
              *(part for arg in args.service_arg for part in arg.split("=", 1))]
    pair = ServicePair(common, common, log_dir=args.log_dir,
                       prefill_prefix=["taskset", "-c", "0"] if pinned else [],
                       decode_prefix=["taskset", "-c", "1"] if pinned else [])
    rounds: list[list[dict]] = []
    try:
        budget_ms = _itl_budget_ms(pair)
        with grpc.insecure_channel(pair.decode_address) as channel:
            for round_ in range(args.rounds):
                order = modes(args.modes)
                rng.shuffle(order)
                rounds.append([run_mode(channel, cut, prompt, args, f"r{round_}-{label}")
                               for label, cut in order])
                print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    finally:
        codes = pair.stop()
    rows = summarize(rounds, modes(args.modes))
    results = {"meta": {**started, "machine": cpu_model(), "cores": os.cpu_count(),
                        "pinned": pinned, "model": DEFAULT_MODEL, "num_layers": L,
                        "itl_budget_ms": budget_ms,
                        "command": "python bench/throughput.py " + " ".join(sys.argv[1:]),
                        **{k: v for k, v in vars(args).items() if k not in ("json", "markdown")}},
               "rows": rows, "rounds": rounds, "exit_codes": codes}
    table = markdown(results)
    print(table)
    write_json(args.json, results, indent=1)
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0 if all(code == 0 for code in codes.values()) else 1


def summarize(rounds: list[list[dict]], ran: list[tuple[str, int | None]]) -> list[dict]:
    """Per mode, the median over rounds of each figure (and every cut the planner chose); the
    ratios are to the first mode that ran (full prefill, when it ran)."""
    rows = []
    for label, _ in ran:
        runs = [r for round_ in rounds for r in round_ if r["mode"].endswith(f"-{label}")]
        rows.append({"mode": label, **{key: statistics.median(r[key] for r in runs) for key in (
            "requests_per_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p99_ms",
            "itl_max_ms", "prefill_ms_per_request")},
            "cuts": sorted(c for r in runs for c in r["cuts"]),
            "pipelined": sum(r.get("pipelined", 0) for r in runs),
            "requests": sum(len(r["cuts"]) for r in runs),
            "fallbacks": sum(r["fallbacks"] for r in runs)})
    full = rows[0]["requests_per_s"]
    for row in rows:
        row["vs_full_prefill"] = row["requests_per_s"] / full
    return rows


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Throughput by cut ({meta['model']}, {meta['prompt_tokens']}-token prompts, "
             f"{meta['concurrency']} at a time, {meta['max_new_tokens']} new tokens each)", "",
             f"Machine: {meta['machine']}, {meta['cores']} cores (services pinned: "
             f"{meta['pinned']}); commit {meta['commit']} (clean tree: "
             f"{meta.get('tree_clean', '?')}); decode ITL budget "
             f"{meta.get('itl_budget_ms', 0):.0f} ms;",
             f"`{meta['command']}`", "",
             "| mode | requests/s | × full prefill | TTFT p50 ms | TTFT p95 ms | ITL p50 ms "
             "| ITL p99 ms | ITL max ms | prefill ms/request | pipelined | cuts chosen |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        cuts = ""
        if r["mode"] == "planner":
            counts = {c: r["cuts"].count(c) for c in sorted(set(r["cuts"]))}
            cuts = ", ".join(f"{c}: {n}" for c, n in counts.items())
        lines.append(f"| {r['mode']} | {r['requests_per_s']:.2f} | {r['vs_full_prefill']:.2f} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | "
                     f"{r.get('itl_p50_ms', 0):.0f} | {r.get('itl_p99_ms', 0):.0f} | "
                     f"{r.get('itl_max_ms', 0):.0f} | "
                     f"{r['prefill_ms_per_request']:.0f} | "
                     f"{r.get('pipelined', 0)} of {r.get('requests', len(r['cuts']))} | {cuts} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
