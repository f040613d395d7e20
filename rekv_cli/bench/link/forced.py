"""A sweep of forced cases across the emulated link, as `bench/token_split.py`, `bench/lynx.py` and
`bench/layer_split.py` run it: both services started once as `rekv bench link` starts them, then
per link rate and prompt length S the bench's cases, each once per round in an order shuffled
each round.

`sweep(args, name, cases_for, summarize, annotate, measures=)` runs it: `cases_for(L, S, cuts)`
gives a point's cases (each with a `role`), `summarize(rows)` gives the point's summary (its key
ending `_over_other` is the ratio printed as the point ends), `annotate(row, number, S, log_dir)`,
when given, adds a bench's own fields to a case's row, and `measures` names the bench's own code
(its script), which its provenance adds to `LINK`'s; the result holds the meta (provenance taken
at the start), the balanced rates, every row and every point. `parse_args(description, argv,
check)` reads the benches' common options, `main(args, run, markdown)` writes their outputs,
`every_case(result)` lists every case in markdown, `heading` and `best_against_other` the rest of
what their reports share.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from rekv_cli.bench.handoff import LinkRate, prompt_ids
from rekv_cli.bench.link.netns import EmulatedLink, unavailable
from rekv_cli.bench.link.report import row
from rekv_cli.bench.link.sweep import (LinkBenchConfig, balanced_gbps, run_client,
                                       service_layout, start_services)
from rekv_cli.bench.machine import cpu_model
from rekv_cli.bench.provenance import LINK, provenance
from rekv_cli.util import write_json
from rekv_core.settings import RuntimeSettings


def sweep(args, name: str, cases_for: Callable[[int, int, list[int]], list[dict]],
          summarize: Callable[[list[dict]], dict],
          annotate: Callable[[dict, int, int, Path], None] | None = None, *,
          measures: Sequence[str]) -> dict:
    started = provenance(measures=(*LINK, *measures))
    settings = RuntimeSettings.from_env(model=args.model, dtype=args.dtype)
    model = settings.load_model()
    shape = model.shape
    L = shape.num_layers
    cuts = args.cuts or [round(L * 0.4), round(L * 0.7)]
    service_args = ["--dtype", args.dtype, "--model", settings.model]
    if args.policy:
        service_args += ["--policy", args.policy]
    cores, role_args = service_layout(service_args)
    why_not = unavailable()
    log_dir = Path(tempfile.mkdtemp(prefix=f"rekv-{name.replace('_', '-')}-"))
    balanced = {S: balanced_gbps(model, prompt_ids(shape.vocab_size, S, 0), cores[1])[0]
                for S in args.prompt_len}
    config = LinkBenchConfig(warmups=args.warmups, runs=args.runs)
    rows, points = [], []
    link = None if why_not else EmulatedLink(args.link_gbps[0].gbps(balanced[args.prompt_len[0]]))
    pair = None
    try:
        pair = start_services(role_args, log_dir, cores, link) if link else None
        for rate in args.link_gbps:
            for S in args.prompt_len:
                gbps = rate.gbps(balanced[S])
                if link:
                    link.set_rate(gbps)
                else:
                    if pair is not None:
                        pair.stop()
                    pair = start_services(role_args, log_dir, cores, None, gbps)
                cases = cases_for(L, S, cuts)
                results = run_client(link.prefix("decode") if link else [], pair.decode_address,
                                     S, shape.vocab_size, cases, config,
                                     seed=random.Random(f"{S}-{rate.label}").randrange(1 << 30),
                                     new_tokens=args.new_tokens)
                point_rows = []
                for number, (case, result) in enumerate(zip(cases, results)):
                    r = row(shape, S, rate, gbps, result)
                    r["role"] = case["role"]
                    r["last_token_median_ms"] = statistics.median(result["last_token_ms"])
                    if annotate is not None:
                        annotate(r, number, S, log_dir)
                    point_rows.append(r)
                rows += point_rows
                summary = summarize(point_rows)
                points.append({"prompt_len": S, "link": rate.label, "link_gbps": gbps,
                               "balanced_gbps": balanced[S], **summary})
                ratio = next(key for key in summary if key.endswith("_over_other"))
                print(f"S={S} {rate.label} ({gbps:.3f} Gb/s): best {summary['best']['label']} "
                      f"{summary['best']['median_ms']:.0f} ms; "
                      f"{ratio.removesuffix('_over_other')}/other {summary[ratio]:.2f}; planner "
                      f"{summary['planner_over_best']:.2f}", file=sys.stderr)
        codes, pair = (pair.stop() if pair else {}), None
    finally:
        if pair is not None:
            pair.stop()
        if link:
            link.close()
    meta = {**started, "machine": cpu_model(), "cores": os.cpu_count(), "model": shape.name,
            "dtype": args.dtype, "cuts": cuts, "codecs": args.codecs,
            "new_tokens": args.new_tokens, "warmups": args.warmups, "runs": args.runs,
            "link": "veth + tc tbf in two network namespaces" if not why_not
            else f"loopback, paced UCX sends ({why_not})",
            "service_cores": {"prefill": cores[0], "decode": cores[1]},
            "service_exit_codes": codes, "logs": str(log_dir),
            "command": f"python bench/{name}.py " + " ".join(sys.argv[1:])}
    return {"meta": meta, "balanced_gbps": balanced, "rows": rows, "points": points}


def heading(title: str, result: dict) -> list[str]:
    """A bench's title line (`title`, the model and dtype) and its provenance line."""
    meta = result["meta"]
    return [f"# {title} across the emulated link ({meta['model']}, {meta['dtype']})", "",
            f"`{meta['command']}`, commit {meta['commit']} (clean tree: {meta['tree_clean']}), "
            f"{meta['machine']}, {meta['link']}; {meta['runs']} timed rounds after "
            f"{meta['warmups']} warm-up, cases shuffled each round; {meta['new_tokens']} greedy "
            f"tokens a call.", ""]


def best_against_other(result: dict, what: str, best_key: str, ratio_key: str) -> list[str]:
    """The markdown table of each point's best `what` case (`best_key`: a `brief`, or None where
    the point has none) against the best other forced case (`ratio_key`) and the planner."""
    lines = [f"| S | link | Gb/s | best {what} | ms | last token | best other | ms | last token "
             f"| {what}/other | planner | ms | planner/best |", "|" + " --- |" * 13]
    for p in result["points"]:
        s, o, pl = p[best_key], p["best_other"], p["planner"]
        best = (f"{s['label']} | {s['median_ms']:.0f} | {s['last_token_ms']:.0f}" if s
                else "- | - | -")
        lines.append(f"| {p['prompt_len']} | {p['link']} | {p['link_gbps']:.3f} | {best} "
                     f"| {o['label']} | {o['median_ms']:.0f} | {o['last_token_ms']:.0f} "
                     f"| {p[ratio_key]:.2f} | {pl['label']} | {pl['median_ms']:.0f} "
                     f"| {p['planner_over_best']:.2f} |")
    return lines


def every_case(result: dict) -> list[str]:
    """The markdown lines listing every case of every point: TTFT median [95% CI], last token."""
    lines = ["Every case (TTFT median ms [95% CI], last token median ms):", ""]
    for p in result["points"]:
        lines.append(f"- S={p['prompt_len']} {p['link']}: " + "; ".join(
            f"{r['label']} {r['median_ms']:.0f} [{r['ci95_ms'][0]:.0f}–{r['ci95_ms'][1]:.0f}] "
            f"{r['last_token_median_ms']:.0f}"
            for r in result["rows"] if r["prompt_len"] == p["prompt_len"]
            and r["link"] == p["link"]))
    return lines


def parse_args(description: str, argv: list[str] | None = None,
               check: Callable[[argparse.Namespace, argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None)
    parser.add_argument("--policy", default="")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", default="512,2048")
    parser.add_argument("--link-gbps", default="x1,x4,10")
    parser.add_argument("--cuts", default="")
    parser.add_argument("--codecs", default="int8,bf16")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--markdown", metavar="FILE")
    args = parser.parse_args(argv)
    try:
        args.prompt_len = [int(v) for v in args.prompt_len.split(",")]
        args.cuts = [int(v) for v in args.cuts.split(",")] if args.cuts else []
        args.codecs = [c for c in args.codecs.split(",") if c]
    except ValueError:
        parser.error("--prompt-len, --cuts: comma-separated integers")
    try:
        args.link_gbps = [LinkRate.parse(v) for v in args.link_gbps.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if check is not None:
        check(args, parser)
    if args.new_tokens < 1 or args.runs < 1 or args.warmups < 0:
        parser.error("--new-tokens, --runs: at least 1; --warmups: at least 0")
    return args


def main(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict],
         markdown: Callable[[dict], str]) -> int:
    result = run(args)
    table = markdown(result)
    print(table)
    write_json(args.json, result, indent=1)
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0 if all(c == 0 for c in result["meta"]["service_exit_codes"].values()) else 1
