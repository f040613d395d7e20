"""PyTorch reference of SpectrumKV's per-token precision tiers (the CPU path).

Tiers, by code: `HI` (0) the token's 16-bit values, `INT8` (1), `INT4` (2); code 3 is invalid.
Cost per token relative to FP16: 1, 0.5, 0.25. A budget b is the mean cost per token.

Tier assignment (`tier_counts`, `assign_tiers`), a deterministic function of (S, b, sinks, tiers):
- the first `min(sinks, S)` tokens (attention sinks) are always `HI`; the budget applies to the
  r = S − sinks others, so the realized cost is at most b·S + sinks·(1 − b) (the sinks' slack);
- 3-tier: all r start at INT4; the surplus (b − 0.25)·r upgrades the top-ranked tokens to INT8
  (+0.25 each) until all r are INT8 or the surplus is spent, and what is left upgrades the top of
  those to HI (+0.5 each). So b = 0.25 gives all INT4, 0.5 all INT8, 1 all HI (sinks aside);
- 2-tier (a model that does not tolerate INT4): all r start at INT8 and the surplus (b − 0.5)·r
  upgrades the top to HI. b < 0.5 is refused: the paper then drops the lowest tokens, but a handoff
  must deliver every token of the cache;
- the budget is resolved to 1e-4 and the counts use integer arithmetic, so sender and receiver
  agree on them exactly; rank = importance descending, ties by token index; a token never gets a
  higher precision than one ranked above it.

Quantizer, shared bit for bit with `spectrum_triton.py`: symmetric absmax per row, a row being one
(head, token) of K or V (d_h values); the arithmetic of `groupwise_reference.py` with the row as the
group: scale = fp16(min(absmax / qmax, 65504)) in float32 with IEEE division, code = round half away
from zero of x / scale (a zero scale divides by 1), clamped to ±qmax (127 INT8, 7 INT4). INT8 codes
are int8 bytes; INT4 codes offset-binary nibbles, element 2j low, 2j+1 high (d_h must be even).
A tier's rows are ordered head-major, then by token index: codes `[n_kv, n, d_h]` flattened, scales
`[n_kv, n]`. Dequantization is fp32(code) · fp32(scale) rounded to the output dtype, written back to
the tokens' positions.
"""

from __future__ import annotations

import torch

from rekv_core.kernels.groupwise_reference import check_bits, quantize_row_blocks, unpack_codes

HI, INT8, INT4 = 0, 1, 2
TIER_MODES = (2, 3)
BUDGET_UNITS = 10000  # the budget's resolution: 1e-4 of an FP16 token
CHUNK_ROWS = 8192  # rows per step of the reference: keeps float32 temporaries at a few MiB


def budget_units(budget: float, tiers: int) -> int:
    """The budget in 1e-4 units, after checking it and the tier mode (ValueError naming them)."""
    if tiers not in TIER_MODES:
        raise ValueError(f"tiers: must be one of {TIER_MODES}, got {tiers!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget: must be a number, got {budget!r}")
    units = round(budget * BUDGET_UNITS)
    floor = BUDGET_UNITS // 4 if tiers == 3 else BUDGET_UNITS // 2
    if not floor <= units <= BUDGET_UNITS:
        mode = ("3-tier (INT4 is the cheapest tier)" if tiers == 3 else
                "2-tier (INT8 is the cheapest tier; tokens are never dropped)")
        raise ValueError(f"budget: must lie in [{floor / BUDGET_UNITS}, 1] in {mode}, "
                         f"got {budget}")
    return units


def tier_counts(seq_len: int, budget: float, sinks: int = 4, tiers: int = 3
                ) -> tuple[int, int, int]:
    """(n_hi, n_int8, n_int4) for S = `seq_len` tokens; n_hi counts the sinks."""
    units = budget_units(budget, tiers)
    if seq_len < 0 or sinks < 0:
        raise ValueError(f"seq_len, sinks: must be >= 0, got {seq_len}, {sinks}")
    n_sinks = min(sinks, seq_len)
    rest = seq_len - n_sinks
    quarter, half = BUDGET_UNITS // 4, BUDGET_UNITS // 2
    if tiers == 2:
        up_hi = min(rest, (units - half) * rest // half)
        return n_sinks + up_hi, rest - up_hi, 0
    surplus = (units - quarter) * rest
    up8 = min(rest, surplus // quarter)
    up_hi = min(up8, (surplus - up8 * quarter) // half)
    return n_sinks + up_hi, up8 - up_hi, rest - up8


def rank_tokens(importance: torch.Tensor, sinks: int) -> torch.Tensor:
    """Token indices by rank: the sinks in order, then the others by importance descending, ties
    by token index."""
    seq_len = importance.numel()
    n_sinks = min(sinks, seq_len)
    rest = importance[n_sinks:].to(torch.float32)
    order = torch.sort(rest, descending=True, stable=True).indices + n_sinks
    return torch.cat([torch.arange(n_sinks, device=importance.device), order])


def check_importance(importance: torch.Tensor | None, seq_len: int) -> torch.Tensor:
    if importance is None:
        raise ValueError("token_importance: spectrum needs one score per token [S] from the "
                         "prefill (EncodeContext(token_importance=...), see "
                         "rekv_core.model.importance)")
    if importance.dim() != 1 or importance.numel() != seq_len:
        raise ValueError(f"token_importance: expected [{seq_len}], got "
                         f"{tuple(importance.shape)}")
    if not importance.dtype.is_floating_point or not bool(torch.isfinite(importance).all()):
        raise ValueError("token_importance: must be finite floating-point scores")
    return importance


def assign_tiers(importance: torch.Tensor, budget: float, sinks: int = 4, tiers: int = 3
                 ) -> torch.Tensor:
    """Tier code per token, uint8 `[S]` on the importance's device."""
    seq_len = importance.numel()
    n_hi, n8, _ = tier_counts(seq_len, budget, sinks, tiers)
    codes = torch.full((seq_len,), INT4, dtype=torch.uint8, device=importance.device)
    ranked = rank_tokens(importance, sinks)
    codes[ranked[:n_hi]] = HI
    codes[ranked[n_hi:n_hi + n8]] = INT8
    return codes


def pack_tiers(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes `[S]` -> uint8 `[ceil(S/4)]`, token 4j + i in bits 2i..2i+1 (padding zero)."""
    padded = torch.zeros(-(-codes.numel() // 4) * 4, dtype=torch.uint8, device=codes.device)
    padded[:codes.numel()] = codes
    quads = padded.reshape(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def unpack_tiers(packed: torch.Tensor, seq_len: int) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)[:seq_len]


def quantize_tokens_reference(x: torch.Tensor, index: torch.Tensor, bits: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of tokens `index` (int64, ascending) of x `[n_kv, S, d]` -> (codes uint8
    `[n_kv·n·d·bits/8]`, scales fp16 `[n_kv·n]`)."""
    return quantize_row_blocks(x.index_select(1, index).reshape(-1, x.shape[2]), bits, CHUNK_ROWS)


def dequantize_tokens_reference(codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor,
                                bits: int, out: torch.Tensor) -> torch.Tensor:
    """Write the dequantized rows of tokens `index` into out `[n_kv, S, d]` (in place)."""
    check_bits(bits)
    n_kv, _, d = out.shape
    values = unpack_codes(codes, bits).to(torch.float32).reshape(-1, d)
    values.mul_(scales.to(torch.float32)[:, None])
    out.index_copy_(1, index, values.reshape(n_kv, index.numel(), d).to(out.dtype))
    return out
