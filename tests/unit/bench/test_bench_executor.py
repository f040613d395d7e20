"""bench/executor.py: its FLOP and byte counts by hand. A dry run's JSON on the CPU:
tests/system/test_commands.py."""


import pytest
import torch

from rekv_core.model import Model, ModelShape
from rekv_core.model.weights import synthetic_weights
from tests.support.paths import ROOT, load_script

SCRIPT = ROOT / "bench" / "executor.py"
TINY = ModelShape(name="tiny", family="qwen2", num_layers=2, hidden_size=8, num_heads=2,
                  num_kv_heads=1, head_dim=4, ffn_size=16, vocab_size=32, rope_theta=1e4,
                  rms_eps=1e-6, tie_embeddings=False, max_positions=64)


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "bench_executor")


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


def test_the_json_is_rewritten_after_the_prefill_and_each_context(bench, monkeypatch):
    writes = []
    monkeypatch.setattr(bench, "write_json", lambda path, result: writes.append(
        (result["prefill"] is not None, len(result["decode"]), result["complete"])))
    assert bench.main(["--dry-run", "--contexts", "16,32", "--steps", "2", "--repeats", "1",
                       "--prompt-len", "16", "--matmul-n", "64", "--json", "out.json"]) == 0
    rows = writes[-1][1]
    assert writes == [(True, 0, False), (True, rows // 2, False), (True, rows, True)]
