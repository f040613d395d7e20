"""The router side of `rekv bench link`, run inside the decode side's namespace.

    python -m rekv_cli.linkbench.client --decode HOST:PORT --prompt-len S --actions JSON
        --warmups W --runs N --seed K --out FILE

For each case in `--actions` (a JSON list of {"action": [codec, cut] or null for the planner's
choice, "schedule": [streamed, boundary chunk tokens] or null for the services' default}), in order:
W untimed and N timed `Generate` calls with one new token and the same prompt of S token ids;
writes, per case, the summaries' TTFT (from Generate's arrival on the decode worker) and measured
handoff ms, their parts (Q, H, X, R, J), and the actions and schedules actually used.
"""

from __future__ import annotations

import argparse
import json
import sys

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
    args = parser.parse_args(argv)
    ids = torch.randint(0, args.vocab, (args.prompt_len,),
                        generator=torch.Generator().manual_seed(args.seed)).tolist()
    results = []
    with grpc.insecure_channel(args.decode) as channel:
        for number, case in enumerate(json.loads(args.actions)):
            forced = tuple(case["action"]) if case["action"] else None
            schedule = tuple(case["schedule"]) if case["schedule"] else None
            samples, handoffs, used, predicted, parts, fallbacks = [], [], [], [], [], 0
            for run in range(args.warmups + args.runs):
                g = generate(channel, f"link-{args.prompt_len}-{number}-{run}", ids, 1,
                             forced_action=forced, forced_schedule=schedule, timeout=600)
                s = g.summary
                fallbacks += s.fallback
                if run >= args.warmups:
                    samples.append(s.ttft_ms)
                    handoffs.append(s.measured_handoff_ms)
                    used.append([s.action_kind, s.action.codec, s.action.cut,
                                 s.schedule.streamed, s.schedule.boundary_chunk_tokens,
                                 s.action.boundary or "bf16"])
                    predicted.append(s.predicted_handoff_ms)
                    t = s.timings
                    parts.append({"Q": t.q_ms, "H": t.h_ms, "X": t.x_ms, "R": t.r_ms,
                                  "J": t.j_ms})
            results.append({"forced": list(forced) if forced else None,
                            "schedule": list(schedule) if schedule else None,
                            "samples_ms": samples, "handoff_ms": handoffs, "used": used,
                            "predicted_ms": predicted, "parts_ms": parts,
                            "fallbacks": fallbacks})
    with open(args.out, "w") as out:
        json.dump(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
