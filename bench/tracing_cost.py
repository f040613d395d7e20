"""What request tracing costs: off (the default) against no tracing code at all, and on, beside
the time of a request itself.

    python bench/tracing_cost.py [--loop-requests 100] [--rounds 31] [--requests 24]
                                 [--prompt-tokens 200] [--new-tokens 8] [--json FILE]
                                 [--markdown FILE]

1. The span code, in this process: every tracing call one request makes on both services
   (`decode_request`, `prefill_request`: the calls of `services/decode/server.py`,
   `services/decode/handoff.py`, `services/prefill/server.py`, with the helpers of
   `services/request_spans.py` on real reports and a real planner decision), in a loop of
   --loop-requests requests, four ways: `none` (the loop with no tracing code), `off`
   (`services.tracing.TRACING_OFF`), `on` (the OpenTelemetry SDK with its batch processor,
   exporting to memory) and `on, a span per message` (the prefill worker's messages as a span
   each instead of events of one: the alternative). Each of --rounds rounds times every case
   once, in an order that turns by one each round, and the exporter's queue is emptied after each
   sample, untimed (the services export on a thread of their own; what that costs them shows in
   part 2); reported: the median µs per request, less `none`'s for the others.
2. The services, as processes: two pairs of the prefill and decode services on loopback (one
   torch thread each), one with tracing off, one exporting OTLP over gRPC to a collector in this
   process; --requests rounds, each sending one request to each pair in turn (the order
   alternating), a --prompt-tokens prompt forced to int8 at cut 15 in layer order, --new-tokens
   generated. Reported: the medians of the request's time at the client and of its TTFT at the
   decode worker, and the per-round ratios on/off with 95% bootstrap intervals
   (`rekv_cli.bench.stats.paired_ratio`), and the spans the collector received.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rekv_cli.bench.machine import machine_info
from rekv_cli.bench.otlp_collector import OtlpCollector
from rekv_cli.bench.provenance import SERVICES, provenance
from rekv_cli.bench.stats import median_ci, paired_ratio
from rekv_cli.client import generate
from rekv_cli.launcher import ServicePair
from rekv_cli.util import write_json
from rekv_core.handoff import Action, Delivery, HandoffPlan, HandoffResult, WireBytes
from rekv_core.handoff.receiver import HandoffTimings
from rekv_core.model import KVCache
from rekv_core.model.shapes import get_preset
from rekv_core.plan import CostInputs
from rekv_core.plan.calibration import codec_costs
from rekv_core.plan.planner import Planner
from rekv_core.plan.policy import shipped_policy
from services.calls import HandoffReport
from services.request_spans import MessageLog, describe_decision, describe_report
from services.request_spans import record_receive, record_recompute
from services.tracing import TRACING_OFF
from services.tracing_sdk import SdkTracing

# what the figures measure (`provenance`): the span code, then the two services as
# processes exporting to the collector
MEASURES = (*SERVICES, "rekv_cli/bench/otlp_collector.py", "rekv_cli/bench/stats.py",
            "bench/tracing_cost.py")

SHAPE = get_preset("smollm2-135m")
CUT = 15
ROUTER = [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
SETTINGS = ["--dtype", "bfloat16", "--torch-threads", "1", "--max-prompt-tokens", "1024",
            "--max-new-tokens", "64", "--codecs", "bf16,int8",
            "--profile", str(Path(__file__).resolve().parents[1]
                             / "rekv_core/plan/profiles/smollm2-135m.json")]


def _fixtures(prompt_tokens: int) -> dict:
    """A handoff's report and result as the decode worker has them, and a planner decision."""
    action = Action("int8", CUT, SHAPE.num_layers)
    wire = WireBytes(boundary=prompt_tokens * SHAPE.hidden_size * 2, prefix=prompt_tokens * 9000,
                     scales=prompt_tokens * 60)
    plan = HandoffPlan(action, prompt_tokens, SHAPE, Delivery(streamed=True), predicted_ms=40.0)
    result = HandoffResult(plan, KVCache(1, 1, 1, 1, torch.float32), torch.zeros(1),
                           HandoffTimings(0.01, 0.02, 0.03, 0.001, 0.045, 0.044), wire)
    report = HandoffReport(action=action, bytes=wire, predicted_ms=40.0, measured_ms=45.0,
                           prefill_ms=30.0, q_ms=2.0, h_ms=10.0, x_ms=20.0, r_ms=30.0, j_ms=1.0,
                           delivery=plan.delivery, send_ms=25.0, prefill_link_gbps=1.0)
    inputs = CostInputs(SHAPE, prompt_tokens, 1.0, 3.0, codec_costs(
        {"bf16": 0.0, "int8": 0.5}, {"bf16": 0.01, "int8": 0.01}), 1.0)
    decision = Planner(shipped_policy(SHAPE.name)).decide(inputs, ["bf16", "int8"])
    names = ["plan", *(f"layer.{i}" for i in range(CUT)), "boundary"]
    return {"report": report, "result": result, "decision": decision, "messages": names,
            "prompt_tokens": prompt_tokens}


def decode_request(tracing, f: dict) -> None:
    """The tracing calls of one `Decode.Generate` with a handoff, in the services' order."""
    trace = tracing.request("Generate", ROUTER, request_id="bench")
    admission = trace.span("admission", queue=1, prompt_tokens=f["prompt_tokens"])
    admission.end()
    with trace.span("handoff", prompt_tokens=f["prompt_tokens"]) as span:
        negotiation = trace.span("negotiation", span, client=True)
        negotiation.set(peer="127.0.0.1:50051", transfer_id="bench/0")
        negotiation.metadata()
        negotiation.end(None)
        record_receive(trace, span, time.perf_counter() - 0.05, f["result"])
        describe_report(span, f["report"])
        record_recompute(trace, span, f["report"])
    first = trace.span("first_token")
    first.set(ttft_ms=50.0)
    first.end()
    decode = trace.span("decode")
    decode.set(tokens=8, finish="length")
    decode.end()
    trace.root.set(prompt_tokens=f["prompt_tokens"], new_tokens=8, ttft_ms=50.0,
                   request_ms=90.0)
    trace.end(None)


def prefill_request(tracing, f: dict, span_per_message: bool = False) -> None:
    """The tracing calls of one `Prefill.Handoff`, its messages noted where tracing is on: as
    events (what the service does), or `span_per_message`, the alternative, a span each."""
    trace = tracing.request("Handoff", ROUTER, request_id="bench", transfer_id="bench/0")
    with trace.span("plan") as plan:
        describe_decision(plan, f["decision"])
    if trace.recording:
        posted = MessageLog()
        with trace.span("send") as span:
            for name in f["messages"]:
                posted.before_send(name)
                posted.after_send(name)
            span.set(prefill_ms=30.0, send_ms=25.0, q_ms=2.0,
                     **{f"bytes_{k}": v for k, v in f["report"].bytes.as_dict().items()})
            if span_per_message:
                for (name, at), (_, end) in zip(posted.posted, posted.posted[1:]):
                    trace.record(name, at, end, span)
            else:
                posted.record(trace, span)
    trace.end(None)


def _loop(tracing, f: dict, requests: int, span_per_message: bool = False) -> float:
    """Seconds per request of `requests` requests' tracing calls (`tracing` None: none)."""
    start = time.perf_counter()
    for _ in range(requests):
        if tracing is not None:
            decode_request(tracing, f)
            prefill_request(tracing, f, span_per_message)
    return (time.perf_counter() - start) / requests


def span_code(requests: int, rounds: int, prompt_tokens: int) -> dict:
    f = _fixtures(prompt_tokens)
    exporter = InMemorySpanExporter()
    on = SdkTracing("bench", exporter)
    cases = {"none": (None, False), "off": (TRACING_OFF, False), "on": (on, False),
             "on, a span per message": (on, True)}
    names = list(cases)
    samples = {name: [] for name in names}
    for name in names:  # warm-up
        _loop(cases[name][0], f, max(1, requests // 10), cases[name][1])
    for round_ in range(rounds):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            samples[name].append(_loop(cases[name][0], f, requests, cases[name][1]))
            on.provider.force_flush()  # untimed: the next sample starts with an empty queue
            exporter.clear()
    on.shutdown()
    none = statistics.median(samples["none"])
    rows = []
    for name in names:
        median, (low, high) = median_ci(samples[name])
        rows.append({"case": name, "us_per_request": median * 1e6,
                     "us_per_request_ci": [low * 1e6, high * 1e6],
                     "us_beyond_none": (median - none) * 1e6, "samples_s": samples[name]})
    return {"requests_per_sample": requests, "rounds": rounds, "rows": rows}


def _request(channel, index: int, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    started = time.perf_counter()
    result = generate(channel, f"cost-{index}", prompt, new_tokens, ("int8", CUT),
                      stop_at_eos=False, forced_schedule=(True, 0, False), metadata=ROUTER)
    assert not result.summary.fallback, result.summary.handoff.fallback_reason
    return time.perf_counter() - started, result.summary.ttft_ms / 1e3


def services(requests: int, prompt_tokens: int, new_tokens: int) -> dict:
    prompt = torch.randint(100, 4000, (prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    collector = OtlpCollector(keep=False)
    on_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
              "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    logs = Path(tempfile.mkdtemp(prefix="rekv-tracing-cost-"))
    pairs = {}
    try:
        for name, env in (("off", {}), ("on", on_env)):
            pairs[name] = ServicePair(SETTINGS, SETTINGS, logs / name, env=env)
        channels = {name: grpc.insecure_channel(p.decode_address) for name, p in pairs.items()}
        for name, channel in channels.items():  # warm-up
            for i in range(2):
                _request(channel, -1 - i, prompt, new_tokens)
        samples = {name: {"request_s": [], "ttft_s": []} for name in pairs}
        for round_ in range(requests):
            for name in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
                total, ttft = _request(channels[name], round_, prompt, new_tokens)
                samples[name]["request_s"].append(total)
                samples[name]["ttft_s"].append(ttft)
    finally:
        codes = {name: pair.stop() for name, pair in pairs.items()}
        collector.stop()
    result = {"rounds": requests, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
              "exit_codes": codes, "spans_received": collector.received, "cases": {}}
    for name, measured in samples.items():
        result["cases"][name] = {key: {"median": median_ci(values)[0],
                                       "ci": list(median_ci(values)[1]), "samples": values}
                                 for key, values in measured.items()}
    result["ratio_on_off"] = {
        key: dict(zip(("median", "ci"), paired_ratio(samples["on"][key], samples["off"][key])))
        for key in ("request_s", "ttft_s")}
    return result


def run(args: argparse.Namespace) -> dict:
    started = provenance(measures=MEASURES)
    result = {"machine": {**machine_info(torch.device("cpu"), torch.bfloat16,
                                         torch.get_num_threads()), **started},
              "command": " ".join(["python", *sys.argv]),
              "shared_machine": args.shared_machine,
              "span_code": span_code(args.loop_requests, args.rounds, args.prompt_tokens)}
    if args.requests:
        result["services"] = services(args.requests, args.prompt_tokens, args.new_tokens)
    return result


def report(result: dict) -> str:
    m = result["machine"]
    lines = [f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, commit {m['commit']} "
             f"(tree clean: {m['tree_clean']}), started {m['started']}",
             f"command: `{result['command']}`"]
    if result["shared_machine"]:
        lines.append("The machine was shared with other work while this ran.")
    code = result["span_code"]
    lines += ["", f"Span code of one request on both services, µs (median of {code['rounds']} "
              f"rounds of {code['requests_per_sample']} requests, 95% interval):", "",
              "| case | µs per request | interval | beyond none |", "|:--|--:|--:|--:|"]
    for row in code["rows"]:
        low, high = row["us_per_request_ci"]
        lines.append(f"| {row['case']} | {row['us_per_request']:.2f} | {low:.2f}–{high:.2f} | "
                     f"{row['us_beyond_none']:.2f} |")
    svc = result.get("services")
    if svc:
        lines += ["", f"Two service pairs as processes, {svc['rounds']} rounds alternating, "
                  f"{svc['prompt_tokens']}-token prompt, int8 at cut {CUT}, "
                  f"{svc['new_tokens']} new tokens; spans received: {svc['spans_received']}:",
                  "", "| measure | off (ms) | on (ms) | on/off (per round) | interval |",
                  "|:--|--:|--:|--:|--:|"]
        for key, label in (("request_s", "request at the client"), ("ttft_s", "TTFT")):
            off, on = (svc["cases"][c][key]["median"] * 1e3 for c in ("off", "on"))
            ratio = svc["ratio_on_off"][key]
            lines.append(f"| {label} | {off:.1f} | {on:.1f} | {ratio['median']:.3f} | "
                         f"{ratio['ci'][0]:.3f}–{ratio['ci'][1]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loop-requests", type=int, default=100,
                        help="requests per timed sample of the span code (default 100: their "
                             "spans fit the batch processor's queue, which is emptied, untimed, "
                             "after each sample)")
    parser.add_argument("--rounds", type=int, default=31, help="timed rounds (default 31)")
    parser.add_argument("--requests", type=int, default=24,
                        help="rounds through the two service pairs (default 24; 0: skip them)")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated")
    parser.add_argument("--shared-machine", action="store_true",
                        help="say in the result that other work shared the machine")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="also write the report as Markdown")
    args = parser.parse_args(argv)
    if args.loop_requests < 1 or args.rounds < 1 or args.requests < 0:
        parser.error("--loop-requests, --rounds: must be positive; --requests: not negative")
    if not 1 <= args.new_tokens <= 64 or not 1 <= args.prompt_tokens <= 1000:
        parser.error("--new-tokens: 1 to 64; --prompt-tokens: 1 to 1000")
    torch.set_num_threads(1)
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # the "off" pair must not trace
    result = run(args)
    text = report(result)
    print(text, end="")
    write_json(args.json, result)
    if args.markdown:
        Path(args.markdown).write_text(f"# What request tracing costs\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
