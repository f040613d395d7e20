"""The decode side's connect-ahead (`services/decode/connect_ahead.py`) against a stand-in prefill
replica: it waits for the replica to listen, probes only while the link is unmeasured and one
replica at a time, asks again after answers that may change, and never leaves a probe's receive
open."""

import asyncio

import grpc
import pytest

from rekv_core.handoff.probe import send_probe
from rekv_core.transport import TransportOptions, create_receiver, create_sender_pool
from rekv_core.units import MiB
from services.decode.connect_ahead import ConnectAhead
from services.rpc import rekv_pb2


class _Replica:
    """A prefill replica's `Connect`: sends the probe asked for over the in-process transport,
    or answers with `status`; counts calls and how many ran at once."""

    def __init__(self, link, status: grpc.StatusCode | None = None, shared: dict | None = None):
        self.link, self.status = link, status
        self.requests = []
        self.shared = shared if shared is not None else {"running": 0, "most": 0}

    async def Connect(self, request, timeout=None):
        self.requests.append(request)
        self.shared["running"] += 1
        self.shared["most"] = max(self.shared["most"], self.shared["running"])
        try:
            await asyncio.sleep(0.05)
            if self.status is not None:
                raise grpc.aio.AioRpcError(self.status, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "as told")
            if request.probe_id:
                await asyncio.to_thread(send_probe, self.link.sender, request.probe_id,
                                        request.probe_key, (MiB // 2,), 0.0, 10.0)
            return rekv_pb2.ConnectResponse(connected_now=True, connect_ms=1.0)
        finally:
            self.shared["running"] -= 1


class _Peer:
    def __init__(self, address: str, stub: _Replica):
        self.address, self.stub = address, stub


class _Link:
    """The in-process transport's receiver (the decode worker's) and a sender to it."""

    def __enter__(self):
        self.receiver = create_receiver("inprocess", TransportOptions())
        self.pool = create_sender_pool("inprocess", TransportOptions())
        self.sender = self.pool.to(self.receiver.address)
        return self

    def __exit__(self, *exc):
        self.pool.shutdown()
        self.receiver.shutdown()


class _Learner:
    """What a `DecodeConnector` is to `ConnectAhead`: the link estimate's keeper."""

    def __init__(self):
        self.samples = []

    @property
    def link_measured(self):
        return bool(self.samples)

    def observe_probe(self, sample):
        self.samples.append(sample)
        return sample[0] * 8 / sample[1] / 1e9


async def _listener():
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_a_replica_that_is_not_listening_is_not_called():
    async def scenario():
        with _Link() as link:
            replica = _Replica(link)
            ahead = ConnectAhead(link.receiver, _Learner(), timeout_s=2.0)
            assert await ahead(_Peer("127.0.0.1:1", replica)) is None
            assert replica.requests == []

    asyncio.run(scenario())


def test_probes_go_one_at_a_time_and_only_while_the_link_is_unmeasured():
    async def scenario():
        server, address = await _listener()
        with _Link() as link:
            shared = {"running": 0, "most": 0}
            replicas = [_Replica(link, shared=shared) for _ in range(3)]
            unmeasured = ConnectAhead(link.receiver, _Learner(), timeout_s=5.0)
            answers = await asyncio.gather(*(unmeasured(_Peer(address, r)) for r in replicas))
            assert answers == [True, True, True]
            # the in-process link stamps no arrivals: each probe timed nothing, so each replica
            # was asked for one, but never two at once
            assert all(r.requests[0].probe_id for r in replicas)
            assert shared["most"] == 1 and link.receiver.pending().idle
            measured = _Learner()
            measured.observe_probe((MiB, 0.01))
            later = _Replica(link)
            assert await ConnectAhead(link.receiver, measured)(_Peer(address, later)) is True
            assert later.requests[0].probe_id == ""  # connected only: handoffs keep the link
        server.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("status, answer", [
    (grpc.StatusCode.UNAVAILABLE, None), (grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, None), (grpc.StatusCode.UNIMPLEMENTED, False),
    (grpc.StatusCode.INVALID_ARGUMENT, False)])
def test_a_refusal_says_whether_to_ask_again_and_frees_the_probe(status, answer):
    async def scenario():
        server, address = await _listener()
        with _Link() as link:
            ahead = ConnectAhead(link.receiver, _Learner(), timeout_s=5.0)
            assert await ahead(_Peer(address, _Replica(link, status))) is answer
            assert link.receiver.pending().idle
        server.close()

    asyncio.run(scenario())


def test_a_cancelled_connect_frees_the_probe():
    async def scenario():
        server, address = await _listener()
        with _Link() as link:
            replica = _Replica(link)
            replica.Connect = lambda request, timeout=None: asyncio.sleep(30)  # never answers
            task = asyncio.ensure_future(ConnectAhead(link.receiver, _Learner())(
                _Peer(address, replica)))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert link.receiver.pending().idle
        server.close()

    asyncio.run(scenario())
