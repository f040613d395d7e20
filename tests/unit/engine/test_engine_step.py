"""Which step the engine runs (`engine_step`): on CUDA the bucketed slab of `max_batch` slots (32
unless told) of `capacity` positions (the model's context unless told); on the CPU the batched
step, its GEMMs prepacked where PyTorch packs the weights; with `invariant` each row through the
single-stream kernels (`exact_linear`), on either device and in any dtype."""

import functools
from types import SimpleNamespace

import pytest
import torch

from rekv_core.engine import loop
from rekv_core.engine.loop import engine_step, exact_linear
from rekv_core.model.batched import batched_decode_step
from rekv_core.model.blocks import linear as block_linear


def _model(device, dtype):
    return SimpleNamespace(device=torch.device(device), dtype=dtype,
                           shape=SimpleNamespace(max_positions=4096))


@pytest.fixture
def buckets(monkeypatch):
    made = []
    monkeypatch.setattr(loop, "BucketedDecoder", lambda *args, **kwargs: made.append(
        (args, kwargs)) or "bucketed")
    return made


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_bucketed_slab_of_the_batch_and_context(buckets, dtype):
    model = _model("cuda", dtype)
    assert engine_step(model) == "bucketed"
    assert engine_step(model, 8, 1000, invariant=True) == "bucketed"
    assert buckets == [((model, 32, 4096), {"linear": block_linear}),
                       ((model, 8, 1000), {"linear": exact_linear})]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_the_cpu_the_batched_step_prepacked_or_invariant(buckets, monkeypatch, dtype):
    step = engine_step(_model("cpu", dtype), invariant=True)
    assert isinstance(step, functools.partial) and step.func is batched_decode_step
    assert step.keywords == {"linear": exact_linear} and not step.args
    packed = SimpleNamespace(linear=object())
    monkeypatch.setattr(loop.PackedLinears, "for_model", lambda model: packed)
    step = engine_step(_model("cpu", dtype))
    assert step.func is batched_decode_step and step.keywords == {"linear": packed.linear}
    monkeypatch.setattr(loop.PackedLinears, "for_model", lambda model: None)
    assert engine_step(_model("cpu", dtype)) is batched_decode_step
    assert buckets == []


def test_a_stream_whose_emit_fails_is_taken_out_and_named_with_the_error(caplog):
    import logging

    def broken(token, finish, error):
        raise RuntimeError("the caller's loop is closed")

    stream = SimpleNamespace(request_id="req-9", emit=broken, cancelled=False)
    with caplog.at_level(logging.ERROR, logger=loop.log.name):
        loop._emit(stream, 5, None, None)
    assert stream.cancelled
    (record,) = caplog.records
    assert record.getMessage() == "stream req-9: emit failed; the stream is taken out"
    assert record.exc_info[1].args == ("the caller's loop is closed",)
