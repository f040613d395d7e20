"""What the planner knows of one request when it predicts each action's time (`plan.cost`).

`CostInputs` gathers both workers' figures: the link estimate, the codecs' encode and restore
costs, the prefill's and the decode side's cost per layer, the join, the queues, how the handoff is
sent, and which of the seeds' optional actions both workers take. Every time is in ms.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rekv_core.handoff import Order
from rekv_core.model.shapes import ModelShape
from rekv_core.plan.evidence import FREE, CodecCost


@dataclass(frozen=True)
class CostInputs:
    shape: ModelShape
    prompt_len: int
    link_gbps: float  # the link estimate, or its prior where `link_measured` is false
    suffix_ms_per_layer: float  # γ at this prompt length, now
    # each codec's encode (α) and restore cost per MiB of BF16 KV (absent: free)
    codec_costs: Mapping[str, CodecCost] = field(default_factory=dict)
    join_ms: float = 0.0
    link_latency_ms: float = 0.0
    message_ms: float = 0.0  # fixed cost of one data-plane message (round trip, probe, checks)
    prefill_ms_per_layer: float = 0.0  # γ_p at this prompt length, now; 0: not counted
    streamed: bool = False  # sent from inside the prefill, which stops at the cut
    chunk_tokens: int = 0  # the boundary's chunk size (0: one message)
    # streamed: the orders the prefix may go in; the one that predicts less where token order
    # applies (`pipelinable`), layer order where it does not
    orders: frozenset[Order] = frozenset({Order.LAYERS})
    link_measured: bool = True  # false: `link_gbps` is a prior, not a measurement
    token_splits: bool = False  # rank KVPR's token splits too (both workers take them)
    progressive: bool = False  # rank Lynx's streams of the int8 actions too (both take them)
    layer_splits: bool = False  # rank KVPR's per-layer form too (both workers take it)
    prefill_queue: int = 0  # other handoffs waiting for the prefill worker's compute
    prefill_wait_ms: float = 0.0  # until the prefill worker may compute: the compute queued ahead
    decode_queue: int = 0  # other requests computing on the decode worker now
    decode_wait_ms: float = 0.0  # until the decode worker may compute: the compute queued ahead

    def __post_init__(self) -> None:
        if self.link_gbps <= 0:
            raise ValueError(f"link_gbps: must be positive, got {self.link_gbps}")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len: must be positive, got {self.prompt_len}")
        if self.suffix_ms_per_layer < 0:
            raise ValueError(f"suffix_ms_per_layer: must be >= 0, got {self.suffix_ms_per_layer}")
        if not self.orders or not all(isinstance(o, Order) for o in self.orders):
            raise ValueError(f"orders: must be a non-empty set of {[o.value for o in Order]}, "
                             f"got {self.orders!r}")

    def codec_cost(self, codec: str) -> CodecCost:
        return self.codec_costs.get(codec, FREE)
