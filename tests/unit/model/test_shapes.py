import pytest

from rekv_core.model.shapes import PRESETS, get_preset

MiB = 1 << 20


@pytest.mark.parametrize("name, ratio", [("qwen2.5-7b", 3.5), ("llama-3.1-8b", 2.0),
                                         ("qwen2.5-3b", 4.0), ("qwen3-8b", 2.0),
                                         ("smollm2-135m", 1.5), ("mini-qwen2.5-7b", 3.5),
                                         ("mini-qwen3-8b", 2.0)])
def test_boundary_to_layer_ratio_is_eq3(name, ratio):
    shape = get_preset(name)
    assert shape.boundary_bytes(1000) / shape.kv_layer_bytes(1000) == ratio


def test_qwen7b_check_values_at_8k():
    shape = get_preset("qwen2.5-7b")
    assert shape.boundary_bytes(8192) == 56 * MiB
    assert shape.kv_layer_bytes(8192) == 16 * MiB
    assert shape.num_layers * shape.kv_layer_bytes(8192) == 448 * MiB


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown model preset 'gpt-5'.*qwen2.5-7b"):
        get_preset("gpt-5")


def test_families_carry_their_features():
    assert get_preset("qwen2.5-7b").qkv_bias and not get_preset("qwen2.5-7b").qk_norm
    assert get_preset("qwen3-8b").qk_norm and not get_preset("qwen3-8b").qkv_bias
    assert get_preset("llama-3.1-8b").rope_scaling is not None
    assert all(s.hidden_size == s.num_heads * s.head_dim for s in PRESETS.values())


def test_embedded_gguf_shape_is_the_preset():
    import gguf

    from rekv_core.model.weights import embedded_gguf_path, shape_from_gguf

    shape = shape_from_gguf(gguf.GGUFReader(str(embedded_gguf_path())))
    assert shape == get_preset("smollm2-135m")


@pytest.mark.parametrize("mini_name, full_name", [("mini-qwen2.5-7b", "qwen2.5-7b"),
                                                  ("mini-qwen3-8b", "qwen3-8b"),
                                                  ("mini-llama-2-7b", "llama-2-7b")])
def test_cpu_sized_presets_keep_their_models_proportions(mini_name, full_name):
    mini, full = get_preset(mini_name), get_preset(full_name)
    assert mini.num_layers == full.num_layers and mini.family == full.family
    assert mini.num_heads // mini.num_kv_heads == full.num_heads // full.num_kv_heads
    assert mini.hidden_size * 8 == full.hidden_size
    assert abs(mini.ffn_size / mini.hidden_size - full.ffn_size / full.hidden_size) < 0.01
