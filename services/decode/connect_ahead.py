"""Connect ahead: each prefill replica makes its data-plane connection to this decode worker, and
times the link with a probe, before the first handoff needs either.

A UCX endpoint over TCP takes a few hundred milliseconds to wire up, and the prefill side makes
one per decode worker on its first send there; and a streamed handoff rarely times the link (see
`rekv_core.handoff.probe`). Without this, every decode worker's first request to every prefill
replica would wait for the connection (on the CPU bench, 250 ms of a 700 ms TTFT), and the
planner would choose blind until some handoff happened to queue on the wire.

`ConnectAhead(receiver, learner)(peer)`, once `peer` accepts TCP connections, opens a probe receive
on `receiver`, calls `Prefill.Connect` on `peer` with its id and a fresh key, and gives the probe's
link sample to `learner` (the `DecodeConnector`, whose calibration holds the link estimate). It says
how it went: True (connected), False (the replica refused, or its probe failed: its first handoff
connects as it would have anyway), None (not reachable yet, busy probing for another worker, or its
probe did not leave in time: worth trying again; `PrefillPool` does, with backoff). Probes go one at
a time (two at once would each see part of the link), and only while the link is unmeasured: a
replica added later (DNS) only connects, so it never slows the handoffs in flight. Nothing here is
needed for correctness: it moves the wait off the first request and gives the planner a measured
link.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Protocol

import grpc

from rekv_core.handoff.probe import receive_probe
from rekv_core.handoff.seal import new_key
from rekv_core.transport import TransportReceiver
from services import wire_convert
from services.calls import ConnectCall
from services.settings import split_host_port

log = logging.getLogger("rekv.decode.pool")


async def _listening(address: str, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at `address` (host:port, IPv6 in brackets),
    tried without gRPC: a failed RPC would put the peer's channel into reconnect backoff, during
    which the first real handoff to a replica that has just come up would fail at once."""
    try:
        host, port = split_host_port(address, "the prefill replica")
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


# Answers after which asking again later may succeed: not up yet, busy probing another worker,
# or a probe that did not leave in time.
RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.DEADLINE_EXCEEDED)


class LinkLearner(Protocol):
    """What learns from a probe (`DecodeConnector`)."""

    link_measured: bool

    def observe_probe(self, sample: tuple[int, float]) -> float | None: ...


class ConnectAhead:
    def __init__(self, receiver: TransportReceiver, learner: LinkLearner | None,
                 timeout_s: float = 30.0):
        """`learner` None: connect only, never probe (a transport that stamps no arrivals)."""
        self.receiver, self.learner = receiver, learner
        self.timeout_s = timeout_s
        self._probing = asyncio.Lock()  # one probe at a time: two would share the link

    async def __call__(self, peer) -> bool | None:
        if not await _listening(peer.address, self.timeout_s):
            return None  # not up yet; an RPC now would leave the channel in its failure backoff
        if self.learner is None or self.learner.link_measured:
            # a measured link needs no probe: one now would only slow the handoffs in flight
            return await self._connect(peer, None)
        async with self._probing:
            probe = not self.learner.link_measured  # unless the probe before this measured it
            return await self._connect(peer, f"probe/{uuid.uuid4().hex}" if probe else None)

    async def _connect(self, peer, probe_id: str | None) -> bool | None:
        key = new_key()
        receiving = None
        if probe_id is not None:
            self.receiver.open(probe_id)
            receiving = asyncio.ensure_future(asyncio.to_thread(
                receive_probe, self.receiver, probe_id, key, self.timeout_s))
        request = wire_convert.connect_request(ConnectCall(self.receiver.address, probe_id, key))
        try:
            reply = await peer.stub.Connect(request, timeout=self.timeout_s)
            if reply.connected_now:
                log.info("prefill pool: %s connected its data plane to %s in %.0f ms",
                         peer.address, self.receiver.address, reply.connect_ms)
            if receiving is not None:
                self._learn(peer, await receiving, reply)
            return True
        except grpc.aio.AioRpcError as exc:
            if exc.code() in RETRY:
                return None
            log.warning("prefill pool: %s did not connect its data plane ahead (%s: %s)",
                        peer.address, exc.code().name, exc.details())
            return False
        except Exception as exc:  # the probe's receive failed: its checks, its deadline
            log.warning("prefill pool: link probe from %s failed: %s", peer.address, exc)
            return False
        finally:
            if receiving is not None and not receiving.done():  # an error, or cancelled
                self.receiver.abort(probe_id)  # wakes the probe's reader
                await asyncio.gather(receiving, return_exceptions=True)

    def _learn(self, peer, sample: tuple[int, float] | None, reply) -> None:
        if sample is None:
            log.info("prefill pool: link probe from %s (%d bytes in %.1f ms) timed nothing",
                     peer.address, reply.probe_bytes, reply.probe_ms)
            return
        nbytes, seconds = sample
        estimate = self.learner.observe_probe(sample)
        log.info("prefill pool: link probe from %s: %.3f Gb/s (%d bytes back to back in %.1f "
                 "ms); link estimate %s Gb/s", peer.address, nbytes * 8 / seconds / 1e9,
                 nbytes, seconds * 1e3, "none" if estimate is None else f"{estimate:.3f}")
