"""Codec interface and registry: `bf16`, `int8`, `int4` (see `base` for the contract)."""

from rekv_core.codecs.base import (Codec, CorruptPayloadError, EncodeContext, EncodedKV,
                                   codec_names, get_codec, register_codec)
from rekv_core.codecs.bf16 import BF16Codec
from rekv_core.codecs.groupwise import GroupwiseIntCodec

BASELINE_CODEC = "bf16"  # lossless for BF16 caches; every worker accepts it

register_codec(BASELINE_CODEC, BF16Codec)
register_codec("int8", lambda: GroupwiseIntCodec(8))
register_codec("int4", lambda: GroupwiseIntCodec(4))

__all__ = ["BASELINE_CODEC", "BF16Codec", "Codec", "CorruptPayloadError", "EncodeContext",
           "EncodedKV", "GroupwiseIntCodec",
           "codec_names", "get_codec", "register_codec"]
