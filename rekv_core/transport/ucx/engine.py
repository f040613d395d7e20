"""The thread that owns every UCX call of a process, and the one engine a process shares.

`UcxEngine(loop_nice, host_eager)` runs an asyncio loop on its own thread ("rekv-ucx"), so the
blocking calls of the transport contract can come from any thread: `submit(coro)` schedules a
coroutine there and returns its future, `call(coro, timeout)` waits for its result, `close()`
cancels what still runs and stops the thread.

ucxx keeps one global context per process, so a receiver and a sender pool in one process must
drive it from one engine: `acquire_engine` returns the process's shared engine, starting it on first
use, and `release_engine` gives it back; the last release closes it. The first acquirer's settings
win: a later acquirer asking for others gets the running engine and a warning.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine

from rekv_core.transport.base import TransportError

logger = logging.getLogger(__name__)

# Host-memory tuning (`UcxEngine(host_eager=True)`): every message travels eagerly, so the sender
# needs no rendezvous handshake with a receiver whose loop thread may be waiting for a core, and
# large socket buffers let the kernel take the data in meanwhile. Process-wide, read when
# UCX starts; variables already set win. Not for CUDA memory, which needs rendezvous (zero copy).
HOST_EAGER_ENV = {"UCX_RNDV_THRESH": "inf", "UCX_TCP_SNDBUF": "4M", "UCX_TCP_RCVBUF": "4M"}


class UcxEngine:
    """A thread running an asyncio loop that owns every UCX call of this process.

    Waiting for a message, the loop probes UCX (`receiver._take_frame`), and in ucxx's threaded
    progress mode each probe busy-waits for the progress thread; `loop_nice` > 0 lowers this
    thread's scheduling priority (Linux nice), so that where the data plane shares a core with
    compute, the compute keeps the core. With `host_eager` (`HOST_EAGER_ENV`, applied before UCX
    first starts in this process) the sender needs no handshake with this thread, so a late probe
    does not hold the wire: the kernel's socket buffers take the data in meanwhile."""

    def __init__(self, loop_nice: int = 0, host_eager: bool = False):
        if not 0 <= loop_nice <= 19:
            raise ValueError(f"loop_nice: must lie in [0, 19], got {loop_nice}")
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        # a restarted decode worker binds its listener port again at once, while the kernel may
        # still hold the old process's connections to it
        os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
        for name, value in HOST_EAGER_ENV.items() if host_eager else ():
            os.environ.setdefault(name, value)
        import ucxx  # noqa: F401  (fail here, clearly, when ucxx is missing)

        self.loop = asyncio.new_event_loop()
        self.loop_nice = loop_nice
        self.host_eager = host_eager
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

    @property
    def closed(self) -> bool:
        return self._closed

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


_shared: UcxEngine | None = None
_holders = 0
_shared_lock = threading.Lock()


def acquire_engine(loop_nice: int = 0, host_eager: bool = False) -> UcxEngine:
    """The process's shared engine, started on first use; give it back with `release_engine`."""
    global _shared, _holders
    with _shared_lock:
        if _shared is None:
            _shared, _holders = UcxEngine(loop_nice, host_eager), 0
        elif (loop_nice, host_eager) != (_shared.loop_nice, _shared.host_eager):
            logger.warning("ucx engine: already running with loop_nice=%s host_eager=%s; "
                           "asked for loop_nice=%s host_eager=%s, which are ignored",
                           _shared.loop_nice, _shared.host_eager, loop_nice, host_eager)
        _holders += 1
        return _shared


def release_engine(engine: UcxEngine) -> None:
    """Give back an engine from `acquire_engine`; the last holder's release closes it."""
    global _shared, _holders
    with _shared_lock:
        if engine is not _shared:
            raise ValueError("engine: not the shared engine (released twice, or never acquired)")
        _holders -= 1
        if not _holders:
            _shared = None
            engine.close()  # under the lock: a new engine starts only once this one has stopped
