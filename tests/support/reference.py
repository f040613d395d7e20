"""The single-process reference that the services' answers are checked against:
`greedy_reference(tokenizer)`, a function of (prompt, n, stop_at_eos=True) giving the embedded
model's greedy tokens in BF16 (the serving dtype), each generated once."""

from collections.abc import Callable

import torch

from rekv_core.model import Model, greedy_generate, load_weights


def greedy_reference(tokenizer) -> Callable[..., list[int]]:
    model = Model(load_weights("smollm2-135m", torch.bfloat16))
    cache = {}

    def tokens(prompt: str, n: int, stop_at_eos: bool = True) -> list[int]:
        if (prompt, n, stop_at_eos) not in cache:
            cache[prompt, n, stop_at_eos] = greedy_generate(
                model, tokenizer.encode(prompt), n,
                tokenizer.eos_token_id if stop_at_eos else None)
        return cache[prompt, n, stop_at_eos]

    return tokens
