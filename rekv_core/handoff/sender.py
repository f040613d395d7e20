"""The prefill side of a handoff: send h_c first, then the prefix layer by layer.

`send_handoff(transport, request_id, action, token_ids, state)` takes the prefill's output (every
layer's K, V and the hidden states it kept) and sends, in order: the plan, the boundary h_c (or the
token ids for c = 0), then each prefix layer as soon as it is encoded, so layer 0 is on the wire
while layer 1 is being quantized; for transfer-only, the last position's final hidden state last.
It returns the seconds spent encoding (Q) and the bytes sent by kind. The receiver must have opened
the request first. Every message is sealed with the handoff's key and carries checksums of its
buffers (`seal`). `state.keys`/`state.values` are only indexed in layer order, so a producer that
yields layers while the prefill still runs can stand in for a finished `PrefillOutput`.

On CUDA the encoding runs on a stream of its own that first waits for the caller's stream (where
the prefill ran), and every message carries the `ready` event of its buffers (`rekv_core.streams`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rekv_core import streams
from rekv_core.codecs import get_codec
from rekv_core.handoff.action import Action, WireBytes, split_layer_bytes
from rekv_core.handoff.seal import check_key, seal, with_checksums
from rekv_core.handoff.wire import BOUNDARY, HEAD, PLAN, TOKENS, Plan, layer_name, tensor_bytes
from rekv_core.model.executor import PrefillOutput
from rekv_core.model.shapes import ModelShape
from rekv_core.transport import Message, TransportSender
from rekv_core.units import BF16_BYTES, TOKEN_ID_BYTES


@dataclass
class SenderReport:
    quantize_seconds: float  # Q: encoding the prefix
    bytes: WireBytes


def send_handoff(transport: TransportSender, request_id: str, action: Action, shape: ModelShape,
                 token_ids: Sequence[int], state: PrefillOutput, flush_timeout: float = 60.0,
                 key: bytes | None = None) -> SenderReport:
    """`key`: the handoff's key from the decode side; every message is sealed with it (`seal`)."""
    check_key(key)
    device = state.keys[0].device if state.keys else None
    stream = streams.side_stream(device)
    streams.follow(stream, device)
    try:
        with streams.on_stream(stream):
            return _send(transport, request_id, action, shape, token_ids, state, flush_timeout,
                         key)
    finally:
        streams.settle(stream)  # the caller may free `state` once this returns, even on failure


def _send(transport: TransportSender, request_id: str, action: Action, shape: ModelShape,
          token_ids: Sequence[int], state: PrefillOutput, flush_timeout: float,
          key: bytes | None) -> SenderReport:
    seq_len = len(token_ids)
    seq = 0
    sent = WireBytes()

    def send(name: str, header: bytes | None = None, buffers: dict | None = None) -> None:
        """`header` None: one holding the buffers' checksums (encoded layers bring their own)."""
        nonlocal seq
        buffers = buffers or {}
        header = with_checksums(buffers) if header is None else header
        transport.send(seal(key, Message(request_id, seq, name, header, buffers,
                                         ready=streams.record_ready(buffers.values()))))
        seq += 1

    send(PLAN, Plan.of(action, shape, seq_len).to_bytes())
    if action.cut == 0:
        ids = torch.tensor(list(token_ids), dtype=torch.int32)
        send(TOKENS, buffers={"ids": tensor_bytes(ids)})
        sent += WireBytes(tokens=ids.numel() * TOKEN_ID_BYTES)
    elif action.sends_boundary:
        h_c = state.hidden[action.cut].to(torch.bfloat16)
        send(BOUNDARY, buffers={"h": tensor_bytes(h_c)})
        sent += WireBytes(boundary=h_c.numel() * BF16_BYTES)

    codec = get_codec(action.codec)
    quantize = 0.0
    for index in action.prefix_layers:
        start = time.perf_counter()
        encoded = codec.encode(state.keys[index], state.values[index])
        quantize += time.perf_counter() - start
        send(layer_name(index), encoded.header_bytes(), encoded.buffers)
        sent += split_layer_bytes(encoded.header()["buffers"])

    if action.cut == action.num_layers:
        head = state.hidden[action.num_layers][-1].to(torch.bfloat16)
        send(HEAD, buffers={"h": tensor_bytes(head)})
        sent += WireBytes(head=head.numel() * BF16_BYTES)
    transport.flush(request_id, flush_timeout)
    return SenderReport(quantize_seconds=quantize, bytes=sent)
