"""Decoding past a Lynx handoff: draft on the anchor cache, verify once the residuals are in.

`continue_on_anchors(model, cache, token, residuals, k, turns)` runs after the first token
(`token`, sampled from the handoff's exact logits and already emitted) while the residuals
(`handoff.residuals.PendingResiduals`) still arrive. It drafts greedily, one decode step per turn
of the decode engine (`model.turns`: it interleaves them with its batched steps, within its ITL
budget), until k drafts are made or the residuals are in; then it waits for the residuals,
writes the full `int8` layers over the anchor rows, and in one more turn verifies the drafts in
one pass over [token, d_1 … d_j] (`model.speculation.verify`: a multi-token extend). It returns
the tokens to emit: the accepted drafts and the correction (or one more token when all held),
greedy decoding's on the full `int8` cache; the cache then holds [prompt, token, accepted drafts],
ready for the engine's next step with the last emitted token. Rejected drafts' rows are dropped.

Nothing drafted is returned unverified: when the residuals are lost (`ResidualsLost`) it raises
before any verification, the cache's anchor rows untouched by a full layer, and the caller falls
back (recompute or fail, as the worker is set) with nothing but the exact first token emitted.
k = 0 (the residuals due before a draft could finish, or a sampled rather than greedy stream)
only waits for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rekv_core.handoff.residuals import PendingResiduals
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import decode_step
from rekv_core.model.layer import Model
from rekv_core.model.speculation import verify
from rekv_core.model.turns import ComputeTurns


@dataclass(frozen=True)
class Continued:
    emitted: list[int]  # verified tokens after `token`, in order; empty when nothing was drafted
    drafted: int
    accepted: int


def continue_on_anchors(model: Model, cache: KVCache, token: int, residuals: PendingResiduals,
                        k: int, turns: ComputeTurns) -> Continued:
    """`cache`: the handoff's, at the prompt's length, its prefix at anchor precision. `k`: the
    most drafts to make (at most the rows the cache has room for beyond the verify pass)."""
    if k < 0:
        raise ValueError(f"k: must be >= 0, got {k}")
    start = cache.length
    k = min(k, cache.capacity - start - 1)
    layers = model.shape.num_layers
    drafts: list[int] = []
    try:
        last = token
        while len(drafts) < k and not residuals.ready():
            with turns.turn(context=cache.length) as turn:
                last = int(torch.argmax(decode_step(model, last, cache)))
                turn.spent = layers
            drafts.append(last)
    except BaseException:
        residuals.abandon("drafting failed")
        raise
    finally:
        cache.length = start  # the drafts' rows: overwritten by the verify pass, or never read
    residuals.wait()  # ResidualsLost: nothing drafted is ever returned
    residuals.apply(cache)
    if not drafts:
        return Continued([], 0, 0)
    with turns.turn(context=start) as turn:
        verified = verify(model, cache, token, drafts)
        turn.spent = layers * (len(drafts) + 1)
    return Continued(verified.emitted, len(drafts), verified.accepted)
