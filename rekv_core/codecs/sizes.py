"""Wire bytes per layer for every registered codec, from shapes alone (eqs. 1, 2 and 7)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rekv_core.codecs.base import codec_names, get_codec
from rekv_core.model.shapes import ModelShape


@dataclass(frozen=True)
class CodecSizeRow:
    model: str
    prompt_len: int
    codec: str
    layer_bytes: int  # K and V of one layer on the wire, scales included
    boundary_bytes: int  # B_H: one BF16 hidden state [S, d]

    def as_dict(self) -> dict:
        return asdict(self)


def layer_bytes(shape: ModelShape, codec: str, prompt_len: int) -> int:
    return get_codec(codec).payload_bytes((shape.num_kv_heads, prompt_len, shape.head_dim))


def codec_size_rows(shapes: list[ModelShape], prompt_len: int) -> list[CodecSizeRow]:
    if prompt_len <= 0:
        raise ValueError(f"prompt_len: must be positive, got {prompt_len}")
    return [CodecSizeRow(model=shape.name, prompt_len=prompt_len, codec=codec,
                         layer_bytes=layer_bytes(shape, codec, prompt_len),
                         boundary_bytes=shape.boundary_bytes(prompt_len))
            for shape in shapes for codec in codec_names()]
