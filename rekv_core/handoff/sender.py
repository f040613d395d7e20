"""The prefill side of a handoff: the plan, then the boundary and the prefix layer by layer.

`send_handoff(transport, plan, source, transfer)` sends one handoff (`HandoffPlan`) from a
`PrefillSource`, in order: the plan; then the token ids for c = 0;
then, from a finished prefill (the seed's schedule), the boundary h_c in token chunks followed by
each prefix layer as soon as it is encoded, so layer 0 is on the wire while layer 1 is being
quantized; from a live prefill (`LivePrefill`, streamed), each prefix layer as soon as the prefill
has computed it, then the boundary chunks once it has reached the cut (the last layer goes first:
it starts the decode side's link sample, which the boundary's first chunk, queued behind it,
completes); from a prefill in token chunks (`ChunkedPrefill`, pipelined), each chunk's boundary
rows as soon as the chunk has reached the cut, then its rows of each prefix layer, encoded on
their own; for transfer-only, the last position's final hidden state last. A token split
(`Action.split` l) sends every layer from a source that runs them all (`through` = L): the prefix
layers whole, the suffix layers' rows [l, S), and the boundary's rows [0, l) first from a finished
prefill or right after layer c − 1 from a live one (the decode side recomputes them while the
suffix rows are still coming); then the head. Lynx's streams (`Action.progressive`) send each
layer's anchor where the layer would go and every residual after the head, in layer order, once
everything before has left (a transport may move posted messages side by side; the residuals must
not take the anchors' bandwidth) (`handoff.residuals`). KVPR's per-layer form
(`Action.layer_split` l) sends each layer's input rows [0, l) in BF16 right before the layer, whose
message then carries its rows [l, S). It returns the
seconds spent encoding (Q) and the bytes sent by kind. The receiver must have opened the request
first. The handoff's `Transfer` bounds it: a cancelled or late handoff stops before its next
message and gives up what it posted. Every message is sealed with the handoff's key (a MAC
over its header and bytes, or AES-GCM when encrypted); an unsealed one carries checksums of its
buffers instead (`seal`).

On CUDA the encoding runs on a stream of its own that waits for the caller's stream (where the
prefill runs) before each layer, and every message carries the `ready` event of its buffers
(`rekv_core.streams`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rekv_core import streams
from rekv_core.codecs import EncodeContext
from rekv_core.handoff.action import WireBytes
from rekv_core.handoff.boundary import chunk_codebook, encode_chunk
from rekv_core.handoff.plan import HandoffPlan
from rekv_core.handoff.bulk_mac import Protection
from rekv_core.handoff.seal import Sealing, encrypt, seal, with_checksums
from rekv_core.handoff.source import ChunkedPrefill, PrefillSource
from rekv_core.handoff.transfer import Transfer, TransferState
from rekv_core.handoff.residuals import split_encoded
from rekv_core.handoff.wire import (HEAD, PLAN, TOKENS, boundary_name, inputs_name, layer_name,
                                    layer_rows_name, residual_name, tensor_bytes)
from rekv_core.transport import Message, TransportSender
from rekv_core.units import BF16_BYTES, TOKEN_ID_BYTES


class SendHooks(Protocol):
    """Around each message of a handoff: fault injection (tests only), the services' tracing."""

    def before_send(self, message: Message) -> Message:
        """The sealed message, or what is sent instead."""

    def after_send(self, name: str) -> None:
        """Called once the message is posted."""


@dataclass
class SenderReport:
    quantize_seconds: float  # Q: encoding the prefix
    bytes: WireBytes


def send_handoff(transport: TransportSender, plan: HandoffPlan, source: PrefillSource,
                 transfer: Transfer, sealing: Sealing = Sealing(),
                 hooks: SendHooks | None = None) -> SenderReport:
    """Send `plan` from `source` (module doc) under `transfer.transfer_id`. `source` must be what
    the plan's delivery says: a finished prefill (`FinishedPrefill`) for the seed's schedule, a
    `LivePrefill` streamed in layer order, a `ChunkedPrefill` in the plan's token chunks and cut
    for token order. `transfer`: the handoff's state and deadline: a cancelled or late transfer
    stops before its next message, and the flush waits no longer than its deadline (or its stall
    limit); it ends DONE or FAILED. `sealing`: the key from the decode side, with which every
    message is sealed, and whether every buffer is encrypted too (`seal`). `hooks`: fault
    injection, tracing (`SendHooks`)."""
    _check_source(plan, source)
    stream = streams.side_stream(source.device)
    try:
        report = _send(plan, source, stream, _Posting(transport, transfer, sealing, hooks))
    except BaseException as exc:
        transfer.fail(f"{type(exc).__name__}: {exc}")
        try:  # give up whatever was posted: nothing stays queued for a failed handoff
            transport.flush(transfer.transfer_id, 0.0)
        except Exception:
            pass
        raise
    finally:
        streams.settle(stream)  # the caller may free `source` once this returns, even on failure
    transfer.advance(TransferState.DONE)
    return report


def _check_source(plan: HandoffPlan, source: PrefillSource) -> None:
    if (source.streamed, source.pipelined) != (plan.streamed, plan.pipelined):
        raise ValueError(f"source: streamed={source.streamed} pipelined={source.pipelined}, the "
                         f"plan's delivery is {plan.delivery}")
    if len(source.token_ids) != plan.seq_len:
        raise ValueError(f"source: {len(source.token_ids)} tokens, the plan is for "
                         f"{plan.seq_len}")
    if source.cut != plan.action.cut:
        raise ValueError(f"source: stops at cut {source.cut}, the plan's is {plan.action.cut}")
    if not source.pipelined and source.through != plan.action.sent_layers:
        raise ValueError(f"source: yields layers [0, {source.through}), the plan sends "
                         f"[0, {plan.action.sent_layers})")
    if not source.pipelined and source.input_rows != plan.action.layer_split:
        raise ValueError(f"source: carries {source.input_rows} input rows per layer, the plan's "
                         f"per-layer form sends {plan.action.layer_split}")
    if source.pipelined and source.bounds != plan.boundary_chunks:
        raise ValueError("source: a prefill in token chunks must run in the boundary's chunks")


class _Posting:
    """Seals, numbers and posts one handoff's messages, minding its transfer."""

    def __init__(self, transport: TransportSender, transfer: Transfer, sealing: Sealing,
                 hooks: SendHooks | None):
        self.transport, self.transfer = transport, transfer
        self.request_id = transfer.transfer_id
        self.sealing, self.hooks = sealing, hooks
        self.sealed = sealing.sealed  # no checksums: the seal's MAC covers the bytes
        self.seq = 0

    def __call__(self, name: str, header: bytes | None = None, buffers: dict | None = None,
                 state: TransferState | None = None) -> None:
        """`header` None: one holding the buffers' checksums, unless sealed (encoded layers bring
        their own)."""
        self.transfer.check()
        if state is not None:
            self.transfer.advance(state)
        buffers = buffers or {}
        header = with_checksums(buffers, sealed=self.sealed) if header is None else header
        message = Message(self.request_id, self.seq, name, header, buffers)
        key, protection = self.sealing.message_key, None
        if self.sealing.encrypted:  # on the host: a copy from the device waits for its producer
            message.buffers = {n: b.cpu() for n, b in buffers.items()}
            message, protection = encrypt(key, message), Protection.AEAD
        else:
            message.ready = streams.record_ready(buffers.values())
        message = seal(key, message, protection)
        if self.hooks is not None:
            message = self.hooks.before_send(message)
        self.transport.send(message)
        self.seq += 1
        if self.hooks is not None:
            self.hooks.after_send(name)

    def drain(self) -> None:
        """Wait until every message posted so far has left (within the transfer's limits)."""
        self.transport.flush(self.request_id, self.transfer.wait_s())

    def flush(self) -> None:
        self.transfer.advance(TransferState.JOINING)
        self.transport.flush(self.request_id, self.transfer.wait_s())


def _send(plan: HandoffPlan, source: PrefillSource, stream, send: _Posting) -> SenderReport:
    action = plan.action
    sent = WireBytes()
    send(PLAN, plan.to_bytes())
    if action.cut == 0:
        ids = torch.tensor(list(source.token_ids), dtype=torch.int32)
        send(TOKENS, buffers={"ids": tensor_bytes(ids)}, state=TransferState.BOUNDARY)
        sent += WireBytes(tokens=ids.numel() * TOKEN_ID_BYTES)
    elif action.sends_boundary and not source.streamed:
        sent += _send_boundary(plan, source, stream, send)
    if plan.pipelined:  # an interior cut: nothing was sent but the plan
        report = _send_in_token_order(plan, source, stream, send)
        send.flush()
        return report

    quantize = 0.0
    split, inputs = action.split, action.layer_split
    residuals: dict[int, dict[str, torch.Tensor]] = {}  # Lynx: sent after every anchor
    with contextlib.closing(source.layers()) as layers:
        for layer in layers:
            streams.follow(stream, source.device)  # after the compute that produced the layer
            # and its K and V are not given to another tensor before the encoding has read them
            produced = (layer.keys, layer.values) + ((layer.inputs,) if inputs else ())
            streams.wait_ready(None, produced, stream)
            keys, values, importance = layer.keys, layer.values, layer.importance
            rows = split if layer.index >= action.cut else inputs  # the rows not sent as KV
            if rows:  # a token split's suffix layer, or the per-layer form: rows [l, S)
                with streams.on_stream(stream):  # copied where they are encoded
                    keys, values = keys[:, rows:].contiguous(), values[:, rows:].contiguous()
                importance = None if importance is None else importance[rows:]
            if inputs:  # the per-layer form: the layer's input rows [0, l) first
                with streams.on_stream(stream):
                    x = layer.inputs.to(torch.bfloat16)
                send(inputs_name(layer.index), buffers={"h": tensor_bytes(x)},
                     state=TransferState.PREFIX)
                sent += WireBytes(prefix=x.numel() * BF16_BYTES)
            start = time.perf_counter()
            with streams.on_stream(stream):
                encoded = plan.codec.encode(
                    keys, values, checksums=not (send.sealed or action.progressive),
                    context=EncodeContext(token_importance=importance))
            quantize += time.perf_counter() - start
            if action.progressive:  # the anchor now, the residual after every anchor
                extra, anchor, residuals[layer.index] = split_encoded(encoded)
                with streams.on_stream(stream):
                    header = with_checksums(anchor, extra, sealed=send.sealed)
                send(layer_name(layer.index), header, anchor, state=TransferState.PREFIX)
            else:
                send(layer_name(layer.index), encoded.header_bytes(), encoded.buffers,
                     state=TransferState.PREFIX)
            sent += WireBytes.of_layer(encoded.layer_bytes())
            if split and source.streamed and layer.index == action.cut - 1:
                sent += _send_boundary(plan, source, stream, send)  # recompute starts early
    if action.sends_boundary and source.streamed and not split:
        sent += _send_boundary(plan, source, stream, send)

    if action.sends_head:
        streams.follow(stream, source.device)
        with streams.on_stream(stream):
            head = source.head().to(torch.bfloat16)
        send(HEAD, buffers={"h": tensor_bytes(head)})
        sent += WireBytes(head=head.numel() * BF16_BYTES)
    if residuals:  # the transport may move posted messages side by side: the anchors leave first
        send.drain()
    for index, buffers in sorted(residuals.items()):
        with streams.on_stream(stream):
            header = with_checksums(buffers, sealed=send.sealed)
        send(residual_name(index), header, buffers)
    send.flush()
    return SenderReport(quantize_seconds=quantize, bytes=sent)


def _send_in_token_order(plan: HandoffPlan, source: ChunkedPrefill, stream, send: _Posting
                         ) -> SenderReport:
    """Each chunk as the prefill passes the cut: its boundary rows, then its rows of each
    prefix layer."""
    sent, quantize, codebook = WireBytes(), 0.0, plan.boundary_codebook
    with contextlib.closing(source.chunks()) as chunks:
        for chunk in chunks:
            streams.follow(stream, source.device)
            streams.wait_ready(None, (chunk.boundary, *(t for layer in chunk.layers
                                                         for t in (layer.keys, layer.values))),
                               stream)
            with streams.on_stream(stream):
                rows = chunk.boundary.to(torch.bfloat16)
                codebook = chunk_codebook(rows, plan.action.boundary, codebook)
            sent += _send_boundary_chunk(plan, chunk.index, rows, codebook, stream, send)
            for layer in chunk.layers:
                start = time.perf_counter()
                with streams.on_stream(stream):
                    encoded = plan.codec.encode(layer.keys.contiguous(),
                                                layer.values.contiguous(),
                                                checksums=not send.sealed, context=EncodeContext())
                quantize += time.perf_counter() - start
                send(layer_rows_name(layer.index, chunk.index), encoded.header_bytes(),
                     encoded.buffers, state=TransferState.PREFIX)
                sent += WireBytes.of_layer(encoded.layer_bytes())
    return SenderReport(quantize_seconds=quantize, bytes=sent)


def _send_boundary(plan: HandoffPlan, source: PrefillSource, stream, send: _Posting
                   ) -> WireBytes:
    """h_c in BF16 or SplitZip-coded (`Action.boundary`), one message per chunk of rows
    (`HandoffPlan.boundary_chunks`)."""
    streams.follow(stream, source.device)
    sent = WireBytes()
    with streams.on_stream(stream):
        h_c = source.boundary()[:plan.boundary_rows].to(torch.bfloat16)
        codebook = chunk_codebook(h_c, plan.action.boundary, plan.boundary_codebook)
    for chunk, (s0, s1) in enumerate(plan.boundary_chunks):
        sent += _send_boundary_chunk(plan, chunk, h_c[s0:s1], codebook, stream, send)
    return sent


def _send_boundary_chunk(plan: HandoffPlan, chunk: int, rows: torch.Tensor,
                         codebook: Sequence[int] | None, stream, send: _Posting) -> WireBytes:
    """One chunk of BF16 boundary rows, coded as the plan's action says."""
    with streams.on_stream(stream):  # the checksums' read waits for the encoding
        buffers, extra = encode_chunk(rows, plan.action.boundary, codebook)
        header = with_checksums(buffers, extra, sealed=send.sealed)
    send(boundary_name(chunk), header, buffers,
         state=None if plan.streamed else TransferState.BOUNDARY)
    return WireBytes(boundary=sum(b.numel() for b in buffers.values()))
