"""Decode steps with static shapes, so one step can be captured once as a CUDA graph and replayed.

`StaticDecoder(model, cache)` appends one token per `step(token_id)` at `cache.length` and returns
its logits `[vocab]` (float32), like `executor.decode_step`, but every tensor a step touches has
the same shape and address from one step to the next: the token id and its position live in
device tensors, K and V are written into the cache at that position with `index_copy_`, and the
new token attends to the cache's whole capacity through a mask of the positions filled so far.
Nothing in a step reads a value back to the host. On CUDA (`graph=None` or True) the first step
captures the step as a CUDA graph, after warm-up runs on a side stream, and every later step
replays it: one launch instead of about a thousand operators, which is what a decode step at
small batch is bound by. Elsewhere the same static step runs eagerly.

One decoder serves one cache (the graph holds its addresses). Warm-up runs write K and V at the
next position, which the real step then overwrites; positions past the filled length are never
attended to. Logits agree with `decode_step`'s to rounding (the softmax runs over the whole
capacity, its masked part zero); a graph replay is bit-identical to the eager static step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from rekv_core.model.cache import KVCache
from rekv_core.model.layer import Model, final_logits, layer_forward

GRAPH_WARMUPS = 2  # eager runs on a side stream before capture, as CUDA graphs require
# One capture at a time per process (PyTorch's rule); each device captures on a stream of its own.
_CAPTURE_LOCK = threading.Lock()
_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_graph(device: torch.device, forward: Callable[[], torch.Tensor]
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`forward` captured as a CUDA graph after `GRAPH_WARMUPS` eager runs on a side stream; the
    graph and its output buffer (rewritten by each replay)."""
    with _CAPTURE_LOCK, torch.cuda.device(device):
        stream = _CAPTURE_STREAMS.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(GRAPH_WARMUPS):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (another request's handoff) may use the device meanwhile;
        # they only may not capture, which the lock rules out
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            output = forward()
    return graph, output


class StaticDecoder:
    def __init__(self, model: Model, cache: KVCache, graph: bool | None = None):
        device = model.device
        if cache.keys[0].device != device:
            raise ValueError(f"cache: on {cache.keys[0].device}, the model on {device}")
        self.model, self.cache = model, cache
        self.graph = device.type == "cuda" if graph is None else graph
        if self.graph and device.type != "cuda":
            raise ValueError(f"graph: CUDA graphs need a CUDA device, the model is on {device}")
        self._token = torch.zeros(1, dtype=torch.long, device=device)
        self._position = torch.zeros(1, dtype=torch.long, device=device)
        self._all_positions = torch.arange(cache.capacity, device=device)
        self._captured: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    def _store(self, index: int, k: torch.Tensor, v: torch.Tensor):
        keys, values = self.cache.keys[index], self.cache.values[index]
        keys.index_copy_(1, self._position, k)
        values.index_copy_(1, self._position, v)
        return keys, values

    def _forward(self) -> torch.Tensor:
        model = self.model
        h = torch.nn.functional.embedding(self._token, model.weights.embed)  # [1, d]
        cos, sin = model.rope(self._position)
        mask = (self._all_positions <= self._position)[None, :]  # [1, capacity]
        for index in range(model.shape.num_layers):
            h, _, _ = layer_forward(model, index, h, cos, sin, self._store, mask)
        return final_logits(model, h[-1])

    def _capture(self) -> None:
        self._captured, self._logits = capture_graph(self.model.device, self._forward)

    @torch.inference_mode()
    def step(self, token_id: int) -> torch.Tensor:
        vocab = self.model.shape.vocab_size
        if not 0 <= int(token_id) < vocab:
            raise ValueError(f"token_id: {token_id} is outside the vocabulary [0, {vocab})")
        position = self.cache.length
        if position >= self.cache.capacity:
            raise ValueError(f"cache: a token at position {position} exceeds its capacity of "
                             f"{self.cache.capacity}")
        self._token.fill_(int(token_id))
        self._position.fill_(position)
        if not self.graph:
            logits = self._forward()
        else:
            if self._captured is None:
                self._capture()
            self._captured.replay()
            logits = self._logits.clone()  # the graph's output buffer is reused by the next step
        self.cache.length = position + 1
        return logits
