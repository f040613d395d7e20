"""How much a lossy codec changes one layer: relative errors of K, V, attention scores and
attention outputs after an encode/decode round trip, all computed in float64.

`relative_mse(x, y)` = Σ(x − y)² / Σx². `kv_error(codec, k, v, queries)` round-trips K and V
`[n_kv, S, d_h]` through `codec` and, given queries `[n_q, S_q, d_h]` (n_q a multiple of n_kv:
grouped-query heads share a KV head, as in the executor), also compares the scores q·kᵀ and the
outputs softmax(q·kᵀ/√d_h)·V over all keys (no mask) with the exact ones.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from rekv_core.codecs.base import Codec, EncodeContext


def relative_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.to(torch.float64), y.to(torch.float64)
    return float(((x - y) ** 2).sum() / (x ** 2).sum().clamp_min(1e-300))


@dataclass(frozen=True)
class KVError:
    k: float  # relative MSE of K
    v: float
    scores: float | None = None  # relative MSE of q·kᵀ
    output: float | None = None  # relative MSE of the attention output

    def as_dict(self) -> dict:
        return asdict(self)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[0] // k.shape[0]
    k = k.to(torch.float64).repeat_interleave(group, dim=0)
    v = v.to(torch.float64).repeat_interleave(group, dim=0)
    scores = q.to(torch.float64) @ k.transpose(1, 2)
    return scores, torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1) @ v


def kv_error(codec: Codec, k: torch.Tensor, v: torch.Tensor,
             queries: torch.Tensor | None = None, context: EncodeContext | None = None
             ) -> KVError:
    """`context`: what the codec needs besides K and V (default: `EncodeContext.for_timing`)."""
    context = EncodeContext.for_timing(codec, k) if context is None else context
    k2, v2 = codec.decode(codec.encode(k, v, context=context))
    if queries is None:
        return KVError(k=relative_mse(k, k2), v=relative_mse(v, v2))
    if queries.dim() != 3 or queries.shape[-1] != k.shape[-1] or queries.shape[0] % k.shape[0]:
        raise ValueError(f"queries: expected [n_q, S_q, {k.shape[-1]}] with n_q a multiple of "
                         f"{k.shape[0]}, got {tuple(queries.shape)}")
    scores, out = _attention(queries, k, v)
    scores2, out2 = _attention(queries, k2, v2)
    return KVError(k=relative_mse(k, k2), v=relative_mse(v, v2),
                   scores=relative_mse(scores, scores2), output=relative_mse(out, out2))
