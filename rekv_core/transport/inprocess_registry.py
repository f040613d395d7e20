"""The in-process transport behind an address, as the factory hands it out.

`RegisteredReceiver()` owns an unthrottled `InProcessLink` and registers it, process-wide, under
an address `inprocess:<n>` (never reused); it is the link's receiver, and `shutdown()` unregisters
it and closes the link. `InProcessSenderPool.to(address)` returns the sender of the link registered
under `address` (behind a `PacedSender` when `pace_gbps` > 0), or raises ValueError naming the
address when none is registered there. The link belongs to its receiver: the pool's `shutdown`
stops its pacing, never the link.
"""

from __future__ import annotations

import itertools
import threading

from rekv_core.transport.base import Message, Pending, TransportReceiver, TransportSender
from rekv_core.transport.pool import SenderPool
from rekv_core.transport.inprocess import InProcessLink

_links: dict[str, InProcessLink] = {}
_numbers = itertools.count(1)
_links_lock = threading.Lock()


class RegisteredReceiver(TransportReceiver):
    def __init__(self):
        self._link = InProcessLink()
        with _links_lock:
            self.address = f"inprocess:{next(_numbers)}"
            _links[self.address] = self._link

    @property
    def strays(self) -> int:
        return self._link.receiver.strays

    def open(self, request_id: str) -> None:
        self._link.receiver.open(request_id)

    def recv(self, request_id: str, timeout: float) -> Message:
        return self._link.receiver.recv(request_id, timeout)

    def close(self, request_id: str) -> None:
        self._link.receiver.close(request_id)

    def abort(self, request_id: str) -> None:
        self._link.receiver.abort(request_id)

    def pending(self) -> Pending:
        return self._link.receiver.pending()

    def shutdown(self) -> None:
        with _links_lock:
            _links.pop(self.address, None)
        self._link.close()


class InProcessSenderPool(SenderPool):
    def _connect(self, address: str) -> TransportSender:
        with _links_lock:
            link = _links.get(address)
        if link is None:
            raise ValueError(f"address: no in-process receiver is registered under {address!r}")
        return link.sender
