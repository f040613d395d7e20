"""What `rekv gate` and the services' start-up measure besides the gate's verdicts, on a tiny
random model: SplitZip's codebooks (from windows taken at the text's end, K and V of every layer
and the boundary states of every interior cut), SpectrumKV's deployment probe (every layer
through the codec with the prefill's importance, the answer decoded from what the codec gives
back), the live layer check of a cached profile (the least of two runs), the codecs two workers
share, and a link probe's sample reaching the decode side's link estimate."""

from __future__ import annotations

import torch

from rekv_core.codecs import BASELINE_CODEC
from rekv_core.eval.needle import passkey_prompt
from rekv_core.eval.spectrum_probe import PROBE_BUDGET, PROBE_DEPTHS, PROBE_TIERS
from rekv_core.kernels import ExponentHistogram
from rekv_core.model import KVCache, decode_greedy, prefill
from rekv_core.plan import gate, profile_cache
from rekv_core.plan.calibration import LINK_SAMPLE_BYTES, DecodeCalibration
from rekv_core.plan.estimates import LayerCost
from rekv_core.plan.planner import common_codecs
from rekv_core.units import MiB
from tests.support.engine_fakes import tiny_model

MODEL = tiny_model(layers=3)
VOCAB = MODEL.shape.vocab_size


class _CharTokenizer:
    """Characters to ids below the tiny model's vocabulary, and back."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(32 + int(i)) for i in ids)


def _recording_prefill(monkeypatch, module):
    calls = []

    def recorded(model, ids, boundaries=None, importance_window=0):
        out = prefill(model, ids, boundaries=boundaries, importance_window=importance_window)
        calls.append({"ids": list(ids), "boundaries": boundaries,
                      "importance_window": importance_window, "out": out})
        return out

    monkeypatch.setattr(module, "prefill", recorded)
    return calls


def test_splitzip_is_calibrated_on_windows_from_the_texts_end(monkeypatch):
    """89 tokens, 3 windows of 16: reading the text backwards, windows start 0, 36 and 72 tokens
    from its end, each run forwards; the K and V of every layer go into one codebook, the
    boundary states of cuts 1..L-1 into the other, all as bfloat16."""
    calls = _recording_prefill(monkeypatch, gate)
    ids = list(range(1, 90))
    found = gate.calibrate_splitzip(MODEL, ids, prompt_len=16, prompts=3)
    assert [c["ids"] for c in calls] == [ids[73:89], ids[37:53], ids[1:17]]
    L = MODEL.shape.num_layers
    assert all(sorted(c["boundaries"]) == list(range(1, L)) for c in calls)
    kv, boundary = ExponentHistogram(), ExponentHistogram()
    for c in calls:
        out = c["out"]
        assert len(out.keys) == L and sorted(out.hidden) == list(range(1, L))
        for k, v in zip(out.keys, out.values):
            kv.add(k.to(torch.bfloat16))
            kv.add(v.to(torch.bfloat16))
        for h in out.hidden.values():
            boundary.add(h.to(torch.bfloat16))
    assert found == {"kv": kv.codebook(), "boundary": boundary.codebook(), "prompts": 3,
                     "prompt_len": 16}
    assert found["kv"] != found["boundary"]


class _ShiftingCodec:
    """SpectrumKV's stand-in: records what it is given and gives back K + 0.5 and V - 0.25 in
    float64, so the answer shows whether the decoded cache (and not the prefill's own) was decoded
    from, cast back to the model's dtype."""

    made: list[tuple] = []
    importance_window = 8

    def __init__(self, budget, tiers):
        self.made.append((budget, tiers))

    def encode(self, k, v, checksums=True, context=None):
        self.made.append(("encode", k, v, context.token_importance, checksums))
        return k, v

    def decode(self, encoded, verify=True):
        self.made.append(("decode", verify))
        k, v = encoded
        return k.double() + 0.5, v.double() - 0.25


def test_the_spectrum_probe_answers_from_the_codecs_cache(monkeypatch):
    """One trial per probe depth: its passkey prompt (filler sized to the context), every layer's
    K and V encoded with that layer's importance from the prefill (the codec's window) and
    decoded, and the answer greedy decoding on that decoded cache."""
    _ShiftingCodec.made = []
    monkeypatch.setattr(gate, "SpectrumCodec", _ShiftingCodec)
    calls = _recording_prefill(monkeypatch, gate)
    tok, progress = _CharTokenizer(), []
    result = gate.probe_spectrum(MODEL, tok, context_len=400, progress=progress.append)

    assert len(calls) == len(result["trials"]) == len(PROBE_DEPTHS) == len(progress)
    assert result["context_len"] == 400
    L = MODEL.shape.num_layers
    made = iter(_ShiftingCodec.made)
    for trial, call, line in zip(result["trials"], calls, progress):
        repeats = gate._filler_repeats(tok, 400)
        assert repeats > 0
        ids = tok.encode(passkey_prompt(trial["passkey"], repeats, trial["depth"]))
        assert call["ids"] == ids and call["importance_window"] == 8
        assert call["out"].hidden == {}, "the probe keeps no boundary state"
        assert next(made) == (PROBE_BUDGET, PROBE_TIERS)
        state = call["out"]
        for layer in range(L):
            what, k, v, scores, checksums = next(made)
            assert k is state.keys[layer] and v is state.values[layer]
            assert scores is state.importance[layer] and checksums is False
            assert next(made) == ("decode", False), "encoded without checksums: no verify"
        cache = KVCache.from_layers([k + 0.5 for k in state.keys],
                                    [v - 0.25 for v in state.values],
                                    len(ids) + gate.PROBE_TOKENS)
        expected = tok.decode(decode_greedy(MODEL, state.logits, cache, gate.PROBE_TOKENS))
        assert trial["answer"] == expected
        assert len(expected) == gate.PROBE_TOKENS
        assert line == f"spectrum probe at depth {trial['depth']}: {expected!r}"
    assert next(made, None) is None


def test_the_live_layer_check_takes_the_least_of_two_single_runs(monkeypatch):
    asked, times = [], iter([7.0, 4.0])

    def measured(model, lengths, repeats):
        asked.append((model, tuple(lengths), repeats))
        return LayerCost(list(lengths), [next(times)])

    monkeypatch.setattr(profile_cache, "measure_layer_cost", measured)
    assert profile_cache.live_layer_ms(MODEL, 192) == 4.0
    assert asked == [(MODEL, (192,), 1)] * 2


def test_the_codecs_both_workers_take_keep_this_workers_order_else_the_baseline():
    assert common_codecs(["int8", "splitzip", "int4h"], iter(["int4h", "int8"])) == [
        "int8", "int4h"]
    assert common_codecs(["int8"], ["splitzip"]) == [BASELINE_CODEC]
    assert common_codecs([], ["int8"]) == [BASELINE_CODEC]


def test_a_link_probe_sample_updates_the_decode_sides_link_estimate():
    decode = DecodeCalibration(MODEL.shape, LayerCost([256], [1.0]), {"int8": 1.0})
    assert decode.link.gbps is None
    assert decode.observe_probe(LINK_SAMPLE_BYTES - 1, 0.001) is None  # too small to time
    assert decode.observe_probe(2 * MiB, 0.01) == 2 * MiB * 8 / 0.01 / 1e9
    assert decode.observe_probe(2 * MiB, 0.04) == (2 * MiB * 8 / 0.01 / 1e9
                                                    + 2 * MiB * 8 / 0.04 / 1e9) / 2
    assert decode.link.samples == 2
