"""The in-memory layout of a model's weights, and building it from any source of named tensors.

`ModelWeights` holds the tensors the executor reads, in Hugging Face orientation (linear weights
are `[out_features, in_features]`), one `LayerWeights` per layer. `expected_layer_shapes(shape)`
names every per-layer tensor a `ModelShape` needs, with its shape. `assemble(shape, fetch, names,
dtype, device)` builds the weights from `fetch(source_name)`, where `names` maps each canonical
key (`embed`, `final_norm`, `lm_head` and the per-layer keys) to the source's name for it, `{i}`
standing for the layer index; a missing tensor raises KeyError and a mismatched shape ValueError,
each naming the tensor. Every loader (`weights`) and the model cache's entry (`weights_entry`)
build through it, so all of them check the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rekv_core.model.shapes import ModelShape


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [d]
    wq: torch.Tensor  # [n_h*d_h, d]
    wk: torch.Tensor  # [n_kv*d_h, d]
    wv: torch.Tensor  # [n_kv*d_h, d]
    wo: torch.Tensor  # [d, n_h*d_h]
    mlp_norm: torch.Tensor  # [d]
    w_gate: torch.Tensor  # [ffn, d]
    w_up: torch.Tensor  # [ffn, d]
    w_down: torch.Tensor  # [d, ffn]
    bq: torch.Tensor | None = None  # Qwen2 only
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3 only: [d_h]
    k_norm: torch.Tensor | None = None
    wqkv: torch.Tensor | None = None  # [q + 2·kv, d]: wq, wk, wv stacked by `fuse`
    bqkv: torch.Tensor | None = None
    w_gate_up: torch.Tensor | None = None  # [2·ffn, d]: w_gate, w_up stacked by `fuse`

    def fuse(self) -> None:
        """Stack Q, K, V into one weight and gate, up into another, so each is one GEMM; the
        separate tensors become views of the stacked ones (no extra memory). Idempotent."""
        if self.wqkv is not None:
            return
        sizes = [self.wq.shape[0], self.wk.shape[0], self.wv.shape[0]]
        self.wqkv = torch.cat((self.wq, self.wk, self.wv))
        self.wq, self.wk, self.wv = self.wqkv.split(sizes)
        if self.bq is not None:
            self.bqkv = torch.cat((self.bq, self.bk, self.bv))
            self.bq, self.bk, self.bv = self.bqkv.split(sizes)
        self.w_gate_up = torch.cat((self.w_gate, self.w_up))
        self.w_gate, self.w_up = self.w_gate_up.chunk(2)


@dataclass
class ModelWeights:
    shape: ModelShape
    embed: torch.Tensor  # [vocab, d]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [d]
    lm_head: torch.Tensor  # [vocab, d]; the same tensor as `embed` when tied
    digest: str = ""  # SHA-256 of the tensors as loaded (`digest`), where a loader kept one

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def fuse_projections(self) -> None:
        """`LayerWeights.fuse` for every layer (a layer shared by several is fused once)."""
        for layer in {id(lw): lw for lw in self.layers}.values():
            layer.fuse()

    @property
    def device(self) -> torch.device:
        return self.embed.device


def expected_layer_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    d, q, kv, f = shape.hidden_size, shape.q_size, shape.kv_size, shape.ffn_size
    shapes = {
        "attn_norm": (d,), "wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q),
        "mlp_norm": (d,), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f),
    }
    if shape.qkv_bias:
        shapes |= {"bq": (q,), "bk": (kv,), "bv": (kv,)}
    if shape.qk_norm:
        shapes |= {"q_norm": (shape.head_dim,), "k_norm": (shape.head_dim,)}
    return shapes


TensorSource = Callable[[str], np.ndarray | torch.Tensor | None]


def assemble(shape: ModelShape, fetch: TensorSource, names: dict[str, str],
              dtype: torch.dtype, device: torch.device | str) -> ModelWeights:
    """Build weights from `fetch(source_name)`; `names` maps canonical keys to source names with
    `{i}` standing for the layer index."""

    def take(key: str, expected: tuple[int, ...], layer: int | None = None) -> torch.Tensor:
        source_name = names[key].format(i=layer)
        value = fetch(source_name)
        if value is None:
            raise KeyError(f"checkpoint has no tensor {source_name!r} (needed for {key})")
        tensor = torch.as_tensor(value)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"tensor {source_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {expected} for model {shape.name}")
        return tensor.to(device=device, dtype=dtype)

    d, vocab = shape.hidden_size, shape.vocab_size
    layer_shapes = expected_layer_shapes(shape)
    layers = [LayerWeights(**{key: take(key, expected, i)
                              for key, expected in layer_shapes.items()})
              for i in range(shape.num_layers)]
    embed = take("embed", (vocab, d))
    lm_head = embed if shape.tie_embeddings else take("lm_head", (vocab, d))
    return ModelWeights(shape=shape, embed=embed, layers=layers,
                        final_norm=take("final_norm", (d,)), lm_head=lm_head)
