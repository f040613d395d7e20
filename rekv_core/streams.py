"""The stream discipline: how buffers on a CUDA device pass between streams and threads safely.

Every producer and consumer of device buffers follows four rules (on the CPU every function here
does nothing and every event is None):

1. Whoever produces device buffers for someone else records a `ready` event on the stream that
   produced them, after the producing work (`record_ready`), and hands it over with the buffers
   (`transport.Message.ready`).
2. Whoever reads them on another stream first makes that stream wait for the event and marks every
   device buffer as in use by that stream (`wait_ready`, which calls `Tensor.record_stream`), so the
   caching allocator cannot give the memory to another tensor before the reading work has run.
3. Whoever reads them outside any stream (a NIC's DMA through UCX, a copy to the host) waits for the
   event on the host first (`host_wait`).
4. A copy that stands for a wire runs on a stream of its own (a NIC is not the compute stream);
   senders encode on their own stream (`side_stream`), after the compute that produced their
   inputs; a receiver allocates and zeroes its cache on the compute stream and makes its side
   stream wait for that (`follow`) before writing into it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch


def _cuda_device(buffers: Iterable[torch.Tensor]) -> torch.device | None:
    return next((b.device for b in buffers if b.is_cuda), None)


def side_stream(device: torch.device | None) -> torch.cuda.Stream | None:
    """A stream of its own on a CUDA device (from PyTorch's pool); None elsewhere."""
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.Stream(device)


def on_stream(stream: torch.cuda.Stream | None):
    """Make `stream` current for the block (nothing when None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def follow(stream: torch.cuda.Stream | None, device: torch.device | None = None) -> None:
    """`stream` waits for everything queued so far on the current stream of its device."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device or stream.device))


def record_ready(buffers: Iterable[torch.Tensor]) -> torch.cuda.Event | None:
    """An event after the work queued so far on the current stream of the buffers' device; None
    when no buffer is on a CUDA device."""
    device = _cuda_device(buffers)
    if device is None:
        return None
    event = torch.cuda.Event(blocking=True)  # a host wait on it sleeps rather than spins
    event.record(torch.cuda.current_stream(device))
    return event


def wait_ready(ready: torch.cuda.Event | None, buffers: Iterable[torch.Tensor],
               stream: torch.cuda.Stream | None = None) -> None:
    """Rule 2: `stream` (default: the current one of the buffers' device) waits for `ready`, and
    every device buffer is marked as used by it."""
    buffers = list(buffers)
    device = _cuda_device(buffers)
    if device is None and ready is None:
        return
    if stream is None:
        stream = torch.cuda.current_stream(device)
    if ready is not None:
        stream.wait_event(ready)
    for buffer in buffers:
        if buffer.is_cuda:
            buffer.record_stream(stream)


def host_wait(ready: torch.cuda.Event | None) -> None:
    """Rule 3: block this thread until the work before `ready` has run."""
    if ready is not None:
        ready.synchronize()


def settle(stream: torch.cuda.Stream | None) -> None:
    """Block until everything queued on `stream` has run (so the inputs it reads may be freed)."""
    if stream is not None:
        stream.synchronize()
