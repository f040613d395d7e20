"""`rekv bench link`: the real services across an emulated cross-node link, every action timed.

The prefill and decode services run in two network namespaces joined by a veth pair shaped with
`tc tbf` (`netns.EmulatedLink`); gRPC and UCX (TCP) both cross it. Without root (or `ip`/`tc`), it
says so and runs both services on loopback instead, with the prefill side pacing its UCX sends to
the link rate (`--pace-gbps`). There is no delay or loss emulation (this kernel has no `netem`).

For each prompt length S and link rate (Gb/s, or xK: K times S's balanced rate, at which all layers'
BF16 KV takes as long on the link as computing all layers), a client inside the decode namespace
(`link_client`) sends, per action: W warm-up and N timed requests with one new token. Actions: full
BF16, int8 transfer-only, BF16 recompute and joint int8 at each cut of the sweep, token-only, then
the planner's own choice (no forced action). Where the machine has two cores or more, each
service is pinned to its own half of them (`taskset`), with as many torch threads as cores, and
the balanced rate is measured under the same pinning: two nodes do not share cores, and without
the pinning the decode side's recompute and the prefill side's encoding and sends would compete.
Per point it reports medians with 95% bootstrap intervals of the measured handoff time (the end
of the prefill to the complete cache on the decode worker), speedups over full BF16, the best
action, and whether the planner's pick is within 10% of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rekv_core.bench.handoff import LinkRate, prompt_ids, time_compute_all
from rekv_core.bench.machine import machine_info
from rekv_core.bench.netns import DECODE_ADDRESS, PREFILL_ADDRESS, EmulatedLink, unavailable
from rekv_core.bench.stats import median_ci
from rekv_core.handoff import Action
from rekv_core.handoff.action import wire_bytes
from rekv_core.model import Model

# Both services share one host, so UCX would otherwise move bulk data through shared memory and
# around the shaped veth pair.
TCP_ONLY = {"UCX_TLS": "tcp"}
SINGLE_MECHANISMS = ("bf16_transfer", "quant_transfer", "bf16_recompute", "token_recompute")


@dataclass
class LinkBenchConfig:
    prompt_lens: Sequence[int] = (256, 1024)
    rates: Sequence[LinkRate] = (LinkRate(1, True), LinkRate(4, True), LinkRate(10, False))
    cuts: Sequence[int] | None = None  # default: L·{0.3, 0.5, 0.7}
    warmups: int = 3
    runs: int = 10
    service_args: list[str] = field(default_factory=list)
    log_dir: str | None = None
    loopback: bool = False  # skip the namespaces even where they can be made
    pin: bool = True  # each service on its own half of the cores (where there are two or more)


def split_cores(cores: Sequence[int]) -> tuple[list[int], list[int]] | None:
    """(prefill's cores, decode's cores): the first half and the rest; None below two cores."""
    cores = sorted(cores)
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return cores[:half], cores[half:]


def _taskset(cores: Sequence[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores))] if cores else []


@contextlib.contextmanager
def pinned(cores: Sequence[int] | None):
    """This process on `cores` with as many torch threads, restored on exit (no-op for None)."""
    if not cores:
        yield
        return
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def default_cuts(num_layers: int) -> list[int]:
    return sorted({round(num_layers * f) for f in (0.3, 0.5, 0.7)})


def forced_actions(num_layers: int, cuts: Sequence[int]) -> list[list | None]:
    L = num_layers
    actions: list = [["bf16", L], ["int8", L], ["bf16", 0]]
    actions += [["bf16", c] for c in cuts] + [["int8", c] for c in cuts]
    return [*actions, None]  # None: the planner chooses


def run_link_bench(model: Model, config: LinkBenchConfig,
                   progress: Callable[[str], None] = lambda _: None) -> dict:
    """The sweep. SIGTERM ends it like Ctrl-C: the services stop and the namespaces go."""
    if threading.current_thread() is not threading.main_thread():
        return _run(model, config, progress)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(model, config, progress)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _run(model: Model, config: LinkBenchConfig, progress: Callable[[str], None]) -> dict:
    from services.launcher import ServicePair

    shape = model.shape
    L = shape.num_layers
    cuts = list(config.cuts or default_cuts(L))
    actions = forced_actions(L, cuts)
    sides = split_cores(os.sched_getaffinity(0)) if config.pin else None
    prefill_cores, decode_cores = sides or (None, None)
    own_threads = "--torch-threads" not in config.service_args
    service_args = {role: [*config.service_args,
                           *(["--torch-threads", str(len(cores))] if cores and own_threads else [])]
                    for role, cores in (("prefill", prefill_cores), ("decode", decode_cores))}
    balanced = {}
    for S in config.prompt_lens:
        with pinned(decode_cores):
            compute = time_compute_all(model, prompt_ids(shape.vocab_size, S, 0))
        balanced[S] = wire_bytes(Action.full_bf16(L), shape, S).prefix * 8 / compute / 1e9
        progress(f"S={S}: all layers compute in {compute * 1e3:.0f} ms, balanced link "
                 f"{balanced[S]:.3f} Gb/s")
    why_not = "loopback requested" if config.loopback else unavailable()
    first_rate = config.rates[0].gbps(balanced[config.prompt_lens[0]])
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="rekv-link-"))
    rows, points = [], []
    link = None if why_not else EmulatedLink(first_rate)
    pair = None
    try:
        if link:
            progress(f"emulated link: namespaces {link.prefill_ns} and {link.decode_ns}, veth "
                     f"shaped with tc tbf")
            pair = ServicePair(
                [*service_args["prefill"], "--host", PREFILL_ADDRESS],
                [*service_args["decode"], "--host", DECODE_ADDRESS], log_dir=log_dir,
                prefill_prefix=[*link.prefix("prefill"), *_taskset(prefill_cores)],
                decode_prefix=[*link.prefix("decode"), *_taskset(decode_cores)], env=TCP_ONLY)
            client_prefix = link.prefix("decode")
        else:
            progress(f"no emulated link ({why_not}): loopback with paced UCX sends instead")
            client_prefix = []
        for rate in config.rates:
            for S in config.prompt_lens:
                gbps = rate.gbps(balanced[S])
                if link:
                    link.set_rate(gbps)
                else:
                    if pair is not None:
                        pair.stop()
                    pair = ServicePair([*service_args["prefill"], "--pace-gbps", f"{gbps}"],
                                       service_args["decode"], log_dir=log_dir,
                                       prefill_prefix=_taskset(prefill_cores),
                                       decode_prefix=_taskset(decode_cores))
                started = time.perf_counter()
                results = _run_client(client_prefix, pair.decode_address, S, shape.vocab_size,
                                      actions, config)
                point_rows = [_row(shape, S, rate, gbps, r, L) for r in results]
                for row in point_rows:
                    row["speedup_vs_bf16"] = point_rows[0]["median_ms"] / row["median_ms"]
                rows += point_rows
                points.append(_point_summary(S, rate, gbps, point_rows, balanced[S]))
                progress(f"S={S} link {rate.label} ({gbps:.3f} Gb/s): best "
                         f"{points[-1]['best']['label']} {points[-1]['best']['median_ms']:.1f} "
                         f"ms, planner {points[-1]['planner']['label']} "
                         f"{points[-1]['planner']['median_ms']:.1f} ms "
                         f"({time.perf_counter() - started:.0f} s)")
        codes, pair = (pair.stop() if pair else {}), None
    finally:
        if pair is not None:  # an error or a signal: stop the services before their namespaces go
            pair.stop()
        if link:
            link.close()
    return {"meta": {**machine_info(model.device, model.dtype, torch.get_num_threads()),
                     "model": shape.name,
                     "num_layers": L,
                     "warmups": config.warmups, "runs": config.runs, "cuts": cuts,
                     "link": "veth + tc tbf in two network namespaces" if not why_not
                     else f"loopback, paced UCX sends ({why_not})",
                     "delay_emulation": "none: this kernel has no netem",
                     "service_exit_codes": codes, "logs": str(log_dir),
                     "service_cores": {"prefill": prefill_cores, "decode": decode_cores},
                     "service_args": service_args},
            "balanced_gbps": balanced, "rows": rows, "points": points}


def _run_client(prefix, address, S, vocab, actions, config) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = out.name
    command = [*prefix, sys.executable, "-m", "rekv_core.bench.link_client", "--decode", address,
               "--prompt-len", str(S), "--vocab", str(vocab), "--actions", json.dumps(actions),
               "--warmups", str(config.warmups), "--runs", str(config.runs), "--out", path]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"link client failed: {result.stderr[-3000:]}")
    data = json.loads(Path(path).read_text())
    Path(path).unlink()
    return data


def _label(kind: str, codec: str, cut: int) -> str:
    return {"bf16_transfer": "BF16", "quant_transfer": f"{codec} only",
            "token_recompute": "tokens"}.get(kind, f"{'BF16' if codec == 'bf16' else codec} c={cut}")


def _row(shape, S, rate, gbps, result, L) -> dict:
    median, (low, high) = median_ci(result["samples_ms"])
    kind, codec, cut = result["used"][-1]
    planner = result["forced"] is None
    return {"model": shape.name, "prompt_len": S, "link": rate.label, "link_gbps": gbps,
            "action": kind, "codec": codec, "cut": cut, "planner": planner,
            "label": ("planner: " if planner else "") + _label(kind, codec, cut),
            "picks": sorted({tuple(u) for u in result["used"]}) if planner else None,
            "bytes": wire_bytes(Action(codec, cut, L), shape, S).total,
            "median_ms": median, "ci95_ms": [low, high],
            "predicted_ms": statistics.median(result["predicted_ms"]),
            "parts_median_ms": {part: statistics.median(p[part] for p in result["parts_ms"])
                                for part in ("Q", "H", "X", "R", "J")},
            "samples_ms": result["samples_ms"], "fallbacks": result["fallbacks"]}


def _point_summary(S, rate, gbps, rows, balanced) -> dict:
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

    within = planner["median_ms"] <= 1.1 * best["median_ms"]
    return {"prompt_len": S, "link": rate.label, "link_gbps": gbps,
            "bf16_over_balanced": gbps / balanced, "best": brief(best),
            "best_single": brief(best_single), "planner": brief(planner),
            "planner_within_10pct": within,
            "planner_over_best": planner["median_ms"] / best["median_ms"],
            "joint_int8_speedup_vs_bf16": bf16["median_ms"] / best_joint["median_ms"]
            if best_joint else None,
            "joint_int8_speedup_vs_best_single": best_single["median_ms"] / best_joint["median_ms"]
            if best_joint else None}


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
        ax.set_ylabel("handoff time / full BF16")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{results['meta']['model']}: measured handoff time normalized to full BF16 "
                 f"({results['meta']['link']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
