"""The sender pool of the transport contract (`base`): one sender per receiver address.

`SenderPool` keeps the sender to each receiver address, made by the implementation's
`_connect(address)` on first use of `to(address)` and reused by every later request until it is
`broken`, when the next `to` connects anew (thread-safe). With `pace_gbps` > 0 every sender is put
behind a `pacing.PacedSender` of that rate. `shutdown()` shuts every sender down, logging those
whose peer is already gone rather than stopping at them; `pending()` and `connections()` report
what it holds. The pool sits above `base` and `pacing`, which builds on `base`.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

from rekv_core.transport.base import Pending, TransportError, TransportSender
from rekv_core.transport.pacing import paced

logger = logging.getLogger(__name__)


class SenderPool(ABC):
    """One sender per receiver address, made by `_connect` on first use of `to` and reused; with
    `pace_gbps` > 0 each is put behind a `pacing.PacedSender` of that rate.

    Implementations provide `_connect(address)`; `to`, `pending` and `shutdown` are shared."""

    def __init__(self, pace_gbps: float = 0.0):
        self.pace_gbps = pace_gbps
        self._senders: dict[str, TransportSender] = {}
        self._lock = threading.Lock()
        self._shut = False

    @abstractmethod
    def _connect(self, address: str) -> TransportSender:
        """A new sender to `address` (called by `to`, under the pool's lock, once per address)."""

    def to(self, address: str) -> TransportSender:
        """The sender to `address`; a broken one is replaced by a fresh connection."""
        self.drop_if_broken(address)
        with self._lock:
            if self._shut:
                raise TransportError("sender pool: shut down")
            sender = self._senders.get(address)
            if sender is None:
                sender = self._senders[address] = paced(self._connect(address), self.pace_gbps)
            return sender

    def holds(self, address: str) -> bool:
        """Whether a sender to `address` is held and not broken."""
        with self._lock:
            sender = self._senders.get(address)
        return sender is not None and not sender.broken

    def drop_if_broken(self, address: str) -> None:
        """Forget the sender to `address` once it is broken and shut it down (its peer is gone;
        a restarted peer at the same address gets a new connection on the next `to`)."""
        with self._lock:
            sender = self._senders.get(address)
            if sender is None or not sender.broken:
                return
            del self._senders[address]
        logger.warning("sender to %s: connection lost; the next handoff reconnects", address)
        try:
            sender.shutdown()
        except Exception as exc:
            logger.warning("sender to %s: shutdown after loss failed: %s", address, exc)

    def pending(self) -> Pending:
        with self._lock:
            senders = list(self._senders.values())
        return sum((s.pending() for s in senders), Pending())

    def connections(self) -> int:
        """Senders held, one per receiver address (a broken one until it is replaced)."""
        with self._lock:
            return len(self._senders)

    def shutdown(self) -> None:
        with self._lock:
            self._shut = True
            senders, self._senders = self._senders, {}
        for address, sender in senders.items():
            try:
                sender.shutdown()
            except Exception as exc:  # the peer may be gone already; the others still need it
                logger.warning("sender to %s: shutdown failed: %s", address, exc)
