"""The transfer state machine, admission control and the sender pool's reconnect, and the handoff
schedules obeying them: no wait outlives its deadline, a cancelled handoff stops and frees what it
posted, a pool replaces a sender whose peer is gone."""

import threading
import time
import types

import pytest

from rekv_core.handoff import Action, receive_handoff, send_handoff
from rekv_core.handoff import transfer as transfer_module
from rekv_core.handoff.transfer import (Transfer, TransferBook, TransferCancelled, TransferState,
                                        allowed_s)
from rekv_core.model import prefill
from rekv_core.transport import SenderPool, TransportSender
from rekv_core.transport.inprocess import InProcessLink
from tests.support.inprocess_handoff import planned
from services.admission import Admission
from services.errors import ResourceExhausted

IDS = list(range(1, 33))


def test_states_only_move_forward_and_end_once():
    book = TransferBook()
    transfer = Transfer("t", book=book)
    assert transfer.state is TransferState.NEGOTIATING and book.count() == 1
    transfer.advance(TransferState.PREFIX)
    transfer.advance(TransferState.PREFIX)  # staying is allowed
    assert book.count(TransferState.PREFIX) == 1
    with pytest.raises(ValueError, match="from PREFIX to BOUNDARY"):
        transfer.advance(TransferState.BOUNDARY)
    with pytest.raises(ValueError):
        transfer.advance(TransferState.FAILED)  # failing goes through fail()
    transfer.fail("peer gone")
    assert transfer.state is TransferState.FAILED and "in PREFIX" in transfer.failure
    assert book.count() == 0
    transfer.fail("again")  # no effect once ended
    assert "peer gone" in transfer.failure
    with pytest.raises(TransferCancelled, match="already FAILED"):
        transfer.advance(TransferState.DONE)
    done = Transfer("d", book=book)
    done.advance(TransferState.DONE)
    assert book.count() == 0 and done.ended


def test_every_wait_is_bounded_by_the_stall_limit_and_the_deadline():
    free = Transfer("free", stall_s=7.0)
    assert free.wait_s() == 7.0  # no deadline: the stall limit
    near = Transfer("near", deadline=time.monotonic() + 0.5, stall_s=7.0)
    assert 0 < near.wait_s() <= 0.5
    near.expect_within(0.1)  # a prediction only ever tightens the deadline
    assert near.wait_s() <= 0.1
    near.expect_within(100.0)
    assert near.wait_s() <= 0.1
    time.sleep(0.15)
    with pytest.raises(TimeoutError, match="deadline passed in NEGOTIATING"):
        near.wait_s()
    assert allowed_s(1.0) > 1.0 and allowed_s(0.0) > 0  # slack, and a floor
    with pytest.raises(ValueError, match="stall_s"):
        Transfer("bad", stall_s=0)


def test_a_cancel_wakes_a_hold_and_stops_the_next_wait():
    transfer = Transfer("t")
    threading.Timer(0.05, transfer.cancel).start()
    began = time.monotonic()
    transfer.hold(10.0)
    assert time.monotonic() - began < 5.0
    with pytest.raises(TransferCancelled, match="cancelled in NEGOTIATING"):
        transfer.wait_s()


def test_admission_bounds_calls_and_bytes_and_names_the_setting():
    admission = Admission(max_calls=2, max_bytes=100, what="request")
    with admission.admit(60):
        with pytest.raises(ResourceExhausted, match="max_inflight_bytes: .* would pass"):
            with admission.admit(50):
                pass
        with admission.admit(40):
            assert (admission.calls, admission.bytes) == (2, 100)
            with pytest.raises(ResourceExhausted, match="max_queue: 2 requests"):
                with admission.admit(0):
                    pass
    assert (admission.calls, admission.bytes) == (0, 0)  # released, also after the refusals
    with pytest.raises(ResourceExhausted, match="more than the"):
        with admission.admit(101):
            pass


class _Sender(TransportSender):
    def __init__(self):
        self.is_broken, self.shut = False, False

    def send(self, message):
        pass

    def flush(self, request_id, timeout=None):
        pass

    def pending(self):
        return {"in_flight_messages": 0}

    @property
    def broken(self):
        return self.is_broken

    def shutdown(self):
        self.shut = True


class _Pool(SenderPool):
    def __init__(self):
        super().__init__()
        self.made = []

    def _connect(self, address):
        self.made.append(_Sender())
        return self.made[-1]


def test_a_pool_replaces_a_sender_whose_peer_is_gone():
    pool = _Pool()
    first = pool.to("decode:1")
    assert pool.to("decode:1") is first and len(pool.made) == 1
    first.is_broken = True
    second = pool.to("decode:1")
    assert second is not first and first.shut and not second.shut


def test_a_handoff_nobody_sends_ends_at_its_deadline_not_its_stall_limit(smollm_bf16):
    with InProcessLink() as link:
        link.receiver.open("silent")
        book = TransferBook()
        transfer = Transfer("silent", deadline=time.monotonic() + 0.3, stall_s=60.0, book=book)
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            receive_handoff(smollm_bf16, link.receiver, transfer)
        assert time.monotonic() - began < 5.0
        assert transfer.state is TransferState.FAILED and book.count() == 0
        assert link.receiver.pending().open_requests == 0


def test_a_cancelled_send_stops_before_its_next_message_and_frees_it(smollm_bf16):
    model = smollm_bf16
    state = prefill(model, IDS)
    action = Action("int8", 20, model.shape.num_layers)
    with InProcessLink() as link:
        link.receiver.open("r")
        transfer = Transfer("r")

        class CancelAfterBoundary:
            def before_send(self, message):
                return message

            def after_send(self, name):
                if name == "boundary":
                    transfer.cancel()

        with pytest.raises(TransferCancelled):
            send_handoff(link.sender, *planned(model, IDS, action, state), transfer,
                         hooks=CancelAfterBoundary())
        assert transfer.state is TransferState.FAILED
        link.receiver.abort("r")
        deadline = time.monotonic() + 5  # the link's thread delivers what was already posted
        while link.sender.pending().in_flight_messages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.sender.pending().in_flight_messages == 0


def test_an_untrusted_prediction_leaves_the_deadline_alone():
    transfer = Transfer("cold", stall_s=7.0, trust_predictions=False)
    transfer.expect_within(0.0)
    assert transfer.deadline is None and transfer.wait_s() == 7.0


def test_the_book_remembers_which_transfers_ended_and_when():
    book = TransferBook(remember=2)
    before = time.monotonic()
    done, failed, live = (Transfer(name, book=book) for name in ("done", "failed", "live"))
    done.advance(TransferState.DONE)
    failed.fail("lost")
    assert book.left_since(before) == ["done", "failed"]
    assert book.left_since(time.monotonic() + 1) == []
    done.fail("late")  # an ended transfer does not leave twice
    third = Transfer("third", book=book)
    third.advance(TransferState.DONE)
    assert book.left_since(before) == ["failed", "third"]  # the last `remember` of them
    assert [t.transfer_id for t in book.live()] == ["live"]


def test_a_book_remembers_the_last_1024_by_default():
    book = TransferBook()
    before = time.monotonic()
    for n in range(1025):
        Transfer(str(n), book=book).fail("ended")
    assert book.left_since(before) == [str(n) for n in range(1, 1025)]


def test_a_hold_without_a_cancel_ends_after_its_time():
    """Not cancelled, a hold still returns once its time is up: it never waits unbounded."""
    transfer = Transfer("t")
    held = threading.Thread(target=transfer.hold, args=(0.01,), daemon=True)
    held.start()
    try:
        held.join(30.0)  # a hold still going after this long is a hang, not slowness
        assert not held.is_alive()
    finally:
        transfer.cancel()  # frees a hold that did hang


def test_a_prediction_sets_the_deadline_of_a_transfer_that_had_none():
    transfer = Transfer("open", stall_s=60.0)
    before = time.monotonic()
    transfer.expect_within(5.0)
    assert transfer.deadline is not None and before + 5.0 <= transfer.deadline
    assert transfer.wait_s() <= 5.0


def test_a_transfer_that_ended_at_the_very_instant_asked_about_is_counted(monkeypatch):
    """`left_since(t)` names the transfers that ended at t or later: one that ended at t itself
    (a coarse monotonic clock reads the same twice) is among them."""
    monkeypatch.setattr(transfer_module, "time", types.SimpleNamespace(monotonic=lambda: 50.0))
    book = TransferBook()
    Transfer("same-instant", book=book).advance(TransferState.DONE)
    assert book.left_since(50.0) == ["same-instant"]
    assert book.left_since(50.5) == []
