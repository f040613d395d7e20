"""Codecs: round trips, the exact byte model (eq. 7) and refusal of corrupted payloads."""

import pytest
import torch

from rekv_core.codecs import CorruptPayloadError, EncodedKV, codec_names, get_codec
from rekv_core.codecs.sizes import codec_size_rows
from rekv_core.model.shapes import PRESETS, get_preset

MiB = 1 << 20


def _kv(shape=(3, 37, 64), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


def test_registry_lists_the_codecs_and_names_unknown_ones():
    assert codec_names()[:3] == ["bf16", "int8", "int4"]
    with pytest.raises(ValueError, match="unknown codec 'int2'.*bf16"):
        get_codec("int2")


def eq7_layer_bytes(shape, seq_len, bits):
    elements = 2 * seq_len * shape.num_kv_heads * shape.head_dim
    return elements * bits // 8 + elements // 64 * 2


@pytest.mark.parametrize("seq_len", [1, 512, 2048, 8192, 32768])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_payload_bytes_equal_eqs_2_and_7(preset, seq_len):
    shape = get_preset(preset)
    kv_shape = (shape.num_kv_heads, seq_len, shape.head_dim)
    assert get_codec("bf16").payload_bytes(kv_shape) == shape.kv_layer_bytes(seq_len)
    for bits in (8, 4):
        assert get_codec(f"int{bits}").payload_bytes(kv_shape) == eq7_layer_bytes(shape, seq_len,
                                                                                   bits)


def test_seed_check_values():
    rows = {(r.model, r.codec): r for r in codec_size_rows(list(PRESETS.values()), 8192)}
    assert rows["qwen2.5-7b", "bf16"].layer_bytes == 16 * MiB
    assert rows["qwen2.5-7b", "int8"].layer_bytes == 8.25 * MiB
    assert rows["qwen2.5-7b", "int4"].layer_bytes == 4.25 * MiB
    assert rows["qwen2.5-7b", "bf16"].boundary_bytes == 56 * MiB
    # A 15-layer Q8 prefix plus the boundary: 179.75 MiB (section 2.2).
    assert 15 * rows["qwen2.5-7b", "int8"].layer_bytes + 56 * MiB == 179.75 * MiB
    assert 28 * rows["qwen2.5-7b", "int8"].layer_bytes == 231 * MiB


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("shape", [(3, 1, 64), (3, 63, 64), (2, 100, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_encoded_size_equals_the_byte_model_and_round_trips(codec, shape):
    k, v = _kv(shape)
    c = get_codec(codec)
    encoded = c.encode(k, v)
    assert encoded.payload_bytes == c.payload_bytes(shape)
    assert all(b.dtype == torch.uint8 and b.dim() == 1 for b in encoded.buffers.values())
    k2, v2 = c.decode(EncodedKV.from_wire(encoded.header_bytes(), encoded.buffers))
    assert k2.dtype == k.dtype and k2.shape == k.shape
    if codec == "bf16":
        assert torch.equal(k2, k) and torch.equal(v2, v)
    else:
        qmax = 127 if codec == "int8" else 7
        for x, y in ((k, k2), (v, v2)):
            bound = x.float().reshape(-1, 64).abs().amax(1, keepdim=True) / qmax
            error = (x.float() - y.float()).reshape(-1, 64).abs()
            # half a step, plus BF16 rounding of the restored value
            assert (error <= bound / 2 + y.float().reshape(-1, 64).abs() / 256 + 1e-12).all()


def test_float32_input_is_restored_as_float32():
    k, v = _kv(dtype=torch.float32)
    k2, v2 = get_codec("bf16").decode(get_codec("bf16").encode(k, v))
    assert k2.dtype == torch.float32 and torch.equal(k2, k.to(torch.bfloat16).float())


@pytest.fixture
def encoded_int8():
    k, v = _kv()
    return get_codec("int8").encode(k, v)


def _with(encoded, **changes):
    fields = dict(codec=encoded.codec, shape=encoded.shape, dtype=encoded.dtype,
                  buffers=dict(encoded.buffers), checksum_algorithm=encoded.checksum_algorithm,
                  checksums=dict(encoded.checksums))
    fields.update(changes)
    return EncodedKV(**fields)


def test_a_flipped_bit_is_caught(encoded_int8):
    for name in encoded_int8.buffers:
        buffers = {n: b.clone() for n, b in encoded_int8.buffers.items()}
        buffers[name][len(buffers[name]) // 2] ^= 0x10
        with pytest.raises(CorruptPayloadError, match=f"buffer {name}: checksum mismatch"):
            get_codec("int8").decode(_with(encoded_int8, buffers=buffers))


def test_device_checksum_catches_flips_and_swaps(encoded_int8):
    from rekv_core.codecs.checksum import checksum

    buf = encoded_int8.buffers["k.codes"].clone()
    reference = checksum(buf, "wsum64")
    flipped = buf.clone()
    flipped[5] ^= 1
    assert checksum(flipped, "wsum64") != reference
    assert not torch.equal(buf[:4], buf[4:8])  # two unequal words, or the swap proves nothing
    swapped = buf.clone()
    swapped[:4], swapped[4:8] = buf[4:8], buf[:4]
    assert checksum(swapped, "wsum64") != reference
    encoded = _with(encoded_int8, checksum_algorithm="wsum64",
                    checksums={n: checksum(b, "wsum64") for n, b in encoded_int8.buffers.items()})
    get_codec("int8").decode(encoded)


def test_truncated_missing_and_mistyped_buffers(encoded_int8):
    codec = get_codec("int8")
    truncated = dict(encoded_int8.buffers)
    truncated["v.codes"] = truncated["v.codes"][:-1]
    with pytest.raises(CorruptPayloadError, match=r"buffer v.codes: \d+ bytes, expected"):
        codec.decode(_with(encoded_int8, buffers=truncated))
    missing = dict(encoded_int8.buffers)
    del missing["k.scales"]
    with pytest.raises(CorruptPayloadError, match="buffers: got"):
        codec.decode(_with(encoded_int8, buffers=missing))
    mistyped = dict(encoded_int8.buffers)
    mistyped["k.codes"] = mistyped["k.codes"].view(torch.int8)
    with pytest.raises(CorruptPayloadError, match="buffer k.codes: must be 1-D uint8"):
        codec.decode(_with(encoded_int8, buffers=mistyped))


def test_wrong_header_fields(encoded_int8):
    codec = get_codec("int8")
    with pytest.raises(CorruptPayloadError, match="codec: payload is 'int8', decoder is 'int4'"):
        get_codec("int4").decode(encoded_int8)
    with pytest.raises(CorruptPayloadError, match="buffer k.codes: .* bytes, expected"):
        codec.decode(_with(encoded_int8, shape=(3, 38, 64)))
    with pytest.raises(CorruptPayloadError, match="head_dim"):
        codec.decode(_with(encoded_int8, shape=(3, 37, 96)))
    with pytest.raises(CorruptPayloadError, match="dtype"):
        codec.decode(_with(encoded_int8, dtype="int64"))
    with pytest.raises(CorruptPayloadError, match="no checksum"):
        codec.decode(_with(encoded_int8, checksums={}))
    with pytest.raises(CorruptPayloadError, match="magic"):
        EncodedKV.from_wire(b"XXXX\x01{}", encoded_int8.buffers)
    with pytest.raises(CorruptPayloadError, match="unreadable"):
        EncodedKV.from_wire(encoded_int8.header_bytes()[:-3], encoded_int8.buffers)


def test_encode_refuses_bad_tensors():
    k, v = _kv()
    with pytest.raises(ValueError, match="v: shape"):
        get_codec("bf16").encode(k, v[:, :5])
    with pytest.raises(ValueError, match=r"k: expected \[n_kv, S, d_h\]"):
        get_codec("bf16").encode(k[0], v[0])
    with pytest.raises(ValueError, match="v: dtype"):
        get_codec("bf16").encode(k, v.float())
    with pytest.raises(ValueError, match="head_dim: int8 needs a multiple of 64"):
        get_codec("int8").encode(torch.zeros(1, 4, 96), torch.zeros(1, 4, 96))
    with pytest.raises(ValueError, match="dtype: must be one of"):
        get_codec("bf16").encode(torch.zeros(1, 4, 64, dtype=torch.float64),
                                 torch.zeros(1, 4, 64, dtype=torch.float64))


def test_triton_backed_codec_matches_the_reference_codec():
    from rekv_core.codecs import GroupwiseIntCodec

    k, v = _kv((2, 63, 128))
    for bits in (8, 4):
        a = GroupwiseIntCodec(bits, backend="torch").encode(k, v)
        b = GroupwiseIntCodec(bits, backend="triton").encode(k, v)
        assert a.checksums == b.checksums
        assert all(torch.equal(a.buffers[n], b.buffers[n]) for n in a.buffers)
