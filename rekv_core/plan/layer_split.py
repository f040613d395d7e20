"""KVPR's per-layer form: how many tokens of each sent layer travel as its input rows.

The action (seed 002, seed-spec §3, `Action.layer_split` l): every layer sent as KV sends its
input rows [0, l) (d BF16 values a token) and its K and V of [l, S) in the codec; the decode side
recomputes the K and V of [0, l) from the input rows (the layer's norm, K and V projections and
RoPE; no attention). The layers go as a pipeline of three stages, each layer in turn: the
prefill's compute and encoding (s; after a full prefill the encoding alone), the link (w), and the
decode side's restore and recompute (r):

    w(l) = a·l + b·(S − l) + messages·m          a, b: one token's input row, one token's coded
    r(l) = g·l + q·(S − l)                       K and V row on the wire; g: one token's
    T(l) = s + w(l) + r(l) + (n − 1)·max(s, w(l), r(l))      recompute, q: one token's restore

for n identical layers (a flow shop's makespan). T is convex in l on (0, S) (linear terms plus a
maximum of lines; at l = 0 one message fewer), so its minimum over [0, S) lies at an end or where
two of s, w, r cross:

    w = r at l = (b·S − q·S + messages·m) / (b − a + g − q),
    w = s at l = (b·S + messages·m − s) / (b − a),   r = s at l = (s − q·S) / (g − q);

`best_layer_split` takes those crossings' neighbours on the grid of allowed l (the multiples of
`EXEC_BLOCK` below S: the recomputed rows are then the prefill's bit for bit) and the ends, and
keeps the least T; `brute_force_layer_split` evaluates every allowed l, for the tests. An input
row is d values against a K and V row's 2·n_kv·d_h: with a ≥ b (n_h ≥ 2·n_kv, ReKV's
Proposition 1) the link only loses, and l > 0 could only pay where recomputing a row costs less
than restoring it (g < q), which no measured codec shows.

`layer_split_costs(inputs, codec, cut)` reads a, b, g, q, s and m off the planner's `CostInputs`:
g is γ's share of the K and V projections (`projection_share`) spread over the prompt's tokens.
`layer_split_actions` gives each codec's and cut's action at its best l, where that is above 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rekv_core.codecs import registered_layer_bytes
from rekv_core.handoff import Action
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.shapes import ModelShape
from rekv_core.plan.cost_inputs import CostInputs
from rekv_core.units import BF16_BYTES, MiB


@dataclass(frozen=True)
class LayerSplitCosts:
    input_row_ms: float  # a
    kv_row_ms: float  # b
    recompute_row_ms: float  # g
    restore_row_ms: float = 0.0  # q
    step_ms: float = 0.0  # s: the prefill's compute and encoding of one layer (streamed)
    message_ms: float = 0.0  # m
    layers: int = 1  # n

    def __post_init__(self) -> None:
        for name in ("input_row_ms", "kv_row_ms", "recompute_row_ms", "restore_row_ms",
                     "step_ms", "message_ms"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        if self.layers < 1:
            raise ValueError(f"layers: must be positive, got {self.layers}")

    def stages(self, seq_len: int, split: int) -> tuple[float, float, float]:
        """(s, w, r) of one layer at split l."""
        messages = 2 if split else 1
        w = (self.input_row_ms * split + self.kv_row_ms * (seq_len - split)
             + messages * self.message_ms)
        r = self.recompute_row_ms * split + self.restore_row_ms * (seq_len - split)
        return self.step_ms, w, r


def allowed_layer_splits(seq_len: int, block: int = EXEC_BLOCK) -> list[int]:
    """0 and the multiples of `block` below S."""
    if seq_len < 1 or block < 1:
        raise ValueError(f"seq_len, block: must be positive, got {seq_len}, {block}")
    return list(range(0, seq_len, block))


def layer_split_time(costs: LayerSplitCosts, seq_len: int, split: int) -> float:
    """T(l) of the module's model, ms: the last layer restored."""
    if not 0 <= split < seq_len:
        raise ValueError(f"split: must lie in [0, {seq_len}), got {split}")
    s, w, r = costs.stages(seq_len, split)
    return s + w + r + (costs.layers - 1) * max(s, w, r)


def crossings(costs: LayerSplitCosts, seq_len: int) -> list[float]:
    """Where two of the stages cross (with l > 0), inside [0, S)."""
    a, b, g, q = (costs.input_row_ms, costs.kv_row_ms, costs.recompute_row_ms,
                  costs.restore_row_ms)
    s, m2, S = costs.step_ms, 2 * costs.message_ms, seq_len
    found = []
    for num, den in (((b - q) * S + m2, b - a + g - q), (b * S + m2 - s, b - a),
                     (s - q * S, g - q)):
        if den != 0 and 0 <= num / den < S:
            found.append(num / den)
    return found


def best_layer_split(costs: LayerSplitCosts, seq_len: int, block: int = EXEC_BLOCK) -> int:
    """The allowed l of least T, from the crossings (ties: the smaller l, less recompute)."""
    grid = allowed_layer_splits(seq_len, block)
    near = {0, grid[-1]}
    for x in crossings(costs, seq_len):
        below = int(x // block) * block
        near |= {below, min(below + block, grid[-1])}
    return min(near, key=lambda l: (layer_split_time(costs, seq_len, l), l))


def brute_force_layer_split(costs: LayerSplitCosts, seq_len: int,
                            block: int = EXEC_BLOCK) -> int:
    return min(allowed_layer_splits(seq_len, block),
               key=lambda l: (layer_split_time(costs, seq_len, l), l))


def projection_share(shape: ModelShape, seq_len: int) -> float:
    """The recompute's share of one layer's prefill flops at `seq_len` tokens: the fused Q, K and
    V projection it runs (`recompute_layer_kv`), against that, the O projection, the FFN and
    causal attention over S/2 keys on average."""
    d, q_width = shape.hidden_size, shape.num_heads * shape.head_dim
    qkv = 2 * d * (q_width + 2 * shape.num_kv_heads * shape.head_dim)
    layer = qkv + 2 * q_width * d + 6 * d * shape.ffn_size + 2 * seq_len * q_width
    return qkv / layer


def layer_split_costs(inputs: CostInputs, codec: str, cut: int) -> LayerSplitCosts:
    """The per-layer form's model for `cut` layers sent in `codec` under `inputs`."""
    shape, S = inputs.shape, inputs.prompt_len
    if not 1 <= cut <= shape.num_layers:
        raise ValueError(f"cut: must lie in [1, {shape.num_layers}], got {cut}")
    per_ms = inputs.link_gbps * 1e9 / 8 / 1e3
    layer = registered_layer_bytes(codec, (shape.num_kv_heads, S, shape.head_dim))
    cost = inputs.codec_cost(codec)
    layer_mib = shape.kv_layer_bytes(S) / MiB  # α and the restore are per MiB of BF16 KV
    step = (inputs.prefill_ms_per_layer if inputs.streamed else 0.0) + (
        cost.encode_ms_per_mib * layer_mib)
    return LayerSplitCosts(
        input_row_ms=shape.hidden_size * BF16_BYTES / per_ms,
        kv_row_ms=(layer.data + layer.scales) / S / per_ms,
        recompute_row_ms=inputs.suffix_ms_per_layer * projection_share(shape, S) / S,
        restore_row_ms=cost.restore_ms_per_mib * layer_mib / S,
        step_ms=step, message_ms=inputs.message_ms, layers=cut)


def layer_split_actions(inputs: CostInputs, codecs: Iterable[str],
                        base: Iterable[Action]) -> list[Action]:
    """Each of `base`'s plain actions that sends layers (c ≥ 1, no other split, not Lynx's) at its
    best l, where that is above 0 (where an input row outweighs a K and V row, only where
    recomputing a row costs less than restoring it)."""
    if inputs.prompt_len <= EXEC_BLOCK:  # no l but 0: no multiple of the block inside (0, S)
        return []
    wanted = set(codecs)
    actions = []
    for action in base:
        if (action.cut == 0 or action.split or action.progressive or action.layer_split
                or action.codec not in wanted):
            continue
        l = best_layer_split(layer_split_costs(inputs, action.codec, action.cut),
                             inputs.prompt_len)
        if l:
            actions.append(Action(action.codec, action.cut, action.num_layers, action.boundary,
                                  layer_split=l))
    return actions
