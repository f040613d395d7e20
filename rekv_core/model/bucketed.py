"""Batched decode steps with static shapes over one slab of caches: CUDA graphs per batch bucket.

`BucketedDecoder(model, max_batch, capacity)` is a step for the decode engine with
`batched.batched_decode_step`'s contract, `decoder(model, tokens, caches) -> [B, vocab]` float32,
built so that a whole step of B sequences is one CUDA graph replay on a GPU (a decode step at
small batch is bound by its thousand-odd kernel launches, not by the device):

- **The slab.** Per layer, K and V `[max_batch + 1, n_kv, capacity, d_h]`. A cache seen for the
  first time is copied once into a free slot and rebound to views of it (`KVCache.rebind`), so
  `cache.layer`, `cache.write` and `cache.length` keep working and nothing is copied again. A
  cache absent from a step has left the batch: its slot is free for the next, and the cache is
  rebound to nothing (a later step with it fails instead of reading another sequence's keys).
  The last slot is the padding rows'.
- **Buckets.** A step of B sequences runs the smallest bucket (1, 2, 4, ... up to `max_batch`)
  that holds them; the rows past B are padding (token 0 at position 0 of the padding slot), and
  their logits are dropped. Each bucket's step reads its token ids, positions, slots and lengths
  from device buffers refilled before each step, so one capture per bucket serves every later step.
- **Attention** is `kernels.decode_attention`: each row reads only its own slot's keys up to its
  own length (the Triton kernel on a GPU, its PyTorch reference elsewhere), so a short sequence
  beside a long one costs its own length, not the longest's.

On CUDA (`graph=None` or True) the first step of each bucket captures it after warm-up runs
(`static_decode.capture_graph`); elsewhere the same static step runs eagerly, which is how the
CPU tests hold it to the reference. Logits agree with `batched_decode_step`'s to rounding (the
attention kernel differs); a replay is bit-identical to the eager static step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from rekv_core.kernels import decode_attention
from rekv_core.model.batched import check_batch
from rekv_core.model.blocks import linear as block_linear
from rekv_core.model.cache import KVCache
from rekv_core.model.layer import Linear, Model, final_logits, mlp, project_qkv, rms_norm
from rekv_core.model.static_decode import capture_graph


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch`: the batch sizes a step is padded to."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    buckets = [1]
    while buckets[-1] * 2 < max_batch:
        buckets.append(buckets[-1] * 2)
    return buckets if buckets[-1] == max_batch else buckets + [max_batch]


class BucketedDecoder:
    def __init__(self, model: Model, max_batch: int, capacity: int, graph: bool | None = None,
                 linear: Linear = block_linear, attention_backend: str = "auto"):
        device, shape = model.device, model.shape
        self.graph = device.type == "cuda" if graph is None else graph
        if self.graph and device.type != "cuda":
            raise ValueError(f"graph: CUDA graphs need a CUDA device, the model is on {device}")
        if capacity < 1:
            raise ValueError(f"capacity: must be positive, got {capacity}")
        self.model, self.capacity, self.buckets = model, capacity, batch_buckets(max_batch)
        self._linear, self._backend = linear, attention_backend
        self.pad_slot = max_batch
        slab = (max_batch + 1, shape.num_kv_heads, capacity, shape.head_dim)
        self.keys = [torch.zeros(slab, dtype=model.dtype, device=device)
                     for _ in range(shape.num_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        top = self.buckets[-1]
        self._tokens = torch.zeros(top, dtype=torch.long, device=device)
        self._positions = torch.zeros(top, dtype=torch.long, device=device)
        self._slots = torch.full((top,), self.pad_slot, dtype=torch.long, device=device)
        self._lengths = torch.ones(top, dtype=torch.long, device=device)
        self._heads = torch.arange(shape.num_kv_heads, device=device)
        self._holders: list[KVCache | None] = [None] * max_batch  # slot -> the cache in it
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, batch: int) -> int:
        for size in self.buckets:
            if batch <= size:
                return size
        raise ValueError(f"tokens: a batch of {batch} exceeds max_batch {self.buckets[-1]}")

    def seated(self) -> int:
        """Caches holding a slot now."""
        return sum(holder is not None for holder in self._holders)

    @torch.inference_mode()
    def __call__(self, model: Model, tokens: Sequence[int], caches: Sequence[KVCache]
                 ) -> torch.Tensor:
        if model is not self.model:
            raise ValueError("model: this decoder's slab was built for another model")
        check_batch(model, tokens, caches)
        size = self.bucket(len(caches))
        slots = self._seat(caches)
        positions = [cache.length for cache in caches]
        pad = size - len(caches)
        self._tokens[:size].copy_(torch.tensor([int(t) for t in tokens] + [0] * pad))
        self._positions[:size].copy_(torch.tensor(positions + [0] * pad))
        self._slots[:size].copy_(torch.tensor(slots + [self.pad_slot] * pad))
        self._lengths[:size].copy_(torch.tensor([p + 1 for p in positions] + [1] * pad))
        if self.graph:
            if size not in self._graphs:
                self._graphs[size] = capture_graph(self.model.device,
                                                   lambda: self._forward(size))
            graph, output = self._graphs[size]
            graph.replay()
            logits = output[:len(caches)].clone()  # the next replay rewrites the buffer
        else:
            logits = self._forward(size)[:len(caches)]
        for cache, position in zip(caches, positions):
            cache.length = position + 1
        return logits

    def _seat(self, caches: Sequence[KVCache]) -> list[int]:
        present = {id(cache) for cache in caches}
        for slot, holder in enumerate(self._holders):
            if holder is not None and id(holder) not in present:
                holder.rebind([k[:0, :0] for k in holder.keys],
                              [v[:0, :0] for v in holder.values])
                self._holders[slot] = None
        at = {id(holder): slot for slot, holder in enumerate(self._holders) if holder is not None}
        return [at[id(cache)] if id(cache) in at else self._adopt(i, cache)
                for i, cache in enumerate(caches)]

    def _adopt(self, index: int, cache: KVCache) -> int:
        shape = self.model.shape
        first = cache.keys[0]
        if (cache.num_layers, first.shape[0], first.shape[2]) != (
                shape.num_layers, shape.num_kv_heads, shape.head_dim):
            raise ValueError(f"caches[{index}]: its layers, KV heads or head size differ from "
                             f"the model's")
        if first.dtype != self.model.dtype or first.device != self.model.device:
            raise ValueError(f"caches[{index}]: {first.dtype} on {first.device}, the model "
                             f"{self.model.dtype} on {self.model.device}")
        if cache.capacity > self.capacity:
            raise ValueError(f"caches[{index}]: capacity {cache.capacity} exceeds the slab's "
                             f"{self.capacity}")
        slot = self._holders.index(None)  # a free one exists: at most max_batch are present
        filled = cache.length
        for layer in range(shape.num_layers):
            self.keys[layer][slot, :, :filled] = cache.keys[layer][:, :filled]
            self.values[layer][slot, :, :filled] = cache.values[layer][:, :filled]
        cache.rebind([k[slot, :, :cache.capacity] for k in self.keys],
                     [v[slot, :, :cache.capacity] for v in self.values])
        self._holders[slot] = cache
        return slot

    def _forward(self, size: int) -> torch.Tensor:
        model, linear = self.model, self._linear
        eps = model.shape.rms_eps
        positions, slots = self._positions[:size], self._slots[:size]
        h = F.embedding(self._tokens[:size], model.weights.embed)  # [n, d]
        cos, sin = model.rope(positions)
        rows, heads = slots[:, None], self._heads[None, :]
        for index, lw in enumerate(model.weights.layers):
            q, k, v = project_qkv(model, lw, rms_norm(h, lw.attn_norm, eps), cos, sin, linear)
            self.keys[index][rows, heads, positions[:, None]] = k.transpose(0, 1)
            self.values[index][rows, heads, positions[:, None]] = v.transpose(0, 1)
            out = decode_attention(q.transpose(0, 1), self.keys[index], self.values[index],
                                   slots, self._lengths[:size], self._backend)
            h = h + linear(out, lw.wo)
            h = h + mlp(lw, rms_norm(h, lw.mlp_norm, eps), linear)
        return final_logits(model, h, linear)
