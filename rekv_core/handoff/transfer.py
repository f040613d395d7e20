"""One handoff's progress on either side: an ordered state and a deadline on every wait.

A `Transfer` moves through `TransferState` (ordered, as SGLang's `KVPoll`; FAILED is the lowest):

    NEGOTIATING  decode: from opening the transfer until the plan has arrived;
                 prefill: from the call's arrival, through the decision, the queue for compute and
                 the prefill, until the first message is posted
    BOUNDARY     h_c (or the token ids) in flight (decode: until its first chunk is in)
    PREFIX       the prefix layers in flight (a streamed handoff's sender goes here from
                 NEGOTIATING: its prefix leaves first, and the boundary after it)
    JOINING      decode: the suffix and the prefix branch joining; prefill: the last bytes leaving
    DONE         the cache is complete (decode), every byte has left (prefill)
    FAILED       ended by an error, a passed deadline or a cancel; terminal

States only ever increase, except that any unfinished state may fail. Every blocking step asks
`wait_s()` for its timeout: the shorter of the stall limit (`stall_s`, the longest a single message
may take) and what is left until the deadline; once the deadline has passed `wait_s()` raises
`TimeoutError` naming the state, so no wait is ever unbounded. The deadline starts as the caller's
(its gRPC deadline less what the caller keeps for itself) and `expect_within(seconds)` tightens it
once the transfer's length is predicted (`allowed_s` of the prediction), where the owner trusts
predictions (`trust_predictions`; the decode worker does once it has measured the link).
`cancel()` (a vanished peer, a cancelled call) makes the next `check()` or `wait_s()` raise
`TransferCancelled`.

`TransferBook` counts the live transfers of one process by state, for the in-flight gauges and
leak checks: every transfer is entered on creation and leaves when it ends, however it ends; it
remembers the ids of the last `remember` to leave, and when (`left_since`). Thread-safe.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque

# A predicted transfer may take this many times its prediction, plus this much, before its
# receiver gives up on it: a black-holed link never ends, but a cold planner's prediction can be
# far too short and an oversubscribed CPU slow everything several-fold (seen in CI: a handoff
# predicted at a few ms took 5 s); giving up then would turn a slowdown into a recompute.
PREDICTION_SLACK = 8.0
PREDICTION_FLOOR_S = 10.0


def allowed_s(predicted_s: float) -> float:
    """How long a transfer predicted to take `predicted_s` may take."""
    return PREDICTION_SLACK * predicted_s + PREDICTION_FLOOR_S


class TransferState(enum.IntEnum):
    FAILED = 0
    NEGOTIATING = 1
    BOUNDARY = 2
    PREFIX = 3
    JOINING = 4
    DONE = 5


class TransferCancelled(RuntimeError):
    """The transfer was given up by its owner (the peer vanished or the call was cancelled)."""


class TransferBook:
    """The live transfers of one process, by state."""

    def __init__(self, remember: int = 1024):
        self._lock = threading.Lock()
        self._live: dict[int, Transfer] = {}
        self._left: deque[tuple[float, str]] = deque(maxlen=remember)  # (monotonic, id)

    def _enter(self, transfer: Transfer) -> None:
        with self._lock:
            self._live[id(transfer)] = transfer

    def _leave(self, transfer: Transfer) -> None:
        with self._lock:
            if self._live.pop(id(transfer), None) is not None:
                self._left.append((time.monotonic(), transfer.transfer_id))

    def left_since(self, since: float) -> list[str]:
        """The ids of the remembered transfers that ended at `since` (monotonic) or later, the
        latest last."""
        with self._lock:
            return [transfer_id for at, transfer_id in self._left if at >= since]

    def count(self, state: TransferState | None = None) -> int:
        with self._lock:
            return sum(state is None or t.state is state for t in self._live.values())

    def live(self) -> list[Transfer]:
        with self._lock:
            return list(self._live.values())


class Transfer:
    """`deadline`: time.monotonic() by which the transfer must have ended (None: none beyond
    the stall limit of each wait). `stall_s` > 0."""

    def __init__(self, transfer_id: str, deadline: float | None = None, stall_s: float = 60.0,
                 book: TransferBook | None = None, trust_predictions: bool = True):
        if stall_s <= 0:
            raise ValueError(f"stall_s: must be > 0, got {stall_s}")
        self.transfer_id = transfer_id
        self.deadline = deadline
        self.stall_s = stall_s
        self.trust_predictions = trust_predictions
        self.failure = ""
        self._state = TransferState.NEGOTIATING
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._book = book
        self.entered = {TransferState.NEGOTIATING: time.monotonic()}
        if book is not None:
            book._enter(self)

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def ended(self) -> bool:
        return self._state in (TransferState.DONE, TransferState.FAILED)

    def advance(self, state: TransferState) -> None:
        """Move forward to `state` (staying is allowed); FAILED only through `fail`."""
        with self._lock:
            if self.ended:
                raise TransferCancelled(f"transfer {self.transfer_id}: already "
                                        f"{self._state.name}, cannot move to {state.name}")
            if state is TransferState.FAILED or state < self._state:
                raise ValueError(f"transfer {self.transfer_id}: cannot move from "
                                 f"{self._state.name} to {state.name}")
            if state is not self._state:
                self._state = state
                self.entered[state] = time.monotonic()
        if state is TransferState.DONE and self._book is not None:
            self._book._leave(self)

    def fail(self, reason: str) -> None:
        """End the transfer as failed (no effect once it has ended)."""
        with self._lock:
            if self.ended:
                return
            self.failure = f"{reason} (in {self._state.name})"
            self._state = TransferState.FAILED
            self.entered[TransferState.FAILED] = time.monotonic()
        if self._book is not None:
            self._book._leave(self)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def hold(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking at once when the transfer is cancelled."""
        self._cancelled.wait(seconds)

    def expect_within(self, seconds: float) -> None:
        """The transfer should end within `seconds` from now: tighten the deadline to that,
        unless predictions are not to be trusted (a cold planner's can be far too short)."""
        if not self.trust_predictions:
            return
        end = time.monotonic() + max(0.0, seconds)
        with self._lock:
            self.deadline = end if self.deadline is None else min(self.deadline, end)

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def check(self) -> None:
        """Raise when the transfer was cancelled or its deadline has passed."""
        if self._cancelled.is_set():
            raise TransferCancelled(f"transfer {self.transfer_id}: cancelled in "
                                    f"{self._state.name}")
        remaining = self.remaining_s()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(f"transfer {self.transfer_id}: deadline passed in "
                               f"{self._state.name}")

    def wait_s(self) -> float:
        """The timeout of the next wait: the stall limit, or less where the deadline is nearer."""
        self.check()
        remaining = self.remaining_s()
        return self.stall_s if remaining is None else min(self.stall_s, remaining)
