"""A router's view of rekv: call `Decode.Generate` and collect the stream.

`generate(channel, request_id, prompt, max_new_tokens, ...)` returns a `Generation` with the new
token ids, their text, the summary and when each message with tokens arrived (`arrivals`,
`time.perf_counter()`: the inter-token latency a router sees); gRPC errors propagate as `grpc.RpcError`. `quality`:
"lossless" (greedy output equals the single-process reference's), "gated" (also the lossy actions
the quality gate passed) or None (the deployment's default); the summary says which applied.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from services.rpc import rekv_pb2, rekv_pb2_grpc


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    summary: rekv_pb2.Summary
    messages: int
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each token message

    def token_gaps(self) -> list[float]:
        """Seconds between consecutive token messages (the inter-token latencies seen here)."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def generate_request(request_id: str, prompt: str | Sequence[int], max_new_tokens: int,
                     forced_action: tuple | None = None,
                     sampling: dict | None = None, stop_at_eos: bool | None = None,
                     forced_schedule: tuple | None = None, quality: str | None = None):
    """`forced_action`: (codec, cut), (codec, cut, boundary coding), (codec, cut, boundary
    coding, token split l), (codec, cut, boundary coding, token split l, progressive) or (codec,
    cut, boundary coding, token split l, progressive, per-layer form's l); `forced_schedule`:
    (streamed, boundary chunk tokens) or (streamed, boundary chunk tokens, pipelined)."""
    request = rekv_pb2.GenerateRequest(request_id=request_id, max_new_tokens=max_new_tokens)
    if quality is not None:
        request.quality = rekv_pb2.Quality.Value(f"QUALITY_{quality.upper()}")
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if forced_action is not None:
        request.forced_action.codec, request.forced_action.cut = forced_action[:2]
        if len(forced_action) > 2:
            request.forced_action.boundary = forced_action[2]
        if len(forced_action) > 3:
            request.forced_action.split_tokens = forced_action[3]
        if len(forced_action) > 4:
            request.forced_action.progressive = forced_action[4]
        if len(forced_action) > 5:
            request.forced_action.layer_split_tokens = forced_action[5]
    if sampling is not None:
        request.sampling.CopyFrom(rekv_pb2.SamplingParams(**sampling))
    if stop_at_eos is not None:
        request.stop_at_eos = stop_at_eos
    if forced_schedule is not None:
        streamed, chunk, *pipelined = forced_schedule
        request.forced_schedule.CopyFrom(rekv_pb2.Schedule(
            streamed=streamed, boundary_chunk_tokens=chunk, pipelined=bool(pipelined)
            and pipelined[0]))
    return request


def generate(channel: grpc.Channel, request_id: str, prompt: str | Sequence[int],
             max_new_tokens: int, forced_action: tuple[str, int] | None = None,
             sampling: dict | None = None, stop_at_eos: bool | None = None,
             timeout: float | None = 300.0,
             forced_schedule: tuple | None = None, quality: str | None = None,
             metadata: Sequence[tuple[str, str]] | None = None) -> Generation:
    """`metadata`: the call's gRPC metadata, e.g. a router's W3C `traceparent`."""
    stub = rekv_pb2_grpc.DecodeStub(channel)
    request = generate_request(request_id, prompt, max_new_tokens, forced_action, sampling,
                               stop_at_eos, forced_schedule, quality)
    tokens, pieces, summary, count, arrivals = [], [], None, 0, []
    for response in stub.Generate(request, timeout=timeout, metadata=metadata):
        count += 1
        if response.token_ids:
            arrivals.append(time.perf_counter())
        tokens.extend(response.token_ids)
        pieces.append(response.text)
        if response.HasField("summary"):
            summary = response.summary
    if summary is None:
        raise RuntimeError(f"request {request_id}: the stream ended without a summary")
    return Generation(tokens, "".join(pieces), summary, count, arrivals)
