"""The decode side's memory of its recent handoffs: what the planner's expectations rest on.

`RecentHandoffs.observe(...)` files each handoff by action and by action kind. Only handoffs
younger than `max_age_s`, over a link within a factor `link_tolerance` of the current estimate,
speak for a new request:

- `corrections(link_gbps)`: by action kind, the median of measured over modelled time of its last
  `window` such handoffs;
- `measured(prompt_len, link_gbps, pipelined)`: by action, within the request's power of two of
  prompt length, the median time (and median prompt length, and count) of its last `window` such
  handoffs sent in that order (token order when `pipelined`: the same action takes another time
  pipelined, and the two must not blur into one median).

An action whose measurements age out, or whose link moved on, is predicted by the model again, so
a change of link that makes it attractive gets it tried.

The first handoff of each action within a length bucket is the cold one (its code paths, buffers,
connection and caches warming up; 5x its warm time has been seen) and is left out of both: one
outlier must not become an action's measurement, nor its kind's correction.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rekv_core.handoff import Action, ActionKind
from rekv_core.plan.evidence import Measured


@dataclass(frozen=True)
class _Handoff:
    prompt_len: int
    measured_ms: float
    over_model: float  # measured / modelled (0: no model)
    link_gbps: float
    at: float  # clock seconds


def length_bucket(prompt_len: int) -> int:
    """Prompts in one power of two share their measurements."""
    return prompt_len.bit_length()


class RecentHandoffs:
    def __init__(self, window: int = 16, max_age_s: float = 600.0, link_tolerance: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        def recent() -> collections.deque:
            return collections.deque(maxlen=window)

        self.max_age_s = max_age_s
        self.link_tolerance = link_tolerance
        self._clock = clock
        self._by_kind: dict[ActionKind, collections.deque] = collections.defaultdict(recent)
        self._by_action: dict[int, dict[tuple[Action, bool], collections.deque]] = (
            collections.defaultdict(lambda: collections.defaultdict(recent)))
        # (bucket, action, pipelined) past its first handoff
        self._warm: set[tuple[int, Action, bool]] = set()
        self._lock = threading.Lock()

    def observe(self, action: Action, prompt_len: int, modelled_ms: float, measured_ms: float,
                link_gbps: float, pipelined: bool = False) -> None:
        """File one handoff, unless it is its action's first in its length bucket and order
        (cold)."""
        if measured_ms <= 0 or link_gbps <= 0:
            return
        handoff = _Handoff(prompt_len, measured_ms,
                           measured_ms / modelled_ms if modelled_ms > 0 else 0.0, link_gbps,
                           self._clock())
        bucket = length_bucket(prompt_len)
        with self._lock:
            if (bucket, action, pipelined) not in self._warm:
                self._warm.add((bucket, action, pipelined))  # the cold one: left out
                return
            if handoff.over_model > 0:
                self._by_kind[action.kind].append(handoff)
            self._by_action[bucket][action, pipelined].append(handoff)

    def _alike(self, handoffs: Iterable[_Handoff], link_gbps: float) -> list[_Handoff]:
        oldest = self._clock() - self.max_age_s
        return [h for h in handoffs if h.at >= oldest and max(
            h.link_gbps / link_gbps, link_gbps / h.link_gbps) <= self.link_tolerance]

    def corrections(self, link_gbps: float) -> dict[ActionKind, float]:
        """Median measured/modelled time by action kind."""
        with self._lock:
            series = {kind: self._alike(h, link_gbps) for kind, h in self._by_kind.items()}
        return {kind: statistics.median(h.over_model for h in alike)
                for kind, alike in series.items() if alike}

    def measured(self, prompt_len: int, link_gbps: float, pipelined: bool = False
                 ) -> dict[Action, Measured]:
        """Each action's recent handoffs in this order that speak for a prompt of `prompt_len`
        tokens over a link of `link_gbps`."""
        with self._lock:
            series = {action: self._alike(h, link_gbps) for (action, order), h in
                      self._by_action.get(length_bucket(prompt_len), {}).items()
                      if order == pipelined}
        return {action: Measured(statistics.median(h.measured_ms for h in alike),
                                 statistics.median_low(h.prompt_len for h in alike), len(alike))
                for action, alike in series.items() if alike}
