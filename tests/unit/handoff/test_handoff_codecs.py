"""The new codecs through a real handoff (sender -> in-process link -> receiver), streamed from
inside the prefill (`LivePrefill`) and on the seed's schedule (a finished prefill):

- `splitzip` is lossless: the decode side's cache is the prefill's bit for bit, its first-token
  logits are the `bf16` codec's, and the prefix costs fewer bytes than BF16's, exactly what the
  headers' escape counts say;
- `spectrum30`/`spectrum50` get each layer's token importance from the prefill (the window the
  prefill worker picks: `get_codec(codec).importance_window`), so the cache is exactly the quality
  gate's `reconstructed_cache`, on either schedule; without importance the sender fails naming
  `token_importance` before any layer leaves, and the decode side returns no cache; after a
  failed SpectrumKV probe the policy's codec sends FP16 and INT8 tiers only;
- `int4h` gives the codec's own round trip, and the receiver follows the rotation in the header;
- a splitzip header whose escape count does not match its buffers is refused by the receiver
  (the seal refuses any altered header first when the handoff is sealed).

A small synthetic BF16 model keeps it fast on a CPU."""

import json
import threading

import pytest
import torch

from rekv_core.codecs import CorruptPayloadError, EncodedKV, HadamardInt4Codec, get_codec
from rekv_core.handoff import Action, Sealing, receive_handoff, send_handoff, wire_bytes
from rekv_core.handoff.seal import SEAL_BYTES, SealError, new_key
from rekv_core.handoff.source import LivePrefill
from rekv_core.handoff.transfer import Transfer, TransferState
from rekv_core.kernels.spectrum_reference import tier_counts
from rekv_core.model import Model, ModelShape, prefill
from rekv_core.model.weights import synthetic_weights
from rekv_core.plan.gate import reconstructed_cache
from rekv_core.transport import TransportError
from rekv_core.transport.inprocess import InProcessLink
from tests.support.inprocess_handoff import planned

SHAPE = ModelShape(name="tiny-codecs", family="qwen2", num_layers=6, hidden_size=128,
                   num_heads=4, num_kv_heads=2, head_dim=32, ffn_size=256, vocab_size=512,
                   rope_theta=1e4, rms_eps=1e-6, tie_embeddings=False, max_positions=1024)
L = SHAPE.num_layers
CUT = 3  # an interior cut: a joint action
S = 160  # prompt tokens: more than the importance window of 32
N = SHAPE.num_kv_heads * S * SHAPE.head_dim  # elements of one layer's K (and of its V)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(synthetic_weights(SHAPE, torch.bfloat16, seed=1))


def _ids(n=S, seed=0):
    return torch.randint(0, SHAPE.vocab_size, (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _source(model, ids, cut, streamed, window=0):
    """What the prefill worker sends from: a live prefill, or a finished one (the seed's)."""
    if streamed:
        return LivePrefill(model, ids, cut, importance_window=window)
    return prefill(model, ids, boundaries={cut, L}, importance_window=window)


def _run(model, ids, action, state, key=None, fault=None, transfer=None, codec=None):
    """One handoff over an in-process link: (sender's report, receiver's result, the messages as
    they left the wire). The receiver's error propagates; a sender's error fails the test."""
    seen, reports, errors = [], [], []
    plan, source = planned(model, ids, action, state, codec=codec)

    def observe(message):
        seen.append(message)
        return fault(message) if fault else [message]

    with InProcessLink(fault=observe) as link:
        link.receiver.open("r")

        def send():
            try:
                reports.append(send_handoff(link.sender, plan, source, Transfer("r"),
                                            Sealing(key)))
            except Exception as exc:  # noqa: BLE001 - surfaced by the test
                errors.append(exc)
            finally:
                if isinstance(state, LivePrefill):
                    state.close()

        thread = threading.Thread(target=send, name="rekv-test-sender")
        thread.start()
        try:
            result = receive_handoff(model, link.receiver,
                                     transfer or Transfer("r", stall_s=30), Sealing(key))
        finally:
            thread.join()
            assert link.receiver.pending().idle
    assert not errors, errors
    return reports[0], result, seen


def _layer_metas(seen) -> list[dict]:
    """The codec meta of every prefix layer's header (unsealed handoffs), in layer order."""
    return [EncodedKV.from_wire(m.header, {}).meta for m in seen if m.name.startswith("layer.")]


@pytest.mark.parametrize("cut", [CUT, L], ids=["joint", "transfer_only"])
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "seed"])
def test_splitzip_is_lossless_through_a_handoff(model, streamed, cut):
    ids = _ids()
    ref = prefill(model, ids)
    runs = {codec: _run(model, ids, Action(codec, cut, L), _source(model, ids, cut, streamed))
            for codec in ("bf16", "splitzip")}
    report, result, seen = runs["splitzip"]
    assert result.cache.length == S and result.plan.streamed == streamed
    for layer in range(L):
        k, v = result.cache.layer(layer)
        assert _same_bits(k, ref.keys[layer]), f"K of layer {layer}"
        assert _same_bits(v, ref.values[layer]), f"V of layer {layer}"
    assert _same_bits(result.logits, runs["bf16"][1].logits)
    assert _same_bits(result.logits, ref.logits)

    zipped, plain = report.bytes, runs["bf16"][0].bytes
    assert (result.bytes.prefix, result.bytes.scales) == (zipped.prefix, 0)
    assert plain.prefix == 2 * 2 * N * cut  # K and V in BF16
    assert 0.75 * plain.prefix <= zipped.prefix < plain.prefix
    escapes = [meta["escapes"] for meta in _layer_metas(seen)]
    assert len(escapes) == cut and sum(e["k"] + e["v"] for e in escapes) > 0  # escapes travel
    # ⌈n/2⌉ + n + 7·n_esc bytes per tensor, with the escape counts the headers carry
    assert zipped.prefix == sum(2 * ((N + 1) // 2 + N) + 7 * (e["k"] + e["v"]) for e in escapes)


def test_splitzip_on_the_embedded_models_cache(smollm_bf16, tokenizer):
    """Real K and V (outlier channels, a wide exponent range): still exact, and smaller."""
    model = smollm_bf16
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    cut, layers = 11, smollm_bf16.shape.num_layers
    ref = prefill(model, ids, boundaries={cut})
    zipped, result, seen = _run(model, ids, Action("splitzip", cut, layers),
                                LivePrefill(model, ids, cut))
    for layer in range(layers):
        k, v = result.cache.layer(layer)
        assert _same_bits(k, ref.keys[layer]) and _same_bits(v, ref.values[layer]), layer
    assert _same_bits(result.logits, ref.logits)
    plain = wire_bytes(Action("bf16", cut, layers), model.shape, len(ids)).prefix
    assert result.bytes.prefix == zipped.bytes.prefix < plain
    assert len(_layer_metas(seen)) == cut


@pytest.mark.parametrize("codec, cut", [("spectrum30", CUT), ("spectrum50", CUT),
                                        ("spectrum30", L)])
def test_spectrum_is_the_gates_cache_on_both_schedules(model, codec, cut):
    window = get_codec(codec).importance_window  # as the prefill worker picks it
    assert window == 32
    ids = _ids(seed=cut)
    ref = prefill(model, ids, importance_window=32)
    assert len(ref.importance) == L
    expected = reconstructed_cache(ref.keys, ref.values, codec, cut, S, ref.importance)
    action = Action(codec, cut, L)
    caches = {}
    for streamed in (True, False):
        report, result, _ = _run(model, ids, action, _source(model, ids, cut, streamed, window))
        for layer in range(L):
            k, v = result.cache.layer(layer)
            want_k, want_v = (expected.layer(layer) if layer < cut
                              else (ref.keys[layer], ref.values[layer]))
            assert _same_bits(k, want_k), f"streamed={streamed}: K of layer {layer}"
            assert _same_bits(v, want_v), f"streamed={streamed}: V of layer {layer}"
        assert _same_bits(result.logits, ref.logits)
        planned = wire_bytes(action, model.shape, S)  # spectrum's layout follows from S alone
        assert (report.bytes.prefix, report.bytes.scales) == (planned.prefix, planned.scales)
        assert (result.bytes.prefix, result.bytes.scales) == (planned.prefix, planned.scales)
        caches[streamed] = result.cache
    for layer in range(L):  # the seed's schedule gives the streamed cache
        for a, b in zip(caches[True].layer(layer), caches[False].layer(layer)):
            assert _same_bits(a, b), f"layer {layer}"

    # not vacuous: the codec lost something, and (where the budget mixes tiers beyond the sinks:
    # spectrum50 is the sinks in hi and every other token INT8) what it kept follows the importance
    assert any(not torch.equal(expected.layer(i)[0], ref.keys[i]) for i in range(cut))
    spectrum = get_codec(codec)
    n_hi, n_int8, n_int4 = tier_counts(S, spectrum.budget, spectrum.sinks, spectrum.tiers)
    if sum(n > 0 for n in (n_hi - spectrum.sinks, n_int8, n_int4)) < 2:
        return
    flipped = reconstructed_cache(ref.keys, ref.values, codec, cut, S,
                                  [s.flip(0) for s in ref.importance])
    assert any(not torch.equal(flipped.layer(i)[0], expected.layer(i)[0]) for i in range(cut))


def test_spectrum_after_a_failed_probe_sends_fp16_and_int8_only(model):
    from rekv_core.plan.policy import Policy

    policy = Policy(SHAPE.name, (1, 1024), {"spectrum50": L},
                    meta={"spectrum_probe": {"int4_tolerated": False, "tiers": 2}})
    codec = policy.codec("spectrum50")  # as the prefill worker builds it
    ids = _ids(seed=7)
    ref = prefill(model, ids, importance_window=codec.importance_window)
    _, result, seen = _run(model, ids, Action("spectrum50", CUT, L),
                           _source(model, ids, CUT, True, codec.importance_window), codec=codec)
    metas = _layer_metas(seen)
    assert [m["tiers"] for m in metas] == [2] * CUT
    assert all(m["counts"][2] == 0 for m in metas)  # no INT4 tier on the wire
    expected = reconstructed_cache(ref.keys, ref.values, codec, CUT, S, ref.importance)
    for layer in range(CUT):
        for got, want in zip(result.cache.layer(layer), expected.layer(layer)):
            assert _same_bits(got, want), f"layer {layer}"


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "seed"])
def test_spectrum_without_importance_fails_by_name_and_leaves_no_cache(model, streamed):
    ids = _ids()
    state = _source(model, ids, CUT, streamed, window=0)  # a prefill asked for no importance
    sent, received = Transfer("r", stall_s=5), Transfer("r", stall_s=1)
    delivered = []
    with InProcessLink(fault=lambda m: delivered.append(m.name) or [m]) as link:
        link.receiver.open("r")
        with pytest.raises(ValueError, match="token_importance"):
            send_handoff(link.sender, *planned(model, ids, Action("spectrum30", CUT, L), state),
                         sent)
        assert sent.state is TransferState.FAILED and "token_importance" in sent.failure
        # nothing tells the decode side: it waits out its stall limit and keeps no cache
        with pytest.raises(TimeoutError):
            receive_handoff(model, link.receiver, received)
        assert received.state is TransferState.FAILED
        assert link.receiver.pending().idle
    assert delivered[0] == "plan"
    assert not any(name.startswith("layer.") for name in delivered), delivered


@pytest.mark.parametrize("streamed, cut", [(True, CUT), (False, CUT), (True, L)])
def test_int4h_is_its_own_round_trip(model, streamed, cut):
    ids = _ids(seed=7)
    ref = prefill(model, ids)
    report, result, seen = _run(model, ids, Action("int4h", cut, L),
                                _source(model, ids, cut, streamed))
    codec = get_codec("int4h")
    assert _layer_metas(seen) == [{"block": 32, "rotate": "kv"}] * cut
    for layer in range(L):
        k, v = result.cache.layer(layer)
        want = (codec.decode(codec.encode(ref.keys[layer], ref.values[layer])) if layer < cut
                else (ref.keys[layer], ref.values[layer]))
        assert _same_bits(k, want[0]) and _same_bits(v, want[1]), f"layer {layer}"
    assert _same_bits(result.logits, ref.logits)
    planned = wire_bytes(Action("int4h", cut, L), model.shape, S)
    assert (result.bytes.prefix, result.bytes.scales) == (planned.prefix, planned.scales)
    assert (report.bytes.prefix, report.bytes.scales) == (planned.prefix, planned.scales)


def test_int4h_decodes_with_the_rotation_in_the_header(model):
    """A sender rotating only K in blocks of 8: the receiver's own codec (K and V, blocks of 32)
    follows the header, not its settings."""
    sent_codec = HadamardInt4Codec(rotate="k", block=8)
    ids = _ids(seed=8)
    ref = prefill(model, ids)
    _, result, seen = _run(model, ids, Action("int4h", CUT, L), _source(model, ids, CUT, True),
                           codec=sent_codec)
    assert _layer_metas(seen) == [{"block": 8, "rotate": "k"}] * CUT
    own = get_codec("int4h")
    for layer in range(CUT):
        k, v = result.cache.layer(layer)
        want_k, want_v = sent_codec.decode(sent_codec.encode(ref.keys[layer], ref.values[layer]))
        assert _same_bits(k, want_k) and _same_bits(v, want_v), f"layer {layer}"
        own_k, own_v = own.decode(own.encode(ref.keys[layer], ref.values[layer]))
        assert not torch.equal(k, own_k) and not torch.equal(v, own_v), f"layer {layer}"


def _tamper_escapes(change, sealed: bool):
    """Rewrite layer.1's header meta `escapes` with `change` (after the MAC when sealed)."""
    def apply(message):
        if message.name == "layer.1":
            mac = message.header[:SEAL_BYTES] if sealed else b""
            header = message.header[len(mac):]
            body = json.loads(header[5:])
            change(body["meta"]["escapes"])
            message.header = mac + header[:5] + json.dumps(body).encode()
        return [message]
    return apply


@pytest.mark.parametrize("change, sealed, error, match", [
    (lambda e: e.update(k=e["k"] + 1), False, CorruptPayloadError, "buffer k.escapes"),
    (lambda e: e.update(v=e["v"] - 1 if e["v"] else 1), False, CorruptPayloadError,
     "buffer v.escapes"),
    (lambda e: e.update(v=N + 1), False, CorruptPayloadError, "escapes.v"),
    (lambda e: e.update(k="3"), False, CorruptPayloadError, "escapes.k"),
    (lambda e: e.update(k=e["k"] + 1), True, SealError, "MAC"),
], ids=["one_more", "one_fewer", "beyond_n", "not_an_int", "sealed"])
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "seed"])
def test_a_wrong_splitzip_escape_count_is_refused(model, streamed, change, sealed, error, match):
    ids = _ids(seed=3)
    transfer = Transfer("r", stall_s=30)
    with pytest.raises(error, match=match) as caught:
        _run(model, ids, Action("splitzip", CUT, L), _source(model, ids, CUT, streamed),
             key=new_key() if sealed else None, fault=_tamper_escapes(change, sealed),
             transfer=transfer)
    assert isinstance(caught.value, (TransportError, CorruptPayloadError))
    assert transfer.state is TransferState.FAILED


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "seed"])
def test_a_splitzip_boundary_is_lossless_and_smaller(model, streamed):
    """h_c SplitZip-coded (`Action.boundary`, the codebook ranked from h_c itself): the suffix's
    logits and cache are the BF16 boundary's bit for bit, on fewer bytes, exactly what each
    chunk's meta on the wire says."""
    ids = _ids(seed=5)
    plain = Action("bf16", CUT, L)
    _, reference, _ = _run(model, ids, plain, _source(model, ids, CUT, streamed))
    coded = Action("bf16", CUT, L, "splitzip")
    _, result, seen = _run(model, ids, coded, _source(model, ids, CUT, streamed))
    assert torch.equal(result.logits, reference.logits)
    for layer in range(CUT, L):
        assert _same_bits(result.cache.keys[layer], reference.cache.keys[layer])
    assert 0 < result.bytes.boundary < reference.bytes.boundary
    chunks = [json.loads(m.header)["splitzip"] for m in seen if m.name.startswith("boundary")]
    assert sum(c["n"] for c in chunks) == S * SHAPE.hidden_size
    assert result.bytes.boundary == sum(
        -(-c["n"] // 2) + c["n"] + 7 * c["escapes"] for c in chunks)


def test_a_boundary_coding_is_only_for_an_interior_cut():
    with pytest.raises(ValueError, match="^boundary: only an interior cut"):
        Action("int8", L, L, "splitzip")
    with pytest.raises(ValueError, match="^boundary: must be one of bf16, splitzip"):
        Action("int8", CUT, L, "zstd")
