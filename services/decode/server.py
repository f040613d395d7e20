"""The decode service: `Decode.Generate`, the router's entry point.

A call's life cycle:
1. admit: read the call and check it against this worker's limits, tokenize (INVALID_ARGUMENT
   naming the field);
2. queue: wait for a slot (at most `max_concurrent` calls at once);
3. open a fresh transfer on the data-plane receiver and start receiving: the cache is allocated
   now, while the prefill side computes, not while the first layers land;
4. negotiate: call the `Handoff` of the least loaded prefill replica (`prefill_pool`) with this
   worker's offer (its costs at this prompt length under its current load, its evidence, its
   address and codecs); the prefill side chooses the action, sends, and reports its queue;
5. wait for the complete cache. If the handoff fails (prefill unreachable, a lost, corrupt or late
   payload) recompute the prompt here from its token ids instead: never decode from a broken
   cache, and say so in the summary;
6. learn from the handoff (the calibration the next offers are made from) and record it;
7. decode `max_new_tokens` (greedy or seeded sampling), streaming each token;
8. end the stream with the summary.
A passed deadline ends the call with DEADLINE_EXCEEDED; the transfer is then aborted, which drains
whatever the prefill side still sends.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
import torch

from rekv_core.handoff import Action, WireBytes
from rekv_core.handoff.seal import new_key
from rekv_core.model import KVCache
from rekv_core.model.sampling import Sampler
from rekv_core.plan.calibration import HandoffObservation
from services import tls, wire_convert
from services.calls import Completion, GenerateCall, HandoffCall, HandoffReport
from services.decode.prefill_pool import PrefillPool
from services.decode.worker import DecodeWorker
from services.errors import InvalidArgument, status_for
from services.metrics import ServiceMetrics
from services.rpc import rekv_pb2, rekv_pb2_grpc
from services.serving import run
from services.settings import ServiceSettings

log = logging.getLogger("rekv.decode")


@dataclass(frozen=True)
class _Handed:
    """A complete cache, the first token's logits and how they were obtained."""

    cache: KVCache
    logits: torch.Tensor
    report: HandoffReport
    link_sample_gbps: float | None = None


class DecodeServicer(rekv_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, prefill_pool: PrefillPool):
        self.worker = worker
        self.metrics = worker.metrics
        self.prefill = prefill_pool
        self.slots = asyncio.Semaphore(worker.settings.max_concurrent)
        self.queue = 0
        self.in_flight = 0

    async def Generate(self, request, context):
        arrived = time.perf_counter()
        metrics, worker = self.metrics, self.worker
        try:
            call = wire_convert.generate_call(request, worker.shape.num_layers)  # 1
            ids = worker.admit(call)
        except InvalidArgument as exc:
            metrics.failures.labels("invalid_argument").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.queue += 1  # 2
        metrics.queue.set(self.queue)
        try:
            async with self.slots:
                handed = await self._handoff(call, ids, context)  # 3-6
                async for response in self._generate(call, ids, handed, arrived):  # 7, 8
                    yield response
        except BaseException as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                metrics.failures.labels("cancelled").inc()
                log.info("request=%s cancelled or past its deadline", call.request_id)
                raise
            code, reason = status_for(exc)
            metrics.failures.labels(reason).inc()
            log.warning("request=%s failed (%s): %s", call.request_id, reason, exc)
            await context.abort(code, str(exc))
        finally:
            self.queue -= 1
            metrics.queue.set(self.queue)

    async def _handoff(self, call: GenerateCall, ids: list[int], context) -> _Handed:
        worker = self.worker
        transfer_id = f"{call.request_id}/{uuid.uuid4().hex}"
        capacity = len(ids) + call.max_new_tokens
        self.in_flight += 1
        load = self.in_flight
        self.metrics.in_flight.set(self.in_flight)
        worker.receiver.open(transfer_id)  # 3
        began = time.perf_counter()
        key = new_key()  # this handoff's: only the chosen prefill worker learns it
        receiving = asyncio.ensure_future(asyncio.to_thread(
            worker.receive, transfer_id, len(ids), call.max_new_tokens, key))
        try:
            offer = worker.offer(len(ids), load, self.queue)  # 4
            request = wire_convert.handoff_request(
                HandoffCall(call.request_id, transfer_id, ids, offer, call.forced_action, key))
            try:
                peer = self.prefill.pick()
            except ConnectionError as exc:  # no replica known yet: never lose the request
                worker.receiver.abort(transfer_id)
                return await self._fallback(ids, capacity, receiving, began, f"prefill: {exc}")
            try:
                response = await peer.stub.Handoff(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as exc:
                self.prefill.report(peer, unreachable=exc.code() == grpc.StatusCode.UNAVAILABLE)
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgument(exc.details()) from None
                worker.receiver.abort(transfer_id)  # wakes the receiving thread
                return await self._fallback(ids, capacity, receiving, began,
                                            f"prefill: {exc.code().name}: {exc.details()}")
            except BaseException:  # cancelled, or past the deadline
                self.prefill.report(peer)
                raise
            try:
                reply = wire_convert.handoff_reply(response, worker.shape.num_layers)
            except InvalidArgument as exc:  # the peer's answer, not the caller's request
                self.prefill.report(peer)
                worker.receiver.abort(transfer_id)
                return await self._fallback(ids, capacity, receiving, began,
                                            f"prefill: unreadable reply: {exc}")
            self.prefill.report(peer, reply.queue_depth)
            try:
                result = await receiving  # 5
            except Exception as exc:  # a broken data plane: never decode from it
                return await self._fallback(ids, capacity, receiving, began, f"transfer: {exc}")
        finally:
            if not receiving.done():
                worker.receiver.abort(transfer_id)
                await asyncio.gather(receiving, return_exceptions=True)
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

        observed = HandoffObservation(  # 6
            action=result.action, prompt_len=len(ids), load=load, timings=result.timings,
            wire=result.bytes, link_sample=result.link_sample, prefill_s=reply.prefill_ms / 1e3,
            modelled_ms=reply.model_ms)
        sample_gbps = worker.calibration.observe(observed)
        self.metrics.record_received(observed, reply.predicted_ms, worker.bf16_bytes(len(ids)))
        t = result.timings
        report = HandoffReport(
            action=result.action, bytes=result.bytes, predicted_ms=reply.predicted_ms,
            measured_ms=observed.handoff_s * 1e3, prefill_ms=reply.prefill_ms, q_ms=reply.q_ms,
            h_ms=observed.boundary_s * 1e3, x_ms=t.x_s * 1e3, r_ms=t.r_s * 1e3,
            j_ms=t.j_s * 1e3)
        return _Handed(result.cache, result.logits, report, sample_gbps)

    async def _fallback(self, ids: list[int], capacity: int, receiving: asyncio.Future,
                        began: float, reason: str) -> _Handed:
        await asyncio.gather(receiving, return_exceptions=True)
        log.warning("handoff failed, recomputing the prompt locally: %s", reason)
        self.metrics.fallbacks.labels(reason.split(":", 1)[0]).inc()
        started = time.perf_counter()
        cache, logits = await asyncio.to_thread(self.worker.recompute, ids, capacity)
        recompute_s = time.perf_counter() - started
        self.metrics.suffix.observe(recompute_s)
        report = HandoffReport(action=Action.token_only(self.worker.shape.num_layers),
                               bytes=WireBytes(), fallback_reason=reason,
                               measured_ms=(time.perf_counter() - began) * 1e3,
                               r_ms=recompute_s * 1e3)
        return _Handed(cache, logits, report)

    async def _generate(self, call: GenerateCall, ids: list[int], handed: _Handed,
                        arrived: float):
        worker, tokenizer = self.worker, self.worker.tokenizer
        sampler = Sampler(call.sampling)
        logits = handed.logits
        tokens: list[int] = []
        text_so_far, ttft, finish = "", None, "length"
        step = worker.decoder(handed.cache)
        while True:  # 7
            token = sampler(logits)
            tokens.append(token)
            text = tokenizer.decode(tokens) if tokenizer else ""
            piece, text_so_far = text[len(text_so_far):], text
            if ttft is None:
                ttft = time.perf_counter() - arrived
                self.metrics.ttft.observe(ttft)
            yield wire_convert.token_response(token, piece)
            if call.stop_at_eos and token == worker.eos_token_id:
                finish = "eos"
                break
            if len(tokens) >= call.max_new_tokens:
                break
            logits = await asyncio.to_thread(step, token)
        total = time.perf_counter() - arrived  # 8
        self.metrics.request.observe(total)
        done = Completion(call.request_id, len(ids), len(tokens), finish, ttft * 1e3, total * 1e3,
                          handed.report)
        h = handed.report
        log.info("request=%s tokens=%d action=%s/%d handoff_ms=%.1f predicted_ms=%.1f "
                 "ttft_ms=%.1f new_tokens=%d fallback=%s request_ms=%.1f link_sample_gbps=%.3f "
                 "link_gbps=%.3f", call.request_id, len(ids), h.action.codec, h.action.cut,
                 h.measured_ms, h.predicted_ms, ttft * 1e3, len(tokens), h.fallback, total * 1e3,
                 handed.link_sample_gbps or 0.0, worker.calibration.link_gbps)
        yield wire_convert.summary_response(done)


async def build(settings: ServiceSettings, server: grpc.aio.Server, metrics: ServiceMetrics):
    worker = await asyncio.to_thread(DecodeWorker, settings, metrics)
    pool = PrefillPool(settings.prefill_address, settings.prefill_refresh_s,
                       connect=lambda address: tls.secure_channel(settings, address))
    await pool.start()
    servicer = DecodeServicer(worker, pool)
    rekv_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

    async def drain() -> None:
        await pool.close()
        await asyncio.to_thread(worker.close)

    extra = {"model": worker.shape.name, "ucx": worker.receiver.address,
             "torch_threads": worker.threads}
    return [rekv_pb2.DESCRIPTOR.services_by_name["Decode"].full_name], drain, extra


def main(argv: list[str] | None = None) -> int:
    settings = ServiceSettings.from_args("decode", argv)
    return run(settings, lambda server, metrics: build(settings, server, metrics))
