"""Kernels over aligned blocks of positions: what makes a chunked suffix bit-identical.

Every kernel of a layer runs over blocks of `EXEC_BLOCK` positions aligned to multiples of it:
`linear` one block of rows at a time, `attend_causal` one block of queries at a time (block
[b0, b1) attends to keys [0, b1): the first block with the kernel's causal flag, the others with a
mask). A run over rows [pos, pos + n) with pos a multiple of the block therefore issues exactly the
kernels that one run over all rows issues for those rows, whatever a BLAS library or an attention
kernel does with the number of rows it is given. `chunk_bounds` cuts a prompt into such chunks.
`attend` is the plain attention call (GQA, an optional mask) the executor's other paths use.

BF16 on a CPU without native BF16 arithmetic (no AVX-512 BF16 or AMX: AVX2-only x86, for one; or
a cap on the kernels' instruction set below them, `rekv_core.cpu_bf16`) goes through emulated
kernels about 6x slower than float32: there a block of at least
`BF16_VIA_FLOAT32_MIN_ROWS` rows is multiplied in float32 (the weight widened for the call) and
rounded to BF16 once, as a native BF16 GEMM accumulates in float32 and rounds its output. Which
kernel a block takes depends only on the block's row count and the CPU, so the guarantee above
holds; a decode step (one row) keeps the native kernel, which is faster at that size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rekv_core import cpu_bf16

EXEC_BLOCK = 256  # positions per kernel call (rows of a linear layer, queries of attention)
# below this many rows, widening the weight costs more than the emulated BF16 GEMM saves (AMD
# EPYC Zen 3, AVX2: break-even at 4-8 rows for SmolLM2's projections, but near 32 for an LM head
# of 50-150K rows, whose float32 copy is fresh memory each call)
BF16_VIA_FLOAT32_MIN_ROWS = 32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies BF16 in hardware (AVX-512 BF16 or AMX tiles) with no cap on the
    kernels' instruction set below that (`rekv_core.cpu_bf16.native`, which `dtype = auto` asks
    too); True off x86, where no such check exists here and BF16 goes to the native kernels."""
    if not torch.cpu._is_avx2_supported():
        return True
    return cpu_bf16.native().native


BF16_VIA_FLOAT32 = not cpu_has_native_bf16()


def _linear_block(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    if (BF16_VIA_FLOAT32 and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.shape[0] >= BF16_VIA_FLOAT32_MIN_ROWS):
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """`F.linear` over blocks of `EXEC_BLOCK` rows of x `[n, k]`."""
    if x.shape[0] <= EXEC_BLOCK:
        return _linear_block(x, weight, bias)
    return torch.cat([_linear_block(x[i:i + EXEC_BLOCK], weight, bias)
                      for i in range(0, x.shape[0], EXEC_BLOCK)])


def chunk_bounds(seq_len: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Row ranges [s0, s1) covering [0, seq_len) in chunks of `chunk_tokens` (a multiple of
    `EXEC_BLOCK`; 0: one chunk); a tail shorter than a block joins the chunk before it."""
    if chunk_tokens < 0 or chunk_tokens % EXEC_BLOCK:
        raise ValueError(f"chunk_tokens: must be a multiple of {EXEC_BLOCK} (0: one chunk), "
                         f"got {chunk_tokens}")
    if seq_len < 1:
        raise ValueError(f"seq_len: must be positive, got {seq_len}")
    if chunk_tokens == 0 or chunk_tokens >= seq_len:
        return [(0, seq_len)]
    starts = list(range(0, seq_len, chunk_tokens))
    if len(starts) > 1 and seq_len - starts[-1] < EXEC_BLOCK:
        starts.pop()
    return [(s0, starts[i + 1] if i + 1 < len(starts) else seq_len)
            for i, s0 in enumerate(starts)]


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int = 0
                   ) -> torch.Tensor:
    """q `[n_h, n, d_h]` at positions [pos, pos + n), k and v `[n_kv, pos + n, d_h]`: causal
    attention one `EXEC_BLOCK` of query positions at a time (the first block with the
    kernel's causal flag, the others with a mask over keys [0, b1)) -> `[n, n_h*d_h]`."""
    end = pos + q.shape[1]
    outs = []
    b0 = pos
    while b0 < end:
        b1 = min(end, (b0 // EXEC_BLOCK + 1) * EXEC_BLOCK)
        rows = q[:, b0 - pos:b1 - pos]
        if b0 == 0:
            outs.append(attend(rows, k[:, :b1], v[:, :b1], is_causal=True))
        else:
            mask = (torch.arange(b1, device=q.device)[None, :]
                    <= torch.arange(b0, b1, device=q.device)[:, None])
            outs.append(attend(rows, k[:, :b1], v[:, :b1], mask=mask))
        b0 = b1
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    # q: [n_h, Sq, d_h]; k, v: [n_kv, Sk, d_h]; mask: [Sq, Sk] (True: attend) -> [Sq, n_h*d_h]
    n_h, n_q, d_h = q.shape
    n_kv = k.shape[0]
    if n_q == 1 and n_h != n_kv:
        # One query (a decode step): the heads of a group share their KV head and the mask, so
        # they go on the query axis, with no GQA expansion of K and V (and fused kernels apply).
        out = F.scaled_dot_product_attention(q.reshape(n_kv, n_h // n_kv, d_h)[None], k[None],
                                             v[None], attn_mask=mask)[0]
        return out.reshape(1, n_h * d_h)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                         is_causal=is_causal, enable_gqa=True)[0]
    return out.transpose(0, 1).reshape(q.shape[1], -1)
