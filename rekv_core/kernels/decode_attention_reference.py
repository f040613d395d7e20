"""Decode attention for a batch of sequences whose caches live in one slab: the PyTorch reference.

Contract (the Triton kernel, `decode_attention_triton.py`, is held to it): one query per sequence,
q `[B, n_h, d_h]`; the slab's keys and values `[slots, n_kv, capacity, d_h]`; `slots[b]` the slab
slot holding sequence b's cache and `lengths[b]` (>= 1) the keys it attends to, positions
[0, lengths[b]). Grouped-query attention: query head h reads KV head h // (n_h / n_kv). Scores are
scaled by 1/sqrt(d_h); softmax and the weighted sum are taken in float32 and the result is cast to
q's dtype, `[B, n_h * d_h]`. Nothing past a sequence's length is read into its result, so whatever
the slab holds there (a departed sequence's keys, the padding rows' writes) cannot leak into it.
"""

from __future__ import annotations

import math

import torch


def check_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           slots: torch.Tensor, lengths: torch.Tensor) -> None:
    if q.dim() != 3 or keys.dim() != 4:
        raise ValueError(f"q/keys: need [B, n_h, d_h] and [slots, n_kv, capacity, d_h], got "
                         f"{tuple(q.shape)} and {tuple(keys.shape)}")
    if values.shape != keys.shape:
        raise ValueError(f"values: {tuple(values.shape)} differs from keys' {tuple(keys.shape)}")
    batch, n_h, d_h = q.shape
    if keys.shape[3] != d_h or n_h % keys.shape[1]:
        raise ValueError(f"keys: {tuple(keys.shape)} does not fit q {tuple(q.shape)} (d_h, and "
                         f"n_h a multiple of n_kv)")
    if slots.shape != (batch,) or lengths.shape != (batch,):
        raise ValueError(f"slots/lengths: need [{batch}], got {tuple(slots.shape)} and "
                         f"{tuple(lengths.shape)}")


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    check_decode_attention(q, keys, values, slots, lengths)
    batch, n_h, d_h = q.shape
    n_kv, capacity = keys.shape[1], keys.shape[2]
    group = n_h // n_kv
    k = keys[slots].float()  # [B, n_kv, C, d_h]
    v = values[slots].float()
    q32 = q.float().reshape(batch, n_kv, group, d_h)
    scores = torch.einsum("bkgd,bkcd->bkgc", q32, k) / math.sqrt(d_h)
    filled = torch.arange(capacity, device=q.device)[None, :] < lengths[:, None]  # [B, C]
    scores = scores.masked_fill(~filled[:, None, None, :], float("-inf"))
    v = v.masked_fill(~filled[:, None, :, None], 0.0)  # 0 · NaN would still be NaN
    out = torch.einsum("bkgc,bkcd->bkgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(batch, n_h * d_h).to(q.dtype)
