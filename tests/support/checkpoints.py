"""Hugging Face checkpoint directories written from `ModelWeights`: `save_hf_checkpoint(directory,
weights)` writes `config.json` and `model.safetensors` (Llama family, tied embeddings) that
`load_weights(str(directory))` reads back bit-identical; the directory's name is the model's."""

import json
from pathlib import Path

_LAYER_NAMES = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj",
                "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
                "mlp_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj",
                "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def save_hf_checkpoint(directory: Path, weights) -> Path:
    from safetensors.torch import save_file

    shape = weights.shape
    if shape.family != "llama" or not shape.tie_embeddings:
        raise ValueError("save_hf_checkpoint writes Llama checkpoints with tied embeddings")
    tensors = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm}
    for index, layer in enumerate(weights.layers):
        for key, name in _LAYER_NAMES.items():
            tensors[f"model.layers.{index}.{name}.weight"] = getattr(layer, key)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    config = {"model_type": "llama", "hidden_size": shape.hidden_size,
              "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
              "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
              "intermediate_size": shape.ffn_size, "vocab_size": shape.vocab_size,
              "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_eps,
              "tie_word_embeddings": True, "max_position_embeddings": shape.max_positions}
    (directory / "config.json").write_text(json.dumps(config))
    return directory
