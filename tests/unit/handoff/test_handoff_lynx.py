"""Lynx's progressive streams as a handoff over the in-process link, and the decoding past it.

Every layer's anchor goes before any residual; when the result comes back the cache's prefix is
at anchor precision (the anchor codes' own decode), and once the residuals are in and applied it
equals the `int8` action's cache bit for bit; the first logits are exact; the bytes of the two
streams are the `int8` action's. Decoding past it (`handoff.progressive`) drafts on the anchor
cache while the residuals are held back (what it hands the verification: greedy decoding's tokens
on the anchor cache), verifies on the full cache, and emits exactly greedy decoding's tokens on
the `int8` cache, including when a ruined anchor forces every draft to be rejected; a residual
that fails its checks raises `ResidualsLost` before anything drafted is verified, the request
aborted and nothing left on the link."""

import threading

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.codecs.lynx import anchor_kv, split_layer
from rekv_core.handoff import progressive
from rekv_core.handoff.progressive import continue_on_anchors
from rekv_core.handoff import (Action, Delivery, HandoffPlan, Order, ReceiveMode, Receiving,
                               wire_bytes)
from rekv_core.handoff.residuals import ResidualsLost
from rekv_core.handoff.source import LivePrefill
from rekv_core.handoff.transfer import Transfer, TransferState
from rekv_core.model import KVCache, prefill
from rekv_core.model.executor import decode_greedy, final_logits
from rekv_core.model.speculation import draft
from rekv_core.model.turns import Turn
from tests.support.engine_fakes import empty_cache
from tests.support.inprocess_handoff import MessageNames, run_handoff

SEQ_LEN, CUT, NEW, DRAFTS = 300, 12, 12, 5  # 300 rows: one boundary chunk at any size


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1000, 40000, (SEQ_LEN,),
                         generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def anchored(smollm_fp32, ids):
    """The float32 prefill of `ids`, its layers through `int8` and at anchor precision."""
    out = prefill(smollm_fp32, ids, boundaries=())
    pairs = list(zip(out.keys, out.values))
    return (out, [_int8(smollm_fp32, k, v) for k, v in pairs],
            [_anchor(smollm_fp32, k, v) for k, v in pairs])


def _int8(model, k, v):
    codec = get_codec("int8")
    rk, rv = codec.decode(codec.encode(k, v))
    return rk.to(model.dtype), rv.to(model.dtype)


def _anchor(model, k, v):
    encoded = get_codec("int8").encode(k, v)
    ak, av = anchor_kv(split_layer(encoded.buffers)[0], tuple(k.shape), k.dtype)
    return ak.to(model.dtype), av.to(model.dtype)


@pytest.mark.parametrize("cut,streamed,chunk_tokens,mode", [
    (30, False, 0, ReceiveMode.OVERLAP), (CUT, True, 0, ReceiveMode.OVERLAP),
    (CUT, False, 256, ReceiveMode.SEQUENTIAL)])
def test_anchors_first_then_residuals_rebuild_the_int8_cache(smollm_bf16, ids, cut, streamed,
                                                            chunk_tokens, mode):
    model = smollm_bf16
    L = model.shape.num_layers
    out = prefill(model, ids)
    action = Action("int8", cut, L, progressive=True)
    source = LivePrefill(model, ids, cut) if streamed else out
    hooks, seen = MessageNames(), {}

    def finish(result):
        seen["anchor"] = [tuple(t.clone() for t in result.cache.layer(i)) for i in range(cut)]
        result.residuals.wait()
        result.residuals.apply(result.cache)

    result, errors = run_handoff(model, ids, action, source, chunk_tokens, Receiving(mode),
                                 hooks=hooks, finish=finish)
    assert errors == []
    for layer in range(L):
        k, v = result.cache.layer(layer)
        if layer < cut:
            want = _int8(model, out.keys[layer], out.values[layer])
            rough = _anchor(model, out.keys[layer], out.values[layer])
            assert all(torch.equal(a, b) for a, b in zip(seen["anchor"][layer], rough)), layer
            assert not torch.equal(rough[0], want[0])
        else:  # recomputed from the BF16 boundary
            want = out.keys[layer], out.values[layer]
        assert torch.equal(k, want[0]) and torch.equal(v, want[1]), layer
    assert torch.equal(result.logits, final_logits(model, out.hidden[L][-1]))
    assert result.bytes + result.residuals.bytes == wire_bytes(action, model.shape, SEQ_LEN)
    anchors = [f"layer.{i}" for i in range(cut)]
    residuals = [f"residual.{i}" for i in range(cut)]
    if cut == L:
        assert hooks.names == ["plan", *anchors, "head", *residuals]
    elif streamed:
        assert hooks.names == ["plan", *anchors, "boundary", *residuals]
    else:
        assert hooks.names == ["plan", "boundary", *anchors, *residuals]


class _Held:
    """A link fault holding the first residual on the wire until `release` is set."""

    def __init__(self):
        self.release = threading.Event()

    def __call__(self, message):
        if message.name == "residual.0":
            assert self.release.wait(60)
        return [message]


class _TurnsThatRelease:
    """Unbounded turns; the `after`-th one lets the held residuals go."""

    def __init__(self, held, after):
        self.held, self.after, self.turns = held, after, 0

    def turn(self, context=0):
        import contextlib

        @contextlib.contextmanager
        def granted():
            yield Turn(allowance=1 << 62)
            self.turns += 1
            if self.turns >= self.after:
                self.held.release.set()
        return granted()


def _continue(model, ids, ruin_anchors=False):
    """(tokens emitted: the first and the continuation's, the continuation, the cache)."""
    L = model.shape.num_layers
    held = _Held()
    got = {}

    def finish(result):
        cache = result.cache
        if ruin_anchors:  # every prefix row wrong: the drafts go astray
            for layer in range(CUT):
                cache.keys[layer][:, :SEQ_LEN].normal_(generator=torch.Generator().manual_seed(1))
        first = int(torch.argmax(result.logits))
        got["cont"] = continue_on_anchors(model, cache, first, result.residuals, DRAFTS,
                                          _TurnsThatRelease(held, DRAFTS))
        got["first"], got["cache"] = first, cache

    _, errors = run_handoff(model, ids, Action("int8", CUT, L, progressive=True),
                            LivePrefill(model, ids, CUT), receiving=Receiving(extra_capacity=NEW),
                            fault=held, finish=finish)
    assert errors == []
    return [got["first"], *got["cont"].emitted], got["cont"], got["cache"]


@pytest.fixture(scope="module")
def int8_reference(smollm_fp32, ids):
    """Greedy decoding on the `int8` action's cache: NEW tokens."""
    model = smollm_fp32
    result, errors = run_handoff(model, ids, Action("int8", CUT, model.shape.num_layers),
                                 LivePrefill(model, ids, CUT),
                                 receiving=Receiving(extra_capacity=NEW))
    assert errors == []
    return decode_greedy(model, result.logits, result.cache, NEW)


@pytest.mark.parametrize("ruin_anchors", [False, True])
def test_verified_drafts_are_greedy_decoding_on_the_int8_cache(smollm_fp32, ids, int8_reference,
                                                               ruin_anchors):
    model = smollm_fp32
    emitted, cont, cache = _continue(model, ids, ruin_anchors)
    assert cont.drafted == DRAFTS  # the residuals were held until every draft was made
    assert len(emitted) == cont.accepted + 2
    assert cache.length == SEQ_LEN + 1 + cont.accepted  # [prompt, token, accepted drafts]
    if ruin_anchors:
        assert cont.accepted < DRAFTS  # a forced rollback: a draft rejected, the correction out
    # the engine goes on from the last emitted token on the verified cache
    rest = decode_greedy(model, torch.nn.functional.one_hot(torch.tensor(emitted[-1]),
                                                            model.shape.vocab_size).float(),
                         cache, NEW - len(emitted) + 1)
    assert emitted + rest[1:] == int8_reference


class _PendingFull:
    """Residuals still on the wire until waited for (never ready before): `apply` writes the full
    `int8` layers over the anchor rows."""

    def __init__(self, full):
        self.full, self.applied = full, False

    def ready(self):
        return False

    def wait(self):
        pass

    def apply(self, cache):
        for layer, (k, v) in enumerate(self.full):
            cache.write(layer, 0, k, v)
        self.applied = True

    def abandon(self, reason):
        raise AssertionError(f"abandoned: {reason}")


def test_the_drafts_are_greedy_decoding_on_the_anchor_cache(smollm_fp32, anchored, monkeypatch):
    """The drafts `continue_on_anchors` hands the verification are the k tokens greedy decoding
    makes on the anchor-precision cache after the first token: the same decode steps on the same
    cache, so bit for bit, on any machine."""
    model, (out, full, rough) = smollm_fp32, anchored

    def anchor_cache():
        return KVCache.from_layers([k for k, _ in rough], [v for _, v in rough], SEQ_LEN + NEW)

    first = int(torch.argmax(out.logits))
    want = draft(model, anchor_cache(), first, DRAFTS)
    assert any(want)  # greedy decoding here is not token 0 throughout
    verify, handed = progressive.verify, []

    def recording(model, cache, token, drafts):
        handed.append((token, list(drafts)))
        return verify(model, cache, token, drafts)

    monkeypatch.setattr(progressive, "verify", recording)
    residuals = _PendingFull(full)
    cont = continue_on_anchors(model, anchor_cache(), first, residuals, DRAFTS, _NoTurns())
    assert handed == [(first, want)] and cont.drafted == DRAFTS and residuals.applied
    assert cont.emitted[:cont.accepted] == want[:cont.accepted]


def test_drafts_stop_where_the_cache_has_room_and_each_turn_is_at_its_context(smollm_fp32,
                                                                              anchored):
    """A cache with room for three rows past the prompt: two drafts (the verify pass takes the
    third), drafted in turns at the cache's length, verified in one at the prompt's; k = 0 drafts
    nothing and k < 0 is refused by name."""
    model, (out, full, rough) = smollm_fp32, anchored

    def anchor_cache():
        return KVCache.from_layers([k for k, _ in rough], [v for _, v in rough], SEQ_LEN + 3)

    first, turns, L = int(torch.argmax(out.logits)), _RecordingTurns(), model.shape.num_layers
    cont = continue_on_anchors(model, anchor_cache(), first, _PendingFull(full), DRAFTS, turns)
    assert cont.drafted == 2
    assert turns.contexts == [SEQ_LEN, SEQ_LEN + 1, SEQ_LEN]
    assert [turn.spent for turn in turns.granted] == [L, L, 3 * L]  # a step each, then verify
    residuals = _PendingFull(full)
    assert continue_on_anchors(model, anchor_cache(), first, residuals, 0, turns) == (
        progressive.Continued([], 0, 0))
    assert residuals.applied
    with pytest.raises(ValueError, match="k: must be >= 0, got -1"):
        continue_on_anchors(model, anchor_cache(), first, _PendingFull(full), -1, turns)


def test_a_draft_that_fails_abandons_the_residuals_and_raises(smollm_fp32):
    model, abandoned = smollm_fp32, []

    class Failing(_RecordingTurns):
        def turn(self, context=0):
            raise RuntimeError("no turn")

    class Recording(_PendingFull):
        def abandon(self, reason):
            abandoned.append(reason)

    cache = empty_cache(model, 8)
    cache.length = 4
    with pytest.raises(RuntimeError, match="no turn"):
        continue_on_anchors(model, cache, 1, Recording([]), 2, Failing())
    assert abandoned == ["drafting failed"] and cache.length == 4


def test_a_lost_residual_raises_before_anything_drafted_is_verified(smollm_fp32, ids):
    model = smollm_fp32
    L = model.shape.num_layers

    def flip(message):
        if message.name == "residual.4":
            buffer = next(iter(message.buffers.values()))
            buffer[buffer.numel() // 2] ^= 0x10
        return [message]

    transfer = Transfer("r", stall_s=30)
    raised = {}

    def finish(result):
        before = [t.clone() for t in result.cache.layer(0)]
        with pytest.raises(ResidualsLost) as caught:
            continue_on_anchors(model, result.cache, int(torch.argmax(result.logits)),
                                result.residuals, DRAFTS, _NoTurns())
        raised["error"] = caught.value
        assert all(torch.equal(a, b) for a, b in zip(before, result.cache.layer(0)))
        assert result.cache.length == SEQ_LEN
        with pytest.raises(RuntimeError, match="apply after a successful wait"):
            result.residuals.apply(result.cache)

    _, errors = run_handoff(model, ids, Action("int8", L, L, progressive=True), prefill(model, ids),
                            receive_transfer=transfer, fault=flip, finish=finish)
    assert "residual.4" in str(raised["error"])
    assert transfer.state is TransferState.FAILED


class _NoTurns:
    def turn(self, context=0):
        import contextlib
        return contextlib.nullcontext(Turn(allowance=1 << 62))


def test_the_plan_carries_the_streams_and_bad_actions_are_refused(smollm_bf16):
    shape = smollm_bf16.shape
    L = shape.num_layers
    plan = HandoffPlan(Action("int8", CUT, L, progressive=True), 512, shape)
    assert HandoffPlan.from_bytes(plan.to_bytes(), shape) == plan
    assert str(plan.action) == f"joint(codec=int8, cut={CUT}/{L}, lynx)"
    for bad in (dict(codec="int4", cut=CUT), dict(codec="int8", cut=0),
                dict(codec="int8", cut=CUT, split=256)):
        with pytest.raises(ValueError, match="progressive"):
            Action(num_layers=L, progressive=True, **bad)
    with pytest.raises(ValueError, match="pipelined"):
        HandoffPlan(Action("int8", CUT, L, progressive=True), 512, shape,
                    Delivery(True, 256, Order.TOKENS))
    # the same bytes as int8's, in another order
    assert (wire_bytes(Action("int8", CUT, L, progressive=True), shape, 512)
            == wire_bytes(Action("int8", CUT, L), shape, 512))


class _RecordingTurns(_NoTurns):
    def __init__(self):
        self.contexts, self.granted = [], []

    def turn(self, context=0):
        self.contexts.append(context)
        granted = super().turn(context)
        self.granted.append(granted.enter_result)
        return granted
