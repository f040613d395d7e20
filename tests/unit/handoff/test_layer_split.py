"""KVPR's per-layer form: a layer's K and V recomputed from its input rows equal the prefill's bit for
bit (the embedded GQA model and the MHA preset), its bytes are the formula, the seed's closed form
is the time model's crossing, and the split pays exactly where ReKV's Proposition 1 says: only
where n_h < 2·n_kv (on the presets, only the multi-head ones). The planner's per-layer actions
(`layer_split_actions`) are offered there, at splits whose rows are recomputed bit for bit."""

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.handoff import Action
from rekv_core.handoff.token_split import layer_split_wire_bytes, recompute_layer_kv
from rekv_core.model import Model, prefill
from rekv_core.model.shapes import PRESETS, get_preset
from rekv_core.model.weights import synthetic_weights
from rekv_core.plan.cost import CostInputs
from rekv_core.plan.evidence import CodecCost
from rekv_core.plan.layer_split import layer_split_actions
from rekv_core.plan.token_split import SplitCosts, best_split, crossing

LINK_BYTES_PER_MS = 1.25e6  # 10 Gb/s
FLOPS_PER_MS = 1e11  # 100 TFLOP/s


def _layer_costs(shape) -> SplitCosts:
    """Per token, one layer: its input row (BF16) and its K, V row (BF16) on the wire, and the K
    and V projections (2 · d · 2·n_kv·d_h flops) on the decode side."""
    kv_width = 2 * shape.num_kv_heads * shape.head_dim
    return SplitCosts(boundary_row_ms=shape.hidden_size * 2 / LINK_BYTES_PER_MS,
                      suffix_row_ms=kv_width * 2 / LINK_BYTES_PER_MS,
                      recompute_row_ms=2 * shape.hidden_size * kv_width / FLOPS_PER_MS)


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_per_layer_split_pays_only_where_n_h_is_below_twice_n_kv(name):
    shape = get_preset(name)
    pays = best_split(_layer_costs(shape), 4096) > 0
    assert pays == (shape.num_heads < 2 * shape.num_kv_heads)
    assert pays == name.endswith("llama-2-7b")


def test_the_seeds_closed_form_is_the_models_crossing():
    shape, s = get_preset("llama-2-7b"), 4096
    h, p = shape.hidden_size, 2
    v_com, v_gpu = LINK_BYTES_PER_MS, FLOPS_PER_MS
    seed = s * p * v_gpu / (2 * h * v_com + p * v_gpu)
    assert crossing(_layer_costs(shape), s) == pytest.approx(seed)


@pytest.fixture(scope="module")
def mha_model():
    return Model(synthetic_weights(get_preset("mini-llama-2-7b"), torch.float32, seed=1))


@pytest.mark.parametrize("which", ["smollm", "mha"])
def test_recomputed_layer_kv_equals_the_prefills(smollm_fp32, mha_model, which):
    model = smollm_fp32 if which == "smollm" else mha_model
    ids = torch.randint(100, 30000, (600,), generator=torch.Generator().manual_seed(2))
    layer, split = 5, 512
    out = prefill(model, ids, boundaries=(layer,))
    k, v = recompute_layer_kv(model, layer, out.hidden[layer][:split])
    assert torch.equal(k, out.keys[layer][:, :split])
    assert torch.equal(v, out.values[layer][:, :split])


def _offered(shape, seq_len: int) -> list[Action]:
    """The planner's per-layer actions of every BF16 cut on a 1 Gb/s link with a cheap recompute
    (1 ms a layer), where the form pays on a multi-head model."""
    inputs = CostInputs(shape, seq_len, 1.0, 1.0, codec_costs={"bf16": CodecCost(0.05, 0.05)},
                        message_ms=0.05, prefill_ms_per_layer=2.0, streamed=True,
                        chunk_tokens=256, layer_splits=True)
    L = shape.num_layers
    return layer_split_actions(inputs, ["bf16"], [Action("bf16", c, L) for c in range(1, L + 1)])


def test_the_planners_per_layer_actions_recompute_their_rows_bit_for_bit(mha_model):
    """On the MHA model the planner offers the form at every cut, each at a split l whose input
    rows give every sent layer's K and V of [0, l) exactly as the prefill computed them; on the
    GQA model (an input row outweighs a K and V row) it offers none."""
    model, seq_len = mha_model, 300
    L = model.shape.num_layers
    offered = _offered(model.shape, seq_len)
    assert [a.cut for a in offered] == list(range(1, L + 1))
    ids = torch.randint(100, 30000, (seq_len,), generator=torch.Generator().manual_seed(3))
    out = prefill(model, ids, boundaries=range(L))
    for split in {a.layer_split for a in offered}:
        assert 0 < split < seq_len
        for layer in range(L):
            k, v = recompute_layer_kv(model, layer, out.hidden[layer][:split])
            assert torch.equal(k, out.keys[layer][:, :split]), (split, layer)
            assert torch.equal(v, out.values[layer][:, :split]), (split, layer)
    assert _offered(get_preset("smollm2-135m"), seq_len) == []


def test_the_per_layer_bytes_are_the_formula():
    shape, s = get_preset("llama-2-7b"), 4096
    for split in (0, 1024, s):
        sent = layer_split_wire_bytes(shape, s, split, get_codec("bf16"))
        assert sent.boundary == split * shape.hidden_size * 2
        assert sent.prefix == (s - split) * 2 * shape.num_kv_heads * shape.head_dim * 2
    whole = layer_split_wire_bytes(shape, s, 0, get_codec("bf16")).total
    assert layer_split_wire_bytes(shape, s, s, get_codec("bf16")).total * 2 == whole
    with pytest.raises(ValueError, match="split"):
        layer_split_wire_bytes(shape, s, 100, get_codec("bf16"))
