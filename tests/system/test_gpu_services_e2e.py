"""`bench/gpu/services_e2e.py --dry-run` on the CPU: both services as processes on a tiny random
Hugging Face checkpoint, UCX on loopback; every lossless action must reproduce the reference."""

import json
import subprocess
import sys

import pytest

from tests.support.paths import ROOT
from tests.support.requires import require

SCRIPT = ROOT / "bench" / "gpu" / "services_e2e.py"

pytest.importorskip("transformers")
require("ucxx")


def test_dry_run_matches_the_reference_for_every_lossless_action(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--device", "cpu",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    report = json.loads((out / "services_e2e.json").read_text())
    summary = report["summary"]
    assert summary["all_lossless_forced_matched"] and summary["all_judged_matched"]
    assert summary["services_exit_codes"] == {"decode": 0, "prefill": 0}
    assert report["checkpoint"]["loader_check"]["ok"]
    forced = [c for c in report["cases"] if c["forced"] is not None]
    kinds = {c["action"]["kind"] for c in forced}
    assert kinds == {"bf16_transfer", "bf16_recompute", "token_recompute"}
    for case in forced:
        assert case["match"] and not case["fallback"], case["request_id"]
        assert [case["action"]["codec"], case["action"]["cut"]] == case["forced"]
        assert case["tokens"] == case["reference"] and len(case["tokens"]) == 4
    planned = [c for c in report["cases"] if c["forced"] is None]
    assert len(planned) == 1 and planned[0]["judged"] and planned[0]["ok"]
    assert (out / "prefill.log").is_file() and (out / "decode.log").is_file()
    assert report["ucx_transports_seen"]  # UCX_PROTO_INFO tables were logged and parsed
    assert report["meta"]["commit"] and report["meta"]["torch"]
