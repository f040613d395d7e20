"""The link probe (`rekv_core.handoff.probe`) over UCX on loopback behind a paced sender: it times
the emulated link, costs a slow link one short stage, admits only messages sealed under its key,
and says nothing when the transport stamps no arrivals."""

import threading
import time

import pytest

from rekv_core.handoff.probe import PROBE_STAGES, receive_probe, send_probe
from rekv_core.handoff.seal import SealError, new_key
from rekv_core.transport import TransportOptions, create_receiver, create_sender_pool
from rekv_core.transport.inprocess import InProcessLink


def _probe(receiver, sender, send_key, receive_key, request_id):
    receiver.open(request_id)
    got = {}

    def receive():
        try:
            got["sample"] = receive_probe(receiver, request_id, receive_key, timeout_s=20)
        except Exception as exc:
            got["error"] = exc

    reader = threading.Thread(target=receive)
    reader.start()
    sent = send_probe(sender, request_id, send_key, timeout_s=20)
    reader.join(30)
    return sent, got


@pytest.fixture(scope="module")
def ucx_receiver():
    receiver = create_receiver("ucx", TransportOptions())
    yield receiver
    receiver.shutdown()


@pytest.mark.parametrize("gbps", [0.1, 0.4])
def test_the_probe_times_a_paced_link(ucx_receiver, gbps):
    pool = create_sender_pool("ucx", TransportOptions(pace_gbps=gbps))
    try:
        key = new_key()
        sent, got = _probe(ucx_receiver, pool.to(ucx_receiver.address), key, key, f"p-{gbps}")
    finally:
        pool.shutdown()
    nbytes, seconds = got["sample"]
    # at most 1.5x: an anchor stamped late on a loaded machine shortens the time (module doc)
    assert 0.75 * gbps <= nbytes * 8 / seconds / 1e9 <= 1.5 * gbps
    # from the second stage on, one of at least 20 ms ends it: at both rates the second
    # (2 MiB: 168 and 42 ms)
    assert sent.bytes == sum(PROBE_STAGES[:2])
    assert ucx_receiver.pending().idle


def test_a_probe_under_another_key_is_refused_and_freed(ucx_receiver):
    pool = create_sender_pool("ucx", TransportOptions(pace_gbps=1.0))
    try:
        _, got = _probe(ucx_receiver, pool.to(ucx_receiver.address), new_key(), new_key(),
                        "forged")
    finally:
        pool.shutdown()
    assert isinstance(got["error"], SealError)
    assert "sample" not in got
    deadline = time.monotonic() + 10  # the receive was aborted: what still arrives is drained
    while not ucx_receiver.pending().idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ucx_receiver.pending().idle


def test_without_arrival_stamps_the_probe_says_nothing():
    with InProcessLink(bandwidth_gbps=1.0) as link:
        key = new_key()
        _, got = _probe(link.receiver, link.sender, key, key, "inprocess")
        assert got == {"sample": None}
        assert link.receiver.pending().idle
