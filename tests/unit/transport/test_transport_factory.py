"""Transports chosen by name: options, the in-process and UCX receivers and pools, the shared UCX
engine; and the contract's shared parts: the sender pool's shutdown when a peer is gone, the
ordered receive states."""

import logging
import threading

import pytest
import torch

from rekv_core.transport import (TRANSPORTS, Message, Pending, ReceiveState, SenderPool,
                                 TransportError, TransportOptions, TransportSender,
                                 create_receiver, create_sender_pool)
from rekv_core.transport.pacing import PacedSender


def _msg(request_id, seq, nbytes=16):
    return Message(request_id, seq, f"m{seq}", b"hdr\x00\xff",
                   {"data": torch.arange(nbytes, dtype=torch.int64).to(torch.uint8) + seq})


def _round_trip(receiver, pool, request_id, sizes):
    sender = pool.to(receiver.address)
    assert pool.to(receiver.address) is sender
    receiver.open(request_id)
    sent = [_msg(request_id, i, n) for i, n in enumerate(sizes)]
    for m in sent:
        sender.send(m)
    got = [receiver.recv(request_id, timeout=10) for _ in sent]
    sender.flush(request_id, timeout=10)
    receiver.close(request_id)
    assert [(g.seq, g.name, g.header) for g in got] == [(m.seq, m.name, m.header) for m in sent]
    assert all(torch.equal(g.buffers["data"], m.buffers["data"]) for g, m in zip(got, sent))
    assert pool.pending().idle
    assert receiver.pending().idle


def _threads(name):
    return [t for t in threading.enumerate() if t.name == name]


@pytest.mark.parametrize("create", [create_receiver, create_sender_pool])
def test_unknown_transport_is_named(create):
    with pytest.raises(ValueError, match=r"transport: must be one of inprocess, ucx, got 'x'"):
        create("x", TransportOptions())
    assert TRANSPORTS == ("inprocess", "ucx")


@pytest.mark.parametrize("field,value", [
    ("host", ""), ("port", -1), ("port", 65536), ("port", "80"), ("device", "toaster"),
    ("loop_nice", 20), ("loop_nice", -1), ("host_eager", "yes"), ("pace_gbps", -0.5),
    ("pace_gbps", float("nan")), ("pace_gbps", float("inf"))])
def test_options_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        TransportOptions(**{field: value})


def test_options_defaults_and_good_values():
    assert TransportOptions() == TransportOptions("127.0.0.1", 0, "cpu", 0, False, 0.0)
    options = TransportOptions(host="0.0.0.0", port=65535, device="cuda:1", loop_nice=19,
                               host_eager=True, pace_gbps=2)
    assert options.pace_gbps == 2 and options.device == "cuda:1"


def test_inprocess_receiver_and_pool_round_trip():
    receiver = create_receiver("inprocess", TransportOptions())
    pool = create_sender_pool("inprocess", TransportOptions())
    try:
        assert receiver.address.startswith("inprocess:")
        _round_trip(receiver, pool, "a", [16, 300_000, 0, 5])
        with pytest.raises(ValueError, match="inprocess:0"):
            pool.to("inprocess:0")
    finally:
        pool.shutdown()
        receiver.shutdown()
    assert not _threads("rekv-inprocess-wire")
    with pytest.raises(ValueError, match=receiver.address):  # unregistered on shutdown
        create_sender_pool("inprocess").to(receiver.address)


def test_each_inprocess_receiver_has_its_own_address():
    first, second = create_receiver("inprocess"), create_receiver("inprocess")
    pool = create_sender_pool("inprocess")
    try:
        assert first.address != second.address
        assert pool.to(first.address) is not pool.to(second.address)
        _round_trip(second, pool, "b", [8, 8])
        assert first.pending().idle
    finally:
        pool.shutdown()
        first.shutdown()
        second.shutdown()


def test_paced_inprocess_pool_wraps_its_senders():
    receiver = create_receiver("inprocess")
    pool = create_sender_pool("inprocess", TransportOptions(pace_gbps=8.0))
    try:
        assert isinstance(pool.to(receiver.address), PacedSender)
        _round_trip(receiver, pool, "p", [1 << 16] * 3)
    finally:
        pool.shutdown()
        receiver.shutdown()
    assert not _threads("rekv-pace")


def test_ucx_receiver_and_pool_share_one_engine_until_both_shut_down():
    options = TransportOptions(host="127.0.0.1", port=0)
    receiver = create_receiver("ucx", options)
    pool = create_sender_pool("ucx", options)
    engine = receiver.engine
    loop_thread = [t for t in _threads("rekv-ucx") if t.native_id == engine.thread_id]
    try:
        assert pool.engine is engine and len(loop_thread) == 1
        assert receiver.address.startswith("127.0.0.1:")
        _round_trip(receiver, pool, "u", [16, 300_000, 0, 1 << 20])
    finally:
        receiver.shutdown()
        assert loop_thread[0].is_alive() and not engine.closed  # the pool still holds it
        pool.shutdown()
    assert engine.closed
    loop_thread[0].join(5)
    assert not loop_thread[0].is_alive()
    with pytest.raises(TransportError, match="shut down"):
        receiver.open("late")


def test_a_later_acquirer_gets_the_running_engine_and_a_warning(caplog):
    receiver = create_receiver("ucx", TransportOptions(loop_nice=3))
    try:
        with caplog.at_level(logging.WARNING, logger="rekv_core.transport.ucx.engine"):
            pool = create_sender_pool("ucx", TransportOptions(loop_nice=5, host_eager=True))
        assert pool.engine is receiver.engine and receiver.engine.loop_nice == 3
        assert any("loop_nice=5" in r.getMessage() for r in caplog.records)
        pool.shutdown()
    finally:
        receiver.shutdown()
    assert receiver.engine.closed


class _Sender(TransportSender):
    def __init__(self, fails):
        self.fails, self.shut = fails, False

    def send(self, message): ...

    def flush(self, request_id, timeout=None): ...

    def pending(self):
        return Pending(in_flight_messages=2)

    def shutdown(self):
        self.shut = True
        if self.fails:
            raise ConnectionError("peer gone")


class _Pool(SenderPool):
    def _connect(self, address):
        return _Sender(fails=address == "gone:1")


def test_pool_shutdown_logs_a_gone_peer_and_shuts_the_others(caplog):
    pool = _Pool()
    gone, alive = pool.to("gone:1"), pool.to("alive:2")
    assert pool.pending().in_flight_messages == 4
    with caplog.at_level(logging.WARNING, logger="rekv_core.transport.pool"):
        pool.shutdown()
    assert gone.shut and alive.shut
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "gone:1" in caplog.records[0].getMessage()
    assert "peer gone" in caplog.records[0].getMessage()
    assert pool.pending().idle
    with pytest.raises(TransportError, match="shut down"):
        pool.to("alive:2")


def test_receive_states_are_ordered():
    assert ReceiveState.OPEN < ReceiveState.DRAINING < ReceiveState.CLOSED
    assert [s.value for s in ReceiveState] == [1, 2, 3]
    assert max(ReceiveState.DRAINING, ReceiveState.OPEN) is ReceiveState.DRAINING
