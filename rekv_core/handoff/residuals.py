"""Lynx's streams on the wire: each `int8` layer as an anchor message, later its residual.

A progressive action (`Action.progressive`) sends each layer's `int8` codes split in two
(`codecs.lynx`): `layer.{i}` holds the anchor (`k.anchor`, `k.scales`, `v.anchor`, `v.scales`)
and `residual.{i}` the low nibbles (`k.residual`, `v.residual`), each message's header the
buffers' checksums beside the layer's shape and dtype (`seal.with_checksums`; the seal's MAC
instead when sealed). Every anchor goes before any residual (`handoff.wire`).

- `split_encoded(encoded)`: the sender's (anchor header fields, anchor buffers, residual buffers)
  of an `int8`-encoded layer;
- `anchor_layer(message, ...)`: K and V at anchor precision (codes 16a + 8, within 8 code steps
  of the full codes) and the anchor buffers kept for the merge;
- `full_layer(anchor, message, ...)`: the `int8` codec's decode of the merged codes, bit for bit
  the K and V the `int8` action would have restored.

`PendingResiduals` is what a receiver hands back with a progressive handoff's result once every
anchor (and the boundary, or the head) is in: the residuals still arriving on the reading thread.
`ready()` says whether they are all in (or the reading ended), without waiting; `wait()` joins the
reading and ends the request (closed, the transfer DONE) or raises `ResidualsLost` (aborted, the
transfer FAILED); `apply(cache)` writes the full layers over the anchor rows [0, S) once waited
for; `abandon()` aborts it. Until `apply`, the cache holds the anchor-precision prefix, which
nothing but a draft may read.
"""

from __future__ import annotations

import json
import threading

import torch

from rekv_core.codecs import Codec, EncodedKV
from rekv_core.codecs.base import dtype_of
from rekv_core.codecs.lynx import BASE_CODEC, anchor_kv, merge_layer, split_layer
from rekv_core.handoff.seal import check_checksums
from rekv_core.handoff.transfer import TransferState
from rekv_core.model.cache import KVCache
from rekv_core.transport import Message, TransportError

ANCHOR_BUFFERS = ("k.anchor", "k.scales", "v.anchor", "v.scales")
RESIDUAL_BUFFERS = ("k.residual", "v.residual")


class ResidualsLost(RuntimeError):
    """A progressive handoff's residuals did not all arrive intact: the anchor cache may only
    ever have drafted; nothing verified on it may be emitted."""


def split_encoded(encoded: EncodedKV) -> tuple[dict, dict[str, torch.Tensor],
                                               dict[str, torch.Tensor]]:
    """An `int8` layer -> (anchor header fields, anchor buffers, residual buffers)."""
    if encoded.codec != BASE_CODEC:
        raise ValueError(f"codec: Lynx's streams split {BASE_CODEC} codes, got {encoded.codec}")
    anchor, residual = split_layer(encoded.buffers)
    return {"shape": list(encoded.shape), "dtype": encoded.dtype}, anchor, residual


def _checked(message: Message, names: tuple[str, ...], sizes: dict[str, int],
             sealed: bool) -> dict[str, torch.Tensor]:
    check_checksums(message, sealed)
    buffers = message.buffers
    if tuple(buffers) != names:
        raise TransportError(f"{message.name}: buffers {sorted(buffers)}, expected {list(names)}")
    for name in names:
        if buffers[name].dtype != torch.uint8 or buffers[name].numel() != sizes[name]:
            raise TransportError(f"{message.name}: buffer {name}: {buffers[name].numel()} "
                                 f"bytes, expected {sizes[name]}")
    return buffers


def _source_dtype(message: Message, shape: tuple[int, int, int]) -> tuple[str, torch.dtype]:
    """The anchor header's source dtype, after its shape is checked against the plan's."""
    try:
        meta = json.loads(message.header)
        got, dtype = tuple(meta["shape"]), meta["dtype"]
        torch_dtype = dtype_of(dtype)
    except (ValueError, KeyError, TypeError) as exc:
        raise TransportError(f"{message.name}: unreadable anchor header ({exc!r})") from None
    if got != shape:
        raise TransportError(f"{message.name}: shape {got}, expected {shape}")
    return dtype, torch_dtype


def anchor_layer(message: Message, codec: Codec, shape: tuple[int, int, int],
                 device: torch.device, sealed: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], str]:
    """An anchor message -> (K, V at anchor precision in the source dtype, the anchor buffers on
    `device`, the source dtype's name)."""
    dtype, torch_dtype = _source_dtype(message, shape)
    int8 = codec.buffer_layout(shape)
    sizes = {"k.anchor": int8["k.codes"] // 2, "k.scales": int8["k.scales"],
             "v.anchor": int8["v.codes"] // 2, "v.scales": int8["v.scales"]}
    buffers = _checked(message, ANCHOR_BUFFERS, sizes, sealed)
    anchor = {name: b.to(device) for name, b in buffers.items()}
    k, v = anchor_kv(anchor, shape, torch_dtype)
    return k, v, anchor, dtype


def full_layer(anchor: dict[str, torch.Tensor], dtype: str, message: Message, codec: Codec,
               shape: tuple[int, int, int], sealed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's anchor (source dtype `dtype`) and its residual message -> K and V as the
    `int8` codec decodes them."""
    int8 = codec.buffer_layout(shape)
    sizes = {"k.residual": int8["k.codes"] // 2, "v.residual": int8["v.codes"] // 2}
    residual = _checked(message, RESIDUAL_BUFFERS, sizes, sealed)
    device = anchor["k.anchor"].device
    merged = merge_layer(anchor, {name: b.to(device) for name, b in residual.items()})
    # the checksums (or the seal) were checked above; decode still checks the layout
    return codec.decode(EncodedKV(BASE_CODEC, shape, dtype, merged), verify=False)


class PendingResiduals:
    """A progressive handoff's residuals, still being read (module doc). `incoming` is the
    reading (`handoff.incoming.Incoming`), on thread `worker`; `join` waits for that thread
    within the transfer's limits and aborts the request past them."""

    def __init__(self, incoming, worker: threading.Thread, join) -> None:
        self._incoming, self._worker, self._join = incoming, worker, join
        self._ended = False
        self.arrived_at: float | None = None  # perf_counter when the last residual was in

    @property
    def layers(self) -> int:
        return self._incoming.action.cut

    @property
    def bytes(self):
        """The residuals' wire bytes received so far (`WireBytes`)."""
        return self._incoming.residual_bytes

    def ready(self) -> bool:
        return not self._worker.is_alive()

    def wait(self) -> None:
        """Every residual in and checked, the request closed; else `ResidualsLost`."""
        incoming = self._incoming
        inbound = incoming.inbound
        self._join(self._worker, inbound)
        if self._ended:
            return
        self._ended = True
        if incoming.error is not None or len(incoming.full) != self.layers:
            cause = incoming.error or TransportError("residuals: the reading stopped early")
            inbound.transport.abort(inbound.request_id)
            inbound.transfer.fail(f"residuals: {type(cause).__name__}: {cause}")
            raise ResidualsLost(f"request {inbound.request_id}: Lynx's residuals were lost "
                                f"({type(cause).__name__}: {cause})") from cause
        self.arrived_at = incoming.residuals_done
        inbound.transport.close(inbound.request_id)
        inbound.transfer.advance(TransferState.DONE)

    def apply(self, cache: KVCache) -> None:
        """The full layers over rows [0, S) of the prefix; after `wait`."""
        if not self._ended or len(self._incoming.full) != self.layers:
            raise RuntimeError("residuals: apply after a successful wait()")
        self._incoming.join_compute_stream()
        for index, (k, v) in sorted(self._incoming.full.items()):
            cache.write(index, 0, k, v)

    @property
    def waited_ms(self) -> float:
        """From the anchors in to the last residual in (0 until then)."""
        incoming = self._incoming
        if not incoming.residuals_done:
            return 0.0
        return max(0.0, incoming.residuals_done - incoming.done) * 1e3

    def abandon(self, why: str = "abandoned") -> None:
        """Stop the reading (the request aborted); nothing of it is kept."""
        incoming = self._incoming
        inbound = incoming.inbound
        if not self._ended:
            self._ended = True
            inbound.transport.abort(inbound.request_id)
            self._worker.join()
            inbound.transfer.fail(f"residuals: {why}")
        incoming.full.clear()
