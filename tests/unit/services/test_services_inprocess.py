"""Both servers in this one process over the in-process transport (`--transport inprocess`):
the services pick their data plane by name, and a lossless handoff still reproduces the
reference."""

import asyncio

import grpc
import pytest
import torch

from rekv_cli.client import generate_request
from rekv_core.model import greedy_generate
from services.decode.server import build as build_decode
from services.metrics import ServiceMetrics
from services.prefill.server import build as build_prefill
from services.rpc import rekv_pb2, rekv_pb2_grpc
from services.settings import ServiceSettings

PROMPT = "The capital of France is"


async def _start(settings: ServiceSettings, build):
    server = grpc.aio.server()
    _, drain, extra = await build(settings, server, ServiceMetrics(settings.role))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, drain, extra


async def _generate(forced: tuple[str, int], n: int) -> tuple[list[int], rekv_pb2.Summary, dict]:
    common = ["--transport", "inprocess", "--dtype", "bfloat16", "--plaintext", "true",
              "--torch-threads", str(torch.get_num_threads())]
    prefill, port, drain_prefill, _ = await _start(
        ServiceSettings.from_args("prefill", common), build_prefill)
    decode_settings = ServiceSettings.from_args("decode",
                                                [*common, "--prefill-address", f"127.0.0.1:{port}"])
    decode, decode_port, drain_decode, extra = await _start(decode_settings, build_decode)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode_port}") as channel:
            request = rekv_pb2.GenerateRequest(request_id="inprocess", text=PROMPT,
                                               max_new_tokens=n, stop_at_eos=False)
            request.forced_action.codec, request.forced_action.cut = forced
            tokens, summary = [], None
            async for response in rekv_pb2_grpc.DecodeStub(channel).Generate(request):
                tokens += response.token_ids
                if response.HasField("summary"):
                    summary = response.summary
    finally:
        for server, drain in ((decode, drain_decode), (prefill, drain_prefill)):
            await server.stop(1)
            await drain()
    return tokens, summary, extra


@pytest.mark.parametrize("forced", [("bf16", 15), ("int8", 30)], ids=["bf16_recompute",
                                                                     "int8_transfer"])
def test_both_services_in_one_process_over_the_inprocess_transport(smollm_bf16, tokenizer,
                                                                   forced):
    tokens, summary, extra = asyncio.run(_generate(forced, 8))
    assert extra["ucx"].startswith("inprocess:")  # the receiver's address names its transport
    assert not summary.fallback and (summary.action.codec, summary.action.cut) == forced
    reference = greedy_generate(smollm_bf16, tokenizer.encode(PROMPT), 8)
    if forced[0] == "bf16":
        assert tokens == reference
    else:
        assert tokens[0] == reference[0]
    assert summary.bytes.prefix > 0


async def _refusals() -> dict[str, grpc.aio.AioRpcError]:
    """A decode service whose prefill pool is unreachable, set to fail fast, holding at most
    about 40 MiB for requests."""
    settings = ServiceSettings.from_args("decode", [
        "--dtype", "bfloat16", "--plaintext", "true", "--prefill-address", "127.0.0.1:1",
        "--max-inflight-bytes", str(40 << 20), "--on-handoff-failure", "fail",
        "--max-prompt-tokens", "4096"])
    server, port, drain, _ = await _start(settings, build_decode)
    errors = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rekv_pb2_grpc.DecodeStub(channel)
            for name, ids in (("long", [17] * 1800), ("short", [17] * 8)):
                request = generate_request(name, ids, 4)
                try:
                    async for _ in stub.Generate(request, timeout=60):
                        pass
                except grpc.aio.AioRpcError as exc:
                    errors[name] = exc
    finally:
        await server.stop(1)
        await drain()
    return errors


def test_beyond_its_memory_bound_a_request_is_refused_and_a_failed_handoff_can_fail_fast():
    errors = asyncio.run(_refusals())
    # 1,800 tokens of cache (30 layers, 3 KV heads of 64, BF16) alone are about 40 MiB
    assert errors["long"].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_inflight_bytes" in errors["long"].details()
    assert errors["short"].code() == grpc.StatusCode.UNAVAILABLE
    assert "on_handoff_failure" in errors["short"].details()
