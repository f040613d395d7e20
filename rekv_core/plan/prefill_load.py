"""The prefill worker's load: its own compute queue, and the decode-side compute it has given out.

`PrefillBacklog` is the predicted compute (ms) of the handoffs waiting for this worker's compute
or running: the wait a new request's prefill has ahead of it (`CostInputs.prefill_wait_ms`).
`add(ms)` counts one in and returns a `Once` that takes it out again.

`AssignedWork`: the decode-side compute of this prefill worker's handoffs in flight, for the offers
that miss it. A decode worker's offer counts the compute committed to it by the handoffs whose plan
has reached it (`DecodeOffer.backlog_ms`), and names them (`DecodeOffer.planned`). Requests that
arrive together were all offered before any of them was planned: the second one's offer does not
know that the first was just given thirty layers to recompute there. `AssignedWork.unseen(decode,
planned)` is the decode-side compute of this worker's handoffs to that decode worker (by its
data-plane address) that the offer did not count. `add(decode, transfer_id, ms)` records one
decision's. An entry is dropped once an offer names it (the decode worker has seen its plan: it
counts what is left of it, or it has ended there), or `grace_s` after `ended(transfer_id)` (the
handoff has left this worker, so its plan, the first message, has reached the decode side; the grace
covers offers made before that, should no offer name it). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection


class AssignedWork:
    def __init__(self, grace_s: float = 1.0):
        self._grace_s = grace_s
        self._ms: dict[str, tuple[str, float]] = {}  # transfer id -> (decode address, ms)
        self._ended: dict[str, float] = {}  # transfer id -> when it left (monotonic)
        self._lock = threading.Lock()

    def add(self, decode: str, transfer_id: str, ms: float) -> None:
        with self._lock:
            self._ms[transfer_id] = (decode, ms)

    def ended(self, transfer_id: str, at: float | None = None) -> None:
        with self._lock:
            if transfer_id in self._ms:
                self._ended[transfer_id] = time.monotonic() if at is None else at

    def unseen(self, decode: str, planned: Collection[str], now: float | None = None) -> float:
        """The decode-side compute of the handoffs to `decode` (in flight here, or ended within
        the grace) that `planned` leaves out, ms."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [t for t in self._ms if t in planned] + [
                t for t, at in self._ended.items() if at < now - self._grace_s]
            for transfer in gone:
                self._ms.pop(transfer, None)
                self._ended.pop(transfer, None)
            return sum(ms for to, ms in self._ms.values() if to == decode)


class PrefillBacklog:
    def __init__(self):
        self._ms, self._lock = 0.0, threading.Lock()

    @property
    def ms(self) -> float:
        with self._lock:
            return max(0.0, self._ms)

    def add(self, ms: float) -> Once:
        """Count `ms` in; the returned callable takes it out again (once)."""
        with self._lock:
            self._ms += ms

        def take_out() -> None:
            with self._lock:
                self._ms -= ms
        return Once(take_out)


class Once:
    """Calls `fn` the first time it is called, never again (thread-safe)."""

    def __init__(self, fn: Callable[[], object]):
        self._fn, self._lock = fn, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()
