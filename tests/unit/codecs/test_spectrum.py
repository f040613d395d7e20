"""SpectrumKV: tier assignment, per-token quantizers (Triton against the reference), the codec's
wire format, the window importance and the INT4-tolerance probe's verdict."""

import math

import pytest
import torch

from rekv_core.codecs import (
    CorruptPayloadError,
    EncodeContext,
    EncodedKV,
    SpectrumCodec,
    codec_names,
    get_codec,
)
from rekv_core.eval.spectrum_probe import probe_int4_tolerance, retrieved_exactly
from rekv_core.kernels import dequantize_tokens, quantize_tokens
from rekv_core.kernels.spectrum_reference import (
    HI,
    INT4,
    INT8,
    assign_tiers,
    pack_tiers,
    rank_tokens,
    tier_counts,
    unpack_tiers,
)
from rekv_core.model.importance import (
    importance_cost,
    observation_window_importance,
    window_attention_received,
)

COST = {HI: 1.0, INT8: 0.5, INT4: 0.25}
BUDGETS = [0.25, 0.26, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0]
LENGTHS = [1, 2, 3, 4, 5, 7, 37, 100, 1000, 4097]


def _kv(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(shape, generator=g) * 3).to(dtype) for _ in range(2))


def _importance(seq_len, seed=0):
    return torch.rand(seq_len, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tiers", [3, 2])
def test_realized_cost_is_the_budget_within_the_sinks_slack(tiers):
    for seq_len in LENGTHS:
        for b in BUDGETS:
            if tiers == 2 and b < 0.5:
                continue
            n_hi, n8, n4 = tier_counts(seq_len, b, 4, tiers)
            sinks = min(4, seq_len)
            cost = n_hi + 0.5 * n8 + 0.25 * n4
            ceiling = b * seq_len + sinks * (1 - b)
            assert n_hi + n8 + n4 == seq_len and n_hi >= sinks
            assert cost <= ceiling + 1e-9, (seq_len, b, cost, ceiling)
            assert cost > ceiling - 0.5, "the surplus buys one more upgrade than it got"
            assert tiers == 3 or n4 == 0


def test_budget_extremes():
    for seq_len in (5, 100):
        rest = seq_len - 4
        assert tier_counts(seq_len, 0.25) == (4, 0, rest)
        assert tier_counts(seq_len, 0.5) == (4, rest, 0)
        assert tier_counts(seq_len, 1.0) == (seq_len, 0, 0)
        assert tier_counts(seq_len, 0.5, tiers=2) == (4, rest, 0)
        assert tier_counts(seq_len, 1.0, tiers=2) == (seq_len, 0, 0)
    assert tier_counts(3, 0.25) == (3, 0, 0)  # fewer tokens than sinks
    assert tier_counts(100, 0.3, sinks=0) == (0, 20, 80)


def test_out_of_range_budgets_and_modes_are_refused():
    with pytest.raises(ValueError, match="budget.*2-tier.*never dropped"):
        SpectrumCodec(0.3, tiers=2)
    for b in (0.2, 1.01):
        with pytest.raises(ValueError, match="budget"):
            SpectrumCodec(b)
    with pytest.raises(ValueError, match="tiers"):
        SpectrumCodec(0.5, tiers=4)
    with pytest.raises(ValueError, match="sinks"):
        SpectrumCodec(0.5, sinks=-1)


@pytest.mark.parametrize("b,tiers", [(0.3, 3), (0.6, 3), (0.8, 2)])
def test_precision_never_rises_as_rank_falls(b, tiers):
    g = torch.Generator().manual_seed(1)
    importance = torch.randint(0, 6, (200,), generator=g).float()  # many ties
    codes = assign_tiers(importance, b, 4, tiers)
    ranked = rank_tokens(importance, 4)
    assert torch.equal(ranked[:4], torch.arange(4)) and (codes[:4] == HI).all()
    assert (codes[ranked].diff() >= 0).all()
    for value in range(6):  # ties: the lower token index never gets less precision
        same = (importance == value).nonzero().flatten()
        same = same[same >= 4]
        assert (codes[same].diff() >= 0).all()
    counts = torch.bincount(codes.long(), minlength=3).tolist()
    assert counts == list(tier_counts(200, b, 4, tiers))


def test_tier_codes_pack_four_per_byte():
    g = torch.Generator().manual_seed(2)
    for seq_len in range(1, 10):
        codes = torch.randint(0, 3, (seq_len,), generator=g).to(torch.uint8)
        packed = pack_tiers(codes)
        assert packed.numel() == math.ceil(seq_len / 4)
        assert torch.equal(unpack_tiers(packed, seq_len), codes)
    assert pack_tiers(torch.tensor([1, 2, 0, 2], dtype=torch.uint8)).item() == 1 | 2 << 2 | 2 << 6


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(2, 9, 64), (3, 20, 128), (1, 5, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_triton_equals_reference(shape, dtype, bits):
    x = _kv(shape, dtype)[0]
    x[1 % shape[0], 2] = 0.0  # an all-zero row: scale 0, codes 0
    index = torch.tensor([0, 2, 3, shape[1] - 1])
    ref = quantize_tokens(x, index, bits, backend="torch")
    got = quantize_tokens(x, index, bits, backend="triton")
    assert torch.equal(got[1], ref[1]), "scales differ"
    assert torch.equal(got[0], ref[0]), "codes differ"
    for out_dtype in (dtype, torch.float32):
        fill = torch.full(shape, 9.0, dtype=out_dtype)
        a = dequantize_tokens(*ref, index, bits, fill.clone(), backend="torch")
        b = dequantize_tokens(*ref, index, bits, fill.clone(), backend="triton")
        assert torch.equal(a, b), f"dequantized {out_dtype} differs"
        untouched = torch.ones(shape[1], dtype=torch.bool)
        untouched[index] = False
        assert (a[:, untouched] == 9.0).all(), "rows of other tokens were written"


@pytest.mark.parametrize("bits", [8, 4])
def test_quantizer_error_is_half_a_step_of_the_row(bits):
    x = _kv((3, 50, 128), seed=3)[0]
    index = torch.arange(50)
    codes, scales = quantize_tokens(x, index, bits, backend="torch")
    out = dequantize_tokens(codes, scales, index, bits, torch.empty(x.shape), backend="torch")
    absmax = x.float().abs().amax(-1, keepdim=True)
    qmax = 127 if bits == 8 else 7
    error = (x.float() - out).abs()
    assert (error <= absmax / (2 * qmax) * (1 + 1e-3)).all()  # absmax/254, absmax/14


def test_codec_tiers_follow_importance_with_per_tier_bounds():
    shape = (2, 60, 64)
    k, v = _kv(shape, seed=4)
    importance = _importance(60, seed=4)
    codec = SpectrumCodec(0.4)
    encoded = codec.encode(k, v, context=EncodeContext(token_importance=importance))
    k2, v2 = codec.decode(EncodedKV.from_wire(encoded.header_bytes(), encoded.buffers))
    codes = assign_tiers(importance, 0.4)
    assert encoded.meta["counts"] == torch.bincount(codes.long(), minlength=3).tolist()
    for x, y in ((k, k2), (v, v2)):
        assert y.dtype == x.dtype and torch.equal(y[:, codes == HI], x[:, codes == HI])
        absmax = x.float().abs().amax(-1, keepdim=True)
        error = (x.float() - y.float()).abs()
        slack = y.float().abs() / 256  # BF16 rounding of the restored value
        for tier, qmax in ((INT8, 127), (INT4, 7)):
            rows = codes == tier
            bound = absmax[:, rows] / (2 * qmax) * (1 + 1e-3) + slack[:, rows]
            assert (error[:, rows] <= bound).all(), f"tier {tier}"


@pytest.mark.parametrize("name", ["spectrum30", "spectrum50"])
@pytest.mark.parametrize("shape", [(3, 1, 64), (2, 37, 128), (1, 101, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_registered_codecs_round_trip_through_the_wire(name, shape):
    assert name in codec_names()
    codec = get_codec(name)
    k, v = _kv(shape, seed=5)
    encoded = codec.encode(k, v, context=EncodeContext(_importance(shape[1])))
    assert encoded.payload_bytes == codec.payload_bytes(shape)
    assert list(encoded.buffers) == list(codec.buffer_layout(shape, encoded.meta))
    assert all(b.dtype == torch.uint8 and b.dim() == 1 for b in encoded.buffers.values())
    k2, v2 = get_codec(name).decode(EncodedKV.from_wire(encoded.header_bytes(), encoded.buffers))
    assert k2.shape == k.shape and k2.dtype == k.dtype
    assert torch.equal(k2[:, :min(4, shape[1])], k[:, :min(4, shape[1])])  # sinks are exact


def test_payload_bytes_match_the_budget():
    shape = (4, 1000, 128)
    bf16 = get_codec("bf16").payload_bytes(shape)
    for name, b in (("spectrum30", 0.3), ("spectrum50", 0.5)):
        data = sum(n for key, n in get_codec(name).buffer_layout(shape).items()
                   if key != "tiers" and not key.endswith(".scales"))
        assert data / bf16 == pytest.approx(b, abs=4 * (1 - b) / 1000 + 1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_other_dtypes_and_extreme_budgets(dtype):
    shape = (2, 30, 64)
    k, v = _kv(shape, dtype, seed=6)
    context = EncodeContext(_importance(30))
    whole = SpectrumCodec(1.0)
    k2, _ = whole.decode(whole.encode(k, v, context=context))
    assert k2.dtype == dtype
    assert torch.equal(k2, k if dtype == torch.float16 else k.to(torch.bfloat16).to(dtype))
    low = SpectrumCodec(0.25).encode(k, v, context=context)
    assert low.meta["counts"] == [4, 0, 26] and "k.int8" not in low.buffers


def test_two_tier_payload_decodes_with_the_registered_codec():
    k, v = _kv((2, 40, 64), seed=7)
    sender = SpectrumCodec(0.5, tiers=2)
    encoded = sender.encode(k, v, context=EncodeContext(_importance(40)))
    assert encoded.meta["tiers"] == 2 and encoded.meta["counts"] == [4, 36, 0]
    assert not any("int4" in name for name in encoded.buffers)
    k2, _ = get_codec("spectrum50").decode(EncodedKV.from_wire(encoded.header_bytes(),
                                                               encoded.buffers))
    assert (k2.float() - k.float()).abs().max() <= k.float().abs().max() / 254 * 1.01 + 0.05


def test_importance_is_required_and_checked():
    k, v = _kv((1, 10, 64))
    codec = get_codec("spectrum30")
    with pytest.raises(ValueError, match="token_importance: spectrum needs"):
        codec.encode(k, v)
    with pytest.raises(ValueError, match=r"token_importance: expected \[10\]"):
        codec.encode(k, v, context=EncodeContext(torch.rand(9)))
    with pytest.raises(ValueError, match="token_importance: must be finite"):
        codec.encode(k, v, context=EncodeContext(torch.full((10,), float("nan"))))


def test_triton_backed_codec_matches_the_reference_codec():
    k, v = _kv((2, 23, 128), seed=8)
    context = EncodeContext(_importance(23, seed=8))
    a = SpectrumCodec(0.4, backend="torch").encode(k, v, context=context)
    b = SpectrumCodec(0.4, backend="triton").encode(k, v, context=context)
    assert a.checksums == b.checksums
    decoded = [SpectrumCodec(0.4, backend=be).decode(a) for be in ("torch", "triton")]
    assert all(torch.equal(x, y) for x, y in zip(*decoded))


@pytest.fixture(scope="module")
def encoded30():
    k, v = _kv((2, 21, 64), seed=9)
    return get_codec("spectrum30").encode(k, v, context=EncodeContext(_importance(21, seed=9)))


def _with_meta(encoded, **changes):
    return EncodedKV(codec=encoded.codec, shape=encoded.shape, dtype=encoded.dtype,
                     buffers=dict(encoded.buffers), checksums=dict(encoded.checksums),
                     meta={**encoded.meta, **changes})


@pytest.mark.parametrize("changes,field", [
    ({"counts": [5, 3, 13]}, "meta.counts"), ({"counts": "4,3,14"}, "meta.counts"),
    ({"budget": 0.5}, "meta.budget"), ({"budget": "0.3"}, "meta.budget"),
    ({"budget": float("nan")}, "meta.budget"),
    ({"tiers": 4}, "meta.tiers"), ({"tiers": 2}, "meta.budget"),
    ({"sinks": -1}, "meta.sinks"), ({"sinks": 5}, "meta.counts"), ({"extra": 1}, "meta: unexp")])
def test_corrupt_meta_is_named(encoded30, changes, field):
    with pytest.raises(CorruptPayloadError, match=field):
        get_codec("spectrum30").decode(_with_meta(encoded30, **changes))


def test_missing_meta_field_is_named(encoded30):
    broken = _with_meta(encoded30)
    del broken.meta["sinks"]
    with pytest.raises(CorruptPayloadError, match="meta.sinks: missing"):
        get_codec("spectrum30").decode(broken)


def _invalid_code(codes):
    codes[20] = 3


def _int8_to_int4(codes):
    codes[codes.tolist().index(INT8)] = INT4


def _sink_swapped(codes):  # the counts still agree
    codes[codes.tolist().index(INT8)] = HI
    codes[0] = INT8


@pytest.mark.parametrize("edit,message", [(_invalid_code, "1 invalid codes"),
                                          (_int8_to_int4, "holds"),
                                          (_sink_swapped, "sink token")])
def test_tier_codes_that_disagree_with_meta_are_named(encoded30, edit, message):
    codes = unpack_tiers(encoded30.buffers["tiers"], 21).clone()
    edit(codes)
    bad = _with_meta(encoded30)
    bad.buffers["tiers"] = pack_tiers(codes)
    with pytest.raises(CorruptPayloadError, match=f"buffer tiers: .*{message}"):
        get_codec("spectrum30").decode(bad, verify=False)


def _brute_force_received(q, k, window):
    n_h, seq_len, d = q.shape
    kx = k.double().repeat_interleave(n_h // k.shape[0], dim=0)
    logits = q.double() @ kx.transpose(1, 2) / math.sqrt(d)
    logits = logits.masked_fill(torch.ones(seq_len, seq_len).triu(1).bool(), float("-inf"))
    return logits.softmax(-1)[:, seq_len - window:].sum(1).mean(0)


def test_window_attention_matches_the_full_probabilities_under_gqa():
    g = torch.Generator().manual_seed(10)
    q, k = torch.randn(6, 50, 32, generator=g), torch.randn(2, 50, 32, generator=g)
    for window in (1, 8, 50, 80):
        expected = _brute_force_received(q, k, min(window, 50))
        got = window_attention_received(q, k, window)
        assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-6), window


def test_importance_puts_sinks_and_a_concentrated_token_on_top():
    g = torch.Generator().manual_seed(11)
    n_h, n_kv, seq_len, d = 8, 2, 300, 64
    q = torch.randn(n_h, seq_len, d, generator=g) * 0.1
    k = torch.randn(n_kv, seq_len, d, generator=g) * 0.1
    direction = torch.randn(d, generator=g)
    k[:, 123] = direction * 2
    q[:, -32:] += direction * 2  # every window query looks at token 123
    for pool_kernel in (7, 1):
        score = observation_window_importance(q, k, pool_kernel=pool_kernel)
        assert score.shape == (seq_len,) and score.dtype == torch.float32
        assert float(score.min()) == 0.0 and float(score.max()) == 1.0
        assert (score[:4] == 1.0).all()
        assert int(score[4:].argmax()) + 4 == 123
        assert int(rank_tokens(score, 4)[4]) == 123
    pooled = observation_window_importance(q, k)
    assert (pooled[120:127] >= 0.5 * pooled[123] - 1e-6).all()  # neighbours lifted


def test_importance_edge_cases():
    q, k = torch.zeros(4, 3, 16), torch.zeros(2, 3, 16)
    assert observation_window_importance(q, k).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="pool_kernel"):
        observation_window_importance(q, k, pool_kernel=4)
    with pytest.raises(ValueError, match="k: shape"):
        observation_window_importance(torch.zeros(3, 3, 16), k)
    cost = importance_cost(seq_len=256, n_heads=4, n_kv=2, head_dim=32, repeats=1)
    assert cost["importance_s"] > 0 and cost["attention_s"] > 0


def test_probe_verdict():
    seen = []

    def passes(trial):
        seen.append(trial)
        return f" {trial.passkey}. Remember it."

    verdict = probe_int4_tolerance(passes, context_len=1000)
    assert verdict["int4_tolerated"] and verdict["tiers"] == 3
    assert [t.depth for t in seen] == [0.25, 0.5, 0.75]
    assert all(t.budget == 0.3 and t.tiers == 3 and t.context_len == 1000 for t in seen)
    assert len({t.passkey for t in seen}) == 3

    def fails_at_half(trial):
        return " 12345." if trial.depth == 0.5 else f" {trial.passkey}"

    verdict = probe_int4_tolerance(fails_at_half)
    assert not verdict["int4_tolerated"] and verdict["tiers"] == 2
    assert [t["found"] for t in verdict["trials"]] == [True, False, True]
    assert verdict["context_len"] == 4096 and verdict["budget"] == 0.3


def test_retrieved_exactly():
    assert retrieved_exactly(" 12345. Remember", 12345)
    assert not retrieved_exactly(" 123456", 12345)
    assert not retrieved_exactly(" 7 then 12345", 12345)
    assert not retrieved_exactly("no number", 12345)
