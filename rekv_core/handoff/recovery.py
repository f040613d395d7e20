"""What a failed handoff leaves that can be trusted, and recomputing only what it lost.

A handoff can fail after its boundary arrived whole and the suffix c..L−1 ran from it, with only
prefix layers lost: a layer whose bytes did not verify, layers still missing at the deadline, or a
prefill that died after sending some of them. The suffix reads only its own layers' K and V, so
it is right whatever became of the prefix. With `Receiving(keep_verified=True)` the receiver then
raises `PartialHandoff` (the failure itself in `cause`, and chained) instead of the failure, with
a `Salvage`: the cache holding every prefix layer whose messages all verified (each decoded by
the plan's codec), layers c..L−1 from the boundary, and the first token's logits (for
transfer-only, from the verified head). No unverified byte is kept: a lost layer's rows, partly
written or not, are all overwritten by the recompute.

`recovery(salvage, ids, num_layers)` decides what to recompute (`Recovery`):
- `partial`: layers 0..m, m the highest prefix layer the salvage lacks, from the token ids (the
  prompt's hidden states through layer m come from running those layers over it);
- `full`: the whole prompt, when there is no salvage (the plan, the boundary or any of its chunks,
  the head or the suffix did not complete, or the handoff was token-only) or its plan was for
  another number of tokens than the prompt's ids.
`recompute_lost(model, ids, salvage)` runs the partial over the salvaged cache: layers 0..m go
through the same kernels as `prefill`'s (`iter_layers` from `embed`), so they are bit-identical
to a full recompute's, and the cache equals a full recompute's layers 0..m plus the verified
layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rekv_core.handoff.action import WireBytes
from rekv_core.handoff.plan import HandoffPlan
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import Model
from rekv_core.model.turns import UNLIMITED, ComputeTurns, prefill_in_turns

PARTIAL, FULL = "partial", "full"


@dataclass(frozen=True)
class Salvage:
    """A failed handoff's verified part: `cache` (length: the prompt) holds the prefix layers in
    `verified` and layers c..L−1; `logits` are the first token's; `bytes`: those restored."""

    plan: HandoffPlan
    cache: KVCache
    logits: torch.Tensor
    verified: frozenset[int]
    bytes: WireBytes = WireBytes()

    @property
    def lost(self) -> list[int]:
        """The prefix layers it lacks, in order."""
        return [i for i in range(self.plan.action.cut) if i not in self.verified]


class PartialHandoff(Exception):
    """The handoff failed (`cause`), but only prefix layers were lost: `salvage` keeps the rest."""

    def __init__(self, salvage: Salvage, cause: BaseException):
        super().__init__(f"prefix layers {_ranges(salvage.lost)} lost: {cause}")
        self.salvage, self.cause = salvage, cause


@dataclass(frozen=True)
class Recovery:
    scope: str  # PARTIAL or FULL
    layers: int  # the layers to recompute: m + 1, or L for FULL


def recovery(salvage: Salvage | None, ids: Sequence[int], num_layers: int) -> Recovery:
    if salvage is None or not salvage.lost or salvage.plan.seq_len != len(ids):
        return Recovery(FULL, num_layers)
    return Recovery(PARTIAL, salvage.lost[-1] + 1)


@torch.inference_mode()
def recompute_lost(model: Model, ids: Sequence[int], salvage: Salvage,
                   turns: ComputeTurns = UNLIMITED) -> KVCache:
    """The salvaged cache with layers 0..m recomputed from `ids` (m: the highest lost layer), in
    `turns` (`rekv_core.model.turns`)."""
    if salvage.plan.seq_len != len(ids):
        raise ValueError(f"ids: {len(ids)} tokens, the salvaged plan has {salvage.plan.seq_len}")
    stop = recovery(salvage, ids, model.shape.num_layers).layers
    prefill_in_turns(model, ids, salvage.cache, turns, stop)
    return salvage.cache


def _ranges(layers: list[int]) -> str:
    if not layers:
        return "none"
    return f"{layers[0]}..{layers[-1]}" if len(layers) > 1 and layers[-1] - layers[0] == len(
        layers) - 1 else ", ".join(map(str, layers))
