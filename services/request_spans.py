"""What the services put into a request's trace (`services.tracing`), beside the code it times.

Decode worker, under its `Decode/Generate` server span: `admission`, `handoff` (the action, bytes
by kind, predicted and measured times, the fallback reason) with `negotiation` (the `Handoff`
call, under which the prefill worker's spans hang) and, after the fact from the receive's timings
(`ReceiveClock`, `record_receive`), `boundary`, `prefix_layers`, `suffix`, `join`, or `recompute`
when the handoff failed; then `first_token` and `decode`. Prefill worker, under its
`Prefill/Handoff` server span: `plan` (the planner's decision, `describe_decision`) and `send`,
whose messages `MessageLog` notes as they are posted: `control` (the in-band plan, token ids, a
split's head), `prefix_layers` and `boundary` spans with one event per message. Every helper
returns at once when the span or trace keeps nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from rekv_core.connector import Decision
from rekv_core.handoff import HandoffResult, WireBytes
from rekv_core.handoff.sender import SendHooks
from rekv_core.handoff.wire import BOUNDARY, HEAD, PLAN, TOKENS
from rekv_core.transport import Message
from services.calls import HandoffReport
from services.tracing import Span, Trace

T = TypeVar("T")


def _bytes(wire: WireBytes) -> dict[str, int]:
    return {f"bytes_{kind}": count for kind, count in wire.as_dict().items()}


def describe_report(span: Span, report: HandoffReport) -> None:
    """The action, bytes by kind, predicted and measured times and any fallback's reason."""
    if not span.recording:
        return
    action = report.action
    delivery = report.delivery
    span.set(codec=action.codec, cut=action.cut, boundary=action.boundary,
             predicted_ms=report.predicted_ms, measured_ms=report.measured_ms,
             prefill_ms=report.prefill_ms, send_ms=report.send_ms, q_ms=report.q_ms,
             fallback=report.fallback, fallback_reason=report.fallback_reason or None,
             fallback_scope=report.fallback_scope or None,
             recomputed_layers=report.recomputed_layers if report.fallback else None,
             delivery=None if delivery is None else delivery.order.value,
             streamed=None if delivery is None else delivery.streamed, **_bytes(report.bytes))


def describe_decision(span: Span, decision: Decision) -> None:
    """The plan: the action, why it was taken (the planner's rule), its predicted time, the link
    and queues it was planned on."""
    if not span.recording:
        return
    action, inputs = decision.action, decision.inputs
    span.set(codec=action.codec, cut=action.cut, boundary=action.boundary, rule=decision.rule.value,
             predicted_ms=decision.predicted_ms, model_ms=decision.model_ms,
             delivery=decision.plan.delivery.order.value, link_gbps=inputs.link_gbps,
             link_measured=inputs.link_measured, prefill_queue=inputs.prefill_queue,
             decode_queue=inputs.decode_queue,
             candidates=[f"{p.action.codec}/{p.action.cut}:{ms:.1f}"
                         for p, ms in decision.candidates[:4]])


class ReceiveClock:
    """When the receive began on its thread, the origin of its timings."""

    began = 0.0

    def timed(self, receive: Callable[..., T], *args) -> T:
        self.began = time.perf_counter()
        return receive(*args)


def record_receive(trace: Trace, parent: Span, began: float, result: HandoffResult) -> None:
    """The receive's parts as spans under `parent`, from `result.timings` (`HandoffTimings`)."""
    if not trace.recording:
        return
    t, action, wire = result.timings, result.action, result.bytes
    boundary_in = began + t.h_s
    trace.record("boundary", began, boundary_in, parent, bytes=wire.boundary + wire.tokens,
                 coding=action.boundary)
    if action.cut:
        trace.record("prefix_layers", boundary_in, boundary_in + t.x_s, parent,
                     layers=action.cut, codec=action.codec, bytes=wire.prefix + wire.scales)
    if t.suffix_end_s > 0:
        trace.record("suffix", boundary_in, began + t.suffix_end_s, parent,
                     layers=action.num_layers - action.cut, compute_ms=t.r_s * 1e3)
    trace.record("join", began + t.total_s - t.j_s, began + t.total_s, parent)


def record_recompute(trace: Trace, parent: Span, report: HandoffReport) -> None:
    """A failed handoff's local recompute, which just ended."""
    if trace.recording and report.fallback:
        end = time.perf_counter()
        trace.record("recompute", end - report.r_ms / 1e3, end, parent,
                     reason=report.fallback_reason)


class MessageLog:
    """`SendHooks` that note when each message of a handoff is posted, around `inner`'s."""

    def __init__(self, inner: SendHooks | None = None):
        self.inner = inner
        self.posted: list[tuple[str, float]] = []

    def wrapping(self, inner: SendHooks | None) -> MessageLog:
        self.inner = inner
        return self

    def before_send(self, message: Message) -> Message:
        return message if self.inner is None else self.inner.before_send(message)

    def after_send(self, name: str) -> None:
        self.posted.append((name, time.perf_counter()))
        if self.inner is not None:
            self.inner.after_send(name)

    def record(self, trace: Trace, parent: Span) -> None:
        """`control` (the plan, token ids, a split's head), `prefix_layers` and `boundary` under
        `parent`, each message an event."""
        for span_name, kinds in (("control", (PLAN, TOKENS, HEAD)), ("prefix_layers", ("layer",)),
                                 ("boundary", (BOUNDARY,))):
            events = [(name, at) for name, at in self.posted if name.split(".")[0] in kinds]
            if events:
                trace.record(span_name, events[0][1], events[-1][1], parent, events=events,
                             messages=len(events))
