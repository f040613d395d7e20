"""One tick's picks run as batched layer calls: shared by the prefill scheduler and the decode
worker's layer batcher.

`run_picks(model, picks, owners, forward, invariant)` runs `forward` (`layer_forward_batch`) once
per layer the picks are at, over the segments their owners give (`Owner.segment(pick)`), and
hands each owner its rows out (`Owner.computed(pick, h)`) and its share of the call's time by rows
(`Owner.compute_s`). A call that raises ends every owner of it with the error (`Owner.fail`); the
other layers' calls still run. `observer(owners, rows, seconds)`, when set, sees each call that
succeeded; `settle`, when set, runs inside each call's timing (a device synchronisation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from rekv_core.engine.prefill_tick import Pick
from rekv_core.model.layer import Model
from rekv_core.model.layer_batch import Segment

log = logging.getLogger("rekv.engine.ticks")

Forward = Callable[[Model, int, Sequence[Segment], bool], list]


class Owner(Protocol):
    compute_s: float

    def segment(self, pick: Pick) -> Segment: ...
    def computed(self, pick: Pick, rows_out: torch.Tensor) -> None: ...
    def fail(self, error: BaseException) -> None: ...


def run_picks(model: Model, picks: Sequence[Pick], owners: Mapping[int, Owner],
              forward: Forward, invariant: bool,
              observer: Callable[[int, int, float], None] | None = None,
              settle: Callable[[], None] | None = None) -> None:
    """`owners`: each pick's owner by `id(pick.progress)`."""
    for layer in sorted({pick.layer for pick in picks}):
        group = [pick for pick in picks if pick.layer == layer]
        mine = [owners[id(pick.progress)] for pick in group]
        began = time.perf_counter()
        try:
            outs = forward(model, layer, [o.segment(p) for o, p in zip(mine, group)], invariant)
            if settle is not None:
                settle()
        except Exception as exc:  # every owner of the call ends with it
            log.exception("layer %d failed for %d prompt(s)", layer, len(mine))
            for owner in mine:
                owner.fail(exc)
            continue
        spent = time.perf_counter() - began
        rows = sum(pick.r1 - pick.r0 for pick in group)
        if observer is not None:
            observer(len(group), rows, spent)
        for owner, pick, out in zip(mine, group, outs):
            owner.compute_s += spent * (pick.r1 - pick.r0) / rows
            owner.computed(pick, out.h)
