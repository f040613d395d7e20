"""Two rules for a loaded pair of workers: a decode worker's handoffs that overlap another's, or
begin while it computes, give no link sample (`services.decode.handoff`: their arrivals time both
transfers, or the machine); and the prefill worker lets the planner pipeline only while both pools
are free of other requests (`PrefillWorker._order`)."""

from types import SimpleNamespace

from rekv_core.handoff import Schedule
from services.decode.handoff import _Overlaps
from services.prefill.worker import PrefillWorker


def test_overlapping_receives_are_marked_shared_both_ways():
    overlaps = _Overlaps()
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


def test_the_planner_picks_the_order_only_while_both_pools_are_idle():
    def order(queue=0, computing=0, forced=None, pipeline=True, accepts=True, chunk=256):
        worker = SimpleNamespace(settings=SimpleNamespace(pipeline_prefill=pipeline))
        call = SimpleNamespace(forced_schedule=forced, offer=SimpleNamespace(
            accepts_pipelined=accepts, computing=computing))
        schedule = forced or Schedule(True, chunk)
        return PrefillWorker._order(worker, call, schedule, queue)

    assert order() == "either"
    assert order(queue=1) == order(computing=2) == "layers"  # under load: layer order
    assert order(pipeline=False) == order(accepts=False) == order(chunk=0) == "layers"
    assert order(queue=3, forced=Schedule(True, 256, pipelined=True)) == "tokens"
    assert order(forced=Schedule(True, 256)) == "layers"
