"""Message names and the plan header of one handoff on the transport.

A handoff is, in sequence order: `plan` (JSON header: action, prompt length, model dimensions,
the sender's prediction of the handoff's length, from which the receiver sets its deadline, whether
it is streamed, and the boundary's chunk size); then `tokens` (token-only), or for an interior cut
the boundary h_c (BF16, or SplitZip-coded: `handoff.boundary`) in token chunks: `boundary` (rows
of the first chunk), `boundary.1`, … (`chunk_bounds`), or nothing extra for transfer-only; then
`layer.0` … `layer.{c-1}` (an encoded layer each: codec header + buffers); and last, for
transfer-only, `head` (the final hidden state of the last position, BF16).

A streamed handoff (`Plan.streamed`) is sent while the prefill runs: each layer as soon as the
prefill has computed it, so the boundary chunks come after the prefix layers (the prefill has h_c
only once it has computed layer c−1); a receiver takes each kind in its own order and the kinds in
any order. A pipelined handoff (`Plan.pipelined`: the prefill runs in the boundary's token chunks)
sends, for each chunk in turn, its boundary rows and then its rows of every prefix layer,
`layer.{i}.{k}` (`layer_rows_name`: layer i, chunk k, encoded on their own).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

from rekv_core.handoff.action import Action
from rekv_core.model.blocks import EXEC_BLOCK, chunk_bounds
from rekv_core.model.shapes import ModelShape

PLAN, TOKENS, BOUNDARY, HEAD = "plan", "tokens", "boundary", "head"


def layer_name(index: int) -> str:
    return f"layer.{index}"


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


@dataclass(frozen=True)
class Plan:
    codec: str
    cut: int
    num_layers: int
    seq_len: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    expect_ms: float = 0.0  # the sender's prediction of the handoff's length; 0: none
    streamed: bool = False  # sent layer by layer while the prefill ran
    chunk_tokens: int = 0  # the boundary's chunk size (a multiple of EXEC_BLOCK); 0: one chunk
    boundary: str = "bf16"  # the boundary's coding (`handoff.boundary`)
    pipelined: bool = False  # the prefill ran in the boundary's chunks, each sent as it passed c

    def __post_init__(self) -> None:
        for name in ("streamed", "pipelined"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"plan: {name} must be true or false, got "
                                 f"{getattr(self, name)!r}")
        if type(self.chunk_tokens) is not int or self.chunk_tokens < 0 or (
                self.chunk_tokens % EXEC_BLOCK):
            raise ValueError(f"plan: chunk_tokens must be a multiple of {EXEC_BLOCK}, got "
                             f"{self.chunk_tokens!r}")
        for name in ("cut", "num_layers", "seq_len", "hidden_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"plan: {name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.codec, str):
            raise ValueError(f"plan: codec must be a string, got {self.codec!r}")
        if not isinstance(self.boundary, str):
            raise ValueError(f"plan: boundary must be a string, got {self.boundary!r}")
        if not (isinstance(self.expect_ms, (int, float)) and 0 <= self.expect_ms < math.inf):
            raise ValueError(f"plan: expect_ms must be finite and >= 0, got {self.expect_ms!r}")
        if self.pipelined and not (self.streamed and 0 < self.cut < self.num_layers):
            raise ValueError("plan: pipelined needs a streamed handoff with an interior cut")

    @classmethod
    def of(cls, action: Action, shape: ModelShape, seq_len: int, expect_ms: float = 0.0,
           streamed: bool = False, chunk_tokens: int = 0, pipelined: bool = False) -> Plan:
        return cls(action.codec, action.cut, action.num_layers, seq_len, shape.hidden_size,
                   shape.num_kv_heads, shape.head_dim, expect_ms, streamed, chunk_tokens,
                   action.boundary, pipelined)

    @property
    def boundary_chunks(self) -> list[tuple[int, int]]:
        """Row ranges of the boundary's chunks; none unless the cut is interior."""
        if not 0 < self.cut < self.num_layers:
            return []
        return chunk_bounds(self.seq_len, self.chunk_tokens)

    @property
    def prefix_row_chunks(self) -> list[tuple[int, int]] | None:
        """Pipelined: the row ranges each prefix layer comes in (the boundary's); else None
        (each layer whole)."""
        return self.boundary_chunks if self.pipelined else None

    @property
    def action(self) -> Action:
        return Action(self.codec, self.cut, self.num_layers, self.boundary)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Plan:
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"plan: unreadable header ({exc})") from exc

    def check_model(self, shape: ModelShape) -> None:
        mine = (self.num_layers, self.hidden_size, self.num_kv_heads, self.head_dim)
        theirs = (shape.num_layers, shape.hidden_size, shape.num_kv_heads, shape.head_dim)
        if mine != theirs:
            raise ValueError(f"plan: sender's model (L, d, n_kv, d_h) = {mine} differs from the "
                             f"receiver's {theirs}")


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
