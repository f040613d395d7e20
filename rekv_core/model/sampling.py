"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling with a
seeded generator (the same seed and logits give the same token on the same device)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


MIN_TEMPERATURE = 1e-6  # below it logits / temperature may overflow float32 to inf


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    seed: int = 0

    def __post_init__(self) -> None:
        # NaN fails every comparison, so each bound is written to fail on it
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"sampling.temperature: must be 0 (greedy) or a finite number >= "
                             f"{MIN_TEMPERATURE:g}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p: must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k: must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams = SamplingParams()):
        self.params = params
        self._generator = torch.Generator().manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scores = logits.float().cpu() / p.temperature
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, 0) - sorted_probs < p.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self._generator))
