"""The planner cold, at link rates and prompt lengths drawn at random: is its first request safe and
is it near the best action from its second request on?

    python bench/planner_cold.py [--points 4] [--seed N] [--planner-requests 6] [--runs 3]
        [--rates 0.03,10] [--lengths 200,1500] [--json FILE] [--markdown FILE]

For each of `--points` points, a link rate log-uniform in `--rates` (Gb/s) and a prompt length
uniform in `--lengths`, both drawn from a seed that is itself random unless given (and recorded), so
the points are not those of any committed sweep or test: fresh prefill and decode services (nothing
learned yet; each pinned to its own core) start across an emulated link (two network namespaces
joined by a veth pair shaped with `tc tbf`; as root, else loopback with paced sends), and a client
in the decode namespace first sends `--planner-requests` requests with no forced action or schedule
(the planner asked before anything else has run), then, per forced action of `CASES` under the
default (streamed) schedule, BF16 and int8 at L/2 pipelined (the prefill in token chunks) and the
baseline (full prefill, then every layer's BF16 KV), one warm-up and `--runs` timed requests. Every
time is TTFT from arrival on the decode worker (`Summary.ttft_ms`). Per point: the first request
against full BF16 transfer (the baseline and streamed); the first request's action timed warm
against the baseline (when it is one of `CASES`: the choice without the first request's cold cost);
the median of requests 2.. against the best forced median; and the actions chosen. Fresh services
are told apart from warm ones by more than the choice: a first request runs code and allocations no
request has run yet.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rekv_cli.bench.link.netns import EmulatedLink, unavailable  # noqa: E402
from rekv_cli.bench.link.sweep import (  # noqa: E402
    LinkBenchConfig,
    run_client,
    service_layout,
    start_services,
)
from rekv_cli.bench.machine import cpu_model  # noqa: E402
from rekv_cli.bench.provenance import LINK, provenance  # noqa: E402
from rekv_cli.launcher import ServicePair  # noqa: E402
from rekv_cli.util import write_json  # noqa: E402
from rekv_core.model.shapes import DEFAULT_MODEL, get_preset  # noqa: E402

# what the figures measure (`provenance`): the services across the emulated link, the
# planner asked first
MEASURES = (*LINK, "bench/planner_cold.py")

L = get_preset(DEFAULT_MODEL).num_layers
STREAMED = None  # the services' default schedule
BASELINE = {"action": ["bf16", L], "schedule": [False, 0]}
CASES = [BASELINE] + [{"action": a, "schedule": STREAMED} for a in (
    ["bf16", L], ["int8", L], ["bf16", 0], ["bf16", L // 2], ["int8", L // 4], ["int8", L // 2],
    ["int8", 3 * L // 4])] + [
    {"action": a, "schedule": [True, 256, True]} for a in (["bf16", L // 2], ["int8", L // 2])]


def draw_points(seed: int, count: int, rates: tuple[float, float], lengths: tuple[int, int]
                ) -> list[dict]:
    rng = random.Random(seed)
    low, high = math.log(rates[0]), math.log(rates[1])
    return [{"link_gbps": round(math.exp(rng.uniform(low, high)), 4),
             "prompt_len": rng.randint(*lengths)} for _ in range(count)]


def client(prefix: list[str], address: str, S: int, cases: list[dict], warmups: int, runs: int,
           seed: int) -> list[dict]:
    return run_client(prefix, address, S, get_preset(DEFAULT_MODEL).vocab_size, cases,
                      LinkBenchConfig(warmups=warmups, runs=runs), seed)


def services(link: EmulatedLink | None, gbps: float, args, log_dir: Path) -> ServicePair:
    cores, service_args = service_layout(["--dtype", args.dtype])
    return start_services(service_args, log_dir, cores, link=link, pace_gbps=gbps)


def run_point(point: dict, args, log_dir: Path, index: int) -> dict:
    why_not = unavailable()
    link = None if why_not else EmulatedLink(point["link_gbps"])
    pair = None
    try:
        pair = services(link, point["link_gbps"], args, log_dir / f"point-{index}")
        prefix = link.prefix("decode") if link else []
        S = point["prompt_len"]
        planner = client(prefix, pair.decode_address, S, [{"action": None, "schedule": None}],
                         0, args.planner_requests, index)[0]
        forced = client(prefix, pair.decode_address, S, CASES, 1, args.runs, index)
    finally:
        codes = pair.stop() if pair else {}
        if link:
            link.close()
    return summarize_point(point, planner, forced, codes, why_not)


def schedule_label(used: list) -> str:
    """How a request's handoff went, from the client's `used` entry."""
    streamed, pipelined = used[3], len(used) > 6 and used[6]
    return "pipelined" if pipelined else "streamed" if streamed else "seed"


def summarize_point(point: dict, planner: dict, forced: list[dict], codes: dict,
                    why_not: str | None) -> dict:
    medians = [{"action": f["forced"], "schedule": schedule_label(f["used"][-1]),
                "median_ms": statistics.median(f["samples_ms"])} for f in forced]
    best = min(medians, key=lambda m: m["median_ms"])
    baseline, streamed_bf16 = medians[0]["median_ms"], medians[1]["median_ms"]
    samples = planner["samples_ms"]
    later = statistics.median(samples[1:])
    first_action = planner["used"][0][1:3]
    warm_first = next((m["median_ms"] for m, f in zip(medians, forced)
                       if f["schedule"] is None and m["action"] == first_action), None)
    return {**point, "link": "veth + tc tbf" if why_not is None else f"paced ({why_not})",
            "planner_ms": samples, "planner_actions": [u[1:3] for u in planner["used"]],
            "first_ms": samples[0], "first_over_baseline": samples[0] / baseline,
            "first_over_streamed_bf16": samples[0] / streamed_bf16,
            # the first request's action timed warm, when it is one of CASES: the choice itself,
            # without the first request's cold cost
            "first_action_warm_over_baseline": None if warm_first is None
            else warm_first / baseline,
            "later_median_ms": later, "later_over_best": later / best["median_ms"],
            "best": best, "forced": medians, "exit_codes": codes,
            "first_ok": samples[0] <= baseline, "later_ok": later <= 1.1 * best["median_ms"]}


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = ["# The planner cold, at random points", "",
             f"Machine: {meta['machine']}; commit {meta['commit']}; seed {meta['seed']}; "
             f"`{meta['command']}`", "",
             "| Gb/s | S | link | 1st ms | 1st / baseline | 1st's action warm / baseline "
             "| 1st / streamed BF16 | 2nd.. median ms | / best forced | best forced "
             "| planner's actions |", "|---|" * 1 + "---|" * 10]
    for p in results["points"]:
        best = p["best"]
        acts = ", ".join(f"{c}/{k}" for c, k in p["planner_actions"])
        warm = p["first_action_warm_over_baseline"]
        lines.append(f"| {p['link_gbps']:.3g} | {p['prompt_len']} | {p['link']} | "
                     f"{p['first_ms']:.0f} | {p['first_over_baseline']:.2f} | "
                     f"{'-' if warm is None else f'{warm:.2f}'} | "
                     f"{p['first_over_streamed_bf16']:.2f} | {p['later_median_ms']:.0f} | "
                     f"{p['later_over_best']:.2f} | {best['action']} {best['schedule']} "
                     f"{best['median_ms']:.0f} | {acts} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    started = provenance(measures=MEASURES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=4)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--planner-requests", type=int, default=6)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rates", type=lambda t: tuple(map(float, t.split(","))),
                        default=(0.03, 10.0))
    parser.add_argument("--lengths", type=lambda t: tuple(map(int, t.split(","))),
                        default=(200, 1500))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--markdown", metavar="FILE")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="rekv-cold-"))
    points = [run_point(p, args, log_dir, i)
              for i, p in enumerate(draw_points(seed, args.points, args.rates, args.lengths))]
    results = {"meta": {**started, "machine": cpu_model(), "seed": seed,
                        "command": "python bench/planner_cold.py " + " ".join(sys.argv[1:]),
                        "dtype": args.dtype, "model": DEFAULT_MODEL, "cases": CASES},
               "points": points,
               "first_never_worse_than_baseline": all(p["first_ok"] for p in points),
               "later_within_10pct": sum(p["later_ok"] for p in points)}
    text = markdown(results)
    print(text)
    write_json(args.json, results, indent=1)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
