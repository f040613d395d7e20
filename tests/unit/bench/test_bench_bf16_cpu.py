"""bench/bf16_cpu.py: each case runs with the block rule it names, once untimed and then once per
round in a shuffled order; medians and ratios to float32; the CPU's own choice is restored; the
script writes its JSON and table on a small synthetic model."""

import json

import pytest
import torch

from rekv_core.model import Model, blocks
from rekv_core.model.weights import load_weights
from tests.support.paths import ROOT, load_script

SCRIPT = ROOT / "bench" / "bf16_cpu.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "bench_bf16_cpu")


def test_each_case_runs_under_its_rule_and_is_timed_once_a_round(bench):
    model = Model(load_weights("synthetic:smollm2-135m", torch.float32))
    models = {case: model for case in bench.CASES}
    seconds = {"float32": 1.0, "bf16-native": 6.0, "bf16-via-float32": 1.5}
    calls, orders = [], []

    def fake_run(case, model_, ids):
        calls.append((case, blocks.BF16_VIA_FLOAT32, len(ids)))
        return seconds[case], torch.zeros(4, dtype=torch.bfloat16)

    chosen = blocks.BF16_VIA_FLOAT32
    rows = bench.measure(models, [16, 32], repeats=5, clock_run=fake_run)
    assert blocks.BF16_VIA_FLOAT32 == chosen
    assert [(r["prompt_len"], r["case"]) for r in rows] == [
        (s, c) for s in (16, 32) for c in bench.CASES]
    for r in rows:
        assert r["median_ms"] == seconds[r["case"]] * 1e3
        assert r["over_float32"] == seconds[r["case"]]
        assert len(r["samples_ms"]) == 5
    assert len(calls) == 2 * 3 * (1 + 5)
    rounds = [tuple(c for c, _, _ in calls[i:i + 3]) for i in range(3, 18, 3)]
    assert all(sorted(r) == sorted(bench.CASES) for r in rounds)
    assert len(set(rounds)) > 1  # shuffled afresh each round


def test_the_rule_is_applied_inside_the_run_and_restored(bench):
    seen = []
    real = blocks._linear_block

    def spy(x, weight, bias):
        seen.append(blocks.BF16_VIA_FLOAT32)
        return real(x, weight, bias)

    model = Model(load_weights("synthetic:smollm2-135m", torch.bfloat16))
    chosen = blocks.BF16_VIA_FLOAT32
    try:
        blocks._linear_block = spy
        for case, expected in (("bf16-native", False), ("bf16-via-float32", True)):
            seen.clear()
            bench._run(case, model, list(range(8)))
            assert seen and set(seen) == {expected}
    finally:
        blocks._linear_block = real
        blocks.BF16_VIA_FLOAT32 = chosen


def test_the_script_writes_its_figures(bench, tmp_path):
    out, table = tmp_path / "bf16.json", tmp_path / "bf16.md"
    assert bench.main(["--model", "synthetic:smollm2-135m", "--prompt-len", "8", "--repeats",
                       "1", "--threads", "1", "--json", str(out), "--markdown", str(table)]) == 0
    result = json.loads(out.read_text())
    assert {r["case"] for r in result["rows"]} == set(bench.CASES)
    assert result["meta"]["measures"] and result["cpu_has_native_bf16"] in (True, False)
    assert "| 8 | bf16-via-float32 |" in table.read_text()


@pytest.mark.parametrize("argv, field", [(["--repeats", "0"], "--repeats"),
                                         (["--prompt-len", "12,x"], "--prompt-len"),
                                         (["--prompt-len", "0"], "--prompt-len")])
def test_bad_arguments_name_the_field(bench, argv, field, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2 and field in capsys.readouterr().err
