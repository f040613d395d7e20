"""KVPR's token split at the boundary: how many tokens to recompute, from the closed form.

The action (seed 002, seed-spec §3, moved from CPU→GPU offload to a P/D handoff): at the cut c,
send h_c for the first l tokens only; the decode side recomputes layers c..L−1 for tokens [0, l)
while the KV of layers c..L−1 for tokens [l, S) arrives coded; layers below c travel as the joint
action sends them. Causal attention makes the recomputed rows exact: token i < l attends only to
tokens ≤ i, all of which it recomputes itself. l runs over the multiples of `EXEC_BLOCK` below S,
and S (the blocks keep the recomputed rows bit-identical to the prefill's: `model.blocks`).

The time model, per token (ms): a, one token's boundary row on the wire; b, one token's KV of the
L − c suffix layers on the wire (in the action's codec); g, one token through the L − c suffix
layers on the decode side; and P, the prefix layers' wire time. The boundary rows go first, then
the suffix rows, then the prefix; the recompute starts once the boundary rows are in:

    T(l) = a·l + max(g·l, b·(S − l) + P)

(streamed, the prefill sends the prefix layers as it computes them and the boundary right after
the last of them: P₀ + a·l + max(g·l, b·(S − l)), the prefix a constant P₀ ahead, P = 0).

T is convex in l (a line plus the larger of a rising and a falling one). Where a ≥ b a token is
cheaper sent as KV than as its boundary row, and T only rises: l* = 0 (every row sent; with c < L
the suffix layers' KV travel too). Otherwise T falls until the recompute meets the wire,

    l_x = (b·S + P) / (g + b),   clipped to [0, S],

and rises after it; on the grid of allowed l the optimum is one of l_x's two neighbours (convexity),
which `best_split` compares. `brute_force_split` evaluates every allowed l, for the tests.
l = S is ReKV's joint action (T = a·S + max(g·S, P)); l = 0 sends the suffix layers' KV whole.

`cost.split_costs(inputs, codec, cut)` reads a, b, g and P (or P₀) off the planner's
`CostInputs`: the link rate, the codec's bytes per token and layer, and γ (the suffix's cost per
layer at this prompt length) spread evenly over the prompt's tokens. That charges the first l rows the average row's
attention, which rows near the start do not pay: the model leans towards recomputing fewer rows
than would pay.
"""

from __future__ import annotations

from dataclasses import dataclass

from rekv_core.model.blocks import EXEC_BLOCK


@dataclass(frozen=True)
class SplitCosts:
    boundary_row_ms: float  # a
    suffix_row_ms: float  # b
    recompute_row_ms: float  # g
    prefix_ms: float = 0.0  # P, when the prefix follows the suffix rows
    prefix_first_ms: float = 0.0  # P₀, when the prefix goes before the boundary (streamed)

    def __post_init__(self) -> None:
        for name in ("boundary_row_ms", "suffix_row_ms", "recompute_row_ms", "prefix_ms",
                     "prefix_first_ms"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")


def _check(seq_len: int, block: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len: must be positive, got {seq_len}")
    if block < 1:
        raise ValueError(f"block: must be positive, got {block}")


def allowed_splits(seq_len: int, block: int = EXEC_BLOCK) -> list[int]:
    """0, the multiples of `block` below S, and S."""
    _check(seq_len, block)
    return list(range(0, seq_len, block)) + [seq_len]


def split_time(costs: SplitCosts, seq_len: int, split: int) -> float:
    """T(l) of the module's model, ms."""
    if not 0 <= split <= seq_len:
        raise ValueError(f"split: must lie in [0, {seq_len}], got {split}")
    a, b, g = costs.boundary_row_ms, costs.suffix_row_ms, costs.recompute_row_ms
    return (costs.prefix_first_ms + a * split
            + max(g * split, b * (seq_len - split) + costs.prefix_ms))


def crossing(costs: SplitCosts, seq_len: int) -> float:
    """l_x: where the recompute of [0, l) meets the wire's suffix rows and prefix; in [0, S]."""
    g, b = costs.recompute_row_ms, costs.suffix_row_ms
    if g + b == 0:
        return float(seq_len)
    return min(float(seq_len), (b * seq_len + costs.prefix_ms) / (g + b))


def best_split(costs: SplitCosts, seq_len: int, block: int = EXEC_BLOCK) -> int:
    """The allowed l of least T, from the closed form (ties: the smaller l, less recompute)."""
    _check(seq_len, block)
    if costs.boundary_row_ms >= costs.suffix_row_ms:
        return 0
    x = crossing(costs, seq_len)
    below = min(int(x // block) * block, seq_len)
    above = min(below + block, seq_len)
    return min((below, above), key=lambda l: (split_time(costs, seq_len, l), l))


def brute_force_split(costs: SplitCosts, seq_len: int, block: int = EXEC_BLOCK) -> int:
    return min(allowed_splits(seq_len, block),
               key=lambda l: (split_time(costs, seq_len, l), l))
