"""A slower link emulated in front of any sender: `PacedSender(inner, gbps)`.

Each message is held until a link of `gbps` would have finished carrying it, then forwarded to
`inner.send`: the link is free again at `link_free_at = max(now, link_free_at) + nbytes·8 / rate`,
and the message leaves at that `link_free_at`, so messages queue behind each other in send order.
`send` returns at once, as the contract requires; one forwarding thread ("rekv-pace") releases the
held messages in order. `flush(request_id, timeout)` waits until that request's messages are
forwarded, then flushes `inner` with the time left. An error from `inner.send` fails that request's
flush. A flush that gives up (past its timeout, or on an error) drops that request's held messages
and makes `inner` drop what it still has for it, so nothing of it is sent later or kept.
`pending()` counts held messages plus inner's in-flight ones. `shutdown()` stops the thread
(messages still held are dropped, and their requests' flushes raise `TransportError`) and shuts
`inner` down; it may be called twice. `paced(sender, gbps)` wraps only when `gbps` > 0.
"""

from __future__ import annotations

import collections
import threading
import time

from rekv_core.transport.base import Message, Pending, TransportError, TransportSender


class PacedSender(TransportSender):
    def __init__(self, inner: TransportSender, gbps: float):
        if not gbps > 0:
            raise ValueError(f"pace_gbps: must be positive, got {gbps}")
        self.inner = inner
        self.gbps = gbps
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[float, Message]] = collections.deque()
        self._held: collections.Counter[str] = collections.Counter()  # not yet forwarded
        self._errors: dict[str, Exception] = {}  # inner.send failed for these requests
        self._dropped: set[str] = set()  # messages of these requests were held at shutdown
        self._abandoned: set[str] = set()  # their flush gave up: what is still held never leaves
        self._link_free_at = 0.0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rekv-pace", daemon=True)
        self._thread.start()

    def send(self, message: Message) -> None:
        with self._cond:
            if self._stopped:
                raise TransportError("paced sender: shut down")
            now = time.monotonic()
            start = max(now, self._link_free_at)
            self._link_free_at = start + message.nbytes * 8 / (self.gbps * 1e9)
            self._queue.append((self._link_free_at, message))
            self._held[message.request_id] += 1
            self._cond.notify_all()

    def _next(self) -> Message | None:
        """The next message once its time has come, or None when stopped."""
        with self._cond:
            while not self._stopped:
                if self._queue:
                    wait = self._queue[0][0] - time.monotonic()
                    if wait <= 0:
                        return self._queue.popleft()[1]
                    self._cond.wait(wait)
                else:
                    self._cond.wait()
            return None

    def _run(self) -> None:
        while (message := self._next()) is not None:
            request_id = message.request_id
            error = None
            try:
                self.inner.send(message)
            except Exception as exc:  # reported by this request's flush
                error = exc
            with self._cond:
                if self._stopped:
                    return
                abandoned = request_id in self._abandoned
                if error is not None and not abandoned:
                    self._errors.setdefault(request_id, error)
                self._release(request_id)
            if abandoned:  # sent while its flush gave up: the inner sender lets go of it too
                self._forget_inner(request_id)

    def _release(self, request_id: str) -> None:
        """One held message of `request_id` is gone (sent or dropped); call with the lock."""
        self._held[request_id] -= 1
        if not self._held[request_id]:
            del self._held[request_id]
            self._abandoned.discard(request_id)
        self._cond.notify_all()

    def _abandon(self, request_id: str) -> None:
        """A flush gave up: drop what is still held and make the inner sender drop the rest."""
        with self._cond:
            kept = collections.deque(item for item in self._queue
                                     if item[1].request_id != request_id)
            for _ in range(len(self._queue) - len(kept)):
                self._release(request_id)
            self._queue = kept
            if self._held[request_id]:  # one is being sent now: `_run` lets go of it after
                self._abandoned.add(request_id)
            else:
                self._held.pop(request_id, None)
            self._errors.pop(request_id, None)
        self._forget_inner(request_id)

    def _forget_inner(self, request_id: str) -> None:
        try:
            self.inner.flush(request_id, 0)
        except (TimeoutError, TransportError):
            pass  # the inner sender cancelled what it still had: the outcome wanted here

    def flush(self, request_id: str, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            done = self._cond.wait_for(
                lambda: not self._held[request_id] or request_id in self._dropped, timeout)
        if not done:
            self._abandon(request_id)
            raise TimeoutError(f"request {request_id}: messages still on the wire after "
                               f"{timeout} s")
        with self._cond:
            if request_id in self._dropped:
                self._dropped.discard(request_id)
                raise TransportError(f"request {request_id}: paced sender shut down with "
                                     f"messages held")
            error = self._errors.pop(request_id, None)
        if error is not None:
            self._abandon(request_id)
            raise TransportError(f"request {request_id}: send failed: {error}") from error
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            self.inner.flush(request_id, remaining)
        except TimeoutError:
            raise TimeoutError(f"request {request_id}: messages still on the wire after "
                               f"{timeout} s") from None

    @property
    def broken(self) -> bool:
        return self.inner.broken

    def pending(self) -> Pending:
        with self._cond:
            held = sum(self._held.values())
        return self.inner.pending() + Pending(in_flight_messages=held)

    def shutdown(self) -> None:
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._dropped.update(self._held)
            self._queue.clear()
            self._held.clear()
            self._cond.notify_all()
        self._thread.join(10)  # at most one inner.send, which never blocks, is under way
        self.inner.shutdown()


def paced(sender: TransportSender, gbps: float) -> TransportSender:
    """`sender` behind a link of `gbps`, or `sender` itself when `gbps` is 0."""
    return PacedSender(sender, gbps) if gbps > 0 else sender
