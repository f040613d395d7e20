"""A slower link emulated in front of any sender: messages are held as long as the link would
carry them, in order, without blocking `send`; flush, pending and shutdown follow the contract."""

import threading
import time

import pytest
import torch

from rekv_core.transport import Message, TransportError, TransportSender
from rekv_core.transport.inprocess import InProcessLink
from rekv_core.transport.pacing import PacedSender, paced

MIB = 1 << 20
TOLERANCE = 0.002  # s: clock reads on either side of a hold


def _msg(request_id, seq, nbytes):
    return Message(request_id, seq, f"m{seq}", b"",
                   {"data": torch.full((nbytes,), seq % 256, dtype=torch.uint8)})


def test_messages_are_held_as_long_as_the_link_needs_and_stay_in_order():
    delivered = []

    def stamp(message):
        delivered.append((time.monotonic(), message.seq))
        return [message]

    gbps = 0.4
    per_message = MIB * 8 / (gbps * 1e9)  # 21 ms
    with InProcessLink(fault=stamp) as link:  # unthrottled
        sender = PacedSender(link.sender, gbps)
        link.receiver.open("a")
        sent = [_msg("a", i, MIB) for i in range(4)]
        start = time.monotonic()
        for m in sent:
            sender.send(m)
        sender.flush("a", timeout=10)
        assert len(delivered) == 4  # flush waited for every message to cross
        assert sender.pending().idle
        for k, (at, seq) in enumerate(delivered):
            assert seq == k
            assert at - start >= (k + 1) * per_message - TOLERANCE, (k, at - start)
        got = [link.receiver.recv("a", timeout=5) for _ in range(4)]
        assert [g.seq for g in got] == [0, 1, 2, 3]
        assert all(torch.equal(g.buffers["data"], m.buffers["data"]) for g, m in zip(got, sent))
        link.receiver.close("a")
        sender.shutdown()
    assert not any(t.name == "rekv-pace" for t in threading.enumerate())


def test_send_returns_before_the_hold_and_shutdown_fails_held_flushes():
    with InProcessLink() as link:
        sender = PacedSender(link.sender, 0.001)  # 1 MiB takes 8 s at 1 Mb/s
        link.receiver.open("a")
        sender.send(_msg("a", 0, MIB))
        sender.send(_msg("a", 1, 16))
        assert sender.pending().in_flight_messages == 2
        assert link.sender.pending().idle  # nothing forwarded yet
        assert link.receiver.pending().buffered_messages == 0
        with pytest.raises(TimeoutError, match="request a: messages still on the wire after"):
            sender.flush("a", timeout=0.05)
        assert sender.pending().idle  # the flush gave "a" up
        sender.send(_msg("b", 0, MIB))
        sender.shutdown()
        sender.shutdown()
        with pytest.raises(TransportError, match="shut down"):
            sender.flush("b", timeout=1)
        with pytest.raises(TransportError, match="shut down"):
            sender.send(_msg("a", 2, 16))
        assert sender.pending().idle
        assert link.receiver.pending().buffered_messages == 0  # the held ones were dropped


class _Recorder(TransportSender):
    """An inner sender that records what reaches it and may refuse a message."""

    def __init__(self, refuse_seq=None):
        self.sent, self.flushed, self.shut = [], [], False
        self.refuse_seq = refuse_seq

    def send(self, message):
        if message.seq == self.refuse_seq:
            raise TransportError("too many buffers")
        self.sent.append(message.seq)

    def flush(self, request_id, timeout=None):
        self.flushed.append((request_id, timeout))

    def pending(self):
        return {"in_flight_messages": 0}

    def shutdown(self):
        self.shut = True


def test_flush_passes_the_time_left_to_the_inner_sender_and_shutdown_reaches_it():
    inner = _Recorder()
    sender = PacedSender(inner, 100.0)
    for seq in range(3):
        sender.send(_msg("r", seq, 1000))
    sender.flush("r", timeout=5)
    assert inner.sent == [0, 1, 2]
    [(request_id, left)] = inner.flushed
    assert request_id == "r" and 0 < left <= 5
    sender.shutdown()
    assert inner.shut


def test_a_refused_message_fails_its_requests_flush_only():
    inner = _Recorder(refuse_seq=1)
    sender = PacedSender(inner, 100.0)
    for seq in range(3):
        sender.send(_msg("bad", seq, 100))
    sender.send(Message("good", 0, "m0"))
    with pytest.raises(TransportError, match="request bad: send failed: too many buffers"):
        sender.flush("bad", timeout=5)
    sender.flush("good", timeout=5)
    assert inner.sent == [0, 2, 0]
    sender.shutdown()


def test_rate_must_be_positive():
    for gbps in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="pace_gbps"):
            PacedSender(_Recorder(), gbps)
    inner = _Recorder()
    assert paced(inner, 0.0) is inner
    wrapped = paced(inner, 1.0)
    assert isinstance(wrapped, PacedSender)
    wrapped.shutdown()


def test_a_flush_that_gives_up_drops_what_is_still_held():
    """Past its timeout the request's held messages never leave, and nothing of it stays held
    by the pacer or by the sender behind it; other requests go on."""
    with InProcessLink() as link:
        sender = PacedSender(link.sender, 0.4)  # 21 ms per MiB
        for request_id in ("late", "next"):
            link.receiver.open(request_id)
        for i in range(4):
            sender.send(_msg("late", i, MIB))
        with pytest.raises(TimeoutError, match="late"):
            sender.flush("late", timeout=0.005)
        sender.send(_msg("next", 0, MIB))
        sender.flush("next", timeout=10)
        time.sleep(0.1)  # anything of "late" still held would have left by now
        assert link.receiver.pending().buffered_messages <= 1 + 1  # "late"'s first, "next"
        assert sender.pending().idle
        assert link.receiver.recv("next", timeout=1).seq == 0
        sender.shutdown()
