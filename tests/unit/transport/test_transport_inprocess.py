"""The in-process link against the transport contract: order, isolation, throttling, faults, and
no thread or buffer left behind."""

import threading
import time

import pytest
import torch

from rekv_core.transport import Message, TransportError
from rekv_core.transport import inprocess
from rekv_core.transport.inprocess import InProcessLink


def _msg(request_id, seq, nbytes=16, name=None):
    return Message(request_id, seq, name or f"m{seq}", b"hdr",
                   {"data": torch.full((nbytes,), seq % 256, dtype=torch.uint8)})


def _no_wire_threads():
    return not any(t.name == "rekv-inprocess-wire" for t in threading.enumerate())


def test_messages_arrive_in_order_as_copies():
    with InProcessLink() as link:
        link.receiver.open("a")
        sent = [_msg("a", i) for i in range(5)]
        for m in sent:
            link.sender.send(m)
        link.sender.flush("a", timeout=5)
        got = [link.receiver.recv("a", timeout=5) for _ in range(5)]
        assert [m.seq for m in got] == list(range(5))
        assert all(torch.equal(g.buffers["data"], s.buffers["data"]) for g, s in zip(got, sent))
        assert got[0].buffers["data"].data_ptr() != sent[0].buffers["data"].data_ptr()
        link.receiver.close("a")
        assert link.receiver.pending().idle
        assert link.sender.pending().idle
    assert _no_wire_threads()


def test_requests_are_isolated_and_strays_are_dropped():
    with InProcessLink() as link:
        link.receiver.open("a")
        link.sender.send(_msg("b", 0))  # never opened
        link.sender.send(_msg("a", 0))
        link.sender.flush("a", timeout=5)
        link.sender.flush("b", timeout=5)
        assert link.receiver.recv("a", timeout=5).request_id == "a"
        assert link.receiver.strays == 1
        link.receiver.close("a")
        link.sender.send(_msg("a", 1))  # late message for a closed request
        link.sender.flush("a", timeout=5)
        assert link.receiver.strays == 2
        with pytest.raises(TransportError, match="not open"):
            link.receiver.recv("a", timeout=0.1)


class _Clock:
    """The in-process link's `time` with a clock that only sleeps move: how long each message
    holds the wire and waits out its latency, exactly, whatever the machine's load."""

    def __init__(self):
        self.now, self.sleeps = 100.0, []
        self._lock = threading.Lock()

    def perf_counter(self):
        with self._lock:
            return self.now

    def sleep(self, seconds):
        with self._lock:
            self.sleeps.append(seconds)
            self.now += seconds


def test_throttle_follows_bandwidth_and_latency(monkeypatch):
    """Each message holds the wire for its bytes at the bandwidth, one after the other, and
    becomes visible `latency_s` after leaving it: latency is pipelined, bandwidth is not."""
    clock = _Clock()
    monkeypatch.setattr(inprocess, "time", clock)
    nbytes = 1_000_000  # 8 Mbit at 0.4 Gbit/s: 20 ms on the wire
    wire = 0.02 + 3 * 8 / 0.4e9  # and its 3 header bytes
    with InProcessLink(bandwidth_gbps=0.4, latency_s=0.03) as link:
        link.receiver.open("a")
        for seq in range(3):
            link.sender.send(_msg("a", seq, nbytes))
        link.sender.flush("a", timeout=5)  # the wire's three 20 ms, and nothing else yet
        assert clock.now - 100.0 == pytest.approx(3 * wire)
        visible = []
        for _ in range(3):
            link.receiver.recv("a", timeout=5)
            visible.append(clock.now - 100.0)
        link.receiver.close("a")
    # each visible 30 ms after leaving the wire, at 50, 70 and 90 ms (not 50, 100, 150): the
    # receiver, first looking at 60 ms, has the first at once and waits for the other two
    assert visible == pytest.approx([3 * wire, 2 * wire + 0.03, 3 * wire + 0.03])
    assert clock.sleeps == pytest.approx([wire, wire, wire, 0.03 - wire, wire])


def test_a_throttled_message_takes_at_least_its_wire_time_and_latency():
    nbytes = 1_000_000  # 8 Mbit at 0.4 Gbit/s: 20 ms on the wire, then 30 ms latency
    with InProcessLink(bandwidth_gbps=0.4, latency_s=0.03) as link:
        link.receiver.open("a")
        start = time.perf_counter()
        link.sender.send(_msg("a", 0, nbytes))
        link.receiver.recv("a", timeout=5)
        # a lower bound only: a loaded machine may take any longer
        assert time.perf_counter() - start >= 0.05
        link.receiver.close("a")


def test_timeout_gap_and_duplicate():
    def drop_second(m):
        return [] if m.seq == 1 else [m]

    with InProcessLink(fault=drop_second) as link:
        link.receiver.open("a")
        with pytest.raises(TimeoutError, match="no message within"):
            link.receiver.recv("a", timeout=0.05)
        for i in range(3):
            link.sender.send(_msg("a", i))
        link.sender.flush("a", timeout=5)
        link.receiver.recv("a", timeout=5)
        with pytest.raises(TransportError, match="expected message 1, got 2.*missing"):
            link.receiver.recv("a", timeout=5)
        link.receiver.close("a")

    with InProcessLink(fault=lambda m: [m, m]) as link:
        link.receiver.open("a")
        link.sender.send(_msg("a", 0))
        link.receiver.recv("a", timeout=5)
        with pytest.raises(TransportError, match="expected message 1, got 0.*repeated"):
            link.receiver.recv("a", timeout=5)
        link.receiver.close("a")
        assert link.receiver.pending().buffered_messages == 0
    assert _no_wire_threads()


def test_close_fails_pending_flushes_and_refuses_sends():
    link = InProcessLink(bandwidth_gbps=0.001)  # 1 Mbit/s: the message stays on the wire
    link.receiver.open("a")
    link.sender.send(_msg("a", 0, 1000))
    link.sender.send(_msg("a", 1, 1000))
    with pytest.raises(TimeoutError, match="still on the wire"):
        link.sender.flush("a", timeout=0.001)
    link.close()
    link.close()
    with pytest.raises(TransportError, match="closed"):
        link.sender.flush("a", timeout=1)
    with pytest.raises(TransportError, match="closed"):
        link.sender.send(_msg("a", 2))
    assert _no_wire_threads()


def test_bad_link_settings():
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        InProcessLink(bandwidth_gbps=0)
    with pytest.raises(ValueError, match="latency_s"):
        InProcessLink(latency_s=-1)


def test_a_failed_copy_fails_that_request_and_the_wire_lives_on(monkeypatch):
    with InProcessLink() as link:
        real_copy = link._copy

        def copy(message):
            if message.request_id == "bad":
                raise RuntimeError("out of memory")
            return real_copy(message)

        monkeypatch.setattr(link, "_copy", copy)
        for request_id in ("bad", "good"):
            link.receiver.open(request_id)
            link.sender.send(Message(request_id, 0, "m", b"",
                                     {"x": torch.zeros(4, dtype=torch.uint8)}))
        with pytest.raises(TransportError, match="copy failed: out of memory"):
            link.sender.flush("bad", timeout=5)
        link.sender.flush("good", timeout=5)
        assert link.receiver.recv("good", 5).name == "m"
