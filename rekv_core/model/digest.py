"""Digests of what a model computes with: its weights as loaded and its tokenizer.

`weights_digest(weights)` is the SHA-256 (hex) over every tensor the executor reads, in one
canonical order (`weights_entry.canonical_tensors`: `embed`, `final_norm`, `lm_head`,
`layers.{i}.{key}`), each framed by its name, dtype and shape, then its bytes. It is taken of the
weights as loaded, in the working dtype: the same file loaded in float32 and in BF16 gives two
digests. A tensor several names share (tied embeddings, synthetic weights with one shared layer)
is read once. Tensors on a device are copied to the host one at a time.

The loaders that read a file keep the digest in the model cache (`ModelWeights.digest`, see
`weights.load_weights`), so a process start reads it instead of hashing again; `digest_of(weights)`
is the kept one, else computed (synthetic weights) and kept on the object.

`tokenizer_digest(tokenizer)`: SHA-256 of the tokenizer's serialized form (`to_json`), "" for a
model served by token ids (no tokenizer).
"""

from __future__ import annotations

import hashlib

import torch

from rekv_core.model.weights_entry import canonical_tensors
from rekv_core.model.weights_layout import ModelWeights


def weights_digest(weights: ModelWeights) -> str:
    model = hashlib.sha256(b"rekv-weights-1")
    seen: dict[tuple, bytes] = {}  # a tensor's storage and view -> the digest of its bytes
    for name, tensor in canonical_tensors(weights).items():
        view = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape),
                tuple(tensor.stride()))
        if view not in seen:
            seen[view] = _bytes_digest(tensor)
        frame = f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}|"
        model.update(frame.encode() + seen[view])
    return model.hexdigest()


def _bytes_digest(tensor: torch.Tensor) -> bytes:
    host = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(host.numpy())).digest()


def digest_of(weights: ModelWeights) -> str:
    """The kept digest, else computed now and kept on `weights`."""
    if not weights.digest:
        weights.digest = weights_digest(weights)
    return weights.digest


def tokenizer_digest(tokenizer) -> str:
    """`tokenizer`: a `GGUFTokenizer`, or None for a model served by token ids."""
    if tokenizer is None:
        return ""
    return hashlib.sha256(tokenizer.to_json().encode()).hexdigest()
