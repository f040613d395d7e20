"""Weight sources and the errors they raise on bad input."""

import dataclasses
import json

import pytest
import torch

from rekv_core.model import Model, get_preset, load_weights, prefill
from rekv_core.model.weights import (expected_layer_shapes, load_gguf, load_hf_checkpoint,
                                     synthetic_weights)
from rekv_core.settings import RuntimeSettings


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        load_weights("synthetic:nope")


def test_preset_without_weights_says_how_to_get_them():
    with pytest.raises(ValueError, match="synthetic:qwen2.5-7b"):
        load_weights("qwen2.5-7b")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_gguf(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a preset"):
        load_weights(str(tmp_path / "nowhere"))


def _save_tiny_llama(directory, mutate=None):
    from safetensors.torch import save_file

    shape = get_preset("smollm2-135m").with_layers(1)
    weights = synthetic_weights(shape)
    tensors = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm}
    names = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "mlp_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj",
             "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for key, name in names.items():
        tensors[f"model.layers.0.{name}.weight"] = getattr(weights.layers[0], key)
    if mutate:
        mutate(tensors)
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    config = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 1,
              "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
              "vocab_size": 49152, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "max_position_embeddings": 8192}
    (directory / "config.json").write_text(json.dumps(config))
    return weights


def test_hf_checkpoint_round_trip(tmp_path):
    weights = _save_tiny_llama(tmp_path / "ok")
    loaded = load_hf_checkpoint(tmp_path / "ok")
    assert torch.equal(loaded.layers[0].wq, weights.layers[0].wq)
    assert loaded.lm_head is loaded.embed


def test_mismatched_and_missing_tensors_are_named(tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(100, 576)

    _save_tiny_llama(tmp_path / "bad", shrink)
    with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(100, 576\), expected "
                                         r"\(192, 576\)"):
        load_hf_checkpoint(tmp_path / "bad")

    def drop(tensors):
        del tensors["model.layers.0.mlp.up_proj.weight"]

    _save_tiny_llama(tmp_path / "missing", drop)
    with pytest.raises(KeyError, match="up_proj"):
        load_hf_checkpoint(tmp_path / "missing")


def test_token_ids_outside_the_vocabulary(smollm_fp32):
    with pytest.raises(ValueError, match=r"token_ids: id 49152 at position 1 is outside"):
        prefill(smollm_fp32, [5, 49152])
    with pytest.raises(ValueError, match="token_ids: id -1"):
        prefill(smollm_fp32, [-1])
    with pytest.raises(ValueError, match="token_ids: the prompt is empty"):
        prefill(smollm_fp32, [])


@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen2.5-3b"])
def test_synthetic_weights_have_the_preset_dims_and_run(preset):
    shape = get_preset(preset)
    weights = synthetic_weights(shape, dtype=torch.bfloat16, shared_layer=True)
    assert len(weights.layers) == shape.num_layers
    assert all(layer is weights.layers[0] for layer in weights.layers)
    for key, dims in expected_layer_shapes(shape).items():
        assert tuple(getattr(weights.layers[0], key).shape) == dims, key
    out = prefill(Model(weights), list(range(16)), boundaries=[shape.num_layers // 2])
    assert out.keys[0].shape == (shape.num_kv_heads, 16, shape.head_dim)
    assert torch.isfinite(out.logits).all()


def test_synthetic_layers_differ_unless_shared():
    shape = get_preset("smollm2-135m").with_layers(2)
    weights = synthetic_weights(shape, shared_layer=False)
    assert not torch.equal(weights.layers[0].wq, weights.layers[1].wq)


def test_runtime_settings_validate_and_read_the_environment(monkeypatch):
    monkeypatch.setenv("REKV_DTYPE", "bfloat16")
    assert RuntimeSettings.from_env().torch_dtype == torch.bfloat16
    assert RuntimeSettings.from_env(dtype="float32").torch_dtype == torch.float32
    assert RuntimeSettings(device="cuda").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype: must be one of"):
        RuntimeSettings(dtype="float64")
    with pytest.raises(ValueError, match="device"):
        RuntimeSettings(device="tpu")
    with pytest.raises(ValueError, match="CUDA runs bfloat16"):
        RuntimeSettings(device="cuda:0", dtype="float32")



@pytest.mark.parametrize("preset", ["qwen2.5-3b", "qwen3-8b"])  # Q/K/V biases; q/k norms
def test_fused_projections_keep_every_weight_as_a_view(preset):
    shape = dataclasses.replace(get_preset(preset), num_layers=2, hidden_size=256, num_heads=4,
                                num_kv_heads=2, head_dim=64, ffn_size=512, vocab_size=300)
    weights = synthetic_weights(shape)
    before = [{name: getattr(lw, name).clone() for name in expected_layer_shapes(shape)}
              for lw in weights.layers]
    model = Model(weights)
    Model(weights)  # fusing again changes nothing
    for lw, original in zip(model.weights.layers, before):
        assert lw.wqkv.shape == (shape.q_size + 2 * shape.kv_size, shape.hidden_size)
        assert lw.w_gate_up.shape == (2 * shape.ffn_size, shape.hidden_size)
        assert (lw.bqkv is not None) == shape.qkv_bias
        for name, tensor in original.items():
            assert torch.equal(getattr(lw, name), tensor), name
        for name, fused in (("wq", "wqkv"), ("wv", "wqkv"), ("w_up", "w_gate_up")):
            assert getattr(lw, name).untyped_storage().data_ptr() == \
                getattr(lw, fused).untyped_storage().data_ptr(), name
