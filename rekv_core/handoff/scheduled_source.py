"""A streamed prefill computed by the prefill worker's scheduler, batched with other prompts.

`ScheduledPrefillSource(scheduler, token_ids, cut, through, input_rows, deadline, name, on_done)`
is a `PrefillSource` like `source.LivePrefill` (streamed, layer order), with the same contract to
the sender: `layers()` yields layers [0, through) in order, each as soon as the scheduler has
computed all its rows; `boundary()` is h_c once layer c − 1 has been yielded; `head()` the last
row leaving layer through − 1 once `layers()` is exhausted; `on_done` is called once, when the
last layer is computed (before it is yielded) or the source is closed, whichever is first. The
prompt is submitted at construction, so it computes (sharing the scheduler's ticks with other
prompts) while the handoff is still being set up; closing the source early, or an error of the
sender, cancels it. `compute_s` is its share of the scheduler's compute
(`PrefillScheduler`'s docstring). The scheduler's errors (a deadline passed, a failed forward)
are raised from `layers()`. Token-only (through 0) submits nothing.

No token importance: a codec that ranks tokens (`importance_window`) takes `LivePrefill`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from rekv_core.engine.prefill_scheduler import LayerDone, PrefillScheduler
from rekv_core.handoff.source import ProducedLayer, ReachedStates


class ScheduledPrefillSource(ReachedStates):
    streamed, pipelined = True, False

    def __init__(self, scheduler: PrefillScheduler, token_ids: Sequence[int], cut: int,
                 through: int | None = None, input_rows: int = 0,
                 deadline: float | None = None, name: str = "",
                 on_done: Callable[[], None] | None = None):
        layers = scheduler.model.shape.num_layers
        if not 0 <= cut <= layers:
            raise ValueError(f"cut: must lie in [0, {layers}], got {cut}")
        self.token_ids, self.cut = token_ids, cut
        self.through = cut if through is None else through
        if not cut <= self.through <= layers:
            raise ValueError(f"through: must lie in [{cut}, {layers}], got {self.through}")
        self.input_rows = input_rows
        self.device = scheduler.model.device
        self._on_done = on_done
        self._h: torch.Tensor | None = None
        self._last: torch.Tensor | None = None
        self._job = (scheduler.submit(token_ids, self.through, deadline, name)
                     if self.through else None)

    @property
    def compute_s(self) -> float:
        return self._job.compute_s if self._job is not None else 0.0

    def close(self) -> None:
        """Cancel what is left of the prompt and call `on_done` if not yet called."""
        if self._job is not None and self._last is None:
            self._job.cancel()
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done()

    def layers(self) -> Iterator[ProducedLayer]:
        try:
            if self._job is None:
                return
            for event in self._job.events():
                if not isinstance(event, LayerDone):
                    break
                if event.index == self.cut - 1:
                    self._h = event.hidden_out
                if event.index == self.through - 1:
                    self._last = event.hidden_out
                    self.close()
                inputs = (event.hidden_in[:self.input_rows].clone() if self.input_rows
                          else None)
                yield ProducedLayer(event.index, event.keys, event.values, None, inputs)
        finally:
            self.close()
