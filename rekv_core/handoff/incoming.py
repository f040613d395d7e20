"""The decode side's reading of one handoff's messages, on a thread of its own.

`Inbound` takes a request's messages in sequence order, each opened with the handoff's key and
decrypted when the handoff is encrypted (`seal`), keeping their arrivals for the link estimate.
`Incoming` reads every message after the plan: it restores the prefix layers into the cache in
layer order (on CUDA on a stream of its own), hands the boundary's chunks to the suffix in chunk
order (`next_chunk`), and keeps the head; the kinds may come in any order (a streamed handoff sends
the prefix layers as they are computed, then the boundary; a pipelined one, `row_chunks`, each
prefix layer in those row ranges, `layer.{i}.{k}`, each layer's in chunk order, interleaved with the
boundary's chunks). Any
other message, a second copy, or one out of its kind's order is a `TransportError`. A token split
(`Action.split` l) also sends layers c..L−1, each its rows [l, S) (restored there; a failure in
one costs the handoff, not only a prefix layer), and the head. Lynx's streams
(`Action.progressive`) send each prefix layer's anchor (restored at anchor precision into the
cache, `anchors_in` set once the anchors, the boundary's chunks and any head are in) and then
every residual (`residual.{i}`, in layer order), whose full layers are kept in `full` for the
caller to write over the anchor rows (`residuals.PendingResiduals`); no layer is salvaged from a
progressive handoff (`keep_verified` does not apply). KVPR's per-layer form (`Action.layer_split`
l) sends each prefix layer's input rows [0, l) (`inputs.{i}`, in layer order), from which this
thread recomputes the layer's K and V of those rows into the cache, and the layer's rows [l, S);
a layer is verified once both are restored. `run()` never
raises: a failure is kept in `error`, and a suffix waiting for a chunk is woken with it. With
`keep_verified`, a prefix layer whose message fails its seal (MAC, decryption), its checksums or
its codec's layout is lost instead (`losses`) and the reading goes on; a message that fails its
seal counts as the prefix layer its name claims only where that layer is next in its order (a
false name can only cost more layers, or the handoff), and as nothing else. `verified()` names
the prefix layers whose every message was restored (`recovery`).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from rekv_core import streams
from rekv_core.codecs import EncodedKV, LayerBytes
from rekv_core.handoff.action import WireBytes
from rekv_core.handoff.boundary import decode_chunk
from rekv_core.handoff.plan import HandoffPlan
from rekv_core.handoff.bulk_mac import Protection
from rekv_core.handoff.seal import SealError, Sealing, decrypt, open_message
from rekv_core.handoff.residuals import anchor_layer, full_layer
from rekv_core.handoff.transfer import Transfer, TransferCancelled
from rekv_core.handoff.token_split import recompute_layer_kv
from rekv_core.handoff.wire import (HEAD, boundary_name, inputs_name, layer_name,
                                    parse_layer_rows, residual_name)
from rekv_core.model.cache import KVCache
from rekv_core.model.executor import Model
from rekv_core.transport import Message, TransportError, TransportReceiver
from rekv_core.transport.arrivals import Arrival, link_sample
from rekv_core.units import BF16_BYTES


@dataclass(frozen=True)
class Refused:
    """A message that failed its seal: only its claimed `name`, and why."""

    name: str
    error: SealError


class Inbound:
    def __init__(self, transport: TransportReceiver, request_id: str, transfer: Transfer,
                 sealing: Sealing = Sealing()):
        self.transport, self.request_id, self.transfer = transport, request_id, transfer
        self.sealing = sealing
        self.arrivals: list[Arrival] = []

    def next(self) -> Message:
        message = self.next_or_refused()
        if isinstance(message, Refused):
            raise message.error
        return message

    def next_or_refused(self) -> Message | Refused:
        """The next message opened, or `Refused` when it fails its seal."""
        key, encrypted = self.sealing.message_key, self.sealing.encrypted
        message = self.transport.recv(self.request_id, self.transfer.wait_s())
        try:
            message = open_message(key, message, Protection.AEAD if encrypted else None)
            if encrypted:
                message = decrypt(key, message)
        except SealError as exc:
            return Refused(message.name, exc)
        if message.arrival is not None:
            self.arrivals.append(message.arrival)
        return message

    def expect(self, name: str) -> Message:
        message = self.next()
        if message.name != name:
            raise TransportError(f"request {self.request_id}: expected {name!r}, "
                                 f"got {message.name!r}")
        return message

    def link_sample(self, before: float | None = None) -> tuple[int, float] | None:
        """From the messages that had landed by `before` (all of them when None)."""
        return link_sample([a for a in self.arrivals if before is None or a.completed <= before])


def _on_device(buffers: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    # non-blocking only towards a device: a copy to the host must have landed before it is read
    return {name: b.to(device, non_blocking=device.type == "cuda") for name, b in buffers.items()}


class Incoming:
    def __init__(self, model: Model, inbound: Inbound, plan: HandoffPlan, cache: KVCache,
                 started: float, keep_verified: bool = False):
        self.model, self.inbound, self.action, self.cache = model, inbound, plan.action, cache
        self.codec = plan.codec
        self.kv_shape = plan.kv_shape
        self.num_chunks = len(plan.boundary_chunks)
        self.row_chunks = plan.prefix_row_chunks
        self.split = plan.action.split
        self.layer_split = plan.action.layer_split
        self.progressive = plan.action.progressive
        self.keep_verified = keep_verified and not self.progressive
        self._anchors: dict[int, tuple[dict[str, torch.Tensor], str]] = {}  # until the residual
        self.full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # progressive: full layers
        self.anchors_in = threading.Event()  # progressive: the anchors in, or the reading over
        self.anchors_complete = False
        self.residual_bytes = WireBytes()
        self.residuals_done = 0.0
        self.losses: dict[int, BaseException] = {}  # prefix layer -> why its bytes were refused
        self._restored = [0] * self.action.cut  # per prefix layer, its messages restored
        self.chunks_in = 0  # boundary chunks handed to the suffix
        self.bytes = WireBytes()
        self.error: BaseException | None = None
        self.done = started  # the prefix restored
        self.decoding_began: float | None = None  # the first restore that computes
        self.head: Message | None = None
        self._chunks: queue.Queue[Message | None] = queue.Queue()
        self.cuda = model.device.type == "cuda"
        self.stream = streams.side_stream(model.device)
        streams.follow(self.stream, model.device)  # the cache is allocated and zeroed first
        self.ready = torch.cuda.Event() if self.cuda else None
        self.anchors_ready = torch.cuda.Event() if self.cuda else None

    def run(self) -> None:
        try:
            with streams.on_stream(self.stream):
                self._receive_all()
                if self.cuda:
                    self.ready.record(self.stream)
        except BaseException as exc:  # re-raised on the calling thread after the join
            self.error = exc
            self._chunks.put(None)
        finally:
            streams.settle(self.stream)  # even after a failure nothing may write into the cache
            self.anchors_in.set()  # a waiter for the anchors sees the error
        if self.error is not None:
            self.done = time.perf_counter()

    def next_chunk(self, index: int) -> Message:
        """The boundary's chunk `index` (in order), waiting within the transfer's limits."""
        try:
            message = self._chunks.get(timeout=max(0.0, self.inbound.transfer.wait_s()))
        except queue.Empty:
            raise TimeoutError(f"transfer {self.inbound.request_id}: boundary chunk {index} "
                               f"did not arrive in time") from None
        if message is None:
            self._chunks.put(None)  # for a later call
            raise self.error
        return message

    def _receive_all(self) -> None:
        c = self.action.cut
        if self.row_chunks is not None:
            self._receive_in_token_order()
            return
        sent, with_head = self.action.sent_layers, self.action.sends_head
        inputs = sent if self.layer_split else 0
        layer = chunk = inputs_in = 0
        for _ in range(sent + inputs + self.num_chunks + with_head):
            message = self._next()
            if inputs_in < inputs and message.name == inputs_name(inputs_in):
                self._restore_or_lose(inputs_in, message, restore=self._recompute)
                inputs_in += 1
            elif layer < sent and message.name == layer_name(layer):
                if self.progressive:
                    self._restore_anchor(layer, _opened(message))
                elif layer < c:
                    self._restore_or_lose(layer, message, self.layer_split)
                else:  # not a prefix layer: a failure costs the handoff (no salvage)
                    self._restore(layer, _opened(message), self.split)
                layer += 1
                if layer == sent:
                    self.done = time.perf_counter()
            elif chunk < self.num_chunks and message.name == boundary_name(chunk):
                self._hand_over(message)
                chunk += 1
            elif message.name == HEAD and with_head and layer == sent and self.head is None:
                self.head = _opened(message)
            else:
                _opened(message)  # a refused one: its seal's error
                raise TransportError(f"request {self.inbound.request_id}: unexpected message "
                                     f"{message.name!r} (after {layer} of {sent} layers, "
                                     f"{inputs_in} of {inputs} layers' inputs and "
                                     f"{chunk} of {self.num_chunks} boundary chunks)")
        if self.progressive:
            if self.cuda:
                self.anchors_ready.record(self.stream)
            self.anchors_complete = True
            self.anchors_in.set()
            self._receive_residuals()

    def wait_anchors(self) -> None:
        """Progressive: until every message but the residuals is in (within the transfer's
        limits); the reading's error, if it failed before."""
        if not self.anchors_in.wait(max(0.0, self.inbound.transfer.wait_s())):
            raise TimeoutError(f"transfer {self.inbound.request_id}: the anchors did not arrive "
                               f"in time")
        if not self.anchors_complete:
            raise self.error or TransportError(f"transfer {self.inbound.request_id}: the "
                                               f"reading ended before the anchors")

    def _restore_anchor(self, index: int, message: Message) -> None:
        streams.wait_ready(message.ready, message.buffers.values())
        if self.decoding_began is None:
            self.decoding_began = time.perf_counter()
        k, v, anchor, dtype = anchor_layer(message, self.codec, self.kv_shape, self.model.device,
                                           self.inbound.sealing.sealed)
        self.cache.write(index, 0, k.to(self.model.dtype), v.to(self.model.dtype))
        self._anchors[index] = (anchor, dtype)
        self.bytes += _bytes_of(message)

    def _receive_residuals(self) -> None:
        """Each prefix layer's residual, in layer order: its full layer into `full`."""
        for index in range(self.action.cut):
            message = self.inbound.next()
            if message.name != residual_name(index):
                raise TransportError(f"request {self.inbound.request_id}: expected "
                                     f"{residual_name(index)!r}, got {message.name!r}")
            streams.wait_ready(message.ready, message.buffers.values())
            anchor, dtype = self._anchors.pop(index)
            k, v = full_layer(anchor, dtype, message, self.codec, self.kv_shape,
                              self.inbound.sealing.sealed)
            self.full[index] = (k.to(self.model.dtype), v.to(self.model.dtype))
            self.residual_bytes += _bytes_of(message)
        self.residuals_done = time.perf_counter()

    def _receive_in_token_order(self) -> None:
        """A pipelined handoff: c·chunks prefix messages and the boundary's chunks."""
        c, chunks = self.action.cut, self.row_chunks
        next_rows = [0] * c  # per layer, the chunk of rows it expects next
        chunk = restored = 0
        for _ in range(c * len(chunks) + self.num_chunks):
            message = self._next()
            rows = parse_layer_rows(message.name)
            if rows is not None and rows[0] < c and rows[1] == next_rows[rows[0]] < len(chunks):
                index, k = rows
                self._restore_or_lose(index, message, *chunks[k])
                next_rows[index] += 1
                restored += 1
                if restored == c * len(chunks):
                    self.done = time.perf_counter()
            elif chunk < self.num_chunks and message.name == boundary_name(chunk):
                self._hand_over(message)
                chunk += 1
            else:
                _opened(message)
                raise TransportError(f"request {self.inbound.request_id}: unexpected message "
                                     f"{message.name!r} (after {restored} of {c * len(chunks)} "
                                     f"prefix chunks and {chunk} of {self.num_chunks} boundary "
                                     f"chunks)")

    def _next(self) -> Message | Refused:
        return self.inbound.next_or_refused() if self.keep_verified else self.inbound.next()

    def _hand_over(self, message: Message | Refused) -> None:
        self._chunks.put(_opened(message))
        self.chunks_in += 1

    @property
    def boundary_complete(self) -> bool:
        return self.chunks_in == self.num_chunks

    def verified(self) -> frozenset[int]:
        """The prefix layers whose every message was restored."""
        per_layer = 1 if self.row_chunks is None else len(self.row_chunks)
        per_layer += 1 if self.layer_split else 0  # its input rows, its KV rows
        return frozenset(i for i, n in enumerate(self._restored)
                         if n == per_layer and i not in self.losses)

    def _restore_or_lose(self, index: int, message: Message | Refused, *rows: int,
                         restore=None) -> None:
        try:
            (restore or self._restore)(index, _opened(message), *rows)
        except (TransportError, ValueError) as exc:  # SealError, CorruptPayloadError among them
            if not self.keep_verified:
                raise
            self.losses.setdefault(index, exc)
            return
        self._restored[index] += 1

    def _restore(self, index: int, message: Message, s0: int = 0, s1: int | None = None) -> None:
        """Decode `message` into rows [s0, s1) of layer `index` (default: all of them)."""
        streams.wait_ready(message.ready, message.buffers.values())
        encoded = EncodedKV.from_wire(message.header,
                                      _on_device(message.buffers, self.model.device))
        n_kv, S, d_h = self.kv_shape
        expected = (n_kv, (S if s1 is None else s1) - s0, d_h)
        if tuple(encoded.shape) != expected:
            raise TransportError(f"{message.name}: shape {encoded.shape}, expected {expected}")
        if self.decoding_began is None and not self.codec.restore_is_copy:
            self.decoding_began = time.perf_counter()
        k, v = self.codec.decode(encoded, verify=not self.inbound.sealing.sealed)
        self.cache.write(index, s0, k.to(self.model.dtype), v.to(self.model.dtype))
        self.bytes += WireBytes.of_layer(encoded.layer_bytes())

    def _recompute(self, index: int, message: Message) -> None:
        """The per-layer form: layer `index`'s K and V of rows [0, l) from its input rows."""
        rows = decode_chunk(message, (self.layer_split, self.model.shape.hidden_size), "bf16",
                            self.inbound.sealing.sealed)
        if self.decoding_began is None:
            self.decoding_began = time.perf_counter()
        k, v = recompute_layer_kv(self.model, index,
                                  rows.to(self.model.device, self.model.dtype))
        self.cache.write(index, 0, k, v)
        self.bytes += WireBytes(prefix=rows.numel() * BF16_BYTES)

    def join_compute_stream(self, anchors: bool = False) -> None:
        """On CUDA: the compute stream waits for every restore (`anchors`: every restore of an
        anchor) before the cache is used."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.model.device)
            stream.wait_event(self.anchors_ready if anchors else self.ready)
            stream.synchronize()


def join_reader(worker: threading.Thread, inbound: Inbound) -> None:
    """Wait for the reading thread; past the transfer's deadline, abort the request, which wakes
    its receive at once, and wait for the thread to stop writing into the cache."""
    try:
        worker.join(max(0.0, inbound.transfer.wait_s()))
    except (TimeoutError, TransferCancelled):
        pass
    if worker.is_alive():
        inbound.transport.abort(inbound.request_id)
        worker.join()


def _bytes_of(message: Message) -> WireBytes:
    return WireBytes.of_layer(LayerBytes.of({n: b.numel() for n, b in message.buffers.items()}))


def _opened(message: Message | Refused) -> Message:
    if isinstance(message, Refused):
        raise message.error
    return message
