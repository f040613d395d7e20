"""Under `make mutate` a mutant's tests run fastest first (tests/conftest.py, `_fastest_first`),
from the fork server's collection on: it knows it is under mutmut."""

import json
from types import SimpleNamespace

from tests.conftest import _fastest_first, under_mutmut


def _items(*nodeids):
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_the_tests_run_in_the_order_of_their_traced_durations_unknown_ones_last(tmp_path):
    stats = tmp_path / "mutmut-stats.json"
    stats.write_text(json.dumps({"duration_by_test": {"a::slow": 9.0, "b::quick": 0.1,
                                                      "c::middling": 2.0}}))
    ordered = _fastest_first(_items("a::slow", "d::untraced", "c::middling", "b::quick"), stats)
    assert [item.nodeid for item in ordered] == ["b::quick", "c::middling", "a::slow",
                                                 "d::untraced"]


def test_without_a_traced_run_the_order_stands(tmp_path):
    items = _items("a::slow", "b::quick")
    assert _fastest_first(items, tmp_path / "mutmut-stats.json") is items
    (tmp_path / "mutmut-stats.json").write_text("{not json")
    assert _fastest_first(items, tmp_path / "mutmut-stats.json") is items


def test_mutmut_is_recognised_in_its_fork_server_where_the_mutant_is_still_unnamed():
    """mutmut 3.8's fork server collects the tests (importing conftest) with the variable set but
    empty; only its grandchildren name a mutant."""
    assert under_mutmut({"MUTANT_UNDER_TEST": ""})
    assert under_mutmut({"MUTANT_UNDER_TEST": "rekv_core.plan.cost.x_f__mutmut_1"})
    assert not under_mutmut({"PATH": "/usr/bin"})
