"""The decode worker's load: who computes there now, and the compute committed to it.

`DecodeLoad(transfers)` keeps the book a decode worker offers from, beside its live transfers
(`TransferBook`):

- `generating()` and `recomputing(prompt_len, layers)`: context managers around a request's decode
  loop and around a local recompute of a prompt's first `layers` layers (all by default: a failed
  handoff's fallback, partial or full);
- `work(transfer)`: a `DecodeWork` for one handoff, the receiver's `ComputeObserver`: it learns
  from the plan how many layers of how many tokens this side computes, and times the compute (a
  suffix run chunk by chunk waits for each chunk in between: only the time it computed counts);
- `computing()`: the requests whose compute runs here now: generating, recomputing, or a handoff's
  suffix or token-only prefill (a handoff still waiting for its data computes nothing);
  `sharers()`: how many would share the compute with one more request's suffix (it, and the
  requests generating here; a handoff's compute counts in the backlog instead);
- `backlog(gamma, num_layers)`: the compute committed here, ms, by handoffs whose plan has arrived
  and by local recomputes (each one's layers at `gamma(prompt_len, sharers)` ms per layer, less what
  it has run, its compute time spread over the others computing now), and the transfer ids of the
  handoffs whose plan this worker has seen: those, and the ones that ended in the last
  `NAMES_ENDED_FOR_S`, the latest kept when they are more than an offer carries
  (`MAX_PLANNED_TRANSFERS`; a local recompute has no id: no prefill worker counts it).

`ReceiveOverlaps` marks each receive that another receive overlapped, or that began while this
worker computed: its arrivals then time both, or the machine, not the wire, so it gives no link
sample. Event-loop thread only; the rest is thread-safe.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rekv_core.handoff.transfer import Transfer, TransferBook, TransferState
from rekv_core.plan.evidence import MAX_PLANNED_TRANSFERS
# an offer names the handoffs that ended here this recently too: the prefill side, which counts
# its own decisions' decode work until an offer names them, then knows they are done
NAMES_ENDED_FOR_S = 5.0


class DecodeWork:
    """One handoff's compute on this side (`handoff.ComputeObserver`)."""

    def __init__(self, transfer: Transfer):
        self.transfer = transfer
        self.layers = 0  # layers this side computes, once the plan says
        self.prompt_len = 0  # and for how many tokens
        self._computed_s = 0.0
        self._since: float | None = None
        self._lock = threading.Lock()

    def planned(self, layers: int, prompt_len: int) -> None:
        with self._lock:
            self.layers, self.prompt_len = layers, prompt_len

    def computing(self, running: bool) -> None:
        now = time.monotonic()
        with self._lock:
            if running and self._since is None:
                self._since = now
            elif not running and self._since is not None:
                self._computed_s += now - self._since
                self._since = None

    def computed_s(self, now: float | None = None) -> float:
        """Seconds this side has computed the handoff by `now` (monotonic; default: now)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            running = now - self._since if self._since is not None else 0.0
            return self._computed_s + running


@dataclass(frozen=True)
class Backlog:
    ms: float  # compute committed here, not yet done
    planned: tuple[str, ...]  # the transfers whose plan arrived here (and those just ended)


class DecodeLoad:
    def __init__(self, transfers: TransferBook):
        self.transfers = transfers
        self._generating = 0
        # start (monotonic), prompt length, layers (None: all)
        self._recomputes: dict[int, tuple[float, int, int | None]] = {}
        self._works: dict[int, DecodeWork] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        with self._lock:
            self._generating += 1
        try:
            yield
        finally:
            with self._lock:
                self._generating -= 1

    @contextlib.contextmanager
    def recomputing(self, prompt_len: int, layers: int | None = None) -> Iterator[None]:
        key = next(self._ids)
        with self._lock:
            self._recomputes[key] = (time.monotonic(), prompt_len, layers)
        try:
            yield
        finally:
            with self._lock:
                del self._recomputes[key]

    def work(self, transfer: Transfer) -> DecodeWork:
        work = DecodeWork(transfer)
        with self._lock:
            self._works[id(work)] = work
        return work

    def computing(self) -> int:
        with self._lock:
            mine = self._generating + len(self._recomputes)
        return mine + self.handoffs_computing()

    def handoffs_computing(self) -> int:
        """Handoffs whose suffix or token-only recompute runs now (one waiting for data does
        not)."""
        return sum(self.transfers.count(state)
                   for state in (TransferState.PREFIX, TransferState.JOINING))

    def sharers(self) -> int:
        with self._lock:
            return 1 + self._generating

    def backlog(self, gamma: Callable[[int, int], float], num_layers: int) -> Backlog:
        """`gamma(prompt_len, sharers)`: one layer's compute now, ms."""
        now, sharers = time.monotonic(), self.sharers()
        with self._lock:
            recomputes = list(self._recomputes.values())
            for key in [k for k, w in self._works.items() if w.transfer.ended]:
                del self._works[key]
            works = [w for w in self._works.values() if w.layers]
        sharing = max(1, self.handoffs_computing() + len(recomputes))
        total, planned = 0.0, []
        for began, prompt_len, layers in recomputes:
            ms = gamma(prompt_len, sharers) * (num_layers if layers is None else layers)
            total += max(0.0, ms - (now - began) * 1e3 / sharing)
        for work in works:
            ms = work.layers * gamma(work.prompt_len, sharers)
            total += max(0.0, ms - work.computed_s(now) * 1e3 / sharing)
            planned.append(work.transfer.transfer_id)
        ended = self.transfers.left_since(now - NAMES_ENDED_FOR_S)
        room = max(0, MAX_PLANNED_TRANSFERS - len(planned))
        return Backlog(total, tuple(planned[:MAX_PLANNED_TRANSFERS])
                       + tuple(ended[-room:] if room else ()))


@dataclass(eq=False)
class Receive:
    shared: bool  # another handoff was receiving, or this worker computing, during it


class ReceiveOverlaps:
    """The receives in flight, each marked once another overlaps it."""

    def __init__(self):
        self._open: set[Receive] = set()

    def begin(self, computing: bool) -> Receive:
        mine = Receive(shared=computing or bool(self._open))
        for other in self._open:
            other.shared = True
        self._open.add(mine)
        return mine

    def end(self, mine: Receive) -> None:
        self._open.discard(mine)
