"""The model fingerprint: one digest of everything that makes a handoff's cache valid elsewhere.

A cache computed by one worker is only right on another that runs the same computation: the same
weights as loaded, the same shape and RoPE settings, the same working dtype, the same tokenizer
(ids mean the same text), and the same handoff layout and codecs. `model_fingerprint(weights,
tokenizer)` is the SHA-256 (hex) of the canonical JSON of those parts (`fingerprint_parts`):

- `weights`: `model.digest.digest_of(weights)` (kept in the model cache for file sources);
- `shape`: every `ModelShape` field (layers, widths, vocabulary, `rope_theta`, `rope_scaling`,
  `rms_eps`, tied embeddings, context);
- `dtype`: the working dtype;
- `tokenizer`: `model.digest.tokenizer_digest` ("" for a model served by token ids);
- `wire`: `handoff.wire.WIRE_FORMAT`; `layer_header`: the codecs' header version;
- `codecs`: every registered codec's `version`.

The device is not in it: a CPU worker and a GPU worker with the same weights and dtype exchange
caches. The decode worker sends its fingerprint in every offer; the prefill worker refuses one
that differs from its own, and both sides put it into the handoff's `Sealing.binding`, so a message
sealed for another model does not verify.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from rekv_core.codecs import codec_versions
from rekv_core.codecs.base import WIRE_VERSION as LAYER_HEADER_VERSION
from rekv_core.handoff.wire import WIRE_FORMAT
from rekv_core.model.digest import digest_of, tokenizer_digest
from rekv_core.model.shapes import ModelShape
from rekv_core.model.weights_layout import ModelWeights

HEX_CHARS = 64  # SHA-256


@dataclass(frozen=True)
class ModelFingerprint:
    hex: str
    parts: dict  # what it covers, `fingerprint_parts`

    @property
    def binding(self) -> bytes:
        """The bytes a handoff's `Sealing.binding` carries."""
        return bytes.fromhex(self.hex)

    def describe(self) -> str:
        """One line for the start-up log: the fingerprint and what it covers."""
        p = self.parts
        codecs = ",".join(f"{name}:{version}" for name, version in p["codecs"].items())
        return (f"{self.hex} (model {p['shape']['name']}, weights {p['weights'][:16]}, dtype "
                f"{p['dtype']}, tokenizer {p['tokenizer'][:16] or 'none'}, wire {p['wire']}, "
                f"layer header {p['layer_header']}, codecs {codecs})")


def fingerprint_parts(shape: ModelShape, dtype: str, weights: str, tokenizer: str) -> dict:
    return {"format": "rekv-model-fingerprint-1", "weights": weights, "shape": asdict(shape),
            "dtype": dtype, "tokenizer": tokenizer, "wire": WIRE_FORMAT,
            "layer_header": LAYER_HEADER_VERSION, "codecs": codec_versions()}


def fingerprint_of(parts: dict) -> ModelFingerprint:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return ModelFingerprint(hashlib.sha256(text.encode()).hexdigest(), parts)


def model_fingerprint(weights: ModelWeights, tokenizer=None) -> ModelFingerprint:
    """`tokenizer`: the `GGUFTokenizer` the model is served with, None when served by ids."""
    dtype = str(weights.dtype).removeprefix("torch.")
    return fingerprint_of(fingerprint_parts(weights.shape, dtype, digest_of(weights),
                                            tokenizer_digest(tokenizer)))


def is_fingerprint(text: str) -> bool:
    """Whether `text` has a fingerprint's form: 64 lower-case hex digits."""
    return len(text) == HEX_CHARS and all(c in "0123456789abcdef" for c in text)
