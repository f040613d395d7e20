"""The five actions and their byte model (seed eqs. 5 and 7)."""

import pytest

from rekv_core.handoff.action import Action, ActionKind, wire_bytes
from rekv_core.model.shapes import PRESETS, get_preset

MiB = 1 << 20
QWEN7B = get_preset("qwen2.5-7b")
L = QWEN7B.num_layers


@pytest.mark.parametrize("codec, cut, kind", [
    ("bf16", L, ActionKind.BF16_TRANSFER), ("int8", L, ActionKind.QUANT_TRANSFER),
    ("int4", L, ActionKind.QUANT_TRANSFER), ("bf16", 13, ActionKind.BF16_RECOMPUTE),
    ("bf16", 0, ActionKind.TOKEN_RECOMPUTE), ("int8", 0, ActionKind.TOKEN_RECOMPUTE),
    ("int8", 15, ActionKind.JOINT), ("int4", 1, ActionKind.JOINT),
])
def test_kinds(codec, cut, kind):
    assert Action(codec, cut, L).kind == kind


def test_seed_byte_values_qwen7b_8k():
    assert wire_bytes(Action.full_bf16(L), QWEN7B, 8192).state == 448 * MiB
    assert wire_bytes(Action("int8", L, L), QWEN7B, 8192).state == 231 * MiB
    assert wire_bytes(Action.full_bf16(L), QWEN7B, 8192).head == 3584 * 2
    joint = wire_bytes(Action("int8", 15, L), QWEN7B, 8192)
    assert joint.total == 179.75 * MiB
    assert joint.boundary == 56 * MiB and joint.scales == 15 * 8192 * 4 * 128 * 2 // 64 * 2
    assert wire_bytes(Action.token_only(L), QWEN7B, 8192).as_dict() == {
        "boundary": 0, "prefix": 0, "scales": 0, "tokens": 8192 * 4, "head": 0,
        "total": 8192 * 4}


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("seq_len", [1, 512, 8192])
def test_eq5_and_eq7_for_every_interior_cut(preset, seq_len):
    shape = get_preset(preset)
    elements = 2 * seq_len * shape.num_kv_heads * shape.head_dim
    boundary = seq_len * shape.hidden_size * 2
    for cut in range(1, shape.num_layers):
        assert wire_bytes(Action("bf16", cut, shape.num_layers), shape, seq_len).total == \
            cut * elements * 2 + boundary  # eq. (5)
        for bits in (8, 4):
            assert wire_bytes(Action(f"int{bits}", cut, shape.num_layers), shape,
                              seq_len).total == cut * elements * (bits * 8 + 2) // 64 + boundary


def test_bf16_cut_saves_bytes_iff_eq6():
    # eq. (6): a BF16 cut saves bytes exactly when r > n_h / (2 n_kv) = 3.5 for Qwen2.5-7B
    full = wire_bytes(Action.full_bf16(L), QWEN7B, 1024).state
    for r in range(1, L):
        saves = wire_bytes(Action("bf16", L - r, L), QWEN7B, 1024).total < full
        assert saves == (r > 3.5)


def test_bad_actions_are_named():
    with pytest.raises(ValueError, match=r"cut: must lie in \[0, 28\], got 29"):
        Action("int8", 29, L)
    with pytest.raises(ValueError, match="cut"):
        Action("int8", -1, L)
    with pytest.raises(ValueError, match="unknown codec 'fp8'"):
        Action("fp8", 3, L)
    with pytest.raises(ValueError, match="action: built for 30 layers"):
        wire_bytes(Action("int8", 3, 30), QWEN7B, 16)


def test_an_action_reads_as_its_kind_codec_and_cut_with_only_the_options_it_uses():
    assert str(Action("int8", 15, L)) == "joint(codec=int8, cut=15/28)"
    assert str(Action("int8", 15, L, boundary="splitzip")) == \
        "joint(codec=int8, cut=15/28, boundary=splitzip)"
    assert str(Action("int8", 15, L, split=512)) == "token_split(codec=int8, cut=15/28, split=512)"
    assert str(Action("int8", 15, L, progressive=True)) == "joint(codec=int8, cut=15/28, lynx)"
    assert str(Action("bf16", L, L, layer_split=256)) == \
        "bf16_transfer(codec=bf16, cut=28/28, layer_split=256)"
