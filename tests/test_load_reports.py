"""What the workers report of their load, for the planner's queues on both sides.

The decode worker: `SharingMeter`, how many requests computed beside a suffix while it ran (the
calibration divides suffix times by it), and `backlog()`, the compute committed to it by the
handoffs whose plan has arrived. The prefill worker: `AssignedWork`, the decode-side compute of
its own decisions that a decode offer made before them cannot have counted.
"""

import itertools
import threading
import time
from types import SimpleNamespace

import pytest

from rekv_core.handoff.transfer import Transfer, TransferBook, TransferState
from services.decode.sharing import SharingMeter
from services.decode.worker import NAMES_ENDED_FOR_S, DecodeWorker
from services.prefill.assigned import AssignedWork


def test_the_meter_averages_the_count_over_an_interval():
    count = {"now": 3}
    meter = SharingMeter(lambda: count["now"], period_s=0.005)
    try:
        t0 = time.perf_counter()
        time.sleep(0.3)
        t1 = time.perf_counter()
        count["now"] = 1
        time.sleep(0.3)
        t2 = time.perf_counter()
        assert meter.average(t0, t1) == pytest.approx(3.0, abs=0.25)
        assert meter.average(t1, t2) == pytest.approx(1.0, abs=0.25)
        assert meter.average(t0, t2) == pytest.approx(2.0, abs=0.3)
        # too short an interval to tell: the count now
        assert meter.average(t2, t2 + 0.001) == 1.0
    finally:
        meter.close()


def _decode_worker(book: TransferBook, computing: int = 0) -> DecodeWorker:
    worker = object.__new__(DecodeWorker)
    worker.transfers, worker.generating = book, computing
    worker.recomputing, worker._recompute_ids = {}, itertools.count()
    worker._recompute_lock = threading.Lock()
    worker.calibration = SimpleNamespace(suffix_ms_per_layer=lambda prompt_len, load: 10.0)
    worker.shape = SimpleNamespace(num_layers=30)
    return worker


def test_the_decode_backlog_counts_planned_handoffs_less_what_they_have_run():
    book = TransferBook()
    negotiating = Transfer("negotiating", book=book)  # no plan yet: nothing known
    planned = Transfer("planned", book=book)
    planned.planned(20, 512)
    planned.advance(TransferState.BOUNDARY)
    running = Transfer("running", book=book)
    running.planned(30, 512)
    running.advance(TransferState.BOUNDARY)
    running.advance(TransferState.PREFIX)
    running.entered[TransferState.PREFIX] -= 0.1  # 100 ms of compute, alone on the worker
    transfer_only = Transfer("transfer-only", book=book)
    transfer_only.planned(0, 512)
    transfer_only.advance(TransferState.BOUNDARY)
    ms, ids = _decode_worker(book).backlog()
    assert set(ids) == {"planned", "running"}
    assert ms == pytest.approx(20 * 10.0 + 30 * 10.0 - 100.0, abs=5.0)
    running.advance(TransferState.DONE)
    # an ended handoff adds nothing, and is still named: its plan was seen here
    assert _decode_worker(book).backlog() == (pytest.approx(200.0), ("planned", "running"))
    assert negotiating.computing_since() is None


def test_back_to_back_requests_see_no_work_that_is_already_done(monkeypatch):
    """One request after another: the prefill side counts its last decision's decode work
    until an offer names that handoff; the next offer does, though it has ended, so the next
    decision sees no decode backlog. A handoff ended longer ago than the decode worker names is
    the prefill's grace's to drop."""
    book, work = TransferBook(), AssignedWork(grace_s=1.0)
    decode = _decode_worker(book)
    first = Transfer("first", book=book)
    work.add("decode:1", "first", 280.0)
    first.planned(28, 512)
    first.advance(TransferState.BOUNDARY)
    ms, named = decode.backlog()  # an offer made while it is still in flight
    assert ms == pytest.approx(280.0) and work.unseen("decode:1", named) == 0.0
    work.add("decode:1", "second", 100.0)  # decided from an offer made before its plan arrived
    first.advance(TransferState.DONE)
    work.ended("first")
    ms, named = decode.backlog()
    assert ms == 0.0 and named == ("first",)
    assert work.unseen("decode:1", named) == pytest.approx(100.0)  # only the unseen one
    later = time.monotonic() + NAMES_ENDED_FOR_S + 1
    monkeypatch.setattr("services.decode.worker.time", SimpleNamespace(monotonic=lambda: later))
    assert decode.backlog() == (0.0, ())


def test_a_local_recompute_is_decode_load_while_it_runs(monkeypatch):
    """A failed handoff's fallback recompute computes here: the worker counts it as computing
    and its remaining work in the backlog (under no transfer id), and not once it is done, nor
    once it has failed."""
    worker = _decode_worker(TransferBook(), computing=1)
    clock = {"now": 100.0}
    monkeypatch.setattr("services.decode.worker.time",
                        SimpleNamespace(monotonic=lambda: clock["now"]))
    seen = {}

    def prefill(model, ids, boundaries):
        clock["now"] += 0.05  # 50 ms of it run, alone among the handoffs
        seen["computing"], seen["backlog"] = worker.computing(), worker.backlog()
        if len(ids) == 13:
            raise RuntimeError("out of memory")
        return SimpleNamespace(keys="k", values="v", logits="logits")

    monkeypatch.setattr("services.decode.worker.prefill", prefill)
    monkeypatch.setattr("services.decode.worker.KVCache",
                        SimpleNamespace(from_layers=lambda keys, values, capacity: "cache"))
    worker.model = None
    assert worker.recompute([1] * 512, 600) == ("cache", "logits")
    assert seen["computing"] == 2
    assert seen["backlog"] == (pytest.approx(30 * 10.0 - 50.0), ())
    assert worker.computing() == 1 and worker.backlog() == (0.0, ())
    with pytest.raises(RuntimeError, match="out of memory"):
        worker.recompute([1] * 13, 20)
    assert seen["computing"] == 2
    assert worker.computing() == 1 and worker.backlog() == (0.0, ())


def test_a_handoff_measures_its_sharing_over_its_suffix_only(monkeypatch):
    """The calibration divides a suffix's time by the requests computing beside it: the mean is
    taken from the boundary's arrival to the suffix's end, not to the complete cache; a
    transfer-only handoff computes nothing here and counts as alone."""
    from rekv_core.handoff.receiver import HandoffTimings

    worker = _decode_worker(TransferBook())
    asked = []
    worker.sharing = SimpleNamespace(average=lambda t0, t1: asked.append((t0, t1)) or 2.5)
    worker.settings = SimpleNamespace(handoff_timeout_s=5.0, encrypt_data_plane=False)
    worker.model = worker.receiver = None
    timings = {}
    monkeypatch.setattr("services.decode.worker.receive_handoff",
                        lambda *args: SimpleNamespace(timings=timings["now"]))
    transfer = SimpleNamespace(transfer_id="t")
    timings["now"] = HandoffTimings(h_s=0.2, x_s=0.9, r_s=0.5, j_s=0.01, total_s=1.11,
                                    suffix_end_s=0.7)
    _, sharing = worker.receive(transfer, 512, 4, b"k" * 32)
    (t0, t1), = asked
    assert sharing == 2.5 and t1 - t0 == pytest.approx(0.5)  # [h, suffix end], not to 1.11
    timings["now"] = HandoffTimings(h_s=0.01, x_s=0.9, j_s=0.01, total_s=0.92)
    assert worker.receive(transfer, 512, 4, b"k" * 32)[1] == 1.0 and len(asked) == 1


def test_the_prefill_counts_its_decisions_a_stale_offer_missed():
    work = AssignedWork(grace_s=1.0)
    work.add("decode-1:5000", "a", 300.0)
    work.add("decode-1:5000", "b", 50.0)
    work.add("decode-2:5000", "c", 700.0)  # another decode worker's: never this one's wait
    assert work.unseen("decode-1:5000", planned=()) == 350.0
    work.ended("a", at=100.0)
    assert work.unseen("decode-1:5000", planned=(), now=100.5) == 350.0  # an offer made before
    assert work.unseen("decode-1:5000", planned=(), now=101.5) == 50.0  # forgotten after grace
    # once an offer names a handoff, the decode worker counts it: dropped here for good
    assert work.unseen("decode-1:5000", planned=frozenset({"b"})) == 0.0
    assert work.unseen("decode-1:5000", planned=()) == 0.0
    work.ended("unknown", at=100.0)  # a call that failed before its decision
    assert work.unseen("decode-2:5000", planned=(), now=200.0) == 700.0
