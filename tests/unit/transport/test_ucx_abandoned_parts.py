"""A message's parts given up on stay alive until their receives end (`receiver._all_parts`).

ucxx's receive has no cancel: a posted receive writes into its buffer whenever the part arrives,
even after the task awaiting it is cancelled. A decode service whose reader gave up on a stalled
transfer crashed (a segmentation fault) once the link came back and the late parts landed in
freed memory (tests/system/test_fault_link.py). Here fake receives stand for UCX's: each holds
its buffer until its event is set, as a posted receive holds its memory until the part lands."""

import asyncio
import gc
import weakref

import pytest
import torch

from rekv_core.transport import TransportError
from rekv_core.transport.ucx import receiver


async def _posted(buffer: torch.Tensor, arrives: asyncio.Event) -> None:
    await arrives.wait()
    buffer.fill_(7)  # where UCX would write the late part


def test_parts_given_up_on_are_kept_until_they_land_then_released():
    async def _landed_now(buffer):
        buffer.fill_(1)

    async def scenario():
        arrives = asyncio.Event()
        landed = torch.zeros(4, dtype=torch.uint8)
        late = [torch.zeros(4, dtype=torch.uint8) for _ in range(2)]
        watch = [weakref.ref(b) for b in late]
        receives = [_landed_now(landed), *(_posted(b, arrives) for b in late)]
        del late
        with pytest.raises(TransportError, match="2 part"):
            await receiver._all_parts(receives, give_up=lambda: True)
        del receives
        gc.collect()
        kept = list(receiver.ABANDONED_PARTS)
        assert len(kept) == 2 and not any(p.cancelled() or p.done() for p in kept)
        assert all(w() is not None for w in watch), "a given-up part's buffer was freed"
        arrives.set()  # the stalled parts land after all
        for _ in range(3):
            await asyncio.sleep(0)
        assert receiver.ABANDONED_PARTS.isdisjoint(kept)
        assert all(p.done() and not p.cancelled() for p in kept)
        del kept
        gc.collect()
        assert all(w() is None for w in watch), "a landed part's buffer is still held"

    asyncio.run(scenario())


def test_a_late_parts_error_is_retrieved_quietly():
    """An abandoned part that fails (its endpoint closed) is released without an unretrieved
    exception for asyncio to log."""
    async def scenario():
        fails = asyncio.Event()

        async def broken():
            await fails.wait()
            raise RuntimeError("endpoint closed")

        with pytest.raises(TransportError):
            await receiver._all_parts([broken()], give_up=lambda: True)
        (part,) = receiver.ABANDONED_PARTS
        fails.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert not receiver.ABANDONED_PARTS
        assert part._log_traceback is False  # retrieved by the done callback, not by us
        assert isinstance(part.exception(), RuntimeError)

    asyncio.run(scenario())
