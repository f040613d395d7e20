"""The decode engine against the per-request path: tokens/s and inter-token latency by concurrent
streams, and what a handoff computing on the decode worker costs the streams running there.

    python bench/decode_engine.py [--streams 1,4,8,16,32] [--new-tokens 48] [--prompt-tokens 64]
        [--prompts 1024,2048] [--long-tokens 200] [--handoffs 2] [--rounds 1] [--seed 0]
        [--dtype float32] [--paths batched,per_request] [--ucx-loop-nice 0[,19...]] [--quick]
        [--json FILE] [--markdown FILE]

Two service pairs run side by side for the whole run, one per decode path (`--decode-path
batched`, the engine; `per_request`, each request decoding alone on a thread of its own, as
before the engine), each prefill service pinned to core 0 and each decode service to core 1 with
one torch thread (`taskset`, with two cores or more), on loopback, the embedded model; the decode
services' UCX thread at `--ucx-loop-nice` (the services' own default, 19, unless told; with
several values, comma-separated,
the batched path runs once per value, to compare them: the data plane's share of a core the engine
keeps busy against what its busy-polling takes from the streams). `--paths` leaves a path out.
Only one
case runs at a time; the cases of both parts run in one shuffled order (`--seed`).

1. Streams: N concurrent `Generate` calls (N in `--streams`), each a prompt of `--prompt-tokens`
   random ids and `--new-tokens` tokens, the whole cache sent (BF16 at cut L: nothing computes on
   the decode worker but decoding). Decode tokens/s: the tokens that arrived while every stream
   ran (from the last stream's first token to the first stream's last; the handoffs before them
   are serialized, so streams start apart), over that window; ITL: the gaps between a stream's
   token messages as the client receives them, p50/p99 over all streams. The ceiling: N × the
   single-stream rate of the per-request path (one step reads the weights once for the whole
   batch, so a batch of N could at best run N streams at one stream's pace).
2. Interference: one long stream (up to `--long-tokens`, cancelled two tokens after the handoffs
   end) decodes; after its 5th token, `--handoffs`
   requests arrive one after the other, each a prompt of S tokens (S in `--prompts`) whose handoff
   computes on the decode worker (token-only: cut 0; BF16 recompute at L/2) or not (BF16
   transfer, cut L). Reported: the long stream's ITL p50/p99/max while they ran (from the first's
   call to the last's end), the decode engine's ITL budget (its `rekv_itl_budget_seconds`), and
   the new requests' TTFT (what chunking their compute costs them).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from rekv_cli.bench.machine import cpu_model  # noqa: E402
from rekv_cli.bench.provenance import SERVICES, provenance  # noqa: E402
from rekv_cli.client import generate, generate_request  # noqa: E402
from rekv_cli.launcher import ServicePair  # noqa: E402
from rekv_cli.util import write_json  # noqa: E402
from services.settings import DEFAULT_NICE  # noqa: E402
from rekv_core.model.shapes import DEFAULT_MODEL, get_preset  # noqa: E402
from services.rpc import rekv_pb2_grpc  # noqa: E402

# what the figures measure (`provenance`): the two services as processes, driven by this script
MEASURES = (*SERVICES, "bench/decode_engine.py")

L = get_preset(DEFAULT_MODEL).num_layers
PATHS = ("batched", "per_request")
KINDS = {"token_only": ("bf16", 0), "recompute_half": ("bf16", L // 2), "transfer": ("bf16", L)}
QUICK = {"streams": "1,2", "new_tokens": 12, "prompt_tokens": 32, "prompts": "300",
         "long_tokens": 200, "handoffs": 1}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _at_once(calls) -> list:
    results, errors = [None] * len(calls), []
    start = threading.Barrier(len(calls))

    def run(index, call):
        try:
            start.wait()
            results[index] = call()
        except Exception as exc:  # raised below: a bench never hides a failed request
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


OVERLAP_TRIES = 3  # a streams case whose streams never overlap is rerun with twice the tokens


def streams_case(channel, path: str, n: int, args, rng: random.Random, tag: str) -> dict:
    """n streams at once; measured in the window where all of them run. The handoffs are
    serialized, so on a slow or busy machine the first streams can finish before the last one
    starts: then the case is run again with twice the tokens (`OVERLAP_TRIES` in all), and the
    row says how many tokens each stream made."""
    new_tokens = args.new_tokens
    for attempt in range(OVERLAP_TRIES):
        prompts = [_prompt(rng, args.prompt_tokens) for _ in range(n)]
        gens = _at_once([(lambda i=i, t=new_tokens: generate(
            channel, f"{tag}-{attempt}-{i}", prompts[i], t, forced_action=KINDS["transfer"],
            stop_at_eos=False, timeout=1800)) for i in range(n)])
        # the window in which every stream runs: from the last stream's first token to the
        # first stream's last
        start = max(g.arrivals[0] for g in gens)
        end = min(g.arrivals[-1] for g in gens)
        inside = sum(start < a <= end for g in gens for a in g.arrivals)
        if end > start and inside >= n:
            break
        new_tokens *= 2
    else:
        raise RuntimeError(f"{tag}: the {n} streams never all ran at once, up to "
                           f"{new_tokens // 2} tokens each; raise --new-tokens")
    gaps = [gap * 1e3 for g in gens for gap in g.token_gaps()]
    return {"part": "streams", "path": path, "streams": n, "new_tokens": new_tokens,
            "window_tokens": inside, "window_s": end - start,
            "tokens_per_s": inside / (end - start), "itl_p50_ms": quantile(gaps, 0.5),
            "itl_p99_ms": quantile(gaps, 0.99), "itl_max_ms": max(gaps)}


def interference_case(channel, path: str, kind: str, seq_len: int, args, rng: random.Random,
                      tag: str) -> dict:
    stub = rekv_pb2_grpc.DecodeStub(channel)
    call = stub.Generate(generate_request(f"{tag}-long", _prompt(rng, args.prompt_tokens),
                                          args.long_tokens, KINDS["transfer"], stop_at_eos=False),
                         timeout=1800)
    arrivals: list[float] = []
    window: list[float] = []
    ttfts: list[float] = []

    def handoffs() -> None:
        window.append(time.perf_counter())
        for i in range(args.handoffs):
            g = generate(channel, f"{tag}-new-{i}", _prompt(rng, seq_len), 2,
                         forced_action=KINDS[kind], stop_at_eos=False, timeout=1800)
            ttfts.append(g.summary.ttft_ms)
        window.append(time.perf_counter())

    sender = threading.Thread(target=handoffs)
    for response in call:
        if response.token_ids:
            arrivals.append(time.perf_counter())
            if len(arrivals) == 5:
                sender.start()
            if len(window) == 2 and sum(a > window[1] for a in arrivals) >= 2:
                call.cancel()  # the handoffs are done: the rest would measure nothing
                break
    sender.join()
    if len(window) < 2 or arrivals[-1] < window[1]:
        raise RuntimeError(f"{tag}: the long stream ended before the handoffs did; raise "
                           f"--long-tokens")
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:]) if b >= window[0]
            and a <= window[1]]
    return {"part": "interference", "path": path, "kind": kind, "prompt_tokens": seq_len,
            "handoffs": args.handoffs, "itl_p50_ms": quantile(gaps, 0.5),
            "itl_p99_ms": quantile(gaps, 0.99), "itl_max_ms": max(gaps), "gaps": len(gaps),
            "ttft_ms": statistics.median(ttfts)}


def itl_budget_ms(pair: ServicePair) -> float:
    with urllib.request.urlopen(pair.metrics_url("decode")) as response:
        text = response.read().decode()
    found = re.search(r"^rekv_itl_budget_seconds (\S+)$", text, re.M)
    return float(found.group(1)) * 1e3 if found else 0.0


def variants(args) -> dict[str, tuple[str, int]]:
    """Service pairs by name: (decode path, the decode services' UCX nice). The batched path runs
    once per `--ucx-loop-nice` value (named with it when there are several), per_request once."""
    named = {}
    for path in args.paths:
        nices = args.ucx_loop_nice if path == "batched" else args.ucx_loop_nice[:1]
        for nice in nices:
            named[path if len(nices) == 1 else f"{path} nice {nice}"] = (path, nice)
    return named


def start_pairs(args, log_dir: Path) -> dict[str, ServicePair]:
    pinned = (os.cpu_count() or 1) >= 2
    common = ["--dtype", args.dtype, "--torch-threads", "1", "--max-prompt-tokens", "4096",
              "--max-new-tokens", str(max(512, args.long_tokens, args.new_tokens))]
    pairs = {}
    try:
        for name, (path, nice) in variants(args).items():
            decode = [*common, "--decode-path", path, "--max-batch", "32", "--max-concurrent",
                      "64" if path == "per_request" else "4", "--ucx-loop-nice", str(nice)]
            pairs[name] = ServicePair(common, decode, log_dir=log_dir / name.replace(" ", "-"),
                                      prefill_prefix=["taskset", "-c", "0"] if pinned else [],
                                      decode_prefix=["taskset", "-c", "1"] if pinned else [])
    except BaseException:
        for pair in pairs.values():
            pair.stop()
        raise
    return pairs


def summarize(rows: list[dict]) -> None:
    """Adds to each streams row its ceiling (N × the single-stream rate of its round: the
    per-request path's where it ran, else its own) and its ratio to that single stream."""
    for row in rows:
        if row["part"] != "streams":
            continue
        ones = {r["path"]: r for r in rows if r["part"] == "streams" and r["streams"] == 1
                and r["round"] == row["round"]}
        single = ones.get("per_request", ones[row["path"]])
        row["ceiling_tokens_per_s"] = row["streams"] * single["tokens_per_s"]
        row["x_single_stream"] = row["tokens_per_s"] / single["tokens_per_s"]


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# The decode engine ({m['model']}, {m['dtype']}, one core per service)", "",
             f"Machine: {m['machine']}, {m['cores']} cores (pinned: {m['pinned']}); commit "
             f"{m['commit']} (clean tree: {m['tree_clean']}); ITL budget of the engine: "
             f"{m['itl_budget_ms']:.0f} ms;", f"`{m['command']}`", "",
             "## 1. Concurrent streams", "",
             "| path | streams | tokens/s | ceiling N × single | × single stream | ITL p50 ms "
             "| ITL p99 ms | ITL max ms |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in result["rows"] if r["part"] == "streams"),
                    key=lambda r: (r["round"], r["path"], r["streams"])):
        lines.append(f"| {r['path']} | {r['streams']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ceiling_tokens_per_s']:.1f} | {r['x_single_stream']:.2f} | "
                     f"{r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | {r['itl_max_ms']:.0f} |")
    lines += ["", "## 2. A long stream while handoffs arrive", "",
              "| path | handoff | prompt | ITL p50 ms | ITL p99 ms | ITL max ms | new TTFT ms |",
              "|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in result["rows"] if r["part"] == "interference"),
                    key=lambda r: (r["round"], r["prompt_tokens"], r["kind"], r["path"])):
        lines.append(f"| {r['path']} | {r['kind']} | {r['prompt_tokens']} | "
                     f"{r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | {r['itl_max_ms']:.0f} | "
                     f"{r['ttft_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def cases(args) -> list[tuple]:
    named = variants(args)
    every = [("streams", name, n) for name in named for n in args.streams]
    kinds = ("token_only", "transfer") if args.quick else tuple(KINDS)
    every += [("interference", name, kind, s) for name in named for kind in kinds
              for s in args.prompts]
    return every


def run(args) -> dict:
    started = provenance(measures=MEASURES)
    rng = random.Random(args.seed)
    rows = []
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="rekv-decode-engine-"))
    pairs = start_pairs(args, log_dir)
    try:
        budget = itl_budget_ms(next(pair for name, pair in pairs.items()
                                    if name.startswith("batched")))
        channels = {p: grpc.insecure_channel(pair.decode_address) for p, pair in pairs.items()}
        for round_ in range(args.rounds):
            order = cases(args)
            rng.shuffle(order)
            for index, case in enumerate(order):
                tag = f"r{round_}-{index}"
                if case[0] == "streams":
                    row = streams_case(channels[case[1]], case[1], case[2], args, rng, tag)
                else:
                    row = interference_case(channels[case[1]], *case[1:], args, rng, tag)
                path, nice = variants(args)[case[1]]
                rows.append({**row, "round": round_, "order": index, "decode_path": path,
                             "ucx_loop_nice": nice})
                print(f"{tag} {case}: done", file=sys.stderr)
        for channel in channels.values():
            channel.close()
    finally:
        codes = {path: pair.stop() for path, pair in pairs.items()}
    summarize(rows)
    meta = {**started, "machine": cpu_model(), "cores": os.cpu_count(),
            "pinned": (os.cpu_count() or 1) >= 2, "model": DEFAULT_MODEL, "itl_budget_ms": budget,
            "command": "python bench/decode_engine.py " + " ".join(sys.argv[1:]),
            **{k: v for k, v in vars(args).items() if k not in ("json", "markdown", "log_dir")}}
    return {"meta": meta, "rows": rows, "exit_codes": codes}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,4,8,16,32")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="1024,2048", help="interference prompt lengths")
    parser.add_argument("--long-tokens", type=int, default=500)
    parser.add_argument("--handoffs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ucx-loop-nice", default=str(DEFAULT_NICE["decode"]),
                        help="the decode services' UCX nice, comma-separated: the batched path "
                             "runs once per value (default: the services' own, "
                             f"{DEFAULT_NICE['decode']}, which starves the data plane of a core "
                             "the engine keeps busy)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"decode paths, comma-separated (default {','.join(PATHS)})")
    parser.add_argument("--quick", action="store_true", help=f"tiny: {QUICK}")
    parser.add_argument("--log-dir")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--markdown", metavar="FILE")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    try:
        args.streams = sorted({int(v) for v in str(args.streams).split(",")} | {1})
        args.prompts = [int(v) for v in str(args.prompts).split(",")]
        args.ucx_loop_nice = [int(v) for v in str(args.ucx_loop_nice).split(",")]
    except ValueError:
        parser.error("--streams, --prompts, --ucx-loop-nice: comma-separated integers")
    args.paths = [p for p in str(args.paths).split(",") if p]
    if not args.paths or set(args.paths) - set(PATHS):
        parser.error(f"--paths: a comma-separated subset of {', '.join(PATHS)}")
    if len(set(args.ucx_loop_nice)) != len(args.ucx_loop_nice) or not all(
            0 <= n <= 19 for n in args.ucx_loop_nice):
        parser.error("--ucx-loop-nice: distinct values in [0, 19]")
    for name in ("new_tokens", "prompt_tokens", "long_tokens", "handoffs", "rounds"):
        if getattr(args, name) < 1 or min(args.streams) < 1 or min(args.prompts) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    table = markdown(result)
    print(table)
    write_json(args.json, result, indent=1)
    if args.markdown:
        Path(args.markdown).write_text(table)
    codes = [c for pair in result["exit_codes"].values() for c in pair.values()]
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
