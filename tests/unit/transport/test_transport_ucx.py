"""The UCX transport (ucxx over TCP on loopback) against the transport contract, and a handoff
over it that rebuilds the same cache as the in-process link."""

import asyncio
import os
import threading
import time

import pytest
import torch

from rekv_core.handoff import Action, receive_handoff, send_handoff
from rekv_core.handoff.transfer import Transfer
from rekv_core.model import prefill
from rekv_core.transport import Message, TransportError
from rekv_core.transport.arrivals import link_sample
from rekv_core.transport.pacing import PacedSender
from rekv_core.transport.ucx import (UcxEngine, UcxReceiver, UcxSender, UcxSenderPool,
                                    message_tag)
from tests.support.inprocess_handoff import planned


@pytest.fixture(scope="module")
def ucx():
    engine = UcxEngine()
    receiver = UcxReceiver(engine, drain_seconds=0.5)
    sender = UcxSender(engine, receiver.address)
    yield engine, receiver, sender
    sender.shutdown()
    receiver.shutdown()
    engine.close()


def _msg(request_id, seq, nbytes=16, name=None):
    return Message(request_id, seq, name or f"m{seq}", b"hdr\x00\xff",
                   {"data": torch.arange(nbytes, dtype=torch.int64).to(torch.uint8) + seq,
                    "empty": torch.empty(0, dtype=torch.uint8)})


def test_tags_separate_requests_messages_and_parts():
    tags = {message_tag(r, s, p) for r in ("a", "b") for s in range(3) for p in range(4)}
    assert len(tags) == 24
    with pytest.raises(TransportError, match="beyond"):
        message_tag("a", 1 << 12, 0)


def test_messages_arrive_whole_and_in_order(ucx):
    _, receiver, sender = ucx
    receiver.open("a")
    sent = [_msg("a", i, nbytes=10 + 300_000 * (i % 2)) for i in range(4)]  # eager and rndv
    for m in sent:
        sender.send(m)
    got = [receiver.recv("a", timeout=10) for _ in range(4)]
    sender.flush("a", timeout=10)
    assert [(g.seq, g.name, g.header) for g in got] == [(m.seq, m.name, m.header) for m in sent]
    for g, m in zip(got, sent):
        assert torch.equal(g.buffers["data"], m.buffers["data"])
        assert g.buffers["empty"].numel() == 0
    receiver.close("a")
    assert receiver.pending().open_requests == 0
    assert sender.pending().idle


def test_messages_are_received_ahead_of_the_consumer(ucx):
    """Rendezvous sends complete before anyone calls recv: the wire never waits for the consumer."""
    _, receiver, sender = ucx
    receiver.open("ahead")
    sent = [_msg("ahead", i, nbytes=300_000) for i in range(3)]
    for m in sent:
        sender.send(m)
    sender.flush("ahead", timeout=10)
    for _ in range(100):  # the last receive completes a moment after the sender's side
        if receiver.pending().buffered_messages == 3:
            break
        threading.Event().wait(0.02)
    assert receiver.pending().buffered_messages == 3
    got = [receiver.recv("ahead", timeout=10) for _ in range(3)]
    assert [g.seq for g in got] == [0, 1, 2]
    assert all(torch.equal(g.buffers["data"], m.buffers["data"]) for g, m in zip(got, sent))
    receiver.close("ahead")
    assert receiver.pending().idle


def _back_to_back(receiver, sender, request_id, count=8, nbytes=4 << 20):
    """Send `count` messages at once to a reader that has been waiting; their arrivals."""
    receiver.open(request_id)
    time.sleep(0.05)  # the reader has been looking and sleeping meanwhile
    sent = [_msg(request_id, i, nbytes=nbytes) for i in range(count)]
    for m in sent:
        sender.send(m)
    got = [receiver.recv(request_id, timeout=10) for _ in range(count)]
    sender.flush(request_id, timeout=10)
    receiver.close(request_id)
    return sent, [g.arrival for g in got]


def test_received_messages_carry_their_arrival(ucx):
    """Messages sent back to back while the reader waits form a run that times the link: long
    enough to outweigh the first message's uncertain landing (its window, about the reader's 1 ms
    probe interval, may be at most a fifth of the run; see `arrivals`)."""
    _, receiver, sender = ucx
    for attempt in range(3):  # a core taken away mid-request can leave that one untimed
        sent, arrivals = _back_to_back(receiver, sender, f"timed-{attempt}")
        assert arrivals[0].came_while_looking and arrivals[0].held == 0.0
        assert 0 < arrivals[0].window < 0.04  # its reader's last looks, not its 50 ms wait
        assert all(a.held >= 0 for a in arrivals)
        ends = [a.completed for a in arrivals]
        assert ends == sorted(ends)
        assert all(a.nbytes > m.payload_bytes for a, m in zip(arrivals, sent))  # and the frame
        sample = link_sample(arrivals)
        if sample is not None:
            break
    assert sample is not None, arrivals
    sample_bytes, seconds = sample
    assert 0 < sample_bytes <= sum(a.nbytes for a in arrivals if a.queued)
    # runs lie between the first landing and the last, each widened by half its anchor's window
    assert 0 < seconds <= ends[-1] - ends[0] + sum(a.window for a in arrivals
                                                   if a.came_while_looking)


def test_other_requests_never_land_and_closed_requests_are_drained(ucx):
    _, receiver, sender = ucx
    receiver.open("mine")
    sender.send(_msg("theirs", 0, nbytes=4 << 20))  # a request this receiver never opened
    with pytest.raises(TimeoutError, match="mine"):
        receiver.recv("mine", timeout=0.3)
    sender.send(_msg("mine", 0, name="wanted"))
    assert receiver.recv("mine", timeout=10).name == "wanted"
    strays = receiver.strays
    for seq in (1, 2):  # still in flight when the request is abandoned
        sender.send(_msg("mine", seq, nbytes=200_000))
    receiver.abort("mine")
    sender.flush("mine", timeout=10)  # completes because the receiver drains them
    deadline = threading.Event()
    for _ in range(100):
        if not receiver.pending().draining_requests:
            break
        deadline.wait(0.05)
    assert receiver.strays == strays + 2
    assert receiver.pending().idle
    with pytest.raises(TransportError, match="not open"):
        receiver.recv("mine", timeout=0.1)
    with pytest.raises(TimeoutError, match="theirs"):
        sender.flush("theirs", timeout=0.3)  # nobody will ever receive it (rendezvous size)


def test_sender_pool_keeps_one_sender_per_address(ucx):
    engine, receiver, _ = ucx
    pool = UcxSenderPool(engine)
    sender = pool.to(receiver.address)
    assert isinstance(sender, UcxSender) and pool.to(receiver.address) is sender
    receiver.open("pooled")
    sender.send(_msg("pooled", 0, nbytes=300_000))
    got = receiver.recv("pooled", timeout=10)
    sender.flush("pooled", timeout=10)
    receiver.close("pooled")
    assert got.buffers["data"].numel() == 300_000
    assert pool.pending().idle
    pool.shutdown()
    pool.shutdown()
    with pytest.raises(TransportError, match="shut down"):
        pool.to(receiver.address)
    assert not engine.closed  # the engine was lent to the pool, not given


def test_paced_pool_wraps_its_senders(ucx):
    engine, receiver, _ = ucx
    pool = UcxSenderPool(engine, pace_gbps=2.0)
    try:
        sender = pool.to(receiver.address)
        assert isinstance(sender, PacedSender) and isinstance(sender.inner, UcxSender)
        assert sender.gbps == 2.0
    finally:
        pool.shutdown()
    assert not any(t.name == "rekv-pace" for t in threading.enumerate())


def test_bad_address_is_named():
    with pytest.raises(ValueError, match="address"):
        UcxSender(None, "no-port-here")


@pytest.mark.parametrize("codec,cut", [("int8", 15), ("bf16", 30), ("bf16", 0)])
def test_handoff_over_ucx_matches_in_process(ucx, smollm_bf16, tokenizer, codec, cut):
    _, receiver, sender = ucx
    model = smollm_bf16
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    state = prefill(model, ids)
    action = Action(codec, cut, model.shape.num_layers)
    request_id = f"handoff-{codec}-{cut}"
    receiver.open(request_id)
    report = {}
    plan, source = planned(model, ids, action, state)
    thread = threading.Thread(target=lambda: report.update(
        r=send_handoff(sender, plan, source, Transfer(request_id))))
    thread.start()
    result = receive_handoff(model, receiver, Transfer(request_id, stall_s=30))
    thread.join()
    assert result.bytes == report["r"].bytes
    for layer in range(cut, model.shape.num_layers):
        k, v = result.cache.layer(layer)
        assert torch.equal(k, state.keys[layer]) and torch.equal(v, state.values[layer])
    if codec == "bf16":
        for layer in range(cut):
            k, _ = result.cache.layer(layer)
            assert torch.equal(k, state.keys[layer])
    assert int(result.logits.argmax()) == int(state.logits.argmax())


def test_close_wakes_a_waiting_receive(ucx):
    _, receiver, _ = ucx
    receiver.open("waiting")
    errors = []

    def wait():
        try:
            receiver.recv("waiting", timeout=30)
        except TransportError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=wait)
    thread.start()
    threading.Event().wait(0.2)
    receiver.abort("waiting")
    thread.join(5)
    assert not thread.is_alive() and errors and "closed while receiving" in errors[0]


def test_engine_runs_its_loop_at_the_given_priority():
    engine = UcxEngine(loop_nice=7)
    try:
        engine.call(asyncio.sleep(0), 10)  # the loop is running
        assert os.getpriority(os.PRIO_PROCESS, engine.thread_id) == 7
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0
    finally:
        engine.close()
    with pytest.raises(ValueError, match="loop_nice"):
        UcxEngine(loop_nice=20)


def _frame(meta) -> torch.Tensor:
    import json
    import struct

    body = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    return torch.frombuffer(bytearray(struct.pack("<I", len(body)) + body), dtype=torch.uint8)


GOOD_FRAME = {"request_id": "r", "seq": 0, "name": "m", "header": "", "buffers": [["a", 8, "cpu"]]}


@pytest.mark.parametrize("change, field", [
    ({"seq": "0"}, "frame.seq"), ({"name": None}, "frame.name"), ({"buffers": {}}, "frame.buffers"),
    ({"buffers": [["a", -1, "cpu"]]}, "frame.buffers"),
    ({"buffers": [["a", 8, "tpu"]]}, "frame.buffers"),
    ({"buffers": [["a", True, "cpu"]]}, "frame.buffers"),
    ({"buffers": [["a", 1 << 40, "cpu"]]}, "frame.buffers"),  # beyond the limit below
    ({"buffers": [[f"b{i}", 1, "cpu"] for i in range(16)]}, "16 buffers"),
])
def test_a_peers_frame_is_checked_before_anything_is_allocated(change, field):
    from rekv_core.transport.ucx.framing import decode_frame

    assert decode_frame(_frame(GOOD_FRAME), max_message_bytes=64)["name"] == "m"
    with pytest.raises(TransportError, match=field):
        decode_frame(_frame(GOOD_FRAME | change), max_message_bytes=1 << 30)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_frames_are_transport_errors(raw):
    from rekv_core.transport.ucx.framing import decode_frame

    with pytest.raises(TransportError, match="frame"):
        decode_frame(_frame(raw))


def test_a_message_beyond_the_receivers_limit_fails_its_request_only():
    engine = UcxEngine()
    receiver = UcxReceiver(engine, drain_seconds=0.5, max_message_bytes=1000)
    sender = UcxSender(engine, receiver.address)
    try:
        receiver.open("big")
        sender.send(_msg("big", 0, nbytes=4096))
        with pytest.raises(TransportError, match="beyond this receiver's limit of 1000"):
            receiver.recv("big", 10)
        receiver.abort("big")
        receiver.open("small")
        sender.send(_msg("small", 0, nbytes=512))
        assert receiver.recv("small", 10).buffers["data"].numel() == 512
        receiver.close("small")
    finally:
        sender.shutdown()
        receiver.shutdown()
        engine.close()
