"""The per-row arithmetic the Triton quantizers share (`groupwise_triton`, `spectrum_triton`,
`hadamard_triton`), so every codec's kernels round as the group-wise references do.

`scale_and_codes(x, absmax, QMAX, FMAX)` gives a row's FP16 scale, absmax / QMAX capped at FMAX,
and its codes, x / scale rounded half away from zero, both divisions IEEE-exact (`div_rn`);
`to_output(x, dtype)` casts float32 to the output dtype rounding to nearest-even. Both are
`@triton.jit` functions, called from kernels only.
"""

import triton
import triton.language as tl


@triton.jit
def scale_and_codes(x, absmax, QMAX: tl.constexpr, FMAX: tl.constexpr):
    """Rows x `[R, n]` (float32) with their absmax `[R]` -> each row's FP16 scale `[R]` and its
    codes `[R, n]` (float32 integers in [-QMAX, QMAX], rounded half away from zero)."""
    scale = tl.minimum(tl.math.div_rn(absmax, QMAX), FMAX).to(tl.float16)
    s = scale.to(tl.float32)
    y = tl.math.div_rn(x, tl.where(s == 0.0, 1.0, s)[:, None])
    q = tl.minimum(tl.floor(tl.abs(y) + 0.5), QMAX)
    return scale, tl.where(y < 0, -q, q)


@triton.jit
def to_output(x, dtype: tl.constexpr):
    """float32 -> output dtype, rounding to nearest-even. BF16 is rounded in integer arithmetic:
    Triton's interpreter truncates on that cast, while GPUs and torch round to nearest-even."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
