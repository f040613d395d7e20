"""Decode attention over a slab of caches: the PyTorch reference against the single-sequence
attention the executor runs (`blocks.attend` over the sequence's own keys), and the Triton kernel
against the reference (interpreter mode on the CPU) across GQA groups, head sizes that are not a
power of two, lengths at and across the kernel's key blocks, and slots in any order."""

import pytest
import torch

from rekv_core.kernels import decode_attention
from rekv_core.kernels.decode_attention_reference import decode_attention_reference
from rekv_core.kernels.decode_attention_triton import BLOCK_N, decode_attention_triton
from rekv_core.model.blocks import attend

SHAPES = [(4, 2, 16), (9, 3, 64), (7, 1, 32), (4, 4, 80)]  # (n_h, n_kv, d_h)
LENGTHS = [1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 2 * BLOCK_N + 7]
CAPACITY = 2 * BLOCK_N + 8


def _slab(n_h, n_kv, d_h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, slots = len(LENGTHS), len(LENGTHS) + 2
    q = torch.randn(batch, n_h, d_h, generator=g).to(dtype)
    keys = torch.randn(slots, n_kv, CAPACITY, d_h, generator=g).to(dtype)
    values = torch.randn(slots, n_kv, CAPACITY, d_h, generator=g).to(dtype)
    order = torch.randperm(slots, generator=g)[:batch]  # slots in any order, some unused
    return q, keys, values, order, torch.tensor(LENGTHS)


@pytest.mark.parametrize("n_h,n_kv,d_h", SHAPES)
def test_the_reference_is_each_sequences_own_attention(n_h, n_kv, d_h):
    q, keys, values, slots, lengths = _slab(n_h, n_kv, d_h, torch.float32)
    out = decode_attention_reference(q, keys, values, slots, lengths)
    for b, (slot, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        alone = attend(q[b][:, None, :], keys[slot, :, :n], values[slot, :, :n])
        torch.testing.assert_close(out[b:b + 1], alone, rtol=1e-5, atol=1e-5)


def test_keys_past_a_sequences_length_do_not_reach_its_result():
    q, keys, values, slots, lengths = _slab(4, 2, 16, torch.float32)
    before = decode_attention_reference(q, keys, values, slots, lengths)
    before_triton = decode_attention_triton(q, keys, values, slots, lengths)
    for slot, n in zip(slots.tolist(), lengths.tolist()):
        keys[slot, :, n:] = 1e4
        values[slot, :, n:] = float("nan")
    assert torch.equal(decode_attention_reference(q, keys, values, slots, lengths), before)
    assert torch.equal(decode_attention_triton(q, keys, values, slots, lengths), before_triton)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("n_h,n_kv,d_h", SHAPES)
def test_the_triton_kernel_equals_the_reference(n_h, n_kv, d_h, dtype, tol):
    q, keys, values, slots, lengths = _slab(n_h, n_kv, d_h, dtype, seed=n_h + d_h)
    want = decode_attention_reference(q, keys, values, slots, lengths)
    got = decode_attention_triton(q, keys, values, slots, lengths)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_backends_dispatch_and_bad_shapes_name_the_field():
    q, keys, values, slots, lengths = _slab(4, 2, 16, torch.float32)
    torch.testing.assert_close(decode_attention(q, keys, values, slots, lengths, "triton"),
                               decode_attention(q, keys, values, slots, lengths, "torch"))
    with pytest.raises(ValueError, match="values"):
        decode_attention(q, keys, values[:, :, :-1], slots, lengths)
    with pytest.raises(ValueError, match="slots/lengths"):
        decode_attention(q, keys, values, slots[:-1], lengths)
    with pytest.raises(ValueError, match="keys"):
        decode_attention(q, keys[:, :, :, :8], values[:, :, :, :8], slots, lengths)
