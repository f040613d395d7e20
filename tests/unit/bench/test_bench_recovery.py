"""bench/recovery.py at a tiny size: every fault's salvage recomputes the layers it should, each
checked against the reference before it is timed, and the result holds what its table shows."""

import json

import pytest

from tests.support.paths import ROOT, load_script

SCRIPT = ROOT / "bench" / "recovery.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "bench_recovery")


def test_a_tiny_run(bench, tmp_path, capsys):
    out = tmp_path / "recovery.json"
    assert bench.main(["--prompt-lens", "24", "--cut", "6", "--repeats", "1", "--json",
                       str(out)]) == 0
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    assert {case: (row["scope"], row["layers"], row["lost"]) for case, row in rows.items()} == {
        "full": ("full", 30, []), "flip_bit": ("partial", 1, [0]),
        "flip_late_bit": ("partial", 6, [5]), "hold_prefix": ("partial", 6, [3, 4, 5]),
        "killed": ("partial", 6, [3, 4, 5])}
    assert rows["flip_late_bit"]["bound"] == pytest.approx(6 / 30)
    assert "| 24 | 6 | killed | partial | 6 |" in capsys.readouterr().out


def test_bad_flags_are_named(bench):
    for flags in (["--cut", "1"], ["--repeats", "0"], ["--prompt-lens", "0"]):
        with pytest.raises(SystemExit):
            bench.main(flags)
