"""The ReKV handoff: the action (b, c) and its byte model, the typed plan (`HandoffPlan`), the
wire messages, the sender and the receiver (overlapped and sequential)."""

from rekv_core.handoff.action import Action, ActionKind, WireBytes, before_residuals, wire_bytes
from rekv_core.handoff.plan import Delivery, HandoffPlan, Order
from rekv_core.handoff.receiver import (ComputeObserver, HandoffResult, HandoffTimings,
                                        ReceiveMode, Receiving, receive_handoff)
from rekv_core.handoff.seal import Sealing
from rekv_core.handoff.sender import SenderReport, send_handoff

__all__ = ["Action", "ActionKind", "ComputeObserver", "Delivery", "HandoffPlan",
           "HandoffResult", "HandoffTimings", "Order", "ReceiveMode", "Receiving", "Sealing",
           "SenderReport", "WireBytes", "receive_handoff", "send_handoff", "wire_bytes"]
