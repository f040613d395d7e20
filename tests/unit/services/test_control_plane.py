"""The control plane's static parts: every RPC and field of the .proto documented, service
settings, sampling. The generated modules in step with the .proto: tests/system/test_commands.py."""

import pytest
import torch

from rekv_core.model.sampling import Sampler, SamplingParams
from services.serving import call_threads
from services.settings import ServiceSettings


def test_every_rpc_and_field_is_documented():
    from services.rpc import rekv_pb2

    text = open("proto/rekv/v1/rekv.proto").read()
    for service in rekv_pb2.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            before = text[:text.index(f"rpc {method.name}(")].rstrip().splitlines()[-1]
            assert before.strip().startswith("//"), f"rpc {method.name} has no comment"
    lines = text.splitlines()
    for message in rekv_pb2.DESCRIPTOR.message_types_by_name.values():
        for f in message.fields:
            start = lines.index(f"message {message.name} {{")
            index = next(i for i in range(start, len(lines))
                         if f" {f.name} = {f.number};" in lines[i])
            documented = "//" in lines[index] or lines[index - 1].strip().startswith("//")
            assert documented, f"{message.name}.{f.name} has no comment"


def test_settings_come_from_flags_then_environment(monkeypatch):
    monkeypatch.setenv("REKV_MAX_PROMPT_TOKENS", "1000")
    monkeypatch.setenv("REKV_CODECS", "bf16,int4")
    monkeypatch.setenv("REKV_PLAINTEXT", "true")
    s = ServiceSettings.from_args("decode", ["--prefill-address", "h:1", "--max-prompt-tokens",
                                             "2000"])
    assert s.max_prompt_tokens == 2000 and s.codecs == ("bf16", "int4")
    with pytest.raises(ValueError, match="max_concurrent"):
        ServiceSettings.from_args("prefill", ["--max-concurrent", "0"])
    with pytest.raises(ValueError, match="link_gbps: cannot read"):
        ServiceSettings.from_args("prefill", ["--link-gbps", "fast"])
    with pytest.raises(ValueError, match="device"):
        ServiceSettings.from_args("prefill", ["--device", "tpu"])


def test_the_prefill_schedulers_settings_are_read_and_checked(monkeypatch):
    monkeypatch.setenv("REKV_PLAINTEXT", "true")
    s = ServiceSettings.from_args("prefill", [])
    assert s.prefill_token_budget == 2048 and not s.batch_invariant
    assert s.prefill_catch_up_layers == 8
    monkeypatch.setenv("REKV_BATCH_INVARIANT", "true")
    s = ServiceSettings.from_args("prefill", ["--prefill-token-budget", "0",
                                              "--prefill-catch-up-layers", "0"])
    assert s.prefill_token_budget == 0 and s.batch_invariant and s.prefill_catch_up_layers == 0
    with pytest.raises(ValueError, match=r"prefill_catch_up_layers: must be >= 0 \(0: off\)"):
        ServiceSettings.from_args("prefill", ["--prefill-catch-up-layers", "-2"])
    with pytest.raises(ValueError, match=r"prefill_token_budget: must be >= 0 \(0: no "):
        ServiceSettings.from_args("prefill", ["--prefill-token-budget", "-1"])


@pytest.mark.parametrize("role,args", [("prefill", []), ("decode", ["--prefill-address", "h:1"])])
def test_every_admitted_call_has_a_thread_for_its_blocking_work(monkeypatch, role, args):
    monkeypatch.setenv("REKV_PLAINTEXT", "true")
    settings = ServiceSettings.from_args(role, args + ["--max-queue", "100"])
    admitted = settings.max_concurrent + settings.max_queue + (
        settings.max_batch if role == "decode" else 0)
    assert call_threads(settings) > admitted


def test_the_deployments_quality_default_comes_from_the_flag_or_rekv_quality(monkeypatch):
    monkeypatch.setenv("REKV_PLAINTEXT", "true")
    decode = ["--prefill-address", "h:1"]
    assert ServiceSettings.from_args("decode", decode).quality == "gated"
    monkeypatch.setenv("REKV_QUALITY", "lossless")
    assert ServiceSettings.from_args("decode", decode).quality == "lossless"
    assert ServiceSettings.from_args("decode", [*decode, "--quality", "gated"]).quality == "gated"
    with pytest.raises(ValueError, match="^quality: must be one of"):
        ServiceSettings.from_args("decode", [*decode, "--quality", "best"])


def test_sampling_is_seeded_and_respects_top_k():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_k=5, seed=3)
    draws = [Sampler(params)(logits) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same token
    sampler = Sampler(params)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    assert {sampler(logits) for _ in range(50)} <= top5
    assert Sampler()(logits) == int(logits.argmax())
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    assert nucleus(logits) == int(logits.argmax())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -1.0),
    ("temperature", 1e-30), ("top_p", float("nan")), ("top_p", float("inf")), ("top_k", -1),
])
def test_every_sampling_number_is_checked_nan_and_inf_included(field, value):
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingParams(**{field: value})


def test_a_nan_temperature_from_the_wire_is_an_invalid_argument():
    from services import wire_convert
    from services.errors import InvalidArgument
    from services.rpc import rekv_pb2

    request = rekv_pb2.GenerateRequest(request_id="r", max_new_tokens=4, text="hi",
                                       sampling=rekv_pb2.SamplingParams(temperature=float("nan")))
    with pytest.raises(InvalidArgument, match="sampling.temperature"):
        wire_convert.generate_call(request, 30)
