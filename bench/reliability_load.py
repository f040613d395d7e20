"""Reliability under load: a burst of concurrent Generate streams, then a long mixed run, against
the two services as real processes (`ServicePair`, the embedded model smollm2-135m in BF16).

    python bench/reliability_load.py [--requests 1000] [--concurrency 8] [--burst 32] [--seed 0]
        [--batching invariant|shared] [--max-new-tokens 4,8] [--prompt-tokens 16,256]
        [--prompts 100] [--deadline-s 120] [--torch-threads 1] [--env MALLOC_ARENA_MAX=2]
        [--json FILE] [--markdown FILE]

One pair of services serves every phase:
1. burst: `--burst` streams opened at once (client threads released together by a barrier), each a
   real request; reported with the most streams the client saw open at one moment and the decode
   service's peak `rekv_queue_depth`.
2. sustained: `--requests` requests, `--concurrency` at a time, in a seeded shuffled order that
   mixes the forced actions of `MIX` (full BF16 transfer, lossless BF16 joint at the middle cut,
   int8 joint there, token-only, the planner's choice) over a pool of `--prompts` WikiText-2
   prompts (token ids; lengths log-uniform in `--prompt-tokens`), each asking for a number of new
   tokens uniform in `--max-new-tokens` (greedy, no stop at EOS). Every `SAMPLE_EVERY` completed
   requests, each service's VmRSS and thread count (/proc/<pid>/status) and its
   `process_resident_memory_bytes`.
3. end: the `rekv_transport_pending` and `rekv_handoffs_in_flight` gauges of both services, read
   until they are 0 (at most `SETTLE_S`), thread counts, what holds each process's resident memory
   (/proc/<pid>/smaps by kind of mapping), then SIGTERM and both exit codes.
4. correctness, once the services have stopped (their CPU is free again): every completed request
   whose action was lossless (BF16 at any cut, token-only, a fallback) and whose index is a
   multiple of `--check-every`, against `greedy_generate` on the same weights, dtype and torch
   thread count; one reference per prompt, its longest continuation (on the CPU a decode step
   attends only to the filled positions, so a shorter run is a prefix of a longer one). The
   services run batch-invariant (`--batching invariant`, the default), where that agreement is
   their promise under any load, and a mismatch fails the run; `--batching shared` measures their
   default batching, whose mismatches (near-ties) are reported and do not fail it.

A request ends "OK", with a gRPC status name (failed, counted by status), or "LOST": no end within
its deadline plus `LOST_GRACE_S`, or a stream that ended without a status but without its summary
or all its tokens. TTFT and handoff time come from the summary (the decode service's clock:
`ttft_ms` from Generate's arrival, `measured_handoff_ms`); `client_ms` is the whole call on the
client. Throughput: completed requests (and generated tokens) per second of the phase's wall time.

Defaults, chosen on a 2-core machine (bench/results/reliability-load.md has the figures): one torch
thread per service: the two processes then hold one core each for their compute, the decode service
still runs several requests' steps at once on its asyncio worker threads, and no OpenMP team waits
on a core another one needs (two threads each gave a similar throughput, but 26 threads per process
instead of 19, and a two-thread process slows down sharply when other jobs share the cores: the
reference check took 243 s against 38 s). Prompts of 16-256 tokens and 4-8 new tokens put 1000
requests at about 14 minutes there: the prefill service, one prefill at a time, is the bottleneck,
and 16-512 tokens ran at about half that rate.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc

sys.path.insert(0, str(ROOT / "bench"))  # the bench's own modules beside it

from reliability_report import markdown, summarize
from reliability_requests import (
    MIX,
    MODEL,
    ROLES,
    SAMPLE_EVERY,
    SHAPE,
    WIKITEXT,
    Outcome,
    most_open,
    plan,
    prompt_pool,
    run_phase,
)

from rekv_cli.bench.machine import cpu_model
from rekv_cli.bench.memory import growth, memory_map, proc_status
from rekv_cli.bench.provenance import SERVICES, provenance
from rekv_cli.launcher import ServicePair
from rekv_cli.util import write_json
from rekv_core.model import Model, greedy_generate, load_weights
from rekv_core.model.tokenizer import load_tokenizer

# what the figures measure (`provenance`): the two services as processes under load
MEASURES = (*SERVICES, "rekv_cli/bench/memory.py", "bench/reliability_load.py",
            "bench/reliability_requests.py", "bench/reliability_report.py")

PROFILE = ROOT / "rekv_core" / "plan" / "profiles" / f"{MODEL}.json"  # no measurement at start
GAUGES = ("rekv_transport_pending", "rekv_handoffs_in_flight")
SETTLE_S = 30.0  # longest wait for the gauges to read 0 after the last request


# ---------------------------------------------------------------------------------- the requests


# ------------------------------------------------------------------------- the processes' state


def metrics_text(pair: ServicePair, role: str) -> str:
    with urllib.request.urlopen(pair.metrics_url(role), timeout=10) as response:
        return response.read().decode()


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def sample(pair: ServicePair, requests: int, t0: float) -> dict:
    """One point of the memory curve: both services after `requests` requests."""
    point = {"requests": requests, "t_s": round(time.monotonic() - t0, 2)}
    for role in ROLES:
        state = proc_status(getattr(pair, role).process.pid)
        text = metrics_text(pair, role)
        rss = metric(text, "process_resident_memory_bytes")  # None where not exported
        point[role] = {**state, "metric_rss_mib": None if rss is None else rss / 2**20}
        if role == "decode":
            point[role]["link_gbps"] = metric(text, "rekv_link_bandwidth_estimate_gbps")
    return point


def settle(pair: ServicePair, timeout: float = SETTLE_S) -> dict:
    """The GAUGES of both services, read until all are 0 (or `timeout`), and how long that took."""
    start = time.monotonic()
    while True:
        values = {role: {g: metric(text, g) for g in GAUGES}
                  for role, text in ((r, metrics_text(pair, r)) for r in ROLES)}
        if all(v == 0 for gauges in values.values() for v in gauges.values()) or \
                time.monotonic() - start > timeout:
            return {"seconds": round(time.monotonic() - start, 2), **values}
        time.sleep(0.2)


def thread_counts(pair: ServicePair) -> dict:
    return {role: proc_status(getattr(pair, role).process.pid)["threads"] for role in ROLES}


# ------------------------------------------------------------------------------------ the checks

def check_tokens(outcomes: list[Outcome], pool: list[list[int]], threads: int,
                 every: int) -> dict:
    """Compare the lossless completed requests (index a multiple of `every`) with the
    single-process reference; sets each one's `match`."""
    chosen = [o for o in outcomes if o.status == "OK" and o.lossless and o.index % every == 0]
    longest: dict[int, int] = {}
    for o in chosen:
        longest[o.prompt] = max(longest.get(o.prompt, 0), o.max_new_tokens)
    start, saved = time.monotonic(), torch.get_num_threads()
    torch.set_num_threads(threads)  # the services' count: the same reductions, the same bits
    try:
        model = Model(load_weights(MODEL, torch.bfloat16))
        reference = {p: greedy_generate(model, pool[p], n) for p, n in longest.items()}
    finally:
        torch.set_num_threads(saved)
    for o in chosen:
        o.match = o.tokens == reference[o.prompt][:len(o.tokens)]
    return {"checked": len(chosen), "mismatches": sum(not o.match for o in chosen),
            "references": len(reference), "seconds": round(time.monotonic() - start, 1),
            "lossy_not_checked": sum(o.status == "OK" and not o.lossless for o in outcomes)}


# --------------------------------------------------------------------------------------- the run

# The services' batching (`--batching`). Only batch-invariant services promise the single-process
# reference's tokens under load; with shared GEMMs a greedy answer can leave it at a near-tie
# (README, "What a handoff may change in an answer"), as 44 of 826 lossless answers did at f6578a6
# on a CPU with native BF16 GEMMs (bench/results/reliability-load-shared.json).
BATCHING = ("invariant", "shared")

def service_args(args: argparse.Namespace) -> list[str]:
    return ["--dtype", "bfloat16", "--batch-invariant", str(args.batching == "invariant").lower(),
            "--torch-threads", str(args.torch_threads),
            "--max-prompt-tokens", str(args.prompt_tokens[1]),
            "--max-new-tokens", str(args.max_new_tokens[1]),
            "--max-concurrent", str(max(args.burst, args.concurrency)),
            "--codecs", "bf16,int8", "--profile", str(PROFILE)]


def drive(pair: ServicePair, args: argparse.Namespace, pool: list[list[int]],
          burst: list[Outcome], sustained: list[Outcome]) -> dict:
    """The burst, then the sustained run with its memory curve, then the end state."""
    t0 = time.monotonic()
    threads = {"ready": thread_counts(pair)}
    ready = sample(pair, 0, t0)
    map_ready = {role: memory_map(getattr(pair, role).process.pid) for role in ROLES}
    peak_queue = [0.0]

    def watch_queue() -> None:
        depth = metric(metrics_text(pair, "decode"), "rekv_queue_depth") or 0.0
        peak_queue[0] = max(peak_queue[0], depth)

    with grpc.insecure_channel(pair.decode_address) as channel:
        burst_s = run_phase(channel, burst, pool, len(burst), args.deadline_s, together=True,
                            watch=watch_queue) if burst else 0.0
        threads["after_burst"] = thread_counts(pair)
        curve = [sample(pair, 0, t0)]

        def on_done(n: int) -> None:
            if n % SAMPLE_EVERY == 0 or n == len(sustained):
                curve.append(sample(pair, n, t0))

        sustained_s = run_phase(channel, sustained, pool, args.concurrency, args.deadline_s,
                                on_done=on_done)
    gauges = settle(pair)
    threads["end"] = thread_counts(pair)
    return {"burst": {"wall_s": burst_s, "most_open_streams": most_open(burst),
                      "peak_decode_queue_depth": peak_queue[0]},
            "sustained": {"wall_s": sustained_s}, "gauges_end": gauges, "threads": threads,
            "memory": {"ready": ready, "map_ready": map_ready, "curve": curve,
                       "growth": {role: growth(curve, role) for role in ROLES},
                       "map_end": {role: memory_map(getattr(pair, role).process.pid)
                                   for role in ROLES}}}


def meta(args: argparse.Namespace, code: dict) -> dict:
    return {**code, "cpu": cpu_model(), "cores": os.cpu_count(),
            "command": " ".join(["python", *sys.argv]),
            "torch": torch.__version__, "python": sys.version.split()[0], "model": MODEL,
            "dtype": "bfloat16", "service_args": service_args(args), "env": dict(args.env),
            "mix": {label: forced for label, forced in MIX},
            "settings": {k: v for k, v in vars(args).items()
                         if k not in ("json", "markdown", "log_dir", "env")}}


def run(args: argparse.Namespace) -> dict:
    code = provenance(measures=MEASURES)
    started = time.monotonic()
    rng = random.Random(args.seed)
    pool = prompt_pool(load_tokenizer(MODEL), args.prompts, args.prompt_tokens, rng,
                       Path(args.wikitext))
    burst = plan("burst", args.burst, pool, args.max_new_tokens, rng)
    sustained = plan("sustained", args.requests, pool, args.max_new_tokens, rng)
    pair = ServicePair(service_args(args), service_args(args), log_dir=args.log_dir,
                       env=dict(args.env))
    try:
        result = drive(pair, args, pool, burst, sustained)
    finally:
        result_codes = pair.stop()
    result["exit_codes"] = result_codes
    result["check"] = check_tokens(burst + sustained, pool, args.torch_threads,
                                   args.check_every)
    result["burst"].update(summarize(burst, result["burst"]["wall_s"]) if burst else {})
    result["sustained"].update(summarize(sustained, result["sustained"]["wall_s"]))
    result["meta"] = meta(args, code) | {"log_dir": str(pair.log_dir),
                                         "wall_s": time.monotonic() - started}
    result["requests"] = [_record(o) for o in burst + sustained]
    return result


def _record(o: Outcome) -> dict:
    record = asdict(o)
    for key in ("started_s", "ended_s"):
        record.pop(key)
    return record


# ------------------------------------------------------------------------------------ the report


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected N or LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _env(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="sustained-phase requests")
    parser.add_argument("--concurrency", type=int, default=8, help="sustained-phase streams")
    parser.add_argument("--burst", type=int, default=32, help="streams opened at once (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=_pair, default=(4, 8), metavar="N|LO,HI")
    parser.add_argument("--prompt-tokens", type=_pair, default=(16, 256), metavar="LO,HI")
    parser.add_argument("--prompts", type=int, default=100, help="distinct prompts in the pool")
    parser.add_argument("--wikitext", default=str(WIKITEXT), help="the prompts' text")
    parser.add_argument("--deadline-s", type=float, default=120.0, help="gRPC deadline per call")
    parser.add_argument("--batching", choices=BATCHING, default="invariant",
                        help="the services' batching: invariant (`--batch-invariant true`, each "
                        "request its lone kernels: every lossless answer must be the reference's) "
                        "or shared (their default: mismatches are reported, not failures)")
    parser.add_argument("--torch-threads", type=int, default=1, help="per service")
    parser.add_argument("--check-every", type=int, default=1,
                        help="check lossless requests whose index is a multiple of this")
    parser.add_argument("--env", type=_env, action="append", default=[], metavar="KEY=VALUE",
                        help="environment of both services (repeatable), e.g. MALLOC_ARENA_MAX=2")
    parser.add_argument("--log-dir", help="the services' logs (default: a temporary folder)")
    parser.add_argument("--json", metavar="FILE", help="also write everything as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="also write the report")
    args = parser.parse_args(argv)
    for name in ("requests", "concurrency", "prompts", "torch_threads", "check_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be positive")
    if args.burst < 0 or args.deadline_s <= 0:
        parser.error("--burst: must be >= 0; --deadline-s: must be positive")
    if args.prompt_tokens[1] + args.max_new_tokens[1] > SHAPE.max_positions:
        parser.error(f"--prompt-tokens, --max-new-tokens: past {SHAPE.max_positions} positions")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    report = markdown(result)
    print(report)
    write_json(args.json, result)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(report + "\n")
    bad = (result["sustained"]["lost"] + result["burst"].get("lost", 0) +
           (result["check"]["mismatches"] if args.batching == "invariant" else 0))
    return 1 if bad or any(result["exit_codes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
