"""What the live quality canary costs: its compute per check beside a request's time, and a user's
token latency under load with the canary checking every lossy handoff against checking none.

    python bench/canary.py [--blocks 4] [--requests 12] [--gap-s 1.5] [--new-tokens 16]
                           [--filler 12] [--json bench/results/canary-cpu.json]

One prefill service stays up; decode services pointed at it are started one block at a time,
alternately with `--canary-fraction 0` and `1` (the order swapped every other block: 0 1 1 0 ...),
each with one torch thread per service and the shipped profile. In each block: two untimed
warm-up requests (and, at fraction 1, their checks awaited), then `--requests` requests forced to
int8 at cut 15 (a lossy action: what the canary checks), sent open loop on the same seeded
schedule in every block, one every `--gap-s` seconds ±30% (each on its own thread, as a router
would send them), so that the decode worker is busy part of the time and idle in between, where
the canary runs; a request arriving then must wait for at most one step of a check. Per request:
TTFT from `Generate`'s arrival (the summary's) and the mean gap between its later streamed tokens
(client side). Per block, from the decode service's metrics: the checks by outcome and the
canary's compute (`rekv_canary_seconds`) while the requests ran and after, until its queue
drained.

Reported: per fraction the median TTFT and token gap over all of its blocks' requests side by
side, the ratio fraction 1 / fraction 0 of those medians and the median of the per-pair ratios
(a block at 0 beside the block at 1 next to it), each with a 95% bootstrap interval; the canary's
mean compute per check over the mean request time (`rekv_request_seconds`, whole requests,
fraction 0) and over the prompt's local recompute (`rekv_suffix_seconds` of a token-only request,
the ceiling: a check recomputes the prompt). The machine may be shared with other work: its
result says so where it was.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rekv_cli.bench.machine import machine_info
from rekv_cli.bench.provenance import SERVICES, provenance
from rekv_cli.bench.stats import median_ci, paired_ratio
from rekv_cli.client import generate, generate_request
from rekv_cli.launcher import ServiceProcess
from rekv_cli.util import write_json
from rekv_core.eval.needle import passkey_prompt
from services.rpc import rekv_pb2_grpc

# what the figures measure (`provenance`): the two services as processes, the canary on and off
MEASURES = (*SERVICES, "rekv_cli/bench/stats.py", "bench/canary.py")

MODEL = "smollm2-135m"
PROFILE = ROOT / "rekv_core" / "plan" / "profiles" / f"{MODEL}.json"
ARGS = ["--dtype", "bfloat16", "--torch-threads", "1", "--profile", str(PROFILE)]
LOSSY = ("int8", 15)
JITTER = 0.3
DRAIN_S = 120.0  # longest wait for a block's canary queue to drain after its requests


def scrape(process: ServiceProcess) -> str:
    with urllib.request.urlopen(f"http://{process.info['metrics']}/metrics", timeout=10) as r:
        return r.read().decode()


def value(text: str, name: str, labels: str = "") -> float:
    found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def canary_state(text: str) -> dict:
    outcomes = {o: value(text, "rekv_canary_checks_total",
                         f'{{codec="{LOSSY[0]}",cut="{LOSSY[1]}",outcome="{o}"}}')
                for o in ("agree", "disagree", "busy", "not_sampled")}
    return {**outcomes, "seconds_sum": value(text, "rekv_canary_seconds_sum"),
            "seconds_count": value(text, "rekv_canary_seconds_count"),
            "request_sum": value(text, "rekv_request_seconds_sum"),
            "request_count": value(text, "rekv_request_seconds_count")}


def one_request(address: str, name: str, prompt: str, new_tokens: int) -> dict:
    """TTFT (the server's) and the mean gap between later tokens as this client saw them."""
    with grpc.insecure_channel(address) as channel:
        stub = rekv_pb2_grpc.DecodeStub(channel)
        arrivals, summary = [], None
        request = generate_request(name, prompt, new_tokens, LOSSY)
        for response in stub.Generate(request, timeout=300):
            if response.token_ids:
                arrivals.append(time.perf_counter())
            if response.HasField("summary"):
                summary = response.summary
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft_ms": summary.ttft_ms, "token_gap_ms": statistics.mean(gaps) * 1e3,
            "request_ms": summary.request_ms, "fallback": summary.fallback,
            "action": f"{summary.action.codec}/{summary.action.cut}"}


def wait_drained(decode: ServiceProcess, fraction: float, expected: float) -> dict:
    """The canary's state once `expected` checks have ended (or after DRAIN_S)."""
    deadline = time.monotonic() + DRAIN_S
    while True:
        state = canary_state(scrape(decode))
        ended = state["agree"] + state["disagree"] + state["busy"]
        if fraction == 0 or ended >= expected or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def run_block(prefill: ServiceProcess, fraction: float, schedule: list[float],
              prompts: list[str], args, log_dir: Path) -> dict:
    decode = ServiceProcess("decode", [*ARGS, "--prefill-address", prefill.info["grpc"],
                                       "--canary-fraction", str(fraction)], log_dir)
    try:
        decode.wait_ready(300)
        address = decode.info["grpc"]
        for index in range(2):
            one_request(address, f"warm-{index}", prompts[index], args.new_tokens)
        before = wait_drained(decode, fraction, 2)
        results: list[dict | None] = [None] * len(schedule)

        def send(index: int) -> None:
            results[index] = one_request(address, f"req-{index}", prompts[index % len(prompts)],
                                         args.new_tokens)

        threads, start = [], time.perf_counter()
        for index, at in enumerate(schedule):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            threads.append(threading.Thread(target=send, args=(index,)))
            threads[-1].start()
        for thread in threads:
            thread.join()
        during = canary_state(scrape(decode))
        after = wait_drained(decode, fraction, 2 + len(schedule))
    finally:
        code = decode.stop()
    delta = {k: during[k] - before[k] for k in during}
    return {"fraction": fraction, "requests": results, "stop_code": code,
            "canary_during": delta,
            "canary_after": {k: after[k] - before[k] for k in after}}


def local_recompute_ms(prefill: ServiceProcess, prompt: str, log_dir: Path) -> float:
    """The decode side's recompute of the prompt (token-only: cut 0), ms: a check's ceiling."""
    decode = ServiceProcess("decode", [*ARGS, "--prefill-address", prefill.info["grpc"],
                                       "--canary-fraction", "0"], log_dir)
    try:
        decode.wait_ready(300)
        with grpc.insecure_channel(decode.info["grpc"]) as channel:
            for index in range(3):
                generate(channel, f"recompute-{index}", prompt, 1, forced_action=("bf16", 0))
        text = scrape(decode)
    finally:
        decode.stop()
    return value(text, "rekv_suffix_seconds_sum") / value(text, "rekv_suffix_seconds_count") * 1e3


def summarize(blocks: list[dict], recompute_ms: float) -> dict:
    by = {f: [b for b in blocks if b["fraction"] == f] for f in (0.0, 1.0)}
    figures = {}
    for key in ("ttft_ms", "token_gap_ms"):
        samples = {f: [r[key] for b in bs for r in b["requests"]] for f, bs in by.items()}
        medians = {f: median_ci(s) for f, s in samples.items()}
        pairs = [(statistics.median(r[key] for r in on["requests"]),
                  statistics.median(r[key] for r in off["requests"]))
                 for on, off in zip(by[1.0], by[0.0])]
        ratio, interval = paired_ratio([p[0] for p in pairs], [p[1] for p in pairs])
        figures[key] = {
            "fraction_0": {"median": medians[0.0][0], "ci95": medians[0.0][1]},
            "fraction_1": {"median": medians[1.0][0], "ci95": medians[1.0][1]},
            "ratio_of_medians": medians[1.0][0] / medians[0.0][0],
            "paired_block_ratio": {"median": ratio, "ci95": interval}}
    during = {k: sum(b["canary_during"][k] for b in by[1.0]) for k in by[1.0][0]["canary_during"]}
    after = {k: sum(b["canary_after"][k] for b in by[1.0]) for k in by[1.0][0]["canary_after"]}
    check_ms = after["seconds_sum"] / max(1.0, after["seconds_count"]) * 1e3
    off = {k: sum(b["canary_during"][k] for b in by[0.0]) for k in ("request_sum",
                                                                    "request_count")}
    request_ms = off["request_sum"] / off["request_count"] * 1e3
    return {**figures, "canary_checks_during_load": during, "canary_checks_with_drain": after,
            "check_compute_ms": check_ms, "request_ms_fraction_0": request_ms,
            "check_over_request": check_ms / request_ms, "local_recompute_ms": recompute_ms,
            "check_over_recompute": check_ms / recompute_ms}


def table(summary: dict) -> str:
    lines = ["| figure | canary off (fraction 0) | canary on (fraction 1) | on / off (medians) "
             "| on / off (paired blocks) |", "| --- | --- | --- | --- | --- |"]
    for key, name in (("ttft_ms", "TTFT, ms"), ("token_gap_ms", "gap between tokens, ms")):
        f = summary[key]
        cells = [f"{f[c]['median']:.1f} [{f[c]['ci95'][0]:.1f}, {f[c]['ci95'][1]:.1f}]"
                 for c in ("fraction_0", "fraction_1")]
        paired = f["paired_block_ratio"]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {f['ratio_of_medians']:.3f} | "
                     f"{paired['median']:.3f} [{paired['ci95'][0]:.3f}, "
                     f"{paired['ci95'][1]:.3f}] |")
    d, a = summary["canary_checks_during_load"], summary["canary_checks_with_drain"]
    lines += ["", f"canary checks while the requests ran: {d['agree']:.0f} agree, "
              f"{d['disagree']:.0f} disagree, {d['busy']:.0f} busy; with its queue drained "
              f"after: {a['agree']:.0f} agree, {a['disagree']:.0f} disagree, {a['busy']:.0f} busy",
              f"compute per check {summary['check_compute_ms']:.0f} ms = "
              f"{summary['check_over_request']:.2f} x a whole request "
              f"({summary['request_ms_fraction_0']:.0f} ms) = "
              f"{summary['check_over_recompute']:.2f} x the prompt's local recompute "
              f"({summary['local_recompute_ms']:.0f} ms)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    source = provenance(measures=MEASURES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4, help="blocks per fraction")
    parser.add_argument("--requests", type=int, default=12, help="timed requests per block")
    parser.add_argument("--gap-s", type=float, default=1.5, help="mean gap between arrivals")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--filler", type=int, default=12, help="passkey prompt filler repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared", action="store_true",
                        help="record that the machine ran other work meanwhile")
    parser.add_argument("--json", default="", help="write every figure here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    schedule = [i * args.gap_s + rng.uniform(-JITTER, JITTER) * args.gap_s
                for i in range(args.requests)]
    schedule = [max(0.0, at) for at in schedule]
    prompts = [passkey_prompt(10000 + 7919 * i, args.filler, 0.5) for i in range(args.requests)]
    log_dir = Path(tempfile.mkdtemp(prefix="rekv-canary-bench-"))
    (log_dir / "prefill").mkdir()
    prefill = ServiceProcess("prefill", ARGS, log_dir / "prefill")
    blocks = []
    try:
        prefill.wait_ready(300)
        for block in range(args.blocks):
            order = (0.0, 1.0) if block % 2 == 0 else (1.0, 0.0)
            for fraction in order:
                folder = log_dir / f"block-{block}-{fraction:g}"
                folder.mkdir(parents=True)
                blocks.append(run_block(prefill, fraction, schedule, prompts, args, folder))
                print(f"block {block} fraction {fraction:g}: median TTFT "
                      f"{statistics.median(r['ttft_ms'] for r in blocks[-1]['requests']):.1f} ms",
                      flush=True)
        folder = log_dir / "recompute"
        folder.mkdir()
        recompute_ms = local_recompute_ms(prefill, prompts[0], folder)
    finally:
        prefill_code = prefill.stop()
    summary = summarize(blocks, recompute_ms)
    print(table(summary))
    write_json(args.json, {
        "meta": {**source, "command": " ".join(["python bench/canary.py", *(argv or sys.argv[1:])]),
                 "machine": machine_info(torch.device("cpu"), torch.bfloat16, 1),
                 "shared_machine": args.shared, "model": MODEL, "action": list(LOSSY),
                 "schedule_s": schedule, "args": vars(args), "prefill_stop_code": prefill_code},
        "summary": summary, "table": table(summary), "blocks": blocks})
    return 0


if __name__ == "__main__":
    sys.exit(main())
