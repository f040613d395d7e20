"""The GPU script's dry run: every step of `bench/gpu/run.sh` runs on the CPU at tiny sizes and
writes what the summary reads, so a lent GPU's minutes are never lost to a typo in it."""

import json
import os
import subprocess

from tests.support.paths import ROOT


def test_the_dry_run_passes_every_step(tmp_path):
    out = tmp_path / "gpu"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(["bash", str(ROOT / "bench/gpu/run.sh"), str(out), "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    failed = {s["step"]: (out / f"{s['step']}.log").read_text()[-3000:]
              for s in steps if s["rc"] != 0}
    assert not failed, f"{done.stdout[-2000:]}\n{failed}"
    assert done.returncode == 0
    names = [s["step"] for s in steps]
    assert names == ["env", "cuda_tests", "kernels", "services", "executor", "batched",
                     "batched_gemm", "codecs", "ttft", "handoff_smollm2-135m", "summary"]
    for produced in ("env.json", "kernels.json", "services/services_e2e.json", "executor.json",
                     "batched.json", "batched-gemm.json", "codecs.json", "ttft.json", "handoff-smollm2-135m.json",
                     "summary.md", "summary.json"):
        assert (out / produced).stat().st_size > 0, produced
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert {"prefill", "decode", "codecs", "handoff", "services", "kernels", "ttft"} <= set(summary)
