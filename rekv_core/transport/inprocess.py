"""An in-process link that emulates a network path: bandwidth, latency and faults.

`InProcessLink(bandwidth_gbps, latency_s)` gives one `sender` and one `receiver` (see `base` for the
contract). A single wire thread serializes messages in send order: each one occupies the link for
nbytes·8 / bandwidth seconds (it is copied during that time, as a real transfer would, so the
receiver never aliases the sender's memory), then becomes visible to the receiver `latency_s` later;
latency is pipelined, bandwidth is not. `bandwidth_gbps=None` means an unthrottled copy. Device
buffers are copied as a NIC would move them (`rekv_core.streams`): on a stream of the link's own,
after the message's `ready` event, and the copy is complete before the message is delivered with a
`ready` event of its own.

`fault`, when given, sees every message leaving the wire and returns the messages to deliver
instead: tests use it to drop, duplicate, truncate or misroute payloads. `close()` stops and joins
the wire thread; messages still queued are discarded and their senders' flushes fail.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable

from rekv_core import streams
from rekv_core.transport.base import (Message, Pending, TransportError, TransportReceiver,
                                      TransportSender)

Fault = Callable[[Message], list[Message]]
_STOP = object()


class InProcessLink:
    def __init__(self, bandwidth_gbps: float | None = None, latency_s: float = 0.0,
                 fault: Fault | None = None):
        if bandwidth_gbps is not None and bandwidth_gbps <= 0:
            raise ValueError(f"bandwidth_gbps: must be positive or None, got {bandwidth_gbps}")
        if latency_s < 0:
            raise ValueError(f"latency_s: must be non-negative, got {latency_s}")
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_s = latency_s
        self.fault = fault
        self.receiver = _InProcessReceiver()
        self.sender = _InProcessSender(self)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._streams = _CopyStreams()
        self._wire = threading.Thread(target=self._run, name="rekv-inprocess-wire", daemon=True)
        self._wire.start()

    def wire_seconds(self, nbytes: int) -> float:
        return 0.0 if self.bandwidth_gbps is None else nbytes * 8 / (self.bandwidth_gbps * 1e9)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._closed:
                continue  # discarded: stays in the sender's in-flight count, so flush fails
            message: Message = item
            start = time.perf_counter()
            try:
                copy = self._copy(message)
            except Exception as exc:  # noqa: BLE001 - the wire lives on; this request fails
                self.sender._done(message.request_id, failure=f"copy failed: {exc}")
                continue
            remaining = self.wire_seconds(message.nbytes) - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)
            visible_at = time.perf_counter() + self.latency_s
            for delivered in (self.fault(copy) if self.fault else [copy]):
                self.receiver._deliver(delivered, visible_at)
            self.sender._done(message.request_id)

    def _copy(self, message: Message) -> Message:
        buffers = list(message.buffers.values())
        stream = self._streams.get(next((b.device for b in buffers if b.is_cuda), None))
        with streams.on_stream(stream):
            streams.wait_ready(message.ready, buffers)
            copies = {name: b.clone() for name, b in message.buffers.items()}
            ready = streams.record_ready(copies.values())
        streams.host_wait(ready)  # the wire is busy until the bytes have landed
        return Message(message.request_id, message.seq, message.name, bytes(message.header),
                       copies, ready=ready)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._wire.join()
        self.sender._fail_all()

    def __enter__(self) -> InProcessLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _CopyStreams:
    """The link's own copy stream per CUDA device, made on first use (wire thread only)."""

    def __init__(self):
        self._by_device: dict = {}

    def get(self, device):
        if device is None:
            return None
        if device not in self._by_device:
            self._by_device[device] = streams.side_stream(device)
        return self._by_device[device]


class _InProcessSender(TransportSender):
    def __init__(self, link: InProcessLink):
        self._link = link
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._failures: dict[str, str] = {}  # request -> why a message of it never left
        self._failed = False
        self._cond = threading.Condition()

    def send(self, message: Message) -> None:
        if self._link._closed:
            raise TransportError("link: closed")
        with self._cond:
            self._in_flight[message.request_id] += 1
        self._link._queue.put(message)

    def _done(self, request_id: str, failure: str | None = None) -> None:
        with self._cond:
            self._in_flight[request_id] -= 1
            if not self._in_flight[request_id]:
                del self._in_flight[request_id]
            if failure is not None:
                self._failures[request_id] = failure
            self._cond.notify_all()

    def _fail_all(self) -> None:
        with self._cond:
            self._failed = bool(self._in_flight)
            self._in_flight.clear()
            self._cond.notify_all()

    def flush(self, request_id: str, timeout: float | None = None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._in_flight[request_id] or self._failed,
                                       timeout):
                raise TimeoutError(f"request {request_id}: messages still on the wire after "
                                   f"{timeout} s")
            self._in_flight.pop(request_id, None)
            failure = self._failures.pop(request_id, None)
            if self._failed:
                raise TransportError("link: closed with messages in flight")
            if failure is not None:
                raise TransportError(f"request {request_id}: {failure}")

    def pending(self) -> Pending:
        with self._cond:
            return Pending(in_flight_messages=sum(self._in_flight.values()))


class _InProcessReceiver(TransportReceiver):
    def __init__(self):
        self._inboxes: dict[str, collections.deque[tuple[float, Message]]] = {}
        self._next_seq: dict[str, int] = {}
        self._cond = threading.Condition()
        self.strays = 0

    def open(self, request_id: str) -> None:
        with self._cond:
            if request_id in self._inboxes:
                raise TransportError(f"request {request_id}: already open")
            self._inboxes[request_id] = collections.deque()
            self._next_seq[request_id] = 0

    def _deliver(self, message: Message, visible_at: float) -> None:
        with self._cond:
            inbox = self._inboxes.get(message.request_id)
            if inbox is None:
                self.strays += 1
                return
            inbox.append((visible_at, message))
            self._cond.notify_all()

    def recv(self, request_id: str, timeout: float) -> Message:
        deadline = time.perf_counter() + timeout
        with self._cond:
            if request_id not in self._inboxes:
                raise TransportError(f"request {request_id}: not open")
            if not self._cond.wait_for(lambda: bool(self._inboxes.get(request_id, True)),
                                       max(0.0, deadline - time.perf_counter())):
                raise TimeoutError(f"request {request_id}: no message within {timeout} s")
            inbox = self._inboxes.get(request_id)
            if inbox is None:
                raise TransportError(f"request {request_id}: closed while receiving")
            visible_at, message = inbox.popleft()
            expected = self._next_seq[request_id]
            if message.seq != expected:
                what = "repeated" if message.seq < expected else "missing"
                raise TransportError(f"request {request_id}: expected message {expected}, got "
                                     f"{message.seq} ({message.name}): {what} message")
            self._next_seq[request_id] = expected + 1
        wait = visible_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return message

    def close(self, request_id: str) -> None:
        with self._cond:
            self._inboxes.pop(request_id, None)
            self._next_seq.pop(request_id, None)
            self._cond.notify_all()

    def pending(self) -> Pending:
        with self._cond:
            return Pending(open_requests=len(self._inboxes),
                           buffered_messages=sum(len(q) for q in self._inboxes.values()))
