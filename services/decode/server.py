"""The decode service: `Decode.Generate`, the router's entry point.

A call's life cycle:
1. read the call and check it against this worker's limits, tokenize (INVALID_ARGUMENT naming the
   field);
2. admit it (`admission`: beyond `max_concurrent + max_queue` calls, or `max_inflight_bytes` of
   caches and buffers, RESOURCE_EXHAUSTED at once) and wait for a slot (at most `max_concurrent`
   calls at once);
3-6. obtain the prompt's cache and first logits (`handoff`): negotiate with the least loaded
   prefill replica, receive the handoff, and learn from it; whenever the handoff fails, recompute
   the prompt here from its token ids (or fail fast, as set): never decode from a broken cache,
   and say so in the summary;
7. decode `max_new_tokens` (greedy or seeded sampling), streaming each token;
8. end the stream with the summary.
A passed deadline ends the call with DEADLINE_EXCEEDED, a cancel with CANCELLED; the transfer is
then aborted, which drains whatever the prefill side still sends.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from rekv_core.model.sampling import Sampler
from services import tls, wire_convert
from services.calls import Completion, GenerateCall
from services.decode.handoff import Handed, Handoffs
from services.decode.connect_ahead import ConnectAhead
from services.decode.prefill_pool import PrefillPool
from services.decode.worker import DecodeWorker
from services.errors import InvalidArgument, status_for
from services.metrics import ServiceMetrics
from services.rpc import rekv_pb2, rekv_pb2_grpc
from services.serving import run
from services.settings import ServiceSettings

log = logging.getLogger("rekv.decode")


class DecodeServicer(rekv_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, prefill_pool: PrefillPool):
        self.worker = worker
        self.metrics = worker.metrics
        self.handoffs = Handoffs(worker, prefill_pool)
        self.slots = asyncio.Semaphore(worker.settings.max_concurrent)
        self.queue = 0

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
            with worker.admission.admit(worker.connector.memory(len(ids), call.max_new_tokens)):
                async with self.slots:
                    handed = await self.handoffs.run(call, ids, context.time_remaining(),
                                                     self.queue)  # 3-6
                    with worker.connector.load.generating():
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

    async def _generate(self, call: GenerateCall, ids: list[int], handed: Handed,
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
                          handed.report, worker.quality(call))
        self.metrics.quality.labels(done.quality.value).inc()
        h = handed.report
        log.info("request=%s tokens=%d action=%s/%d handoff_ms=%.1f delivery=%s "
                 "predicted_ms=%.1f send_ms=%.1f ttft_ms=%.1f new_tokens=%d fallback=%s "
                 "request_ms=%.1f link_sample_gbps=%.3f link_gbps=%.3f prefill_link_gbps=%.3f",
                 call.request_id, len(ids), h.action.codec, h.action.cut, h.measured_ms,
                 h.delivery, h.predicted_ms, h.send_ms, ttft * 1e3, len(tokens), h.fallback,
                 total * 1e3, handed.link_sample_gbps or 0.0, worker.connector.link_gbps,
                 h.prefill_link_gbps)
        yield wire_convert.summary_response(done)


async def build(settings: ServiceSettings, server: grpc.aio.Server, metrics: ServiceMetrics):
    worker = await asyncio.to_thread(DecodeWorker, settings, metrics)
    pool = PrefillPool(settings.prefill_address, settings.prefill_refresh_s,
                       connect=lambda address: tls.secure_channel(settings, address),
                       on_added=ConnectAhead(worker.receiver, worker.connector))
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
