"""The decode-side compute of this prefill worker's handoffs in flight, for the offers that miss it.

A decode worker's offer counts the compute committed to it by the handoffs whose plan has reached
it (`DecodeOffer.backlog_ms`), and names them (`DecodeOffer.planned`). Requests that arrive
together were all offered before any of them was planned: the second one's offer does not know
that the first was just given thirty layers to recompute there. `AssignedWork.unseen(planned)`
is the decode-side compute of this worker's handoffs in flight that the offer did not count;
`add(transfer_id, ms)` records one decision's; `ended(transfer_id)`: the handoff has left this
worker, so its plan (the first message) has reached the decode side and fresh offers count it;
it is kept for `grace_s` more for the offers made before that, then forgotten. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection


class AssignedWork:
    def __init__(self, grace_s: float = 1.0):
        self._grace_s = grace_s
        self._ms: dict[str, float] = {}
        self._ended: dict[str, float] = {}  # transfer id -> when it left (monotonic)
        self._lock = threading.Lock()

    def add(self, transfer_id: str, ms: float) -> None:
        with self._lock:
            self._ms[transfer_id] = ms

    def ended(self, transfer_id: str, at: float | None = None) -> None:
        with self._lock:
            if transfer_id in self._ms:
                self._ended[transfer_id] = time.monotonic() if at is None else at

    def unseen(self, planned: Collection[str], now: float | None = None) -> float:
        """The decode-side compute of the handoffs here (in flight, or ended within the grace)
        that `planned` leaves out, ms."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for transfer in [t for t, at in self._ended.items() if at < now - self._grace_s]:
                del self._ended[transfer], self._ms[transfer]
            return sum(ms for transfer, ms in self._ms.items() if transfer not in planned)
