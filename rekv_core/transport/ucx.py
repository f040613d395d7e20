"""The UCX transport (through `ucxx`): the contract of `base`, between processes and machines.

The decode side runs a `UcxReceiver`, which listens on a host:port (its `address`); the prefill side
runs a `UcxSender`, which keeps one UCX endpoint per receiver address, made on first use and reused
by every later request. Both drive UCX from one `UcxEngine`: a thread with its own asyncio loop, so
the blocking `send/recv/flush` of the contract can be called from any thread, including handoff
threads and a gRPC server's event loop (through `asyncio.to_thread`).

On the wire every message is tagged, not merely ordered: part p of message seq of request r travels
under the 64-bit UCX tag `H(r) << 16 | seq << 4 | p`, where H is a 48-bit BLAKE2 hash of the
request id. Part 0 is a small frame (length-prefixed JSON: name, header, buffer names, sizes and
memory kinds); parts 1..15 are the buffers, sent from where they live: device memory for CUDA
tensors (GPU to GPU where UCX has CUDA transports), host memory otherwise. The receiver posts a
receive for exactly the tag it expects next, into a buffer of the announced size, so a message of
another request, or a late message of a closed one, can never be received into this request.
Request ids must be unique per transfer (the services add a nonce to each request's id).

Each open request has a reader on the engine loop that receives its messages in order as soon as
they arrive, up to `prefetch` messages ahead of the consumer, so the wire does not idle while the
consumer decodes the previous layer (a rendezvous send completes only once its receive is posted).
Each message it hands over carries its `Arrival` (how long the reader took to look for it, whether
it was already there, when its last byte landed; `arrivals`), from which the decode worker estimates
the link. A request aborted before its last message (timeout, error, cancelled request) is drained:
its reader discards what it has queued and, for `drain_seconds` after the last arrival, takes and
discards the remaining messages in order, so the sender's pending sends complete and UCX holds no
unexpected data for it; they count as `strays`.
Messages for a request that is never opened are never received: a large one sent by rendezvous makes
the sender's `flush` time out, an eager one stays in UCX's unexpected queue until the worker closes.
The services only send for requests the decode side has opened.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import torch

from rekv_core.transport.arrivals import Arrival
from rekv_core.transport.base import Message, TransportError, TransportReceiver, TransportSender

MAX_FRAME = 1 << 16  # bytes of part 0 of a message
MAX_BUFFERS = 15
# Host-memory tuning (`UcxEngine(host_eager=True)`): every message travels eagerly, so the sender
# needs no rendezvous handshake with a receiver whose loop thread may be waiting for a core, and
# large socket buffers let the kernel take the data in meanwhile. Process-wide, read when
# UCX starts; variables already set win. Not for CUDA memory, which needs rendezvous (zero copy).
HOST_EAGER_ENV = {"UCX_RNDV_THRESH": "inf", "UCX_TCP_SNDBUF": "4M", "UCX_TCP_RCVBUF": "4M"}
MAX_SEQ = (1 << 12) - 1
PROBE_INTERVAL_MAX = 0.001  # s: a waiting receiver sees a new message at most this late


def message_tag(request_id: str, seq: int, part: int) -> int:
    if not 0 <= seq <= MAX_SEQ:
        raise TransportError(f"request {request_id}: message {seq} beyond {MAX_SEQ} per request")
    digest = hashlib.blake2b(request_id.encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big") << 16 | seq << 4 | part


def _encode_frame(message: Message) -> bytes:
    meta = {"request_id": message.request_id, "seq": message.seq, "name": message.name,
            "header": message.header.decode("latin-1"),
            "buffers": [[name, int(buf.numel()), buf.device.type]
                        for name, buf in message.buffers.items()]}
    body = json.dumps(meta).encode()
    frame = struct.pack("<I", len(body)) + body
    if len(frame) > MAX_FRAME:
        raise TransportError(f"{message.name}: frame of {len(frame)} bytes exceeds {MAX_FRAME}")
    return frame


def _decode_frame(raw: torch.Tensor) -> dict:
    data = raw.numpy().tobytes()
    (length,) = struct.unpack_from("<I", data)
    if length + 4 > len(data):
        raise TransportError(f"frame: announces {length} bytes, holds {len(data) - 4}")
    return json.loads(data[4:4 + length])


def _wire_view(buffer: torch.Tensor):
    """What ucxx sends from: the numpy view of a host tensor, the CUDA tensor itself."""
    buffer = buffer.contiguous()
    return buffer if buffer.is_cuda else buffer.numpy()


class UcxEngine:
    """A thread running an asyncio loop that owns every UCX call of this process.

    Waiting for a message, the loop probes UCX (`_take_frame`), and in ucxx's threaded progress
    mode each probe busy-waits for the progress thread; `loop_nice` > 0 lowers this thread's
    scheduling priority (Linux nice), so that where the data plane shares a core with compute,
    the compute keeps the core. With `host_eager` (`HOST_EAGER_ENV`, applied before UCX first
    starts in this process) the sender needs no handshake with this thread, so a late probe does
    not hold the wire: the kernel's socket buffers take the data in meanwhile."""

    def __init__(self, loop_nice: int = 0, host_eager: bool = False):
        if not 0 <= loop_nice <= 19:
            raise ValueError(f"loop_nice: must lie in [0, 19], got {loop_nice}")
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        for name, value in HOST_EAGER_ENV.items() if host_eager else ():
            os.environ.setdefault(name, value)
        import ucxx  # noqa: F401  (fail here, clearly, when ucxx is missing)

        self.loop = asyncio.new_event_loop()
        self.loop_nice = loop_nice
        self._thread = threading.Thread(target=self._run, name="rekv-ucx", daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        if self.loop_nice:
            os.setpriority(os.PRIO_PROCESS, 0, self.loop_nice)  # Linux: this thread only
        self.loop.run_forever()

    @property
    def thread_id(self) -> int | None:
        return self._thread.native_id

    def submit(self, coro: Coroutine):
        if self._closed:
            coro.close()
            raise TransportError("ucx engine: closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine, timeout: float | None = None):
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _context():
    from ucxx import core

    return core._get_ctx()


async def _recv_tag(buffer, tag: int) -> None:
    await _context().recv(buffer, tag)


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
    """One open request on the receiving side: its read-ahead task and what it has received.

    Lives on the engine loop. `state`: open (messages go to `queue`), draining (aborted: messages
    are discarded until none arrives for `drain_seconds`) or closed (the reader stops)."""

    queue: asyncio.Queue
    next_seq: int = 0  # the consumer's next message
    state: str = "open"
    drain_until: float = 0.0
    done: bool = False  # the reader has returned


class UcxReceiver(TransportReceiver):
    """Decode side. `address` is what the prefill side must be told (host:port); `prefetch` is how
    many messages each open request's reader may receive ahead of its consumer."""

    def __init__(self, engine: UcxEngine, host: str = "127.0.0.1", port: int = 0,
                 device: torch.device | str = "cpu", drain_seconds: float = 5.0,
                 prefetch: int = 4):
        self._engine = engine
        self._device = torch.device(device)
        self.drain_seconds = drain_seconds
        self.prefetch = prefetch
        self._endpoints: list = []
        self._lock = threading.Lock()
        self._inboxes: dict[str, _Inbox] = {}
        self._draining: set[str] = set()
        self._waiting: dict[str, concurrent.futures.Future] = {}
        self.strays = 0
        self._listener = engine.call(self._listen(port))
        self.address = f"{host}:{self._listener.port}"

    async def _listen(self, port: int):
        import ucxx

        async def on_connect(endpoint) -> None:
            self._endpoints.append(endpoint)  # kept alive; the peer reuses it for every request

        return ucxx.create_listener(on_connect, port=port)

    def open(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._inboxes or request_id in self._draining:
                raise TransportError(f"request {request_id}: already open")
            inbox = _Inbox(asyncio.Queue(self.prefetch))
            self._inboxes[request_id] = inbox
        self._engine.submit(self._read_ahead(request_id, inbox))

    def _give_up(self, inbox: _Inbox) -> bool:
        return inbox.state == "closed" or (inbox.state == "draining"
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
                draining = inbox.state != "open"
                message = await self._recv_message(
                    request_id, seq, frame, device=torch.device("cpu") if draining else None)
                previous_end = time.perf_counter()
                message.arrival = Arrival(held, first_look, window, previous_end,
                                          len(frame) + message.payload_bytes)
                seq += 1
                if inbox.state != "open":
                    self._discard(inbox, 1)
                    continue
                await inbox.queue.put(message)
                if inbox.state != "open":  # aborted while waiting for room
                    self._discard(inbox, 0)
        except Exception as exc:
            if inbox.state == "open":
                await inbox.queue.put(exc)  # the consumer raises it
            else:  # a broken stray is still a stray; nothing else to free
                self._discard(inbox, 1)
        finally:
            inbox.done = True
            with self._lock:
                self._draining.discard(request_id)

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
                            device=None) -> Message:
        meta = _decode_frame(frame)
        if meta["request_id"] != request_id or meta["seq"] != seq:
            raise TransportError(f"request {request_id}: frame of request {meta['request_id']} "
                                 f"message {meta['seq']} under the tag of message {seq}")
        if len(meta["buffers"]) > MAX_BUFFERS:
            raise TransportError(f"{meta['name']}: {len(meta['buffers'])} buffers, at most "
                                 f"{MAX_BUFFERS}")
        buffers, receives = {}, []
        for part, (name, nbytes, kind) in enumerate(meta["buffers"], start=1):
            where = device or (self._device if kind == "cuda" else torch.device("cpu"))
            buf = torch.empty(int(nbytes), dtype=torch.uint8, device=where)
            buffers[name] = buf
            if nbytes:
                receives.append(_recv_tag(_wire_view(buf), message_tag(request_id, seq, part)))
        await asyncio.gather(*receives)
        return Message(request_id, seq, meta["name"], meta["header"].encode("latin-1"), buffers)

    def close(self, request_id: str) -> None:
        self._end(request_id, "closed")

    def abort(self, request_id: str) -> None:
        self._end(request_id, "draining" if self.drain_seconds > 0 else "closed")

    def _end(self, request_id: str, state: str) -> None:
        with self._lock:
            inbox = self._inboxes.pop(request_id, None)
            waiting = self._waiting.pop(request_id, None)
            if inbox is None:
                return
            if state == "draining":
                self._draining.add(request_id)
        if waiting is not None:
            waiting.cancel()  # its thread raises "closed while receiving"

        def end() -> None:  # on the engine loop, where the reader looks at the state
            inbox.state = state
            self._discard(inbox, 0)
            if inbox.done:
                with self._lock:
                    self._draining.discard(request_id)

        self._engine.loop.call_soon_threadsafe(end)

    def pending(self) -> dict[str, int]:
        with self._lock:
            inboxes = list(self._inboxes.values())
            return {"open_requests": len(inboxes),
                    "buffered_messages": sum(i.queue.qsize() for i in inboxes),
                    "draining_requests": len(self._draining)}

    def shutdown(self) -> None:
        async def close_all():
            for endpoint in self._endpoints:
                if not endpoint.closed:
                    await endpoint.close()
            self._listener.close()

        self._engine.call(close_all(), 10)


class UcxSender(TransportSender):
    """Prefill side: sends to one receiver address; the endpoint is made once and reused.

    `pace_gbps` > 0 emulates a slower link: each message is held until a link of that rate would
    have finished carrying it (messages queue behind each other), then sent."""

    def __init__(self, engine: UcxEngine, address: str, connect_timeout: float = 10.0,
                 pace_gbps: float = 0.0):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address: expected host:port, got {address!r}")
        self._engine = engine
        self.address = address
        self._endpoint = engine.call(self._connect(host, int(port)), connect_timeout)
        self._in_flight: dict[str, list] = {}
        self._lock = threading.Lock()
        self.pace_gbps = pace_gbps
        self._link_free_at = 0.0

    def _pace(self, nbytes: int) -> float:
        """Seconds to hold a message of `nbytes` so the link rate is not exceeded."""
        if self.pace_gbps <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            start = max(now, self._link_free_at)
            self._link_free_at = start + nbytes * 8 / (self.pace_gbps * 1e9)
            return self._link_free_at - now

    @staticmethod
    async def _connect(host: str, port: int):
        import ucxx

        return await ucxx.create_endpoint(host, port)

    def send(self, message: Message) -> None:
        if len(message.buffers) > MAX_BUFFERS:
            raise TransportError(f"{message.name}: {len(message.buffers)} buffers, at most "
                                 f"{MAX_BUFFERS}")
        frame = torch.frombuffer(bytearray(_encode_frame(message)), dtype=torch.uint8)
        parts = [frame.numpy()] + [_wire_view(b) for b in message.buffers.values()]
        # Posted on the engine loop in call order, so the parts of a request leave in order.
        future = self._engine.submit(self._send_parts(message, parts,
                                                      self._pace(message.nbytes)))
        with self._lock:
            self._in_flight.setdefault(message.request_id, []).append(future)

    async def _send_parts(self, message: Message, parts: list, hold: float = 0.0) -> None:
        if hold > 0:
            await asyncio.sleep(hold)
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
            for future in futures:
                future.cancel()
            raise TimeoutError(f"request {request_id}: messages still on the wire after "
                               f"{timeout} s") from None
        except Exception as exc:
            for future in futures:
                future.cancel()
            raise TransportError(f"request {request_id}: send failed: {exc}") from exc

    def pending(self) -> dict[str, int]:
        with self._lock:
            return {"in_flight_messages": sum(not f.done() for fs in self._in_flight.values()
                                              for f in fs)}

    def shutdown(self) -> None:
        async def close():
            if not self._endpoint.closed:
                await self._endpoint.close()

        self._engine.call(close(), 10)
