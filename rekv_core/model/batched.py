"""One decode step for a batch of sequences, each with its own cache (continuous batching).

`batched_decode_step(model, tokens, caches)` appends `tokens[i]` to `caches[i]` at that cache's own
length and returns the logits of every sequence, `[B, vocab]` float32. The projections, the MLP
and the final norm and head run once for the whole batch (one GEMM per weight: the weights are
read once per step, which is what a decode step is bound by); RoPE uses each row's own position;
attention runs per sequence over exactly its own cache (no padding), with the same call the
single-sequence step makes (`blocks.attend`, one query). Each sequence's logits therefore agree
with `executor.decode_step`'s to the rounding of a GEMM over B rows instead of one.

Why per-sequence attention and not a padded batch: at decode, attention reads each cache once
whichever way it is laid out, and a padded batch would copy every joined cache into a shared
`[B, n_kv, max_len, d_h]` block (or pre-allocate max_batch × max_context per layer) to save B − 1
kernel calls per layer; on the CPU those calls cost a few percent of a step (design doc, the
engine's section). On a GPU, where a step is bound by launches, `bucketed.BucketedDecoder` keeps
the batch's caches in one slab and replays a CUDA graph per batch bucket. On the CPU the engine passes `packed.PackedLinears.linear`,
whose prepacked weights make a GEMM over a few rows 1.7–2.4× faster.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from rekv_core.model.blocks import attend, linear
from rekv_core.model.cache import KVCache
from rekv_core.model.layer import Linear, Model, final_logits, mlp, project_qkv, rms_norm


def check_batch(model: Model, tokens: Sequence[int], caches: Sequence[KVCache]) -> None:
    if len(tokens) != len(caches) or not tokens:
        raise ValueError(f"tokens/caches: need the same nonzero number, got {len(tokens)} and "
                         f"{len(caches)}")
    vocab = model.shape.vocab_size
    for i, (token, cache) in enumerate(zip(tokens, caches)):
        if not 0 <= int(token) < vocab:
            raise ValueError(f"tokens[{i}]: {token} is outside the vocabulary [0, {vocab})")
        if cache.length >= cache.capacity:
            raise ValueError(f"caches[{i}]: a token at position {cache.length} exceeds its "
                             f"capacity of {cache.capacity}")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("caches: a cache appears twice in the batch")


@torch.inference_mode()
def batched_decode_step(model: Model, tokens: Sequence[int], caches: Sequence[KVCache],
                        linear: Linear = linear) -> torch.Tensor:
    """Append one token to each cache; the logits after each, `[B, vocab]` float32. `linear`:
    how a weight is applied (`packed.PackedLinears.linear` on the CPU)."""
    check_batch(model, tokens, caches)
    device, shape = model.device, model.shape
    positions = [cache.length for cache in caches]
    ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=device)
    h = F.embedding(ids, model.weights.embed)  # [B, d]
    cos, sin = model.rope(torch.tensor(positions, device=device))
    eps = shape.rms_eps
    for index, lw in enumerate(model.weights.layers):
        q, k, v = project_qkv(model, lw, rms_norm(h, lw.attn_norm, eps), cos, sin, linear)
        outs = []
        for row, (cache, pos) in enumerate(zip(caches, positions)):
            cache.write(index, pos, k[:, row:row + 1], v[:, row:row + 1])
            k_all, v_all = cache.layer(index, pos + 1)
            outs.append(attend(q[:, row:row + 1], k_all, v_all))
        h = h + linear(torch.cat(outs), lw.wo)
        h = h + mlp(lw, rms_norm(h, lw.mlp_norm, eps), linear)
    for cache, pos in zip(caches, positions):
        cache.length = pos + 1
    return final_logits(model, h, linear)
