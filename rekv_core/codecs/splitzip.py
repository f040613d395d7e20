"""`splitzip`: lossless coding of BF16 exponents (SplitZip), for K and V and for any BF16 tensor.

Each BF16 element becomes a 4-bit code for its exponent (one of a 16-value codebook) plus its sign
and mantissa byte; elements whose exponent is outside the codebook go to a sparse escape stream.
A tensor of n elements takes exactly ⌈n/2⌉ + n + 7·n_esc bytes (ratio ≤ 4/3). The stream layout
and the codebook ranking are the contract of `rekv_core.kernels.splitzip_reference`; the arithmetic
runs in `rekv_core.kernels` (Triton on CUDA, the PyTorch reference elsewhere).

Tensor level (also for the boundary hidden state h_c): `encode_bf16(x, codebook)` gives the streams
`codes`, `sm`, `escapes` and a meta `{"codebook", "n", "chunk", "escapes"}` (escapes: the count);
`decode_bf16(buffers, meta)` gives the 1-D BF16 tensor back, bit for bit, after checking the meta
and the buffers (`CorruptPayloadError` naming the field or buffer).

Codec: wire buffers per layer `k.codes`, `k.sm`, `k.escapes`, `v.codes`, `v.sm`, `v.escapes`;
header meta `{"codebook": [16 ints], "chunk": C, "escapes": {"k": n_k, "v": n_v}}`, so decode
needs no policy. With `codebook=None` the encoder ranks the exponents of the K and V it encodes
(one shared codebook). Lossless for BF16 caches; float32 and float16 input is rounded to BF16 on
the wire and restored to its dtype by decode, exactly as the `bf16` codec does, so `lossless` means
what it means for `bf16`. `buffer_layout(shape, None)` plans with `expected_escape_rate`.
"""

from __future__ import annotations

import torch

from rekv_core.codecs.base import Codec, CorruptPayloadError, check_buffers
from rekv_core.kernels import (
    BACKENDS,
    SPLITZIP_CHUNK,
    ExponentHistogram,
    splitzip_decode,
    splitzip_encode,
)
from rekv_core.kernels import splitzip_reference as ref

STREAMS = ("codes", "sm", "escapes")
EXPECTED_ESCAPE_RATE = 0.001  # planning only: calibrated codebooks cover > 99 % of KV exponents
_TENSOR_META = ("codebook", "n", "chunk", "escapes")
_CODEC_META = ("codebook", "chunk", "escapes")


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
    return backend


def encode_bf16(x: torch.Tensor, codebook: list[int], chunk: int = SPLITZIP_CHUNK,
                backend: str = "auto") -> tuple[dict[str, torch.Tensor], dict]:
    """A BF16 tensor (any shape) -> (streams `codes`, `sm`, `escapes` as 1-D uint8 on x's device,
    meta `{"codebook", "n", "chunk", "escapes"}`). `ValueError` naming a bad argument."""
    codebook = ref.check_codebook(codebook)
    codes, sm, escapes = splitzip_encode(x, codebook, chunk, _check_backend(backend))
    meta = {"codebook": codebook, "n": x.numel(), "chunk": chunk,
            "escapes": escapes.numel() // ref.ESCAPE_BYTES}
    return dict(zip(STREAMS, (codes, sm, escapes))), meta


def _received(check, value):
    """`check(value)`, its `ValueError` turned into `CorruptPayloadError`."""
    try:
        return check(value)
    except ValueError as exc:
        raise CorruptPayloadError(str(exc)) from exc


def _count(field: str, value, most: int | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (
            most is not None and value > most):
        bound = "" if most is None else f" at most {most}"
        raise CorruptPayloadError(f"{field}: must be an int >= 0{bound}, got {value!r}")
    return value


def _fields(meta, expected: tuple[str, ...], where: str) -> None:
    if not isinstance(meta, dict) or set(meta) != set(expected):
        got = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise CorruptPayloadError(f"{where}: expected fields {list(expected)}, got {got}")


def check_tensor_meta(meta: dict) -> tuple[list[int], int, int, int]:
    """A received tensor meta -> (codebook, n, chunk, escape count), or `CorruptPayloadError`."""
    _fields(meta, _TENSOR_META, "meta")
    codebook = _received(ref.check_codebook, meta["codebook"])
    chunk = _received(ref.check_chunk, meta["chunk"])
    n = _count("n", meta["n"], None)
    return codebook, n, chunk, _count("escapes", meta["escapes"], n)


def decode_bf16(buffers: dict[str, torch.Tensor], meta: dict, backend: str = "auto"
                ) -> torch.Tensor:
    """Streams and meta from `encode_bf16` -> the 1-D BF16 tensor, bit for bit."""
    _check_backend(backend)
    codebook, n, chunk, n_esc = check_tensor_meta(meta)
    layout = ref.stream_bytes(n, n_esc)
    if set(buffers) == set(layout):  # in any order
        buffers = {name: buffers[name] for name in layout}
    check_buffers(buffers, layout, f"n={n} with {n_esc} escapes")
    return _received(lambda streams: splitzip_decode(*streams, codebook, n, chunk, backend),
                     tuple(buffers[name] for name in STREAMS))


class SplitZipCodec(Codec):
    name = "splitzip"
    lossless = True

    def __init__(self, codebook: list[int] | None = None, chunk: int = SPLITZIP_CHUNK,
                 backend: str = "auto", expected_escape_rate: float = EXPECTED_ESCAPE_RATE):
        self.codebook = None if codebook is None else ref.check_codebook(codebook)
        self.chunk = ref.check_chunk(chunk)
        self.backend = _check_backend(backend)
        if not 0.0 <= expected_escape_rate <= 1.0:
            raise ValueError(f"expected_escape_rate: must be in [0, 1], got {expected_escape_rate}")
        self.expected_escape_rate = expected_escape_rate

    def buffer_layout(self, shape: tuple[int, int, int], meta: dict | None = None
                      ) -> dict[str, int]:
        n = shape[0] * shape[1] * shape[2]
        expected = round(n * self.expected_escape_rate)
        counts = {"k": expected, "v": expected} if meta is None else meta["escapes"]
        return {f"{t}.{stream}": size for t in ("k", "v")
                for stream, size in ref.stream_bytes(n, counts[t]).items()}

    def check_meta(self, meta: dict, shape: tuple[int, int, int]) -> None:
        _fields(meta, _CODEC_META, "meta")
        _received(ref.check_codebook, meta["codebook"])
        _received(ref.check_chunk, meta["chunk"])
        _fields(meta["escapes"], ("k", "v"), "meta escapes")
        n = shape[0] * shape[1] * shape[2]
        for t in ("k", "v"):
            _count(f"escapes.{t}", meta["escapes"][t], n)

    def _encode(self, k, v, context):
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
        codebook = self.codebook
        if codebook is None:
            codebook = ExponentHistogram().add(k).add(v).codebook()
        buffers, escapes = {}, {}
        for t, x in (("k", k), ("v", v)):
            streams, meta = encode_bf16(x, codebook, self.chunk, self.backend)
            buffers.update({f"{t}.{stream}": b for stream, b in streams.items()})
            escapes[t] = meta["escapes"]
        return buffers, {"codebook": codebook, "chunk": self.chunk, "escapes": escapes}

    def _decode(self, buffers, shape, dtype, meta):
        n = shape[0] * shape[1] * shape[2]
        out = []
        for t in ("k", "v"):
            tensor_meta = {"codebook": meta["codebook"], "n": n, "chunk": meta["chunk"],
                           "escapes": meta["escapes"][t]}
            try:
                x = decode_bf16({s: buffers[f"{t}.{s}"] for s in STREAMS}, tensor_meta,
                                self.backend)
            except CorruptPayloadError as exc:
                raise CorruptPayloadError(f"{t}.{exc}") from exc
            out.append(x.reshape(shape).to(dtype))
        return tuple(out)
