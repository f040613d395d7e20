"""One decoder layer and what surrounds it: the `Model`, its norms, RoPE and final logits.

`layer_forward(model, index, h, cos, sin, ...)` is the one transformer layer body every path of
the executor runs (prefill, suffix recompute, chunked prefill, appending to a cache) and the
static decode step (`static_decode`) runs too, so their K, V and logits come from the same kernels
on the same shapes. `Model` holds the weights and the RoPE table; `final_logits` turns the last
residual states into float32 logits. Shapes: h `[S, d]`; q `[n_h, S, d_h]`; K, V
`[n_kv, S, d_h]`; cos, sin `[S, d_h]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rekv_core.model.blocks import attend, attend_causal, linear
from rekv_core.model.shapes import ModelShape
from rekv_core.model.weights_layout import LayerWeights, ModelWeights


def rope_inv_freq(shape: ModelShape) -> torch.Tensor:
    """Inverse RoPE frequencies `[d_h/2]` in float32, with Llama-3 scaling when configured."""
    dim = shape.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (shape.rope_theta ** exponents)
    scaling = shape.rope_scaling
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_positions / scaling.low_freq_factor
    high_wavelen = scaling.original_max_positions / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_positions / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Model:
    """Weights plus the derived tables the executor needs (RoPE frequencies). Each layer's Q, K, V
    and its gate, up projections are fused into one GEMM each (`LayerWeights.fuse`)."""

    def __init__(self, weights: ModelWeights):
        weights.fuse_projections()
        self.weights = weights
        self.shape = weights.shape
        self.inv_freq = rope_inv_freq(self.shape).to(weights.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[S, d_h]` in the working dtype for integer `positions` `[S]`."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [H, S, d_h]; cos, sin: [S, d_h]
    return x * cos + _rotate_half(x) * sin


Linear = Callable[..., torch.Tensor]  # (x, weight, bias=None) -> x @ weight.T + bias


def project_qkv(model: Model, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, linear: Linear = linear
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = model.shape
    s = x.shape[0]
    q, k, v = linear(x, lw.wqkv, lw.bqkv).split([shape.q_size, shape.kv_size, shape.kv_size],
                                                   dim=-1)
    q = q.view(s, shape.num_heads, shape.head_dim)
    k = k.view(s, shape.num_kv_heads, shape.head_dim)
    v = v.view(s, shape.num_kv_heads, shape.head_dim)
    if shape.qk_norm:
        q = rms_norm(q, lw.q_norm, shape.rms_eps)
        k = rms_norm(k, lw.k_norm, shape.rms_eps)
    q = apply_rope(q.transpose(0, 1), cos, sin)  # [n_h, S, d_h]
    k = apply_rope(k.transpose(0, 1), cos, sin).contiguous()  # [n_kv, S, d_h]
    v = v.transpose(0, 1).contiguous()  # [n_kv, S, d_h]
    return q, k, v


def mlp(lw: LayerWeights, x: torch.Tensor, linear: Linear = linear) -> torch.Tensor:
    gate, up = linear(x, lw.w_gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, lw.w_down)


KVStore = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


QKObserver = Callable[[torch.Tensor, torch.Tensor], None]


def layer_forward(model: Model, index: int, h: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, store: KVStore | None = None,
                  mask: torch.Tensor | None = None, causal_from: int | None = None,
                  observe: QKObserver | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one transformer layer body: attention, then MLP, each around a residual.

    Without a `store` the n positions of h `[n, d]` attend to each other causally (prefill, suffix
    recompute). With one, `store(index, K, V)` keeps the new K and V in a cache and returns the
    keys and values to attend to: causally (`attend_causal`) when `causal_from` gives the first
    position of h, else through `mask` `[n, keys]` (True: attend), or to all of them when it is
    None. `observe(q, k)`, if given, sees the layer's queries and keys after RoPE. Returns h_out,
    K, V `[n_kv, n, d_h]`."""
    lw = model.weights.layers[index]
    eps = model.shape.rms_eps
    q, k, v = project_qkv(model, lw, rms_norm(h, lw.attn_norm, eps), cos, sin)
    if observe is not None:
        observe(q, k)
    if store is None:
        out = attend_causal(q, k, v)
    else:
        k_all, v_all = store(index, k, v)
        out = (attend_causal(q, k_all, v_all, causal_from) if causal_from is not None
               else attend(q, k_all, v_all, mask=mask))
    h = h + linear(out, lw.wo)
    h = h + mlp(lw, rms_norm(h, lw.mlp_norm, eps))
    return h, k, v


def final_logits(model: Model, h_last: torch.Tensor, linear: Linear = F.linear
                 ) -> torch.Tensor:
    """Logits (float32) from final residual states: `[d]` -> `[vocab]`, `[n, d]` -> `[n, vocab]`."""
    w = model.weights
    return linear(rms_norm(h_last, w.final_norm, model.shape.rms_eps), w.lm_head).float()
