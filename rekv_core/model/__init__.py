"""Model shapes, weights, tokenizer and the executor the handoff runs on."""

from rekv_core.model.cache import KVCache
from rekv_core.model.executor import (Model, PrefillOutput, SuffixOutput, decode_greedy,
                                      decode_step, decode_steps, extend, greedy_generate,
                                      iter_layers, prefill, run_layers, run_layers_chunk,
                                      validate_token_ids)
from rekv_core.model.shapes import DEFAULT_MODEL, PRESETS, ModelShape, get_preset
from rekv_core.model.weights import ModelWeights, embedded_gguf_path, load_weights

__all__ = [
    "DEFAULT_MODEL", "KVCache", "Model", "ModelShape", "ModelWeights", "PRESETS", "PrefillOutput",
    "SuffixOutput", "decode_greedy", "decode_step", "decode_steps", "embedded_gguf_path", "extend",
    "get_preset", "greedy_generate", "iter_layers", "load_weights", "prefill", "run_layers",
    "run_layers_chunk",
    "validate_token_ids",
]
