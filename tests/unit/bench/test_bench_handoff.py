"""`rekv bench handoff`: its statistics, its sweep and its JSON, on a small real run."""

import json
import random
import statistics
import subprocess
import sys

import pytest
import torch

from rekv_cli.bench import handoff, provenance
from rekv_cli.bench.handoff import BenchConfig, LinkRate, cases_for, default_cuts
from rekv_cli.bench.stats import median_ci, paired_ratio
from rekv_cli.main import main
from rekv_core.handoff import ReceiveMode
from rekv_core.handoff.action import ActionKind
from tests.git_checkout import git, make_checkout

ROW_KEYS = {"action", "codec", "cut", "prompt_len", "link_gbps", "bytes", "median_ms", "ci95_ms",
            "speedup_vs_bf16"}


def test_median_ci_brackets_the_median_and_narrows_with_agreement():
    samples = [10.0, 11.0, 12.0, 13.0, 50.0, 9.0, 10.5, 11.5, 12.5, 10.2]
    median, (low, high) = median_ci(samples)
    assert median == statistics.median(samples)
    assert low <= median <= high
    assert high < 50.0  # the outlier does not drag the median's interval
    assert median_ci([7.0] * 12) == (7.0, (7.0, 7.0))
    # seeded: a committed interval is recomputed from its samples, whatever the global random
    # state; with 20 resamples each seed gives its own interval (pinned: any other draw differs)
    assert (low, high) == (10.2, 12.5)
    state = random.getstate()
    try:
        for global_seed in (1, 2):
            random.seed(global_seed)
            assert median_ci(samples, resamples=20) == (11.25, (10.35, 12.25))
    finally:
        random.setstate(state)
    assert median_ci(samples, resamples=20, seed=3) == (11.25, (10.0, 13.0))
    with pytest.raises(ValueError, match="samples"):
        median_ci([])


def test_paired_ratios_cancel_a_drift_the_cases_share():
    """Two cases run once per round on a machine whose speed drifts by 2x between rounds: each
    case's own median is spread over the drift, the ratio of the same round is not."""
    drift = [1.0, 1.5, 2.0, 1.2, 1.8, 1.1, 1.6]
    fast = [100.0 * d for d in drift]
    slow = [110.0 * d for d in drift]
    ratio, (low, high) = paired_ratio(slow, fast)
    assert ratio == pytest.approx(1.1) and high - low == pytest.approx(0.0, abs=1e-12)
    _, (own_low, own_high) = median_ci(slow)
    assert own_high / own_low > 1.3  # unpaired, the drift swamps the 10%
    with pytest.raises(ValueError, match="one numerator per denominator"):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="denominators"):
        paired_ratio([1.0], [0.0])


def test_link_rates_parse_and_scale():
    assert LinkRate.parse("x2").gbps(0.25) == 0.5
    assert LinkRate.parse("10").gbps(0.25) == 10.0
    assert LinkRate.parse("x0.5").label == "x0.5"
    for bad in ("fast", "x", "-1", "x0"):
        with pytest.raises(ValueError, match="link-gbps"):
            LinkRate.parse(bad)


def test_sweep_covers_every_action_kind_and_both_schedules():
    cases = cases_for(30, BenchConfig())
    assert {c.action.kind for c in cases} == set(ActionKind)
    assert default_cuts(30) == [6, 12, 18, 24]
    joint_int8 = {c.action.cut for c in cases if c.action.codec == "int8" and
                  c.action.kind == ActionKind.JOINT and c.mode is ReceiveMode.SEQUENTIAL}
    assert joint_int8 == {6, 12, 18, 24}
    with pytest.raises(ValueError, match="cuts"):
        cases_for(30, BenchConfig(cuts=[30]))


def _rekv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rekv_cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_small_run_writes_rows_for_every_action(tmp_path):
    out = tmp_path / "handoff.json"
    result = _rekv("bench", "handoff", "--prompt-len", "24", "--link-gbps", "x1,2",
                   "--cuts", "15", "--quant-codecs", "int8", "--joint-codecs", "int8,int4",
                   "--sequential-codecs", "int8", "--warmups", "1", "--runs", "3",
                   "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "Overlapped vs sequential" in result.stdout
    report = json.loads(out.read_text())
    rows = report["rows"]
    # 5 transfer/token actions + bf16 and int8, int4 at cut 15 + int8 sequential, per link rate
    assert len(rows) == 2 * 7
    assert all(ROW_KEYS <= set(r) for r in rows)
    assert {r["action"] for r in rows} == {k.value for k in ActionKind}
    assert {r["link_gbps"] for r in rows if r["link"] == "2"} == {2.0}
    starts = [t for r in rows for t in r["samples_started_s"]]
    assert len(set(starts)) == len(starts) == 2 * 7 * 3  # every sample is its own run
    for r in rows:
        assert r["runs"] == 3 and len(r["samples_ms"]) == 3
        assert r["samples_started_s"] == sorted(r["samples_started_s"])
        assert r["ci95_ms"][0] <= r["median_ms"] <= r["ci95_ms"][1]
        if r["action"] == "bf16_transfer":
            assert r["speedup_vs_bf16"] == 1.0
    by = {(r["link"], r["action"], r["codec"], r["schedule"]): r for r in rows}
    # bytes: 30 BF16 layers of [3, 24, 64] K and V, plus the head (576 BF16 values)
    assert by["2", "bf16_transfer", "bf16", "overlap"]["bytes"] == 30 * 2 * 3 * 24 * 64 * 2 + 1152
    assert by["2", "token_recompute", "tokens", "overlap"]["bytes"] == 24 * 4
    assert by["2", "joint", "int8", "overlap"]["bytes_by_kind"]["boundary"] == 24 * 576 * 2
    pairs = report["overlap_vs_sequential"]
    assert {(p["link"], p["codec"], p["cut"]) for p in pairs} == {("x1", "int8", 15),
                                                                  ("2", "int8", 15)}
    assert report["points"][0]["balanced_gbps"] > 0
    assert report["meta"]["model"] == "smollm2-135m" and report["meta"]["runs"] == 3


def test_the_json_names_the_commit_read_before_the_run(tmp_path, monkeypatch):
    """A commit made while the bench runs is not credited with its figures: the meta carries the
    commit and the clean tree read before the first timed run, and when the run started."""
    checkout = make_checkout(tmp_path / "checkout")
    first = git(checkout, "rev-parse", "HEAD")
    monkeypatch.setattr(provenance, "REPO", checkout)
    run_once = handoff.run_once

    def commit_meanwhile(*args, **kwargs):
        if git(checkout, "rev-parse", "HEAD") == first:
            (checkout / "code.py").write_text("FIGURE = 2\n")
            git(checkout, "commit", "-q", "-am", "made during the run")
            (checkout / "code.py").write_text("FIGURE = 3\n")  # and left uncommitted
        return run_once(*args, **kwargs)

    monkeypatch.setattr(handoff, "run_once", commit_meanwhile)
    out = tmp_path / "handoff.json"
    assert main(["bench", "handoff", "--prompt-len", "24", "--link-gbps", "2", "--cuts", "15",
                 "--quant-codecs", "int8", "--joint-codecs", "int8", "--sequential-codecs",
                 "int8", "--warmups", "0", "--runs", "1", "--threads",
                 str(torch.get_num_threads()), "--json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert git(checkout, "rev-parse", "HEAD") != first  # the run did see a new commit
    assert meta["commit"] == first and meta["tree_clean"] is True
    assert meta["started"] and meta["model"] == "smollm2-135m"


def test_bad_arguments_are_named():
    result = _rekv("bench", "handoff", "--link-gbps", "fast")
    assert result.returncode == 2 and "link-gbps" in result.stderr
    result = _rekv("bench", "handoff", "--runs", "0")
    assert result.returncode == 2 and "runs" in result.stderr
    result = _rekv("bench", "handoff", "--joint-codecs", "int3")
    assert result.returncode == 2 and "int3" in result.stderr
