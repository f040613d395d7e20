"""The router side of `rekv bench link`, run inside the decode side's namespace.

    python -m rekv_cli.bench.link.client --decode HOST:PORT --prompt-len S --actions JSON
        --warmups W --runs N --seed K --out FILE [--new-tokens T]

The cases are `--actions` (a JSON list of {"action": [codec, cut] or null for the planner's choice,
"schedule": [streamed, boundary chunk tokens] or null for the services' default}). W untimed rounds,
then N timed ones; a round makes one `Generate` call per case (one new token, the same prompt of S
token ids), in an order shuffled each round (seeded by K), so a drift of the machine's speed
touches every case alike and the i-th samples of two cases come from the same round. Writes, per
case in the order given, the summaries' TTFT (from Generate's arrival on the decode worker) and
measured handoff ms, their parts (Q, H, X, R, J), and the actions and schedules actually used.
With `--new-tokens` T > 1 each call generates T tokens (EOS ignored) and it also writes the time
from the call to the T-th token's arrival here (`last_token_ms`, the client's clock).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import grpc
import torch

from rekv_cli.client import generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", required=True)
    parser.add_argument("--prompt-len", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--actions", required=True)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--new-tokens", type=int, default=1)
    args = parser.parse_args(argv)
    ids = torch.randint(0, args.vocab, (args.prompt_len,),
                        generator=torch.Generator().manual_seed(args.seed)).tolist()
    cases = json.loads(args.actions)
    results = [{"forced": case["action"], "schedule": case["schedule"], "samples_ms": [],
                "handoff_ms": [], "used": [], "predicted_ms": [], "parts_ms": [],
                "last_token_ms": [],
                "fallbacks": 0} for case in cases]
    order = random.Random(args.seed)
    with grpc.insecure_channel(args.decode) as channel:
        for run in range(args.warmups + args.runs):
            for number in order.sample(range(len(cases)), len(cases)):
                _request(channel, args, ids, number, run, cases[number], results[number],
                         timed=run >= args.warmups)
    with open(args.out, "w") as out:
        json.dump(results, out)
    return 0


def _request(channel, args, ids: list[int], number: int, run: int, case: dict, result: dict,
             timed: bool) -> None:
    forced = tuple(case["action"]) if case["action"] else None
    schedule = tuple(case["schedule"]) if case["schedule"] else None
    called = time.perf_counter()
    g = generate(channel, f"link-{args.prompt_len}-{number}-{run}", ids, args.new_tokens,
                 forced_action=forced, forced_schedule=schedule, timeout=600,
                 stop_at_eos=False if args.new_tokens > 1 else None)
    s = g.summary
    result["fallbacks"] += s.fallback
    if not timed:
        return
    result["samples_ms"].append(s.ttft_ms)
    result["handoff_ms"].append(s.measured_handoff_ms)
    if len(g.token_ids) != args.new_tokens:
        raise RuntimeError(f"case {number}: {len(g.token_ids)} tokens, asked for "
                           f"{args.new_tokens}")
    result["last_token_ms"].append((g.arrivals[-1] - called) * 1e3)
    result["used"].append([s.action_kind, s.action.codec, s.action.cut, s.schedule.streamed,
                           s.schedule.boundary_chunk_tokens, s.action.boundary or "bf16",
                           s.schedule.pipelined, s.action.split_tokens, s.action.progressive,
                           s.action.layer_split_tokens])
    result["predicted_ms"].append(s.predicted_handoff_ms)
    t = s.timings
    result["parts_ms"].append({"Q": t.q_ms, "H": t.h_ms, "X": t.x_ms, "R": t.r_ms, "J": t.j_ms})


if __name__ == "__main__":
    sys.exit(main())
