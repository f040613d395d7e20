"""The prefill side of a handoff: send h_c first, then the prefix layer by layer.

`send_handoff(transport, request_id, action, token_ids, state)` takes the prefill's output (every
layer's K, V and the hidden states it kept) and sends, in order: the plan, the boundary h_c (or the
token ids for c = 0), then each prefix layer as soon as it is encoded, so layer 0 is on the wire
while layer 1 is being quantized; for transfer-only, the last position's final hidden state last. It
returns the seconds spent encoding (Q) and the bytes sent by kind. The receiver must have opened the
request first. The handoff's `Transfer` bounds it: a cancelled or late handoff stops before its next
message and gives up what it posted. Every message is sealed with the handoff's key and carries
checksums of its buffers (`seal`). `state.keys`/`state.values` are only indexed in layer order, so a
producer that yields layers while the prefill still runs can stand in for a finished
`PrefillOutput`.

On CUDA the encoding runs on a stream of its own that first waits for the caller's stream (where
the prefill ran), and every message carries the `ready` event of its buffers (`rekv_core.streams`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rekv_core import streams
from rekv_core.codecs import get_codec
from rekv_core.handoff.action import Action, WireBytes, split_layer_bytes
from rekv_core.handoff.seal import check_key, encrypt, seal, with_checksums
from rekv_core.handoff.transfer import Transfer, TransferState
from rekv_core.handoff.wire import BOUNDARY, HEAD, PLAN, TOKENS, Plan, layer_name, tensor_bytes
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
                 token_ids: Sequence[int], state: PrefillOutput, flush_timeout: float = 60.0,
                 key: bytes | None = None, transfer: Transfer | None = None,
                 expect_ms: float = 0.0, hooks: SendHooks | None = None,
                 encrypted: bool = False) -> SenderReport:
    """`key`: the handoff's key from the decode side; every message is sealed with it (`seal`).
    `transfer`: the handoff's state and deadline: a cancelled or late transfer stops before its
    next message, and the flush waits no longer than its deadline (without one: `flush_timeout`);
    it ends DONE or FAILED. `expect_ms`: the predicted handoff length the plan tells the
    receiver. `hooks`: fault injection (`SendHooks`).
    `encrypted`: every buffer is encrypted under the key (`seal.encrypt`; on the host)."""
    check_key(key)
    if encrypted and key is None:
        raise ValueError("encrypted: needs the handoff's key")
    transfer = transfer or Transfer(request_id, stall_s=flush_timeout)
    device = state.keys[0].device if state.keys else None
    stream = streams.side_stream(device)
    streams.follow(stream, device)
    try:
        with streams.on_stream(stream):
            report = _send(action, shape, token_ids, state,
                           _Posting(transport, request_id, transfer, key, hooks, encrypted),
                           expect_ms)
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


def _send(action: Action, shape: ModelShape, token_ids: Sequence[int], state: PrefillOutput,
          send: _Posting, expect_ms: float) -> SenderReport:
    seq_len = len(token_ids)
    sent = WireBytes()
    send(PLAN, Plan.of(action, shape, seq_len, expect_ms).to_bytes())
    if action.cut == 0:
        ids = torch.tensor(list(token_ids), dtype=torch.int32)
        send(TOKENS, buffers={"ids": tensor_bytes(ids)}, state=TransferState.BOUNDARY)
        sent += WireBytes(tokens=ids.numel() * TOKEN_ID_BYTES)
    elif action.sends_boundary:
        h_c = state.hidden[action.cut].to(torch.bfloat16)
        send(BOUNDARY, buffers={"h": tensor_bytes(h_c)}, state=TransferState.BOUNDARY)
        sent += WireBytes(boundary=h_c.numel() * BF16_BYTES)

    codec = get_codec(action.codec)
    quantize = 0.0
    for index in action.prefix_layers:
        start = time.perf_counter()
        encoded = codec.encode(state.keys[index], state.values[index])
        quantize += time.perf_counter() - start
        send(layer_name(index), encoded.header_bytes(), encoded.buffers,
             state=TransferState.PREFIX)
        sent += split_layer_bytes(encoded.header()["buffers"])

    if action.cut == action.num_layers:
        head = state.hidden[action.num_layers][-1].to(torch.bfloat16)
        send(HEAD, buffers={"h": tensor_bytes(head)})
        sent += WireBytes(head=head.numel() * BF16_BYTES)
    send.flush()
    return SenderReport(quantize_seconds=quantize, bytes=sent)
