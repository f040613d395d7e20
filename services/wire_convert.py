"""Conversions between the protobuf messages and the handoff's own values."""

from __future__ import annotations

from rekv_core.codecs import codec_names
from rekv_core.handoff import Action
from rekv_core.handoff.action import WireBytes
from services.rpc import rekv_pb2
from services.serving import InvalidArgument


def action_from_proto(message, num_layers: int, field: str = "forced_action") -> Action:
    if message.codec not in codec_names():
        raise InvalidArgument(f"{field}.codec: unknown codec {message.codec!r}; known: "
                              f"{', '.join(codec_names())}")
    if message.cut > num_layers:
        raise InvalidArgument(f"{field}.cut: must lie in [0, {num_layers}], got {message.cut}")
    return Action(message.codec, message.cut, num_layers)


def action_to_proto(action: Action):
    return rekv_pb2.Action(codec=action.codec, cut=action.cut)


def wire_bytes_to_proto(wire: WireBytes):
    return rekv_pb2.WireBytes(boundary=wire.boundary, prefix=wire.prefix, scales=wire.scales,
                              tokens=wire.tokens, head=wire.head)
