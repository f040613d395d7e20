"""The decode worker's load book (`rekv_core.plan.decode_load`, `sharing`), without a server: who
counts as computing, the compute committed by planned handoffs less what they have run (each at its
own prompt length, its run time shared with the others computing, never below nothing, all taken
at one instant), the local recompute's share, the names an offer carries (at most
`MAX_PLANNED_TRANSFERS`, the latest ended in the room left), the receives that overlapped, and how
many requests shared a suffix's time."""

from types import SimpleNamespace

import pytest

from rekv_core.handoff.transfer import Transfer, TransferBook, TransferState
from rekv_core.plan import decode_load
from rekv_core.plan.decode_load import NAMES_ENDED_FOR_S, DecodeLoad, ReceiveOverlaps
from rekv_core.plan.prefill_load import AssignedWork
from rekv_core.plan.sharing import SharingMeter
from tests.support.clocks import HandClock


@pytest.fixture
def clock(monkeypatch):
    """`time.monotonic` of the load book and of the transfers, moved by hand."""
    fake = HandClock(100.0)
    monkeypatch.setattr(decode_load, "time", SimpleNamespace(monotonic=fake))
    monkeypatch.setattr("rekv_core.handoff.transfer.time", SimpleNamespace(monotonic=fake))
    return fake


def gamma(prompt_len, sharers):  # ms per layer, as a calibration would say
    return 10.0 * sharers


def test_the_meter_averages_the_count_over_an_interval():
    count, clock = {"now": 3}, HandClock(0.0)
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


def prompt_gamma(prompt_len, sharers):  # ms per layer: 10 ms at 512 tokens, alone
    return 10.0 * sharers * prompt_len / 512


def test_each_commitment_is_priced_at_its_own_prompt_length(clock):
    load = DecodeLoad(TransferBook())
    load.work(Transfer("long", book=load.transfers)).planned(10, 1024)
    with load.recomputing(256, layers=4):
        assert load.backlog(prompt_gamma, 30).ms == pytest.approx(10 * 20.0 + 4 * 5.0)


def test_concurrent_recomputes_share_the_time_they_have_run(clock):
    """Two local recomputes run side by side: 100 ms of wall time is 50 ms of each one's."""
    load = DecodeLoad(TransferBook())
    with load.recomputing(512, layers=10), load.recomputing(512, layers=20):
        clock.now += 0.1
        assert load.backlog(gamma, 30).ms == pytest.approx((100.0 - 50.0) + (200.0 - 50.0))


def test_a_handoff_shares_its_time_with_the_others_computing(clock):
    load = DecodeLoad(TransferBook())
    running = load.work(Transfer("running", book=load.transfers))
    running.planned(30, 512)
    running.transfer.advance(TransferState.PREFIX)
    other = Transfer("other", book=load.transfers)  # another handoff's suffix runs too
    other.advance(TransferState.PREFIX)
    running.computing(True)
    clock.now += 0.1  # 100 ms of wall time, half of it this handoff's
    assert load.backlog(gamma, 30).ms == pytest.approx(300.0 - 50.0)


def test_compute_past_its_prediction_leaves_nothing_committed(clock):
    load = DecodeLoad(TransferBook())
    running = load.work(Transfer("running", book=load.transfers))
    running.planned(2, 512)
    running.transfer.advance(TransferState.PREFIX)
    running.computing(True)
    clock.now += 1.0  # 1 s run of a 20 ms prediction
    assert load.backlog(gamma, 30).ms == 0.0
    running.computing(False)
    running.transfer.advance(TransferState.DONE)
    with load.recomputing(512, layers=3):
        clock.now += 1.0  # 1 s run of a 30 ms prediction
        assert load.backlog(gamma, 30).ms == 0.0


def test_the_backlog_is_one_instants(clock, monkeypatch):
    """Every work's compute counts up to the instant the backlog was taken, however long the
    backlog takes to add it up."""
    load = DecodeLoad(TransferBook())
    running = load.work(Transfer("running", book=load.transfers))
    running.planned(30, 512)
    running.transfer.advance(TransferState.PREFIX)
    running.computing(True)  # at 100.0
    reads = iter([100.1, 100.2, 100.3, 100.4])  # the clock moves on at each later look
    monkeypatch.setattr(decode_load, "time", SimpleNamespace(monotonic=lambda: next(reads)))
    assert load.backlog(gamma, 30).ms == pytest.approx(300.0 - 100.0)


def test_a_work_reports_its_compute_at_the_instant_asked(clock):
    load = DecodeLoad(TransferBook())
    work = load.work(Transfer("running", book=load.transfers))
    work.computing(True)
    assert work.computed_s(now=clock.now + 0.25) == pytest.approx(0.25)
    work.computing(True)  # still running: its start stays
    clock.now += 0.5
    assert work.computed_s() == pytest.approx(0.5)


def test_a_work_that_stops_before_it_started_has_computed_nothing(clock):
    load = DecodeLoad(TransferBook())
    work = load.work(Transfer("waiting", book=load.transfers))
    work.computing(False)
    clock.now += 1.0
    assert work.computed_s() == 0.0


def test_an_offer_names_at_most_max_planned_transfers_the_latest_ended_in_the_room_left(clock):
    room = decode_load.MAX_PLANNED_TRANSFERS
    load = DecodeLoad(TransferBook())
    for i in range(5):
        Transfer(f"ended-{i}", book=load.transfers).advance(TransferState.DONE)
    for i in range(room - 2):
        load.work(Transfer(f"planned-{i}", book=load.transfers)).planned(1, 512)
    names = load.backlog(gamma, 30).planned
    assert len(names) == room and names[-2:] == ("ended-3", "ended-4")
    for i in range(room - 2, room):
        load.work(Transfer(f"planned-{i}", book=load.transfers)).planned(1, 512)
    names = load.backlog(gamma, 30).planned
    assert len(names) == room and not any(n.startswith("ended") for n in names)
