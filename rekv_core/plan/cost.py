"""Predicted handoff time of every action, and the cheapest eligible one (eqs. 8–9 of the seed).

Inputs (`CostInputs`) come from both workers: the link estimate and the quantize cost α from the
prefill side; the suffix cost per layer γ (at this prompt length, under the decode worker's current
load), the restore cost and the join J from the decode side. For an action (b, c), with W the
link rate in bytes/s and `lat` its latency:

- token-only (c = 0): T = lat + m + tokens/W + L·γ + J
- otherwise, overlapped schedule (eq. 9): T = H + max(X, R) + J, where
    H = lat + m + B_H/W                  (boundary; transfer-only: the first layer's latency)
    X = max(c·α_b, B_prefix/W) + α_b + restore_b(c layers) + c·m  (encoding overlaps the wire:
                                          the sender encodes layer i+1 while layer i is on it)
    R = (L − c)·γ
  and transfer-only (c = L) adds the head's bytes and has R = 0.

m is the fixed cost of one data-plane message, measured by the decode worker.

`choose(inputs, codecs)` evaluates every c in [0, L] for each eligible codec and returns the
predictions sorted by predicted time; the first is the choice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rekv_core.handoff.action import Action, wire_bytes
from rekv_core.model.shapes import ModelShape
from rekv_core.units import MiB


@dataclass(frozen=True)
class CostInputs:
    shape: ModelShape
    prompt_len: int
    link_gbps: float  # the link estimate
    suffix_ms_per_layer: float  # γ at this prompt length, now
    quantize_ms_per_mib: dict[str, float] = field(default_factory=dict)  # α per MiB of BF16 KV
    # decoding received prefix into the cache, per MiB of BF16 KV, by codec (absent: free)
    restore_ms_per_mib: dict[str, float] = field(default_factory=dict)
    join_ms: float = 0.0
    link_latency_ms: float = 0.0
    message_ms: float = 0.0  # fixed cost of one data-plane message (round trip, probe, checks)

    def __post_init__(self) -> None:
        if self.link_gbps <= 0:
            raise ValueError(f"link_gbps: must be positive, got {self.link_gbps}")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len: must be positive, got {self.prompt_len}")
        if self.suffix_ms_per_layer < 0:
            raise ValueError(f"suffix_ms_per_layer: must be >= 0, got {self.suffix_ms_per_layer}")


@dataclass(frozen=True)
class Prediction:
    action: Action
    total_ms: float
    h_ms: float
    x_ms: float
    r_ms: float
    j_ms: float
    bytes: int

    def as_dict(self) -> dict:
        return {"action": self.action.kind.value, "codec": self.action.codec,
                "cut": self.action.cut, "predicted_ms": self.total_ms, "h_ms": self.h_ms,
                "x_ms": self.x_ms, "r_ms": self.r_ms, "j_ms": self.j_ms, "bytes": self.bytes}


def predict(action: Action, inputs: CostInputs) -> Prediction:
    shape, S = inputs.shape, inputs.prompt_len
    L, c = shape.num_layers, action.cut
    bytes_per_ms = inputs.link_gbps * 1e9 / 8 / 1e3
    wire = wire_bytes(action, shape, S)
    gamma = inputs.suffix_ms_per_layer
    m = inputs.message_ms
    if c == 0:
        h = inputs.link_latency_ms + m + wire.tokens / bytes_per_ms
        r = L * gamma
        return Prediction(action, h + r + inputs.join_ms, h, 0.0, r, inputs.join_ms, wire.total)
    bf16_layer_mib = shape.kv_layer_bytes(S) / MiB
    alpha = inputs.quantize_ms_per_mib.get(action.codec, 0.0) * bf16_layer_mib
    restore = inputs.restore_ms_per_mib.get(action.codec, 0.0) * bf16_layer_mib * c
    h = inputs.link_latency_ms + m + wire.boundary / bytes_per_ms
    x = (max(c * alpha, (wire.prefix + wire.scales + wire.head) / bytes_per_ms) + alpha + restore
         + c * m)
    r = (L - c) * gamma
    return Prediction(action, h + max(x, r) + inputs.join_ms, h, x, r, inputs.join_ms,
                      wire.total)


def candidate_actions(shape: ModelShape, codecs: Iterable[str]) -> list[Action]:
    """Every (b, c) for the given prefix codecs, c in [1, L], plus token-only (c = 0)."""
    L = shape.num_layers
    actions = [Action.token_only(L)]
    for codec in dict.fromkeys(codecs):
        actions += [Action(codec, c, L) for c in range(1, L + 1)]
    return actions


def choose(inputs: CostInputs, codecs: Iterable[str]) -> list[Prediction]:
    """Predictions of every candidate, cheapest first (ties: fewer bytes first)."""
    predictions = [predict(a, inputs) for a in candidate_actions(inputs.shape, codecs)]
    return sorted(predictions, key=lambda p: (p.total_ms, p.bytes))

