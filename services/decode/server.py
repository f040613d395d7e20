"""The decode service: `Decode.Generate`, the router's entry point.

A call's life cycle:
1. read the call and check it against this worker's limits, tokenize (INVALID_ARGUMENT naming the
   field);
2. admit it (`admission`: beyond `max_concurrent + max_batch + max_queue` calls, or `max_inflight_bytes` of
   caches and buffers, RESOURCE_EXHAUSTED at once) and wait for a handoff slot (at most
   `max_concurrent` handoffs at once);
3-6. obtain the prompt's cache and first logits (`handoff`): negotiate with the least loaded
   prefill replica, receive the handoff, and learn from it; whenever the handoff fails, recompute
   the prompt here from its token ids (or fail fast, as set): never decode from a broken cache,
   and say so in the summary;
7. send the first token at once, then join the worker's decode engine (`rekv_core.engine`), which
   decodes every joined request's next token in one batched step (at most `max_batch`; more wait
   to join) with the request's own sampler (greedy or seeded), streaming each token; a cancel or
   a deadline takes the request out of the batch (with `decode_path = per_request`, the request
   decodes alone on a thread of its own, within its handoff slot, as before the engine);
8. end the stream with the summary; a sampled lossy handoff's cache then goes to the quality
   canary (`canary`), which checks it in the background while this worker is idle.
Each call is traced (`services.request_spans`) where tracing is on, as a child of the router's
W3C trace context in the call's metadata.
A passed deadline ends the call with DEADLINE_EXCEEDED, a cancel with CANCELLED; the transfer is
then aborted, which drains whatever the prefill side still sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from rekv_core.model.sampling import Sampler
from services import tls, wire_convert
from services.calls import Completion, GenerateCall
from rekv_core.engine import Stream
from services.decode.canary import build_canary
from services.decode.handoff import Handed, Handoffs
from services.decode.progressive import let_go, verified_tokens
from services.decode.connect_ahead import ConnectAhead
from services.decode.prefill_pool import PrefillPool
from services.decode.worker import DecodeWorker
from services.errors import InvalidArgument, status_for
from services.metrics import ServiceMetrics
from services.rpc import rekv_pb2, rekv_pb2_grpc
from services.serving import run
from services.settings import ServiceSettings
from services.tracing import TRACING_OFF, Trace, Tracing

log = logging.getLogger("rekv.decode")


class DecodeServicer(rekv_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, prefill_pool: PrefillPool,
                 tracing: Tracing = TRACING_OFF):
        self.worker = worker
        self.metrics = worker.metrics
        self.tracing = tracing
        self.handoffs = Handoffs(worker, prefill_pool)
        self.slots = asyncio.Semaphore(worker.settings.max_concurrent)
        self.queue = 0
        self.canary = build_canary(worker, lambda: self.queue)

    async def Generate(self, request, context):
        arrived = time.perf_counter()
        metrics, worker = self.metrics, self.worker
        trace = self.tracing.request("Generate", context.invocation_metadata(),
                                     request_id=request.request_id)
        try:
            call = wire_convert.generate_call(request, worker.shape.num_layers)  # 1
            ids = worker.admit(call)
        except InvalidArgument as exc:
            metrics.failures.labels("invalid_argument").inc()
            trace.end(exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.queue += 1  # 2
        metrics.queue.set(self.queue)
        admission = trace.span("admission", queue=self.queue, prompt_tokens=len(ids))
        failed = None
        try:
            with worker.admission.admit(worker.connector.memory(len(ids), call.max_new_tokens)):
                async with contextlib.AsyncExitStack() as held:
                    await held.enter_async_context(self.slots)
                    admission.end()
                    handed = await self.handoffs.run(call, ids, context.time_remaining(),
                                                     self.queue, trace)  # 3-6
                    if worker.engine is not None:  # the batch bounds the decoding streams
                        await held.aclose()
                    with worker.connector.load.generating():
                        async for response in self._generate(call, ids, handed, arrived,
                                                             trace):  # 7, 8
                            yield response
        except BaseException as exc:
            failed = exc
            admission.end(exc)
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
            trace.end(failed)

    def _finish(self, call: GenerateCall, tokens: list[int]) -> str | None:
        if call.stop_at_eos and tokens[-1] == self.worker.eos_token_id:
            return "eos"
        return "length" if len(tokens) >= call.max_new_tokens else None

    async def _engine_tokens(self, call: GenerateCall, handed: Handed, sampler: Sampler,
                             sent: list[int]):
        """(token, finish) after the tokens `sent`, from the worker's batched engine; the stream
        leaves the batch when this generator closes (a cancel, a deadline, a client gone)."""
        engine, loop = self.worker.engine, asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(token, finish, error) -> None:  # the engine's thread
            loop.call_soon_threadsafe(queue.put_nowait, (token, finish, error))

        eos = self.worker.eos_token_id if call.stop_at_eos else None
        stream = Stream(call.request_id, handed.cache, sent[-1], call.max_new_tokens - len(sent),
                        sampler, emit, eos, last_token_at=engine.now())
        engine.join(stream)
        try:
            while True:
                token, finish, error = await queue.get()
                if error is not None:
                    raise error
                yield token, finish
                if finish is not None:
                    return
        finally:
            engine.cancel(stream)

    async def _own_tokens(self, call: GenerateCall, handed: Handed, sampler: Sampler,
                          sent: list[int]):
        """(token, finish) after the tokens `sent`, decoded alone on a thread of this request's
        own (`decode_path = per_request`, the comparison path)."""
        step, tokens = self.worker.decoder(handed.cache), list(sent)
        observe, last = self.metrics.engine.token_gap, time.perf_counter()
        while True:
            tokens.append(sampler(await asyncio.to_thread(step, tokens[-1])))
            now = time.perf_counter()
            observe(now - last)
            last = now
            finish = self._finish(call, tokens)
            yield tokens[-1], finish
            if finish is not None:
                return

    async def _generate(self, call: GenerateCall, ids: list[int], handed: Handed,
                        arrived: float, trace: Trace):
        worker, tokenizer = self.worker, self.worker.tokenizer
        sampler = Sampler(call.sampling)
        token = sampler(handed.logits)  # 7: the first token, at once, whatever the batch does
        tokens = [token]
        ttft = time.perf_counter() - arrived
        self.metrics.ttft.observe(ttft)
        with trace.span("first_token") as span:
            span.set(ttft_ms=ttft * 1e3)
        span = trace.span("decode")
        text_so_far = tokenizer.decode(tokens) if tokenizer else ""
        try:
            yield wire_convert.token_response(token, text_so_far)
        except BaseException:  # the call ended: Lynx's residuals are not waited for
            let_go(handed, "the request ended")
            raise
        finish = self._finish(call, tokens)
        if finish is None and handed.residuals is not None:  # Lynx: what the residuals verify
            verified, handed = await verified_tokens(self.handoffs, call, ids, handed, token)
            for token in verified:
                tokens.append(token)
                text = tokenizer.decode(tokens) if tokenizer else ""
                piece, text_so_far = text[len(text_so_far):], text
                yield wire_convert.token_response(token, piece)
                finish = self._finish(call, tokens)
                if finish is not None:
                    break
        else:  # one token asked for: Lynx's residuals, if any, are not needed
            let_go(handed, "the request needed only its first token")
        if finish is None:
            more = (self._engine_tokens(call, handed, sampler, tokens) if worker.engine
                    else self._own_tokens(call, handed, sampler, tokens))
            async for token, finish in more:
                tokens.append(token)
                text = tokenizer.decode(tokens) if tokenizer else ""
                piece, text_so_far = text[len(text_so_far):], text
                yield wire_convert.token_response(token, piece)
        total = time.perf_counter() - arrived  # 8
        span.set(tokens=len(tokens), finish=finish)
        span.end()
        trace.root.set(prompt_tokens=len(ids), new_tokens=len(tokens), ttft_ms=ttft * 1e3,
                       request_ms=total * 1e3)
        self.metrics.request.observe(total)
        done = Completion(call.request_id, len(ids), len(tokens), finish, ttft * 1e3, total * 1e3,
                          handed.report, worker.quality(call))
        self.metrics.quality.labels(done.quality.value).inc()
        h = handed.report
        if handed.residuals is None:  # else the cache is the anchors' alone
            self.canary.offer(h.action, h.fallback, ids, handed.cache, handed.logits)
        log.info("request=%s tokens=%d action=%s/%d handoff_ms=%.1f delivery=%s "
                 "predicted_ms=%.1f send_ms=%.1f ttft_ms=%.1f new_tokens=%d fallback=%s "
                 "request_ms=%.1f link_sample_gbps=%.3f link_gbps=%.3f prefill_link_gbps=%.3f",
                 call.request_id, len(ids), h.action.codec, h.action.cut, h.measured_ms,
                 h.delivery, h.predicted_ms, h.send_ms, ttft * 1e3, len(tokens), h.fallback,
                 total * 1e3, handed.link_sample_gbps or 0.0, worker.connector.link_gbps,
                 h.prefill_link_gbps)
        yield wire_convert.summary_response(done)


async def build(settings: ServiceSettings, server: grpc.aio.Server, metrics: ServiceMetrics,
                tracing: Tracing = TRACING_OFF):
    worker = await asyncio.to_thread(DecodeWorker, settings, metrics)
    pool = PrefillPool(settings.prefill_address, settings.prefill_refresh_s,
                       connect=lambda address: tls.secure_channel(settings, address),
                       on_added=ConnectAhead(worker.receiver, worker.connector),
                       incompatible_s=settings.prefill_incompatible_s)
    metrics.watch_incompatible(pool.incompatible)
    await pool.start()
    servicer = DecodeServicer(worker, pool, tracing)
    rekv_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

    async def drain() -> None:
        await pool.close()
        await asyncio.to_thread(servicer.canary.close)
        await asyncio.to_thread(worker.close)

    extra = {"model": worker.shape.name, "model_fingerprint": worker.fingerprint.hex,
             "ucx": worker.receiver.address, "torch_threads": worker.threads}
    return [rekv_pb2.DESCRIPTOR.services_by_name["Decode"].full_name], drain, extra


def main(argv: list[str] | None = None) -> int:
    settings = ServiceSettings.from_args("decode", argv)
    return run(settings, lambda server, metrics, tracing: build(settings, server, metrics,
                                                                tracing))
