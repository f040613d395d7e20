"""Per-token importance for SpectrumKV's precision tiers, from the q and k a prefill layer has.

`observation_window_importance(q, k)` gives one score per prompt token `[S]` in [0, 1]:
1. attention from the last `window` (32) prompt queries to every key: q·kᵀ/√d_h, causal within
   the window (the query at position p sees keys 0..p), softmax per query row in float32;
2. summed over those queries and averaged over all query heads (query head h reads KV head
   h // (n_h / n_kv), the GQA grouping of the attention itself);
3. pooled: the mean of the score and its 1-D max pool (kernel 7, stride 1), so the ±3 neighbours of
   a strongly attended token rise to at least half its score (the tokens around a key fact keep
   their precision with it) while the token itself keeps first place (a plain max pool would tie
   it with its neighbours, and ties go to the lower index);
4. the first `sinks` (4) tokens forced to the top (set to the maximum), then min–max normalized.

Why the observation window (SnapKV) rather than the paper's "attention received, summed over all
queries": the full sum needs every row of the S×S attention probabilities, which the blocked
attention kernel (`blocks.attend_causal`, SDPA) never materializes; recovering it is an extra pass
over all S queries, about another attention's worth of work (S²·d_h per head) and, unfused, S²
floats per head of memory. The window costs window·S·d_h per head, ~window/S of an attention
(1.6% at S = 2048), and its memory is g·window·S floats (g query heads per KV head, one KV head at a
time). The last queries are also the ones whose attention pattern predicts what decoding will read.
The window's own tokens are scored only by the window queries at or after them (causal).

`importance_cost(...)` times the score against one layer's causal attention on random tensors,
so the window's share can be measured on the machine that serves.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from rekv_core.model.blocks import attend_causal

WINDOW = 32
POOL_KERNEL = 7
SINKS = 4


def _check(q: torch.Tensor, k: torch.Tensor, window: int, pool_kernel: int) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q, k: expected [n_h, S, d_h] and [n_kv, S, d_h], got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if k.shape[1:] != q.shape[1:] or q.shape[0] % k.shape[0]:
        raise ValueError(f"k: shape {tuple(k.shape)} does not fit q {tuple(q.shape)} "
                         f"(same S and d_h, n_h a multiple of n_kv)")
    if window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    if pool_kernel < 1 or pool_kernel % 2 == 0:
        raise ValueError(f"pool_kernel: must be odd and >= 1 (1: no pooling), got {pool_kernel}")


def window_attention_received(q: torch.Tensor, k: torch.Tensor, window: int = WINDOW
                              ) -> torch.Tensor:
    """Steps 1–2: attention each key receives from the last `window` queries, `[S]` float32."""
    n_h, seq_len, d_h = q.shape
    n_kv = k.shape[0]
    group = n_h // n_kv
    w = min(window, seq_len)
    positions = torch.arange(seq_len, device=q.device)
    hidden = positions[None, :] > positions[seq_len - w:, None]  # [w, S]: keys after the query
    received = torch.zeros(seq_len, dtype=torch.float32, device=q.device)
    for head in range(n_kv):
        queries = q[head * group:(head + 1) * group, seq_len - w:].to(torch.float32)
        logits = (queries * (1.0 / math.sqrt(d_h))) @ k[head].to(torch.float32).T  # [g, w, S]
        received += logits.masked_fill_(hidden, float("-inf")).softmax(-1).sum(dim=(0, 1))
    return received / n_h


def observation_window_importance(q: torch.Tensor, k: torch.Tensor, window: int = WINDOW,
                                  pool_kernel: int = POOL_KERNEL, sinks: int = SINKS
                                  ) -> torch.Tensor:
    """q `[n_h, S, d_h]` (after RoPE), k `[n_kv, S, d_h]` (after RoPE) -> importance `[S]`
    float32 in [0, 1], on q's device (steps in the module docstring)."""
    _check(q, k, window, pool_kernel)
    score = window_attention_received(q, k, window)
    if pool_kernel > 1:
        pooled = F.max_pool1d(score[None, None], pool_kernel, stride=1,
                              padding=pool_kernel // 2)[0, 0]
        score = (score + pooled) / 2
    n_sinks = min(sinks, score.numel())
    score[:n_sinks] = score.max()
    low, span = score.min(), score.max() - score.min()
    if float(span) == 0.0:
        score.zero_()
        score[:n_sinks] = 1.0
        return score
    return ((score - low) / span).clamp_(0.0, 1.0)


def _best_time(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def importance_cost(seq_len: int = 2048, n_heads: int = 28, n_kv: int = 4, head_dim: int = 128,
                    window: int = WINDOW, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", repeats: int = 3) -> dict:
    """Best-of-`repeats` seconds of `observation_window_importance` and of one layer's causal
    attention (`attend_causal`) on random q, k, v of a Qwen2.5-7B-like layer, and their ratio."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, seq_len, head_dim, generator=g).to(device=device, dtype=dtype)
               for n in (n_heads, n_kv, n_kv))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run_importance():
        observation_window_importance(q, k, window)
        sync()

    def run_attention():
        attend_causal(q, k, v)
        sync()

    run_importance(), run_attention()  # warm-up
    importance_s = _best_time(run_importance, repeats)
    attention_s = _best_time(run_attention, repeats)
    return {"seq_len": seq_len, "window": window, "dtype": str(dtype), "device": device,
            "importance_s": importance_s, "attention_s": attention_s,
            "ratio": importance_s / attention_s}
