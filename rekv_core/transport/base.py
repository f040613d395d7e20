"""The transport contract: ordered, named buffers from one sender to one receiver, per request.

A `Message` is one unit on the wire: the request it belongs to, its sequence number within that
request (0, 1, 2, … in send order), a name (`plan`, `boundary`, `layer.3`, …), a small header and
named 1-D uint8 buffers. The transport moves bytes and knows nothing of models or codecs. A
receiving transport that crosses a real wire stamps each message with its `arrival` (see
`arrivals`), from which the receiver's user may estimate the link.

Device buffers follow the stream discipline of `rekv_core.streams`: a message whose buffers live
on a CUDA device carries `ready`, an event recorded after the work that produced them; a transport
never reads them before that event (its copies wait for it on a stream of their own, a NIC's DMA
waits for it on the host), and whoever reads a received message's buffers on a stream first waits
for its `ready` there (`streams.wait_ready`). Host buffers need no event.

Which side calls what:

- receiver (decode side), one per process, made by `factory.create_receiver`: its `address` is
  what the sending side must be told. `open(request_id)` before the sender may send for that
  request; then `recv(request_id, timeout)` returns that request's messages one by one in sequence
  order; then `close(request_id)` when every message was received, or `abort(request_id)` when the
  request is abandoned early (error, timeout, cancel), which also wakes a `recv` waiting on it and
  discards whatever the sender still sends for it. Both free everything buffered for the request.
  Messages for a request that is not open (never opened, or closed) are dropped and counted in
  `strays`; they can never reach another request. A gap or a repeated sequence number raises
  `TransportError`; no message within `timeout` seconds raises `TimeoutError`. `close()` may be
  called twice. `shutdown()`, once the service stops, frees everything the receiver owns
  (listener, connections, open requests); it may be called twice.
- sender (prefill side): `send(message)` queues the message and returns at once; the caller must not
  modify its buffers until `flush(request_id)` has returned, which blocks until every message of
  that request has left (raises `TimeoutError` past its timeout, `TransportError` when the messages
  can no longer leave). `send` never blocks on the receiver. `shutdown()` frees the connection.
- sender pool (prefill side, `pool.SenderPool`), one per process, made by
  `factory.create_sender_pool`: `to(address)`
  returns the sender to the receiver at `address`, made on first use and reused by every later
  request until it is `broken` (its peer died or restarted), when a new one connects
  (thread-safe); `shutdown()`, once the service stops, shuts every sender down, logging
  those whose peer is already gone rather than stopping at them.

A receive's life cycle is the ordered `ReceiveState`: OPEN < DRAINING < CLOSED.

`pending()` on each side reports what is still held (`Pending`; for leak checks: `idle`);
`connections()` on a receiver and a sender pool how many peer connections they hold.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from rekv_core.transport.arrivals import Arrival

# Messages a receiving transport may take in ahead of its consumer, per open request (what a
# request's memory budget counts for them).
PREFETCH = 4


class TransportError(RuntimeError):
    """A message stream that cannot be trusted (gap, duplicate, closed link)."""


@dataclass(frozen=True)
class Pending:
    """What one side of a transport still holds; all zero (`idle`) when nothing is in flight."""

    open_requests: int = 0  # receiver: requests opened and not yet closed or aborted
    buffered_messages: int = 0  # receiver: messages taken in and not yet received
    draining_requests: int = 0  # receiver: aborted requests still discarding what arrives
    in_flight_messages: int = 0  # sender: messages posted that have not yet left

    @property
    def idle(self) -> bool:
        return self == Pending()

    @property
    def total(self) -> int:
        return (self.open_requests + self.buffered_messages + self.draining_requests
                + self.in_flight_messages)

    def __add__(self, other: Pending) -> Pending:
        return Pending(self.open_requests + other.open_requests,
                       self.buffered_messages + other.buffered_messages,
                       self.draining_requests + other.draining_requests,
                       self.in_flight_messages + other.in_flight_messages)


class ReceiveState(enum.IntEnum):
    """Where one request stands on the receiving side; states only ever increase.

    OPEN: opened and not yet ended; its messages are kept for `recv`.
    DRAINING: aborted early; whatever the sender still sends for it is taken and discarded (as
    strays), so the sender's pending sends complete.
    CLOSED: ended; nothing more is taken for it."""

    OPEN = 1
    DRAINING = 2
    CLOSED = 3


@dataclass
class Message:
    request_id: str
    seq: int
    name: str
    header: bytes = b""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    arrival: Arrival | None = None  # set by receiving transports that time the wire
    ready: torch.cuda.Event | None = None  # device buffers: after the work that produced them

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
    def pending(self) -> Pending: ...

    @property
    def broken(self) -> bool:
        """True once the connection is known to be gone (its peer died or restarted): nothing
        sent on it can arrive any more. Senders without a connection never break."""
        return False

    def shutdown(self) -> None:
        """Free the connection; senders that hold none have nothing to do."""


class TransportReceiver(ABC):
    address: str  # where senders reach this receiver
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
    def pending(self) -> Pending: ...

    def connections(self) -> int:
        """Live connections from senders; transports without connections have none."""
        return 0

    def shutdown(self) -> None:
        """Free everything the receiver owns; receivers that own nothing have nothing to do."""
