"""The prefill side of the UCX transport: one endpoint per receiver, and a pool of them.

`UcxSender(engine, address)` connects once to the receiver at `address` (host:port) and sends every
message as its tagged parts (`framing`): the frame, then each buffer from where it lives; device
buffers only after their `ready` event (UCX reads them outside every stream, `rekv_core.streams`).
Parts are posted on the engine loop in call order, so a request's messages leave in order; `flush`
waits for a request's sends to complete. `UcxSenderPool` keeps one `UcxSender` per receiver
address, made on first use and reused; with `pace_gbps` > 0 each is wrapped in a `PacedSender`.
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from rekv_core import streams
from rekv_core.transport.base import Message, Pending, TransportError, TransportSender
from rekv_core.transport.pool import SenderPool
from rekv_core.transport.ucx.engine import UcxEngine, release_engine
from rekv_core.transport.ucx.framing import (check_buffer_count, encode_frame, message_tag,
                                             wire_view)


class UcxSender(TransportSender):
    """Prefill side: sends to one receiver address; the endpoint is made once and reused."""

    def __init__(self, engine: UcxEngine, address: str, connect_timeout: float = 10.0):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address: expected host:port, got {address!r}")
        self._engine = engine
        self.address = address
        try:
            self._endpoint = engine.call(self._connect(host, int(port), connect_timeout),
                                         connect_timeout + 1)
        except Exception as exc:  # refused, unreachable, timed out: the peer is not there
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        self._in_flight: dict[str, list] = {}
        self._orphans: list[list] = []  # parts of given-up sends, kept until shutdown
        self._lock = threading.Lock()
        self._failed = False  # a send failed: the endpoint cannot be trusted any more

    @staticmethod
    async def _connect(host: str, port: int, timeout: float):
        import ucxx

        return await ucxx.create_endpoint(host, port, connect_timeout=timeout)

    def send(self, message: Message) -> None:
        check_buffer_count(message.name, len(message.buffers))
        streams.host_wait(message.ready)
        frame = torch.frombuffer(bytearray(encode_frame(message)), dtype=torch.uint8)
        parts = [frame.numpy()] + [wire_view(b) for b in message.buffers.values()]
        # Posted on the engine loop in call order, so the parts of a request leave in order.
        future = self._engine.submit(self._send_parts(message, parts))
        future.parts = parts  # what UCX reads until its requests end (see flush)
        with self._lock:
            self._in_flight.setdefault(message.request_id, []).append(future)

    async def _send_parts(self, message: Message, parts: list) -> None:
        endpoint = self._endpoint
        sends = [endpoint.send(part, tag=message_tag(message.request_id, message.seq, index),
                               force_tag=True)
                 for index, part in enumerate(parts) if len(part)]
        await asyncio.gather(*sends)

    def flush(self, request_id: str, timeout: float | None = None) -> None:
        with self._lock:
            futures = self._in_flight.pop(request_id, [])
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for future in futures:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                future.result(remaining)
        except TimeoutError:
            self._give_up(futures)
            raise TimeoutError(f"request {request_id}: messages still on the wire after "
                               f"{timeout} s") from None
        except Exception as exc:
            self._give_up(futures)
            self._failed = True
            raise TransportError(f"request {request_id}: send failed: {exc}") from exc

    @property
    def broken(self) -> bool:
        return self._failed or self._endpoint.closed

    def _give_up(self, futures: list) -> None:
        """Cancelling a future does not end the UCX requests already posted, which may still read
        the buffers: keep those alive (device memory would otherwise go back to the allocator)
        until the endpoint closes."""
        for future in futures:
            future.cancel()
        with self._lock:
            self._orphans += [f.parts for f in futures if not f.done() or f.cancelled()]

    def pending(self) -> Pending:
        with self._lock:
            return Pending(in_flight_messages=sum(not f.done() for fs in self._in_flight.values()
                                                  for f in fs))

    def shutdown(self) -> None:
        async def close():
            if not self._endpoint.closed:
                await self._endpoint.close()
            else:  # the peer is gone: release the endpoint without a closing handshake
                self._endpoint.abort()

        self._engine.call(close(), 10)
        with self._lock:
            self._orphans.clear()


class UcxSenderPool(SenderPool):
    """One `UcxSender` per receiver address on `engine`. With `shared_engine` the engine came from
    `acquire_engine`, and `shutdown` gives it back once every sender is shut down."""

    def __init__(self, engine: UcxEngine, connect_timeout: float = 10.0, pace_gbps: float = 0.0,
                 shared_engine: bool = False):
        super().__init__(pace_gbps)
        self._engine = engine
        self.connect_timeout = connect_timeout
        self._shared_engine = shared_engine

    @property
    def engine(self) -> UcxEngine:
        return self._engine

    def _connect(self, address: str) -> TransportSender:
        return UcxSender(self._engine, address, self.connect_timeout)

    def shutdown(self) -> None:
        with self._lock:
            release, self._shared_engine = self._shared_engine, False  # give it back once
        try:
            super().shutdown()
        finally:
            if release:
                release_engine(self._engine)
