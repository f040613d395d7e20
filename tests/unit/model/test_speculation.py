"""Lynx's drafting and verification on the embedded model (float32): drafts made on the
anchor-precision cache and verified on the full INT8 cache emit exactly the tokens of greedy
decoding on the INT8 cache, over several rounds; a forced rollback (a wrong draft) emits the
correction, drops the rejected rows, and decoding after it still follows the reference."""

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.codecs.lynx import anchor_kv, split_layer
from rekv_core.model import KVCache, prefill
from rekv_core.model.executor import decode_greedy
from rekv_core.model.speculation import draft, verify

NEW = 24


@pytest.fixture(scope="module")
def caches(smollm_fp32, tokenizer):
    """(INT8 layers, anchor layers, first-token logits) of a prompt."""
    ids = tokenizer.encode("The history of the printing press begins in China, where")
    out = prefill(smollm_fp32, ids, boundaries=())
    codec = get_codec("int8")
    full, rough = [], []
    for k, v in zip(out.keys, out.values):
        encoded = codec.encode(k, v)
        full.append(codec.decode(encoded))
        rough.append(anchor_kv(split_layer(encoded.buffers)[0], tuple(k.shape), k.dtype))
    return full, rough, out.logits


def _cache(layers, extra=NEW + 8):
    return KVCache.from_layers([k for k, _ in layers], [v for _, v in layers],
                               layers[0][0].shape[1] + extra)


def test_verified_drafts_are_greedy_decoding_on_the_int8_cache(smollm_fp32, caches):
    model = smollm_fp32
    full, rough, logits = caches
    want = decode_greedy(model, logits, _cache(full), NEW)
    exact = _cache(full)
    emitted = [int(logits.argmax())]
    accepted = 0
    while len(emitted) < NEW:
        anchor = _cache(rough)  # the anchor cache, caught up to the exact one's tokens
        anchor.load([k[:, :exact.length] for k in exact.keys],
                    [v[:, :exact.length] for v in exact.values])
        for layer, (k, v) in enumerate(rough):
            anchor.write(layer, 0, k, v)
        drafts = draft(model, anchor, emitted[-1], 4)
        result = verify(model, exact, emitted[-1], drafts)
        emitted += result.emitted
        accepted += result.accepted
        assert exact.length == len(full[0][0][0]) + len(emitted) - 1
    assert emitted[:NEW] == want
    assert accepted > 0  # the anchor's drafts were worth something


def test_a_forced_rollback_emits_the_correction_and_drops_the_rejected_rows(smollm_fp32,
                                                                           caches):
    model = smollm_fp32
    full, _, logits = caches
    want = decode_greedy(model, logits, _cache(full), NEW)
    exact = _cache(full)
    prompt = exact.length
    wrong = [want[1], (want[2] + 1) % model.shape.vocab_size, want[3]]
    result = verify(model, exact, want[0], wrong)
    assert result.accepted == 1 and result.emitted == want[1:3]
    assert exact.length == prompt + 2
    rest = decode_greedy(model, torch.nn.functional.one_hot(
        torch.tensor(want[2]), model.shape.vocab_size).float(), exact, NEW - 2)
    assert rest == want[2:]
