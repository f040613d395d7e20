"""A failed handoff through both services in this one process (`--transport inprocess`), the
prefill side injecting the fault each request id names (`services/prefill/faults.py`): when only
prefix layers are lost the decode service recomputes layers 0..m alone (`partial` in the summary
and the metrics), when the boundary is lost the whole prompt (`full`), and either way the tokens
are the reference's."""

import asyncio

import grpc
import torch

from rekv_cli.client import generate_request
from rekv_core.model import greedy_generate
from services.decode.server import build as build_decode
from services.metrics import ServiceMetrics
from services.prefill.server import build as build_prefill
from services.rpc import rekv_pb2_grpc
from services.settings import ServiceSettings

PROMPT = "The history of the city begins with a small settlement on the river. In the end,"
NEW_TOKENS = 6
SEED = (False, 0)  # the boundary first, then layers 0..c-1
STREAMED = (True, 0)  # layers 0..c-1 as the prefill computes them, then the boundary
REQUESTS = [  # request id, schedule, (scope, layers) expected
    ("flip_late_bit/streamed", STREAMED, ("partial", 15)),
    ("flip_bit/streamed", STREAMED, ("partial", 1)),  # the first payload: layer 0
    ("hold_prefix/seed", SEED, ("partial", 15)),  # layers 7..14 still held at the deadline
    ("flip_bit/seed", SEED, ("full", 30)),  # the first payload: the boundary
    ("hold_prefix/streamed", STREAMED, ("full", 30)),  # the boundary never left
]


async def _start(settings: ServiceSettings, build, metrics: ServiceMetrics):
    server = grpc.aio.server()
    _, drain, _ = await build(settings, server, metrics)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, drain


async def _serve_faults() -> tuple[dict, ServiceMetrics]:
    common = ["--transport", "inprocess", "--dtype", "bfloat16", "--plaintext", "true",
              "--torch-threads", str(torch.get_num_threads())]
    prefill, port, drain_prefill = await _start(ServiceSettings.from_args("prefill", [
        *common, "--fault-inject", "by_request", "--fault-hold-s", "30"]), build_prefill,
        ServiceMetrics("prefill"))
    metrics = ServiceMetrics("decode")
    decode, decode_port, drain_decode = await _start(ServiceSettings.from_args("decode", [
        *common, "--prefill-address", f"127.0.0.1:{port}", "--handoff-timeout-s", "3"]),
        build_decode, metrics)
    outcomes = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode_port}") as channel:
            stub = rekv_pb2_grpc.DecodeStub(channel)
            for request_id, schedule, _ in REQUESTS:
                request = generate_request(request_id, PROMPT, NEW_TOKENS, ("bf16", 15),
                                           stop_at_eos=False, forced_schedule=schedule)
                tokens, summary = [], None
                async for response in stub.Generate(request, timeout=120):
                    tokens += response.token_ids
                    if response.HasField("summary"):
                        summary = response.summary
                outcomes[request_id] = tokens, summary
    finally:
        for server, drain in ((decode, drain_decode), (prefill, drain_prefill)):
            await server.stop(1)
            await drain()
    return outcomes, metrics


def test_only_the_lost_layers_are_recomputed(smollm_bf16, tokenizer):
    outcomes, metrics = asyncio.run(_serve_faults())
    reference = greedy_generate(smollm_bf16, tokenizer.encode(PROMPT), NEW_TOKENS)
    for request_id, _, (scope, layers) in REQUESTS:
        tokens, summary = outcomes[request_id]
        assert summary.fallback, request_id
        assert (summary.fallback_scope, summary.recomputed_layers) == (scope, layers), request_id
        assert tokens == reference, request_id
        if scope == "partial":  # the action the verified layers and the boundary came by
            assert (summary.action.codec, summary.action.cut) == ("bf16", 15), request_id
            assert summary.bytes.boundary > 0, request_id
    sample = metrics.registry.get_sample_value
    assert sample("rekv_fallback_recompute_seconds_count", {"scope": "partial"}) == 3
    assert sample("rekv_fallback_recompute_seconds_count", {"scope": "full"}) == 2
    assert sample("rekv_fallback_recomputed_layers_total", {"scope": "partial"}) == 15 + 1 + 15
    assert sample("rekv_fallback_recomputed_layers_total", {"scope": "full"}) == 60
    assert sample("rekv_fallbacks_total", {"reason": "integrity"}) == 3
    assert sample("rekv_fallbacks_total", {"reason": "timeout"}) == 2
