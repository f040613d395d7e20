"""Model shapes: every dimension of every supported model lives here and nowhere else.

`ModelShape` describes one decoder (Llama, Qwen2 or Qwen3 family). `PRESETS` holds the named shapes
that the CLI, the synthetic weights and the byte model refer to; `get_preset(name)` raises a
`ValueError` naming the allowed presets for an unknown name. The byte helpers implement the seed's
eqs. (1) and (2): B_H = S·d·e and B_KV = 2·S·n_kv·d_h·e.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rekv_core.units import BF16_BYTES

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (`rope_type: llama3` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    family: str  # one of FAMILIES
    num_layers: int  # L
    hidden_size: int  # d: width of the residual stream
    num_heads: int  # n_h
    num_kv_heads: int  # n_kv
    head_dim: int  # d_h
    ffn_size: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    max_positions: int
    rope_scaling: Llama3RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family: {self.family!r} is not one of {FAMILIES}")
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "ffn_size", "vocab_size", "max_positions"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field}: must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_layer_elements(self, seq_len: int) -> int:
        """E = 2·S·n_kv·d_h: keys and values of one layer."""
        return 2 * seq_len * self.num_kv_heads * self.head_dim

    def kv_layer_bytes(self, seq_len: int, elem_bytes: int = BF16_BYTES) -> int:
        """Eq. (2): B_KV = 2·S·n_kv·d_h·e."""
        return self.kv_layer_elements(seq_len) * elem_bytes

    def boundary_bytes(self, seq_len: int, elem_bytes: int = BF16_BYTES) -> int:
        """Eq. (1): B_H = S·d·e, one hidden state at the cut."""
        return seq_len * self.hidden_size * elem_bytes

    def with_layers(self, num_layers: int) -> ModelShape:
        return dataclasses.replace(self, num_layers=num_layers)


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape(name="smollm2-135m", family="llama", num_layers=30, hidden_size=576,
                   num_heads=9, num_kv_heads=3, head_dim=64, ffn_size=1536, vocab_size=49152,
                   rope_theta=100000.0, rms_eps=1e-5, tie_embeddings=True, max_positions=8192),
        ModelShape(name="qwen2.5-3b", family="qwen2", num_layers=36, hidden_size=2048,
                   num_heads=16, num_kv_heads=2, head_dim=128, ffn_size=11008,
                   vocab_size=151936, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=True,
                   max_positions=32768),
        ModelShape(name="qwen2.5-7b", family="qwen2", num_layers=28, hidden_size=3584,
                   num_heads=28, num_kv_heads=4, head_dim=128, ffn_size=18944,
                   vocab_size=152064, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False,
                   max_positions=32768),
        ModelShape(name="qwen3-8b", family="qwen3", num_layers=36, hidden_size=4096,
                   num_heads=32, num_kv_heads=8, head_dim=128, ffn_size=12288,
                   vocab_size=151936, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False,
                   max_positions=40960),
        ModelShape(name="llama-3.1-8b", family="llama", num_layers=32, hidden_size=4096,
                   num_heads=32, num_kv_heads=8, head_dim=128, ffn_size=14336,
                   vocab_size=128256, rope_theta=500000.0, rms_eps=1e-5,
                   tie_embeddings=False, max_positions=131072,
                   rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0,
                                                  original_max_positions=8192)),
        # Multi-head attention (n_kv = n_h), Llama-2-7B's shape: the model where KVPR's per-layer
        # form pays (a layer's input row is half its K and V row; ReKV's Proposition 1)
        ModelShape(name="llama-2-7b", family="llama", num_layers=32, hidden_size=4096,
                   num_heads=32, num_kv_heads=32, head_dim=128, ffn_size=11008,
                   vocab_size=32000, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=False,
                   max_positions=4096),
        # Llama-2-7B's proportions at 1/8 of its width, sized for a CPU: the same depth (32),
        # MHA, head_dim (128) and FFN ratio (2.7).
        ModelShape(name="mini-llama-2-7b", family="llama", num_layers=32, hidden_size=512,
                   num_heads=4, num_kv_heads=4, head_dim=128, ffn_size=1376,
                   vocab_size=32000, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=False,
                   max_positions=4096),
        # Qwen2.5-7B's proportions at 1/8 of its widths, sized for a CPU: the same depth (28), GQA
        # ratio (7:1), boundary-to-layer-KV ratio (d / 2·n_kv·d_h = 3.5) and FFN ratio (5.3).
        ModelShape(name="mini-qwen2.5-7b", family="qwen2", num_layers=28, hidden_size=448,
                   num_heads=7, num_kv_heads=1, head_dim=64, ffn_size=2368,
                   vocab_size=151936, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False,
                   max_positions=32768),
        # Qwen3-8B's proportions at 1/8 of its width, sized for a CPU: the same depth (36), GQA
        # ratio (4:1), head_dim (128), boundary-to-layer-KV ratio (2) and FFN ratio (3).
        ModelShape(name="mini-qwen3-8b", family="qwen3", num_layers=36, hidden_size=512,
                   num_heads=4, num_kv_heads=1, head_dim=128, ffn_size=1536,
                   vocab_size=151936, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False,
                   max_positions=40960),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def get_preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: "
                         f"{', '.join(PRESETS)}") from None
