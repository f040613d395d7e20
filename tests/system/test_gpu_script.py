"""The GPU script's dry run, in a venv holding only what the lent GPU machine holds plus the
carried wheels (`bench/gpu/device_venv.sh`, built here on first use: PyPI), so a package the
device lacks fails here and not in device minutes: every step of `bench/gpu/run.sh` runs on the
CPU at tiny sizes and writes what the summary reads. And what the call would carry fits."""

import json
import os
import subprocess

import pytest

from tests.support.paths import ROOT

VENV = ROOT / ".venv-device"
WHEELS = ROOT / ".gpu-wheels"


@pytest.fixture(scope="module")
def device_python():
    done = subprocess.run(["bash", str(ROOT / "bench/gpu/device_venv.sh"), str(VENV),
                           str(WHEELS)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return VENV / "bin" / "python"


def test_the_device_venv_lacks_what_the_device_lacks(device_python):
    """The venv is the device's image, not this one's: no cryptography, no OpenTelemetry; and
    every module a GPU step imports imports there."""
    for missing in ("cryptography", "opentelemetry"):
        probe = subprocess.run([str(device_python), "-c", f"import {missing}"],
                               capture_output=True, text=True)
        assert probe.returncode != 0, f"{missing} is in the device venv"
    check = subprocess.run([str(device_python), str(ROOT / "bench/gpu/import_check.py"),
                            "--json"], cwd="/", capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-2000:]
    result = json.loads(check.stdout)
    assert not result["failed"] and len(result["imported"]) > 150
    assert set(result["optional_missing"].values()) == {"opentelemetry"}


def test_the_dry_run_passes_every_step_in_the_device_venv(tmp_path, device_python):
    out = tmp_path / "gpu"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = str(device_python)
    done = subprocess.run(["bash", str(ROOT / "bench/gpu/run.sh"), str(out), "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    failed = {s["step"]: (out / f"{s['step']}.log").read_text()[-3000:]
              for s in steps if s["rc"] != 0}
    assert not failed, f"{done.stdout[-2000:]}\n{failed}"
    assert done.returncode == 0
    names = [s["step"] for s in steps]
    assert names == ["env", "cuda_tests", "handoff_smollm2-135m", "kernels", "services",
                     "executor", "batched", "batched_invariant", "codecs", "ttft", "summary"]
    for produced in ("env.json", "kernels.json", "services/services_e2e.json", "executor.json",
                     "batched.json", "batched-invariant.json", "codecs.json", "ttft.json",
                     "handoff-smollm2-135m.json", "summary.md", "summary.json"):
        assert (out / produced).stat().st_size > 0, produced
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert {"prefill", "decode", "codecs", "handoff", "services", "kernels", "ttft"} <= set(summary)
    env_json = json.loads((out / "env.json").read_text())
    assert env_json["commit"] and env_json["tree_clean"] in (True, False)
    assert "cryptography" not in env_json["packages"]
    handoff = json.loads((out / "handoff-smollm2-135m.json").read_text())
    assert handoff["complete"] is True and handoff["meta"]["commit"] == env_json["commit"]


def test_what_the_device_call_carries_fits_with_room(device_python, tmp_path):
    """The tree that travels, the slimmed wheels and the manifest, under 64 MiB with 8 free."""
    manifest = tmp_path / "manifest.json"
    subprocess.run([str(device_python), str(ROOT / "bench/gpu/tree_manifest.py"), "write",
                    str(manifest)], cwd=ROOT, check=True, capture_output=True)
    done = subprocess.run([str(device_python), str(ROOT / "bench/gpu/carry_size.py"), "--carry",
                           ".gpu-wheels", "--carry", str(manifest), "--json"],
                          cwd=ROOT, capture_output=True, text=True)
    result = json.loads(done.stdout)
    assert done.returncode == 0 and result["fits"], result
    assert result["carried_bytes"] < 40 * 2**20  # the slimmed wheel set
