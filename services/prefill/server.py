"""The prefill service: `Prefill.Handoff` and `Prefill.Connect`, called by decode workers.

`Connect` makes (or keeps) the data-plane connection to a decode worker's listener before its
first handoff needs it, and sends it the link probe (`rekv_core.handoff.probe`) it asks for.

A `Handoff` call's life cycle:
1. read the call and check it against this worker's limits, its model and what its connector can
   serve (INVALID_ARGUMENT naming the field); an offer whose model fingerprint is not this
   worker's ends with FAILED_PRECONDITION naming both, this worker's also in the trailing
   metadata (`FINGERPRINT_TRAILER`);
2. admit it (`admission`: beyond `max_concurrent + max_queue` handoffs, or `max_inflight_bytes` of
   prefill state and buffers, RESOURCE_EXHAUSTED at once, and the decode side recomputes);
3. the connector decides the plan (`PrefillConnector.decide`): the planner's choice from the
   decode side's offer and this side's own costs, or the forced action, which the planner
   evaluates the same way, with the delivery and its order;
4. the connector prefills the prompt (one prefill at a time, the wait for it bounded by the call's
   deadline; streamed, only up to the cut) and sends the plan, the prefix and the boundary to the
   offer's data-plane address under the call's transfer id, and waits until every byte has left,
   all within the call's deadline (`Transfer`); a cancelled call (its decode peer gave up or
   vanished) stops the sending before its next message and frees its buffers;
5. record it and answer with the action, its prediction, every candidate and the timings.
A failure at any step ends the call with the status `errors.status_for` gives it; the sender never
leaves messages queued for a transfer it gave up. Where tracing is on, the call is a span under the
decode worker's `negotiation` (the W3C trace context in its metadata), with `plan` and `send`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from rekv_core.connector import Decision, HandoffCall, HandoffReply, ModelMismatch, SentHandoff
from rekv_core.handoff.transfer import Transfer
from services import wire_convert
from services.errors import FINGERPRINT_TRAILER, status_for
from services.metrics import ServiceMetrics
from services.prefill.worker import PrefillWorker
from services.request_spans import MessageLog, describe_decision
from services.rpc import rekv_pb2, rekv_pb2_grpc
from services.serving import run
from services.settings import ServiceSettings
from services.tracing import TRACING_OFF, Trace, Tracing

log = logging.getLogger("rekv.prefill")


class PrefillServicer(rekv_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, tracing: Tracing = TRACING_OFF):
        self.worker = worker
        self.metrics = worker.metrics
        self.tracing = tracing
        self.active = 0  # handoff calls waiting or running

    async def Handoff(self, request, context):
        worker, metrics = self.worker, self.metrics
        started = time.perf_counter()
        trace = self.tracing.request("Handoff", context.invocation_metadata(),
                                     request_id=request.request_id,
                                     transfer_id=request.transfer_id)
        metrics.in_flight.inc()
        self.active += 1
        transfer = call = failed = None
        try:
            call = wire_convert.handoff_call(request, worker.shape.name,  # 1
                                             worker.shape.num_layers)
            worker.check(call)
            with worker.admission.admit(worker.connector.memory(len(call.token_ids))):  # 2
                remaining = context.time_remaining()
                transfer = Transfer(call.transfer_id, None if remaining is None else
                                    time.monotonic() + remaining,
                                    worker.settings.handoff_timeout_s, worker.transfers)
                with trace.span("plan") as plan:
                    decision = worker.connector.decide(call, self.active - 1)  # 3
                    describe_decision(plan, decision)
                sent = await _send(worker, call, decision, transfer, trace)  # 4
        except BaseException as exc:
            failed = exc
            if transfer is not None:
                transfer.fail(f"{type(exc).__name__}: {exc}")
            code, reason = status_for(exc)
            if isinstance(exc, asyncio.CancelledError):
                reason = "cancelled"
            metrics.failures.labels(reason).inc()
            log.warning("request=%s transfer=%s failed (%s): %s", request.request_id,
                        request.transfer_id, reason, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            await context.abort(code, str(exc), _trailers(exc))
        finally:
            if call is not None:
                worker.connector.ended(call.transfer_id)
            metrics.in_flight.dec()
            self.active -= 1
            trace.end(failed)
        report = sent.report  # 5
        metrics.link.set(decision.inputs.link_gbps)
        metrics.record_sent(decision.action, sent.prefill_s, report.quantize_seconds, sent.send_s,
                            report.bytes, worker.bf16_bytes(len(call.token_ids)))
        _log_handoff(call, decision, sent, time.perf_counter() - started)
        return wire_convert.handoff_response(HandoffReply(
            action=decision.action, predicted_ms=decision.predicted_ms,
            model_ms=decision.model_ms, prefill_ms=sent.prefill_s * 1e3,
            q_ms=report.quantize_seconds * 1e3, send_ms=sent.send_s * 1e3, bytes=report.bytes,
            link_gbps=decision.inputs.link_gbps, candidates=decision.candidates,
            queue_depth=self.active, delivery=decision.plan.delivery))

    async def Connect(self, request, context):
        try:
            call = wire_convert.connect_call(request)
            remaining = context.time_remaining()
            connected = await asyncio.to_thread(self.worker.connect, call, remaining)
        except Exception as exc:
            code, reason = status_for(exc)
            log.warning("connect to %s failed (%s): %s", request.ucx_address[:80], reason, exc)
            await context.abort(code, str(exc))
        log.info("data plane: %s %s in %.1f ms; probe %d bytes in %.1f ms", call.address,
                 "connected" if connected.connected_now else "already connected",
                 connected.connect_s * 1e3, connected.probe_bytes, connected.probe_s * 1e3)
        return wire_convert.connect_response(connected)


def _trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    if isinstance(exc, ModelMismatch):
        return ((FINGERPRINT_TRAILER, exc.served),)
    return ()


def _log_handoff(call: HandoffCall, decision: Decision, sent: SentHandoff, total_s: float
                 ) -> None:
    inputs, report = decision.inputs, sent.report
    offered = call.offer.costs.link_gbps
    log.info("request=%s transfer=%s tokens=%d action=%s delivery=%s predicted_ms=%.1f "
             "prefill_ms=%.1f q_ms=%.1f send_ms=%.1f bytes=%d link_gbps=%.3f%s "
             "offered_link_gbps=%s top=%s total_ms=%.1f queues=%d/%d waits_ms=%.0f/%.0f "
             "suffix_ms_per_layer=%.1f", call.request_id, call.transfer_id, len(call.token_ids),
             decision.action, decision.plan.delivery, decision.predicted_ms,
             sent.prefill_s * 1e3, report.quantize_seconds * 1e3, sent.send_s * 1e3,
             report.bytes.total, inputs.link_gbps, "" if inputs.link_measured else " (prior)",
             "none" if offered is None else f"{offered:.3f}",
             ",".join(f"{p.action.codec}/{p.action.cut}:{ms:.0f}/{p.total_ms:.0f}"
                      for p, ms in decision.candidates[:4]),
             total_s * 1e3, inputs.prefill_queue, inputs.decode_queue, inputs.prefill_wait_ms,
             inputs.decode_wait_ms, inputs.suffix_ms_per_layer)


async def _send(worker: PrefillWorker, call: HandoffCall, decision: Decision,
                transfer: Transfer, trace: Trace) -> SentHandoff:
    """Step 4 on a worker thread, as the `send` span with its messages where tracing is on."""
    if not trace.recording:
        return await _until_done(asyncio.to_thread(worker.handoff, call, decision, transfer),
                                 transfer)
    posted = MessageLog()
    with trace.span("send") as span:
        sent = await _until_done(asyncio.to_thread(worker.handoff, call, decision, transfer,
                                                   posted), transfer)
        span.set(prefill_ms=sent.prefill_s * 1e3, send_ms=sent.send_s * 1e3,
                 q_ms=sent.report.quantize_seconds * 1e3,
                 **{f"bytes_{k}": v for k, v in sent.report.bytes.as_dict().items()})
        posted.record(trace, span)
    return sent


async def _until_done(work, transfer: Transfer):
    """Await the worker thread's `work`; when this call is cancelled (its decode peer gave up or
    vanished), cancel the transfer, which stops the thread before its next message, and wait for
    the thread to let go of its buffers before the cancel goes on."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        transfer.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise


async def build(settings: ServiceSettings, server: grpc.aio.Server, metrics: ServiceMetrics,
                tracing: Tracing = TRACING_OFF):
    worker = await asyncio.to_thread(PrefillWorker, settings, metrics)
    rekv_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker, tracing), server)

    async def drain() -> None:
        await asyncio.to_thread(worker.close)

    extra = {"model": worker.shape.name, "model_fingerprint": worker.fingerprint.hex,
             "torch_threads": worker.threads}
    return [rekv_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name], drain, extra


def main(argv: list[str] | None = None) -> int:
    settings = ServiceSettings.from_args("prefill", argv)
    return run(settings, lambda server, metrics, tracing: build(settings, server, metrics,
                                                                tracing))
