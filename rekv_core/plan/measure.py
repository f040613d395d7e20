"""Measuring, on this machine, the per-layer costs the cost model needs.

`measure_layer_cost(model, lengths)`: one layer's prefill time (ms, median of `repeats` after a
warm-up) at each prompt length, as a `LayerCost`. `measure_codec_costs(codec, shape, S, device)`:
(encode, decode) milliseconds per MiB of BF16 KV for one layer of that shape.
"""

from __future__ import annotations

import torch

from rekv_core.codecs import EncodeContext, get_codec
from rekv_core.model.executor import Model, iter_layers
from rekv_core.model.shapes import ModelShape
from rekv_core.plan.estimates import LayerCost
from rekv_core.timing import median_seconds
from rekv_core.units import MiB


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    return median_seconds(fn, repeats, device) * 1e3


@torch.inference_mode()
def measure_layer_cost(model: Model, lengths=(64, 256, 1024), repeats: int = 3) -> LayerCost:
    generator = torch.Generator().manual_seed(0)
    times = []
    for S in lengths:
        h = (torch.randn(S, model.shape.hidden_size, generator=generator) * 0.5).to(
            model.device, model.dtype)
        times.append(_median_ms(lambda: next(iter_layers(model, h, 0, 1)), repeats,
                                model.device))
    return LayerCost(list(lengths), times)


def measure_codec_costs(codec_name: str, shape: ModelShape, prompt_len: int = 512,
                        device: torch.device | str = "cpu", repeats: int = 3
                        ) -> tuple[float, float]:
    device = torch.device(device)
    codec = get_codec(codec_name)
    kv = (shape.num_kv_heads, prompt_len, shape.head_dim)
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(kv, generator=generator).to(device, torch.bfloat16)
    v = torch.randn(kv, generator=generator).to(device, torch.bfloat16)
    mib = shape.kv_layer_bytes(prompt_len) / MiB
    context = EncodeContext.for_timing(codec, k)
    encoded = codec.encode(k, v, context=context)
    encode_ms = _median_ms(lambda: codec.encode(k, v, context=context), repeats, device)
    decode_ms = _median_ms(lambda: codec.decode(encoded), repeats, device)
    return encode_ms / mib, decode_ms / mib
