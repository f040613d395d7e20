"""Message names of one handoff on the transport.

A handoff is, in sequence order: `plan` (its header: `HandoffPlan.to_bytes()`, the action, prompt
length, model dimensions, the sender's prediction of the handoff's length, from which the receiver
sets its deadline, and the delivery); then `tokens` (token-only), or for an interior cut
the boundary h_c (BF16, or SplitZip-coded: `handoff.boundary`) in token chunks: `boundary` (rows
of the first chunk), `boundary.1`, … (`chunk_bounds`), or nothing extra for transfer-only; then
`layer.0` … `layer.{c-1}` (an encoded layer each: codec header + buffers); and last, for
transfer-only, `head` (the final hidden state of the last position, BF16).

A streamed handoff (`Delivery.streamed`) is sent while the prefill runs: each layer as soon as the
prefill has computed it, so the boundary chunks come after the prefix layers (the prefill has h_c
only once it has computed layer c−1); a receiver takes each kind in its own order and the kinds in
any order. A pipelined handoff (`Order.TOKENS`: the prefill runs in the boundary's token chunks)
sends, for each chunk in turn, its boundary rows and then its rows of every prefix layer,
`layer.{i}.{k}` (`layer_rows_name`: layer i, chunk k, encoded on their own). A token split
(`Action.split` l) sends the boundary's rows [0, l) only, `layer.0` … `layer.{L-1}` (layers c and
on: their rows [l, S)) and `head` last. Lynx's streams (`Action.progressive`) send each layer's
anchor as `layer.{i}` in the layers' order and place, then, after the head, every layer's residual,
`residual.0` … `residual.{c-1}` (`handoff.residuals`). KVPR's per-layer form (`Action.layer_split`
l) sends, right before each `layer.{i}` (which then carries its rows [l, S)), `inputs.{i}`: the
layer's input rows [0, l) in BF16.

`WIRE_FORMAT` is the version of this layout (with the plan's and boundary's headers); it is part of
the model fingerprint (`handoff.fingerprint`), so workers that lay a handoff out differently never
exchange one.
"""

from __future__ import annotations

import torch

PLAN, TOKENS, BOUNDARY, HEAD = "plan", "tokens", "boundary", "head"
WIRE_FORMAT = 5  # bump when a message's name, order, header or seal changes (2: MAC over
# bytes; 3: the plan's token split, and its suffix rows and head; 4: Lynx's anchors and residuals;
# 5: KVPR's per-layer form, its input rows)


def layer_name(index: int) -> str:
    return f"layer.{index}"


def inputs_name(index: int) -> str:
    return f"inputs.{index}"


def residual_name(index: int) -> str:
    return f"residual.{index}"


def layer_rows_name(index: int, chunk: int) -> str:
    return f"layer.{index}.{chunk}"


def parse_layer_rows(name: str) -> tuple[int, int] | None:
    """(layer, chunk) of a `layer_rows_name`, else None."""
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layer" and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def boundary_name(chunk: int) -> str:
    return BOUNDARY if chunk == 0 else f"{BOUNDARY}.{chunk}"


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
