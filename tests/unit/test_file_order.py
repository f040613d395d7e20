"""`make test` hands its workers the longest test files first (tests/conftest.py,
`_slowest_files_first`, from the table tools/file_seconds.py writes)."""

import json
from types import SimpleNamespace

import pytest

from tests.conftest import FILE_SECONDS, _slowest_files_first
from tests.support.paths import ROOT, load_script

REPORT = """\
============================= slowest durations ==============================
142.11s setup    tests/system/test_b.py::test_one[burst-32]
0.50s call     tests/system/test_b.py::test_two
3.00s call     tests/unit/test_a.py::test_x
1.25s teardown tests/unit/test_a.py::test_x
0.01s call     tests/unit/test_c.py::TestGroup::test_y
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


@pytest.fixture(scope="module")
def file_seconds():
    return load_script(ROOT / "tools" / "file_seconds.py", "file_seconds")


def _items(*nodeids):
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_files_go_longest_first_unknown_ones_before_all_and_each_file_keeps_its_order(tmp_path):
    costs = tmp_path / "file_seconds.json"
    costs.write_text(json.dumps({"seconds_by_file": {"a.py": 1.0, "b.py": 50.0, "c.py": 7.0}}))
    items = _items("a.py::t1", "b.py::t2", "a.py::t3", "c.py::t4", "new.py::t5", "b.py::t6",
                   "other.py::t7")
    ordered = [item.nodeid for item in _slowest_files_first(items, costs)]
    assert ordered == ["new.py::t5", "other.py::t7", "b.py::t2", "b.py::t6", "c.py::t4",
                       "a.py::t1", "a.py::t3"]


def test_without_the_table_the_order_stands(tmp_path):
    items = _items("a.py::slow", "b.py::quick")
    assert _slowest_files_first(items, tmp_path / "missing.json") is items
    (tmp_path / "broken.json").write_text('{"other": 1}')
    assert _slowest_files_first(items, tmp_path / "broken.json") is items


def test_the_report_is_summed_per_file_over_every_phase(file_seconds):
    table = file_seconds.seconds_by_file(REPORT)
    assert table == {"tests/system/test_b.py": 142.61, "tests/unit/test_a.py": 4.25,
                     "tests/unit/test_c.py": 0.01}
    assert list(table) == ["tests/system/test_b.py", "tests/unit/test_a.py",
                           "tests/unit/test_c.py"]
    with pytest.raises(ValueError, match="--durations=0"):
        file_seconds.seconds_by_file("12 passed in 3.0s\n")


def test_the_command_writes_the_table_conftest_reads(file_seconds, tmp_path, capsys):
    report, table = tmp_path / "run.log", tmp_path / "file_seconds.json"
    report.write_text(REPORT)
    assert file_seconds.main([str(report), "--json", str(table)]) == 0
    written = json.loads(table.read_text())
    assert written["total_s"] == 146.87 and len(written["seconds_by_file"]) == 3
    assert "146.87  in all, 3 files" in capsys.readouterr().out
    ordered = _slowest_files_first(_items("tests/unit/test_a.py::t", "tests/system/test_b.py::t"),
                                   table)
    assert [item.nodeid for item in ordered] == ["tests/system/test_b.py::t",
                                                 "tests/unit/test_a.py::t"]
    assert file_seconds.main([str(tmp_path / "absent.log")]) == 2


def test_the_committed_table_names_files_that_exist():
    """A renamed or removed file's entry would hold no time any more, and its successor would be
    treated as unknown: refresh the table (tools/file_seconds.py) when that happens."""
    seconds = json.loads(FILE_SECONDS.read_text())["seconds_by_file"]
    assert len(seconds) > 50
    missing = [name for name in seconds if not (ROOT / name).is_file()]
    assert not missing
