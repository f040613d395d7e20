"""One handoff's plan: what the planner decided, what the sender executes, what the receiver reads.

`HandoffPlan` is the one typed value that carries a handoff from the planner to the wire:

- `action`: the pair (codec b, cut c) and the boundary's coding (`Action`);
- `codec`: the prefix codec's instance the sender encodes with (as the model deploys it, e.g.
  SplitZip with the model's codebook); its name is the action's;
- `seq_len`, `shape`: the prompt's length and the model the plan is for;
- `delivery`: how it is sent (`Delivery`: streamed or after a full prefill, the boundary's token
  chunks, and the `Order` of the prefix: whole layers, or pipelined in the boundary's chunks);
- `boundary_codebook`: the model's SplitZip codebook for boundary states (sender only; a SplitZip
  boundary without one ranks its own h_c's exponents);
- `predicted_ms`: the planner's prediction of the handoff's length, from which the receiver sets
  its deadline (0: none).

`to_bytes()` is the plan's wire form, the first message of every handoff (`wire.PLAN`: a JSON
object of the action (with a token split's l, whether Lynx's streams carry it, and the per-layer
form's l), the prompt
length, the model's dimensions, the prediction and the delivery);
`from_bytes(raw, shape)` reads it back against the receiver's model (`ValueError` naming the field).
The codebook does not travel: every coded buffer carries its own in its header.

A plan is checked when it is made: the codec is the action's, the model's layers are the action's,
token order needs a streamed delivery in chunks, an interior cut and a codec that ranks no tokens
(`Codec.importance_window` 0): `can_pipeline`, the rule the cost model applies as well.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field

from rekv_core.codecs import Codec, get_codec
from rekv_core.handoff.action import Action
from rekv_core.model.blocks import chunk_bounds
from rekv_core.model.shapes import ModelShape


class Order(enum.Enum):
    """The order of a streamed handoff's prefix on the wire."""

    LAYERS = "layers"  # each prefix layer whole, as the prefill computes it
    TOKENS = "tokens"  # pipelined: the prefill in the boundary's chunks, each sent past the cut


@dataclass(frozen=True)
class Delivery:
    """How a handoff is sent. `streamed`: from inside the prefill, each prefix layer as soon as
    it is computed, the prefill stopping at the cut; else after a prefill of every layer, the
    boundary first (the seed's). `chunk_tokens`: the boundary in chunks of that many tokens (a
    multiple of `EXEC_BLOCK`), each of which the decode side starts on at once; 0: one message.
    `order` `TOKENS` (pipelined; streamed, in chunks): the prefill itself runs in those token
    chunks up to the cut, and each chunk's boundary rows, then its prefix rows, leave as soon as
    the chunk has reached the cut, so the decode side's layers run on the first chunk while the
    prefill computes the next."""

    streamed: bool = True
    chunk_tokens: int = 0
    order: Order = Order.LAYERS

    def __post_init__(self) -> None:
        if not isinstance(self.streamed, bool):
            raise ValueError(f"streamed: must be true or false, got {self.streamed!r}")
        if type(self.chunk_tokens) is not int:
            raise ValueError(f"chunk_tokens: must be an integer, got {self.chunk_tokens!r}")
        chunk_bounds(1, self.chunk_tokens)  # ValueError naming chunk_tokens
        if not isinstance(self.order, Order):
            raise ValueError(f"order: must be one of {[o.value for o in Order]}, got "
                             f"{self.order!r}")
        if self.pipelined and not (self.streamed and self.chunk_tokens):
            raise ValueError("pipelined: needs a streamed delivery with the boundary in chunks "
                             "(chunk_tokens > 0)")

    @classmethod
    def seed(cls) -> Delivery:
        """The seed's schedule: a full prefill, then the handoff, the boundary in one message."""
        return cls(streamed=False, chunk_tokens=0)

    @property
    def pipelined(self) -> bool:
        return self.order is Order.TOKENS

    def __str__(self) -> str:
        how = "pipelined" if self.pipelined else "streamed" if self.streamed else "after_prefill"
        return f"{how}/chunk{self.chunk_tokens}" if self.chunk_tokens else how


def can_pipeline(action: Action, codec: Codec) -> bool:
    """Whether `action` can go in token order: an interior cut, a codec that ranks no tokens, and
    not Lynx's streams (their anchors go before every residual, in layer order) nor KVPR's
    per-layer form (a layer's input rows go whole, before its KV rows)."""
    return (action.sends_boundary and codec.importance_window == 0 and not action.progressive
            and not action.layer_split)


@dataclass(frozen=True)
class HandoffPlan:
    action: Action
    seq_len: int
    shape: ModelShape
    delivery: Delivery = field(default_factory=Delivery)
    codec: Codec | None = field(default=None, compare=False)  # None: the registry's
    boundary_codebook: tuple[int, ...] | None = field(default=None, compare=False)
    predicted_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.codec is None:
            object.__setattr__(self, "codec", get_codec(self.action.codec))
        if self.codec.name != self.action.codec:
            raise ValueError(f"codec: {self.codec.name!r} is not the action's "
                             f"{self.action.codec!r}")
        if self.action.num_layers != self.shape.num_layers:
            raise ValueError(f"action: built for {self.action.num_layers} layers, model "
                             f"{self.shape.name} has {self.shape.num_layers}")
        if type(self.seq_len) is not int or self.seq_len < 1:
            raise ValueError(f"seq_len: must be a positive integer, got {self.seq_len!r}")
        if not (isinstance(self.predicted_ms, (int, float)) and 0 <= self.predicted_ms < math.inf):
            raise ValueError(f"predicted_ms: must be finite and >= 0, got {self.predicted_ms!r}")
        try:
            self.action.check_prompt(self.seq_len)
        except ValueError as exc:
            raise ValueError(f"action: {exc}") from None
        if self.delivery.pipelined and self.action.split:
            raise ValueError("pipelined: a token split goes in layer order")
        if self.delivery.pipelined and self.action.progressive:
            raise ValueError("pipelined: Lynx's streams go in layer order")
        if self.delivery.pipelined and self.action.layer_split:
            raise ValueError("pipelined: KVPR's per-layer form goes in layer order")
        if self.delivery.pipelined and not self.action.sends_boundary:
            raise ValueError("pipelined: needs an interior cut (0 < c < L)")
        if self.delivery.pipelined and self.codec.importance_window:
            raise ValueError(f"codec: {self.action.codec} ranks a layer's tokens and cannot "
                             f"encode a chunk of them alone (pipelined)")

    @property
    def streamed(self) -> bool:
        return self.delivery.streamed

    @property
    def pipelined(self) -> bool:
        return self.delivery.pipelined

    @property
    def chunk_tokens(self) -> int:
        return self.delivery.chunk_tokens

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """One prefix layer's K (and V): [n_kv, S, d_h]."""
        return (self.shape.num_kv_heads, self.seq_len, self.shape.head_dim)

    @property
    def boundary_rows(self) -> int:
        """The tokens whose h_c travels: the split's first l, else all (interior cuts)."""
        return self.action.split or self.seq_len

    @property
    def boundary_chunks(self) -> list[tuple[int, int]]:
        """Row ranges of the boundary's chunks; none unless the cut is interior."""
        if not self.action.sends_boundary:
            return []
        return chunk_bounds(self.boundary_rows, self.delivery.chunk_tokens)

    @property
    def prefix_row_chunks(self) -> list[tuple[int, int]] | None:
        """Pipelined: the row ranges each prefix layer comes in (the boundary's); else None
        (each layer whole)."""
        return self.boundary_chunks if self.pipelined else None

    def to_bytes(self) -> bytes:
        a, s, d = self.action, self.shape, self.delivery
        return json.dumps({
            "codec": a.codec, "cut": a.cut, "num_layers": a.num_layers, "seq_len": self.seq_len,
            "hidden_size": s.hidden_size, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
            "expect_ms": self.predicted_ms, "streamed": d.streamed,
            "chunk_tokens": d.chunk_tokens, "boundary": a.boundary, "pipelined": d.pipelined,
            "split": a.split, "progressive": a.progressive, "layer_split": a.layer_split,
        }).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, shape: ModelShape) -> HandoffPlan:
        """The plan a sender wrote, for the receiver's model `shape`."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("not an object")
            fields = {name: data.pop(name) for name in _REQUIRED}
            fields.update({name: data.pop(name, default) for name, default in _OPTIONAL.items()})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"plan: unreadable header ({exc!r})") from None
        if data:
            raise ValueError(f"plan: unknown fields {sorted(data)}")
        for name in ("cut", "num_layers", "seq_len", "hidden_size", "num_kv_heads", "head_dim",
                     "chunk_tokens", "split", "layer_split"):
            if type(fields[name]) is not int or fields[name] < 0:
                raise ValueError(f"plan: {name} must be a non-negative integer, got "
                                 f"{fields[name]!r}")
        for name in ("streamed", "pipelined", "progressive"):
            if not isinstance(fields[name], bool):
                raise ValueError(f"plan: {name} must be true or false, got {fields[name]!r}")
        for name in ("codec", "boundary"):
            if not isinstance(fields[name], str):
                raise ValueError(f"plan: {name} must be a string, got {fields[name]!r}")
        if type(fields["expect_ms"]) not in (int, float):
            raise ValueError(f"plan: expect_ms must be a number, got {fields['expect_ms']!r}")
        mine = (fields["num_layers"], fields["hidden_size"], fields["num_kv_heads"],
                fields["head_dim"])
        theirs = (shape.num_layers, shape.hidden_size, shape.num_kv_heads, shape.head_dim)
        if mine != theirs:
            raise ValueError(f"plan: sender's model (L, d, n_kv, d_h) = {mine} differs from the "
                             f"receiver's {theirs}")
        try:
            action = Action(fields["codec"], fields["cut"], fields["num_layers"],
                            fields["boundary"], fields["split"], fields["progressive"],
                            fields["layer_split"])
            delivery = Delivery(fields["streamed"], fields["chunk_tokens"],
                                Order.TOKENS if fields["pipelined"] else Order.LAYERS)
            return cls(action, fields["seq_len"], shape, delivery,
                       predicted_ms=float(fields["expect_ms"]))
        except ValueError as exc:
            raise ValueError(f"plan: {exc}") from None


_REQUIRED = ("codec", "cut", "num_layers", "seq_len", "hidden_size", "num_kv_heads", "head_dim")
_OPTIONAL = {"expect_ms": 0.0, "streamed": False, "chunk_tokens": 0, "boundary": "bf16",
             "pipelined": False, "split": 0, "progressive": False, "layer_split": 0}
