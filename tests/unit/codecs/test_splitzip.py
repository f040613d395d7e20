"""SplitZip: bit-exact BF16 exponent coding by the PyTorch reference and the Triton kernels
(interpreter mode on the CPU), the exact stream sizes, calibration, the tensor API and the codec."""

import dataclasses

import pytest
import torch

from rekv_core.codecs import CorruptPayloadError, EncodedKV, SplitZipCodec, codec_names, get_codec
from rekv_core.codecs.splitzip import decode_bf16, encode_bf16
from rekv_core.kernels import ExponentHistogram, calibrate_codebook, splitzip_encode

BACKENDS = ["torch", "triton"]
# Every BF16 bit pattern: ±0, subnormals, normals, ±inf and every NaN payload.
ALL_PATTERNS = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
TYPICAL = list(range(112, 128))  # the exponents of magnitudes in [2^-15, 1)
LOW = list(range(16))  # zero and subnormals (exponent 0) and the smallest normals


def _device(backend):
    """Triton runs on the GPU where there is one, in the interpreter on the CPU otherwise."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _bits(x):
    return x.reshape(-1).view(torch.int16).cpu()


def _from_exponents(exps, seed=0):
    """BF16 values with the given exponents and random signs and mantissas."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.as_tensor(exps, dtype=torch.int32)
    low = torch.randint(0, 256, exps.shape, generator=g, dtype=torch.int32)
    raw = ((low & 0x80) << 8) | (exps << 7) | (low & 0x7F)
    return (raw - ((raw & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def _realistic(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)


def _escape_fields(escapes):
    """The planar little-endian escape buffer, parsed independently of the codec."""
    data = bytes(escapes.cpu().tolist())
    m = len(data) // 7
    ids = [int.from_bytes(data[4 * i:4 * i + 4], "little") for i in range(m)]
    offsets = [int.from_bytes(data[4 * m + 2 * i:4 * m + 2 * i + 2], "little") for i in range(m)]
    return ids, offsets, list(data[6 * m:])


def _round_trip(x, codebook, chunk=1024, backend="torch"):
    buffers, meta = encode_bf16(x, codebook, chunk, backend)
    n, n_esc = x.numel(), meta["escapes"]
    assert list(buffers) == ["codes", "sm", "escapes"]
    assert all(b.dtype == torch.uint8 and b.dim() == 1 for b in buffers.values())
    assert sum(b.numel() for b in buffers.values()) == (n + 1) // 2 + n + 7 * n_esc
    assert meta == {"codebook": codebook, "n": n, "chunk": chunk, "escapes": n_esc}
    y = decode_bf16(buffers, meta, backend)
    assert y.dtype == torch.bfloat16 and y.shape == (n,)
    assert torch.equal(_bits(y), _bits(x)), "round trip is not bit-exact"
    return buffers, meta


@pytest.mark.parametrize("codebook", [TYPICAL, LOW], ids=["typical", "low"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_bf16_bit_pattern_round_trips(backend, codebook):
    order = torch.randperm(ALL_PATTERNS.numel(), generator=torch.Generator().manual_seed(1))
    x = ALL_PATTERNS[order].to(_device(backend))  # escapes spread over all chunks
    buffers, meta = _round_trip(x, codebook, 256, backend)
    assert meta["escapes"] == 65536 - 16 * 256  # every exponent occurs 256 times
    if backend == "triton":
        reference, _ = encode_bf16(x.cpu(), codebook, 256, "torch")
        for name, buf in reference.items():
            assert torch.equal(buffers[name].cpu(), buf), f"{name} differs from the reference"


@pytest.mark.parametrize("chunk", [1, 64, 1024])
@pytest.mark.parametrize("n", [1, 2, 3, 1023, 1025, 3001])
def test_triton_streams_equal_the_reference_byte_for_byte(n, chunk):
    x = _realistic(n, seed=n)
    x[::97] = 3.0e4  # exponent 141: an escape every 97 elements
    codebook = calibrate_codebook([_realistic(4096)])
    reference = splitzip_encode(x, codebook, chunk, backend="torch")
    triton = splitzip_encode(x.to(_device("triton")), codebook, chunk, backend="triton")
    for name, a, b in zip(("codes", "sm", "escapes"), reference, triton):
        mismatch = (a != b.cpu()).nonzero()
        assert a.numel() == b.numel() and mismatch.numel() == 0, f"{name} differs at {mismatch[:5]}"
    assert reference[2].numel() >= 7 * len(range(0, n, 97))
    _round_trip(x.to(_device("triton")), codebook, chunk, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_layout_and_odd_n(backend):
    x = _from_exponents([TYPICAL[3], TYPICAL[15], 200], seed=2).to(_device(backend))
    buffers, meta = _round_trip(x, TYPICAL, 4, backend)
    assert buffers["codes"].tolist() == [3 | (15 << 4), 0]  # the escape and the pad nibble: code 0
    raw = _bits(x).to(torch.int32) & 0xFFFF
    assert buffers["sm"].cpu().tolist() == (((raw >> 8) & 0x80) | (raw & 0x7F)).tolist()
    assert meta["escapes"] == 1 and _escape_fields(buffers["escapes"]) == ([0], [2], [200])


@pytest.mark.parametrize("backend", BACKENDS)
def test_escapes_at_chunk_boundaries(backend):
    chunk, n = 64, 4 * 64 + 5
    exps = torch.full((n,), TYPICAL[0])
    positions = [p for c in range(4) for p in (c * chunk, c * chunk + chunk - 1)] + [n - 1]
    exps[positions] = torch.tensor([255, 0, 130, 1, 254, 129, 2, 253, 131])
    x = _from_exponents(exps, seed=3).to(_device(backend))
    buffers, meta = _round_trip(x, TYPICAL, chunk, backend)
    ids, offsets, values = _escape_fields(buffers["escapes"])
    assert meta["escapes"] == 9
    assert ids == [p // chunk for p in positions] and offsets == [p % chunk for p in positions]
    assert values == [255, 0, 130, 1, 254, 129, 2, 253, 131]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_escapes_all_escapes_and_empty(backend):
    device = _device(backend)
    order = torch.randperm(1024, generator=torch.Generator().manual_seed(4))
    x = _from_exponents(torch.tensor(TYPICAL * 64)[order], seed=4).to(device)
    buffers, meta = _round_trip(x[:1001], TYPICAL, 128, backend)
    assert meta["escapes"] == 0 and buffers["escapes"].numel() == 0
    buffers, meta = _round_trip(x[:1001], LOW, 128, backend)
    assert meta["escapes"] == 1001 and buffers["codes"].eq(0).all()
    assert _escape_fields(buffers["escapes"])[1] == [p % 128 for p in range(1001)]
    buffers, meta = _round_trip(x[:0], TYPICAL, 1024, backend)
    assert meta["n"] == 0 and all(b.numel() == 0 for b in buffers.values())


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 10001])
def test_the_size_is_exactly_the_formula(n):
    x = _realistic(n, seed=5)
    codebook = TYPICAL[:12] + [200, 201, 202, 203]  # leaves the smallest magnitudes escaped
    buffers, meta = _round_trip(x, codebook)
    exps = (_bits(x).to(torch.int32) >> 7) & 0xFF
    outside = int((~torch.isin(exps, torch.tensor(codebook))).sum())
    assert meta["escapes"] == outside
    assert sum(b.numel() for b in buffers.values()) == (n + 1) // 2 + n + 7 * outside


def test_codebook_ranking_is_deterministic():
    exps = [130] * 5 + [120] * 5 + [125] * 3 + [7] * 3 + [0] * 1
    x = _from_exponents(exps, seed=6)
    unused = [e for e in range(256) if e not in (0, 7, 120, 125, 130)]
    expected = [120, 130, 7, 125, 0] + unused[:11]  # counts 5, 5, 3, 3, 1, then unused values
    assert calibrate_codebook([x]) == expected
    assert calibrate_codebook([x[torch.randperm(len(exps))]]) == expected
    parts = ExponentHistogram().add(x[:6]).add(x[6:11]).add(x[11:])
    assert parts.codebook() == expected
    assert calibrate_codebook([]) == LOW and calibrate_codebook([ALL_PATTERNS]) == LOW
    assert calibrate_codebook([x.float()]) == expected  # other dtypes are ranked as BF16


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_are_named(backend):
    x = _realistic(8)
    for codebook in (TYPICAL[:15], TYPICAL[:15] + [112], TYPICAL[:15] + [256], [True] * 16, None):
        with pytest.raises(ValueError, match="codebook"):
            encode_bf16(x, codebook, backend=backend)
    for chunk in (0, 3, 1000, 1 << 17, 2.0):
        with pytest.raises(ValueError, match="chunk"):
            encode_bf16(x, TYPICAL, chunk, backend=backend)
    with pytest.raises(ValueError, match="x: dtype must be bfloat16"):
        encode_bf16(x.float(), TYPICAL, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        encode_bf16(x, TYPICAL, backend="cuda")


def _corrupt_escapes(escapes, m, field, index, value):
    """Set one escape's field in the planar buffer of m escapes."""
    out = escapes.clone()
    start, width = {"id": (4 * index, 4), "offset": (4 * m + 2 * index, 2)}[field]
    out[start:start + width] = torch.tensor(list(value.to_bytes(width, "little")))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_meta_and_streams_are_refused_and_named(backend):
    x = _from_exponents([TYPICAL[0]] * 200 + [200, 201, 202] + [TYPICAL[0]] * 3, seed=7)
    buffers, meta = encode_bf16(x, TYPICAL, 64)
    bad_metas = {"meta": {k: meta[k] for k in ("codebook", "n", "chunk")},
                 "codebook": {**meta, "codebook": TYPICAL[:15] + [TYPICAL[0]]},
                 "chunk": {**meta, "chunk": 48}, "n": {**meta, "n": -1},
                 "escapes": {**meta, "escapes": "3"},
                 "buffer codes": {**meta, "n": meta["n"] + 2},
                 "buffer escapes": {**meta, "escapes": 2}}
    for field, bad in bad_metas.items():
        with pytest.raises(CorruptPayloadError, match=f"^{field}: "):
            decode_bf16(buffers, bad, backend)
    with pytest.raises(CorruptPayloadError, match="buffer sm: 205 bytes, expected 206"):
        decode_bf16({**buffers, "sm": buffers["sm"][:-1]}, meta, backend)
    with pytest.raises(CorruptPayloadError, match="buffers: got"):
        decode_bf16({"codes": buffers["codes"], "sm": buffers["sm"]}, meta, backend)
    esc = buffers["escapes"]  # 3 escapes, in chunk 3 of 4, at offsets 8, 9 and 10
    bad_escapes = [("a chunk id is out of range", _corrupt_escapes(esc, 3, "id", 1, 4)),
                   ("an offset is not below the chunk", _corrupt_escapes(esc, 3, "offset", 0, 64)),
                   ("a position is not below n=206", _corrupt_escapes(esc, 3, "offset", 2, 63)),
                   ("not strictly increasing", _corrupt_escapes(esc, 3, "offset", 1, 7)),
                   ("not strictly increasing", _corrupt_escapes(esc, 3, "offset", 1, 8))]  # twice
    for problem, bad in bad_escapes:
        with pytest.raises(CorruptPayloadError, match=f"escapes: .*{problem}"):
            decode_bf16({**buffers, "escapes": bad}, meta, backend)


def _kv(shape=(3, 37, 64), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(shape, generator=g) * 0.1, torch.randn(shape, generator=g) * 3
    k.view(-1)[::101] = 1e30  # a few escapes
    return k.to(dtype), v.to(dtype)


def test_the_codec_is_registered_and_lossless():
    assert "splitzip" in codec_names()
    codec = get_codec("splitzip")
    assert isinstance(codec, SplitZipCodec) and codec.lossless and codec.name == "splitzip"


@pytest.mark.parametrize("shape", [(3, 37, 64), (1, 1, 3), (2, 5, 7)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_codec_round_trips_through_the_wire(shape):
    k, v = _kv(shape)
    codec = get_codec("splitzip")
    encoded = codec.encode(k, v)
    assert list(encoded.buffers) == ["k.codes", "k.sm", "k.escapes", "v.codes", "v.sm", "v.escapes"]
    assert encoded.meta["codebook"] == calibrate_codebook([k, v])
    assert encoded.meta["chunk"] == 1024 and set(encoded.meta["escapes"]) == {"k", "v"}
    assert encoded.payload_bytes == sum(codec.buffer_layout(shape, encoded.meta).values())
    n = k.numel()
    n_esc = encoded.meta["escapes"]["k"] + encoded.meta["escapes"]["v"]
    assert encoded.payload_bytes == 2 * ((n + 1) // 2 + n) + 7 * n_esc
    k2, v2 = SplitZipCodec(codebook=LOW).decode(
        EncodedKV.from_wire(encoded.header_bytes(), encoded.buffers))  # the header decides
    assert k2.dtype == torch.bfloat16 and k2.shape == k.shape
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))


def test_the_codec_with_a_fixed_codebook_float32_and_planning():
    k, v = _kv()
    codec = SplitZipCodec(codebook=TYPICAL, chunk=256)
    encoded = codec.encode(k, v)
    assert encoded.meta["codebook"] == TYPICAL and encoded.meta["chunk"] == 256
    k2, v2 = codec.decode(encoded)
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))
    k32, v32 = _kv(dtype=torch.float32)
    k3, v3 = codec.decode(codec.encode(k32, v32))
    assert k3.dtype == torch.float32 and torch.equal(k3, k32.to(torch.bfloat16).float())
    n = k.numel()
    planned = SplitZipCodec(expected_escape_rate=0.01).buffer_layout(k.shape)
    assert planned["k.escapes"] == 7 * round(0.01 * n) and planned["k.codes"] == (n + 1) // 2
    assert get_codec("splitzip").payload_bytes(k.shape) == 2 * ((n + 1) // 2 + n + 7 * round(
        0.001 * n))
    with pytest.raises(ValueError, match="codebook"):
        SplitZipCodec(codebook=[1] * 16)
    with pytest.raises(ValueError, match="chunk"):
        SplitZipCodec(chunk=100)


def test_the_triton_backed_codec_matches_the_reference_codec():
    k, v = _kv((2, 9, 64))
    a = SplitZipCodec(backend="torch").encode(k, v)
    b = SplitZipCodec(backend="triton").encode(k.to(_device("triton")), v.to(_device("triton")))
    assert a.meta == b.meta
    assert all(torch.equal(a.buffers[n], b.buffers[n].cpu()) for n in a.buffers)
    k2, v2 = SplitZipCodec(backend="triton").decode(b)
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))


def test_the_codec_refuses_corrupt_headers_and_buffers():
    codec = get_codec("splitzip")
    encoded = SplitZipCodec(codebook=TYPICAL).encode(*_kv())  # escapes in both K and V
    meta = encoded.meta
    assert min(meta["escapes"].values()) > 0
    bad_metas = {"meta: expected fields": {"codebook": meta["codebook"], "chunk": 1024},
                 "codebook": {**meta, "codebook": meta["codebook"][:15]},
                 "chunk": {**meta, "chunk": 1023},
                 "meta escapes": {**meta, "escapes": {"k": 1}},
                 "escapes.k": {**meta, "escapes": {**meta["escapes"], "k": 10 ** 9}},
                 "escapes.v": {**meta, "escapes": {**meta["escapes"], "v": True}},
                 "buffer v.escapes": {**meta, "escapes": {**meta["escapes"], "v": 0}}}
    for field, bad in bad_metas.items():
        with pytest.raises(CorruptPayloadError, match=f"^{field}"):
            codec.decode(dataclasses.replace(encoded, meta=bad))
    truncated = {**encoded.buffers, "k.escapes": encoded.buffers["k.escapes"][:-7]}
    with pytest.raises(CorruptPayloadError, match=r"buffer k.escapes: \d+ bytes, expected"):
        codec.decode(dataclasses.replace(encoded, buffers=truncated))
    m = meta["escapes"]["k"]
    corrupted = {**encoded.buffers,
                 "k.escapes": _corrupt_escapes(encoded.buffers["k.escapes"], m, "id", 0, 10 ** 6)}
    with pytest.raises(CorruptPayloadError, match="buffer k.escapes: checksum mismatch"):
        codec.decode(dataclasses.replace(encoded, buffers=corrupted))
    with pytest.raises(CorruptPayloadError, match="k.escapes: a chunk id is out of range"):
        codec.decode(dataclasses.replace(encoded, buffers=corrupted), verify=False)


def test_compression_ratio_on_a_realistic_distribution():
    shape = (8, 512, 128)
    g = torch.Generator().manual_seed(8)
    k = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
    v = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
    encoded = get_codec("splitzip").encode(k, v, checksums=False)
    ratio = 2 * 2 * k.numel() / encoded.payload_bytes
    assert 1.25 < ratio <= 4 / 3, f"ratio {ratio:.4f}"
