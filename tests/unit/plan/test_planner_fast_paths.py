"""What the planner remembers and skips to rank its candidates quickly changes no ranking: a
registered codec's layer bytes are the codec's own; the candidate list is built once per model and
codecs, yet each call gets a list of its own; token splits and the per-layer form are skipped
only where no multiple of the block lies inside the prompt, and are the full search's elsewhere;
an unknown codec is named as before, without building a codec."""

import pytest

from rekv_core.codecs import check_codec_name, codec_names, get_codec, registered_layer_bytes
from rekv_core.handoff import Action
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.shapes import get_preset
from rekv_core.plan.cost import CostInputs, candidate_actions, split_actions, split_costs
from rekv_core.plan.evidence import CodecCost
from rekv_core.plan.layer_split import best_layer_split, layer_split_actions, layer_split_costs
from rekv_core.plan.token_split import best_split

SHAPE = get_preset("smollm2-135m")
L = SHAPE.num_layers
MHA = get_preset("llama-2-7b")  # n_h < 2 n_kv: the per-layer form is ranked
PROMPTS = (1, 32, EXEC_BLOCK - 1, EXEC_BLOCK, EXEC_BLOCK + 1, 300, 2 * EXEC_BLOCK)


@pytest.mark.parametrize("name", codec_names())
@pytest.mark.parametrize("rows", [1, 31, 256, 1000])
def test_a_registered_codecs_layer_bytes_are_the_codecs_own(name, rows):
    shape = (SHAPE.num_kv_heads, rows, SHAPE.head_dim)
    assert registered_layer_bytes(name, shape) == get_codec(name).layer_bytes(shape)
    assert registered_layer_bytes(name, shape) == get_codec(name).layer_bytes(shape)  # remembered


def test_an_unknown_codec_is_named_with_the_registered_ones():
    for name in codec_names():
        check_codec_name(name)
    with pytest.raises(ValueError, match="unknown codec 'int3'; registered codecs: bf16, int8"):
        check_codec_name("int3")
    with pytest.raises(ValueError, match="unknown codec 'int3'; registered codecs: bf16, int8"):
        Action("int3", 4, L)
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        registered_layer_bytes("int3", (3, 32, 64))


def test_each_call_gets_its_own_list_of_the_same_candidates():
    expected = [Action.token_only(L)]
    for codec in ("int8", "splitzip"):
        expected += [Action(codec, c, L) for c in range(1, L + 1)]
        expected += [Action(codec, c, L, "splitzip") for c in range(1, L)]
    first = candidate_actions(SHAPE, ["int8", "splitzip", "int8"])
    assert first == expected
    first.clear()
    assert candidate_actions(SHAPE, ("int8", "splitzip")) == expected
    assert candidate_actions(SHAPE, ["int8"]) == [Action.token_only(L)] + [
        Action("int8", c, L) for c in range(1, L + 1)]


@pytest.mark.parametrize("S", PROMPTS)
@pytest.mark.parametrize("gbps, gamma", [(1.0, 1.0), (0.1, 20.0), (1.0, 2.0)])
def test_token_splits_are_the_full_searchs_at_every_length(S, gbps, gamma):
    inputs = CostInputs(SHAPE, S, gbps, gamma, prefill_ms_per_layer=1.0, message_ms=0.0,
                        token_splits=True)
    expected = [Action(codec, c, L, split=l) for codec in ("int8", "bf16") for c in range(1, L)
                if 0 < (l := best_split(split_costs(inputs, codec, c), S)) < S]
    assert split_actions(inputs, ["int8", "bf16"]) == expected
    assert bool(expected) == (S > EXEC_BLOCK)  # these points split wherever a split exists


def _layer_inputs(S):
    return CostInputs(MHA, S, 0.1, 0.01, codec_costs={"int8": CodecCost(0.05, 0.05)},
                      message_ms=0.0, prefill_ms_per_layer=2.0, streamed=True, chunk_tokens=256,
                      layer_splits=True)


@pytest.mark.parametrize("S", PROMPTS)
def test_the_per_layer_form_is_the_full_searchs_at_every_length(S):
    inputs, layers = _layer_inputs(S), MHA.num_layers
    base = [Action(codec, c, layers) for codec in ("bf16", "int8") for c in range(1, layers + 1)]
    expected = [Action(a.codec, a.cut, layers, layer_split=l) for a in base
                if (l := best_layer_split(layer_split_costs(inputs, a.codec, a.cut), S))]
    assert layer_split_actions(inputs, ["bf16", "int8"], base) == expected
    assert bool(expected) == (S > EXEC_BLOCK)
