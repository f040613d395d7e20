"""`spectrum<B>`: SpectrumKV per-token mixed precision at budget b = B/100 (seed spec section 2).

Each token of the layer gets one tier, shared by K and V and by all heads: `hi` (16-bit), INT8 or
INT4, from the prefill's token importance (`EncodeContext.token_importance`, `[S]`, see
`rekv_core.model.importance`) and the budget b, the mean cost per token relative to FP16 (FP16 1,
INT8 0.5, INT4 0.25). The assignment and the quantizers are in `rekv_core.kernels`
(`spectrum_reference.py` states them): the first `sinks` tokens always `hi`, the budget spent on the
others by rank; INT8/INT4 symmetric absmax per (head, token) with an FP16 scale. `tiers=2` (for a
model that does not tolerate INT4, see `rekv_core.eval.spectrum_probe`) uses `hi` and INT8 only and
needs b >= 0.5: tokens are never dropped, the decoder's cache holds every one.

The `hi` tier carries the source's own 16-bit values: FP16 for an FP16 cache, BF16 for a BF16 cache
(both lossless) and BF16 for a float32 one (rounded, as the `bf16` codec does). It is named `hi`,
not `fp16`, because it is BF16 for the usual BF16 cache; it costs 2 bytes an element either way.

Wire buffers, in order, a tier's buffers left out when it holds no token:
- `tiers`: the 2-bit tier code per token (0 hi, 1 INT8, 2 INT4), four per byte, token 4j + i in
  bits 2i..2i+1, `ceil(S/4)` bytes;
- for K, then V: `k.hi` (`[n_kv, n_hi, d_h]` 16-bit), `k.int8` and `k.int8.scales`, `k.int4` and
  `k.int4.scales` (codes `[n_kv, n, d_h]`, INT4 two per byte, FP16 scales `[n_kv, n]`); each tier's
  tokens in token order.
Header meta: {"budget": b, "tiers": 3 | 2, "sinks": n, "counts": [n_hi, n_int8, n_int4]}. The
counts are a deterministic function of (S, b, sinks, tiers), so the layout follows from the shape
and meta; `check_meta` recomputes them and names the field that disagrees, and decode checks that
the `tiers` buffer holds those counts before scattering the tokens back.
"""

from __future__ import annotations

import torch

from rekv_core.codecs.base import Codec, CorruptPayloadError
from rekv_core.kernels import dequantize_tokens, quantize_tokens
from rekv_core.model.importance import WINDOW
from rekv_core.kernels.spectrum_reference import (
    HI,
    INT4,
    INT8,
    TIER_MODES,
    assign_tiers,
    budget_units,
    check_importance,
    pack_tiers,
    tier_counts,
    unpack_tiers,
)
from rekv_core.units import BF16_BYTES

META_FIELDS = ("budget", "tiers", "sinks", "counts")
_BITS = {INT8: 8, INT4: 4}
_TIER_NAMES = {HI: "hi", INT8: "int8", INT4: "int4"}


def _hi_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


class SpectrumCodec(Codec):
    def __init__(self, budget: float, tiers: int = 3, sinks: int = 4, backend: str = "auto"):
        budget_units(budget, tiers)
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks: must be an integer >= 0, got {sinks!r}")
        self.budget = float(budget)
        self.tiers = tiers
        self.sinks = sinks
        self.backend = backend
        self.name = f"spectrum{round(budget * 100)}"
        self.importance_window = WINDOW

    def check_shape(self, shape: tuple[int, int, int]) -> None:
        super().check_shape(shape)
        if shape[2] % 2:
            raise ValueError(f"head_dim: {self.name} packs INT4 pairs, needs an even head_dim, "
                             f"got {shape[2]}")

    def _counts(self, shape: tuple[int, int, int], meta: dict | None) -> list[int]:
        if meta is None:
            return list(tier_counts(shape[1], self.budget, self.sinks, self.tiers))
        return [int(n) for n in meta["counts"]]

    def buffer_layout(self, shape: tuple[int, int, int], meta: dict | None = None
                      ) -> dict[str, int]:
        n_kv, seq_len, d = shape
        counts = self._counts(shape, meta)
        layout = {"tiers": -(-seq_len // 4)}
        for name in ("k", "v"):
            if counts[HI]:
                layout[f"{name}.hi"] = n_kv * counts[HI] * d * BF16_BYTES
            for tier, bits in _BITS.items():
                if counts[tier]:
                    layout[f"{name}.{_TIER_NAMES[tier]}"] = n_kv * counts[tier] * d * bits // 8
                    layout[f"{name}.{_TIER_NAMES[tier]}.scales"] = n_kv * counts[tier] * BF16_BYTES
        return layout

    def check_meta(self, meta: dict, shape: tuple[int, int, int]) -> None:
        for field in META_FIELDS:
            if field not in meta:
                raise CorruptPayloadError(f"meta.{field}: missing")
        extra = sorted(set(meta) - set(META_FIELDS))
        if extra:
            raise CorruptPayloadError(f"meta: unexpected fields {extra}")
        budget, tiers, sinks = meta["budget"], meta["tiers"], meta["sinks"]
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (
                abs(budget - self.budget) <= 1e-9):
            raise CorruptPayloadError(f"meta.budget: {budget!r}, {self.name} has {self.budget}")
        if isinstance(tiers, bool) or tiers not in TIER_MODES:
            raise CorruptPayloadError(f"meta.tiers: must be one of {TIER_MODES}, got {tiers!r}")
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise CorruptPayloadError(f"meta.sinks: must be an integer >= 0, got {sinks!r}")
        try:
            expected = list(tier_counts(shape[1], budget, sinks, tiers))
        except ValueError as exc:
            raise CorruptPayloadError(f"meta.budget: {exc}") from None
        if meta["counts"] != expected:
            raise CorruptPayloadError(f"meta.counts: {meta['counts']!r}, the assignment for "
                                      f"S={shape[1]}, budget {budget}, {sinks} sinks, {tiers} "
                                      f"tiers gives {expected}")

    def _encode(self, k, v, context):
        seq_len = k.shape[1]
        importance = check_importance(context.token_importance, seq_len).to(k.device)
        codes = assign_tiers(importance, self.budget, self.sinks, self.tiers)
        index = [(codes == tier).nonzero().flatten() for tier in (HI, INT8, INT4)]
        buffers = {"tiers": pack_tiers(codes)}
        for name, t in (("k", k), ("v", v)):
            if index[HI].numel():
                hi = t.index_select(1, index[HI]).to(_hi_dtype(t.dtype))
                buffers[f"{name}.hi"] = hi.reshape(-1).view(torch.uint8)
            for tier, bits in _BITS.items():
                if index[tier].numel():
                    q, scales = quantize_tokens(t, index[tier], bits, self.backend)
                    buffers[f"{name}.{_TIER_NAMES[tier]}"] = q
                    buffers[f"{name}.{_TIER_NAMES[tier]}.scales"] = scales.view(torch.uint8)
        counts = [int(i.numel()) for i in index]
        meta = {"budget": self.budget, "tiers": self.tiers, "sinks": self.sinks, "counts": counts}
        return buffers, meta

    def _tier_index(self, packed: torch.Tensor, seq_len: int, meta: dict) -> list[torch.Tensor]:
        """The token positions of each tier from the `tiers` buffer, checked against meta."""
        codes = unpack_tiers(packed, seq_len)
        found = torch.bincount(codes.to(torch.int64), minlength=4).tolist()
        expected = list(meta["counts"]) + [0]
        if found != expected:
            raise CorruptPayloadError(f"buffer tiers: holds {found[:3]} tokens per tier "
                                      f"({found[3]} invalid codes), meta.counts says "
                                      f"{meta['counts']}")
        n_sinks = min(meta["sinks"], seq_len)
        if n_sinks and bool((codes[:n_sinks] != HI).any()):
            raise CorruptPayloadError("buffer tiers: a sink token is not in the hi tier")
        return [(codes == tier).nonzero().flatten() for tier in (HI, INT8, INT4)]

    def _decode(self, buffers, shape, dtype, meta):
        n_kv, seq_len, d = shape
        index = self._tier_index(buffers["tiers"], seq_len, meta)
        outputs = []
        for name in ("k", "v"):
            out = torch.empty(shape, dtype=dtype, device=buffers["tiers"].device)
            if index[HI].numel():
                hi = buffers[f"{name}.hi"].view(_hi_dtype(dtype))
                out.index_copy_(1, index[HI], hi.reshape(n_kv, -1, d).to(dtype))
            for tier, bits in _BITS.items():
                if index[tier].numel():
                    prefix = f"{name}.{_TIER_NAMES[tier]}"
                    dequantize_tokens(buffers[prefix], buffers[f"{prefix}.scales"].view(
                        torch.float16), index[tier], bits, out, self.backend)
            outputs.append(out)
        return tuple(outputs)
