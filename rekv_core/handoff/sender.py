"""The prefill side of a handoff: the plan, then the boundary and the prefix layer by layer.

`send_handoff(transport, request_id, action, shape, token_ids, source)` sends one handoff from a
`PrefillSource` (or a finished `PrefillOutput`), in order: the plan; then the token ids for c = 0;
then, from a finished prefill (the seed's schedule), the boundary h_c in token chunks followed by
each prefix layer as soon as it is encoded, so layer 0 is on the wire while layer 1 is being
quantized; from a live prefill (`LivePrefill`, streamed), each prefix layer as soon as the prefill
has computed it, then the boundary chunks once it has reached the cut (the last layer goes first:
it starts the decode side's link sample, which the boundary's first chunk, queued behind it,
completes); from a prefill in token chunks (`ChunkedPrefill`, pipelined), each chunk's boundary
rows as soon as the chunk has reached the cut, then its rows of each prefix layer, encoded on
their own; for transfer-only, the last position's final hidden state last. It returns the
seconds spent encoding (Q) and the bytes sent by kind. The receiver must have opened the request
first. The handoff's `Transfer` bounds it: a cancelled or late handoff stops before its next
message and gives up what it posted. Every message is sealed with the handoff's key and carries
checksums of its buffers (`seal`).

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
from rekv_core.codecs import Codec, EncodeContext, get_codec
from rekv_core.handoff.action import Action, WireBytes, split_layer_bytes
from rekv_core.handoff.boundary import chunk_codebook, encode_chunk
from rekv_core.handoff.seal import check_key, encrypt, seal, with_checksums
from rekv_core.handoff.source import ChunkedPrefill, FinishedPrefill, PrefillSource
from rekv_core.handoff.transfer import Transfer, TransferState
from rekv_core.handoff.wire import (HEAD, PLAN, TOKENS, Plan, boundary_name, layer_name,
                                    layer_rows_name, tensor_bytes)
from rekv_core.model.executor import PrefillOutput
from rekv_core.model.shapes import ModelShape
from rekv_core.transport import Message, TransportSender
from rekv_core.units import BF16_BYTES, TOKEN_ID_BYTES


class SendHooks(Protocol):
    """Fault injection around each message of a handoff (tests only)."""

    def before_send(self, message: Message) -> Message:
        """The sealed message, or what is sent instead."""

    def after_send(self, name: str) -> None:
        """Called once the message is posted."""


@dataclass
class SenderReport:
    quantize_seconds: float  # Q: encoding the prefix
    bytes: WireBytes


def send_handoff(transport: TransportSender, request_id: str, action: Action, shape: ModelShape,
                 token_ids: Sequence[int], state: PrefillOutput | PrefillSource | ChunkedPrefill,
                 flush_timeout: float = 60.0, key: bytes | None = None,
                 transfer: Transfer | None = None, expect_ms: float = 0.0,
                 hooks: SendHooks | None = None, encrypted: bool = False,
                 chunk_tokens: int = 0, boundary_codebook: list[int] | None = None,
                 codec: Codec | None = None) -> SenderReport:
    """`state`: a finished prefill, or a `PrefillSource` (`LivePrefill` streams) or a
    `ChunkedPrefill` (pipelined: its chunks must be `chunk_tokens`'s, its cut the action's).
    `chunk_tokens`: the boundary's chunk size (`chunk_bounds`; 0: one message).
    `key`: the handoff's key from the decode side; every message is sealed with it (`seal`).
    `transfer`: the handoff's state and deadline: a cancelled or late transfer stops before its
    next message, and the flush waits no longer than its deadline (without one: `flush_timeout`);
    it ends DONE or FAILED. `expect_ms`: the predicted handoff length the plan tells the
    receiver. `hooks`: fault injection (`SendHooks`).
    `encrypted`: every buffer is encrypted under the key (`seal.encrypt`; on the host).
    `boundary_codebook`: the model's SplitZip codebook for boundary states (a SplitZip boundary
    without one ranks the exponents of its own h_c). `codec`: the prefix codec's instance to
    encode with (default: the registry's `action.codec`), e.g. SplitZip with the model's
    codebook."""
    if codec is not None and codec.name != action.codec:
        raise ValueError(f"codec: {codec.name!r} is not the action's {action.codec!r}")
    check_key(key)
    if encrypted and key is None:
        raise ValueError("encrypted: needs the handoff's key")
    transfer = transfer or Transfer(request_id, stall_s=flush_timeout)
    source = FinishedPrefill(state, action.cut) if isinstance(state, PrefillOutput) else state
    plan = Plan.of(action, shape, len(token_ids), expect_ms, source.streamed, chunk_tokens,
                   source.pipelined)
    if source.pipelined and (source.cut != action.cut or source.bounds != plan.boundary_chunks):
        raise ValueError("state: a prefill in token chunks must stop at the action's cut and run "
                         "in the boundary's chunks")
    if source.pipelined and (codec or get_codec(action.codec)).importance_window:
        raise ValueError(f"codec: {action.codec} ranks a layer's tokens and cannot encode a "
                         f"chunk of them alone (pipelined)")
    stream = streams.side_stream(source.device)
    try:
        report = _send(plan, token_ids, source, stream,
                       _Posting(transport, request_id, transfer, key, hooks, encrypted),
                       boundary_codebook, codec or get_codec(action.codec))
    except BaseException as exc:
        transfer.fail(f"{type(exc).__name__}: {exc}")
        try:  # give up whatever was posted: nothing stays queued for a failed handoff
            transport.flush(request_id, 0.0)
        except Exception:
            pass
        raise
    finally:
        streams.settle(stream)  # the caller may free `state` once this returns, even on failure
    transfer.advance(TransferState.DONE)
    return report


class _Posting:
    """Seals, numbers and posts one handoff's messages, minding its transfer."""

    def __init__(self, transport: TransportSender, request_id: str, transfer: Transfer,
                 key: bytes | None, hooks: SendHooks | None, encrypted: bool):
        self.transport, self.request_id, self.transfer = transport, request_id, transfer
        self.key, self.hooks, self.encrypted = key, hooks, encrypted
        self.seq = 0

    def __call__(self, name: str, header: bytes | None = None, buffers: dict | None = None,
                 state: TransferState | None = None) -> None:
        """`header` None: one holding the buffers' checksums (encoded layers bring their own)."""
        self.transfer.check()
        if state is not None:
            self.transfer.advance(state)
        buffers = buffers or {}
        header = with_checksums(buffers) if header is None else header
        message = Message(self.request_id, self.seq, name, header, buffers)
        if self.encrypted:  # on the host: a copy from the device waits for its producer
            message.buffers = {n: b.cpu() for n, b in buffers.items()}
            message = encrypt(self.key, message)
        else:
            message.ready = streams.record_ready(buffers.values())
        message = seal(self.key, message)
        if self.hooks is not None:
            message = self.hooks.before_send(message)
        self.transport.send(message)
        self.seq += 1
        if self.hooks is not None:
            self.hooks.after_send(name)

    def flush(self) -> None:
        self.transfer.advance(TransferState.JOINING)
        self.transport.flush(self.request_id, self.transfer.wait_s())


def _send(plan: Plan, token_ids: Sequence[int], source: PrefillSource, stream,
          send: _Posting, boundary_codebook: list[int] | None, codec: Codec) -> SenderReport:
    action = plan.action
    sent = WireBytes()
    send(PLAN, plan.to_bytes())
    if action.cut == 0:
        ids = torch.tensor(list(token_ids), dtype=torch.int32)
        send(TOKENS, buffers={"ids": tensor_bytes(ids)}, state=TransferState.BOUNDARY)
        sent += WireBytes(tokens=ids.numel() * TOKEN_ID_BYTES)
    elif action.sends_boundary and not source.streamed:
        sent += _send_boundary(plan, source, stream, send, boundary_codebook)
    if plan.pipelined:  # an interior cut: nothing was sent but the plan
        report = _send_in_token_order(plan, source, stream, send, boundary_codebook, codec)
        send.flush()
        return report

    quantize = 0.0
    with contextlib.closing(source.layers()) as layers:
        for layer in layers:
            streams.follow(stream, source.device)  # after the compute that produced the layer
            # and its K and V are not given to another tensor before the encoding has read them
            streams.wait_ready(None, (layer.keys, layer.values), stream)
            start = time.perf_counter()
            with streams.on_stream(stream):
                encoded = codec.encode(layer.keys, layer.values,
                                       context=EncodeContext(token_importance=layer.importance))
            quantize += time.perf_counter() - start
            send(layer_name(layer.index), encoded.header_bytes(), encoded.buffers,
                 state=TransferState.PREFIX)
            sent += split_layer_bytes(encoded.header()["buffers"])
    if action.sends_boundary and source.streamed:
        sent += _send_boundary(plan, source, stream, send, boundary_codebook)

    if action.cut == action.num_layers:
        streams.follow(stream, source.device)
        with streams.on_stream(stream):
            head = source.head().to(torch.bfloat16)
        send(HEAD, buffers={"h": tensor_bytes(head)})
        sent += WireBytes(head=head.numel() * BF16_BYTES)
    send.flush()
    return SenderReport(quantize_seconds=quantize, bytes=sent)


def _send_in_token_order(plan: Plan, source: ChunkedPrefill, stream, send: _Posting,
                         codebook: list[int] | None, codec: Codec) -> SenderReport:
    """Each chunk as the prefill passes the cut: its boundary rows, then its rows of each
    prefix layer."""
    sent, quantize = WireBytes(), 0.0
    with contextlib.closing(source.chunks()) as chunks:
        for chunk in chunks:
            streams.follow(stream, source.device)
            streams.wait_ready(None, (chunk.boundary, *(t for layer in chunk.layers
                                                         for t in (layer.keys, layer.values))),
                               stream)
            with streams.on_stream(stream):
                rows = chunk.boundary.to(torch.bfloat16)
                codebook = chunk_codebook(rows, plan.boundary, codebook)
            sent += _send_boundary_chunk(plan, chunk.index, rows, codebook, stream, send)
            for layer in chunk.layers:
                start = time.perf_counter()
                with streams.on_stream(stream):
                    encoded = codec.encode(layer.keys.contiguous(), layer.values.contiguous(),
                                           context=EncodeContext())
                quantize += time.perf_counter() - start
                send(layer_rows_name(layer.index, chunk.index), encoded.header_bytes(),
                     encoded.buffers, state=TransferState.PREFIX)
                sent += split_layer_bytes(encoded.header()["buffers"])
    return SenderReport(quantize_seconds=quantize, bytes=sent)


def _send_boundary(plan: Plan, source: PrefillSource, stream, send: _Posting,
                   codebook: list[int] | None) -> WireBytes:
    """h_c in BF16 or SplitZip-coded (`plan.boundary`), one message per chunk of rows
    (`Plan.boundary_chunks`)."""
    streams.follow(stream, source.device)
    sent = WireBytes()
    with streams.on_stream(stream):
        h_c = source.boundary().to(torch.bfloat16)
        codebook = chunk_codebook(h_c, plan.boundary, codebook)
    for chunk, (s0, s1) in enumerate(plan.boundary_chunks):
        sent += _send_boundary_chunk(plan, chunk, h_c[s0:s1], codebook, stream, send)
    return sent


def _send_boundary_chunk(plan: Plan, chunk: int, rows: torch.Tensor, codebook: list[int] | None,
                         stream, send: _Posting) -> WireBytes:
    """One chunk of BF16 boundary rows, coded as `plan.boundary` says."""
    with streams.on_stream(stream):  # the checksums' read waits for the encoding
        buffers, extra = encode_chunk(rows, plan.boundary, codebook)
        header = with_checksums(buffers, extra)
    send(boundary_name(chunk), header, buffers,
         state=None if plan.streamed else TransferState.BOUNDARY)
    return WireBytes(boundary=sum(b.numel() for b in buffers.values()))
