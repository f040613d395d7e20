"""The codec interface: one layer's K and V to named wire buffers and back.

A codec
- `encode(k, v)`: K and V of one layer, each `[n_kv, S, d_h]`, to an `EncodedKV`: named, ordered
  1-D uint8 buffers on the tensors' device, plus a small header (codec, shape, source dtype, buffer
  sizes, checksums) that `header_bytes()` serializes and `EncodedKV.from_wire()` parses back;
- `decode(encoded)`: back to K and V in the source dtype, on the buffers' device. Before decoding it
  checks the codec name, shape, buffer names, dtypes and sizes against `buffer_layout()` and every
  checksum; any mismatch raises `CorruptPayloadError` naming what is wrong, never a wrong tensor;
- `buffer_layout(shape, meta)` / `payload_bytes(shape)` / `layer_bytes(shape)`: the exact wire bytes
  as a function of the
  shape and of the header's codec-specific `meta` (a JSON object; empty for codecs whose sizes
  follow from the shape alone), without encoding anything (headers are not payload). With
  `meta=None` a codec whose sizes depend on the data (an escape count) gives its expected layout,
  which planning uses. A buffer whose name ends in `.scales` holds quantizer scales, every other
  one data: `layer_bytes` (and `EncodedKV.layer_bytes()` for an encoded layer) splits the bytes so.
- `encode(k, v, context=...)`: a codec that needs more than K and V (per-token importance) reads it
  from `EncodeContext`; the others ignore it.

Codecs know tensors and bytes, not what a layer means: the handoff decides which layer goes in
which codec. `register_codec` adds a codec class to the registry; `get_codec(name)` builds one.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rekv_core.codecs.checksum import checksums as checksums_of
from rekv_core.codecs.checksum import default_algorithm, verify_checksums

WIRE_MAGIC = b"RKVL"
WIRE_VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CorruptPayloadError(ValueError):
    """An encoded layer that does not match its header or its codec's layout."""


class LayerBytes(NamedTuple):
    """One encoded layer's wire bytes (K and V together), split by what they hold."""

    data: int  # codes, or the values themselves
    scales: int  # quantizer scales

    @classmethod
    def of(cls, sizes: Mapping[str, int]) -> LayerBytes:
        """From buffer name -> bytes: names ending in `.scales` are scales."""
        scales = sum(n for name, n in sizes.items() if name.endswith(SCALES_SUFFIX))
        return cls(sum(sizes.values()) - scales, scales)


SCALES_SUFFIX = ".scales"


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a header's `dtype` names (`dtype_name`'s inverse); ValueError otherwise."""
    if name not in _DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype: must be one of {sorted(_DTYPES)}, got {dtype}")


@dataclass
class EncodedKV:
    codec: str
    shape: tuple[int, int, int]  # [n_kv, S, d_h] of K (and of V)
    dtype: str  # source dtype, restored by decode
    buffers: dict[str, torch.Tensor]  # ordered: the wire order
    checksum_algorithm: str = "crc32"
    checksums: dict[str, int] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # codec-specific header fields (JSON values)

    @property
    def payload_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def layer_bytes(self) -> LayerBytes:
        return LayerBytes.of({name: b.numel() for name, b in self.buffers.items()})

    def header(self) -> dict:
        return {"codec": self.codec, "shape": list(self.shape), "dtype": self.dtype,
                "buffers": {name: b.numel() for name, b in self.buffers.items()},
                "checksum_algorithm": self.checksum_algorithm, "checksums": self.checksums,
                "meta": self.meta}

    def header_bytes(self) -> bytes:
        body = json.dumps(self.header(), separators=(",", ":")).encode()
        return WIRE_MAGIC + bytes([WIRE_VERSION]) + body

    @classmethod
    def from_wire(cls, header: bytes, buffers: dict[str, torch.Tensor]) -> EncodedKV:
        """Rebuild from a serialized header and the received buffers (validated at decode)."""
        if header[:4] != WIRE_MAGIC or len(header) < 5:
            raise CorruptPayloadError("header: missing the RKVL magic")
        if header[4] != WIRE_VERSION:
            raise CorruptPayloadError(f"header: wire version {header[4]} is not {WIRE_VERSION}")
        try:
            meta = json.loads(header[5:])
            return cls(codec=meta["codec"], shape=tuple(meta["shape"]), dtype=meta["dtype"],
                       buffers=dict(buffers), checksum_algorithm=meta["checksum_algorithm"],
                       checksums={k: int(v) for k, v in meta["checksums"].items()},
                       meta=meta.get("meta", {}))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptPayloadError(f"header: unreadable ({exc})") from exc


def check_kv_pair(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    if k.dim() != 3:
        raise ValueError(f"k: expected [n_kv, S, d_h], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    if v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v: dtype/device {v.dtype}/{v.device} differ from k's "
                         f"{k.dtype}/{k.device}")
    dtype_name(k.dtype)
    return tuple(k.shape)


@dataclass(frozen=True)
class EncodeContext:
    """What a codec may use besides K and V. `token_importance`: one score per token `[S]` (higher
    is more important), from the prefill's attention (`rekv_core.model.importance`)."""

    token_importance: torch.Tensor | None = None

    @classmethod
    def for_timing(cls, codec: Codec, k: torch.Tensor) -> EncodeContext:
        """What `codec` needs to encode K `[n_kv, S, d_h]` when only its cost is measured: a fixed
        ranking (earlier tokens first) where it ranks tokens, nothing otherwise."""
        if codec.importance_window <= 0:
            return cls()
        S = k.shape[1]
        return cls(torch.linspace(1.0, 0.0, S, device=k.device) if S > 1
                   else torch.ones(S, device=k.device))


class Codec(ABC):
    name: str = ""
    version: int = 1  # bump when what it writes or how it reads changes (in the model fingerprint)
    lossless: bool = False  # decode(encode(x)) == x for working-dtype caches: always eligible
    restore_is_copy: bool = False  # decode is a dtype view and a copy, no arithmetic
    importance_window: int = 0  # > 0: encode needs `EncodeContext.token_importance` from the
    #   prefill's last that many queries (`model.importance`)

    @abstractmethod
    def buffer_layout(self, shape: tuple[int, int, int], meta: dict | None = None
                      ) -> dict[str, int]:
        """Buffer names in wire order -> exact bytes, for K and V of `shape` each, given the
        header's `meta` (validated by `check_meta` first); `meta=None`: the expected layout, for
        planning."""

    @abstractmethod
    def _encode(self, k: torch.Tensor, v: torch.Tensor, context: EncodeContext
                ) -> tuple[dict[str, torch.Tensor], dict]:
        """Inputs are validated and contiguous; return the buffers named by `buffer_layout` and the
        header's `meta`."""

    @abstractmethod
    def _decode(self, buffers: dict[str, torch.Tensor], shape: tuple[int, int, int],
                dtype: torch.dtype, meta: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers are validated against the layout and their checksums, `meta` by `check_meta`."""

    def check_meta(self, meta: dict, shape: tuple[int, int, int]) -> None:
        """Raise `CorruptPayloadError` naming the field of a received `meta` that is wrong."""
        if meta:
            raise CorruptPayloadError(f"meta: {self.name} carries none, got {sorted(meta)}")

    def check_shape(self, shape: tuple[int, int, int]) -> None:
        """Raise `ValueError` naming the dimension this codec cannot encode."""
        if len(shape) != 3 or any(int(n) <= 0 for n in shape):
            raise ValueError(f"shape: expected three positive dims [n_kv, S, d_h], got {shape}")

    def payload_bytes(self, shape: tuple[int, int, int]) -> int:
        return sum(self.buffer_layout(shape).values())

    def layer_bytes(self, shape: tuple[int, int, int]) -> LayerBytes:
        """The expected wire bytes of K and V of `shape`, data and scales apart."""
        return LayerBytes.of(self.buffer_layout(shape))

    def encode(self, k: torch.Tensor, v: torch.Tensor, checksums: bool = True,
               context: EncodeContext = EncodeContext()) -> EncodedKV:
        shape = check_kv_pair(k, v)
        self.check_shape(shape)
        buffers, meta = self._encode(k.contiguous(), v.contiguous(), context)
        algorithm = default_algorithm(k.device)
        sums = checksums_of(buffers, algorithm) if checksums else {}
        return EncodedKV(codec=self.name, shape=shape, dtype=dtype_name(k.dtype), buffers=buffers,
                         checksum_algorithm=algorithm, checksums=sums, meta=meta)

    def decode(self, encoded: EncodedKV, verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if encoded.codec != self.name:
            raise CorruptPayloadError(f"codec: payload is {encoded.codec!r}, decoder is "
                                      f"{self.name!r}")
        if encoded.dtype not in _DTYPES:
            raise CorruptPayloadError(f"dtype: {encoded.dtype!r} is not one of {sorted(_DTYPES)}")
        shape = tuple(int(n) for n in encoded.shape)
        try:
            self.check_shape(shape)
        except ValueError as exc:
            raise CorruptPayloadError(str(exc)) from exc
        if not isinstance(encoded.meta, dict):
            raise CorruptPayloadError(f"meta: must be an object, got {type(encoded.meta).__name__}")
        self.check_meta(encoded.meta, shape)
        layout = self.buffer_layout(shape, encoded.meta)
        check_buffers(encoded.buffers, layout, f"{self.name} with shape {shape}")
        for name in layout:
            if verify and name not in encoded.checksums:
                raise CorruptPayloadError(f"buffer {name}: no checksum in the header")
        if verify:
            self._verify(encoded)
        buffers = {name: b.contiguous() for name, b in encoded.buffers.items()}
        return self._decode(buffers, shape, _DTYPES[encoded.dtype], encoded.meta)

    @staticmethod
    def _verify(encoded: EncodedKV) -> None:
        verify_checksums(encoded.buffers, encoded.checksum_algorithm, encoded.checksums,
                         CorruptPayloadError)


def check_buffers(buffers: dict[str, torch.Tensor], layout: dict[str, int], needed_by: str
                  ) -> None:
    """`buffers` are exactly `layout`'s names, in its order, each 1-D uint8 of its size;
    else `CorruptPayloadError` naming the buffer and what needs the size (`needed_by`)."""
    if list(buffers) != list(layout):
        raise CorruptPayloadError(f"buffers: got {list(buffers)}, {needed_by} needs "
                                  f"{list(layout)}")
    for name, expected in layout.items():
        buf = buffers[name]
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise CorruptPayloadError(f"buffer {name}: must be 1-D uint8, got {buf.dtype} with "
                                      f"shape {tuple(buf.shape)}")
        if buf.numel() != expected:
            raise CorruptPayloadError(f"buffer {name}: {buf.numel()} bytes, expected {expected} "
                                      f"for {needed_by}")


_REGISTRY: dict[str, Callable[[], Codec]] = {}


def register_codec(name: str, factory: Callable[[], Codec]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"codec {name!r} is already registered")
    _REGISTRY[name] = factory


def codec_names() -> list[str]:
    return list(_REGISTRY)


def codec_versions() -> dict[str, int]:
    """Every registered codec's `version`, by name."""
    return {name: get_codec(name).version for name in _REGISTRY}


@functools.lru_cache(maxsize=4096)
def registered_layer_bytes(name: str, shape: tuple[int, int, int]) -> LayerBytes:
    """`get_codec(name).layer_bytes(shape)`, remembered: a name is registered once and for good,
    its factory takes no argument, and the planner asks for the same few shapes for every
    candidate it ranks."""
    return get_codec(name).layer_bytes(shape)


def get_codec(name: str) -> Codec:
    check_codec_name(name)
    return _REGISTRY[name]()


def check_codec_name(name: str) -> None:
    """Raise `ValueError` naming the registered codecs unless `name` is one (without making it)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r}; registered codecs: {', '.join(_REGISTRY)}")
