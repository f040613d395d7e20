"""Triton kernel for decode attention over a slab of caches (the CUDA path of the bucketed step).

Exactly the contract of `decode_attention_reference.py`. One program per (sequence, KV head): it
loads the group's queries once (padded to 16 rows, `tl.dot`'s least), reads the sequence's slot
and length from device memory (so a CUDA graph captured once serves every later step: nothing
about lengths is baked into the launch) and walks the keys [0, length) in blocks of `BLOCK_N` with
an online softmax, reading each key and value once. Products and sums are float32 (`ieee`, not
TF32): decode attention is bound by reading the cache, not by its few flops. Run on the CPU under
`TRITON_INTERPRET=1` for tests.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rekv_core.kernels.decode_attention_reference import check_decode_attention

# 64 keys per block: a [16, 64] score tile and a [64, d_h] value tile per iteration. Not tuned on
# hardware yet.
BLOCK_N = 64
MIN_DOT_ROWS = 16


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, lengths_ptr, out_ptr,
                             stride_qb, stride_qh, stride_ks, stride_kh, stride_kc,
                             stride_ob, scale,
                             GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                             D_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int32)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_in = g < GROUP
    d_in = d < D
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_in[:, None] & d_in[None, :], other=0.0).to(tl.float32)
    base = slot * stride_ks + kv_head * stride_kh
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_in = n < length
        at = base + n[:, None].to(tl.int64) * stride_kc + d[None, :]
        tile_in = n_in[:, None] & d_in[None, :]
        k = tl.load(k_ptr + at, mask=tile_in, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + at, mask=tile_in, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, BLOCK_N]
        s = tl.where(n_in[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_in[:, None] & d_in[None, :])


def decode_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    check_decode_attention(q, keys, values, slots, lengths)
    batch, n_h, d_h = q.shape
    n_kv = keys.shape[1]
    if q.stride(2) != 1 or keys.stride(3) != 1 or keys.stride() != values.stride():
        raise ValueError("q/keys/values: need a contiguous last dimension and keys and values "
                         "laid out alike")
    group = n_h // n_kv
    out = torch.empty(batch, n_h * d_h, dtype=q.dtype, device=q.device)
    _decode_attention_kernel[(batch, n_kv)](
        q, keys, values, slots, lengths, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        out.stride(0), 1.0 / math.sqrt(d_h),
        GROUP=group, G_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), D=d_h,
        D_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(d_h)), BLOCK_N=BLOCK_N)
    return out
