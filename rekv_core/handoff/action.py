"""The handoff action a = (codec b, cut c) and the bytes it puts on the wire.

c is the first recomputed layer (0 ≤ c ≤ L); layers 0..c−1 travel in codec b, layers c..L−1 are
recomputed on the decode side. The seed's five actions are the cases of that pair:

| kind              | cut         | codec          | sends                                       |
| ----------------- | ----------- | -------------- | ------------------------------------------- |
| `bf16_transfer`   | c = L       | bf16           | every layer's KV                            |
| `quant_transfer`  | c = L       | int8, int4, …  | every layer's KV, quantized                 |
| `bf16_recompute`  | 0 < c < L   | bf16           | BF16 prefix KV + BF16 boundary h_c (eq. 5)  |
| `token_recompute` | c = 0       | (none)         | the prompt's token ids, int32               |
| `joint`           | 0 < c < L   | int8, int4, …  | b-bit prefix KV + BF16 boundary h_c (eq. 7) |
| `token_split`     | 0 < c < L   | any            | KVPR: h_c of tokens [0, l) only, and layers |
|                   |             |                | c..L−1's KV of tokens [l, S) in codec b     |
| `layer_split`     | 1 ≤ c ≤ L   | any            | KVPR's per-layer form: each sent layer's    |
|                   |             |                | input rows [0, l) (BF16), its KV of [l, S)  |

A token split (`split` l > 0, KVPR's action, `handoff.token_split`) sends the boundary for the
first l tokens only, which the decode side recomputes layers c..L−1 for, while those layers' KV of
tokens [l, S) arrives in the codec with the prefix; the last position's final hidden state (`head`)
gives the first logits, as for transfer-only. l is a multiple of `EXEC_BLOCK` below the prompt's
length (so the recomputed rows are bit-identical to the prefill's); `split` 0 is no split.

KVPR's per-layer form (`layer_split` l > 0, `handoff.token_split`) replaces, in every layer that
travels as KV (the prefix, or every layer for transfer-only), the K and V of tokens [0, l) by the
layer's input rows (its residual stream entering it, BF16), from which the decode side recomputes
them (the layer's norm, K and V projections and RoPE: no attention); rows [l, S) travel in the
codec. An input row is d values against a K and V row's 2·n_kv·d_h, so it pays only where
n_h < 2·n_kv (multi-head attention; ReKV's Proposition 1). l is a multiple of `EXEC_BLOCK` below
the prompt's length; recomputed from BF16 inputs, the rows are the prefill's bit for bit where the
model runs in BF16 (the inputs' precision otherwise, as for the boundary). The kind and the quality
gate's verdict are the codec's action's: the recomputed rows are exact.

Lynx's progressive streams (`progressive`, an `int8` action with c ≥ 1, no split) send the same
bytes in another order: every sent layer's anchor (the codes' top four bits, with the scales)
before any layer's residual (the low four bits), so the decode side drafts tokens on the anchor
cache while the residuals arrive and verifies them on the full `int8` cache (`codecs.lynx`,
`handoff.residuals`). Once verified it is the `int8` action: the same kind, the same gate verdict.

An interior cut's boundary travels as BF16 or SplitZip-coded (`boundary`, see `handoff.boundary`):
lossless either way, so it leaves the kind and the quality gate's verdict as they are.

`wire_bytes(action, shape, S)` splits the payload by kind: boundary, prefix (KV data), scales,
tokens and head. The boundary always travels in BF16 (2 bytes per element), whatever the working
dtype. Transfer-only actions also send `head`, the last position's final hidden state (d BF16
values), from which the decode side computes the first-token logits, as a P/D prefill returns its
first token; the seed's byte figures count only `state` = boundary + prefix + scales.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property, lru_cache

from rekv_core.codecs import (BASELINE_CODEC, Codec, LayerBytes, check_codec_name, get_codec,
                              registered_layer_bytes)
from rekv_core.codecs.lynx import BASE_CODEC as PROGRESSIVE_CODEC
from rekv_core.handoff.boundary import boundary_bytes, check_coding
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.shapes import ModelShape
from rekv_core.units import BF16_BYTES, TOKEN_ID_BYTES


class ActionKind(str, enum.Enum):
    BF16_TRANSFER = "bf16_transfer"
    QUANT_TRANSFER = "quant_transfer"
    BF16_RECOMPUTE = "bf16_recompute"
    TOKEN_RECOMPUTE = "token_recompute"
    JOINT = "joint"
    TOKEN_SPLIT = "token_split"


@dataclass(frozen=True)
class Action:
    codec: str  # the prefix codec b; ignored (BASELINE_CODEC by convention) when cut == 0
    cut: int  # c, the first recomputed layer
    num_layers: int  # L
    boundary: str = "bf16"  # how h_c travels (`BOUNDARY_CODINGS`); bf16 unless 0 < c < L
    split: int = 0  # l: the boundary's tokens (KVPR's token split); 0: every token's, no split
    progressive: bool = False  # Lynx: every layer's anchor before any residual (int8 only)
    layer_split: int = 0  # l: KVPR's per-layer form, each sent layer's input rows [0, l)

    def __post_init__(self) -> None:
        if not 0 <= self.cut <= self.num_layers:
            raise ValueError(f"cut: must lie in [0, {self.num_layers}], got {self.cut}")
        if type(self.split) is not int or self.split < 0 or self.split % EXEC_BLOCK:
            raise ValueError(f"split: must be a multiple of {EXEC_BLOCK} (0: no split), got "
                             f"{self.split!r}")
        if self.split and not 0 < self.cut < self.num_layers:
            raise ValueError(f"split: a token split needs an interior cut, cut is {self.cut} of "
                             f"{self.num_layers}")
        check_codec_name(self.codec)  # raises ValueError naming the registered codecs
        if not isinstance(self.progressive, bool):
            raise ValueError(f"progressive: must be true or false, got {self.progressive!r}")
        if self.progressive and (self.codec != PROGRESSIVE_CODEC or self.cut == 0 or self.split):
            raise ValueError(f"progressive: Lynx's streams split {PROGRESSIVE_CODEC} codes, with "
                             f"a cut of at least 1 and no token split; got codec={self.codec}, "
                             f"cut={self.cut}, split={self.split}")
        if (type(self.layer_split) is not int or self.layer_split < 0
                or self.layer_split % EXEC_BLOCK):
            raise ValueError(f"layer_split: must be a multiple of {EXEC_BLOCK} (0: none), got "
                             f"{self.layer_split!r}")
        if self.layer_split and (self.cut == 0 or self.split or self.progressive):
            raise ValueError(f"layer_split: the per-layer form needs layers sent as KV (a cut of "
                             f"at least 1), without a token split or Lynx's streams; got "
                             f"cut={self.cut}, split={self.split}, "
                             f"progressive={self.progressive}")
        if check_coding(self.boundary) != "bf16" and not self.sends_boundary:
            raise ValueError(f"boundary: only an interior cut sends one, cut is {self.cut} of "
                             f"{self.num_layers}")

    @classmethod
    def full_bf16(cls, num_layers: int) -> Action:
        return cls(BASELINE_CODEC, num_layers, num_layers)

    @classmethod
    def token_only(cls, num_layers: int) -> Action:
        return cls(BASELINE_CODEC, 0, num_layers)

    @cached_property
    def registered_codec(self) -> Codec:
        """The registry's codec of this name (one per action, built once)."""
        return get_codec(self.codec)

    @property
    def kind(self) -> ActionKind:
        if self.split:
            return ActionKind.TOKEN_SPLIT
        if self.cut == 0:
            return ActionKind.TOKEN_RECOMPUTE
        lossless = self.registered_codec.lossless
        if self.cut == self.num_layers:
            return ActionKind.BF16_TRANSFER if lossless else ActionKind.QUANT_TRANSFER
        return ActionKind.BF16_RECOMPUTE if lossless else ActionKind.JOINT

    @property
    def lossless(self) -> bool:
        """The decode side ends with exactly the prefill's cache: token-only, or a lossless
        codec. Such actions need no quality gate."""
        return (self.cut == 0 and not self.split) or self.registered_codec.lossless

    @property
    def sends_boundary(self) -> bool:
        return 0 < self.cut < self.num_layers

    @property
    def sent_layers(self) -> int:
        """How many layers' KV travel, from layer 0: the prefix's c, or for a token split every
        layer (its suffix layers' rows [l, S))."""
        return self.num_layers if self.split else self.cut

    @property
    def sends_head(self) -> bool:
        """The last position's final hidden state travels: transfer-only, a token split."""
        return self.cut == self.num_layers or bool(self.split)

    @property
    def prefix_layers(self) -> range:
        return range(self.cut) if self.cut else range(0)

    @property
    def suffix_layers(self) -> range:
        return range(self.cut, self.num_layers)

    def check_prompt(self, seq_len: int) -> None:
        """ValueError naming `split` (or `layer_split`) when it leaves no token to send as KV."""
        for name in ("split", "layer_split"):
            tokens = getattr(self, name)
            if tokens and tokens >= seq_len:
                raise ValueError(f"{name}: must be below the prompt's {seq_len} tokens, got "
                                 f"{tokens}")

    def __str__(self) -> str:
        boundary = f", boundary={self.boundary}" if self.boundary != "bf16" else ""
        split = f", split={self.split}" if self.split else ""
        lynx = ", lynx" if self.progressive else ""
        inputs = f", layer_split={self.layer_split}" if self.layer_split else ""
        return (f"{self.kind.value}(codec={self.codec}, cut={self.cut}/{self.num_layers}"
                f"{boundary}{split}{lynx}{inputs})")


@dataclass(frozen=True)
class WireBytes:
    boundary: int = 0
    prefix: int = 0  # KV data of the transmitted layers (codes, or BF16 values)
    scales: int = 0
    tokens: int = 0
    head: int = 0  # transfer-only: the last position's final hidden state, for the first logits

    @property
    def total(self) -> int:
        return self.boundary + self.prefix + self.scales + self.tokens + self.head

    @property
    def state(self) -> int:
        """The seed's payload: KV (with scales) plus boundary, without tokens or head."""
        return self.boundary + self.prefix + self.scales

    def __add__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.boundary + other.boundary, self.prefix + other.prefix,
                         self.scales + other.scales, self.tokens + other.tokens,
                         self.head + other.head)

    def as_dict(self) -> dict[str, int]:
        return {"boundary": self.boundary, "prefix": self.prefix, "scales": self.scales,
                "tokens": self.tokens, "head": self.head, "total": self.total}

    @classmethod
    def of_layer(cls, layer: LayerBytes) -> WireBytes:
        """One encoded prefix layer's bytes (`Codec.layer_bytes`, `EncodedKV.layer_bytes`)."""
        return cls(prefix=layer.data, scales=layer.scales)


@lru_cache(maxsize=8192)
def wire_bytes(action: Action, shape: ModelShape, seq_len: int) -> WireBytes:
    """Payload bytes of `action` for a prompt of `seq_len` tokens: eqs. (2), (5) and (7).
    Remembered per argument (all three are immutable): the planner asks for every candidate's."""
    if action.num_layers != shape.num_layers:
        raise ValueError(f"action: built for {action.num_layers} layers, model {shape.name} has "
                         f"{shape.num_layers}")
    action.check_prompt(seq_len)
    if action.split:
        return _split_bytes(action, shape, seq_len)
    if action.cut == 0:
        return WireBytes(tokens=seq_len * TOKEN_ID_BYTES)
    per_layer = sent_layer_bytes(action, shape, seq_len)
    total = WireBytes(prefix=per_layer.prefix * action.cut, scales=per_layer.scales * action.cut)
    if action.sends_boundary:
        total += WireBytes(boundary=boundary_bytes(seq_len * shape.hidden_size, action.boundary))
    else:
        total += WireBytes(head=shape.hidden_size * BF16_BYTES)
    return total


def sent_layer_bytes(action: Action, shape: ModelShape, seq_len: int) -> WireBytes:
    """One layer sent as KV, in `prefix` and `scales`: its codec's bytes, or under the per-layer
    form its BF16 input rows [0, l) (counted in `prefix`) and its coded rows [l, S)."""
    rows = seq_len - action.layer_split
    coded = WireBytes.of_layer(registered_layer_bytes(
        action.codec, (shape.num_kv_heads, rows, shape.head_dim)))
    return coded + WireBytes(prefix=action.layer_split * shape.hidden_size * BF16_BYTES)


def before_residuals(action: Action, wire: WireBytes) -> WireBytes:
    """What of `wire` (an action's, or one layer's) travels before the first token can be
    computed: for Lynx's streams all but the residuals (the low half of every code byte), for
    any other action all of it."""
    if not action.progressive:
        return wire
    return WireBytes(wire.boundary, wire.prefix // 2, wire.scales, wire.tokens, wire.head)


def _split_bytes(action: Action, shape: ModelShape, seq_len: int) -> WireBytes:
    """A token split: the prefix layers whole, the suffix layers' rows [l, S), the boundary's
    rows [0, l), the head."""
    n_kv, d_h = shape.num_kv_heads, shape.head_dim
    whole = registered_layer_bytes(action.codec, (n_kv, seq_len, d_h))
    rows = registered_layer_bytes(action.codec, (n_kv, seq_len - action.split, d_h))
    suffix = shape.num_layers - action.cut
    return WireBytes(boundary=boundary_bytes(action.split * shape.hidden_size, action.boundary),
                     prefix=whole.data * action.cut + rows.data * suffix,
                     scales=whole.scales * action.cut + rows.scales * suffix,
                     head=shape.hidden_size * BF16_BYTES)
