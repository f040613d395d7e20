"""Triton quantizer kernels against their PyTorch reference (interpreter mode on the CPU)."""

import pytest
import torch

from rekv_core.kernels import dequantize_groupwise, quantize_groupwise
from rekv_core.kernels.groupwise_reference import unpack_codes

SHAPES = [(3, 1, 64), (3, 63, 64), (3, 100, 64), (2, 63, 128), (1, 1, 128)]


def _shape_id(shape):
    return "x".join(map(str, shape))


def _sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 1, shape[-1])  # varied group ranges
    x[..., :64][0, 0] = 0.0  # one all-zero group: scale 0, codes 0
    return x.to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_triton_equals_reference(shape, dtype, bits):
    x = _sample(shape, dtype)
    ref_codes, ref_scales = quantize_groupwise(x, bits, backend="torch")
    codes, scales = quantize_groupwise(x, bits, backend="triton")
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel() * bits // 8
    assert torch.equal(scales, ref_scales), "scales differ"
    mismatch = (codes != ref_codes).nonzero()
    assert mismatch.numel() == 0, f"codes differ at {mismatch[:5].flatten().tolist()}"
    for out_dtype in (dtype, torch.float32):
        ref = dequantize_groupwise(ref_codes, ref_scales, bits, shape, out_dtype, backend="torch")
        got = dequantize_groupwise(codes, scales, bits, shape, out_dtype, backend="triton")
        assert torch.equal(got, ref), f"dequantized {out_dtype} differs"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_error_is_at_most_half_a_step(shape, bits):
    x = _sample(shape, torch.bfloat16, seed=1)
    codes, scales = quantize_groupwise(x, bits, backend="torch")
    restored = dequantize_groupwise(codes, scales, bits, shape, torch.float32, backend="torch")
    error = (x.float() - restored).abs().reshape(-1, 64)
    step = scales.float()[:, None]
    assert (error <= step / 2 * (1 + 1e-6)).all(), f"max error/step {(error / step).max():.4f}"
    qmax = 127 if bits == 8 else 7
    assert unpack_codes(codes, bits).abs().max() <= qmax
    assert restored.reshape(-1, 64)[0].eq(0).all() and scales[0] == 0  # the all-zero group


def test_int4_nibble_layout():
    x = torch.zeros(64)
    x[0], x[1], x[2] = 7.0, -7.0, 1.0  # scale 1: codes 7, -7, 1, then zeros
    codes, scales = quantize_groupwise(x, 4, backend="torch")
    assert scales[0] == 1.0
    assert codes[0] == (7 + 8) | ((-7 + 8) << 4)
    assert codes[1] == (1 + 8) | (8 << 4)


def test_values_beyond_fp16_range_clamp_the_scale():
    x = torch.full((64,), 1e9)
    codes, scales = quantize_groupwise(x, 8, backend="torch")
    assert scales[0] == 65504.0
    assert torch.isfinite(dequantize_groupwise(codes, scales, 8, (64,), torch.float32)).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_are_named(backend):
    with pytest.raises(ValueError, match="bits"):
        quantize_groupwise(torch.zeros(64), 3, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        quantize_groupwise(torch.zeros(64), 8, backend="cuda")
    if backend == "triton":
        with pytest.raises(ValueError, match="last dimension must be a multiple of 64"):
            quantize_groupwise(torch.zeros(2, 96), 8, backend=backend)
        with pytest.raises(ValueError, match="contiguous"):
            quantize_groupwise(torch.zeros(128, 64).t(), 8, backend=backend)
        with pytest.raises(ValueError, match="do not describe shape"):
            dequantize_groupwise(torch.zeros(10, dtype=torch.uint8), torch.zeros(1).half(), 8,
                                 (64,), torch.float32, backend=backend)
