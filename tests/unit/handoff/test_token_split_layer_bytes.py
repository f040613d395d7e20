"""KVPR's per-layer form's bytes for one layer (`token_split.layer_split_wire_bytes`) with a codec
that sends scales (int8: one FP16 scale per 64 values, beside one byte per value) and on a model of
a single layer, where the per-layer form is a valid action (a cut of 1 = L)."""

import dataclasses

from rekv_core.codecs import get_codec
from rekv_core.handoff.action import Action
from rekv_core.handoff.token_split import layer_split_wire_bytes
from rekv_core.model.shapes import get_preset

LLAMA = get_preset("llama-2-7b")


def test_an_int8_layer_sends_its_codes_and_their_scales_for_the_rows_after_the_split():
    s, split = 4096, 1024
    sent = layer_split_wire_bytes(LLAMA, s, split, get_codec("int8"))
    values = 2 * (s - split) * LLAMA.num_kv_heads * LLAMA.head_dim  # K and V of rows [l, S)
    assert sent.boundary == split * LLAMA.hidden_size * 2
    assert sent.prefix == values
    assert sent.scales == values // 64 * 2
    assert sent.total == sent.boundary + values + values // 64 * 2


def test_a_single_layer_model_sends_its_one_layer_in_the_per_layer_form():
    one = dataclasses.replace(LLAMA, num_layers=1)
    s, split = 1024, 512
    Action("bf16", 1, 1, layer_split=split)  # a valid action on this model
    sent = layer_split_wire_bytes(one, s, split, get_codec("bf16"))
    assert sent.boundary == split * one.hidden_size * 2
    assert sent.prefix == (s - split) * 2 * one.num_kv_heads * one.head_dim * 2
