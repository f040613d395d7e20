"""bench/fixed_cost.py end to end: a real pair exporting its spans to the script's collector, two
requests sent at once in each of two modes (the planner's pick and a forced action), each read
into phases that add up to its TTFT, every figure in the JSON with its provenance and its mode."""

import json
import subprocess
import sys

from tests.support.paths import ROOT

SLACK_MS = 5.0  # two processes' readings of one clock, each span's ends rounded


def test_one_request_is_broken_into_phases_that_add_up(tmp_path):
    out = tmp_path / "fixed.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "fixed_cost.py"), "--requests",
                           "2", "--concurrency", "2", "--warmup", "0", "--modes", "planner,bf16/30",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["exit_codes"] == {"decode": 0, "prefill": 0}
    assert result["compute"]["decode"]["dtype"] == result["compute"]["prefill"]["dtype"]
    assert result["machine"]["commit"] and "bench/fixed_cost.py" in result["machine"]["measures"]
    assert result["concurrency"] == 2 and result["modes"] == ["planner", "bf16/30"]
    assert [row["request"] for row in result["rows"]] == [0, 1, 2, 3]
    forced = [row for row in result["rows"] if row["mode"] == "bf16/30"]
    assert len(forced) == 2 and {row["action"] for row in forced} == {"bf16/30"}
    assert set(result["by_mode"]) == {"planner", "bf16/30"}
    assert result["median"] == result["by_mode"]["planner"]["median"]
    for row in result["rows"]:
        phases = row["phases_ms"]
        assert list(phases) == list(result["median_phases_ms"])
        assert abs(sum(phases.values()) - row["ttft_ms"]) < 1e-6
        assert all(ms > -SLACK_MS for ms in phases.values()), phases
        assert row["compute_ms"] == row["prefill_ms"] + row["decode_compute_ms"] > 0
        assert row["wire_ms"] > 0 and row["over_compute_and_wire"] > 0
        assert row["predicted_ms"] > 0 and row["measured_handoff_ms"] > 0
        assert row["predicted_over_ttft"] == row["predicted_ms"] / row["ttft_ms"]
    assert "2 requests per mode in waves of 2 at once" in done.stdout
    assert "| phase | planner (ms) | bf16/30 (ms) |" in done.stdout
    assert "The planner predicted" in done.stdout and "predicted over the handoff" in done.stdout
    assert "prefill: plan" in done.stdout and "TTFT over compute plus wire" in done.stdout
