"""A model's weights as one safetensors file: the model cache's entry for a converted GGUF.

`write_weights(weights, path)` stores every tensor `ModelWeights` holds under its canonical name
(`embed`, `final_norm`, `lm_head` unless tied, `layers.{i}.{key}`) in its own dtype, with the
`ModelShape` as JSON in the file's metadata, beside the weights' digest (`ModelWeights.digest`,
see `digest`) when they carry one. `read_weights(path, dtype, device)` builds the weights back
through the loaders' own `weights_layout.assemble`, so every tensor's shape is checked as a fresh
conversion's is; the tensors are bit-identical to the ones written, and the digest is read back
with them, so the entry and its digest are made, kept and dropped together.
`canonical_tensors(weights)` names every tensor the executor reads, in the entry's order.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from rekv_core.model.shapes import Llama3RopeScaling, ModelShape
from rekv_core.model.weights_layout import ModelWeights, assemble, expected_layer_shapes

MODEL_KEYS = ("embed", "final_norm", "lm_head")  # stored under their own names


def _names(shape: ModelShape) -> dict[str, str]:
    """Each canonical key this shape has and its name in the file; per-layer ones under
    `layers.{i}.`."""
    return {key: key for key in MODEL_KEYS} | {key: f"layers.{{i}}.{key}"
                                               for key in expected_layer_shapes(shape)}


def canonical_tensors(weights: ModelWeights, tied_head: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor by its canonical name, in order; `lm_head` of tied embeddings only with
    `tied_head` (it is `embed`)."""
    tensors = {key: getattr(weights, key) for key in MODEL_KEYS
               if key != "lm_head" or tied_head or not weights.shape.tie_embeddings}
    for index, layer in enumerate(weights.layers):
        for key in expected_layer_shapes(weights.shape):
            tensors[f"layers.{index}.{key}"] = getattr(layer, key)
    return tensors


def write_weights(weights: ModelWeights, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = canonical_tensors(weights, tied_head=False)
    metadata = {"shape": json.dumps(asdict(weights.shape))}
    if weights.digest:
        metadata["digest"] = weights.digest
    save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, str(path),
              metadata=metadata)


def read_weights(path: Path, dtype: torch.dtype, device: torch.device | str) -> ModelWeights:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(torch.device(device))) as entry:
        metadata = entry.metadata()
        fields = json.loads(metadata["shape"])
        scaling = fields.pop("rope_scaling")
        shape = ModelShape(**fields, rope_scaling=Llama3RopeScaling(**scaling) if scaling else None)
        names = set(entry.keys())
        weights = assemble(shape, lambda name: entry.get_tensor(name) if name in names else None,
                           _names(shape), dtype, device)
    weights.digest = metadata.get("digest", "")
    return weights
