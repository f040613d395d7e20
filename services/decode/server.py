"""The decode service: `Decode.Generate`, the router's entry point.

Per call: validate (INVALID_ARGUMENT naming the field) and tokenize; wait for a slot (at most
`max_concurrent` at once); open a fresh transfer on the UCX receiver and start receiving (the cache
is allocated then, while the prefill side computes, not while the first layers land); call the
prefill service's `Handoff` with this worker's offer (its suffix cost per layer at this prompt
length under its current load, its restore costs, its UCX address, the codecs it accepts); once the
cache is complete, decode `max_new_tokens` from it (greedy or seeded sampling) and stream the
tokens, with a summary last. If the data plane fails (a lost, corrupt or late payload), the worker
falls back to recomputing the prompt from its token ids, never decoding from a broken cache, and
says so in the summary. A passed deadline ends the call with DEADLINE_EXCEEDED; the transfer is
closed, which drains whatever the prefill side still sends.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from rekv_core.handoff import receive_handoff
from rekv_core.model import KVCache, decode_step, prefill
from rekv_core.model.sampling import Sampler, SamplingParams
from rekv_core.model.tokenizer import GGUFTokenizer
from rekv_core.model.weights import embedded_gguf_path
from rekv_core.plan.estimates import Ewma, LinkEstimate
from rekv_core.plan.measure import measure_codec_costs, measure_layer_cost
from rekv_core.plan.planner import RecentHandoffs
from rekv_core.plan.profile import Profile
from rekv_core.transport.ucx import UcxReceiver
from services.metrics import ServiceMetrics
from services.rpc import rekv_pb2, rekv_pb2_grpc
from services.serving import InvalidArgument, Worker, run, status_for
from services.settings import ServiceSettings
from services.wire_convert import action_from_proto, action_to_proto, wire_bytes_to_proto

log = logging.getLogger("rekv.decode")
MAX_REQUEST_ID = 128
LINK_SAMPLE_BYTES = 256 << 10  # a handoff's back-to-back runs must carry this much to time the link


class DecodeWorker(Worker):
    """Model, tokenizer, UCX receiver and the costs this worker offers. Thread-safe."""

    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics):
        super().__init__(settings, metrics)
        self.tokenizer = load_tokenizer(settings.model)
        self.receiver = UcxReceiver(self.engine, settings.host, settings.ucx_port,
                                    device=self.model.device)
        if settings.profile:
            profile = Profile.load(settings.profile)
            self.layer_cost, self.restore_ms_per_mib = profile.layer_cost, {
                c: ms for c, ms in profile.restore_ms_per_mib.items() if c in settings.codecs}
        else:
            self.layer_cost = measure_layer_cost(self.model, lengths=(64, 256, 1024))
            self.restore_ms_per_mib = {
                codec: measure_codec_costs(codec, self.shape, 512, self.model.device)[1]
                for codec in settings.codecs}
        self.recent = RecentHandoffs()
        self.message_ms = Ewma(0.0)
        # the link as the handoffs' back-to-back messages crossed it (`HandoffResult.link_sample`)
        self.link = LinkEstimate(prior_gbps=10.0, min_bytes=LINK_SAMPLE_BYTES)
        metrics.link.set_function(lambda: self.link.gbps)
        self.join_ms = Ewma(0.0)
        metrics.transport_pending.set_function(
            lambda: sum(v for k, v in self.receiver.pending().items()))
        # measured suffix time over the startup profile's prediction, from recent handoffs
        self.gamma_scale = Ewma(1.0)

    def tokenize(self, request) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            if self.tokenizer is None:
                raise InvalidArgument("text: this model has no tokenizer; send token_ids")
            ids = self.tokenizer.encode(request.text)
        elif which == "token_ids":
            ids = list(request.token_ids.ids)
        else:
            raise InvalidArgument("prompt: set token_ids or text")
        if not ids:
            raise InvalidArgument(f"{which}: the prompt is empty")
        if len(ids) > self.settings.max_prompt_tokens:
            raise InvalidArgument(f"{which}: {len(ids)} prompt tokens exceed the limit of "
                                  f"{self.settings.max_prompt_tokens}")
        vocab = self.shape.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids: id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) + request.max_new_tokens > self.shape.max_positions:
            raise InvalidArgument(f"max_new_tokens: prompt plus new tokens exceed the model's "
                                  f"context of {self.shape.max_positions}")
        return ids

    def validate(self, request) -> tuple[list[int], SamplingParams]:
        if not request.request_id:
            raise InvalidArgument("request_id: required")
        if len(request.request_id) > MAX_REQUEST_ID:
            raise InvalidArgument(f"request_id: longer than {MAX_REQUEST_ID} characters")
        if not 1 <= request.max_new_tokens <= self.settings.max_new_tokens:
            raise InvalidArgument(f"max_new_tokens: must lie in [1, "
                                  f"{self.settings.max_new_tokens}], got {request.max_new_tokens}")
        if request.HasField("forced_action"):
            action_from_proto(request.forced_action, self.shape.num_layers)
        params = SamplingParams()
        if request.HasField("sampling"):
            s = request.sampling
            try:
                params = SamplingParams(temperature=s.temperature, top_p=s.top_p or 1.0,
                                        top_k=s.top_k, seed=s.seed)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        return self.tokenize(request), params

    def offer(self, prompt_len: int, in_flight: int, queue: int):
        gamma = self.layer_cost.at(prompt_len) * self.gamma_scale.value * max(1, in_flight)
        return rekv_pb2.DecodeOffer(
            ucx_address=self.receiver.address, codecs=list(self.settings.codecs),
            suffix_ms_per_layer=gamma, restore_ms_per_mib=self.restore_ms_per_mib,
            join_ms=self.join_ms.value, queue_depth=queue, handoffs_in_flight=in_flight,
            model=self.shape.name, num_layers=self.shape.num_layers,
            measured_over_model=self.recent.corrections(self.link.gbps),
            link_gbps=self.link.gbps if self.link.samples else 0.0,
            message_ms=self.message_ms.value,
            measured={key: rekv_pb2.MeasuredHandoffs(median_ms=m.median_ms,
                                                     median_prompt_len=m.prompt_len,
                                                     count=m.count)
                      for key, m in self.recent.measured(prompt_len, self.link.gbps).items()})

    def observe_suffix(self, prompt_len: int, layers: int, seconds: float, in_flight: int) -> None:
        expected = self.layer_cost.at(prompt_len) * layers * max(1, in_flight)
        if layers and expected > 0:
            self.gamma_scale.update(seconds * 1e3 / expected)

    def observe_prefix(self, action, prompt_len: int, wire, x_seconds: float,
                       r_seconds: float) -> None:
        """Learn the fixed per-message cost from X: what the bytes and the restore do not explain.

        Only from handoffs whose prefix was not held back by the suffix: transfer-only, or a prefix
        that was still arriving well after the suffix was done (X > 1.2 R). While the suffix runs,
        the UCX loop yields the core (`ucx_loop_nice`), so a prefix that ends with the suffix says
        how long the suffix took, not what a message costs."""
        if action.cut == 0 or self.link.samples == 0:
            return
        if r_seconds > 0 and x_seconds <= 1.2 * r_seconds:
            return
        layers = action.cut
        wire_ms = (wire.prefix + wire.scales) * 8 / (self.link.gbps * 1e9) * 1e3
        restore_ms = (self.restore_ms_per_mib.get(action.codec, 0.0) * layers
                      * self.shape.kv_layer_bytes(prompt_len) / 2**20)
        self.message_ms.update(max(0.0, (x_seconds * 1e3 - wire_ms - restore_ms) / layers))

    def local_prefill(self, ids: list[int], capacity: int):
        out = prefill(self.model, ids, boundaries=())
        return KVCache.from_layers(out.keys, out.values, capacity), out.logits

    def close(self) -> None:
        self.receiver.shutdown()
        self.engine.close()


def load_tokenizer(model_source: str) -> GGUFTokenizer | None:
    if model_source == "smollm2-135m":
        return GGUFTokenizer.from_gguf(embedded_gguf_path())
    if model_source.endswith(".gguf"):
        return GGUFTokenizer.from_gguf(model_source)
    return None  # synthetic weights and checkpoint directories: token ids only


class DecodeServicer(rekv_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, prefill_stub):
        self.worker = worker
        self.metrics = worker.metrics
        self.prefill = prefill_stub
        self.slots = asyncio.Semaphore(worker.settings.max_concurrent)
        self.queue = 0
        self.in_flight = 0

    async def Generate(self, request, context):
        arrived = time.perf_counter()
        metrics, worker = self.metrics, self.worker
        try:
            ids, params = worker.validate(request)
        except InvalidArgument as exc:
            metrics.failures.labels("invalid_argument").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.queue += 1
        metrics.queue.set(self.queue)
        try:
            async with self.slots:
                async for response in self._generate(request, ids, params, arrived, context):
                    yield response
        except BaseException as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                metrics.failures.labels("cancelled").inc()
                log.info("request=%s cancelled or past its deadline", request.request_id)
                raise
            code, reason = status_for(exc)
            metrics.failures.labels(reason).inc()
            log.warning("request=%s failed (%s): %s", request.request_id, reason, exc)
            await context.abort(code, str(exc))
        finally:
            self.queue -= 1
            metrics.queue.set(self.queue)

    async def _generate(self, request, ids, params, arrived, context):
        worker, metrics = self.worker, self.metrics
        handoff = await self._handoff(request, ids, context)
        cache, logits = handoff.pop("cache"), handoff.pop("logits")
        link_sample_gbps = handoff.pop("link_sample_gbps", 0.0)
        sampler = Sampler(params)
        stop_at_eos = request.stop_at_eos if request.HasField("stop_at_eos") else True
        eos = worker.tokenizer.eos_token_id if worker.tokenizer else None
        tokens: list[int] = []
        text_so_far = ""
        ttft = None
        finish = "length"
        while True:
            token = sampler(logits)
            tokens.append(token)
            text = worker.tokenizer.decode(tokens) if worker.tokenizer else ""
            piece, text_so_far = text[len(text_so_far):], text
            if ttft is None:
                ttft = time.perf_counter() - arrived
                metrics.ttft.observe(ttft)
            yield rekv_pb2.GenerateResponse(token_ids=[token], text=piece)
            if stop_at_eos and token == eos:
                finish = "eos"
                break
            if len(tokens) >= request.max_new_tokens:
                break
            logits = await asyncio.to_thread(decode_step, worker.model, token, cache)
        total = time.perf_counter() - arrived
        metrics.request.observe(total)
        summary = rekv_pb2.Summary(
            request_id=request.request_id, prompt_tokens=len(ids), generated_tokens=len(tokens),
            finish_reason=finish, ttft_ms=ttft * 1e3, request_ms=total * 1e3, **handoff)
        log.info("request=%s tokens=%d action=%s/%d handoff_ms=%.1f predicted_ms=%.1f "
                 "ttft_ms=%.1f new_tokens=%d fallback=%s request_ms=%.1f link_sample_gbps=%.3f "
                 "link_gbps=%.3f", request.request_id, len(ids), summary.action.codec,
                 summary.action.cut, summary.measured_handoff_ms, summary.predicted_handoff_ms,
                 ttft * 1e3, len(tokens), summary.fallback, total * 1e3, link_sample_gbps,
                 worker.link.gbps)
        yield rekv_pb2.GenerateResponse(summary=summary)

    async def _handoff(self, request, ids, context) -> dict:
        """Run one handoff; returns the cache, the first logits and the summary's handoff fields."""
        worker, metrics = self.worker, self.metrics
        transfer_id = f"{request.request_id}/{uuid.uuid4().hex}"
        capacity = len(ids) + request.max_new_tokens
        self.in_flight += 1
        load = self.in_flight
        metrics.in_flight.set(self.in_flight)
        worker.receiver.open(transfer_id)
        call_start = time.perf_counter()
        receiving = asyncio.ensure_future(asyncio.to_thread(
            receive_handoff, worker.model, worker.receiver, transfer_id, "overlap",
            worker.settings.handoff_timeout_s, request.max_new_tokens, len(ids)))
        response = None
        try:
            handoff_request = rekv_pb2.HandoffRequest(
                request_id=request.request_id, transfer_id=transfer_id, token_ids=ids,
                offer=worker.offer(len(ids), load, self.queue))
            if request.HasField("forced_action"):
                handoff_request.forced_action.CopyFrom(request.forced_action)
            try:
                response = await self.prefill.Handoff(handoff_request,
                                                      timeout=context.time_remaining())
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgument(exc.details()) from None
                worker.receiver.abort(transfer_id)  # wakes the receiving thread
                return await self._fallback(ids, capacity, receiving, call_start,
                                            f"prefill: {exc.code().name}: {exc.details()}")
            try:
                result = await receiving
            except Exception as exc:  # a broken data plane: never decode from it
                return await self._fallback(ids, capacity, receiving, call_start,
                                            f"transfer: {exc}")
        finally:
            if not receiving.done():
                worker.receiver.abort(transfer_id)
                await asyncio.gather(receiving, return_exceptions=True)
            self.in_flight -= 1
            metrics.in_flight.set(self.in_flight)

        t = result.timings
        prefill_s = response.prefill_ms / 1e3
        handoff_s = max(0.0, t["total"] - prefill_s)
        worker.join_ms.update(t["J"] * 1e3)
        action = result.action
        link_sample_gbps = 0.0
        if result.link_sample is not None:
            nbytes, seconds = result.link_sample
            link_sample_gbps = nbytes * 8 / seconds / 1e9
            worker.link.observe(nbytes, seconds)
        worker.observe_suffix(len(ids), worker.shape.num_layers - action.cut, t["R"], load)
        worker.observe_prefix(action, len(ids), result.bytes, t["X"], t["R"])
        metrics.handoff.observe(handoff_s)
        metrics.boundary.observe(max(0.0, t["H"] - prefill_s))
        metrics.prefix.observe(t["X"])
        metrics.suffix.observe(t["R"])
        metrics.join.observe(t["J"])
        metrics.count_bytes(result.bytes)
        metrics.requests.labels(action.kind.value, action.codec, str(action.cut)).inc()
        if response.predicted_ms > 0:
            metrics.prediction_error.observe(handoff_s * 1e3 / response.predicted_ms)
        worker.recent.observe(action, len(ids), response.model_ms, handoff_s * 1e3,
                              worker.link.gbps)
        return {
            "cache": result.cache, "logits": result.logits, "link_sample_gbps": link_sample_gbps,
            "action": action_to_proto(action), "action_kind": action.kind.value,
            "bytes": wire_bytes_to_proto(result.bytes),
            "predicted_handoff_ms": response.predicted_ms,
            "measured_handoff_ms": handoff_s * 1e3,
            "timings": rekv_pb2.HandoffTimings(
                prefill_ms=response.prefill_ms, q_ms=response.q_ms,
                h_ms=max(0.0, t["H"] - prefill_s) * 1e3, x_ms=t["X"] * 1e3,
                r_ms=t["R"] * 1e3, j_ms=t["J"] * 1e3),
        }

    async def _fallback(self, ids, capacity, receiving, call_start, reason: str) -> dict:
        worker, metrics = self.worker, self.metrics
        await asyncio.gather(receiving, return_exceptions=True)
        log.warning("handoff failed, recomputing the prompt locally: %s", reason)
        metrics.fallbacks.labels(reason.split(":", 1)[0]).inc()
        started = time.perf_counter()
        cache, logits = await asyncio.to_thread(worker.local_prefill, ids, capacity)
        recompute = time.perf_counter() - started
        metrics.suffix.observe(recompute)
        return {"cache": cache, "logits": logits,
                "action": rekv_pb2.Action(codec="bf16", cut=0), "action_kind": "token_recompute",
                "bytes": rekv_pb2.WireBytes(), "fallback": True, "fallback_reason": reason,
                "measured_handoff_ms": (time.perf_counter() - call_start) * 1e3,
                "timings": rekv_pb2.HandoffTimings(r_ms=recompute * 1e3)}


async def build(settings: ServiceSettings, server: grpc.aio.Server, metrics: ServiceMetrics):
    worker = await asyncio.to_thread(DecodeWorker, settings, metrics)
    channel = grpc.aio.insecure_channel(settings.prefill_address)
    servicer = DecodeServicer(worker, rekv_pb2_grpc.PrefillStub(channel))
    rekv_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

    async def drain() -> None:
        await channel.close()
        await asyncio.to_thread(worker.close)

    extra = {"model": worker.shape.name, "ucx": worker.receiver.address,
             "torch_threads": worker.threads}
    return [rekv_pb2.DESCRIPTOR.services_by_name["Decode"].full_name], drain, extra


def main(argv: list[str] | None = None) -> int:
    settings = ServiceSettings.from_args("decode", argv)
    return run(settings, lambda server, metrics: build(settings, server, metrics))
