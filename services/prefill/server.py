"""The prefill service: `Prefill.Handoff` prefills a prompt, chooses the action and sends the KV
handoff over UCX to the decode worker that asked.

Per call: validate (INVALID_ARGUMENT naming the field); choose the action from the decode side's
offer, this worker's quantize costs and its link estimate (or take the forced one); prefill, keeping
h_c; send the plan, the boundary and the prefix layers to the offer's UCX address under the call's
transfer id; answer when every byte has left. Prefills run one at a time (one model, one device);
sends to one decode address share one UCX endpoint. The link estimate is updated from each
transfer's bytes and seconds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc

from rekv_core.codecs import codec_names
from rekv_core.handoff import Action, send_handoff
from rekv_core.model import prefill
from rekv_core.plan import CostInputs, predict
from rekv_core.plan.estimates import LinkEstimate
from rekv_core.plan.measure import measure_codec_costs
from rekv_core.plan.planner import Measured, Planner, expected_ms
from rekv_core.plan.policy import Policy, shipped_policy
from rekv_core.plan.profile import Profile
from rekv_core.transport.ucx import UcxSender
from services.metrics import ServiceMetrics
from services.rpc import rekv_pb2, rekv_pb2_grpc
from services.serving import InvalidArgument, Worker, run, status_for
from services.settings import ServiceSettings
from services.wire_convert import action_from_proto, action_to_proto, wire_bytes_to_proto

log = logging.getLogger("rekv.prefill")


class PrefillWorker(Worker):
    """The blocking side of the service: model, UCX senders, estimates. Thread-safe."""

    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics):
        super().__init__(settings, metrics)
        self.link = LinkEstimate(settings.link_gbps)
        if settings.profile:
            self.quantize_ms_per_mib = Profile.load(settings.profile).quantize_ms_per_mib
        else:
            self.quantize_ms_per_mib = {
                codec: measure_codec_costs(codec, self.shape, 512, self.model.device)[0]
                for codec in settings.codecs}
        policy = Policy.load(settings.policy) if settings.policy else shipped_policy(
            self.shape.name)
        if policy is not None and policy.model != self.shape.name:
            raise ValueError(f"policy: written for {policy.model}, serving {self.shape.name}")
        self.planner = Planner(policy)
        self._senders: dict[str, UcxSender] = {}
        self._senders_lock = threading.Lock()
        self._compute = threading.Lock()
        metrics.link.set(self.link.gbps)
        metrics.transport_pending.set_function(self._pending_messages)

    def _pending_messages(self) -> int:
        with self._senders_lock:
            return sum(s.pending()["in_flight_messages"] for s in self._senders.values())

    def sender(self, address: str) -> UcxSender:
        with self._senders_lock:
            if address not in self._senders:
                self._senders[address] = UcxSender(self.engine, address,
                                                   pace_gbps=self.settings.pace_gbps)
            return self._senders[address]

    def validate(self, request) -> None:
        if not request.transfer_id:
            raise InvalidArgument("transfer_id: required")
        if not request.token_ids:
            raise InvalidArgument("token_ids: must not be empty")
        if len(request.token_ids) > self.settings.max_prompt_tokens:
            raise InvalidArgument(f"token_ids: {len(request.token_ids)} tokens exceed the limit "
                                  f"of {self.settings.max_prompt_tokens}")
        vocab = self.shape.vocab_size
        bad = next((t for t in request.token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids: id {bad} is outside the vocabulary [0, {vocab})")
        offer = request.offer
        if offer.model != self.shape.name or offer.num_layers != self.shape.num_layers:
            raise InvalidArgument(f"offer.model: decode runs {offer.model!r} with "
                                  f"{offer.num_layers} layers, prefill {self.shape.name!r} with "
                                  f"{self.shape.num_layers}")
        if not offer.ucx_address:
            raise InvalidArgument("offer.ucx_address: required")
        unknown = [c for c in offer.codecs if c not in codec_names()]
        if unknown:
            raise InvalidArgument(f"offer.codecs: unknown codec(s) {unknown}")
        if request.HasField("forced_action"):
            action_from_proto(request.forced_action, self.shape.num_layers)

    def decide(self, request):
        """(action, predicted ms, eq. 9 ms, candidates): forced, or the planner's choice."""
        offer = request.offer
        link_gbps = offer.link_gbps if offer.link_gbps > 0 else self.link.gbps
        inputs = CostInputs(self.shape, len(request.token_ids), link_gbps,
                            offer.suffix_ms_per_layer, self.quantize_ms_per_mib,
                            max(offer.restore_ms_per_mib.values(), default=0.0), offer.join_ms,
                            message_ms=offer.message_ms)
        eligible = [c for c in self.settings.codecs if c in offer.codecs] or ["bf16"]
        measured = {key: Measured(m.median_ms, m.median_prompt_len, m.count)
                    for key, m in offer.measured.items()}
        decision = self.planner.decide(inputs, eligible, offer.measured_over_model, measured)
        if request.HasField("forced_action"):
            action = action_from_proto(request.forced_action, self.shape.num_layers)
            prediction = predict(action, inputs)
            return (action, expected_ms(prediction, inputs, offer.measured_over_model, measured),
                    prediction.total_ms, decision.candidates)
        return decision.action, decision.predicted_ms, decision.model_ms, decision.candidates

    def handoff(self, request, action: Action, deadline_s: float | None) -> dict:
        ids = list(request.token_ids)
        sender = self.sender(request.offer.ucx_address)
        with self._compute:
            started = time.perf_counter()
            state = prefill(self.model, ids, boundaries={action.cut, self.shape.num_layers})
            prefill_s = time.perf_counter() - started
        send_start = time.perf_counter()
        flush_timeout = self.settings.handoff_timeout_s if deadline_s is None else max(
            0.1, deadline_s - (send_start - started))
        report = send_handoff(sender, request.transfer_id, action, self.shape, ids, state,
                              flush_timeout=flush_timeout)
        send_s = time.perf_counter() - send_start
        self.metrics.link.set(self.link.observe(report.bytes.total, send_s))
        return {"prefill_s": prefill_s, "send_s": send_s, "report": report}

    def close(self) -> None:
        for sender in self._senders.values():
            try:
                sender.shutdown()
            except Exception:  # the peer may be gone already
                pass
        self.engine.close()


class PrefillServicer(rekv_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.metrics = worker.metrics

    async def Handoff(self, request, context):
        worker, metrics = self.worker, self.metrics
        started = time.perf_counter()
        metrics.in_flight.inc()
        try:
            worker.validate(request)
            action, predicted_ms, model_ms, candidates = worker.decide(request)
            done = await asyncio.to_thread(worker.handoff, request, action,
                                           context.time_remaining())
        except BaseException as exc:
            code, reason = status_for(exc)
            if isinstance(exc, asyncio.CancelledError):
                reason = "cancelled"
            metrics.failures.labels(reason).inc()
            log.warning("request=%s transfer=%s failed (%s): %s", request.request_id,
                        request.transfer_id, reason, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            await context.abort(code, str(exc))
        finally:
            metrics.in_flight.dec()
        report = done["report"]
        total = time.perf_counter() - started
        metrics.handoff.observe(done["send_s"])
        metrics.prefill.observe(done["prefill_s"])
        metrics.quantize.observe(report.quantize_seconds)
        metrics.count_bytes(report.bytes)
        metrics.requests.labels(action.kind.value, action.codec, str(action.cut)).inc()
        log.info("request=%s transfer=%s tokens=%d action=%s predicted_ms=%.1f prefill_ms=%.1f "
                 "q_ms=%.1f send_ms=%.1f bytes=%d link_gbps=%.3f offered_link_gbps=%.3f "
                 "top=%s total_ms=%.1f",
                 request.request_id, request.transfer_id, len(request.token_ids), action,
                 predicted_ms, done["prefill_s"] * 1e3, report.quantize_seconds * 1e3,
                 done["send_s"] * 1e3, report.bytes.total, worker.link.gbps,
                 request.offer.link_gbps,
                 ",".join(f"{p.action.codec}/{p.action.cut}:{ms:.0f}" for p, ms in candidates[:4]),
                 total * 1e3)
        return rekv_pb2.HandoffResponse(
            action=action_to_proto(action), action_kind=action.kind.value,
            predicted_ms=predicted_ms,
            model_ms=model_ms,
            candidates=[rekv_pb2.Candidate(action=action_to_proto(p.action),
                                           action_kind=p.action.kind.value,
                                           predicted_ms=ms, bytes=p.bytes)
                        for p, ms in candidates],
            prefill_ms=done["prefill_s"] * 1e3, q_ms=report.quantize_seconds * 1e3,
            send_ms=done["send_s"] * 1e3, bytes=wire_bytes_to_proto(report.bytes),
            link_gbps_estimate=worker.link.gbps)


async def build(settings: ServiceSettings, server: grpc.aio.Server, metrics: ServiceMetrics):
    worker = await asyncio.to_thread(PrefillWorker, settings, metrics)
    rekv_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)

    async def drain() -> None:
        await asyncio.to_thread(worker.close)

    extra = {"model": worker.shape.name, "torch_threads": worker.threads}
    return [rekv_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name], drain, extra


def main(argv: list[str] | None = None) -> int:
    settings = ServiceSettings.from_args("prefill", argv)
    return run(settings, lambda server, metrics: build(settings, server, metrics))
