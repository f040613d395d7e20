"""The decode worker's load book (`rekv_core.plan.decode_load`, `sharing`), without a server: who
counts as computing, the compute committed by planned handoffs less what they have run, the local
recompute's share, the receives that overlapped, and how many requests shared a suffix's time."""

from types import SimpleNamespace

import pytest

from rekv_core.handoff.transfer import Transfer, TransferBook, TransferState
from rekv_core.plan import decode_load
from rekv_core.plan.decode_load import NAMES_ENDED_FOR_S, DecodeLoad, ReceiveOverlaps
from rekv_core.plan.prefill_load import AssignedWork
from rekv_core.plan.sharing import SharingMeter


class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    """`time.monotonic` of the load book and of the transfers, moved by hand."""
    fake = Clock()
    monkeypatch.setattr(decode_load, "time", SimpleNamespace(monotonic=fake))
    monkeypatch.setattr("rekv_core.handoff.transfer.time", SimpleNamespace(monotonic=fake))
    return fake


def gamma(prompt_len, sharers):  # ms per layer, as a calibration would say
    return 10.0 * sharers


def test_the_meter_averages_the_count_over_an_interval():
    count, clock = {"now": 3}, Clock(0.0)
    meter = SharingMeter(lambda: count["now"], period_s=0.01, clock=clock, start=False)
    for _ in range(30):  # 0.3 s at 3
        clock.now += 0.01
        meter.sample()
    count["now"] = 1
    for _ in range(30):  # 0.3 s at 1
        clock.now += 0.01
        meter.sample()
    assert meter.average(0.0, 0.3) == pytest.approx(3.0)
    assert meter.average(0.3, 0.6) == pytest.approx(1.0)
    assert meter.average(0.0, 0.6) == pytest.approx(2.0)
    assert meter.average(0.15, 0.45) == pytest.approx(2.0)  # half of each
    assert meter.average(0.6, 0.601) == 1.0  # too short to tell: the count now
    assert meter.average(-5.0, 0.3) == 1.0  # older than the history: the count now


def test_the_worker_counts_as_computing_only_what_runs_on_it(clock):
    """Requests generating, handoffs running their suffix or a token-only recompute, and local
    recomputes; a handoff still waiting for its data is not compute load."""
    load = DecodeLoad(TransferBook())
    with load.generating(), load.generating():
        waiting = Transfer("waiting", book=load.transfers)
        waiting.advance(TransferState.BOUNDARY)
        assert load.computing() == 2 and load.sharers() == 3
        suffix = Transfer("suffix", book=load.transfers)
        suffix.advance(TransferState.PREFIX)
        token_only = Transfer("token-only", book=load.transfers)
        token_only.advance(TransferState.JOINING)
        assert load.computing() == 4
        suffix.advance(TransferState.DONE)
        assert load.computing() == 3
        with load.recomputing(100):
            assert load.computing() == 4
    assert load.computing() == 1 and load.sharers() == 1  # token-only still runs


def test_a_work_counts_only_the_time_it_computed(clock):
    """A chunked suffix waits for each boundary chunk between its computes: the work a decode
    worker reports as still ahead must not shrink while it waits."""
    load = DecodeLoad(TransferBook())
    work = load.work(Transfer("chunked", book=load.transfers))
    assert work.computed_s() == 0.0
    work.computing(True)
    clock.now += 0.3
    work.computing(False)
    clock.now += 2.0  # waiting for the next chunk: nothing computed
    assert work.computed_s() == pytest.approx(0.3)
    work.computing(True)
    clock.now += 0.2
    assert work.computed_s() == pytest.approx(0.5)  # the running chunk counts as it runs
    work.computing(False)
    work.computing(False)  # idempotent
    assert work.computed_s() == pytest.approx(0.5)


def test_the_backlog_counts_planned_handoffs_less_what_they_have_run(clock):
    load = DecodeLoad(TransferBook())
    load.work(Transfer("negotiating", book=load.transfers))  # no plan yet: nothing known
    planned = load.work(Transfer("planned", book=load.transfers))
    planned.planned(20, 512)
    running = load.work(Transfer("running", book=load.transfers))
    running.planned(30, 512)
    running.transfer.advance(TransferState.PREFIX)
    running.computing(True)
    clock.now += 0.1  # 100 ms of compute, alone among the handoffs
    load.work(Transfer("transfer-only", book=load.transfers)).planned(0, 512)
    backlog = load.backlog(gamma, num_layers=30)
    assert backlog.planned == ("planned", "running")
    assert backlog.ms == pytest.approx(20 * 10.0 + 30 * 10.0 - 100.0)
    running.computing(False)
    running.transfer.advance(TransferState.DONE)
    # an ended handoff adds nothing, and is still named: its plan was seen here
    assert load.backlog(gamma, 30) == decode_load.Backlog(pytest.approx(200.0),
                                                          ("planned", "running"))
    with load.generating():  # a request generating makes each layer dearer (gamma's sharers)
        assert load.backlog(gamma, 30).ms == pytest.approx(400.0)


def test_back_to_back_requests_see_no_work_that_is_already_done(clock):
    """The prefill side counts its last decision's decode work until an offer names that
    handoff; the next offer does, though it has ended, so the next decision sees no decode
    backlog. A handoff ended longer ago than the decode worker names is the prefill's grace's to
    drop."""
    load, given = DecodeLoad(TransferBook()), AssignedWork(grace_s=1.0)
    first = load.work(Transfer("first", book=load.transfers))
    given.add("decode:1", "first", 280.0)
    first.planned(28, 512)
    offered = load.backlog(gamma, 30)  # an offer made while it is still in flight
    assert offered.ms == pytest.approx(280.0)
    assert given.unseen("decode:1", offered.planned) == 0.0
    given.add("decode:1", "second", 100.0)  # decided from an offer made before its plan arrived
    first.transfer.advance(TransferState.DONE)
    given.ended("first")
    offered = load.backlog(gamma, 30)
    assert offered.ms == 0.0 and offered.planned == ("first",)
    assert given.unseen("decode:1", offered.planned) == pytest.approx(100.0)  # the unseen one
    clock.now += NAMES_ENDED_FOR_S + 1
    assert load.backlog(gamma, 30) == decode_load.Backlog(0.0, ())


def test_a_local_recompute_is_load_while_it_runs(clock):
    """A failed handoff's fallback computes here: it counts as computing and its remaining work
    in the backlog (under no transfer id), and not once it is done, nor once it has failed."""
    load = DecodeLoad(TransferBook())
    with load.recomputing(512):
        clock.now += 0.05  # 50 ms of it run, alone among the handoffs
        assert load.computing() == 1
        assert load.backlog(gamma, 30) == decode_load.Backlog(pytest.approx(300.0 - 50.0), ())
    assert load.computing() == 0 and load.backlog(gamma, 30).ms == 0.0
    with pytest.raises(RuntimeError, match="out of memory"), load.recomputing(13):
        raise RuntimeError("out of memory")
    assert load.computing() == 0 and load.backlog(gamma, 30).ms == 0.0


def test_overlapping_receives_are_marked_shared_both_ways():
    overlaps = ReceiveOverlaps()
    first = overlaps.begin(computing=False)
    assert not first.shared
    second = overlaps.begin(computing=False)  # the first is still receiving
    assert first.shared and second.shared
    overlaps.end(first)
    overlaps.end(second)
    alone = overlaps.begin(computing=False)
    assert not alone.shared  # the others had ended
    overlaps.end(alone)
    busy = overlaps.begin(computing=True)  # the worker was computing another request
    assert busy.shared
    overlaps.end(busy)
    assert not overlaps.begin(computing=False).shared


def test_a_partial_recompute_commits_only_its_layers(clock):
    """A fallback that recomputes layers 0..m alone counts m + 1 layers, a full one every layer."""
    load = DecodeLoad(TransferBook())
    with load.recomputing(100, layers=12):
        assert load.backlog(gamma, 30).ms == pytest.approx(12 * 10.0)
        with load.recomputing(100):
            assert load.backlog(gamma, 30).ms == pytest.approx(12 * 10.0 + 30 * 10.0)
    assert load.backlog(gamma, 30).ms == 0.0
