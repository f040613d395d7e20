"""The per-request KV cache the decode side generates from.

Layout: one contiguous tensor per layer for keys and one for values, `[n_kv, capacity, d_h]`, filled
up to `length` positions. All layers share `length`. A paged layout would replace `layer()` and
`write()` with block-table lookups; callers only use those two methods and `length`. `rebind`
moves a cache's storage elsewhere (the bucketed decode step's slab) without the callers noticing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if capacity <= 0:
            raise ValueError(f"capacity: must be positive, got {capacity}")
        self.capacity = capacity
        self.length = 0
        self.keys = [torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]

    @classmethod
    def from_layers(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                    capacity: int) -> KVCache:
        """A cache holding the given per-layer `[n_kv, S, d_h]` K and V, with room to `capacity`."""
        if len(keys) != len(values) or not keys:
            raise ValueError(f"keys/values: need the same nonzero number of layers, got "
                             f"{len(keys)} and {len(values)}")
        n_kv, seq_len, head_dim = keys[0].shape
        if capacity < seq_len:
            raise ValueError(f"capacity: {capacity} is smaller than the prompt ({seq_len})")
        cache = cls(len(keys), n_kv, head_dim, capacity, keys[0].dtype, keys[0].device)
        cache.load(keys, values)
        return cache

    def load(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Fill every layer with the given `[n_kv, S, d_h]` K and V from position 0; length = S."""
        n_kv, seq_len, head_dim = keys[0].shape
        for index, (k, v) in enumerate(zip(keys, values)):
            if k.shape != (n_kv, seq_len, head_dim) or v.shape != k.shape:
                raise ValueError(f"layer {index}: K {tuple(k.shape)} / V {tuple(v.shape)} differ "
                                 f"from layer 0's {(n_kv, seq_len, head_dim)}")
            self.write(index, 0, k, v)
        self.length = seq_len

    def rebind(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """From now on the cache's K and V are these per-layer `[n_kv, capacity, d_h]` tensors
        (views of storage owned elsewhere); the caller has copied the filled positions there.
        Empty tensors (capacity 0) leave the cache unusable: any later step or write fails."""
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise ValueError(f"keys/values: need {self.num_layers} layers, got {len(keys)} and "
                             f"{len(values)}")
        self.keys, self.values = list(keys), list(values)
        self.capacity = keys[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `[n_kv, n, d_h]` K and V at positions [start, start + n) of `layer`."""
        end = start + k.shape[1]
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v

    def layer(self, layer: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first `length` (default: all filled) positions of `layer`'s K and V."""
        n = self.length if length is None else length
        return self.keys[layer][:, :n], self.values[layer][:, :n]
