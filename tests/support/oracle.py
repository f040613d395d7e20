"""Helpers that read a transformers model the way our executor reports results."""

import torch


@torch.inference_mode()
def hf_prefill(model, token_ids: list[int]):
    """Last-position logits `[vocab]` and per-layer K, V `[n_kv, S, d_h]` from transformers."""
    out = model(torch.tensor([token_ids]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    if hasattr(cache, "layers"):
        kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    else:
        kv = [(cache[i][0][0], cache[i][1][0]) for i in range(len(cache))]
    return out.logits[0, -1].float(), kv


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= atol, f"{what}: max |diff| {diff:.3g} > {atol}"
