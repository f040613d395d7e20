"""Where a short prompt's time to first token goes through the pair: the fixed cost of a handoff,
phase by phase, from both services' own traces.

    python bench/fixed_cost.py [--requests 20] [--prompt-tokens 32] [--warmup 3]
                               [--concurrency 1] [--modes planner,bf16/0,bf16/30]
                               [--service-arg=--dtype=float32 ...]
                               [--json FILE] [--markdown FILE]

A prefill and a decode service on loopback (the first on core 0, the second on core 1 where there
are two, one torch thread each, the shipped profile), exporting their spans over OTLP to a
collector in this process (`rekv_cli/bench/otlp_collector.py`, the spans of
`services/request_spans.py`). --warmup requests one at a time, then --requests in waves of
--concurrency sent at once (1: one at a time; a wave starts when the last one's requests are all
answered), each a --prompt-tokens prompt of random token ids (its own seed) with one new token and
the planner's choice, each in a trace of its own. Under concurrency the phases show where a
request waits for the others. `--modes` sets the planner's pick beside forced actions under the
same load: `planner` or CODEC/CUT each, --requests requests per mode, the waves (one request each
at --concurrency 1) taking the modes in a shuffled order per round, and every figure reported per
mode. From each request's spans, these instants on the critical
path to its first token, in order (both processes read one clock: the spans' wall-clock time):

    arrived       `Decode/Generate` starts (the router's call is in)
    admitted      `admission` ends
    handoff       `handoff` starts
    called        `negotiation` starts: the offer built, the replica picked, the call made
    at prefill    `Prefill/Handoff` starts on the prefill worker
    planning      `plan` starts: the call parsed, checked and admitted there
    planned       `plan` ends
    sending       `send` starts: the worker thread has the handoff
    first posted  the first data message (the in-band plan) is posted: `send`'s `control` span
    payload       the first message after it is posted: the token ids, the boundary or a layer
    sent          `send` ends: the last message's bytes are gone
    joined        the decode worker's `join` ends: the cache is whole
    first token   `first_token` ends: the token's message leaves

The phases are the gaps between consecutive instants; they add up to the TTFT the trace spans
(first token − arrived). Beside them: the prompt's compute on both sides (the prefill's, `send`'s
`prefill_ms`, and the decode worker's recompute from the boundary, `suffix`'s `compute_ms`), the
wire time (the handoff's bytes at the link rate the plan used), the TTFT less the compute, and
the goal's ratio: TTFT over compute plus wire (the issue asks for at most 1.5); and the planner's
prediction against what happened: its predicted handoff time (`plan`'s `predicted_ms`) over the
handoff the decode worker measured (`handoff`'s `measured_ms`) and over the TTFT (under load
the issue asks for the median within 1.5x either way); the TTFT also holds what passed before the
plan (the decode worker's admission, above all), which the plan does not predict. Reported: each
phase's median over the requests, per request too in the JSON. A gap can come out a little
negative where two processes' readings of one instant differ by their rounding.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import secrets
import statistics
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from rekv_cli.bench.machine import machine_info  # noqa: E402
from rekv_cli.bench.otlp_collector import CollectedSpan, OtlpCollector  # noqa: E402
from rekv_cli.bench.provenance import SERVICES, provenance  # noqa: E402
from rekv_cli.client import generate  # noqa: E402
from rekv_cli.launcher import ServicePair  # noqa: E402
from rekv_cli.util import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MEASURES = (*SERVICES, "rekv_cli/bench/otlp_collector.py", "bench/fixed_cost.py")
SETTINGS = ["--torch-threads", "1", "--max-prompt-tokens", "2048", "--max-new-tokens", "16",
            "--profile", str(ROOT / "rekv_core/plan/profiles/smollm2-135m.json")]
INSTANTS = ("arrived", "admitted", "handoff", "called", "at_prefill", "planning", "planned",
            "sending", "first_posted", "payload", "sent", "joined", "first_token")
PHASES = {  # the gap ending at each instant after the first
    "admitted": "admission", "handoff": "to the handoff", "called": "offer and call",
    "at_prefill": "call in transit", "planning": "prefill: parse, check, admit",
    "planned": "prefill: plan", "sending": "prefill: to its thread",
    "first_posted": "prefill: to the plan's message", "payload": "prefill: to the first payload",
    "sent": "prefill and send the rest",
    "joined": "landing and join", "first_token": "first token"}


def _one(spans: list[CollectedSpan], name: str) -> CollectedSpan:
    found = [s for s in spans if s.name == name]
    if len(found) != 1:
        raise ValueError(f"{name}: {len(found)} spans in the trace, want 1 "
                         f"({sorted(s.name for s in spans)})")
    return found[0]


def instants(spans: list[CollectedSpan]) -> dict[str, int]:
    """The request's instants (module doc), ns, from its trace's spans."""
    send = _one(spans, "send")
    posts = sorted(at for s in spans if s.parent_id == send.span_id for _, at in s.events)
    if len(posts) < 2:
        raise ValueError(f"send: {len(posts)} message events under it, want the plan and more")
    plan = _one(spans, "plan")
    return {"arrived": _one(spans, "rekv.v1.Decode/Generate").start_ns,
            "admitted": _one(spans, "admission").end_ns,
            "handoff": _one(spans, "handoff").start_ns,
            "called": _one(spans, "negotiation").start_ns,
            "at_prefill": _one(spans, "rekv.v1.Prefill/Handoff").start_ns,
            "planning": plan.start_ns, "planned": plan.end_ns, "sending": send.start_ns,
            "first_posted": posts[0], "payload": posts[1], "sent": send.end_ns,
            "joined": _one(spans, "join").end_ns,
            "first_token": _one(spans, "first_token").end_ns}


def breakdown(spans: list[CollectedSpan]) -> dict:
    """One request's phases (ms), its TTFT across the trace, its compute on either side, its
    wire time and the goal's ratio (module doc)."""
    at = instants(spans)
    phases = {PHASES[b]: (at[b] - at[a]) / 1e6 for a, b in zip(INSTANTS, INSTANTS[1:])}
    ttft_ms = (at["first_token"] - at["arrived"]) / 1e6
    prefill_ms = float(_one(spans, "send").attributes.get("rekv.prefill_ms", 0.0))
    suffix = [s for s in spans if s.name == "suffix"]  # none when the prefill ran every layer
    decode_ms = sum(float(s.attributes.get("rekv.compute_ms", 0.0)) for s in suffix)
    handoff = _one(spans, "handoff").attributes
    gbps = float(_one(spans, "plan").attributes["rekv.link_gbps"])
    wire_ms = int(handoff.get("rekv.bytes_total", 0)) * 8 / (gbps * 1e9) * 1e3
    compute_ms = prefill_ms + decode_ms
    predicted_ms = float(_one(spans, "plan").attributes["rekv.predicted_ms"])
    measured_ms = float(handoff.get("rekv.measured_ms", 0.0))
    return {"phases_ms": phases, "ttft_ms": ttft_ms, "prefill_ms": prefill_ms,
            "beyond_prefill_ms": ttft_ms - prefill_ms, "decode_compute_ms": decode_ms,
            "compute_ms": compute_ms, "beyond_compute_ms": ttft_ms - compute_ms,
            "wire_ms": wire_ms, "over_compute_and_wire": ttft_ms / (compute_ms + wire_ms),
            "predicted_ms": predicted_ms, "measured_handoff_ms": measured_ms,
            "predicted_over_handoff": predicted_ms / measured_ms if measured_ms else None,
            "predicted_over_ttft": predicted_ms / ttft_ms,
            "action": f"{handoff.get('rekv.codec')}/{handoff.get('rekv.cut')}"}


def compute_info(metrics_url: str) -> dict[str, str]:
    """A service's `rekv_compute_info` labels: the device, dtype and why."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = re.search(r'^rekv_compute_info\{device="([^"]*)",dtype="([^"]*)",reason="([^"]*)"\}',
                      text, re.M)
    if found is None:
        raise ValueError(f"{metrics_url}: no rekv_compute_info")
    return dict(zip(("device", "dtype", "reason"), found.groups()))


def _pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if (os.cpu_count() or 1) >= 2 else []


def wave_modes(modes: list[str], waves_per_mode: int, seed: int = 0) -> list[str]:
    """The mode of each wave: `waves_per_mode` rounds, each every mode once in a shuffled order."""
    rng, order = random.Random(seed), []
    for _ in range(waves_per_mode):
        round_ = list(modes)
        rng.shuffle(round_)
        order += round_
    return order


def forced_action(mode: str) -> tuple[str, int] | None:
    """`planner`: None; CODEC/CUT: that action. ValueError naming the mode otherwise."""
    if mode == "planner":
        return None
    codec, _, cut = mode.partition("/")
    if not codec or not cut.isdigit():
        raise ValueError(f"mode {mode!r}: expected planner or CODEC/CUT, as bf16/15")
    return codec, int(cut)


def summarize(rows: list[dict]) -> dict:
    """The medians of one mode's requests: each phase, and the figures of the summary."""
    return {"median_phases_ms": {name: statistics.median(r["phases_ms"][name] for r in rows)
                                 for name in PHASES.values()},
            "median": {key: statistics.median(r[key] for r in rows if r[key] is not None)
                       for key in ("ttft_ms", "prefill_ms", "beyond_prefill_ms",
                                   "decode_compute_ms", "compute_ms", "beyond_compute_ms",
                                   "wire_ms", "over_compute_and_wire", "predicted_ms",
                                   "measured_handoff_ms", "predicted_over_handoff",
                                   "predicted_over_ttft", "summary_ttft_ms")}}


def measure(requests: int, warmup: int, prompt_tokens: int, service_args: list[str],
            concurrency: int = 1, modes: list[str] | None = None) -> dict:
    modes = modes or ["planner"]
    collector = OtlpCollector()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    settings = [*SETTINGS, *service_args]
    traces, summaries = {}, {}
    pair = ServicePair(settings, settings, Path(tempfile.mkdtemp(prefix="rekv-fixed-cost-")),
                       env=env, prefill_prefix=_pinned(0), decode_prefix=_pinned(1))
    try:
        computes = {role: compute_info(pair.metrics_url(role)) for role in ("prefill", "decode")}
        with grpc.insecure_channel(pair.decode_address) as channel:
            def one(i: int, mode: str, name: str | None = None) -> None:
                prompt = torch.randint(100, 4000, (prompt_tokens,),
                                       generator=torch.Generator().manual_seed(i)).tolist()
                trace_id = secrets.token_hex(16)
                result = generate(channel, name or f"fixed-{i}", prompt, 1, stop_at_eos=False,
                                  forced_action=forced_action(mode), metadata=[(
                                      "traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01")])
                if result.summary.fallback:
                    raise RuntimeError(f"request {i} fell back: {result.summary.fallback_reason}")
                if i >= 0:
                    traces[trace_id], summaries[trace_id] = (i, mode), result.summary

            for i in range(-warmup, 0):
                for k, mode in enumerate(modes):
                    one(i, mode, f"fixed-warmup{-i}-{k}")
            waves = -(-requests // concurrency)
            with ThreadPoolExecutor(concurrency) as pool:
                for wave, mode in enumerate(wave_modes(modes, waves)):
                    first = wave * concurrency
                    size = min(concurrency, requests - (wave // len(modes)) * concurrency)
                    list(pool.map(lambda i: one(i, mode), range(first, first + size)))
    finally:
        codes = pair.stop()  # each flushes its spans on the way out
        collector.stop()
    by_trace: dict[str, list[CollectedSpan]] = {}
    for span in collector.spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    rows = []
    for trace_id, (index, mode) in sorted(traces.items(), key=lambda item: item[1][0]):
        row = breakdown(by_trace.get(trace_id, []))
        row.update(request=index, mode=mode, summary_ttft_ms=summaries[trace_id].ttft_ms)
        rows.append(row)
    by_mode = {mode: summarize([r for r in rows if r["mode"] == mode]) for mode in modes}
    return {"requests": requests, "warmup": warmup, "prompt_tokens": prompt_tokens,
            "concurrency": concurrency, "modes": modes, "service_args": settings,
            "compute": computes, "exit_codes": codes, "rows": rows, **by_mode[modes[0]],
            "by_mode": by_mode}


def report(result: dict) -> str:
    m, modes, by_mode = result["machine"], result["modes"], result["by_mode"]
    actions = {mode: ", ".join(sorted({r["action"] for r in result["rows"] if r["mode"] == mode}))
               for mode in modes}
    lines = [f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, commit {m['commit']} "
             f"(tree clean: {m['tree_clean']}), started {m['started']}",
             f"command: `{result['command']}`",
             f"services compute in {result['compute']['decode']['dtype']} "
             f"({result['compute']['decode']['reason']}), one core and one torch thread each", "",
             f"{result['requests']} requests per mode "
             + (f"in waves of {result['concurrency']} at once"
                if result["concurrency"] > 1 else "one at a time")
             + f" after {result['warmup']} to warm up, "
             f"{result['prompt_tokens']}-token prompts, one new token; the modes in a shuffled "
             "order per round (the planner's actions: "
             + "; ".join(f"{mode}: {actions[mode]}" for mode in modes) + "):", "",
             "| phase | " + " | ".join(f"{mode} (ms)" for mode in modes) + " |",
             "|:--|" + "--:|" * len(modes)]
    for name in PHASES.values():
        lines.append(f"| {name} | " + " | ".join(f"{by_mode[mode]['median_phases_ms'][name]:.2f}"
                                                for mode in modes) + " |")
    for mode in modes:
        med = by_mode[mode]["median"]
        lines += ["", f"{mode}: TTFT across the trace {med['ttft_ms']:.1f} ms (the decode "
                  f"worker's own figure {med['summary_ttft_ms']:.1f} ms); the prompt's compute "
                  f"{med['compute_ms']:.1f} ms (the prefill worker's {med['prefill_ms']:.1f}, the "
                  f"decode worker's recompute {med['decode_compute_ms']:.1f}); beyond it "
                  f"{med['beyond_compute_ms']:.1f} ms; the wire {med['wire_ms']:.2f} ms at the "
                  f"plan's link rate. TTFT over compute plus wire: "
                  f"{med['over_compute_and_wire']:.2f} (median of the requests'; the goal: at "
                  f"most 1.5).",
                  f"The planner predicted {med['predicted_ms']:.1f} ms for the handoff, which "
                  f"took {med['measured_handoff_ms']:.1f} ms; predicted over the handoff "
                  f"{med['predicted_over_handoff']:.2f}, over the TTFT "
                  f"{med['predicted_over_ttft']:.2f} (medians of the requests')."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--modes", default="planner",
                        help="comma-separated: planner and forced actions, as planner,bf16/0")
    parser.add_argument("--service-arg", action="append", default=[],
                        help="a setting for both services, as --service-arg=--dtype=float32")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--markdown", help="write the report here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0 or args.prompt_tokens < 1 or args.concurrency < 1:
        parser.error("--requests, --prompt-tokens and --concurrency must be >= 1, --warmup >= 0")
    modes = args.modes.split(",")
    try:
        for mode in modes:
            forced_action(mode)
    except ValueError as exc:
        parser.error(f"--modes: {exc}")
    if len(set(modes)) != len(modes):
        parser.error(f"--modes: each mode once, got {args.modes}")
    started = provenance(measures=MEASURES)
    service_args = [part for arg in args.service_arg for part in arg.split("=", 1)]
    measured = measure(args.requests, args.warmup, args.prompt_tokens, service_args,
                       args.concurrency, modes)
    dtype = getattr(torch, measured["compute"]["decode"]["dtype"])
    result = {"machine": {**machine_info(torch.device("cpu"), dtype, 1), **started},
              "command": " ".join(["python", *sys.argv]), **measured}
    text = report(result)
    print(text, end="")
    if args.json:
        write_json(args.json, result)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
