"""The block GEMM: on a CPU without native BF16, a BF16 block of at least
`BF16_VIA_FLOAT32_MIN_ROWS` rows is the float32 product rounded once to BF16, on every CPU
(forced here either way); fewer rows keep the native kernel; the choice depends only on a block's
rows, so a chunked product equals the whole one bit for bit, and both stay within BF16's rounding
of the float32 product."""

import pytest
import torch
import torch.nn.functional as F

from rekv_core import cpu_bf16
from rekv_core.model import blocks
from rekv_core.model.blocks import BF16_VIA_FLOAT32_MIN_ROWS, EXEC_BLOCK, linear


def _operands(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    w = (torch.randn(160, 96, generator=g) / 10).to(torch.bfloat16)
    b = torch.randn(160, generator=g).to(torch.bfloat16)
    return x, w, b


@pytest.fixture(params=[True, False], ids=["via-float32", "native"])
def via_float32(request, monkeypatch):
    monkeypatch.setattr(blocks, "BF16_VIA_FLOAT32", request.param)
    return request.param


def test_a_wide_block_is_the_float32_product_rounded_once(via_float32):
    x, w, b = _operands(BF16_VIA_FLOAT32_MIN_ROWS)
    wide = F.linear(x.float(), w.float(), b.float())
    out = linear(x, w, b)
    assert out.dtype == torch.bfloat16
    if via_float32:
        assert torch.equal(out, wide.to(torch.bfloat16))
    else:
        assert torch.equal(out, F.linear(x, w, b))
    # either way within a few BF16 roundings of the float32 product
    assert torch.allclose(out.float(), wide, rtol=2 ** -6, atol=2 ** -6)


def test_a_narrow_block_keeps_the_native_kernel(via_float32):
    x, w, b = _operands(BF16_VIA_FLOAT32_MIN_ROWS - 1)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_float32_is_untouched(via_float32):
    x, w, b = (t.float() for t in _operands(64))
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("rows", [EXEC_BLOCK + BF16_VIA_FLOAT32_MIN_ROWS + 5, 3 * EXEC_BLOCK + BF16_VIA_FLOAT32_MIN_ROWS - 1])
def test_a_chunked_product_equals_the_whole(via_float32, rows):
    """Chunks start at multiples of the block, so each block of a chunk is the whole run's."""
    x, w, b = _operands(rows, seed=rows)
    whole = linear(x, w, b)
    parts = [linear(x[s0:s0 + EXEC_BLOCK], w, b) for s0 in range(0, rows, EXEC_BLOCK)]
    assert torch.equal(torch.cat(parts), whole)
    tail = rows % EXEC_BLOCK
    expected = F.linear(x[-tail:], w, b)
    if via_float32 and tail >= BF16_VIA_FLOAT32_MIN_ROWS:
        expected = F.linear(x[-tail:].float(), w.float(), b.float()).to(torch.bfloat16)
    assert torch.equal(whole[-tail:], expected)


def test_the_cpu_check_matches_the_cpu(monkeypatch):
    """The flags `cpu_bf16` reads are the instructions torch's own CPU check finds; a cap on the
    kernels' instruction set sends BF16 GEMMs through float32 as on a CPU without them."""
    cpu = torch.cpu
    native = cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    if not cpu._is_avx2_supported():
        pytest.skip("not x86 with AVX2: BF16 goes to the native kernels whatever the flags")
    assert cpu_bf16.native(environ={}).native == native
    assert blocks.cpu_has_native_bf16() == cpu_bf16.native().native
    assert blocks.BF16_VIA_FLOAT32 == (not blocks.cpu_has_native_bf16())
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not blocks.cpu_has_native_bf16()
