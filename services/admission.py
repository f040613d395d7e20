"""Admission control: bounded calls and bounded memory for the handoffs a worker holds.

`Admission(max_calls, max_bytes, what)` admits a call that declares the bytes it will hold
(`admit(nbytes)`, a context manager) while fewer than `max_calls` are admitted and the declared
bytes of all admitted calls stay within `max_bytes`; otherwise it raises `ResourceExhausted` at
once, naming the bound, before anything is allocated for the call. A single call larger than
`max_bytes` can never be admitted; its message says so. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rekv_core.units import MiB
from services.errors import ResourceExhausted


class Admission:
    def __init__(self, max_calls: int, max_bytes: int, what: str):
        if max_calls < 1 or max_bytes < 1:
            raise ValueError(f"admission: bounds must be >= 1, got {max_calls} calls and "
                             f"{max_bytes} bytes")
        self.max_calls, self.max_bytes, self.what = max_calls, max_bytes, what
        self._lock = threading.Lock()
        self.calls = 0
        self.bytes = 0

    @contextmanager
    def admit(self, nbytes: int) -> Iterator[None]:
        with self._lock:
            if nbytes > self.max_bytes:
                raise ResourceExhausted(
                    f"max_inflight_bytes: this {self.what} needs {nbytes / MiB:.1f} MiB, more "
                    f"than the {self.max_bytes / MiB:.1f} MiB this worker holds for all of them")
            if self.calls >= self.max_calls:
                raise ResourceExhausted(f"max_queue: {self.calls} {self.what}s already admitted "
                                        f"(the limit); retry later or elsewhere")
            if self.bytes + nbytes > self.max_bytes:
                raise ResourceExhausted(
                    f"max_inflight_bytes: {self.bytes / MiB:.1f} MiB held by {self.calls} "
                    f"{self.what}s; {nbytes / MiB:.1f} MiB more would pass "
                    f"{self.max_bytes / MiB:.1f} MiB")
            self.calls += 1
            self.bytes += nbytes
        try:
            yield
        finally:
            with self._lock:
                self.calls -= 1
                self.bytes -= nbytes
