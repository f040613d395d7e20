"""The ReKV handoff: the action (b, c), its byte model, and (next) the sender and receiver
schedules."""

from rekv_core.handoff.action import Action, ActionKind, WireBytes, wire_bytes

__all__ = ["Action", "ActionKind", "WireBytes", "wire_bytes"]
