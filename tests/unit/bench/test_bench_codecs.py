"""bench/codecs.py and bench/codec_real.py at tiny sizes: the interleaved timing, the JSON the
script writes, and the real-data section on a small synthetic model."""

import json
import math
import types

import pytest
import torch

from rekv_core.codecs import codec_names
from rekv_core.model import Model, ModelShape
from rekv_core.model.weights import synthetic_weights
from tests.support.paths import ROOT, load_script

SCRIPT = ROOT / "bench" / "codecs.py"
SHAPE = ModelShape(name="tiny-bench", family="qwen2", num_layers=3, hidden_size=128, num_heads=2,
                   num_kv_heads=1, head_dim=64, ffn_size=128, vocab_size=128, rope_theta=1e4,
                   rms_eps=1e-6, tie_embeddings=False, max_positions=256)
OLD_ROW_FIELDS = {"model", "prompt_len", "codec", "op", "input_bytes", "payload_bytes",
                  "median_ms", "gbps", "fraction_of_copy"}


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "bench_codecs")


@pytest.fixture(scope="module")
def real():
    from bench import codec_real

    return codec_real


def test_interleaved_timing_runs_every_case_warmups_plus_repeats_times(bench, monkeypatch):
    """On a clock only the cases move (1000 s per warm-up, then each round's given seconds):
    every case warmed up untimed, then timed once per round in an order shuffled afresh, and
    its median (not its mean) returned."""
    now, log = [0.0], []
    rounds_s = {"a": [5, 1, 4, 2, 3], "b": [10, 10, 40, 20, 90], "c": [7, 7, 7, 7, 700]}

    def case(key):
        def fn():
            log.append(key)
            timed = log.count(key) - 3  # after its 2 warm-ups
            now[0] += 1000.0 if timed < 0 else rounds_s[key][timed]
        return fn

    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    seconds = bench.interleaved_medians({key: case(key) for key in rounds_s}, 5,
                                        torch.device("cpu"), warmups=2)
    assert seconds == {"a": 3.0, "b": 20.0, "c": 7.0}
    assert log[:6] == ["a", "a", "b", "b", "c", "c"] and len(log) == 6 + 5 * 3
    rounds = [log[i:i + 3] for i in range(6, len(log), 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)  # each case once per round
    assert len({tuple(r) for r in rounds}) > 1  # in a fresh order (seed 0: not all alike)


def test_the_json_keeps_its_fields_and_covers_every_codec(bench, tmp_path):
    out = tmp_path / "codecs.json"
    assert bench.main(["--model", "smollm2-135m", "--prompt-len", "64", "--repeats", "1",
                       "--no-real", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"machine", "command", "repeats", "warmups", "copy_gbps", "rows", "ceilings",
            "real"} <= set(result)
    assert {"cpu", "cores", "device", "torch", "python", "commit", "tree_clean",
            "started"} <= set(result["machine"])
    assert result["real"] is None and result["copy_gbps"] > 0
    assert [c["op"] for c in result["ceilings"]] == ["copy_", "clone"]
    ops = {(r["codec"], r["op"]) for r in result["rows"]}
    assert {(name, op) for name in codec_names() for op in ("encode", "decode")} <= ops
    for name in ("int8", "int4", "int4h"):
        assert {(name, "quantize kernel"), (name, "dequantize kernel")} <= ops
    assert {("splitzip", "encode kernel"), ("splitzip", "decode kernel")} <= ops
    for r in result["rows"]:
        assert OLD_ROW_FIELDS <= set(r)
        assert r["gbps"] > 0 and math.isfinite(r["fraction_of_copy_same_size"])
        assert r["input_bytes"] == 2 * 2 * 3 * 64 * 64  # K and V, 3 kv heads, S 64, d_h 64
    splitzip = next(r for r in result["rows"] if r["codec"] == "splitzip")
    assert 1.0 < splitzip["ratio"] <= 4 / 3


def test_windows_are_disjoint_and_spread(real):
    ids = list(range(10_000))
    measured, calibration = real.split_windows(ids, 100, 4, 2)
    assert len(measured) == 4 and len(calibration) == 2
    starts = [w[0] for w in measured + calibration]
    assert len(set(starts)) == 6 and all(len(w) == 100 for w in measured + calibration)
    assert min(abs(a - b) for a in starts for b in starts if a != b) >= 100


def test_real_section_ratios_and_round_trips_on_a_small_model(real):
    model = Model(synthetic_weights(SHAPE, torch.bfloat16, seed=3))
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, SHAPE.vocab_size, (48,), generator=g).tolist() for _ in range(3)]
    result = real.real_section(model, windows[:2], windows[2:])
    assert result["boundaries"] == [1, 2] and set(result["codebooks"]) == {"kv", "boundary"}
    kv = {(r["codec"], r["codebook"]): r for r in result["kv"]}
    assert set(kv) == {(n, "per-tensor" if n == "splitzip" else None) for n in codec_names()} | {
        ("splitzip", "kv"), ("splitzip", "boundary")}
    for r in result["kv"]:
        assert list(r["layer_ratios"]) == ["0", "1", "2"]
        assert r["input_bytes"] == 2 * 2 * 3 * 48 * 64 * 2  # windows, K and V, layers, BF16
        if r["lossless"]:
            assert r["exact"] is True
        else:
            assert r["ratio"] > 1.5 and 0 < r["k_rel_err"] < 0.5
    assert kv[("bf16", None)]["ratio"] == 1.0
    assert 1.0 < kv[("splitzip", "per-tensor")]["ratio"] <= 4 / 3
    assert 0.0 <= kv[("splitzip", "per-tensor")]["escape_rate"] < 0.05
    boundary = {r["codebook"]: r for r in result["boundary"]}
    assert set(boundary) == {"per-tensor", "kv", "boundary"}
    assert all(r["exact"] and list(r["boundary_ratios"]) == ["1", "2"] for r in boundary.values())
    assert 1.0 < boundary["per-tensor"]["ratio"] <= 4 / 3
    assert boundary["per-tensor"]["input_bytes"] == 2 * 2 * 48 * 128 * 2  # windows, cuts, BF16


def test_the_json_is_rewritten_after_each_model(bench, tmp_path, monkeypatch):
    """A run cut short keeps every model it finished: one write per model, marked incomplete,
    then the complete result."""
    writes = []
    monkeypatch.setattr(bench, "write_json", lambda path, result: writes.append(
        (path, len(result["rows"]), result["complete"])))
    assert bench.main(["--model", "smollm2-135m", "--model", "smollm2-135m", "--prompt-len",
                       "64", "--repeats", "1", "--no-real", "--json", "out.json"]) == 0
    per_model = writes[0][1]
    assert writes == [("out.json", per_model, False), ("out.json", 2 * per_model, False),
                      ("out.json", 2 * per_model, True)]
