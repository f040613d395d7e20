"""Draft on an approximate cache, verify on the exact one: what Lynx's anchor stream buys.

`draft(model, cache, token, k)` decodes k greedy tokens after `token` (the last token emitted, not
yet in the cache) on an approximate cache (Lynx's anchor-precision one, `codecs.lynx.anchor_kv`),
appending to it; the caller throws that cache away. `verify(model, cache, token, drafts)` checks
them on the exact cache, filled to the same length, in one pass (`executor.extend` over
[token, d_1, …, d_k]): with y_i the greedy token after the i-th of them, it accepts the longest
prefix with d_{i+1} = y_i, j drafts, and emits d_1 … d_j and then y_j (the correction, or one more
token when every draft held). The cache keeps the K and V of [token, d_1 … d_j]; the rows of
rejected drafts are dropped (its length rolls back, and the next tokens overwrite them). The
emitted tokens are greedy decoding's on the exact cache, to the rounding of one pass over k + 1
rows against k + 1 single steps; nothing a verification rejects is ever emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rekv_core.model.cache import KVCache
from rekv_core.model.executor import decode_step, extend
from rekv_core.model.layer import Model


@dataclass(frozen=True)
class Verified:
    emitted: list[int]  # d_1 … d_j, then y_j: the next token to feed is the last one
    accepted: int  # j


def draft(model: Model, cache: KVCache, token: int, k: int) -> list[int]:
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    drafts = []
    for _ in range(k):
        token = int(torch.argmax(decode_step(model, token, cache)))
        drafts.append(token)
    return drafts


def verify(model: Model, cache: KVCache, token: int, drafts: list[int]) -> Verified:
    if not drafts:
        raise ValueError("drafts: need at least one")
    start = cache.length
    greedy = torch.argmax(extend(model, [token, *drafts], cache), dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    cache.length = start + 1 + accepted  # [token, d_1 … d_j]; the rejected drafts' rows go
    return Verified(drafts[:accepted] + [greedy[accepted]], accepted)
