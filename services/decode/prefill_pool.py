"""The prefill replicas a decode worker negotiates with, and the choice of one per request.

`--prefill-address` names the pool in one of three forms:
- `host:port`: one prefill service;
- `host:port,host:port,...`: a fixed list;
- `dns:///name:port`: every address `name` resolves to (a Kubernetes headless Service's A records,
  one per ready prefill pod), resolved again every `refresh_s` seconds, so replicas that come and
  go are picked up without a restart.

`PrefillPool.pick()` returns the peer with the least load as this worker knows it: the handoffs it
has in flight with that peer plus the queue that peer last reported in its `Handoff` reply
(`report`); ties go round robin. A peer whose call failed as unreachable (`UNAVAILABLE`) is left
out for `down_s` seconds, or until every peer is out, when all are tried again; the request that
saw the failure recomputes its prompt locally (see the decode server), so none is lost. A peer that
refused this worker's model fingerprint (`mark_incompatible`: it serves another model, e.g. during
a rolling upgrade) is left out for `incompatible_s` seconds, logged once with both fingerprints;
when every peer is incompatible `pick()` raises `NoCompatiblePeer` and the request recomputes
locally; `incompatible()` says which peers are left out (the metrics read it). Each peer
keeps one gRPC channel; the prefill side keeps one UCX endpoint per decode worker it sends to.
With `on_added` (`connect_ahead.ConnectAhead`), each new peer is asked to make that endpoint at
once, in the background, and asked again (after 0.5 s, then twice as long each time, up to
`refresh_s`) while `on_added` answers None (not reachable yet); `start()` waits up to
`start_wait_s` for the first peers' first answers, so a decode worker that reports ready has its
data plane connected to every prefill replica that was up. A replica that restarts at the same
address is not asked again: its first handoff connects, as before (asking it would race the
restart, and an RPC refused then leaves the peer's gRPC channel in reconnect backoff, during
which the first real handoff fails at once).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from services.rpc import rekv_pb2_grpc
from services.settings import parse_prefill_address, split_host_port

log = logging.getLogger("rekv.decode.pool")


class NoCompatiblePeer(ConnectionError):
    """Every known prefill replica serves another model than this worker."""


def resolve(target: str) -> list[str]:
    """Every IPv4/IPv6 address of `name:port`, as sorted `host:port` strings."""
    host, port = split_host_port(target, "the DNS target")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = {f"[{a[4][0]}]:{port}" if ":" in a[4][0] else f"{a[4][0]}:{port}" for a in infos}
    return sorted(found)


@dataclass
class PrefillPeer:
    address: str
    channel: grpc.aio.Channel
    stub: rekv_pb2_grpc.PrefillStub
    in_flight: int = 0  # this worker's handoffs with the peer now
    reported_queue: int = 0  # the peer's own count, from its last reply
    down_until: float = 0.0
    incompatible_until: float = 0.0  # left out until then: it serves another model
    calls: int = field(default=0)

    @property
    def load(self) -> int:
        return self.in_flight + self.reported_queue


class PrefillPool:
    def __init__(self, prefill_address: str, refresh_s: float = 5.0, down_s: float = 5.0,
                 connect: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel,
                 on_added: Callable[[PrefillPeer], Awaitable[bool | None]] | None = None,
                 start_wait_s: float = 5.0, incompatible_s: float = 60.0):
        """`connect(address)` makes a peer's channel (the decode server passes `tls`'s)."""
        self._connect = connect
        self._on_added, self.start_wait_s = on_added, start_wait_s
        self._added: dict[str, asyncio.Task] = {}  # by address: asking it, or done asking
        self._answered: dict[str, asyncio.Event] = {}  # by address: it answered once
        self.kind, targets = parse_prefill_address(prefill_address)
        self.target = targets[0] if self.kind == "dns" else None
        self.refresh_s, self.down_s, self.incompatible_s = refresh_s, down_s, incompatible_s
        self.peers: dict[str, PrefillPeer] = {}
        self._retired: list[PrefillPeer] = []
        self._turn = itertools.count()
        self._refresher: asyncio.Task | None = None
        if self.kind == "static":
            self._update(targets)

    async def start(self) -> None:
        """Resolve a DNS target now and keep refreshing it; then wait (at most `start_wait_s`)
        for the first peers' `on_added`."""
        if self.kind == "dns":
            await self.refresh()
            self._refresher = asyncio.create_task(self._refresh_forever())
        self._announce()
        answered = [self._answered[a] for a in self.peers if a in self._answered]
        if answered:
            waits = [asyncio.ensure_future(a.wait()) for a in answered]
            await asyncio.wait(waits, timeout=self.start_wait_s)
            for wait in waits:
                wait.cancel()

    def _announce(self) -> None:
        """Start `on_added` for every peer that has not had it (needs the running loop), with
        an event set once the peer first answered."""
        if self._on_added is None:
            return
        for address, peer in self.peers.items():
            if address not in self._added:
                self._answered[address] = asyncio.Event()
                self._added[address] = asyncio.ensure_future(
                    self._until_added(peer, self._answered[address]))

    async def _until_added(self, peer: PrefillPeer, answered: asyncio.Event) -> None:
        delay = 0.5
        try:
            while await self._on_added(peer) is None:
                answered.set()
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.refresh_s)
        except Exception as exc:  # only ever a lost head start: the handoffs go on without it
            log.warning("prefill pool: on_added for %s failed: %s", peer.address, exc)
        finally:
            answered.set()

    async def refresh(self) -> None:
        try:
            addresses = await asyncio.to_thread(resolve, self.target)
        except OSError as exc:  # keep the peers we have; the next refresh tries again
            log.warning("prefill pool: cannot resolve %s: %s", self.target, exc)
            return
        self._update(addresses)
        self._announce()
        idle = [p for p in self._retired if not p.in_flight]
        self._retired = [p for p in self._retired if p.in_flight]
        for peer in idle:
            await peer.channel.close()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    def _update(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.peers:
                channel = self._connect(address)
                self.peers[address] = PrefillPeer(address, channel,
                                                  rekv_pb2_grpc.PrefillStub(channel))
                log.info("prefill pool: added %s", address)
        for address in [a for a in self.peers if a not in addresses]:
            self._retired.append(self.peers.pop(address))  # closed once its calls are done
            if address in self._added:
                self._added.pop(address).cancel()
                self._answered.pop(address)
            log.info("prefill pool: removed %s", address)

    def pick(self) -> PrefillPeer:
        """The least loaded compatible peer that is not down (every compatible one when all are
        down); `NoCompatiblePeer` when every peer serves another model."""
        if not self.peers:
            raise ConnectionError(f"prefill pool: no prefill address known for "
                                  f"{self.target or 'the configured list'}")
        now = time.monotonic()
        peers = [p for p in self.peers.values() if p.incompatible_until <= now]
        if not peers:
            raise NoCompatiblePeer(f"prefill pool: every replica serves another model "
                                   f"({', '.join(sorted(self.peers))})")
        candidates = [p for p in peers if p.down_until <= now] or peers
        offset = next(self._turn)
        order = candidates[offset % len(candidates):] + candidates[:offset % len(candidates)]
        peer = min(order, key=lambda p: p.load)
        peer.in_flight += 1
        peer.calls += 1
        return peer

    def report(self, peer: PrefillPeer, reported_queue: int | None = None,
               unreachable: bool = False) -> None:
        """The call with `peer` ended: with the queue it reported, or unreachable."""
        peer.in_flight -= 1
        if reported_queue is not None:
            peer.reported_queue = reported_queue
        if unreachable:
            peer.down_until = time.monotonic() + self.down_s
            log.warning("prefill pool: %s unreachable, left out for %.0f s", peer.address,
                        self.down_s)

    def mark_incompatible(self, peer: PrefillPeer, theirs: str, ours: str) -> None:
        """`peer` refused this worker's model fingerprint `ours`, serving `theirs`: leave it out
        for `incompatible_s` seconds (the call with it has ended: `report` it too)."""
        peer.incompatible_until = time.monotonic() + self.incompatible_s
        log.warning("prefill pool: %s serves another model (fingerprint %s, this worker's %s); "
                    "left out for %.0f s", peer.address, theirs or "unknown", ours,
                    self.incompatible_s)

    def incompatible(self) -> dict[str, bool]:
        """Each known peer's address, and whether it is left out now for serving another
        model."""
        now = time.monotonic()
        return {a: p.incompatible_until > now for a, p in dict(self.peers).items()}

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        for task in self._added.values():
            task.cancel()
        await asyncio.gather(*self._added.values(), return_exceptions=True)
        self._added.clear()
        self._answered.clear()
        for peer in [*self.peers.values(), *self._retired]:
            await peer.channel.close()
        self.peers.clear()
        self._retired.clear()
