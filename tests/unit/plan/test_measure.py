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
