"""`rekv bench handoff` as a user runs it (a real subprocess) on a small real run, and the commit
its JSON names, read in a scratch git checkout. Its statistics and its sweep, in-process:
tests/unit/bench/test_bench_handoff.py."""

import json
import subprocess
import sys

import pytest
import torch

from rekv_cli.bench import handoff, provenance, ttft
from rekv_cli.main import main
from rekv_core.handoff.action import ActionKind
from tests.support.git_checkout import git, make_checkout

ROW_KEYS = {"action", "codec", "cut", "prompt_len", "link_gbps", "bytes", "median_ms", "ci95_ms",
            "speedup_vs_bf16"}


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
    # every kind but the token split, whose l (256) needs a longer prompt: skipped at 24 tokens
    assert {r["action"] for r in rows} == {k.value for k in ActionKind} - {"token_split"}
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
    assert {"rekv_core/handoff", "rekv_cli/bench/handoff.py"} <= set(meta["measures"])


def test_bad_arguments_are_named():
    result = _rekv("bench", "handoff", "--link-gbps", "fast")
    assert result.returncode == 2 and "link-gbps" in result.stderr
    result = _rekv("bench", "handoff", "--runs", "0")
    assert result.returncode == 2 and "runs" in result.stderr
    result = _rekv("bench", "handoff", "--joint-codecs", "int3")
    assert result.returncode == 2 and "int3" in result.stderr


class _Stopped(Exception):
    """The run stopped from outside (the GPU script's step limit), after some points."""


@pytest.mark.parametrize("command, module, runner", [
    (["bench", "handoff", "--quant-codecs", "int8", "--joint-codecs", "int8",
      "--sequential-codecs", ""], handoff, "run_once"),
    (["bench", "ttft", "--codecs", "int8", "--chunk-tokens", "256"], ttft, "run_case")])
def test_a_run_stopped_early_leaves_what_it_finished(tmp_path, monkeypatch, command, module,
                                                     runner):
    """The JSON is rewritten as the run goes (the handoff bench after every case, the TTFT bench,
    whose rounds shuffle the cases, after every (S, link) point): a run stopped in its second
    point leaves the first whole, marked incomplete; a handoff run stopped after two cases leaves
    those two; a finished run says it is complete."""
    out = tmp_path / "partial.json"
    real = getattr(module, runner)
    args = [*command, "--prompt-len", "24", "--link-gbps", "2,3", "--cuts", "15", "--warmups",
            "0", "--runs", "1", "--json", str(out)]

    def stopping(when):
        calls = []

        def run(*a, **kw):
            calls.append(a[1].bandwidth_gbps)  # the link
            if when(calls):
                raise _Stopped
            return real(*a, **kw)
        return run

    monkeypatch.setattr(module, runner, stopping(lambda calls: len(set(calls)) == 2))
    with pytest.raises(_Stopped):
        main(args)
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["rows"]
    assert {r["link"] for r in report["rows"]} == {"2"}
    first_point = len(report["rows"])
    assert not list(tmp_path.glob(".*partial*"))  # written whole, then renamed
    if module is handoff:
        monkeypatch.setattr(module, runner, stopping(lambda calls: len(calls) == 3))
        with pytest.raises(_Stopped):
            main(args)
        report = json.loads(out.read_text())
        assert len(report["rows"]) == 2 < first_point and not report["complete"]
        assert report["rows"][0]["action"] == "bf16_transfer"
        assert all("speedup_vs_bf16" in r for r in report["rows"])
    monkeypatch.setattr(module, runner, real)
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["complete"] is True and {r["link"] for r in report["rows"]} == {"2", "3"}
