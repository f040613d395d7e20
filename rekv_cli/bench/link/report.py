"""`rekv bench link`'s results: one row per (point, case) from the client's samples, one summary
per point, and the Fig. 2-style plot.

Every time is TTFT from Generate's arrival on the decode worker to its first token. A point's
summary compares, each by its best case: (a) the baseline (full prefill, then every layer's BF16
KV), (b) the seed's schedule (full prefill, then the overlapped handoff), (c) the streamed schedule
with the boundary in one message, (d) streamed with the boundary in chunks (layer order), (d') the
same pipelined (token order: the prefill runs in the boundary's chunks, each sent as it passes the
cut), (e) the decode side's own prefill (token-only, streamed: the prefill service computes nothing;
the colocated bound plus one RPC), also as the median ratio of the samples of the same round
(`paired`: the client runs every case once per round); and the planner against the best forced case,
joint int8 against full BF16 and against the best single mechanism; with newer codecs in the sweep,
how each moved the best forced case (`codec_gains`).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rekv_cli.bench.handoff import LinkRate
from rekv_cli.bench.stats import median_ci, paired_ratio
from rekv_cli.bench.ttft import BASE_CODECS, Way, codec_gains
from rekv_core.handoff import Action
from rekv_core.handoff.action import wire_bytes
from rekv_core.model.shapes import ModelShape

SINGLE_MECHANISMS = ("bf16_transfer", "quant_transfer", "bf16_recompute", "token_recompute")
INTERIOR = ("joint", "bf16_recompute", "token_split")  # kinds with a boundary
LINK_PAIRED = (("(d)/(e)", "chunked_over_local"), ("(a)/(d)", "baseline_over_chunked"),
               ("(b)/(d)", "seed_over_chunked"), ("(d')/(e)", "pipelined_over_local"),
               ("(a)/(d')", "baseline_over_pipelined"), ("(b)/(d')", "seed_over_pipelined")
               )  # the ratios a point gives both ways


def _label(kind: str, codec: str, cut: int) -> str:
    if kind in ("bf16_transfer", "quant_transfer") and codec != "bf16":
        return f"{codec} only"
    interior = f"{'BF16' if codec == 'bf16' else codec} c={cut}"
    return {"bf16_transfer": "BF16", "quant_transfer": f"{codec} only",
            "token_recompute": "tokens"}.get(kind, interior)


def schedule_class(streamed: bool, chunk_tokens: int, pipelined: bool = False) -> Way:
    if not streamed:
        return Way.SEED
    if pipelined:
        return Way.PIPELINED
    return Way.CHUNKED if chunk_tokens else Way.STREAMED


def row(shape: ModelShape, S: int, rate: LinkRate, gbps: float, result: dict) -> dict:
    """One action at one point, from the client's results for it."""
    median, (low, high) = median_ci(result["samples_ms"])
    kind, codec, cut, streamed, chunk, boundary, *order = result["used"][-1]
    split = order[1] if len(order) > 1 else 0  # a token split's l (clients since issue 30)
    lynx = bool(order[2]) if len(order) > 2 else False  # Lynx's streams (since issue 30)
    inputs = order[3] if len(order) > 3 else 0  # KVPR's per-layer form's l (since issue 30)
    planner = result["forced"] is None
    schedule = schedule_class(streamed, chunk if kind in INTERIOR else 0, bool(order and order[0]))
    return {"model": shape.name, "prompt_len": S, "link": rate.label, "link_gbps": gbps,
            "action": kind, "codec": codec, "cut": cut, "planner": planner,
            "schedule": schedule.value, "chunk_tokens": chunk,
            "boundary": boundary,
            "label": ("planner: " if planner else "") + _label(kind, codec, cut)
            + ("+zb" if boundary != "bf16" else "") + (f" l={split}" if split else "")
            + ("+lynx" if lynx else "") + (f"+ls{inputs}" if inputs else "")
            + f" {schedule.value}",
            "picks": sorted({tuple(u) for u in result["used"]}) if planner else None,
            "split": split, "progressive": lynx, "layer_split": inputs,
            "bytes": wire_bytes(Action(codec, cut, shape.num_layers, boundary, split, lynx,
                                       inputs), shape, S).total,
            "median_ms": median, "ci95_ms": [low, high],
            "predicted_ms": statistics.median(result["predicted_ms"]),
            "parts_median_ms": {part: statistics.median(p[part] for p in result["parts_ms"])
                                for part in ("Q", "H", "X", "R", "J")},
            "samples_ms": result["samples_ms"], "fallbacks": result["fallbacks"],
            "handoff_median_ms": statistics.median(result["handoff_ms"]),
            # with several new tokens: the call to the last token, the client's clock
            "last_token_ms": result.get("last_token_ms") or None}


def point_summary(S: int, rate: LinkRate, gbps: float, rows: list[dict], balanced: float
                  ) -> dict:
    forced = [r for r in rows if not r["planner"]]
    planner = next(r for r in rows if r["planner"])
    best = min(forced, key=lambda r: r["median_ms"])
    singles = [r for r in forced if r["action"] in SINGLE_MECHANISMS]
    best_single = min(singles, key=lambda r: r["median_ms"])
    joints = [r for r in forced if r["action"] == "joint"]
    best_joint = min(joints, key=lambda r: r["median_ms"]) if joints else None
    bf16 = forced[0]

    def brief(r):
        return {"label": r["label"], "action": r["action"], "codec": r["codec"], "cut": r["cut"],
                "median_ms": r["median_ms"]}

    def best_of(way: Way) -> dict:
        """The seed's: any action; streamed: transfer-only, or an interior cut with the boundary
        in one message; chunked: an interior cut with the boundary in chunks, in layer order;
        pipelined: the same in token order. None: no such case."""
        def member(r: dict) -> bool:
            return r["schedule"] == way.value and r["action"] != "token_recompute"
        return min(filter(member, forced), key=lambda r: r["median_ms"], default=None)

    way_rows = {"baseline": bf16, "seed": best_of(Way.SEED), "streamed": best_of(Way.STREAMED),
                "chunked": best_of(Way.CHUNKED), "pipelined": best_of(Way.PIPELINED),
                "local_prefill": next(r for r in forced if r["action"] == "token_recompute")}
    way_rows = {way: r for way, r in way_rows.items() if r is not None}
    ways = {way: brief(r) for way, r in way_rows.items()}
    ratios, pairs = {}, {}
    for way in ("chunked", "pipelined"):
        if way not in way_rows:
            continue
        for numerator, denominator, key in (
                (way, "local_prefill", f"{way}_over_local"),
                ("baseline", way, f"baseline_over_{way}"), ("seed", way, f"seed_over_{way}")):
            ratios[key] = ways[numerator]["median_ms"] / ways[denominator]["median_ms"]
            ratio, (low, high) = paired_ratio(way_rows[numerator]["samples_ms"],
                                              way_rows[denominator]["samples_ms"])
            pairs[key] = {"median": ratio, "ci95": [low, high]}

    within = planner["median_ms"] <= 1.1 * best["median_ms"]
    return {"prompt_len": S, "link": rate.label, "link_gbps": gbps, "ways": ways,
            "paired": pairs, **ratios,
            "bf16_over_balanced": gbps / balanced, "best": brief(best),
            "best_single": brief(best_single), "planner": brief(planner),
            "planner_within_10pct": within,
            "planner_over_best": planner["median_ms"] / best["median_ms"],
            "joint_int8_speedup_vs_bf16": bf16["median_ms"] / best_joint["median_ms"]
            if best_joint else None,
            "joint_int8_speedup_vs_best_single": best_single["median_ms"] / best_joint["median_ms"]
            if best_joint else None,
            "codec_gains": codec_gains(forced) if any(
                r["cut"] and (r["codec"] not in BASE_CODECS or r["boundary"] != "bf16")
                for r in forced) else None}


def plot(results: dict, path: str | Path) -> None:
    """One panel per link rate label: handoff time normalized to full BF16, grouped by S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    links = list(dict.fromkeys(r["link"] for r in rows))
    lengths = list(dict.fromkeys(r["prompt_len"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4.2), squeeze=False)
    for ax, link in zip(axes[0], links):
        labels = list(dict.fromkeys(r["label"] if not r["planner"] else "planner"
                                    for r in rows if r["link"] == link))
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            heights, errors = [], []
            for S in lengths:
                point = [r for r in rows if r["link"] == link and r["prompt_len"] == S]
                bf16 = point[0]["median_ms"]
                row = next((r for r in point if (r["label"] if not r["planner"] else "planner")
                            == label), None)
                heights.append(row["median_ms"] / bf16 if row else 0)
                errors.append([(row["median_ms"] - row["ci95_ms"][0]) / bf16 if row else 0,
                               (row["ci95_ms"][1] - row["median_ms"]) / bf16 if row else 0])
            xs = [j + i * width for j in range(len(lengths))]
            ax.bar(xs, heights, width, label=label,
                   yerr=list(zip(*errors)) if errors else None, capsize=2,
                   hatch="//" if label == "planner" else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))])
        ax.set_xticklabels([f"S={S}" for S in lengths])
        ax.set_title(f"link {link}")
        ax.set_ylabel("TTFT / full prefill + BF16 transfer")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{results['meta']['model']}: TTFT normalized to full prefill + BF16 transfer "
                 f"({results['meta']['link']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
