"""bench/seal.py at its smallest size: every case timed, the bulk ones against the copy and the
link, the header-only seal per message, and the JSON it writes."""

import json

import pytest

from tests.support.paths import ROOT, load_script

SCRIPT = ROOT / "bench" / "seal.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "bench_seal")


def test_every_case_is_timed_beside_the_copy_and_the_link(bench, tmp_path, capsys):
    out = tmp_path / "seal.json"
    assert bench.main(["--sizes", "1", "--repeats", "2", "--warmups", "0", "--threads", "1",
                       "--link-gbps", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {row["case"]: row for row in result["rows"]}
    assert {"copy", "checksum", "mac, poly1305", "mac, poly61 reference", "seal", "open",
            "seal, sizes only", "encrypt", "decrypt"} <= set(rows)
    assert result["link_gbps"] == 8
    for name, row in rows.items():
        if name in bench.PER_MESSAGE:
            assert row["gbps"] is None and row["times_link"] is None
        else:
            assert row["gbps"] == pytest.approx((1 << 20) / row["median_s"] / 1e9)
            assert row["times_link"] == pytest.approx(row["gbps"] * 8 / result["link_gbps"])
    assert rows["copy"]["fraction_of_copy"] == 1.0
    assert "× 8 Gb/s link" in capsys.readouterr().out


def test_a_link_rate_that_is_not_positive_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--link-gbps", "0"])
