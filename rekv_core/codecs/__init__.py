"""Codec interface and registry: `bf16`, `int8`, `int4`, `int4h`, `spectrum30`, `spectrum50`,
`splitzip` (see `base` for the contract)."""

from rekv_core.codecs.base import (Codec, CorruptPayloadError, EncodeContext, EncodedKV,
                                   LayerBytes, check_codec_name, codec_names, codec_versions,
                                   get_codec, register_codec, registered_layer_bytes)
from rekv_core.codecs.bf16 import BF16Codec
from rekv_core.codecs.groupwise import GroupwiseIntCodec
from rekv_core.codecs.int4h import HadamardInt4Codec
from rekv_core.codecs.spectrum import SpectrumCodec
from rekv_core.codecs.splitzip import SplitZipCodec

BASELINE_CODEC = "bf16"  # lossless for BF16 caches; every worker accepts it

register_codec(BASELINE_CODEC, BF16Codec)
register_codec("int8", lambda: GroupwiseIntCodec(8))
register_codec("int4", lambda: GroupwiseIntCodec(4))
register_codec("int4h", HadamardInt4Codec)  # Hadamard-rotated INT4
register_codec("spectrum30", lambda: SpectrumCodec(0.3))  # 3-tier; needs token_importance
register_codec("spectrum50", lambda: SpectrumCodec(0.5))
register_codec("splitzip", SplitZipCodec)  # lossless BF16 exponent coding

__all__ = ["BASELINE_CODEC", "BF16Codec", "Codec", "CorruptPayloadError", "EncodeContext",
           "EncodedKV", "GroupwiseIntCodec", "HadamardInt4Codec", "LayerBytes", "SpectrumCodec",
           "SplitZipCodec",
           "check_codec_name", "codec_names", "codec_versions", "get_codec", "register_codec",
           "registered_layer_bytes"]
