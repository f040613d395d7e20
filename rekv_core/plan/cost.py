"""Predicted time to first token of every action, and the cheapest eligible one.

Inputs (`CostInputs`) come from both workers: the link estimate, the quantize cost α and the
prefill's cost per layer γ_p from the prefill side; the suffix cost per layer γ (at this prompt
length, shared with the requests generating there), the restore cost, the join J and D_w, the
compute already committed to the decode worker (`decode_wait_ms`), from the decode side; and how
the handoff is sent (`streamed`, `chunk_tokens`). W is the link rate in bytes/ms,
`lat` its latency, m the fixed cost of one data-plane message (measured by the decode worker).
Every time counts from the start of the prefill to the decode side's complete cache and
first-token logits. Decode-side compute (R, or token-only's L·γ) starts no earlier than D_w: the
decode worker's compute is a queue, as the prefill worker's is (P_w); transfer-only computes
nothing there and does not wait for it.

The seed's schedule (a full prefill, then the handoff, eqs. 8–9), `streamed` false:

- token-only (c = 0): T = max(P_w + L·γ_p + lat + m + tokens/W, D_w) + L·γ + J
- otherwise: T = max(P_w + L·γ_p + H + X, max(P_w + L·γ_p + H, D_w) + R) + J, where
    H = lat + m + B_H/W + coding         (boundary; transfer-only: the first layer's latency;
                                          coding: a SplitZip boundary's encode and decode)
    X = max(c·α_b, B_prefix/W) + α_b + restore_b(c layers) + c·m  (encoding overlaps the wire)
    R = (L − c)·γ
  and transfer-only (c = L) adds the head's bytes and has R = 0.

Streamed (the prefill sends each layer as it computes it and stops at the cut; the boundary goes
in chunks, and the decode side starts its layers on each chunk): with one layer's step s = γ_p + α_b
and its wire time w = B_layer/W + m,

- token-only: T = max(lat + m + tokens/W, D_w) + L·γ + J (the prefill computes nothing, and
  waits for nothing);
- the prefix is on the decode side at E = P_w + max(c·s + w, s + c·w) (the link serializes what
  the prefill produces, from when the prefill worker may compute, P_w after the request's
  arrival: the compute queued ahead of it), restored one layer later;
- transfer-only: T = lat + E + head/W + m + restore_b(1 layer) + J;
- otherwise the chunks follow the prefix on the link from max(P_w + c·s, E) on, each
  rows·(B_H/S/W + coding per row) + m, and each chunk's share of R = (L − c)·γ starts once it
  has arrived and the previous chunk's share is done (the first no earlier than D_w):
  T = lat + max(suffix end, E + restore_b(1 layer)) + J. (The boundary's first chunk could
  overtake the last prefix layer, saving up to that layer's wire time; it does not, because the
  layer then starts the decode side's link sample and the chunk, queued behind it, completes
  it, where a chunk sent first has nothing before it to time from.)

Pipelined (`Order.TOKENS` among `orders`, alone or where it predicts less than layer order; an
interior cut, a codec that ranks no tokens): the prefill runs layers [0, c) one boundary chunk at a
time, and each chunk's boundary rows, then its c prefix rows, leave as soon as it has passed the
cut. With n_k the chunk's rows and shares f_k = n_k/S: the chunk is computed, and then encoded, on
the prefill's one thread, P_k = P_{k−1} + f_k·c·(γ_p + α_b) (from P_w); its boundary rows are in at
A_k = max(P_k − f_k·c·α_b, link free) + n_k·(B_H/S/W + coding per row) + m, and its prefix rows
leave after them: link free = max(A_k, P_k) + f_k·B_prefix/W + c·m. Its share of R starts at
max(A_k, the previous chunk's end) (the first no earlier than D_w): T = lat + max(suffix end, link
free + f_last·restore_b(c layers)) + J. The decode side's layers run on a chunk while the prefill
computes the next, so two workers share one prompt's compute.

The planner ranks by T plus the wait the action puts on the other requests (`load_ms`). A busy
pool already shows in T, through P_w and D_w. But the requests behind this one pass both pools in
turn, and in a busy pipeline each of them waits for the longer of this request's two stages, not
for the sum: `load_ms` = (prefill queue + decode queue) · max(prefill compute, suffix compute),
least where the stages balance (streamed; the seed's schedule prefills every layer whatever the
cut, so there the term hardly moves). With nothing else in flight it is 0 and T alone decides; under
load it keeps the cut between the ends, where the two pools serve the most requests, instead of
swinging it from one end to the other as the queues move.

A token split (KVPR's, `Action.split` l, `_predict_split`): every layer computed on the prefill
side, the boundary's rows [0, l) first (after a full prefill) or right after layer c − 1
(streamed), each layer's coded rows (the prefix layers whole, the others [l, S)) serialized on the link as
computed, the head last; the decode side recomputes layers c..L−1 for [0, l) chunk by chunk from
each arrival: R = (L − c)·γ·l/S.

Lynx's streams (`Action.progressive`, an `int8` action's bytes with every layer's anchor before any
residual): T counts the bytes before the residuals only (`before_residuals`: the codes' top
nibbles and the scales), since the first token is computed on the anchors; the residuals follow on
the link while the decode side drafts, and the verified tokens are the `int8` action's.

KVPR's per-layer form (`Action.layer_split` l, `plan.layer_split`): each sent layer is a stage
of a pipeline (the prefill's step, the link's input rows and coded rows, the decode side's restore
and recompute of the K and V projections), the slowest stage setting the pace:
restored = P_w + s + w + r + (c − 1)·max(s, w, r), in place of the prefix's end plus one restore
(streamed); after a full prefill, X as the plain action's with each layer's restore r.

`choose(inputs, codecs)` evaluates every c in [0, L] for each eligible codec (and, where
`inputs.token_splits`, each interior cut's token split at the closed form's l: `split_actions`,
`split_costs`; where `inputs.layer_splits`, each action that sends layers also at its best
per-layer l: `layer_split_actions`; where `inputs.progressive`, each `int8` action also as Lynx's
streams) and returns the predictions sorted by predicted time; the first is the choice.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass

from rekv_core.codecs import registered_layer_bytes
from rekv_core.codecs.lynx import BASE_CODEC as PROGRESSIVE_CODEC
from rekv_core.handoff import Action, Order, WireBytes, before_residuals, wire_bytes
from rekv_core.handoff.plan import can_pipeline
from rekv_core.model.blocks import EXEC_BLOCK, chunk_bounds
from rekv_core.model.shapes import ModelShape
from rekv_core.plan.cost_inputs import CostInputs
from rekv_core.plan.layer_split import layer_split_actions, layer_split_costs
from rekv_core.plan.token_split import SplitCosts, best_split
from rekv_core.units import BF16_BYTES, MiB


@dataclass(frozen=True)
class Prediction:
    action: Action
    total_ms: float
    h_ms: float
    x_ms: float
    r_ms: float
    j_ms: float
    bytes: int
    prefill_ms: float = 0.0  # the prefill's compute for this action
    load_ms: float = 0.0  # the wait it puts on the other queued requests (see the module doc)
    pipelined: bool = False  # predicted in token order

    def as_dict(self) -> dict:
        return {"action": self.action.kind.value, "codec": self.action.codec,
                "cut": self.action.cut, "split": self.action.split,
                "predicted_ms": self.total_ms, "h_ms": self.h_ms,
                "x_ms": self.x_ms, "r_ms": self.r_ms, "j_ms": self.j_ms, "bytes": self.bytes,
                "prefill_ms": self.prefill_ms, "load_ms": self.load_ms,
                "pipelined": self.pipelined, "progressive": self.action.progressive,
                "layer_split": self.action.layer_split}


def predict(action: Action, inputs: CostInputs) -> Prediction:
    """T of `action` under `inputs`' schedule, with its load term."""
    if action.split:
        p = _predict_split(action, inputs)
    elif not inputs.streamed:
        p = _predict_after_prefill(action, inputs)
    else:
        p = _predict_streamed(action, inputs)
        if Order.TOKENS in inputs.orders and pipelinable(action, inputs):
            tokens = _predict_pipelined(action, inputs)
            if Order.LAYERS not in inputs.orders or tokens.total_ms < p.total_ms:
                p = tokens
    load = (inputs.prefill_queue + inputs.decode_queue) * max(p.prefill_ms, p.r_ms)
    # (not dataclasses.replace, which costs a third of a prediction: the planner makes hundreds)
    return Prediction(p.action, p.total_ms, p.h_ms, p.x_ms, p.r_ms, p.j_ms, p.bytes,
                      p.prefill_ms, load, p.pipelined)


def pipelinable(action: Action, inputs: CostInputs) -> bool:
    """Whether `action` can go in token order under `inputs`' schedule."""
    return (inputs.streamed and inputs.chunk_tokens > 0
            and can_pipeline(action, action.registered_codec))


def _alpha_ms(action: Action, inputs: CostInputs) -> tuple[float, float]:
    """(encode, restore) ms of one layer in the action's codec."""
    layer_mib = inputs.shape.kv_layer_bytes(inputs.prompt_len) / MiB
    cost = inputs.codec_cost(action.codec)
    return cost.encode_ms_per_mib * layer_mib, cost.restore_ms_per_mib * layer_mib


def _boundary_ms_per_mib(action: Action, inputs: CostInputs) -> float:
    """Encoding plus decoding of one MiB of BF16 boundary, in the boundary's coding."""
    if action.boundary == "bf16":
        return 0.0
    cost = inputs.codec_cost(action.boundary)
    return cost.encode_ms_per_mib + cost.restore_ms_per_mib


def _predict_streamed(action: Action, inputs: CostInputs) -> Prediction:
    shape, S = inputs.shape, inputs.prompt_len
    L, c = shape.num_layers, action.cut
    per_ms = inputs.link_gbps * 1e9 / 8 / 1e3
    wire = wire_bytes(action, shape, S)
    m, lat, gamma, join = (inputs.message_ms, inputs.link_latency_ms, inputs.suffix_ms_per_layer,
                           inputs.join_ms)
    if c == 0:
        h = lat + m + wire.tokens / per_ms
        return Prediction(action, max(h, inputs.decode_wait_ms) + L * gamma + join, h, 0.0,
                          L * gamma, join, wire.total)
    alpha, restore = _alpha_ms(action, inputs)
    step = inputs.prefill_ms_per_layer + alpha
    layer = before_residuals(action, WireBytes.of_layer(registered_layer_bytes(
        action.codec, (shape.num_kv_heads, S, shape.head_dim))))
    w = (layer.prefix + layer.scales) / per_ms + m
    if action.layer_split:
        step, w, restore = layer_split_costs(inputs, action.codec, c).stages(S, action.layer_split)
    wait = inputs.prefill_wait_ms
    prefill = c * inputs.prefill_ms_per_layer
    prefix_end = wait + max(c * step + w, step + c * w)
    restored = prefix_end + restore
    if action.layer_split:  # the decode side's recompute may be the pipeline's slowest stage
        restored = wait + step + w + restore + (c - 1) * max(step, w, restore)
    if c == L:
        end = max(restored, prefix_end + restore + wire.head / per_ms + m)
        return Prediction(action, lat + end + join, lat + step, end - step, 0.0, join,
                          wire.total, prefill)
    r = (L - c) * gamma
    arrived = max(wait + c * step, prefix_end)  # the chunks follow the prefix on the link
    first = None
    suffix_end = max(0.0, inputs.decode_wait_ms - lat)  # this branch adds lat at the end
    per_row = wire.boundary / S  # bytes of one row of h_c as it travels
    coding = _boundary_ms_per_mib(action, inputs) * shape.hidden_size * BF16_BYTES / MiB
    for s0, s1 in chunk_bounds(S, inputs.chunk_tokens):
        arrived += (s1 - s0) * (per_row / per_ms + coding) + m
        first = arrived if first is None else first
        suffix_end = max(arrived, suffix_end) + r * (s1 - s0) / S
    end = max(suffix_end, restored)
    return Prediction(action, lat + end + join, lat + first,
                      max(0.0, restored - first), r, join, wire.total, prefill)


def _predict_pipelined(action: Action, inputs: CostInputs) -> Prediction:
    shape, S = inputs.shape, inputs.prompt_len
    L, c = shape.num_layers, action.cut
    per_ms = inputs.link_gbps * 1e9 / 8 / 1e3
    wire = wire_bytes(action, shape, S)
    m, lat, join = inputs.message_ms, inputs.link_latency_ms, inputs.join_ms
    alpha, restore = _alpha_ms(action, inputs)
    gamma_p, r = inputs.prefill_ms_per_layer, (L - c) * inputs.suffix_ms_per_layer
    row_ms = wire.boundary / S / per_ms + (
        _boundary_ms_per_mib(action, inputs) * shape.hidden_size * BF16_BYTES / MiB)
    prefix_ms = (wire.prefix + wire.scales) / per_ms  # all c layers' rows, all chunks
    encoded = inputs.prefill_wait_ms
    link_free, first, share = 0.0, None, 0.0
    suffix_end = max(0.0, inputs.decode_wait_ms - lat)  # this branch adds lat at the end
    for s0, s1 in chunk_bounds(S, inputs.chunk_tokens):
        share = (s1 - s0) / S
        computed = encoded + share * c * gamma_p
        encoded = computed + share * c * alpha
        arrived = max(computed, link_free) + (s1 - s0) * row_ms + m
        first = arrived if first is None else first
        link_free = max(arrived, encoded) + share * prefix_ms + c * m
        suffix_end = max(arrived, suffix_end) + share * r
    prefix_end = link_free + share * c * restore
    end = max(suffix_end, prefix_end)
    return Prediction(action, lat + end + join, lat + first, max(0.0, prefix_end - first), r,
                      join, wire.total, c * gamma_p, pipelined=True)


def _predict_split(action: Action, inputs: CostInputs) -> Prediction:
    """A token split (KVPR's, `Action.split` l): every layer is computed on the prefill side (the
    suffix layers' rows [l, S) travel), the boundary's rows [0, l) go first (after a full
    prefill) or right after layer c − 1 (streamed), each layer's coded rows follow as the link
    serializes them, and the head last. The decode side recomputes layers c..L−1 for rows
    [0, l), chunk by chunk as the boundary lands: R = (L − c)·γ·l/S, γ spread evenly over the
    prompt's rows (rows near the start attend to fewer keys: the model overstates R a little)."""
    shape, S = inputs.shape, inputs.prompt_len
    L, c, l = shape.num_layers, action.cut, action.split
    per_ms = inputs.link_gbps * 1e9 / 8 / 1e3
    wire = wire_bytes(action, shape, S)
    m, lat, join = inputs.message_ms, inputs.link_latency_ms, inputs.join_ms
    alpha, restore = _alpha_ms(action, inputs)
    kept = (S - l) / S  # a suffix layer's share of rows on the wire
    whole = WireBytes.of_layer(registered_layer_bytes(
        action.codec, (shape.num_kv_heads, S, shape.head_dim)))
    rows = WireBytes.of_layer(registered_layer_bytes(
        action.codec, (shape.num_kv_heads, S - l, shape.head_dim)))
    layer_ms = [(whole.prefix + whole.scales) / per_ms + m] * c + [
        (rows.prefix + rows.scales) / per_ms + m] * (L - c)
    encode = [alpha] * c + [alpha * kept] * (L - c)
    coding = _boundary_ms_per_mib(action, inputs) * shape.hidden_size * BF16_BYTES / MiB
    row_ms = wire.boundary / l / per_ms + coding
    chunks = chunk_bounds(l, inputs.chunk_tokens)
    gamma_p, wait = inputs.prefill_ms_per_layer, inputs.prefill_wait_ms
    r = (L - c) * inputs.suffix_ms_per_layer * l / S
    if inputs.streamed:
        ready, link_free, boundary_at = wait, wait, wait
    else:  # the whole prefill first, then the boundary
        ready = link_free = wait + L * gamma_p
        boundary_at = link_free
    arrivals: list[tuple[float, int]] = []

    def send_boundary(at: float) -> float:
        for s0, s1 in chunks:
            at += (s1 - s0) * row_ms + m
            arrivals.append((at, s1 - s0))
        return at

    if not inputs.streamed:
        link_free = send_boundary(boundary_at)
    for i in range(L):
        ready += (gamma_p if inputs.streamed else 0.0) + encode[i]
        link_free = max(link_free, ready) + layer_ms[i]
        if inputs.streamed and i == c - 1:
            link_free = send_boundary(link_free)
    prefix_end = link_free + wire.head / per_ms + m + restore * max(kept, 1.0 / L)
    suffix_end = max(0.0, inputs.decode_wait_ms - lat)
    for at, n in arrivals:
        suffix_end = max(suffix_end, at) + r * n / l
    first = arrivals[0][0]
    end = max(suffix_end, prefix_end)
    return Prediction(action, lat + end + join, lat + first, max(0.0, prefix_end - first), r,
                      join, wire.total, L * gamma_p)


def _predict_after_prefill(action: Action, inputs: CostInputs) -> Prediction:
    shape, S = inputs.shape, inputs.prompt_len
    L, c = shape.num_layers, action.cut
    bytes_per_ms = inputs.link_gbps * 1e9 / 8 / 1e3
    wire = wire_bytes(action, shape, S)
    gamma = inputs.suffix_ms_per_layer
    m = inputs.message_ms
    prefill = L * inputs.prefill_ms_per_layer
    start = inputs.prefill_wait_ms + prefill  # the handoff starts once the prefill is done
    if c == 0:
        h = inputs.link_latency_ms + m + wire.tokens / bytes_per_ms
        r = L * gamma
        return Prediction(action, max(start + h, inputs.decode_wait_ms) + r + inputs.join_ms,
                          h, 0.0, r, inputs.join_ms, wire.total, prefill)
    alpha, restore_layer = _alpha_ms(action, inputs)
    messages = c
    if action.layer_split:  # each layer restored and recomputed, its input rows a message more
        _, _, restore_layer = layer_split_costs(inputs, action.codec, c).stages(
            S, action.layer_split)
        messages = 2 * c
    restore = restore_layer * c
    h = (inputs.link_latency_ms + m + wire.boundary / bytes_per_ms
         + _boundary_ms_per_mib(action, inputs) * shape.boundary_bytes(S, BF16_BYTES) / MiB)
    first = before_residuals(action, wire)
    x = (max(c * alpha, (first.prefix + first.scales + first.head) / bytes_per_ms) + alpha
         + restore + messages * m)
    r = (L - c) * gamma
    suffix_end = max(start + h, inputs.decode_wait_ms) + r if r else 0.0
    end = max(start + h + x, suffix_end)
    return Prediction(action, end + inputs.join_ms, h, x, r, inputs.join_ms, wire.total, prefill)


def candidate_actions(shape: ModelShape, codecs: Iterable[str]) -> list[Action]:
    """Every (b, c) for the given prefix codecs, c in [1, L], plus token-only (c = 0); with
    `splitzip` among the codecs, every interior cut also with a SplitZip-coded boundary."""
    return list(_candidate_actions(shape, tuple(dict.fromkeys(codecs))))


@functools.lru_cache(maxsize=64)
def _candidate_actions(shape: ModelShape, codecs: tuple[str, ...]) -> tuple[Action, ...]:
    """`candidate_actions`, remembered: the same few (model, codecs) every request."""
    L = shape.num_layers
    actions = [Action.token_only(L)]
    for codec in codecs:
        actions += [Action(codec, c, L) for c in range(1, L + 1)]
        if "splitzip" in codecs:
            actions += [Action(codec, c, L, "splitzip") for c in range(1, L)]
    return tuple(actions)


def split_actions(inputs: CostInputs, codecs: Iterable[str]) -> list[Action]:
    """KVPR's token splits: for each codec and interior cut, the split l of the closed form
    (`token_split.best_split`), where it is one (0 < l < S)."""
    L, S = inputs.shape.num_layers, inputs.prompt_len
    if S <= EXEC_BLOCK:  # no multiple of the block inside (0, S)
        return []
    actions = []
    for codec in dict.fromkeys(codecs):
        for c in range(1, L):
            l = best_split(split_costs(inputs, codec, c), S)
            if 0 < l < S:
                actions.append(Action(codec, c, L, split=l))
    return actions


def choose(inputs: CostInputs, codecs: Iterable[str]) -> list[Prediction]:
    """Predictions of every candidate, cheapest first (ties: fewer bytes first); token splits
    too where `inputs.token_splits`."""
    codecs = list(codecs)
    actions = candidate_actions(inputs.shape, codecs)
    if inputs.token_splits:
        actions += split_actions(inputs, codecs)
    if inputs.layer_splits:
        actions += layer_split_actions(inputs, codecs, actions)
    if inputs.progressive:
        actions += [dataclasses.replace(a, progressive=True) for a in actions
                    if a.codec == PROGRESSIVE_CODEC and a.cut and not a.split
                    and not a.layer_split]
    predictions = [predict(a, inputs) for a in actions]
    return sorted(predictions, key=lambda p: (p.total_ms, p.bytes))


def split_costs(inputs: CostInputs, codec: str, cut: int) -> SplitCosts:
    """a, b, g and P (after a full prefill) or P₀ (streamed) of a token split at `cut` with the
    prefix and suffix rows in `codec` (`token_split`'s time model)."""
    shape, seq_len = inputs.shape, inputs.prompt_len
    if not 0 < cut < shape.num_layers:
        raise ValueError(f"cut: must lie in (0, {shape.num_layers}), got {cut}")
    per_ms = inputs.link_gbps * 1e9 / 8 / 1e3
    layer = registered_layer_bytes(codec, (shape.num_kv_heads, seq_len, shape.head_dim))
    layer_ms = (layer.data + layer.scales) / per_ms
    suffix_layers = shape.num_layers - cut
    prefix_ms = cut * layer_ms
    return SplitCosts(boundary_row_ms=shape.hidden_size * BF16_BYTES / per_ms,
                      suffix_row_ms=suffix_layers * layer_ms / seq_len,
                      recompute_row_ms=suffix_layers * inputs.suffix_ms_per_layer / seq_len,
                      prefix_ms=0.0 if inputs.streamed else prefix_ms,
                      prefix_first_ms=prefix_ms if inputs.streamed else 0.0)
