"""KVPR's per-layer form across the emulated link: TTFT and the time to the 8th token against the
same codec's action sent without it, the other forced actions, and the planner with the form among
its actions.

    python bench/layer_split.py [--model synthetic:mini-llama-2-7b] [--dtype float32]
        [--prompt-len 512,2048] [--link-gbps x1,x4,10] [--cuts 13,22] [--codecs bf16,int8]
        [--new-tokens 8] [--warmups 1] [--runs 3] [--json FILE] [--markdown FILE]

Both services run as `rekv bench link` runs them (two network namespaces joined by a veth pair
shaped with `tc tbf`, UCX over TCP only, each service pinned to its own half of the cores; without
root, loopback with paced UCX sends), with the services' defaults otherwise (streamed handoffs, the
boundary in 256-token chunks, the per-layer form offered). Per prompt length S and link rate (Gb/s,
or xK: K times S's balanced rate, at which every layer's BF16 KV takes as long on the link as
computing every layer), the cases, every one once per round in an order shuffled each round:

- each codec sent whole (transfer-only, c = L), and each codec's joint action at each cut;
- each codec whole and at each cut in the per-layer form, l the largest allowed below S (every
  layer's input rows but the last block's: the most the form can save on the link);
- the planner's choice (no forced action), the form among its candidates.

The default model is the MHA preset (n_h = n_kv, Llama-2-7B's proportions), where an input row is
half a BF16 K and V row; on a GQA model (the embedded one) the form sends more bytes than it saves.
Reported per case: TTFT from Generate's arrival on the decode worker (median, 95% bootstrap
interval), the median time from the call to the last token (the client's clock), the bytes; per
point: each form's case against the same action without it, the best form case against the best
other forced case (the planner's previous choice set), and the planner against the best forced case
(goal: within 10%).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rekv_cli.bench.link import forced  # noqa: E402
from rekv_core.model.blocks import EXEC_BLOCK  # noqa: E402

CHUNKED = [True, EXEC_BLOCK]  # the services' default schedule: streamed, the boundary in chunks
DEFAULT_MODEL = "synthetic:mini-llama-2-7b"


def largest_split(S: int) -> int:
    """The largest allowed l below S."""
    return (S - 1) // EXEC_BLOCK * EXEC_BLOCK


def cases_for(L: int, S: int, cuts: list[int], codecs: list[str]) -> list[dict]:
    cases = [{"action": [codec, c], "schedule": CHUNKED, "role": "whole"}
             for codec in codecs for c in [L, *cuts]]
    l = largest_split(S)
    if l:
        cases += [{"action": [codec, c, "bf16", 0, False, l], "schedule": CHUNKED,
                   "role": "layer_split"} for codec in codecs for c in [L, *cuts]]
    return [*cases, {"action": None, "schedule": None, "role": "planner"}]


def point_summary(rows: list[dict]) -> dict:
    forced_rows = [r for r in rows if r["role"] != "planner"]
    planner = next(r for r in rows if r["role"] == "planner")
    best = min(forced_rows, key=lambda r: r["median_ms"])
    splits = [r for r in forced_rows if r["role"] == "layer_split"]
    other = min((r for r in forced_rows if r["role"] != "layer_split"),
                key=lambda r: r["median_ms"])

    def brief(r: dict) -> dict:
        return {"label": r["label"], "median_ms": r["median_ms"],
                "last_token_ms": r["last_token_median_ms"], "bytes": r["bytes"]}

    def without(r: dict) -> dict:
        return next(o for o in forced_rows if o["role"] == "whole" and o["codec"] == r["codec"]
                    and o["cut"] == r["cut"])

    versus = [{"codec": r["codec"], "cut": r["cut"], "layer_split": r["layer_split"],
               "ttft": r["median_ms"] / without(r)["median_ms"],
               "last_token": r["last_token_median_ms"] / without(r)["last_token_median_ms"],
               "bytes": r["bytes"] / without(r)["bytes"]} for r in splits]
    summary = {"best": brief(best), "best_other": brief(other), "split_over_whole": versus,
               "planner": {**brief(planner), "picks": planner["picks"]},
               "planner_over_best": planner["median_ms"] / best["median_ms"],
               "planner_within_10pct": planner["median_ms"] <= 1.1 * best["median_ms"]}
    if splits:
        split = min(splits, key=lambda r: r["median_ms"])
        summary["best_split"] = brief(split)
        summary["split_over_other"] = split["median_ms"] / other["median_ms"]
    else:  # S below two blocks: no l is allowed
        summary["best_split"], summary["split_over_other"] = None, float("nan")
    return summary


def run(args) -> dict:
    return forced.sweep(args, "layer_split",
                        lambda L, S, cuts: cases_for(L, S, cuts, args.codecs), point_summary,
                        measures=("bench/layer_split.py",))


def markdown(result: dict) -> str:
    lines = [*forced.heading("KVPR's per-layer form", result),
             "Each per-layer case against the same action without the form (ratios):", "",
             "| S | link | Gb/s | codec | cut | l | bytes | TTFT | last token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in result["points"]:
        for v in p["split_over_whole"]:
            lines.append(f"| {p['prompt_len']} | {p['link']} | {p['link_gbps']:.3f} "
                         f"| {v['codec']} | {v['cut']} | {v['layer_split']} | {v['bytes']:.2f} "
                         f"| {v['ttft']:.2f} | {v['last_token']:.2f} |")
    lines += ["", "The best per-layer case against the best other forced case, and the planner:",
              "", *forced.best_against_other(result, "per-layer", "best_split",
                                              "split_over_other")]
    return "\n".join([*lines, "", *forced.every_case(result)]) + "\n"


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if min(args.prompt_len) < 1:
        parser.error("--prompt-len: positive")
    args.model = args.model or DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    args = forced.parse_args(__doc__.split("\n\n")[0], argv, _check)
    return forced.main(args, run, markdown)


if __name__ == "__main__":
    sys.exit(main())
