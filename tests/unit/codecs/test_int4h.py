"""`int4h`: the Hadamard rotation, the quantizer's bounds and layout, Triton against the reference,
the codec on the wire, and the error it saves over plain `int4` on keys with outlier channels."""

import pytest
import torch

from rekv_core.codecs import (
    CorruptPayloadError,
    EncodedKV,
    HadamardInt4Codec,
    codec_names,
    get_codec,
)
from rekv_core.codecs.fidelity import kv_error, relative_mse
from rekv_core.kernels import dequantize_int4h, quantize_int4h
from rekv_core.kernels.hadamard_reference import (
    block_hadamard,
    default_block,
    fwht,
    hadamard_matrix,
    rotate,
    rotation_scales,
    unpack_nibbles,
    unrotate,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (shape, block): power-of-two and padded head_dims, several blocks, block 1 = no rotation
CASES = [((2, 5, 64), 64), ((3, 7, 128), 128), ((1, 9, 128), 32), ((2, 9, 96), 32),
         ((1, 3, 80), 16), ((2, 4, 64), 1), ((1, 2, 6), 2)]


def _case_id(case):
    shape, block = case
    return "x".join(map(str, shape)) + f"-b{block}"


def _sample(shape, dtype=torch.float32, seed=0, outliers=0):
    g = torch.Generator().manual_seed(seed)
    channel = torch.logspace(-1, 1, shape[-1])
    if outliers:
        channel = torch.ones(shape[-1])
        channel[torch.randperm(shape[-1], generator=g)[:outliers]] = 10 + 20 * torch.rand(
            outliers, generator=g)
    x = torch.randn(shape, generator=g) * channel
    rows = x.view(-1, shape[-1])
    rows[0] = 0.0  # scale 0: exact zeros back
    if rows.shape[0] > 3:  # min ±0: stored as +0 by both backends
        rows[3] = rows[3].abs()
        rows[3, ::3] = -0.0
    if x.shape[1] > 2:
        x[0, 1] = 3.0  # a constant row: rotated to one spike (or constant, for block 1)
        big = 6e4 if dtype == torch.float16 else 1e6  # beyond FP16 (rotated): clamped, finite
        x[0, 2, :2] = torch.tensor([big, -big])
    return x.to(dtype)


@pytest.mark.parametrize("block", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_hadamard_is_orthonormal_symmetric_and_the_butterfly_computes_it(block):
    h = hadamard_matrix(block)
    assert torch.allclose(h @ h.T, torch.eye(block, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(h, h.T)
    x = torch.randn(5, 2 * block, generator=torch.Generator().manual_seed(block))
    want = x.double() @ block_hadamard(2 * block, block) * block ** 0.5
    assert torch.allclose(fwht(x.clone(), block).double(), want, rtol=1e-5, atol=1e-5)
    forward, inverse = rotation_scales(block)
    assert forward * inverse * block == 1.0
    assert torch.allclose(unrotate(rotate(x, block), block), x, rtol=1e-5, atol=1e-5)


def test_block_diagonal_rotation_preserves_dot_products_in_fp64():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(7, 96, generator=g, dtype=torch.float64), torch.randn(
        11, 96, generator=g, dtype=torch.float64)
    for block in (2, 8, 32):
        h = block_hadamard(96, block)
        assert torch.allclose(h @ h.T, torch.eye(96, dtype=torch.float64), atol=1e-12, rtol=0)
        assert torch.allclose((q @ h) @ (k @ h).T, q @ k.T, rtol=0, atol=1e-11)


def test_default_block_and_bad_blocks():
    assert [default_block(d) for d in (64, 128, 96, 80, 6)] == [64, 128, 32, 16, 2]
    with pytest.raises(ValueError, match="block: must be a power of two"):
        quantize_int4h(torch.zeros(2, 96), 3)
    with pytest.raises(ValueError, match="block: 128 does not divide head_dim 96"):
        quantize_int4h(torch.zeros(2, 96), 128)
    with pytest.raises(ValueError, match="head_dim: int4h needs a positive even head_dim"):
        quantize_int4h(torch.zeros(2, 7), 1)
    with pytest.raises(ValueError, match="codes/scales"):
        dequantize_int4h(torch.zeros(3, dtype=torch.uint8), torch.zeros(2).half(), 2, (1, 8),
                         torch.float32)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_error_is_at_most_half_a_step_in_the_rotated_domain(case):
    shape, block = case
    x = _sample(shape, seed=2)
    codes, scales = quantize_int4h(x, block, backend="torch")
    d = shape[-1]
    step, low = scales[:, 0].float(), scales[:, 1].float()
    q = unpack_nibbles(codes).float().reshape(-1, d)
    assert q.max() <= 15
    y = rotate(x, block).reshape(-1, d)
    y2 = q * step[:, None] + low[:, None]
    ok = y.abs().amax(1) < 65504  # rows beyond FP16 clamp
    error = (y - y2).abs()[ok]
    assert (error <= step[ok, None] / 2 * (1 + 1e-5) + y2[ok].abs() * 2.0 ** -23).all()
    restored = dequantize_int4h(codes, scales, block, shape, torch.float32, backend="torch")
    assert torch.isfinite(restored).all()
    assert torch.equal(restored.reshape(-1, d)[0], torch.zeros(d))
    # the inverse rotation is orthogonal up to a known factor: the L2 error per row carries over
    alpha = rotation_scales(block)[0] * block ** 0.5
    row_error = (x.reshape(-1, d) - restored.reshape(-1, d)).double().norm(dim=1)[ok]
    assert torch.allclose(row_error, (y - y2).double().norm(dim=1)[ok] / alpha, rtol=1e-4,
                          atol=1e-6)
    assert (row_error <= d ** 0.5 * step[ok].double() / 2 / alpha * (1 + 1e-4) + 1e-6).all()


def test_nibble_layout_and_values_without_rotation():
    x = torch.tensor([[0.0, 15.0, 1.0, 14.0, 2.0, 2.0]])  # min 0, scale 1: codes are the values
    codes, scales = quantize_int4h(x, 1, backend="torch")
    assert scales.tolist() == [[1.0, 0.0]]
    assert codes.tolist() == [0 | 15 << 4, 1 | 14 << 4, 2 | 2 << 4]
    assert torch.equal(dequantize_int4h(codes, scales, 1, (1, 6), torch.float32), x)
    rotated, _ = quantize_int4h(_sample((2, 3, 64)), 64, backend="torch")
    nibbles = unpack_nibbles(rotated).reshape(-1, 2)
    assert torch.equal(nibbles[:, 0] | (nibbles[:, 1] << 4), rotated)


def test_directed_fp16_rounding_keeps_codes_in_range():
    x = torch.tensor([[0.1, 0.1001, 0.1002, 0.1003]])  # min not an FP16 value
    codes, scales = quantize_int4h(x, 1, backend="torch")
    step, low = scales[0].float()
    assert low <= 0.1 and step * 15 >= x.max() - low
    error = (dequantize_int4h(codes, scales, 1, (1, 4), torch.float32) - x).abs()
    assert (error <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_equals_reference(case, dtype):
    shape, block = case
    x = _sample(shape, dtype, seed=3)
    ref_codes, ref_scales = quantize_int4h(x, block, backend="torch")
    codes, scales = quantize_int4h(x, block, backend="triton")
    assert torch.equal(scales.view(torch.int16), ref_scales.view(torch.int16)), "scales differ"
    mismatch = (codes != ref_codes).nonzero()
    assert mismatch.numel() == 0, f"codes differ at {mismatch[:5].flatten().tolist()}"
    for out_dtype in {dtype, torch.float32}:
        ref = dequantize_int4h(ref_codes, ref_scales, block, shape, out_dtype, backend="torch")
        got = dequantize_int4h(codes, scales, block, shape, out_dtype, backend="triton")
        assert torch.equal(got.view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8)), (
            f"dequantized {out_dtype} differs")


@pytest.mark.cuda
@CUDA
def test_cuda_kernels_equal_the_cpu_reference():
    for shape, block in CASES + [((8, 4099, 128), 128), ((4, 1000, 96), 32)]:
        x = _sample(shape, torch.bfloat16, seed=4)
        ref_codes, ref_scales = quantize_int4h(x, block, backend="torch")
        codes, scales = quantize_int4h(x.cuda(), block)
        assert torch.equal(codes.cpu(), ref_codes), (shape, block)
        assert torch.equal(scales.cpu().view(torch.int16), ref_scales.view(torch.int16))
        ref = dequantize_int4h(ref_codes, ref_scales, block, shape, torch.bfloat16)
        got = dequantize_int4h(codes, scales, block, shape, torch.bfloat16)
        assert torch.equal(got.cpu().view(torch.int16), ref.view(torch.int16)), (shape, block)


def test_registered_with_both_tensors_rotated_by_default():
    assert "int4h" in codec_names()
    codec = get_codec("int4h")
    assert isinstance(codec, HadamardInt4Codec) and codec.rotate == "kv"


@pytest.mark.parametrize("rotate", ["k", "v", "kv"])
@pytest.mark.parametrize("shape", [(3, 1, 64), (2, 37, 128), (2, 5, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_codec_round_trip_through_the_wire(shape, rotate):
    k, v = _sample(shape, torch.bfloat16, seed=5), _sample(shape, torch.bfloat16, seed=6)
    codec = HadamardInt4Codec(rotate)
    encoded = codec.encode(k, v)
    assert encoded.meta == {"block": default_block(shape[2]), "rotate": rotate}
    assert encoded.payload_bytes == codec.payload_bytes(shape) == 2 * shape[0] * shape[1] * (
        shape[2] // 2 + 4)
    assert list(encoded.buffers) == ["k.codes", "k.scales", "v.codes", "v.scales"]
    wire = EncodedKV.from_wire(encoded.header_bytes(), encoded.buffers)
    k2, v2 = get_codec("int4h").decode(wire)  # follows the header's rotate, not its own
    assert k2.dtype == k.dtype and k2.shape == k.shape
    for name, x, y in (("k", k, k2), ("v", v, v2)):
        block = encoded.meta["block"] if name in rotate else 1
        scales = encoded.buffers[f"{name}.scales"].view(torch.float16)
        want = dequantize_int4h(encoded.buffers[f"{name}.codes"], scales, block, shape, x.dtype)
        assert torch.equal(y, want)


def test_triton_backed_codec_matches_the_reference_codec():
    k, v = _sample((2, 9, 128), torch.bfloat16, seed=7), _sample((2, 9, 128), torch.bfloat16)
    a = HadamardInt4Codec(block=32, backend="torch").encode(k, v)
    b = HadamardInt4Codec(block=32, backend="triton").encode(k, v)
    assert a.meta == b.meta == {"block": 32, "rotate": "kv"} and a.checksums == b.checksums
    assert all(torch.equal(a.buffers[n], b.buffers[n]) for n in a.buffers)


def _with_meta(encoded, meta, shape=None):
    return EncodedKV(codec=encoded.codec, shape=shape or encoded.shape, dtype=encoded.dtype,
                     buffers=dict(encoded.buffers), checksum_algorithm=encoded.checksum_algorithm,
                     checksums=dict(encoded.checksums), meta=meta)


@pytest.mark.parametrize("meta, message", [
    ({}, "meta: int4h needs exactly block and rotate"),
    ({"block": 64, "rotate": "kv", "extra": 1}, "meta: int4h needs exactly block and rotate"),
    ({"block": 48, "rotate": "kv"}, "meta.block: must be a power of two"),
    ({"block": 1, "rotate": "kv"}, "meta.block: must be a power of two >= 2"),
    ({"block": True, "rotate": "kv"}, "meta.block: must be a power of two"),
    ({"block": "64", "rotate": "kv"}, "meta.block: must be a power of two"),
    ({"block": 128, "rotate": "kv"}, "meta.block: 128 does not divide head_dim 64"),
    ({"block": 64, "rotate": "q"}, "meta.rotate: must be one of"),
    ({"block": 64, "rotate": ["k"]}, "meta.rotate: must be one of"),
])
def test_bad_meta_is_named(meta, message):
    k, v = _sample((2, 3, 64), torch.bfloat16), _sample((2, 3, 64), torch.bfloat16, seed=1)
    encoded = get_codec("int4h").encode(k, v)
    with pytest.raises(CorruptPayloadError, match=message):
        get_codec("int4h").decode(_with_meta(encoded, meta))


def test_bad_shapes_and_settings_are_named():
    with pytest.raises(ValueError, match="head_dim: int4h needs an even head_dim"):
        get_codec("int4h").encode(torch.zeros(1, 2, 7), torch.zeros(1, 2, 7))
    with pytest.raises(ValueError, match="head_dim: 96 is not a multiple of the rotation block 64"):
        HadamardInt4Codec(block=64).encode(torch.zeros(1, 2, 96), torch.zeros(1, 2, 96))
    with pytest.raises(ValueError, match="rotate: must be one of"):
        HadamardInt4Codec("q")
    with pytest.raises(ValueError, match="block: must be a power of two >= 2"):
        HadamardInt4Codec(block=24)
    k = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    encoded = get_codec("int4h").encode(k, k)
    with pytest.raises(CorruptPayloadError, match="head_dim"):
        get_codec("int4h").decode(_with_meta(encoded, encoded.meta, shape=(1, 2, 63)))


def test_rotating_keys_beats_plain_int4_on_outlier_channels():
    """Keys with 4 of 128 channels 10-30x larger (as post-RoPE keys have): rotation cuts the key
    and score errors several-fold (measured: 8x); values without outliers gain nothing."""
    g = torch.Generator().manual_seed(8)
    k = _sample((4, 256, 128), torch.bfloat16, seed=8, outliers=4)
    v = torch.randn(4, 256, 128, generator=g).bfloat16()
    queries = torch.randn(8, 32, 128, generator=g)
    plain = kv_error(get_codec("int4"), k, v, queries)
    rotated = kv_error(HadamardInt4Codec("k"), k, v, queries)
    both = kv_error(HadamardInt4Codec("kv"), k, v, queries)
    assert rotated.k * 4 < plain.k and rotated.scores * 4 < plain.scores
    assert rotated.output * 2 < plain.output
    assert both.k == rotated.k and abs(both.v - rotated.v) < 0.2 * rotated.v
    assert relative_mse(k, k) == 0.0
    with pytest.raises(ValueError, match="queries"):
        kv_error(get_codec("int4"), k, v, queries[:3])
