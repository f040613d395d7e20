"""`bench/decode_engine.py --quick`: both decode paths as real services, every case measured.

The decode services' UCX thread runs at nice 0 here: at their default, 19, on the one core each
service is pinned to, a new stream's handoff waits for the running streams, so the streams case
may never see its streams run at once (bench/results/decode-engine-default-nice-cpu.md); this
test is of the bench's mechanics, not of that setting."""

import json
import math
import subprocess
import sys

from tests.support.paths import ROOT


def test_a_quick_run_measures_every_case_of_both_paths(tmp_path):
    out = tmp_path / "decode-engine.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_engine.py"), "--quick",
                           "--ucx-loop-nice", "0", "--json", str(out), "--log-dir", str(tmp_path / "logs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    streams = {(r["path"], r["streams"]) for r in rows if r["part"] == "streams"}
    assert streams == {(p, n) for p in ("batched", "per_request") for n in (1, 2)}
    interference = {(r["path"], r["kind"]) for r in rows if r["part"] == "interference"}
    assert interference == {(p, k) for p in ("batched", "per_request")
                            for k in ("token_only", "transfer")}
    for row in rows:
        figures = [v for k, v in row.items() if k.endswith(("_ms", "_per_s"))]
        assert figures and all(math.isfinite(v) and v > 0 for v in figures), row
    assert result["meta"]["itl_budget_ms"] > 0 and result["meta"]["commit"]
    assert "## 1. Concurrent streams" in done.stdout and "| batched | 2 |" in done.stdout
