"""The transport contract: ordered, named buffers from one sender to one receiver, per request.

A `Message` is one unit on the wire: the request it belongs to, its sequence number within that
request (0, 1, 2, … in send order), a name (`plan`, `boundary`, `layer.3`, …), a small header and
named 1-D uint8 buffers. The transport moves bytes and knows nothing of models or codecs. A
receiving transport that crosses a real wire stamps each message with its `arrival` (see
`arrivals`), from which the receiver's user may estimate the link.

Which side calls what:

- receiver (decode side): `open(request_id)` before the sender may send for that request; then
  `recv(request_id, timeout)` returns that request's messages one by one in sequence order; then
  `close(request_id)` when every message was received, or `abort(request_id)` when the request is
  abandoned early (error, timeout, cancel), which also wakes a `recv` waiting on it and discards
  whatever the sender still sends for it. Both free everything buffered for the request. Messages for a
  request that is not open (never opened, or closed) are dropped and counted in `strays`; they can
  never reach another request. A gap or a repeated sequence number raises `TransportError`; no
  message within `timeout` seconds raises `TimeoutError`. `close()` may be called twice.
- sender (prefill side): `send(message)` queues the message and returns at once; the caller must not
  modify its buffers until `flush(request_id)` has returned, which blocks until every message of
  that request has left (raises `TimeoutError` past its timeout). `send` never blocks on the
  receiver.

`pending()` on either side reports what is still held (for leak checks: all zeros when idle).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from rekv_core.transport.arrivals import Arrival


class TransportError(RuntimeError):
    """A message stream that cannot be trusted (gap, duplicate, closed link)."""


@dataclass
class Message:
    request_id: str
    seq: int
    name: str
    header: bytes = b""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    arrival: Arrival | None = None  # set by receiving transports that time the wire

    @property
    def payload_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload_bytes


class TransportSender(ABC):
    @abstractmethod
    def send(self, message: Message) -> None: ...

    @abstractmethod
    def flush(self, request_id: str, timeout: float | None = None) -> None: ...

    @abstractmethod
    def pending(self) -> dict[str, int]: ...


class TransportReceiver(ABC):
    strays: int

    @abstractmethod
    def open(self, request_id: str) -> None: ...

    @abstractmethod
    def recv(self, request_id: str, timeout: float) -> Message: ...

    @abstractmethod
    def close(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> None:
        """Abandon the request early; transports that buffer nothing further just close."""
        self.close(request_id)

    @abstractmethod
    def pending(self) -> dict[str, int]: ...
