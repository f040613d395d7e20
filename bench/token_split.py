"""KVPR's token split across the emulated link: TTFT and the time to the 8th token against the
same codec sent whole, the joint action at the same cuts, and the planner with splits among its
actions.

    python bench/token_split.py [--model M] [--dtype float32] [--prompt-len 512,2048]
        [--link-gbps x1,x4,10] [--cuts 12,21] [--codecs int8,bf16] [--new-tokens 8]
        [--warmups 1] [--runs 3] [--json FILE] [--markdown FILE]

Both services run as `rekv bench link` runs them (two network namespaces joined by a veth pair
shaped with `tc tbf`, UCX over TCP only, each service pinned to its own half of the cores; without
root, loopback with paced UCX sends), with the services' defaults otherwise (streamed handoffs,
the boundary in 256-token chunks, token splits offered). Per prompt length S and link rate (Gb/s,
or xK: K times S's balanced rate, at which every layer's BF16 KV takes as long on the link as
computing every layer), the cases, every one once per round in an order shuffled each round:

- each codec sent whole (transfer-only, c = L);
- each codec's joint action (its prefix, a BF16 boundary) at each cut;
- each codec's token split at each cut, l in {256, S/2 rounded down to 256} below S;
- the planner's choice (no forced action), splits among its candidates.

Each call generates `--new-tokens` tokens (EOS ignored). Reported per case: TTFT from Generate's
arrival on the decode worker (median, 95% bootstrap interval), the median time from the call to
the last token (the client's clock), the bytes; per point: the best split against the best other
forced case (the planner's previous choice set: every action but a split), and the planner
against the best forced case (goal: within 10%).
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


def splits_for(S: int) -> list[int]:
    """l in {256, S/2 rounded down to 256}, below S."""
    return sorted({l for l in (EXEC_BLOCK, S // 2 // EXEC_BLOCK * EXEC_BLOCK) if 0 < l < S})


def cases_for(L: int, S: int, cuts: list[int], codecs: list[str]) -> list[dict]:
    cases = [{"action": [codec, L], "schedule": CHUNKED, "role": "whole"} for codec in codecs]
    cases += [{"action": [codec, c], "schedule": CHUNKED, "role": "joint"}
              for codec in codecs for c in cuts]
    cases += [{"action": [codec, c, "bf16", l], "schedule": CHUNKED, "role": "split"}
              for codec in codecs for c in cuts for l in splits_for(S)]
    return [*cases, {"action": None, "schedule": None, "role": "planner"}]


def point_summary(rows: list[dict]) -> dict:
    forced = [r for r in rows if r["role"] != "planner"]
    planner = next(r for r in rows if r["role"] == "planner")
    best = min(forced, key=lambda r: r["median_ms"])
    split = min((r for r in forced if r["role"] == "split"), key=lambda r: r["median_ms"])
    other = min((r for r in forced if r["role"] != "split"), key=lambda r: r["median_ms"])

    def brief(r: dict) -> dict:
        return {"label": r["label"], "median_ms": r["median_ms"],
                "last_token_ms": r["last_token_median_ms"]}

    return {"best": brief(best), "best_split": brief(split), "best_other": brief(other),
            "split_over_other": split["median_ms"] / other["median_ms"],
            "split_over_other_last_token": (split["last_token_median_ms"]
                                            / other["last_token_median_ms"]),
            "planner": {**brief(planner), "picks": planner["picks"]},
            "planner_over_best": planner["median_ms"] / best["median_ms"],
            "planner_within_10pct": planner["median_ms"] <= 1.1 * best["median_ms"]}


def run(args) -> dict:
    return forced.sweep(args, "token_split",
                        lambda L, S, cuts: cases_for(L, S, cuts, args.codecs), point_summary,
                        measures=("bench/token_split.py",))


def markdown(result: dict) -> str:
    lines = [*forced.heading("KVPR's token split", result),
             *forced.best_against_other(result, "split", "best_split", "split_over_other")]
    return "\n".join([*lines, "", *forced.every_case(result)]) + "\n"


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if min(args.prompt_len) <= EXEC_BLOCK:
        parser.error(f"--prompt-len: a split needs prompts longer than {EXEC_BLOCK} tokens")


def main(argv: list[str] | None = None) -> int:
    args = forced.parse_args(__doc__.split("\n\n")[0], argv, _check)
    return forced.main(args, run, markdown)


if __name__ == "__main__":
    sys.exit(main())
