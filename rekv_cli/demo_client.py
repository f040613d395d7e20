"""The router side of `rekv demo`, run inside the decode side's namespace (or on loopback).

    python -m rekv_cli.demo_client --decode HOST:PORT < REQUESTS.json

Reads a JSON list of requests on stdin, each {"id", "prompt" (text), "max_new_tokens", "action":
[codec, cut] or null (the planner's choice), "schedule": [streamed, boundary chunk tokens] or null
(the services' default), optionally "quality": "lossless" or "gated"}, sends them one at a time
through `Decode.Generate`, and writes one JSON line per request on stdout as soon as it is answered:
the summary's figures with the generated token ids and text, or {"id", "error"} when the call failed
(the next request is still sent).
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from rekv_cli.client import Generation, generate
from services.rpc import rekv_pb2


def figures(g: Generation) -> dict:
    """What the demo reports of one answered request."""
    s, b, t = g.summary, g.summary.bytes, g.summary.timings
    return {"prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
            "action_kind": s.action_kind, "codec": s.action.codec, "cut": s.action.cut,
            "streamed": s.schedule.streamed, "pipelined": s.schedule.pipelined,
            "boundary_chunk_tokens": s.schedule.boundary_chunk_tokens,
            "bytes": sum((b.boundary, b.prefix, b.scales, b.tokens, b.head)),
            "bytes_by_kind": {"boundary": b.boundary, "prefix": b.prefix, "scales": b.scales,
                              "tokens": b.tokens, "head": b.head},
            "ttft_ms": s.ttft_ms, "handoff_ms": s.measured_handoff_ms,
            "predicted_handoff_ms": s.predicted_handoff_ms, "request_ms": s.request_ms,
            "prefill_ms": t.prefill_ms,
            "parts_ms": {"Q": t.q_ms, "H": t.h_ms, "X": t.x_ms, "R": t.r_ms, "J": t.j_ms},
            "fallback": s.fallback, "fallback_reason": s.fallback_reason,
            "quality": rekv_pb2.Quality.Name(s.quality).removeprefix("QUALITY_").lower(),
            "token_ids": list(g.token_ids), "text": g.text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", required=True, help="the decode service's gRPC host:port")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = parser.parse_args(argv)
    requests = json.load(sys.stdin)
    with grpc.insecure_channel(args.decode) as channel:
        for r in requests:
            action = tuple(r["action"]) if r.get("action") else None
            schedule = tuple(r["schedule"]) if r.get("schedule") else None
            try:
                g = generate(channel, r["id"], r["prompt"], r["max_new_tokens"],
                             forced_action=action, forced_schedule=schedule,
                             timeout=args.timeout, quality=r.get("quality"))
                answer = {"id": r["id"], **figures(g)}
            except (grpc.RpcError, RuntimeError) as error:
                details = error.details() if isinstance(error, grpc.RpcError) else str(error)
                answer = {"id": r["id"], "error": details or repr(error)}
            print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
