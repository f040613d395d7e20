"""The tests that start a process of the project's own: `rekv` and bench commands run as a user
runs them (a real subprocess), the RPC generator's check and a fresh interpreter. The in-process
parts of what they check are under tests/unit (bench/, plan/, services/, transport/)."""

import json
import math
import subprocess
import sys

import pytest

from rekv_cli.bench.ttft import SCHEDULES
from rekv_core.model import get_preset
from rekv_core.plan.policy import Policy
from tests.support.paths import ROOT, load_script

SCRIPT = ROOT / "bench" / "executor.py"


def _rekv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rekv_cli", *args], capture_output=True,
                          text=True, timeout=600)


def _policy(max_cut):
    return Policy("smollm2-135m", (1, 2048), max_cut)


@pytest.fixture(scope="module")
def bench():
    """bench/executor.py, loaded as a module: its hand-checked FLOP count."""
    return load_script(SCRIPT, "bench_executor")


def test_generated_modules_match_the_proto():
    result = subprocess.run([sys.executable, "-m", "rekv_cli.generate_rpc", "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_importing_transports_leaves_ucx_alone():
    code = ("import sys; from rekv_core.transport import create_receiver, create_sender_pool; "
            "r = create_receiver('inprocess'); create_sender_pool('inprocess').shutdown(); "
            "r.shutdown(); assert 'ucxx' not in sys.modules, 'ucxx imported'; "
            "assert 'rekv_core.transport.ucx' not in sys.modules, 'ucx imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def test_profile_then_plan_from_the_command_line(tmp_path):
    profile = tmp_path / "profile.json"
    result = _rekv("profile", "--lengths", "16,64", "--codecs", "bf16,int8", "--out",
                   str(profile), "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    data = json.loads(profile.read_text())
    assert data["layer_ms"]["lengths"] == [16, 64] and set(data["quantize_ms_per_mib"]) == {
        "bf16", "int8"}
    policy = tmp_path / "policy.json"
    _policy({"int8": 30}).save(policy)
    result = _rekv("plan", "--prompt-len", "2048", "--link-gbps", "0.2", "--profile",
                   str(profile), "--policy", str(policy), "--json")
    assert result.returncode == 0, result.stderr
    decision = json.loads(result.stdout)
    assert set(decision["chosen"]) == {"action", "codec", "cut", "split", "layer_split",
                                       "predicted_ms", "pipelined"}
    ranked = [c["predicted_ms"] for c in decision["candidates"]]
    assert ranked == sorted(ranked) and decision["chosen"]["predicted_ms"] == ranked[0]
    fast = json.loads(_rekv("plan", "--prompt-len", "2048", "--link-gbps", "400", "--profile",
                            str(profile), "--policy", str(policy), "--json").stdout)
    assert fast["chosen"]["cut"] >= decision["chosen"]["cut"]  # a faster link sends more
    result = _rekv("plan", "--prompt-len", "0", "--link-gbps", "1", "--profile", str(profile))
    assert result.returncode == 2 and "prompt-len" in result.stderr


def test_bench_ttft_command(tmp_path):
    out = tmp_path / "ttft.json"
    done = subprocess.run(
        [sys.executable, "-m", "rekv_cli", "bench", "ttft", "--prompt-len", "300",
         "--link-gbps", "x1", "--cuts", "15", "--warmups", "0", "--runs", "1",
         "--threads", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    (point,) = results["points"]
    rows = results["rows"]
    assert {r["schedule"] for r in rows} == set(SCHEDULES)
    for schedule in SCHEDULES:
        best = min((r for r in rows if r["schedule"] == schedule), key=lambda r: r["median_ms"])
        assert point["best"][schedule]["label"] == best["label"]
    assert point["chunked_over_colocated"] == pytest.approx(
        point["best"]["chunked"]["median_ms"] / point["best"]["colocated"]["median_ms"])
    # one round: the paired ratio is that round's ratio of the same two rows
    samples = {s: next(r for r in rows if r["label"] == point["best"][s]["label"])["samples_ms"]
               for s in ("chunked", "colocated")}
    paired = point["paired"]["chunked_over_colocated"]
    assert paired["median"] == pytest.approx(samples["chunked"][0] / samples["colocated"][0])
    assert paired["ci95"][0] <= paired["median"] <= paired["ci95"][1]
    lossless = [r for r in rows if r["codec"] in (None, "bf16")]
    assert lossless and all(r["same_first_token"] for r in lossless)
    streamed_tokens = next(r for r in rows if r["label"] == "streamed tokens/0")
    assert streamed_tokens["prefill_ms"] == 0  # token-only: the prefill computes nothing
    assert point["seed_over_pipelined"] == pytest.approx(
        point["best"]["seed"]["median_ms"] / point["best"]["pipelined"]["median_ms"])
    assert next(r for r in rows if r["label"] == "pipelined int8/15")["prefill_ms"] > 0
    # (how long the prefill takes, a partial one against a whole one, is the benchmark's figure,
    # not a test's: unit/handoff's streamed tests check that the prefill stops at the cut)


def _numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_dry_run_on_the_cpu_writes_positive_finite_figures(bench, tmp_path):
    out = tmp_path / "executor.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--device", "cpu",
                             "--threads", "1", "--json", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "prefill S=256" in result.stdout and "x floor" in result.stdout
    report = json.loads(out.read_text())
    assert set(report) == {"meta", "ceilings", "prefill", "decode", "complete"}
    assert report["complete"] is True
    meta = report["meta"]
    assert meta["model"] == "synthetic:smollm2-135m" and meta["dtype"] == "float32"
    assert meta["contexts"] == [128, 512] and meta["steps"] == 8 and meta["repeats"] == 3
    assert meta["commit"] and "--dry-run" in meta["command"] and meta["machine"]["cpu"]
    assert meta["tree_clean"] in (True, False) and meta["started"]
    assert report["ceilings"]["matmul"]["n"] == 512
    assert report["prefill"]["flops"] == bench.prefill_flops(get_preset("smollm2-135m"), 256)
    rows = report["decode"]
    assert [(r["context"], r["mode"]) for r in rows] == [
        (128, "eager"), (128, "static"), (512, "eager"), (512, "static")]
    # 30 layers of 576 + 576·960 + 576·576 + 3·576·1536 + 576 float32 values, the final norm,
    # one row of the tied embedding and the whole of it as LM head, K and V of 128 positions
    weights = 30 * (2 * 576 + 576 * 960 + 576 * 576 + 3 * 576 * 1536) + 2 * 576 + 49152 * 576
    assert rows[0]["read_bytes"] == 4 * (weights + 2 * 30 * 3 * 128 * 64)
    for row in rows:
        assert row["ratio_to_floor"] == pytest.approx(row["median_ms"] / row["floor_ms"])
        assert row["tokens_per_s"] == pytest.approx(1e3 / row["median_ms"])
    numbers = list(_numbers({k: report[k] for k in ("ceilings", "prefill", "decode")}))
    assert numbers and all(math.isfinite(x) and x > 0 for x in numbers)
