"""What `plan.measure` times and in which unit: the codec's encode and decode of one layer of
random BF16 K and V (512 tokens of the shape, on the CPU unless told), median of 3, in
milliseconds per MiB of BF16 KV."""

import pytest
import torch

from rekv_core.model.shapes import get_preset
from rekv_core.plan import measure
from rekv_core.units import MiB


def test_codec_costs_are_the_median_timing_in_ms_per_mib(monkeypatch):
    calls = []

    def timed(fn, repeats, device):
        calls.append((repeats, device))
        fn()
        return 0.002  # 2 ms, whatever ran

    encoded_shapes = []
    monkeypatch.setattr(measure, "median_seconds", timed)
    shape = get_preset("smollm2-135m")
    real_get_codec = measure.get_codec

    class Recording:
        def __init__(self, name):
            self.codec = real_get_codec(name)

        def __getattr__(self, name):
            return getattr(self.codec, name)

        def encode(self, k, v, **kwargs):
            encoded_shapes.append(tuple(k.shape))
            return self.codec.encode(k, v, **kwargs)

    monkeypatch.setattr(measure, "get_codec", Recording)
    encode_ms, decode_ms = measure.measure_codec_costs("int8", shape)
    mib = shape.kv_layer_bytes(512) / MiB
    assert encode_ms == pytest.approx(2.0 / mib) and decode_ms == pytest.approx(2.0 / mib)
    assert calls == [(3, torch.device("cpu"))] * 2
    assert set(encoded_shapes) == {(shape.num_kv_heads, 512, shape.head_dim)}


def test_a_profile_holds_what_was_measured_and_how(monkeypatch):
    from types import SimpleNamespace

    from rekv_core.plan import profile
    from rekv_core.plan.estimates import LayerCost

    model = SimpleNamespace(shape=get_preset("smollm2-135m"), device=torch.device("meta"),
                            dtype=torch.bfloat16)
    codec_calls, layer_calls = [], []
    layer_cost = LayerCost([64, 256], [1.0, 3.0])

    def codec_costs(name, shape, prompt_len, device):
        codec_calls.append((name, shape.name, prompt_len, device))
        return {"int8": (0.5, 0.25), "int4": (0.75, 0.5)}[name]

    monkeypatch.setattr(profile, "measure_codec_costs", codec_costs)
    monkeypatch.setattr(profile, "measure_layer_cost",
                        lambda m, lengths: layer_calls.append((m, lengths)) or layer_cost)
    measured = profile.measure_profile(model, ["int8", "int4"])
    assert codec_calls == [("int8", "smollm2-135m", 1024, model.device),
                           ("int4", "smollm2-135m", 1024, model.device)]
    assert layer_calls == [(model, (64, 256, 1024, 2048))]
    assert measured == profile.Profile(
        model="smollm2-135m", device="meta", dtype="bfloat16",
        torch_threads=torch.get_num_threads(), layer_cost=layer_cost,
        quantize_ms_per_mib={"int8": 0.5, "int4": 0.75},
        restore_ms_per_mib={"int8": 0.25, "int4": 0.5}, meta={"codec_prompt_len": 1024})


class _Fake:
    """A codec that ranks tokens and records what it was given."""

    importance_window = 4

    def __init__(self):
        self.encoded, self.decoded = [], []

    def encode(self, k, v, **kwargs):
        self.encoded.append((k, v, kwargs))
        return ("payload", len(self.encoded))

    def decode(self, encoded):
        self.decoded.append(encoded)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_codec_costs_time_the_codec_on_seeded_bf16_kv_on_the_device(monkeypatch, device):
    """K and V: the first two draws of a generator seeded 0, in BF16 on `device`; every encode
    gets the fixed timing ranking (earlier tokens first); decode gets what encode returned."""
    fake = _Fake()
    monkeypatch.setattr(measure, "get_codec", lambda name: fake)
    monkeypatch.setattr(measure, "median_seconds", lambda fn, repeats, dev: (fn(), 0.001)[1])
    shape = get_preset("smollm2-135m")
    measure.measure_codec_costs("spectrum30", shape, prompt_len=8, device=device)
    assert len(fake.encoded) == 2 and fake.decoded == [("payload", 1)]
    generator = torch.Generator().manual_seed(0)
    kv = (shape.num_kv_heads, 8, shape.head_dim)
    want_k, want_v = (torch.randn(kv, generator=generator).to(torch.bfloat16) for _ in range(2))
    for k, v, kwargs in fake.encoded:
        assert k.device.type == v.device.type == device
        assert k.dtype == v.dtype == torch.bfloat16 and tuple(k.shape) == kv
        ranking = kwargs["context"].token_importance
        assert ranking.device.type == device and tuple(ranking.shape) == (8,)
        if device == "cpu":
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
            assert torch.equal(ranking, torch.linspace(1.0, 0.0, 8))
