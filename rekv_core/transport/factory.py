"""Transports chosen by name: `create_receiver(name, options)` and `create_sender_pool(...)`.

`TRANSPORTS` names them: "inprocess" (one process: tests, demos, warm-up; `inprocess_registry`)
and "ucx" (between processes and machines; `ucx`, imported only when chosen). `TransportOptions`
says where a receiver listens and how the UCX engine runs; `pace_gbps` > 0 puts every sender of a
pool behind a `PacedSender` of that rate. A UCX receiver and a UCX sender pool in one process share
the process's engine; each gives it back on `shutdown()`, and the last one closes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rekv_core.transport.base import TransportReceiver
from rekv_core.transport.pool import SenderPool

TRANSPORTS = ("inprocess", "ucx")


@dataclass(frozen=True)
class TransportOptions:
    host: str = "127.0.0.1"  # where a UCX receiver listens, and what its address names
    port: int = 0  # a UCX receiver's port; 0: any free one
    device: str = "cpu"  # UCX: where received buffers sent from device memory land
    loop_nice: int = 0  # the UCX engine thread's nice value, in [0, 19]
    host_eager: bool = False  # UCX sends host memory eagerly (`ucx.HOST_EAGER_ENV`)
    pace_gbps: float = 0.0  # senders emulate a link of this rate; 0: as fast as the wire
    max_message_bytes: int = 0  # a receiver refuses a message announcing more; 0: no limit

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) \
                or not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be an integer in [0, 65535], got {self.port!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: not a torch device, got {self.device!r}") from None
        if isinstance(self.loop_nice, bool) or not isinstance(self.loop_nice, int) \
                or not 0 <= self.loop_nice <= 19:
            raise ValueError(f"loop_nice: must be an integer in [0, 19], got {self.loop_nice!r}")
        if not isinstance(self.host_eager, bool):
            raise ValueError(f"host_eager: must be True or False, got {self.host_eager!r}")
        if isinstance(self.max_message_bytes, bool) or not isinstance(
                self.max_message_bytes, int) or self.max_message_bytes < 0:
            raise ValueError(f"max_message_bytes: must be an integer >= 0 (0: no limit), got "
                             f"{self.max_message_bytes!r}")
        if isinstance(self.pace_gbps, bool) or not isinstance(self.pace_gbps, (int, float)) \
                or not math.isfinite(self.pace_gbps) or self.pace_gbps < 0:
            raise ValueError(f"pace_gbps: must be a finite number >= 0 (0: no pacing), "
                             f"got {self.pace_gbps!r}")


def _inprocess_receiver(options: TransportOptions) -> TransportReceiver:
    from rekv_core.transport.inprocess_registry import RegisteredReceiver

    return RegisteredReceiver()


def _inprocess_pool(options: TransportOptions) -> SenderPool:
    from rekv_core.transport.inprocess_registry import InProcessSenderPool

    return InProcessSenderPool(options.pace_gbps)


def _ucx_receiver(options: TransportOptions) -> TransportReceiver:
    from rekv_core.transport.ucx import UcxReceiver, acquire_engine, release_engine

    engine = acquire_engine(options.loop_nice, options.host_eager)
    try:
        return UcxReceiver(engine, options.host, options.port, device=options.device,
                           shared_engine=True, max_message_bytes=options.max_message_bytes)
    except BaseException:
        release_engine(engine)
        raise


def _ucx_pool(options: TransportOptions) -> SenderPool:
    from rekv_core.transport.ucx import UcxSenderPool, acquire_engine

    engine = acquire_engine(options.loop_nice, options.host_eager)
    return UcxSenderPool(engine, pace_gbps=options.pace_gbps, shared_engine=True)


_RECEIVERS: dict[str, Callable[[TransportOptions], TransportReceiver]] = {
    "inprocess": _inprocess_receiver, "ucx": _ucx_receiver}
_POOLS: dict[str, Callable[[TransportOptions], SenderPool]] = {
    "inprocess": _inprocess_pool, "ucx": _ucx_pool}


def _check(name: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(f"transport: must be one of {', '.join(TRANSPORTS)}, got {name!r}")


def create_receiver(name: str, options: TransportOptions = TransportOptions()
                    ) -> TransportReceiver:
    """The receiver of transport `name`; `shutdown()` it once done."""
    _check(name)
    return _RECEIVERS[name](options)


def create_sender_pool(name: str, options: TransportOptions = TransportOptions()) -> SenderPool:
    """The sender pool of transport `name`; `shutdown()` it once done."""
    _check(name)
    return _POOLS[name](options)
