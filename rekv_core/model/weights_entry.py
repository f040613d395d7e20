"""A model's weights as one safetensors file: the model cache's entry for a converted GGUF.

`write_weights(weights, path)` stores every tensor `ModelWeights` holds under its canonical name
(`embed`, `final_norm`, `lm_head` unless tied, `layers.{i}.{key}`) in its own dtype, with the
`ModelShape` as JSON in the file's metadata. `read_weights(path, dtype, device)` builds the
weights back through the loaders' own `_assemble`, so every tensor's shape is checked as a fresh
conversion's is; the tensors are bit-identical to the ones written.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from rekv_core.model.shapes import Llama3RopeScaling, ModelShape
from rekv_core.model.weights import (_GGUF_NAMES, ModelWeights, _assemble,
                                     expected_layer_shapes)

# the canonical keys the GGUF loader knows, per layer ones under `layers.{i}.`
_NAMES = {key: f"layers.{{i}}.{key}" if "{i}" in name else key for key, name in _GGUF_NAMES.items()}


def write_weights(weights: ModelWeights, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"embed": weights.embed, "final_norm": weights.final_norm}
    if not weights.shape.tie_embeddings:
        tensors["lm_head"] = weights.lm_head
    for index, layer in enumerate(weights.layers):
        for key in expected_layer_shapes(weights.shape):
            tensors[f"layers.{index}.{key}"] = getattr(layer, key)
    save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, str(path),
              metadata={"shape": json.dumps(asdict(weights.shape))})


def read_weights(path: Path, dtype: torch.dtype, device: torch.device | str) -> ModelWeights:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(torch.device(device))) as entry:
        fields = json.loads(entry.metadata()["shape"])
        scaling = fields.pop("rope_scaling")
        shape = ModelShape(**fields, rope_scaling=Llama3RopeScaling(**scaling) if scaling else None)
        names = set(entry.keys())
        return _assemble(shape, lambda name: entry.get_tensor(name) if name in names else None,
                         _NAMES, dtype, device)
