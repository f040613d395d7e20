"""The ReKV handoff: the action (b, c) and its byte model, the wire messages, the sender and the
receiver schedules (overlapped and sequential)."""

from rekv_core.handoff.action import Action, ActionKind, Schedule, WireBytes, wire_bytes
from rekv_core.handoff.receiver import HandoffResult, HandoffTimings, receive_handoff
from rekv_core.handoff.sender import SenderReport, send_handoff

__all__ = ["Action", "ActionKind", "HandoffResult", "HandoffTimings", "Schedule", "SenderReport",
           "WireBytes", "receive_handoff", "send_handoff", "wire_bytes"]
