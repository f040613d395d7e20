"""The prefill worker: model, planner, calibration and data-plane senders behind `Prefill.Handoff`.

`check(call)` applies this worker's limits to a call; `decide(call)` asks the planner (forced
actions too, which the planner evaluates); `handoff(call, action, deadline_s)` prefills the prompt,
one at a time (one model, one device), and sends the handoff to the offer's address, returning when
every byte has left. Sends to one decode address share one sender (one UCX endpoint). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from rekv_core.handoff import Action, SenderReport, send_handoff
from rekv_core.model import prefill
from rekv_core.plan.calibration import PrefillCalibration
from rekv_core.plan.planner import Decision, Planner, common_codecs
from rekv_core.plan.policy import Policy, shipped_policy
from rekv_core.transport import create_sender_pool
from services.calls import HandoffCall
from services.errors import InvalidArgument
from services.metrics import ServiceMetrics
from services.serving import Worker
from services.settings import ServiceSettings


@dataclass(frozen=True)
class SentHandoff:
    prefill_s: float
    send_s: float  # first message posted to last byte gone
    report: SenderReport


class PrefillWorker(Worker):
    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics):
        super().__init__(settings, metrics)
        self.calibration = PrefillCalibration.for_model(self.model, settings.codecs,
                                                        settings.profile, settings.link_gbps)
        policy = Policy.load(settings.policy) if settings.policy else shipped_policy(
            self.shape.name)
        if policy is not None and policy.model != self.shape.name:
            raise ValueError(f"policy: written for {policy.model}, serving {self.shape.name}")
        self.planner = Planner(policy)
        self.senders = create_sender_pool(settings.transport, self.transport_options())
        self._compute = threading.Lock()
        metrics.link.set(self.calibration.link_gbps(0.0))
        metrics.transport_pending.set_function(
            lambda: self.senders.pending()["in_flight_messages"])

    def check(self, call: HandoffCall) -> None:
        """This worker's limits; INVALID_ARGUMENT naming the field."""
        if len(call.token_ids) > self.settings.max_prompt_tokens:
            raise InvalidArgument(f"token_ids: {len(call.token_ids)} tokens exceed the limit "
                                  f"of {self.settings.max_prompt_tokens}")
        vocab = self.shape.vocab_size
        bad = next((t for t in call.token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids: id {bad} is outside the vocabulary [0, {vocab})")

    def decide(self, call: HandoffCall) -> Decision:
        costs = call.offer.costs
        inputs = self.calibration.cost_inputs(self.shape, len(call.token_ids), costs)
        codecs = common_codecs(self.settings.codecs, call.offer.codecs)
        decision = self.planner.decide(inputs, codecs, costs.evidence, call.forced_action)
        self.metrics.link.set(inputs.link_gbps)
        return decision

    def handoff(self, call: HandoffCall, action: Action, deadline_s: float | None) -> SentHandoff:
        sender = self.senders.to(call.offer.address)
        with self._compute:
            started = time.perf_counter()
            state = prefill(self.model, call.token_ids,
                            boundaries={action.cut, self.shape.num_layers})
            prefill_s = time.perf_counter() - started
        send_start = time.perf_counter()
        flush_timeout = self.settings.handoff_timeout_s if deadline_s is None else max(
            0.1, deadline_s - (send_start - started))
        report = send_handoff(sender, call.transfer_id, action, self.shape, call.token_ids, state,
                              flush_timeout=flush_timeout, key=call.handoff_key)
        send_s = time.perf_counter() - send_start
        self.calibration.observe_send(report.bytes.total, send_s)
        return SentHandoff(prefill_s, send_s, report)

    def close(self) -> None:
        self.senders.shutdown()
