"""One request's handoff on the decode worker: negotiate, receive, or recompute locally.

`Handoffs.run(call, ids, time_remaining, queue)` returns a complete cache and the first token's
logits, however the handoff goes:
1. the connector begins it (`DecodeConnector.begin`): a `Transfer` with its deadline, a fresh key,
   the receive opened on the data plane, which starts receiving at once (the cache is allocated
   while the prefill side computes);
2. the `Handoff` call goes to the least loaded prefill replica with the connector's offer and the
   handoff's key; the plan that arrives first on the data plane sets the receive going (and, once
   the link is measured, tightens the deadline to what the prefill side predicts); every wait
   obeys the deadline;
3. the cache is complete once every message has arrived and passed its checks; the reply, which
   the prefill side sends once its last byte has left, must name the plan that arrived, and
   teaches the connector (`learn`). A verified cache whose reply is late (or lost) is kept: the
   reply only carries timings.
A replica that refuses the offer with FAILED_PRECONDITION serves another model (its fingerprint is
not this worker's): the pool leaves it out for a while (`PrefillPool.mark_incompatible`) and the
request recomputes (reason `model_mismatch`, also when no compatible replica is left).
Whenever the handoff fails (no replica, the call refused or broken, a message late, lost, corrupt
or unauthenticated, a reply that disagrees with the plan, a lossy plan under the `lossless`
quality setting, a deadline passed) the receive is aborted, which drains whatever the prefill side
still sends, and the prompt is recovered here from its token ids, counted in
`rekv_fallbacks_total` by reason: where the receive lost only prefix layers (its `Salvage`,
`_salvage_of`), layers 0..m alone are recomputed and the verified ones kept (`partial`), else the
whole prompt (`full`; `rekv_core.handoff.recovery`), counted in `rekv_fallback_recompute_seconds`
and `rekv_fallback_recomputed_layers_total` by scope; or, with `on_handoff_failure = fail`, the
call ends with UNAVAILABLE. A progressive handoff (Lynx's streams, `Action.progressive`) comes back on its anchors with its
residuals still arriving (`Handed.residuals`) and its `Handoff` call still open (`Handed.reply`:
the reply follows the last residual; it is checked and learnt from, and the peer reported, when it
comes);
`services.decode.progressive` verifies on them or falls back (`fallback_after_lost_residuals`).
Only the caller's own bad input (INVALID_ARGUMENT from the prefill
side) and the caller's cancel or deadline end the call instead. Where tracing is on, the handoff
is a span of the request's trace (`services.request_spans`), and the `Handoff` call carries its
`negotiation` span's context to the prefill worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
import torch

from rekv_core.codecs import CorruptPayloadError
from rekv_core.connector import HandoffCall, HandoffReply, PendingHandoff
from rekv_core.handoff import Action, HandoffResult, WireBytes
from rekv_core.handoff.recovery import PARTIAL, PartialHandoff, Salvage
from rekv_core.handoff.residuals import PendingResiduals, ResidualsLost
from rekv_core.handoff.seal import SealError
from rekv_core.handoff.transfer import TransferCancelled, allowed_s
from rekv_core.model import KVCache
from services import wire_convert
from services.calls import GenerateCall, HandoffReport
from services.decode.prefill_pool import NoCompatiblePeer, PrefillPool
from services.decode.worker import DecodeWorker
from services.errors import FINGERPRINT_TRAILER, HandoffFailed, InvalidArgument
from services.request_spans import ReceiveClock, describe_report, record_receive, record_recompute
from services.tracing import NO_SPAN, OFF, Span, Trace

log = logging.getLogger("rekv.decode")

REPLY_GRACE_S = allowed_s(0.0)  # how long a complete cache waits for its late reply


@dataclass(frozen=True)
class Handed:
    """A complete cache, the first token's logits and how they were obtained."""

    cache: KVCache
    logits: torch.Tensor
    report: HandoffReport
    link_sample_gbps: float | None = None
    residuals: PendingResiduals | None = None  # Lynx: still arriving; the cache is the anchors'
    reply: asyncio.Future | None = None  # Lynx: the `Handoff` call, answered after the residuals


class _Failed(Exception):
    """The handoff failed for `label` (the fallback metric's reason); `detail` says how."""

    def __init__(self, label: str, detail: str):
        super().__init__(f"{label}: {detail}")
        self.label = label


def _receive_failure(exc: BaseException) -> _Failed:
    if isinstance(exc, PartialHandoff):  # the failure that cost the prefix layers
        exc = exc.cause
    if isinstance(exc, (SealError, CorruptPayloadError)):
        return _Failed("integrity", str(exc))
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return _Failed("timeout", str(exc) or "deadline passed")
    if isinstance(exc, TransferCancelled):
        return _Failed("cancelled", str(exc))
    return _Failed("transfer", f"{type(exc).__name__}: {exc}")


def _call_failure(exc: grpc.aio.AioRpcError) -> _Failed:
    code = exc.code()
    label = {grpc.StatusCode.UNAVAILABLE: "prefill_unavailable",
             grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
             grpc.StatusCode.RESOURCE_EXHAUSTED: "prefill_busy",
             grpc.StatusCode.FAILED_PRECONDITION: "model_mismatch"}.get(code, "prefill_error")
    return _Failed(label, f"prefill: {code.name}: {exc.details()}")


def _trailer(exc: grpc.aio.AioRpcError, key: str) -> str:
    return next((str(v) for k, v in exc.trailing_metadata() or () if k == key), "")


class Handoffs:
    def __init__(self, worker: DecodeWorker, prefill: PrefillPool):
        self.worker, self.prefill = worker, prefill
        self.connector = worker.connector
        self.metrics = worker.metrics
        self.in_flight = 0

    async def run(self, call: GenerateCall, ids: list[int], time_remaining: float | None,
                  queue: int, trace: Trace = OFF) -> Handed:
        with trace.span("handoff", prompt_tokens=len(ids)) as span:
            handed = await self._run(call, ids, time_remaining, queue, trace, span)
            describe_report(span, handed.report)
            record_recompute(trace, span, handed.report)
        return handed

    async def _run(self, call: GenerateCall, ids: list[int], time_remaining: float | None,
                   queue: int, trace: Trace, span: Span) -> Handed:
        connector = self.connector
        self.in_flight += 1
        in_flight = self.in_flight
        self.metrics.in_flight.set(self.in_flight)
        began = time.perf_counter()
        pending = connector.begin(call.request_id, len(ids), call.max_new_tokens,  # 1
                                  time_remaining, f"{call.request_id}/{uuid.uuid4().hex}")
        clock = ReceiveClock()
        receiving = asyncio.ensure_future(asyncio.to_thread(clock.timed, connector.receive,
                                                            pending))
        negotiation = trace.span("negotiation", span, client=True)
        try:
            (result, sharing), reply, call_on = await self._negotiate(  # 2, 3
                call, ids, pending, in_flight, queue, receiving, negotiation)
            record_receive(trace, span, clock.began, result)
        except _Failed as failed:
            connector.abandon(pending, str(failed))  # wakes the receiving thread
            await asyncio.gather(receiving, return_exceptions=True)
            return await self._fallback(ids, len(ids) + call.max_new_tokens, began, failed,
                                        _salvage_of(receiving))
        finally:
            if not receiving.done():  # cancelled, or the caller's own error
                connector.cancel(pending)
                await asyncio.gather(receiving, return_exceptions=True)
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
            connector.end(pending)
        handed = self._learn(pending, result, reply, sharing)
        if result.residuals is None:
            return handed
        return dataclasses.replace(handed, residuals=result.residuals, reply=call_on)

    async def _negotiate(self, call: GenerateCall, ids: list[int], pending: PendingHandoff,
                         in_flight: int, queue: int, receiving: asyncio.Future,
                         negotiation: Span = NO_SPAN):
        """`negotiation`: the `Handoff` call's span, ended with the call."""
        quality = self.worker.quality(call)
        offer = self.connector.offer(len(ids), in_flight, queue, quality)
        transfer = pending.transfer
        request = wire_convert.handoff_request(HandoffCall(
            call.request_id, transfer.transfer_id, ids, offer, call.forced_action,
            pending.sealing, call.forced_delivery, quality))
        try:
            peer = self.prefill.pick()
        except NoCompatiblePeer as exc:  # every replica serves another model
            negotiation.end(exc)
            raise _Failed("model_mismatch", str(exc)) from None
        except ConnectionError as exc:  # no replica known yet: never lose the request
            negotiation.end(exc)
            raise _Failed("prefill_unavailable", f"prefill: {exc}") from None
        negotiation.set(peer=peer.address, transfer_id=transfer.transfer_id)
        timeout = transfer.remaining_s()
        rpc = asyncio.ensure_future(peer.stub.Handoff(
            request, timeout=None if timeout is None else max(0.0, timeout),
            metadata=negotiation.metadata() or None))
        rpc.add_done_callback(lambda done: negotiation.end(
            None if done.cancelled() else done.exception()))
        lynx = False  # a progressive handoff's call goes on: its reply follows the residuals
        try:
            await asyncio.wait({rpc, receiving}, return_when=asyncio.FIRST_COMPLETED)
            if not rpc.done():  # the data plane ended first
                if receiving.exception() is not None:
                    raise _receive_failure(receiving.exception())
                if receiving.result()[0].residuals is None:
                    await asyncio.wait({rpc}, timeout=REPLY_GRACE_S)
            reply = self._reply(peer, rpc) if rpc.done() else None
            try:
                result = await receiving
            except Exception as exc:  # a broken data plane: never decode from it
                raise _receive_failure(exc) from None
            if not quality.allows(result[0].plan.action):  # never a lossy cache under lossless
                raise _Failed("prefill_error", f"prefill: sent {result[0].plan.action} under "
                                               f"quality {quality.value}")
            if reply is not None:
                try:
                    self.connector.check_reply(result[0].plan, reply)
                except ValueError as exc:
                    raise _Failed("prefill_error", f"prefill: {exc}") from None
            lynx = result[0].residuals is not None
        finally:
            if not rpc.done() and not lynx:
                rpc.cancel()  # the prefill side sees its call cancelled and stops sending
                self.prefill.report(peer)
        if lynx and not rpc.done():
            rpc.add_done_callback(functools.partial(self._late_reply, peer, pending, result))
        return result, reply, rpc

    def _late_reply(self, peer, pending: PendingHandoff, received: tuple[HandoffResult, float],
                    rpc: asyncio.Future) -> None:
        """A progressive handoff's reply, after its residuals: the peer reported, the reply
        checked against the plan and learnt from (its timings are the anchors', as its
        prediction's are); what goes wrong is logged (the tokens were verified already)."""
        if rpc.cancelled():
            self.prefill.report(peer)
            return
        result, sharing = received
        try:
            reply = self._reply(peer, rpc)
            self.connector.check_reply(result.plan, reply)
            self._learn(pending, result, reply, sharing)
        except Exception as exc:  # noqa: BLE001 - logged: the tokens were verified on the data
            log.warning("the prefill reply after Lynx's residuals: %s", exc)

    def _reply(self, peer, rpc: asyncio.Future) -> HandoffReply:
        exc = rpc.exception()
        if isinstance(exc, grpc.aio.AioRpcError):
            self.prefill.report(peer, unreachable=exc.code() == grpc.StatusCode.UNAVAILABLE)
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(exc.details()) from None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self.prefill.mark_incompatible(peer, _trailer(exc, FINGERPRINT_TRAILER),
                                               self.worker.fingerprint.hex)
            raise _call_failure(exc)
        if exc is not None:
            self.prefill.report(peer)
            raise exc
        try:
            reply = wire_convert.handoff_reply(rpc.result(), self.worker.shape.num_layers)
        except InvalidArgument as bad:  # the peer's answer, not the caller's request
            self.prefill.report(peer)
            raise _Failed("prefill_error", f"prefill: unreadable reply: {bad}") from None
        self.prefill.report(peer, reply.queue_depth)
        return reply

    def _learn(self, pending: PendingHandoff, result: HandoffResult, reply: HandoffReply | None,
               sharing: float) -> Handed:
        if reply is None:  # a verified cache whose reply never came: nothing to learn from
            if result.residuals is None:  # Lynx's reply follows its residuals
                log.warning("transfer complete but the prefill reply is late; not calibrating")
            report = HandoffReport(action=result.action, bytes=result.bytes,
                                   measured_ms=result.timings.total_s * 1e3,
                                   delivery=result.plan.delivery)
            return Handed(result.cache, result.logits, report)
        learned = self.connector.learn(pending, result, sharing, reply)
        observed = learned.observation
        self.metrics.record_received(observed, reply.predicted_ms,
                                     self.worker.bf16_bytes(pending.prompt_len))
        t = result.timings
        report = HandoffReport(
            action=result.action, bytes=result.bytes, predicted_ms=reply.predicted_ms,
            measured_ms=observed.handoff_s * 1e3, prefill_ms=reply.prefill_ms, q_ms=reply.q_ms,
            h_ms=observed.boundary_s * 1e3, x_ms=t.x_s * 1e3, r_ms=t.r_s * 1e3,
            j_ms=t.j_s * 1e3, delivery=reply.delivery, send_ms=reply.send_ms,
            prefill_link_gbps=reply.link_gbps)
        return Handed(result.cache, result.logits, report, learned.link_sample_gbps)

    async def fallback_after_lost_residuals(self, ids: list[int], capacity: int, began: float,
                                            lost: ResidualsLost) -> Handed:
        """A progressive handoff whose residuals were lost: the fallback of any failed handoff,
        for the residuals' cause."""
        return await self._fallback(ids, capacity, began, _receive_failure(lost.__cause__ or lost),
                                    None)

    async def _fallback(self, ids: list[int], capacity: int, began: float,
                        failed: _Failed, salvage: Salvage | None) -> Handed:
        self.metrics.fallbacks.labels(failed.label).inc()
        if self.worker.settings.on_handoff_failure == "fail":
            raise HandoffFailed(f"handoff failed ({failed}); on_handoff_failure is fail")
        started = time.perf_counter()
        recovered = await asyncio.to_thread(self.connector.recover, ids, capacity, salvage)
        recompute_s = time.perf_counter() - started
        scope, layers = recovered.recovery.scope, recovered.recovery.layers
        log.warning("handoff failed, recomputed %s locally (%s, %d layers): %s",
                    "its lost layers" if scope == PARTIAL else "the prompt", scope, layers, failed)
        self.metrics.suffix.observe(recompute_s)
        self.metrics.record_fallback(scope, layers, recompute_s)
        kept = salvage if scope == PARTIAL else None
        report = HandoffReport(
            action=kept.plan.action if kept else Action.token_only(self.worker.shape.num_layers),
            bytes=kept.bytes if kept else WireBytes(), fallback_reason=str(failed),
            measured_ms=(time.perf_counter() - began) * 1e3, r_ms=recompute_s * 1e3,
            delivery=kept.plan.delivery if kept else None, fallback_scope=scope,
            recomputed_layers=layers)
        return Handed(recovered.cache, recovered.logits, report)


def _salvage_of(receiving: asyncio.Future) -> Salvage | None:
    """What an ended receive kept of a handoff that lost only prefix layers, if it did."""
    if receiving.cancelled() or not isinstance(receiving.exception(), PartialHandoff):
        return None
    return receiving.exception().salvage
