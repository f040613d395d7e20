"""The decode side of the UCX transport: a listener, and one read-ahead reader per open request.

`UcxReceiver` listens on host:port (its `address`) and keeps every endpoint a sender connects with.
Each open request has a reader on the engine loop that receives its messages in order as soon as
they arrive, up to `prefetch` messages ahead of the consumer, so the wire does not idle while the
consumer decodes the previous layer (a rendezvous send completes only once its receive is posted).
The reader looks for exactly the tag it expects next (`framing.message_tag`), so a message of
another request, or a late message of a closed one, can never be received into this request.
Each message it hands over carries its `Arrival` (`arrivals`).

A request moves through `ReceiveState`: OPEN until `close` (CLOSED: the reader stops) or `abort`
(DRAINING: the reader discards what it has queued and, for `drain_seconds` after the last arrival,
takes and discards the remaining messages in order, so the sender's pending sends complete and UCX
holds no unexpected data for it; they count as `strays`; then CLOSED). `shutdown()` closes every
request, the endpoints and the listener, and gives back a shared engine.

Device buffers land in memory allocated on a landing stream of the receiver's own, on which no
kernel ever runs: UCX writes outside every stream's order, so that memory must not come from a
stream that may still have queued work on it. UCX completes a receive only once the bytes are in
place, so a received message needs no `ready` event; its reader marks the buffers as used by its
own stream (`rekv_core.streams.wait_ready`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rekv_core import streams
from rekv_core.transport.arrivals import Arrival
from rekv_core.transport.base import (
    PREFETCH,
    Message,
    Pending,
    ReceiveState,
    TransportError,
    TransportReceiver,
)
from rekv_core.transport.ucx.engine import UcxEngine, release_engine
from rekv_core.transport.ucx.framing import MAX_FRAME, decode_frame, message_tag, wire_view

PROBE_INTERVAL_MAX = 0.001  # s: a waiting receiver sees a new message at most this late
PART_GIVE_UP_LOOK_S = 0.05  # s: how often a reader missing parts of a message may give up
LISTEN_ATTEMPTS = 20  # binding a fixed port, 0.5 s apart


def _context():
    from ucxx import core

    return core._get_ctx()


async def _recv_tag(buffer, tag: int) -> None:
    await _context().recv(buffer, tag)


# Receives of parts given up on. Cancelling the task that awaits a posted UCX receive does not
# take the receive out of UCX, which writes into its buffer whenever the part arrives (a stalled
# sender's part may come long after the link is back); the task's coroutine holds that buffer.
# So the task is kept here, not cancelled, until UCX completes it: the buffer outlives UCX's use.
ABANDONED_PARTS: set[asyncio.Future] = set()


def _abandon(part: asyncio.Future) -> None:
    ABANDONED_PARTS.add(part)
    part.add_done_callback(_forget_abandoned)


def _forget_abandoned(part: asyncio.Future) -> None:
    ABANDONED_PARTS.discard(part)
    if not part.cancelled():
        part.exception()  # retrieved: a late part's error is expected, not worth a warning


async def _all_parts(receives: list, give_up: Callable[[], bool]) -> None:
    waiting = {asyncio.ensure_future(r) for r in receives}
    try:
        while waiting:
            done, waiting = await asyncio.wait(waiting, timeout=PART_GIVE_UP_LOOK_S)
            for part in done:
                part.result()
            if waiting and give_up():
                raise TransportError(f"{len(waiting)} part(s) of a message never came")
    finally:
        for part in waiting:
            _abandon(part)


async def _discard(context, probe) -> None:
    """Take an oversized message out of UCX without room for it: UCX truncates and drops it."""
    try:
        await context.recv_with_handle(torch.empty(MAX_FRAME, dtype=torch.uint8).numpy(), probe)
    except Exception:  # the truncation error is what dropping it looks like
        pass


async def _take_frame(tag: int, give_up: Callable[[], bool]
                      ) -> tuple[torch.Tensor | None, bool, float]:
    """Wait for the message under `tag` and receive it whole, or return None once `give_up()`.
    Also returns whether the first look found it, and the span within which it arrived: that
    look's own duration, or from the start of the last look that found nothing to the end of the
    one that found it. (A look can take long: in threaded progress mode a probe waits for the
    progress thread, and this thread may be waiting for a core.) Probing, rather than posting a
    receive, leaves nothing posted in UCX when we give up."""
    context = _context()
    delay = 0.00005
    last_empty = None
    while True:
        began = time.perf_counter()
        probe = context.tag_probe(tag, remove=True)
        if probe.matched:
            window = time.perf_counter() - (began if last_empty is None else last_empty)
            if probe.length > MAX_FRAME:  # checked before anything of its size is allocated
                await _discard(context, probe)
                raise TransportError(f"frame: {probe.length} bytes, more than {MAX_FRAME}")
            frame = torch.empty(probe.length, dtype=torch.uint8)
            await context.recv_with_handle(frame.numpy(), probe)
            return frame, last_empty is None, window
        if give_up():
            return None, last_empty is None, 0.0
        last_empty = began
        await asyncio.sleep(delay)
        delay = min(2 * delay, PROBE_INTERVAL_MAX)


@dataclass(eq=False)
class _Inbox:
    """One request on the receiving side: its read-ahead task and what it has received.

    Lives on the engine loop: only the loop changes `state`, and the reader looks at it there."""

    queue: asyncio.Queue
    next_seq: int = 0  # the consumer's next message
    state: ReceiveState = ReceiveState.OPEN
    drain_until: float = 0.0
    done: bool = False  # the reader has returned


class UcxReceiver(TransportReceiver):
    """Decode side. `address` is what the prefill side must be told (host:port); `prefetch` is how
    many messages each open request's reader may receive ahead of its consumer; `device` is where
    buffers sent from device memory land; `max_message_bytes` (> 0) bounds what one message's
    frame may announce, checked before anything is allocated for it. With `shared_engine` the
    engine came from `acquire_engine`, and `shutdown` gives it back."""

    def __init__(self, engine: UcxEngine, host: str = "127.0.0.1", port: int = 0,
                 device: torch.device | str = "cpu", drain_seconds: float = 5.0,
                 prefetch: int = PREFETCH, shared_engine: bool = False,
                 max_message_bytes: int = 0):
        self._engine = engine
        self.max_message_bytes = max_message_bytes
        self._shared_engine = shared_engine
        self._device = torch.device(device)
        self._landing = streams.side_stream(self._device)
        self.drain_seconds = drain_seconds
        self.prefetch = prefetch
        self._endpoints: list = []
        self._lock = threading.Lock()
        self._inboxes: dict[str, _Inbox] = {}
        self._draining: dict[str, _Inbox] = {}
        self._waiting: dict[str, concurrent.futures.Future] = {}
        self._shut = False
        self.strays = 0
        self._listener = engine.call(self._listen(port))
        self.address = f"{host}:{self._listener.port}"

    @property
    def engine(self) -> UcxEngine:
        return self._engine

    async def _listen(self, port: int):
        import ucxx

        async def on_connect(endpoint) -> None:
            # kept alive, the peer reuses it for every request; those of gone peers are released
            gone = [e for e in self._endpoints if e.closed]
            self._endpoints = [e for e in self._endpoints if not e.closed] + [endpoint]
            for old in gone:
                old.abort()

        for attempt in range(LISTEN_ATTEMPTS):  # a port just freed may stay busy a moment
            try:
                return ucxx.create_listener(on_connect, port=port)
            except ucxx.exceptions.UCXBusyError:
                if not port or attempt == LISTEN_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.5)

    def open(self, request_id: str) -> None:
        with self._lock:
            if self._shut:
                raise TransportError("receiver: shut down")
            if request_id in self._inboxes or request_id in self._draining:
                raise TransportError(f"request {request_id}: already open")
            inbox = _Inbox(asyncio.Queue(self.prefetch))
            self._inboxes[request_id] = inbox
        self._engine.submit(self._read_ahead(request_id, inbox))

    def _give_up(self, inbox: _Inbox) -> bool:
        return inbox.state is ReceiveState.CLOSED or (inbox.state is ReceiveState.DRAINING
                                                      and time.monotonic() > inbox.drain_until)

    async def _read_ahead(self, request_id: str, inbox: _Inbox) -> None:
        seq, previous_end = 0, None
        try:
            while True:
                looked = time.perf_counter()
                held = 0.0 if previous_end is None else looked - previous_end
                frame, first_look, window = await _take_frame(message_tag(request_id, seq, 0),
                                                              lambda: self._give_up(inbox))
                if frame is None:
                    return
                draining = inbox.state > ReceiveState.OPEN
                message = await self._recv_message(
                    request_id, seq, frame, device=torch.device("cpu") if draining else None,
                    give_up=lambda: self._give_up(inbox))
                previous_end = time.perf_counter()
                message.arrival = Arrival(held, first_look, window, previous_end,
                                          len(frame) + message.payload_bytes)
                seq += 1
                if inbox.state > ReceiveState.OPEN:
                    self._discard(inbox, 1)
                    continue
                await inbox.queue.put(message)
                if inbox.state > ReceiveState.OPEN:  # ended while waiting for room
                    self._discard(inbox, 0)
        except Exception as exc:
            if inbox.state is ReceiveState.OPEN:
                await inbox.queue.put(exc)  # the consumer raises it
            else:  # a broken stray is still a stray; nothing else to free
                self._discard(inbox, 1)
        finally:
            inbox.done = True
            with self._lock:
                self._forget_draining(request_id, inbox)

    def _forget_draining(self, request_id: str, inbox: _Inbox) -> None:
        if self._draining.get(request_id) is inbox:
            del self._draining[request_id]

    def _discard(self, inbox: _Inbox, received: int) -> None:
        """Count `received` plus everything queued as strays, and empty the queue."""
        while not inbox.queue.empty():
            inbox.queue.get_nowait()
            received += 1
        inbox.drain_until = time.monotonic() + self.drain_seconds
        with self._lock:
            self.strays += received

    def recv(self, request_id: str, timeout: float) -> Message:
        with self._lock:
            inbox = self._inboxes.get(request_id)
            if inbox is None:
                raise TransportError(f"request {request_id}: not open")
        future = self._engine.submit(asyncio.wait_for(inbox.queue.get(), timeout))
        with self._lock:
            self._waiting[request_id] = future
        try:
            item = future.result(timeout + 5)
        except (TimeoutError, asyncio.TimeoutError):
            future.cancel()
            raise TimeoutError(f"request {request_id}: no message within {timeout} s") from None
        except concurrent.futures.CancelledError:
            raise TransportError(f"request {request_id}: closed while receiving") from None
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)
        with self._lock:
            if self._inboxes.get(request_id) is not inbox:
                raise TransportError(f"request {request_id}: closed while receiving")
        if isinstance(item, BaseException):
            raise item
        if item.seq != inbox.next_seq:
            raise TransportError(f"request {request_id}: message {item.seq}, expected "
                                 f"{inbox.next_seq}")
        inbox.next_seq += 1
        return item

    async def _recv_message(self, request_id: str, seq: int, frame: torch.Tensor,
                            device=None, give_up: Callable[[], bool] = lambda: False
                            ) -> Message:
        """The message `frame` announces, its buffers received whole; a TransportError once
        `give_up()` while a part is still missing (an aborted sender's parts may never come)."""
        meta = decode_frame(frame, self.max_message_bytes)
        if meta["request_id"] != request_id or meta["seq"] != seq:
            raise TransportError(f"request {request_id}: frame of request {meta['request_id']} "
                                 f"message {meta['seq']} under the tag of message {seq}")
        buffers, receives = {}, []
        for part, (name, nbytes, kind) in enumerate(meta["buffers"], start=1):
            where = device or (self._device if kind == "cuda" else torch.device("cpu"))
            with streams.on_stream(self._landing if where.type == "cuda" else None):
                buf = torch.empty(int(nbytes), dtype=torch.uint8, device=where)
            buffers[name] = buf
            if nbytes:
                receives.append(_recv_tag(wire_view(buf), message_tag(request_id, seq, part)))
        await _all_parts(receives, give_up)
        return Message(request_id, seq, meta["name"], meta["header"].encode("latin-1"), buffers)

    def close(self, request_id: str) -> None:
        self._end(request_id, ReceiveState.CLOSED)

    def abort(self, request_id: str) -> None:
        self._end(request_id, ReceiveState.DRAINING if self.drain_seconds > 0
                  else ReceiveState.CLOSED)

    def _end(self, request_id: str, state: ReceiveState) -> None:
        with self._lock:
            inbox = self._inboxes.pop(request_id, None)
            waiting = self._waiting.pop(request_id, None)
            if inbox is None:
                return
            if state is ReceiveState.DRAINING:
                self._draining[request_id] = inbox
        if waiting is not None:
            waiting.cancel()  # its thread raises "closed while receiving"

        def end() -> None:  # on the engine loop, where the reader looks at the state
            inbox.state = state
            self._discard(inbox, 0)
            if inbox.done:
                with self._lock:
                    self._forget_draining(request_id, inbox)

        self._engine.loop.call_soon_threadsafe(end)

    def connections(self) -> int:
        """Endpoints of live senders (those of gone peers are released at the next connect)."""
        return sum(not e.closed for e in self._endpoints)

    def pending(self) -> Pending:
        with self._lock:
            inboxes = list(self._inboxes.values())
            return Pending(open_requests=len(inboxes),
                           buffered_messages=sum(i.queue.qsize() for i in inboxes),
                           draining_requests=len(self._draining))

    def shutdown(self) -> None:
        with self._lock:
            if self._shut:
                return
            self._shut = True
            open_requests = list(self._inboxes)
            draining = list(self._draining.values())
        for request_id in open_requests:
            self.close(request_id)
        try:
            self._engine.call(self._close_all(draining), 10)
        finally:
            if self._shared_engine:
                release_engine(self._engine)

    async def _close_all(self, draining: list[_Inbox]) -> None:
        for inbox in draining:  # their readers stop at their next look
            inbox.state = ReceiveState.CLOSED
        for endpoint in self._endpoints:
            if not endpoint.closed:
                await endpoint.close()
        self._listener.close()
