"""Connect ahead: each prefill replica makes its data-plane connection to this decode worker, and
times the link with a probe, before the first handoff needs either.

A UCX endpoint over TCP takes a few hundred milliseconds to wire up, and the prefill side makes
one per decode worker on its first send there; and a streamed handoff rarely times the link (see
`rekv_core.handoff.probe`). Without this, every decode worker's first request to every prefill
replica would wait for the connection (on the CPU bench, 250 ms of a 700 ms TTFT), and the
planner would choose blind until some handoff happened to queue on the wire.

`ConnectAhead(receiver, link)(peer)`, once `peer` accepts TCP connections, opens a probe receive
on `receiver`, calls `Prefill.Connect` on `peer` with its id and a fresh key, and feeds the
probe's link sample to `link` (the decode calibration's `LinkEstimate`). It says how it went:
True (connected), False (the replica refused, or its probe failed: its first handoff connects as
it would have anyway), None (not reachable yet: worth trying again; `PrefillPool` does, with
backoff). Nothing here is needed for correctness: it moves the wait off the first request and
gives the planner a measured link.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from rekv_core.handoff.probe import receive_probe
from rekv_core.handoff.seal import new_key
from rekv_core.plan.estimates import LinkEstimate
from rekv_core.transport import TransportReceiver
from services import wire_convert
from services.calls import ConnectCall

log = logging.getLogger("rekv.decode.pool")


async def _listening(address: str, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at `address` (host:port, IPv6 in brackets),
    tried without gRPC: a failed RPC would put the peer's channel into reconnect backoff, during
    which the first real handoff to a replica that has just come up would fail at once."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)),
                                           timeout_s)
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


class ConnectAhead:
    def __init__(self, receiver: TransportReceiver, link: LinkEstimate | None,
                 timeout_s: float = 30.0):
        """`link` None: connect only, no probe."""
        self.receiver, self.link = receiver, link
        self.timeout_s = timeout_s

    async def __call__(self, peer) -> bool | None:
        if not await _listening(peer.address, self.timeout_s):
            return None  # not up yet; an RPC now would leave the channel in its failure backoff
        probe_id = f"probe/{uuid.uuid4().hex}" if self.link is not None else None
        key = new_key()
        receiving = None
        if probe_id is not None:
            self.receiver.open(probe_id)
            receiving = asyncio.ensure_future(asyncio.to_thread(
                receive_probe, self.receiver, probe_id, key, self.timeout_s))
        request = wire_convert.connect_request(ConnectCall(self.receiver.address, probe_id, key))
        try:
            reply = await peer.stub.Connect(request, timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if receiving is not None:
                self.receiver.abort(probe_id)  # wakes the probe's reader
                await asyncio.gather(receiving, return_exceptions=True)
            if isinstance(exc, asyncio.CancelledError):  # the pool closes, or lost the peer
                raise
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return None
            log.warning("prefill pool: %s did not connect its data plane ahead (%s: %s)",
                        peer.address, exc.code().name, exc.details())
            return False
        if reply.connected_now:
            log.info("prefill pool: %s connected its data plane to %s in %.0f ms",
                     peer.address, self.receiver.address, reply.connect_ms)
        if receiving is not None:
            return await self._learn(peer, receiving, reply)
        return True

    async def _learn(self, peer, receiving: asyncio.Future, reply) -> bool:
        try:
            sample = await receiving
        except Exception as exc:
            log.warning("prefill pool: link probe from %s failed: %s", peer.address, exc)
            return False
        if sample is None:
            log.info("prefill pool: link probe from %s (%d bytes in %.1f ms) timed nothing",
                     peer.address, reply.probe_bytes, reply.probe_ms)
            return True
        nbytes, seconds = sample
        self.link.observe(nbytes, seconds)
        log.info("prefill pool: link probe from %s: %.3f Gb/s (%d bytes back to back in %.1f "
                 "ms); link estimate %.3f Gb/s", peer.address, nbytes * 8 / seconds / 1e9,
                 nbytes, seconds * 1e3, self.link.gbps)
        return True
