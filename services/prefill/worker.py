"""The prefill worker: model, planner, calibration and data-plane senders behind `Prefill.Handoff`.

`check(call)` applies this worker's limits to a call; `schedule(call)` says how its handoff is sent
(streamed from inside the prefill when the decode worker takes it and `stream_handoff` is set, with
the boundary chunk size the decode worker asks for; or the call's forced schedule);
`decide(call, schedule, queue)` asks the planner (forced actions too, which the planner evaluates),
which also picks the order of a default streamed schedule (`pipeline_prefill`, where the decode
worker takes it), and `ordered(schedule, decision)` is the schedule the handoff then goes by;
`handoff(call, decision, schedule, transfer)` prefills the prompt, one at a time (one model, one
device), streamed: layer by layer up to the cut, each sent as it is computed (pipelined: token
chunk by token chunk up to the cut, each sent as it passes the cut), the compute released
once the cut is reached (token-only does not wait for it); else every layer, then the handoff; and
returns when every byte has left, within the transfer's deadline. `backlog` is the predicted
compute queued here, which the planner takes as a new request's wait for the prefill. Sends to
one decode address share one sender (one UCX endpoint), replaced once its peer is found gone.
`handoff_memory(prompt_len)` is what one handoff holds, for admission control. Thread-safe.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from rekv_core.handoff import Schedule, SenderReport, send_handoff
from rekv_core.handoff.probe import send_probe
from rekv_core.handoff.source import ChunkedPrefill, LivePrefill
from rekv_core.handoff.transfer import Transfer
from rekv_core.model import prefill
from rekv_core.plan.calibration import PrefillCalibration
from rekv_core.plan.planner import Decision, Planner, common_codecs
from rekv_core.plan.policy import Policy, shipped_policy
from rekv_core.transport import TransportError, create_sender_pool
from services.calls import ConnectCall, Connected, HandoffCall
from services.errors import InvalidArgument, ResourceExhausted
from services.metrics import ServiceMetrics
from services.prefill.assigned import AssignedWork
from services.prefill.faults import Faults
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
        self.policy = policy or Policy(self.shape.name, (1, self.shape.max_positions), {})
        self.senders = create_sender_pool(settings.transport, self.transport_options())
        self._compute = threading.Lock()
        self._probing = threading.Lock()  # a link probe being sent (`connect`)
        self.backlog = _Backlog()  # the prefill compute queued or running here
        self.assigned = AssignedWork()  # decode-side compute given out, for offers made before
        self.faults = Faults(settings.fault_inject, settings.fault_hold_s)
        metrics.link.set(self.calibration.link_gbps(0.0))
        metrics.transport_pending.set_function(
            lambda: self.senders.pending()["in_flight_messages"])
        metrics.connections.set_function(self.senders.connections)

    def check(self, call: HandoffCall) -> None:
        """This worker's limits; INVALID_ARGUMENT naming the field."""
        if len(call.token_ids) > self.settings.max_prompt_tokens:
            raise InvalidArgument(f"token_ids: {len(call.token_ids)} tokens exceed the limit "
                                  f"of {self.settings.max_prompt_tokens}")
        vocab = self.shape.vocab_size
        bad = next((t for t in call.token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids: id {bad} is outside the vocabulary [0, {vocab})")
        forced = call.forced_action
        if forced is not None and forced.cut:
            try:
                self.policy.codec(forced.codec)
            except ValueError as exc:
                raise InvalidArgument(f"forced_action.codec: {exc}") from None

    def schedule(self, call: HandoffCall) -> Schedule:
        """How this call's handoff is sent (INVALID_ARGUMENT for a forced schedule the decode
        worker cannot take)."""
        offer = call.offer
        if call.forced_schedule is not None:
            if call.forced_schedule.streamed and not offer.accepts_streamed:
                raise InvalidArgument("forced_schedule.streamed: the decode worker does not "
                                      "take a streamed handoff")
            if call.forced_schedule.pipelined and not offer.accepts_pipelined:
                raise InvalidArgument("forced_schedule.pipelined: the decode worker does not "
                                      "take a pipelined handoff")
            return call.forced_schedule
        return Schedule(self.settings.stream_handoff and offer.accepts_streamed,
                        offer.chunk_tokens)

    def decide(self, call: HandoffCall, schedule: Schedule, queue: int = 0) -> Decision:
        """`queue`: this worker's other handoffs, waiting or running. The decode side's compute
        ahead of this request is the backlog its offer reports plus that of this worker's
        handoffs in flight whose plan the offer had not counted yet; the requests computing
        there are the ones this request's suffix would delay (`cost.predict`'s load term). The
        decision's own decode-side compute is recorded until `handoff_ended`."""
        costs = call.offer.costs
        unseen = self.assigned.unseen(call.offer.address, call.offer.planned)
        inputs = self.calibration.cost_inputs(
            self.shape, len(call.token_ids), costs, schedule.streamed, schedule.chunk_tokens,
            self._order(call, schedule, queue), prefill_queue=queue,
            decode_queue=call.offer.computing, prefill_wait_ms=self.backlog.ms,
            decode_wait_ms=call.offer.backlog_ms + unseen)
        codecs = common_codecs(self.settings.codecs, call.offer.codecs)
        decision = self.planner.decide(inputs, codecs, costs.evidence, call.forced_action,
                                       link_measured=costs.link_gbps > 0)
        self.assigned.add(call.offer.address, call.transfer_id,
                          (self.shape.num_layers - decision.action.cut)
                          * costs.suffix_ms_per_layer)
        self.metrics.link.set(inputs.link_gbps)
        return decision

    def _order(self, call: HandoffCall, schedule: Schedule, queue: int) -> str:
        """`cost.CostInputs.order`: a forced schedule's own; else both orders where the planner
        may pick one and both pools are free of other requests (`queue` here, `computing`
        there), layer order under load. Pipelining runs both pools on one request at once; under
        load they have other work, and ranked in both orders there the planner split the layers
        worse (`bench/results/throughput-orders/`: 1.33x a full prefill's rate against 1.57-1.61x
        in layer order, with the forced middle cut pipelined at 1.69-1.75x and in layer order at
        1.55-1.63x): the measurements it corrects its model by were taken under load in one
        order or the other."""
        if call.forced_schedule is not None:
            return "tokens" if schedule.pipelined else "layers"
        free = (self.settings.pipeline_prefill and call.offer.accepts_pipelined
                and schedule.streamed and schedule.chunk_tokens > 0)
        idle = queue == 0 and call.offer.computing == 0
        return "either" if free and idle else "layers"

    @staticmethod
    def ordered(schedule: Schedule, decision: Decision) -> Schedule:
        """The schedule the decided handoff goes by: in token order where the decision says."""
        return dataclasses.replace(schedule, pipelined=decision.pipelined)

    def handoff_ended(self, call: HandoffCall) -> None:
        self.assigned.ended(call.transfer_id)

    def handoff_memory(self, prompt_len: int) -> int:
        """What one handoff holds here: every layer's K and V and the hidden states the prefill
        keeps, and the encoded layers until they have left (at most BF16-sized)."""
        shape, elem = self.shape, self.elem_bytes()
        prefill = shape.num_layers * shape.kv_layer_bytes(prompt_len, elem)
        hidden = 2 * shape.boundary_bytes(prompt_len, elem)
        return prefill + hidden + shape.num_layers * shape.kv_layer_bytes(prompt_len)

    def connect(self, call: ConnectCall, time_remaining: float | None = None) -> Connected:
        """Hold a data-plane connection to the decode worker at `call.address` (one already held
        and unbroken is kept), and send it the link probe it asked for within `time_remaining`
        (the call's; None: `handoff_timeout_s`). One probe at a time: while one runs, another
        is refused (`ResourceExhausted`: it would share the link, and each pins a thread)."""
        started = time.perf_counter()
        made = not self.senders.holds(call.address)
        sender = self.senders.to(call.address)
        connect_s = time.perf_counter() - started if made else 0.0
        if call.probe_id is None:
            return Connected(made, connect_s)
        if not self._probing.acquire(blocking=False):
            raise ResourceExhausted("probe: another probe is being sent; ask again later")
        timeout = self.settings.handoff_timeout_s
        if time_remaining is not None:
            timeout = max(0.0, min(timeout, time_remaining - (time.perf_counter() - started)))
        try:
            sent = send_probe(sender, call.probe_id, call.probe_key, timeout_s=timeout)
        except TransportError:
            self.senders.drop_if_broken(call.address)
            raise
        finally:
            self._probing.release()
        return Connected(made, connect_s, sent.bytes, sent.seconds)

    def handoff(self, call: HandoffCall, decision: Decision, schedule: Schedule,
                transfer: Transfer) -> SentHandoff:
        """Prefill and send under `transfer`, whose deadline bounds the wait for the compute and
        for the last byte; a sender whose peer turned out gone is dropped, so the next handoff
        to that address connects anew."""
        action = decision.action
        sender = self.senders.to(call.offer.address)
        self.faults.at_negotiation(call.request_id, transfer)
        layers = action.cut if schedule.streamed else self.shape.num_layers
        queued = self.backlog.add(layers * self.calibration.prefill_ms_per_layer(
            len(call.token_ids), schedule.streamed, call.offer.costs.suffix_scale))
        if layers and not self._compute.acquire(timeout=transfer.wait_s()):
            queued()
            raise TimeoutError(f"transfer {call.transfer_id}: no turn to compute before its "
                               f"deadline")
        release = _Once(lambda: (self._compute.release() if layers else None, queued()))
        try:
            transfer.check()
            started = time.perf_counter()
            codec = self.policy.codec(action.codec) if action.cut else None
            window = codec.importance_window if codec else 0
            if schedule.pipelined:
                source = ChunkedPrefill(self.model, call.token_ids, action.cut,
                                        schedule.chunk_tokens, on_done=release)
            elif schedule.streamed:
                source = LivePrefill(self.model, call.token_ids, action.cut, on_done=release,
                                     importance_window=window)
            else:
                source = prefill(self.model, call.token_ids,
                                 boundaries={action.cut, self.shape.num_layers},
                                 importance_window=window)
                release()
            prefill_s = time.perf_counter() - started
            send_start = time.perf_counter()
            report = send_handoff(
                sender, call.transfer_id, action, self.shape, call.token_ids, source,
                key=call.handoff_key, encrypted=call.encrypt, transfer=transfer,
                expect_ms=decision.predicted_ms, chunk_tokens=schedule.chunk_tokens,
                hooks=self.faults.for_handoff(call.request_id, transfer, action.cut, sender),
                codec=codec,
                boundary_codebook=self.policy.splitzip_codebook("boundary"))
        except TransportError:
            self.senders.drop_if_broken(call.offer.address)
            raise
        finally:
            release()
        send_s = time.perf_counter() - send_start
        if schedule.streamed:  # the sends ran beside the compute: no link figure in them
            prefill_s = source.compute_s
        else:
            self.calibration.observe_send(report.bytes.total, send_s)
        self.calibration.observe_prefill(layers, len(call.token_ids), prefill_s,
                                         schedule.streamed)
        return SentHandoff(prefill_s, send_s, report)

    def close(self) -> None:
        self.senders.shutdown()


class _Backlog:
    """The predicted compute (ms) of the handoffs waiting for this worker's compute or running:
    the wait a new request's prefill has ahead of it. Thread-safe."""

    def __init__(self):
        self._ms, self._lock = 0.0, threading.Lock()

    @property
    def ms(self) -> float:
        with self._lock:
            return max(0.0, self._ms)

    def add(self, ms: float) -> _Once:
        """Count `ms` in; the returned callable takes it out again (once)."""
        with self._lock:
            self._ms += ms

        def take_out() -> None:
            with self._lock:
                self._ms -= ms
        return _Once(take_out)


class _Once:
    """Calls `fn` the first time it is called, never again (thread-safe)."""

    def __init__(self, fn):
        self._fn, self._lock = fn, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()
