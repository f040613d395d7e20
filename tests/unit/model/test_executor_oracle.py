"""The executor against Hugging Face transformers on the embedded model and on small random Qwen2,
Qwen3 and Llama-3 (RoPE scaling) checkpoints."""

import pytest
import torch

from rekv_core.model import Model, greedy_generate, prefill
from rekv_core.model.weights import load_hf_checkpoint
from tests.support.oracle import assert_close, hf_prefill

pytestmark = pytest.mark.oracle

PROMPTS = [
    "The capital of France is",
    "Here is a list of prime numbers: 2, 3, 5, 7, 11,",
    "def quicksort(items):\n    ",
]


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_embedded_logits_and_kv_match_transformers(smollm_fp32, hf_smollm, tokenizer, prompt):
    ids = tokenizer.encode(prompt)
    ours = prefill(smollm_fp32, ids, boundaries=())
    logits, kv = hf_prefill(hf_smollm, ids)
    assert_close(ours.logits, logits, 2e-3, "logits")
    assert len(kv) == smollm_fp32.shape.num_layers
    for layer, (k, v) in enumerate(kv):
        assert_close(ours.keys[layer], k, 2e-3, f"K of layer {layer}")
        assert_close(ours.values[layer], v, 2e-3, f"V of layer {layer}")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_32_tokens_equal_transformers(smollm_fp32, hf_smollm, tokenizer, prompt):
    ids = tokenizer.encode(prompt)
    ours = greedy_generate(smollm_fp32, ids, 32)
    theirs = _hf_greedy(hf_smollm, ids, 32)
    assert len(theirs) == 32
    assert ours == theirs


@torch.inference_mode()
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy decoding of exactly n tokens over its own KV cache (no stop token)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        cache = getattr(out, "cache", None) or out.past_key_values
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def _random_hf_checkpoint(tmp_path, family: str):
    import transformers

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if family == "qwen2":
        config = transformers.Qwen2Config(rope_theta=1e6, **common)
        model_cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(head_dim=64, rope_theta=1e6, **common)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                "rope_theta": 500000.0}
        config = transformers.LlamaConfig(rope_scaling=rope, rope_theta=500000.0, **common)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # make the biases and norms non-trivial so a missing one is noticed
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    directory = tmp_path / f"tiny-{family}"
    model.save_pretrained(directory)
    return model, directory


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_random_checkpoints_match_transformers(tmp_path, family):
    hf_model, directory = _random_hf_checkpoint(tmp_path, family)
    model = Model(load_hf_checkpoint(directory))
    assert model.shape.family == family
    ids = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prefill(model, ids, boundaries=())
    logits, kv = hf_prefill(hf_model, ids)
    assert_close(ours.logits, logits, 1e-4, "logits")
    for layer, (k, v) in enumerate(kv):
        assert_close(ours.keys[layer], k, 1e-4, f"K of layer {layer}")
        assert_close(ours.values[layer], v, 1e-4, f"V of layer {layer}")
    assert greedy_generate(model, ids, 8) == _hf_greedy(hf_model, ids, 8)
