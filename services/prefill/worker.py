"""The prefill worker: the model, its connector, the data-plane senders behind `Prefill.Handoff`.

`check(call)` applies this worker's limits to a call and the connector's (a forced action or
delivery it cannot serve); `handoff(call, decision, transfer)` has the connector prefill and send
the decided plan to the offer's data-plane address (one sender, one UCX endpoint, per decode
address, replaced once its peer is found gone), with this worker's fault injection where set;
`connect(call, time_remaining)` holds a data-plane connection to a decode worker and sends it the
link probe it asked for. Deciding, the compute queue and what the prefill side learns are the
connector's (`rekv_core.connector.PrefillConnector`). Thread-safe.
"""

from __future__ import annotations

import logging
import time

from rekv_core.connector import (Decision, HandoffCall, PrefillConnector, PrefillOptions,
                                 SentHandoff)
from rekv_core.handoff.transfer import Transfer
from rekv_core.transport import TransportError, create_sender_pool
from services.calls import ConnectCall, Connected
from services.errors import InvalidArgument
from services.metrics import ServiceMetrics
from services.prefill.faults import Faults
from services.request_spans import MessageLog
from services.serving import Worker
from services.settings import ServiceSettings

log = logging.getLogger("rekv.prefill")


class PrefillWorker(Worker):
    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics):
        super().__init__(settings, metrics)
        self.connector = PrefillConnector.for_model(
            self.model, PrefillOptions(settings.codecs, settings.stream_handoff,
                                       settings.pipeline_prefill, self.fingerprint.hex,
                                       settings.token_split, settings.lynx_streams,
                                       settings.layer_split, settings.prefill_token_budget,
                                       settings.batch_invariant,
                                       settings.prefill_catch_up_layers),
            settings.profile, settings.policy, settings.link_gbps)
        self.senders = create_sender_pool(settings.transport, self.transport_options())
        self.faults = Faults(settings.fault_inject, settings.fault_hold_s)
        metrics.link.set(self.connector.link_gbps(None))
        metrics.transport_pending.set_function(
            lambda: self.senders.pending().in_flight_messages)
        metrics.connections.set_function(self.senders.connections)
        scheduler = self.connector.scheduler
        if scheduler is not None:
            metrics.scheduler.watch(lambda: scheduler.queued)
            scheduler.observer = metrics.scheduler.called
            log.info("prefill scheduler: up to %d prompt rows per tick, %s, late arrivals catch "
                     "up %d layers", scheduler.token_budget,
                     "batch-invariant (each prompt its lone kernels)" if scheduler.invariant
                     else "shared GEMMs across prompts", scheduler.catch_up)
        else:
            log.info("prefill scheduler off: one prefill at a time")

    def check(self, call: HandoffCall) -> None:
        """This worker's limits and its connector's; INVALID_ARGUMENT naming the field."""
        if len(call.token_ids) > self.settings.max_prompt_tokens:
            raise InvalidArgument(f"token_ids: {len(call.token_ids)} tokens exceed the limit "
                                  f"of {self.settings.max_prompt_tokens}")
        vocab = self.shape.vocab_size
        bad = next((t for t in call.token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids: id {bad} is outside the vocabulary [0, {vocab})")
        self.connector.check(call)

    def handoff(self, call: HandoffCall, decision: Decision, transfer: Transfer,
                posted: MessageLog | None = None) -> SentHandoff:
        """Prefill and send under `transfer`; a sender whose peer turned out gone is dropped, so
        the next handoff to that address connects anew. `posted`: notes each message sent."""
        sender = self.senders.to(call.offer.address)
        self.faults.at_negotiation(call.request_id, transfer)
        hooks = self.faults.for_handoff(call.request_id, transfer, decision.action.cut, sender)
        decision = self.faults.decision_for(call.request_id, decision)
        if posted is not None:
            hooks = posted.wrapping(hooks)
        try:
            return self.connector.send(call, decision, sender, transfer, hooks)
        except TransportError:
            self.senders.drop_if_broken(call.offer.address)
            raise

    def connect(self, call: ConnectCall, time_remaining: float | None = None) -> Connected:
        """Hold a data-plane connection to the decode worker at `call.address` (one already held
        and unbroken is kept), and send it the link probe it asked for within `time_remaining`
        (the call's; None: `handoff_timeout_s`)."""
        started = time.perf_counter()
        made = not self.senders.holds(call.address)
        sender = self.senders.to(call.address)
        connect_s = time.perf_counter() - started if made else 0.0
        if call.probe_id is None:
            return Connected(made, connect_s)
        timeout = self.settings.handoff_timeout_s
        if time_remaining is not None:
            timeout = max(0.0, min(timeout, time_remaining - (time.perf_counter() - started)))
        try:
            sent = self.connector.probe(sender, call.probe_id, call.probe_key, timeout)
        except TransportError:
            self.senders.drop_if_broken(call.address)
            raise
        return Connected(made, connect_s, sent.bytes, sent.seconds)

    def close(self) -> None:
        self.senders.shutdown()
        self.connector.close()
