"""Lynx's progressive streams across the emulated link: TTFT and the time to the 8th token against
the same int8 action sent in one stream, the other forced actions, and the planner with Lynx among
its actions.

    python bench/lynx.py [--model M] [--dtype float32] [--prompt-len 512,2048]
        [--link-gbps x1,x4,10] [--cuts 12,21] [--codecs int8,bf16] [--new-tokens 8]
        [--warmups 1] [--runs 3] [--json FILE] [--markdown FILE]

Both services run as `rekv bench link` runs them (two network namespaces joined by a veth pair
shaped with `tc tbf`, UCX over TCP only, each service pinned to its own half of the cores; without
root, loopback with paced UCX sends), with the services' defaults otherwise (streamed handoffs,
the boundary in 256-token chunks, Lynx's streams offered). Per prompt length S and link rate
(Gb/s, or xK: K times S's balanced rate, at which every layer's BF16 KV takes as long on the link
as computing every layer), the cases, every one once per round in an order shuffled each round:

- each codec sent whole (transfer-only, c = L), and each codec's joint action at each cut;
- int8 whole and at each cut as Lynx's streams (every layer's anchor before any residual);
- the planner's choice (no forced action), Lynx among its candidates.

Each call generates `--new-tokens` greedy tokens (EOS ignored). Reported per case: TTFT from
Generate's arrival on the decode worker (median, 95% bootstrap interval), the median time from the
call to the last token (the client's clock), the bytes, and for Lynx the drafts made and accepted
(the decode worker's log); per point: each Lynx case against the same int8 action in one stream,
the best Lynx case against the best other forced case (the planner's previous choice set), and the
planner against the best forced case (goal: within 10%).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rekv_cli.bench.link import forced  # noqa: E402
from rekv_core.model.blocks import EXEC_BLOCK  # noqa: E402

CHUNKED = [True, EXEC_BLOCK]  # the services' default schedule: streamed, the boundary in chunks


def cases_for(L: int, cuts: list[int], codecs: list[str]) -> list[dict]:
    cases = [{"action": [codec, c], "schedule": CHUNKED, "role": "one stream"}
             for codec in codecs for c in [L, *cuts]]
    cases += [{"action": ["int8", c, "bf16", 0, True], "schedule": CHUNKED, "role": "lynx"}
              for c in [L, *cuts]]
    return [*cases, {"action": None, "schedule": None, "role": "planner"}]


def point_summary(rows: list[dict]) -> dict:
    forced = [r for r in rows if r["role"] != "planner"]
    planner = next(r for r in rows if r["role"] == "planner")
    best = min(forced, key=lambda r: r["median_ms"])
    lynx = min((r for r in forced if r["role"] == "lynx"), key=lambda r: r["median_ms"])
    other = min((r for r in forced if r["role"] != "lynx"), key=lambda r: r["median_ms"])

    def brief(r: dict) -> dict:
        return {"label": r["label"], "median_ms": r["median_ms"],
                "last_token_ms": r["last_token_median_ms"]}

    def same_int8(r: dict) -> dict:
        return next(o for o in forced if o["role"] != "lynx" and o["codec"] == "int8"
                    and o["cut"] == r["cut"])

    versus_int8 = [{"cut": r["cut"], "ttft": r["median_ms"] / same_int8(r)["median_ms"],
                    "last_token": (r["last_token_median_ms"]
                                   / same_int8(r)["last_token_median_ms"]),
                    "drafted": r.get("drafted"), "accepted": r.get("accepted")}
                   for r in forced if r["role"] == "lynx"]
    return {"best": brief(best), "best_lynx": brief(lynx), "best_other": brief(other),
            "lynx_over_int8": versus_int8,
            "lynx_over_other": lynx["median_ms"] / other["median_ms"],
            "lynx_over_other_last_token": (lynx["last_token_median_ms"]
                                           / other["last_token_median_ms"]),
            "planner": {**brief(planner), "picks": planner["picks"]},
            "planner_over_best": planner["median_ms"] / best["median_ms"],
            "planner_within_10pct": planner["median_ms"] <= 1.1 * best["median_ms"]}


def drafts_in_log(log: Path, S: int, number: int, warmups: int) -> tuple[int, int] | None:
    """(drafted, accepted) over the timed calls of case `number` at S (the decode worker's log)."""
    if not log.exists():
        return None
    pattern = re.compile(rf"request=link-{S}-{number}-(\d+) lynx drafted=(\d+) "
                         rf"accepted=(\d+)")
    found = [(int(m[2]), int(m[3])) for m in pattern.finditer(log.read_text())
             if int(m[1]) >= warmups]
    return (sum(d for d, _ in found), sum(a for _, a in found)) if found else None


def run(args) -> dict:
    def annotate(r: dict, number: int, S: int, log_dir: Path) -> None:
        drafts = drafts_in_log(log_dir / "decode.log", S, number, args.warmups)
        r["drafted"], r["accepted"] = drafts or (None, None)

    return forced.sweep(args, "lynx", lambda L, S, cuts: cases_for(L, cuts, args.codecs),
                        point_summary, annotate, measures=("bench/lynx.py",))


def markdown(result: dict) -> str:
    lines = [*forced.heading("Lynx's progressive streams", result),
             "Lynx against the same int8 action in one stream (TTFT ratio, last-token ratio, "
             "drafts accepted/made over the timed calls):", "",
             "| S | link | Gb/s | cut | TTFT lynx/int8 | last token lynx/int8 | accepted/drafted |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in result["points"]:
        for v in p["lynx_over_int8"]:
            drafts = (f"{v['accepted']}/{v['drafted']}" if v["drafted"] is not None else "-")
            lines.append(f"| {p['prompt_len']} | {p['link']} | {p['link_gbps']:.3f} | {v['cut']} "
                         f"| {v['ttft']:.2f} | {v['last_token']:.2f} | {drafts} |")
    lines += ["", "The best Lynx case against the best other forced case, and the planner:", "",
              *forced.best_against_other(result, "lynx", "best_lynx", "lynx_over_other")]
    return "\n".join([*lines, "", *forced.every_case(result)]) + "\n"


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if min(args.prompt_len) < 1:
        parser.error("--prompt-len: positive")


def main(argv: list[str] | None = None) -> int:
    args = forced.parse_args(__doc__.split("\n\n")[0], argv, _check)
    return forced.main(args, run, markdown)


if __name__ == "__main__":
    sys.exit(main())
