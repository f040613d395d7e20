"""bench/executor.py: its FLOP and byte counts by hand, and a dry run's JSON on the CPU."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rekv_core.model import Model, ModelShape, get_preset
from rekv_core.model.weights import synthetic_weights

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "executor.py"
TINY = ModelShape(name="tiny", family="qwen2", num_layers=2, hidden_size=8, num_heads=2,
                  num_kv_heads=1, head_dim=4, ffn_size=16, vocab_size=32, rope_theta=1e4,
                  rms_eps=1e-6, tie_embeddings=False, max_positions=64)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_executor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefill_flops_match_a_hand_count(bench):
    # S=10, d=8, q=8, kv=4, ffn=16: QKV 2·10·8·16 = 2560, O 2·10·8·8 = 1280,
    # MLP 2·10·8·32 + 2·10·16·8 = 7680, causal attention 2·2·10²·2·4/2 = 1600; two layers,
    # plus the LM head of one position 2·8·32 = 512
    assert bench.prefill_flops(TINY, 10) == 2 * (2560 + 1280 + 7680 + 1600) + 512


@pytest.mark.parametrize("shared", [True, False])
def test_decode_read_bytes_match_a_hand_count(bench, shared):
    model = Model(synthetic_weights(TINY, torch.bfloat16, shared_layer=shared))
    # per layer: norms 2·8, fused QKV 16·8 and its bias 16, O 8·8, gate/up 32·8, down 8·16
    layer = 2 * 8 + 16 * 8 + 16 + 8 * 8 + 32 * 8 + 8 * 16
    weights = 2 * layer + 8 + 8 + 32 * 8  # two layers, final norm, one embedding row, LM head
    kv = 2 * 2 * 1 * 10 * 4  # K and V, 2 layers, 1 kv head, 10 positions, d_h 4
    assert bench.weight_read_bytes(model) == weights * 2
    assert bench.decode_read_bytes(model, 10) == (weights + kv) * 2


def test_contexts_are_clipped_to_the_model(bench):
    assert bench.clip_contexts([1024, 8192, 9000], 32, 8192) == [1024, 8160]
    with pytest.raises(ValueError, match="steps"):
        bench.clip_contexts([16], 64, 64)


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
    assert set(report) == {"meta", "ceilings", "prefill", "decode"}
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
